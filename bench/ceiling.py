"""The hardware's decode ceiling and what each engine reaches of it, with cost per million
tokens, through `localllm bench` (issue 16): both engines on the default model at 1, 2, 4 and 8
clients, in one run, against the ceiling the memory-bandwidth probe gives (bandwidth ÷ bytes a
step reads: every weight once plus each sequence's KV cache).

    python bench/ceiling.py [--quick] [--gpu-cost-per-hour 0.50]

Writes bench/results/ceiling.json (each engine's whole `bench --json` report)."""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import log, save  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="1 and 2 clients, few tokens: a smoke run")
    ap.add_argument("--backends", default="llama.cpp,torch")
    ap.add_argument("--gpu-cost-per-hour", type=float, default=0.50,
                    help="the hourly price the cost columns assume (a small cloud machine)")  # fmt: skip
    a = ap.parse_args()
    os.environ.setdefault("LOCALLLM_HOME", tempfile.mkdtemp(prefix="bench-ceiling-"))
    from localllm.bench import Price, run_bench
    from localllm.types import LoadOptions

    levels = (1, 2) if a.quick else (1, 2, 4, 8)
    prompt, gen = (32, 8) if a.quick else (128, 64)
    price = Price.of(gpu_cost_per_hour=a.gpu_cost_per_hour)
    engines = {}
    for backend in a.backends.split(","):
        log(f"{backend}: {levels} clients, {prompt} + {gen} tokens")
        engines[backend] = run_bench("smollm2", options=LoadOptions(backend=backend), prompt_tokens=prompt,
                                     gen_tokens=gen, concurrency=levels, requests=None if not a.quick else 2,
                                     price=price)  # fmt: skip
        for lv in engines[backend]["levels"]:
            log(f"  {lv['concurrency']} clients: {lv['output_tokens_per_s']:.1f} tok/s out, decode "
                f"{lv['decode_tokens_per_s']:.1f} = {100 * lv['ceiling_fraction']:.0f}% of {lv['ceiling_tokens_per_s']:.0f}")
    save("ceiling", {"model": "smollm2", "prompt_tokens": prompt, "gen_tokens": gen, "levels": list(levels),
                     "engines": engines}, quick=a.quick)  # fmt: skip


if __name__ == "__main__":
    main()
