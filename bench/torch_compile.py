"""The torch engine's compiled step against its eager path, side by side in one run (issue 33).

    .venv/bin/python bench/torch_compile.py [--tokens 128] [--quick]

Each variant runs in a process of its own (a compile cache starts where the variant says):
SmolLM2 in a precision, one slot reads a prompt (the start of Alice), then decodes --tokens
tokens greedily, one at a time; then 8 slots decode 32 steps together.
- `eager`: `--no-compile` (the CPU's default).
- `compiled, cold`: `--compile` with an empty inductor cache: the first step's time is the compile.
- `compiled, warm`: `--compile` again in a new process over the caches the cold run left (what a
  second start of `localllm run` costs): inductor's kernels and the whole graphs (`compiled.py`).
- `llama.cpp`: llama-cpp-python on the same file, the same prompt, as many threads, greedy.
Per variant: seconds to load, seconds for the first decode step (the compile where there is
one), ms/token at batch 1 (the mean after the first token, as for llama.cpp), ms per step at
batch 8 (torch), and the tokens (compiled and eager should agree). Precisions: the CPU default
(int4 feed-forward, fbgemm fp16 elsewhere) and f32.

Writes bench/results/torch_compile.json (--quick: 32 tokens, the default precision only;
bench/results/quick/).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from common import corpus_dir, log, save
from torch_engine import model_path


def llama_cpp(tokens: int) -> dict:
    from torch_engine import llama_decode, llama_load

    t0 = time.perf_counter()
    llm = llama_load(model_path("smollm2"), os.cpu_count() or 1, 1024)
    load = time.perf_counter() - t0
    ids = llm.tokenize((corpus_dir() / "alice.txt").read_text().encode(), add_bos=True)[:200]
    tps, out = llama_decode(llm, ids, tokens + 1)
    return {"load_s": load, "ms_per_token": 1000 / tps, "tokens": out[1:]}


def worker(dtype: str, compile: str, tokens: int) -> dict:
    if compile == "llama.cpp":
        return llama_cpp(tokens)
    from localllm.backends.base import Piece
    from localllm.backends.torch.runner import TorchRunner

    t0 = time.perf_counter()
    saved = Path(os.environ["TORCHINDUCTOR_CACHE_DIR"]).parent / "compiled"  # as under a store
    r = TorchRunner(model_path("smollm2"), n_ctx=1024, n_slots=8, dtype=dtype, compile=compile,
                    compiled_dir=saved)  # fmt: skip
    load = time.perf_counter() - t0
    ids = r.tokenize((corpus_dir() / "alice.txt").read_text())[:200]
    r.forward([Piece(0, ids[:-1], 0)])
    last, out, times = ids[-1], [], []
    for _ in range(tokens):
        t = time.perf_counter()
        last = int(r.forward([Piece(0, [last], 1)]).logits[0].argmax())
        times.append(time.perf_counter() - t)
        out.append(last)
    for s in range(1, 8):
        r.forward([Piece(s, ids[: 100 + 10 * s], 0)])
    lasts = [ids[100 + 10 * s] for s in range(8)]
    lasts[0] = last
    steps = []
    for i in range(32 + 2):
        t = time.perf_counter()
        logits = r.forward([Piece(s, [lasts[s]], 1) for s in range(8)]).logits
        if i >= 2:  # the first steps at 8 rows compile that bucket
            steps.append(time.perf_counter() - t)
        lasts = [int(x) for x in logits.argmax(-1)]
    step = r._compiled
    return {"load_s": load, "first_step_s": times[0],
            "graphs_loaded": step.loaded if step else 0, "graphs_built": step.built if step else 0,
            "ms_per_token": 1000 * statistics.mean(times[1:] or times),
            "ms_per_step_8": 1000 * statistics.median(steps), "tokens": out}  # fmt: skip


def variant(dtype: str, compile: str, tokens: int, cache: Path) -> dict:
    env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=str(cache / "inductor"))
    p = subprocess.run([sys.executable, __file__, "--worker", dtype, compile, str(tokens)],
                       env=env, capture_output=True, text=True, check=False)  # fmt: skip
    if p.returncode:
        sys.exit(f"the {dtype} {compile} run failed:\n{p.stderr[-3000:]}")
    return json.loads(p.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--worker", nargs=3)
    a = ap.parse_args()
    if a.worker:
        dtype, compile, tokens = a.worker
        print(json.dumps(worker(dtype, compile, int(tokens))))
        return
    if a.quick:
        a.tokens = 32
    out: dict = {"model": "smollm2", "tokens": a.tokens}
    for dtype in ("int4",) if a.quick else ("int4", "f32"):
        with tempfile.TemporaryDirectory() as tmp:
            cache = Path(tmp)
            runs = {"eager": variant(dtype, "off", a.tokens, cache),
                    "compiled, cold": variant(dtype, "on", a.tokens, cache),
                    "compiled, warm": variant(dtype, "on", a.tokens, cache)}  # fmt: skip
        for name, r in runs.items():
            log(f"{dtype:5} {name:15} load {r['load_s']:5.1f} s  first step {r['first_step_s']:6.2f} s  "
                f"{r['ms_per_token']:6.1f} ms/token  8 rows {r['ms_per_step_8']:6.1f} ms/step")  # fmt: skip
        if dtype == "int4":
            ref = out["llama.cpp"] = variant(dtype, "llama.cpp", a.tokens, Path(tempfile.gettempdir()))
            log(f"llama.cpp load {ref['load_s']:5.1f} s  {ref['ms_per_token']:6.1f} ms/token")
            for name in ("eager", "compiled, warm"):
                runs[name]["over_llamacpp"] = ref["ms_per_token"] / runs[name]["ms_per_token"]
        runs["same_tokens"] = runs["eager"]["tokens"] == runs["compiled, warm"]["tokens"]
        runs["first_difference"] = next(
            (i for i, (x, y) in enumerate(zip(runs["eager"]["tokens"], runs["compiled, warm"]["tokens"]))
             if x != y), None)  # fmt: skip
        runs["speedup"] = runs["eager"]["ms_per_token"] / runs["compiled, warm"]["ms_per_token"]
        out[dtype] = runs
    save("torch_compile", out, quick=a.quick)


if __name__ == "__main__":
    main()
