"""Small dialogs shared by the screens: a yes/no question and a one-line answer."""

from __future__ import annotations

from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Vertical
from textual.screen import ModalScreen
from textual.widgets import Button, Input, Label


class Confirm(ModalScreen[bool]):
    BINDINGS = [Binding("escape", "no", "Cancel"), Binding("y", "yes", "Yes")]

    def __init__(self, question: str) -> None:
        super().__init__()
        self.question = question

    def compose(self) -> ComposeResult:
        with Vertical(id="dialog"):
            yield Label(self.question)
            yield Button("Yes (y)", id="yes", variant="error")
            yield Button("No (esc)", id="no")

    def on_button_pressed(self, event: Button.Pressed) -> None:
        self.dismiss(event.button.id == "yes")

    def action_yes(self) -> None:
        self.dismiss(True)

    def action_no(self) -> None:
        self.dismiss(False)


class Ask(ModalScreen[str | None]):
    BINDINGS = [Binding("escape", "cancel", "Cancel")]

    def __init__(self, question: str, value: str = "") -> None:
        super().__init__()
        self.question, self.value = question, value

    def compose(self) -> ComposeResult:
        with Vertical(id="dialog"):
            yield Label(self.question)
            yield Input(self.value)

    def on_input_submitted(self, event: Input.Submitted) -> None:
        self.dismiss(event.value.strip() or None)

    def action_cancel(self) -> None:
        self.dismiss(None)


class ToolPermission(ModalScreen[str]):
    """May the model's tool call run? "once", "always" (this tool, this session) or "deny"."""

    BINDINGS = [Binding("y", "answer('once')", "Allow once"), Binding("a", "answer('always')", "Always"),
                Binding("n", "answer('deny')", "Deny"), Binding("escape", "answer('deny')", "Deny")]  # fmt: skip

    def __init__(self, name: str, arguments: str, server: str | None = None) -> None:
        super().__init__()
        self.call_name, self.arguments, self.server = name, arguments, server

    def compose(self) -> ComposeResult:
        with Vertical(id="dialog"):
            where = f" (MCP server {self.server})" if self.server else ""
            yield Label(f"The model calls the tool {self.call_name}{where} with:", id="tool-question")
            yield Label(self.arguments[:2000], id="tool-arguments", markup=False)
            yield Button("Allow once (y)", id="once", variant="primary")
            yield Button("Always for this tool (a)", id="always")
            yield Button("Deny (n)", id="deny", variant="error")

    def on_button_pressed(self, event: Button.Pressed) -> None:
        self.dismiss(event.button.id or "deny")

    def action_answer(self, answer: str) -> None:
        self.dismiss(answer)
