"""Our quantizers against llama.cpp's: every type byte-identical on random, heavy-tailed, constant,
all-zero, one-signed and tiny inputs and on real weights; dequantized error within each type's bound."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from localllm.quant import BLOCK, native, quantize, row_bytes

from conftest import need
from ggml_oracle import ggml_quantize

TYPES = ["Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "IQ4_NL", "IQ4_XS",
         "F16", "BF16"]  # fmt: skip


def inputs() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(7)
    ramp = np.linspace(-1, 1, 512, dtype=np.float32)
    outlier = rng.standard_normal((4, 512)).astype(np.float32) * 0.01
    outlier[:, 5] = 3.0
    return {
        "normal": (rng.standard_normal((32, 1024)) * 0.02).astype(np.float32),
        "heavy": (rng.standard_t(2, (32, 512)) * 0.05).astype(np.float32),
        "special": np.stack(
            [
                np.zeros(512),
                np.full(512, 0.3),
                np.full(512, -2.0),
                ramp,
                -np.abs(rng.standard_normal(512)),
                np.abs(rng.standard_normal(512)),
                rng.standard_normal(512) * 1e-20,
                rng.standard_normal(512) * 1e4,
            ]
        ).astype(np.float32),  # fmt: skip
        "outlier": outlier,
    }


def both(types: list[str]) -> list[tuple[str, str]]:
    """Each type with the numpy port, and again with the compiled quantizer where it has the type
    (`quantize` takes the compiled one when it can: both must give llama.cpp's bytes)."""
    return [(t, "numpy") for t in types] + [(t, "compiled") for t in types if t in native.TYPES]


@pytest.fixture
def quantizer(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """`quantize` through the numpy ports only, or through the compiled quantizer (which must build)."""
    kind = request.node.callspec.params["path"]
    if kind == "numpy":
        monkeypatch.setattr(native, "_state", {"dll": None, "why": "the numpy ports for this test"})
    elif not native.available():
        pytest.fail(f"the compiled quantizer did not build ({native.why_not()}): install a C compiler "
                    "(apt install gcc)", pytrace=False)  # fmt: skip
    return kind


@pytest.mark.parametrize(("type_name", "path"), both(TYPES))
def test_byte_identical_to_llamacpp(type_name: str, path: str, quantizer: str) -> None:
    for name, x in inputs().items():
        ours = quantize(x, type_name)
        theirs = ggml_quantize(x, type_name, row_bytes(type_name, x.shape[1]))
        bad = np.nonzero((ours != theirs).any(axis=1))[0]
        assert ours.shape == theirs.shape and not len(bad), (
            f"{type_name} {name}: rows {bad[:8]} differ"
        )


def real_weights(path: Path) -> dict[str, np.ndarray]:
    """A few of the default model's matrices, dequantized to float32 (rows cut to 512 values)."""
    need("gguf", "pip install -e '.[dev]'")
    from gguf import GGUFReader
    from gguf.quants import dequantize

    r = GGUFReader(path)
    out = {}
    for t in r.tensors:
        if t.name in ("blk.0.ffn_down.weight", "blk.5.attn_q.weight", "blk.29.ffn_gate.weight"):
            w = dequantize(t.data, t.tensor_type).reshape(-1)
            out[t.name] = w[: w.size // 512 * 512].reshape(-1, 512)[:256].astype(np.float32)
    assert len(out) == 3
    return out


@pytest.mark.parametrize(("type_name", "path"), both(["Q4_0", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "Q8_0"]))
def test_byte_identical_on_real_weights(type_name: str, path: str, quantizer: str, default_model_path: Path) -> None:
    for name, x in real_weights(default_model_path).items():
        theirs = ggml_quantize(x, type_name, row_bytes(type_name, x.shape[1]))
        assert np.array_equal(quantize(x, type_name), theirs), f"{type_name} {name}"


# relative RMS error bounds of dequantize(quantize(x)) on Gaussian values (measured here: Q8_0
# 0.0053, Q4_0 0.085, Q4_1 0.077, Q5_0 0.042, Q5_1 0.038, Q4_K 0.070, Q5_K 0.036, Q6_K 0.017,
# F16 0.0002, BF16 0.0017), with a third more room
BOUNDS = {"Q8_0": 0.007, "Q4_0": 0.115, "Q4_1": 0.1, "Q5_0": 0.056, "Q5_1": 0.05, "Q2_K": 0.34,
          "Q3_K": 0.18, "Q4_K": 0.093, "Q5_K": 0.048, "Q6_K": 0.023, "IQ4_NL": 0.1, "IQ4_XS": 0.1,
          "F16": 3e-4, "BF16": 2.3e-3}  # fmt: skip


@pytest.mark.parametrize("type_name", TYPES)
def test_round_trip_error_is_bounded(type_name: str) -> None:
    need("gguf", "pip install -e '.[dev]'")
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    x = (np.random.default_rng(3).standard_normal((16, 1024)) * 0.02).astype(np.float32)
    back = dequantize(quantize(x, type_name), GGMLQuantizationType[type_name]).reshape(x.shape)
    rel = float(np.sqrt(np.mean((back - x) ** 2)) / np.sqrt(np.mean(x**2)))
    assert rel < BOUNDS[type_name], f"{type_name}: relative RMS error {rel:.4f}"
    assert rel > BOUNDS[type_name] / 4  # it did quantize, to this type's precision


def test_rows_that_do_not_fit_the_block_are_refused() -> None:
    with pytest.raises(ValueError, match="multiple of 256"):
        quantize(np.zeros((2, 576), np.float32), "Q4_K")
    with pytest.raises(ValueError, match="no quantizer for TQ1_0"):
        quantize(np.zeros((2, 512), np.float32), "TQ1_0")
    with pytest.raises(ValueError, match="IQ2_XS needs an importance matrix"):
        quantize(np.zeros((2, 512), np.float32), "IQ2_XS")
    assert set(BLOCK) >= set(TYPES)


@pytest.mark.parametrize("type_name", ["Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "IQ4_NL", "IQ4_XS"])
def test_k_quants_with_an_importance_matrix_are_byte_identical(type_name: str) -> None:
    """llama.cpp's importance-weighted paths (`quantize_row_q{2,3,4,5,6}_K_impl`): ours give its bytes."""
    from localllm.quant import iquants, kquants

    fn = {"Q2_K": kquants.quantize_q2_k, "Q3_K": kquants.quantize_q3_k, "Q4_K": kquants.quantize_q4_k,
          "Q5_K": kquants.quantize_q5_k, "Q6_K": kquants.quantize_q6_k, "IQ4_NL": iquants.quantize_iq4_nl,
          "IQ4_XS": iquants.quantize_iq4_xs}  # fmt: skip
    rng = np.random.default_rng(11)
    for name, x in inputs().items():
        imatrix = (rng.uniform(0.01, 5, x.shape[1]) ** 2).astype(np.float32)
        theirs = ggml_quantize(x, type_name, row_bytes(type_name, x.shape[1]), imatrix)
        per_value = np.tile(imatrix.reshape(-1, 256), (x.shape[0], 1))
        ours = fn[type_name](x, per_value).reshape(theirs.shape)
        bad = np.nonzero((ours != theirs).any(axis=1))[0]
        assert not len(bad), f"{type_name} with imatrix, {name}: rows {bad[:8]} differ"
        assert not np.array_equal(ours, quantize(x, type_name))  # the weights changed the result


@pytest.mark.parametrize("type_name", native.WEIGHTED)
def test_the_compiled_quantizer_with_an_importance_matrix_is_byte_identical(type_name: str) -> None:
    if not native.available():
        pytest.fail(f"the compiled quantizer did not build ({native.why_not()}): install a C compiler "
                    "(apt install gcc)", pytrace=False)  # fmt: skip
    rng = np.random.default_rng(13)
    for name, x in inputs().items():
        imatrix = (rng.uniform(0.01, 5, x.shape[1]) ** 2).astype(np.float32)
        theirs = ggml_quantize(x, type_name, row_bytes(type_name, x.shape[1]), imatrix)
        ours = native.quantize_rows(x, type_name, importance=imatrix)
        bad = np.nonzero((ours != theirs).any(axis=1))[0]
        assert not len(bad), f"{type_name} with imatrix, {name}: rows {bad[:8]} differ"
        assert np.array_equal(quantize(x, type_name, imatrix), ours)  # quantize takes it


@pytest.mark.parametrize("type_name", ["Q4_0", "Q4_1", "Q5_0", "Q5_1"])
def test_legacy_types_with_an_importance_matrix_are_byte_identical(type_name: str) -> None:
    from localllm.quant.legacy import quantize_weighted

    rng = np.random.default_rng(12)
    for name, x in inputs().items():
        imatrix = (rng.uniform(0.01, 5, x.shape[1]) ** 2).astype(np.float32)
        theirs = ggml_quantize(x, type_name, row_bytes(type_name, x.shape[1]), imatrix)
        ours = quantize_weighted(x, imatrix, type_name)
        bad = np.nonzero((ours != theirs).any(axis=1))[0]
        assert ours.shape == theirs.shape and not len(bad), (
            f"{type_name} {name}: rows {bad[:8]} differ"
        )
        assert not np.array_equal(ours, quantize(x, type_name))


@pytest.mark.parametrize("type_name", ["Q4_K", "Q6_K", "Q5_0", "Q8_0"])
def test_quantize_takes_an_importance_matrix(type_name: str) -> None:
    """`quantize(x, type, imatrix)`: llama.cpp's bytes in pieces of rows; Q8_0 ignores it, as
    llama.cpp does; a matrix of the wrong width is refused."""
    rng = np.random.default_rng(13)
    x = (rng.standard_normal((300, 512)) * 0.02).astype(np.float32)  # several pieces
    imatrix = rng.uniform(0.1, 3, 512).astype(np.float32)
    theirs = ggml_quantize(x, type_name, row_bytes(type_name, 512), imatrix)
    assert np.array_equal(quantize(x, type_name, imatrix), theirs)
    with pytest.raises(ValueError, match="importance matrix has 256 columns"):
        quantize(x, "Q4_K", imatrix[:256])


LATTICE = ["IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ3_XXS", "IQ3_S", "IQ1_S", "IQ1_M"]
# relative RMS error with an importance matrix (measured here: 0.357, 0.316, 0.261, 0.191, 0.143, 0.510, 0.480)
LATTICE_BOUNDS = {"IQ2_XXS": 0.45, "IQ2_XS": 0.4, "IQ2_S": 0.33, "IQ3_XXS": 0.25, "IQ3_S": 0.19, "IQ1_S": 0.65, "IQ1_M": 0.6}


@pytest.mark.parametrize("type_name", LATTICE)
def test_lattice_iquants_are_byte_identical(type_name: str) -> None:
    """`quantize_row_iq{2_xxs,2_xs,2_s,3_xxs,3_s,1_s}_impl` (grid search with neighbour lists, sign
    parity, make_qp_quants on values one of which may be negative; IQ1_S's and IQ1_M's exhaustive
    split of each block into −1, 0, 1 with a shift): ours give ggml's bytes on every
    input, with an importance matrix and — where ggml allows — without; blocks of zeros inside a
    super-block (IQ3_S then writes the next block's codes in their place); in pieces of rows; and
    decode (gguf's dequantizer) to within the type's error."""
    need("gguf", "pip install -e '.[dev]'")
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    rng = np.random.default_rng(17)
    cases = inputs()
    holes = (rng.standard_normal((6, 512)) * 0.02).astype(np.float32)
    for r, (a, b) in enumerate([(32, 64), (0, 32), (224, 256), (16, 32), (64, 192), (288, 320)]):
        holes[r, a:b] = 0
    cases["holes"] = holes
    for name, x in cases.items():
        imatrix = (rng.uniform(0.01, 5, x.shape[1]) ** 2).astype(np.float32)
        for qw in (imatrix, None) if type_name not in ("IQ2_XXS", "IQ2_XS", "IQ1_S") else (imatrix,):
            theirs = ggml_quantize(x, type_name, row_bytes(type_name, x.shape[1]), qw)
            ours = quantize(x, type_name, qw)
            bad = np.nonzero((ours != theirs).any(axis=1))[0]
            assert ours.shape == theirs.shape and not len(bad), (
                f"{type_name} {name} {'with' if qw is not None else 'without'} imatrix: rows {bad[:8]} differ"
            )
    x = (rng.standard_normal((300, 512)) * 0.02).astype(np.float32)  # several pieces
    imatrix = rng.uniform(0.1, 3, 512).astype(np.float32)
    ours = quantize(x, type_name, imatrix)
    assert np.array_equal(ours, ggml_quantize(x, type_name, row_bytes(type_name, 512), imatrix))
    back = dequantize(ours, GGMLQuantizationType[type_name]).reshape(x.shape)
    rel = float(np.sqrt(np.mean((back - x) ** 2) / np.mean(x**2)))
    assert LATTICE_BOUNDS[type_name] / 4 < rel < LATTICE_BOUNDS[type_name], rel


@pytest.mark.parametrize("type_name", LATTICE)
def test_lattice_iquants_on_real_weights(type_name: str, default_model_path: Path) -> None:
    rng = np.random.default_rng(18)
    for name, x in real_weights(default_model_path).items():
        imatrix = rng.uniform(0.05, 4, x.shape[1]).astype(np.float32)
        theirs = ggml_quantize(x, type_name, row_bytes(type_name, x.shape[1]), imatrix)
        assert np.array_equal(quantize(x, type_name, imatrix), theirs), f"{type_name} {name}"
