"""The torch engine's paged KV pool, side by side in one run: a cached prefix shared by blocks
against copied into each slot, and Gemma 3's sliding-window layers keeping their window against
keeping every position.

    .venv/bin/python bench/kv_pool.py [--prefix 2000] [--slots 4] [--context 2000]
        [--stream 3000] [--window 1020] [--budget 1024] [--only kivi,h2o] [--quick]

1. Prefix (smollm2, the CPU default precision, f16 keys): one slot evaluates a --prefix-token
   text (Alice) and the prefix is saved (`runner.save`, as the engine's prefix cache does when a
   request ends); then --slots slots each take the prefix and greedily decode 16 tokens, all the
   slots together. `shared`: the runner's restore (the slots' tables point at the prefix's
   blocks; a slot copies a block only when it writes into it). `copied`: what a restore did
   before issue 33 — the saved keys and values written into each slot's own blocks
   (`update_and_fetch` of the prefix's state, every layer). Per variant: ms per restore (median
   over the slots), KV bytes in use afterwards (blocks held × their bytes, prefix handle
   included), and the tokens (the same in both).
2. Window (gemma, the default precision): one slot reads --context tokens of text, then decodes
   32 tokens greedily. `windowed`: the local layers' pages give back what their window no longer
   sees (the default); `every position`: those pages keep everything (`Pages.window` 0; the mask
   still hides the same keys, so the tokens are the same). KV bytes in use and decode ms/token.
3. Codes (smollm2, the default precision, `--kv-cache int8`): one slot reads --context tokens,
   then decodes 32 greedily. `pool`: int8 codes and scales in the paged pool's blocks, decoded
   as attention gathers them (issue 33); `stores`: the slot's own per-sequence stores, dequantized
   whole in every layer at every step (what int8 was before). KV bytes and decode ms/token.

4. Streaming (smollm2, the default precision, `--streaming 4:--window`, a context of sinks and
   window): one slot reads --stream tokens (the window forgets what passes it), then decodes 32
   greedily. `pool`: the sinks and window are the slot's blocks, keys before RoPE rotated as
   attention reads them (issue 33); `stores`: `StreamingCache`'s stores of its own, the window
   moved down every 64 tokens; `pool, compiled`: the pool's slot through the compiled step
   (`--compile`). KV bytes and decode ms/token. The tokens may part: decode
   attention rounds otherwise in the pool (blocks of 64 keys, float32) than SDPA over a store,
   and the default precision's logits then differ by 0.1-0.6 (plain caches alike: 0.1-0.2).

5. KIVI (smollm2, the default precision, `--kv-cache int4`): one slot, then --slots slots, each
   reads --context tokens and they decode 32 greedily together. `pool`: KIVI's codes in the
   pool's blocks, each slot's residual in its ring, every row in one attention call (issue 33);
   `stores`: per-sequence stores, dequantized whole in every layer, one attention call per row;
   `pool, compiled`: the pool through the compiled step. KV bytes and decode ms a step.
6. H2O (smollm2, the default precision, f16 keys, `--evict h2o:--budget`): as 5, `pool`: each
   head's kept tokens in the slot's blocks, the rows in one attention call that also gives each
   slot its probabilities; `stores`: `H2OCache`'s stores, one call per row.

Writes bench/results/kv_pool.json (--quick: 300-token prefix, 2 slots, 700-token context, 600
tokens under 4:252; bench/results/quick/).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import statistics
import time
from concurrent.futures import ProcessPoolExecutor

from common import corpus_dir, log, results_path, save
from torch_engine import model_path

from localllm.backends.base import Piece
from localllm.backends.torch.runner import TorchRunner, on_compute_thread
from localllm.types import ContextPolicy


def in_use(r: TorchRunner) -> int:
    """Bytes of the blocks slots and prefix handles hold now, every layer."""
    return sum(p.used * sum(layer.block_bytes for layer in p.layers) for p in r._pages)


def decode(r: TorchRunner, slots: list[int], first: list[int], n: int) -> tuple[list[list[int]], float]:
    """n greedy steps of the slots together from their `first` tokens: (tokens per slot, the
    median step's seconds; the first steps after a prefill run slower, and a median leaves
    them out)."""
    out, last, steps = [[] for _ in slots], list(first), []
    for _ in range(n):
        t0 = time.perf_counter()
        logits = r.forward([Piece(s, [t], 1) for s, t in zip(slots, last)]).logits
        last = [int(x) for x in logits.argmax(-1)]
        steps.append(time.perf_counter() - t0)
        for o, t in zip(out, last):
            o.append(t)
    return out, statistics.median(steps)


@on_compute_thread
def copy_in(r: TorchRunner, slot: int, state: list) -> None:
    """A restore as it was: the saved keys and values written into the slot's own blocks."""
    r.clear(slot)
    for c, (k, v) in zip(r._slot(slot), state):
        c.update_and_fetch(k, v)


def prefix(n_prefix: int, n_slots: int) -> dict:
    r = TorchRunner(model_path("smollm2"), n_ctx=n_prefix + 64, n_slots=n_slots + 1, threads=None)
    ids = r.tokenize((corpus_dir() / "alice.txt").read_text())[:n_prefix]
    out: dict = {"prefix_tokens": len(ids), "slots": n_slots, "dtype": r.dtype, "kv": "f16"}
    try:
        for i in range(0, len(ids) - 1, r.max_batch):
            r.forward([Piece(0, ids[i : min(i + r.max_batch, len(ids) - 1)], 0)])
        handle = r.save(0, 0, len(ids) - 1)
        state = [c.state for c in r._caches[0]]  # what the old save copied out
        r.clear(0)
        slots = list(range(1, n_slots + 1))
        for name in ("copied", "shared"):
            times = []
            for s in slots:
                t0 = time.perf_counter()
                if name == "shared":
                    assert r.restore(s, [(handle, len(ids) - 1)])
                else:
                    copy_in(r, s, state)
                times.append(time.perf_counter() - t0)
            tokens, secs = decode(r, slots, [ids[-1]] * n_slots, 16)
            out[name] = {"restore_ms": 1000 * statistics.median(times), "kv_bytes": in_use(r),
                         "decode_ms_per_step": 1000 * secs, "tokens": tokens[0]}  # fmt: skip
            log(f"prefix {name:7} restore {out[name]['restore_ms']:7.2f} ms  KV {in_use(r) / 2**20:7.1f} MiB  "
                f"decode {out[name]['decode_ms_per_step']:.1f} ms/step")  # fmt: skip
            for s in slots:
                r.clear(s)
        r.release(handle)
        out["same_tokens"] = out["copied"]["tokens"] == out["shared"]["tokens"]
        out["kv_ratio"] = out["shared"]["kv_bytes"] / out["copied"]["kv_bytes"]
        out["restore_speedup"] = out["copied"]["restore_ms"] / out["shared"]["restore_ms"]
    finally:
        r.close()
    return out


def window(n_context: int) -> dict:
    r = TorchRunner(model_path("gemma"), n_ctx=n_context + 64, n_slots=1, threads=None)
    ids = r.tokenize((corpus_dir() / "alice.txt").read_text())[:n_context]
    out: dict = {"context_tokens": len(ids), "dtype": r.dtype,
                 "window": max(getattr(layer.attention, "window", 0) for layer in r.model.layers)}  # fmt: skip
    try:
        for name in ("every position", "windowed"):
            r.clear(0)
            r._slot(0)  # a fresh pool's pages (made with their windows), now to set the variant on
            if name == "every position":
                for p in r._pages:
                    p.window = 0
            for i in range(0, len(ids) - 1, r.max_batch):
                r.forward([Piece(0, ids[i : min(i + r.max_batch, len(ids) - 1)], 0)])
            tokens, secs = decode(r, [0], [ids[-1]], 32)
            out[name] = {"kv_bytes": in_use(r), "decode_ms_per_token": 1000 * secs, "tokens": tokens[0]}
            log(f"window {name:14} KV {in_use(r) / 2**20:7.1f} MiB  decode {out[name]['decode_ms_per_token']:.1f} ms/token")
        out["same_tokens"] = out["every position"]["tokens"] == out["windowed"]["tokens"]
        out["kv_ratio"] = out["windowed"]["kv_bytes"] / out["every position"]["kv_bytes"]
    finally:
        r.close()
    return out


@on_compute_thread
def per_sequence(r: TorchRunner, slot: int, policy: ContextPolicy | None = None) -> None:
    """The slot's caches as they were before the pool held them (int8 codes, StreamingLLM):
    stores of its own."""
    r.clear(slot, policy)
    r._caches[slot] = r.new_caches(policy)  # no slot: not the pool's


def pool_against_stores(r: TorchRunner, ids: list[int], what: str, out: dict,
                        policy: ContextPolicy | None = None, slots: int = 1) -> dict:  # fmt: skip
    """Each of `slots` slots reads ids[:-1] (in the runner's chunks), then they decode 32
    tokens greedily together: with stores of their own (`per_sequence`: a row attends alone),
    then in the pool (one attention call for every row). Fills `out` with each one's KV bytes
    (every slot's caches: blocks, a KIVI ring, stores), median decode ms per step and tokens
    (slot 0's, and what it holds), whether the tokens agree and the pool's speedup; the runner
    is closed."""
    rows = list(range(slots))
    try:
        for name in ("stores", "pool"):
            for s in rows:
                if name == "stores":
                    per_sequence(r, s, policy)
                else:
                    r.clear(s, policy)
                r.forward([Piece(s, ids[:-1], 0)])  # a policy's chunks: the window forgets
            kv = sum(c.nbytes for s in rows for c in r._caches[s])
            tokens, secs = decode(r, rows, [ids[-1]] * slots, 32)
            out[name] = {"kv_bytes": kv, "decode_ms_per_token": 1000 * secs, "tokens": tokens[0],
                         "held": r.held(0)}  # fmt: skip
            log(f"{what:6} {name:14} KV {kv / 2**20:7.1f} MiB  decode {1000 * secs:.1f} ms a step of {slots}")
        out["same_tokens"] = out["stores"]["tokens"] == out["pool"]["tokens"]
        out["speedup"] = out["stores"]["decode_ms_per_token"] / out["pool"]["decode_ms_per_token"]
    finally:
        r.close()
    return out


def codes(n_context: int) -> dict:
    r = TorchRunner(model_path("smollm2"), n_ctx=n_context + 64, n_slots=1, threads=None, kv_cache="int8")
    ids = r.tokenize((corpus_dir() / "alice.txt").read_text())[:n_context]
    return pool_against_stores(r, ids, "codes", {"context_tokens": len(ids), "dtype": r.dtype, "kv": "int8"})


def streaming(n_context: int, sinks: int, window: int) -> dict:
    r = TorchRunner(model_path("smollm2"), n_ctx=sinks + window, n_slots=1, threads=None)
    ids = r.tokenize((corpus_dir() / "alice.txt").read_text())[:n_context]
    policy = ContextPolicy(sinks, window)
    out: dict = {"context_tokens": len(ids), "dtype": r.dtype, "kv": "f16", "sinks": sinks, "window": window}
    pool_against_stores(r, ids, "stream", out, policy)
    out["pool, compiled"] = compiled("stream", 1, ids, policy, n_ctx=sinks + window)
    return out


def compiled(what: str, slots: int, ids: list[int], policy: ContextPolicy | None = None, **kw) -> dict:
    """The pool's slots through the compiled step: each reads ids[:-1], then they decode 32
    tokens greedily together (the first steps compile: the median leaves them out)."""
    r = TorchRunner(model_path("smollm2"), n_slots=slots, threads=None, compile="on", **kw)
    try:
        for s in range(slots):
            r.clear(s, policy)
            r.forward([Piece(s, ids[:-1], 0)])
        tokens, secs = decode(r, list(range(slots)), [ids[-1]] * slots, 32)
        assert r._compiled is not None and r._compiled.calls == 32
        log(f"{what:6} {'pool, compiled':14}                decode {1000 * secs:.1f} ms a step of {slots}")
        return {"decode_ms_per_token": 1000 * secs, "tokens": tokens[0]}
    finally:
        r.close()


def kivi(n_context: int, slots: int) -> dict:
    """KIVI's int4 keys and values at one slot and at `slots`: pool against stores, then the
    pool through the compiled step."""
    out: dict = {}
    for n in (1, slots):
        r = TorchRunner(model_path("smollm2"), n_ctx=n_context + 64, n_slots=n, threads=None, kv_cache="int4")
        ids = r.tokenize((corpus_dir() / "alice.txt").read_text())[:n_context]
        got = out[f"{n} slots"] = {"context_tokens": len(ids), "dtype": r.dtype, "kv": "int4"}
        pool_against_stores(r, ids, "kivi", got, slots=n)
        got["pool, compiled"] = compiled("kivi", n, ids, n_ctx=n_context + 64, kv_cache="int4")
    return out


def h2o(n_context: int, budget: int, slots: int) -> dict:
    """H2O (`--evict h2o:budget`, f16 keys) at one slot and at `slots`: pool against stores."""
    out: dict = {}
    for n in (1, slots):
        r = TorchRunner(model_path("smollm2"), n_ctx=n_context + 64, n_slots=n, threads=None,
                        evict=f"h2o:{budget}")  # fmt: skip
        ids = r.tokenize((corpus_dir() / "alice.txt").read_text())[:n_context]
        got = out[f"{n} slots"] = {"context_tokens": len(ids), "dtype": r.dtype, "kv": "f16", "budget": budget}
        pool_against_stores(r, ids, "h2o", got, slots=n)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--prefix", type=int, default=2000)
    ap.add_argument("--slots", type=int, default=4)
    ap.add_argument("--context", type=int, default=2000)
    ap.add_argument("--stream", type=int, default=3000)
    ap.add_argument("--window", type=int, default=1020)
    ap.add_argument("--budget", type=int, default=1024, help="H2O's tokens per layer and head")
    ap.add_argument("--only", default="", help="comma-separated sections (default: all)")
    ap.add_argument("--quick", action="store_true")
    a = ap.parse_args()
    if a.quick:
        a.prefix, a.slots, a.context, a.stream, a.window, a.budget = 300, 2, 700, 600, 252, 256
    sections = {"prefix": (prefix, a.prefix, a.slots), "window": (window, a.context),
                "codes": (codes, a.context), "streaming": (streaming, a.stream, 4, a.window),
                "kivi": (kivi, a.context, a.slots), "h2o": (h2o, a.context, a.budget, a.slots)}  # fmt: skip
    only = [x for x in a.only.split(",") if x] or list(sections)
    data = {}
    if a.only and results_path("kv_pool", a.quick).exists():  # the other sections as they were
        data = {k: v for k, v in json.loads(results_path("kv_pool", a.quick).read_text()).items()
                if k in sections}  # fmt: skip
    save("kv_pool", data | {name: alone(*sections[name]) for name in only}, quick=a.quick)


def alone(section, *args):
    """A section in a process of its own. In one process, the codes section's decode measured
    27-32 ms/token after the prefix section against 15-17 alone (both variants alike; the cause
    not found: no thread left busy, no runner left alive, glibc's trim and mmap thresholds
    pinned changed nothing), so sections do not share one."""
    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
        return pool.submit(section, *args).result()


if __name__ == "__main__":
    main()
