"""Speculative decoding in the llama.cpp backend (issue 13): prompt lookup and a draft model (a
second llama.cpp context), verified in the slot step; rejected cells leave the cache; `self` and
`--streaming` are refused in one line. How often llama.cpp's batched verification changes greedy
text is measured in bench/speculative.py (its rounding differs from one-token decoding)."""

from __future__ import annotations

from pathlib import Path

import pytest

from conftest import need

need("llama_cpp", "pip install -e '.[dev]' (llama-cpp-python)")

from localllm.backends.base import Seq  # noqa: E402
from localllm.engine import Model, load  # noqa: E402
from localllm.errors import LocalLLMError  # noqa: E402
from localllm.types import ContextPolicy, SamplingParams  # noqa: E402

PATTERN = "red green blue, " * 5 + "red"  # the model goes on with it, confidently


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Model:
    mp = pytest.MonkeyPatch()
    mp.setenv("LOCALLLM_HOME", str(tmp_path_factory.mktemp("home")))
    m = load("smollm2", backend="llama.cpp", ctx=512, parallel=2, speculative="draft:smollm2")
    yield m
    m.close()
    mp.undo()


@pytest.mark.parametrize("mode", ["lookup", "draft:smollm2"])
def test_drafts_are_accepted_and_greedy_text_is_plain(model: Model, mode: str) -> None:
    plain = model.complete(PATTERN, max_tokens=40, temperature=0, speculative="off")
    spec = model.complete(PATTERN, max_tokens=40, temperature=0, speculative=mode)
    assert spec.text == plain.text
    sp = spec.speculative
    # every draft is right on the pattern (how many rounds run depends on the measured costs)
    assert sp.mode == mode and sp.rounds >= 1 and sp.accepted == sp.drafted > 0
    assert sp.passes + sp.accepted == 39


def test_sampling_with_drafts_runs_and_reports(model: Model) -> None:
    r = model.complete(PATTERN, max_tokens=30, temperature=0.7, seed=5, speculative="lookup")
    assert r.usage.completion_tokens == 30 and r.speculative.drafted >= r.speculative.accepted


def test_rejected_drafts_leave_the_cache(model: Model) -> None:
    """After a generation with rejections, the slot's cells end where its tokens end."""
    b = model.backend
    seq = Seq(b.tokenize("Once upon a time"), SamplingParams(temperature=0, max_tokens=40),
              speculative="draft:smollm2")  # fmt: skip
    b.admit(seq)
    try:
        slot = seq.state
        slot.pace.plain(1.0)  # speculate from the first decode pass
        n = rejected = 0
        out = b.step({seq: 0})[seq]
        while n < 30:
            steps = b.step({seq: 0})[seq]
            n += len(steps)
            rejected += sum(s.drafted - s.accepted for s in steps)
        lib = b._lib
        assert lib.llama_memory_seq_pos_max(b._mem, slot.sid) == slot.n_past - 1 == len(slot.tokens) - 1
        assert slot.tokens[-1] != slot.last or out  # the last sampled token is not yet in the cache
    finally:
        b.release(seq)


def test_streaming_and_self_are_refused(model: Model) -> None:
    b = model.backend
    with pytest.raises(LocalLLMError, match="cannot run with --streaming"):
        b.admit(Seq([1, 2, 3], SamplingParams(), ContextPolicy(4, 64), speculative="lookup"))
    with pytest.raises(LocalLLMError, match="torch backend has it"):
        b.admit(Seq([1, 2, 3], SamplingParams(), speculative="self"))
    with pytest.raises(LocalLLMError, match="loaded with the draft model smollm2"):
        b.admit(Seq([1, 2, 3], SamplingParams(), speculative="draft:other"))


def test_a_draft_of_another_vocabulary_is_refused(gemma_model_path: Path, default_model_path: Path) -> None:
    from localllm.backends.llamacpp import LlamaCppBackend

    with pytest.raises(LocalLLMError, match="another vocabulary"):
        LlamaCppBackend(default_model_path, n_ctx=256, speculative="draft:gemma",
                        draft=("gemma", gemma_model_path))  # fmt: skip
