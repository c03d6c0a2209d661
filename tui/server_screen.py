"""Server: start and stop the OpenAI/Ollama server inside the app, its URL and key, live numbers
and the requests it answered.

The server shares the app's model pool: a model a chat has loaded serves requests without a second
load. It keeps running while you use other screens, and stops when the app quits. Starting and
stopping run in a worker thread (loading, binding); the screen reads the server's numbers once a
second.
"""

from __future__ import annotations

import secrets
import time
from typing import Any

from textual import work
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal
from textual.screen import Screen
from textual.widgets import DataTable, Footer, Header, Input, Label, Static

from localllm.errors import LocalLLMError

HINT = "Ctrl+S starts or stops · Ctrl+Y copies the URL and key · Ctrl+G makes a new key · Esc back"


def _num(n: float) -> str:
    return f"{int(n):,}"


class ServerScreen(Screen):
    DEFAULT_CSS = """
    ServerScreen #fields { height: auto; padding: 0 1; }
    ServerScreen #fields Label { padding: 1 1 0 0; }
    ServerScreen #host { width: 18; }
    ServerScreen #port { width: 10; }
    ServerScreen #key { width: 1fr; }
    ServerScreen #state { padding: 0 1; height: auto; }
    ServerScreen #numbers { padding: 0 1; height: auto; color: $text-muted; }
    """
    BINDINGS = [
        Binding("ctrl+s", "toggle", "Start/stop", priority=True),
        Binding("ctrl+y", "copy", "Copy URL", priority=True),
        Binding("ctrl+g", "new_key", "New key", priority=True),
        Binding("escape", "back", "Back"),
    ]

    def compose(self) -> ComposeResult:
        settings = self.app.settings
        yield Header()
        with Horizontal(id="fields"):
            yield Label("Host")
            yield Input(settings.get("server_host", "127.0.0.1"), id="host")
            yield Label("Port")
            yield Input(str(settings.get("server_port", 11435)), id="port", type="integer")
            yield Label("Key")
            yield Input(settings.get("server_key", ""), id="key", placeholder="none (loopback only)")
        yield Static("", id="state")
        yield Static("", id="numbers")
        yield DataTable(id="requests", cursor_type="row", zebra_stripes=True)
        yield Footer()

    def on_mount(self) -> None:
        self.sub_title = "Server"
        table = self.query_one(DataTable)
        table.add_columns("Time", "Route", "Model", "Prompt", "Cached", "Out", "TTFT", "Tok/s", "Finish")
        self._seen = 0.0
        self._busy = False
        self.refresh_numbers()
        self.set_interval(1.0, self.refresh_numbers)

    @property
    def server(self) -> Any:
        return getattr(self.app, "server", None)

    def refresh_numbers(self) -> None:
        state = self.query_one("#state", Static)
        numbers = self.query_one("#numbers", Static)
        bg = self.server
        if bg is None or not bg.running:
            state.update("Stopped. " + HINT)
            numbers.update("")
            return
        key = bg.config.api_key
        state.update(f"Running at [b]{bg.url}[/b] (OpenAI: {bg.url}/v1) · key: "
                     f"{key if key else 'none'} · {HINT}")  # fmt: skip
        srv = bg.app.state.server
        m = srv.metrics.summary()
        acc = f"{m['acceptance']:.0%}" if m["acceptance"] else "-"
        numbers.update(
            f"requests {_num(m['requests'])} (refused {_num(m['refused'])}) · tokens in {_num(m['prompt_tokens'])} "
            f"out {_num(m['completion_tokens'])} · prefix-cache hits {_num(m['cached_tokens'])} · "
            f"TTFT {m['ttft_s'] * 1000:.0f} ms · TPOT {m['tpot_s'] * 1000:.1f} ms · running {_num(m['running'])} · "
            f"queued {_num(m['queued'])} · KV {m['kv_bytes'] / 2**20:.1f} MiB · acceptance {acc}"
        )
        table = self.query_one(DataTable)
        for e in [e for e in list(srv.log) if e["time"] > self._seen]:
            self._seen = e["time"]
            table.add_row(time.strftime("%H:%M:%S", time.localtime(e["time"])), e["route"], e["model"],
                          _num(e["prompt_tokens"]), _num(e["cached_tokens"]), _num(e["completion_tokens"]),
                          f"{e['ttft_s'] * 1000:.0f} ms", f"{e['tokens_per_s']:.1f}", e["finish_reason"])  # fmt: skip
            table.move_cursor(row=table.row_count - 1)

    def action_toggle(self) -> None:
        if self._busy:
            return
        bg = self.server
        if bg is not None and bg.running:
            self._busy = True
            self.query_one("#state", Static).update("Stopping…")
            self._stop(bg)
            return
        host = self.query_one("#host", Input).value.strip() or "127.0.0.1"
        try:
            port = int(self.query_one("#port", Input).value or 11435)
        except ValueError:
            self.app.fail("the port must be a number")
            return
        key = self.query_one("#key", Input).value.strip() or None
        from localllm.server.config import ServerConfig
        from localllm.types import LoadOptions

        try:
            config = ServerConfig(host=host, port=port, api_key=key, options=LoadOptions())
        except LocalLLMError as e:
            self.app.fail(str(e))
            return
        self.app.remember("server_host", host)
        self.app.remember("server_port", port)
        self.app.remember("server_key", key or "")
        self._busy = True
        self.query_one("#state", Static).update("Starting…")
        self._start(config)

    @work(thread=True, exclusive=True, group="server")
    def _start(self, config: Any) -> None:
        from localllm.server.runner import BackgroundServer
        from localllm.server.served import Served

        default = self.app.settings.get("default_model")
        served = Served(config, self.app.pool, self.app.store, default=default)
        try:
            bg = BackgroundServer(config, served, record=True).start()
        except LocalLLMError as e:
            self.app.call_from_thread(self.app.fail, str(e))
        else:
            self.app.server = bg
        finally:
            self._busy = False
            self.app.call_from_thread(self.refresh_numbers)

    @work(thread=True, exclusive=True, group="server")
    def _stop(self, bg: Any) -> None:
        try:
            bg.stop()
        finally:
            self.app.server = None
            self._busy = False
            self.app.call_from_thread(self.refresh_numbers)

    def action_copy(self) -> None:
        bg = self.server
        if bg is None or not bg.running:
            self.app.fail("the server is not running")
            return
        key = bg.config.api_key
        self.app.copy_to_clipboard(f"{bg.url}/v1" + (f" {key}" if key else ""))
        self.notify(f"copied {bg.url}/v1" + (" and the key" if key else ""))

    def action_new_key(self) -> None:
        self.query_one("#key", Input).value = "sk-local-" + secrets.token_urlsafe(24)

    def action_back(self) -> None:
        self.app.pop_screen()
