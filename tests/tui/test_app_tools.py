"""MCP tools in the app (issue 39), driven by Textual's pilot: the servers of `mcp.json` beside the
store (a stdio server written with the official `mcp` SDK), each call shown in a permission dialog
— allow once, always, deny — its result fed back to the model, the rounds bounded, a crashed
server one line while the chat goes on. The model is the engine over the scripted runner
(`say:TEXT` in its prompt makes it say TEXT), so every turn is known."""

from __future__ import annotations

import asyncio
import json
import sys
import time
from pathlib import Path

from fakebackend import FakeRunner

from conftest import need

need("mcp", "pip install mcp")

from test_mcp_tools import SERVER, call_text  # noqa: E402

from localllm.engine import Model  # noqa: E402
from localllm.mcp_tools import MAX_ROUNDS  # noqa: E402
from localllm.models_registry.store import Store  # noqa: E402
from localllm.tui.app import LocalLLMApp  # noqa: E402
from localllm.tui.chat_screen import ChatScreen, MessageView, PromptArea  # noqa: E402
from localllm.tui.dialogs import ToolPermission  # noqa: E402


async def wait_for(pilot, cond, timeout: float = 20.0) -> None:  # noqa: ANN001
    end = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < end, "timed out"
        await pilot.pause(0.05)


def test_tool_calls_are_asked_for_run_fed_back_and_bounded(tmp_path: Path, tiny_llama: Path) -> None:
    Store().add_file(tiny_llama, "fake", source="file:x")  # the chat's model (the loader answers for it)
    home = Store().home
    home.mkdir(parents=True, exist_ok=True)
    (tmp_path / "server.py").write_text(SERVER)
    (home / "mcp.json").write_text(json.dumps({"mcpServers": {
        "tools": {"command": sys.executable, "args": [str(tmp_path / "server.py")]}}}))  # fmt: skip
    models: list[Model] = []

    def load(name: str, options: object) -> Model:
        models.append(Model(FakeRunner(n_ctx=16384, n_slots=2), name, options=options))
        return models[-1]

    async def send(pilot, screen: ChatScreen, text: str) -> None:  # noqa: ANN001
        area = screen.query_one(PromptArea)
        area.text = text
        area.focus()
        await pilot.press("enter")

    async def go() -> None:
        app = LocalLLMApp(loader=load, chat_model="fake")
        async with app.run_test(size=(100, 30)) as pilot:
            screen = app.screen
            assert isinstance(screen, ChatScreen)
            # allowed once: the result reaches the next turn, which answers from it
            await send(pilot, screen, call_text("lookup", {"q": "life"}))
            await wait_for(pilot, lambda: isinstance(app.screen, ToolPermission) and app.screen.query("#tool-question"))
            dialog = app.screen
            assert "lookup (MCP server tools)" in str(dialog.query_one("#tool-question").render())
            assert '"q": "life"' in str(dialog.query_one("#tool-arguments").render())
            await pilot.press("y")
            await wait_for(pilot, lambda: not screen.generating)
            history = screen.history
            assert history[-1] == {"role": "assistant", "content": "The answer to life is 42."}
            assert history[-3]["tool_calls"][0]["function"]["name"] == "lookup"
            assert history[-2] == {"role": "tool", "tool_call_id": history[-3]["tool_calls"][0]["id"],
                                   "name": "lookup", "content": "say:The answer to life is 42."}  # fmt: skip
            # denied: the model is told; it asks again each turn until the rounds run out
            await send(pilot, screen, call_text("add", {"a": 1, "b": 2}))
            seen: list = [None]
            for _ in range(MAX_ROUNDS):  # each turn's dialog is a new one (the next comes at once)
                await wait_for(pilot, lambda: isinstance(app.screen, ToolPermission) and app.screen is not seen[0])
                seen[0] = app.screen
                await pilot.press("n")
            await wait_for(pilot, lambda: not screen.generating)
            denied = [m for m in screen.history if m["role"] == "tool" and m["name"] == "add"]
            assert len(denied) == MAX_ROUNDS and denied[0]["content"].startswith("The user denied the call to add")
            assert f"stopped after {MAX_ROUNDS} rounds" in screen.answer
            # always: asked once; a server that crashes is one line as the tool's answer, the chat goes on
            await send(pilot, screen, call_text("crash", {}))
            await wait_for(pilot, lambda: isinstance(app.screen, ToolPermission))
            await pilot.press("a")
            await wait_for(pilot, lambda: not screen.generating)
            crashed = [m for m in screen.history if m["role"] == "tool" and m["name"] == "crash"]
            assert len(crashed) == MAX_ROUNDS and all(m["content"].startswith("Error: crash failed") for m in crashed)
            await send(pilot, screen, "say:still here")
            await wait_for(pilot, lambda: not screen.generating)
            assert screen.history[-1] == {"role": "assistant", "content": "still here"}
            await screen._render_branch()  # reopened: an answer that used tools says which
            await pilot.pause()
            notes = [v.note for v in screen.query(MessageView)]
            assert "tools: lookup" in notes and "tools: crash" in notes
        for m in models:
            m.close()

    asyncio.run(go())
