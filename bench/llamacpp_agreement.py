"""How far llama.cpp agrees with itself, beside how far the torch engine agrees with it, in one run.

    .venv/bin/python bench/llamacpp_agreement.py [--models smollm2,gemma] [--tokens 2000] [--threads 2]
        [--quick]

Teacher-forced over the first --tokens tokens of alice.txt (as tests/backends/torch/test_vs_llamacpp.py),
per model, the next-token distributions of:
- llama.cpp evaluating the text in batches of 512 (the reference the test uses),
- llama.cpp evaluating the same tokens one at a time (its matrix-vector kernels: what decoding runs),
- the torch engine on its f32 reference path and on the CPU default,
each compared with the first: top-1 agreement, mean KL(reference || other) in nats, perplexity.
The issue asks top-1 >= 98% of ours against llama.cpp; llama.cpp against itself is the noise floor
that bar sits on (it quantizes activations to 8 bits per block, differently in its two paths).
Writes bench/results/llamacpp_agreement.json (`--quick`: both models, 64 tokens,
bench/results/quick/llamacpp_agreement.json; most of its time is loading Gemma's engines).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).parent))
from common import corpus_dir, save  # noqa: E402
from torch_engine import model_path  # noqa: E402


def llama_scores(path: Path, ids: list[int], n_batch: int, threads: int) -> np.ndarray:
    import llama_cpp

    llm = llama_cpp.Llama(model_path=str(path), n_ctx=len(ids), n_batch=n_batch, n_ubatch=n_batch,
                          logits_all=True, verbose=False, n_threads=threads)  # fmt: skip
    llm.eval(ids)
    scores = np.array(llm.scores[: len(ids)], dtype=np.float32)
    llm.close()
    return scores


def torch_scores(path: Path, ids: list[int], dtype: str) -> np.ndarray:
    from localllm.backends.base import Piece
    from localllm.backends.torch.runner import TorchRunner

    runner = TorchRunner(path, n_ctx=len(ids), max_batch=250, dtype=dtype, kv_cache="f32",
                         device="cpu")  # fmt: skip
    rows = []
    for i in range(0, len(ids), 250):
        piece = ids[i : i + 250]
        rows.append(runner.forward([Piece(0, piece, len(piece))]).logits)
    runner.close()
    return np.concatenate(rows)


def compare(ref: np.ndarray, other: np.ndarray, targets: np.ndarray) -> dict[str, float]:
    import torch

    n = len(targets)
    r = torch.from_numpy(ref[:n]).log_softmax(-1)
    o = torch.from_numpy(other[:n]).log_softmax(-1)
    t = torch.from_numpy(targets)[:, None]
    return {
        "top1": float((r.argmax(-1) == o.argmax(-1)).float().mean()),
        "kl": float((r.exp() * (r - o)).sum(-1).mean()),
        "ppl_ref": math.exp(float(-r.gather(-1, t).mean())),
        "ppl": math.exp(float(-o.gather(-1, t).mean())),
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default="smollm2,gemma")
    ap.add_argument("--tokens", type=int, default=2000)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--quick", action="store_true", help="a smoke run: 64 tokens")
    ap.add_argument("--out", help="default: bench/results/llamacpp_agreement.json (common.save)")
    args = ap.parse_args()
    if args.quick:
        args.tokens = 64
    import llama_cpp
    import torch

    torch.set_num_threads(args.threads)
    text = (corpus_dir() / "alice.txt").read_text(encoding="utf-8")
    out: dict = {"machine": {"cpu": platform.processor() or platform.machine(),
                             "cpu_capability": torch.backends.cpu.get_cpu_capability(),
                             "torch": torch.__version__, "llama_cpp": llama_cpp.__version__},
                 "args": vars(args), "models": {}}  # fmt: skip
    for name in args.models.split(","):
        path = model_path(name)
        vocab = llama_cpp.Llama(model_path=str(path), vocab_only=True, verbose=False)
        ids = vocab.tokenize(text.encode(), add_bos=True, special=False)[: args.tokens]
        targets = np.array(ids[1:])  # the last position has no next token
        ref = llama_scores(path, ids, 512, args.threads)
        others = {
            "llama.cpp token by token": llama_scores(path, ids, 1, args.threads),
            "torch f32": torch_scores(path, ids, "f32"),
            "torch default": torch_scores(path, ids, "auto"),
        }
        rows = {k: compare(ref, v, targets) for k, v in others.items()}
        out["models"][name] = {"file": path.name, "tokens": len(ids), "vs llama.cpp batch 512": rows}
        print(f"== {name} ({path.name}), {len(ids)} tokens, against llama.cpp in batches of 512")
        for k, r in rows.items():
            print(f"  {k:26s} top-1 {r['top1']:.2%}  KL {r['kl']:.4f}  "
                  f"ppl {r['ppl']:.3f} (ref {r['ppl_ref']:.3f})")  # fmt: skip
    if args.out:
        os.makedirs(Path(args.out).parent, exist_ok=True)
        Path(args.out).write_text(json.dumps(out, indent=2) + "\n")
        print(f"wrote {args.out}")
    else:
        save("llamacpp_agreement", out, quick=args.quick)


if __name__ == "__main__":
    main()
