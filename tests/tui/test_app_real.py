"""End to end with the real default model: stream, stop, regenerate, branch, reopen after restart."""

from __future__ import annotations

import asyncio
from pathlib import Path

from test_app import wait_for

from localllm.tui.app import LocalLLMApp
from localllm.tui.chat_screen import ChatScreen, MessageView


def test_real_model_chat_flow(default_model_path: Path) -> None:
    greedy = {"temperature": 0, "max_tokens": 40}

    async def first() -> tuple[int, str]:
        app = LocalLLMApp(chat_model="smollm2")
        async with app.run_test(size=(100, 30)) as pilot:
            chat = app.screen
            assert isinstance(chat, ChatScreen)
            chat.sampling = dict(greedy)
            pieces: list[str] = []
            append = chat._append

            async def spy(text: str, reasoning: str = "") -> None:
                pieces.append(text)
                await append(text, reasoning)

            chat._append = spy
            await pilot.press(*"Say hello", "enter")
            await wait_for(pilot, lambda: not chat.generating and chat.answer, timeout=60)
            assert len(pieces) >= 2, "the answer arrived in one piece, not streamed"
            hello = chat.history[-1]["content"]
            assert hello.strip() and chat.history[-2] == {"role": "user", "content": "Say hello"}
            # the app shows exactly what the engine says for the same conversation
            oracle = chat.llm.chat([{"role": "user", "content": "Say hello"}], **greedy).text
            assert hello == oracle
            assert "tokens/s" in str(chat.query_one("#status").render())

            chat.sampling = {"temperature": 0, "max_tokens": 400}
            await pilot.press(*"Write a long story about a lighthouse.", "enter")
            await wait_for(pilot, lambda: len(chat.answer) > 40, timeout=60)
            await pilot.press("escape")
            await wait_for(pilot, lambda: not chat.generating, timeout=30)
            (stopped,) = [m for m in app.conversations.branch(chat.conv_id)[-1:]]
            assert stopped.status == "cancelled" and 0 < len(stopped.content) < 2000
            assert "stopped" in str(chat.query_one("#status").render())

            chat.sampling = dict(greedy)
            await pilot.press("ctrl+r")  # a new answer beside the stopped one
            await wait_for(pilot, lambda: not chat.generating and chat.history[-1]["role"] ==
                           "assistant" and chat.history[-1]["content"] != stopped.content,
                           timeout=60)  # fmt: skip
            answers = app.conversations.siblings(app.conversations.branch(chat.conv_id)[-1].id)
            assert [a.status for a in answers] == ["cancelled", "complete"]
            return chat.conv_id, hello

    conv_id, hello = asyncio.run(first())

    async def second() -> None:
        app = LocalLLMApp()
        async with app.run_test(size=(100, 30)) as pilot:
            await pilot.press("c")
            await pilot.press("enter")
            await pilot.pause()
            chat = app.screen
            assert isinstance(chat, ChatScreen) and chat.conv_id == conv_id
            texts = [v.text for v in chat.query(MessageView)]
            assert texts[:2] == ["Say hello", hello] and len(texts) == 4

    asyncio.run(second())


def test_speculative_mode_is_a_chat_setting_and_the_status_shows_acceptance(default_model_path: Path) -> None:
    """The torch engine with `lookup` chosen in the chat's settings: the request carries it, and
    after the answer the status line shows the share of drafts accepted and tokens per pass."""

    async def go() -> None:
        app = LocalLLMApp(chat_model="smollm2")
        async with app.run_test(size=(160, 50)) as pilot:
            chat = app.screen
            await pilot.press("ctrl+s")
            modal = app.screen
            modal.query_one("#backend").value = "torch"
            await wait_for(pilot, lambda: modal.query("#speculative"))
            await pilot.pause()
            modal.query_one("#speculative").value = "lookup"
            await pilot.press("ctrl+s")
            assert app.screen is chat and chat.options.speculative == "lookup"
            chat.sampling = {"temperature": 0, "max_tokens": 48}
            await pilot.press(*"Repeat after me: one two three, one two three, one two three.", "enter")
            await wait_for(pilot, lambda: not chat.generating and chat.answer, timeout=120)
            status = str(chat.query_one("#status").render())
            assert "lookup" in status and "accepted" in status and "/pass" in status, status

    asyncio.run(go())
