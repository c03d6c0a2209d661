"""`quantize --method gptq`: every block format's grid read back from its bytes (against the gguf
package's dequantizers, ggml's), GPTQ lowering the layer loss it is built to lower, and whole files
in llama.cpp's formats — as large as the plain type's, read by llama.cpp, closer to the source."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from localllm.gguf_file import GGUFFile
from localllm.quant import gptq, iquants, quantize
from localllm.quant.writer import _values, quantize_file

from conftest import need


def dequantize(blocks: np.ndarray, type_name: str, shape: tuple[int, ...]) -> np.ndarray:
    from gguf import GGMLQuantizationType, quants

    return quants.dequantize(np.ascontiguousarray(blocks).reshape(-1), GGMLQuantizationType[type_name]).reshape(shape)


@pytest.mark.parametrize("type_name", gptq.TYPES)
def test_grid_and_levels_are_the_formats_own(type_name: str) -> None:
    """Any levels written under a block's scales dequantize (in ggml's code) to the grid's values,
    and the quantizer's own levels read back give its own bytes."""
    import importlib

    need("gguf", "pip install -e '.[dev]'")
    module_name, width = gptq.FORMATS[type_name]
    module = importlib.import_module(f"localllm.quant.{module_name}")
    rng = np.random.default_rng(7)
    x = rng.standard_normal((48, width)).astype(np.float32)
    blocks = quantize(x, type_name)
    if type_name.startswith("IQ"):
        scale = module.grid(type_name, blocks)
        levels = rng.integers(0, 16, x.shape)
        want = scale * iquants.KVALUES[levels]
    else:
        a, m = module.grid(type_name, blocks)
        levels = rng.integers(0, module.LEVELS[type_name] + 1, x.shape)
        want = a * levels - m
        own = np.rint((dequantize(blocks, type_name, x.shape) + m) / a).astype(np.int64)
        assert np.array_equal(module.with_levels(type_name, blocks, own), blocks)
    moved = module.with_levels(type_name, blocks, levels)
    assert np.array_equal(dequantize(moved, type_name, x.shape), want)
    width_bytes = blocks.shape[1]
    assert moved.shape == blocks.shape and width_bytes == quantize(x[:1], type_name).shape[1]


@pytest.mark.parametrize("act_order", [True, False])
@pytest.mark.parametrize("type_name", gptq.TYPES)
def test_gptq_lowers_the_layer_loss(type_name: str, act_order: bool) -> None:
    """On inputs with correlated columns of unequal size, ‖(W − Q)X‖² is far below what rounding
    each value (with the importance matrix) leaves."""
    need("gguf", "pip install -e '.[dev]'")
    rng = np.random.default_rng(1)
    n, rows = 512, 64
    x = (rng.standard_normal((2048, n)) * np.exp(rng.standard_normal(n))) @ (rng.standard_normal((n, n)) * 0.3 + np.eye(n))
    h = x.T @ x / len(x)
    w = (rng.standard_normal((rows, n)) * 0.05).astype(np.float32)
    rounded = gptq.layer_loss(w, dequantize(quantize(w, type_name, np.diagonal(h).astype(np.float32)), type_name, w.shape), h)
    blocks = gptq.quantize_gptq(w, h, type_name, act_order=act_order)
    assert blocks.shape == quantize(w, type_name).shape
    assert gptq.layer_loss(w, dequantize(blocks, type_name, w.shape), h) < 0.5 * rounded


def test_gptq_handles_dead_inputs_and_refuses_bad_shapes() -> None:
    """An input that is never active (a zero row and column in H) gets no weight; wrong shapes and
    types without a grid are refused."""
    need("gguf", "pip install -e '.[dev]'")
    rng = np.random.default_rng(2)
    x = rng.standard_normal((512, 256))
    x[:, 5] = 0
    h = x.T @ x / len(x)
    w = rng.standard_normal((8, 256)).astype(np.float32)
    q = dequantize(gptq.quantize_gptq(w, h, "Q4_K"), "Q4_K", w.shape)
    assert np.isfinite(q).all()
    with pytest.raises(ValueError, match="Hessian"):
        gptq.quantize_gptq(w, h[:128, :128], "Q4_K")
    with pytest.raises(ValueError, match="multiple of 256"):
        gptq.quantize_gptq(w[:, :96], h[:96, :96], "Q4_K")
    with pytest.raises(ValueError, match="not F16"):
        gptq.quantize_gptq(w, h, "F16")


def cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "localllm", "quantize", *args], capture_output=True,
                          text=True, timeout=900)  # fmt: skip


def test_gptq_needs_a_calibration_text(tiny_llama: Path, corpus_dir: Path, tmp_path: Path) -> None:
    out = str(tmp_path / "out.gguf")
    done = cli(str(tiny_llama), "--type", "Q4_K_M", "--method", "gptq", "--output", out)
    assert done.returncode != 0 and "--method gptq needs --calibrate TEXT" in done.stderr
    done = cli(str(tiny_llama), "--type", "Q4_K_M", "--method", "gptx", "--output", out)
    assert done.returncode != 0 and "unknown --method gptx" in done.stderr
    imatrix = tmp_path / "m.imatrix"
    made = cli(str(tiny_llama), "--type", "Q8_0", "--output", str(tmp_path / "q8.gguf"), "--calibrate",
               str(corpus_dir / "alice.txt"), "--calibrate-tokens", "64", "--save-imatrix", str(imatrix))  # fmt: skip
    assert made.returncode == 0, made.stderr
    done = cli(str(tiny_llama), "--type", "Q4_K_M", "--method", "gptq", "--calibrate", str(imatrix), "--output", out)
    assert done.returncode != 0 and "keeps no Hessians" in done.stderr
    done = cli(str(tiny_llama), "--type", "Q4_K_M", "--method", "gptq", "--calibrate", str(corpus_dir / "alice.txt"),
               "--engine", "llama.cpp", "--output", out)  # fmt: skip
    assert done.returncode != 0 and "--engine localllm" in done.stderr
    assert not Path(out).exists()


@pytest.fixture(scope="module")
def smol_f32(default_model_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    need("gguf", "pip install -e '.[dev]'")
    out = tmp_path_factory.mktemp("smol") / "smollm2-f32.gguf"
    return quantize_file(default_model_path, out, "F32", allow_requantize=True).path


CAL_TOKENS, EVAL_TOKENS = "1024", 256


def quantize_smol(smol_f32: Path, out: Path, *extra: str) -> dict:
    done = cli(str(smol_f32), "--type", "Q4_K_M", "--json", "--output", str(out), "--calibrate",
               str(corpus_dir_path() / "tinyshakespeare.txt"), "--calibrate-tokens", CAL_TOKENS, *extra)  # fmt: skip
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def corpus_dir_path() -> Path:
    import conftest

    return Path(os.environ.get("LOCALLLM_CORPUS") or conftest.CORPUS)


def kl_against(smol_f32: Path, path: Path) -> dict:
    """llama.cpp's evaluation of `path` against the F32 source on text the calibration did not see."""
    from localllm.evaluate import evaluate, read_text
    from localllm.models_registry.store import Store
    from localllm.types import LoadOptions

    store = Store()
    store.import_file(smol_f32, "f32")
    store.import_file(path, path.stem)
    r = evaluate(path.stem, read_text(corpus_dir_path() / "alice.txt"), options=LoadOptions(backend="llama.cpp"),
                 limit=EVAL_TOKENS, ref="f32")  # fmt: skip
    assert np.isfinite(r["perplexity"]) and r["top1_agreement"] > 0.8, r
    return r


@pytest.fixture(scope="module")
def rounded(smol_f32: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict, float]:
    """The default model's Q4_K_M with the importance matrix of the same text, rounded (llama.cpp's
    bytes): (file, quantize's report, KL against the source)."""
    need("torch", "pip install -e '.[dev]'")
    need("llama_cpp", "pip install -e '.[dev]' (llama-cpp-python)")
    path = tmp_path_factory.mktemp("rounded") / "imatrix.gguf"
    report = quantize_smol(smol_f32, path)
    return path, report, kl_against(smol_f32, path)["kl_mean"]


def test_gptq_file_on_the_default_model(smol_f32: Path, rounded: tuple[Path, dict, float], tmp_path: Path) -> None:
    """GPTQ Q4_K_M of the default model: the plain file's types and size, other values, read by
    llama.cpp, and its logits closer to the F32 source's than the same importance matrix's
    rounding gives (on text the calibration did not see)."""
    path, report, kl_rounded = rounded
    corrected = quantize_smol(smol_f32, tmp_path / "gptq.gguf", "--method", "gptq")
    assert corrected["bytes"] == report["bytes"] and corrected["tensor_types"] == report["tensor_types"]
    with GGUFFile(path) as a, GGUFFile(tmp_path / "gptq.gguf") as b:
        assert [(t.name, t.ggml_type) for t in a.tensors.values()] == [(t.name, t.ggml_type) for t in b.tensors.values()]
        differ = {n for n in a.tensors if bytes(a.tensor_bytes(n)) != bytes(b.tensor_bytes(n))}
        assert {n for n in a.tensors if ".attn_" in n and n.endswith("weight") and "norm" not in n} <= differ
        assert "token_embd.weight" not in differ  # looked up, not multiplied: rounded as it was
    assert kl_against(smol_f32, tmp_path / "gptq.gguf")["kl_mean"] < kl_rounded


def test_awq_scales_fold_without_changing_the_model(tiny_llama: Path, corpus_dir: Path, tmp_path: Path) -> None:
    """The scales AWQ picks are folded exactly: written unrounded (F32), the model's logits in
    llama.cpp are the source's; and the scaled matrices' inputs are measured as x / s."""
    need("torch", "pip install -e '.[dev]'")
    need("llama_cpp", "pip install -e '.[dev]' (llama-cpp-python)")
    from localllm.evaluate import evaluate, read_text
    from localllm.models_registry.store import Store
    from localllm.quant import awq
    from localllm.quant.calibrate import collect_imatrix
    from localllm.types import LoadOptions

    text = read_text(corpus_dir / "alice.txt")
    hessians: dict[str, np.ndarray] = {}
    collect_imatrix(tiny_llama, text, tokens=256, hessians=hessians)
    values, scales, alphas = awq.fold(str(tiny_llama), "Q4_0", hessians)
    assert set(alphas) == {f"blk.{i}.{p}.weight" for i in range(2) for p in ("attn_norm", "ffn_norm", "ffn_up")}
    assert any(a > 0 for a in alphas.values()) and set(scales) <= set(values)
    with GGUFFile(tiny_llama) as f:
        for name, s in scales.items():  # input channels up; ffn_up's rows down, ffn_down's inputs up
            want = _values(f, name) * s[None, :].astype(np.float32)
            down = scales.get(name.replace("ffn_up", "ffn_down"), np.ones(1)) if "ffn_up" in name else np.ones(1)
            np.testing.assert_allclose(values[name], want / down[:, None].astype(np.float32), rtol=1e-5)
        for name in values.keys() - scales.keys():  # the producers: norms divided, ffn_up rows
            assert name.endswith(("attn_norm.weight", "ffn_norm.weight", "ffn_up.weight")), name
    scaled = collect_imatrix(tiny_llama, text, tokens=256)
    for name, v in awq.rescaled(scaled, scales).items():
        np.testing.assert_allclose(v, scaled[name] / scales[name] ** 2, rtol=1e-5)
    quantize_file(tiny_llama, tmp_path / "folded.gguf", "F32", values=values)
    store = Store()
    store.import_file(tiny_llama, "source")
    store.import_file(tmp_path / "folded.gguf", "folded")
    r = evaluate("folded", text, options=LoadOptions(backend="llama.cpp"), limit=128, ref="source")
    assert r["kl_mean"] < 1e-5 and r["top1_agreement"] > 0.99, r


def test_awq_gptq_file_on_the_default_model(smol_f32: Path, rounded: tuple[Path, dict, float], tmp_path: Path) -> None:
    """`--method awq+gptq` Q4_K_M of the default model: the plain file's types and size, its norms
    rescaled, and its logits closer to the F32 source's than rounding gives, by more than a tenth."""
    path, report, kl_rounded = rounded
    made = quantize_smol(smol_f32, tmp_path / "awq.gguf", "--method", "awq+gptq")
    assert made["bytes"] == report["bytes"] and made["tensor_types"] == report["tensor_types"]
    with GGUFFile(smol_f32) as a, GGUFFile(tmp_path / "awq.gguf") as b:
        norms = [n for n in a.tensors if n.endswith("_norm.weight") and n.startswith("blk.")]
        assert sum(bytes(a.tensor_bytes(n)) != bytes(b.tensor_bytes(n)) for n in norms) > len(norms) // 4
    assert kl_against(smol_f32, tmp_path / "awq.gguf")["kl_mean"] < 0.9 * kl_rounded
