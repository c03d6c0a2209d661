"""Chat: a streaming Markdown answer, stop, regenerate, edit-and-branch, settings, live numbers.

The model loads and generates in a worker thread. Text reaches the screen through
`Markdown.get_stream()`, which batches fragments so a fast model never outruns the renderer. Every
conversation is saved as it happens (`conversations.py`): the answer is written every half second
while it streams, so a kill keeps what was shown, marked as interrupted.

The context meter counts prompt + answer against the model's context and turns to warning at 80%
and danger at 95%; an overflow is refused by the engine with the numbers (a notification), never
truncated silently — unless the conversation's engine settings turn context shift on.

The screen does not own its model: it acquires one from the app's `ModelPool` for (model name,
the conversation's `LoadOptions`) and releases it when it goes or when the options change, so a
reload happens exactly when the options differ from those the model was acquired with.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

from textual import work
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Vertical, VerticalScroll
from textual.message import Message
from textual.screen import Screen
from textual.widgets import Collapsible, Footer, Header, Markdown, Static, TextArea

from localllm.conversations import image_meta
from localllm.errors import LocalLLMError
from localllm.types import LoadOptions

APP_PARALLEL = 2  # sequences one loaded model decodes at once for the app
SAVE_EVERY_S = 0.5  # how often a streaming answer is written to the database
# Streamed text is handed to the UI in batches. Each hand-over re-renders the answer and lays out
# the chat (~10–20 ms of the UI thread for a long answer), and on a small machine every core the UI
# takes is a core the model loses. So the interval adapts: the UI thread may use UI_CPU_BUDGET of
# one core while an answer streams, never updating faster than UI_MIN_S nor slower than UI_MAX_S.
UI_CPU_BUDGET = 0.03
UI_MIN_S, UI_MAX_S = 0.1, 1.0


PLACEHOLDER = "Message (Enter to send, Shift+Enter or Ctrl+J for a new line, Esc to stop)"


class PromptArea(TextArea):
    """The message box. Enter sends; Shift+Enter (where the terminal tells it apart) and Ctrl+J
    insert a newline; a paste keeps every line and never sends by itself (Textual's bracketed
    paste); the box grows with its text to 8 lines, then scrolls."""

    DEFAULT_CSS = "PromptArea { height: auto; max-height: 10; }"  # 8 lines and the border

    class Submitted(Message):
        def __init__(self, area: PromptArea, value: str) -> None:
            super().__init__()
            self.area, self.value = area, value

    async def _on_key(self, event: Any) -> None:
        if event.key == "enter":
            event.stop()
            event.prevent_default()
            self.post_message(self.Submitted(self, self.text))
        elif event.key in ("shift+enter", "ctrl+j"):
            event.stop()
            event.prevent_default()
            self.insert("\n")
        else:
            await super()._on_key(event)


class MessageView(Vertical, can_focus=True):
    """One message. Focus it (Tab / Shift+Tab) to edit it (`e`), copy it (`c`, to the terminal's
    clipboard through OSC 52) or switch branches (← →)."""

    BINDINGS = [
        Binding("e", "edit", "Edit"),
        Binding("c", "copy", "Copy"),
        Binding("left", "branch(-1)", "Prev branch"),
        Binding("right", "branch(1)", "Next branch"),
    ]

    def __init__(self, role: str, text: str = "", *, msg_id: int | None = None,
                 note: str = "", reasoning: str = "", thought: str = "") -> None:  # fmt: skip
        super().__init__(classes="message")
        self.role, self.text, self.msg_id, self.note = role, text, msg_id, note
        self.reasoning, self.thought = reasoning, thought  # a thinking model's, and its summary

    def compose(self) -> ComposeResult:
        yield Static(
            self.role + (f"  {self.note}" if self.note else ""), classes=f"role role-{self.role}"
        )
        if self.reasoning:
            yield self._thoughts()
        yield Markdown(self.text)

    def _thoughts(self) -> Collapsible:
        """The reasoning, collapsed under its summary ("Thinking…" while it streams)."""
        return Collapsible(Static(self.reasoning, classes="thinking-text", markup=False),
                           title=self.thought or "Thinking…", collapsed=True,
                           classes="thinking")  # fmt: skip

    async def think(self, text: str) -> None:
        """More reasoning, as it streams."""
        self.reasoning += text
        found = self.query(Collapsible)
        if found:
            found.first().query_one(".thinking-text", Static).update(self.reasoning)
        else:
            await self.mount(self._thoughts(), before=self.query_one(Markdown))

    def thought_for(self, summary: str) -> None:
        self.thought = summary
        for c in self.query(Collapsible):
            c.title = summary

    def action_edit(self) -> None:
        self.screen.start_edit(self)

    def action_copy(self) -> None:
        self.app.copy_to_clipboard(self.text)
        self.notify(f"copied the {self.role} message ({len(self.text):,} characters)")

    async def action_branch(self, step: int) -> None:
        await self.screen.switch_branch(self, step)


def _summary(meta: dict[str, Any]) -> str:
    """A thinking block's title: how long the model thought, once it is known."""
    if "reasoning_tokens" not in meta:
        return ""
    return f"Thought for {meta['reasoning_tokens']:,} tokens, {meta.get('thinking_s', 0):.1f} s"


class ChatScreen(Screen):
    BINDINGS = [
        Binding("escape", "stop", "Stop"),
        Binding("ctrl+r", "regenerate", "Regenerate"),
        Binding("f2", "edit_last", "Edit last"),
        Binding("ctrl+s", "settings", "Settings"),
        Binding("ctrl+t", "think", "Thinking"),
        Binding("f4", "attach", "Attach image"),
        Binding("ctrl+n", "new_chat", "New chat"),
        Binding("ctrl+l", "conversations", "Chats"),
        Binding("ctrl+o", "models", "Models"),
    ]

    def __init__(self, model: str, conversation_id: int | None = None) -> None:
        super().__init__()
        self.model_name = model
        self.conv_id = conversation_id
        self.llm: Any = None  # acquired from app.pool; released on unmount or an options change
        self.llm_options: LoadOptions | None = None  # what `llm` was acquired with
        self.sampling: dict[str, Any] = {}  # SamplingParams keywords over the model's defaults
        self.options = LoadOptions()  # the conversation's engine options
        self.system_prompt: str | None = None
        self.think: bool | None = None  # a thinking model thinks, or not (None: its default)
        self.attached: list[tuple[str, bytes]] = []  # images (name, bytes) for the next message
        self._llm_lock = threading.Lock()  # the worker acquires, unmount releases
        self._gone = False
        self._stop = False  # Esc came before the answer's stream existed
        self.stream: Any = None
        self.md_stream: Any = None
        self.answer = ""
        self.answer_view: MessageView | None = None  # the answer streaming (or last streamed)
        self.generating = False
        self.editing: int | None = None  # id of the message being edited
        self.ui_interval = UI_MIN_S * 2
        self._ui_clock: tuple[float, float] | None = None  # UI thread CPU time, wall time

    @property
    def db(self) -> Any:
        return self.app.conversations

    @property
    def history(self) -> list[dict[str, str]]:
        """The current branch as chat messages (the system prompt first)."""
        msgs: list[dict[str, Any]] = [{"role": "system", "content": self.system_prompt}] if self.system_prompt else []
        if self.conv_id is not None:
            for m in self.db.branch(self.conv_id):
                if m.status == "error":
                    continue
                for sent in m.meta.get("tool_rounds") or ():  # the calls an answer made, and their results
                    msgs += sent
                msgs.append(m.chat())
        return msgs

    def compose(self) -> ComposeResult:
        yield Header()
        yield VerticalScroll(id="messages")
        yield Static("", id="status")
        yield PromptArea(placeholder=PLACEHOLDER, id="prompt", soft_wrap=True)
        yield Footer()

    async def on_mount(self) -> None:
        self.query_one("#messages").anchor()
        self.query_one(PromptArea).focus()
        if self.conv_id is not None:
            conv = self.db.get(self.conv_id)
            self.model_name = conv.model
            self.system_prompt = conv.system_prompt
            saved = conv.chat_settings
            self.sampling, self.options, self.think = dict(saved.sampling), saved.options, saved.think
            if saved.ignored:  # saved by another localllm: it still opens, and the user knows
                self.app.say_once(f"ignored:{self.conv_id}",
                                  "this conversation's saved settings include options this localllm "
                                  f"does not know or cannot use, ignored: {', '.join(saved.ignored)}")  # fmt: skip
            await self._render_branch()
        else:  # a new chat starts from the context and KV type chosen on the Models screen
            self.options = self._models_screen_options()
        self.sub_title = f"Chat — {self.model_name}"
        self._status(f"{self.model_name}: loads on the first message")

    def _models_screen_options(self) -> LoadOptions:
        from localllm.memory import DEFAULT_CTX

        ctx = self.app.settings.get("ctx")
        kv = self.app.settings.get("kv_cache")
        try:
            return LoadOptions(ctx=ctx if ctx and ctx != DEFAULT_CTX else None, kv_cache=kv or "f16")
        except (LocalLLMError, TypeError, ValueError, AttributeError):
            return LoadOptions()  # a hand-edited settings.json: the defaults

    @property
    def saved_settings(self) -> dict[str, Any]:
        from localllm.conversations import ChatSettings

        return ChatSettings(self.sampling, self.options, think=self.think).to_dict()

    async def _render_branch(self) -> None:
        box = self.query_one("#messages")
        await box.remove_children()
        views = []
        for m in self.db.branch(self.conv_id):
            siblings = self.db.siblings(m.id)
            note = []
            if len(siblings) > 1:
                note.append(f"branch {[s.id for s in siblings].index(m.id) + 1}/{len(siblings)}")
            used = [c["function"]["name"] for sent in m.meta.get("tool_rounds") or () for c in sent[0]["tool_calls"]]
            if used:  # the answer's tool calls (their results are sent with the conversation)
                note.append(f"tools: {', '.join(dict.fromkeys(used))}")
            if m.status in ("partial", "cancelled", "error"):
                note.append({"partial": "(interrupted)", "cancelled": "(stopped)",
                             "error": "(error)"}[m.status])  # fmt: skip
            views.append(MessageView(m.role, m.content, msg_id=m.id, note=" ".join(note),
                                     reasoning=m.meta.get("reasoning") or "",
                                     thought=_summary(m.meta)))  # fmt: skip
        await box.mount_all(views)

    # -- sending -------------------------------------------------------------------------------

    async def on_prompt_area_submitted(self, event: PromptArea.Submitted) -> None:
        text = event.value.strip("\n")
        if not text.strip() or self.generating:
            return
        event.area.clear()
        if self.conv_id is None:
            conv = self.db.create(self.model_name, system_prompt=self.system_prompt,
                                  settings=self.saved_settings)  # fmt: skip
            self.conv_id = conv.id
        if self.editing is not None:
            msg = self.db.edit(self.editing, text)  # a new branch; the old one stays
            self.editing = None
            event.area.placeholder = PLACEHOLDER
            await self._render_branch()
        else:
            meta = image_meta([data for _, data in self.attached], [name for name, _ in self.attached])
            self.attached = []
            msg = self.db.add_message(self.conv_id, "user", text, meta=meta)
            await self.query_one("#messages").mount(MessageView("user", text, msg_id=msg.id))
        await self._start_answer(parent_id=msg.id)

    async def _start_answer(self, parent_id: int) -> None:
        msg = self.db.add_message(self.conv_id, "assistant", "", parent_id=parent_id,
                                  status="streaming")  # fmt: skip
        view = self.answer_view = MessageView("assistant", msg_id=msg.id)
        await self.query_one("#messages").mount(view)
        self.md_stream = Markdown.get_stream(view.query_one(Markdown))
        self.answer = ""
        self.generating = True
        self._stop = False
        self._ui_clock = None
        self._generate(self.history[:-1], msg.id)  # the empty answer itself is not sent

    # -- actions -------------------------------------------------------------------------------

    def action_stop(self) -> None:
        if self.editing is not None and not self.generating:
            self.editing = None
            prompt = self.query_one(PromptArea)
            prompt.clear()
            prompt.placeholder = PLACEHOLDER
            return
        self._stop = self.generating  # Esc while the model loads: stop as soon as it starts
        if self.stream is not None:
            self.stream.cancel()

    async def action_regenerate(self) -> None:
        """A new answer to the same question, beside the old one (← → on it switches)."""
        if self.generating or self.conv_id is None:
            return
        branch = self.db.branch(self.conv_id)
        if not branch or branch[-1].role != "assistant" or branch[-1].parent_id is None:
            return
        views = self.query(MessageView)
        if views:
            await views.last().remove()
        await self._start_answer(parent_id=branch[-1].parent_id)

    def action_edit_last(self) -> None:
        views = [v for v in self.query(MessageView) if v.role == "user" and v.msg_id]
        if views:
            self.start_edit(views[-1])

    def start_edit(self, view: MessageView) -> None:
        if self.generating or view.msg_id is None or view.role != "user":
            return
        self.editing = view.msg_id
        prompt = self.query_one(PromptArea)
        prompt.load_text(view.text)
        prompt.move_cursor(prompt.document.end)
        prompt.placeholder = "Editing: Enter sends a new branch, Esc cancels"
        prompt.focus()

    async def switch_branch(self, view: MessageView, step: int) -> None:
        if self.generating or view.msg_id is None:
            return
        siblings = [s.id for s in self.db.siblings(view.msg_id)]
        if len(siblings) < 2:
            return
        target = siblings[(siblings.index(view.msg_id) + step) % len(siblings)]
        self.db.set_current_leaf(self.conv_id, target)
        await self._render_branch()
        for v in self.query(MessageView):
            if v.msg_id == target:
                v.focus()

    async def action_new_chat(self) -> None:
        if self.generating:
            return
        self.conv_id = None
        await self.query_one("#messages").remove_children()
        self._status(self.model_name)

    def action_models(self) -> None:
        self.app.back_to_models()

    def action_conversations(self) -> None:
        self.app.action_show_conversations()

    def action_settings(self) -> None:
        from localllm.tui.settings_screen import SettingsScreen

        self.app.push_screen(SettingsScreen(self.system_prompt, self.sampling, self.options),
                             self._apply_settings)  # fmt: skip

    def action_attach(self) -> None:
        """F4: an image (a path) goes with the next message; the model reads it when it has its
        vision projector, else the message is refused in one line (never sent without it)."""
        from localllm.tui.dialogs import Ask

        def done(path: str | None) -> None:
            if not path:
                return
            file = Path(path).expanduser()
            try:
                data = file.read_bytes()
            except OSError as e:
                self.app.fail(f"cannot read the image {file}: {e.strerror or e}")
                return
            if len(data) > MAX_IMAGE_BYTES:
                self.app.fail(f"the image {file} is over {MAX_IMAGE_BYTES >> 20} MiB")
                return
            self.attached.append((file.name, data))
            names = ", ".join(n for n, _ in self.attached)
            self._status(f"attached {names}: they go with the next message")

        self.app.push_screen(Ask("Attach an image (path to a PNG, JPEG, GIF or BMP file)"), done)

    def action_think(self) -> None:
        """Ctrl+T: thinking as the model does by default → on → off → the model's default again
        (a model that cannot think refuses "on" in one line at the next message)."""
        self.think = {None: True, True: False, False: None}[self.think]
        if self.conv_id is not None:
            self.db.update_settings(self.conv_id, settings=self.saved_settings)
        said = {None: "as the model does by default", True: "on", False: "off"}[self.think]
        self._status(f"thinking: {said} (from the next message)")

    def _apply_settings(self, result: tuple[str | None, dict[str, Any], LoadOptions] | None) -> None:
        if result is None:
            return
        system, sampling, options = result
        reload = options != self.options
        self.system_prompt, self.sampling, self.options = system, sampling, options
        if self.conv_id is not None:
            self.db.update_settings(self.conv_id, system_prompt=system or "",
                                    settings=self.saved_settings)  # fmt: skip
        self.notify("settings saved" + ("; the model reloads with the new engine options at the "
                                        "next message" if reload else ""))  # fmt: skip

    # -- the worker ----------------------------------------------------------------------------

    def _request(self, llm: Any, messages: list[dict[str, str]], tools: Any = None) -> Any:
        from localllm.types import Request, SamplingParams

        # over the model's own defaults (its GGUF, else the catalog) when it has them
        given = {k: v for k, v in self.sampling.items() if v is not None}
        sampling_for = getattr(llm, "sampling", None)
        sampling = sampling_for(**given) if callable(sampling_for) else \
            SamplingParams.from_kwargs(**given)  # fmt: skip
        return Request(messages=tuple(messages), sampling=sampling, context=self.options.context,
                       think=self.think, tools=tuple(tools.tools()) if tools is not None else ())  # fmt: skip

    def _ask_tool(self, call: Any) -> str:
        """(Worker thread.) The user's answer to one tool call: the dialog waits; a chat closed or
        stopped meanwhile denies it."""
        from localllm.tui.dialogs import ToolPermission

        answer: list[str] = []
        done = threading.Event()
        box = self.app.tools()
        server = box.server_of(call.name) if box is not None else None

        def show() -> None:
            self.app.push_screen(ToolPermission(call.name, call.arguments, server),
                                 lambda value: (answer.append(value or "deny"), done.set()))  # fmt: skip

        self.app.call_from_thread(show)
        while not done.wait(0.1):
            if self._gone or self._stop:
                return "deny"
        return answer[0]

    def _model(self) -> Any:
        """(Worker thread.) The model for this conversation's options, from the app's pool."""
        pool = self.app.pool
        # chats of one model share it through the pool; two slots let a chat left streaming under
        # another screen and the chat in front answer side by side (KV memory for two, not four)
        options = self.options.replace(parallel=APP_PARALLEL)
        with self._llm_lock:
            old = self.llm if self.llm is not None and self.llm_options != options else None
            if old is not None:  # acquired with other options (settings changed): give it back
                self.llm = self.llm_options = None
        if old is not None:
            pool.release(old)
        if self.llm is not None:
            return self.llm
        self.app.call_from_thread(self._status, f"loading {self.model_name}…")
        t0 = time.monotonic()
        llm = pool.acquire(self.model_name, options)
        with self._llm_lock:
            gone = self._gone
            if not gone:
                self.llm, self.llm_options = llm, options
        if gone:  # the screen went while the model loaded
            pool.release(llm)
            raise LocalLLMError("the chat was closed")
        note = getattr(getattr(getattr(llm, "backend", None), "chat_template", None), "note", "")
        if note:
            self.app.call_from_thread(self.app.say_once, f"template:{llm.name}", f"{llm.name}: {note}")
        where = f", served by {llm.url}" if getattr(llm, "url", None) else ""  # localllm.remote
        self.app.call_from_thread(self._status,
                                  f"{self.model_name} ready in {time.monotonic() - t0:.1f} s{where}")  # fmt: skip
        return llm

    @work(thread=True, exclusive=True, group="generate")
    def _generate(self, messages: list[dict[str, str]], msg_id: int) -> None:
        call = self.app.call_from_thread
        text, status, meta = "", "error", {}
        thinking: dict[str, Any] = {}  # a thinking model's reasoning, saved apart from the answer
        rounds: list[list[dict[str, Any]]] = []  # each round: the calls message and their results
        try:
            from dataclasses import replace

            from localllm.chat import ToolHold
            from localllm.mcp_tools import MAX_ROUNDS, run_round

            llm = self._model()
            tools = self.app.tools()
            request = self._request(llm, messages, tools)
            while True:
                self.stream = llm.submit(request)
                if self._stop:
                    self.stream.cancel()
                hold = ToolHold(tools is not None)  # a call's markup is never shown
                pending: list[str] = []
                pending_thought: list[str] = []
                last_ui = last_save = time.monotonic()
                t_think = 0.0
                for chunk in self.stream:
                    if chunk.reasoning:
                        t_think = t_think or time.monotonic()
                        pending_thought.append(chunk.reasoning)
                        thinking["reasoning"] = thinking.get("reasoning", "") + chunk.reasoning
                        thinking["thinking_s"] = time.monotonic() - t_think
                    shown = hold.feed(chunk.text)
                    if not shown and not chunk.reasoning:
                        continue
                    pending.append(shown)
                    text += shown
                    now = time.monotonic()
                    if now - last_ui >= self.ui_interval:  # batches, not one hand-over per token
                        call(self._append, "".join(pending), "".join(pending_thought))
                        pending, pending_thought, last_ui = [], [], now
                    if now - last_save >= SAVE_EVERY_S:
                        self.db.update_message(msg_id, content=text, meta=thinking or None)
                        last_save = now
                result = self.stream.result
                rest = hold.rest(result.text, bool(result.tool_calls))
                pending.append(rest)
                text += rest
                if any(pending) or pending_thought:
                    call(self._append, "".join(pending), "".join(pending_thought))
                if not (result.tool_calls and tools is not None) or self._stop or self._gone:
                    break
                if len(rounds) == MAX_ROUNDS:
                    call(self._append, f"\n\n*(stopped after {MAX_ROUNDS} rounds of tool calls)*\n")
                    break

                def said(c: Any, out: str) -> None:
                    call(self._append, f"\n\n`{c.name}` → {out[:300]}\n\n")

                rounds.append(run_round(tools, result, self._ask_tool, self.app.tool_permissions, said))
                text = ""  # the answer is what follows the last round (the rounds are in meta)
                request = replace(request, messages=(*request.messages, *rounds[-1]))
            status = "cancelled" if result.finish_reason == "cancelled" else "complete"
            if thinking:
                thinking["reasoning_tokens"] = result.usage.reasoning_tokens
            meta = {"finish_reason": result.finish_reason, "usage": {
                "prompt_tokens": result.usage.prompt_tokens,
                "completion_tokens": result.usage.completion_tokens},
                "ttft_s": result.timings.ttft_s,
                "tokens_per_s": result.timings.tokens_per_s(result.usage.completion_tokens),
                **thinking, **({"tool_rounds": rounds} if rounds else {})}  # fmt: skip
            self.db.update_message(msg_id, content=text, status=status, meta=meta)
            if thinking and not self._gone:
                call(self._thought, _summary(meta))
            if not self._gone:
                call(self._finished, result, None)
        except Exception as e:  # noqa: BLE001 - one notification; the app stays alive
            said = str(e) if isinstance(e, LocalLLMError) else f"{type(e).__name__}: {e}"
            self.db.update_message(msg_id, content=text, status="error",
                                   meta={"error": said, **thinking})  # fmt: skip
            if not self._gone:  # a chat closed mid-load says nothing; its answer is saved as error
                call(self._finished, None, said.splitlines()[0] if said else "failed")
        finally:
            self.stream = None

    async def _append(self, text: str, reasoning: str = "") -> None:
        view = self.answer_view  # the streaming answer's (its text is what `c` copies)
        if reasoning and view is not None:
            await view.think(reasoning)
        if text:
            self.answer += text
            if view is not None:
                view.text += text
            await self.md_stream.write(text)
        self._pace()

    def _thought(self, summary: str) -> None:
        if self.answer_view is not None:
            self.answer_view.thought_for(summary)

    def _pace(self) -> None:
        """Adapt the hand-over interval to what the UI thread has spent since the last one."""
        cpu, now = time.thread_time(), time.monotonic()
        if self._ui_clock is not None:
            used = (cpu - self._ui_clock[0]) / max(1e-3, now - self._ui_clock[1])
            factor = 1.5 if used > UI_CPU_BUDGET else 0.8 if used < UI_CPU_BUDGET / 2 else 1.0
            self.ui_interval = min(UI_MAX_S, max(UI_MIN_S, self.ui_interval * factor))
        self._ui_clock = (cpu, now)

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
        self._show_numbers(result)

    def _show_numbers(self, result: Any) -> None:
        n = result.usage.completion_tokens
        used = result.usage.prompt_tokens + n
        limit = getattr(self.llm, "n_ctx", 0) or 0
        stopped = " · stopped" if result.finish_reason == "cancelled" else ""
        policy = self.options.context
        if policy.enabled:  # no hard limit: the meter shows the window and what fell out of it
            window = min(limit, (policy.sinks or 0) + policy.window) if limit else 0
            held = min(used, window) if window else used
            meter = (f"context {used:,} · window {held:,}/{window:,} "
                     f"({policy.sinks} sinks) · {used - held:,} evicted")  # fmt: skip
            level, tokens = "", window
        else:
            frac = used / limit if limit else 0.0
            meter = f"context {used:,}/{limit:,} ({frac:.0%})"
            level = "danger" if frac >= 0.95 else "warning" if frac >= 0.8 else ""
            tokens = limit
        shifted = f" · shifted {result.context_shifts}x" if result.context_shifts else ""
        sp = getattr(result, "speculative", None)
        spec = ""
        if sp is not None:  # acceptance and tokens per target pass; "off" once it switched off
            spec = (f" · {sp.mode} {sp.acceptance:.0%} accepted, {sp.tokens_per_pass:.2f}/pass"
                    + (" (off)" if sp.switched_off else ""))  # fmt: skip
        self._status(
            f"{self.model_name} · TTFT {result.timings.ttft_s * 1000:.0f} ms · "
            f"{result.timings.tokens_per_s(n):.1f} tokens/s · {meter}"
            f"{self._kv_text(tokens)}{spec}{shifted}{stopped}",
            level=level,
        )

    def _kv_text(self, n_tokens: int) -> str:
        """KV memory: what the engine's caches hold now where it can say (the torch engine,
        whatever the cache types and policy), else what `n_tokens` cells of the chosen K and V
        types take (llama.cpp allocates its cells when it loads; H2O keeps at most its budget)."""
        try:
            from localllm.memory import kv_cache_bytes, parse_kv_cache
            from localllm.model_info import human_bytes
            from localllm.models_registry.catalog import find_local

            live = getattr(self.llm, "kv_bytes", None)
            if callable(live) and (held := live()) is not None:
                return f" · KV {human_bytes(held)} ({self.options.kv_cache})"
            record = find_local(self.model_name, self.app.store)
            if record is None or not n_tokens:
                return ""
            if self.options.evict:
                n_tokens = min(n_tokens, int(self.options.evict.partition(":")[2]))
            type_k, type_v = parse_kv_cache(self.options.kv_cache)
            return f" · KV {human_bytes(kv_cache_bytes(record.info, n_tokens, type_k, type_v))}"
        except (LocalLLMError, TypeError, ValueError):
            return ""

    def _status(self, text: str, level: str = "") -> None:
        status = self.query_one("#status", Static)
        status.update(text)
        status.set_class(level == "warning", "warning")
        status.set_class(level == "danger", "danger")

    def on_unmount(self) -> None:
        if self.stream is not None:
            self.stream.cancel()
        with self._llm_lock:
            self._gone = True
            llm, self.llm = self.llm, None
        if llm is not None:
            self.app.pool.release(llm)  # the pool keeps it a while for the next chat


MAX_IMAGE_BYTES = 20 << 20  # as the server takes one
