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

__all__ = ["BLOCK", "KVCache", "Pages", "PositionIndexed", "Rows", "make_caches"]


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


BLOCK = 64  # positions per block of `Rows`' pool (and per block of decode attention)


class Pages:
    """Which blocks of the pool each slot holds, for every layer at once (every layer's `Rows`
    share one `Pages`: a slot's position p is in block `tables[slot][p // BLOCK]` of each
    layer's pool, whichever layers a forward pass skips). Block 0 is never handed out: it stays
    zeros, what a row reads past its last block. Freed blocks are reused first; the pool grows
    (doubling) only when none is free."""

    def __init__(self, n_slots: int, capacity: int) -> None:
        self.capacity = capacity  # positions one slot may hold
        self.tables: list[list[int]] = [[] for _ in range(n_slots)]
        self.free: list[int] = []
        self.n_blocks = 1  # the zero block

    def reserve(self, slot: int, n: int) -> None:
        """Blocks for the slot's first `n` positions (ValueError past the capacity)."""
        if n > self.capacity:
            raise ValueError(f"KV cache full: {n} tokens, capacity {self.capacity}")
        table = self.tables[slot]
        while len(table) * BLOCK < n:
            if not self.free:  # double the pool: new blocks at the end
                grow = max(self.n_blocks, PositionIndexed.step // BLOCK)
                self.free = list(range(self.n_blocks + grow - 1, self.n_blocks - 1, -1))
                self.n_blocks += grow
            table.append(self.free.pop())

    def shrink(self, slot: int, n: int) -> None:
        """Keep the slot's blocks for its first `n` positions; the rest go back to the pool."""
        table = self.tables[slot]
        while len(table) * BLOCK >= n + BLOCK:
            self.free.append(table.pop())

    def release(self, slot: int) -> None:
        """The slot's blocks go back to the free list."""
        self.free.extend(reversed(self.tables[slot]))
        self.tables[slot] = []

    @property
    def used(self) -> int:
        return sum(len(t) for t in self.tables)

    def index(self, slots: Sequence[int], nb: int) -> list[int]:
        """The blocks of `slots`' first nb blocks, row after row, the zero block past a table."""
        return [t[i] if i < len(t) else 0 for t in (self.tables[s] for s in slots) for i in range(nb)]


class Rows:
    """One layer's keys and values for every slot of a backend, paged: a pool of
    (n_blocks, n_kv, BLOCK, hd) blocks that `pages` hands out to slots as their positions need
    them, so a slot holds what it uses (not the longest slot's length) and growing copies no
    held position. A slot's `KVCache` reads and writes through its table; a decode step of
    several slots writes their new keys with one indexed copy and attends over their blocks in
    one call (`models.base.attend`), where buffers of their own would need one attention call
    per sequence."""

    def __init__(self, n_slots: int, n_kv: int, head_dim: int, capacity: int, *, dtype: torch.dtype,
                 device: torch.device | str = "cpu", v_head_dim: int | None = None,
                 pages: Pages | None = None) -> None:  # fmt: skip
        self.n_kv, self.head_dim = n_kv, head_dim
        self.v_head_dim = v_head_dim or head_dim
        self.dtype, self.device = dtype, torch.device(device)
        self.pages = pages or Pages(n_slots, capacity)  # one for every layer of a runner
        self.k: torch.Tensor | None = None  # (n_blocks, n_kv, BLOCK, hd)
        self.v: torch.Tensor | None = None

    @property
    def allocated(self) -> int:
        """Blocks in this layer's pool (the zero block too)."""
        return 0 if self.k is None else self.k.shape[0]

    def reserve(self, slot: int, n: int) -> None:
        """Blocks for the slot's first `n` positions; the pool grown to what `pages` hands out."""
        self.pages.reserve(slot, n)
        have, want = self.allocated, self.pages.n_blocks
        if want <= have:
            return
        k = torch.zeros(want, self.n_kv, BLOCK, self.head_dim, dtype=self.dtype, device=self.device)
        v = torch.zeros(want, self.n_kv, BLOCK, self.v_head_dim, dtype=self.dtype, device=self.device)
        if have:
            k[:have] = self.k  # type: ignore[index]
            v[:have] = self.v  # type: ignore[index]
        self.k, self.v = k, v

    def write(self, slot: int, start: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """k, v (1, n_kv, T, hd) at the slot's positions start .. start + T - 1."""
        self.reserve(slot, start + k.shape[2])
        table, t, done = self.pages.tables[slot], k.shape[2], 0
        while done < t:
            p = start + done
            b, at = table[p // BLOCK], p % BLOCK
            n = min(t - done, BLOCK - at)
            self.k[b, :, at : at + n] = k[0, :, done : done + n]  # type: ignore[index]
            self.v[b, :, at : at + n] = v[0, :, done : done + n]  # type: ignore[index]
            done += n

    def read(self, slot: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The slot's first `end` keys and values as (1, n_kv, end, hd) tensors (a copy)."""
        nb = -(-end // BLOCK)
        idx = torch.tensor(self.pages.tables[slot][:nb], dtype=torch.long, device=self.device)
        k = self.k.index_select(0, idx).transpose(0, 1).reshape(1, self.n_kv, nb * BLOCK, self.head_dim)  # type: ignore[union-attr]
        v = self.v.index_select(0, idx).transpose(0, 1).reshape(1, self.n_kv, nb * BLOCK, self.v_head_dim)  # type: ignore[union-attr]
        return k[:, :, :end], v[:, :, :end]

    def slot_bytes(self, slot: int) -> int:
        """Bytes of the blocks the slot holds in this layer."""
        return len(self.pages.tables[slot]) * self.block_bytes

    @property
    def block_bytes(self) -> int:
        size = torch.empty(0, dtype=self.dtype).element_size()
        return self.n_kv * BLOCK * (self.head_dim + self.v_head_dim) * size

    @property
    def nbytes(self) -> int:
        """Bytes of this layer's pool."""
        return self.allocated * self.block_bytes


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
        return self._k

    @property
    def v(self) -> torch.Tensor | None:
        return self._v

    def _reserve(self, n: int) -> None:
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
        if self.rows is not None:  # through the slot's pages
            self.rows.write(self.slot, self.offset, k, v)
            self.offset = end
            return self.rows.read(self.slot, end)
        self._reserve(end)
        mk, mv = self.k, self.v
        mk[:, :, self.offset : end] = k  # type: ignore[index]
        mv[:, :, self.offset : end] = v  # type: ignore[index]
        self.offset = end
        return mk[:, :, :end], mv[:, :, :end]  # type: ignore[index]

    @property
    def nbytes(self) -> int:
        """Bytes its buffers hold (with `rows`: the blocks its slot holds)."""
        if self.rows is not None:
            return self.rows.slot_bytes(self.slot)
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
        if self.rows is not None:
            return self.rows.read(self.slot, self.offset) if self.rows.k is not None else None
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
