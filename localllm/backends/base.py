"""What a backend is: a `Runner`, the model's forward pass over slots of KV cache.

The engine (`localllm.engine`) owns decoding: which sequences run, how much of a prompt goes into
a step, which slot a prompt takes, sampling, speculative drafts and their verification, grammar
masks, stop strings, the prefix cache. A runner owns the weights, the tokenizer and the caches,
and evaluates tokens:

    forward([Piece(slot, tokens, logits)])   every piece's tokens at its slot's next positions,
        -> Forward(logits, shifted)          in one call (the runner batches them as it can); the
                                             logits of each piece's last `logits` tokens, in piece
                                             order, as one numpy float32 array (rows, n_vocab) on
                                             the host; `shifted[slot]`: positions a StreamingLLM
                                             policy made the slot forget (slots that forgot none
                                             are left out)
    forward([Piece(slot, tokens, 1, True)])  where `logits_on_device`: the piece's logits row
        -> Forward(..., device_rows=...)     stays on the runner's device (`device_rows`, a
                                             framework tensor, in piece order) and out of
                                             `logits`: the engine samples it there
                                             (`engine.device_sampling`), so a step of such pieces
                                             moves only token ids to the host
    held(slot)                               positions the slot's cache holds
    clear(slot, policy)                      empty the slot's cache; `policy` is the context policy
                                             its next tokens follow (StreamingLLM: the runner
                                             shifts the cache itself, and says so in `shifted`)
    trim(slot, n, exact=, skip=)             forget the slot's last n positions (a rejected draft);
                                             exact: only if what stays is what a fresh evaluation
                                             gives (else the slot is cleared and False returned)
    save/restore/split                       prefix-cache handles (`localllm.prefix_cache`)
    embed(texts)                             pooled, normalised vectors (a context of its own)
    tokenize_media(text, images)             where `media` has "image" (a vision projector): the
                                             tokens of a text whose MEDIA_MARKERs stand for the
                                             images, each image's positions as media ids

`forward` either evaluates every piece or raises with every slot's cache as it was (but for what
a context shift already forgot: that is final). `restore` of "full" handles gets [(handle, the
prefix's whole length)]; of "edge" handles, every handle on the path with the tokens used of each.
Slots hold
positions only: which tokens they are, and whether they are still exactly a prompt's prefix, the
engine knows (`localllm.engine.slots`).

Every attribute and method the engine, eval, bench, tune or the server reads is declared here
(`RUNNER_MEMBERS`); tests/test_runner_contract.py fails on any other access.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple, Protocol

import numpy as np

from localllm.backends import Capabilities
from localllm.chat import ChatTemplate
from localllm.types import ContextPolicy

__all__ = ["MEDIA_MARKER", "RUNNER_MEMBERS", "Capabilities", "Forward", "NoDraftHead", "Piece", "Runner",
           "TextOnly", "media_cut", "media_id", "media_of"]


# -- images in a prompt ----------------------------------------------------------------------
# A runner that reads images gives the positions of each image ids below zero: the k-th image it
# has encoded, at offset j, is -(k * MEDIA_SPAN + j + 1). They key slots and the prefix cache as
# tokens do (the same image bytes, the same ids) and never meet a vocabulary. An image is
# evaluated whole (a model may attend across it both ways): no step ends inside one.
MEDIA_MARKER = "<__media__>"  # where an image goes in a rendered prompt (libmtmd's own marker)
MEDIA_SPAN = 1 << 16  # positions one image may take


def media_id(key: int, offset: int) -> int:
    return -(key * MEDIA_SPAN + offset + 1)


def media_of(token: int) -> tuple[int, int] | None:
    """(image key, offset) of a media id; None for a token."""
    if token >= 0:
        return None
    key, offset = divmod(-token - 1, MEDIA_SPAN)
    return key, offset


def media_cut(ids: Sequence[int], start: int, n: int) -> int:
    """The tokens of ids[start:] a step may take: `n`, unless that ends inside an image; then up
    to the image (when it does not begin the step) or through its end."""
    end = start + n
    if n <= 0 or end >= len(ids) or ids[end] >= 0:
        return n
    key, offset = media_of(ids[end])  # type: ignore[misc]
    begin = end - offset  # where that image's positions begin
    if offset == 0 or begin > start:
        return begin - start
    stop = end
    while stop < len(ids) and media_of(ids[stop]) == (key, stop - begin):
        stop += 1
    return stop - start


class Piece(NamedTuple):
    """Tokens for one slot in a forward pass, and how many of the last ones need logits."""

    slot: int
    tokens: Sequence[int]
    logits: int = 1  # 0: none (mid-prompt), 1: the last token's, len(tokens): all (verification)
    on_device: bool = False  # with logits 1: the row stays on the device (`logits_on_device`)
    # a draft tree (only where `tree_tokens(slot)`): token j > 0 follows token parents[j] < j
    # (not j - 1), token 0 the slot's last; each sees its ancestors only, at its depth's position
    parents: Sequence[int] | None = None


@dataclass
class Forward:
    """What a forward pass gives back."""

    logits: np.ndarray  # (sum of the pieces' `logits` but on_device ones', n_vocab) float32, in piece order
    shifted: dict[int, int] = field(default_factory=dict)  # slot -> positions forgotten (shifts)
    device_rows: Any = None  # (pieces on_device, n_vocab) on the runner's device, in piece order


class Runner(Protocol):
    """A model on one device with `n_slots` caches: everything a backend is."""

    name: str
    capabilities: Capabilities
    model_path: str
    device: str  # "cpu", "cuda", "cuda:1", "mps"; "gpu" where the runner offloads to one it does not name
    device_name: str  # what the user would call it ("CPU", "NVIDIA H200")
    dtype: str  # working precision ("auto" where the file's)
    n_threads: int
    n_layers: int
    n_slots: int  # caches it holds at once
    n_ctx: int  # positions per slot
    max_batch: int  # tokens one forward may evaluate
    n_vocab: int
    scoring_chunk: int  # tokens per forward when scoring a text (1: token by token)
    chat_template: ChatTemplate
    has_template: bool
    prefix_kind: str  # "edge" (a handle per tree edge) or "full" (a handle holds its whole prefix)
    prefix_budget: int  # bytes of handles the engine may keep (0: no prefix cache)
    logits_on_device: bool  # pieces may keep their logits row on the device (`forward`)

    def tokenize(self, text: str, *, add_special: bool = True) -> list[int]: ...
    def token_bytes(self, token: int) -> bytes: ...
    def detokenize(self, tokens: Sequence[int]) -> str: ...
    def is_end(self, token: int) -> bool: ...
    def bos_text(self) -> str: ...

    def forward(self, pieces: Sequence[Piece], *, skip: frozenset[int] = frozenset()) -> Forward:
        """Evaluate the pieces (one per slot at most). `skip`: layers left out (a layer-skip
        draft; only where `capabilities.speculative` has "self"): only the kept layers' caches
        grow, and `trim(..., skip=skip)` undoes it."""
        ...

    def held(self, slot: int) -> int: ...
    def clear(self, slot: int, policy: ContextPolicy | None = None) -> None: ...
    def trim(self, slot: int, n: int, *, exact: bool = False,
             skip: frozenset[int] = frozenset()) -> bool: ...  # fmt: skip

    # a draft head (only where `capabilities.speculative` has "head"): after `use_head`, the
    # head's logits (n_vocab,) of the token after `token` (the slot's last sampled one on a
    # round's first call, then each drafted one; -inf outside its draft vocabulary; None: no
    # draft), and `head_done` when a round's drafting is over
    def use_head(self, path: Any, digest: str) -> None: ...
    def head_logits(self, slot: int, token: int) -> np.ndarray | None: ...
    def head_done(self, slot: int) -> None: ...

    # draft trees (EAGLE-2): `head_expand` drafts from several entries of a round at once —
    # entry i of the round reads tokens[i] after entry parents[i] (-1: the round's first call's;
    # entries count from 0 in the order they were made) — and gives their logits (len, n_vocab).
    # A slot verifies a tree of up to `tree_tokens` tokens (0: none) in one piece
    # (`Piece.parents`); `keep` then keeps the path the engine accepted: of the positions from
    # `start`, the piece's tokens at `path` (ascending, 0 first) at start, start + 1 ..., and
    # forgets the rest
    def head_expand(self, slot: int, tokens: Sequence[int], parents: Sequence[int]) -> np.ndarray | None: ...
    def tree_tokens(self, slot: int) -> int: ...
    def keep(self, slot: int, start: int, path: Sequence[int]) -> None: ...

    def save(self, slot: int, start: int, end: int) -> Any: ...
    def restore(self, slot: int, pieces: Sequence[tuple[Any, int]]) -> bool: ...
    def split(self, handle: Any, k: int) -> tuple[Any, Any]: ...
    def release(self, handle: Any) -> None: ...  # the prefix cache is done with a handle

    def embed(self, texts: Sequence[str]) -> list[list[float]]: ...

    media: tuple[str, ...]  # what a prompt may hold beside text: ("image",) with a projector

    def tokenize_media(self, text: str, images: Sequence[bytes], *,
                       add_special: bool = True) -> list[int]: ...  # fmt: skip
    def kv_bytes(self) -> int: ...
    def kv_stats(self, slot: int) -> dict[str, float]: ...
    def decode_weight_bytes(self) -> int | None:
        """Weight bytes one decode step reads as the runner holds them (None: the file's)."""
        ...

    def close(self) -> None: ...


class TextOnly:
    """What a runner without a vision projector says about images (the engine asks `media` first)."""

    media: tuple[str, ...] = ()

    def tokenize_media(self, text: str, images: Sequence[bytes], *,
                       add_special: bool = True) -> list[int]:  # fmt: skip
        from localllm.errors import Unsupported

        raise Unsupported(f"the {getattr(self, 'name', 'this')} backend has no vision projector "
                          "loaded: it cannot read images")  # fmt: skip


class NoDraftHead:
    """What a runner without draft heads says (the engine asks `capabilities.speculative` first:
    a request for `head` is refused before any of these is called)."""

    def use_head(self, path: Any, digest: str) -> None:
        from localllm.errors import Unsupported

        raise Unsupported(f"the {getattr(self, 'name', 'this')} backend has no draft heads: use "
                          "--backend torch for --speculative head")  # fmt: skip

    def head_logits(self, slot: int, token: int) -> np.ndarray | None:
        return None

    def head_done(self, slot: int) -> None:
        return None

    def head_expand(self, slot: int, tokens: Sequence[int], parents: Sequence[int]) -> np.ndarray | None:
        return None

    def tree_tokens(self, slot: int) -> int:
        return 0

    def keep(self, slot: int, start: int, path: Sequence[int]) -> None:
        raise ValueError(f"the {getattr(self, 'name', 'this')} backend verifies no draft trees")


def _members() -> frozenset[str]:
    names = set(Runner.__annotations__)
    names.update(n for n in vars(Runner) if not n.startswith("_"))
    return frozenset(names)


RUNNER_MEMBERS = _members()
