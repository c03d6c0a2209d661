"""GGUF tensors → torch tensors: vectorized dequantization straight from the memory map.

    tensor(f, "blk.0.attn_q.weight")        one tensor, dequantized, in torch order (out, in)
    iter_tensors(f, names)                  the same, one tensor at a time
    dequantize(data, "Q4_K", shape)         raw GGUF bytes (1-D uint8) → a float tensor
    raw(f, name)                            the GGUF blocks themselves, for a quantized path
    coded(data, "Q6_K", shape)              a quantized matrix kept as its codes and per-group maps

A tensor's raw bytes are read through `GGUFFile.tensor_bytes` (a view into the map, never a copy of
the file) and unpacked with bit operations on a (n_blocks, type_size) uint8 view: no Python loop
runs per block. Tensors are unpacked in chunks of at most 256K elements, so temporaries stay
small (Gemma's 262144 × 640 embedding never exists twice in float32).
Every returned tensor owns its memory: the model stays valid after the GGUFFile is closed, and the
peak is one tensor's temporaries on top of the weights already loaded.

The arithmetic follows ggml's `dequantize_row_*` (ggml-quants.c) in float32 in the same order as
the `gguf` package's numpy reference, so results match it bit for bit; other dtypes are rounded
once from float32. Block layouts: ggml's `ggml-common.h` (`block_q4_0`, `block_q4_K`, ...), whose
sizes `GGML_QUANT_SIZES` of the `gguf` package repeats.
"""

from __future__ import annotations

import functools
import math
import os
import warnings
from collections.abc import Callable, Container, Iterable, Iterator, Sequence
from dataclasses import dataclass

import torch

from localllm.errors import LocalLLMError
from localllm.gguf_file import GGML_TYPE_BY_NAME, GGUFFile, TensorInfo

__all__ = [
    "CODED_TYPES",
    "SUPPORTED_TYPES",
    "Coded",
    "WeightsError",
    "coded",
    "dequantize",
    "iter_tensors",
    "raw",
    "tensor",
]

SUPPORTED_TYPES: tuple[str, ...] = (
    "F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K",
    "IQ4_NL", "IQ4_XS",
)  # fmt: skip


def _chunk_elements() -> int:
    """Elements decoded per step.

    With several threads, 28672: every op then stays under torch's 32768-element grain
    (at::internal::GRAIN_SIZE) and runs on the calling thread. An op split over threads waits
    for the slowest one, which on a busy machine is one descheduled for a whole time slice:
    SmolLM2 took 8-11 s in 256K-element chunks with 2 threads while other jobs shared this
    2-core box, 1-3 s in these. With one thread, 256K: 1 MB float32 temporaries still fit L2
    and there are fewer ops (0.58 s of CPU for SmolLM2 against 0.84 s).
    """
    return 1 << 18 if torch.get_num_threads() == 1 else 28672


_FLOATS = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}


class WeightsError(LocalLLMError):
    """A tensor the torch engine cannot read (its type, or bytes that do not fit its shape)."""


# -- block decoders -------------------------------------------------------------------------
# Each fills `o`, (n, block_size) float32, from `b`, (n, type_size) contiguous uint8 blocks, with
# the blocks' integer codes, and returns their affine maps (scale, low): (n, groups, 1) float32
# each (low None where the type has none), so that value = scale * code + low group by group.
# Every product and sum is exact in float32 except the one that adds a K type's min, which rounds
# once as ggml's does: the values are ggml's bit for bit (tests check them against the `gguf`
# package's numpy reference).
# Speed: uint8 ops over rows of only 16-32 bytes do not vectorize (a 16-byte slice costs 10x a
# contiguous pass), so nibbles are split over whole blocks at once and slicing happens in the
# one strided copy that also converts to float32; the rest are in-place float ops on `o`.

Maps = tuple[torch.Tensor, "torch.Tensor | None"]


def _halves(b: torch.Tensor) -> torch.Tensor:
    """(n, type_size) uint8 → (n, type_size / 2) float16: the f16 scales sit at even offsets."""
    return b.view(torch.float16)


def _nibbles(b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Low and high nibbles of every byte of the blocks (scale bytes too: they are ignored)."""
    return b & 0x0F, b >> 4


@functools.cache
def _fifth_bits(device: torch.device) -> torch.Tensor:
    """(256, 8) float32: row v holds bit i of byte value v times 16, for i = 0..7."""
    bits = (torch.arange(256, device=device).unsqueeze(-1) >> torch.arange(8, device=device)) & 1
    return bits.float() * 16


def _high32(b: torch.Tensor, at: int) -> torch.Tensor:
    """The little-endian u32 at byte `at` of each block → (n, 32) float32: 16 × bit j for
    element j. A table lookup per byte: shifting 4-byte rows by 8 broadcast amounts is 3x slower."""
    qh = b[:, at : at + 4].reshape(-1).int()  # (n * 4,)
    return _fifth_bits(b.device).index_select(0, qh).view(-1, 32)


def _d(b: torch.Tensor, at: int = 0) -> torch.Tensor:
    """The f16 at half `at` of each block, (n, 1, 1) float32: one group's scale or low."""
    return _halves(b)[:, at : at + 1].float().unsqueeze(-1)


def _q8_0(b: torch.Tensor, o: torch.Tensor) -> Maps:
    # f16 d | 32 × int8; x = d q
    o.copy_(b[:, 2:].view(torch.int8))
    return _d(b), None


def _q4_0(b: torch.Tensor, o: torch.Tensor) -> Maps:
    # f16 d | 16 bytes: element j is the low nibble of byte j, element j + 16 its high one
    # x = d (q - 8) = d q - 8 d: codes stay 0..15, as the int4 kernel takes them
    lo, hi = _nibbles(b)
    o[:, :16], o[:, 16:] = lo[:, 2:], hi[:, 2:]
    d = _d(b)
    return d, -8 * d


def _q4_1(b: torch.Tensor, o: torch.Tensor) -> Maps:
    # f16 d | f16 m | 16 bytes of nibbles as Q4_0; x = d q + m
    lo, hi = _nibbles(b)
    o[:, :16], o[:, 16:] = lo[:, 4:], hi[:, 4:]
    return _d(b), _d(b, 1)


def _q5_0(b: torch.Tensor, o: torch.Tensor) -> Maps:
    # f16 d | u32 of fifth bits | 16 bytes of nibbles as Q4_0; x = d (q - 16)
    lo, hi = _nibbles(b)
    o[:, :16], o[:, 16:] = lo[:, 6:], hi[:, 6:]
    o.add_(_high32(b, 2)).sub_(16)
    return _d(b), None


def _q5_1(b: torch.Tensor, o: torch.Tensor) -> Maps:
    # f16 d | f16 m | u32 of fifth bits | 16 bytes of nibbles as Q4_0; x = d q + m
    lo, hi = _nibbles(b)
    o[:, :16], o[:, 16:] = lo[:, 8:], hi[:, 8:]
    o.add_(_high32(b, 4))
    return _d(b), _d(b, 1)


def _k_scales(b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K/Q5_K: d·scale and -dmin·min of the 8 sub-blocks of 32, each (n, 8, 1) float32.

    Bytes 4-15 hold 6-bit scales and mins (ggml's get_scale_min_k4): bytes 4-7 scales 0-3 in
    their low 6 bits and the top 2 bits of scales 4-7; bytes 8-11 the same for mins; bytes
    12-15 the low 4 bits of scales 4-7 (low nibble) and of mins 4-7 (high nibble).
    """
    s, m, sm = b[:, 4:8], b[:, 8:12], b[:, 12:16]
    sc = torch.cat((s & 0x3F, (sm & 0x0F) | ((s >> 2) & 0x30)), dim=-1)  # (n, 8)
    mn = torch.cat((m & 0x3F, (sm >> 4) | ((m >> 2) & 0x30)), dim=-1)
    h = _halves(b)
    return (h[:, 0:1].float() * sc).unsqueeze(-1), (h[:, 1:2].float() * mn).neg_().unsqueeze(-1)


def _k_nibbles(b: torch.Tensor, at: int, o: torch.Tensor) -> None:
    """128 bytes of nibbles at `at` → o (n, 256): each 32 bytes give 32 low nibbles, then 32 high."""
    lo, hi = _nibbles(b)
    o4 = o.view(-1, 4, 2, 32)
    o4[:, :, 0] = lo[:, at : at + 128].view(-1, 4, 32)
    o4[:, :, 1] = hi[:, at : at + 128].view(-1, 4, 32)


def _q4_k(b: torch.Tensor, o: torch.Tensor) -> Maps:
    # f16 d | f16 dmin | 12 bytes of scales and mins | 128 bytes of nibbles
    # x = d sc q - dmin m, 8 sub-blocks of 32
    _k_nibbles(b, 16, o)
    return _k_scales(b)


def _q5_k(b: torch.Tensor, o: torch.Tensor) -> Maps:
    # as Q4_K with 32 bytes of fifth bits before the nibbles: bit i of byte j is element 32 i + j
    _k_nibbles(b, 48, o)
    shifts = torch.arange(8, dtype=torch.uint8, device=b.device).view(1, 8, 1)
    fifth = (b[:, 16:48].unsqueeze(1) >> shifts) & 1  # (n, 8, 32)
    o.view(-1, 8, 32).add_(fifth, alpha=16)
    return _k_scales(b)


def _q6_k(b: torch.Tensor, o: torch.Tensor) -> Maps:
    # 128 bytes of low nibbles | 64 bytes of 2-bit highs | 16 × int8 scales | f16 d
    # x = d sc (q - 32), 16 sub-blocks of 16. Each half of 128 elements takes 64 low bytes
    # (low nibbles, then high ones) and 32 high bytes (bit pairs 0-1, 2-3, 4-5, 6-7 in turn).
    lo, hi = _nibbles(b)
    o4 = o.view(-1, 2, 2, 64)
    o4[:, :, 0] = lo[:, :128].view(-1, 2, 64)
    o4[:, :, 1] = hi[:, :128].view(-1, 2, 64)
    shifts = torch.tensor([0, 2, 4, 6], dtype=torch.uint8, device=b.device).view(1, 1, 4, 1)
    top = (b[:, 128:192].view(-1, 2, 1, 32) >> shifts) & 3  # (n, 2, 4, 32)
    o.view(-1, 2, 4, 32).add_(top, alpha=16)
    o.sub_(32)
    d = _halves(b)[:, 104:105].float() * b[:, 192:208].view(torch.int8)  # (n, 16)
    return d.unsqueeze(-1), None


def _two_bits(b: torch.Tensor, at: int, o: torch.Tensor) -> None:
    """64 bytes of bit pairs at `at` → o (n, 256): per 128-value half, 32 bytes whose bit pairs
    0-1, 2-3, 4-5, 6-7 give its 4 runs of 32 (Q2_K's and Q3_K's low bits)."""
    shifts = torch.tensor([0, 2, 4, 6], dtype=torch.uint8, device=b.device).view(1, 1, 4, 1)
    o.view(-1, 2, 4, 32).copy_((b[:, at : at + 64].view(-1, 2, 1, 32) >> shifts) & 3)


def _q2_k(b: torch.Tensor, o: torch.Tensor) -> Maps:
    # 16 bytes of 4-bit scale | 4-bit min | 64 bytes of bit pairs | f16 d | f16 dmin
    # x = d sc q - dmin m, 16 sub-blocks of 16
    _two_bits(b, 16, o)
    h = _halves(b)
    sc = b[:, :16]
    return (h[:, 40:41].float() * (sc & 0x0F)).unsqueeze(-1), (h[:, 41:42].float() * (sc >> 4)).neg_().unsqueeze(-1)


def _q3_k(b: torch.Tensor, o: torch.Tensor) -> Maps:
    # 32 bytes of third bits | 64 bytes of bit pairs | 12 bytes of 6-bit scales | f16 d
    # x = d (sc - 32) (q - 4), 16 sub-blocks of 16; bit i of hmask byte j belongs to element 32 i + j.
    # Scales: the low nibbles of bytes 96-103 are scales 0-7, their high nibbles 8-15; bytes
    # 104-107 hold the top 2 bits, scale j's at bits 2 (j // 4) of byte 104 + j % 4.
    _two_bits(b, 32, o)
    shifts = torch.arange(8, dtype=torch.uint8, device=b.device).view(1, 8, 1)
    third = (b[:, :32].unsqueeze(1) >> shifts) & 1  # (n, 8, 32)
    o.view(-1, 8, 32).add_(third, alpha=4).sub_(4)
    low = b[:, 96:104]
    top = (b[:, 104:108].unsqueeze(1) >> (2 * shifts[:, :4])) & 3  # (n, 4 [j // 4], 4 [j % 4])
    sc = torch.cat((low & 0x0F, low >> 4), dim=-1).int() | (top.reshape(-1, 16).int() << 4)
    return (_halves(b)[:, 54:55].float() * (sc - 32)).unsqueeze(-1), None


@functools.cache
def _iq4_values(device: torch.device) -> torch.Tensor:
    """IQ4_NL's 16 non-uniform levels (ggml's kvalues_iq4nl), float32."""
    return torch.tensor([-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113],
                        dtype=torch.float32, device=device)  # fmt: skip


def _iq4_nl(b: torch.Tensor, o: torch.Tensor) -> Maps:
    # f16 d | 16 bytes of nibbles as Q4_0, each an index into the 16 levels; x = d level
    lo, hi = _nibbles(b)
    table = _iq4_values(b.device)
    o[:, :16], o[:, 16:] = table[lo[:, 2:].long()], table[hi[:, 2:].long()]
    return _d(b), None


def _iq4_xs(b: torch.Tensor, o: torch.Tensor) -> Maps:
    # f16 d | u16 of 2-bit scale highs | 4 bytes of 4-bit scale lows | 8 × 16 bytes of nibbles
    # as IQ4_NL's; x = d (ls - 32) level, 8 sub-blocks of 32, ls = low | high << 4
    lo, hi = _nibbles(b)
    table = _iq4_values(b.device)
    o4 = o.view(-1, 8, 2, 16)
    o4[:, :, 0] = table[lo[:, 8:].long()].view(-1, 8, 16)
    o4[:, :, 1] = table[hi[:, 8:].long()].view(-1, 8, 16)
    h = b[:, 2:4].contiguous().view(torch.int16).int() & 0xFFFF  # (n, 1)
    shifts = torch.arange(8, device=b.device).view(1, 8)
    sl = b[:, 4:8].int()
    ls = torch.stack((sl & 0x0F, sl >> 4), dim=-1).view(-1, 8) | (((h >> (2 * shifts)) & 3) << 4)
    return (_halves(b)[:, 0:1].float() * (ls - 32)).unsqueeze(-1), None


_DECODERS: dict[str, Callable[[torch.Tensor, torch.Tensor], Maps]] = {
    "Q8_0": _q8_0,
    "Q4_0": _q4_0,
    "Q4_1": _q4_1,
    "Q5_0": _q5_0,
    "Q5_1": _q5_1,
    "Q2_K": _q2_k,
    "Q3_K": _q3_k,
    "Q4_K": _q4_k,
    "Q5_K": _q5_k,
    "Q6_K": _q6_k,
    "IQ4_NL": _iq4_nl,
    "IQ4_XS": _iq4_xs,
}


# -- public API -----------------------------------------------------------------------------


def _unsupported(label: str, type_name: str) -> WeightsError:
    return WeightsError(
        f"{label} has type {type_name}, which the torch engine cannot read "
        f"(it reads {', '.join(SUPPORTED_TYPES)})"
    )


def _check(data: torch.Tensor, type_name: str, shape: tuple[int, ...], label: str) -> None:
    """Raise a one-line WeightsError unless `data` is exactly the bytes of `shape` in `type_name`."""
    gtype = GGML_TYPE_BY_NAME.get(type_name)
    if type_name not in SUPPORTED_TYPES or gtype is None:
        raise _unsupported(label, type_name)
    if data.dtype != torch.uint8 or data.dim() != 1:
        raise WeightsError(
            f"{label}: expected 1-D uint8 bytes, got {data.dtype} {list(data.shape)}"
        )
    if any(d <= 0 for d in shape):
        raise WeightsError(f"{label} has an empty or negative shape {list(shape)}")
    row = shape[-1] if shape else 1
    if row % gtype.block_size:
        raise WeightsError(
            f"{label}: a row of {row} is not a multiple of the {type_name} "
            f"block size {gtype.block_size}"
        )
    need = math.prod(shape) // gtype.block_size * gtype.type_size
    if data.numel() != need:
        raise WeightsError(
            f"{label} has {data.numel()} bytes, but {type_name} {list(shape)} needs {need}"
        )


def _aligned(data: torch.Tensor) -> torch.Tensor:
    """`data`, or a copy if it is strided or not 4-byte aligned (viewing bytes as f16 or f32
    needs contiguous, aligned bytes; tensors from the map always are)."""
    if data.is_contiguous() and data.storage_offset() % 4 == 0:
        return data
    return data.clone()


def dequantize(
    data: torch.Tensor,
    type_name: str,
    shape: tuple[int, ...],
    dtype: torch.dtype = torch.float32,
    *,
    label: str = "data",
) -> torch.Tensor:
    """Decode raw GGUF bytes into a new tensor.

    Args:
        data: 1-D uint8, exactly the tensor's bytes (on any device; decoding runs there).
        type_name: the ggml type, one of SUPPORTED_TYPES.
        shape: the tensor's shape in torch order (the last dimension varies fastest).
        dtype: the result's dtype; quantized values are computed in float32, then rounded once.
        label: names the tensor in errors (e.g. "model.gguf: tensor 'blk.0.attn_q.weight'").
    Returns:
        A tensor of `shape` and `dtype` that owns its memory (never a view of `data`).
    Raises:
        WeightsError: an unsupported type, or bytes that do not match the shape.
    """
    shape = tuple(int(d) for d in shape)
    _check(data, type_name, shape, label)
    data = _aligned(data)
    if type_name in _FLOATS:
        return data.view(_FLOATS[type_name]).to(dtype, copy=True).reshape(shape)

    gtype = GGML_TYPE_BY_NAME[type_name]
    decode = _DECODERS[type_name]
    blocks = data.view(-1, gtype.type_size)  # (n_blocks, type_size)
    out = torch.empty(math.prod(shape), dtype=dtype, device=data.device)
    out_blocks = out.view(-1, gtype.block_size)  # (n_blocks, block_size)
    step = max(1, _chunk_elements() // gtype.block_size)
    scratch = None  # float32 chunk, reused, when the result is another dtype
    if dtype != torch.float32:
        rows = min(step, out_blocks.shape[0])
        scratch = torch.empty(rows, gtype.block_size, dtype=torch.float32, device=data.device)
    for i in range(0, blocks.shape[0], step):
        chunk = out_blocks[i : i + step]
        o = chunk if scratch is None else scratch[: chunk.shape[0]]
        scale, low = decode(blocks[i : i + step], o)
        groups = o.view(o.shape[0], scale.shape[1], -1).mul_(scale)
        if low is not None:
            groups.add_(low)
        if scratch is not None:
            chunk.copy_(o)
    return out.view(shape)


# The ggml types a matrix can be kept in as codes (`coded`), and their codes' bits and group
# sizes. 4-bit codes are 0..15 with a low per group (what torch's int4 kernels take); the others
# are int8: Q5_0, Q6_K and Q8_0 signed and without a low.
CODED_TYPES: dict[str, tuple[int, int]] = {
    "Q4_0": (4, 32), "Q4_1": (4, 32), "Q4_K": (4, 32), "Q5_0": (5, 32), "Q5_1": (5, 32),
    "Q5_K": (5, 32), "Q6_K": (6, 16), "Q8_0": (8, 32),
}  # fmt: skip


@dataclass
class Coded:
    """A matrix kept as its file stores it: integer codes and one affine map per `group`
    weights, w[o, group g + j] = scale[o, g] * q[o, group g + j] + low[o, g] (low 0 where None),
    exact for CODED_TYPES: ggml's values bit for bit."""

    q: torch.Tensor  # (out, in) int8 codes of `bits` bits
    scale: torch.Tensor  # (out, in / group) float32
    low: torch.Tensor | None  # (out, in / group) float32, or None: 0
    group: int
    bits: int

    @property
    def shape(self) -> torch.Size:
        return self.q.shape

    def map(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> Coded:
        """The same rows rearranged (or moved): `fn` (e.g. a permutation of rows) applied to every part."""
        low = None if self.low is None else fn(self.low)
        return Coded(fn(self.q), fn(self.scale), low, self.group, self.bits)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """(out, in) in `dtype`, computed in float32."""
        out, n = self.q.shape
        w = self.q.view(out, -1, self.group).float() * self.scale.unsqueeze(-1)
        if self.low is not None:
            w += self.low.unsqueeze(-1)
        return w.view(out, n).to(dtype)

    def regrouped(self, group: int) -> Coded:
        """The same matrix with maps per `group` weights (a divisor of this one's): each map repeated."""
        if group == self.group:
            return self
        times = self.group // group
        low = None if self.low is None else self.low.repeat_interleave(times, dim=1)
        return Coded(self.q, self.scale.repeat_interleave(times, dim=1), low, group, self.bits)

    @staticmethod
    def cat(parts: Sequence[Coded]) -> Coded:
        """Stacked along `out` (fused projections), mixed types too (a Q4_K_M file's Q4_K queries
        beside Q6_K values): maps per the smallest group, a low where any part has one."""
        group = min(p.group for p in parts)
        parts = [p.regrouped(group) for p in parts]
        lows = None
        if any(p.low is not None for p in parts):
            lows = torch.cat([torch.zeros_like(p.scale) if p.low is None else p.low for p in parts])
        return Coded(torch.cat([p.q for p in parts]), torch.cat([p.scale for p in parts]), lows,
                     group, max(p.bits for p in parts))  # fmt: skip


def coded(data: torch.Tensor, type_name: str, shape: tuple[int, ...], *,
          label: str = "data") -> Coded:  # fmt: skip
    """Raw bytes of a 2-D matrix in one of CODED_TYPES → its codes and maps (no dequantization)."""
    shape = tuple(int(d) for d in shape)
    _check(data, type_name, shape, label)
    if type_name not in CODED_TYPES or len(shape) != 2:
        raise WeightsError(f"{label}: {type_name} {list(shape)} is not a matrix of codes")
    out, n = shape
    bits, group = CODED_TYPES[type_name]
    gtype = GGML_TYPE_BY_NAME[type_name]
    blocks = _aligned(data).view(-1, gtype.type_size)
    q = torch.empty(blocks.shape[0], gtype.block_size, dtype=torch.int8, device=data.device)
    step = max(1, _chunk_elements() // gtype.block_size)
    o = torch.empty(min(step, blocks.shape[0]), gtype.block_size, dtype=torch.float32,
                    device=data.device)
    scales, lows = [], []
    for i in range(0, blocks.shape[0], step):
        chunk = q[i : i + step]
        scale, low = _DECODERS[type_name](blocks[i : i + step], o[: chunk.shape[0]])
        chunk.copy_(o[: chunk.shape[0]])  # small integers: exact
        scales.append(scale.flatten(1))
        lows.append(low)
    scale = torch.cat(scales).view(out, -1)
    low = None if lows[0] is None else torch.cat([x.flatten(1) for x in lows]).view(out, -1)
    return Coded(q.view(out, n), scale, low, group, bits)


def _info(f: GGUFFile, name: str) -> tuple[TensorInfo, str, tuple[int, ...]]:
    """The tensor's index entry, its label for errors, and its torch-order shape."""
    base = os.path.basename(f.path)
    info = f.tensors.get(name)
    if info is None:
        raise WeightsError(f"{base}: no tensor {name!r} in the file")
    if f.byte_order != "<":
        raise WeightsError(f"{base}: big-endian GGUF files cannot be read by the torch engine")
    return info, f"{base}: tensor {name!r}", tuple(reversed(info.shape))


def _bytes(f: GGUFFile, name: str) -> torch.Tensor:
    """The tensor's bytes as a 1-D uint8 tensor over the map (read-only: never write to it)."""
    with warnings.catch_warnings():  # that the map is read-only: we never write to it
        warnings.filterwarnings("ignore", "The given buffer is not writable", UserWarning)
        return torch.frombuffer(f.tensor_bytes(name), dtype=torch.uint8)


def tensor(
    f: GGUFFile,
    name: str,
    *,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
) -> torch.Tensor:
    """One tensor of `f`, dequantized, in torch order (the reverse of GGUF's shape).

    1-D tensors (norms, biases) stay float32 whatever `dtype` is: they are tiny and models apply
    them in float32. On another device the raw bytes move there and are decoded there.
    """
    info, label, shape = _info(f, name)
    data = _bytes(f, name)
    device = torch.device(device)
    if device.type != "cpu":
        data = data.to(device)
    if len(shape) == 1:
        dtype = torch.float32
    return dequantize(data, info.ggml_type.name, shape, dtype, label=label)


def iter_tensors(
    f: GGUFFile,
    names: Iterable[str] | None = None,
    *,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
    keep_coded: Container[str] = (),
) -> Iterator[tuple[str, torch.Tensor | Coded]]:
    """`(name, tensor(f, name, ...))` for `names` (default: every tensor, in file order), decoded
    one at a time so a caller that converts or drops each one never holds two full copies.
    Matrices named in `keep_coded` whose type is one of CODED_TYPES come as `Coded` instead, on
    the CPU (a linear layer moves what it keeps)."""
    for name in f.tensors if names is None else names:
        info = f.tensors.get(name) if name in keep_coded else None
        if info is not None and info.ggml_type.name in CODED_TYPES and len(info.shape) == 2:
            _, label, shape = _info(f, name)
            yield name, coded(_bytes(f, name), info.ggml_type.name, shape, label=label)
        else:
            yield name, tensor(f, name, dtype=dtype, device=device)


def raw(f: GGUFFile, name: str) -> tuple[str, torch.Tensor, tuple[int, ...]]:
    """A tensor's GGUF blocks, copied out of the map, for kernels that use them directly.

    Returns:
        (type name, uint8 tensor of shape (*shape[:-1], bytes per row), torch-order shape).
    """
    info, label, shape = _info(f, name)
    gtype = info.ggml_type
    if gtype.name not in SUPPORTED_TYPES:
        raise _unsupported(label, gtype.name)
    row_bytes = shape[-1] // gtype.block_size * gtype.type_size
    return gtype.name, _bytes(f, name).clone().view(*shape[:-1], row_bytes), shape
