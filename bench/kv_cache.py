"""KV-cache types, StreamingLLM and H2O on the default model, both engines side by side, one run.

    .venv/bin/python bench/kv_cache.py [--only types,streaming,h2o] [--ppl-tokens 4096]
        [--stream-tokens 16384] [--threads 2] [--quick]

SmolLM2-135M (the default model), weights in each engine's CPU default (torch: int4 feed-forward,
fp16 elsewhere; llama.cpp: the file's Q4_1), text `moby_dick_part.txt` from tests/data/corpus.

1. types: perplexity over the first --ppl-tokens tokens with every cache type, each evaluated as
   generation runs (`localllm.evaluate`: token by token where a type quantizes late), against the
   same engine with an f16 cache: the perplexity cost (PPL / PPL_f16 - 1), KL(f16 ‖ type) mean and
   p99, top-1 agreement, and the bytes one more token costs. torch: f16, int8, fp8, int4, int2,
   k=int8,v=int4, k=int4,v=int8; llama.cpp: f16, q8_0, q4_0, k=q8_0,v=q4_0. Goals: int8 within
   +0.5%, int4 within +3%, and torch int4's cost below half of llama.cpp q4_0's; bytes per token
   int8 ≥ 1.9x, int4 ≥ 3.5x, int2 ≥ 6x smaller than f16.
2. streaming: --stream-tokens tokens through a 512-token cache (4 sinks + 508), one token at a
   time: torch f16, torch int4 (sinks and window), llama.cpp f16 (its context shift, rolling one
   token at a time). Oracle: the sliding window with recomputation — at every 32nd position once
   the cache is full, a fresh evaluation of the same [4 sinks + newest 508] tokens at positions
   0..511 (torch, f16) — compared with torch's streaming NLL at the same positions (goal: within
   10%); torch vs llama.cpp over all positions (goal: within 5%). Per-token time over the last
   1,000 tokens against the first 1,000 after the cache fills (goal: within 10%). Sinks matter:
   4 sinks against none with 256 cells over 3,072 tokens, both engines.
3. h2o: --ppl-tokens tokens with a 20% budget: H2O (half heavy hitters, half recent) against the
   full cache and against the same budget of recent tokens only (text positions, as H2O's), and
   StreamingLLM with 4 sinks at that budget. Goal: H2O beats recent-only.

Writes bench/results/kv_cache.json (every number, the machine, timings). `--quick` (a smoke run of
every part, bench/results/quick/kv_cache.json): QUICK's token counts, streaming through a 16-token
cache (4 sinks + 12, the oracle at every 4th position) and the sinks comparison with 16 cells. It
still loads an engine about 30 times (each cache type and its f16 reference, every streaming run).
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time

from common import corpus_dir, log, machine, results_path, save

MODEL = "smollm2"
TEXT = "moby_dick_part.txt"  # in the corpus folder (common.corpus_dir)


def text() -> str:
    return (corpus_dir() / TEXT).read_text(encoding="utf-8")
QUICK = {"ppl_tokens": 80, "stream_tokens": 64}  # --quick (h2o: a 16-token budget)


def evaluate(backend: str, kv: str = "f16", *, tokens: int, streaming: str | None = None,
             evict: str | None = None, ref_kv: str | None = "f16") -> dict:  # fmt: skip
    from localllm.evaluate import evaluate as run
    from localllm.types import LoadOptions

    opts = LoadOptions(backend=backend, kv_cache=kv, streaming=streaming, evict=evict, parallel=1)
    t = time.perf_counter()
    r = run(MODEL, text(), options=opts, limit=tokens, ref_kv=ref_kv)
    log(f"  {backend:9} {kv:14} {streaming or '':8} {evict or '':9} PPL {r['perplexity']:.4f} "
        f"KL {r.get('kl_mean', float('nan')):.5f} top1 {r.get('top1_agreement', float('nan')):.4f} "
        f"{r['kv_bytes_per_token']:.0f} B/token  {time.perf_counter() - t:.0f} s")  # fmt: skip
    return r


# -- 1. types -----------------------------------------------------------------------------------


def types(tokens: int) -> dict:
    log("types")
    out: dict = {}
    for backend, kinds in (("torch", ["f16", "int8", "fp8", "int4", "int2", "k=int8,v=int4",
                                      "k=int4,v=int8"]),
                           ("llama.cpp", ["f16", "q8_0", "q4_0", "k=q8_0,v=q4_0"])):  # fmt: skip
        rows = {k: evaluate(backend, k, tokens=tokens, ref_kv=None if k == "f16" else "f16")
                for k in kinds}  # fmt: skip
        base = rows["f16"]
        for r in rows.values():
            r["ppl_cost"] = r["perplexity"] / base["perplexity"] - 1
            r["bytes_vs_f16"] = base["kv_bytes_per_token"] / r["kv_bytes_per_token"]
        out[backend] = rows
    t, c = out["torch"], out["llama.cpp"]
    out["goals"] = {
        "int8_within_0.5pct": t["int8"]["ppl_cost"] <= 0.005,
        "int4_within_3pct": t["int4"]["ppl_cost"] <= 0.03,
        "int4_cost_below_half_of_llamacpp_q4_0": t["int4"]["ppl_cost"] * 2 < c["q4_0"]["ppl_cost"],
        "int8_bytes_1.9x": t["int8"]["bytes_vs_f16"] >= 1.9,
        "int4_bytes_3.5x": t["int4"]["bytes_vs_f16"] >= 3.5,
        "int2_bytes_6x": t["int2"]["bytes_vs_f16"] >= 6,
    }
    return out


# -- 2. streaming ---------------------------------------------------------------------------------


def _stream(backend_name: str, ids: list[int], spec: str, kv: str = "f16") -> dict:
    """Token by token through a StreamingLLM cache: NLL and seconds per position."""
    import numpy as np

    from localllm.backends.base import Piece
    from localllm.engine import load
    from localllm.evaluate import _log_softmax
    from localllm.types import ContextPolicy, LoadOptions

    policy = ContextPolicy.parse(spec)
    ctx = (policy.sinks or 0) + policy.window
    llm = load(MODEL, LoadOptions(backend=backend_name, kv_cache=kv, streaming=spec, parallel=1,
                                  ctx=ctx))  # fmt: skip
    try:
        runner = llm.runner
        runner.clear(0, policy)
        nll, secs = [], []
        for p in range(len(ids) - 1):
            t = time.perf_counter()
            logits = runner.forward([Piece(0, [ids[p]], 1)]).logits
            logp = _log_softmax(logits)[0]
            secs.append(time.perf_counter() - t)
            nll.append(-float(logp[ids[p + 1]]))
        stats = dict(runner.kv_stats(0))
    finally:
        llm.close()
    return {"nll": nll, "secs": secs, "ppl": math.exp(float(np.mean(nll))), "kv": stats}


def _oracle(ids: list[int], sinks: int, window: int, every: int) -> dict[int, float]:
    """The sliding window with recomputation: at positions p (cache full, p % every == every-1),
    a fresh f16-cache evaluation of ids[:sinks] + the newest `window` tokens ending at p, at
    positions 0..n-1; NLL of ids[p + 1]."""
    import torch

    from localllm.backends.torch.runner import TorchRunner, on_compute_thread
    from localllm.evaluate import _log_softmax
    from localllm.models_registry.catalog import ensure_local
    from localllm.models_registry.store import Store

    store = Store()
    path = store.path_of(ensure_local(MODEL, store))
    b = TorchRunner(path, n_ctx=sinks + window + 8, n_slots=1, max_batch=sinks + window,
                    kv_cache="f16")  # fmt: skip

    @on_compute_thread
    @torch.inference_mode()
    def last(held: list[int]) -> torch.Tensor:
        caches = b.new_caches()
        h = b.model(torch.tensor([held]), [caches])
        return b.model.logits(h[0, -1:]).float().numpy()

    out = {}
    for p in range(sinks + window - 1, len(ids) - 1):
        if p % every != every - 1:
            continue
        held = ids[:sinks] + ids[p + 1 - window : p + 1]
        out[p] = -float(_log_softmax(last(held))[0][ids[p + 1]])
    b.close()
    return out


def streaming(tokens: int, quick: bool) -> dict:
    import numpy as np

    from localllm.engine import load
    from localllm.types import LoadOptions

    log("streaming")
    llm = load(MODEL, LoadOptions(backend="torch", parallel=1, ctx=64))
    ids = llm.runner.tokenize(text(), add_special=True)[:tokens]
    llm.close()
    sinks, window, every = (4, 12, 4) if quick else (4, 508, 32)
    cells = 16 if quick else 256  # sinks matter: the cache of that comparison
    spec = f"{sinks}:{window}"
    out: dict = {"tokens": len(ids), "cache": sinks + window, "sinks": sinks}
    runs = {"torch_f16": ("torch", spec, "f16"), "torch_int4": ("torch", spec, "int4"),
            "llamacpp_f16": ("llama.cpp", spec, "f16")}  # fmt: skip
    got = {}
    for name, (backend, s, kv) in runs.items():
        t = time.perf_counter()
        got[name] = _stream(backend, ids, s, kv)
        log(f"  {name}: PPL {got[name]['ppl']:.4f} ({time.perf_counter() - t:.0f} s)")
    t = time.perf_counter()
    oracle = _oracle(ids, sinks, window, every)
    log(f"  oracle at {len(oracle)} positions ({time.perf_counter() - t:.0f} s)")
    at = sorted(oracle)
    ppl_oracle = math.exp(float(np.mean([oracle[p] for p in at])))
    full = sinks + window
    for r in got.values():
        nll, secs = r.pop("nll"), r.pop("secs")
        r["ppl_at_oracle_positions"] = math.exp(float(np.mean([nll[p] for p in at])))
        r["vs_oracle"] = r["ppl_at_oracle_positions"] / ppl_oracle - 1
        first = secs[full : full + 1000]
        last = secs[-1000:]
        r["ms_per_token_first_1000_after_full"] = 1e3 * statistics.median(first)
        r["ms_per_token_last_1000"] = 1e3 * statistics.median(last)
        r["last_vs_first"] = statistics.median(last) / statistics.median(first) - 1
    out["runs"] = got
    out["oracle"] = {"positions": len(at), "every": every, "ppl": ppl_oracle}
    out["torch_vs_llamacpp"] = got["torch_f16"]["ppl"] / got["llamacpp_f16"]["ppl"] - 1
    # sinks matter: 4 sinks against none, 256 cells, 3,072 tokens (the llama.cpp anchor)
    short = ids[:3072]
    out["sinks_vs_none"] = {}
    for backend in ("torch", "llama.cpp"):
        with_sinks = _stream(backend, short, f"4:{cells - 4}")["ppl"]
        without = _stream(backend, short, f"0:{cells}")["ppl"]
        out["sinks_vs_none"][backend] = {"sinks_4": with_sinks, "sinks_0": without,
                                         "ratio": without / with_sinks}  # fmt: skip
        log(f"  {backend}: {cells} cells, {len(short):,} tokens: 4 sinks {with_sinks:.3f}, "
            f"none {without:.3f}")  # fmt: skip
    out["goals"] = {
        "torch_f16_within_10pct_of_oracle": abs(got["torch_f16"]["vs_oracle"]) <= 0.10,
        "torch_int4_within_10pct_of_oracle": abs(got["torch_int4"]["vs_oracle"]) <= 0.10,
        "torch_within_5pct_of_llamacpp": abs(out["torch_vs_llamacpp"]) <= 0.05,
        "flat_time_f16": got["torch_f16"]["last_vs_first"] <= 0.10,
        "flat_time_int4": got["torch_int4"]["last_vs_first"] <= 0.10,
    }
    return out


# -- 3. h2o ---------------------------------------------------------------------------------------


def h2o(tokens: int) -> dict:
    from localllm.engine import load
    from localllm.engine.scoring import Scorer
    from localllm.evaluate import _score
    from localllm.types import LoadOptions

    log("h2o")
    budget = tokens // 5
    full = evaluate("torch", "f16", tokens=tokens, ref_kv=None)
    heavy = evaluate("torch", "f16", tokens=tokens, evict=f"h2o:{budget}", ref_kv="f16")
    sink = evaluate("torch", "f16", tokens=tokens, streaming=f"4:{budget - 4}", ref_kv=None)
    # recent only, with text positions as H2O's: its cache with every slot given to recent tokens
    llm = load(MODEL, LoadOptions(backend="torch", evict=f"h2o:{budget}", parallel=1, ctx=tokens))
    try:
        ids = llm.runner.tokenize(text(), add_special=True)[:tokens]
        scorer = Scorer(llm.runner)  # slot 0, token by token (H2O: scoring_chunk 1)
        for c in llm.runner._slot(0):  # its H2O caches, made now: every slot to recent tokens
            c.recent = budget - 1
        t = time.perf_counter()
        recent = _score(ids, scorer, None, None)
        log(f"  recent-only {budget}: PPL {recent['perplexity']:.4f} ({time.perf_counter() - t:.0f} s)")
    finally:
        llm.close()
    return {"budget": budget, "tokens": tokens, "full": full, "h2o": heavy, "recent_only": recent,
            "streaming_4_sinks": sink,
            "goals": {"h2o_beats_recent_only": heavy["perplexity"] < recent["perplexity"]}}  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--only", default="types,streaming,h2o")
    ap.add_argument("--ppl-tokens", type=int, default=4096)
    ap.add_argument("--stream-tokens", type=int, default=16384)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--quick", action="store_true",
                    help="a smoke run: 80 / 64 tokens, a 16-token streaming cache")  # fmt: skip
    a = ap.parse_args()
    if a.quick:
        a.ppl_tokens, a.stream_tokens = QUICK["ppl_tokens"], QUICK["stream_tokens"]
    import torch

    torch.set_num_threads(a.threads)
    path = results_path("kv_cache", a.quick)
    out = json.loads(path.read_text()) if path.is_file() else {}
    out.pop("machine", None), out.pop("when", None)  # save() stamps this run's
    out["machine_start"] = machine()
    out["text"] = TEXT
    for part in a.only.split(","):
        t = time.perf_counter()
        if part == "types":
            out["types"] = types(a.ppl_tokens)
        elif part == "streaming":
            out["streaming"] = streaming(a.stream_tokens, a.quick)
        elif part == "h2o":
            out["h2o"] = h2o(a.ppl_tokens)
        else:
            sys.exit(f"unknown part {part!r}")
        out.setdefault("seconds", {})[part] = round(time.perf_counter() - t, 1)
        out["machine_end"] = machine()
        save("kv_cache", out, quick=a.quick)  # after each part: a later failure keeps it


if __name__ == "__main__":
    main()
