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

from collections.abc import Sequence

import torch

__all__ = ["KVCache", "PositionIndexed", "Rows", "make_caches"]


def grown(have: int, n: int, capacity: int, step: int) -> int:
    """The new buffer length for `n` tokens when `have` are allocated: doubling, in whole steps,
    at most `capacity` (ValueError past it)."""
    if n > capacity:
        raise ValueError(f"KV cache full: {n} tokens, capacity {capacity}")
    size = min(capacity, max(n, 2 * have, step))
    return min(capacity, -(-size // step) * step)


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
        return grown(have, n, self.capacity, self.step)

    def is_trimmable(self) -> bool:
        return True

    def trim(self, n: int) -> int:
        n = max(0, min(n, self.offset))
        self.offset -= n
        return n


class Rows:
    """One layer's keys and values for every slot of a backend: (n_slots, n_kv, allocated, hd)
    buffers, grown in steps for the longest slot (zeros in what nothing wrote yet). A slot's
    `KVCache` reads and writes its row; a decode step of several slots writes their new keys
    with one indexed copy and attends over the rows in one call (`models.base.attend`), where
    buffers of their own would need one attention call per sequence."""

    def __init__(self, n_slots: int, n_kv: int, head_dim: int, capacity: int, *, dtype: torch.dtype,
                 device: torch.device | str = "cpu", v_head_dim: int | None = None) -> None:  # fmt: skip
        self.n_slots, self.n_kv, self.head_dim = n_slots, n_kv, head_dim
        self.v_head_dim = v_head_dim or head_dim
        self.capacity = capacity
        self.dtype, self.device = dtype, torch.device(device)
        self.k: torch.Tensor | None = None
        self.v: torch.Tensor | None = None

    @property
    def allocated(self) -> int:
        return 0 if self.k is None else self.k.shape[2]

    def reserve(self, n: int) -> None:
        """Room for `n` tokens in every row (grown as `grown` says)."""
        have = self.allocated
        if n <= have:
            return
        shape = (self.n_slots, self.n_kv, grown(have, n, self.capacity, PositionIndexed.step))
        k = torch.zeros(*shape, self.head_dim, dtype=self.dtype, device=self.device)
        v = torch.zeros(*shape, self.v_head_dim, dtype=self.dtype, device=self.device)
        if have:
            k[:, :, :have] = self.k  # type: ignore[index]
            v[:, :, :have] = self.v  # type: ignore[index]
        self.k, self.v = k, v

    @property
    def nbytes(self) -> int:
        if self.k is None or self.v is None:
            return 0
        return self.k.numel() * self.k.element_size() + self.v.numel() * self.v.element_size()


class KVCache(PositionIndexed):
    """Position-indexed buffers, preallocated in steps: appending never copies what is held
    except when the buffer grows. With `rows`, the buffers are row `slot` of that shared store."""

    def __init__(self, n_kv: int, head_dim: int, capacity: int, *, dtype: torch.dtype,
                 device: torch.device | str = "cpu", v_head_dim: int | None = None,
                 rows: Rows | None = None, slot: int = 0) -> None:  # fmt: skip
        self.n_kv, self.head_dim, self.v_head_dim = n_kv, head_dim, v_head_dim or head_dim
        self.capacity = capacity
        self.dtype, self.device = dtype, torch.device(device)
        self.offset = 0
        self.rows, self.slot = rows, slot
        self._k: torch.Tensor | None = None  # (1, n_kv, allocated, hd)
        self._v: torch.Tensor | None = None

    @property
    def k(self) -> torch.Tensor | None:
        if self.rows is not None:
            return None if self.rows.k is None else self.rows.k[self.slot : self.slot + 1]
        return self._k

    @property
    def v(self) -> torch.Tensor | None:
        if self.rows is not None:
            return None if self.rows.v is None else self.rows.v[self.slot : self.slot + 1]
        return self._v

    def _reserve(self, n: int) -> None:
        if self.rows is not None:
            self.rows.reserve(n)
            return
        have = 0 if self._k is None else self._k.shape[2]
        if n <= have:
            return
        size = self._grown(have, n)
        k = torch.empty(1, self.n_kv, size, self.head_dim, dtype=self.dtype, device=self.device)
        v = torch.empty(1, self.n_kv, size, self.v_head_dim, dtype=self.dtype, device=self.device)
        if self.offset:
            k[:, :, : self.offset] = self._k[:, :, : self.offset]  # type: ignore[index]
            v[:, :, : self.offset] = self._v[:, :, : self.offset]  # type: ignore[index]
        self._k, self._v = k, v

    def update_and_fetch(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """k, v: (1, n_kv, T, hd) for the next T positions. Returns (1, n_kv, offset + T, hd) views."""
        t = k.shape[2]
        end = self.offset + t
        self._reserve(end)
        mk, mv = self.k, self.v
        mk[:, :, self.offset : end] = k  # type: ignore[index]
        mv[:, :, self.offset : end] = v  # type: ignore[index]
        self.offset = end
        return mk[:, :, :end], mv[:, :, :end]  # type: ignore[index]

    @property
    def nbytes(self) -> int:
        """Bytes its buffers hold (with `rows`: its share of them)."""
        if self.rows is not None:
            return self.rows.nbytes // self.rows.n_slots
        if self._k is None or self._v is None:
            return 0
        return self._k.numel() * self._k.element_size() + self._v.numel() * self._v.element_size()

    residual_bytes = 0  # nothing is kept beside the cache itself

    def bytes_per_token(self) -> float:
        """What one more cached token costs, K and V."""
        size = torch.empty(0, dtype=self.dtype).element_size()
        return self.n_kv * (self.head_dim + self.v_head_dim) * size

    @property
    def state(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        k, v = self.k, self.v
        if k is None or v is None:
            return None
        return k[:, :, : self.offset], v[:, :, : self.offset]

    @state.setter
    def state(self, kv: tuple[torch.Tensor, torch.Tensor] | None) -> None:
        self.offset = 0
        if kv is not None:
            self.update_and_fetch(*kv)


def make_caches(n_layers: int, n_kv: int, head_dim: int, capacity: int, *, dtype: torch.dtype,
                device: torch.device | str = "cpu", rows: Sequence[Rows] | None = None,
                slot: int = 0) -> list[KVCache]:  # fmt: skip
    """One plain cache per layer for one sequence (row `slot` of each layer's `rows` if given)."""
    return [KVCache(n_kv, head_dim, capacity, dtype=dtype, device=device,
                    rows=rows[i] if rows else None, slot=slot) for i in range(n_layers)]  # fmt: skip
