"""Slots' caches as rows of one shared buffer per layer (`cache.Rows`): a decode step of several
slots attends in one call, and each row gets the very bits it gets alone, whatever steps beside
it (the engine's batches must not change what a seeded sequence samples); the rows grow
together, are counted once, and are freed when every slot is cleared."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from conftest import need

need("torch", "pip install -e '.[dev]' (torch: pip install torch==2.13.0 first)")

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from localllm.backends.base import Piece  # noqa: E402
from localllm.backends.torch.cache import KVCache, Rows  # noqa: E402
from localllm.backends.torch.models import base  # noqa: E402
from localllm.backends.torch.runner import TorchRunner  # noqa: E402
from localllm.errors import LocalLLMError  # noqa: E402

ORDER = (3, 1, 0, 7, 6, 2, 5, 4)  # the caller's order of the slots: not the slots' own


def prompts(lengths: list[int], seed: int = 0) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [[int(t) for t in rng.integers(0, 1000, n)] for n in lengths]


def alone_and_beside(r: TorchRunner, lengths: list[int], steps: int) -> tuple[int, int]:
    """Prompts of `lengths[slot]` tokens in every slot; `steps` decode steps of all the slots
    together, then (after the same prompts again) of each slot alone. Returns (rows compared,
    rows that differ in any bit), and checks that the shared-rows path was the one taken."""
    ps = prompts(lengths)
    tokens = prompts([steps] * len(lengths), seed=1)
    calls: list[int] = []
    real = base._attend_rows

    def spy(q, *args, **kwargs):  # type: ignore[no-untyped-def]
        calls.append(q.shape[0])
        return real(q, *args, **kwargs)

    def prefill() -> np.ndarray:
        for s in range(r.n_slots):
            r.clear(s)
        return r.forward([Piece(s, p, 1) for s, p in enumerate(ps)]).logits

    first = prefill()
    base._attend_rows = spy
    try:
        together = [r.forward([Piece(s, [tokens[s][i]], 1) for s in ORDER]).logits
                    for i in range(steps)]  # fmt: skip
    finally:
        base._attend_rows = real
    assert calls == [r.n_slots] * (r.n_layers * steps)  # one call per layer for every row
    assert np.array_equal(prefill(), first)
    compared = differ = 0
    base._attend_rows = spy
    try:
        for s in range(r.n_slots):
            for i in range(steps):
                alone = r.forward([Piece(s, [tokens[s][i]], 1)]).logits
                compared += 1
                differ += not np.array_equal(alone[0], together[i][ORDER.index(s)])
    finally:
        base._attend_rows = real
    assert calls[r.n_layers * steps :] == [1] * (r.n_layers * steps * r.n_slots)  # the same path
    assert [r.held(s) for s in range(r.n_slots)] == [n + steps for n in lengths]
    return compared, differ


# f32 weights go through MKL, whose kernels round one row otherwise than eight (`RowsApart`);
# f16 weights through fbgemm, which does not (its batched products are kept); f16 and f32 keys
LENGTHS = [5, 37, 120, 64, 63, 200, 1, 129]  # one and several key blocks, block edges


@pytest.mark.parametrize(("dtype", "kv"), [("f32", "f32"), ("f32", "f16"), ("f16", "f16"),
                                           ("f32", "int8"), ("f16", "k=fp8,v=f16")])  # fmt: skip
def test_a_slot_decodes_the_same_bits_alone_and_beside_seven(tiny_llama: Path, dtype: str,
                                                               kv: str) -> None:  # fmt: skip
    r = TorchRunner(tiny_llama, n_ctx=256, n_slots=8, dtype=dtype, kv_cache=kv, threads=2)
    try:
        assert alone_and_beside(r, LENGTHS, steps=4) == (32, 0)
    finally:
        r.close()


def test_the_real_model_decodes_the_same_bits_alone_and_beside_seven(
    default_model_path: Path,
) -> None:
    """SmolLM2 on the CPU's default path (int4 feed-forward, fp16 elsewhere, f16 keys), past the
    rows' first 256-token allocation."""
    r = TorchRunner(default_model_path, n_ctx=512, n_slots=8, dtype="int4", threads=2)
    try:
        assert alone_and_beside(r, [300, 2, 70, 64, 11, 129, 190, 33], steps=2) == (16, 0)
    finally:
        r.close()


def test_decode_attention_over_rows_matches_sdpa_and_ignores_the_batch() -> None:
    """`_attend_rows` against SDPA over each row's own keys (to float32 rounding), and each row's
    bits the same in any subset of the rows, in any order, with a window or without."""
    g = torch.Generator().manual_seed(3)
    n_slots, kv, h, hd = 6, 2, 6, 16
    lengths = [250, 3, 64, 65, 128, 1]
    for window in (0, 50):
        rows = Rows(n_slots, kv, hd, 1024, dtype=torch.float16)
        caches = [
            KVCache(kv, hd, 1024, dtype=torch.float16, rows=rows, slot=s) for s in range(n_slots)
        ]
        for c, n in zip(caches, lengths):
            c.update_and_fetch(torch.randn(1, kv, n, hd, generator=g).half(),
                               torch.randn(1, kv, n, hd, generator=g).half())  # fmt: skip
        q = torch.randn(n_slots, 1, h, hd, generator=g)
        k, v = (
            torch.randn(n_slots, 1, kv, hd, generator=g),
            torch.randn(n_slots, 1, kv, hd, generator=g),
        )
        everyone = base._attend_rows(q, k, v, caches, window=window, scale=None)
        for c in caches:
            c.trim(1)
        for subset in ([4], [0, 5], [5, 2, 0], [1, 3, 4, 2]):
            at = torch.tensor(subset)
            some = base._attend_rows(q[at], k[at], v[at], [caches[i] for i in subset],
                                     window=window, scale=None)  # fmt: skip
            assert torch.equal(some, everyone[at]), (window, subset)
            for c in (caches[i] for i in subset):
                c.trim(1)
        for i, c in enumerate(caches):
            n = c.offset + 1  # with the step's key
            kk, vv = (x.float() for x in rows.read(i, n))
            mask = (torch.arange(n) >= n - window)[None] if window else None  # (T, L)
            want = F.scaled_dot_product_attention(q[i : i + 1].transpose(1, 2), kk, vv, attn_mask=mask,
                                                  enable_gqa=True)  # fmt: skip
            assert torch.allclose(everyone[i], want.reshape(1, -1), atol=1e-5), (window, i)


def pooled_and_alone(types: tuple[str, str], kv: int, hd: int, capacity: int) -> tuple:
    """(codecs, the pool, slot 1's cache in it, a per-sequence quantized cache) of these K and V
    types, at the same bytes per token."""
    from localllm.backends.torch.kvquant import QuantizedKVCache, codec, make_store

    codecs = (codec(types[0], key=True), codec(types[1], key=False))
    rows = Rows(2, kv, hd, capacity, dtype=torch.float32, codecs=codecs)
    pooled = KVCache(kv, hd, capacity, dtype=torch.float32, rows=rows, slot=1)
    alone = QuantizedKVCache(*(make_store(t, key=key, n_kv=kv, head_dim=hd, capacity=capacity,
                                          out_dtype=torch.float32)
                               for t, key in zip(types, (True, False))))  # fmt: skip
    assert pooled.bytes_per_token() == alone.bytes_per_token()
    return codecs, rows, pooled, alone


@pytest.mark.parametrize("types", [("int8", "int8"), ("fp8", "fp8"), ("int8", "f16"), ("f32", "fp8")])
def test_a_pool_of_codes_holds_what_the_quantized_cache_holds(types: tuple[str, str]) -> None:
    """int8 and fp8 keys and values in the paged pool (`Rows` with codecs): a slot reads back bit
    for bit what the per-sequence quantized cache of the same types (`kvquant`) gives, at the
    same bytes per token; decode attention reads the codes as their blocks are gathered, and
    equals SDPA over what the slot reads (float32 rounding); a copied block is the same codes."""
    g = torch.Generator().manual_seed(11)
    kv, h, hd = 2, 6, 16
    codecs, rows, pooled, alone = pooled_and_alone(types, kv, hd, 1024)
    for n in (1, 62, 3, 70, 1):  # across block edges
        k = torch.randn(1, kv, n, hd, generator=g) * torch.rand(1, kv, n, 1, generator=g) * 5
        v = torch.randn(1, kv, n, hd, generator=g)
        got, want = pooled.update_and_fetch(k, v), alone.update_and_fetch(k, v)
        for a, b in zip(got, want):
            assert a.dtype == b.dtype and torch.equal(a.float(), b.float()), n
    assert rows.k.dtype == codecs[0].parts(hd, 1)[0][2] and len(rows.k_parts) == len(codecs[0].parts(hd, 1))
    q = torch.randn(1, 1, h, hd, generator=g)
    k, v = torch.randn(1, 1, kv, hd, generator=g), torch.randn(1, 1, kv, hd, generator=g)
    out = base._attend_rows(q, k, v, [pooled], window=0, scale=None)
    kk, vv = (x.float() for x in rows.read(1, pooled.offset))  # the step's key too, as stored
    want = F.scaled_dot_product_attention(q.transpose(1, 2), kk, vv, enable_gqa=True)
    assert torch.allclose(out, want.transpose(1, 2).reshape(1, 1, -1), atol=1e-5)
    b = rows.pages.tables[1][0]
    other = rows.pages.spare()  # a block no slot holds
    rows.copy(b, other, 0, 64)
    assert all(torch.equal(p[b], p[other]) for p in (*rows.k_parts, *rows.v_parts))


@pytest.mark.parametrize("types", [("int4", "int4"), ("int2", "int4")])
def test_a_pool_of_kivi_codes_holds_what_the_quantized_cache_holds(types: tuple[str, str]) -> None:
    """KIVI's int4/int2 in the paged pool: a block is coded once 128 positions follow it, its
    floats kept in the slot's ring until then (and the last coded block's after). Through
    pieces of every size (a 300-token one codes blocks it wrote whole), decode steps and
    rollbacks, a slot reads back bit for bit what the per-sequence store (`kvquant.Store`)
    fetches; a rollback of up to one block is exact, a deeper one reopens blocks from their codes
    and says so; decode attention over rows (what a compiled step runs) reads the coded blocks
    and the ring's and equals SDPA over what the slot reads."""
    g = torch.Generator().manual_seed(11)
    kv, h, hd = 2, 6, 64
    _, rows, pooled, alone = pooled_and_alone(types, kv, hd, 2048)

    def same() -> None:
        got = rows.read(1, pooled.offset)
        assert all(torch.equal(a, b) for a, b in zip(got, (alone.k.fetch(), alone.v.fetch())))

    for n in (1, 62, 3, 70, 1, 300, 5, 64, 128, 1):  # across block edges and the residual's
        k = torch.randn(1, kv, n, hd, generator=g) * torch.rand(1, kv, n, 1, generator=g) * 5
        v = torch.randn(1, kv, n, hd, generator=g)
        got, want = pooled.update_and_fetch(k, v), alone.update_and_fetch(k, v)
        assert all(a.dtype == b.dtype and torch.equal(a, b) for a, b in zip(got, want)), n
    assert rows._coded[1] == (pooled.offset - 128) // 64 == 7
    assert pooled.exact(64) and pooled.trim(64) == alone.trim(64) == 64  # reopens one block: exact
    same()
    assert rows._coded[1] == 6 and not pooled.exact(128)  # its originals are gone
    for step in range(140):  # decode steps: one block coded past the residual, then a rollback
        q = torch.randn(1, 1, h, hd, generator=g)
        k, v = torch.randn(1, 1, kv, hd, generator=g), torch.randn(1, 1, kv, hd, generator=g)
        out = base._attend_rows(q, k, v, [pooled], window=0, scale=None)
        alone.update_and_fetch(k.transpose(1, 2), v.transpose(1, 2))
        same()
        kk, vv = (x.float() for x in rows.read(1, pooled.offset))
        want = F.scaled_dot_product_attention(q.transpose(1, 2), kk, vv, enable_gqa=True)
        assert torch.allclose(out, want.transpose(1, 2).reshape(1, 1, -1), atol=1e-5), step
        if step == 100:
            assert pooled.trim(3) == alone.trim(3)
            same()
    assert rows._coded[1] == (pooled.offset - 128) // 64 == 9
    pooled.trim(200)  # past the ring: blocks decoded from their codes, as the store does
    alone.trim(200)
    same()
    rows.pages.release(1)  # the slot lets go: its ring is forgotten
    assert rows._coded[1] == 0 and rows._ring_of[1] == [-1] * 4


def test_a_pool_refuses_mixed_grouped_codes() -> None:
    from localllm.backends.torch.kvquant import codec

    with pytest.raises(ValueError, match="for both keys and values"):
        Rows(1, 1, 64, 64, dtype=torch.float32, codecs=(codec("int4", key=True), codec("f16", key=False)))


def test_each_slot_holds_the_blocks_its_positions_fill() -> None:
    # 250 + 12 crosses a 64-position block: slot 2 takes a fifth block, slot 0 keeps its one;
    # the pool grows (doubling its blocks) without moving what the slots hold
    g = torch.Generator().manual_seed(3)
    rows = Rows(3, 2, 8, 1024, dtype=torch.float32)
    lengths = {2: 250, 0: 3}
    shared = [KVCache(2, 8, 1024, dtype=torch.float32, rows=rows, slot=s) for s in lengths]
    alone = [KVCache(2, 8, 1024, dtype=torch.float32) for _ in lengths]
    for a, b, n in zip(shared, alone, lengths.values()):
        k, v = torch.randn(1, 2, n, 8, generator=g), torch.randn(1, 2, n, 8, generator=g)
        a.update_and_fetch(k, v)
        b.update_and_fetch(k, v)
    assert [len(t) for t in rows.pages.tables] == [1, 0, 4] and rows.allocated == 10  # 1 + 4, doubled
    for _ in range(12):
        q = torch.randn(2, 1, 4, 8, generator=g)
        k, v = torch.randn(2, 1, 2, 8, generator=g), torch.randn(2, 1, 2, 8, generator=g)
        masks = base.Masks([c.offset for c in shared], 1, q.device)
        together = base.attend(q, k, v, shared, masks)
        each = [base.attend(q[i : i + 1], k[i : i + 1], v[i : i + 1], [alone[i]],
                            base.Masks([alone[i].offset], 1, q.device)) for i in range(2)]  # fmt: skip
        assert torch.allclose(together, torch.cat(each), atol=1e-6)
    assert [c.offset for c in shared] == [262, 15]
    empty = KVCache(2, 8, 1024, dtype=torch.float32, rows=rows, slot=1)  # a slot with nothing yet
    assert [tuple(x.shape) for x in empty.state] == [(1, 2, 0, 8)] * 2  # type: ignore[union-attr]
    assert [len(t) for t in rows.pages.tables] == [1, 0, 5] and rows.allocated == 10
    for a, b in zip(shared, alone):
        assert torch.equal(a.state[0], b.state[0]) and torch.equal(a.state[1], b.state[1])


def test_rows_are_counted_once_and_freed_when_every_slot_is_cleared(tiny_llama: Path) -> None:
    r = TorchRunner(tiny_llama, n_ctx=256, n_slots=4, dtype="f32", kv_cache="f32", threads=2)
    assert r._rows is None and r.kv_bytes() == 0
    r.forward([Piece(1, [1, 2, 3], 0), Piece(3, [4, 5], 0)])
    rows = r._rows
    assert rows is not None and len(rows) == r.n_layers
    a = r.model.args
    block = 2 * a.n_kv_heads * 64 * a.head_dim * 4  # K and V, 64 positions, f32
    # the pool: the zero block and four more (256 positions), once for all slots, per layer
    assert r.kv_bytes() == len(rows) * 5 * block
    assert sum(c.nbytes for c in r._caches[1]) == len(rows) * block  # the one block slot 1 holds
    r.clear(1)
    assert r._rows is rows and r.held(1) == 0 and r.held(3) == 2  # slot 3 still holds its block
    assert rows[0].pages.tables[1] == [] and len(rows[0].pages.free) == 3
    r.clear(3)
    assert r._rows is None and r.kv_bytes() == 0
    r.forward([Piece(0, [1, 2, 3], 1)])  # rows again, as the slot's next tokens need them
    assert r._rows is not None and r.held(0) == 3
    r.close()
    assert r._rows is None and r.kv_bytes() == 0 and all(not cs for cs in r._caches)


def test_a_window_is_part_of_the_rows_mask() -> None:
    """A window that hides keys (Gemma's local layers) no longer sends the rows one by one:
    the mask hides them, as SDPA's windowed mask does row by row."""
    g = torch.Generator().manual_seed(5)
    rows = Rows(2, 1, 4, 64, dtype=torch.float32)
    caches = [KVCache(1, 4, 64, dtype=torch.float32, rows=rows, slot=s) for s in (0, 1)]
    alone = [KVCache(1, 4, 64, dtype=torch.float32) for _ in (0, 1)]
    for c, a, n in zip(caches, alone, (10, 3)):
        kv = torch.randn(1, 1, n, 4, generator=g), torch.randn(1, 1, n, 4, generator=g)
        c.update_and_fetch(*kv)
        a.update_and_fetch(*kv)
    q = torch.randn(2, 1, 2, 4, generator=g)
    k, v = torch.randn(2, 1, 1, 4, generator=g), torch.randn(2, 1, 1, 4, generator=g)
    out = base._attend_rows(q, k, v, caches, window=8, scale=None)
    assert out.shape == (2, 1, 8) and [c.offset for c in caches] == [11, 4]
    each = [base.attend(q[i : i + 1], k[i : i + 1], v[i : i + 1], [alone[i]],
                        base.Masks([alone[i].offset], 1, q.device), window=8) for i in (0, 1)]  # fmt: skip
    assert torch.allclose(out, torch.cat(each), atol=1e-6)


def test_a_piece_of_a_few_tokens_attends_as_that_many_decode_steps() -> None:
    """A speculative verification (k + 1 tokens of one slot) gets for each token the bits a
    decode step gives it (`QUERIES_AS_ROWS`): greedy text must not depend on speculation."""
    g = torch.Generator().manual_seed(5)
    kv, h, hd, t = 2, 6, 16, 5
    for window in (0, 40):
        rows = Rows(2, kv, hd, 512, dtype=torch.float16)
        caches = [KVCache(kv, hd, 512, dtype=torch.float16, rows=rows, slot=s) for s in range(2)]
        for c, n in zip(caches, (130, 7)):
            c.update_and_fetch(torch.randn(1, kv, n, hd, generator=g).half(),
                               torch.randn(1, kv, n, hd, generator=g).half())  # fmt: skip
        q = torch.randn(2, t, h, hd, generator=g)
        k, v = torch.randn(2, t, kv, hd, generator=g), torch.randn(2, t, kv, hd, generator=g)
        together = base._attend_rows(q, k, v, caches, window=window, scale=None)  # (2, T, H * hd)
        assert [c.offset for c in caches] == [130 + t, 7 + t]
        for c in caches:
            c.trim(t)
        for j in range(t):  # the same tokens, one decode step at a time
            step = base._attend_rows(q[:, j : j + 1], k[:, j : j + 1], v[:, j : j + 1], caches,
                                     window=window, scale=None)  # fmt: skip
            assert torch.equal(step[:, 0], together[:, j]), (window, j)
        # and it is attention: causal over each row's keys, to float32 rounding
        n = caches[0].offset
        kk, vv = (x.float() for x in caches[0].state)  # type: ignore[union-attr]
        diff = torch.arange(n - t, n)[:, None] - torch.arange(n)[None]
        mask = (diff >= 0) & ((diff < window) if window else True)
        want = F.scaled_dot_product_attention(q[0:1].transpose(1, 2), kk, vv, attn_mask=mask, enable_gqa=True)
        assert torch.allclose(together[0], want.transpose(1, 2).reshape(t, -1), atol=1e-5), window


def test_greedy_text_is_the_same_plain_with_lookup_and_beside_seven_in_the_default_precision() -> None:
    """The default model in the CPU's default precision (int4 feed-forward, fp16 elsewhere, f16
    keys): a grounded answer (lookup drafts, some accepted, some rejected) gives plain greedy's
    tokens with `--speculative lookup` and among eight streams (they differed before verification
    attended query by query: measured, plain and lookup parted at token 20 of a
    grounded answer)."""
    from localllm.engine import load
    from localllm.types import LoadOptions, Request, SamplingParams

    from conftest import CORPUS

    text = (CORPUS / "alice.txt").read_text()
    prompts = [f"Read this and then repeat its first paragraph exactly.\n\n{text[:2500]}",
               f"{text[1200:1700]}\n\nRepeat the text above exactly."]  # fmt: skip

    def req(p: str, spec: str) -> Request:
        return Request(messages=({"role": "user", "content": p},), speculative=spec,
                       sampling=SamplingParams(temperature=0, max_tokens=48))  # fmt: skip

    with load("smollm2", LoadOptions(backend="torch", parallel=8, ctx=1024)) as llm:
        assert llm.runner.dtype == "int4"
        plains = [llm.submit(req(p, "off")).wait().token_ids for p in prompts]
        for p, plain in zip(prompts, plains):
            look = llm.submit(req(p, "lookup")).wait()
            assert look.speculative is not None and look.speculative.rejections > 0  # it verified
            assert look.token_ids == plain
        streams = [llm.submit(req(prompts[i % 2], "off")) for i in range(8)]
        assert [s.wait().token_ids for s in streams] == plains * 4


def test_no_block_leaks_after_a_thousand_mixed_requests(tiny_llama: Path) -> None:
    """Prompts of 1-150 tokens, decode steps of several slots together, speculative-style trims,
    clears at any point, prefix spans saved, cut and restored into slots (sharing blocks, copied
    on write): every block comes back to the pool, and each is counted once per holder."""
    r = TorchRunner(tiny_llama, n_ctx=256, n_slots=4, dtype="f32", kv_cache="f32", threads=2)
    rng = np.random.default_rng(7)
    try:
        spans: list = []  # a kept prefix, cut in two as the tree cuts an edge
        for _ in range(1000):
            s = int(rng.integers(0, 4))
            op = rng.random()
            if op < 0.3 or r.held(s) == 0:  # a new request
                r.clear(s)
                n = int(rng.integers(1, 150))
                r.forward([Piece(s, [int(t) for t in rng.integers(0, 100, n)], 1)])
            elif op < 0.7:  # decode steps of the slots that hold something
                live = [x for x in range(4) if 0 < r.held(x) < 250]
                if live:
                    r.forward([Piece(x, [int(rng.integers(0, 100))], 1) for x in live])
            elif op < 0.8:
                r.trim(s, int(rng.integers(0, r.held(s) + 1)))
            elif op < 0.9:  # a prefix kept (sharing the slot's blocks)
                for h in spans:
                    r.release(h)
                whole = r.save(s, 0, r.held(s))
                spans = list(r.split(whole, int(rng.integers(0, r.held(s) + 1))))
                r.release(whole)
            elif spans:  # restored (the second span in part), then written past
                head, tail = spans
                r.restore(s, [(head, head.end), (tail, int(rng.integers(0, tail.end - tail.start + 1)))])
            else:
                r.clear(s)
        pages = r._rows[0].pages if r._rows else None
        assert pages is not None
        kept = [b for h in spans for b in h.spans[0].blocks]
        held = {b for x in range(4) if r._caches[x] for b in pages.tables[x]}
        assert pages.used == len(held | set(kept))
        assert all(pages.refs[b] == sum(t.count(b) for t in pages.tables) + kept.count(b)
                   for b in range(1, pages.n_blocks))  # fmt: skip
        for s in range(4):
            r.clear(s)
        assert r._rows is not None and pages.used == len(set(kept))  # the spans keep their blocks
        for h in spans:
            r.release(h)
        assert r._rows is None  # every slot empty, no span: the pool is gone
        assert len(pages.free) == pages.n_blocks - 1 and pages.used == 0  # all but the zero block
    finally:
        r.close()


def test_a_restored_prefix_shares_its_blocks_and_writes_never_reach_another_sequence(
    tiny_llama: Path,
) -> None:
    """A saved prefix is the slot's blocks, not a copy; three slots restored from it (one in
    part, one from two spans that meet inside a block) and the slot it came from each write on
    past it: each gets the logits a fresh evaluation of its own tokens gives, and the span still
    holds what it held (a slot writing into a shared block writes into its own copy of it)."""
    r = TorchRunner(tiny_llama, n_ctx=256, n_slots=4, dtype="f32", kv_cache="f32", threads=2)
    fresh = TorchRunner(tiny_llama, n_ctx=256, n_slots=1, dtype="f32", kv_cache="f32", threads=2)
    p, x0, x1, x2, x3 = prompts([100, 9, 9, 9, 9], seed=4)

    def alone(tokens: list[int], tail: list[int]) -> np.ndarray:
        fresh.clear(0)
        fresh.forward([Piece(0, tokens, 0)])
        return fresh.forward([Piece(0, tail, 1)]).logits

    try:
        r.forward([Piece(0, p, 0)])
        pages = r._rows[0].pages  # type: ignore[index]
        before = pages.used
        whole = r.save(0, 0, 100)
        kept = [x.clone() for x in r._caches[0][1].state]  # layer 1's keys and values
        assert pages.used == before and whole.spans[0].blocks == pages.tables[0]  # shared, no copy
        head, tail = r.split(whole, 40)  # the tree cuts the edge inside the first block
        assert r.restore(1, [(whole, 100)]) and r.restore(2, [(whole, 70)])
        assert r.restore(3, [(head, 40), (tail, 60)])
        assert pages.tables[1] == pages.tables[0] and pages.tables[2] == pages.tables[0][:2]
        assert pages.tables[3][1] == pages.tables[0][1] != pages.tables[3][0]  # 40 | 60 met in block 0
        assert pages.used == before + 1  # that one block is all the restores made
        out = r.forward([Piece(0, x0, 1), Piece(1, x1, 1), Piece(2, x2, 1), Piece(3, x3, 1)]).logits
        want = [alone(p, x0), alone(p, x1), alone(p[:70], x2), alone(p, x3)]
        for got, w in zip(out, want):
            assert np.abs(got - w[0]).max() <= 1e-5
        # block 1 (positions 64-127) was written by all four: four copies of it, the span's untouched
        assert len({pages.tables[s][1] for s in range(4)} | {whole.spans[0].blocks[1]}) == 5
        assert all(pages.tables[s][0] == whole.spans[0].blocks[0] for s in (0, 1, 2))  # never written
        assert all(torch.equal(a, b) for a, b in zip(r._rows[1].gather(whole.spans[0].blocks, 100), kept))  # type: ignore[index]
        for h in (whole, head, tail):
            r.release(h)
        for s in range(4):
            r.clear(s)
        assert r._rows is None
    finally:
        r.close()
        fresh.close()


def test_out_of_blocks_is_a_wait_for_room_never_a_crash(tiny_llama: Path) -> None:
    """A pool of 3 blocks (192 positions) for 4 slots: of four requests of ~100-token prompts
    (two blocks each, with the answer) one holds its blocks at a time. Those that find no room wait (first in line) until another
    ends; every one gets the greedy tokens it gets alone. A request that cannot fit even alone
    fails in one line, and the others go on."""
    from localllm.engine.core import Model
    from localllm.types import LoadOptions, Request, SamplingParams

    words = "the cat sat on a mat and looked at the dog who ran round the garden after a ball "
    prompts_ = [f"{i} {words * 5}" for i in range(4)]
    greedy = SamplingParams(temperature=0, max_tokens=24)
    alone_r = TorchRunner(tiny_llama, n_ctx=512, n_slots=1, dtype="f32", kv_cache="f32", threads=2)
    with Model(alone_r, "alone") as m:
        want = [m.submit(Request(prompt=p, sampling=greedy)).wait().token_ids for p in prompts_]
    r = TorchRunner(tiny_llama, n_ctx=512, n_slots=4, dtype="f32", kv_cache="f32", threads=2,
                    kv_blocks=3)  # fmt: skip
    assert 64 < len(r.tokenize(prompts_[0])) < 128  # two blocks each, with its answer
    with Model(r, "tight", options=LoadOptions(parallel=4)) as m:
        streams = [m.submit(Request(prompt=p, sampling=greedy)) for p in prompts_]
        assert [s.wait().token_ids for s in streams] == want
        assert m._deferred == [] and not m._room_wait
        big = m.submit(Request(prompt=words * 11, sampling=greedy))  # ~200 tokens: 4 blocks
        small = m.submit(Request(prompt=prompts_[1], sampling=greedy))
        with pytest.raises(LocalLLMError, match="KV pool's 3 blocks .* this request does not fit"):
            big.wait()
        assert small.wait().token_ids == want[1]


@pytest.fixture(scope="module")
def tiny_gemma(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """test_models' tiny Gemma 3 (local layers of window 16, one global), as a GGUF file."""
    need("transformers", "pip install -e '.[dev]'")
    need("gguf", "pip install -e '.[dev]'")
    from backends.torch.test_models import hf_model, write_gguf

    return write_gguf(hf_model("gemma3"), tmp_path_factory.mktemp("gemma") / "gemma3.gguf")


def test_sliding_window_layers_keep_only_their_window(tiny_gemma: Path) -> None:
    """Gemma 3's local layers (window 16) have pages of their own that give back each block no
    query from the slot's next position can see: two slots, prompts in chunks, then decode steps
    together and a speculative-style trim, give the logits of the model over plain caches (its
    attention is oracle-checked against transformers, test_models); the local layers hold the
    last block or two while the global one holds every position. A trim back past a dropped
    block is not exact (the slot is cleared), and a prefix restores only where its window is
    still held."""
    from localllm.backends.torch.cache import make_caches

    r = TorchRunner(tiny_gemma, n_ctx=256, n_slots=2, max_batch=48, dtype="f32", kv_cache="f32",
                    threads=2)  # fmt: skip
    model, a = r.model, r.model.args
    local = [i for i, layer in enumerate(model.layers) if layer.attention.window]
    assert local and len(local) < a.n_layers and model.layers[local[0]].attention.window == 16
    tokens = [[t % 384 for t in p] for p in prompts([230, 230], seed=9)]  # its vocabulary: 384
    plain = [make_caches(a.n_layers, a.n_kv_heads, a.head_dim, 256, dtype=torch.float32)
             for _ in range(2)]  # fmt: skip

    def want(row: int, lo: int, hi: int) -> torch.Tensor:
        with torch.no_grad():
            x = torch.tensor([tokens[row][lo:hi]])
            return model.logits(model(x, [plain[row]]))[0]

    try:
        for row, n in ((0, 200), (1, 130)):
            got = torch.from_numpy(r.forward([Piece(row, tokens[row][:n], n)]).logits)
            assert (got - want(row, 0, n)).abs().max() <= 1e-4
        for step in range(24):
            at = (200 + step, 130 + step)
            got = r.forward([Piece(row, [tokens[row][at[row]]], 1) for row in (0, 1)]).logits
            for row in (0, 1):
                assert np.abs(got[row] - want(row, at[row], at[row] + 1)[0].numpy()).max() <= 1e-4
        pages = r._rows[local[0]].pages
        glob = r._rows[[i for i in range(a.n_layers) if i not in local][0]].pages
        assert pages is not glob and pages.window == 16 and glob.window == 0
        # 224 held: a query from 224 on sees keys from 209, in block 3; blocks 0-2 are dropped
        assert pages.tables[0][:3] == [0, 0, 0] and pages.first[0] == 3 and pages.tables[0][3]
        assert len(glob.tables[0]) == 4 and all(glob.tables[0])
        assert r.trim(0, 3, exact=True) and r.held(0) == 221  # what a verification rejects
        for c in plain[0]:
            c.trim(3)
        got = r.forward([Piece(0, tokens[0][221:224], 1)]).logits
        assert np.abs(got[0] - want(0, 221, 224)[-1].numpy()).max() <= 1e-4
        saved = r.save(0, 0, 224)
        assert r.restore(1, [(saved, 224)]) and r.held(1) == 224  # the window it needs is held
        assert not r.restore(1, [(saved, 100)]) and r.held(1) == 0  # block 1 was dropped
        assert not r.trim(0, 150, exact=True) and r.held(0) == 0  # back past a dropped block
        r.release(saved)
        r.clear(1)
        assert r._rows is None
    finally:
        r.close()


def test_kivi_codes_beside_sliding_window_layers(tmp_path_factory: pytest.TempPathFactory) -> None:
    """Gemma 3's window-16 local layers with KIVI's int4 in the pool: their pages drop blocks no
    query sees before the residual would code them (a dropped block is not coded: the zero block
    stays zeros), the global layer codes its blocks; decode steps past both give the logits of
    the per-sequence stores, bit for bit."""
    need("transformers", "pip install -e '.[dev]'")
    from backends.torch.test_models import hf_model, write_gguf

    path = write_gguf(hf_model("gemma3"), tmp_path_factory.mktemp("gemma3") / "gemma3.gguf")
    r = TorchRunner(path, n_ctx=256, n_slots=2, dtype="f32", threads=2, kv_cache="int4")
    stores = r.new_caches()
    tokens = [t % r.n_vocab for t in prompts([240], seed=4)[0]]

    def step(toks: list[int]) -> float:
        """|pool - stores| relative to the largest logit (Gemma's reach ~70)."""
        with torch.no_grad():
            want = r.model.logits(r.model(torch.tensor([toks]), [stores]))[0, -1]
        got = torch.from_numpy(r.forward([Piece(0, toks, 1)]).logits[0])
        return float((got - want).abs().max() / want.abs().max())

    # the prompt's last logits: the head over one row here, over every row there (MKL rounds
    # them otherwise: 1e-7 of the largest); its keys and values are the same bits
    assert step(tokens[:150]) <= 1e-6
    assert all(isinstance(c, KVCache) and c.rows.grouped for c in r._caches[0])  # type: ignore[union-attr]
    # eagerly a KIVI row attends alone over what its slot reads (`base._row_groups`): the bits
    # of the store's, step after step
    assert [step([t]) for t in tokens[150:]] == [0.0] * 90
    windows = {rows.pages.window for rows in r._rows}  # type: ignore[union-attr]
    assert 0 in windows and len(windows) == 2
    for rows in r._rows:  # type: ignore[union-attr]
        assert rows._coded[0] == (240 - 128) // 64
        assert not any(p[0].any() for p in (*rows.k_parts, *rows.v_parts))
    r.close()
