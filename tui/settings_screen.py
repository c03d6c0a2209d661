"""Per-conversation settings: system prompt, sampling, and the engine options the backend declares.

Engine options come from the backend's `Capabilities` (today llama.cpp: context size, the KV-cache
types it can allocate, and context shift), so a new backend or option shows up here by declaring
it; nothing is offered that the backend would refuse. Values are checked before they are saved.
"""

from __future__ import annotations

from typing import Any

from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, VerticalScroll
from textual.screen import ModalScreen
from textual.widgets import Button, Input, Label, Select

from localllm.errors import LocalLLMError

# (key, label, parser): blank means "the model's / engine's default"
SAMPLING = (
    ("temperature", "Temperature (0 = greedy)", float),
    ("top_p", "Top-p", float),
    ("top_k", "Top-k", int),
    ("min_p", "Min-p", float),
    ("max_tokens", "Max tokens per answer", int),
    ("seed", "Seed", int),
)


class ChatSettings(ModalScreen[tuple[str | None, dict[str, Any]] | None]):
    BINDINGS = [Binding("escape", "cancel", "Cancel"), Binding("ctrl+s", "save", "Save")]

    def __init__(
        self, system: str | None, settings: dict[str, Any], capabilities: Any = None
    ) -> None:
        super().__init__()
        if capabilities is None:
            from localllm.backends.llamacpp import CAPABILITIES as capabilities
        self.system = system or ""
        self.settings = dict(settings)
        self.caps = capabilities

    def compose(self) -> ComposeResult:
        s = self.settings
        with VerticalScroll(id="dialog"):
            yield Label("System prompt")
            yield Input(self.system, id="system", placeholder="(none)")
            for key, label, _ in SAMPLING:
                yield Label(label)
                yield Input(
                    "" if s.get(key) is None else str(s[key]), id=key, placeholder="default"
                )
            yield Label("Context size (tokens; reloads the model)")
            yield Input(str(s.get("ctx") or ""), id="ctx", placeholder="default 4096")
            yield Label("KV cache type (reloads the model)")
            types = [("f16 (default)", "f16")] + [
                (t, t) for t in self.caps.kv_cache_types if t != "f16"
            ]
            yield Select(types, value=s.get("kv_cache") or "f16", id="kv_cache", allow_blank=False)
            if self.caps.streaming:
                yield Label("Context shift SINKS:WINDOW (blank: refuse on overflow)")
                yield Input(s.get("streaming") or "", id="streaming", placeholder="e.g. 4:2044")
            with Horizontal():
                yield Button("Save (ctrl+s)", id="save", variant="primary")
                yield Button("Cancel (esc)", id="cancel")

    def on_button_pressed(self, event: Button.Pressed) -> None:
        if event.button.id == "save":
            self.action_save()
        else:
            self.action_cancel()

    def action_cancel(self) -> None:
        self.dismiss(None)

    def action_save(self) -> None:
        try:
            result = self.values()
        except (LocalLLMError, ValueError) as e:
            self.app.fail(str(e))
            return
        self.dismiss(result)

    def values(self) -> tuple[str | None, dict[str, Any]]:
        """The form's values, checked the way the engine will check them."""
        from localllm.types import ContextPolicy, SamplingParams

        out: dict[str, Any] = {}
        for key, label, parse in SAMPLING:
            text = self.query_one(f"#{key}", Input).value.strip()
            if text:
                try:
                    out[key] = parse(text)
                except ValueError:
                    raise LocalLLMError(f"{label}: {text!r} is not a number") from None
        SamplingParams.from_kwargs(**out)  # raises the engine's own one-line message
        ctx = self.query_one("#ctx", Input).value.strip()
        if ctx:
            if not ctx.isdigit() or int(ctx) < 64:
                raise LocalLLMError(f"context size {ctx!r}: a whole number of at least 64")
            out["ctx"] = int(ctx)
        kv = self.query_one("#kv_cache", Select).value
        if kv and kv != "f16":
            out["kv_cache"] = kv
        if self.caps.streaming:
            spec = self.query_one("#streaming", Input).value.strip()
            if spec:
                ContextPolicy.parse(spec)
                out["streaming"] = spec
        system = self.query_one("#system", Input).value.strip() or None
        return system, out
