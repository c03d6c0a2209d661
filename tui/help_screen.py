"""Help: every key, on one screen."""

from __future__ import annotations

from textual.app import ComposeResult
from textual.binding import Binding
from textual.screen import ModalScreen
from textual.widgets import Markdown

HELP = """\
# localllm — keys

| Where  | Key      | Does |
|--------|----------|------|
| any    | Ctrl+Q   | quit |
| any    | F1       | this help |
| any    | Ctrl+T   | light / dark theme |
| any    | Ctrl+P   | command palette |
| Models | Enter    | chat with the selected model |
| Models | p        | pull a model (Esc cancels; the next pull resumes) |
| Models | d        | delete (asks first) |
| Models | s        | scan the Hugging Face cache, Ollama and LM Studio |
| Models | f        | make the selected model the default |
| Chat   | Enter    | send |
| Chat   | Esc      | stop the answer |
| Chat   | Ctrl+R   | regenerate the last answer |
| Chat   | Ctrl+N   | new chat |
| Chat   | Ctrl+O   | back to Models |

Press Esc to close.
"""


class HelpScreen(ModalScreen[None]):
    BINDINGS = [Binding("escape", "dismiss", "Close"), Binding("f1", "dismiss", "Close")]

    def compose(self) -> ComposeResult:
        yield Markdown(HELP)
