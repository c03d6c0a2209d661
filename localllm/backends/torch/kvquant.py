"""Quantized KV caches with the plain cache's interface (`cache.KVCache`): issue 12's first types.

    Int8KVCache    symmetric int8 per token and head: x ≈ scale · q, q in [-127, 127],
                   scale = max|x| / 127 over the head's hd values (float16); 1 + 2/hd bytes per
                   element against f16's 2 (SmolLM2, hd 64: 1.94x smaller)
    Fp8KVCache     the same with float8 e4m3 codes (scale = max|x| / 448): 3 mantissa bits, so
                   2^-4 relative rounding where int8 has 2^-8 of the head's largest value

Keys and values are quantized as they are appended and never again, so `trim(n)` restores exactly
what was held before the last n tokens (speculative rollback) and `state` round-trips bit for bit.
`update_and_fetch` returns the whole cache dequantized to `out_dtype`: one full-precision copy
of this layer's keys and values exists per call (L · kv_heads · hd · 2 elements, freed when the
layer is done); only the codes and scales persist.
"""

from __future__ import annotations

import torch

from localllm.backends.torch.cache import PositionIndexed

__all__ = ["Fp8KVCache", "Int8KVCache", "ScaledKVCache"]


class ScaledKVCache(PositionIndexed):
    """Codes (1, n_kv, allocated, hd) of `CODES` and float16 scales (1, n_kv, allocated, 1) for K
    and V, one scale per token and head, preallocated in steps of `step` tokens as the plain
    cache is. Subclasses say how a scaled value becomes a code."""

    CODES: torch.dtype = torch.int8
    _QMAX = 127.0

    def __init__(self, n_kv: int, head_dim: int, capacity: int, *, out_dtype: torch.dtype,
                 device: torch.device | str = "cpu") -> None:  # fmt: skip
        self.n_kv, self.head_dim, self.capacity = n_kv, head_dim, capacity
        self.dtype = out_dtype  # what attention reads (the model's working dtype)
        self.device = torch.device(device)
        self.offset = 0
        self._bufs: list[torch.Tensor] | None = None  # k codes, k scales, v codes, v scales

    # -- storage ---------------------------------------------------------------------------------

    def _reserve(self, n: int) -> list[torch.Tensor]:
        have = 0 if self._bufs is None else self._bufs[0].shape[2]
        if n <= have:
            return self._bufs  # type: ignore[return-value]
        shape = (1, self.n_kv, self._grown(have, n))
        bufs = [
            torch.empty(*shape, self.head_dim, dtype=self.CODES, device=self.device),
            torch.empty(*shape, 1, dtype=torch.float16, device=self.device),
            torch.empty(*shape, self.head_dim, dtype=self.CODES, device=self.device),
            torch.empty(*shape, 1, dtype=torch.float16, device=self.device),
        ]
        if self.offset:
            for new, old in zip(bufs, self._bufs):  # type: ignore[arg-type]
                new[:, :, : self.offset] = old[:, :, : self.offset]
        self._bufs = bufs
        return bufs

    @classmethod
    def quantize(cls, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x (..., hd) → codes (..., hd) and float16 scales (..., 1), scale = max|x| / QMAX
        (rounded to float16 first, so the codes use the stored scale)."""
        amax = x.float().abs().amax(-1, keepdim=True)
        scale = (amax / cls._QMAX).to(torch.float16)
        s = scale.float()
        y = torch.where(s > 0, x.float() / s, torch.zeros_like(s)).clamp_(-cls._QMAX, cls._QMAX)
        return cls.encode(y), scale

    @staticmethod
    def encode(y: torch.Tensor) -> torch.Tensor:
        """Scaled values in [-QMAX, QMAX] → codes."""
        raise NotImplementedError

    def _dequantize(self, q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        """Codes and scales → values in `dtype`, computed in float32."""
        return (q.to(torch.float32) * scale.to(torch.float32)).to(self.dtype)

    # -- the cache interface ---------------------------------------------------------------------

    def update_and_fetch(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """k, v (1, n_kv, T, hd) for the next T positions → every cached key and value so far,
        dequantized: (1, n_kv, offset + T, hd) in `dtype`."""
        end = self.offset + k.shape[2]
        kq, ks, vq, vs = self._reserve(end)
        for codes, scales, x in ((kq, ks, k), (vq, vs, v)):
            q, s = self.quantize(x)
            codes[:, :, self.offset : end] = q
            scales[:, :, self.offset : end] = s
        self.offset = end
        return (self._dequantize(kq[:, :, :end], ks[:, :, :end]),
                self._dequantize(vq[:, :, :end], vs[:, :, :end]))  # fmt: skip

    @property
    def nbytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self._bufs or ())

    @staticmethod
    def bytes_per_token(n_kv: int, head_dim: int) -> int:
        """Bytes one more cached token costs (K and V): codes plus their float16 scales."""
        return 2 * n_kv * (head_dim + 2)

    @property
    def state(self) -> tuple[torch.Tensor, ...] | None:
        """(k codes, k scales, v codes, v scales) of what is held, as stored."""
        if self._bufs is None:
            return None
        return tuple(b[:, :, : self.offset] for b in self._bufs)

    @state.setter
    def state(self, stored: tuple[torch.Tensor, ...] | None) -> None:
        self.offset = 0
        if stored is None:
            return
        n = stored[0].shape[2]
        for buf, part in zip(self._reserve(n), stored):
            buf[:, :, :n] = part
        self.offset = n


class Int8KVCache(ScaledKVCache):
    """int8 codes: |x - scale·q| ≤ scale / 2."""

    CODES = torch.int8
    _QMAX = 127.0

    @staticmethod
    def encode(y: torch.Tensor) -> torch.Tensor:
        return y.round_().to(torch.int8)


class Fp8KVCache(ScaledKVCache):
    """float8 e4m3 codes (torch's round to nearest): |x - scale·q| ≤ 2^-4 |x| for scaled values
    of 2^-6 and up, ≤ 2^-10 · scale below (e4m3's subnormals)."""

    CODES = torch.float8_e4m3fn
    _QMAX = 448.0

    @staticmethod
    def encode(y: torch.Tensor) -> torch.Tensor:
        return y.to(torch.float8_e4m3fn)
