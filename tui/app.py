"""The terminal app: `localllm` (Models, or Chat when a default model exists), `localllm chat MODEL`.

Everything slow — loading a model, generating, pulling, scanning — runs in a worker thread; the UI
thread only draws. Errors reach the user as a notification with the one-line message. The app is
built from small parts: a screen per job (`models_screen.py`, `chat_screen.py`), settings in one
JSON file beside the store, and one `ModelPool` (`localllm.pool`) that owns the loaded models:
screens acquire a model for (name, LoadOptions) and release it, so two chats with the same model
and options share one, and reopening a chat within the idle time does not load it again. The pool's
`loader` turns a name and options into something with `submit(Request) -> stream`: the copy a
running `localllm serve` holds when it suits (`localllm.remote`), else the engine's `localllm.load`
(or a fake in tests).
"""

from __future__ import annotations

import contextlib
import json
import os
import threading
from pathlib import Path
from typing import Any

from textual.app import App
from textual.binding import Binding

from localllm.errors import LocalLLMError
from localllm.models_registry.store import Store, temp_path
from localllm.pool import Loader, ModelPool

KEEP_LOADED_S = 300.0  # a model no chat uses stays loaded this long (settings: keep_loaded_s)


class Settings:
    """App settings (`settings.json` in the store folder): the default model, the theme, the
    context and KV type chosen on Models. Written atomically: a kill never leaves half a file."""

    def __init__(self, path: Path) -> None:
        self.path = path
        try:
            self.data: dict[str, Any] = json.loads(path.read_text())
            if not isinstance(self.data, dict):
                self.data = {}
        except (OSError, ValueError):
            self.data = {}

    def get(self, key: str, default: Any = None) -> Any:
        return self.data.get(key, default)

    def set(self, key: str, value: Any) -> None:
        """Change one setting and save: a temporary file in the same folder, fsynced, renamed."""
        self.data[key] = value
        data = json.dumps(self.data, indent=1).encode()
        folder = self.path.parent
        tmp = temp_path(folder, f".{self.path.name}")
        try:
            folder.mkdir(parents=True, exist_ok=True)
            with open(tmp, "xb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, self.path)
            fd = os.open(folder, os.O_RDONLY)
            try:
                os.fsync(fd)  # the rename itself survives a power cut
            finally:
                os.close(fd)
        except OSError as e:
            with contextlib.suppress(OSError):
                tmp.unlink()
            raise LocalLLMError(f"cannot save {self.path}: {e.strerror or e}") from None


class LocalLLMApp(App):
    TITLE = "localllm"
    BINDINGS = [
        Binding("ctrl+q", "quit", "Quit", priority=True),
        Binding("f1", "help", "Help"),
        Binding("ctrl+t", "toggle_theme", "Theme"),
        Binding("f3", "show_server", "Server"),
    ]
    CSS = """
    Screen { layout: vertical; }
    DataTable { height: 1fr; }
    #messages { height: 1fr; }
    .message { margin: 0 1; height: auto; }
    .role { color: $accent; text-style: bold; }
    .role-user { color: $success; }
    #status { height: 1; color: $text-muted; padding: 0 1; }
    #status.warning { color: $warning; }
    #status.danger { color: $error; }
    MessageView:focus { background: $boost; border-left: thick $accent; }
    #dialog { width: 80%; height: auto; max-height: 90%; border: round $accent; padding: 1 2;
              background: $panel; }
    ModalScreen { align: center middle; }
    """

    def __init__(self, *, chat_model: str | None = None, store: Store | None = None,
                 loader: Loader | None = None, pool: ModelPool | None = None) -> None:  # fmt: skip
        """`loader(name, options)` replaces the engine's load (tests); `pool` replaces the pool."""
        super().__init__()
        self.store = store or Store()
        self.settings = Settings(self.store.home / "settings.json")
        try:
            keep = float(self.settings.get("keep_loaded_s", KEEP_LOADED_S))
        except (TypeError, ValueError):
            keep = KEEP_LOADED_S
        fit: Any = "registry"
        if pool is None and loader is None and self.settings.get("use_server", True):
            loader, fit = self._server_first()
        self.pool = pool or ModelPool(loader, idle_s=max(0.0, keep), store=self.store, fit=fit)
        self.chat_model = chat_model
        self._conversations: Any = None
        self.server: Any = None  # the in-app server (localllm.server.runner.BackgroundServer)
        self._said: set[str] = set()  # notes already shown this session (template, ignored keys)
        self._toolbox: Any = None  # MCP tools (mcp_tools.Toolbox), started on the first answer
        self._tools_tried = False
        self._tools_lock = threading.Lock()
        self.tool_permissions: Any = None  # mcp_tools.Permissions: tools allowed always this session
        self.theme = self.settings.get("theme", "textual-dark")

    def _server_first(self) -> tuple[Loader, Any]:
        """The pool's loader and memory check while `localllm serve` may run on this machine: a
        chat uses the server's copy of its model when it suits the chat's options (settings:
        `use_server: false` always loads here); the server's copy costs this process no memory."""
        from localllm.pool import registry_fit
        from localllm.remote import open_model, serving

        registry = registry_fit(self.store)

        def fit(name: str, options: Any) -> tuple[int, int] | None:
            return None if serving() is not None else registry(name, options)

        def load(name: str, options: Any) -> Any:
            return open_model(name, options, say=lambda why: self.call_from_thread(self.notify, why))

        return load, fit

    def on_mount(self) -> None:
        from localllm.tui.models_screen import ModelsScreen

        self.push_screen(ModelsScreen())
        model = self.chat_model or self.settings.get("default_model")
        if model and self._known(model):
            self.open_chat(model)

    def _known(self, model: str) -> bool:
        from localllm.errors import LocalLLMError
        from localllm.models_registry.catalog import find_local

        try:
            return find_local(model, self.store) is not None or model == "smollm2"
        except LocalLLMError:
            return False

    @property
    def conversations(self) -> Any:
        """The saved conversations (SQLite beside the store), opened on first use."""
        if self._conversations is None:
            from localllm.conversations import Conversations

            self._conversations = Conversations(self.store.home / "conversations.db")
        return self._conversations

    def open_chat(self, model: str, conversation_id: int | None = None) -> None:
        from localllm.tui.chat_screen import ChatScreen

        self.push_screen(ChatScreen(model, conversation_id))

    def open_conversation(self, model: str, conversation_id: int) -> None:
        """A saved conversation's chat, in place of the open chat if one is on top (it gives its
        model back to the pool; the new one gets it from there when it needs the same model with
        the same options)."""
        from localllm.tui.chat_screen import ChatScreen

        chat = ChatScreen(model, conversation_id)
        if isinstance(self.screen, ChatScreen):
            self.switch_screen(chat)
        else:
            self.push_screen(chat)

    def back_to_models(self) -> None:
        """Models from a chat: back to it when it is the screen below, else in the chat's place."""
        from localllm.tui.models_screen import ModelsScreen

        if isinstance(self.screen_stack[-2] if len(self.screen_stack) > 1 else None, ModelsScreen):
            self.pop_screen()
        else:
            self.switch_screen(ModelsScreen())

    def tools(self) -> Any:
        """(Worker thread.) The tools of the MCP servers in `mcp.json` beside the store (the
        settings' `mcp_config` names another file), started once: None without such a file. A
        server that does not start is one note; the others' tools are offered."""
        with self._tools_lock:
            if not self._tools_tried:
                self._tools_tried = True
                path = Path(self.settings.get("mcp_config") or self.store.home / "mcp.json")
                if path.is_file():
                    from localllm.mcp_tools import Permissions, Toolbox

                    try:
                        self._toolbox = Toolbox.from_file(path)
                    except LocalLLMError as e:
                        self.call_from_thread(self.fail, str(e))
                        return None
                    self.tool_permissions = Permissions()
                    for line in self._toolbox.errors:
                        self.call_from_thread(self.say_once, f"mcp:{line}", line)
            return self._toolbox

    def on_unmount(self) -> None:
        if self._toolbox is not None:
            with contextlib.suppress(Exception):
                self._toolbox.close()
        if self.server is not None:
            with contextlib.suppress(Exception):
                self.server.stop()
        self.pool.close()
        if self._conversations is not None:
            self._conversations.close()

    def remember(self, key: str, value: Any) -> None:
        """Save one app setting; a failure (disk full, read-only) is a notification."""
        try:
            self.settings.set(key, value)
        except LocalLLMError as e:
            self.fail(str(e))

    def say_once(self, key: str, message: str) -> None:
        """A note the user needs once per session (a model's template, ignored saved options)."""
        if key not in self._said:
            self._said.add(key)
            self.notify(message, severity="warning", timeout=10)

    def get_system_commands(self, screen: Any) -> Any:
        """The command palette (Ctrl+P): Textual's own entries, then ours."""
        from textual.app import SystemCommand

        yield from super().get_system_commands(screen)
        yield SystemCommand("Models", "The local models", self.action_show_models)
        yield SystemCommand("Conversations", "Saved chats: search, open, export",
                            self.action_show_conversations)  # fmt: skip
        yield SystemCommand("Pull a model", "Download from Hugging Face", self.action_pull)
        yield SystemCommand("Scan for models", "Hugging Face cache, Ollama, LM Studio",
                            self.action_scan)  # fmt: skip
        yield SystemCommand("Server", "The local OpenAI/Ollama server: start, stop, requests",
                            self.action_show_server)  # fmt: skip
        yield SystemCommand("Help", "Every key", self.action_help)

    def _models_screen(self) -> Any:
        from localllm.tui.models_screen import ModelsScreen

        while not isinstance(self.screen, ModelsScreen) and len(self.screen_stack) > 2:
            self.pop_screen()  # Models is the bottom screen of the stack (pushed on mount)
        return self.screen

    def action_show_models(self) -> None:
        self._models_screen()

    def action_show_conversations(self) -> None:
        from localllm.tui.conversations_screen import ConversationsScreen

        self.push_screen(ConversationsScreen())

    def action_show_server(self) -> None:
        from importlib.util import find_spec

        from localllm.tui.server_screen import ServerScreen

        if find_spec("fastapi") is None or find_spec("uvicorn") is None:
            self.fail("the server needs fastapi and uvicorn: pip install 'localllm[server]'")
            return
        if not isinstance(self.screen, ServerScreen):
            self.push_screen(ServerScreen())

    def action_pull(self) -> None:
        self._models_screen().action_pull()

    def action_scan(self) -> None:
        self._models_screen().action_scan()

    def action_toggle_theme(self) -> None:
        self.theme = "textual-light" if self.theme == "textual-dark" else "textual-dark"
        self.remember("theme", self.theme)

    def action_help(self) -> None:
        from localllm.tui.help_screen import HelpScreen

        self.push_screen(HelpScreen())

    def fail(self, message: str) -> None:
        """One line for the user, never a traceback."""
        self.notify(message, severity="error", timeout=8)


def run(chat_model: str | None = None, *, chat: bool = False) -> None:
    """`localllm` (chat=False: Models, or Chat with the default model) or `localllm chat [MODEL]`."""
    app = LocalLLMApp(chat_model=chat_model)
    if chat and chat_model is None:
        app.chat_model = app.settings.get("default_model") or "smollm2"
    app.run()
