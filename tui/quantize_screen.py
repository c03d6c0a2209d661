"""Quantize from the Models screen (`q`): a type picker with the size each type gives, an optional
calibration text (an importance matrix from the torch engine), an optional text to measure the
result on, progress per tensor, cancel (Escape), then the quality report.

The same job as `localllm quantize` (`localllm.quant.job.run_quantize`), on a worker thread."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

from textual import work
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Vertical
from textual.screen import ModalScreen
from textual.widgets import Button, Input, Label, OptionList, ProgressBar, Static
from textual.widgets.option_list import Option

from localllm.errors import LocalLLMError

TYPES = ("Q4_K_M", "Q4_K_S", "Q5_K_M", "Q5_K_S", "Q6_K", "Q8_0", "IQ4_XS", "IQ4_NL", "Q3_K_L", "Q3_K_M",
         "Q3_K_S", "IQ3_M", "IQ3_S", "IQ3_XS", "IQ3_XXS", "Q2_K", "Q2_K_S", "IQ2_M", "IQ2_S", "IQ2_XS", "IQ2_XXS",
         "IQ1_M", "IQ1_S", "Q5_1", "Q5_0", "Q4_1", "Q4_0", "BF16", "F16")  # fmt: skip


def type_choices(path: Path) -> list[tuple[str, str]]:
    """(type, label with the weights' size after quantizing) for the picker."""
    from localllm.model_info import human_bytes
    from localllm.quant.mix import IMATRIX_FILE_TYPES
    from localllm.quant.writer import estimate_bytes

    out = []
    for t in TYPES:
        try:
            size = f"weights {human_bytes(estimate_bytes(path, t))}"
        except LocalLLMError as e:
            size = str(e)
        if t in IMATRIX_FILE_TYPES:
            size += " (needs a calibration text)"
        out.append((t, f"{t:<7} {size}"))
    return out


class QuantizeScreen(ModalScreen[Any]):
    DEFAULT_CSS = """
    QuantizeScreen #types { height: auto; max-height: 10; }
    QuantizeScreen #report { padding: 1 0 0 0; }
    """
    BINDINGS = [Binding("escape", "cancel", "Cancel / close")]

    def __init__(self, model: str) -> None:
        super().__init__()
        self.model = model
        self.cancel_event = threading.Event()
        self.running = False
        self.job: Any = None

    def compose(self) -> ComposeResult:
        store = self.app.store  # type: ignore[attr-defined]
        from localllm.models_registry.catalog import ensure_local

        try:
            choices = type_choices(store.path_of(ensure_local(self.model, store)))
            title = f"Quantize {self.model}: pick a type (the size is the weights' after it)"
        except LocalLLMError as e:  # the file went away, or is not a GGUF we can read
            choices, title = [(t, t) for t in TYPES], f"Quantize {self.model}: {e}"
        with Vertical(id="dialog"):
            yield Label(title)
            yield OptionList(*(Option(label, id=t) for t, label in choices), id="types")
            yield Input(placeholder="a text to calibrate on, or an imatrix file (optional)",
                        id="calibrate")  # fmt: skip
            yield Input(placeholder="a text file to measure quality on (optional)", id="eval")
            yield Button("Quantize", id="go", variant="primary")
            yield ProgressBar(id="bar", show_eta=False)
            yield Label("", id="detail")
            yield Static("", id="report")

    def on_mount(self) -> None:
        self.query_one(ProgressBar).display = False

    def on_button_pressed(self, event: Button.Pressed) -> None:
        if event.button.id == "go":
            self.start()

    def start(self) -> None:
        if self.running:
            return
        options = self.query_one("#types", OptionList)
        index = options.highlighted if options.highlighted is not None else 0
        kind = options.get_option_at_index(index).id or TYPES[0]
        text = self.query_one("#eval", Input).value.strip()
        calibrate = self.query_one("#calibrate", Input).value.strip()
        self.running = True
        self.cancel_event.clear()
        self.query_one(ProgressBar).display = True
        self.query_one("#detail", Label).update(f"quantizing to {kind}…")
        self._run(kind, Path(text).expanduser() if text else None,
                  Path(calibrate).expanduser() if calibrate else None)  # fmt: skip

    @work(thread=True, exclusive=True, group="quantize")
    def _run(self, kind: str, text: Path | None, calibrate: Path | None) -> None:
        from localllm.quant.job import run_quantize

        def tensor(e: Any) -> None:
            self.app.call_from_thread(self._show, e)

        def phase(what: str) -> None:
            self.app.call_from_thread(self.query_one("#detail", Label).update, what + "…")

        try:
            job = run_quantize(self.app.store, self.model, kind, eval_text=text,  # type: ignore[attr-defined]
                               calibrate=calibrate, on_tensor=tensor, cancel=self.cancel_event,
                               on_phase=phase)  # fmt: skip
        except LocalLLMError as e:
            self.app.call_from_thread(self._failed, str(e))
            return
        self.app.call_from_thread(self._finished, job)

    def _show(self, e: Any) -> None:
        self.query_one(ProgressBar).update(total=e.total, progress=e.index)
        self.query_one("#detail", Label).update(f"{e.index}/{e.total} {e.name} → {e.type_name}")

    def _failed(self, message: str) -> None:
        self.running = False
        self.query_one("#detail", Label).update(message)
        self.app.fail(message)  # type: ignore[attr-defined]

    def _finished(self, job: Any) -> None:
        from localllm.model_info import human_bytes

        self.running = False
        self.job = job
        r = job.result
        self.query_one("#detail", Label).update(
            f"{job.where}: {human_bytes(r.nbytes)}, {r.bits_per_weight:.2f} bits/weight, "
            f"{r.seconds:.1f} s — Escape closes"
        )
        if job.report is not None:
            from localllm.quant.report import report_table

            lines = [f"{label:<16} {value}" for label, value in report_table(job.report)]
            self.query_one("#report", Static).update("\n".join(lines))
        self.notify(f"quantized {job.where}")

    def action_cancel(self) -> None:
        if self.running:
            self.cancel_event.set()  # the job stops at the next tensor and keeps nothing
        else:
            self.dismiss(self.job)
