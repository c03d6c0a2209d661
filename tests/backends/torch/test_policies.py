"""StreamingLLM and H2O caches (issue 12): positions inside the cache against a direct
recomputation, bounded memory over a generation 4x longer than the cache, and H2O keeping a
heavy hitter made so by construction."""

from __future__ import annotations

import pytest

from conftest import need

need("torch", "pip install -e '.[dev]' (torch: pip install torch==2.13.0 first)")

import torch  # noqa: E402

from localllm.backends.torch.kvquant import make_store  # noqa: E402
from localllm.backends.torch.models.base import Masks, attend  # noqa: E402
from localllm.backends.torch.policies import H2OCache, PagedH2O, StreamingCache, make_caches  # noqa: E402
from localllm.types import ContextPolicy  # noqa: E402

SINKS, WINDOW, N = 2, 8, 40


@pytest.fixture(scope="module", params=["llama", "gemma3"])
def tiny_model(request, tmp_path_factory):
    """A tiny random one-layer model of the family (Gemma 3's: a sliding-window layer, with its
    local RoPE). One layer, because only there a token's cached key and value depend on nothing
    but the token: deeper, StreamingLLM keeps what earlier layers computed over a context since
    forgotten, which a recomputation over the held tokens does not reproduce (the paper compares
    them by perplexity, as bench/kv_cache.py does)."""
    need("transformers", "pip install -e '.[dev]'")
    need("gguf", "pip install -e '.[dev]'")
    from test_models import hf_model, write_gguf

    from localllm.backends.torch.models import build_model
    from localllm.gguf_file import GGUFFile

    path = write_gguf(hf_model(request.param, num_hidden_layers=1),
                      tmp_path_factory.mktemp("t") / "m.gguf")  # fmt: skip
    with GGUFFile(path) as f:
        return build_model(f)


def last_logits(model, tokens, caches) -> torch.Tensor:
    with torch.no_grad():
        return model.logits(model(torch.tensor([tokens]), [caches]))[0, -1]


@pytest.mark.parametrize("kv_types", [("f32", "f32"), ("int8", "int8"), ("fp8", "int8")])
def test_streaming_positions_are_positions_inside_the_cache(tiny_model, kv_types) -> None:
    """Token by token through sinks 2 + window 8 over 40 tokens: at every step the logits equal a
    fresh evaluation of exactly the tokens the cache holds — the sinks, then the newest 8 — at
    positions 0..n-1 (the sliding window with recomputation), through a cache of the same types
    that forgets nothing."""
    tokens = torch.randint(0, 384, (N,), generator=torch.Generator().manual_seed(3)).tolist()
    policy = ContextPolicy(SINKS, WINDOW)
    caches = make_caches(tiny_model, 64, kv_types=kv_types, policy=policy)
    assert all(isinstance(c, StreamingCache) for c in caches)
    worst = 0.0
    for t, tok in enumerate(tokens):
        got = last_logits(tiny_model, [tok], caches)
        held = tokens[: min(SINKS, t + 1)] + tokens[max(SINKS, t + 1 - WINDOW) : t + 1]
        assert caches[0].offset == len(held) == min(t + 1, SINKS + WINDOW)
        fresh = make_caches(tiny_model, 64, kv_types=kv_types, policy=ContextPolicy(SINKS, 60))
        want = last_logits(tiny_model, held, fresh)
        assert want.std() > 0.3
        worst = max(worst, float((got - want).abs().max()))
    assert worst <= 1e-4, worst
    assert caches[0].dropped == N - SINKS - WINDOW


def test_a_window_without_sinks_and_int4_keys(tiny_model) -> None:
    """0 sinks and KIVI int4 keys with a residual smaller than the window (so groups are
    forgotten from the front while partly read): every step still sees exactly the newest 8."""
    torch.manual_seed(0)
    tokens = torch.randint(0, 384, (300,)).tolist()
    a = tiny_model.args

    def caches(window: int):
        out = []
        for layer in range(a.n_layers):
            def pair(size: int, **kw):
                return tuple(make_store(t, key=key, n_kv=a.n_kv_heads, head_dim=a.head_dim,
                                        capacity=size, out_dtype=torch.float32, **kw)
                             for t, key in (("int4", True), ("f32", False)))  # fmt: skip
            out.append(StreamingCache(pair(0), pair(window, residual=2, group=4), n_sinks=0,
                                      n_window=window, rope=tiny_model.rope_for(layer)))  # fmt: skip
        return out

    live = caches(WINDOW)
    for t, tok in enumerate(tokens):
        last_logits(tiny_model, [tok], live)
        assert live[0].offset == min(t + 1, WINDOW)
        assert live[0].win_k.fetch().shape[2] == min(t + 1, WINDOW)
    # the stores stayed bounded: whole dead groups are freed (in batches of 64 tokens) as the
    # window moves, so 300 tokens never needed more than the window and one batch
    assert live[0].win_k._parts[0].shape[2] * 4 <= 2 * (WINDOW + 64)


def test_trim_is_exact_until_the_window_forgets() -> None:
    kv, hd = 2, 16
    from localllm.backends.torch.models.base import RoPE

    def pair(size):
        return tuple(make_store("int8", key=key, n_kv=kv, head_dim=hd, capacity=size,
                                out_dtype=torch.float32) for key in (True, False))  # fmt: skip

    c = StreamingCache(pair(2), pair(6), n_sinks=2, n_window=6, rope=RoPE(hd, 10000.0))
    x = torch.randn(1, kv, 12, hd)
    c.make_room(5)
    c.update_and_fetch(x[:, :, :5], x[:, :, :5])
    c.make_room(2)
    c.update_and_fetch(x[:, :, 5:7], x[:, :, 5:7])
    assert c.exact(2) and c.trim(2) == 2 and c.offset == 5
    c.make_room(3)
    c.update_and_fetch(x[:, :, 5:8], x[:, :, 5:8])  # 8 held: full, nothing forgotten yet
    assert c.make_room(1) == 1
    c.update_and_fetch(x[:, :, 8:9], x[:, :, 8:9])
    assert not c.exact(1) and c.exact(0)
    copy = StreamingCache(pair(2), pair(6), n_sinks=2, n_window=6, rope=RoPE(hd, 10000.0))
    copy.state = c.state
    assert all(torch.equal(a, b) for a, b in zip(copy.update_and_fetch(x[:, :, :0], x[:, :, :0]),
                                                 c.update_and_fetch(x[:, :, :0], x[:, :, :0])))  # fmt: skip


def test_a_generation_4x_longer_than_the_cache_keeps_memory_bounded(tiny_llama) -> None:
    """The runner under --streaming 4:60 with a 64-token context: 256 tokens decode, and once
    the window is full the cache tensors never grow (bytes measured after every step)."""
    from localllm.backends.base import Piece
    from localllm.backends.torch.runner import TorchRunner

    r = TorchRunner(tiny_llama, n_ctx=64, dtype="f32", device="cpu", kv_cache="k=int8,v=int4")
    r.clear(0, ContextPolicy(4, 60))
    f = r.forward([Piece(0, r.tokenize("Once upon a time"), 1)])
    sizes, dropped = [], 0
    for _ in range(256):
        f = r.forward([Piece(0, [int(f.logits[-1].argmax())], 1)])  # never "context full"
        assert f.logits.shape == (1, r.n_vocab)
        dropped += f.shifted.get(0, 0)
        caches = r._caches[0]
        sizes.append(sum(c.nbytes for c in caches))
        assert caches[0].offset == r.held(0) <= 64
        assert r.kv_stats(0)["kv_peak_bytes"] >= sizes[-1]
    full = sizes[70]
    assert max(sizes[70:]) == full, (full, max(sizes))
    assert dropped >= 256 - 64
    r.close()


def test_h2o_keeps_the_heavy_hitter() -> None:
    """One layer, budget 8 (4 recent): token 2's key points where every query looks, so it
    collects most of the attention and must survive 40 steps; a token nobody attends to
    (orthogonal key, its own value) is forgotten."""
    kv, h, hd = 2, 4, 16
    g = torch.Generator().manual_seed(1)
    u = torch.nn.functional.normalize(torch.randn(hd, generator=g), dim=0)
    store = {key: make_store("int8", key=key, n_kv=kv, head_dim=hd, capacity=64,
                             out_dtype=torch.float32) for key in (True, False)}  # fmt: skip
    cache = H2OCache(store[True], store[False], budget=8)
    heavy_v = None
    for t in range(40):
        cache.make_room(1)
        k = torch.randn(1, 1, kv, hd, generator=g) * 0.3
        v = torch.randn(1, 1, kv, hd, generator=g)
        if t == 2:
            k = (u * 6).expand(1, 1, kv, hd).clone()
            heavy_v = v.clone()
        q = (u * 3 + torch.randn(1, 1, h, hd, generator=g) * 0.3)
        masks = Masks([cache.offset], 1, torch.device("cpu"))
        attend(q, k, v, [cache], masks)
        assert len(cache.k) <= 8 and cache.offset == t + 1
    held_v = cache.v.fetch()[0]  # (KV, L, hd)
    assert len(cache.k) == 8 and cache.dropped == 32
    for head in range(kv):  # it is held, and it has the most attention accumulated
        rows = [i for i, row in enumerate(held_v[head])
                if torch.allclose(row, heavy_v[0, 0, head], atol=0.05)]  # fmt: skip
        assert rows == [int(cache.scores[head].argmax())]


def test_h2o_through_the_runner_and_its_refusals(tiny_llama, default_model_path) -> None:
    from localllm.backends.base import Piece
    from localllm.backends.torch.runner import TorchRunner
    from localllm.errors import LocalLLMError

    r = TorchRunner(tiny_llama, n_ctx=128, dtype="f32", device="cpu", kv_cache="int8",
                    evict="h2o:16")  # fmt: skip
    assert r.scoring_chunk == 1 and r.prefix_budget == 0  # it forgets between tokens
    f = r.forward([Piece(0, r.tokenize("Once upon a time there was a dragon"), 1)])
    shifted = 0
    for _ in range(40):
        f = r.forward([Piece(0, [int(f.logits[-1].argmax())], 1)])
        assert f.logits.shape == (1, r.n_vocab)
        shifted += f.shifted.get(0, 0)
    caches = r._caches[0]
    assert all(isinstance(c, PagedH2O) and c.held <= 16 for c in caches)
    assert caches[0].offset == r.held(0) > 40 and shifted == caches[0].dropped > 0
    with pytest.raises(LocalLLMError, match="int4 and int2 caches group them"):
        TorchRunner(tiny_llama, n_ctx=64, kv_cache="int4", evict="h2o:16")


def pool_matched_stores(r, pages, worst: float, spread: float) -> None:
    """How a policy in the pool against its stores ends: logits within f32 rounding at every step
    (the logits spread, so that says something), slot 0 forgot tokens, and once both slots are
    cleared every block is back in the pool."""
    assert worst <= 1e-4 and spread > 0.1, (worst, spread)
    assert r._caches[0][0].dropped > 0
    r.clear(0)
    r.clear(1)
    assert pages.used == 0
    r.close()


@pytest.mark.parametrize(("kv", "sinks", "window"), [("f32", 4, 100), ("f16", 3, 70), ("int8", 0, 90)])
def test_streaming_in_the_pool_is_streaming_in_stores(tiny_llama, kv, sinks, window) -> None:
    """StreamingLLM in the paged pool (issue 33: the sinks and window are the slot's blocks,
    forgetting moves the window's start) against `StreamingCache`'s stores of their own, through
    the runner's model: a prompt in chunks, then 300 tokens one by one (the window forgets from
    token ~100 on, blocks wholly forgotten go back to the pool), a speculative-style trim on the
    way, and a batch beside a plain slot. The logits agree to f32 rounding at every step; the
    slot never holds more blocks than its sinks and window span, and gives them all back."""
    import numpy as np

    from localllm.backends.base import Piece
    from localllm.backends.torch.cache import BLOCK
    from localllm.backends.torch.policies import PagedStreaming
    from localllm.backends.torch.runner import TorchRunner

    r = TorchRunner(tiny_llama, n_ctx=128, n_slots=2, dtype="f32", threads=2, kv_cache=kv)
    policy = ContextPolicy(sinks, window)
    r.clear(0, policy)
    r.clear(1)
    stores = r.new_caches(policy)  # no slot: stores of their own
    assert isinstance(stores[0], StreamingCache)
    tokens = torch.randint(0, 1000, (360,), generator=torch.Generator().manual_seed(1)).tolist()

    def step(toks, with_plain=False):
        want = last_logits(r.model, toks, stores)
        pieces = [Piece(0, toks, 1)] + ([Piece(1, [7], 1)] if with_plain else [])
        got = r.forward(pieces).logits[0]
        return float((torch.from_numpy(got) - want).abs().max()), float(want.std())

    worst, spread = step(tokens[:40])  # a chunk (more than `QUERIES_AS_ROWS`): update_and_fetch
    assert isinstance(r._caches[0][0], PagedStreaming)
    pages = r._rows[0].pages
    most = -(-sinks // BLOCK) + -(-window // BLOCK) + 1
    r.forward([Piece(1, tokens[:5], 0)])
    n = 40  # tokens the slot took since it was last empty
    for i, tok in enumerate(tokens[40:], 40):
        err, sd = step([tok], with_plain=i % 3 == 0)
        n += 1
        worst, spread = max(worst, err), min(spread, sd)
        assert r._caches[0][0].offset == r.held(0) == min(n, sinks + window)
        assert sum(1 for b in pages.tables[0] if b) <= most
        if i == 60:  # a drafted token taken back before the window is full: exact
            before = r.forward([Piece(0, [9], 1)]).logits
            assert r.trim(0, 1, exact=True)
            assert np.array_equal(r.forward([Piece(0, [9], 1)]).logits, before)
            assert r.trim(0, 1, exact=True)
        if i == 200:  # once the window forgets, a draft taken back is not exact: the slot
            for t in (5, 6, 7):  # starts afresh (its policy kept)
                r.forward([Piece(0, [t], 1)])
            assert not r.trim(0, 3, exact=True) and r.held(0) == 0
            stores[:] = r.new_caches(policy)
            err, sd = step(tokens[i - 39 : i + 1])
            worst, n = max(worst, err), 40
    pool_matched_stores(r, pages, worst, spread)


@pytest.mark.parametrize("kv", ["f32", "int8"])
def test_h2o_in_the_pool_is_h2o_in_stores(tiny_llama, kv) -> None:
    """H2O in the paged pool (issue 33: each KV head's kept tokens at the first places of the
    slot's blocks, moved down as it forgets) against `H2OCache`'s stores of their own, through
    the runner's model: a prompt in chunks that already forget, then 150 tokens one by one,
    every third beside a second H2O slot in one attention call (whose probabilities feed each
    slot's scores), a draft taken back exactly before anything is forgotten in between. The
    logits and every kept token's accumulated attention agree to f32 rounding at every step;
    the slot holds the blocks its budget spans and gives them back."""
    import numpy as np

    from localllm.backends.base import Piece
    from localllm.backends.torch.cache import BLOCK
    from localllm.backends.torch.runner import TorchRunner

    budget = 100
    r = TorchRunner(tiny_llama, n_ctx=256, n_slots=2, dtype="f32", threads=2, kv_cache=kv,
                    evict=f"h2o:{budget}")  # fmt: skip
    stores = r.new_caches()  # no slot: stores of their own
    assert isinstance(stores[0], H2OCache)
    tokens = torch.randint(0, 1000, (230,), generator=torch.Generator().manual_seed(2)).tolist()
    r.forward([Piece(1, tokens[:30], 0)])

    def step(toks, beside=False):
        want = last_logits(r.model, toks, stores)
        pieces = [Piece(0, toks, 1)] + ([Piece(1, [7], 1)] if beside else [])
        got = r.forward(pieces).logits[0]
        return float((torch.from_numpy(got) - want).abs().max()), float(want.std())

    worst, spread = step(tokens[:80])  # two chunks of 50 and 30: the second forgets 10
    assert isinstance(r._caches[0][0], PagedH2O) and r._caches[0][0].dropped == 0
    pages = r._rows[0].pages
    for i, tok in enumerate(tokens[80:], 80):
        err, sd = step([tok], beside=i % 3 == 0)
        worst, spread = max(worst, err), min(spread, sd)
        c = r._caches[0][0]
        assert c.offset == r.held(0) == i + 1 and c.held == min(i + 1, budget)
        for a, b in zip(r._caches[0], stores):  # the attention each kept token collected
            assert torch.allclose(a.scores, b.scores, rtol=1e-4, atol=1e-5), i
        assert sum(1 for b in pages.tables[0] if b) <= -(-(budget + 1) // BLOCK)
        if i == 90:  # nothing forgotten since: a draft taken back is exact
            before = r.forward([Piece(0, [9], 1)]).logits
            assert r.trim(0, 1, exact=True)
            assert np.array_equal(r.forward([Piece(0, [9], 1)]).logits, before)
            assert r.trim(0, 1, exact=True)
        if i > budget:  # it forgets at every token now: a draft taken back is not exact
            assert not c.exact(1) and c.exact(0)
    pool_matched_stores(r, pages, worst, spread)
