"""The per-tensor type mix against llama.cpp's own quantizer: for every file type, `choose_types`
gives exactly the types `llama_model_quantize` writes, on float32 copies of the real SmolLM2 and
Gemma 3 models and on synthetic Llama models (256-multiple rows, many layers, odd rows, untied
output, shuffled file order, 8 experts, an 80-layer GQA model)."""

from __future__ import annotations

import ctypes
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from localllm.errors import LocalLLMError
from localllm.gguf_file import GGUFFile
from localllm.quant.mix import (
    FILE_TYPES,
    IMATRIX_FILE_TYPES,
    choose_types,
    default_type,
    needs_imatrix,
)
from localllm.quant.writer import _imatrix_entries, quantize_file

from conftest import need
from ggufs import tokenizer_metadata, write_tiny_llama


def f32_copy(src: Path, dst: Path, *, extra: dict[str, np.ndarray] | None = None,
             drop: tuple[str, ...] = (), kv: dict[str, int] | None = None,
             reverse: bool = False) -> Path:  # fmt: skip
    """A float32 GGUF copy of `src` (metadata copied, general.file_type 0), tensors dequantized and
    streamed one at a time; `extra` tensors appended, names containing a `drop` part left out, `kv`
    uint32 keys added or replaced, tensor order reversed with `reverse`."""
    import gguf
    from gguf.quants import dequantize

    reader = gguf.GGUFReader(src)
    arch = str(reader.get_field("general.architecture").contents())
    writer = gguf.GGUFWriter(str(dst), arch=arch)
    kv = kv or {}
    for f in reader.fields.values():
        if f.name.startswith("GGUF.") or f.name in ("general.architecture", "general.file_type"):
            continue
        if f.name in kv:
            continue
        if f.types[0] == gguf.GGUFValueType.ARRAY:
            writer.add_key_value(f.name, f.contents(), f.types[0], sub_type=f.types[-1])
        else:
            writer.add_key_value(f.name, f.contents(), f.types[0])
    writer.add_file_type(0)
    for key, value in kv.items():
        writer.add_uint32(key, value)

    def source(t: gguf.ReaderTensor) -> tuple[tuple[int, ...], Callable[[], np.ndarray]]:
        shape = tuple(int(n) for n in reversed(t.shape))
        return shape, lambda: dequantize(t.data, t.tensor_type).reshape(shape)

    items = [(t.name, *source(t)) for t in reader.tensors if not any(d in t.name for d in drop)]
    items += [(name, a.shape, lambda a=a: a) for name, a in (extra or {}).items()]
    if reverse:
        items.reverse()
    for name, shape, _ in items:
        writer.add_tensor_info(name, shape, np.dtype(np.float32), 4 * int(np.prod(shape)))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for _, _, load in items:
        writer.write_tensor_data(np.ascontiguousarray(load(), dtype=np.float32))
    writer.close()
    return dst


@pytest.fixture(scope="module")
def models(default_model_path: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Synthetic float32 Llama models, small enough to quantize to every file type."""
    need("gguf", "pip install -e '.[dev]' (the gguf package writes test models)")
    tok = tokenizer_metadata(default_model_path)
    d = tmp_path_factory.mktemp("mix")
    rng = np.random.default_rng(3)

    def tiny(name: str, **kw: int) -> Path:
        return write_tiny_llama(d / f"{name}.gguf", tok, dtype=np.float32, seed=kw.pop("seed", 0),
                                **kw)  # fmt: skip

    def w(*shape: int) -> np.ndarray:
        return (rng.standard_normal(shape) * 0.02).astype(np.float32)

    n_vocab = len(tok["tokenizer.ggml.tokens"])
    out = {}
    # 16 layers, rows of 256 multiples: no fallbacks; an untied output.weight and rope_freqs,
    # tensors written in reverse order (llama.cpp visits them sorted by layer, then name)
    base = tiny("base16", n_embd=256, n_ff=512, n_layer=16, n_head=4, n_kv_head=2)
    out["untied16"] = f32_copy(base, d / "untied16.gguf", reverse=True,
                               extra={"output.weight": w(n_vocab, 256),
                                      "rope_freqs.weight": np.ones(32, np.float32)})  # fmt: skip
    # tied embeddings, 12 layers (another use_more_bits pattern), ffn 768
    out["tied12"] = tiny("tied12", n_embd=256, n_ff=768, n_layer=12, n_head=4, n_kv_head=1)
    # rows of 80 (not a multiple of 32: F16 fallbacks) and 96 (Q5_0 / Q5_1 / Q8_0 fallbacks)
    out["odd"] = tiny("odd", n_embd=80, n_ff=96, n_layer=3, n_head=4, n_kv_head=2)
    # 8 layers, tied: the i-quant file types on few enough values to quantize in seconds
    out["small8"] = tiny("small8", n_embd=256, n_ff=512, n_layer=8, n_head=4, n_kv_head=2)
    # 80 layers, n_head != n_head_kv: llama.cpp calls it a 70B model (attn_v Q4_K → Q5_K)
    out["l80"] = tiny("l80", n_embd=256, n_ff=256, n_layer=80, n_head=4, n_kv_head=1)
    # 8 experts (Mixtral-style 3-D expert tensors and a router that stays F32)
    moe_base = tiny("moe_base", n_embd=256, n_ff=512, n_layer=4, n_head=4, n_kv_head=2)
    experts = {}
    for i in range(4):
        experts[f"blk.{i}.ffn_gate_inp.weight"] = w(8, 256)
        experts[f"blk.{i}.ffn_gate_exps.weight"] = w(8, 512, 256)
        experts[f"blk.{i}.ffn_up_exps.weight"] = w(8, 512, 256)
        experts[f"blk.{i}.ffn_down_exps.weight"] = w(8, 256, 512)
    out["moe8"] = f32_copy(moe_base, d / "moe8.gguf", drop=(".ffn_gate.", ".ffn_up.", ".ffn_down."),
                           extra=experts, kv={"llama.expert_count": 8, "llama.expert_used_count": 2})  # fmt: skip
    return out


@pytest.fixture(scope="module")
def smol_f32(default_model_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The default model dequantized to F32 by our writer (its `F32` file type)."""
    need("gguf", "pip install -e '.[dev]'")
    out = tmp_path_factory.mktemp("smol") / "smollm2-f32.gguf"
    return quantize_file(default_model_path, out, "F32", allow_requantize=True).path


@pytest.fixture(scope="module")
def gemma_f32(gemma_model_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    need("gguf", "pip install -e '.[dev]'")
    out = tmp_path_factory.mktemp("gemma") / "gemma3-f32.gguf"
    return quantize_file(gemma_model_path, out, "F32", allow_requantize=True).path


def header(path: Path) -> tuple[dict[str, object], list[tuple[str, tuple[int, ...], str]]]:
    """Metadata and (name, ne shape, type) of every tensor, in file order. `GGUFFile`, not
    `gguf.GGUFReader`: the reader takes ~5 s per file to parse a 49k-token vocabulary."""
    with GGUFFile(path) as g:
        tensors = [(t.name, t.shape, t.ggml_type.name) for t in g.tensors.values()]
        return dict(g.metadata), tensors


def llamacpp_types(src: Path, dst: Path, file_type: str, *, reader: bool = False,
                   keep: bool = False) -> dict[str, str]:  # fmt: skip
    """Quantize `src` with llama.cpp's `llama_model_quantize`; the written tensor types (checked
    against `gguf.GGUFReader`'s reading with `reader`)."""
    need("llama_cpp", "pip install -e '.[dev]' (llama-cpp-python is the quantization oracle)")
    import llama_cpp

    p = llama_cpp.llama_model_quantize_default_params()
    p.ftype = FILE_TYPES[file_type]
    p.nthread = 2
    alive = None
    if file_type in IMATRIX_FILE_TYPES:  # llama.cpp refuses these without one
        alive = _imatrix_entries(llama_cpp, importance(src))
        p.imatrix = ctypes.cast(alive[0], type(p.imatrix))
    rc = llama_cpp.llama_model_quantize(str(src).encode(), str(dst).encode(), ctypes.byref(p))
    del alive
    assert rc == 0, f"llama_model_quantize {src.name} → {file_type} failed ({rc})"
    metadata, tensors = header(dst)
    assert metadata["general.file_type"] == FILE_TYPES[file_type]
    types = {name: t for name, _, t in tensors}
    if reader:
        import gguf

        r = gguf.GGUFReader(dst)
        assert {t.name: t.tensor_type.name for t in r.tensors} == types
        del r
    if not keep:
        dst.unlink()
    return types


def ours(src: Path, file_type: str) -> dict[str, str]:
    metadata, tensors = header(src)
    arch = str(metadata["general.architecture"])
    hp = {k.removeprefix(f"{arch}."): v for k, v in metadata.items() if k.startswith(f"{arch}.")}
    return choose_types(file_type, tensors, arch=arch, n_layer=hp["block_count"],
                        n_head=hp["attention.head_count"], n_head_kv=hp["attention.head_count_kv"],
                        n_expert=hp.get("expert_count", 0), has_imatrix=file_type in IMATRIX_FILE_TYPES)  # fmt: skip


def check(src: Path, dst: Path, file_type: str, *, reader: bool = False,
          keep: bool = False) -> Counter[str]:  # fmt: skip
    theirs = llamacpp_types(src, dst, file_type, reader=reader, keep=keep)
    mine = ours(src, file_type)
    assert set(mine) == set(theirs)
    wrong = {n: (mine[n], theirs[n]) for n in theirs if mine[n] != theirs[n]}
    assert not wrong, f"{src.name} {file_type}: (ours, llama.cpp) differ for {wrong}"
    return Counter(theirs.values())


SYNTHETIC = ["untied16", "tied12", "odd", "l80", "moe8"]
# the i-quant file types (their quantization in llama.cpp takes seconds each): in the suite on the
# models whose rules differ for them (GQA 2 untied, 70B, 8 experts); tied12, odd and the F16
# source under -m slow (run by hand: all match)
_IQ_SLOW_ON = ("tied12", "odd", "tiny_f16")


def _cases(*models: str) -> list[object]:
    """(model, file type) parameters — or the file type alone for one model — slow where said."""
    out: list[object] = []
    for model in models:
        for t in FILE_TYPES:
            args = (model, t) if len(models) > 1 else (t,)
            slow = model in _IQ_SLOW_ON and (t in IMATRIX_FILE_TYPES or t in ("IQ3_S", "IQ3_M"))
            out.append(pytest.param(*args, marks=pytest.mark.slow) if slow else pytest.param(*args))
    return out


@pytest.mark.parametrize(("model", "file_type"), _cases(*SYNTHETIC))
def test_synthetic_matches_llamacpp(model: str, file_type: str, models: dict[str, Path],
                                    tmp_path: Path) -> None:  # fmt: skip
    check(models[model], tmp_path / "out.gguf", file_type)


@pytest.mark.parametrize("file_type", _cases("tiny_f16"))
def test_tiny_f16_source_matches_llamacpp(file_type: str, tiny_llama: Path, tmp_path: Path) -> None:
    """An F16 source: tensors that are not quantized keep their own type (F32 norms, F16 here)."""
    check(tiny_llama, tmp_path / "out.gguf", file_type)


@pytest.mark.parametrize("file_type", ["Q4_K_M", "Q5_K_S", "Q6_K", "Q3_K_M"])
def test_smollm2_matches_llamacpp(file_type: str, smol_f32: Path, tmp_path: Path) -> None:
    """The types, and the whole file's tensor data byte for byte against our writer's."""
    theirs = tmp_path / "theirs.gguf"
    counts = check(smol_f32, theirs, file_type, reader=file_type == "Q4_K_M", keep=True)
    assert counts["F32"] == 61  # the 1-D norms
    if file_type == "Q4_K_M":  # 576-wide rows: Q4_K → Q5_0, Q6_K → Q8_0 (incl. tied token_embd)
        assert counts == {"Q5_0": 166, "Q4_K": 16, "Q6_K": 14, "Q8_0": 15, "F32": 61}
    mine = quantize_file(smol_f32, tmp_path / "ours.gguf", file_type, engine="localllm").path
    with GGUFFile(mine) as a, GGUFFile(theirs) as b:
        assert set(a.tensors) == set(b.tensors)
        differ = [n for n in a.tensors if bytes(a.tensor_bytes(n)) != bytes(b.tensor_bytes(n))]
    assert not differ, f"{file_type}: {len(differ)} tensors differ from llama.cpp's, e.g. {differ[:3]}"


def test_gemma3_matches_llamacpp(gemma_f32: Path, tmp_path: Path) -> None:
    check(gemma_f32, tmp_path / "out.gguf", "Q4_K_M")


def test_file_types() -> None:
    assert default_type("Q4_K_M") == default_type("Q4_K_S") == "Q4_K"
    assert default_type("Q5_K_M") == "Q5_K" and default_type("Q8_0") == "Q8_0"
    assert FILE_TYPES["Q4_K_M"] == 15 and FILE_TYPES["F32"] == 0
    with pytest.raises(ValueError, match="unknown file type 'TQ1_0'"):
        choose_types("TQ1_0", [], arch="llama", n_layer=1, n_head=1, n_head_kv=1)
    with pytest.raises(ValueError, match="unknown file type"):
        default_type("q4_k_m")


# -- the legacy and BF16 file types, and quantizing with an importance matrix, byte for byte ------


def same_tensors(a: Path, b: Path) -> list[str]:
    """Names of the tensors whose type or bytes differ between two GGUFs (the same names)."""
    with GGUFFile(a) as x, GGUFFile(b) as y:
        assert set(x.tensors) == set(y.tensors)
        return [n for n in x.tensors if x.tensors[n].ggml_type != y.tensors[n].ggml_type
                or bytes(x.tensor_bytes(n)) != bytes(y.tensor_bytes(n))]  # fmt: skip


@pytest.mark.parametrize("file_type", ["Q4_1", "Q5_0", "Q5_1", "BF16", "Q2_K", "Q3_K_S", "Q3_K_M", "Q3_K_L",
                                       "IQ4_NL", "IQ4_XS"])  # fmt: skip
@pytest.mark.parametrize("model", ["untied16", "odd"])
def test_legacy_and_bf16_files_are_llamacpps_byte_for_byte(file_type: str, model: str, models: dict[str, Path],
                                                          tmp_path: Path) -> None:  # fmt: skip
    src = models[model]
    theirs = tmp_path / "theirs.gguf"
    llamacpp_types(src, theirs, file_type, keep=True)
    mine = quantize_file(src, tmp_path / "ours.gguf", file_type, engine="localllm")
    assert mine.engine == "localllm"
    differ = same_tensors(mine.path, theirs)
    assert not differ, f"{model} {file_type}: {len(differ)} tensors differ, e.g. {differ[:3]}"


def importance(src: Path, seed: int = 5) -> dict[str, np.ndarray]:
    """A made-up importance matrix: a positive weight for each input column of every matrix."""
    rng = np.random.default_rng(seed)
    _, tensors = header(src)
    return {name: (rng.random(shape[0] * (shape[2] if len(shape) == 3 else 1)) * 4 + 0.05).astype(np.float32)
            for name, shape, _ in tensors if len(shape) in (2, 3) and name.endswith("weight")}  # fmt: skip


@pytest.mark.parametrize("file_type", ["Q4_0", "Q5_0", "Q4_1", "Q5_1", "Q2_K", "Q3_K_M", "Q4_K_M", "Q5_K_S", "Q6_K",
                                       "IQ4_NL", "IQ4_XS"])  # fmt: skip
def test_with_an_importance_matrix_ours_is_llamacpps(file_type: str, models: dict[str, Path],
                                                     tmp_path: Path) -> None:  # fmt: skip
    """The same importance matrix given to llama.cpp's quantizer (its `llama_model_imatrix_data`)
    and to ours: the same file. Q4_0 / Q5_0 with one keep the first eighth of ffn_down as Q4_1 /
    Q5_1 (llama.cpp's guard), which a plain quantization does not."""
    src = models["untied16"]
    imatrix = importance(src)
    mine = quantize_file(src, tmp_path / "ours.gguf", file_type, engine="localllm", imatrix=imatrix)
    theirs = quantize_file(src, tmp_path / "theirs.gguf", file_type, engine="llama.cpp", imatrix=imatrix)
    differ = same_tensors(mine.path, theirs.path)
    assert not differ, f"{file_type}: {len(differ)} tensors differ, e.g. {differ[:3]}"
    plain = quantize_file(src, tmp_path / "plain.gguf", file_type, engine="localllm")
    assert same_tensors(plain.path, mine.path)  # the importance matrix changed the bytes
    if file_type in ("Q4_0", "Q5_0"):
        guarded = {n for n, t in mine.types.items() if "ffn_down" in n and t != file_type}
        assert guarded == {"blk.0.ffn_down.weight", "blk.1.ffn_down.weight"}  # 16 layers / 8
        assert {mine.types[n] for n in guarded} == {file_type.replace("_0", "_1")}
        assert not any("ffn_down" in n and t != file_type for n, t in plain.types.items())


IQ_FILES = ["IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ2_M", "IQ3_XXS", "IQ3_XS", "IQ3_S", "IQ3_M", "Q2_K_S", "IQ1_S", "IQ1_M"]
# on the 8-layer model in the default suite: between them every lattice type, make_qp_quants's path
# (IQ2_XXS) and Q2_K_S's Q2_K with an importance matrix; the rest, and the larger models, under -m slow
IQ_FAST = ("IQ2_XXS", "IQ2_M", "IQ3_XS", "Q2_K_S", "IQ1_S")


def _iq_cases() -> list[object]:
    cases: list[object] = []
    for file_type in IQ_FILES:
        for model in ("small8", "odd", "untied16", "moe8"):
            fast = model == "odd" or (model == "small8" and file_type in IQ_FAST)
            cases.append(pytest.param(model, file_type, marks=() if fast else pytest.mark.slow))
    return cases


@pytest.mark.parametrize(("model", "file_type"), _iq_cases())
def test_iquant_files_are_llamacpps_byte_for_byte(file_type: str, model: str, models: dict[str, Path],
                                                  tmp_path: Path) -> None:  # fmt: skip
    """The same importance matrix to both quantizers: the same file — the i-quant tensors, the Q2_K /
    IQ3_S / Q4_K / Q5_K bumps, the IQ4_NL fallback of rows that do not fit 256 ("odd"), the 8-expert
    rules and per-expert importance rows ("moe8"; the suite checks those rows below too). IQ3_S and
    IQ3_M need no importance matrix: without one, the same file too."""
    src = models[model]
    imatrix = importance(src)
    mine = quantize_file(src, tmp_path / "ours.gguf", file_type, engine="localllm", imatrix=imatrix)
    theirs = quantize_file(src, tmp_path / "theirs.gguf", file_type, engine="llama.cpp", imatrix=imatrix)
    differ = same_tensors(mine.path, theirs.path)
    assert not differ, f"{model} {file_type}: {len(differ)} tensors differ, e.g. {differ[:3]}"
    kinds = set(mine.types.values())
    fallback = "Q4_0" if file_type == "Q2_K_S" else "IQ4_NL"  # odd: no row fits 256 values
    assert (fallback if model == "odd" else default_type(file_type)) in kinds
    if file_type in IMATRIX_FILE_TYPES and model != "odd":
        assert needs_imatrix(mine.types, file_type) and "output.weight" not in needs_imatrix(mine.types, file_type)
    if file_type in ("IQ3_S", "IQ3_M") and model != "moe8":
        mine = quantize_file(src, tmp_path / "ours-plain.gguf", file_type, engine="localllm")
        theirs = quantize_file(src, tmp_path / "theirs-plain.gguf", file_type, engine="llama.cpp")
        assert not same_tensors(mine.path, theirs.path)


@pytest.mark.parametrize("file_type", IMATRIX_FILE_TYPES)
def test_iquants_without_an_importance_matrix_are_refused_before_writing(file_type: str, models: dict[str, Path],
                                                                         tmp_path: Path) -> None:  # fmt: skip
    """llama.cpp bails out mid-file ("the result will be garbage"); ours refuses first — either
    engine — naming the option that makes one, and keeps nothing; an imatrix that lacks a tensor is
    named too."""
    src = models["untied16"]
    out = tmp_path / "out.gguf"
    for engine in ("localllm", "llama.cpp"):
        with pytest.raises(LocalLLMError, match=rf"{file_type} needs an importance matrix \((IQ|Q2_K).*--calibrate"):
            quantize_file(src, out, file_type, engine=engine)
    assert list(tmp_path.iterdir()) == []
    if file_type != "IQ2_XS":
        return
    partial = importance(src)
    del partial["blk.3.ffn_up.weight"]
    with pytest.raises(LocalLLMError, match="has no entry for blk.3.ffn_up.weight"):
        quantize_file(src, out, "IQ2_XS", engine="localllm", imatrix=partial)
    assert list(tmp_path.iterdir()) == []


def test_expert_tensors_take_one_importance_row_per_expert(models: dict[str, Path]) -> None:
    """A 3-D expert tensor with llama.cpp's ne0·ne2 importance values: each expert quantized with its
    own row, as `llama_model_quantize` does (ggml's quantizer per expert slice is the oracle)."""
    from localllm.quant import row_bytes
    from localllm.quant.writer import quantized_bytes

    from ggml_oracle import ggml_quantize

    name = "blk.1.ffn_up_exps.weight"
    with GGUFFile(models["moe8"]) as f:
        values = np.frombuffer(f.tensor_bytes(name), "<f4").reshape(8, 512, 256)
        per = np.random.default_rng(4).uniform(0.1, 3, (8, 256)).astype(np.float32)
        for type_name in ("IQ2_XXS", "Q4_K"):
            mine = np.frombuffer(quantized_bytes(f, name, type_name, per.reshape(-1)), np.uint8)
            theirs = np.concatenate([ggml_quantize(v, type_name, row_bytes(type_name, 256), w).reshape(-1)
                                     for v, w in zip(values, per, strict=True)])  # fmt: skip
            assert np.array_equal(mine, theirs), type_name
        with pytest.raises(LocalLLMError, match="has 768 values; its rows need 256 for each of 8 experts"):
            quantized_bytes(f, name, "Q4_K", per.reshape(-1)[:768])
        with pytest.raises(LocalLLMError, match="has 512 values; its rows need 256$"):
            quantized_bytes(f, "blk.1.attn_q.weight", "Q4_K", per.reshape(-1)[:512])
