"""The app driven by Textual's pilot, with a fake backend (queued outputs) and a real store."""

from __future__ import annotations

import asyncio
import sys
import threading
import time
from pathlib import Path

import pytest

from localllm.models_registry.store import Store
from localllm.tui.app import LocalLLMApp
from localllm.tui.chat_screen import ChatScreen, MessageView
from localllm.tui.models_screen import ModelsScreen
from localllm.types import Chunk, Result, Timings, Usage


class FakeStream:
    def __init__(self, tokens: list[str], delay: float) -> None:
        self.tokens, self.delay = tokens, delay
        self.cancelled = threading.Event()
        self.result: Result | None = None

    def cancel(self) -> None:
        self.cancelled.set()

    def __iter__(self):  # noqa: ANN204
        t0 = time.monotonic()
        out = []
        reason = "stop"
        for tok in self.tokens:
            if self.cancelled.is_set():
                reason = "cancelled"
                break
            time.sleep(self.delay)
            out.append(tok)
            yield Chunk(tok)
        n = len(out)
        self.result = Result("".join(out), tuple(range(n)), reason, Usage(10, n),
                             Timings(ttft_s=0.01, decode_s=max(1, n - 1) * self.delay,
                                     total_s=time.monotonic() - t0))  # fmt: skip


class FakeLLM:
    """Answers with the queued outputs in order; records the requests."""

    def __init__(self, outputs: list[list[str]], delay: float = 0.005, n_ctx: int = 100) -> None:
        self.outputs, self.delay, self.n_ctx = outputs, delay, n_ctx
        self.requests: list = []
        self.closed = False

    def submit(self, request):  # noqa: ANN001, ANN201
        self.requests.append(request)
        return FakeStream(self.outputs.pop(0), self.delay)

    def close(self) -> None:
        self.closed = True


async def wait_for(pilot, cond, timeout: float = 10.0) -> None:  # noqa: ANN001
    end = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < end, "timed out"
        await pilot.pause(0.05)


def app_with(fake: FakeLLM, **kw) -> LocalLLMApp:  # noqa: ANN003
    return LocalLLMApp(loader=lambda name, **o: fake, **kw)


def test_models_screen_lists_the_store(tiny_llama: Path) -> None:
    Store().add_file(tiny_llama, "tiny", source="file:x")

    async def go() -> None:
        app = app_with(FakeLLM([]))
        async with app.run_test(size=(120, 40)) as pilot:
            assert isinstance(app.screen, ModelsScreen)
            table = app.screen.query_one("DataTable")
            row = table.get_row_at(0)
            assert row[0] == "tiny:latest" and row[1] == "llama" and row[6] == "yes"
            await pilot.press("f")  # default
            assert app.settings.get("default_model") == "tiny:latest"
            assert table.get_row_at(0)[0] == "* tiny:latest"

    asyncio.run(go())


def test_delete_asks_first(tiny_llama: Path) -> None:
    Store().add_file(tiny_llama, "tiny", source="file:x")

    async def go() -> None:
        app = app_with(FakeLLM([]))
        async with app.run_test(size=(80, 24)) as pilot:
            await pilot.press("d")
            await pilot.press("escape")  # no
            assert [r.name for r in Store().list()] == ["tiny:latest"]
            await pilot.press("d")
            await pilot.press("y")
            await pilot.pause()
            assert Store().list() == []
            assert app.screen.query_one("DataTable").row_count == 0

    asyncio.run(go())


def test_chat_streams_stops_and_regenerates(tiny_llama: Path) -> None:
    Store().add_file(tiny_llama, "tiny", source="file:x")
    fake = FakeLLM([["Hel", "lo", " there", "!"], [f"w{i} " for i in range(400)],
                    ["Second", " answer"]], delay=0.005)  # fmt: skip

    async def go() -> None:
        app = app_with(fake, chat_model="tiny")
        async with app.run_test(size=(80, 24)) as pilot:
            screen = app.screen
            assert isinstance(screen, ChatScreen)
            await pilot.click("#prompt")
            await pilot.press(*"hi", "enter")
            await wait_for(pilot, lambda: not screen.generating and len(screen.history) == 2)
            assert screen.history[1] == {"role": "assistant", "content": "Hello there!"}
            assert fake.requests[0].messages == ({"role": "user", "content": "hi"},)
            status = str(screen.query_one("#status").render())
            assert "tokens/s" in status and "context 14/100" in status

            await pilot.press(*"long", "enter")  # 400 tokens: stop it midway
            await wait_for(pilot, lambda: len(screen.answer) > 20)
            await pilot.press("escape")
            await wait_for(pilot, lambda: not screen.generating)
            assert 0 < screen.history[-1]["content"].count("w") < 400
            assert "stopped" in str(screen.query_one("#status").render())

            await pilot.press("ctrl+r")  # regenerate the stopped answer
            await wait_for(pilot, lambda: not screen.generating and
                           screen.history[-1]["content"] == "Second answer")  # fmt: skip
            assert len(screen.query(MessageView)) == 4
            assert fake.requests[2].messages[-1] == {"role": "user", "content": "long"}

    asyncio.run(go())


def test_errors_are_one_line_notifications(tiny_llama: Path) -> None:
    from localllm.errors import ContextOverflow

    class Overflowing(FakeLLM):
        def submit(self, request):  # noqa: ANN001, ANN201
            raise ContextOverflow("the prompt has 120 tokens but the context holds 100")

    Store().add_file(tiny_llama, "tiny", source="file:x")

    async def go() -> None:
        app = app_with(Overflowing([]), chat_model="tiny")
        async with app.run_test(size=(80, 24)) as pilot:
            await pilot.press(*"hi", "enter")
            await wait_for(pilot, lambda: not app.screen.generating)
            notes = [n.message for n in app._notifications]
            assert any("context holds 100" in m for m in notes), notes
            assert "context holds 100" in str(app.screen.query_one("#status").render())

    asyncio.run(go())


def test_first_paint_imports_neither_torch_nor_llama_cpp(tmp_path: Path) -> None:
    import subprocess

    code = ("import asyncio, sys\n"
            "from localllm.tui.app import LocalLLMApp\n"
            "async def go():\n"
            "    app = LocalLLMApp()\n"
            "    async with app.run_test(size=(80, 24)) as pilot:\n"
            "        await pilot.pause()\n"
            "        assert app.screen.query_one('DataTable') is not None\n"
            "asyncio.run(go())\n"
            "bad = [m for m in ('torch', 'llama_cpp') if m in sys.modules]\n"
            "print('imported:', bad)\n")  # fmt: skip
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    assert p.stdout.strip().endswith("imported: []")


@pytest.mark.parametrize("size", [(80, 24), (120, 40)])
def test_help_and_theme(size: tuple[int, int]) -> None:
    async def go() -> None:
        app = app_with(FakeLLM([]))
        async with app.run_test(size=size) as pilot:
            await pilot.press("f1")
            assert type(app.screen).__name__ == "HelpScreen"
            await pilot.press("escape")
            assert isinstance(app.screen, ModelsScreen)
            dark = app.theme
            await pilot.press("ctrl+t")
            assert app.theme != dark and app.settings.get("theme") == app.theme

    asyncio.run(go())
