"""The llama.cpp backend through the engine, against llama-cpp-python itself as the oracle."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

from localllm.backends.llamacpp import default_threads
from localllm.cli import main
from localllm.engine import Model, load
from localllm.errors import ContextOverflow, LocalLLMError
from localllm.types import ContextPolicy, Request, SamplingParams

from conftest import need

PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "List three uses for a paperclip.",
]
RAW = ["Once upon a time", "The three laws of robotics are", "def fibonacci(n):"]


@pytest.fixture(scope="module")
def reference(default_model_path: Path):  # noqa: ANN201
    need("llama_cpp", "pip install -e '.[dev]'")
    import llama_cpp

    llm = llama_cpp.Llama(
        str(default_model_path), n_ctx=4096, n_threads=default_threads(), flash_attn=True,
        verbose=False,
    )  # fmt: skip
    yield llm
    llm.close()


@pytest.fixture(scope="module")
def model(default_model_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Model:
    mp = pytest.MonkeyPatch()
    mp.setenv("LOCALLLM_HOME", str(tmp_path_factory.mktemp("home")))
    m = load("smollm2")
    mp.undo()
    yield m
    m.close()


def run_cli(args: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    with pytest.raises(SystemExit) as exc:
        main(args)
    out, err = capsys.readouterr()
    return exc.value.code, out, err


@pytest.mark.parametrize("prompt", PROMPTS)
def test_golden_run_equals_create_chat_completion(prompt: str, reference, capsys) -> None:  # noqa: ANN001
    want = reference.create_chat_completion(
        [{"role": "user", "content": prompt}], max_tokens=64, temperature=0
    )
    rc, out, err = run_cli(
        ["run", "smollm2", prompt, "--temperature", "0", "--max-tokens", "64"], capsys
    )
    assert rc == 0, err
    assert out == want["choices"][0]["message"]["content"] + "\n"


@pytest.mark.parametrize("prompt", RAW)
def test_golden_raw_equals_create_completion(prompt: str, reference, capsys) -> None:  # noqa: ANN001
    want = reference.create_completion(prompt, max_tokens=64, temperature=0)
    rc, out, err = run_cli(
        ["run", "smollm2", prompt, "--raw", "--temperature", "0", "--max-tokens", "64"], capsys
    )
    assert rc == 0, err
    assert out == want["choices"][0]["text"] + "\n"


def test_python_api(model: Model, reference) -> None:  # noqa: ANN001
    chunks = list(model.stream("Once upon a time", max_tokens=16, temperature=0))
    result = chunks[-1].result
    assert result is not None and all(c.result is None for c in chunks[:-1])
    assert "".join(c.text for c in chunks) == result.text
    assert result.finish_reason == "length" and result.usage.completion_tokens == 16
    assert result.usage.prompt_tokens == len(model.tokenize("Once upon a time"))
    reply = model.chat([{"role": "user", "content": PROMPTS[0]}], max_tokens=32, temperature=0)
    want = reference.create_chat_completion(
        [{"role": "user", "content": PROMPTS[0]}], max_tokens=32, temperature=0
    )
    assert reply.text == want["choices"][0]["message"]["content"]
    assert (
        reply.timings.ttft_s > 0 and reply.timings.tokens_per_s(reply.usage.completion_tokens) > 0
    )
    assert model.complete("Once upon a time", max_tokens=16, temperature=0).text == result.text


def test_prefix_cache_is_reused(model: Model) -> None:
    msgs = [{"role": "user", "content": "Tell me about whales."}]
    model.chat(msgs, max_tokens=4, temperature=0)
    again = model.chat(msgs, max_tokens=4, temperature=0)
    assert again.usage.cached_tokens == again.usage.prompt_tokens - 1


def test_seeded_sampling_is_reproducible(model: Model) -> None:
    a = model.complete("The weather today", max_tokens=24, temperature=0.9, seed=7).text
    b = model.complete("The weather today", max_tokens=24, temperature=0.9, seed=7).text
    c = model.complete("The weather today", max_tokens=24, temperature=0.9, seed=8).text
    assert a == b and a != c


def test_stop_strings(model: Model) -> None:
    full = model.complete("1, 2, 3, 4,", max_tokens=24, temperature=0).text
    assert " 7," in full
    cut = model.complete("1, 2, 3, 4,", max_tokens=24, temperature=0, stop=[" 7"])
    assert cut.finish_reason == "stop" and cut.text == full[: full.index(" 7")]


def test_logprobs(model: Model) -> None:
    r = model.complete("The capital of France is", max_tokens=3, temperature=0, logprobs=3)
    assert r.logprobs is not None and len(r.logprobs) == 3
    for lp in r.logprobs:
        assert lp.logprob <= 0 and len(lp.top) == 3
        assert lp.logprob == pytest.approx(lp.top[0][1])  # greedy picks the most likely token


def test_cancel_mid_generation_within_one_token(model: Model) -> None:
    stream = model.submit(
        Request(prompt="Chapter 1.", sampling=SamplingParams(temperature=0, max_tokens=400))
    )
    seen = 0
    for chunk in stream:
        if chunk.result is None:
            seen += 1
            if seen == 5:
                stream.cancel()
    result = stream.result
    assert result.finish_reason == "cancelled"
    assert 5 <= result.usage.completion_tokens <= 6
    # still usable, and gives the same answer as before
    assert (
        model.complete("Once upon a time", max_tokens=16, temperature=0).finish_reason == "length"
    )


def test_cancel_from_another_thread(model: Model) -> None:
    stream = model.submit(
        Request(prompt="Chapter 1.", sampling=SamplingParams(temperature=0, max_tokens=400))
    )
    first = next(stream)
    threading.Timer(0.05, stream.cancel).start()
    result = stream.wait()
    assert (
        first.text is not None
        and result.finish_reason == "cancelled"
        and result.usage.completion_tokens < 400
    )


def test_context_overflow_is_refused_with_numbers(corpus_dir: Path, capsys) -> None:  # noqa: ANN001
    long = (corpus_dir / "moby_dick_part.txt").read_text()[20_000:24_000]
    with load("smollm2", ctx=256) as m:
        with pytest.raises(
            ContextOverflow, match=r"the prompt has \d+ tokens but the context holds 256"
        ):
            m.complete(long, max_tokens=8)
        with pytest.raises(ContextOverflow, match=r"\+ max_tokens \(300\)"):
            m.complete("Hello", max_tokens=300)
    rc, out, err = run_cli(
        ["run", "smollm2", long, "--raw", "--ctx", "256", "--max-tokens", "8"], capsys
    )
    assert rc == 1 and err.count("\n") == 1 and "context holds 256" in err


def test_streaming_policy_runs_past_the_context(corpus_dir: Path) -> None:
    """With --streaming 4:W the cache shifts: a prompt + generation of 3x the context completes."""
    text = (corpus_dir / "moby_dick_part.txt").read_text()[30_000:32_600]
    with load("smollm2", ctx=256, streaming="4:200") as m:
        n_prompt = len(m.tokenize(text))
        assert n_prompt > 2 * m.n_ctx
        r = m.complete(text, max_tokens=max(64, 3 * m.n_ctx - n_prompt + 16), temperature=0)
    assert r.usage.prompt_tokens + r.usage.completion_tokens >= 3 * 256 or r.finish_reason == "stop"
    assert r.context_shifts > 0 and r.discarded_tokens > 0
    assert r.finish_reason in ("length", "stop") and r.text.strip()


def test_capabilities_refuse_clearly() -> None:
    with pytest.raises(
        LocalLLMError, match="no speculative mode 'self' .*; the torch backend has it"
    ):
        load("smollm2", speculative="self", backend="llama.cpp")
    with pytest.raises(LocalLLMError, match="no int4 KV cache .*; the torch backend has it"):
        load("smollm2", kv_cache="int4", backend="llama.cpp")
    with pytest.raises(LocalLLMError, match="no q5_k KV cache|unknown KV cache type 'q5_k'"):
        load("smollm2", kv_cache="q5_k")
    with pytest.raises(LocalLLMError, match="bad --streaming"):
        ContextPolicy.parse("4")


def test_embeddings(model: Model) -> None:
    import math

    a, b, c = model.embed(
        ["The cat sat on the mat.", "A cat is sitting on a mat.", "Quarterly tax filing deadlines"]
    )
    assert len(a) == 576 and math.isclose(sum(x * x for x in a), 1.0, rel_tol=1e-4)
    dot = lambda u, v: sum(x * y for x, y in zip(u, v))  # noqa: E731
    assert dot(a, b) > dot(a, c)
    assert model.embed("The cat sat on the mat.")[0] == pytest.approx(a, abs=1e-5)
    with pytest.raises(ContextOverflow):
        model.embed(["word " * 5000])


def test_a_prompt_batch_equals_token_by_token(default_model_path: Path) -> None:
    """The oracle that needs no other program: evaluating a prompt in one batch or one token at a
    time must give the same next-token distribution. llama.cpp's non-flash attention with an f16
    cache broke this on an AMD EPYC here (and so did every answer's first tokens). Driven through
    the runner's own forward pass: one piece of the whole prompt, or one piece per token."""
    from localllm.backends.base import Piece
    from localllm.backends.llamacpp import LlamaCppRunner
    from localllm.engine.sampling import logprobs

    prompt = "<|im_start|>user\nSay hello<|im_end|>\n<|im_start|>assistant\n"
    r = LlamaCppRunner(default_model_path, n_ctx=256)
    try:
        ids = r.tokenize(prompt, add_special=False)
        assert 1 < len(ids) <= r.max_batch  # one piece is one batch

        def first_token(per_piece: int) -> tuple[int, dict[int, float]]:
            """The greedy first token and the 20 likeliest tokens' logprobs after the prompt."""
            r.clear(0)
            for i in range(0, len(ids), per_piece):
                row = r.forward([Piece(0, ids[i : i + per_piece], 1)]).logits[0]
            assert r.held(0) == len(ids)
            token = int(row.argmax())
            return token, dict(logprobs(row, token, 20)[1])

        (batch, top_b), (single, top_s) = first_token(len(ids)), first_token(1)
    finally:
        r.close()
    assert batch == single
    common = top_b.keys() & top_s.keys()
    assert len(common) >= 15
    scale = max(1.0, max(abs(v) for v in top_s.values()))
    assert max(abs(top_b[t] - top_s[t]) for t in common) <= 1e-2 * scale
