"""Models: the local models with a fits / does-not-fit mark; pull, delete, scan, set default."""

from __future__ import annotations

import threading
from typing import Any

from textual import work
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Vertical
from textual.screen import ModalScreen, Screen
from textual.widgets import DataTable, Footer, Header, Input, Label, ProgressBar

from localllm.errors import LocalLLMError

COLUMNS = ("Name", "Arch", "Params", "Quant", "Size", "Context", "Fits", "Source")


class ModelsScreen(Screen):
    BINDINGS = [
        Binding("enter", "chat", "Chat"),
        Binding("p", "pull", "Pull"),
        Binding("d", "delete", "Delete"),
        Binding("s", "scan", "Scan"),
        Binding("f", "set_default", "Default"),
        Binding("r", "refresh", "Refresh"),
        Binding("c", "conversations", "Chats"),
        Binding("i", "import", "Import"),
        Binding("x", "cycle_ctx", "Context"),
        Binding("k", "cycle_kv", "KV type"),
    ]
    CTX_CHOICES = (2048, 4096, 8192, 16384, 32768, 131072)
    KV_CHOICES = ("f16", "q8_0", "q4_0")

    def compose(self) -> ComposeResult:
        yield Header()
        yield DataTable(id="models", cursor_type="row", zebra_stripes=True)
        yield Footer()

    def on_mount(self) -> None:
        table = self.query_one(DataTable)
        table.add_columns(*COLUMNS)
        self.action_refresh()

    def on_screen_resume(self) -> None:
        self.action_refresh()  # a chat may have registered the default model meanwhile

    @property
    def ctx(self) -> int:
        return int(self.app.settings.get("ctx", 4096))

    @property
    def kv(self) -> str:
        return str(self.app.settings.get("kv_cache", "f16"))

    def action_cycle_ctx(self) -> None:
        c = self.CTX_CHOICES
        self.app.settings.set("ctx", c[(c.index(self.ctx) + 1) % len(c)] if self.ctx in c else 4096)
        self.action_refresh()

    def action_cycle_kv(self) -> None:
        k = self.KV_CHOICES
        self.app.settings.set(
            "kv_cache", k[(k.index(self.kv) + 1) % len(k)] if self.kv in k else "f16"
        )
        self.action_refresh()

    def action_refresh(self) -> None:
        from localllm.memory import available_memory, estimate
        from localllm.model_info import human_bytes, human_params

        self.sub_title = f"Models — fits at context {self.ctx:,}, KV {self.kv} (x, k change)"
        table = self.query_one(DataTable)
        table.clear()
        default = self.app.settings.get("default_model")
        try:
            records = self.app.store.list()
        except LocalLLMError as e:
            self.app.fail(str(e))
            return
        try:
            free = available_memory()  # once per refresh, not once per row (it may run nvidia-smi)
        except LocalLLMError:
            free = None
        for r in records:
            i = r.info
            try:
                fits = (
                    "?"
                    if free is None
                    else (
                        "yes"
                        if estimate(i, ctx=self.ctx, kv_cache=self.kv, available=free).fits
                        else "NO"
                    )
                )
            except LocalLLMError:
                fits = "?"
            name = f"* {r.name}" if r.name == default else r.name
            table.add_row(name, i.architecture, human_params(i.parameters), i.quant,
                          human_bytes(r.size), f"{i.context_length:,}", fits, r.source,
                          key=r.name)  # fmt: skip

    def _selected(self) -> str | None:
        table = self.query_one(DataTable)
        if table.row_count == 0:
            return None
        key = table.coordinate_to_cell_key(table.cursor_coordinate).row_key
        return str(key.value)

    def action_chat(self) -> None:
        name = self._selected()
        if name:
            self.app.open_chat(name)

    def on_data_table_row_selected(self, event: DataTable.RowSelected) -> None:
        self.app.open_chat(str(event.row_key.value))

    def action_conversations(self) -> None:
        from localllm.tui.conversations_screen import ConversationsScreen

        self.app.push_screen(ConversationsScreen())

    def action_set_default(self) -> None:
        name = self._selected()
        if name:
            self.app.settings.set("default_model", name)
            self.notify(f"{name} is the default model")
            self.action_refresh()

    def action_delete(self) -> None:
        name = self._selected()
        if not name:
            return

        def done(confirmed: bool | None) -> None:
            if confirmed:
                try:
                    self.app.store.remove(name)
                except LocalLLMError as e:
                    self.app.fail(str(e))
                    return
                self.notify(f"removed {name}")
                self.action_refresh()

        from localllm.tui.dialogs import Confirm

        self.app.push_screen(Confirm(f"Remove {name}?"), done)

    def action_import(self) -> None:
        from localllm.tui.dialogs import Ask

        def done(path: str | None) -> None:
            if path:
                self._import(path)

        self.app.push_screen(Ask("Import a GGUF file (path)"), done)

    @work(thread=True, exclusive=True, group="import")
    def _import(self, text: str) -> None:
        from pathlib import Path

        from localllm.models_registry.names import name_from_file

        src = Path(text).expanduser()
        try:
            record = self.app.store.add_file(
                src, name_from_file(src), source=f"file:{src.resolve()}"
            )
        except LocalLLMError as e:
            self.app.call_from_thread(self.app.fail, str(e))
            return
        self.app.call_from_thread(self.notify, f"imported {record.name}")
        self.app.call_from_thread(self.action_refresh)

    def action_pull(self) -> None:
        self.app.push_screen(PullScreen(), lambda _r: self.action_refresh())

    def action_scan(self) -> None:
        self.notify("scanning the Hugging Face cache, Ollama and LM Studio…")
        self._scan()

    @work(thread=True, exclusive=True, group="scan")
    def _scan(self) -> None:
        from localllm.models_registry.scan import register_found, scan

        try:
            results = register_found(self.app.store, scan())
        except LocalLLMError as e:
            self.app.call_from_thread(self.app.fail, str(e))
            return
        n = sum(r.status == "registered" for r in results)
        self.app.call_from_thread(self.notify, f"{n} model(s) registered by reference")
        self.app.call_from_thread(self.action_refresh)


class PullScreen(ModalScreen[Any]):
    """A name, a progress bar with speed and ETA, and cancel (Escape)."""

    BINDINGS = [Binding("escape", "cancel", "Cancel / close")]

    def __init__(self) -> None:
        super().__init__()
        self.cancel_event = threading.Event()
        self.running = False

    def compose(self) -> ComposeResult:
        with Vertical(id="dialog"):
            yield Label(
                "Pull a model: smollm2[:TAG], hf.co/ORG/REPO[:QUANT], hf.co/ORG/REPO/FILE.gguf"
            )
            yield Input(placeholder="model name", id="name")
            yield ProgressBar(id="bar", show_eta=True)
            yield Label("", id="detail")

    def on_input_submitted(self, event: Input.Submitted) -> None:
        if self.running or not event.value.strip():
            return
        self.running = True
        self.cancel_event.clear()
        self._pull(event.value.strip())

    @work(thread=True, exclusive=True, group="pull")
    def _pull(self, name: str) -> None:
        from localllm.models_registry.pull import pull

        def progress(e: Any) -> None:
            self.app.call_from_thread(self._show, e)

        try:
            record = pull(name, store=self.app.store, on_progress=progress,
                          cancel=self.cancel_event)  # fmt: skip
        except LocalLLMError as e:
            self.app.call_from_thread(self._failed, str(e))
            return
        self.app.call_from_thread(self._finished, record)

    def on_mount(self) -> None:
        self.query_one(ProgressBar).display = False  # until a size is known

    def _show(self, e: Any) -> None:
        bar = self.query_one(ProgressBar)
        if e.total:
            bar.display = True
            bar.update(total=e.total, progress=e.done)
        detail = f"{e.phase} {e.done / 1e6:,.1f} / {e.total / 1e6:,.1f} MB"
        self.query_one("#detail", Label).update(detail + (f" — {e.message}" if e.message else ""))

    def _failed(self, message: str) -> None:
        self.running = False
        self.app.fail(message)
        self.query_one("#detail", Label).update(message)

    def _finished(self, record: Any) -> None:
        self.running = False
        self.notify(f"pulled {record.name}")
        self.dismiss(record)

    def action_cancel(self) -> None:
        if self.running:
            self.cancel_event.set()  # the worker ends with PullCancelled; the partial file stays
        else:
            self.dismiss(None)
