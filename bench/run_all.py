"""Run the benchmark suite and regenerate BENCHMARKS.md (issue 16).

    python bench/run_all.py [--quick] [--only a,b] [--skip a,b] [--timeout S] [--report-only]

Each script runs in its own process, one after another (they measure the same 2 cores: never
side by side with each other), with `--quick` passed on; then `report.py` renders every result.
`--quick` is the smoke run the tests use: results go to bench/results/quick/ and the report
beside them, so a smoke run never replaces a measurement. A script that fails is reported and
the rest still run; the exit code is 1 when any failed."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import BENCH, log, results_dir  # noqa: E402

# in the order they run: fast and independent first; each claim's script
SCRIPTS = [
    "startup", "gguf_parse", "llamacpp_overhead", "engine_batching", "ceiling", "torch_engine",
    "llamacpp_agreement", "torch_gemv", "kv_cache", "speculative", "server", "quantize",
    "pull_throughput", "app_latency", "llamacpp_build", "torch_cuda", "run_shared", "streaming_eval",
    "kv_pool", "torch_compile", "llamacpp_gpu",
]  # fmt: skip


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="smoke-run sizes (the test's mode)")
    ap.add_argument("--only", default="", help="these scripts only (comma-separated names)")
    ap.add_argument("--skip", default="", help="not these")
    ap.add_argument("--timeout", type=float, default=None, help="seconds per script (default: 600 quick, none)")
    ap.add_argument("--report-only", action="store_true", help="render BENCHMARKS.md from what is there")
    ap.add_argument("--out", type=Path, default=None, help="the report (default: BENCHMARKS.md; quick: beside)")
    a = ap.parse_args()
    names = [n for n in (a.only.split(",") if a.only else SCRIPTS) if n and n not in a.skip.split(",")]
    unknown = [n for n in names if not (BENCH / f"{n}.py").is_file()]
    if unknown:
        log(f"unknown bench scripts: {', '.join(unknown)} (known: {', '.join(SCRIPTS)})")
        return 2
    timeout = a.timeout or (600.0 if a.quick else None)
    failed = []
    if not a.report_only:
        for name in names:
            cmd = [sys.executable, str(BENCH / f"{name}.py")] + (["--quick"] if a.quick else [])
            log(f"== {name}: {' '.join(cmd[1:])}")
            t = time.perf_counter()
            try:
                p = subprocess.run(cmd, cwd=BENCH, timeout=timeout, env=os.environ.copy())
                ok = p.returncode == 0
                why = f"exit {p.returncode}"
            except subprocess.TimeoutExpired:
                ok, why = False, f"ran past {timeout:.0f} s"
            log(f"== {name}: {'ok' if ok else 'FAILED (' + why + ')'} in {time.perf_counter() - t:.1f} s")
            if not ok:
                failed.append(f"{name} ({why})")
    from report import render

    results = results_dir(a.quick)
    out = a.out or (results / "BENCHMARKS.md" if a.quick else BENCH.parent / "BENCHMARKS.md")
    render(results, out.resolve(), a.quick)
    log(f"wrote {out}")
    if failed:
        log(f"failed: {', '.join(failed)}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
