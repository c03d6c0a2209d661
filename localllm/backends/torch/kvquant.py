"""Quantized KV caches with the plain cache's interface (`cache.KVCache`): issue 12's first type.

    Int8KVCache    symmetric int8 per token and head: x ≈ scale · q, q in [-127, 127],
                   scale = max|x| / 127 over the head's hd values (float16); 1 + 2/hd bytes per
                   element against f16's 2 (SmolLM2, hd 64: 1.94x smaller)

Keys and values are quantized as they are appended and never again, so `trim(n)` restores exactly
what was held before the last n tokens (speculative rollback) and `state` round-trips bit for bit.
`update_and_fetch` returns the whole cache dequantized to `out_dtype`: one full-precision copy
of this layer's keys and values exists per call (L · kv_heads · hd · 2 elements, freed when the
layer is done); only the int8 codes and scales persist.
"""

from __future__ import annotations

import torch

__all__ = ["Int8KVCache"]


class Int8KVCache:
    """int8 codes (1, n_kv, allocated, hd) and float16 scales (1, n_kv, allocated, 1) for K and V,
    preallocated in steps of `step` tokens as the plain cache is."""

    step = 256
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
        if n > self.capacity:
            raise ValueError(f"KV cache full: {n} tokens, capacity {self.capacity}")
        size = min(self.capacity, max(n, 2 * have, self.step))
        size = min(self.capacity, -(-size // self.step) * self.step)
        shape = (1, self.n_kv, size)
        bufs = [
            torch.empty(*shape, self.head_dim, dtype=torch.int8, device=self.device),
            torch.empty(*shape, 1, dtype=torch.float16, device=self.device),
            torch.empty(*shape, self.head_dim, dtype=torch.int8, device=self.device),
            torch.empty(*shape, 1, dtype=torch.float16, device=self.device),
        ]
        if self.offset:
            for new, old in zip(bufs, self._bufs):  # type: ignore[arg-type]
                new[:, :, : self.offset] = old[:, :, : self.offset]
        self._bufs = bufs
        return bufs

    @classmethod
    def quantize(cls, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x (..., hd) → int8 codes (..., hd) and float16 scales (..., 1); |x - scale·q| ≤ scale/2
        (scale = max|x| / 127, rounded to float16 first so the codes use the stored scale)."""
        amax = x.float().abs().amax(-1, keepdim=True)
        scale = (amax / cls._QMAX).to(torch.float16)
        s = scale.float()
        q = torch.where(s > 0, x.float() / s, torch.zeros_like(s)).round_().clamp_(-127, 127)
        return q.to(torch.int8), scale

    def _dequantize(self, q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
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

    def is_trimmable(self) -> bool:
        return True

    def trim(self, n: int) -> int:
        n = max(0, min(n, self.offset))
        self.offset -= n
        return n

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
