"""Pieces every architecture shares: hyperparameters from GGUF metadata, RMSNorm, RoPE, attention
over the caller's caches (GQA, causal and sliding-window masks, rows at different offsets), and
streaming GGUF tensors into a module built on the meta device.

Shapes: B rows, T new tokens, H query heads, KV key/value heads, hd head size, L cached keys.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, fields
from functools import partial
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from localllm.backends.torch.cache import BLOCK, Pages
from localllm.backends.torch.kvquant import Kivi, Plain, stored
from localllm.backends.torch.weights import Coded
from localllm.errors import InconsistentModel
from localllm.gguf_file import GGUFFile

# `linear(weight (out, in), bias | None) -> nn.Module`: builds a projection from loaded weights.
# A factory with `coded = (suffixes of module names)` takes those projections' quantized matrices
# as `weights.Coded` (the file's codes and groups, as stored) where the file has them.
LinearFactory = Callable[[torch.Tensor, "torch.Tensor | None"], nn.Module]

# llama.cpp's tensor names → ours. Projections that run on the same input are fused into one
# matmul (fewer kernel launches per layer at decode): parts are concatenated along `out`.
FUSED = {
    "attn_q": ("attention.wqkv", 0),
    "attn_k": ("attention.wqkv", 1),
    "attn_v": ("attention.wqkv", 2),
    "attn_output": ("attention.wo", 0),
    "ffn_gate": ("feed_forward.w13", 0),
    "ffn_up": ("feed_forward.w13", 1),
    "ffn_down": ("feed_forward.w2", 0),
}
PLAIN = {
    "attn_norm": "attention_norm",
    "ffn_norm": "ffn_norm",
    "attn_q_norm": "attention.q_norm",
    "attn_k_norm": "attention.k_norm",
    "post_attention_norm": "post_attention_norm",
    "post_ffw_norm": "post_ffw_norm",
}


# -- hyperparameters --------------------------------------------------------------------------


@dataclass
class BaseModelArgs:
    """Hyperparameters every family has. `from_gguf` reads `{arch}.*` keys and ignores the rest."""

    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    ffn_dim: int
    vocab_size: int
    context_length: int = 0
    norm_eps: float = 1e-5
    rope_base: float = 10000.0
    rope_scale: float = 1.0  # linear RoPE scaling: positions are multiplied by this

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> BaseModelArgs:
        names = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in names})

    @classmethod
    def from_gguf(cls, metadata: dict[str, Any]) -> BaseModelArgs:
        """Raises ValueError (one line) when a required key is missing or a value is unusable."""
        return cls.from_dict(gguf_hparams(metadata))


def gguf_hparams(metadata: dict[str, Any]) -> dict[str, Any]:
    """The `{arch}.*` keys of a GGUF, under `BaseModelArgs`' names (plus gemma's extras)."""
    arch = metadata.get("general.architecture")
    if not isinstance(arch, str):
        raise ValueError("general.architecture is missing")

    def get(key: str, default: Any = None, *, required: bool = False) -> Any:
        value = metadata.get(f"{arch}.{key}", default)
        if value is None and required:
            raise ValueError(f"{arch}.{key} is missing")
        return value

    def count(key: str, default: Any = None) -> int:
        value = get(key, default, required=True)
        if isinstance(value, Sequence) and not isinstance(value, str):  # one value per layer
            values = set(value)
            if len(values) != 1:
                raise ValueError(f"{arch}.{key} differs between layers, which is not supported")
            value = values.pop()
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            raise ValueError(f"{arch}.{key} = {value!r} is not a positive integer")
        return value

    dim, n_heads = count("embedding_length"), count("attention.head_count")
    head_dim = count("attention.key_length", dim // n_heads)
    if count("attention.value_length", head_dim) != head_dim:
        raise ValueError(f"{arch}: key and value heads of different sizes are not supported")
    if get("rope.dimension_count", head_dim) != head_dim:
        raise ValueError(f"{arch}: RoPE on part of each head is not supported")
    vocab = get("vocab_size") or len(metadata.get("tokenizer.ggml.tokens") or ())
    if not vocab:
        raise ValueError(f"{arch}.vocab_size and tokenizer.ggml.tokens are missing")
    scaling = get("rope.scaling.type", "none")
    if scaling not in ("none", "linear"):
        raise ValueError(f"{arch}: RoPE scaling {scaling!r} is not supported (none, linear)")
    factor = float(get("rope.scaling.factor", 1.0) or 1.0) if scaling == "linear" else 1.0
    return {
        "dim": dim,
        "n_layers": count("block_count"),
        "n_heads": n_heads,
        "n_kv_heads": count("attention.head_count_kv", n_heads),
        "head_dim": head_dim,
        "ffn_dim": count("feed_forward_length"),
        "vocab_size": int(vocab),
        "context_length": int(get("context_length", 0)),
        "norm_eps": float(get("attention.layer_norm_rms_epsilon", 1e-5)),
        "rope_base": float(get("rope.freq_base", 10000.0)),
        "rope_scale": 1.0 / factor,
        "sliding_window": int(get("attention.sliding_window", 0) or 0),
        "sliding_window_pattern": get("attention.sliding_window_pattern"),
        "rope_base_local": float(get("rope.freq_base_swa", 10000.0)),
        "final_logit_softcap": float(get("final_logit_softcapping", 0.0) or 0.0),
    }


# -- layers -----------------------------------------------------------------------------------


class RMSNorm(nn.Module):
    """x / rms(x) * w, computed in float32. Gemma's (1 + w) is already folded into w by llama.cpp's
    converter, so one norm serves every family."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(dim), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # one fused op (bit-identical to x * rsqrt(mean(x²) + eps) * w here, and fewer launches)
        if x.dtype == torch.float32:  # the common case: no casts to dispatch
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        return F.rms_norm(x.float(), self.weight.shape, self.weight, self.eps).to(x.dtype)


def projection(in_features: int, *parts: int) -> nn.Linear:
    """A placeholder linear (on whatever device is current: meta while building) whose output
    concatenates `parts` (e.g. q, k, v sizes); the loader replaces it with the real one."""
    m = nn.Linear(in_features, sum(parts), bias=False)
    m.parts = parts  # type: ignore[assignment]
    return m


def embedding(vocab: int, dim: int) -> nn.Embedding:
    """A placeholder token embedding for the loader to fill: given its (empty) weight,
    nn.Embedding skips the random init, whose meta-device path imports torch._dynamo (≈1.4 s)."""
    return nn.Embedding(vocab, dim, _weight=torch.empty(vocab, dim), _freeze=True)


def working(emb: nn.Module) -> torch.Tensor:
    """Something with the model's working dtype and device: the embedding's table, or for a
    table kept in blocks (`quantized.BlockEmbedding`) an empty tensor of its output dtype."""
    weight = getattr(emb, "weight", None)
    if isinstance(weight, torch.Tensor):
        return weight
    return torch.empty(0, dtype=emb.dtype, device=emb.device)


class RoPE:
    """Rotary embedding in the half-split ("NEOX") layout: dims i and i + n/2 form a pair.

    inv_freq[i] = scale / (base^(2i/hd) * factor[i]), as ggml's rope computes it: `scale` is linear
    scaling; `factors` is llama.cpp's `rope_freqs.weight` (Llama 3's per-frequency scaling, which
    llama.cpp's converter stores as a tensor instead of metadata).
    """

    def __init__(self, head_dim: int, base: float, *, scale: float = 1.0,
                 factors: torch.Tensor | None = None, device: torch.device | str = "cpu") -> None:  # fmt: skip
        exponent = torch.arange(0, head_dim, 2, dtype=torch.int64, device=device).float() / head_dim
        inv_freq = 1.0 / (base**exponent)
        if factors is not None:
            inv_freq = inv_freq / factors.to(device=device, dtype=torch.float32)
        self.inv_freq = inv_freq * scale  # (hd/2,)
        self._table: tuple[int, torch.dtype, tuple[torch.Tensor, torch.Tensor]] | None = None

    def __call__(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
        """positions (B, T) → cos, signed sin (B, T, 1, hd), broadcasting over heads.

        The sin's first half is negated, so `apply_rope` needs one roll instead of the usual
        rotate_half (two slices, a negation and a concatenation per call)."""
        self.inv_freq = self.inv_freq.to(positions.device)  # no-op after the first call
        freqs = positions[:, :, None, None].float() * self.inv_freq  # (B, T, 1, hd/2)
        cos, sin = freqs.cos(), freqs.sin()
        return torch.cat((cos, cos), -1).to(dtype), torch.cat((-sin, sin), -1).to(dtype)


    def table(self, n: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, signed sin for positions 0..n-1 as (1, 1, n, hd), for keys laid out (1, KV, n, hd)
        (a cache that rotates keys at use). Kept for the last n: every layer of a step asks."""
        if self._table is None or self._table[:2] != (n, dtype):
            pos = torch.arange(n, device=self.inv_freq.device)[None]
            cos, sin = self(pos, dtype)
            self._table = (n, dtype, (cos.transpose(1, 2), sin.transpose(1, 2)))
        return self._table[2]


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x (B, T, heads, hd) with pairs (i, i + hd/2): x * cos + rotate_half(x) * sin, where
    rotate_half(x) = (-x2, x1) = roll(x, hd/2) * (-1, 1) (the sign is in `sin`). Queries and
    keys may go through together (one call on the q|k heads of the fused projection)."""
    return torch.addcmul(x * cos, x.roll(x.shape[-1] // 2, -1), sin)


# -- attention over the caller's caches -------------------------------------------------------


class Tree:
    """One row's T new tokens as a tree (a speculative draft tree, verified in one pass): token
    j > 0 follows token parents[j] < j, token 0 the row's cache. Token j sits at place
    offset + j of the cache but at position offset + depth[j] (RoPE, windows), and attends to
    the cache and to its own ancestors (and itself) among the new tokens only."""

    def __init__(self, parents: Sequence[int]) -> None:
        t = len(parents)
        if not t or parents[0] != -1 or any(not 0 <= parents[j] < j for j in range(1, t)):
            raise ValueError("a tree's first token follows the cache and every other one an "
                             "earlier token of it")  # fmt: skip
        self.parents = list(parents)
        self.depth = [0] * t
        seen = torch.eye(t, dtype=torch.bool)
        for j in range(1, t):
            self.depth[j] = self.depth[parents[j]] + 1
            seen[j] |= seen[parents[j]]
        self.seen = seen  # (T, T): token j sees token a

    def order(self, offset: int, first: int, n: int, device: torch.device) -> torch.Tensor:
        """For each token, the order its n keys are read in (T, n), as indices into keys that
        begin at place `first` (the new tokens at `offset` ..): its ancestors, then
        itself, right after the cache's keys — where a chain of its path would hold them —
        and the other new keys after those (hidden). Read so, each token's attention is
        bit for bit a chain's (`_RowsPlan`)."""
        t, at = len(self.depth), offset - first
        rows = []
        for j in range(t):
            up = self.seen[j].nonzero().flatten().tolist()  # ascending: by depth along the path
            rest = [a for a in range(t) if not self.seen[j, a]]
            rows.append([*range(at), *(at + a for a in up + rest), *range(at + t, n)])
        return torch.tensor(rows, device=device)


class Masks:
    """The attention masks of one forward pass, built on first use and shared by every layer
    with the same window. Row b's queries sit at starts[b] + arange(T); the L keys its cache
    returns are the last L positions up to its newest token. A `tree` (one row): its tokens
    see their ancestors only (`Tree`)."""

    def __init__(self, starts: Sequence[int], n_new: int, device: torch.device,
                 tree: Tree | None = None) -> None:  # fmt: skip
        self.starts, self.n_new, self.device, self.tree = starts, n_new, device, tree
        self._memo: dict[tuple[int, int, int], tuple[torch.Tensor | None, bool]] = {}
        self.memo: dict[tuple, _RowsPlan] = {}  # `_attend_rows`' plans, one per rows and window

    def get(self, row: int, n_keys: int, window: int) -> tuple[torch.Tensor | None, bool]:
        """(attn_mask (T, L) or None, is_causal) for row `row` attending to `n_keys` keys;
        window 0: none. True in the mask means "may attend"."""
        key = (self.starts[row], n_keys, window)
        if key not in self._memo:
            self._memo[key] = self._build(self.starts[row], n_keys, window)
        return self._memo[key]

    def _build(self, start: int, n_keys: int, window: int) -> tuple[torch.Tensor | None, bool]:
        t = self.n_new
        if self.tree is not None:
            raise ValueError("a tree is verified over one row of a plain pool")
        if not window or n_keys <= window:
            if t == 1:
                return None, False  # one query sees every key
            if n_keys == t:
                return None, True  # no past keys: plain top-left causal
        q_pos = start + torch.arange(t, device=self.device)[:, None]  # (T, 1)
        k_pos = start + t - n_keys + torch.arange(n_keys, device=self.device)  # (L,)
        diff = q_pos - k_pos  # (T, L)
        mask = diff >= 0
        if window:
            mask &= diff < window  # llama.cpp and HF: key k is visible from q when q - k < window
        return mask, False


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, caches: Sequence[Any],
           masks: Masks | Step, *, window: int = 0, scale: float | None = None,
           k_raw: torch.Tensor | None = None) -> torch.Tensor:  # fmt: skip
    """Append the new k, v (B, T, KV, hd) to each row's cache and attend from q (B, T, H, hd).

    Returns (B, T, H * hd), ready for the output projection. Inputs may be strided views of the
    fused qkv projection: the cache copies k and v into its buffers. GQA repeats no key or value
    (`_sdpa` folds the query heads of a KV head together). A decode step of slots that
    share `cache.Rows`, or a piece of a few tokens (T ≤ `QUERIES_AS_ROWS`: a speculative
    verification), attends through `_attend_rows`, one row or many alike, query by query, so that
    a token gets the same bits whatever other rows step with it and however many tokens of its
    own go through with it (greedy text does not depend on batching or speculation); other rows attend one by one over their
    own caches (padding them to one length would copy every row's keys each layer). A cache
    stored in another type than q (f16 under f32 compute) is read in place, q cast to its type.

    A cache with `pre_rope` gets `k_raw` (the keys before RoPE) and rotates what it returns
    itself; one that `observes` (H2O) gets this step's attention probabilities, which only it
    makes attention compute outside the fused kernel.
    """
    if isinstance(masks, Step):  # planned beforehand: caches is this layer's (keys, values) pool
        k_parts, v_parts = caches[0]
        plan = masks.plans[window]  # with cos, sin: keys stored before RoPE (StreamingLLM)
        return rows_attention(q, rows_keys(k, k_raw, plan), v, k_parts, v_parts, *plan[:6], scale=scale)
    outs: list[torch.Tensor | None] = [None] * len(caches)
    if q.shape[1] <= QUERIES_AS_ROWS:
        for group in _row_groups(caches):
            kin = k_raw if k_raw is not None and caches[group[0]].pre_rope else k
            if len(group) == len(caches):  # the common case: every row, in order
                return _attend_rows(q, kin, v, caches, window=window, scale=scale, memo=masks.memo,
                                    tree=masks.tree)  # fmt: skip
            at = torch.tensor(group, device=q.device)
            out = _attend_rows(q[at], kin[at], v[at], [caches[i] for i in group], window=window,
                               scale=scale, memo=masks.memo)  # fmt: skip
            for j, i in enumerate(group):
                outs[i] = out[j : j + 1]
    for b, cache in enumerate(caches):
        if outs[b] is not None:
            continue
        kin = k_raw if k_raw is not None and cache.pre_rope else k
        if len(caches) > 1:
            qb, kb, vb = q[b : b + 1], kin[b : b + 1], v[b : b + 1]
        else:
            qb, kb, vb = q, kin, v
        kk, vv = cache.update_and_fetch(kb.transpose(1, 2), vb.transpose(1, 2))  # (1, KV, L, hd)
        mask, causal = masks.get(b, kk.shape[2], window)
        if cache.observes:
            if kk.dtype != q.dtype:
                kk, vv = kk.to(q.dtype), vv.to(q.dtype)
            out = _attend_observed(qb.transpose(1, 2), kk, vv, mask, causal, scale, cache)
        else:  # casting the keys and values up instead copied the whole cache in every layer
            out = _sdpa(qb.transpose(1, 2).to(kk.dtype), kk, vv, mask, causal, scale).to(q.dtype)
        outs[b] = out.transpose(1, 2).reshape(1, out.shape[2], -1)  # (1, T, H * hd)
    return outs[0] if len(outs) == 1 else torch.cat(outs)  # type: ignore[arg-type,return-value]


def _sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
          causal: bool, scale: float | None) -> torch.Tensor:  # fmt: skip
    """SDPA of q (1, H, T, hd) over k, v (1, KV, L, hd). Under a mask, GQA is folded into the
    queries — the G query heads of a KV head as G·T rows of one, (1, KV, G·T, hd), the mask
    repeated — rather than SDPA's `enable_gqa`, which repeats the keys and values for its math
    kernel. The same bits, and on the CPU with f16 keys (the default cache) 1.45-1.55x faster
    alone: 256 queries over 1,024 keys 12.1 → 8.3 ms, over 2,048 24.7 → 15.9, 64 over 2,048
    8.5 → 5.7 (SmolLM2's 9 heads on 3, 2 threads; f32 keys within ±10% either way). A 2,000-token
    prompt in the CPU default: SmolLM2 8.18 → 8.07 s, Gemma 3 270M (4 heads on 1) 4.64 → 4.13 s."""
    h, kv = q.shape[1], k.shape[1]
    if mask is None or h == kv:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal,
                                              scale=scale, enable_gqa=h != kv)  # fmt: skip
    _, _, t, hd = q.shape
    folded = q.reshape(1, kv, (h // kv) * t, hd)
    out = F.scaled_dot_product_attention(folded, k, v, attn_mask=mask.repeat(h // kv, 1), scale=scale)
    return out.reshape(1, h, t, v.shape[-1])


def _row_groups(caches: Sequence[Any]) -> list[list[int]]:
    """Indices of the caches that are slots of one `cache.Rows`, grouped by it and by whether
    their keys are stored before RoPE (`policies.PagedStreaming`).

    Not KIVI's (`Rows.grouped`): eagerly, a row of those attends alone, SDPA over what its slot
    reads (`Rows.read`, the bits `kvquant.Store` fetches), since decoding its codes gives float32
    keys, over which SDPA is faster than the rows' blocks (SmolLM2, 2,000 tokens of context,
    the CPU default: 24.2 against 28.0 ms a step at 1 slot, 70.3 against 114.8 at 4:
    bench/kv_pool.py). The compiled step reads them as rows (16.1 and 55.5 ms)."""
    groups: dict[tuple[int, bool], list[int]] = {}
    for i, c in enumerate(caches):
        rows = getattr(c, "rows", None)
        if rows is not None and not rows.grouped:
            groups.setdefault((id(rows), c.pre_rope), []).append(i)
    return list(groups.values())


# Keys per block of `_attend_rows`: every row's keys are cut into blocks of this size from its
# first position, whatever the lengths of the rows beside it.
ROW_BLOCK = BLOCK  # the paged pool's blocks (`cache.Rows`)


# A piece of at most this many tokens (a speculative verification: k + 1) attends as that many
# decode steps would, query by query, so that its tokens get the bits plain decoding gives them
QUERIES_AS_ROWS = 16

# Ring blocks an entry of a KIVI pool reads (`_RowsPlan._grouped`): the blocks not yet coded
RING_READS = Pages.RING - 1


class _RowsPlan:
    """What every layer of one step shares in `_attend_rows` for the same rows and window: where
    the new keys go, the key blocks' count, and the mask as an additive bias (0 or -inf).

    A compiled step (`compiled.CompiledStep`) pads its entries to `rows` (a batch bucket: a
    padding entry writes its key into the pages' `spare` block and reads the zero block) and
    reads at least `blocks` blocks (a dynamic size is never 1: torch specializes 0 and 1)."""

    def __init__(self, pages: Any, slots: list[int], offsets: Sequence[int], t: int, window: int,
                 device: torch.device, *, rows: int = 0, blocks: int = 1,
                 streams: tuple[Sequence[tuple[int, int] | None], Any] | None = None,
                 tree: Tree | None = None) -> None:  # fmt: skip
        self.rot: tuple[torch.Tensor, torch.Tensor] | None = None
        self.raw: torch.Tensor | None = None
        self.order: torch.Tensor | None = None  # a tree (one row): each entry's order of keys
        if streams is not None:
            self._streams(pages, slots, offsets, t, device, *streams, rows=rows, blocks=blocks)
            return
        if pages.residual:
            self._grouped(pages, slots, offsets, t, window, device, rows=rows, blocks=blocks)
            return
        entries = [s for s in slots for _ in range(t)]  # T queries of a row: T entries
        positions = [o + j for o in offsets for j in range(t)]
        self.n = max(offsets) + t
        # a window's keys start at its earliest query's first visible block (the blocks before
        # it are hidden from every entry: leaving them out changes no bit, `_attend_rows`)
        lo = max(0, min(positions) - window + 1) // ROW_BLOCK if window else 0
        self.nb = max(blocks, -(-self.n // ROW_BLOCK) - lo)
        # where each entry's new key goes: (block, place in it) through the slot's table
        where = [(pages.tables[s][p // ROW_BLOCK], p % ROW_BLOCK) for s, p in zip(entries, positions)]
        self.single = where[0] if len(where) == 1 else None  # a plain copy for one row, one token
        pad = max(0, rows - len(entries))
        if pad:
            where += [(pages.spare(), 0)] * pad
            positions += [lo * ROW_BLOCK] * pad  # sees one key (the zero block's): no NaN
        self.block = torch.tensor([w[0] for w in where], device=device)
        self.place = torch.tensor([w[1] for w in where], device=device)
        # what each entry reads: its row's blocks lo .. lo + nb - 1 (zero blocks past its table)
        gather = pages.index(entries, lo, lo + self.nb) + [0] * (pad * self.nb)
        self.gather = torch.tensor(gather, device=device).view(len(where), self.nb)
        key = torch.arange(lo * ROW_BLOCK, (lo + self.nb) * ROW_BLOCK, device=device)
        key = key.view(self.nb, 1, 1, ROW_BLOCK)
        if tree is not None:  # entry j reads its keys as its path's chain would, at its depth
            self.order = tree.order(offsets[0], lo * ROW_BLOCK, self.nb * ROW_BLOCK, device)
            positions = [offsets[0] + d for d in tree.depth]
        length = torch.tensor(positions, device=device).add_(1).view(-1, 1, 1, 1, 1)
        hidden = key >= length  # (E, nb, 1, 1, ROW_BLOCK)
        if window:
            hidden = hidden | (key < length - window)  # visible when q - k < window
        self.bias = torch.zeros(hidden.shape, device=device).masked_fill_(hidden, float("-inf"))

    def _grouped(self, pages: Any, slots: list[int], offsets: Sequence[int], t: int, window: int,
                 device: torch.device, *, rows: int = 0, blocks: int = 1) -> None:  # fmt: skip
        """The plan of rows in a KIVI pool (`cache.Rows` with a residual): an entry reads its
        row's coded blocks (the pool's, `gather`'s first columns, the zero block past them),
        then `RING_READS` blocks from the first one not coded (the ring's, its last columns:
        the residual spans at most that many); the new keys go into the ring. Every entry of a
        row reads the blocks coded at the row's end, as the per-sequence store does after it
        appends them all (`kvquant.Store`). Padding entries write into the ring's spare block
        and see the zero block's first key."""
        b, nr = ROW_BLOCK, RING_READS
        self.n = max(offsets) + t
        codes, ring, keys, where, qpos = [], [], [], [], []
        for s, o in zip(slots, offsets):
            c = pages.coded(o + t)
            for p in range(o, o + t):
                lo = max(0, p - window + 1) // b if window else 0
                codes.append((s, list(range(lo, c))))
                ring.append([pages.ring(s, j) if j * b <= p else 0 for j in range(c, c + nr)])
                keys.append((lo, c))
                where.append((pages.ring(s, p // b), p % b))
                qpos.append(p)
        nbc = max(blocks, max(len(js) for _, js in codes))  # coded columns (never 1 compiled)
        self.nb = nbc + nr
        self.single = where[0] if len(where) == 1 else None
        e = max(rows, len(where))
        where += [(pages.ring_spare, 0)] * (e - len(where))
        self.block = torch.tensor([w[0] for w in where], device=device)
        self.place = torch.tensor([w[1] for w in where], device=device)
        gather, blocks_of = [], []  # per entry: each column's block, and its index in the row
        for (s, js), (lo, c), rs in zip(codes, keys, ring):
            pad = [0] * (nbc - len(js))
            gather.append(pages.tables[s][lo:c] + pad + rs)
            blocks_of.append(js + [-1] * len(pad) + list(range(c, c + nr)))
        gather += [[0] * self.nb] * (e - len(gather))
        blocks_of += [[-1] * self.nb] * (e - len(blocks_of))
        ix = torch.tensor(blocks_of).view(e, self.nb, 1)
        key = torch.where(ix < 0, -1, ix * b + torch.arange(b))  # each column's positions, -1: none
        at = torch.tensor(qpos + [0] * (e - len(qpos))).view(e, 1, 1)
        hidden = (key < 0) | (key > at)
        if window:
            hidden |= key <= at - window  # visible when q - k < window
        hidden[len(qpos) :] = True
        hidden[len(qpos) :, 0, 0] = False  # padding: the zero block's first key
        self.gather = torch.tensor(gather, device=device)
        self.bias = torch.zeros(e, self.nb, 1, 1, b).masked_fill_(
            hidden.view(e, self.nb, 1, 1, b), float("-inf")).to(device)  # fmt: skip

    def _streams(self, pages: Any, slots: list[int], ats: Sequence[int], t: int,
                 device: torch.device, windows: Sequence[tuple[int, int] | None], rope: Any, *,
                 rows: int = 0, blocks: int = 1) -> None:  # fmt: skip
        """The plan of StreamingLLM rows (`policies.PagedStreaming`): `ats` are their places in
        their tables, `windows` their (sinks, gap). A row reads its sink blocks and its window's
        (not the blocks of the gap between, dropped or not), every entry its keys up to itself
        but those of the gap; each key is rotated at its position inside the cache (its place,
        less the gap after the sinks), the queries already are (at `offset`). Padding entries
        (`rows`) write into the spare block and see the zero block's first key.

        A window of None is a plain row beside them (a compiled step of both kinds): its keys
        are stored rotated, so it reads them through cos 1 and sin 0 (the same bits), and
        `raw` (E,) then says which entries store the keys before RoPE (`rows_keys`)."""
        b = ROW_BLOCK
        plain = [w is None for w in windows]
        windows = [w or (0, 0) for w in windows]
        lists = []
        for a, (sinks, gap) in zip(ats, windows):
            end = -(-(a + t) // b)
            if gap:
                first = -(-sinks // b)
                lists.append(list(range(first)) + list(range(max(first, (sinks + gap) // b), end)))
            else:
                lists.append(list(range(end)))
        self.nb = nb = max(blocks, max(map(len, lists)))
        self.n = max(ats) + t
        idx, qpos, lo, hi, where, tables = [], [], [], [], [], []
        for s, a, (sinks, gap), row in zip(slots, ats, windows, lists):
            table = pages.tables[s]
            for j in range(t):
                p = a + j
                idx.append(row + [-1] * (nb - len(row)))
                qpos.append(p)
                lo.append(sinks)
                hi.append(sinks + gap)
                where.append((table[p // b], p % b))
                tables.append(table)
        self.single = where[0] if len(where) == 1 else None
        for _ in range(max(0, rows - len(where))):  # padding: sees position 0 of the zero block
            idx.append([0] + [-1] * (nb - 1))
            qpos.append(0)
            lo.append(0)
            hi.append(0)
            where.append((pages.spare(), 0))
            tables.append([0])
        self.block = torch.tensor([w[0] for w in where], device=device)
        self.place = torch.tensor([w[1] for w in where], device=device)
        ix = torch.tensor(idx, device=device)  # (E, nb) indices into the tables, -1: none
        self.gather = torch.tensor([[tb[i] if i >= 0 else 0 for i in row] for tb, row in zip(tables, idx)],
                                   device=device)  # fmt: skip
        key = ix[..., None] * b + torch.arange(b, device=device)  # (E, nb, BLOCK) places
        e = len(where)
        q_at = torch.tensor(qpos, device=device).view(e, 1, 1)
        s_lo = torch.tensor(lo, device=device).view(e, 1, 1)
        s_hi = torch.tensor(hi, device=device).view(e, 1, 1)
        hidden = (ix[..., None] < 0) | (key > q_at) | ((key >= s_lo) & (key < s_hi))
        self.bias = torch.zeros(e, nb, 1, 1, b, device=device).masked_fill_(
            hidden.view(e, nb, 1, 1, b), float("-inf"))  # fmt: skip
        inside = torch.where(key >= s_hi, key - (s_hi - s_lo), key).clamp_(min=0)
        cos, sin = rope(inside.view(e, nb * b), torch.float32)  # (E, nb·BLOCK, 1, hd)
        if any(plain):
            flat = [not f for f in plain for _ in range(t)]
            self.raw = torch.tensor(flat + [False] * (e - len(flat)), device=device)
            kept = ~self.raw  # plain rows' and padding entries: turned by nothing
            cos[kept], sin[kept] = 1.0, 0.0
        self.rot = tuple(x.view(e, nb, b, 1, -1).transpose(2, 3) for x in (cos, sin))  # type: ignore[assignment]

    @property
    def tensors(self) -> tuple[torch.Tensor, ...]:
        """What `rows_attention` takes: block, place, gather, bias (and cos, sin: `_streams`);
        then `raw` where StreamingLLM and plain rows step together (`rows_keys`)."""
        raw = () if self.raw is None else (self.raw,)
        return (self.block, self.place, self.gather, self.bias, *(self.rot or ()), *raw)


def rows_keys(k: torch.Tensor, k_raw: torch.Tensor | None, plan: Sequence[torch.Tensor]) -> torch.Tensor:
    """The keys (B, T, KV, hd) a planned step stores (`Step`): rotated ones (`k`) for plain
    rows, the keys before RoPE (`k_raw`) for StreamingLLM rows (a plan with cos and sin), entry
    by entry where the plan has both kinds (its `raw`, (B·T,))."""
    if k_raw is None or len(plan) <= 4:
        return k
    if len(plan) == 6:
        return k_raw
    b, t = k.shape[:2]
    return torch.where(plan[6].view(b, t, 1, 1), k_raw, k)


class Step:
    """A forward pass planned beforehand (the compiled step, `compiled.CompiledStep`): the new
    tokens' positions (B, T) and, for each window (0: none), its rows plan's tensors
    (`_RowsPlan.tensors`). It stands in for `Masks`, and each layer's `caches` is then its pool's
    (keys, values): `attend` writes the new keys there and reads through the plan, with no
    Python number that changes from step to step."""

    def __init__(self, positions: torch.Tensor, plans: dict[int, tuple[torch.Tensor, ...]]) -> None:
        self.positions, self.plans = positions, plans


def step_inputs(caches: Sequence[Sequence[Any]], live: Sequence[int], n_new: int,
                device: torch.device, step: Step | None = None,
                tree: Tree | None = None) -> tuple[torch.Tensor, Masks | Step]:  # fmt: skip
    """(positions (B, T), masks) of a forward pass over the rows' caches of layers `live`; with
    a `step`, what it planned; with a `tree` (one row), its tokens at their depths."""
    if step is not None:
        return step.positions, step
    pos = positions([[row[i] for i in live] for row in caches], n_new, device)
    if tree is not None:
        if pos.shape != (1, len(tree.depth)):
            raise ValueError("a tree is one row's tokens")
        pos = pos[:, :1] + torch.tensor(tree.depth, device=device)
    return pos, Masks([row[live[0]].offset for row in caches], n_new, device, tree)


def _attend_rows(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, caches: Sequence[Any], *,
                 window: int, scale: float | None, memo: dict | None = None,
                 tree: Tree | None = None) -> torch.Tensor:  # fmt: skip
    """One decode step of rows whose caches are slots of one shared `cache.Rows`: their new keys
    and values go in with one indexed copy each into their pages' blocks, then attention is
    written out over those blocks of `ROW_BLOCK` keys (gathered through each row's block table,
    the pool's zero block past its last one), so that each row's result is bit-identical whether it steps alone or beside
    others, however long they are (the scheduler's batches must not change what a seeded
    sequence samples). q (B, T, H, hd), k, v (B, T, KV, hd) → (B, T, H * hd): T tokens of a row
    attend as T rows of one query, each over its keys up to itself, with the bits T decode steps
    give them (measured: lookup's verification this way costs nothing visible at 1,600 tokens of
    context — 34.8 against 33.4 tokens/s, within the noise — and greedy lookup then equals plain
    greedy, where it parted at token 20 of a grounded answer before).

    SDPA over the rows padded to the longest (what this was) rounds a row differently as the
    padded length changes: its kernel splits the keys into blocks counted from the padded end
    and sums each with a tail. Here every matrix product has one shape whatever the batch
    ((G, hd) @ (hd, ROW_BLOCK) per block, G queries per KV head; then (G, ROW_BLOCK) @
    (ROW_BLOCK, hd)), on contiguous float32 copies (the layout decides BLAS's kernel too); a
    row's keys past its length hold exact zeros after the mask (-inf added, then exp), and blocks are combined by a
    running sum (`cumsum`: one fixed order, so zeros added at the end change nothing). The
    softmax uses the row's maximum over all its keys (exact, order-free). A window (Gemma's
    local layers) is part of the mask.

    Against what this was (SDPA; one row alone over its own keys), per layer at SmolLM2's shapes
    (9 query heads, 3 KV heads of 64), CPU time on 1 thread (bench: random keys, 50 calls):
    f16 keys (the default) 0.30 ms against 0.37-0.45 for one row at 200 keys, 0.7-1.1 against
    4.0-4.1 at 2,000, and 7.8-8.0 against 34-35 for eight rows at 2,000 (SDPA is slow on half
    precision on the CPU); f32 keys 0.22 against 0.07 (one row, 200 keys), 0.73 against 0.29
    (2,000) and 4.7 against 3.7 (eight rows, 2,000): there the float32 copy is the cost. Every
    layer of a step shares one `_RowsPlan` (positions, the mask as a bias): 307 → 166 µs a call
    for one row at 110 keys, SmolLM2's decode 22.7-23.4 → 20.1-20.8 ms a token (issue 33)."""
    rows, t = caches[0].rows, q.shape[1]
    slots, ats = [c.slot for c in caches], [c.at for c in caches]
    for c, a in zip(caches, ats):  # a block shared with a cached prefix is copied first
        rows.ready(c.slot, a, a + t, held=c.offset + t)
    # T queries of a row attend as T rows of one query each: entry (row, j) reads its row's keys
    # up to position offset + j. The layers of a step that share a `Pages` (every layer, or every
    # layer of one window) share a plan. Keys stored before RoPE (StreamingLLM: k is then the
    # keys before RoPE) are rotated at their positions inside the cache as they are read.
    streams = None
    if caches[0].pre_rope:
        streams = (tuple((c.n_sinks, c.gap) for c in caches), caches[0].rope)
    key = (id(rows.pages), tuple(slots), tuple(ats), t, window,
           streams and (streams[0], id(streams[1])), id(tree))  # fmt: skip
    plan = memo.get(key) if memo is not None else None
    if plan is None:
        if tree is not None and (streams is not None or rows.grouped or len(slots) != 1):
            raise ValueError("a tree is verified over one row of a plain pool")
        plan = _RowsPlan(rows.pages, slots, ats, t, window, q.device, streams=streams, tree=tree)
        if memo is not None:
            memo[key] = plan
    for c in caches:
        c.advance(t)
    if not caches[0].observes:
        return rows_attention(q, k, v, *rows.parts, *plan.tensors, scale=scale, single=plan.single,
                              order=plan.order)  # fmt: skip
    seen: list[torch.Tensor] = []  # H2O: each entry's probabilities, (E, KV, nb·ROW_BLOCK)
    out = rows_attention(q, k, v, *rows.parts, *plan.tensors, scale=scale, single=plan.single,
                         observed=seen)  # fmt: skip
    probs = seen[0].view(len(caches), t, *seen[0].shape[1:]).sum(1)  # a row's queries summed
    for i, c in enumerate(caches):
        c.observe(probs[i, :, : c.held])
    return out


def rows_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                   k_parts: Sequence[torch.Tensor], v_parts: Sequence[torch.Tensor],
                   block: torch.Tensor, place: torch.Tensor, gather: torch.Tensor,
                   bias: torch.Tensor, cos: torch.Tensor | None = None,
                   sin: torch.Tensor | None = None, *, scale: float | None,
                   single: tuple[int, int] | None = None,
                   observed: list[torch.Tensor] | None = None,
                   order: torch.Tensor | None = None) -> torch.Tensor:  # fmt: skip
    """`_attend_rows`' tensor work, with no Python number that changes between steps (what a
    compiled step captures): the new k, v (B, T, KV, hd) into the pools' (n_blocks, KV, BLOCK,
    width) parts (`cache.Rows.parts`: a float pool, or codes and their scales; KIVI's codes,
    scales, zeros and then the ring, where the new keys go and which `gather`'s last
    `RING_READS` columns index) at `block`,
    `place` (E = B·T entries), then each entry's query over its `gather` blocks (E, nb) with
    `bias` (E, nb, 1, 1, BLOCK). Codes are decoded as their blocks are gathered (one fused
    kernel when compiled), never as a copy of the pool. `cos`, `sin` (E, nb, 1, BLOCK, hd): keys
    stored before RoPE, rotated where each entry reads them. `single`: (block, place) of one
    entry, a plain copy. `observed` (H2O) gets each entry's attention probabilities on its
    keys, summed over the query heads of a KV head: (E, KV, nb·ROW_BLOCK), in the order of its
    blocks. `order` (E, nb·BLOCK): the order each entry reads its keys in (a draft tree's,
    `Tree.order`). Returns (B, T, H * hd)."""
    b0, t, h, hd = q.shape
    kv = k.shape[2]
    g, b, nb = h // kv, b0 * t, gather.shape[1]
    codecs = stored(k_parts), stored(v_parts)
    grouped = type(codecs[0]) is Kivi  # KIVI: new keys into the ring (its last part)
    for pool, c, x in zip((k_parts, v_parts), codecs, (k, v)):
        if grouped:
            pairs = [(pool[-1], x.reshape(b, kv, -1).to(pool[-1].dtype))]
        else:
            pairs = list(zip(pool, c.encode(x.reshape(b, kv, -1))))
        for part, y in pairs:
            if single is not None:
                part[single[0], :, single[1]] = y[0]
            else:
                part[block, :, place] = y

    def read(pool: Sequence[torch.Tensor], c: Any, idx: torch.Tensor) -> torch.Tensor:
        n, at = idx.shape[1], idx.reshape(-1)
        return c.decode([p.index_select(0, at).view(b, n, kv, p.shape[2], -1) for p in pool], torch.float32)

    # each entry's blocks as contiguous float32, (E, nb, KV, ROW_BLOCK, hd)
    if grouped:  # the coded blocks, then the ring's
        coded, ring = gather[:, :-RING_READS], gather[:, -RING_READS:]
        kk, vv = (torch.cat([read(pool[:-1], c, coded), read(pool[-1:], Plain(pool[-1].dtype), ring)], 1)
                  for pool, c in zip((k_parts, v_parts), codecs))  # fmt: skip
    else:
        kk, vv = (read(pool, c, gather) for pool, c in zip((k_parts, v_parts), codecs))
    if cos is not None and sin is not None:
        kk = apply_rope(kk, cos, sin)
    if order is not None:  # (E, nb, KV, BLOCK, hd) read in each entry's order, as contiguous
        at = order.view(b, 1, -1, 1)
        kk, vv = (torch.gather(x.transpose(1, 2).reshape(b, kv, nb * x.shape[3], -1), 2,
                               at.expand(-1, kv, -1, x.shape[-1]))
                  .view(b, kv, nb, x.shape[3], -1).transpose(1, 2).contiguous() for x in (kk, vv))  # fmt: skip
    qs = q.reshape(b, 1, kv, g, hd).float() * (scale if scale is not None else hd**-0.5)
    s = torch.matmul(qs.expand(b, nb, kv, g, hd).contiguous(), kk.transpose(-1, -2))
    s = s + bias  # (E, nb, KV, G, ROW_BLOCK), -inf where a key is hidden
    p = (s - s.amax(dim=(1, 4), keepdim=True)).exp()
    total = p.sum(-1).cumsum(1)[:, -1]  # (E, KV, G)
    out = torch.matmul(p, vv).cumsum(1)[:, -1]  # (E, KV, G, hd)
    out = out / total[..., None]
    if observed is not None:  # (E, nb, KV, G, BLOCK) → (E, KV, nb·BLOCK)
        share = (p / total[:, None, :, :, None]).sum(3)
        observed.append(share.transpose(1, 2).reshape(b, kv, -1))
    return out.to(q.dtype).reshape(b0, t, -1)


def _attend_observed(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
                     causal: bool, scale: float | None, cache: Any) -> torch.Tensor:  # fmt: skip
    """Attention written out, for a cache that observes it: q (1, H, T, hd), k, v (1, KV, L, hd)
    → (1, H, T, hd); the cache gets the probabilities summed over its KV heads' queries, (KV, L)."""
    _, h, t, hd = q.shape
    kv, n = k.shape[1], k.shape[2]
    qg = q.reshape(1, kv, h // kv, t, hd)
    scores = qg @ k[:, :, None].transpose(-1, -2) * (scale if scale is not None else hd**-0.5)
    if causal and mask is None:
        mask = torch.ones(t, n, dtype=torch.bool, device=q.device).tril(n - t)
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    probs = scores.float().softmax(-1)
    cache.observe(probs.sum((0, 2, 3)))
    return (probs.to(v.dtype) @ v[:, :, None]).reshape(1, h, t, hd)


def positions(caches: Sequence[Sequence[Any]], n_new: int, device: torch.device) -> torch.Tensor:
    """(B, T) positions of the new tokens: each row continues from its cache's offset, once
    every cache has made room for them (an evicting cache forgets tokens here)."""
    for row in caches:
        for c in row:
            c.make_room(n_new)
    starts = [row[0].offset for row in caches]
    if len(starts) == 1:
        return torch.arange(starts[0], starts[0] + n_new, device=device)[None]
    return torch.tensor(starts, device=device)[:, None] + torch.arange(n_new, device=device)


# -- loading ----------------------------------------------------------------------------------


def default_linear(weight: torch.Tensor, bias: torch.Tensor | None, *,
                   column_major: bool = True) -> nn.Module:  # fmt: skip
    """A plain nn.Linear around the loaded tensors.

    A float32 matrix on the CPU with more outputs than inputs is stored column-major (a
    transposed view of an (in, out) copy): for one row, MKL multiplies that layout up to twice as
    fast (SmolLM2's gate|up 360 µs against 612, q|k|v 149 against 207, the tied head 5.2 ms against
    9.7: bench/torch_engine.py's `column_major` floor), at any row count within 15% of the
    other. Same module, same numbers to float32 rounding; `column_major=False` keeps the tensor
    as given (the tied head shares the embedding's memory).
    """
    if (column_major and weight.device.type == "cpu" and weight.dtype == torch.float32
            and weight.shape[0] > weight.shape[1]):  # fmt: skip
        weight = weight.t().contiguous().t()
    m = nn.Linear(weight.shape[1], weight.shape[0], bias=bias is not None, device="meta")
    m.weight = nn.Parameter(weight, requires_grad=False)
    if bias is not None:
        m.bias = nn.Parameter(bias, requires_grad=False)
    return m


def device_linear(device: torch.device, dtype: torch.dtype) -> Callable[..., nn.Module]:
    """What a GPU's int4 precision passes to build_model(linear=...): every quantized matrix of
    the file moves to `device` as its codes (1 byte a weight on the way, never a bf16 copy) and
    stays coded there: 4-bit ones as `Int4Linear` (tinygemm's kernel) where the kernel is there
    and takes them, the rest (Q8_0, Q6_K, Q5_*; 4-bit ones the kernel does not take) as
    `Int8Linear`. Float matrices (F16, BF16, F32) come as plain Linears in `dtype`. All
    projections, attention's and a tied head's too: on a GPU the activations are bf16 anyway, so
    the kernels' roundings add nothing."""
    from localllm.backends.torch import quantized

    def linear(weight: torch.Tensor | Coded, bias: torch.Tensor | None = None) -> nn.Module:
        if isinstance(weight, Coded):
            weight = weight.map(lambda t: t.to(device))
            if quantized.int4_available(device.type) and quantized.Int4Linear.fits(weight):
                return quantized.Int4Linear(weight, bias)
            return quantized.Int8Linear(weight, bias)
        return default_linear(weight, bias)

    linear.coded = ("",)  # type: ignore[attr-defined]  # every projection's name ends so
    return linear


class RowsApart(nn.Module):
    """A projection whose kernel rounds a row differently with the number of rows beside it,
    made to evaluate the rows of a decode step ((B, 1, in), B > 1) one at a time: each then gets
    the bits it gets alone, whatever else steps with it. Everything else goes in as it is.

    MKL's float32 GEMM (and oneDNN's bf16 one) take one kernel for one row, others for two or
    three and for four and more, each rounding its sums its own way (measured on SmolLM2's
    shapes, torch 2.13 on an AVX-512 EPYC: one row alone never matched the same row among
    eight). fbgemm's fp16 GEMM (`quantized.Fp16Linear`, its rows padded where its kernels need
    it: `quantized.fp16_row_quantum`) and torch's int4 matmul (`quantized.Int4Linear`) give
    every row the same bits at any row count, so the CPU's default path keeps its batched
    products; float32 decode reads the weights once per row instead.
    """

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() == 3 and x.shape[1] == 1 and x.shape[0] > 1:
            return torch.cat([self.inner(x[i : i + 1]) for i in range(x.shape[0])])
        return self.inner(x)


def keep_rows_apart(model: nn.Module) -> int:
    """Wrap every projection of a model on the CPU whose kernel is not row-invariant in
    `RowsApart`: plain `nn.Linear`s, and fp16 ones without fbgemm. Returns how many."""
    from localllm.backends.torch.quantized import Fp16Linear

    if any(isinstance(m, RowsApart) for m in model.modules()):
        return 0  # already done
    found = [name for name, m in model.named_modules()
             if type(m) is nn.Linear or (isinstance(m, Fp16Linear) and m._packed is None)]  # fmt: skip
    for name in found:
        _set(model, name, RowsApart(model.get_submodule(name)))
    return len(found)


def _set(root: nn.Module, path: str, value: Any) -> None:
    parent, _, attr = path.rpartition(".")
    setattr(root.get_submodule(parent) if parent else root, attr, value)


def load_weights(model: nn.Module, f: GGUFFile, *, dtype: torch.dtype, device: torch.device | str,
                 linear: LinearFactory | None = None,
                 convert: Callable[[str, torch.Tensor], torch.Tensor] | None = None) -> None:  # fmt: skip
    """Stream `f`'s tensors into `model` (built on the meta device), one at a time.

    Each projection is built by `linear` as soon as all its parts are in, so only one layer's
    full-precision pieces exist at once. `convert(name, tensor)` may rewrite a tensor first
    (Llama un-permutes q/k). Model hooks: `model.rope_freqs(tensor)` takes `rope_freqs.weight`;
    no `output.weight` means the head is tied to the embedding.
    """
    from localllm.backends.torch.weights import CODED_TYPES, iter_tensors

    path, linear = f.path, linear or default_linear
    targets: dict[str, tuple[str, int, str]] = {}  # GGUF name → (our module, part, weight|bias)
    plain: dict[str, str] = {}  # GGUF name → our parameter
    hooks: dict[str, Callable[[torch.Tensor], None]] = {}  # GGUF name → the model's loader
    for name in f.tensors:
        stem, _, kind = name.rpartition(".")
        blk, _, short = stem.rpartition(".")
        prefix = f"layers.{blk[4:]}." if blk.startswith("blk.") else ""
        if stem == "token_embd":
            plain[name] = "tok_embeddings.weight"
        elif stem == "output_norm":
            plain[name] = "norm.weight"
        elif stem == "output":
            targets[name] = ("output", 0, kind)
        elif stem == "rope_freqs" and hasattr(model, "rope_freqs"):
            hooks[name] = model.rope_freqs  # type: ignore[assignment]
        elif prefix and short in FUSED:
            targets[name] = (prefix + FUSED[short][0], FUSED[short][1], kind)
        elif prefix and short in PLAIN and kind == "weight":
            plain[name] = f"{prefix}{PLAIN[short]}.weight"
        if name not in hooks and not _exists(model, plain.get(name), targets.get(name)):
            raise InconsistentModel(path, f"unexpected tensor {name!r} for this architecture")

    # What each projection waits for: its weight parts, and bias parts if the file has any.
    needed: dict[str, int] = {}
    for module, _, _ in targets.values():
        needed[module] = needed.get(module, 0) + 1
    pending: dict[str, dict[tuple[str, int], torch.Tensor]] = {}

    def check(name: str, t: torch.Tensor, want: tuple[int, ...]) -> None:
        if tuple(t.shape) != want:
            raise InconsistentModel(path, f"tensor {name!r} has shape {tuple(t.shape)}, "
                                          f"expected {want}")  # fmt: skip

    # a `linear` with `coded = (module suffixes, ...)` gets those projections' quantized matrices
    # as the file stores them (`Coded`)
    coded = tuple(getattr(linear, "coded", ()))
    keep = {n for n, (module, _, kind) in targets.items()
            if kind == "weight" and module.endswith(coded)}  # fmt: skip
    for name, t in iter_tensors(f, dtype=dtype, device=device, keep_coded=keep):
        if name in hooks:
            hooks[name](t)
            continue
        if name in plain:
            check(name, t, tuple(model.get_parameter(plain[name]).shape))
            _set(model, plain[name], nn.Parameter(t, requires_grad=False))
            continue
        module, part, kind = targets[name]
        placeholder = model.get_submodule(module)
        parts = getattr(placeholder, "parts", (placeholder.out_features,))
        check(
            name, t, (parts[part], placeholder.in_features) if kind == "weight" else (parts[part],)
        )
        if convert is not None:
            t = t.map(partial(convert, name)) if isinstance(t, Coded) else convert(name, t)
        got = pending.setdefault(module, {})
        got[(kind, part)] = t if kind == "weight" else t.to(dtype)
        if len(got) < needed[module]:
            continue
        weights = [got.get(("weight", i)) for i in range(len(parts))]
        biases = [got.get(("bias", i)) for i in range(len(parts))]
        n_bias = sum(b is not None for b in biases)
        if any(w is None for w in weights) or 0 < n_bias < len(parts):
            raise InconsistentModel(path, f"some of the tensors of {module} are missing")
        if len(parts) == 1:
            weight = weights[0]
        elif all(isinstance(w, Coded) for w in weights):
            weight = Coded.cat(weights)  # type: ignore[arg-type]  # a Q4_K_M file's mixed types too
        else:  # coded parts fused with float ones: all dense
            weight = torch.cat([w.dequantize(dtype).to(device) if isinstance(w, Coded) else w
                                for w in weights])  # type: ignore[union-attr]  # fmt: skip
        bias = (torch.cat(biases) if len(parts) > 1 else biases[0]) if n_bias else None  # type: ignore[arg-type]
        del pending[module], got, weights, biases
        _set(model, module, linear(weight, bias))  # type: ignore[arg-type]

    if "output.weight" not in f.tensors and "tok_embeddings.weight" in plain.values():
        # tied: the head reads the embedding matrix (a plain Linear shares it, no copy); a
        # `linear` that takes the head coded gets the embedding's codes
        emb = model.get_parameter("tok_embeddings.weight").data
        if linear is default_linear:
            model.output = default_linear(emb, None, column_major=False)
        elif "output".endswith(coded) and f.tensors["token_embd.weight"].ggml_type.name in CODED_TYPES:
            _, codes = next(iter_tensors(f, ["token_embd.weight"], keep_coded={"token_embd.weight"}))
            model.output = linear(codes, None)
        else:
            model.output = linear(emb, None)
    for module in pending:
        raise InconsistentModel(path, f"some of the tensors of {module} are missing")
    for pname, p in model.named_parameters():
        if p.is_meta:
            raise InconsistentModel(path, f"missing tensor {_gguf_names(pname)}")


def _gguf_names(param: str) -> str:
    """Our parameter → the GGUF tensor(s) it is loaded from (for error messages)."""
    top = {"tok_embeddings.weight": "token_embd.weight", "norm.weight": "output_norm.weight"}
    if not param.startswith("layers."):
        return top.get(param, param)
    _, i, rest = param.split(".", 2)
    module = rest.rpartition(".")[0]
    shorts = [k for k, (m, _) in FUSED.items() if m == module]
    shorts = shorts or [k for k, m in PLAIN.items() if m == module]
    return " / ".join(f"blk.{i}.{short}.weight" for short in shorts)


def _exists(model: nn.Module, param: str | None, target: tuple[str, int, str] | None) -> bool:
    """Whether the model has the parameter or the projection a GGUF tensor maps to."""
    try:
        if param:
            model.get_parameter(param)
        elif target:
            model.get_submodule(target[0])
        else:
            return False
    except AttributeError:
        return False
    return True
