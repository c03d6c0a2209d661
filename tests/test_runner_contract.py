"""The Runner protocol, checked against every runner (the fake, llama.cpp, torch).

A `Declared` proxy stands between the engine and the runner and fails on any attribute the
protocol does not declare (`localllm.backends.base.RUNNER_MEMBERS`): generation (greedy, sampled,
with logprobs, speculative lookup, constrained), the prefix cache, scoring, embeddings and the
memory figures all go through it. And the same seed and sampling parameters give the same tokens
whether a sequence runs alone or beside seven others.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from fakebackend import FakeRunner

from localllm.backends.base import RUNNER_MEMBERS
from localllm.engine import Model, load
from localllm.engine.scoring import Scorer
from localllm.types import Request, SamplingParams

from conftest import in_home

UNDECLARED: list[str] = []


class Declared:
    """The runner, as far as `Runner` declares it."""

    def __init__(self, runner: Any) -> None:
        object.__setattr__(self, "_runner", runner)

    def __getattr__(self, name: str) -> Any:
        if name not in RUNNER_MEMBERS:
            UNDECLARED.append(name)
            raise AssertionError(
                f"the engine read {name!r}, which the Runner protocol does not declare"
            )
        return getattr(object.__getattribute__(self, "_runner"), name)


def test_the_protocol_declares_what_a_runner_is() -> None:
    for member in ("forward", "held", "clear", "trim", "save", "restore", "split", "embed",
                   "n_slots", "n_ctx", "max_batch", "n_vocab", "capabilities", "tokenize"):  # fmt: skip
        assert member in RUNNER_MEMBERS
    missing = {m for m in RUNNER_MEMBERS if not hasattr(FakeRunner(), m)}
    assert not missing, f"the fake runner lacks {sorted(missing)}"


@pytest.fixture(scope="module", params=["fake", "llama.cpp", "torch"])
def runner_model(request: pytest.FixtureRequest, default_model_path: Path,
                 tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Model]]:  # fmt: skip
    """A model with 8 slots whose runner is behind `Declared`."""
    if request.param == "fake":
        m = Model(Declared(FakeRunner(n_ctx=512, n_slots=8)), "fake")
    else:
        with in_home(tmp_path_factory.mktemp("home")):
            loaded = load("smollm2", backend=request.param, ctx=512, parallel=8)
        runner = loaded.runner
        loaded._closed = True  # hand its runner to a model that sees it through the proxy
        loaded._queue.put(None)
        loaded._thread.join()
        m = Model(Declared(runner), loaded.name, options=loaded.options)
    yield request.param, m
    m.close()


def _prompt(kind: str, text: str, sampling: SamplingParams, **kw: Any) -> Request:
    if kind == "fake":
        return Request(
            prompt=f"{text} say:{text[::-1]} and more words here", sampling=sampling, **kw
        )
    return Request(messages=({"role": "user", "content": text},), sampling=sampling, **kw)


def test_every_runner_member_the_engine_uses_is_declared(runner_model: tuple[str, Model]) -> None:
    kind, m = runner_model
    UNDECLARED.clear()
    greedy = m.submit(_prompt(kind, "Name a fruit.", SamplingParams(temperature=0, max_tokens=12, logprobs=3))).wait()  # fmt: skip
    assert greedy.finish_reason in ("stop", "length") and greedy.logprobs
    sampled = m.submit(_prompt(kind, "Name a colour.", SamplingParams(temperature=0.9, top_k=20, seed=3, max_tokens=12))).wait()  # fmt: skip
    assert sampled.error is None
    again = m.submit(_prompt(kind, "Name a fruit.", SamplingParams(temperature=0, max_tokens=12))).wait()  # fmt: skip
    assert again.token_ids == greedy.token_ids
    if "lookup" in m.capabilities.speculative:
        spec = m.submit(_prompt(kind, "Repeat: one two three one two three", SamplingParams(temperature=0, max_tokens=12), speculative="lookup")).wait()  # fmt: skip
        assert spec.error is None
    if m.capabilities.grammar:
        js = m.submit(_prompt(kind, "Give me JSON.", SamplingParams(temperature=0, max_tokens=16), response_format={"type": "json_object"})).wait()  # fmt: skip
        assert js.error is None
    with Scorer(m.runner) as scorer:
        ids = m.tokenize("The quick brown fox jumps over the lazy dog.")
        logits = m.run_here(lambda: scorer.feed(ids))
        assert logits.shape == (len(ids), m.runner.n_vocab)
        scorer.kv_stats()
    m.kv_bytes()
    m.runner.decode_weight_bytes()
    if m.capabilities.embeddings:
        assert len(m.embed(["a", "b"])) == 2
    assert not UNDECLARED, f"undeclared members read: {sorted(set(UNDECLARED))}"


def _answer(m: Model, kind: str, text: str, seed: int) -> tuple[int, ...]:
    return m.submit(_prompt(kind, text, SamplingParams(temperature=0.8, top_k=40, top_p=0.95, seed=seed, max_tokens=24))).wait().token_ids  # fmt: skip


def test_the_same_seed_gives_the_same_tokens_alone_and_beside_seven(
    runner_model: tuple[str, Model],
) -> None:
    kind, m = runner_model
    m.drop_caches()
    alone = _answer(m, kind, "Tell me about the sea.", 1234)
    m.drop_caches()
    others = [m.submit(_prompt(kind, f"Tell me about number {i}.", SamplingParams(temperature=0.8, seed=i, max_tokens=40 + 3 * i))) for i in range(7)]  # fmt: skip
    beside = _answer(m, kind, "Tell me about the sea.", 1234)
    for s in others:
        s.wait()
    assert beside == alone
    assert len(alone) > 4
