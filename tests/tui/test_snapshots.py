"""Snapshots of every screen at 80x24 and 120x40, light and dark (pytest-textual-snapshot).

Update after an intended change with `pytest tests/tui/test_snapshots.py --snapshot-update` and look
at the SVGs in `__snapshots__/` before committing them. Everything on screen is fixed: the store
holds the tiny test model (or nothing, for the first screen), the free memory behind the Fits marks
is fixed, conversation times are 1970-01-01 UTC, and the fake backend's timings make the status
line's numbers constant.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from test_app import FakeLLM

from localllm.models_registry.store import Store
from localllm.tui.app import LocalLLMApp

from conftest import need

need("pytest_textual_snapshot", "pip install -e '.[dev]' (pytest-textual-snapshot)")

SIZES = [(80, 24), (120, 40)]
THEMES = ["textual-dark", "textual-light"]


@pytest.fixture(autouse=True)
def fixed_memory(monkeypatch: pytest.MonkeyPatch) -> None:
    """The Fits marks must not depend on this machine's free memory: 4 GiB free of 8."""
    from localllm import memory

    avail = memory.Available("cpu", 4 * 1024**3, 8 * 1024**3)
    monkeypatch.setattr(memory, "available_memory", lambda device="auto": avail)


@pytest.fixture
def empty_store(monkeypatch: pytest.MonkeyPatch) -> Store:
    monkeypatch.setenv("TZ", "UTC")
    time.tzset()
    return Store()


@pytest.fixture
def fixed_store(tiny_llama: Path, empty_store: Store) -> Store:
    store = empty_store
    store.add_file(tiny_llama, "tiny", source="file:tiny-llama.gguf")
    return store


def make_app(theme: str, *, chat: bool = False) -> LocalLLMApp:
    answer = ["Paris ", "is ", "the ", "capital ", "of ", "**France**.", "\n\n- one", "\n- two"]
    fake = FakeLLM([answer], delay=0.001)
    app = LocalLLMApp(loader=lambda name, options: fake, chat_model="tiny" if chat else None)
    app.theme = theme
    return app


def settle_conversations(app: LocalLLMApp) -> None:
    db = app.conversations
    c = db.create("tiny:latest", title="A question about France")
    db.add_message(c.id, "user", "What is the capital of France?")
    db.add_message(c.id, "assistant", "Paris.")
    db._conn.execute("UPDATE conversations SET updated = 0, created = 0")


@pytest.mark.parametrize("size", SIZES)
@pytest.mark.parametrize("theme", THEMES)
def test_models(snap_compare, fixed_store: Store, size, theme) -> None:  # noqa: ANN001
    assert snap_compare(make_app(theme), terminal_size=size)


@pytest.mark.parametrize("size", SIZES)
@pytest.mark.parametrize("theme", THEMES)
def test_models_empty_store(snap_compare, empty_store: Store, size, theme) -> None:  # noqa: ANN001
    """The first screen on a new machine: the built-in model, a hint, the catalog."""
    assert snap_compare(make_app(theme), terminal_size=size)


@pytest.mark.parametrize("size", SIZES)
@pytest.mark.parametrize("theme", THEMES)
def test_chat(snap_compare, fixed_store: Store, size, theme) -> None:  # noqa: ANN001
    async def ask(pilot) -> None:  # noqa: ANN001
        await pilot.press(*"What is the capital of France?", "enter")
        screen = pilot.app.screen
        screen.query_one("#prompt").cursor_blink = False  # a blinking cursor made this flaky
        end = time.monotonic() + 10
        while (screen.generating or not screen.answer) and time.monotonic() < end:
            await pilot.pause(0.05)
        await pilot.pause(0.2)

    assert snap_compare(make_app(theme, chat=True), terminal_size=size, run_before=ask)


@pytest.mark.parametrize("size", SIZES)
def test_chat_multi_line_prompt(snap_compare, fixed_store: Store, size) -> None:  # noqa: ANN001
    """Issue 34: the message box grows with a message of several lines (Ctrl+J: a new line)."""

    async def type_lines(pilot) -> None:  # noqa: ANN001
        pilot.app.screen.query_one("#prompt").cursor_blink = False
        await pilot.press(*"Explain this code:", "ctrl+j", *"def double(x):", "ctrl+j")
        await pilot.press(*"    return x * 2")
        await pilot.pause(0.2)

    assert snap_compare(make_app("textual-dark", chat=True), terminal_size=size, run_before=type_lines)


@pytest.mark.parametrize("opened", [False, True], ids=["collapsed", "open"])
def test_chat_thinking_block(snap_compare, fixed_store: Store, opened: bool) -> None:  # noqa: ANN001
    """Issue 34: a thinking model's reasoning folds under how long it thought."""
    thoughts = [("think", "The user asks for the capital of France. "), ("think", "That is Paris.")]
    fake = FakeLLM([[*thoughts, "The capital is ", "**Paris**."]], delay=0.001)
    app = LocalLLMApp(loader=lambda name, options: fake, chat_model="tiny")
    app.theme = "textual-dark"

    async def ask(pilot) -> None:  # noqa: ANN001
        screen = pilot.app.screen
        screen.query_one("#prompt").cursor_blink = False
        await pilot.press(*"What is the capital of France?", "enter")
        end = time.monotonic() + 10
        while (screen.generating or not screen.answer) and time.monotonic() < end:
            await pilot.pause(0.05)
        from textual.widgets import Collapsible

        block = screen.query_one(Collapsible)
        block.title = "Thought for 2 tokens, 0.1 s"  # the measured time varies: fixed here
        block.collapsed = not opened
        await pilot.pause(0.2)

    assert snap_compare(app, terminal_size=(80, 24), run_before=ask)


@pytest.mark.parametrize("size", SIZES)
@pytest.mark.parametrize("theme", THEMES)
def test_conversations(snap_compare, fixed_store: Store, size, theme) -> None:  # noqa: ANN001
    app = make_app(theme)

    async def open_list(pilot) -> None:  # noqa: ANN001
        settle_conversations(pilot.app)
        await pilot.press("c")
        await pilot.pause()

    assert snap_compare(app, terminal_size=size, run_before=open_list)


@pytest.mark.parametrize("size", SIZES)
@pytest.mark.parametrize("theme", THEMES)
def test_help(snap_compare, fixed_store: Store, size, theme) -> None:  # noqa: ANN001
    assert snap_compare(make_app(theme), terminal_size=size, press=["f1"])


@pytest.mark.parametrize("size", SIZES)
@pytest.mark.parametrize("theme", THEMES)
def test_settings(snap_compare, fixed_store: Store, size, theme) -> None:  # noqa: ANN001
    assert snap_compare(make_app(theme, chat=True), terminal_size=size, press=["ctrl+s"])


@pytest.mark.parametrize("size", SIZES)
@pytest.mark.parametrize("theme", THEMES)
def test_pull_dialog(snap_compare, fixed_store: Store, size, theme) -> None:  # noqa: ANN001
    assert snap_compare(make_app(theme), terminal_size=size, press=["p"])
