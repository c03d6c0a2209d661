"""The memory estimate against llama.cpp's own report for the same file, context and cache type."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from localllm.errors import LocalLLMError
from localllm.memory import (
    KV_CACHE_TYPES,
    KV_TYPES,
    Available,
    element_bytes,
    estimate,
    kv_cache_bytes,
    kv_types,
    parse_kv_cache,
)
from localllm.model_info import read_model_info

from conftest import llamacpp_load_log

MiB = 1024 * 1024
_LLAMA_TYPES = {"f32": 0, "f16": 1, "q4_0": 2, "q4_1": 3, "q5_0": 6, "q5_1": 7, "q8_0": 8}


def llamacpp_report(path: Path, n_ctx: int, cache_type: str) -> tuple[float, float]:
    """(KV bytes, compute buffer bytes) as llama.cpp logs them when it creates a context."""
    t = _LLAMA_TYPES[cache_type]
    log = llamacpp_load_log(path, n_ctx=n_ctx, type_k=t, type_v=t,
                            flash_attn=cache_type != "f16")  # a quantized V cache needs flash attention
    kv = [float(m) for m in re.findall(r"llama_kv_cache: size =\s+([\d.]+) MiB", log)]
    compute = [float(m) for m in re.findall(r"CPU compute buffer size =\s+([\d.]+) MiB", log)]
    assert kv and compute, log[-2000:]
    return sum(kv) * MiB, compute[-1] * MiB


CASES = [
    ("default_model_path", 1000, "f16"),  # llama.cpp pads the context to 1024
    ("default_model_path", 4096, "f16"),
    ("default_model_path", 4096, "q8_0"),
    ("default_model_path", 2048, "q4_0"),
    ("gemma_model_path", 1024, "f16"),  # head_dim 256, one KV head, sliding-window layers
    ("gemma_model_path", 8192, "q8_0"),
]


@pytest.mark.parametrize(("which", "ctx", "cache_type"), CASES)
def test_estimate_matches_llamacpp(
    which: str, ctx: int, cache_type: str, request: pytest.FixtureRequest
) -> None:
    path = request.getfixturevalue(which)
    info = read_model_info(str(path))
    est = estimate(info, ctx=ctx, kv_cache=cache_type, available=Available("cpu", 1 << 40, 1 << 40))
    kv, compute = llamacpp_report(path, ctx, cache_type)
    print(f"{path.name} ctx={ctx} {cache_type}: KV ours {est.kv_bytes / MiB:.2f} MiB, "
          f"llama.cpp {kv / MiB:.2f} MiB; compute ours {est.compute_bytes / MiB:.2f}, "
          f"llama.cpp {compute / MiB:.2f} MiB")  # fmt: skip
    assert est.kv_bytes == pytest.approx(kv, rel=0.05)
    assert est.compute_bytes == pytest.approx(compute, rel=0.10)
    assert est.weights_bytes == info.weights_bytes <= path.stat().st_size


def test_kv_formula_for_the_default_model(default_model_path: Path) -> None:
    """REFERENCE.md: 2 · 30 layers · 3 KV heads · 64 = 11,520 elements per token, 22.5 KB in f16."""
    info = read_model_info(str(default_model_path))
    assert info.kv_elements_per_token == 11_520
    assert kv_cache_bytes(info, 1) == 23_040
    assert kv_cache_bytes(info, 1024, "q8_0", "q8_0") == 11_520 // 32 * 34 * 1024
    assert kv_cache_bytes(info, 1024, "int4", "int4") < kv_cache_bytes(info, 1024, "int8", "int8")
    assert kv_cache_bytes(info, 10, "q8_0", "f16") == (5_760 // 32 * 34 + 5_760 * 2) * 10


def test_fits_and_does_not_fit(default_model_path: Path) -> None:
    info = read_model_info(str(default_model_path))
    small = estimate(info, ctx=2048, available=Available("cpu", 200 * MiB, 200 * MiB))
    big = estimate(info, ctx=2048, available=Available("cpu", 1 << 34, 1 << 34))
    assert not small.fits and big.fits
    assert small.total_bytes == small.weights_bytes + small.kv_bytes + small.compute_bytes
    assert estimate(info, available=Available("cpu", 1, 1)).ctx == 4096  # the default context


@pytest.mark.parametrize(
    ("spec", "expected"),
    [
        ("f16", ("f16", "f16")),
        ("Q8_0", ("q8_0", "q8_0")),
        ("k=q8_0,v=f16", ("q8_0", "f16")),
        ("v=int4,k=int8", ("int8", "int4")),
    ],
)
def test_parse_kv_cache(spec: str, expected: tuple[str, str]) -> None:
    assert parse_kv_cache(spec) == expected


@pytest.mark.parametrize("spec", ["q3", "k=q8_0", "k=f16,v=nope", "x=f16,v=f16", ""])
def test_parse_kv_cache_rejects(spec: str) -> None:
    with pytest.raises(LocalLLMError):
        parse_kv_cache(spec)


def test_every_cache_type_has_a_size(default_model_path: Path) -> None:
    info = read_model_info(str(default_model_path))
    sizes = {t: kv_cache_bytes(info, 256, t, t) for t in KV_CACHE_TYPES}
    assert sizes["f32"] > sizes["f16"] > sizes["q8_0"] > sizes["q4_0"] > 0


def test_one_table_of_kv_types() -> None:
    """Each engine's list, in the order it prints it, comes from `KV_TYPES`; every type there
    belongs to an engine, once in its list."""
    assert kv_types("llama.cpp") == ("f16", "f32", "bf16", "q8_0", "q4_0", "q4_1", "iq4_nl",
                                     "q5_0", "q5_1")  # fmt: skip
    assert kv_types("torch") == ("f16", "bf16", "f32", "int8", "fp8", "int4", "int2")
    engines = set(kv_types("llama.cpp")) | set(kv_types("torch"))
    assert set(KV_CACHE_TYPES) == engines == set(KV_TYPES)
    for column in ("llama_cpp", "torch"):
        places = [getattr(t, column) for t in KV_TYPES.values() if getattr(t, column)]
        assert sorted(places) == list(range(1, len(places) + 1)), column
    with pytest.raises(ValueError, match="no engine 'vllm'"):
        kv_types("vllm")


@pytest.mark.parametrize(("kind", "per_element"), [("f32", 4.0), ("f16", 2.0), ("bf16", 2.0),
                         ("q8_0", 34 / 32), ("q4_0", 18 / 32), ("iq4_nl", 18 / 32), ("q5_1", 24 / 32),
                         ("int8", 1 + 2 / 64), ("fp8", 1 + 2 / 64), ("int4", 0.5 + 4 / 64),
                         ("int2", 0.25 + 4 / 64)])  # fmt: skip
def test_bytes_per_element(kind: str, per_element: float) -> None:
    """ggml's block sizes for llama.cpp's types; the torch engine's codes plus scales (per head
    of 64 for int8 and fp8, per group of 64 for int4 and int2)."""
    assert element_bytes(kind, head_dim=64) == pytest.approx(per_element)
