"""Speculative decoding by the engine over the torch runner (issue 13; issue 32: the engine owns
decoding): every drafter driven with a real `TorchRunner`, through `localllm.engine.load`.
Greedy output with drafts is plain greedy output (fp32); sampled output is distributed as plain
sampling's; a layer-skip draft leaves every layer's cache as it was; a draft model catches up
with the target's slot and trims what it drafted past it; the pace drafts what pays and switches
itself off; `tune` stores its result and reads it back; the `self` mode decodes plainly where
tuning found it does not pay. The accept rule itself, on crafted rows, is tests/engine/
test_accept.py's (greedy exactness, first and bonus tokens distributed as the target's)."""

from __future__ import annotations

import json
import math
import threading
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from chisquare import chi2_sf

from conftest import in_home, need

need("torch", "pip install -e '.[dev]' (torch: pip install torch==2.13.0 first)")

import torch  # noqa: E402

from localllm.backends.base import Piece  # noqa: E402
from localllm.backends.torch.runner import TorchRunner  # noqa: E402
from localllm.engine import Model, load, tune  # noqa: E402
from localllm.engine.sampling import Sampler  # noqa: E402
from localllm.engine.scoring import teacher_argmax  # noqa: E402
from localllm.engine.slots import Slot  # noqa: E402
from localllm.engine.speculative import DraftModel, LayerSkip, Lookup, Pace  # noqa: E402
from localllm.errors import LocalLLMError  # noqa: E402
from localllm.models_registry.store import Store  # noqa: E402
from localllm.types import ContextPolicy, Request, Result, SamplingParams  # noqa: E402

P_MIN = 1e-3  # a chi-square p-value below this fails (the seeds are fixed: no flaky runs)
ATOL = 1e-4  # float32 keys, values and logits of the same tokens evaluated in other batches


# -- the drafters' bookkeeping, without a model ------------------------------------------------


def test_lookup_proposes_what_followed_the_latest_match() -> None:
    lookup = Lookup()
    text = [5, 6, 7, 8, 9, 1, 5, 6, 7]
    assert lookup.lookup(text, 3) == [8, 9, 1]  # 3-gram 5 6 7
    assert lookup.lookup([*text, 8, 4, 2, 7], 2) == [8, 4]  # 1-gram 7: its latest match
    assert Lookup().lookup([1, 2, 3], 4) == []
    seq = Live(Slot(0), [1, 2, 3, 1, 2], Sampler(SamplingParams(temperature=0)))
    draft = Lookup().propose(seq, 5)  # what a sequence proposes: from its history
    assert draft.tokens == [3, 1, 2] and draft.q is None


def test_pace_drafts_what_pays_pauses_and_switches_off() -> None:
    """The draft length maximises the predicted speed-up from the measured acceptance and cost;
    where nothing pays it pauses, doubling; it gives up after `WINDOW` rounds that kept nothing
    (a modelling drafter), or when the measured speed falls below plain decoding's."""
    pace = Pace(10, 4)
    assert pace.want() == 0  # plain first: its cost is not known yet
    pace.plain(0.010)
    assert pace.want() == 4
    pace.verified(4, 4, 0.011)  # all kept, a drafted token costs 2.5% of a pass
    assert pace.k == 10 and pace.want() == 10
    for _ in range(3):
        pace.verified(10, 1, 0.030)  # α falls, and a drafted token costs 20% of a pass
    assert pace.k < 4
    costly = Pace(10, 4)
    costly.plain(0.010)
    costly.verified(4, 0, 0.040)  # nothing kept, 75% of a pass per drafted token
    assert costly.wait == 1 and costly.want() == 0  # a pause of one plain pass
    costly.plain(0.010)
    costly.verified(costly.k, 0, 0.030)
    assert costly.wait == 2  # then two
    wrong = Pace(4, 4)
    wrong.plain(0.010)
    for _ in range(Pace.WINDOW):
        wrong.wait = 0
        wrong.verified(1, 0, 0.0101)
    assert not wrong.on and "rejected" in wrong.reason and wrong.want() == 0
    lookup = Pace(4, 4, give_up=False)  # lookup does not give up on rejections alone
    lookup.plain(0.010)
    for _ in range(Pace.WINDOW):
        lookup.wait = 0
        lookup.verified(1, 0, 0.0101)
    assert lookup.on
    slow = Pace(4, 4)
    for _ in range(Pace.SPAN // 2):
        slow.plain(0.01)
    for _ in range(Pace.WINDOW):
        slow.wait = 0
        slow.verified(2, 1, 0.05)  # 2 tokens in 5 plain passes' time
    assert not slow.on and "more time than plain" in slow.reason


# -- helpers ---------------------------------------------------------------------------------------


class Live:
    """What a drafter reads of the engine's live sequence: its slot (the target's cache holds
    `slot.tokens`), its sampler, prompt + generated (`history`) and the last sampled token (not
    yet evaluated)."""

    def __init__(self, slot: Slot, history: list[int], sampler: Sampler) -> None:
        self.slot, self.history, self.sampler = slot, list(history), sampler
        self.last = history[-1]


class Counting:
    """A runner seen through a proxy that notes how many tokens each forward evaluated."""

    def __init__(self, runner: Any) -> None:
        self.inner = runner
        self.fed: list[int] = []

    def forward(self, pieces: Any, **kw: Any) -> Any:
        self.fed.append(sum(len(p.tokens) for p in pieces))
        return self.inner.forward(pieces, **kw)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


class Rounds(Pace):
    """A pace that asks for `k_max` drafts every pass (no pause: what is tested is the drafter and
    the verification, not the timings of a shared machine) while it is on, and notes every
    round: (drafted, accepted)."""

    def __init__(self, k_max: int, k: int | None = None, **kw: Any) -> None:
        super().__init__(k_max, k, **kw)
        self.log: list[tuple[int, int]] = []

    def want(self) -> int:
        return self.k_max if self.on else 0

    def verified(self, drafted: int, accepted: int, seconds: float, tokens: int = 0) -> None:
        self.log.append((drafted, accepted))
        super().verified(drafted, accepted, seconds, tokens)


def generate(llm: Model, prompt: str, n: int, *, drafter: Any = None, pace: Pace | None = None,
             **sampling: Any) -> Result:  # fmt: skip
    """n tokens through the engine's own request path (`complete`), greedy unless `sampling`
    says otherwise; with `drafter` and `pace` as the sequence's speculation, drafting from the
    first decode pass (the pace is told a plain pass took a second)."""
    kw: dict[str, Any] = {"temperature": 0, "ignore_eos": True, **sampling}
    if drafter is None:
        return llm.complete(prompt, max_tokens=n, speculative="off", **kw)
    assert pace is not None

    def forced(spec: str | None, policy: ContextPolicy) -> tuple[Any, Pace]:
        pace.plain(1.0)
        return drafter, pace

    llm._drafter = forced  # type: ignore[method-assign]
    try:
        return llm.complete(prompt, max_tokens=n, speculative="lookup", **kw)
    finally:
        del llm._drafter


def idle(llm: Model) -> None:
    """Wait until every slot is free (a result reaches its consumer just before its slot is
    released); a slot still busy after that is a leak."""
    end = time.monotonic() + 30
    while any(s.busy for s in llm.slots.all):
        assert time.monotonic() < end, "a slot stayed busy"
        time.sleep(0.005)


def fresh(llm: Model) -> None:
    """Every cache forgotten: the free slots', the draft runner's and the prefix cache's."""
    idle(llm)
    if llm.prefix_cache is not None:
        llm.prefix_cache.clear()
    llm.drop_caches()


def offsets(runner: TorchRunner, slot: int) -> list[int]:
    """Positions every layer's cache of the slot holds (`held` reads only the first layer's)."""
    return [c.offset for c in runner._caches[slot]]


def _flat(state: Any) -> list[torch.Tensor]:
    """The tensors of a cache's state, empty ones left out (buffers a store made but holds
    nothing in)."""
    if state is None:
        return []
    if isinstance(state, torch.Tensor):
        return [state] if state.numel() else []
    return [t for s in state for t in _flat(s)]


# -- the real model --------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def llm(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Model]:
    """SmolLM2 in float32 (greedy is exactly reproducible there) through `load`, two slots, with
    the 2-layer random-weight model that shares its vocabulary as its draft model."""
    with in_home(tmp_path_factory.mktemp("home")):
        Store().add_file(tiny_llama, "tiny", source="file:x")
        m = load("smollm2", backend="torch", ctx=1024, dtype="f32", kv_cache="f32", threads=2,
                 parallel=2, speculative="draft:tiny")  # fmt: skip
    yield m
    m.close()


@pytest.fixture(scope="module")
def same(llm: Model, default_model_path: Path) -> Iterator[TorchRunner]:
    """A second runner of the target's own file and precision: a draft model identical to it."""
    r = TorchRunner(default_model_path, n_ctx=llm.n_ctx, n_slots=llm.runner.n_slots, dtype="f32",
                    kv_cache="f32", threads=2)  # fmt: skip
    yield r
    r.close()


PROMPTS = [
    "The capital of France is Paris. The capital of Germany is Berlin. The capital of France is",
    "def add(a, b):\n    return a + b\n\n\ndef add(a, b):\n",
    "Once upon a time, a little fox lived in the woods.",
]


def test_the_loaded_model_has_its_draft_runner(llm: Model) -> None:
    assert isinstance(llm.runner, TorchRunner) and isinstance(llm.draft, TorchRunner)
    assert llm.draft_name == "tiny" and llm.draft.n_layers == 2 and llm.runner.n_layers == 30
    assert llm.draft.n_slots == llm.runner.n_slots == 2
    drafter, pace = llm._drafter("draft:tiny", ContextPolicy())
    assert isinstance(drafter, DraftModel) and drafter.runner is llm.draft and pace.on
    assert llm._drafter("draft:tiny", ContextPolicy())[0] is drafter  # one per model


@pytest.mark.parametrize("which", range(len(PROMPTS)), ids=["facts", "code", "story"])
def test_greedy_output_is_plain_greedy_for_every_drafter(llm: Model, same: TorchRunner,
                                                         which: int) -> None:  # fmt: skip
    """fp32, 32 tokens: lookup, layer skip (two skip sets), the random-weight draft model
    (rejects at the first token nearly always) and the model as its own draft (accepts
    everything) all give plain greedy's tokens; each drafter meets k = 1, 3 and 8 over the
    three prompts."""
    prompt, n = PROMPTS[which], 32
    plain = generate(llm, prompt, n)
    assert plain.usage.completion_tokens == n and plain.speculative is None
    drafters = {
        "lookup": Lookup(),
        "self-few": LayerSkip(llm.runner, (3, 4, 5)),
        "self-many": LayerSkip(llm.runner, tuple(range(4, 26))),
        "draft-random": llm._drafter("draft:tiny", ContextPolicy())[0],
        "draft-same": DraftModel(same),
    }
    for i, (name, drafter) in enumerate(drafters.items()):
        k = (1, 3, 8)[(i + which) % 3]
        pace = Rounds(k, k)
        got = generate(llm, prompt, n, drafter=drafter, pace=pace)
        assert got.token_ids == plain.token_ids, (name, k)
        sp = got.speculative
        assert sp is not None and sp.rounds == len(pace.log) > 0, name
        assert sp.drafted == sum(d for d, _ in pace.log), name
        assert sp.accepted == sum(a for _, a in pace.log), name
        # the first decode pass drafted k (a lookup drafts what it finds: at most k)
        assert pace.log[0][0] <= k and (name == "lookup" or pace.log[0][0] == k), name
        assert sp.passes + sp.accepted == n - 1, name  # every token after the first
        if name == "draft-same":
            assert all(a == d for d, a in pace.log), name  # all accepted
            assert sp.passes <= -(-n // (k + 1)) + 1
        if name == "draft-random":
            assert any(a == 0 for _, a in pace.log), name  # a first-token rejection
    idle(llm)
    assert not any(s.busy for s in llm.slots.all)


def test_greedy_with_penalties_is_plain(llm: Model) -> None:
    """Penalties judge each verified row after the drafts kept before it: with drafts, the
    penalised greedy text is the one without. (Prompt lookup's drafts are all rejected here:
    the penalties steer the text away from what it copies.)"""
    penalties = {"repeat_penalty": 1.3, "frequency_penalty": 0.2}
    plain = generate(llm, PROMPTS[0], 40, **penalties)
    assert plain.token_ids != generate(llm, PROMPTS[0], 40).token_ids  # the penalties matter here
    for drafter in (Lookup(), LayerSkip(llm.runner, (3, 4, 5, 16, 17))):
        pace = Rounds(4, 4)
        got = generate(llm, PROMPTS[0], 40, drafter=drafter, pace=pace, **penalties)
        assert got.token_ids == plain.token_ids
        sp = got.speculative
        assert sp.rounds > 0 and sp.rejections > 0
        assert isinstance(drafter, Lookup) or sp.accepted > 0


@pytest.mark.parametrize("kv", ["f32", "int8", "int4"])
def test_a_draft_leaves_the_caches_as_they_were(default_model_path: Path, kv: str) -> None:
    """Layer-skip drafting writes into the kept layers' caches; after it every layer's cache
    holds the positions it held, bit for bit (the int4 cache with its residual crossing a group
    border), and the next token's logits are bit for bit those of a slot that never drafted."""
    r = TorchRunner(default_model_path, n_ctx=512, n_slots=2, dtype="f32", kv_cache=kv, threads=2)
    try:
        prompt = list(range(100, 100 + 190))  # 190: KIVI quantizes none yet; 6 drafts will a group
        logits = r.forward([Piece(0, prompt, 1)]).logits
        assert np.array_equal(r.forward([Piece(1, prompt, 1)]).logits, logits)  # the reference
        last = int(logits[0].argmax())
        before = [tuple(t.clone() for t in _flat(c.state)) for c in r._caches[0]]
        assert offsets(r, 0) == [190] * r.n_layers
        greedy = Sampler(SamplingParams(temperature=0))
        seq = Live(Slot(0, list(prompt)), [*prompt, last], greedy)
        draft = LayerSkip(r, (3, 4, 5, 16)).propose(seq, 6)
        assert len(draft.tokens) == 6 and draft.q is None
        assert seq.history == [*prompt, last]  # the drafter works on a copy
        assert r.held(0) == 190 and offsets(r, 0) == [190] * r.n_layers
        for c, want in zip(r._caches[0], before):
            got = _flat(c.state)
            assert len(got) == len(want) and all(torch.equal(x, y) for x, y in zip(got, want))
        # a confident-enough threshold no token meets: one draft token, and the caches again
        sure = LayerSkip(r, (3, 4, 5, 16), confidence=1.0).propose(seq, 6)
        assert sure.tokens == draft.tokens[:1] and offsets(r, 0) == [190] * r.n_layers
        got = r.forward([Piece(0, [last], 1)]).logits
        want = r.forward([Piece(1, [last], 1)]).logits
        assert np.array_equal(got, want)
    finally:
        r.close()


def test_rolled_back_caches_equal_a_run_that_never_drafted(llm: Model) -> None:
    """After 30 tokens with rejections along the way, every layer's cache of the slot holds the
    prompt and every token but the last sampled one, with the keys and values a fresh
    evaluation of them gives (to float32 rounding: verification computes several positions in
    one matmul), and the next token's logits are that evaluation's."""
    prompt = PROMPTS[0]
    fresh(llm)
    plain = generate(llm, prompt, 30)
    fresh(llm)
    pace = Rounds(4, 4)
    r = generate(llm, prompt, 30, drafter=LayerSkip(llm.runner, tuple(range(6, 22))), pace=pace)
    assert r.token_ids == plain.token_ids
    assert any(a < d for d, a in pace.log) and r.speculative.rejections > 0
    idle(llm)
    used = [s for s in llm.slots.all if s.tokens]
    assert len(used) == 1
    slot, runner = used[0], llm.runner
    assert slot.exact and slot.tokens == llm.tokenize(prompt) + list(r.token_ids[:-1])
    held = len(slot.tokens)
    assert runner.held(slot.sid) == held and offsets(runner, slot.sid) == [held] * runner.n_layers
    with llm.slot_for_work() as other:  # holds the scheduler: no step runs meanwhile
        assert other != slot.sid and runner.held(other) == 0
        for i in range(0, held, runner.max_batch):
            runner.forward([Piece(other, slot.tokens[i : i + runner.max_batch], 0)])
        spec, ref = ([c.state for c in runner._caches[s]] for s in (slot.sid, other))
        for (k1, v1), (k2, v2) in zip(spec, ref):
            assert k1.shape == k2.shape and v1.shape == v2.shape
            assert torch.allclose(k1, k2, atol=ATOL) and torch.allclose(v1, v2, atol=ATOL)
        want = runner.forward([Piece(other, [r.token_ids[-1]], 1)]).logits
        got = runner.forward([Piece(slot.sid, [r.token_ids[-1]], 1)]).logits
        assert runner.trim(slot.sid, 1) and runner.held(slot.sid) == held
    assert np.abs(got - want).max() <= ATOL and got.argmax() == want.argmax()


def test_a_draft_model_catches_up_and_trims(tiny_llama: Path) -> None:
    """The draft model's slot follows the target's: it evaluates only what the target's slot
    gained since its last draft (trimming its own drafted tokens past what was accepted), starts
    over where the target's slot took another prefix or its own cache was cleared, and proposes
    nothing for a shifted slot. Its drafts are the greedy choices of a fresh evaluation."""
    inner = TorchRunner(tiny_llama, n_ctx=128, n_slots=2, max_batch=16, dtype="f32",
                        kv_cache="f32", threads=2)  # fmt: skip
    r = Counting(inner)
    try:
        dm = DraftModel(r)
        greedy = Sampler(SamplingParams(temperature=0))
        prompt = [int(t) for t in np.random.default_rng(3).integers(100, 5000, 40)]
        d1 = dm.propose(Live(Slot(0, prompt[:-1]), prompt, greedy), 5)
        assert len(d1.tokens) == 5 and d1.q is None
        assert dm.held[0] == [*prompt, *d1.tokens[:4]] and inner.held(0) == 44
        # the prompt in pieces of max_batch, then the last token and each draft one by one
        assert r.fed == [16, 16, 7, 1, 1, 1, 1, 1]  # fmt: skip
        # two drafts kept, then the target's own token: the third and fourth are trimmed
        t = (d1.tokens[2] + 1) % inner.n_vocab
        history = [*prompt, *d1.tokens[:2], t]
        r.fed.clear()
        d2 = dm.propose(Live(Slot(0, history[:-1]), history, greedy), 3)
        assert r.fed == [1, 1, 1]  # t and two drafts: nothing of what it held again
        assert dm.held[0] == [*history, *d2.tokens[:2]] and inner.held(0) == len(history) + 2
        # its drafts and its cache are what a fresh evaluation in another slot gives
        text = [*history, *d2.tokens]
        inner.clear(1)
        rows = inner.forward([Piece(1, text, len(text))]).logits
        argmax = rows.argmax(-1)
        assert d1.tokens[:3] == [int(x) for x in argmax[len(prompt) - 1 : len(prompt) + 2]]
        assert d2.tokens == [int(x) for x in argmax[len(history) - 1 : len(history) + 2]]
        got = inner.forward([Piece(0, [d2.tokens[-1]], 1)]).logits
        assert np.abs(got[0] - rows[-1]).max() <= ATOL
        assert inner.trim(0, 1) and inner.held(0) == len(dm.held[0])
        # another prompt sharing the first 20 tokens: trimmed to them, the rest evaluated
        other = [*prompt[:20], *[(x + 7) % inner.n_vocab for x in prompt[20:30]]]
        r.fed.clear()
        d3 = dm.propose(Live(Slot(0, other[:-1]), other, greedy), 2)
        assert r.fed == [9, 1, 1] and inner.held(0) == len(other) + 1
        assert dm.held[0] == [*other, d3.tokens[0]]
        # its cache cleared behind its back (the engine's drop_caches): all again, from empty
        inner.clear(0)
        r.fed.clear()
        d4 = dm.propose(Live(Slot(0, other[:-1]), other, greedy), 2)
        assert r.fed == [16, 13, 1, 1] and d4.tokens == d3.tokens
        assert dm.held[0] == [*other, d3.tokens[0]] and inner.held(0) == len(other) + 1
        # a shifted target slot: no exact prefix to follow, no draft, nothing evaluated
        r.fed.clear()
        assert dm.propose(Live(Slot(0, [], exact=False), other, greedy), 4).tokens == []
        assert r.fed == []
        # sampling: each draft token drawn from the processed distribution kept in q
        sampler = Sampler(SamplingParams(temperature=1.0, top_k=5, top_p=1.0, min_p=0.0, seed=1))
        d5 = dm.propose(Live(Slot(1, prompt[:-1]), prompt, sampler), 4)
        assert len(d5.tokens) == 4 and d5.q is not None and len(d5.q) == 4
        for x, q in zip(d5.tokens, d5.q):
            assert q.sum() == pytest.approx(1.0) and np.count_nonzero(q) <= 5 and q[x] > 0
    finally:
        inner.close()


def test_a_draft_model_drafts_within_its_own_context(tiny_llama: Path) -> None:
    """A draft model's runner may hold fewer positions than the target's (its file's context is
    smaller): it drafts what room it has left, and nothing once the target's slot holds more
    than it can (no exception: there is just no draft)."""
    r = TorchRunner(tiny_llama, n_ctx=64, n_slots=1, dtype="f32", kv_cache="f32", threads=2)
    try:
        dm = DraftModel(r)
        greedy = Sampler(SamplingParams(temperature=0))
        text = [int(t) for t in np.random.default_rng(5).integers(100, 5000, 80)]
        d = dm.propose(Live(Slot(0, text[:59]), text[:60], greedy), 5)
        # 59 held, then the last and 3 drafts fed: the draft's 64th position stays free, as
        # the engine leaves the target's
        assert len(d.tokens) == 4 and r.held(0) == 63
        d = dm.propose(Live(Slot(0, text[:69]), text[:70], greedy), 5)
        assert d.tokens == [] and r.held(0) <= r.n_ctx
    finally:
        r.close()


def finished(stream: Any, seconds: float) -> Result:
    """The stream's result, or a failure where it has not ended within `seconds` (the request is
    cancelled then, so the model goes on serving)."""
    done = threading.Event()
    box: dict[str, Any] = {}

    def consume() -> None:
        try:
            box["result"] = stream.wait()
        except BaseException as e:  # noqa: BLE001 - handed to the test
            box["error"] = e
        finally:
            done.set()

    threading.Thread(target=consume, daemon=True).start()
    if not done.wait(seconds):
        stream.cancel()
        done.wait(60)
        pytest.fail(f"the request did not end within {seconds:.0f} s (cancelled)")
    if "error" in box:
        raise box["error"]
    return box["result"]


def test_drafts_stop_at_the_draft_models_context(llm: Model) -> None:
    """The draft model's context (the tiny model's 256) is smaller than the target's (1024): past
    it the draft model has nothing to propose, and the request goes on (greedy, as plain)."""
    assert llm.draft.n_ctx < llm.n_ctx
    prompt = " ".join(["one two three four five six seven eight nine ten"] * 26)
    assert llm.draft.n_ctx < len(llm.tokenize(prompt)) < llm.n_ctx - 20
    plain = generate(llm, prompt, 20)
    drafter, pace = llm._drafter("draft:tiny", ContextPolicy())[0], Rounds(4, 4)
    llm._drafter = lambda spec, policy: (drafter, pace)  # type: ignore[method-assign]
    try:
        sampling = llm.sampling(temperature=0, ignore_eos=True, max_tokens=20)
        stream = llm.submit(Request(prompt=prompt, sampling=sampling, speculative="lookup"))
        got = finished(stream, 60)
    finally:
        del llm._drafter
    assert got.finish_reason == "length" and got.token_ids == plain.token_ids
    assert got.speculative.drafted == 0  # nothing to follow: every pass plain


def test_a_drafter_that_fails_ends_its_request(llm: Model) -> None:
    """A drafter that raises does not stall the model: its request ends (with the error in one
    line, or decoded plainly), and the next request is served."""

    class Broken:
        def propose(self, seq: Any, k: int) -> Any:
            raise RuntimeError("the drafter broke")

    plain = generate(llm, PROMPTS[2], 8)
    llm._drafter = lambda spec, policy: (Broken(), Rounds(4, 4))  # type: ignore[method-assign]
    sampling = llm.sampling(temperature=0, ignore_eos=True, max_tokens=8)
    try:
        got = finished(llm.submit(Request(prompt=PROMPTS[2], sampling=sampling,
                                          speculative="lookup")), 60)  # fmt: skip
    except LocalLLMError as e:  # before its first token
        assert "the drafter broke" in str(e) and "\n" not in str(e)
    else:
        if got.error is not None:  # after it: the tokens so far and the error
            assert "the drafter broke" in got.error and "\n" not in got.error
            assert got.token_ids == plain.token_ids[: len(got.token_ids)]
        else:
            assert got.token_ids == plain.token_ids
    finally:
        del llm._drafter
    idle(llm)
    assert generate(llm, PROMPTS[2], 8).token_ids == plain.token_ids


def test_sampling_the_first_two_tokens_matches_plain(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    """Temperature 1 with top-k 3 from a fixed prompt: the joint distribution of the first two
    tokens (the second verified against a sampled layer-skip draft) is the same as plain
    sampling's: Pearson's homogeneity test over the 2 x 9 table, p > 0.001, 300 draws each,
    fixed seeds, all submitted at once, 32 decoding together. (The CPU's default precision:
    lossless sampling needs no fp32.)"""
    with in_home(tmp_path_factory.mktemp("home")):
        m = load("smollm2", backend="torch", ctx=256, threads=2, parallel=32)
    try:
        assert m.runner.dtype == "int4"  # the CPU's default
        prompt = "My favourite colour is"
        params = {"temperature": 1.0, "top_k": 3, "top_p": 1.0, "min_p": 0.0, "max_tokens": 3}

        def layer_skip(spec: str | None, policy: ContextPolicy) -> tuple[Any, Pace]:
            return LayerSkip(m.runner, (3, 4, 5, 16, 17)), Rounds(2, 2)

        m._drafter = layer_skip  # type: ignore[method-assign]
        streams = [(mode, m.submit(Request(prompt=prompt, speculative=mode,
                                           sampling=m.sampling(**params, seed=1000 + i))))
                   for i in range(300) for mode in ("off", "lookup")]  # fmt: skip
        plain, spec = Counter(), Counter()
        for mode, stream in streams:
            got = stream.wait()
            assert got.usage.completion_tokens == 3 or got.finish_reason == "stop"
            if mode == "off":
                assert got.speculative is None
                plain[tuple(got.token_ids[:2])] += 1
                continue
            # max_tokens 3 leaves room for one draft, in the first decode pass only (the pace
            # drafts from the first): the second token came out of a verification
            assert got.speculative.rounds == got.speculative.drafted == 1
            spec[tuple(got.token_ids[:2])] += 1
        stat, df = chi2_homogeneity(plain, spec)
        assert 3 <= df <= 8 and chi2_sf(stat, df) > P_MIN, (stat, plain, spec)
    finally:
        m.close()


def chi2_homogeneity(a: Counter, b: Counter) -> tuple[float, int]:
    """Two samples from one distribution? (Pearson's test on the 2 x cells table.)"""
    cells = sorted(set(a) | set(b))
    na, nb = sum(a.values()), sum(b.values())
    stat = 0.0
    for c in cells:
        total = a.get(c, 0) + b.get(c, 0)
        for got, n in ((a.get(c, 0), na), (b.get(c, 0), nb)):
            want = total * n / (na + nb)
            stat += (got - want) ** 2 / want
    return stat, len(cells) - 1


# -- tune and the `self` mode --------------------------------------------------------------------


def test_tuned_config_is_kept_per_model_and_device(llm: Model, tmp_path: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    """`cached_or_tuned` searches once, stores the result under the model's device key, then
    reads what it stored (the search is not run again); a damaged file is searched again. The
    model asks once and keeps the answer."""
    calls = []
    found = tune.SelfConfig(skip=(3, 4), k=2, pays=True, speedup=1.3, acceptance=0.9)
    monkeypatch.setattr(tune, "tune", lambda m, report=None: calls.append(m) or found)
    path = tmp_path / "tuned" / "x.json"
    monkeypatch.setattr(llm, "tuned_path", path)
    assert tune.cached_or_tuned(llm) == found and calls == [llm]
    stored = json.loads(path.read_text())
    key = tune.device_key(llm)
    assert list(stored) == [key] and key.endswith(f"/f32/{llm.runner.n_threads}t")
    assert stored[key]["version"] == tune.VERSION and stored[key]["skip"] == [3, 4]
    assert tune.cached_or_tuned(llm) == found and len(calls) == 1
    path.write_text("{not json")
    assert tune.cached_or_tuned(llm) == found and len(calls) == 2  # a damaged file: again
    monkeypatch.setattr(llm, "_self_config", None)
    assert llm.self_config() == found and llm.self_config() is llm.self_config()
    assert len(calls) == 2  # read from the file it stored
    drafter, pace = llm._drafter("self", ContextPolicy())
    assert isinstance(drafter, LayerSkip) and drafter.runner is llm.runner
    assert drafter.skip == {3, 4} and pace.on and pace.k_max == 2


def test_the_device_key_names_the_cpus_vector_extensions(llm: Model) -> None:
    """A store may move between machines: a result measured with AVX-512 kernels is not one for
    an AVX2 CPU, so the key names the vector extensions torch uses here (as `tune.device_key`
    says), beside the precision and the threads."""
    key = tune.device_key(llm)
    isa = torch.backends.cpu.get_cpu_capability().lower()
    assert isa in key.lower(), (key, isa)
    assert key.endswith(f"/f32/{llm.runner.n_threads}t")


def test_self_decodes_plainly_where_it_does_not_pay(
    llm: Model, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Tuned to not pay: `self` is accepted, drafts nothing and gives plain greedy's tokens;
    eval's teacher-forced drafts say so (None). Tuned to pay: it drafts with the tuned skip set."""
    monkeypatch.setattr(llm, "_self_config", tune.SelfConfig(pays=False, speedup=1.0))
    plain = generate(llm, PROMPTS[2], 16)
    r = llm.complete(PROMPTS[2], max_tokens=16, temperature=0, ignore_eos=True, speculative="self")
    assert r.token_ids == plain.token_ids
    assert r.speculative.mode == "self" and r.speculative.rounds == r.speculative.drafted == 0
    assert r.speculative.passes == 15
    ids = llm.tokenize(PROMPTS[2])
    assert llm.draft_argmax("self", ids) is None
    monkeypatch.setattr(llm, "_self_config", tune.SelfConfig(skip=(3, 4, 5), k=3, pays=True,
                                                             speedup=1.2))  # fmt: skip
    r = llm.complete(PROMPTS[2], max_tokens=16, temperature=0, ignore_eos=True, speculative="self")
    assert r.token_ids == plain.token_ids
    assert r.speculative.mode == "self" and r.speculative.rounds >= 1  # after one plain pass
    assert r.speculative.drafted <= 3 * r.speculative.rounds
    got = llm.draft_argmax("self", ids)
    with llm.slot_for_work() as sid:
        want = teacher_argmax(llm.runner, ids, skip=frozenset({3, 4, 5}), slot=sid)
    assert got.shape == (len(ids),) and np.array_equal(got, want)
    assert not np.array_equal(want, llm.draft_argmax("draft", ids))  # the draft model's: others


def test_the_search_measures_and_reports(llm: Model) -> None:
    """A small search on the real model: every row measured beside plain decoding; the fastest
    row, where it beat plain by `tune.PAYS`, measured again, and chosen only where the median of
    its measurements beats plain by `tune.PAYS`; greedy text stayed the same in every row (fp32)."""
    lines: list[str] = []
    config = tune.tune(llm, report=lines.append, gen_tokens=12, max_skip=0.1, tries=2, measure=2,
                       confirm=2)  # fmt: skip
    assert len(config.table) == 2 and all(r["same_text"] for r in config.table)
    assert all(r["tokens_per_s"] > 0 and r["plain_tokens_per_s"] > 0 for r in config.table)
    sizes = [len(g["skip"]) for g in config.grown]
    assert sizes == list(range(1, len(config.grown) + 1))  # one more each
    pairs = zip(config.grown, config.grown[1:])
    assert config.grown and all(set(a["skip"]) < set(b["skip"]) for a, b in pairs)
    eligible = [r for r in config.table if r["speedup"] > tune.PAYS and r["best_case"] > 1]
    fastest = max(eligible or config.table, key=lambda r: r["speedup"])
    if eligible:
        ratios = fastest["confirmed"]
        assert len(ratios) == 3 and ratios[0] == fastest["speedup"]
        median = sorted(ratios)[1]
        assert config.pays == (median > tune.PAYS) and any("again" in line for line in lines)
        if config.pays:
            assert list(config.skip) == fastest["skip"] and config.speedup == median
    else:
        assert "confirmed" not in fastest and not config.pays
    if not config.pays:
        assert config.skip == () and config.speedup == 1.0
    assert any("agreement" in line for line in lines) and any("measured" in line for line in lines)
    assert math.isfinite(config.speedup)
    idle(llm)
    assert not any(s.busy for s in llm.slots.all)  # its work slots are given back


ARGMAX: dict[tuple[tuple[int, ...], tuple[int, ...]], Any] = {}


@pytest.mark.parametrize(("again", "accepted", "pays"),
                         [((0.9, 1.0), True, False), ((1.2, 1.3), True, True), ((1.2, 1.3), False, False)])  # fmt: skip
def test_one_lucky_measurement_does_not_make_a_skip_set_pay(llm: Model, monkeypatch: pytest.MonkeyPatch,
                                                            again: tuple[float, float], accepted: bool,
                                                            pays: bool) -> None:  # fmt: skip
    """The fastest row is measured twice more beside plain decoding, and the median of its three
    ratios decides; a row whose drafts were rejected cannot pay however fast it ran (its best case
    is below 1). Scripted: plain takes 1 s; the first candidate 0.8 s, the second 1.1 s; four
    rounds of drafts, all accepted or all rejected."""
    real = tune._generate
    candidate = iter([0.8, 1.1, *(1 / r for r in again)])

    def scripted(b, prompt, n, *, drafter=None, pace=None):  # noqa: ANN001, ANN202
        if prompt != b.tokenize(tune.CALIBRATION_PROMPT):
            return real(b, prompt, n, drafter=drafter, pace=pace)
        if drafter is None:
            return list(range(n)), 1.0
        pace.rounds, pace.drafted = 4, 4 * pace.k
        pace.accepted = pace.drafted if accepted else 0
        return list(range(n)), next(candidate)

    real_argmax = tune._argmax

    def agreement_once(b, ids, skip):  # noqa: ANN001, ANN202
        """The teacher-forced passes (the same in every case: scripted text) run once."""
        key = (tuple(ids), tuple(skip))
        if key not in ARGMAX:
            ARGMAX[key] = real_argmax(b, ids, skip)
        return ARGMAX[key]

    monkeypatch.setattr(tune, "_generate", scripted)
    monkeypatch.setattr(tune, "_argmax", agreement_once)
    config = tune.tune(llm, gen_tokens=8, max_skip=0.1, tries=2, measure=2, confirm=2)
    assert [r["speedup"] for r in config.table] == [1.25, pytest.approx(0.909, abs=1e-3)]
    assert (config.table[0]["best_case"] > 1) is accepted
    if not accepted:
        assert "confirmed" not in config.table[0] and not config.pays
        return
    assert config.table[0]["confirmed"] == [1.25, *again]
    assert config.pays is pays
    if pays:
        assert list(config.skip) == config.table[0]["skip"] and config.speedup == pytest.approx(
            1.25
        )
    else:
        assert config.skip == () and config.speedup == 1.0


def test_a_refused_combination_takes_no_slot(llm: Model) -> None:
    """StreamingLLM with drafts is refused in one line, and the slot stays free."""
    for _ in range(3):  # more than the model's two slots
        with pytest.raises(LocalLLMError, match="cannot run with --streaming") as e:
            request = Request(prompt="Hello", context=ContextPolicy(4, 64), speculative="lookup")
            llm.submit(request).wait()
        assert "\n" not in str(e.value)
        idle(llm)
        assert llm.running == 0
    r = llm.complete("Hello", max_tokens=4, temperature=0, speculative="lookup")
    assert r.usage.completion_tokens == 4 and r.speculative.mode == "lookup"
