"""The CPU fast path's linear layer: fp16 weights in fbgemm's packed GEMM, fp32 products.

Oracles: F.linear on the same fp16-rounded weights (what the layer promises to compute), the
fp16 rounding bound, the plain F.linear fallback (what runs without fbgemm or off the CPU), and
the real default model in float32 (distribution and greedy choice over a corpus passage).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from localllm.backends.torch import quantized, weights
from localllm.backends.torch.quantized import Fp16Linear, Int4Linear, Int8Linear, quantize_linear
from localllm.backends.torch.weights import Coded
from localllm.gguf_file import GGUFFile

from conftest import need

# fp32 products of O(1) inputs and 0.05-scale weights over K <= 1536: summation order alone
# moves the result by ~1e-6 (fbgemm and MKL block the sums differently).
ATOL, RTOL = 2e-5, 1e-5
FP16_EPS = 2.0**-11  # unit roundoff of fp16: |fl16(w) - w| <= 2^-11 |w| in the normal range
FP16_SUBNORMAL_STEP = 2.0**-24  # spacing below 2^-14; round to nearest errs by half of it


def make(
    out_f: int, in_f: int, bias: bool, seed: int = 0
) -> tuple[torch.Tensor, torch.Tensor | None]:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(out_f, in_f, generator=g) * 0.05
    # fp16 subnormals (< 6.1e-5), one that rounds to zero, one just above, one large
    w[0, :4] = torch.tensor([3e-6, -1e-8, 7e-5, 1.0])
    b = torch.randn(out_f, generator=g) if bias else None
    return w, b


def test_fbgemm_runs_here() -> None:
    # the fast path is the point of the module: on this x86 CPU torch must provide it
    assert quantized.fbgemm_fp16_available()
    layer = quantize_linear(*make(8, 16, bias=False))
    assert layer._packed is not None and layer.weight is None


@pytest.mark.parametrize("rows", [1, 4, 8, 64])
@pytest.mark.parametrize("bias", [False, True], ids=["no-bias", "bias"])
def test_matches_f_linear_on_fp16_weights(rows: int, bias: bool) -> None:
    w, b = make(192, 576, bias)
    layer = quantize_linear(w, b)
    x = torch.randn(rows, 576)
    want = F.linear(x, w.half().float(), b)
    torch.testing.assert_close(layer(x), want, atol=ATOL, rtol=RTOL)
    # leading dims are kept: (B, T, in) → (B, T, out)
    x3 = torch.randn(2, rows, 576)
    torch.testing.assert_close(layer(x3), F.linear(x3, w.half().float(), b), atol=ATOL, rtol=RTOL)


def test_rounding_error_bound() -> None:
    w, _ = make(256, 576, bias=False)
    layer = quantize_linear(w, None)
    err = (layer.dequantize() - w).abs()
    bound = FP16_EPS * w.abs() + FP16_SUBNORMAL_STEP / 2
    assert bool((err <= bound).all()), float((err - bound).max())
    assert float(err.max()) > 0  # the weights really were rounded
    # per output row: |y - x W^T| <= 2^-11 sum_k |x_k| |W_nk| (+ subnormal and fp32 sum terms)
    x = torch.randn(4, 576)
    row_err = (layer(x) - F.linear(x, w)).abs()
    row_bound = (x.abs() @ bound.T) + ATOL
    assert bool((row_err <= row_bound).all())


def test_fallback_equals_fbgemm_path(monkeypatch: pytest.MonkeyPatch) -> None:
    w, b = make(320, 640, bias=True)
    fast = quantize_linear(w, b)
    monkeypatch.setattr(quantized, "fbgemm_fp16_available", lambda: False)
    plain = quantize_linear(w, b)
    assert fast._packed is not None and plain._packed is None
    assert plain.weight.dtype == torch.float16
    assert torch.equal(fast.dequantize(), plain.dequantize())
    for rows in (1, 8, 64):
        x = torch.randn(rows, 640)
        torch.testing.assert_close(fast(x), plain(x), atol=ATOL, rtol=RTOL)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_input_dtypes(dtype: torch.dtype) -> None:
    w, b = make(96, 128, bias=True)
    layer = quantize_linear(w, b)
    x = torch.randn(3, 128)
    y = layer(x.to(dtype))
    assert y.dtype == dtype and y.shape == (3, 96)
    # bf16 in and out: the input and the result are rounded to bf16 (8 bits), nothing else
    torch.testing.assert_close(y.float(), F.linear(x.to(dtype).float(), w.half().float(), b),
                               atol=ATOL, rtol=2.0**-8)  # fmt: skip


def test_device_moves_and_dtype_casts() -> None:
    w, b = make(64, 32, bias=True)
    layer = quantize_linear(w, b)
    layer.float().to(torch.bfloat16)  # dtype casts keep the packed fp16 weights
    assert layer._packed is not None
    x = torch.randn(2, 32)
    torch.testing.assert_close(layer(x), F.linear(x, w.half().float(), b), atol=ATOL, rtol=RTOL)
    # off the CPU (meta stands in for cuda/mps here) the weights become a plain fp16 buffer
    layer.to("meta")
    assert layer._packed is None and layer.weight.device.type == "meta"
    assert layer.weight.dtype == torch.float16
    y = layer(torch.empty(5, 32, device="meta", dtype=torch.bfloat16))
    assert y.shape == (5, 64) and y.device.type == "meta" and y.dtype == torch.bfloat16
    # and back on the CPU it is packed again (from real buffers: meta holds no numbers)
    plain = quantize_linear(w, b).to("meta")
    plain.weight, plain.bias = w.half(), b
    plain.to("cpu")
    assert plain._packed is not None and plain.weight is None
    torch.testing.assert_close(plain(x), F.linear(x, w.half().float(), b), atol=ATOL, rtol=RTOL)


def test_one_vector() -> None:
    """A 1-D input (one position's hidden state) gives a 1-D output, on both layers."""
    w, b = make(32, 64, bias=True)
    x = torch.randn(64)
    for layer in (quantize_linear(w, b), Int4Linear(four_bit(32, 64), b)):
        y = layer(x)
        assert y.shape == (32,)
        torch.testing.assert_close(y, layer(x[None])[0])


def test_empty_input() -> None:
    layer = quantize_linear(*make(16, 8, bias=True))
    assert layer(torch.empty(0, 8)).shape == (0, 16)


def test_build_model_hook(tiny_llama: Path) -> None:
    """`build_model(f, linear=quantize_linear)` makes every projection and the tied head an
    Fp16Linear; the tiny model's weights are fp16 already, so its logits are the fp32 model's."""
    from localllm.backends.torch.models import build_model

    with GGUFFile(tiny_llama) as f:
        ref, fast = build_model(f), build_model(f, linear=quantize_linear)
    n_fp16 = sum(isinstance(m, Fp16Linear) for m in fast.modules())
    assert n_fp16 == sum(isinstance(m, torch.nn.Linear) for m in ref.modules()) > 0
    assert isinstance(fast.output, Fp16Linear)
    ids = torch.randint(0, ref.args.vocab_size, (1, 24), generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        want = ref.logits(ref(ids, [ref.make_caches(32)]))
        got = fast.logits(fast(ids, [fast.make_caches(32)]))
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


def test_default_model_keeps_fp32_predictions(default_model_path: Path, corpus_dir: Path) -> None:
    """SmolLM2 in float32, then with every projection and the head made Fp16Linear, over a
    passage of the corpus: KL(fp32 || fp16) per token and greedy agreement."""
    need("llama_cpp", "pip install -e '.[dev]' (llama-cpp-python tokenizes the passage)")
    import llama_cpp

    from localllm.backends.torch.models import build_model

    text = (corpus_dir / "alice.txt").read_text(encoding="utf-8")[2000:4000]
    vocab = llama_cpp.Llama(str(default_model_path), vocab_only=True, verbose=False)
    ids = torch.tensor([vocab.tokenize(text.encode())[:160]])
    with GGUFFile(default_model_path) as f:
        model = build_model(f)
    with torch.inference_mode():
        want = model.logits(model(ids, [model.make_caches(256)])).log_softmax(-1)
        for name, m in list(model.named_modules()):
            if isinstance(m, torch.nn.Linear):
                model.set_submodule(name, Fp16Linear.from_float(m.weight, m.bias))
        got = model.logits(model(ids, [model.make_caches(256)])).log_softmax(-1)
    kl = (want.exp() * (want - got)).sum(-1).mean().item()
    assert kl < 1e-3, kl  # measured ~2e-6; the goal for any CPU fast path is 0.01
    # greedy choices agree except at near ties of the fp32 model (1 of 160 here, gap ~1e-3)
    picked = got.argmax(-1, keepdim=True)
    gap = want.max(-1, keepdim=True).values - want.gather(-1, picked)
    assert float(gap.max()) < 0.01, float(gap.max())
    assert (gap > 0).float().mean().item() <= 0.01


# -- the file's 4-bit matrices (Int4Linear) ---------------------------------------------------

BF16_EPS = 2.0**-8  # bf16's spacing relative to a value: rounding errs by at most half of it


def four_bit(out_f: int, in_f: int, seed: int = 0) -> Coded:
    """Random codes with Q4_1-like groups: low ≈ -8 scale, scale ~ 0.01."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 16, (out_f, in_f), generator=g, dtype=torch.int8)
    scale = torch.rand(out_f, in_f // 32, generator=g) * 0.02 + 1e-3
    low = -8 * scale + torch.randn(out_f, in_f // 32, generator=g) * 1e-3
    return Coded(q, scale, low, 32, 4)


def eight_bit(out_f: int, in_f: int, *, group: int, low: bool, seed: int = 0) -> Coded:
    """Random int8 codes in groups of `group` (Q8_0-like without a low, Q5_K-like with one)."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(-128, 128, (out_f, in_f), generator=g, dtype=torch.int8)
    scale = torch.rand(out_f, in_f // group, generator=g) * 1e-3 + 1e-5
    lows = torch.randn(out_f, in_f // group, generator=g) * 1e-2 if low else None
    return Coded(q, scale, lows, group, 8)


def bf16(t: torch.Tensor) -> torch.Tensor:
    return t.to(torch.bfloat16).float()


def test_int4_runs_here() -> None:
    # torch's CPU int4 matmul is part of every x86 build this project installs
    assert quantized.int4_available()


@pytest.mark.parametrize("rows", [1, 3, 8, 64])
@pytest.mark.parametrize("bias", [False, True], ids=["no-bias", "bias"])
def test_int4_is_the_files_matrix_in_bf16_arithmetic(rows: int, bias: bool) -> None:
    """y = bf16(x) @ W.T with W the codes times bf16 scales plus bf16 zeros (what the layer
    documents). The kernel rounds each dequantized weight and the result to bf16 (sums are
    float32), so the error bound is 2^-9 (|y| + Σ|x w|): bf16's unit roundoff on both."""
    w = four_bit(48, 96, seed=rows)
    b = torch.randn(48) if bias else None
    layer = Int4Linear(w, b)
    x = torch.randn(2, rows, 96)
    zero = bf16(w.low + 8 * w.scale)
    codes = w.q.double().view(48, 3, 32) - 8
    weight = (codes * bf16(w.scale).double().unsqueeze(-1) + zero.double().unsqueeze(-1))
    xb, weight = bf16(x).double(), weight.view(48, 96)
    want, magnitude = xb @ weight.T, xb.abs() @ weight.abs().T
    got = layer(x)
    assert got.shape == (2, rows, 48) and got.dtype == torch.float32
    if b is not None:
        got = got - b
    err = (got.double() - want).abs()
    assert bool((err <= BF16_EPS / 2 * (want.abs() + magnitude)).all()), float(err.max())
    # dequantize() is the kernel times the identity: the weights as it rounds them
    assert float((layer.dequantize().double() - weight).abs().max()) <= BF16_EPS * float(
        weight.abs().max()
    )


def test_quantize_linear_keeps_4_bit_only_where_the_kernel_takes_it() -> None:
    assert isinstance(quantize_linear(four_bit(32, 64)), Int4Linear)
    rows_of_8 = quantize_linear(four_bit(24, 64))  # the kernel wants rows in tiles of 16
    assert isinstance(rows_of_8, Fp16Linear)
    torch.testing.assert_close(rows_of_8.dequantize(), four_bit(24, 64).dequantize(),
                               atol=FP16_SUBNORMAL_STEP, rtol=FP16_EPS)  # fmt: skip
    assert isinstance(quantize_linear(*make(32, 64, bias=False)), Fp16Linear)  # dense input


def test_int4_falls_back_to_fp16_without_the_kernel(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(quantized, "int4_available", lambda: False)
    assert isinstance(quantize_linear(four_bit(32, 64)), Fp16Linear)


# -- int4 on a GPU: tinygemm's layout (device_linear) -----------------------------------------


def test_int4_gpu_branch_passes_torchs_shape_checks_on_meta() -> None:
    """The GPU branch (`_convert_weight_to_int4pack`, `_weight_int4pack_mm`) has no kernel
    without a GPU; on fake tensors (the meta device) torch's own shape functions check every call
    it makes: two codes a byte in uint8, the K tiling, a 4-D int32 packed matrix, 2-D rows in."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    assert [Int4Linear.inner_k_tiles(k) for k in (96, 576, 1536, 2048)] == [2, 4, 8, 8]
    w = four_bit(48, 576)
    with FakeTensorMode(allow_non_fake_inputs=True):
        layer = Int4Linear(w.map(lambda t: t.to("meta")), torch.zeros(48, device="meta"))
        y = layer(torch.zeros(2, 3, 576, device="meta"))
    assert layer.packed.shape == (48 // 8, 576 // (16 * 4), 32, 4 // 2)
    assert layer.packed.dtype == torch.int32 and layer.scales_zeros.shape == (576 // 32, 48, 2)
    assert y.shape == (2, 3, 48) and y.dtype == torch.float32


def test_device_linear_keeps_every_quantized_matrix_coded() -> None:
    """The factory a GPU's int4 precision loads with, run here on the CPU's kernel: every
    projection (attention's too) is asked for its codes; 4-bit matrices the kernel takes stay
    4-bit, other codes (and 4-bit ones it does not take) are int8, and float matrices are plain
    Linears in the compute dtype, shared, not copied."""
    from localllm.backends.torch.models.base import device_linear

    linear = device_linear(torch.device("cpu"), torch.bfloat16)
    assert "layers.0.attention.wqkv".endswith(linear.coded) and "output".endswith(linear.coded)
    assert isinstance(linear(four_bit(32, 64)), Int4Linear)
    odd = linear(four_bit(24, 64))  # rows the kernel does not take: int8 codes
    assert isinstance(odd, Int8Linear) and odd.q.dtype == torch.int8
    assert torch.equal(odd.dequantize(torch.bfloat16), four_bit(24, 64).dequantize(torch.bfloat16))
    assert isinstance(linear(eight_bit(24, 64, group=16, low=False)), Int8Linear)
    w, b = make(32, 64, bias=True)
    dense = linear(w, b)
    assert isinstance(dense, torch.nn.Linear) and dense.weight.data_ptr() == w.data_ptr()


def test_device_linear_without_the_kernel_keeps_4_bit_codes_in_int8(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from localllm.backends.torch.models.base import device_linear

    monkeypatch.setattr(quantized, "int4_available", lambda device="cpu": False)
    layer = device_linear(torch.device("cpu"), torch.bfloat16)(four_bit(32, 64))
    assert isinstance(layer, Int8Linear)
    assert torch.equal(layer.dequantize(), four_bit(32, 64).dequantize())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("group,low", [(32, False), (16, False), (32, True)],
                         ids=["q8_0-like", "q6_k-like", "q5_k-like"])  # fmt: skip
def test_int8_is_the_files_matrix_decoded_to_the_input_dtype(dtype: torch.dtype, group: int,
                                                             low: bool) -> None:  # fmt: skip
    """Int8Linear computes exactly F.linear over the file's values rounded once to the input's
    dtype: the numbers of a model decoded up front, at 1 byte a weight (plus the maps)."""
    w = eight_bit(48, 96, group=group, low=low)
    b = torch.randn(48)
    layer = Int8Linear(w, b)
    for rows in (1, 5):
        x = torch.randn(2, rows, 96).to(dtype)
        got = layer(x)
        assert got.dtype == dtype and got.shape == (2, rows, 48)
        assert torch.equal(got, F.linear(x, w.dequantize(dtype), b.to(dtype)))
    assert torch.equal(layer.dequantize(), w.dequantize())
    layer.chunk = 5 * 96  # eager: a large weight is decoded (and multiplied) 5 rows at a time
    x = torch.randn(3, 96).to(dtype)
    dense = w.dequantize(dtype)
    assert torch.equal(layer(x), torch.cat([F.linear(x, dense[i : i + 5], b[i : i + 5].to(dtype))
                                            for i in range(0, 48, 5)], dim=-1))  # fmt: skip
    per_weight = sum(t.numel() * t.element_size() for t in (layer.q, layer.scale, layer.low)
                     if t is not None) / w.q.numel()  # fmt: skip
    assert per_weight == 1 + 4 / group * (2 if low else 1)


def test_int4_model_through_device_linear_matches_the_cpu_kernel(default_model_path: Path) -> None:
    """SmolLM2 loaded the way a GPU's int4 loads it (every Q4_1 projection 4-bit, bf16 compute),
    here with the CPU's kernel: the projections are the file's codes, and its next-token
    distribution over a corpus line stays near f32's (all of attention's inputs round to bf16,
    so the bar is the int4 precision's own, KL < 0.05)."""
    from localllm.backends.torch.models import build_model
    from localllm.backends.torch.models.base import device_linear

    with GGUFFile(default_model_path) as f:
        model = build_model(f, dtype=torch.bfloat16, linear=device_linear(torch.device("cpu"),
                                                                          torch.bfloat16))  # fmt: skip
        ref = build_model(f)
        embedding = weights.tensor(f, "token_embd.weight")
    assert isinstance(model.layers[0].attention.wqkv, Int4Linear)
    assert isinstance(model.layers[29].feed_forward.w2, Int4Linear)
    # the tied head is the Q8_0 embedding's codes, not a bf16 copy of it
    assert isinstance(model.output, Int8Linear) and torch.equal(model.output.dequantize(), embedding)
    ids = torch.tensor([[1, 504, 3156, 282, 253, 655, 314, 1115, 28, 357, 2092, 288]])
    with torch.no_grad():
        got = model.logits(model(ids, [model.make_caches(16)])).float().log_softmax(-1)
        want = ref.logits(ref(ids, [ref.make_caches(16)])).log_softmax(-1)
    kl = (want.exp() * (want - got)).sum(-1)
    assert float(kl.max()) < 0.05, kl.tolist()


def test_int8_compiles_to_one_graph_with_the_eager_numbers(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """What a compiled GPU step does with an int8 matrix (the decode traced into the graph, no
    break), here with inductor's CPU backend: the same bits as eager."""
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    layer = Int8Linear(eight_bit(48, 96, group=16, low=True), torch.randn(48))
    compiled = torch.compile(layer, fullgraph=True)
    for rows in (1, 5):
        x = torch.randn(2, rows, 96).to(torch.bfloat16)
        assert torch.equal(compiled(x), layer(x))


def test_mixed_types_stay_coded_and_compute_as_decoded(gemma_model_path: Path,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """Gemma 3's Q4_K_M file fuses Q4_K with Q6_K parts (and has Q8_0/Q5_* matrices): loaded as
    a GPU's int4 loads it, no projection is a bf16 copy, and the logits are bit for bit those of
    the same model with every non-int4 matrix decoded to bf16 up front."""
    from localllm.backends.torch.models import build_model
    from localllm.backends.torch.models.base import default_linear, device_linear

    def decoded(w: torch.Tensor | Coded, b: torch.Tensor | None = None) -> torch.nn.Module:
        if isinstance(w, Coded):
            if Int4Linear.fits(w):
                return Int4Linear(w, b)
            w = w.dequantize(torch.bfloat16)
        return default_linear(w, b)

    decoded.coded = ("",)  # type: ignore[attr-defined]
    monkeypatch.setattr(Int8Linear, "chunk", 1 << 30)  # the 262,144-row head in one product too
    with GGUFFile(gemma_model_path) as f:
        types = {info.ggml_type.name for name, info in f.tensors.items() if name.startswith("blk.")}
        model = build_model(f, dtype=torch.bfloat16, linear=device_linear(torch.device("cpu"),
                                                                          torch.bfloat16))  # fmt: skip
        ref = build_model(f, dtype=torch.bfloat16, linear=decoded)
    assert {"Q4_K", "Q6_K"} <= types, types
    kinds = {type(m) for name, m in model.named_modules() if name.endswith(("wqkv", "wo", "w13", "w2", "output"))}
    assert kinds == {Int4Linear, Int8Linear}, kinds
    ids = torch.tensor([[2, 818, 5279, 529, 7001, 563]])
    with torch.no_grad():
        got = model.logits(model(ids, [model.make_caches(8)]))
        want = ref.logits(ref(ids, [ref.make_caches(8)]))
    assert torch.equal(got, want)


def test_default_model_int4_layout(default_model_path: Path) -> None:
    """SmolLM2 (Q4_1 projections, a Q8_0 embedding) on the CPU default: the feed-forward
    matrices are its own 4-bit codes, attention and the tied head fp16."""
    from localllm.backends.torch.models import build_model
    from localllm.backends.torch.weights import tensor

    with GGUFFile(default_model_path) as f:
        model = build_model(f, linear=quantize_linear)
        w2 = tensor(f, "blk.3.ffn_down.weight")
    layer = model.layers[3]
    assert isinstance(layer.feed_forward.w13, Int4Linear)
    assert isinstance(layer.feed_forward.w2, Int4Linear)
    assert isinstance(layer.attention.wqkv, Fp16Linear)
    assert isinstance(model.output, Fp16Linear)
    # the codes are the file's: only the bf16 rounding of each group's scale and zero differs
    got = layer.feed_forward.w2.dequantize()
    assert float((got - w2).abs().max()) <= BF16_EPS * float(w2.abs().max())


# -- the file's embedding rows (BlockEmbedding) -----------------------------------------------


@pytest.mark.parametrize("which", ["default_model_path", "gemma_model_path"])
def test_block_embedding_rows_are_the_tables(which: str, request: pytest.FixtureRequest) -> None:
    """Rows dequantized on lookup equal the dense table's, bit for bit, and it holds only the
    file's bytes (Q8_0 in both packaged models)."""
    from localllm.backends.torch.quantized import BlockEmbedding
    from localllm.backends.torch.weights import tensor

    path = request.getfixturevalue(which)
    with GGUFFile(path) as f:
        emb = BlockEmbedding.from_gguf(f, "token_embd.weight", torch.float32)
        dense = tensor(f, "token_embd.weight")
        stored = f.tensors["token_embd.weight"].nbytes
    vocab = dense.shape[0]
    ids = torch.tensor([[0, 1, vocab - 1], [17, 17, vocab // 2]])
    got = emb(ids)
    assert got.shape == (2, 3, dense.shape[1]) and got.dtype == torch.float32
    assert torch.equal(got, dense[ids])
    assert emb.blocks.numel() == stored


def test_cpu_fast_paths_look_up_the_files_rows(default_model_path: Path) -> None:
    from localllm.backends.torch.quantized import BlockEmbedding
    from localllm.backends.torch.runner import TorchRunner

    fast = TorchRunner(default_model_path, n_ctx=64, dtype="int4", device="cpu")
    assert isinstance(fast.model.tok_embeddings, BlockEmbedding)
    assert fast.model.make_caches(4)[0].dtype == torch.float32  # the working dtype, as before
    ref = TorchRunner(default_model_path, n_ctx=64, dtype="f32", device="cpu")
    assert isinstance(ref.model.tok_embeddings, torch.nn.Embedding)  # f32 shares it with the head
    ids = torch.tensor([[1, 500, 49151]])
    assert torch.equal(fast.model.embed(ids), ref.model.embed(ids))


def _rows_alone_and_together(layer: torch.nn.Module, in_f: int) -> int:
    """Decode rows (B, 1, in) for B = 2..16: how many rows differ in any bit from the same row
    evaluated alone."""
    g = torch.Generator().manual_seed(7)
    differ = 0
    for b in range(2, 17):
        x = torch.randn(b, 1, in_f, generator=g)
        together = layer(x)
        differ += sum(not torch.equal(layer(x[i : i + 1]), together[i : i + 1]) for i in range(b))
    return differ


def test_a_decode_rows_bits_do_not_depend_on_the_rows_beside_it() -> None:
    """What keeps a seeded sequence's tokens the same alone and in a batch: fbgemm's fp16 GEMM
    (its rows padded to `fp16_row_quantum()`) and torch's int4 matmul give a row the same bits at
    any row count, so the runner keeps them batched; MKL's float32 GEMM does not (one row takes
    another kernel than several), so the runner's CPU models evaluate plain projections' decode
    rows one at a time (`RowsApart`)."""
    from localllm.backends.torch.models.base import RowsApart

    w, b = make(960, 576, bias=True)
    assert _rows_alone_and_together(quantize_linear(w, b), 576) == 0
    if quantized.int4_available():
        assert _rows_alone_and_together(Int4Linear(four_bit(576, 1536), None), 1536) == 0
    plain = torch.nn.Linear(576, 960)
    plain.weight.data, plain.bias.data = w, b
    assert _rows_alone_and_together(RowsApart(plain), 576) == 0
    x = torch.randn(3, 5, 576)  # anything but decode rows goes in whole
    assert torch.equal(RowsApart(plain)(x), plain(x))


@pytest.mark.parametrize(("odd_rows", "want"), [((), 1), ((1, 2), 3), ((1,), 2)])
def test_the_fp16_row_quantum_is_where_every_row_count_agrees(odd_rows: tuple, want: int,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    """The probe on kernels that round a last block of `odd_rows` rows (of blocks of 6) their own
    way, as fbgemm's AVX2 kernels do with 1 and 2: it finds the smallest padding that hides them
    (the real kernel is checked above, on whatever CPU this is)."""

    def gemm(x: torch.Tensor, packed: torch.Tensor) -> torch.Tensor:
        y = (x[:, None, :] * packed[None]).sum(-1)  # the same sum for a row at any count
        if x.shape[0] % 6 in odd_rows:
            y[-(x.shape[0] % 6) :] += 1e-3
        return y

    monkeypatch.setattr(quantized, "_fp16_gemm", gemm)
    monkeypatch.setattr(torch.ops.quantized, "linear_prepack_fp16", lambda w, b: w, raising=False)
    quantized.fp16_row_quantum.cache_clear()
    try:
        assert quantized.fp16_row_quantum() == want
    finally:
        quantized.fp16_row_quantum.cache_clear()
