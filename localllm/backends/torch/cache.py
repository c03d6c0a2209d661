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
from typing import Any

import torch

from localllm.backends.torch.draft_head import pick
from localllm.backends.torch.kvquant import RESIDUAL, Kivi, Plain, Scaled
from localllm.errors import OutOfBlocks

__all__ = ["BLOCK", "KVCache", "Pages", "PositionIndexed", "Prefix", "Rows", "Span", "make_caches"]


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
    def at(self) -> int:
        """The next token's position in the slot's page table (a paged StreamingLLM cache's
        counts forgotten tokens too: `policies.PagedStreaming`)."""
        return self.offset

    def advance(self, n: int) -> None:
        """n tokens were written at `at` (by a step that writes the pool itself)."""
        self.offset += n

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
    (doubling) only when none is free.

    A block may be held by several tables and prefix-cache `Span`s at once (`refs` counts them):
    a restored prefix shares the blocks that hold it instead of copying them, and a slot about to
    write into a block someone else holds gets its own copy first (`own`: copy-on-write), so
    that no write ever reaches another sequence's positions.

    The pages of sliding-window layers (`window`: a key is visible from query q when q - k <
    window) keep only the blocks a query from the slot's next position can see: the older ones
    go back to the pool as the slot writes on, their table entries the zero block (`first`).

    `residual` (KIVI's int4/int2 codes, `Rows`): a block is coded once the slot has written
    `residual` positions past it (`coded`); until then its positions are floats in a ring of
    `RING` blocks per slot beside the pool (`ring`), which also keeps the last coded block's
    originals, so that a rollback of up to one block reopens it exactly."""

    RING = 4  # a slot's float blocks: residual + BLOCK - 1 positions span 3, and the last coded

    def __init__(self, n_slots: int, capacity: int, limit: int | None = None,
                 window: int = 0, residual: int = 0) -> None:  # fmt: skip
        self.capacity = capacity  # positions one slot may hold
        self.limit = limit  # blocks the pool may grow to, the zero block too (None: no bound)
        self.window = window
        self.residual = residual
        if residual and (residual % BLOCK or residual + BLOCK > (self.RING - 1) * BLOCK):
            raise ValueError(f"a residual of {residual} positions does not fit the ring")
        self.tables: list[list[int]] = [[] for _ in range(n_slots)]
        self.first = [0] * n_slots  # a window's slot: its blocks before this one are dropped
        self.free: list[int] = []
        self.refs = [1]  # holders of each block; the zero block is held for good
        self.layers: list[Rows] = []  # every layer's pool (what a copy of a block copies)
        self._spare = 0  # `spare`'s block, once taken

    @property
    def n_blocks(self) -> int:
        return len(self.refs)

    def coded(self, end: int) -> int:
        """Blocks a slot of `end` positions holds as codes (the residual's policy: KIVI's
        groups quantize once `residual` later tokens arrived, `kvquant.Store`)."""
        return max(0, end - self.residual) // BLOCK

    def ring(self, slot: int, j: int) -> int:
        """The ring block holding the floats of the slot's block j (index 0: zeros)."""
        return 1 + slot * self.RING + j % self.RING

    @property
    def ring_blocks(self) -> int:
        """Blocks of each layer's ring: the zero block, every slot's, a spare for padding."""
        return 2 + len(self.tables) * self.RING if self.residual else 0

    @property
    def ring_spare(self) -> int:
        return self.ring_blocks - 1

    def _take(self) -> int:
        if not self.free:  # double the pool: new blocks at the end
            n = self.n_blocks
            grow = max(n, PositionIndexed.step // BLOCK)
            if self.limit is not None:
                if n >= self.limit:
                    raise OutOfBlocks(f"the KV pool's {self.limit - 1} blocks of {BLOCK} positions "
                                      "are all in use")  # fmt: skip
                grow = min(grow, self.limit - n)
            self.free = list(range(n + grow - 1, n - 1, -1))
            self.refs += [0] * grow
        b = self.free.pop()
        self.refs[b] = 1
        return b

    def _drop(self, b: int) -> None:
        if not b:  # the zero block (a dropped position's entry) is held for good
            return
        self.refs[b] -= 1
        if not self.refs[b]:
            self.free.append(b)

    def reserve(self, slot: int, n: int, held: int | None = None) -> None:
        """Blocks for the slot's first `n` positions (ValueError past the capacity: `held`
        positions when not n, a StreamingLLM slot's that forgot some)."""
        held = n if held is None else held
        if held > self.capacity:
            raise ValueError(f"KV cache full: {held} tokens, capacity {self.capacity}")
        table = self.tables[slot]
        while len(table) * BLOCK < n:
            table.append(self._take())

    def own(self, slot: int, start: int, end: int, held: int | None = None) -> None:
        """Blocks for the slot's positions [start, end) that it alone holds, as it is about to
        write them: a block shared with another holder is copied (every layer's) and the copy
        takes its place in the slot's table; a dropped one (`forget`) is a fresh block."""
        self.reserve(slot, end, held)
        table = self.tables[slot]
        for j in range(start // BLOCK, -(-end // BLOCK)):
            b = table[j]
            if not b:
                table[j] = self._take()
            elif self.refs[b] > 1:
                table[j] = self._take()
                self._copy(b, table[j], 0, BLOCK)
                self._drop(b)
        if self.window:  # what no query from `start` on can see (a trim never goes before it)
            first = self.first[slot]
            while (first + 1) * BLOCK <= start - self.window:
                self._drop(table[first])
                table[first] = 0
                first += 1
            self.first[slot] = first

    def forget(self, slot: int, start: int, end: int) -> None:
        """The slot's blocks wholly inside positions [start, end) go back to the pool, their
        table entries the zero block (what StreamingLLM forgot between its sinks and window)."""
        table = self.tables[slot]
        for j in range(-(-start // BLOCK), min(end // BLOCK, len(table))):
            if table[j]:
                self._drop(table[j])
                table[j] = 0

    def spare(self) -> int:
        """A block no slot holds, for a compiled step's padding rows to write their keys into
        (taken on first use, kept for good, not counted `used`)."""
        if not self._spare:
            self._spare = self._take()
            for layer in self.layers:
                layer._grow()
        return self._spare

    def keeps(self, slot: int, start: int) -> bool:
        """Whether the slot still holds every key a query from position `start` can see."""
        return self.first[slot] * BLOCK <= max(0, start - self.window + 1)

    def _copy(self, src: int, dst: int, lo: int, hi: int) -> None:
        for layer in self.layers:
            layer.copy(src, dst, lo, hi)

    def shrink(self, slot: int, n: int) -> None:
        """Keep the slot's blocks for its first `n` positions; the rest go back to the pool."""
        table = self.tables[slot]
        while len(table) * BLOCK >= n + BLOCK:
            self._drop(table.pop())
        self.first[slot] = min(self.first[slot], len(table))

    def release(self, slot: int) -> None:
        """The slot lets go of its blocks (free once no one else holds them)."""
        for b in reversed(self.tables[slot]):
            self._drop(b)
        self.tables[slot] = []
        self.first[slot] = 0
        for layer in self.layers:
            layer.forget_ring(slot)

    def span(self, slot: int, start: int, end: int) -> Span:
        """A handle on the slot's positions [start, end): the blocks that hold them, shared."""
        table = self.tables[slot]
        if not 0 <= start <= end <= len(table) * BLOCK:
            raise ValueError(f"positions [{start}, {end}) are not in the slot's blocks")
        return Span(self, start, end, table[start // BLOCK : -(-end // BLOCK)])

    def assemble(self, slot: int, spans: Sequence[tuple[Span, int]]) -> int:
        """Make the slot's table the first n positions of each span in turn (each span starts
        where the one before it ends): a block that one span fills alone is shared, one where
        two spans meet is a new block with each one's positions copied in. Returns the positions.
        Under a window, only the blocks the next query sees (LookupError where a span dropped
        one of them)."""
        cut, at = [], 0
        for sp, n in spans:
            if sp.pages is not self or sp.start != at or not 0 <= n <= sp.end - sp.start:
                raise ValueError("spans that do not follow each other from position 0")
            cut.append((sp, at, at + n))
            at += n
        if at > self.capacity:
            raise ValueError(f"KV cache full: {at} tokens, capacity {self.capacity}")
        first = max(0, at - self.window + 1) // BLOCK if self.window else 0
        parts_of = []
        for j in range(first, -(-at // BLOCK)):
            lo, hi = j * BLOCK, min(j * BLOCK + BLOCK, at)
            parts = [(sp, max(a, lo), min(b, hi)) for sp, a, b in cut if a < hi and b > lo]
            if any(sp.block(j) == 0 for sp, _, _ in parts):
                raise LookupError("the prefix's window was dropped where it would be needed")
            parts_of.append((j, lo, hi, parts))
        self.release(slot)
        table = self.tables[slot]
        table += [0] * first
        self.first[slot] = first
        for j, lo, hi, parts in parts_of:
            if len(parts) == 1 and (parts[0][1], parts[0][2]) == (lo, hi):
                b = parts[0][0].block(j)
                self.refs[b] += 1
                table.append(b)
                continue
            table.append(self._take())
            for sp, a, b in parts:
                self._copy(sp.block(j), table[-1], a - lo, b - lo)
        return at

    @property
    def used(self) -> int:
        """Blocks held by tables or spans (each once)."""
        return self.n_blocks - 1 - len(self.free) - bool(self._spare)

    def index(self, slots: Sequence[int], lo: int, hi: int) -> list[int]:
        """Blocks lo .. hi - 1 of `slots`, row after row, the zero block past a table."""
        return [t[i] if i < len(t) else 0 for t in (self.tables[s] for s in slots) for i in range(lo, hi)]


class Span:
    """A prefix-cache handle (`localllm.prefix_cache`): positions [start, end) of every layer,
    as the pool blocks that held them when saved (shared: held until `release`)."""

    def __init__(self, pages: Pages, start: int, end: int, blocks: Sequence[int]) -> None:
        self.pages, self.start, self.end = pages, start, end
        self.blocks = list(blocks)  # block i: positions of block index start // BLOCK + i
        for b in self.blocks:
            if b:  # not a window's dropped position
                pages.refs[b] += 1
        held = sum(1 for b in self.blocks if b)
        self.nbytes = held * sum(layer.block_bytes for layer in pages.layers)
        self.released = False

    def block(self, j: int) -> int:
        """The block holding positions [j * BLOCK, (j + 1) * BLOCK) of the span."""
        return self.blocks[j - self.start // BLOCK]

    def split(self, k: int) -> tuple[Span, Span]:
        """Two new spans, before and after its first k positions (it stays held)."""
        cut = self.start + k
        first = self.start // BLOCK
        return (Span(self.pages, self.start, cut, self.blocks[: -(-cut // BLOCK) - first]),
                Span(self.pages, cut, self.end, self.blocks[cut // BLOCK - first :]))  # fmt: skip

    def release(self) -> None:
        if not self.released:
            self.released = True
            for b in self.blocks:
                self.pages._drop(b)


class Prefix:
    """A prefix-cache handle on positions [start, end) of a runner's slot: one `Span` in each of
    its page sets (the sliding-window layers' and the others')."""

    def __init__(self, spans: Sequence[Span], head: tuple[Any, ...] | None = None) -> None:
        self.spans = list(spans)
        self.start, self.end = self.spans[0].start, self.spans[0].end
        # a draft head's entries of these positions (`draft_head.HeadState.entries`), or None
        self.head = head
        self.nbytes = sum(sp.nbytes for sp in self.spans) + (
            sum(t.numel() * t.element_size() for t in head) if head is not None else 0)  # fmt: skip

    @property
    def released(self) -> bool:
        return any(sp.released for sp in self.spans)

    def split(self, k: int) -> tuple[Prefix, Prefix]:
        cuts = [sp.split(k) for sp in self.spans]
        heads: list[tuple[Any, ...] | None] = [None, None]
        if self.head is not None:
            left = self.head[0] < self.start + k
            heads = [pick(self.head, left), pick(self.head, ~left)]
        return Prefix([a for a, _ in cuts], heads[0]), Prefix([b for _, b in cuts], heads[1])

    def release(self) -> None:
        for sp in self.spans:
            sp.release()


class Rows:
    """One layer's keys and values for every slot of a backend, paged: a pool of
    (n_blocks, n_kv, BLOCK, hd) blocks that `pages` hands out to slots as their positions need
    them, so a slot holds what it uses (not the longest slot's length) and growing copies no
    held position. A slot's `KVCache` reads and writes through its table; a decode step of
    several slots writes their new keys with one indexed copy and attends over their blocks in
    one call (`models.base.attend`), where buffers of their own would need one attention call
    per sequence.

    `codecs` (keys', values'; `kvquant.codec`): how a position is stored — a float type as it
    is, int8/fp8 codes with a scale per token and head (`kvquant.Scaled`), or KIVI's int4/int2
    (`kvquant.Kivi`: a block is one group, its scales and zeros per channel for keys, per token
    for values), each part a pool of its own ((n_blocks, n_kv, rows, width): `k_parts`,
    `v_parts`). KIVI codes a block only when `pages.residual` later positions are written
    (`Pages.coded`); until then, and for the last coded block, its floats are in this layer's
    ring (`k_ring`, `v_ring`: (`pages.ring_blocks`, n_kv, BLOCK, hd), float16 under float32
    compute, as `kvquant.Store`'s residual) — so a slot reads what the per-sequence store
    reads, bit for bit. Reads decode what they gather (to `dtype`; keys and values of one float
    type are read in it), so attention never holds a full-precision copy of the pool, only of
    the blocks it reads; the prefix cache shares quantized blocks as it shares float ones (not
    KIVI's: a prefix's residual is in its slot's ring). Without `codecs`, both are `dtype`.

    `static`: the pool is allocated whole (`pages.limit` blocks) on first use and never moves,
    as a compiled step needs (a CUDA graph replays on fixed addresses); else it doubles as the
    pages hand out blocks."""

    def __init__(self, n_slots: int, n_kv: int, head_dim: int, capacity: int, *, dtype: torch.dtype,
                 device: torch.device | str = "cpu", v_head_dim: int | None = None,
                 pages: Pages | None = None, static: bool = False,
                 codecs: tuple[Plain, Plain] | None = None) -> None:  # fmt: skip
        self.n_kv, self.head_dim = n_kv, head_dim
        self.v_head_dim = v_head_dim or head_dim
        self.dtype, self.device = dtype, torch.device(device)
        self.codecs = codecs or (Plain(dtype), Plain(dtype))
        grouped = [type(c) is Kivi for c in self.codecs]
        if any(type(c) not in (Plain, Scaled, Kivi) for c in self.codecs) or len(set(grouped)) > 1:
            raise ValueError("a paged pool stores float or per-token (int8, fp8) codes, or KIVI's "
                             "int4/int2 for both keys and values")  # fmt: skip
        self.grouped = grouped[0]
        self.pages = pages or Pages(n_slots, capacity, residual=RESIDUAL if self.grouped else 0)
        if self.grouped != bool(self.pages.residual):
            raise ValueError("KIVI's codes and a residual go together")
        self.pages.layers.append(self)
        if static and self.pages.limit is None:
            raise ValueError("a static pool needs pages with a limit")
        self.static = static
        self.k_parts: tuple[torch.Tensor, ...] = ()  # each (n_blocks, n_kv, rows, width)
        self.v_parts: tuple[torch.Tensor, ...] = ()
        # KIVI: each layer's floats of the blocks not yet coded (and of the last coded one),
        # and which block each ring block holds (-1: none)
        self.ring_dtype = torch.float16 if dtype == torch.float32 else dtype
        self.k_ring: torch.Tensor | None = None
        self.v_ring: torch.Tensor | None = None
        self._ring_of = [[-1] * Pages.RING for _ in range(n_slots)]
        self._coded = [0] * n_slots  # blocks the slot holds as codes in this layer

    @property
    def k(self) -> torch.Tensor | None:
        """The keys' pool (their codes under a codec), None before the first block."""
        return self.k_parts[0] if self.k_parts else None

    @property
    def v(self) -> torch.Tensor | None:
        return self.v_parts[0] if self.v_parts else None

    @property
    def parts(self) -> tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, ...]]:
        """(keys' parts, values' parts): what a step reads and writes (KIVI's ring last)."""
        if self.grouped:
            return (*self.k_parts, self.k_ring), (*self.v_parts, self.v_ring)  # type: ignore[return-value]
        return self.k_parts, self.v_parts

    @property
    def allocated(self) -> int:
        """Blocks in this layer's pool (the zero block too)."""
        return 0 if self.k is None else self.k.shape[0]

    def _specs(self) -> list[list[tuple[int, int, torch.dtype]]]:
        """(rows, width, dtype) of each part of a block, keys' then values'."""
        return [c.parts(hd, BLOCK) for c, hd in zip(self.codecs, (self.head_dim, self.v_head_dim))]

    def _grow(self) -> None:
        """The pool grown to the blocks `pages` has handed out (and KIVI's ring made)."""
        if self.grouped and self.k_ring is None:
            self.k_ring, self.v_ring = (
                torch.zeros(self.pages.ring_blocks, self.n_kv, BLOCK, hd, dtype=self.ring_dtype,
                            device=self.device)
                for hd in (self.head_dim, self.v_head_dim))  # fmt: skip
        have, want = self.allocated, self.pages.n_blocks
        if want <= have:
            return
        if self.static:
            want = max(want, self.pages.limit)  # type: ignore[type-var]
        grown_parts = []
        for old, specs in zip((self.k_parts, self.v_parts), self._specs()):
            new = tuple(torch.zeros(want, self.n_kv, rows, w, dtype=dt, device=self.device)
                        for rows, w, dt in specs)  # fmt: skip
            for a, b in zip(new, old):
                a[:have] = b
            grown_parts.append(new)
        self.k_parts, self.v_parts = grown_parts

    def own(self, slot: int, start: int, end: int, held: int | None = None) -> None:
        """The slot's positions [start, end) in blocks it alone holds (`Pages.own`), in the pool."""
        self.pages.own(slot, start, end, held)
        self._grow()

    def ready(self, slot: int, start: int, end: int, held: int | None = None) -> None:
        """`own`, for a step that writes positions [start, end) itself (`models.base.rows_attention`:
        KIVI's into the ring): the blocks `end` puts past the residual are coded first (they
        end before `start`: a step writes fewer positions than the residual)."""
        self.own(slot, start, end, held)
        if self.grouped:
            self._seal(slot, self.pages.coded(end))
            for j in range(start // BLOCK, -(-end // BLOCK)):
                self._ring_of[slot][j % Pages.RING] = j

    def _seal(self, slot: int, n: int) -> None:
        """Code the slot's blocks up to n from their floats in the ring."""
        table = self.pages.tables[slot]
        for j in range(self._coded[slot], n):
            if not table[j]:  # a window's block no query sees any more: dropped, not coded
                continue
            if self._ring_of[slot][j % Pages.RING] != j:
                raise RuntimeError(f"block {j} of slot {slot} is in neither the ring nor the pool")
            r = self.pages.ring(slot, j)
            for c, ring, pool in zip(self.codecs, (self.k_ring, self.v_ring), (self.k_parts, self.v_parts)):
                for part, y in zip(pool, c.encode(ring[r][None, :, None])):  # type: ignore[index]
                    part[table[j]] = y[0, :, 0]
        self._coded[slot] = max(self._coded[slot], n)

    def forget_ring(self, slot: int) -> None:
        """The slot holds nothing (`Pages.release`)."""
        self._ring_of[slot] = [-1] * Pages.RING
        self._coded[slot] = 0

    def exact(self, slot: int, end: int) -> bool:
        """Whether cutting the slot back to `end` positions reopens only blocks whose floats
        the ring still holds (else `reopen` decodes their codes: `kvquant.Store.truncate`)."""
        return not self.grouped or all(self._ring_of[slot][j % Pages.RING] == j
                                       for j in range(self.pages.coded(end), self._coded[slot]))  # fmt: skip

    def reopen(self, slot: int, end: int) -> None:
        """The slot was cut back to `end` positions: blocks it puts back inside the residual are
        floats in the ring again (from their originals, or decoded where those are gone)."""
        if not self.grouped:
            return
        n, table = self.pages.coded(end), self.pages.tables[slot]
        for j in range(n, self._coded[slot]):
            if self._ring_of[slot][j % Pages.RING] == j:
                continue
            r = self.pages.ring(slot, j)
            for c, ring, pool in zip(self.codecs, (self.k_ring, self.v_ring), (self.k_parts, self.v_parts)):
                ring[r] = c.decode([p[table[j]] for p in pool], self.ring_dtype)  # type: ignore[index]
            self._ring_of[slot][j % Pages.RING] = j
        self._coded[slot] = min(self._coded[slot], n)

    def copy(self, src: int, dst: int, lo: int, hi: int) -> None:
        """Positions [lo, hi) of block src into block dst (a coded block whole)."""
        self._grow()
        if self.grouped:
            lo, hi = 0, BLOCK
        for part in (*self.k_parts, *self.v_parts):
            part[dst, :, lo:hi] = part[src, :, lo:hi]

    def write(self, slot: int, start: int, k: torch.Tensor, v: torch.Tensor,
              held: int | None = None) -> None:  # fmt: skip
        """k, v (1, n_kv, T, hd) at the slot's positions start .. start + T - 1."""
        t = k.shape[2]
        self.own(slot, start, start + t, held)
        if self.grouped:
            return self._write_grouped(slot, start, k, v)
        new = [c.encode(x) for c, x in zip(self.codecs, (k, v))]  # each part (1, n_kv, T, width)
        table, done = self.pages.tables[slot], 0
        while done < t:
            p = start + done
            b, at = table[p // BLOCK], p % BLOCK
            n = min(t - done, BLOCK - at)
            for pool, parts in zip((self.k_parts, self.v_parts), new):
                for part, x in zip(pool, parts):
                    part[b, :, at : at + n] = x[0, :, done : done + n]
            done += n

    def _write_grouped(self, slot: int, start: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """KIVI: block after block, the new floats into the ring, then the block coded once the
        end is `residual` past it (a long piece codes blocks it wrote whole)."""
        end = start + k.shape[2]
        last = self.pages.coded(end)
        for j in range(self._coded[slot], -(-end // BLOCK)):
            lo, hi = max(start, j * BLOCK), min(end, j * BLOCK + BLOCK)
            if lo < hi:
                r = self.pages.ring(slot, j)
                self.k_ring[r, :, lo % BLOCK : lo % BLOCK + hi - lo] = k[0, :, lo - start : hi - start]  # type: ignore[index]
                self.v_ring[r, :, lo % BLOCK : lo % BLOCK + hi - lo] = v[0, :, lo - start : hi - start]  # type: ignore[index]
                self._ring_of[slot][j % Pages.RING] = j
            if j < last:
                self._seal(slot, j + 1)

    def keep(self, slot: int, n: int, index: torch.Tensor) -> None:
        """Of the slot's first n places, keep those at `index` (n_kv, m) (sorted, each head its
        own) at places 0 .. m - 1, every part alike (H2O: `policies.PagedH2O`)."""
        if self.grouped:
            raise ValueError("KIVI's codes span tokens: they cannot be kept one by one")
        table, m = self.pages.tables[slot], index.shape[1]
        nb, mb = -(-n // BLOCK), -(-m // BLOCK)
        at = torch.tensor(table[:nb], dtype=torch.long, device=self.device)
        index = index.to(self.device)
        for part in (*self.k_parts, *self.v_parts):
            x = part.index_select(0, at).transpose(0, 1).reshape(self.n_kv, nb * BLOCK, -1)
            kept = torch.zeros(self.n_kv, mb * BLOCK, x.shape[-1], dtype=x.dtype, device=x.device)
            kept[:, :m] = torch.gather(x, 1, index[..., None].expand(-1, -1, x.shape[-1]))
            part[at[:mb]] = kept.view(self.n_kv, mb, BLOCK, -1).transpose(0, 1)

    def move(self, slot: int, src: Sequence[int], dst: Sequence[int]) -> None:
        """The slot's entries at places `src` to places `dst`, every part alike, all read
        before any is written (a draft tree's accepted path to the front: `KVCache.keep`)."""
        if self.grouped:
            raise ValueError("KIVI's codes span tokens: they cannot be moved one by one")
        table, dev = self.pages.tables[slot], self.device
        bs, ps, bd, pd = (torch.tensor(x, dtype=torch.long, device=dev) for x in (
            [table[p // BLOCK] for p in src], [p % BLOCK for p in src],
            [table[p // BLOCK] for p in dst], [p % BLOCK for p in dst]))  # fmt: skip
        for part in (*self.k_parts, *self.v_parts):
            part[bd, :, pd] = part[bs, :, ps]

    def read(self, slot: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The slot's keys and values up to `end` as (1, n_kv, L, hd) tensors (a copy): all `end`
        of them, or under a window the last L from its first held block."""
        lo = self.pages.first[slot]
        if self.grouped:
            return self._read_grouped(slot, lo, end)
        return self.gather(self.pages.tables[slot][lo:], end - lo * BLOCK)

    def _read_grouped(self, slot: int, lo: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        """KIVI: the coded blocks decoded, then the ring's floats, each in `dtype`."""
        table, coded = self.pages.tables[slot], self._coded[slot]
        out = []
        for c, pool, ring in zip(self.codecs, (self.k_parts, self.v_parts), (self.k_ring, self.v_ring)):
            blocks = []
            if lo < coded:  # the codes (not the floats) put head-first: decoded in place
                x = c.decode([self._take(p, table[lo:coded]).transpose(0, 1) for p in pool], self.dtype)
                blocks.append(x.view(1, self.n_kv, -1, x.shape[-1]))  # (KV, nb, BLOCK, hd) as one
            fl = [self.pages.ring(slot, j) for j in range(max(lo, coded), -(-end // BLOCK))]
            if fl:
                x = ring[torch.tensor(fl, device=self.device)].transpose(0, 1)  # type: ignore[index]
                blocks.append(x.reshape(1, self.n_kv, -1, x.shape[-1]).to(self.dtype))
            out.append(torch.cat(blocks, 2)[:, :, : end - lo * BLOCK])
        return out[0], out[1]

    def _take(self, part: torch.Tensor, blocks: Sequence[int]) -> torch.Tensor:
        """These blocks of a part: a view where they follow each other in the pool (a slot's
        usually do: blocks are handed out in order), else a copy."""
        b0 = blocks[0]
        if blocks[-1] - b0 == len(blocks) - 1 and list(blocks) == list(range(b0, b0 + len(blocks))):
            return part[b0 : b0 + len(blocks)]
        return part.index_select(0, torch.tensor(blocks, dtype=torch.long, device=self.device))

    def gather(self, blocks: Sequence[int], end: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The first `end` positions of these blocks in turn, as `read` gives a slot's."""
        nb = -(-end // BLOCK)
        idx = torch.tensor(blocks[:nb], dtype=torch.long, device=self.device)
        ck, cv = self.codecs
        # one float type stored as it is is read in place; anything else in `dtype`, both alike
        same = type(ck) is Plain and type(cv) is Plain and ck.dtype == cv.dtype
        out = []
        for c, pool in zip(self.codecs, (self.k_parts, self.v_parts)):
            parts = [p.index_select(0, idx).transpose(0, 1).reshape(1, self.n_kv, nb * BLOCK, p.shape[-1])[:, :, :end]
                     for p in pool]  # fmt: skip
            out.append(c.decode(parts, ck.dtype if same else self.dtype))
        return out[0], out[1]

    def slot_bytes(self, slot: int) -> int:
        """Bytes of the blocks the slot holds in this layer (not a dropped entry's), and of
        its ring (KIVI)."""
        return sum(1 for b in self.pages.tables[slot] if b) * self.block_bytes + self.ring_bytes

    @property
    def ring_bytes(self) -> int:
        """Bytes of one slot's ring (0 without KIVI)."""
        if not self.grouped:
            return 0
        size = torch.empty(0, dtype=self.ring_dtype).element_size()
        return Pages.RING * BLOCK * self.n_kv * (self.head_dim + self.v_head_dim) * size

    @property
    def block_bytes(self) -> int:
        return int(BLOCK * self.n_kv * sum(c.bytes_per_token(hd, BLOCK)
                   for c, hd in zip(self.codecs, (self.head_dim, self.v_head_dim))))  # fmt: skip

    @property
    def nbytes(self) -> int:
        """Bytes of this layer's pool (and ring)."""
        ring = 0 if self.k_ring is None else self.ring_bytes // Pages.RING * self.pages.ring_blocks
        return self.allocated * self.block_bytes + ring


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

    @property
    def residual_bytes(self) -> int:
        """Full-precision bytes beside the cache: KIVI's ring in the pool, else none."""
        return 0 if self.rows is None else self.rows.ring_bytes

    def exact(self, n: int) -> bool:
        """Trimming n keeps every key the next query sees (a window's dropped blocks do not)
        as it was read (KIVI: `Rows.exact`)."""
        if self.rows is None:
            return True
        end = self.offset - n
        return self.rows.pages.keeps(self.slot, end) and self.rows.exact(self.slot, end)

    def trim(self, n: int) -> int:
        n = super().trim(n)
        if self.rows is not None:
            self.rows.reopen(self.slot, self.offset)
        return n

    def keep(self, start: int, path: Sequence[int]) -> None:
        """Of the positions from `start` on, keep those at start + path[i] (ascending) at
        start + i, and forget the rest (a verified draft tree's accepted path)."""
        moves = [(start + j, start + i) for i, j in enumerate(path) if i != j]
        if moves:
            src, dst = zip(*moves)
            if self.rows is not None:
                self.rows.move(self.slot, src, dst)
            else:
                for buf in (self._k, self._v):
                    assert buf is not None
                    buf[:, :, list(dst)] = buf[:, :, list(src)]
        self.trim(self.offset - start - len(path))

    def bytes_per_token(self) -> float:
        """What one more cached token costs, K and V."""
        if self.rows is not None:
            return self.rows.block_bytes / BLOCK
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
