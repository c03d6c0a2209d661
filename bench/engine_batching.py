"""Continuous batching: llama.cpp's own multi-sequence decode against the engine's, in one run.

    .venv/bin/python bench/engine_batching.py [--rounds 3] [--gen 96] [--long 4000] [--threads 2]
        [--min-chunk N ...] [--quick]

(a) raw: one llama.cpp context built as the backend builds it (n_seq_max = N, the same context per
    sequence, kv_unified off, flash attention, n_batch 512), driven directly through the batch API:
    N short prompts prefilled, then --gen steps that decode one token per sequence in one
    llama_batch, each sequence's greedy token the argmax of its logits row (as the backend picks
    it). tokens/s = N * gen / time.
(b) engine: `localllm.engine.load("smollm2", parallel=N)`, N greedy streams (the same prompts)
    submitted together, consumer threads stamping every chunk. Decode only: from the moment every
    stream has its first token to the moment the first one ends, tokens received / that window.
    N = 1, 4, 8; rounds alternate raw/engine for each N. Goal: engine/raw >= 0.80 for 4 and 8,
    and at most 5% below raw for one stream.
(c) TPOT: with parallel 4, three greedy streams run; the p95 of their time per output token over
    a baseline window (--base tokens per stream), then while a --long-token prompt is prefilled
    (from its submission to its first token). Goal: p95 with / p95 without <= 3. Also that
    prompt's TTFT beside the streams and alone (the caches are dropped before each, so it is
    evaluated afresh every round). `--min-chunk N` runs (c) again with the engine scheduler's
    smallest prefill chunk set to N (an experiment on `Model.scheduler.MIN_CHUNK`).
Writes bench/results/engine_batching.json with every sample and the medians. `--quick`: one
round, 32 tokens per stream, a 256-token long prompt after 4 baseline tokens
(bench/results/quick/engine_batching.json).
"""

from __future__ import annotations

import argparse
import ctypes
import os
import statistics
import tempfile
import threading
import time

import numpy as np
from common import corpus_dir, save

PROMPTS = ["Chapter 1.", "Once upon a time", "The history of the Roman Empire",
           "It was a dark and stormy night", "The old lighthouse keeper", "In the beginning",
           "Dear diary,", "The recipe calls for"]  # fmt: skip  (greedy: none stops within 160)
CTX = 512  # per sequence, for (a) and (b)


class RawBatch:
    """llama.cpp alone: one context with `n` sequences, decoded in lockstep."""

    def __init__(self, path: str, n: int, threads: int) -> None:
        from localllm.backends.llamacpp import quiet_llama_log

        lib = self.lib = quiet_llama_log()
        lib.llama_backend_init()
        mp = lib.llama_model_default_params()
        mp.n_gpu_layers = 0
        self.model = lib.llama_model_load_from_file(path.encode(), mp)
        cp = lib.llama_context_default_params()
        cp.n_ctx, cp.n_seq_max, cp.kv_unified = CTX * n, n, False
        cp.n_batch = cp.n_ubatch = 512
        cp.n_threads = cp.n_threads_batch = threads
        cp.flash_attn_type = lib.LLAMA_FLASH_ATTN_TYPE_ENABLED
        self.ctx = lib.llama_init_from_model(self.model, cp)
        self.vocab = lib.llama_model_get_vocab(self.model)
        self.n_vocab = lib.llama_vocab_n_tokens(self.vocab)
        self.batch = lib.llama_batch_init(512, 0, 1)
        self.n = n

    def tokenize(self, text: str) -> list[int]:
        buf = (ctypes.c_int32 * 256)()
        raw = text.encode()
        k = self.lib.llama_tokenize(self.vocab, raw, len(raw), buf, 256, True, True)
        return list(buf[:k])

    def _decode(self, items: list[tuple[int, int, int, bool]]) -> None:  # (token, pos, seq, logits)
        b = self.batch
        b.n_tokens = len(items)
        for i, (tok, pos, seq, out) in enumerate(items):
            b.token[i], b.pos[i], b.n_seq_id[i], b.logits[i] = tok, pos, 1, out
            b.seq_id[i][0] = seq
        assert self.lib.llama_decode(self.ctx, b) == 0

    def run(self, gen: int) -> float:
        """Decode tokens/s over `gen` lockstep steps (after each sequence's prompt)."""
        lib = self.lib
        lib.llama_memory_clear(lib.llama_get_memory(self.ctx), True)
        toks, pos = [], []
        for s in range(self.n):
            ids = self.tokenize(PROMPTS[s % len(PROMPTS)])
            self._decode([(t, i, s, i == len(ids) - 1) for i, t in enumerate(ids)])
            toks.append(self.argmax(len(ids) - 1))
            pos.append(len(ids))
        t0 = time.perf_counter()
        for _ in range(gen):
            self._decode([(toks[s], pos[s], s, True) for s in range(self.n)])
            for s in range(self.n):
                toks[s] = self.argmax(s)
                pos[s] += 1
        return self.n * gen / (time.perf_counter() - t0)

    def argmax(self, row: int) -> int:
        ptr = self.lib.llama_get_logits_ith(self.ctx, row)
        return int(np.ctypeslib.as_array(ptr, shape=(self.n_vocab,)).argmax())

    def close(self) -> None:
        self.lib.llama_batch_free(self.batch)
        self.lib.llama_free(self.ctx)
        self.lib.llama_model_free(self.model)


class Watch:
    """Consumes a stream in a thread, stamping each chunk: (time, tokens in it)."""

    def __init__(self, stream) -> None:  # noqa: ANN001
        self.stream, self.stamps = stream, []
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        for chunk in self.stream:
            if chunk.token_ids:
                self.stamps.append((time.perf_counter(), len(chunk.token_ids)))

    def wait(self):  # noqa: ANN201
        self.thread.join()
        return self.stream.result


def step_split(model, gen: int) -> dict:  # noqa: ANN001
    """One greedy stream: the engine's time per decode step, and the part of it spent outside
    the runner's forward (the Python the engine runs per step: planning, sampling, assembly)."""
    from localllm.types import Request, SamplingParams

    model.drop_caches()
    inner, spent = model.runner.forward, []

    def timed(pieces, **kw):  # noqa: ANN001, ANN003, ANN202
        t = time.perf_counter()
        try:
            return inner(pieces, **kw)
        finally:
            spent.append(time.perf_counter() - t)

    model.runner.forward = timed
    try:
        w = Watch(model.submit(Request(prompt=PROMPTS[0], sampling=SamplingParams(
            temperature=0, max_tokens=gen + 1))))  # fmt: skip
        w.wait()
    finally:
        del model.runner.forward
    steps = len(w.stamps) - 1
    total = w.stamps[-1][0] - w.stamps[0][0]
    in_forward = sum(spent[-steps:])
    return {"ms_per_step": 1000 * total / steps, "forward_ms_per_step": 1000 * in_forward / steps,
            "python_ms_per_step": 1000 * (total - in_forward) / steps}  # fmt: skip


def engine_decode(model, n: int, gen: int) -> float:  # noqa: ANN001
    """Aggregate decode tokens/s of `n` concurrent greedy streams through the engine."""
    from localllm.types import Request, SamplingParams

    model.drop_caches()
    sp = SamplingParams(temperature=0, max_tokens=gen + 1)
    watches = [Watch(model.submit(Request(prompt=PROMPTS[s % len(PROMPTS)], sampling=sp)))
               for s in range(n)]  # fmt: skip
    for w in watches:
        r = w.wait()
        assert r.finish_reason == "length", r.finish_reason
    start = max(w.stamps[0][0] for w in watches)  # every stream has its first token
    end = min(w.stamps[-1][0] for w in watches)  # the first stream is done
    count = sum(k for w in watches for t, k in w.stamps if start < t <= end)
    return count / (end - start)


def tpot(stamps: list[tuple[float, int]], t0: float, t1: float) -> list[float]:
    """Seconds per output token between consecutive chunks arriving in (t0, t1]."""
    out = []
    for (ta, _), (tb, k) in zip(stamps, stamps[1:]):
        if t0 < ta and tb <= t1:
            out.extend([(tb - ta) / k] * k)
    return out


def p95(xs: list[float]) -> float:
    return sorted(xs)[min(len(xs) - 1, int(0.95 * len(xs)))]


def long_prompt_round(model, long: str, base: int) -> dict[str, float]:  # noqa: ANN001
    """Three streams: p95 TPOT over `base` tokens each, then while `long` is prefilled."""
    from localllm.types import Request, SamplingParams

    model.drop_caches()
    sp = SamplingParams(temperature=0, max_tokens=None)
    watches = [Watch(model.submit(Request(prompt=p, sampling=sp))) for p in PROMPTS[:3]]
    while min(len(w.stamps) for w in watches) < 3:
        time.sleep(0.01)
    t_base = time.perf_counter()
    while min(len(w.stamps) for w in watches) < 3 + base:
        time.sleep(0.01)
    t0 = time.perf_counter()
    r = model.submit(Request(prompt=long, sampling=SamplingParams(temperature=0, max_tokens=1))).wait()
    t1 = t0 + r.timings.ttft_s
    for w in watches:
        w.stream.cancel()
        w.wait()
    without = [x for w in watches for x in tpot(w.stamps, t_base, t0)]
    with_long = [x for w in watches for x in tpot(w.stamps, t0, t1)]
    return {"p95_tpot_without_s": p95(without), "p95_tpot_with_s": p95(with_long),
            "median_tpot_without_s": statistics.median(without),
            "median_tpot_with_s": statistics.median(with_long),
            "stream_tokens_during_prefill": len(with_long), "ttft_beside_streams_s": r.timings.ttft_s,
            "long_prompt_tokens": r.usage.prompt_tokens}  # fmt: skip


def long_prompt(load, long_ids: int, text: str, args, min_chunk: int | None) -> dict:  # noqa: ANN001
    """(c) for one scheduler floor: every round beside three streams, then alone."""
    from localllm.types import Request, SamplingParams

    model = load("smollm2", ctx=long_ids + 256, parallel=4, threads=args.threads)
    if min_chunk is not None:
        model.scheduler.MIN_CHUNK = min_chunk
    long = model.detokenize(model.tokenize(text)[:long_ids])
    rounds, alone = [], []
    for i in range(args.rounds):
        # every prompt starts with its own words: the engine's prefix cache keeps what an earlier
        # round evaluated and would answer it warm, in milliseconds
        rounds.append(long_prompt_round(model, f"Round {i}. {long}", args.base))
        model.drop_caches()
        r = model.submit(Request(prompt=f"Alone {i}. {long}", sampling=SamplingParams(temperature=0, max_tokens=1)))
        res = r.wait()
        # ("Alone 0." and "Alone 1." share their first tokens: a few may match, a warm answer would be thousands)
        assert res.usage.cached_tokens < 8, f"{res.usage.cached_tokens} prompt tokens came from a cache"
        alone.append(res.timings.ttft_s)
        print(f"long prompt (min chunk {model.scheduler.MIN_CHUNK}): {rounds[-1]}, "
              f"alone TTFT {alone[-1]:.2f} s", flush=True)  # fmt: skip
    floor = model.scheduler.MIN_CHUNK
    model.close()
    tp = {k: statistics.median(r[k] for r in rounds) for k in rounds[0]}
    return {"scheduler_min_chunk": floor, "rounds": rounds, "alone_ttft_s": alone, "median": tp,
            "median_alone_ttft_s": statistics.median(alone),
            "p95_tpot_ratio": tp["p95_tpot_with_s"] / tp["p95_tpot_without_s"]}  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--gen", type=int, default=96)
    ap.add_argument("--long", type=int, default=4000)
    ap.add_argument("--base", type=int, default=30, help="baseline tokens per stream in (c)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--min-chunk", type=int, action="append", default=[],
                    help="also run (c) with this scheduler floor (repeatable)")  # fmt: skip
    ap.add_argument("--quick", action="store_true",
                    help="a smoke run: 1 round, 32 tokens, a 256-token prompt")  # fmt: skip
    args = ap.parse_args()
    if args.quick:
        args.rounds, args.gen, args.long, args.base = 1, 32, 256, 4
    os.environ.setdefault("LOCALLLM_HOME", tempfile.mkdtemp(prefix="localllm-bench-"))
    from localllm.engine import load

    samples: dict[str, list] = {}
    split: list[dict] = []
    for n in (1, 4, 8):
        model = load("smollm2", ctx=CTX, parallel=n, threads=args.threads)
        raw = RawBatch(model.backend.model_path, n, args.threads)
        raw.run(8), engine_decode(model, n, 8)  # warm up
        for _ in range(args.rounds):
            samples.setdefault(f"raw_{n}", []).append(raw.run(args.gen))
            samples.setdefault(f"engine_{n}", []).append(engine_decode(model, n, args.gen))
        if n == 1:
            split = [step_split(model, args.gen) for _ in range(args.rounds)]
        raw.close()
        model.close()
        print(f"{n} streams: raw {statistics.median(samples[f'raw_{n}']):.1f} tok/s, engine "
              f"{statistics.median(samples[f'engine_{n}']):.1f} tok/s", flush=True)  # fmt: skip

    text = (corpus_dir() / "moby_dick_part.txt").read_text()[: 6 * args.long]
    longs = [long_prompt(load, args.long, text, args, floor) for floor in [None, *args.min_chunk]]

    med = {k: statistics.median(v) for k, v in samples.items()}
    out = {
        "model": "smollm2:135m-instruct-q4_1", "threads": args.threads, "ctx_per_sequence": CTX,
        "gen_tokens": args.gen, "rounds": args.rounds, "samples": samples, "median": med,
        "engine_over_raw": {n: med[f"engine_{n}"] / med[f"raw_{n}"] for n in (1, 4, 8)},
        "long_prompt": longs[0], "long_prompt_other_floors": longs[1:],
    }  # fmt: skip
    if split:
        out["step_split_1"] = {k: statistics.median(r[k] for r in split) for k in split[0]}
        print(f"1 stream: {out['step_split_1']['ms_per_step']:.2f} ms a step, "
              f"{out['step_split_1']['python_ms_per_step']:.2f} ms of it outside forward")
    for n in (1, 4, 8):
        print(f"decode tokens/s, {n} streams: raw {med[f'raw_{n}']:.1f}  engine "
              f"{med[f'engine_{n}']:.1f}  engine/raw {out['engine_over_raw'][n]:.2f}")  # fmt: skip
    for lp in longs:
        tp = lp["median"]
        print(f"min chunk {lp['scheduler_min_chunk']}: p95 TPOT of 3 streams "
              f"{tp['p95_tpot_without_s'] * 1000:.0f} ms without, {tp['p95_tpot_with_s'] * 1000:.0f} "
              f"ms while a {tp['long_prompt_tokens']:.0f}-token prompt is prefilled "
              f"(x{lp['p95_tpot_ratio']:.2f}); its TTFT {tp['ttft_beside_streams_s']:.1f} s "
              f"beside them, {lp['median_alone_ttft_s']:.1f} s alone")  # fmt: skip
    save("engine_batching", out, quick=args.quick)


if __name__ == "__main__":
    main()
