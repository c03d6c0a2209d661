"""Reduced-precision linear layers for the CPU's fast path (pass `quantize_linear` as `linear=`).

Decode streams every weight once per token, so on CPU its speed is bytes per weight. What torch
ships, side by side on SmolLM2-135M's real shapes (bench/torch_gemv.py, 2 threads, AVX2, a
shared 2-core machine; ms for all of one decode step's products at 1 / 4 / 8 rows, then 256
rows without the head; KL(fp32 || format) per token on 512 corpus tokens, top-1 agreement):

    fp32 F.linear                    4 B/w  60 / 144 / 125 ms, 1460 ms   baseline
    fbgemm fp16 weights (this)       2 B/w  21 /  30 /  42 ms, 1010 ms   KL 2e-6, top-1 100%
    bf16 F.linear                    2 B/w  24 /  78 / 145 ms, 6970 ms   KL 5e-5, 99.4%
    fbgemm int8 `linear_dynamic`     1 B/w  13 /  17 /  19 ms,  280 ms   KL 0.07, 82%: it also
                                                                         quantizes activations
    `_weight_int8pack_mm`            1 B/w  106 / 643 / 1229 ms          (bf16 inputs: 23/33/64)
    `_weight_int4pack_mm_for_cpu`  0.6 B/w  14 /  28 /  53 ms            int4 g32: KL 0.06, 81%
    torch.compile'd dequant-GEMV     1 B/w  595 ms at 1 row              inductor's reduction
    weight-only int8, any kernel     1 B/w                               per channel KL 0.004,
                                                                         95.9%; groups of 32
                                                                         KL 0.001, 97.9%

Requantizing to int8 or int4 loses too much (the last rows: KL and top-1 of SmolLM2 with every
matrix requantized from its fp32 weights). Only fp16 and bf16 weights keep the fp32 model's
choices (>= 99% top-1), and fbgemm's fp16 GEMM is the fastest of those at every row count, so
`Fp16Linear` keeps fp16 weights in fbgemm's packed layout and multiplies in fp32; no compile
step. Where fbgemm is missing (another platform, a torch without it) or the input is not on the
CPU, it falls back to `F.linear` on the fp16 weights cast to the input's dtype: the same
numbers, slower.

A file's own 4-bit matrices are another matter: Q4_0, Q4_1 and Q4_K are exactly 4-bit codes with
one affine map per 32 weights, which is what torch's int4 kernel multiplies, so `Int4Linear` keeps
them as stored — nothing is requantized, only the kernel's bf16 roundings differ from f32. On
SmolLM2's feed-forward matrices (AVX-512 EPYC, 2 threads, µs per product at 1 / 4 / 8 rows:
gate|up 65 / 116 / 218 against fp16's 86 / 138 / 209; down 36 / 65 / 112 against 61 / 89 / 131)
it is the faster of the two up to 8 rows, and decode goes from 58 to 67 tokens/s. `quantize_linear`
(the CPU default, `--dtype int4`) uses it for the feed-forward matrices only: see `coded` below.
"""

from __future__ import annotations

import functools
import itertools
import logging
import weakref
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from localllm.backends.torch.weights import Coded, dequantize, raw
from localllm.gguf_file import GGUFFile

__all__ = ["BlockEmbedding", "Fp16Linear", "Int4Linear", "Int8Linear", "fbgemm_fp16_available",
           "int4_available", "quantize_linear"]

log = logging.getLogger(__name__)
_fp16_gemm = torch.ops.quantized.linear_dynamic_fp16  # looked up once: each lookup costs a call
_int4_mm = getattr(torch, "_weight_int4pack_mm_for_cpu", None)  # torch >= 2.5; else no int4

# fbgemm's packed matrix is an object torch.compile cannot trace into (each call split the
# compiled step into ~90 graphs, slower than eager) nor keep in a saved graph: a compiled step
# calls `fp16_gemm` instead, an op the compiler sees as one opaque call, which finds the layer
# by its number. The number reaches the op as a tensor (the layer's `number` buffer), read at
# each call: a graph saved by one process then finds the layers of another.
_LAYERS: dict[int, weakref.ref] = {}
_numbers = itertools.count()


@torch.library.custom_op("localllm::fp16_gemm", mutates_args=())
def fp16_gemm(x: torch.Tensor, layer: torch.Tensor, n_out: int) -> torch.Tensor:
    """x (..., in) float32 through the packed matrix of the `Fp16Linear` whose number is
    `layer` (a 0-d tensor): (..., n_out)."""
    rows = x.reshape(-1, x.shape[-1])
    return _fp16_rows(rows, _LAYERS[int(layer)]()._packed).view(*x.shape[:-1], n_out)


def _fp16_rows(rows: torch.Tensor, packed: object) -> torch.Tensor:
    """fbgemm's fp16 GEMM of rows (n, in) float32, padded with zero rows to a multiple of
    `fp16_row_quantum()` so that each row gets the same bits whatever the row count."""
    return _fp16_padded(rows, packed, fp16_row_quantum())


def _fp16_padded(rows: torch.Tensor, packed: object, quantum: int) -> torch.Tensor:
    """fbgemm's fp16 GEMM of rows (n, in), zero rows added up to a multiple of `quantum`."""
    pad = -rows.shape[0] % quantum
    if not pad:
        return _fp16_gemm(rows, packed)
    return _fp16_gemm(torch.cat((rows, rows.new_zeros(pad, rows.shape[1]))), packed)[: rows.shape[0]]


@functools.cache
def fp16_row_quantum() -> int:
    """The row counts at which fbgemm's fp16 GEMM gives a row the same bits as at any other:
    multiples of this (found once, on a probe).

    fbgemm's kernels take rows in blocks; with its AVX-512 kernels every block rounds alike (1:
    any count), but its AVX2 ones multiply a last block of one or two rows with kernels of their
    own that round differently (measured on a Zen 1 EPYC: a row alone, in two, and in three or
    more gave three different results; padded to a multiple of 3, every count agrees). Padding
    costs one-row decode most: 1.55x for a 1,536 × 576 product there, 1.47x for the 49,152-row
    head; rows then come from one kernel at every count, as speculation and batching need."""
    g = torch.Generator().manual_seed(0)
    packed = torch.ops.quantized.linear_prepack_fp16(torch.randn(64, 256, generator=g), None)
    x = torch.randn(40, 256, generator=g)
    for quantum in (1, 2, 3, 4, 6, 8, 12, 16):
        whole = _fp16_padded(x, packed, quantum)
        if all(torch.equal(_fp16_padded(x[:n], packed, quantum), whole[:n]) for n in range(1, 40)):
            return quantum
    log.warning("fbgemm's fp16 GEMM gives a row other bits at each row count here; a greedy "
                "answer may depend on batching and speculation")  # fmt: skip
    return 1


@fp16_gemm.register_fake
def _(x: torch.Tensor, layer: torch.Tensor, n_out: int) -> torch.Tensor:
    return x.new_empty(*x.shape[:-1], n_out)


@functools.cache
def fbgemm_fp16_available() -> bool:
    """Whether this torch has fbgemm's fp16-weight GEMM (x86 CPU builds do); checked once."""
    try:
        w = torch.ones(8, 8)
        packed = torch.ops.quantized.linear_prepack_fp16(w, None)
        y = torch.ops.quantized.linear_dynamic_fp16(torch.ones(1, 8), packed)
        if not torch.equal(y, torch.full((1, 8), 8.0)):
            raise RuntimeError(f"wrong result {y.tolist()}")
    except Exception as e:  # noqa: BLE001 - any failure means: use the plain path
        log.warning("fbgemm fp16 GEMM unavailable (%s: %s); CPU linears use F.linear on fp16 "
                    "weights, slower", type(e).__name__, e)  # fmt: skip
        return False
    return True


class Fp16Linear(nn.Module):
    """y = x @ W.T + b with W rounded to fp16 (|W16 - W| <= 2^-11 |W|, plus 2^-25 for the
    subnormals below 6.1e-5); products and sums in fp32.

    On CPU the weight lives only in fbgemm's packed form (2 bytes per weight); `dequantize()`
    recovers it. Moving the module off the CPU unpacks it into a plain fp16 `weight` buffer.
    """

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        """weight: (out, in) in fp16 (or any float dtype, rounded to fp16); bias: (out,) or None."""
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self._packed = None
        # (out, in) fp16 and (out,) fp32; `weight` is None while fbgemm holds the packed copy
        self.register_buffer("bias", None if bias is None else bias.detach().float())
        self.register_buffer("weight", None)
        self._key = number = next(_numbers)
        self.register_buffer("number", torch.tensor(number), persistent=False)  # for `fp16_gemm`
        _LAYERS[number] = weakref.ref(self, lambda _, n=number: _LAYERS.pop(n, None))
        self._store(weight.detach())

    def _store(self, weight: torch.Tensor) -> None:
        """Keep `weight` rounded to fp16: on CPU only in fbgemm's packed form, else as `weight`.

        fbgemm rounds float32 to fp16 as torch does (to nearest, ties to even; subnormals too),
        so a float32 matrix is packed as it is: no fp16 and float32 copies (Gemma's head: 1 GB
        at load)."""
        if weight.is_cpu and fbgemm_fp16_available():
            self._packed = torch.ops.quantized.linear_prepack_fp16(weight.float(), self.bias)
            self.weight = None
        else:
            self._packed, self.weight = None, weight.to(torch.float16)

    @classmethod
    def from_float(cls, weight: torch.Tensor, bias: torch.Tensor | None = None) -> Fp16Linear:
        """The layer for a full-precision `weight` (out, in) and `bias`: fits `build_model(linear=)`."""
        return cls(weight, bias)

    def dequantize(self) -> torch.Tensor:
        """The weight this layer multiplies by, (out, in) float32."""
        if self._packed is not None:
            return torch.ops.quantized.linear_unpack_fp16(self._packed)[0]
        return self.weight.float()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: (..., in) → (..., out) in x's dtype."""
        if torch.compiler.is_compiling():  # no look at the packed object: a guard on it cannot be saved
            if self.weight is None and x.is_cpu and x.numel():  # fbgemm holds the weight
                return fp16_gemm(x.float(), self.number, self.out_features).to(x.dtype)
        elif self._packed is not None and x.is_cpu and x.numel():
            rows = x.reshape(-1, self.in_features).float()  # fbgemm takes >= 2-D fp32
            y = _fp16_rows(rows, self._packed)  # (bias added)
            return y.view(*x.shape[:-1], self.out_features).to(x.dtype)
        w = self.dequantize() if self.weight is None else self.weight
        b = None if self.bias is None else self.bias.to(x.dtype)
        return F.linear(x, w.to(device=x.device, dtype=x.dtype), b)

    def _apply(self, fn: Callable[[torch.Tensor], torch.Tensor], recurse: bool = True) -> nn.Module:
        # `.to(device)` cannot move fbgemm's packed matrix: unpack it into a plain fp16 buffer
        # first (and pack again on the way back to the CPU). Dtype changes (`.float()`,
        # `.to(torch.bfloat16)`) leave the weights in fp16: their precision is the point.
        device = fn(torch.zeros(1)).device
        if self._packed is not None and device.type != "cpu":
            self.weight = self.dequantize().to(torch.float16)
            self._packed = None
        weight, self.weight = self.weight, None
        self.number = None  # stays a CPU tensor (the packed path's), made anew: meta has no value
        super()._apply(fn, recurse)
        self.number = torch.tensor(self._key)
        if weight is not None:
            self._store(weight.to(device))
        return self

    def extra_repr(self) -> str:
        kernel = "fbgemm" if self._packed is not None else "F.linear"
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"bias={self.bias is not None}, weights=fp16 ({kernel})")  # fmt: skip


@functools.cache
def int4_available(device: str = "cpu") -> bool:
    """Whether this torch has the int4 matmul on `device` ("cpu": `_weight_int4pack_mm_for_cpu`;
    "cuda", "mps": `_weight_int4pack_mm`), and it gives the right numbers; checked once each."""
    try:
        q = torch.arange(16, dtype=torch.uint8, device=device).repeat(16, 2)  # (16, 32): codes 0..15
        one, zero = torch.ones(16, 1, device=device), torch.zeros(16, 1, device=device)
        y = Int4Linear(Coded(q.to(torch.int8), one, zero, 32, 4))(
            torch.ones(1, 32, dtype=torch.bfloat16, device=device))
        if not torch.equal(y.float().cpu(), torch.full((1, 16), 240.0)):  # w = q: 2 × (0 + ... + 15)
            raise RuntimeError(f"wrong result {y.tolist()}")
    except Exception as e:  # noqa: BLE001 - any failure means: fp16 weights instead
        log.warning("torch's int4 matmul is unavailable on %s (%s: %s); 4-bit matrices run as "
                    "%s weights", device, type(e).__name__, e,
                    "fp16" if device == "cpu" else "bf16")  # fmt: skip
        return False
    return True


class Int4Linear(nn.Module):
    """y = x @ W.T + b for W kept as the file's 4-bit codes with one (scale, low) per 32 weights
    (`weights.Coded` of Q4_0, Q4_1, Q4_K), through torch's int4 matmul on the device the codes
    are on: 0.5 bytes per weight plus 4 bytes of bf16 scale and zero per 32.

    On the CPU that is `_weight_int4pack_mm_for_cpu` over `_convert_weight_to_int4pack_for_cpu`'s
    layout; on CUDA (and MPS) tinygemm's `_weight_int4pack_mm` over `_convert_weight_to_int4pack`,
    which takes two codes a byte (the even column in the high nibble) and tiles K by
    `inner_k_tiles` × 16. Both kernels are fast only for bf16 inputs, so activations go in
    rounded to bf16 (relative error 2^-9); they round each dequantized weight to bf16 too, sum in
    float32 and return bf16. Scale and zero are bf16 (zero = low + 8 scale: the kernels compute
    (q - 8) scale + zero). On the CPU every other layer stays in float32, so these roundings do
    not compound.
    """

    group = 32

    def __init__(self, weight: Coded, bias: torch.Tensor | None = None) -> None:
        super().__init__()
        if not self.fits(weight):
            raise ValueError(f"the int4 kernels do not take this matrix ({weight.bits}-bit codes in "
                             f"groups of {weight.group}, {list(weight.shape)})")  # fmt: skip
        self.out_features, self.in_features = weight.shape
        q = weight.q
        if q.device.type == "cpu":
            packed = torch._convert_weight_to_int4pack_for_cpu(q.to(torch.int32), 2)
        else:  # two codes a byte, the even one high: what tinygemm's packing reads
            pairs = (q[:, ::2].to(torch.uint8) << 4) | q[:, 1::2].to(torch.uint8)
            packed = torch._convert_weight_to_int4pack(pairs, self.inner_k_tiles(self.in_features))
        self.register_buffer("packed", packed)
        zero = weight.low + 8 * weight.scale
        sz = torch.stack([weight.scale, zero], -1).transpose(0, 1)  # (in / 32, out, 2)
        self.register_buffer("scales_zeros", sz.to(torch.bfloat16).contiguous())
        self.register_buffer("bias", None if bias is None else bias.detach().float())

    @staticmethod
    def inner_k_tiles(n_in: int) -> int:
        """tinygemm's K tiling: the largest of 8, 4, 2 whose 16 × tiles divides the input size."""
        return next(t for t in (8, 4, 2) if n_in % (16 * t) == 0)

    @staticmethod
    def fits(weight: Coded) -> bool:
        """Whether the kernels take this matrix: 4-bit codes with a (scale, low) per 32 weights,
        rows in tiles of 16 (the CPU's) and of 8 (tinygemm's), columns in groups of 32 (so K
        tiles of 2 × 16 at least)."""
        return (weight.bits == 4 and weight.group == Int4Linear.group and weight.low is not None
                and weight.shape[0] % 16 == 0 and weight.shape[1] % Int4Linear.group == 0)  # fmt: skip

    def _mm(self, rows: torch.Tensor) -> torch.Tensor:
        """rows (n, in) bf16 → (n, out) bf16."""
        if self.packed.device.type == "cpu":
            return _int4_mm(rows, self.packed, self.group, self.scales_zeros)
        return torch._weight_int4pack_mm(rows, self.packed, self.group, self.scales_zeros)

    def dequantize(self) -> torch.Tensor:
        """The weight this layer multiplies by (bf16 scales and zeros applied), (out, in) float32."""
        eye = torch.eye(self.in_features, dtype=torch.bfloat16, device=self.packed.device)
        return self._mm(eye).float().t().contiguous()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features).to(torch.bfloat16)
        y = self._mm(rows).to(x.dtype)
        if self.bias is not None:
            y = y + self.bias.to(x.dtype)
        return y.view(*x.shape[:-1], self.out_features)

    def _apply(self, fn: Callable[[torch.Tensor], torch.Tensor], recurse: bool = True) -> nn.Module:
        # the packed layouts differ between the CPU and the GPUs: a move is a mistake, said once
        device = fn(torch.zeros(1, device=self.packed.device)).device
        if device.type != self.packed.device.type and device.type != "meta":
            raise ValueError("an Int4Linear is built on its device (its packed layout is the "
                             "device's); load the model there instead of moving it")  # fmt: skip
        return super()._apply(fn, recurse)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"bias={self.bias is not None}, weights=int4 g32")  # fmt: skip


class Int8Linear(nn.Module):
    """y = x @ W.T + b for W kept as the file's codes (`weights.Coded`: Q8_0, Q6_K, Q5_*, and the
    4-bit types where the int4 kernel is not there or does not take the matrix) in int8, one
    byte a weight plus a float32 scale (and low) per group of 16 or 32: on a GPU, a Q6_K or Q8_0
    matrix streams 1.1-1.25 bytes a weight per token instead of bf16's 2.

    The matrix is decoded in float32 (exactly ggml's values) and rounded once to the input's
    dtype, then multiplied: the same numbers as the file decoded to that dtype up front. Eager,
    that decode is a temporary at every call (a block of rows at a time past `chunk` weights,
    each block's product apart: the same values, summed as a GEMM of that many rows sums them).
    Compiled, the decode is traced into the step's graph (no break), where inductor may fold it
    into a decode step's small-row product so that only the int8 codes are read: what gpt-fast's
    int8 weight-only path (`F.linear(x, w.to(dtype)) * scales`) relies on on CUDA; not measured
    on a GPU here. Ours keeps the file's groups instead of one scale per row: requantizing
    SmolLM2 to int8 per row costs KL 0.004 nats against 0.001 in groups of 32 (module
    docstring), and the file's own groups cost nothing.
    """

    def __init__(self, weight: Coded, bias: torch.Tensor | None = None) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.group, self.bits = weight.group, weight.bits
        self.register_buffer("q", weight.q.to(torch.int8))
        self.register_buffer("scale", weight.scale.float())
        self.register_buffer("low", None if weight.low is None else weight.low.float())
        self.register_buffer("bias", None if bias is None else bias.detach().float())

    # Eagerly, rows of the weight are decoded this many weights at a time (a float32 temporary
    # of 16 MiB): Gemma 3's 262,144-row head would otherwise take 670 MB at every step.
    chunk = 1 << 22

    def dequantize(self, dtype: torch.dtype = torch.float32, rows: slice = slice(None)) -> torch.Tensor:
        """The weight this layer multiplies by, (out, in) in `dtype` (or those `rows` of it)."""
        low = None if self.low is None else self.low[rows]
        return Coded(self.q[rows], self.scale[rows], low, self.group, self.bits).dequantize(dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b = None if self.bias is None else self.bias.to(x.dtype)
        if torch.compiler.is_compiling() or self.q.numel() <= self.chunk:  # compiled: fused
            return F.linear(x, self.dequantize(x.dtype), b)
        step = max(1, self.chunk // self.in_features)
        return torch.cat([F.linear(x, self.dequantize(x.dtype, slice(i, i + step)),
                                   None if b is None else b[i : i + step])
                          for i in range(0, self.out_features, step)], dim=-1)  # fmt: skip

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"bias={self.bias is not None}, weights=int{self.bits} codes in int8, g{self.group}")  # fmt: skip


def quantize_linear(weight: torch.Tensor | Coded, bias: torch.Tensor | None = None) -> nn.Module:
    """What the CPU fast path passes to build_model(f, linear=...): the file's 4-bit matrices
    stay 4-bit (`Int4Linear`) where the kernel exists and takes them; the rest are fp16."""
    if isinstance(weight, Coded):
        if int4_available() and Int4Linear.fits(weight):
            return Int4Linear(weight, bias)
        weight = weight.dequantize()
    return Fp16Linear(weight, bias)


# The projections whose 4-bit matrices stay 4-bit: the feed-forward ones, 80% of a layer's weights.
# Measured on SmolLM2 over 2,000 corpus tokens against the f32 path: these alone, top-1 99.2% and
# KL 1.5e-4 nats; with the attention projections too (their q, k, v and output rounded to bf16),
# top-1 falls to 99.0%, at the bar the CPU default must hold (>= 99%).
quantize_linear.coded = ("feed_forward.w13", "feed_forward.w2")  # type: ignore[attr-defined]


class BlockEmbedding(nn.Module):
    """A token embedding kept as the file stores it (e.g. Q8_0: 1.06 bytes per weight), each
    looked-up row dequantized as it is read: the same values as the dense table, exactly.

    The CPU's fast paths keep their head in fp16 (a packed copy), so a float32 table beside it
    only served lookups: 113 MB for SmolLM2, 671 MB for Gemma 3 270M's 262,144 × 640.
    """

    def __init__(self, type_name: str, blocks: torch.Tensor, dim: int, dtype: torch.dtype) -> None:
        """blocks: (vocab, bytes per row) uint8, the GGUF tensor's rows; dtype: rows come out in it."""
        super().__init__()
        self.type_name, self.dim, self.dtype = type_name, dim, dtype
        self.num_embeddings = blocks.shape[0]
        self.register_buffer("blocks", blocks)

    @classmethod
    def from_gguf(cls, f: GGUFFile, name: str, dtype: torch.dtype) -> BlockEmbedding:
        type_name, blocks, shape = raw(f, name)
        return cls(type_name, blocks, shape[-1], dtype)

    @property
    def device(self) -> torch.device:
        return self.blocks.device

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """tokens (...) → (..., dim)."""
        if torch.compiler.is_compiling():  # one opaque op: the step stays one graph
            return block_rows(self.blocks, tokens, self.type_name, self.dim, self.dtype)
        return _block_rows(self.blocks, tokens, self.type_name, self.dim, self.dtype)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.dim}, rows={self.type_name} as stored"


def _block_rows(blocks: torch.Tensor, tokens: torch.Tensor, type_name: str, dim: int,
                dtype: torch.dtype) -> torch.Tensor:  # fmt: skip
    """The rows `tokens` (...) of a block-quantized table `blocks` (vocab, bytes per row),
    decoded: (..., dim) in `dtype`."""
    rows = blocks.index_select(0, tokens.reshape(-1))  # (n, bytes per row), a copy
    out = dequantize(rows.view(-1), type_name, (rows.shape[0], dim), dtype)
    return out.view(*tokens.shape, dim)


# The byte decoding is not traceable: a compiled step calls it as one op (a graph break would
# keep the step from being one graph, and so from being saved whole).
block_rows = torch.library.custom_op("localllm::block_rows", _block_rows, mutates_args=())


@block_rows.register_fake
def _(blocks: torch.Tensor, tokens: torch.Tensor, type_name: str, dim: int, dtype: torch.dtype) -> torch.Tensor:
    return blocks.new_empty(*tokens.shape, dim, dtype=dtype)
