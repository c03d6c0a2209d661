"""Caches that forget: StreamingLLM's sinks and window, and H2O's heavy hitters. A runner's slots
keep them in the paged pool's blocks (`PagedStreaming`, `PagedH2O`: float and int8/fp8 types);
otherwise (KIVI's int4/int2 under StreamingLLM, mixed types, caches outside a pool) they hold
their keys and values in `kvquant.Store`s, so every cache type composes with them (int4 keys
with a window, int8 with H2O, ...). All keep the cache interface (`cache.KVCache`) plus:

    cache.make_room(n)     before n new tokens: forget what the policy says; returns how many
    cache.dropped          tokens forgotten so far
    cache.pre_rope         True: `update_and_fetch` takes keys before RoPE and returns them
                           rotated at their positions inside the cache (StreamingLLM)
    cache.observes         True: attention reports each step's probabilities (`observe`)
    cache.exact(n)         whether trim(n) gives back exactly the earlier state (not when the
                           policy forgot something during those n tokens: forgetting is final)
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from localllm.backends.torch.cache import BLOCK, Rows
from localllm.backends.torch.kvquant import POOLED, QuantizedKVCache, Store, make_store, pooled
from localllm.backends.torch.models.base import RoPE, apply_rope
from localllm.types import ContextPolicy

__all__ = ["H2OCache", "PagedH2O", "PagedStreaming", "StreamingCache", "make_caches"]

_FLOATS = {"f32": torch.float32, "f16": torch.float16, "bf16": torch.bfloat16}
# Tokens a window keeps after forgetting them, until their room is needed: the held ones move
# down once per this many tokens instead of at every token.
WINDOW_SLACK = 64


class _Forgetting:
    """Accounting both policies share: what was appended, what was forgotten and when."""

    pre_rope = False
    observes = False

    def __init__(self) -> None:
        self.dropped = 0
        self._appended = 0
        self._forgot_at = -1  # `_appended` when the policy last forgot something

    def _forgot(self, n: int) -> int:
        if n > 0:
            self.dropped += n
            self._forgot_at = self._appended
        return n

    def is_trimmable(self) -> bool:
        return True

    def exact(self, n: int) -> bool:
        stores = self._stores()
        return self._appended - n > self._forgot_at and all(s.exact(n) for s in stores)

    def _stores(self) -> list[Store]:
        raise NotImplementedError

    @property
    def nbytes(self) -> int:
        return sum(s.nbytes for s in self._stores())

    @property
    def residual_bytes(self) -> int:
        return sum(s.residual_bytes for s in self._stores())

    @property
    def state(self) -> tuple[tuple[torch.Tensor, ...], ...]:
        return tuple(s.state for s in self._stores())

    @state.setter
    def state(self, stored: tuple[tuple[torch.Tensor, ...], ...]) -> None:
        for s, part in zip(self._stores(), stored):
            s.state = part
        self._restored()

    def _restored(self) -> None:
        """After `state` was set: forget what was derived from the stores."""


class StreamingCache(_Forgetting):
    """StreamingLLM (arXiv 2309.17453): the first `sinks` tokens and the most recent `window`.

    Positions are positions inside the cache, as in the paper: keys are stored before RoPE and
    rotated at every read with positions 0..L-1 (the model's queries sit at L-T..L-1: the cache's
    `offset` after `make_room`). One token is forgotten per token appended once the window is
    full, the oldest after the sinks. Sinks and window are stores of the cache's types; the
    sinks quantize as soon as they are complete (a KIVI key group of `sinks` tokens).
    """

    pre_rope = True

    def __init__(self, sinks: tuple[Store, Store], window: tuple[Store, Store], *,
                 n_sinks: int, n_window: int, rope: RoPE) -> None:  # fmt: skip
        super().__init__()
        self.sink_k, self.sink_v = sinks
        self.win_k, self.win_v = window
        self.n_sinks, self.window, self.rope = n_sinks, n_window, rope
        self.capacity = n_sinks + n_window
        self._sinks: tuple[torch.Tensor, torch.Tensor] | None = None  # read back, K rotated

    def _stores(self) -> list[Store]:
        return [self.sink_k, self.sink_v, self.win_k, self.win_v]

    @property
    def offset(self) -> int:
        return len(self.sink_k) + len(self.win_k)

    held = offset

    def _split(self, n: int) -> int:
        """How many of n new tokens go to the sinks."""
        return max(0, min(n, self.n_sinks - len(self.sink_k)))

    def make_room(self, n: int) -> int:
        over = len(self.win_k) + n - self._split(n) - self.window
        if over <= 0:
            return 0
        if over > len(self.win_k):
            raise ValueError(f"{n} new tokens do not fit a window of {self.window}")
        self.win_k.drop_front(over)
        self.win_v.drop_front(over)
        return self._forgot(over)

    def update_and_fetch(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """k (1, KV, T, hd) before RoPE, v → every held key, rotated at 0..L-1, and value."""
        s = self._split(k.shape[2])
        if s:
            self.sink_k.append(k[:, :, :s])
            self.sink_v.append(v[:, :, :s])
        if s < k.shape[2]:
            self.win_k.append(k[:, :, s:])
            self.win_v.append(v[:, :, s:])
        self._appended += k.shape[2]
        sk, sv = self._read_sinks()
        wk, wv = self.win_k.fetch(), self.win_v.fetch()
        cos, sin = self.rope.table(len(self.sink_k) + wk.shape[2], wk.dtype)
        n = sk.shape[2]
        wk = apply_rope(wk, cos[:, :, n:], sin[:, :, n:])
        if not n:
            return wk, wv
        return torch.cat([sk, wk], 2), torch.cat([sv, wv], 2)

    def _read_sinks(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The sinks read back (keys rotated at 0..sinks-1): once complete they never change, so
        they are read once, not at every token."""
        if self._sinks is not None:
            return self._sinks
        sk, sv = self.sink_k.fetch(), self.sink_v.fetch()
        if sk.shape[2]:
            cos, sin = self.rope.table(sk.shape[2], sk.dtype)
            sk = apply_rope(sk, cos, sin)
        if len(self.sink_k) == self.n_sinks:
            self._sinks = (sk, sv)
        return sk, sv

    def trim(self, n: int) -> int:
        n = max(0, min(n, self.offset))
        w = min(n, len(self.win_k))
        self.win_k.truncate(w)
        self.win_v.truncate(w)
        self.sink_k.truncate(n - w)
        self.sink_v.truncate(n - w)
        if n > w:
            self._sinks = None
        self._appended -= n
        return n

    def bytes_per_token(self) -> float:
        return self.win_k.bytes_per_token() + self.win_v.bytes_per_token()

    def _restored(self) -> None:
        self._sinks = None


class _InPool:
    """A policy whose keys and values are its slot's blocks of the pool (`rows`): nothing of its
    own to quantize, keep or report."""

    rows: Rows
    slot: int

    def _stores(self) -> list[Store]:
        return []

    @property
    def nbytes(self) -> int:
        return self.rows.slot_bytes(self.slot)

    def bytes_per_token(self) -> float:
        return self.rows.block_bytes / BLOCK


class PagedStreaming(_InPool, _Forgetting):
    """StreamingLLM in the paged pool (`cache.Rows`, issue 33): the sinks and the window are the
    slot's blocks, keys stored before RoPE, as `StreamingCache` keeps them in stores of its own.

    The slot's table keeps growing with every token, forgotten ones too (`at`: the next token's
    place in it); what is forgotten is the positions [sinks, sinks + gap) between the sinks and
    the window, so forgetting copies nothing: the window's start moves on, and a block wholly
    inside the gap goes back to the pool (once every layer of the slot forgot it: `peers`, the
    slot's caches, since a layer-skip draft moves some layers only). Positions inside the cache
    are as the paper's: a sink's is its place, a window key's its place less the gap (`offset`,
    the next query's, is `at - gap`); attention reads the keys rotated there, in one call with
    the slot's neighbours in a decode step (`models.base._attend_rows`), or by `update_and_fetch`
    for a longer piece. The prefix cache takes no StreamingLLM slot (positions inside the cache
    are not positions in the text)."""

    pre_rope = True

    def __init__(self, rows: Rows, slot: int, *, n_sinks: int, n_window: int, rope: RoPE,
                 dtype: torch.dtype, peers: list[Any]) -> None:  # fmt: skip
        super().__init__()
        self.rows, self.slot = rows, slot
        self.n_sinks, self.window, self.rope = n_sinks, n_window, rope
        self.capacity = n_sinks + n_window
        self.dtype = dtype  # what `update_and_fetch` returns
        self.peers = peers
        self.at = 0
        self.gap = 0  # positions forgotten after the sinks: the window starts at sinks + gap

    @property
    def offset(self) -> int:
        return self.at - self.gap

    held = offset

    def _window_len(self) -> int:
        return max(0, self.at - self.n_sinks - self.gap)

    def make_room(self, n: int) -> int:
        split = max(0, min(n, self.n_sinks - self.at))
        win = self._window_len()
        over = win + n - split - self.window
        if over <= 0:
            return 0
        if over > win:
            raise ValueError(f"{n} new tokens do not fit a window of {self.window}")
        self.gap += over
        lowest = min(p.gap for p in self.peers)
        self.rows.pages.forget(self.slot, self.n_sinks, self.n_sinks + lowest)
        return self._forgot(over)

    def advance(self, n: int) -> None:
        self.at += n
        self._appended += n

    def update_and_fetch(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """k (1, KV, T, hd) before RoPE, v → every held key, rotated at 0..L-1, and value."""
        t = k.shape[2]
        self.rows.write(self.slot, self.at, k, v, held=self.offset + t)
        self.advance(t)
        table, b = self.rows.pages.tables[self.slot], BLOCK
        sinks = min(self.at, self.n_sinks)
        parts = [self.rows.gather(table, sinks)] if sinks else []
        if self.at > self.n_sinks:
            lo = self.n_sinks + self.gap
            wk, wv = self.rows.gather(table[lo // b :], self.at - lo // b * b)
            parts.append((wk[:, :, lo % b :], wv[:, :, lo % b :]))
        kk = torch.cat([x[0] for x in parts], 2).to(self.dtype)
        vv = torch.cat([x[1] for x in parts], 2).to(self.dtype)
        cos, sin = self.rope.table(kk.shape[2], kk.dtype)
        return apply_rope(kk, cos, sin), vv

    def trim(self, n: int) -> int:
        n = max(0, min(n, self.offset))
        w = min(n, self._window_len())
        self.at -= w
        if n > w:  # into the sinks: the window starts afresh after them
            self.at -= self.gap + n - w
            self.gap = 0
        self._appended -= n
        return n

class _Scores(_Forgetting):
    """H2O's attention accumulated by each held token, per KV head (`scores` (KV, held)), and
    the scores as they were before each of the last `KEPT` pieces: taking tokens back (`trim`:
    a failed forward pass, a caller's rollback) puts back what their queries added, so that an
    exact trim leaves the next choice of what to forget as it was. (The engine refuses
    speculation under H2O all the same: a verification makes room for all its drafts at once.)"""

    KEPT = 16
    observes = True
    held: int  # tokens kept (`make_room` chooses among them)

    def __init__(self, n_kv: int, device: torch.device | str, *, budget: int, recent: int | None,
                 capacity: int) -> None:  # fmt: skip
        super().__init__()
        self.budget = budget
        self.recent = budget // 2 if recent is None else recent
        self.capacity = capacity  # positions: the model's context
        self.pos = 0
        self.scores = torch.zeros(n_kv, 0, dtype=torch.float32, device=device)
        self._before: list[tuple[int, torch.Tensor]] = []  # (`_appended` then, scores then)

    def make_room(self, n: int) -> int:
        """Before n new tokens, forget what exceeds the budget: each KV head keeps the `recent`
        newest and the older ones with the most attention (`_keep`)."""
        held = self.held
        over = held + n - self.budget
        if over <= 0:
            return 0
        older = held - min(held, self.recent)  # candidates: all but the recent ones
        if over > older:
            raise ValueError(f"{n} new tokens do not fit an H2O budget of {self.budget}")
        heavy = self.scores[:, :older].topk(older - over, dim=1).indices.sort(dim=1).values
        recent = torch.arange(older, held, device=heavy.device).expand(heavy.shape[0], -1)
        index = torch.cat([heavy, recent], 1)  # (KV, kept), sorted per head
        self._keep(index)
        self.scores = torch.gather(self.scores, 1, index)
        return self._forgot(over)

    def _keep(self, index: torch.Tensor) -> None:
        raise NotImplementedError

    def _append_scores(self, n: int) -> None:
        """Before n new tokens: the scores kept, a zero for each new one."""
        self._before = [*self._before[-(self.KEPT - 1) :], (self._appended, self.scores)]
        self._appended += n
        fresh = torch.zeros(self.scores.shape[0], n, dtype=self.scores.dtype, device=self.scores.device)
        self.scores = torch.cat([self.scores, fresh], 1)  # a new tensor: the kept one stays

    def observe(self, probs: torch.Tensor) -> None:
        """probs (KV, L): this step's attention on each held token, summed over its queries."""
        self.scores += probs.float()

    def _trim_scores(self, n: int, held: int) -> None:
        self._appended -= n
        back = [s for a, s in self._before if a == self._appended]
        self._before = [(a, s) for a, s in self._before if a < self._appended]
        self.scores = back[0] if back else self.scores[:, :held]

    def exact(self, n: int) -> bool:
        return super().exact(n) and (n <= 0 or any(a == self._appended - n for a, _ in self._before))


class PagedH2O(_InPool, _Scores):
    """H2O in the paged pool (`cache.Rows`, issue 33), as `H2OCache` keeps it in stores of its
    own: the slot's blocks hold the kept tokens of each KV head at its first `at` places (each
    head its own heavy hitters, so the place of a token differs between heads; keys keep their
    RoPE at their positions in the text, so a place is only where a key is kept). Forgetting
    moves each head's kept tokens down in every part of the pool (`Rows.keep`: codes too), as
    the store's `keep` does. A decode step attends with the slot's neighbours in one call and
    gets the probabilities back for the scores (`models.base._attend_rows`); a longer piece
    reads its keys by `update_and_fetch`. No prefix cache: places are not positions."""

    def __init__(self, rows: Rows, slot: int, *, budget: int, recent: int | None = None) -> None:
        super().__init__(rows.n_kv, rows.device, budget=budget, recent=recent,
                         capacity=rows.pages.capacity)  # fmt: skip
        self.rows, self.slot = rows, slot
        self.at = 0  # places held (the next token's place in the slot's table)

    @property
    def offset(self) -> int:
        return self.pos

    @property
    def held(self) -> int:
        return self.at

    def _keep(self, index: torch.Tensor) -> None:
        self.rows.keep(self.slot, self.at, index)
        self.at = index.shape[1]

    def advance(self, n: int) -> None:
        self.at += n
        self.pos += n
        self._append_scores(n)

    def update_and_fetch(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        t = k.shape[2]
        self.rows.write(self.slot, self.at, k, v, held=self.at + t)
        self.advance(t)
        return self.rows.read(self.slot, self.at)

    def trim(self, n: int) -> int:
        n = max(0, min(n, self.at))
        self.at -= n
        self.pos -= n
        self._trim_scores(n, self.at)
        return n

class H2OCache(_Scores):
    """H2O (arXiv 2306.14048): at most `budget` tokens per layer and KV head — the `recent`
    newest and the heavy hitters, the older tokens with the most attention accumulated over every
    query so far (summed over the query heads that share the KV head). Keys keep their RoPE at
    their positions in the text; `offset` is the next position, not the count held."""

    def __init__(self, k: Store, v: Store, *, budget: int, recent: int | None = None) -> None:
        super().__init__(k.n_kv, k.device, budget=budget, recent=recent, capacity=k.capacity)
        self.k, self.v = k, v

    def _stores(self) -> list[Store]:
        return [self.k, self.v]

    @property
    def offset(self) -> int:
        return self.pos

    @property
    def held(self) -> int:
        return len(self.k)

    def _keep(self, index: torch.Tensor) -> None:
        self.k.keep(index)
        self.v.keep(index)

    def update_and_fetch(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        self.k.append(k)
        self.v.append(v)
        t = k.shape[2]
        self.pos += t
        self._append_scores(t)
        return self.k.fetch(), self.v.fetch()

    def trim(self, n: int) -> int:
        n = max(0, min(n, len(self.k)))
        self.k.truncate(n)
        self.v.truncate(n)
        self.pos -= n
        self._trim_scores(n, len(self.k))
        return n

    def bytes_per_token(self) -> float:
        return self.k.bytes_per_token() + self.v.bytes_per_token()


def make_caches(model: Any, capacity: int, *, kv_types: tuple[str, str] = ("f16", "f16"),
                policy: ContextPolicy | None = None, budget: int = 0,
                dtype: torch.dtype = torch.float32,
                device: torch.device | str = "cpu", rows: Sequence[Rows] | None = None,
                slot: int = 0) -> list[Any]:  # fmt: skip
    """One sequence's caches, one per layer of `model`: the plain cache for one float type and no
    policy (the fast path; row `slot` of each layer's `rows` when given, which also hold int8,
    fp8 and KIVI's codes: `cache.Rows`' codecs are the types); else K and V stores of
    their types (`kvquant.make_store`), under StreamingLLM (`policy` enabled: sinks and window)
    or H2O (`budget` tokens) or neither. Attention reads them in `dtype`."""
    policy = policy or ContextPolicy()
    k_type, v_type = kv_types
    if (policy.enabled and not budget and rows and k_type in POOLED and v_type in POOLED
            and not any(r.pages.window for r in rows)):  # fmt: skip
        # StreamingLLM in the pool's blocks (not beside sliding-window layers, whose pages drop
        # what their window no longer sees: Gemma 3 keeps stores of its own)
        sinks = policy.sinks or 0
        window = min(policy.window, capacity - sinks)
        peers: list[Any] = []
        peers += [PagedStreaming(r, slot, n_sinks=sinks, n_window=window,
                                 rope=model.rope_for(layer), dtype=dtype, peers=peers)
                  for layer, r in enumerate(rows)]  # fmt: skip
        return peers
    if budget and not policy.enabled and rows and k_type in POOLED and v_type in POOLED:
        return [PagedH2O(r, slot, budget=budget) for r in rows]  # H2O in the pool's blocks
    if not policy.enabled and not budget and (
        (k_type == v_type and k_type in _FLOATS) or (rows and pooled(kv_types))
    ):  # the pool's blocks hold what its codecs say (`cache.Rows`)
        return model.make_caches(capacity, dtype=_FLOATS.get(k_type, dtype), device=device, rows=rows,
                                 slot=slot)  # fmt: skip
    a = model.args

    def pair(size: int, **kw: Any) -> tuple[Store, Store]:
        return tuple(make_store(t, key=key, n_kv=a.n_kv_heads, head_dim=a.head_dim, capacity=size,
                                out_dtype=dtype, device=device, **kw)
                     for t, key in ((k_type, True), (v_type, False)))  # type: ignore[return-value]  # fmt: skip

    caches: list[Any] = []
    for layer in range(a.n_layers):
        if policy.enabled:
            sinks = policy.sinks or 0
            window = min(policy.window, capacity - sinks)
            # the sinks quantize as soon as they are complete: one key group of `sinks` tokens
            caches.append(StreamingCache(pair(sinks, residual=0, group=max(1, sinks)),
                                         pair(window, slack=WINDOW_SLACK), n_sinks=sinks,
                                         n_window=window,
                                         rope=model.rope_for(layer)))  # fmt: skip
        elif budget:
            caches.append(H2OCache(*pair(capacity), budget=budget))  # a cache outside the pool
        else:
            caches.append(QuantizedKVCache(*pair(capacity)))
    return caches
