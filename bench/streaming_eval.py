"""`localllm eval --streaming` scored by chunks against one token at a time, side by side in one run.

    .venv/bin/python bench/streaming_eval.py [--tokens 3072] [--spec 4:252] [--quick]

The same text (Alice), the same model (the default), the same policy, through the engine's
`Scorer` exactly as `localllm eval` runs it: once one position at a time (StreamingLLM's paper,
what eval did before), once sliding the window a chunk at a time (eval's default now: the
window // 16). Per engine: seconds, ms per token, perplexity; the speed-up and the perplexity
difference. Goal (issue 33): ≥ 5x faster, perplexity within 0.5%.

Writes bench/results/streaming_eval.json (`--quick`: 400 tokens, bench/results/quick/).
"""

from __future__ import annotations

import argparse
import time

from common import corpus_dir, log, save

from localllm.engine import load
from localllm.engine.scoring import Scorer
from localllm.evaluate import _score
from localllm.types import ContextPolicy, LoadOptions


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=3072)
    ap.add_argument("--spec", default="4:252")
    ap.add_argument("--quick", action="store_true")
    a = ap.parse_args()
    tokens = 400 if a.quick else a.tokens
    policy = ContextPolicy.parse(a.spec)
    text = (corpus_dir() / "alice.txt").read_text()
    out: dict = {"tokens": tokens, "streaming": a.spec, "model": "smollm2", "engines": {}}
    for backend in ("torch", "llama.cpp"):
        opts = LoadOptions(backend=backend, parallel=1, ctx=(policy.sinks or 0) + policy.window, streaming=a.spec)
        with load("smollm2", opts) as llm:
            ids = llm.runner.tokenize(text, add_special=True)[:tokens]
            runs = {}
            for chunk in (1, None):
                def score(chunk: int | None = chunk, ids: list[int] = ids) -> tuple[float, float, int]:
                    with Scorer(llm.runner, policy, chunk=chunk) as scorer:
                        t0 = time.perf_counter()
                        ppl = _score(ids, scorer, None, None)["perplexity"]
                        return ppl, time.perf_counter() - t0, scorer.chunk

                ppl, secs, used = llm.run_here(score)
                name = "token_by_token" if chunk == 1 else "chunked"
                runs[name] = {"chunk": used, "perplexity": ppl, "seconds": secs, "ms_per_token": 1000 * secs / len(ids)}
                log(f"{backend:9} {name:14} chunk {used:3}  ppl {ppl:.4f}  {secs:6.1f} s  {1000 * secs / len(ids):6.1f} ms/token")
            one, ch = runs["token_by_token"], runs["chunked"]
            runs["speedup"] = one["seconds"] / ch["seconds"]
            runs["perplexity_rel_diff"] = ch["perplexity"] / one["perplexity"] - 1
            log(f"{backend:9} speed-up {runs['speedup']:.2f}x, perplexity {100 * runs['perplexity_rel_diff']:+.2f}%")
            out["engines"][backend] = runs
    save("streaming_eval", out, quick=a.quick)


if __name__ == "__main__":
    main()
