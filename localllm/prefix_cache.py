"""The prefix cache: KV of finished requests kept in a radix tree of token sequences (SGLang's
RadixAttention), so a request that shares a prefix with an earlier one — a system prompt, the
history of a multi-turn chat — reuses its KV instead of evaluating it again.

The tree lives in the engine (so the CLI, the app and the server gain it alike); the KV itself is
the runner's (`localllm.backends.base.Runner`), held in opaque handles it makes and restores:

    runner.prefix_kind                  "edge": a handle holds the KV of its node's own tokens and a
                                        prefix is restored from every handle on its path (torch:
                                        tensor blocks); "full": a handle holds its whole prefix from
                                        position 0 and one suffices (llama.cpp: a sequence state)
    runner.save(slot, start, end) -> handle | None   the KV of positions [start, end)
                                        ("full": [0, end)) of a slot whose sequence is finishing
    runner.split(handle, k)             ("edge") the handle cut after its first k tokens
    runner.restore(slot, pieces)        put [(handle, tokens used)] into the slot
    runner.release(handle)              the tree no longer holds it (torch: its blocks go back to
                                        the pool unless a slot shares them)
    handle.nbytes                       what it holds

Every node counts the running sequences restored from it (`refs`); a node in use is never evicted.
Beyond `budget` bytes, the least recently used leaves go first (an internal node becomes a leaf
when its children are gone). Only the scheduler thread touches the tree: no locks.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

_clock = itertools.count(1)


@dataclass(eq=False)
class Node:
    tokens: tuple[int, ...]  # the edge from the parent
    start: int  # position of tokens[0]
    handle: Any = None
    parent: Node | None = None
    children: dict[int, Node] = field(default_factory=dict)
    refs: int = 0
    used: int = 0  # the clock when last matched or made

    @property
    def end(self) -> int:
        return self.start + len(self.tokens)


@dataclass(frozen=True)
class Hit:
    """A match: `n` tokens, restorable from `pieces` [(handle, tokens used from it)]."""

    n: int
    nodes: tuple[Node, ...] = ()
    pieces: tuple[tuple[Any, int], ...] = ()


NO_HIT = Hit(0)


class RadixCache:
    def __init__(self, runner: Any, budget: int) -> None:
        self.runner = runner
        self.kind = runner.prefix_kind
        self.budget = max(0, int(budget))
        self.root = Node((), 0)
        self._held: dict[int, list[Any]] = {}  # id(handle) -> [handle, nodes holding it]
        self.nbytes = 0
        self.hits = 0  # tokens restored, over the cache's life
        self.inserted = 0

    # -- looking up ----------------------------------------------------------------------------

    def match(self, ids: Sequence[int]) -> Hit:
        """The longest cached prefix of `ids` (whole tokens; a node's tokens may match in part)."""
        node, n, nodes = self.root, 0, []
        while n < len(ids):
            child, k = self._step(node, ids, n)
            if child is None or not k or child.handle is None:
                break
            nodes.append((child, k))
            n += k
            if k < len(child.tokens):
                break
            node = child
        if not nodes:
            return NO_HIT
        now = next(_clock)
        for nd, _ in nodes:
            nd.used = now
        if self.kind == "full":
            last, k = nodes[-1]
            pieces = ((last.handle, last.start + k),)
        else:
            pieces = tuple((nd.handle, k) for nd, k in nodes)
        return Hit(n, tuple(nd for nd, _ in nodes), pieces)

    @staticmethod
    def _step(node: Node, ids: Sequence[int], n: int) -> tuple[Node | None, int]:
        """The child of `node` that `ids[n:]` enters, and how many of its tokens match."""
        child = node.children.get(ids[n])
        if child is None:
            return None, 0
        k, top = 0, min(len(child.tokens), len(ids) - n)
        while k < top and child.tokens[k] == ids[n + k]:
            k += 1
        return child, k

    def hold(self, hit: Hit) -> None:
        for nd in hit.nodes:
            nd.refs += 1
        self.hits += hit.n

    def let_go(self, hit: Hit) -> None:
        for nd in hit.nodes:
            nd.refs = max(0, nd.refs - 1)

    # -- adding --------------------------------------------------------------------------------

    def insert(self, ids: Sequence[int], save: Callable[[int, int], Any]) -> int:
        """Add `ids` (a finished sequence's cached tokens); `save(start, end)` makes the handle of
        the new part. Returns the tokens added (0: all were cached, or saving was refused)."""
        if self.budget <= 0 or not ids:
            return 0
        node, n = self.root, 0
        while n < len(ids):
            child, k = self._step(node, ids, n)
            if child is None:
                break
            if k < len(child.tokens):
                child = self._split(child, k)
            child.used = next(_clock)
            node, n = child, n + k
        if n == len(ids):
            return 0
        handle = save(n, len(ids))
        if handle is None:
            return 0
        leaf = Node(tuple(ids[n:]), n, handle, node, used=next(_clock))
        node.children[ids[n]] = leaf
        self._take(handle, leaf)
        self.inserted += len(ids) - n
        self.evict()
        return len(ids) - n

    def _split(self, node: Node, k: int) -> Node:
        """Cut `node` after its first k tokens; returns the new upper part."""
        assert node.parent is not None
        if self.kind == "edge":
            head_h, tail_h = self.runner.split(node.handle, k)
            self._drop(node.handle, node)
        else:
            head_h = tail_h = node.handle
            self._drop(node.handle, node)
        head = Node(node.tokens[:k], node.start, head_h, node.parent, refs=node.refs, used=node.used)
        node.parent.children[node.tokens[0]] = head
        node.tokens, node.start, node.handle, node.parent = node.tokens[k:], node.start + k, tail_h, head
        head.children[node.tokens[0]] = node
        self._take(head_h, head)
        self._take(tail_h, node)
        return head

    # -- memory --------------------------------------------------------------------------------

    def _take(self, handle: Any, node: Node) -> None:
        held = self._held.get(id(handle))
        if held is None:
            self._held[id(handle)] = [handle, {node}]
            self.nbytes += int(getattr(handle, "nbytes", 0))
        else:
            held[1].add(node)

    def _drop(self, handle: Any, node: Node) -> None:
        held = self._held.get(id(handle))
        if held is None:
            return
        held[1].discard(node)
        if not held[1]:
            del self._held[id(handle)]
            self.nbytes -= int(getattr(handle, "nbytes", 0))
            self.runner.release(handle)

    def evict(self, budget: int | None = None) -> int:
        """Drop least recently used leaves (not in use) until the bytes held fit `budget`."""
        budget = self.budget if budget is None else budget
        dropped = 0
        while self.nbytes > budget:
            leaves = [nd for nd in self._nodes() if not nd.children and nd.refs == 0]
            if not leaves:
                break
            victim = min(leaves, key=lambda nd: nd.used)
            assert victim.parent is not None
            del victim.parent.children[victim.tokens[0]]
            self._drop(victim.handle, victim)
            victim.handle = None
            dropped += 1
        return dropped

    def clear(self) -> None:
        for handle, _ in self._held.values():
            self.runner.release(handle)
        self.root.children.clear()
        self._held.clear()
        self.nbytes = 0

    def _nodes(self) -> list[Node]:
        out, todo = [], list(self.root.children.values())
        while todo:
            nd = todo.pop()
            out.append(nd)
            todo.extend(nd.children.values())
        return out

    @property
    def tokens(self) -> int:
        """Tokens the tree holds (each once)."""
        return sum(len(nd.tokens) for nd in self._nodes())
