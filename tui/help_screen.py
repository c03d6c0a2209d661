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
| any    | F3       | the server: Ctrl+S start/stop, Ctrl+Y copy URL and key, Ctrl+G new key |
| Models | Enter    | chat with the selected model (Available: pull it) |
| Models | Tab      | Local models ⇄ Available (the catalog) |
| Models | x, k     | context and KV cache type for the Fits marks |
| Models | i        | import a GGUF file by path |
| Models | p        | pull a model (Esc cancels; the next pull resumes) |
| Models | d        | delete (asks first) |
| Models | s        | scan the Hugging Face cache, Ollama and LM Studio |
| Models | f        | make the selected model the default |
| Models | c        | saved conversations |
| Models | r        | read the store again |
| Models | q        | quantize the selected model (type, calibration text, quality report) |
| Models | b        | bench the selected model (latency, tokens/s, % of the decode ceiling); compare all |
| Chat   | Enter    | send (Shift+Enter or Ctrl+J: a new line; a paste keeps all its lines) |
| Chat   | Esc      | stop the answer (or cancel an edit) |
| Chat   | Ctrl+R   | regenerate the last answer (a new branch beside it) |
| Chat   | F2       | edit the last question (a new branch) |
| Chat   | Tab      | focus a message: `e` edits it, `c` copies it, ← → switch its branches |
| Chat   | Ctrl+S   | settings: system prompt, sampling, context, KV cache, context shift |
| Chat   | Ctrl+T   | thinking (a thinking model's): its default → on → off |
| Chat   | F4       | attach an image (a path) to the next message |
| Chat   | Ctrl+N   | new chat |
| Chat   | Ctrl+L   | saved conversations |
| Chat   | Ctrl+O   | back to Models |
| Chats  | type     | search titles and messages |
| Chats  | Enter    | open; Ctrl+R rename, Ctrl+D delete, Ctrl+X export to Markdown |

Press Esc to close.
"""


class HelpScreen(ModalScreen[None]):
    BINDINGS = [Binding("escape", "dismiss", "Close"), Binding("f1", "dismiss", "Close")]

    def compose(self) -> ComposeResult:
        yield Markdown(HELP)
