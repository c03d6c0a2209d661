"""`localllm run` while `localllm serve` holds the model, side by side with `run --local`, in one run.

    .venv/bin/python bench/run_shared.py [--runs 5] [--quick]

Each run is the command as a user types it (a new process: start-up, load or connect, answer,
exit), on the default model, greedy, 32 tokens. Measured per run: wall seconds to exit, the TTFT
the command reports (`--stats`), and the command process's peak resident memory (`wait4`'s
ru_maxrss: the process alone, not the server). The server is started once, before either case,
and holds the model the whole time (what a user with `localllm serve` running has).

Writes bench/results/run_shared.json (`--quick`: one run of each, bench/results/quick/).
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time

from common import log, save

PROMPT = "Name three colors and say one thing about each."


def timed(cmd: list[str], env: dict[str, str], runs: int) -> dict:
    samples = []
    for _ in range(runs):
        # wait4 gives this child's own peak memory; output goes to files (nothing to drain)
        with tempfile.TemporaryFile() as fo, tempfile.TemporaryFile() as fe:
            t0 = time.perf_counter()
            p = subprocess.Popen(cmd, env=env, stdout=fo, stderr=fe)
            _, status, usage = os.wait4(p.pid, 0)
            wall = time.perf_counter() - t0
            p.returncode = os.waitstatus_to_exitcode(status)
            fo.seek(0)
            fe.seek(0)
            out, err = fo.read(), fe.read()
        text = err.decode(errors="replace")
        if p.returncode:
            raise SystemExit(f"{' '.join(cmd)} failed: {text.strip()[-500:]}")
        ttft = re.search(r"TTFT (\d+) ms", text)
        backend = re.search(r"backend (.+?), loaded", text)
        samples.append({"wall_s": wall, "ttft_s": int(ttft.group(1)) / 1000 if ttft else None,
                        "rss_mb": usage.ru_maxrss / 1024, "backend": backend.group(1) if backend else "",
                        "text": out.decode(errors="replace").strip()})  # fmt: skip
    med = {k: statistics.median(s[k] for s in samples if s[k] is not None)
           for k in ("wall_s", "ttft_s", "rss_mb")}  # fmt: skip
    return med | {"backend": samples[0]["backend"], "text": samples[0]["text"], "runs": len(samples)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--quick", action="store_true", help="a smoke run: one run of each")
    args = ap.parse_args()
    if args.quick:
        args.runs = 1
    home = tempfile.mkdtemp(prefix="localllm-bench-")
    env = os.environ | {"LOCALLLM_HOME": home}
    env.pop("LOCALLLM_API_KEY", None)
    cli = [sys.executable, "-m", "localllm"]
    run = [*cli, "run", "smollm2", PROMPT, "--temperature", "0", "--max-tokens", "32", "--stats",
           "--backend", "llama.cpp", "--ctx", "2048"]  # fmt: skip
    local = timed([*run, "--local"], env, args.runs)  # before the server: nothing else running
    server = subprocess.Popen([*cli, "serve", "--port", "0", "--model", "smollm2", "--backend", "llama.cpp",
                               "--ctx", "2048", "--parallel", "2"],
                              env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)  # fmt: skip
    try:
        line = server.stderr.readline()  # type: ignore[union-attr]
        if not line.startswith("localllm http"):
            raise SystemExit(f"the server did not start: {line}")
        shared = timed(run, env, args.runs)
    finally:
        server.terminate()
        server.wait(30)
    if shared["text"] != local["text"]:
        raise SystemExit("the answers differ: the server's copy must answer as a local load does")
    if not shared["backend"].startswith("localllm serve"):
        raise SystemExit(f"run did not use the server ({shared['backend']!r})")
    for name, r in (("run --local", local), ("run (server up)", shared)):
        log(f"{name:<16} wall {r['wall_s']:.2f} s   TTFT {r['ttft_s'] * 1000:.0f} ms   "
            f"peak RSS {r['rss_mb']:.0f} MB   ({r['backend']})")
    save("run_shared", {"runs": args.runs, "prompt": PROMPT, "local": local, "shared": shared,
                        "speedup_wall": local["wall_s"] / shared["wall_s"],
                        "rss_saved_mb": local["rss_mb"] - shared["rss_mb"]}, quick=args.quick)  # fmt: skip


if __name__ == "__main__":
    main()
