"""Quantized KV storage: a codec says how a group of tokens becomes codes, a `Store` holds one of
K or V in them, and `QuantizedKVCache` pairs two stores (K and V chosen separately) behind the
plain cache's interface (`cache.KVCache`). The evicting caches (`policies`) use the same stores.

Codecs (one head's `hd` values per token; `G` tokens per group):

    f16/bf16/f32  the values as they are (`Plain`)
    int8          symmetric per token and head: x ≈ s·q, q in [-127, 127], s = max|x| / 127 (f16)
    fp8           the same with float8 e4m3 codes, s = max|x| / 448: 2^-4 relative rounding
    int4, int2    KIVI (arXiv 2402.02750): asymmetric, x ≈ s·q + z with q in [0, 2^b - 1] and one
                  f16 scale and zero per group of 64 — keys per channel (the group is 64 tokens
                  of one channel: keys have outlier channels), values per token (64 channels of
                  one token) — and the most recent 128 tokens kept in full precision (the
                  residual), as Hugging Face's QuantizedCache defaults. Codes are packed 8/b per
                  byte.

Bytes one more cached token costs per head (hd 64): f16 128, int8/fp8 66, int4 36, int2 20.

A store quantizes a group once, when it leaves the residual (`end - qend ≥ R + G`), and never
again; it keeps the full-precision copy of the group it quantized last. So `truncate(n)` is exact
— what is read afterwards is bit for bit what was read before those n tokens came — whenever it
reopens at most that one group (`exact(n)`: always for n ≤ G; speculative rollback needs no more).
A deeper truncation reopens groups from their codes.

`fetch()` dequantizes the whole store: attention reads one full-precision copy of one layer's K
and V per step (freed when the layer is done); only codes, scales and the residual persist.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

__all__ = ["CODECS", "GROUPED", "POOLED", "QuantizedKVCache", "Store", "codec", "make_store", "pooled", "stored"]

RESIDUAL = 128  # KIVI's full-precision window (tokens)
GROUP = 64  # tokens (keys) or channels (values) sharing one scale and zero


# -- codecs -------------------------------------------------------------------------------------


class Plain:
    """Values stored as they are, in `dtype`."""

    per_channel = False

    def __init__(self, dtype: torch.dtype) -> None:
        self.dtype = dtype

    def parts(self, hd: int, g: int) -> list[tuple[int, int, torch.dtype]]:
        """(rows per group, width, dtype) of each stored tensor."""
        return [(g, hd, self.dtype)]

    def encode(self, x: torch.Tensor) -> list[torch.Tensor]:
        """x (1, KV, n, G, hd) → the parts, each (1, KV, n, rows, width)."""
        return [x.to(self.dtype)]

    def decode(self, parts: list[torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
        return parts[0].to(dtype)

    def bytes_per_token(self, hd: int, g: int) -> float:
        return sum(rows * width * torch.empty(0, dtype=dt).element_size()
                   for rows, width, dt in self.parts(hd, g)) / g  # fmt: skip


class Scaled(Plain):
    """int8 or fp8 codes with one float16 scale per token and head (symmetric)."""

    def __init__(self, kind: str) -> None:
        super().__init__(torch.int8 if kind == "int8" else torch.float8_e4m3fn)
        self.qmax = 127.0 if kind == "int8" else 448.0

    def parts(self, hd: int, g: int) -> list[tuple[int, int, torch.dtype]]:
        return [(g, hd, self.dtype), (g, 1, torch.float16)]

    def encode(self, x: torch.Tensor) -> list[torch.Tensor]:
        x = x.float()
        scale = (x.abs().amax(-1, keepdim=True) / self.qmax).to(torch.float16)
        s = scale.float()  # codes use the stored scale
        y = torch.where(s > 0, x / s, torch.zeros_like(s)).clamp_(-self.qmax, self.qmax)
        codes = y.round_().to(torch.int8) if self.dtype == torch.int8 else y.to(self.dtype)
        return [codes, scale]

    def decode(self, parts: list[torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
        q, s = parts
        return (q.to(torch.float32) * s.to(torch.float32)).to(dtype)


class Kivi(Plain):
    """b-bit asymmetric codes, packed; scale and zero (float16) per channel over the group's
    tokens (`per_channel`, keys) or per `GROUP` channels of each token (values)."""

    def __init__(self, bits: int, per_channel: bool) -> None:
        super().__init__(torch.uint8)
        self.bits, self.per_channel = bits, per_channel
        self.qmax = float(2**bits - 1)

    def _width(self, hd: int) -> int:  # channels per scale for per-token groups
        return min(GROUP, hd)

    def parts(self, hd: int, g: int) -> list[tuple[int, int, torch.dtype]]:
        scales = (1, hd) if self.per_channel else (g, hd // self._width(hd))
        return [(g, hd * self.bits // 8, torch.uint8), (*scales, torch.float16),
                (*scales, torch.float16)]  # fmt: skip

    def encode(self, x: torch.Tensor) -> list[torch.Tensor]:
        x = x.float()
        shape = x.shape
        if self.per_channel:  # over the group's tokens
            lo, hi = x.amin(3, keepdim=True), x.amax(3, keepdim=True)  # (1, KV, n, 1, hd)
            xs = x
        else:  # over `width` channels of each token
            w = self._width(shape[-1])
            xs = x.reshape(*shape[:-1], shape[-1] // w, w)
            lo, hi = xs.amin(-1, keepdim=True), xs.amax(-1, keepdim=True)
        scale = ((hi - lo) / self.qmax).to(torch.float16)
        zero = lo.to(torch.float16)
        s, z = scale.float(), zero.float()
        q = torch.where(s > 0, (xs - z) / s, torch.zeros_like(xs)).round_().clamp_(0, self.qmax)
        q = q.to(torch.uint8).reshape(shape)
        if not self.per_channel:
            scale, zero = scale.squeeze(-1), zero.squeeze(-1)
        return [self._pack(q), scale, zero]

    def decode(self, parts: list[torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
        packed, scale, zero = parts
        q = self._unpack(packed).float()
        if self.per_channel:
            return (q * scale.float() + zero.float()).to(dtype)
        shape = q.shape
        w = shape[-1] // scale.shape[-1]
        q = q.reshape(*shape[:-1], scale.shape[-1], w)
        return (q * scale.float()[..., None] + zero.float()[..., None]).reshape(shape).to(dtype)

    def _pack(self, q: torch.Tensor) -> torch.Tensor:
        """Codes (..., hd) → bytes (..., hd·b/8): byte j holds elements j, j + hd/per, ..."""
        per = 8 // self.bits
        q = q.reshape(*q.shape[:-1], per, q.shape[-1] // per)
        out = q[..., 0, :].clone()
        for i in range(1, per):
            out |= q[..., i, :] << (self.bits * i)
        return out

    def _unpack(self, b: torch.Tensor) -> torch.Tensor:
        per, mask = 8 // self.bits, 2**self.bits - 1
        return torch.cat([(b >> (self.bits * i)) & mask for i in range(per)], -1)


CODECS = ("f16", "bf16", "f32", "int8", "fp8", "int4", "int2")
POOLED = ("f16", "bf16", "f32", "int8", "fp8")  # token by token: what a pool's prefix shares
GROUPED = ("int4", "int2")  # in a pool for keys and values both (`cache.Rows`), no prefix
_FLOATS = {"f16": torch.float16, "bf16": torch.bfloat16, "f32": torch.float32}


def pooled(kinds: Sequence[str]) -> bool:
    """Whether a paged pool (`cache.Rows`) stores keys and values of these types."""
    return all(k in POOLED for k in kinds) or all(k in GROUPED for k in kinds)


def codec(kind: str, *, key: bool) -> Plain:
    """The codec of a cache type, for keys (`key`) or values."""
    if kind in _FLOATS:
        return Plain(_FLOATS[kind])
    if kind in ("int8", "fp8"):
        return Scaled(kind)
    if kind in ("int4", "int2"):
        return Kivi(int(kind[3]), per_channel=key)
    raise ValueError(f"no {kind} KV codec")


def stored(parts: Sequence[torch.Tensor]) -> Plain:
    """The codec whose parts these are, by their types and shapes (a paged pool's, `cache.Rows`,
    each (n_blocks, n_kv, rows, width)): one float part is stored as it is; int8 or fp8 codes
    come with their scale; KIVI's packed codes with their scales, zeros and the float ring,
    whose width is the head's (keys' scales are one row a block: per channel)."""
    if len(parts) == 1:
        return Plain(parts[0].dtype)
    if len(parts) == 2:
        return Scaled("int8" if parts[0].dtype == torch.int8 else "fp8")
    codes, scale, _, ring = parts
    return Kivi(8 * codes.shape[-1] // ring.shape[-1], per_channel=scale.shape[2] == 1)


# -- one of K or V ------------------------------------------------------------------------------


class Store:
    """One of K or V for one layer and sequence, as (1, KV, tokens, hd).

    Tokens are counted from when the store was made: it holds [start, end). Groups of `group`
    tokens are quantized in [base, qend) (group i at index i of the part buffers); the full-
    precision buffer holds [fp_base, end) in `fp_dtype`. `drop_front(n)` forgets the oldest held
    tokens (StreamingLLM's window), `keep(index)` keeps a subset per head (H2O).
    """

    def __init__(self, codec: Plain, n_kv: int, head_dim: int, capacity: int, *,
                 residual: int = 0, group: int = 1, fp_dtype: torch.dtype = torch.float16,
                 out_dtype: torch.dtype = torch.float32, slack: int = 0,
                 device: torch.device | str = "cpu") -> None:  # fmt: skip
        self.codec, self.n_kv, self.hd, self.capacity = codec, n_kv, head_dim, capacity
        self.slack = slack  # a window's: forgotten tokens kept until this many need the room
        self.residual, self.group = residual, group
        self.fp_dtype, self.dtype, self.device = fp_dtype, out_dtype, torch.device(device)
        self.start = self.end = self.base = self.qend = self.fp_base = 0
        self._parts: list[torch.Tensor] = []  # (1, KV, groups, rows, width) each
        self._fp: torch.Tensor | None = None  # (1, KV, n, hd)

    def __len__(self) -> int:
        return self.end - self.start

    # -- buffers ---------------------------------------------------------------------------------

    def _groups_room(self, n: int) -> int:
        """Room for `n` groups from `base`, freeing forgotten ones first; returns the (possibly
        smaller) count from the new `base`."""
        have = self._parts[0].shape[2] if self._parts else 0
        if n <= have:
            return n
        dead = (min(self.start, self.qend) - self.base) // self.group
        if dead:  # forgotten groups at the front: move the held ones down
            used = (self.qend - self.base) // self.group
            for p in self._parts:
                p[:, :, : used - dead] = p[:, :, dead:used].clone()
            self.base += dead * self.group
            n -= dead
            if n <= have:
                return n
        if self.slack:  # a window: its whole size at once, so it never grows while it slides
            size = max(n, -(-(self.capacity + self.slack) // self.group) + 1)
        else:
            size = max(n, 2 * have, -(-min(self.capacity, 256) // self.group))
        new = [torch.empty(1, self.n_kv, size, rows, width, dtype=dt, device=self.device)
               for rows, width, dt in self.codec.parts(self.hd, self.group)]  # fmt: skip
        used = (self.qend - self.base) // self.group
        for a, b in zip(new, self._parts):
            a[:, :, :used] = b[:, :, :used]
        self._parts = new
        return n

    def _fp_room(self, n: int) -> torch.Tensor:
        have = 0 if self._fp is None else self._fp.shape[2]
        if n > have or self._fp is None:
            size = max(n, self.residual + 2 * self.group + self.slack, 16)  # bounded
            fp = torch.empty(1, self.n_kv, size, self.hd, dtype=self.fp_dtype, device=self.device)
            used = self.end - self.fp_base
            if used:
                fp[:, :, :used] = self._fp[:, :, :used]  # type: ignore[index]
            self._fp = fp
        return self._fp  # type: ignore[return-value]

    def _qend_for(self, end: int) -> int:
        """Where the quantized groups end when the store ends at `end`."""
        full = max(0, end - self.base - self.residual) // self.group * self.group
        return min(self.qend, self.base + full)

    # -- appending and reading ---------------------------------------------------------------------

    def append(self, x: torch.Tensor) -> None:
        """x (1, KV, T, hd): the next T tokens."""
        t = x.shape[2]
        if len(self) + t > self.capacity:
            raise ValueError(f"KV cache full: {len(self) + t} tokens, capacity {self.capacity}")
        if self.group == 1 and not self.residual:  # each token on its own, at once: no originals
            g0 = self._groups_room(self.end - self.base + t) - t
            for buf, part in zip(self._parts, self.codec.encode(x[:, :, :, None])):
                buf[:, :, g0 : g0 + t] = part
            self.end = self.qend = self.fp_base = self.end + t
            return
        fp = self._fp_room(self.end + t - self.fp_base)
        fp[:, :, self.end - self.fp_base : self.end - self.fp_base + t] = x
        self.end += t
        n = (self.end - self.qend - self.residual) // self.group  # whole groups past the residual
        if n > 0:
            g0 = self._groups_room((self.qend - self.base) // self.group + n) - n
            lo = self.qend - self.fp_base
            xs = fp[:, :, lo : lo + n * self.group].reshape(1, self.n_kv, n, self.group, self.hd)
            for buf, part in zip(self._parts, self.codec.encode(xs)):
                buf[:, :, g0 : g0 + n] = part
            self.qend += n * self.group
            self._drop_fp(self.qend - self.group)  # keep the last quantized group's originals
            bound = self.residual + 2 * self.group
            if fp.shape[2] > bound:  # a long prompt passed through: back to the bounded size
                used = self.end - self.fp_base
                self._fp = fp[:, :, : max(used, bound)].clone()

    def _drop_fp(self, upto: int) -> None:
        """Forget the full-precision copies before `upto` (moving the rest to the front)."""
        upto = min(upto, self.end)
        if upto <= self.fp_base:
            return
        k, n = upto - self.fp_base, self.end - upto
        if n:
            self._fp[:, :, :n] = self._fp[:, :, k : k + n].clone()  # type: ignore[index]
        self.fp_base = upto

    def fetch(self) -> torch.Tensor:
        """Everything held, dequantized: (1, KV, len, hd) in `dtype`."""
        out = []
        if self.start < self.qend:
            g = self.group
            g0, g1 = (self.start - self.base) // g, (self.qend - self.base) // g
            parts = [p[:, :, g0:g1] for p in self._parts]
            x = self.codec.decode(parts, self.dtype).reshape(1, self.n_kv, (g1 - g0) * g, self.hd)
            out.append(x[:, :, self.start - self.base - g0 * g :])
        lo = max(self.start, self.qend)
        if lo < self.end:
            out.append(self._fp[:, :, lo - self.fp_base : self.end - self.fp_base].to(self.dtype))  # type: ignore[index]
        if not out:
            return torch.empty(1, self.n_kv, 0, self.hd, dtype=self.dtype, device=self.device)
        return out[0] if len(out) == 1 else torch.cat(out, 2)

    # -- forgetting ------------------------------------------------------------------------------

    def exact(self, n: int) -> bool:
        """Whether `truncate(n)` gives back exactly what was read before the last n tokens."""
        end = self.end - min(n, len(self))
        q = self._qend_for(end)
        return q >= min(end, self.qend) or q >= self.fp_base

    def truncate(self, n: int) -> int:
        """Forget the last n tokens (at most what is held); returns how many."""
        n = max(0, min(n, len(self)))
        end = self.end - n
        q = self._qend_for(end)
        if q < min(end, self.qend, self.fp_base):  # reopen groups whose originals are gone
            g = self.group
            g0, g1 = (q - self.base) // g, (self.fp_base - self.base) // g
            parts = [p[:, :, g0:g1] for p in self._parts]
            lost = self.codec.decode(parts, self.fp_dtype).reshape(1, self.n_kv, -1, self.hd)
            kept = self._fp[:, :, : max(0, end - self.fp_base)]  # type: ignore[index]
            fp = torch.cat([lost[:, :, : end - q], kept], 2)
            self._fp = torch.cat([fp, torch.empty_like(fp[:, :, : max(16, self.residual)])], 2)
            self.fp_base = q
        self.qend = min(self.qend, q)
        self.end = end
        self.start = min(self.start, end)
        return n

    def drop_front(self, n: int) -> None:
        """Forget the oldest n held tokens. Their room is reused when the buffers fill (one move
        of what is held per `slack` tokens); a partly forgotten group is skipped when read."""
        self.start = min(self.end, self.start + n)
        if self.start >= self.qend:  # no quantized token is held: groups restart at `start`
            self.base = self.qend = self.start
            if self.start - self.fp_base >= max(self.slack, 1):
                self._drop_fp(self.start)

    def keep(self, index: torch.Tensor) -> None:
        """Keep, per head, the held tokens at `index` (KV, n) (sorted, relative to `start`).
        Only for stores that quantize each token on its own (group 1, no residual)."""
        assert self.group == 1 and self.residual == 0
        n = index.shape[1]
        used = self.qend - self.base
        fresh = []
        for p in self._parts:
            live = p[:, :, self.start - self.base : used]  # (1, KV, L, 1, width)
            idx = index.to(self.device)[None, :, :, None, None].expand(1, -1, -1, *live.shape[3:])
            fresh.append(torch.gather(live, 2, idx))
        for p, f in zip(self._parts, fresh):
            p[:, :, :n] = f
        # the store's timeline restarts: n tokens, all quantized, no originals kept
        self.base = self.start = 0
        self.qend = self.end = self.fp_base = n

    # -- accounting ------------------------------------------------------------------------------

    @property
    def nbytes(self) -> int:
        bufs = [*self._parts, *([self._fp] if self._fp is not None else [])]
        return sum(b.numel() * b.element_size() for b in bufs)

    @property
    def residual_bytes(self) -> int:
        """Bytes of the full-precision buffer (the residual and the last group's originals)."""
        return 0 if self._fp is None else self._fp.numel() * self._fp.element_size()

    def bytes_per_token(self) -> float:
        """What one more quantized token costs: codes plus scales and zero points."""
        return self.n_kv * self.codec.bytes_per_token(self.hd, self.group)

    @property
    def state(self) -> tuple[torch.Tensor, ...]:
        """What is held, as stored: the quantized groups' parts, then the full-precision tail."""
        g0, g1 = (self.start - self.base) // self.group, (self.qend - self.base) // self.group
        lo = max(self.start, self.qend)
        tail = (self._fp[:, :, lo - self.fp_base : self.end - self.fp_base]  # type: ignore[index]
                if lo < self.end else torch.empty(1, self.n_kv, 0, self.hd, dtype=self.fp_dtype))  # fmt: skip
        skip = self.start - self.base - g0 * self.group
        return (*(p[:, :, g0:g1] for p in self._parts), tail,
                torch.tensor(skip if g1 > g0 else 0))  # fmt: skip

    @state.setter
    def state(self, stored: tuple[torch.Tensor, ...]) -> None:
        *parts, tail, skip = stored
        n = parts[0].shape[2] if parts else 0
        self.start = self.base = 0
        self.qend = n * self.group
        self._groups_room(n)
        for buf, p in zip(self._parts, parts):
            buf[:, :, :n] = p
        self.fp_base = self.end = self.qend
        fp = self._fp_room(tail.shape[2])
        fp[:, :, : tail.shape[2]] = tail
        self.end += tail.shape[2]
        self.start = int(skip)


def make_store(kind: str, *, key: bool, n_kv: int, head_dim: int, capacity: int,
               out_dtype: torch.dtype, device: torch.device | str = "cpu",
               residual: int = RESIDUAL, group: int = GROUP, slack: int = 0) -> Store:  # fmt: skip
    """A store for `kind` keys (`key`) or values: for int4/int2 KIVI's `group` tokens per key
    group and `residual` (values are grouped by tokens too, so both reopen alike); one token per
    group without a residual for the rest. The residual is float16 (bfloat16 on a GPU in bf16):
    what the f16 cache holds."""
    c = codec(kind, key=key)
    grouped = isinstance(c, Kivi)
    fp_dtype = torch.float16 if out_dtype == torch.float32 else out_dtype
    return Store(c, n_kv, head_dim, capacity, residual=residual if grouped else 0,
                 group=group if grouped else 1, fp_dtype=fp_dtype, out_dtype=out_dtype,
                 slack=slack, device=device)  # fmt: skip


# -- the cache ----------------------------------------------------------------------------------


class QuantizedKVCache:
    """The plain cache's interface over a key store and a value store."""

    pre_rope = False
    observes = False
    dropped = 0

    def __init__(self, k: Store, v: Store) -> None:
        self.k, self.v = k, v
        self.capacity = k.capacity

    @property
    def offset(self) -> int:
        return len(self.k)

    held = offset

    def make_room(self, n: int) -> int:
        return 0

    def update_and_fetch(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        self.k.append(k)
        self.v.append(v)
        return self.k.fetch(), self.v.fetch()

    def is_trimmable(self) -> bool:
        return True

    def exact(self, n: int) -> bool:
        return self.k.exact(n) and self.v.exact(n)

    def trim(self, n: int) -> int:
        self.v.truncate(n)
        return self.k.truncate(n)

    @property
    def nbytes(self) -> int:
        return self.k.nbytes + self.v.nbytes

    @property
    def residual_bytes(self) -> int:
        return self.k.residual_bytes + self.v.residual_bytes

    def bytes_per_token(self) -> float:
        return self.k.bytes_per_token() + self.v.bytes_per_token()

    @property
    def state(self) -> tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, ...]]:
        return self.k.state, self.v.state

    @state.setter
    def state(self, stored: tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, ...]] | None) -> None:
        if stored is None:
            self.k.truncate(len(self.k))
            self.v.truncate(len(self.v))
            return
        self.k.state, self.v.state = stored
