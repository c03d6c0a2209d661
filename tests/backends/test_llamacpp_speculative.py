"""Speculative decoding over the llama.cpp runner (issue 13): prompt lookup and a draft model (a
second llama.cpp runner), drafted and verified by the engine (`localllm.engine.speculative`) in
one target forward; rejected positions leave the slot's cache; `self` and `--streaming` are
refused in one line, before a slot is taken. How often llama.cpp's batched verification changes
greedy text is measured in bench/speculative.py (its rounding differs from one-token decoding)."""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import pytest

from conftest import need

need("llama_cpp", "pip install -e '.[dev]' (llama-cpp-python)")

from localllm.backends.base import Piece  # noqa: E402
from localllm.engine import Model, load  # noqa: E402
from localllm.errors import LocalLLMError  # noqa: E402
from localllm.types import ContextPolicy, Request  # noqa: E402

PATTERN = "red green blue, " * 5 + "red"  # the model goes on with it, confidently
ATOL = 0.3  # logits: llama.cpp's kernels round a row of a larger batch otherwise (flash attention)


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Model:
    mp = pytest.MonkeyPatch()
    mp.setenv("LOCALLLM_HOME", str(tmp_path_factory.mktemp("home")))
    m = load("smollm2", backend="llama.cpp", ctx=512, parallel=2, speculative="draft:smollm2")
    yield m
    m.close()
    mp.undo()


def idle(model: Model) -> None:
    """Wait until every slot is free (a result reaches its consumer just before its slot is
    released); a slot still busy after that is a leak."""
    end = time.monotonic() + 30
    while any(s.busy for s in model.slots.all):
        assert time.monotonic() < end, "a slot stayed busy"
        time.sleep(0.005)


def fresh(model: Model) -> None:
    """Every cache forgotten: the free slots', the draft runner's and the prefix cache's."""
    idle(model)
    if model.prefix_cache is not None:
        model.prefix_cache.clear()
    model.drop_caches()


@pytest.mark.parametrize("mode", ["lookup", "draft:smollm2"])
def test_drafts_are_accepted_and_greedy_text_is_plain(model: Model, mode: str) -> None:
    plain = model.complete(PATTERN, max_tokens=40, temperature=0, speculative="off")
    spec = model.complete(PATTERN, max_tokens=40, temperature=0, speculative=mode)
    assert plain.speculative is None or plain.speculative.drafted == 0
    assert spec.text == plain.text and spec.token_ids == plain.token_ids
    assert spec.usage.completion_tokens == plain.usage.completion_tokens == 40
    sp = spec.speculative
    # every draft is right on the pattern (how many rounds run depends on the measured costs)
    assert sp.mode == mode and sp.rounds >= 1 and sp.accepted == sp.drafted > 0
    assert sp.rejections == 0 and sp.passes + sp.accepted == 39


def test_the_models_default_mode_is_its_draft(model: Model) -> None:
    """Loaded with `speculative="draft:smollm2"`, a request that names no mode drafts with it."""
    r = model.complete(PATTERN, max_tokens=40, temperature=0)
    assert r.speculative is not None and r.speculative.mode == "draft:smollm2"
    assert r.speculative.drafted > 0
    assert r.token_ids == model.complete(PATTERN, max_tokens=40, temperature=0,
                                         speculative="off").token_ids  # fmt: skip


@pytest.mark.parametrize("mode", ["lookup", "draft:smollm2"])
def test_sampling_with_drafts_runs_and_reports(model: Model, mode: str) -> None:
    r = model.complete(PATTERN, max_tokens=30, temperature=0.7, seed=5, speculative=mode)
    sp = r.speculative
    assert r.usage.completion_tokens == 30 and r.finish_reason == "length"
    assert sp is not None and sp.mode == mode and sp.drafted >= sp.accepted
    assert sp.drafted > 0 and sp.passes + sp.accepted == 29


@pytest.mark.parametrize("mode", ["lookup", "draft:smollm2"])
def test_rejected_drafts_leave_the_cache(model: Model, mode: str) -> None:
    """After a generation with drafts (lookup's, on this prompt, with rejections), the slot's
    cache ends where its tokens end: the prompt and every token but the last sampled one (not yet
    evaluated), and no rejected position. Continuing from that cache gives what a fresh
    evaluation of those tokens gives."""
    prompt = "Once upon a time"
    fresh(model)
    r = model.complete(prompt, max_tokens=40, temperature=0, speculative=mode)
    sp = r.speculative
    assert r.usage.completion_tokens == 40 and sp is not None and sp.drafted > 0
    if mode == "lookup":  # lookup guesses from earlier text: on a story, some guesses are wrong
        assert sp.rejections > 0 and sp.accepted < sp.drafted
    idle(model)
    used = [s for s in model.slots.all if s.tokens]
    assert len(used) == 1
    slot, runner = used[0], model.runner
    assert slot.exact and slot.tokens == model.tokenize(prompt) + list(r.token_ids[:-1])
    assert runner.held(slot.sid) == len(slot.tokens)
    with model.slot_for_work() as other:  # holds the scheduler: no step runs meanwhile
        assert other != slot.sid and runner.held(other) == 0
        for i in range(0, len(slot.tokens), runner.max_batch):
            runner.forward([Piece(other, slot.tokens[i : i + runner.max_batch], 0)])
        want = runner.forward([Piece(other, [r.token_ids[-1]], 1)]).logits
        got = runner.forward([Piece(slot.sid, [r.token_ids[-1]], 1)]).logits
        assert runner.trim(slot.sid, 1) and runner.held(slot.sid) == len(slot.tokens)
    assert np.abs(got - want).max() <= ATOL and got.argmax() == want.argmax()
    # greedy with drafts is greedy without; what the slot held serves the next prompt sharing
    # its start (its state, kept in the prefix cache when the request ended)
    again = model.complete(prompt, max_tokens=40, temperature=0, speculative="off")
    assert again.token_ids == r.token_ids
    assert again.usage.cached_tokens == again.usage.prompt_tokens - 1


def test_streaming_and_self_are_refused(model: Model) -> None:
    """Each refusal is one line, and takes no slot: the model answers the next request."""
    refusals = [
        (Request(prompt="Hello", context=ContextPolicy(4, 64), speculative="lookup"),
         "cannot run with --streaming"),
        (Request(prompt="Hello", speculative="self"), "no speculative mode 'self'"),
        (Request(prompt="Hello", speculative="draft:other"),
         "loaded with the draft model smollm2"),
    ]  # fmt: skip
    for request, match in refusals:
        with pytest.raises(LocalLLMError, match=match) as e:
            model.submit(request).wait()
        assert "\n" not in str(e.value)
        idle(model)
        assert model.running == 0
    r = model.complete("Hello", max_tokens=4, temperature=0, speculative="lookup")
    assert r.usage.completion_tokens == 4


def test_a_draft_of_another_vocabulary_is_refused(gemma_model_path: Path) -> None:
    from localllm.models_registry.store import Store

    Store().add_file(gemma_model_path, "gemma3:270m-test", source="file:test")
    with pytest.raises(LocalLLMError, match="another vocabulary"):
        load("smollm2", ctx=256, speculative="draft:gemma3:270m-test")
