"""KV caches: one object per layer and sequence, all with the same small interface.

    K, V = cache.update_and_fetch(k, v)   append (1, n_kv, T, hd) keys/values at `offset`,
                                          return every cached one so far: (1, n_kv, offset, hd)
    cache.offset                          tokens held (the next token's position)
    cache.trim(n)                         forget the last n tokens (speculative rollback); returns n
    cache.is_trimmable()                  whether trim works (a rotating window cannot)
    cache.nbytes                          bytes held by its buffers
    cache.held                            keys attention reads (H2O: fewer than `offset`)
    cache.bytes_per_token()               what one more cached token costs (K and V)
    cache.residual_bytes                  full-precision bytes kept beside quantized ones
    cache.state                           (K, V) of what is held; assignable

The model never keeps state: the caller owns `[cache(layer) for layer in range(n_layers)]` per
sequence (`make_caches`). Quantized, StreamingLLM and H2O caches implement the same interface.
"""

from __future__ import annotations

import torch

__all__ = ["KVCache", "PositionIndexed", "make_caches"]


class PositionIndexed:
    """What every position-indexed cache shares: `offset` tokens held at the front of buffers
    that grow in steps (by `step` tokens at least, doubling, up to `capacity`), and a `trim`
    that only moves `offset` back (what was appended is never rewritten, so it is exact)."""

    step = 256
    capacity: int
    offset: int
    pre_rope = False  # keys arrive rotated (see `policies`)
    observes = False  # no attention probabilities wanted
    dropped = 0  # nothing is ever forgotten

    def make_room(self, n: int) -> int:
        return 0

    @property
    def held(self) -> int:
        """Keys attention reads (`offset` is the next position; they differ under H2O)."""
        return self.offset

    def exact(self, n: int) -> bool:
        return True

    def _grown(self, have: int, n: int) -> int:
        """The new buffer length for `n` tokens when `have` are allocated (ValueError past
        `capacity`)."""
        if n > self.capacity:
            raise ValueError(f"KV cache full: {n} tokens, capacity {self.capacity}")
        size = min(self.capacity, max(n, 2 * have, self.step))
        return min(self.capacity, -(-size // self.step) * self.step)

    def is_trimmable(self) -> bool:
        return True

    def trim(self, n: int) -> int:
        n = max(0, min(n, self.offset))
        self.offset -= n
        return n


class KVCache(PositionIndexed):
    """Position-indexed buffers, preallocated in steps: appending never copies what is held
    except when the buffer grows."""

    def __init__(self, n_kv: int, head_dim: int, capacity: int, *, dtype: torch.dtype,
                 device: torch.device | str = "cpu", v_head_dim: int | None = None) -> None:  # fmt: skip
        self.n_kv, self.head_dim, self.v_head_dim = n_kv, head_dim, v_head_dim or head_dim
        self.capacity = capacity
        self.dtype, self.device = dtype, torch.device(device)
        self.offset = 0
        self.k: torch.Tensor | None = None  # (1, n_kv, allocated, hd)
        self.v: torch.Tensor | None = None

    def _reserve(self, n: int) -> None:
        have = 0 if self.k is None else self.k.shape[2]
        if n <= have:
            return
        size = self._grown(have, n)
        k = torch.empty(1, self.n_kv, size, self.head_dim, dtype=self.dtype, device=self.device)
        v = torch.empty(1, self.n_kv, size, self.v_head_dim, dtype=self.dtype, device=self.device)
        if self.offset:
            k[:, :, : self.offset] = self.k[:, :, : self.offset]  # type: ignore[index]
            v[:, :, : self.offset] = self.v[:, :, : self.offset]  # type: ignore[index]
        self.k, self.v = k, v

    def update_and_fetch(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """k, v: (1, n_kv, T, hd) for the next T positions. Returns (1, n_kv, offset + T, hd) views."""
        t = k.shape[2]
        end = self.offset + t
        self._reserve(end)
        self.k[:, :, self.offset : end] = k  # type: ignore[index]
        self.v[:, :, self.offset : end] = v  # type: ignore[index]
        self.offset = end
        return self.k[:, :, :end], self.v[:, :, :end]  # type: ignore[index]

    @property
    def nbytes(self) -> int:
        if self.k is None or self.v is None:
            return 0
        return self.k.numel() * self.k.element_size() + self.v.numel() * self.v.element_size()

    residual_bytes = 0  # nothing is kept beside the cache itself

    def bytes_per_token(self) -> float:
        """What one more cached token costs, K and V."""
        size = torch.empty(0, dtype=self.dtype).element_size()
        return self.n_kv * (self.head_dim + self.v_head_dim) * size

    @property
    def state(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        if self.k is None or self.v is None:
            return None
        return self.k[:, :, : self.offset], self.v[:, :, : self.offset]

    @state.setter
    def state(self, kv: tuple[torch.Tensor, torch.Tensor] | None) -> None:
        self.offset = 0
        if kv is not None:
            self.update_and_fetch(*kv)


def make_caches(n_layers: int, n_kv: int, head_dim: int, capacity: int, *, dtype: torch.dtype,
                device: torch.device | str = "cpu") -> list[KVCache]:  # fmt: skip
    """One plain cache per layer for one sequence."""
    return [KVCache(n_kv, head_dim, capacity, dtype=dtype, device=device) for _ in range(n_layers)]
