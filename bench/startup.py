"""Start-up time of `localllm` commands, side by side with a bare `python -c pass` in one run.

    .venv/bin/python bench/startup.py [--runs 15] [--quick]

Writes bench/results/startup.json (`--quick`: one run of each, bench/results/quick/startup.json).
`--help` and `list` must stay well under a second: they import neither torch, llama_cpp nor textual
(tests/test_cli.py checks the imports; this measures the time).
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time

from common import save


def timed(cmd: list[str], env: dict[str, str], runs: int) -> dict[str, float]:
    samples = []
    for _ in range(runs):
        t0 = time.perf_counter()
        subprocess.run(cmd, env=env, check=True, capture_output=True)
        samples.append(time.perf_counter() - t0)
    return {"median_s": statistics.median(samples), "min_s": min(samples), "max_s": max(samples)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=15)
    ap.add_argument("--quick", action="store_true", help="a smoke run: one run of each command")
    args = ap.parse_args()
    if args.quick:
        args.runs = 1
    home = tempfile.mkdtemp(prefix="localllm-bench-")
    env = os.environ | {"LOCALLLM_HOME": home}
    cli = [sys.executable, "-m", "localllm"]
    subprocess.run(
        [*cli, "show", "smollm2"], env=env, check=True, capture_output=True
    )  # register once
    cases = {
        "python -c pass": [sys.executable, "-c", "pass"],
        "localllm --version": [*cli, "--version"],
        "localllm --help": [*cli, "--help"],
        "localllm list": [*cli, "list"],
        "localllm show smollm2": [*cli, "show", "smollm2"],
    }
    results = {name: timed(cmd, env, args.runs) for name, cmd in cases.items()}
    base = results["python -c pass"]["median_s"]
    for name, r in results.items():
        r["over_bare_python_s"] = r["median_s"] - base
        print(
            f"{name:<24} median {r['median_s'] * 1000:7.1f} ms   (+{r['over_bare_python_s'] * 1000:6.1f} ms over bare python)"
        )
    out = {"machine": platform.processor() or platform.machine(), "cpus": os.cpu_count(),
           "runs": args.runs, "results": results}  # fmt: skip
    save("startup", out, quick=args.quick)


if __name__ == "__main__":
    main()
