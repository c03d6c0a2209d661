"""weights.py against the `gguf` package's numpy dequantizers (the oracle), on random blocks of
every supported type and on real tensors of both packaged models; shapes, dtypes, chunking,
lifetime after close, and one-line errors."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from conftest import need

need("torch", "pip install -e '.[dev]' (torch: pip install torch==2.13.0 first)")
need("gguf", "pip install -e '.[dev]' (the gguf package is the oracle)")

import gguf  # noqa: E402
import torch  # noqa: E402

from localllm.backends.torch import weights  # noqa: E402
from localllm.backends.torch.weights import (  # noqa: E402
    CODED_TYPES,
    SUPPORTED_TYPES,
    Coded,
    WeightsError,
    coded,
    dequantize,
    iter_tensors,
    raw,
    tensor,
)
from localllm.errors import LocalLLMError  # noqa: E402
from localllm.gguf_file import GGML_TYPE_BY_NAME, GGUFFile  # noqa: E402

from ggufs import write_small  # noqa: E402

QUANTIZED = ("Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "IQ4_NL", "IQ4_XS")
# byte offsets of each block's f16 fields (scales, mins): random bytes there could be NaN or inf
F16_FIELDS = {
    "Q8_0": (0,), "Q4_0": (0,), "Q4_1": (0, 2), "Q5_0": (0,), "Q5_1": (0, 2),
    "Q2_K": (80, 82), "Q3_K": (108,), "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,), "IQ4_NL": (0,),
    "IQ4_XS": (0,),
}  # fmt: skip


def random_bytes(type_name: str, shape: tuple[int, ...], rng: np.random.Generator) -> np.ndarray:
    """Valid random data of `shape` (torch order) as (rows, bytes per row) uint8: every bit
    pattern in the quants, finite f16 scales, finite floats."""
    gtype = GGML_TYPE_BY_NAME[type_name]
    rows, row = int(np.prod(shape[:-1])), shape[-1]
    if type_name in ("F32", "F16", "BF16"):
        x = (rng.standard_normal((rows, row)) * 10.0 ** rng.integers(-3, 3, (rows, 1))).astype(
            np.float32
        )
        if type_name == "BF16":
            return gguf.quants.quantize(x, gguf.GGMLQuantizationType.BF16)
        return x.astype(np.float16 if type_name == "F16" else np.float32).view(np.uint8)
    n_blocks = rows * row // gtype.block_size
    b = rng.integers(0, 256, (n_blocks, gtype.type_size), dtype=np.uint8)
    for at in F16_FIELDS[type_name]:
        scales = rng.uniform(-1, 1, n_blocks) * 10.0 ** rng.integers(-4, 2, n_blocks)
        b[:, at : at + 2] = scales.astype(np.float16).view(np.uint8).reshape(-1, 2)
    return b.reshape(rows, -1)


def oracle(data: np.ndarray, type_name: str) -> torch.Tensor:
    """gguf's dequantization of (rows, bytes per row) → (rows, row) float32."""
    out = gguf.quants.dequantize(data, gguf.GGMLQuantizationType[type_name])
    return torch.from_numpy(np.array(out, dtype=np.float32))


def as_bytes(data: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(data).reshape(-1).copy())


def block_shape(type_name: str) -> tuple[int, ...]:
    return (3, 5, 2 * GGML_TYPE_BY_NAME[type_name].block_size)


def test_supported_types_are_ggml_types() -> None:
    assert set(SUPPORTED_TYPES) == {"F32", "F16", "BF16", *QUANTIZED}
    assert all(t in GGML_TYPE_BY_NAME for t in SUPPORTED_TYPES)
    assert issubclass(WeightsError, LocalLLMError)


@pytest.mark.parametrize("type_name", SUPPORTED_TYPES)
def test_random_blocks_match_gguf_exactly(type_name: str) -> None:
    """Random bit patterns: float32 results are bit-identical, K-quants included."""
    shape = block_shape(type_name)
    data = random_bytes(type_name, shape, np.random.default_rng(0))
    want = oracle(data, type_name).reshape(shape)
    got = dequantize(as_bytes(data), type_name, shape)
    assert got.dtype == torch.float32 and got.shape == shape
    assert torch.equal(got, want)


@pytest.mark.parametrize("type_name", CODED_TYPES)
def test_codes_and_groups_are_the_tensor_bit_for_bit(type_name: str) -> None:
    """Kept as int8 codes and per-group (scale, low): scale * q + low is gguf's float32 value
    exactly (every product is exact in float32; only a K type's min rounds, once, as in ggml);
    4-bit codes are 0..15 with a low (what the int4 kernels take)."""
    shape = (4, 2 * GGML_TYPE_BY_NAME[type_name].block_size)
    data = random_bytes(type_name, shape, np.random.default_rng(11))
    m = coded(as_bytes(data), type_name, shape)
    bits, group = CODED_TYPES[type_name]
    assert (m.bits, m.group) == (bits, group) and m.shape == shape and m.q.dtype == torch.int8
    assert m.scale.shape == (shape[0], shape[1] // group)
    if bits == 4:
        assert int(m.q.min()) >= 0 and int(m.q.max()) <= 15 and m.low is not None
    else:
        assert -(2 ** (bits - 1)) <= int(m.q.min()) and int(m.q.max()) < 2**bits
    assert torch.equal(m.dequantize(), oracle(data, type_name))
    rows = torch.tensor([2, 0, 3, 1])
    both = Coded.cat([m, m.map(lambda t: t[rows])])  # fusing parts; permuting rows
    assert torch.equal(both.dequantize(), torch.cat([m.dequantize(), m.dequantize()[rows]]))


def test_fused_parts_of_mixed_types_keep_every_value() -> None:
    """A Q4_K_M file fuses Q4_K queries with Q6_K values (groups of 32 and 16, a low and none)
    and Q8_0: one Coded with the smallest group and the widest codes, the same values."""
    rng = np.random.default_rng(13)
    parts = [coded(as_bytes(random_bytes(t, (16, 256), rng)), t, (16, 256))
             for t in ("Q4_K", "Q6_K", "Q8_0")]  # fmt: skip
    fused = Coded.cat(parts)
    assert (fused.group, fused.bits, fused.shape) == (16, 8, (48, 256)) and fused.low is not None
    assert torch.equal(fused.dequantize(), torch.cat([p.dequantize() for p in parts]))
    assert torch.equal(fused.dequantize(torch.bfloat16),
                       torch.cat([p.dequantize() for p in parts]).to(torch.bfloat16))  # fmt: skip


def test_codes_refuse_other_types_and_shapes() -> None:
    data = as_bytes(random_bytes("F16", (2, 64), np.random.default_rng(12)))
    with pytest.raises(WeightsError, match="F16 .* is not a matrix of codes"):
        coded(data, "F16", (2, 64))
    data = as_bytes(random_bytes("Q8_0", (2, 3, 64), np.random.default_rng(12)))
    with pytest.raises(WeightsError, match=r"Q8_0 \[2, 3, 64\] is not a matrix of codes"):
        coded(data, "Q8_0", (2, 3, 64))


@pytest.mark.parametrize(
    "type_name", ["F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1"]
)
def test_quantized_floats_match_gguf_exactly(type_name: str) -> None:
    """Real quantizations (gguf's quantizer) of rows of very different scales, one all zero."""
    rng = np.random.default_rng(1)
    x = rng.standard_normal((16, 256)) * np.logspace(-4, 3, 16)[:, None]
    x = x.astype(np.float32)
    x[3] = 0
    qtype = gguf.GGMLQuantizationType[type_name]
    data = gguf.quants.quantize(x, qtype).view(np.uint8).reshape(16, -1)
    got = dequantize(as_bytes(data), type_name, (16, 256))
    assert torch.equal(got, oracle(data, type_name))
    # and a check of the oracle itself: each row is close to what went in, for its scale
    err = (got - torch.from_numpy(x)).abs().amax(-1)
    assert torch.all(err <= torch.from_numpy(x).abs().amax(-1) / 7)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("type_name", SUPPORTED_TYPES)
def test_half_dtypes_round_once_from_float32(type_name: str, dtype: torch.dtype) -> None:
    shape = block_shape(type_name)
    data = random_bytes(type_name, shape, np.random.default_rng(2))
    got = dequantize(as_bytes(data), type_name, shape, dtype=dtype)
    assert got.dtype == dtype and got.shape == shape
    assert torch.equal(got, oracle(data, type_name).reshape(shape).to(dtype))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("type_name", ["Q8_0", "Q5_1", "Q6_K"])
def test_chunks_cover_the_tensor_and_bound_temporaries(
    type_name: str, dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch
) -> None:
    """10 blocks in chunks of 3: the last chunk is partial; no decoder sees more than 3 blocks."""
    bs = GGML_TYPE_BY_NAME[type_name].block_size
    monkeypatch.setattr(weights, "_chunk_elements", lambda: 3 * bs)
    seen: list[int] = []
    decode = weights._DECODERS[type_name]

    def spy(b: torch.Tensor, o: torch.Tensor) -> weights.Maps:
        seen.append(b.shape[0])
        return decode(b, o)

    monkeypatch.setitem(weights._DECODERS, type_name, spy)
    data = random_bytes(type_name, (2, 5 * bs), np.random.default_rng(3))
    got = dequantize(as_bytes(data), type_name, (2, 5 * bs), dtype=dtype)
    assert seen == [3, 3, 3, 1]
    assert torch.equal(got, oracle(data, type_name).to(dtype))
    if type_name in CODED_TYPES:  # the codes come in the same chunks
        seen.clear()
        assert torch.equal(coded(as_bytes(data), type_name, (2, 5 * bs)).dequantize(dtype), got)
        assert seen == [3, 3, 3, 1]


def test_torch_order_is_ggml_order_reversed(tmp_path: Path) -> None:
    """numpy (= torch) order goes in through gguf's writer, the same order comes out."""
    x = np.arange(2 * 3 * 32, dtype=np.float32).reshape(2, 3, 32)
    q = np.random.default_rng(4).standard_normal((64, 32)).astype(np.float32)
    w = gguf.GGUFWriter(str(tmp_path / "order.gguf"), arch="llama")
    w.add_tensor("x", x)
    w.add_tensor(
        "q",
        gguf.quants.quantize(q, gguf.GGMLQuantizationType.Q8_0),
        raw_dtype=gguf.GGMLQuantizationType.Q8_0,
    )
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with GGUFFile(tmp_path / "order.gguf") as f:
        assert f.tensors["x"].shape == (32, 3, 2)
        assert torch.equal(tensor(f, "x"), torch.from_numpy(x))
        assert tensor(f, "q").shape == (64, 32)
        assert torch.allclose(tensor(f, "q"), torch.from_numpy(q), atol=0.05)


def test_unaligned_and_strided_bytes() -> None:
    shape = block_shape("Q4_K")
    data = as_bytes(random_bytes("Q4_K", shape, np.random.default_rng(5)))
    want = dequantize(data, "Q4_K", shape)
    shifted = torch.cat((torch.zeros(1, dtype=torch.uint8), data))[1:]  # starts at an odd byte
    assert torch.equal(dequantize(shifted, "Q4_K", shape), want)
    strided = torch.stack((data, data), dim=1)[:, 0]
    assert torch.equal(dequantize(strided, "Q4_K", shape), want)
    f32 = torch.randn(64)
    odd = torch.cat((torch.zeros(3, dtype=torch.uint8), f32.view(torch.uint8)))[3:]
    assert torch.equal(dequantize(odd, "F32", (64,)), f32)


# -- files ------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def every_type(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, np.ndarray]]:
    """A GGUF with one (4, 2 blocks) tensor per supported type and a 1-D F32 norm."""
    rng = np.random.default_rng(6)
    path = tmp_path_factory.mktemp("every") / "every-type.gguf"
    w = gguf.GGUFWriter(str(path), arch="llama")
    data = {}
    for type_name in SUPPORTED_TYPES:
        shape = (4, 2 * GGML_TYPE_BY_NAME[type_name].block_size)
        data[type_name] = random_bytes(type_name, shape, rng)
        w.add_tensor(
            f"{type_name}.weight",
            data[type_name],
            raw_dtype=gguf.GGMLQuantizationType[type_name],
        )
    w.add_tensor("norm.weight", rng.standard_normal(64).astype(np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path, data


def test_every_type_from_a_file(every_type: tuple[Path, dict[str, np.ndarray]]) -> None:
    path, data = every_type
    with GGUFFile(path) as f:
        for type_name in SUPPORTED_TYPES:
            name = f"{type_name}.weight"
            got = tensor(f, name)
            assert got.shape == tuple(reversed(f.tensors[name].shape)), type_name
            assert torch.equal(got, oracle(data[type_name], type_name)), type_name
            kind, blocks, shape = raw(f, name)
            assert (kind, shape) == (type_name, got.shape)
            assert blocks.dtype == torch.uint8 and np.array_equal(blocks.numpy(), data[type_name])
            assert torch.equal(dequantize(blocks.reshape(-1), kind, shape), got)


def test_iter_tensors_one_at_a_time_in_file_order(
    every_type: tuple[Path, dict[str, np.ndarray]],
) -> None:
    path, _ = every_type
    with GGUFFile(path) as f:
        names = [name for name, _ in iter_tensors(f)]
        assert names == list(f.tensors)
        out = dict(iter_tensors(f, ["norm.weight", "Q4_K.weight"], dtype=torch.bfloat16))
        assert list(out) == ["norm.weight", "Q4_K.weight"]
        assert out["norm.weight"].dtype == torch.float32  # 1-D norms stay float32
        assert out["Q4_K.weight"].dtype == torch.bfloat16
        assert torch.equal(out["Q4_K.weight"], tensor(f, "Q4_K.weight").to(torch.bfloat16))
        assert tensor(f, "norm.weight", dtype=torch.float16).dtype == torch.float32
        kept = dict(iter_tensors(f, keep_coded={"Q4_1.weight", "Q6_K.weight", "F16.weight",
                                                "norm.weight"}))  # fmt: skip
        for name in ("Q4_1.weight", "Q6_K.weight"):  # asked for and coded
            assert isinstance(kept[name], Coded), name
            assert torch.equal(kept[name].dequantize(), tensor(f, name))
        assert isinstance(kept["F16.weight"], torch.Tensor)  # asked for, floats: dense
        assert isinstance(kept["Q4_K.weight"], torch.Tensor)  # coded, not asked for


def test_decoding_runs_on_the_target_device(
    every_type: tuple[Path, dict[str, np.ndarray]],
) -> None:
    """Bytes move to the device and the ops run there (the meta device has no data, but an
    elementwise op with a constant left on the CPU raises there, as it would on a GPU)."""
    path, _ = every_type
    with GGUFFile(path) as f:
        for name, t in iter_tensors(f, dtype=torch.bfloat16, device="meta"):
            assert t.device.type == "meta", name
            assert t.shape == tuple(reversed(f.tensors[name].shape)), name


def test_tensors_outlive_the_file_and_hold_no_view_of_it(
    every_type: tuple[Path, dict[str, np.ndarray]],
) -> None:
    path, data = every_type
    f = GGUFFile(path)
    kept = dict(iter_tensors(f))
    kept_raw = raw(f, "Q6_K.weight")[1]
    mapping = f._map
    f.close()
    assert mapping is not None and mapping.closed  # no tensor still exports the map's buffer
    assert torch.equal(kept["F32.weight"], oracle(data["F32"], "F32"))
    assert torch.equal(kept["Q6_K.weight"], oracle(data["Q6_K"], "Q6_K"))
    assert np.array_equal(kept_raw.numpy(), data["Q6_K"])


# -- errors -----------------------------------------------------------------------------------


def one_line(e: pytest.ExceptionInfo[WeightsError]) -> str:
    msg = str(e.value)
    assert "\n" not in msg and msg
    return msg


def test_unsupported_type_in_a_file(tmp_path: Path) -> None:
    path = tmp_path / "iq2.gguf"
    w = gguf.GGUFWriter(str(path), arch="llama")
    w.add_tensor("ok.weight", np.ones(32, dtype=np.float32))
    w.add_tensor(
        "blk.0.attn_q.weight",
        np.zeros((2, 66), dtype=np.uint8),
        raw_dtype=gguf.GGMLQuantizationType.IQ2_XXS,
    )
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with GGUFFile(path) as f:
        for call in (lambda: tensor(f, "blk.0.attn_q.weight"), lambda: dict(iter_tensors(f))):
            with pytest.raises(WeightsError) as e:
                call()
            msg = one_line(e)
            assert msg.startswith("iq2.gguf: tensor 'blk.0.attn_q.weight' has type IQ2_XXS")
            assert "cannot read" in msg and "Q4_K" in msg and "F32" in msg
        with pytest.raises(WeightsError, match="IQ2_XXS"):
            raw(f, "blk.0.attn_q.weight")
        with pytest.raises(WeightsError) as e:
            tensor(f, "missing.weight")
        assert "iq2.gguf" in one_line(e) and "'missing.weight'" in str(e.value)


def test_big_endian_files_are_refused(tmp_path: Path) -> None:
    with GGUFFile(write_small(tmp_path / "be.gguf", big_endian=True)) as f:
        with pytest.raises(WeightsError) as e:
            tensor(f, "a.weight")
        assert "be.gguf" in one_line(e) and "big-endian" in str(e.value)


@pytest.mark.parametrize(
    ("type_name", "nbytes", "shape", "words"),
    [
        ("Q4_0", 18 * 4 - 1, (4, 32), "71 bytes, but Q4_0 [4, 32] needs 72"),  # truncated
        ("Q4_K", 144 * 3, (2, 256), "432 bytes, but Q4_K [2, 256] needs 288"),  # too long
        ("F32", 4 * 10, (11,), "40 bytes, but F32 [11] needs 44"),
        ("Q8_0", 34, (33,), "a row of 33 is not a multiple of the Q8_0 block size 32"),
        ("IQ2_XXS", 66, (256,), "has type IQ2_XXS, which the torch engine cannot read"),
        ("IQ3_S", 110, (256,), "has type IQ3_S"),
        ("Q9_9", 18, (32,), "has type Q9_9"),
        ("F32", 0, (0, 4), "empty or negative shape [0, 4]"),
    ],
)
def test_bad_bytes_and_types(type_name: str, nbytes: int, shape: tuple, words: str) -> None:
    data = torch.zeros(nbytes, dtype=torch.uint8)
    with pytest.raises(WeightsError) as e:
        dequantize(data, type_name, shape, label="m.gguf: tensor 'w'")
    msg = one_line(e)
    assert msg.startswith("m.gguf: tensor 'w'") and words in msg


def test_bytes_must_be_1d_uint8() -> None:
    for data in (torch.zeros(8, dtype=torch.int8), torch.zeros(2, 4, dtype=torch.uint8)):
        with pytest.raises(WeightsError, match="expected 1-D uint8"):
            dequantize(data, "F32", (2,))


# -- the packaged models ------------------------------------------------------------------------


def check_real(path: Path, per_type: int) -> set[str]:
    """The first `per_type` tensors of each type (and the embedding) against gguf on up to 512
    sampled rows; returns the types seen."""
    rng = np.random.default_rng(7)
    counts: dict[str, int] = {}
    with GGUFFile(path) as f:
        for name, info in f.tensors.items():
            kind = info.ggml_type.name
            if counts.get(kind, 0) >= per_type and name != "token_embd.weight":
                continue
            counts[kind] = counts.get(kind, 0) + 1
            got = tensor(f, name)
            assert got.shape == tuple(reversed(info.shape)), name
            blocks = np.frombuffer(f.tensor_bytes(name), dtype=np.uint8)
            rows = blocks.reshape(-1, blocks.size // (got.numel() // got.shape[-1]))
            pick = np.sort(rng.choice(len(rows), min(len(rows), 512), replace=False))
            want = oracle(rows[pick], kind)
            assert torch.equal(got.reshape(len(rows), -1)[torch.from_numpy(pick)], want), name
            del blocks, rows
    return set(counts)


def test_default_model_tensors_match_gguf(default_model_path: Path) -> None:
    assert check_real(default_model_path, per_type=3) == {"F32", "Q8_0", "Q4_1"}


def test_gemma_tensors_match_gguf(gemma_model_path: Path) -> None:
    """Includes the 262144 × 640 Q8_0 embedding, decoded in chunks."""
    types = check_real(gemma_model_path, per_type=2)
    assert types == {"F32", "Q5_0", "Q4_K", "Q6_K", "Q8_0"}
