"""Chat: a streaming Markdown answer, stop, regenerate, and live numbers (TTFT, tokens/s, context).

The model loads and generates in a worker thread. Text reaches the screen through
`Markdown.get_stream()`, which batches fragments so a fast model never outruns the renderer. The
context meter counts prompt + answer against the model's context and turns to warning at 80% and
danger at 95%; an overflow is refused by the engine with numbers (shown as a notification), never
truncated silently.
"""

from __future__ import annotations

import time
from typing import Any

from textual import work
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Vertical, VerticalScroll
from textual.screen import Screen
from textual.widgets import Footer, Header, Input, Markdown, Static

from localllm.errors import LocalLLMError


class MessageView(Vertical):
    def __init__(self, role: str, text: str = "") -> None:
        super().__init__(classes="message")
        self.role = role
        self.text = text

    def compose(self) -> ComposeResult:
        yield Static(self.role, classes=f"role role-{self.role}")
        yield Markdown(self.text)


class ChatScreen(Screen):
    BINDINGS = [
        Binding("escape", "stop", "Stop"),
        Binding("ctrl+r", "regenerate", "Regenerate"),
        Binding("ctrl+n", "new_chat", "New chat"),
        Binding("ctrl+o", "models", "Models"),
    ]

    def __init__(self, model: str) -> None:
        super().__init__()
        self.model_name = model
        self.llm: Any = None
        self.history: list[dict[str, str]] = []
        self.stream: Any = None
        self.md_stream: Any = None
        self.answer = ""
        self.generating = False

    def compose(self) -> ComposeResult:
        yield Header()
        yield VerticalScroll(id="messages")
        yield Static("", id="status")
        yield Input(placeholder="Message (Enter to send, Esc to stop)", id="prompt")
        yield Footer()

    def on_mount(self) -> None:
        self.sub_title = f"Chat — {self.model_name}"
        self.query_one("#messages").anchor()
        self.query_one(Input).focus()
        self._status(f"{self.model_name}: loads on the first message")

    # -- actions -------------------------------------------------------------------------------

    async def on_input_submitted(self, event: Input.Submitted) -> None:
        text = event.value.strip()
        if not text or self.generating:
            return
        event.input.value = ""
        self.history.append({"role": "user", "content": text})
        await self.query_one("#messages").mount(MessageView("user", text))
        await self._start_answer()

    async def _start_answer(self) -> None:
        view = MessageView("assistant")
        await self.query_one("#messages").mount(view)
        self.md_stream = Markdown.get_stream(view.query_one(Markdown))
        self.answer = ""
        self.generating = True
        self._generate(list(self.history))

    def action_stop(self) -> None:
        if self.stream is not None:
            self.stream.cancel()

    async def action_regenerate(self) -> None:
        if self.generating or not self.history or self.history[-1]["role"] != "assistant":
            return
        self.history.pop()
        views = self.query(MessageView)
        if views:
            await views.last().remove()
        await self._start_answer()

    async def action_new_chat(self) -> None:
        if self.generating:
            return
        self.history.clear()
        await self.query_one("#messages").remove_children()
        self._status(self.model_name)

    def action_models(self) -> None:
        self.app.pop_screen()

    # -- the worker ----------------------------------------------------------------------------

    @work(thread=True, exclusive=True, group="generate")
    def _generate(self, messages: list[dict[str, str]]) -> None:
        from localllm.types import Request

        call = self.app.call_from_thread
        try:
            if self.llm is None:
                call(self._status, f"loading {self.model_name}…")
                t0 = time.monotonic()
                self.llm = self.app.loader(self.model_name)
                call(self._status, f"{self.model_name} loaded in {time.monotonic() - t0:.1f} s")
            self.stream = self.llm.submit(Request(messages=tuple(messages)))
            pending, last = [], time.monotonic()
            for chunk in self.stream:
                if chunk.text:
                    pending.append(chunk.text)
                    now = time.monotonic()
                    if now - last >= 0.05:  # hand text to the UI ~20 times a second, not per token
                        call(self._append, "".join(pending))
                        pending, last = [], now
            if pending:
                call(self._append, "".join(pending))
            call(self._finished, self.stream.result, None)
        except LocalLLMError as e:
            call(self._finished, None, str(e))
        finally:
            self.stream = None

    async def _append(self, text: str) -> None:
        self.answer += text
        await self.md_stream.write(text)

    async def _finished(self, result: Any, error: str | None) -> None:
        if self.md_stream is not None:
            await self.md_stream.stop()
        self.generating = False
        if error:
            self.app.fail(error)
            views = self.query(MessageView)
            if views and not self.answer:
                await views.last().remove()
            self._status(f"{self.model_name}: {error}", level="danger")
            return
        self.history.append({"role": "assistant", "content": self.answer})
        self._show_numbers(result)

    def _show_numbers(self, result: Any) -> None:
        n = result.usage.completion_tokens
        used = result.usage.prompt_tokens + n
        limit = getattr(self.llm, "n_ctx", 0) or 0
        frac = used / limit if limit else 0.0
        level = "danger" if frac >= 0.95 else "warning" if frac >= 0.8 else ""
        stopped = " · stopped" if result.finish_reason == "cancelled" else ""
        self._status(
            f"{self.model_name} · TTFT {result.timings.ttft_s * 1000:.0f} ms · "
            f"{result.timings.tokens_per_s(n):.1f} tokens/s · context {used:,}/{limit:,} "
            f"({frac:.0%}){stopped}",
            level=level,
        )

    def _status(self, text: str, level: str = "") -> None:
        status = self.query_one("#status", Static)
        status.update(text)
        status.set_class(level == "warning", "warning")
        status.set_class(level == "danger", "danger")

    def on_unmount(self) -> None:
        if self.stream is not None:
            self.stream.cancel()
        if self.llm is not None and hasattr(self.llm, "close"):
            self.llm.close()
