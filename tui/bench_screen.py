"""Bench from the Models screen (`b`): a quick `localllm bench` of the selected model (1 and 2
clients) with its latency percentiles, throughput and % of the machine's decode ceiling, and
`localllm recommend`'s table over every local model. Both run on a worker thread; Escape stops
them after the request in flight, then closes.

The same functions as the commands (`localllm.bench.run_bench`, `localllm.recommend.recommend`)."""

from __future__ import annotations

import threading
from typing import Any

from textual import work
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical
from textual.screen import ModalScreen
from textual.widgets import Button, DataTable, Label, ProgressBar

from localllm.errors import LocalLLMError

QUICK = {"prompt_tokens": 64, "gen_tokens": 32, "concurrency": (1, 2), "requests": 4}
QUICK_RECOMMEND = {"prompt_tokens": 64, "gen_tokens": 16, "quality_chars": 1000}


def bench_rows(report: dict[str, Any]) -> list[tuple[str, ...]]:
    """One row per concurrency level: the numbers the table shows."""
    rows = []
    for lv in report["levels"]:
        ms = lambda d: f"{1000 * d['p50']:.0f} / {1000 * d['p95']:.0f}"  # noqa: E731
        ceiling = (f"{100 * lv['ceiling_fraction']:.0f}% of {lv['ceiling_tokens_per_s']:.0f}"
                   if lv.get("ceiling_fraction") is not None else "-")  # fmt: skip
        rows.append((str(lv["concurrency"]), ms(lv["ttft_s"]), ms(lv["tpot_s"]), f"{lv['output_tokens_per_s']:.1f}",
                     f"{lv['decode_tokens_per_s']:.1f}", ceiling))  # fmt: skip
    return rows


def recommend_rows(report: dict[str, Any]) -> list[tuple[str, ...]]:
    from localllm.model_info import human_bytes

    out = []
    f = lambda v, fmt: "-" if v is None else format(v, fmt)  # noqa: E731
    for i, r in enumerate(report["rows"], 1):
        setting = f"{r['backend']}, KV {r['kv_cache']}" + (f", {r['speculative']}" if r["speculative"] != "off" else "")
        out.append((f"{i}." if r["meets"] else "✗", r["model"], setting, human_bytes(r["memory_bytes"]),
                    f(r.get("tokens_per_s"), ".1f"), f(r.get("bits_per_char"), ".3f"), f(r.get("kl_mean"), ".4f"),
                    "; ".join(r["misses"])))  # fmt: skip
    return out


class BenchScreen(ModalScreen[Any]):
    DEFAULT_CSS = """
    BenchScreen #results { height: auto; max-height: 16; }
    BenchScreen #buttons { height: auto; }
    """
    BINDINGS = [Binding("escape", "cancel", "Stop / close")]

    def __init__(self, model: str) -> None:
        super().__init__()
        self.model = model
        self.cancel_event = threading.Event()
        self.running = False
        self.report: dict[str, Any] | None = None
        self.recommendation: dict[str, Any] | None = None

    def compose(self) -> ComposeResult:
        q = QUICK
        with Vertical(id="dialog"):
            yield Label(f"Bench {self.model}: {q['prompt_tokens']} prompt + {q['gen_tokens']} generated tokens, "
                        f"{', '.join(map(str, q['concurrency']))} clients; or compare every local model",
                        id="title")  # fmt: skip
            with Horizontal(id="buttons"):
                yield Button("Bench", id="bench", variant="primary")
                yield Button("Recommend", id="recommend")
            yield ProgressBar(id="bar", show_eta=False)
            yield Label("", id="detail")
            yield DataTable(id="results", cursor_type="row", zebra_stripes=True)

    def on_mount(self) -> None:
        self.query_one(ProgressBar).display = False
        self.query_one(DataTable).display = False

    def on_button_pressed(self, event: Button.Pressed) -> None:
        if event.button.id == "bench":
            self.start_bench()
        elif event.button.id == "recommend":
            self.start_recommend()

    def _begin(self, what: str) -> bool:
        if self.running:
            return False
        self.running = True
        self.cancel_event.clear()
        bar = self.query_one(ProgressBar)
        bar.display = True
        bar.update(total=None, progress=0)
        self.query_one("#detail", Label).update(what)
        return True

    def start_bench(self) -> None:
        if self._begin(f"benchmarking {self.model}… (loading)"):
            self._bench()

    def start_recommend(self) -> None:
        if self._begin("measuring every local model and setting (kept numbers are reused)…"):
            self._recommend()

    @work(thread=True, exclusive=True, group="bench")
    def _bench(self) -> None:
        from localllm.bench import run_bench
        from localllm.types import LoadOptions

        def progress(label: str, done: int, total: int) -> None:
            self.app.call_from_thread(self._progress, f"{label}: {done}/{total} requests", done, total)

        kv = self.app.settings.get("kv_cache")  # type: ignore[attr-defined] - the Models screen's KV type
        try:
            report = run_bench(self.model, options=LoadOptions(kv_cache=kv if isinstance(kv, str) else "f16"),
                               progress=progress, cancel=self.cancel_event, **QUICK)  # fmt: skip
        except LocalLLMError as e:
            self.app.call_from_thread(self._failed, str(e))
            return
        self.app.call_from_thread(self._bench_done, report)

    @work(thread=True, exclusive=True, group="bench")
    def _recommend(self) -> None:
        from localllm.recommend import Targets, recommend

        def progress(line: str) -> None:
            self.app.call_from_thread(self.query_one("#detail", Label).update, line)

        try:
            report = recommend(Targets(), progress=progress, cancel=self.cancel_event, **QUICK_RECOMMEND)
        except LocalLLMError as e:
            self.app.call_from_thread(self._failed, str(e))
            return
        self.app.call_from_thread(self._recommend_done, report)

    def _progress(self, text: str, done: int, total: int) -> None:
        self.query_one(ProgressBar).update(total=total, progress=done)
        self.query_one("#detail", Label).update(text)

    def _table(self, columns: tuple[str, ...], rows: list[tuple[str, ...]]) -> None:
        table = self.query_one(DataTable)
        table.clear(columns=True)
        table.add_columns(*columns)
        table.add_rows(rows)
        table.display = True

    def _failed(self, message: str) -> None:
        self.running = False
        self.query_one(ProgressBar).display = False
        self.query_one("#detail", Label).update(message)
        self.app.fail(message)  # type: ignore[attr-defined]

    def _bench_done(self, report: dict[str, Any]) -> None:
        self.running = False
        self.report = report
        self.query_one(ProgressBar).display = False
        bw = report.get("memory_bandwidth_bytes_per_s")
        self.query_one("#detail", Label).update(
            f"{report['backend']} on {report['device']}"
            + (f"; memory bandwidth {bw / 1e9:.1f} GB/s" if bw else "") + " — Escape closes")  # fmt: skip
        self._table(("clients", "TTFT ms p50/95", "TPOT ms p50/95", "out tok/s", "decode tok/s", "% of ceiling"),
                    bench_rows(report))  # fmt: skip

    def _recommend_done(self, report: dict[str, Any]) -> None:
        self.running = False
        self.recommendation = report
        self.query_one(ProgressBar).display = False
        met = [r for r in report["rows"] if r["meets"]]
        best = (f"best: {met[0]['model']} ({met[0]['backend']}, KV {met[0]['kv_cache']}"
                + (f", {met[0]['speculative']}" if met[0]["speculative"] != "off" else "") + ")") if met else ""
        self.query_one("#detail", Label).update(f"{best} — Escape closes")
        self._table(("", "model", "setting", "memory", "tok/s", "bits/char", "KL vs best", "misses"),
                    recommend_rows(report))  # fmt: skip

    def action_cancel(self) -> None:
        if self.running:
            self.cancel_event.set()  # stops before the next request
            self.query_one("#detail", Label).update("stopping after the request in flight…")
        else:
            self.dismiss(self.report or self.recommendation)
