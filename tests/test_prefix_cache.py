"""The prefix cache: the radix tree on its own (both handle kinds), then both engines restoring a
system prompt another conversation had pushed out of the only slot — same answer, far less work."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from localllm import load
from localllm.prefix_cache import RadixCache

from conftest import in_home


class Handle:
    def __init__(self, start: int, end: int) -> None:
        self.start, self.end = start, end
        self.nbytes = 10 * (end - start)


class Edge:
    prefix_kind = "edge"

    def __init__(self) -> None:
        self.released: list[Handle] = []

    def release(self, h: Handle) -> None:
        self.released.append(h)

    @staticmethod
    def split(h: Handle, k: int) -> tuple[Handle, Handle]:
        return Handle(h.start, h.start + k), Handle(h.start + k, h.end)


class Full(Edge):
    prefix_kind = "full"


def test_insert_match_split_edge() -> None:
    c = RadixCache(Edge(), budget=10_000)
    assert c.insert([1, 2, 3, 4, 5], Handle) == 5
    hit = c.match([1, 2, 3, 9])
    assert hit.n == 3 and [(h.start, h.end, n) for h, n in hit.pieces] == [(0, 5, 3)]
    assert c.insert([1, 2, 3, 7, 8], Handle) == 2  # splits [1..5] after 3
    assert c.tokens == 7 and c.nbytes == 70
    assert [(h.start, h.end) for h in c.runner.released] == [(0, 5)]  # the cut handle given back
    hit = c.match([1, 2, 3, 7, 8, 9])
    assert hit.n == 5 and [(h.start, h.end, n) for h, n in hit.pieces] == [(0, 3, 3), (3, 5, 2)]
    assert c.insert([1, 2, 3], Handle) == 0  # all cached
    assert c.match([4, 1]).n == 0


def test_full_handles_restore_from_one() -> None:
    c = RadixCache(Full(), budget=10_000)
    c.insert([1, 2, 3, 4], lambda a, b: Handle(0, b))
    c.insert([1, 2, 9], lambda a, b: Handle(0, b))
    hit = c.match([1, 2, 9, 9])
    assert hit.n == 3 and len(hit.pieces) == 1 and hit.pieces[0][1] == 3 and hit.pieces[0][0].end == 3
    hit = c.match([1, 2, 5])
    assert hit.n == 2 and hit.pieces[0][1] == 2  # the first two positions of a longer state
    assert c.nbytes == 40 + 30  # a state shared by split nodes counts once


def test_lru_eviction_under_the_budget_spares_what_is_in_use() -> None:
    c = RadixCache(Edge(), budget=100)
    c.insert([1] * 5, Handle)  # 50 bytes
    c.insert([2] * 4, Handle)  # 40
    in_use = c.match([1] * 5)
    c.hold(in_use)
    c.match([2] * 4)  # used more recently than [1]*5, but [1]*5 is held
    c.insert([3] * 3, Handle)  # 30 more: 120 > 100, something goes
    assert c.nbytes <= 100
    assert c.match([1] * 5).n == 5  # held: kept
    assert c.match([2] * 4).n == 0  # the least recently used of what is not held
    c.let_go(in_use)
    c.evict(0)
    assert c.nbytes == 0 and c.tokens == 0
    assert sorted(h.end - h.start for h in c.runner.released) == [3, 4, 5]  # each given back once


S = "You are a helpful assistant who knows a lot about baking bread. " * 20
T = "You are a pirate who only talks about ships and the sea and treasure. " * 20


@pytest.fixture(scope="module", params=["llama.cpp", "torch"])
def model(request: pytest.FixtureRequest, default_model_path: Path,
          tmp_path_factory: pytest.TempPathFactory) -> Iterator:  # fmt: skip
    with in_home(tmp_path_factory.mktemp("home")):
        m = load("smollm2", backend=request.param, ctx=1024, parallel=1)
    yield m
    m.close()


def ask(model, system: str, q: str):  # noqa: ANN001, ANN201
    return model.chat([{"role": "system", "content": system}, {"role": "user", "content": q}],
                      max_tokens=12, temperature=0)  # fmt: skip


def test_a_system_prompt_comes_back_from_the_tree(model) -> None:
    model.prefix_cache.clear()
    cold = ask(model, S, "How do I knead dough?")
    other = ask(model, T, "Where is the gold?")  # takes the only slot: its cells now hold T
    warm = ask(model, S, "How do I knead dough?")
    assert cold.usage.cached_tokens == 0 and other.usage.cached_tokens < 10
    assert warm.usage.cached_tokens == warm.usage.prompt_tokens - 1  # all but the last token
    assert warm.text == cold.text and warm.token_ids == cold.token_ids
    other_q = ask(model, S, "What flour is best?")  # shares the system prompt only
    system_tokens = len(model.tokenize("<|im_start|>system\n" + S))
    assert other_q.usage.cached_tokens >= system_tokens - 2
    assert model.prefix_cache.nbytes > 0 and model.prefix_cache.hits > 0
