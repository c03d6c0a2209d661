"""The engine's contract, backend-agnostic: scripted fakes, and the real llama.cpp and torch backends.

Every generated token appears in exactly one chunk; chunk texts add up to the result; stop strings
are found across chunk borders; a cancel takes effect within one step; an overflow is refused with
the numbers; a field the backend lacks is refused, never ignored; a failure after the first token
ends that sequence with finish "error" and the model keeps serving.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from fakebackend import FakeRunner

from localllm.engine import Model, load
from localllm.errors import ContextOverflow, LocalLLMError, Unsupported
from localllm.types import Chunk, Request, SamplingParams


@pytest.fixture(scope="module")
def llamacpp(default_model_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Model]:
    mp = pytest.MonkeyPatch()
    mp.setenv("LOCALLLM_HOME", str(tmp_path_factory.mktemp("home")))
    m = load("smollm2", ctx=512, parallel=4)
    mp.undo()
    yield m
    m.close()


@pytest.fixture(scope="module")
def torch_engine(default_model_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Model]:
    mp = pytest.MonkeyPatch()
    mp.setenv("LOCALLLM_HOME", str(tmp_path_factory.mktemp("home")))
    m = load("smollm2", backend="torch", device="cpu", ctx=512, parallel=4)
    mp.undo()
    yield m
    m.close()


@pytest.fixture(params=["fake", "llama.cpp", "torch"])
def model(request: pytest.FixtureRequest) -> Iterator[Model]:
    if request.param in ("llama.cpp", "torch"):
        yield request.getfixturevalue("llamacpp" if request.param == "llama.cpp" else "torch_engine")
        return
    backend = FakeRunner(n_ctx=256)
    m = Model(backend, "fake")
    yield m
    m.close()


def is_fake(m: Model) -> bool:
    return m.backend.name == "fake"


def ask(m: Model, text: str, **kw: object) -> Request:
    """A raw prompt for the fakes (`say:` scripts them); a chat message for the real model."""
    sampling = SamplingParams(temperature=0, **kw)  # type: ignore[arg-type]
    if is_fake(m):
        return Request(prompt=text, sampling=sampling)
    return Request(messages=({"role": "user", "content": text},), sampling=sampling)


def drain(m: Model, request: Request) -> tuple[list[Chunk], object]:
    stream = m.submit(request)
    chunks = list(stream)
    return chunks, stream.result


def test_every_token_in_exactly_one_chunk(model: Model) -> None:
    chunks, result = drain(model, ask(model, "say:héllo, wörld — 日本語 ✓", max_tokens=40))
    assert result is not None and result.usage.completion_tokens > 0
    ids = [t for c in chunks for t in c.token_ids]
    assert tuple(ids) == result.token_ids
    assert "".join(c.text for c in chunks) == result.text
    assert sum(1 for c in chunks if c.result is not None) == 1 and chunks[-1].result is result
    if is_fake(model):
        assert result.text == "héllo, wörld — 日本語 ✓" and result.finish_reason == "stop"


def test_stop_string_across_chunk_borders(model: Model) -> None:
    first = model.submit(ask(model, "say:abcdefghijklmnop", max_tokens=30)).wait()
    pieces = [model.detokenize([t]) for t in first.token_ids]
    # a stop string that begins inside one token's text and ends inside a later one
    starts = [sum(len(p) for p in pieces[:i]) for i in range(len(pieces) + 1)]
    k = next(i for i in range(2, len(pieces)) if len(pieces[i - 1]) >= 1 and starts[i] > 1)
    stop = first.text[starts[k] - 1 : starts[k] + 2]
    assert len(stop) >= 2, first.text
    expected = first.text[: first.text.find(stop)]
    chunks, result = drain(model, ask(model, "say:abcdefghijklmnop", max_tokens=30, stop=(stop,)))
    assert result.finish_reason == "stop"
    assert result.text == expected
    assert "".join(c.text for c in chunks) == expected  # nothing of the stop string leaked
    assert tuple(t for c in chunks for t in c.token_ids) == result.token_ids


def _watch_steps(m: Model, *, pause: float = 0.0, fail_after: int | None = None) -> dict[str, int]:
    """Count the runner's forward passes (slowed by `pause` so a consumer keeps up with a fake);
    with `fail_after`, the pass after that many raises once and the runner's own comes back."""
    inner = m.runner.forward
    count = {"n": 0}

    def forward(pieces, **kw):  # noqa: ANN001, ANN003, ANN202
        count["n"] += 1
        if fail_after is not None and count["n"] == fail_after + 1:
            del m.runner.forward  # the class's own forward again
            raise RuntimeError("the device went away")
        time.sleep(pause)
        return inner(pieces, **kw)

    m.runner.forward = forward  # type: ignore[method-assign]
    return count


def test_cancel_takes_effect_within_one_step(model: Model) -> None:
    steps = _watch_steps(model, pause=0.01 if is_fake(model) else 0.0)
    try:
        stream = model.submit(ask(model, "say:" + "x" * 100, max_tokens=100))
        seen = 0
        for chunk in stream:
            seen += len(chunk.token_ids)
            if seen >= 3 and chunk.result is None:
                at_cancel = steps["n"]
                stream.cancel()
                break
        rest = list(stream)
        result = stream.result
        assert result.finish_reason == "cancelled"
        assert steps["n"] <= at_cancel + 1  # at most the step already under way
        assert rest[-1].result is result
    finally:
        del model.runner.forward


def test_overflow_is_refused_with_the_numbers(model: Model) -> None:
    n_ctx = model.n_ctx
    long = "say:" + "word " * (n_ctx * 2)
    with pytest.raises(ContextOverflow, match=f"holds {n_ctx}"):
        model.submit(ask(model, long, max_tokens=4)).wait()
    with pytest.raises(ContextOverflow, match="exceeds the context"):
        model.submit(ask(model, "say:hi", max_tokens=n_ctx)).wait()
    assert model.submit(ask(model, "say:ok", max_tokens=4)).wait().usage.completion_tokens > 0


def test_fields_the_backend_lacks_are_refused(model: Model) -> None:
    base = ask(model, "say:hi", max_tokens=4)
    from dataclasses import replace

    if not model.capabilities.grammar:  # the real engines have it (llguidance: test_structured.py)
        with pytest.raises(Unsupported, match="response_format json_object"):
            model.submit(replace(base, response_format={"type": "json_object"}))
    for mode, spec in (("lookup", "lookup"), ("self", "self"), ("draft", "draft:other"), ("head", "head")):
        if mode not in model.capabilities.speculative:
            with pytest.raises(Unsupported, match=f"speculative mode '{mode}'"):
                model.submit(replace(base, speculative=spec))
    if base.messages is not None and not model.capabilities.grammar:
        tools = ({"type": "function", "function": {"name": "f", "parameters": {}}},)
        with pytest.raises(Unsupported, match="tool_choice"):
            model.submit(replace(base, tools=tools, tool_choice="required"))
    # what the backend has is accepted
    assert model.submit(replace(base, response_format={"type": "text"})).wait().text is not None


def test_failure_mid_stream_gives_finish_error_and_the_model_lives(model: Model) -> None:
    before = model.submit(ask(model, "say:abcdefghij", max_tokens=8)).wait()
    if is_fake(model):
        request = ask(model, "FAIL@4 say:abcdefghij", max_tokens=8)  # the runner raises
        said = "scripted failure"
    else:
        # prefill is one step for a short prompt; fail three decode steps later
        _watch_steps(model, fail_after=4)
        request, said = ask(model, "say:abcdefghij", max_tokens=8), "the device went away"
    chunks, result = drain(model, request)
    assert result.finish_reason == "error" and said in result.error
    assert 0 < result.usage.completion_tokens < 8
    assert tuple(t for c in chunks for t in c.token_ids) == result.token_ids
    assert result.to_dict()["error"] == result.error
    after = model.submit(ask(model, "say:abcdefghij", max_tokens=8)).wait()
    assert after.finish_reason == before.finish_reason and after.text == before.text


def test_failure_before_the_first_token_is_raised(model: Model) -> None:
    _watch_steps(model, fail_after=0)
    with pytest.raises(LocalLLMError, match="the device went away"):
        model.submit(ask(model, "say:abc", max_tokens=4)).wait()
    assert model.submit(ask(model, "say:abc", max_tokens=4)).wait().usage.completion_tokens > 0


# -- the scheduler, watched through the scripted batch backend ------------------------------------


def test_concurrent_requests_each_get_their_own_answer() -> None:
    backend = FakeRunner(n_ctx=512, n_slots=4, max_batch=32)
    with Model(backend, "fake") as m:
        answers = [f"answer number {i} " * (i + 1) for i in range(8)]
        streams = [m.submit(Request(prompt=f"q{i} say:{a}", sampling=SamplingParams(temperature=0)))
                   for i, a in enumerate(answers)]  # fmt: skip
        results = [s.wait() for s in streams]
    assert [r.text for r in results] == answers
    assert all(len(p) <= 4 for p in backend.plans)
    assert max(len(p) for p in backend.plans) == 4  # they really ran side by side
    assert not any(s.busy for s in m.slots.all)


def test_a_long_prompt_is_prefilled_in_chunks_beside_running_decodes() -> None:
    backend = FakeRunner(n_ctx=8192, n_slots=4, max_batch=64, step_s=0.002)
    with Model(backend, "fake") as m:
        sampling = SamplingParams(temperature=0)
        running = [m.submit(Request(prompt=f"r{i} say:" + "y" * 300, sampling=sampling))
                   for i in range(3)]  # fmt: skip
        for s in running:
            next(s)  # all three are decoding
        long = m.submit(Request(prompt="z" * 4000 + " say:done", sampling=sampling))
        assert long.wait().text == "done"
        for s in running:
            s.cancel()
            s.wait()
    slot = next(iter({*range(4)} - {0, 1, 2}))
    prefill = [i for i, p in enumerate(backend.plans) if p.get(slot, 0) > 1]
    assert len(prefill) > 4000 // 64  # in chunks, never more than max_batch at once
    # every prefill step still decoded the three running sequences (the pass after its chunk)
    assert all(sum(1 for s, n in backend.plans[i + 1].items() if n == 0 and s != slot) == 3
               for i in prefill)  # fmt: skip


def test_cancelled_requests_free_their_slots_for_waiting_ones() -> None:
    backend = FakeRunner(n_ctx=1024, n_slots=4, max_batch=32, step_s=0.001)
    with Model(backend, "fake") as m:
        sampling = SamplingParams(temperature=0)
        long = [m.submit(Request(prompt=f"l{i} say:" + "z" * 500, sampling=sampling))
                for i in range(4)]  # fmt: skip
        waiting = [m.submit(Request(prompt=f"w{i} say:short", sampling=sampling))
                   for i in range(3)]  # fmt: skip
        next(long[0])
        for s in long[:3]:
            s.cancel()
        assert [w.wait().text for w in waiting] == ["short"] * 3  # they got the freed slots
        assert all(s.wait().finish_reason == "cancelled" for s in long[:3])
        long[3].cancel()
        long[3].wait()
    assert not any(s.busy for s in m.slots.all)


def test_a_request_cancelled_while_waiting_ends_without_a_slot() -> None:
    backend = FakeRunner(n_ctx=1024, n_slots=1, step_s=0.001)
    with Model(backend, "fake") as m:
        sampling = SamplingParams(temperature=0)
        busy = m.submit(Request(prompt="say:" + "a" * 800, sampling=sampling))
        waiting = m.submit(Request(prompt="say:b", sampling=sampling))
        next(busy)
        waiting.cancel()
        result = waiting.wait()  # while the only slot is still busy
        assert result.finish_reason == "cancelled" and result.usage.completion_tokens == 0
        assert [s.busy for s in m.slots.all] == [True]
        busy.cancel()
        busy.wait()


def test_closing_the_model_ends_running_and_waiting_requests() -> None:
    backend = FakeRunner(n_ctx=1024, n_slots=1, step_s=0.001)
    m = Model(backend, "fake")
    sampling = SamplingParams(temperature=0)
    a = m.submit(Request(prompt="say:" + "a" * 800, sampling=sampling))
    b = m.submit(Request(prompt="say:b", sampling=sampling))
    next(a)
    m.close()
    assert a.wait().finish_reason == "cancelled"
    with pytest.raises(LocalLLMError, match="closed"):
        b.wait()
    assert backend.closed
