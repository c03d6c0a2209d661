"""Speculative decoding, once for every runner: a drafter proposes, one target pass verifies.

    drafter.propose(seq, k) -> Draft       up to k tokens after the sequence's last sampled one,
                                           with the drafter's distributions q (None: one-hot)
    accept_path(logits, draft, sampler, hist)
                                           the exact rule (arXiv 2211.17192), down a chain or a
                                           tree: greedy keeps drafts while each is the target's
                                           argmax; sampling keeps draft x when u ≤ p(x)/q(x), else
                                           goes on with normalize(max(0, p − q)) (a sibling drawn
                                           next, or a draw from it); all kept → one bonus token
    Pace                                   the draft length from recent acceptance, and whether
                                           speculation still pays (else it switches itself off)

Drafters: `Lookup` (n-gram prompt lookup over prompt + generated text), `DraftModel` (a smaller
model with the same vocabulary, on a runner of its own, one slot per slot of the target's),
`LayerSkip` (the target itself with some layers left out, through `forward(..., skip=)`: a runner
that has "self" among its speculative modes) and `HeadDrafter` (an EAGLE-style draft head on the
target's own features, through `head_logits`: a runner that has "head"). Target and drafter see
the same processed distributions (`Sampler.distribution`), so the output is distributed exactly
as the target's; greedy output is the target's greedy output.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from localllm.backends.base import Piece
from localllm.engine.sampling import Sampler
from localllm.engine.slots import common_prefix
from localllm.errors import LocalLLMError
from localllm.types import ContextPolicy, speculative_mode

__all__ = [
    "DRAFT_K",
    "HEAD_K",
    "LOOKUP_K",
    "TREE_COST",
    "TREE_NODES",
    "TREE_WIDTH",
    "Draft",
    "DraftModel",
    "HeadDrafter",
    "LayerSkip",
    "Lookup",
    "Pace",
    "accept",
    "accept_path",
    "check_speculative",
]

LOOKUP_K = 10  # the most tokens prompt lookup proposes in one pass
DRAFT_K = 8  # ... and a draft model or layer skipping
HEAD_K = 8  # ... and a draft head
# A draft head drafts a tree of TREE_WIDTH branches per node and at most TREE_NODES tokens where
# one more verified token costs less than TREE_COST of a plain pass (`Pace.cost`, measured): on
# a GPU, where a pass of 16 tokens costs about what one does. On the CPU here it costs 0.15 (a
# pass of 10 tokens 2.1 plain ones) and trees lost to the chain (bench/speculative.py, `tree`).
TREE_WIDTH = 4
TREE_NODES = 15
TREE_COST = 0.05


@dataclass
class Draft:
    """Tokens a drafter proposes after a sequence's last one."""

    tokens: list[int]
    q: list[Any] | None = None  # (V,) probabilities each token was drawn from; None: one-hot
    # a tree (EAGLE-2): each token's parent's index among them (-1: the sequence's last); None:
    # a chain (token i follows token i - 1)
    parents: list[int] | None = None
    # a sampled tree: each expanded node's children (-1: the sequence's last's), as drawn — one
    # entry per draw (two draws of one token: one child, listed twice); None: in index order
    draws: dict[int, list[int]] | None = None

    @property
    def depth(self) -> int:
        """The most drafts a verification may accept: the chain's length, the tree's depth."""
        if self.parents is None:
            return len(self.tokens)
        depth: list[int] = []
        for p in self.parents:
            depth.append(depth[p] + 1 if p >= 0 else 1)
        return max(depth, default=0)

    def piece_parents(self) -> list[int] | None:
        """A tree's `Piece.parents` for the piece [last, *tokens]; None for a chain."""
        return None if self.parents is None else [-1, *(p + 1 for p in self.parents)]


class Pace:
    """How many tokens to draft next, and whether speculation still pays.

    It keeps two estimates, both moving averages over recent rounds: the acceptance α (accepted
    drafts over accepted drafts plus rejections: a draft token's chance to survive, given the
    ones before it did) and the cost c of one more drafted token (drafting it and verifying it),
    as a share of a plain pass. Each round it drafts the k in [1, k_max] that maximises the
    predicted speed-up (1 − α^(k+1)) / (1 − α) / (1 + c·k). Where no k is predicted to pay, it
    pauses (plain passes) for 1, 2, 4 ... up to `PAUSE` passes, then tries again: the text may
    turn back to something a draft can follow.

    It switches speculation off for the rest of the request when, after `WINDOW` rounds and
    `SPAN` / 2 passes, the rounds among the last `SPAN` passes cost more than `MARGIN` of those passes' time beyond what
    plain passes for their tokens would have taken (so the request as a whole stays within that
    margin of plain decoding: where nothing pays, the pauses keep that share small), or — for a
    drafter that models the text (`give_up`: a draft model, layer skipping) —
    when its last `WINDOW` rounds kept no draft at all. Prompt lookup does not give up on
    rejections alone: its drafts fail where the text stops copying and succeed again where it
    resumes, and a failed lookup costs little. Plain decoding's cost is measured
    on the sequence itself: its first decode pass is plain, and so is every `REFRESH`-th after,
    as the context (and so the cost of a pass) grows.
    """

    WINDOW = 8
    SPAN = 128
    MARGIN = 0.03
    REFRESH = 24
    PAUSE = 32

    def __init__(self, k_max: int, k: int | None = None, *, on: bool = True,
                 give_up: bool = True) -> None:  # fmt: skip
        self.k_max = max(1, k_max)
        self.give_up = give_up
        self.k = max(1, min(self.k_max, k or self.k_max))
        self.on = on
        self.t_plain = 0.0  # seconds per plain decode pass (moving average)
        self.kept = self.lost = 0.0  # decayed counts: accepted drafts, rejections
        self.cost = 0.0  # c: one more drafted token's seconds over a plain pass's
        self.rounds = self.drafted = self.accepted = self.rejections = 0  # totals
        self.since_plain = 0
        self.wait = self.pause = 0  # plain passes left in a pause, and the last pause's length
        self.recent: deque[int] = deque(maxlen=self.WINDOW)  # accepted drafts per round
        self.passes: deque[tuple[int, float, bool]] = deque(maxlen=self.SPAN)  # tokens, s, round
        self.reason = ""  # why it switched off

    def want(self) -> int:
        """Tokens to draft for the next pass; 0: a plain pass."""
        if not self.on or not self.t_plain or self.wait or self.since_plain >= self.REFRESH:
            return 0
        return self.k

    @property
    def alpha(self) -> float:
        return (self.kept + 0.5) / (self.kept + self.lost + 1.0)

    def predicted(self, k: int) -> float:
        """The speed-up k drafts are predicted to give over plain decoding."""
        a = min(self.alpha, 0.999)
        return (1 - a ** (k + 1)) / (1 - a) / (1 + self.cost * k)

    @property
    def loss(self) -> float:
        """The share of the last `SPAN` passes' time the rounds among them lost against plain
        passes for the same tokens (negative: they saved time)."""
        lost = sum(s - t * self.t_plain for t, s, spec in self.passes if spec)
        total = sum(s for _, s, _ in self.passes)
        return lost / total if total else 0.0

    def plain(self, seconds: float) -> None:
        self.t_plain = seconds if not self.t_plain else 0.7 * self.t_plain + 0.3 * seconds
        self.since_plain = 0
        self.wait = max(0, self.wait - 1)
        self.passes.append((1, seconds, False))

    def verified(self, drafted: int, accepted: int, seconds: float, tokens: int = 0) -> None:
        """One round: `drafted` proposed (a tree's depth), `accepted` kept, drafting + verifying
        `tokens` drafts (a tree's nodes; 0: `drafted`) took `seconds`."""
        self.rounds += 1
        self.drafted += drafted
        self.accepted += accepted
        self.rejections += accepted < drafted
        self.since_plain += 1
        self.recent.append(accepted)
        self.passes.append((accepted + 1, seconds, True))
        self.kept = 0.85 * self.kept + accepted
        self.lost = 0.85 * self.lost + (accepted < drafted)
        extra = max(0.0, seconds / max(self.t_plain, 1e-9) - 1) / max(tokens or drafted, 1)
        self.cost = extra if self.rounds == 1 else 0.7 * self.cost + 0.3 * extra
        best = max(range(1, self.k_max + 1), key=self.predicted)
        self.k = best
        if self.predicted(best) < 1:
            self.pause = min(self.PAUSE, 2 * self.pause or 1)
            self.wait = self.pause
        else:
            self.pause = 0
        if self.give_up and len(self.recent) == self.WINDOW and not any(self.recent):
            self.switch_off(f"the last {self.WINDOW} drafts were all rejected")
        elif (self.rounds >= self.WINDOW and len(self.passes) >= self.SPAN // 2
              and self.loss > self.MARGIN):  # fmt: skip
            self.switch_off(f"its rounds cost {self.loss:.0%} more time than plain decoding")

    def switch_off(self, reason: str) -> None:
        self.on, self.reason = False, reason


class Lookup:
    """Prompt lookup (apoorvumang/prompt-lookup-decoding): the last n tokens (n = 3, 2, 1) found
    earlier in prompt + generated text propose what followed them there (the latest match).

    An index of every n-gram's latest end grows with the text, so a proposal costs a few dict
    lookups, not a scan of the context."""

    def __init__(self, max_n: int = 3, min_n: int = 1) -> None:
        self.max_n, self.min_n = max_n, min_n
        self.ends: dict[tuple[int, ...], int] = {}
        self.indexed = 0  # n-grams ending before this position are in `ends`
        self.n = 0  # the length of the last match (0: none)

    def propose(self, seq: Any, k: int) -> Draft:
        return Draft(self.lookup(seq.history, k))

    def lookup(self, text: Sequence[int], k: int) -> list[int]:
        n_text = len(text)
        while self.indexed < n_text - 1:  # every n-gram except the ones ending at the last token
            e = self.indexed
            for n in range(1, self.max_n + 1):
                if e + 1 >= n:
                    self.ends[tuple(text[e + 1 - n : e + 1])] = e
            self.indexed += 1
        for n in range(min(self.max_n, n_text), self.min_n - 1, -1):
            e = self.ends.get(tuple(text[n_text - n :]))
            if e is not None:
                self.n = n
                follow = list(text[e + 1 : e + 1 + k])
                images = [i for i, t in enumerate(follow) if t < 0]  # an image's positions: no draft
                return follow[: images[0]] if images else follow
        self.n = 0
        return []


class Drafter(Protocol):
    def propose(self, seq: Any, k: int) -> Draft:
        """Up to k tokens to follow `seq.last` (its slot's cache holds what precedes it)."""
        ...


def accept(logits: Callable[[int], np.ndarray], draft: Draft, sampler: Sampler,
           history: list[int]) -> tuple[list[int], int]:  # fmt: skip
    """The tokens one verification pass of a chain of drafts yields, and how many of them are
    accepted drafts (`accept_path`: tokens, and the path's length)."""
    tokens, path = accept_path(logits, draft, sampler, history)
    return tokens, len(path)


def accept_path(logits: Callable[[int], np.ndarray], draft: Draft, sampler: Sampler,
                history: list[int]) -> tuple[list[int], list[int]]:  # fmt: skip
    """The tokens one verification pass yields, and the drafts accepted on the way (indices
    into `draft.tokens`, each a child of the one before: a path down a tree, or a chain's first n).

    At each node (first the sequence's last token) the target's row decides among its children:
    greedy keeps the child that is the target's argmax; sampling tries the children in the order
    they were drawn (`draft.draws`), keeping child x when u ≤ p(x)/q(x), else going on with the
    residual p = normalize(max(0, p − q)) — for drafts drawn independently from q, the emitted
    token is distributed as p (SpecInfer, arXiv 2305.09781; one child: arXiv 2211.17192). Where
    no child is kept, or the node has none, the target's own token ends the round.

    Args:
        logits: row i → the target's raw logits (n_vocab,) after the last token and the path to
            draft i - 1 (row 0: after the last token alone).
        history: prompt + generated so far (for penalties); extended with what is returned.
    Returns:
        (tokens, path): the accepted drafts' tokens and then one of the target's own (its choice
        where the path stopped), 1..depth+1 tokens; the accepted drafts' indices.
    """
    n = len(draft.tokens)
    parents = draft.parents if draft.parents is not None else list(range(-1, n - 1))
    children: dict[int, list[int]] = {}
    for i, p in enumerate(parents):
        children.setdefault(p, []).append(i)
    out: list[int] = []
    path: list[int] = []
    node = -1
    while True:
        kids = children.get(node, [])
        kept = None
        if sampler.greedy:
            t = int(sampler.process(logits(node + 1), history).argmax())
            kept = next((c for c in kids if draft.tokens[c] == t), None)
        else:
            p = sampler.distribution(logits(node + 1), history)
            for c in draft.draws.get(node, kids) if draft.draws is not None else kids:
                x = draft.tokens[c]
                q = draft.q[c] if draft.q is not None else None
                qx = float(q[x]) if q is not None else 1.0
                if qx > 0 and sampler.uniform() * qx <= float(p[x]):  # u ≤ min(1, p(x)/q(x))
                    kept, t = c, x
                    break
                if q is not None:
                    residual = np.maximum(p - q, 0.0)
                else:  # max(0, p − one-hot(x)): p without x
                    residual = p.copy()
                    residual[x] = 0.0
                total = float(residual.sum())
                p = residual / total if total > 0 else p
            if kept is None:
                t = sampler.draw(p)
        out.append(t)
        history.append(t)
        if kept is None:
            return out, path
        path.append(kept)
        node = kept


def _choose(sampler: Sampler, logits: np.ndarray, history: list[int],
            q: list[np.ndarray] | None) -> tuple[int, float]:  # fmt: skip
    """A drafter's token from its logits and its confidence (the top probability). Greedy targets
    get the argmax; sampling ones a draw from the same processed distribution (kept in q)."""
    if sampler.greedy:
        z = sampler.process(logits, history)
        top = float(z.max())
        return int(z.argmax()), float(1.0 / np.exp(z.astype(np.float64) - top).sum())
    p = sampler.distribution(logits, history)
    assert q is not None
    q.append(p)
    return sampler.draw(p), float(p.max())


class LayerSkip:
    """The target itself with `skip` layers left out (Draft & Verify, arXiv 2309.08168; SWIFT,
    2410.06916): the kept layers read and write their own caches, so drafting needs no prefill and
    no memory of its own. What a draft wrote is trimmed before the target verifies: every layer's
    cache then holds the full model's keys and values only.

    Drafting stops early at a token whose probability is below `confidence` (the draft is
    unlikely to survive past it)."""

    def __init__(self, runner: Any, skip: Collection[int], *, confidence: float = 0.0) -> None:
        self.runner = runner
        self.skip = frozenset(skip)
        self.confidence = confidence

    def propose(self, seq: Any, k: int) -> Draft:
        sampler: Sampler = seq.sampler
        history = list(seq.history)
        q: list[np.ndarray] | None = None if sampler.greedy else []
        tokens: list[int] = []
        sid, tok, fed = seq.slot.sid, seq.last, 0
        try:
            for _ in range(k):
                f = self.runner.forward([Piece(sid, [tok], 1)], skip=self.skip)
                fed += 1
                tok, conf = _choose(sampler, f.logits[0], history, q)
                tokens.append(tok)
                history.append(tok)
                if conf < self.confidence:
                    break
        finally:
            if fed:
                self.runner.trim(sid, fed, skip=self.skip)
        return Draft(tokens, q)


class HeadDrafter:
    """A draft head (EAGLE, arXiv 2401.15077) in the target's runner: one small layer over the
    target's features of the positions it evaluated, then over its own predicted features, a
    token at a time (`Runner.head_logits`). Its vocabulary is the draft vocabulary it was
    trained with; tokens outside it are never drafted (probability 0), which the exact rule
    allows for.

    With `width` > 1, where the runner verifies trees (`Runner.tree_tokens`) and one more
    verified token costs less than `tree_cost` of a plain pass (the sequence's `Pace.cost`,
    measured on its rounds; None: whatever it costs), it drafts a tree
    (EAGLE-2, arXiv 2406.16858) of at most `nodes` tokens and k levels: each level, the `width`
    most likely nodes of the level before (by the product of the draft probabilities along
    their paths) are expanded in one call of the head (`Runner.head_expand`) — greedy by their
    `width` most likely tokens, then the best `nodes` of all kept; sampling by `width` tokens
    drawn from the node's distribution (every draw kept, as the exact rule for several drafts
    needs them: `accept_path`). One target pass verifies the whole tree.

    With `lookup`, prompt lookup drafts instead where the last `COPY_N` or more tokens occurred
    earlier in prompt + answer (the answer is copying, or repeating itself: a copied draft costs
    nothing to make and is kept often), the head everywhere else.

    Drafting stops early at a token whose probability is below `confidence`."""

    COPY_N = 2

    def __init__(self, runner: Any, *, confidence: float = 0.0, lookup: bool = False,
                 width: int = 1, nodes: int = 0, tree_cost: float | None = None) -> None:  # fmt: skip
        self.runner = runner
        self.confidence = confidence
        self.lookup = Lookup() if lookup else None
        self.width, self.nodes, self.tree_cost = max(1, width), nodes, tree_cost
        self.copied = 0  # rounds that drafted by prompt lookup
        self.trees = 0  # rounds that drafted a tree

    def propose(self, seq: Any, k: int) -> Draft:
        if self.lookup is not None:
            copy = self.lookup.lookup(seq.history, k)
            if copy and self.lookup.n >= self.COPY_N:
                self.copied += 1
                return Draft(copy)
        if not seq.slot.exact:
            return Draft([])  # the target's cache was shifted: its features lead elsewhere
        sid = seq.slot.sid
        room = 0
        pace = getattr(seq, "pace", None)
        if self.width > 1 and (self.tree_cost is None or (
                pace is not None and pace.rounds and pace.cost < self.tree_cost)):  # fmt: skip
            r = self.runner
            room = min(r.tree_tokens(sid), r.n_ctx - r.held(sid), r.max_batch) - 1
        try:
            if room > k:  # a tree holds more than the chain would
                self.trees += 1
                return self._tree(seq, k, min(room, self.nodes or room))
            return self._chain(seq, k)
        finally:
            self.runner.head_done(sid)

    def _chain(self, seq: Any, k: int) -> Draft:
        sampler: Sampler = seq.sampler
        history = list(seq.history)
        q: list[np.ndarray] | None = None if sampler.greedy else []
        tokens: list[int] = []
        sid, tok = seq.slot.sid, seq.last
        for _ in range(k):
            logits = self.runner.head_logits(sid, tok)
            if logits is None:
                break
            tok, conf = _choose(sampler, logits, history, q)
            tokens.append(tok)
            history.append(tok)
            if conf < self.confidence:
                break
        return Draft(tokens, q)

    def _tree(self, seq: Any, depth: int, budget: int) -> Draft:
        """A tree of at most `budget` drafts and `depth` levels (see the class)."""
        sampler: Sampler = seq.sampler
        sid, w = seq.slot.sid, self.width
        root = self.runner.head_logits(sid, seq.last)
        if root is None:
            return Draft([])
        tokens: list[int] = []
        parents: list[int] = []
        score: list[float] = []  # log of the draft probability of each node's path
        q: list[Any] = []
        draws: dict[int, list[int]] = {}
        entry = {-1: -1}  # node -> its entry among the head's of this round
        level = [(-1, root)]  # nodes to expand, with the head's logits after them
        floor = np.log(self.confidence) if self.confidence > 0 else -np.inf
        for d in range(depth):
            new: list[int] = []
            for node, logits in level:
                history = [*seq.history, *self._path(tokens, parents, node)]
                if sampler.greedy:
                    z = sampler.process(logits, history).astype(np.float64)
                    top = np.argpartition(-z, w - 1)[:w] if len(z) > w else np.arange(len(z))
                    kids = [int(x) for x in top[np.argsort(-z[top], kind="stable")] if z[x] > -np.inf]
                    logp = z - z.max() - np.log(np.exp(z - z.max()).sum())
                    dist = None
                else:
                    if len(tokens) + w > budget:
                        break  # a node's draws are all kept or none is (`accept_path`)
                    dist = sampler.distribution(logits, history)
                    kids = [sampler.draw(dist) for _ in range(w)]
                    logp = np.log(np.maximum(dist, 1e-300))
                base = score[node] if node >= 0 else 0.0
                made: dict[int, int] = {}
                for x in kids:
                    if x not in made:
                        made[x] = len(tokens)
                        tokens.append(x)
                        parents.append(node)
                        score.append(base + float(logp[x]))
                        q.append(dist)
                        new.append(made[x])
                    if dist is not None:
                        draws.setdefault(node, []).append(made[x])
            grow = [i for i in sorted(new, key=lambda i: -score[i])[:w] if score[i] >= floor]
            if d == depth - 1 or not grow or (not sampler.greedy and len(tokens) + w > budget):
                break
            got = self.runner.head_expand(sid, [tokens[i] for i in grow],
                                          [entry[parents[i]] for i in grow])  # fmt: skip
            if got is None:
                break
            entry.update({i: len(entry) - 1 + j for j, i in enumerate(grow)})
            level = list(zip(grow, got))
        if not sampler.greedy:
            return Draft(tokens, q, parents, draws)
        # greedy: the `budget` most likely nodes (a parent is at least as likely as its child,
        # and comes first among equals: what is kept is a tree)
        keep = sorted(sorted(range(len(tokens)), key=lambda i: (-score[i], i))[:budget])
        at = {old: i for i, old in enumerate(keep)}
        return Draft([tokens[i] for i in keep], None, [at.get(parents[i], -1) for i in keep])

    @staticmethod
    def _path(tokens: list[int], parents: list[int], node: int) -> list[int]:
        """The tokens from the root's first child down to `node`."""
        out = []
        while node >= 0:
            out.append(tokens[node])
            node = parents[node]
        return out[::-1]


class DraftModel:
    """A second, smaller model with the same vocabulary on a runner of its own, one slot per slot
    of the target's, so its prompt prefix is reused like the target's. Before drafting it catches
    up with what the target's slot holds (the prompt at first, then the tokens accepted since);
    what it drafted past that is trimmed on the next catch-up."""

    def __init__(self, runner: Any, *, confidence: float = 0.0) -> None:
        self.runner = runner
        self.confidence = confidence
        self.held: dict[int, list[int]] = {i: [] for i in range(runner.n_slots)}

    def propose(self, seq: Any, k: int) -> Draft:
        slot, r = seq.slot, self.runner
        if not slot.exact:
            return Draft([])  # the target's cache was shifted: no exact prefix to follow
        held, want = self.held[slot.sid], slot.tokens
        if len(want) + 2 > r.n_ctx:  # past the draft model's own context: no draft
            return Draft([])
        keep = common_prefix(held, want, len(want))
        if keep < len(held) or r.held(slot.sid) != len(held):
            if keep and r.held(slot.sid) == len(held):
                r.trim(slot.sid, len(held) - keep)
            else:
                r.clear(slot.sid)
                keep = 0
            del held[keep:]
        for i in range(keep, len(want), r.max_batch):
            piece = want[i : i + r.max_batch]
            r.forward([Piece(slot.sid, piece, 0)])
            held.extend(piece)
        sampler: Sampler = seq.sampler
        history = list(seq.history)
        q: list[np.ndarray] | None = None if sampler.greedy else []
        tokens: list[int] = []
        tok = seq.last
        for _ in range(max(0, min(k, r.n_ctx - len(held) - 1))):
            f = r.forward([Piece(slot.sid, [tok], 1)])
            held.append(tok)
            tok, conf = _choose(sampler, f.logits[0], history, q)
            tokens.append(tok)
            history.append(tok)
            if conf < self.confidence:
                break
        return Draft(tokens, q)


def check_speculative(spec: str | None, *, policy: ContextPolicy, evict: bool = False,
                      draft_name: str | None = "") -> None:  # fmt: skip
    """What speculation cannot compose with (`LocalLLMError`, one line each). `draft_name`: the
    loaded draft model's (None: none loaded; "": not known yet, before loading)."""
    mode = speculative_mode(spec)
    if mode == "off":
        return
    if evict:
        raise LocalLLMError(
            "speculative decoding cannot run with H2O eviction (--evict): verifying drafts adds "
            "their attention to the heavy-hitter scores and can evict tokens, which a "
            "rollback cannot undo"
        )
    if policy.enabled:
        raise LocalLLMError(
            "speculative decoding cannot run with --streaming: verifying k drafts at once "
            "can make the context shift early, which a rollback cannot undo"
        )
    if mode == "draft" and draft_name != "" and spec != f"draft:{draft_name}":
        raise LocalLLMError(
            f"--speculative {spec}: this model was loaded "
            + (f"with the draft model {draft_name}" if draft_name else "without a draft model")
            + "; load it with that --speculative to use another"
        )
