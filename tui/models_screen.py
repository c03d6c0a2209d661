"""Models: the local models with a fits / does-not-fit mark; pull, delete, scan, set default."""

from __future__ import annotations

import threading
from typing import Any

from textual import work
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Vertical
from textual.screen import ModalScreen, Screen
from textual.widgets import Button, DataTable, Footer, Header, Input, Label, ProgressBar

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
    ]

    def compose(self) -> ComposeResult:
        yield Header()
        yield DataTable(id="models", cursor_type="row", zebra_stripes=True)
        yield Footer()

    def on_mount(self) -> None:
        self.sub_title = "Models"
        table = self.query_one(DataTable)
        table.add_columns(*COLUMNS)
        self.action_refresh()

    def action_refresh(self) -> None:
        from localllm.memory import available_memory, estimate
        from localllm.model_info import human_bytes, human_params

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
                    else ("yes" if estimate(i, kv_cache="f16", available=free).fits else "NO")
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

        self.app.push_screen(Confirm(f"Remove {name}?"), done)

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

    def _show(self, e: Any) -> None:
        bar = self.query_one(ProgressBar)
        if e.total:
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
