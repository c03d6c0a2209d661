"""Quantized KV caches (issue 12, first type): int8 per token and head against the plain cache."""

from __future__ import annotations

import pytest

from conftest import need

need("torch", "pip install -e '.[dev]' (torch: pip install torch==2.13.0 first)")

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from localllm.backends.torch.cache import KVCache  # noqa: E402
from localllm.backends.torch.kvquant import Fp8KVCache, Int8KVCache  # noqa: E402

KV, HD = 3, 64


def kv(t: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(1, KV, t, HD, generator=g) * torch.rand(1, KV, t, 1, generator=g) * 4
    v = torch.randn(1, KV, t, HD, generator=g)
    k[0, 0, 0] = 0.0  # an all-zero head: scale 0, codes 0, no division by zero
    return k, v


def test_round_trip_error_is_half_a_step_per_token_and_head() -> None:
    cache = Int8KVCache(KV, HD, 512, out_dtype=torch.float32)
    k, v = kv(300, 1)  # past one growth step
    kk, vv = cache.update_and_fetch(k, v)
    assert kk.shape == k.shape and kk.dtype == torch.float32 and cache.offset == 300
    for got, x in ((kk, k), (vv, v)):
        scale = (x.abs().amax(-1, keepdim=True) / 127).half().float()
        assert bool(((got - x).abs() <= scale / 2 + 1e-7).all())
    assert torch.equal(kk[0, 0, 0], torch.zeros(HD))


def test_fp8_round_trip_error_is_e4m3s() -> None:
    cache = Fp8KVCache(KV, HD, 512, out_dtype=torch.float32)
    k, v = kv(300, 8)
    kk, vv = cache.update_and_fetch(k, v)
    assert cache.state[0].dtype == torch.float8_e4m3fn and cache.state[0].element_size() == 1
    for got, x in ((kk, k), (vv, v)):
        scale = (x.abs().amax(-1, keepdim=True) / 448).half().float()
        bound = torch.maximum(x.abs() * 2.0**-4, scale * 2.0**-10) + 1e-7
        assert bool(((got - x).abs() <= bound).all())
    assert torch.equal(kk[0, 0, 0], torch.zeros(HD))


CACHES = [Int8KVCache, Fp8KVCache]


@pytest.mark.parametrize("kind", CACHES, ids=["int8", "fp8"])
def test_appends_in_pieces_equal_one_append(kind: type) -> None:
    whole = kind(KV, HD, 512, out_dtype=torch.float32)
    parts = kind(KV, HD, 512, out_dtype=torch.float32)
    k, v = kv(40, 2)
    want = whole.update_and_fetch(k, v)
    for i in range(0, 40, 7):
        got = parts.update_and_fetch(k[:, :, i : i + 7], v[:, :, i : i + 7])
    assert all(torch.equal(a, b) for a, b in zip(got, want))


@pytest.mark.parametrize("kind", CACHES, ids=["int8", "fp8"])
def test_trim_restores_exactly_and_state_round_trips(kind: type) -> None:
    cache = kind(KV, HD, 512, out_dtype=torch.float32)
    k, v = kv(50, 3)
    cache.update_and_fetch(k[:, :, :30], v[:, :, :30])
    before = [t.clone() for t in cache.state]
    cache.update_and_fetch(k[:, :, 30:], v[:, :, 30:])
    assert cache.trim(20) == 20 and cache.offset == 30 and cache.is_trimmable()
    assert all(torch.equal(a.view(torch.uint8), b.view(torch.uint8)) if a.element_size() == 1
               else torch.equal(a, b) for a, b in zip(cache.state, before))  # fmt: skip
    copy = kind(KV, HD, 512, out_dtype=torch.float32)
    copy.state = cache.state
    assert copy.offset == 30
    assert all(torch.equal(a.float(), b.float()) for a, b in zip(copy.state, before))
    assert cache.trim(99) == 30 and cache.offset == 0


def test_attention_over_it_stays_close_to_the_f16_cache() -> None:
    """One query per head against 200 cached positions whose keys span a 4x range of scales:
    the int8 cache's attention output is within 3% (relative, max over heads; measured 0.6-2.1%
    on this draw) of the f16 cache's. Per-token rounding moves each key by at most half a step
    (0.4% of its largest element), which these peaked softmaxes amplify."""
    k, v = kv(200, 4)
    q = torch.randn(1, 3 * KV, 1, HD, generator=torch.Generator().manual_seed(5))
    plain = KVCache(KV, HD, 512, dtype=torch.float16)
    int8 = Int8KVCache(KV, HD, 512, out_dtype=torch.float32)
    pk, pv = plain.update_and_fetch(k, v)
    ik, iv = int8.update_and_fetch(k, v)
    ref = F.scaled_dot_product_attention(q, pk.float(), pv.float(), enable_gqa=True)
    got = F.scaled_dot_product_attention(q, ik, iv, enable_gqa=True)
    rel = (got - ref).norm(dim=-1) / ref.norm(dim=-1)
    assert float(rel.max()) < 0.03, rel


def test_bytes() -> None:
    cache = Int8KVCache(KV, HD, 4096, out_dtype=torch.float32)
    cache.update_and_fetch(*kv(10, 6))
    assert cache.nbytes == 256 * Int8KVCache.bytes_per_token(KV, HD)  # one step allocated
    f16 = 2 * KV * HD * 2
    assert f16 / Int8KVCache.bytes_per_token(KV, HD) >= 1.9  # the bar for int8


def test_capacity_is_enforced() -> None:
    cache = Int8KVCache(KV, HD, 16, out_dtype=torch.float32)
    with pytest.raises(ValueError, match="KV cache full: 17 tokens, capacity 16"):
        cache.update_and_fetch(*kv(17, 7))


def test_the_backend_decodes_through_an_int8_cache(default_model_path) -> None:  # noqa: ANN001
    """`--kv-cache int8` on the torch engine: its slots hold Int8KVCache layers, and greedy text
    stays the f16 cache's over a short answer (SmolLM2, f32 weights)."""
    from localllm.backends.torch.backend import TorchBackend
    from localllm.engine import Model

    texts = {}
    for kv_type in ("f16", "int8"):
        b = TorchBackend(default_model_path, n_ctx=256, dtype="f32", device="cpu", kv_cache=kv_type)
        with Model(b, "smollm2") as m:
            texts[kv_type] = m.complete("The capital of France is", max_tokens=12,
                                        temperature=0).text  # fmt: skip
            if kv_type == "int8":
                assert all(isinstance(c, Int8KVCache) for c in b._slots[0].caches)
    assert texts["int8"] == texts["f16"], texts


def test_the_backend_decodes_through_an_fp8_cache(default_model_path) -> None:  # noqa: ANN001
    from localllm.backends.torch.backend import TorchBackend
    from localllm.engine import Model

    b = TorchBackend(default_model_path, n_ctx=256, dtype="f32", device="cpu", kv_cache="fp8")
    with Model(b, "smollm2") as m:
        r = m.complete("The capital of France is", max_tokens=8, temperature=0)
        assert r.usage.completion_tokens == 8 and r.text.strip()
        assert all(isinstance(c, Fp8KVCache) and c.offset > 0 for c in b._slots[0].caches)


def test_mixed_k_and_v_types_are_refused_in_one_line(default_model_path) -> None:  # noqa: ANN001
    from localllm.backends.torch.backend import TorchBackend
    from localllm.errors import LocalLLMError

    with pytest.raises(LocalLLMError, match="the torch backend has no k=int8,v=f16 KV cache "
                                            r"\(it has f32, f16, bf16, int8, fp8\)"):  # fmt: skip
        TorchBackend(default_model_path, n_ctx=64, kv_cache="k=int8,v=f16")
