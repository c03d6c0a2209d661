"""The app with the real engine when llama.cpp cannot run, or a model's template is hostile.

Both must end as one notification in a live app, never as a crashed process or a hung worker.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest
from test_app import wait_for

from localllm.models_registry.store import Store
from localllm.tui.app import LocalLLMApp
from localllm.tui.chat_screen import ChatScreen

from conftest import SIGILL_SELF, python_command
from ggufs import copy_gguf


def notes(app: LocalLLMApp) -> list[str]:
    return [n.message for n in app._notifications]


def test_llama_cpp_unavailable_is_a_notification(
    monkeypatch: pytest.MonkeyPatch, default_model_path: Path
) -> None:
    """The real loader, with a probe that dies by SIGILL and no torch engine to fall back to: the
    chat says why, the app lives on."""
    import importlib.util

    command = python_command(SIGILL_SELF)
    monkeypatch.setenv("LOCALLLM_LLAMACPP_PROBE", command)
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "torch" else real(name, *a))  # fmt: skip

    async def go() -> None:
        app = LocalLLMApp(chat_model="smollm2")
        async with app.run_test(size=(80, 24)) as pilot:
            chat = app.screen
            assert isinstance(chat, ChatScreen)
            await pilot.press(*"hi", "enter")
            await wait_for(pilot, lambda: not chat.generating and notes(app), timeout=60)
            (note,) = notes(app)
            assert note.startswith("llama.cpp cannot run on this machine") and "SIGILL" in note
            assert "torch cannot run on this machine: torch is not installed" in note
            assert "\n" not in note and app.screen is chat
            await pilot.press("ctrl+o")  # still a working app: back to Models
            await pilot.pause()
            assert type(app.screen).__name__ == "ModelsScreen"

    asyncio.run(go())


def test_hostile_template_in_the_app(default_model_path: Path, tmp_path: Path) -> None:
    evil = copy_gguf(default_model_path, tmp_path / "evil.gguf",
                     {"tokenizer.chat_template": "{{ 7 ** 999999999 }}"})  # fmt: skip
    Store().add_file(evil, "evil", source="test")

    async def go() -> None:
        app = LocalLLMApp(chat_model="evil")
        async with app.run_test(size=(80, 24)) as pilot:
            chat = app.screen
            assert isinstance(chat, ChatScreen)
            t0 = time.monotonic()
            await pilot.press(*"hi", "enter")
            await wait_for(pilot, lambda: not chat.generating and notes(app), timeout=90)
            assert time.monotonic() - t0 < 60
            (note,) = notes(app)
            assert "template" in note and "\n" not in note and app.screen is chat

    asyncio.run(go())
