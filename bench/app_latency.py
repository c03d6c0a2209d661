"""The terminal app against its targets, on the real binary and the real default model, in one run.

    .venv/bin/python bench/app_latency.py [--runs 10] [--keys 50] [--tmux-keys 30] [--rounds 9]
                                          [--gen 256] [--quick]

1. First paint (target: median ≤ 1.0 s): `localllm` started in tmux (100x30, a temp LOCALLLM_HOME
   with smollm2 registered) until `tmux capture-pane` (polled every 10 ms) shows the Models row
   "smollm2:135m-instruct-q4_1"; in the same loop, side by side, `localllm --version` (the floor:
   Python start-up and the CLI import).
2. Keypress → render while the model generates at full speed (target: p95 ≤ 50 ms). (a) In
   process, headless (`App.run_test`, 100x30), the real model streaming an unbounded answer: each
   key event is posted the way the pilot posts it and timed to the first screen update
   (`App._display`) that shows the prompt box holding the new character; keys 50–100 ms apart. Not
   `pilot.press` + `pilot.pause`: both wait for the *process* CPU to go idle (up to 1 s each),
   which never happens while the model decodes — a few such samples are kept to show it. (b) The
   real binary in tmux: `send-keys` → `capture-pane` shows the character (real terminal output;
   includes the polling cost, reported as `capture_pane_ms`).
3. Tokens/s (target: app ≥ 0.95 × run): greedy, --gen tokens of one chat prompt; rounds alternate
   (a) `localllm run --stats` as a subprocess, (b) the app in process (sampling set through the
   chat screen's settings when it has them, else injected by wrapping the loader; tokens/s from
   the engine Result the wrapper records), (c) the engine in process (`load().submit`). Every
   column loads the model afresh each round, one model at a time. The machine may be shared:
   each sample records the cores other processes used meanwhile (`others_cores`). Nine rounds by
   default: with three, one round's ratio ranged 0.71-1.09 on the AMD EPYC and the medians moved
   by ±5% from run to run.

Writes bench/results/app_latency.json (all samples, medians, targets, pass/fail). `--quick`
(bench/results/quick/app_latency.json): QUICK's counts — one paint, 5 keys in each part, one
round of 16 tokens; each part still starts the app or loads the model (about 10 in all).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import re
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

from common import save

EXE = Path(sys.executable).with_name("localllm")
ROW = "smollm2:135m-instruct-q4_1"
LONG_PROMPT = "Write a very long story about the sea."
SIZE = (100, 30)
SOCK = f"localllm-bench-{os.getpid()}"  # a tmux server of our own: no one else's sessions
QUICK = {"runs": 1, "keys": 5, "tmux_keys": 5, "pilot_samples": 1, "rounds": 1, "gen": 16}  # --quick


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, max(0, round(q * (len(xs) - 1))))]


def summary(xs: list[float]) -> dict[str, float]:
    if not xs:
        return {"n": 0}
    return {"n": len(xs), "median": statistics.median(xs), "p95": pct(xs, 0.95), "max": max(xs),
            "min": min(xs)}  # fmt: skip


class Cpu:
    """CPU seconds used by the whole machine and by this process (+ reaped children) since start.

    The bench machine is shared: `others_cores` (busy cores not ours) flags disturbed samples. In
    the tmux parts the app runs under the tmux server, not as our child, so it counts as others.
    """

    def __init__(self) -> None:
        self.t0, self.busy0, self.ours0 = self._now()

    @staticmethod
    def _now() -> tuple[float, float, float]:
        with open("/proc/stat") as f:
            v = [int(x) for x in f.readline().split()[1:9]]
        t = os.times()
        busy = (sum(v) - v[3] - v[4]) / os.sysconf("SC_CLK_TCK")
        return time.perf_counter(), busy, t.user + t.system + t.children_user + t.children_system

    def read(self) -> dict[str, float]:
        t, busy, ours = self._now()
        wall = t - self.t0
        return {"busy_cores": (busy - self.busy0) / wall, "our_cores": (ours - self.ours0) / wall,
                "others_cores": max(0.0, (busy - self.busy0 - (ours - self.ours0)) / wall)}  # fmt: skip


def tmux(*args: str, check: bool = False) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["tmux", "-L", SOCK, *args], capture_output=True, text=True, check=check)


def capture(session: str) -> str:
    return tmux("capture-pane", "-p", "-t", session).stdout


def start(session: str, home: Path, *args: str) -> None:
    tmux("new-session", "-d", "-s", session, "-x", str(SIZE[0]), "-y", str(SIZE[1]),
         "-e", f"LOCALLLM_HOME={home}", "-e", "TERM=xterm-256color", str(EXE), *args,
         check=True)  # fmt: skip


def wait_screen(session: str, text: str, timeout: float = 60) -> str:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        shot = capture(session)
        if text in shot:
            return shot
        time.sleep(0.02)
    raise RuntimeError(f"never saw {text!r} in tmux:\n{capture(session)}")


def quit_session(session: str) -> None:
    tmux("send-keys", "-t", session, "C-q")
    end = time.monotonic() + 10
    while time.monotonic() < end and tmux("has-session", "-t", session).returncode == 0:
        time.sleep(0.05)
    tmux("kill-session", "-t", session)


# -- 1. first paint ----------------------------------------------------------------------------


def first_paint(home: Path, runs: int) -> dict[str, Any]:
    env = os.environ | {"LOCALLLM_HOME": str(home)}

    def paint(i: int) -> float:
        session = f"paint{i}"
        t0 = time.perf_counter()
        start(session, home)
        while True:
            if ROW in capture(session):
                dt = time.perf_counter() - t0
                break
            if time.perf_counter() - t0 > 30:
                raise RuntimeError(f"no Models row after 30 s:\n{capture(session)}")
            time.sleep(0.01)
        quit_session(session)
        return dt

    def version() -> float:
        t0 = time.perf_counter()
        subprocess.run([str(EXE), "--version"], env=env, check=True, capture_output=True)
        return time.perf_counter() - t0

    paint(-1), version()  # warm up: byte-code caches, page cache
    cpu = Cpu()
    samples: dict[str, list[float]] = {"first_paint_s": [], "version_s": []}
    for i in range(runs):
        samples["first_paint_s"].append(paint(i))
        samples["version_s"].append(version())
    t0 = time.perf_counter()
    for _ in range(20):
        capture("hold")
    poll_ms = (time.perf_counter() - t0) / 20 * 1000
    return {"samples": samples, "first_paint": summary(samples["first_paint_s"]),
            "version": summary(samples["version_s"]), "capture_pane_ms_idle": poll_ms,
            "cpu": cpu.read()}  # fmt: skip


# -- the app, in process ------------------------------------------------------------------------


class Recorder:
    """Wraps the loaded model: records each stream (its Result) and, if told to, sets sampling."""

    def __init__(self, model: Any, inject: dict[str, Any] | None) -> None:
        self.model, self.inject = model, inject
        self.streams: list[Any] = []
        self.requests: list[Any] = []
        self.injected = 0

    def submit(self, request: Any) -> Any:
        from localllm.types import SamplingParams

        if self.inject is not None:
            want = SamplingParams.from_kwargs(**self.inject)
            if request.sampling != want:
                request = replace(request, sampling=want)
                self.injected += 1
        self.requests.append(request)
        stream = self.model.submit(request)
        self.streams.append(stream)
        return stream

    def __getattr__(self, name: str) -> Any:
        return getattr(self.model, name)


async def until(cond: Any, timeout: float, what: str) -> None:
    end = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > end:
            raise RuntimeError(f"timed out waiting for {what}")
        await asyncio.sleep(0.02)


async def send(app: Any, pilot: Any, text: str) -> None:
    from localllm.tui.chat_screen import PromptArea

    app.screen.query_one(PromptArea).text = text
    await pilot.press("enter")


async def keys_in_process(keys: int, pilot_samples: int) -> dict[str, Any]:
    from textual import events

    from localllm.engine import load
    from localllm.tui.app import LocalLLMApp

    rec: list[Recorder] = []

    def loader(name: str, options: Any = None, **o: Any) -> Recorder:  # the pool's (name, options)
        rec.append(Recorder(load(name, options, **o), inject=None))  # pass-through: default sampling
        return rec[-1]

    app = LocalLLMApp(chat_model="smollm2", loader=loader)
    out: dict[str, Any] = {"samples_ms": [], "answer_chars_at_key": [], "restarts": 0}
    async with app.run_test(size=SIZE) as pilot:
        screen = app.screen
        from localllm.tui.chat_screen import PromptArea

        inp = screen.query_one(PromptArea)
        await send(app, pilot, "Say hi.")  # loads the model
        await until(lambda: not screen.generating, 120, "the warm-up answer")

        want: dict[str, Any] = {"value": None, "t": None}
        done = asyncio.Event()
        original = app._display

        def display(scr: Any, renderable: Any) -> None:
            original(scr, renderable)
            if renderable is not None and want["t"] is None and inp.text == want["value"]:
                want["t"] = time.perf_counter()
                done.set()

        app._display = display  # type: ignore[method-assign]

        async def long_answer() -> None:
            await send(app, pilot, LONG_PROMPT)
            await until(lambda: len(screen.answer) > 0, 60, "the answer to start")

        await long_answer()
        cpu = Cpu()
        for i in range(keys):
            if not screen.generating:  # the model stopped on its own: ask again
                out["restarts"] += 1
                await long_answer()
            ch = "abcdefghij"[i % 10]
            want["value"], want["t"] = inp.text + ch, None
            done.clear()
            t0 = time.perf_counter()
            key = events.Key(ch, ch)
            key.set_sender(app)
            app._driver.send_message(key)  # what pilot.press posts, without its idle waits
            await asyncio.wait_for(done.wait(), 10)
            if screen.generating:  # only count keys that landed while the model was generating
                out["samples_ms"].append((want["t"] - t0) * 1000)
                out["answer_chars_at_key"].append(len(screen.answer))
            await asyncio.sleep(random.uniform(0.05, 0.1))
        want["value"] = None
        out["cpu"] = cpu.read()
        pilot_ms = []
        for _ in range(pilot_samples):  # the naive pilot measure, to show why it is not used
            if not screen.generating:
                break
            before = inp.text
            t0 = time.perf_counter()
            await pilot.press("z")
            await pilot.pause()
            assert inp.text == before + "z"
            pilot_ms.append((time.perf_counter() - t0) * 1000)
        out["pilot_press_pause_ms"] = pilot_ms
        was_generating = screen.generating
        await pilot.press("escape")
        await until(lambda: not screen.generating, 30, "the answer to stop")
        out["still_generating_at_the_end"] = was_generating
        status = str(screen.query_one("#status").render())
        m = re.search(r"([\d.]+) tokens/s", status)
        out["status_line"] = status
        out["status_tokens_per_s"] = float(m.group(1)) if m else None
        results = [s.result for s in rec[0].streams[1:] if s.result is not None]
        out["answers"] = [{"completion_tokens": r.usage.completion_tokens, "finish": r.finish_reason,
                           "tokens_per_s": r.timings.tokens_per_s(r.usage.completion_tokens)}
                          for r in results]  # fmt: skip
    out["summary"] = summary(out["samples_ms"])
    return out


# -- 2b. keypress → render in the real binary ---------------------------------------------------


def keys_tmux(home: Path, keys: int) -> dict[str, Any]:
    session = "keys"
    start(session, home, "chat", "smollm2")
    out: dict[str, Any] = {"samples_ms": [], "capture_pane_ms": []}
    try:
        shot = wait_screen(session, "Message (Enter to send")
        row = next(
            i for i, line in enumerate(shot.splitlines()) if "Message (Enter to send" in line
        )
        tmux("send-keys", "-t", session, "-l", LONG_PROMPT)
        tmux("send-keys", "-t", session, "Enter")
        wait_screen(session, "ready in", 120)  # first answer: the status says so until it ends
        time.sleep(0.5)
        cpu = Cpu()
        for n in range(1, keys + 1):
            want = "q" * n
            t0 = time.perf_counter()
            tmux("send-keys", "-t", session, "-l", "q")
            while True:
                c0 = time.perf_counter()
                shot = capture(session)
                out["capture_pane_ms"].append((time.perf_counter() - c0) * 1000)
                lines = shot.splitlines()
                if len(lines) > row and want in lines[row]:
                    dt = time.perf_counter() - t0
                    break
                if time.perf_counter() - t0 > 10:
                    raise RuntimeError(f"key {n} never showed:\n{shot}")
                time.sleep(0.002)
            if "tokens/s" in shot:  # the answer ended: later keys would not be under load
                out["answer_ended_after_keys"] = n - 1
                break
            out["samples_ms"].append(dt * 1000)
            time.sleep(random.uniform(0.05, 0.1))
        out["cpu"] = cpu.read()
        out["last_screen"] = capture(session)
        tmux("send-keys", "-t", session, "Escape")
    finally:
        quit_session(session)
    out["summary"] = summary(out["samples_ms"])
    out["capture_pane"] = summary(out.pop("capture_pane_ms"))
    return out


# -- 3. tokens/s: run vs app vs engine ----------------------------------------------------------


def throughput(rounds: int, gen: int, home: Path) -> dict[str, Any]:
    """Each round loads afresh in all three columns, and never two models at once in this process:
    with two llama.cpp contexts used from two threads, libgomp throttles its spin-waits (more
    OpenMP threads than cores) and decode drops by about a third — measured while writing this."""
    from localllm.engine import load
    from localllm.tui.app import LocalLLMApp
    from localllm.types import Request, SamplingParams

    sampling = {"temperature": 0, "max_tokens": gen}
    env = os.environ | {"LOCALLLM_HOME": str(home)}
    samples: dict[str, list[float]] = {"run": [], "app": [], "engine": []}
    tokens: dict[str, list[int]] = {"run": [], "app": [], "engine": []}
    others: dict[str, list[float]] = {"run": [], "app": [], "engine": []}
    notes: dict[str, Any] = {"requests_rewritten_by_wrapper": 0}

    def run_cli() -> None:
        cpu = Cpu()
        p = subprocess.run([str(EXE), "run", "smollm2", LONG_PROMPT, "--max-tokens", str(gen),
                            "--temperature", "0", "--stats"], env=env, capture_output=True,
                           text=True, check=True)  # fmt: skip
        m = re.search(r"(\d+) tokens, TPOT [\d.]+ ms, ([\d.]+) tokens/s", p.stderr)
        if not m:
            raise RuntimeError(f"no stats line in: {p.stderr}")
        others["run"].append(cpu.read()["others_cores"])
        tokens["run"].append(int(m.group(1)))
        samples["run"].append(float(m.group(2)))

    def run_engine() -> None:
        with load("smollm2") as engine:
            request = Request(messages=({"role": "user", "content": LONG_PROMPT},),
                              sampling=SamplingParams.from_kwargs(**sampling))  # fmt: skip
            cpu = Cpu()
            r = engine.submit(request).wait()
            others["engine"].append(cpu.read()["others_cores"])
        tokens["engine"].append(r.usage.completion_tokens)
        samples["engine"].append(r.timings.tokens_per_s(r.usage.completion_tokens))

    async def run_app() -> None:
        rec: list[Recorder] = []

        def loader(name: str, options: Any = None, **o: Any) -> Recorder:
            rec.append(Recorder(load(name, options, **o), inject=sampling))
            return rec[-1]

        app = LocalLLMApp(chat_model="smollm2", loader=loader)
        async with app.run_test(size=SIZE) as pilot:
            screen = app.screen
            if isinstance(getattr(screen, "settings", None), dict) and hasattr(screen, "_request"):
                screen.settings.update(sampling)  # what the settings dialog (ctrl+s) sets
                notes["app_sampling_via"] = "chat screen settings (temperature 0, max_tokens)"
            else:
                notes["app_sampling_via"] = "loader wrapper (the chat screen has no settings)"
            cpu = Cpu()
            await send(app, pilot, LONG_PROMPT)
            await until(lambda: rec and rec[0].streams and not screen.generating, 120,
                        "the app's answer")  # fmt: skip
            others["app"].append(cpu.read()["others_cores"])
            notes["app_status_line"] = str(screen.query_one("#status").render())
        r = rec[0].streams[-1].result
        notes["requests_rewritten_by_wrapper"] += rec[0].injected
        if not rec[0].model._closed:  # the chat screen closes its model on unmount
            notes["app_left_model_open"] = True
            rec[0].model.close()
        tokens["app"].append(r.usage.completion_tokens)
        samples["app"].append(r.timings.tokens_per_s(r.usage.completion_tokens))

    run_cli(), asyncio.run(run_app()), run_engine()  # warm up
    for d in (samples, tokens, others):
        for v in d.values():
            v.clear()
    for _ in range(rounds):
        run_cli()
        asyncio.run(run_app())
        run_engine()
    med = {k: statistics.median(v) for k, v in samples.items()}
    quiet = {k: [x for x, o in zip(v, others[k]) if o < 0.25] for k, v in samples.items()}
    paired = {
        "app_over_run": [a / r for a, r in zip(samples["app"], samples["run"])],
        "app_over_engine": [a / e for a, e in zip(samples["app"], samples["engine"])],
    }
    return {"samples_tokens_per_s": samples, "completion_tokens": tokens, "median": med,
            "others_cores": others, "per_round_ratios": paired,
            "per_round_ratio_median": {k: statistics.median(v) for k, v in paired.items()},
            "median_quiet_samples": {k: statistics.median(v) if v else None
                                     for k, v in quiet.items()},
            "quiet_means": "samples with others_cores < 0.25 (the machine is shared)",
            "app_over_run": med["app"] / med["run"], "app_over_engine": med["app"] / med["engine"],
            **notes}  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=10)
    ap.add_argument("--keys", type=int, default=50)
    ap.add_argument("--tmux-keys", type=int, default=30)
    ap.add_argument("--pilot-samples", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--gen", type=int, default=256)
    ap.add_argument("--quick", action="store_true", help="a smoke run: QUICK's counts")
    args = ap.parse_args()
    if args.quick:
        vars(args).update(QUICK)
    home = Path(tempfile.mkdtemp(prefix="localllm-bench-"))
    os.environ["LOCALLLM_HOME"] = str(home)
    from localllm.backends.llamacpp import default_threads
    from localllm.models_registry.catalog import ensure_local
    from localllm.models_registry.store import Store

    ensure_local("smollm2", Store(home))
    tmux("new-session", "-d", "-s", "hold", "-x", "100", "-y", "30", "sleep 100000", check=True)
    t_start = time.perf_counter()
    try:
        paint = first_paint(home, args.runs)
        print(f"first paint  median {paint['first_paint']['median']:.3f} s  max "
              f"{paint['first_paint']['max']:.3f} s   (--version {paint['version']['median']:.3f} s)",
              flush=True)  # fmt: skip
        keys = asyncio.run(keys_in_process(args.keys, args.pilot_samples))
        print(f"keys in process  p50 {keys['summary']['median']:.1f}  p95 {keys['summary']['p95']:.1f}"
              f"  max {keys['summary']['max']:.1f} ms", flush=True)  # fmt: skip
        keys_t = keys_tmux(home, args.tmux_keys)
        print(f"keys in tmux  p50 {keys_t['summary']['median']:.1f}  p95 "
              f"{keys_t['summary']['p95']:.1f}  max {keys_t['summary']['max']:.1f} ms", flush=True)  # fmt: skip
        tput = throughput(args.rounds, args.gen, home)
    finally:
        tmux("kill-server")
    med = tput["median"]
    print(f"tokens/s  run {med['run']:.1f}  app {med['app']:.1f}  engine {med['engine']:.1f}  "
          f"app/run {tput['app_over_run']:.3f}  app/engine {tput['app_over_engine']:.3f}")  # fmt: skip
    targets = {
        "first_paint_median_s": {"target": 1.0, "value": paint["first_paint"]["median"],
                                 "pass": paint["first_paint"]["median"] <= 1.0},
        "keypress_render_p95_ms_in_process": {"target": 50, "value": keys["summary"]["p95"],
                                              "pass": keys["summary"]["p95"] <= 50},
        "keypress_render_p95_ms_tmux": {"target": 50, "value": keys_t["summary"]["p95"],
                                        "pass": keys_t["summary"]["p95"] <= 50},
        "app_tokens_per_s_over_run": {"target": 0.95, "value": tput["app_over_run"],
                                      "pass": tput["app_over_run"] >= 0.95},
    }  # fmt: skip
    out = {"machine": platform.processor() or platform.machine(), "cpus": os.cpu_count(),
           "threads": default_threads(), "model": ROW, "prompt": LONG_PROMPT,
           "loadavg_at_end": os.getloadavg(), "args": vars(args), "wall_s": time.perf_counter() - t_start, "targets": targets,
           "first_paint": paint, "keypress_in_process": keys, "keypress_tmux": keys_t,
           "tokens_per_s": tput}  # fmt: skip
    save("app_latency", out, quick=args.quick)
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
