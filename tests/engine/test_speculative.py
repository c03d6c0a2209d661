"""Speculative decoding in the torch engine (issue 13): lossless by the exact rule, caches rolled
back to what a run that never drafted holds, the off-switch, and every drafter on the real model."""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import replace

import pytest

from conftest import need

need("torch", "pip install -e '.[dev]' (torch: pip install torch==2.13.0 first)")

import torch  # noqa: E402

from localllm.backends.base import Seq  # noqa: E402
from localllm.backends.torch import tune  # noqa: E402
from localllm.backends.torch.sampling import make_sampler  # noqa: E402
from localllm.backends.torch.speculative import (  # noqa: E402
    Draft,
    DraftModel,
    LayerSkip,
    Lookup,
    Pace,
    accept,
)
from localllm.types import SamplingParams  # noqa: E402

# chi-square critical values at α = 0.001 (df → value), from the chi-square table
CHI2_001 = {3: 16.266, 4: 18.467, 5: 20.515, 6: 22.458, 7: 24.322, 8: 26.124}
PLAIN = SamplingParams(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0)  # draws from softmax(logits)


def chi2_goodness(counts: Counter, p: torch.Tensor) -> tuple[float, int]:
    n = sum(counts.values())
    stat = sum((counts.get(i, 0) - n * float(pi)) ** 2 / (n * float(pi)) for i, pi in enumerate(p) if pi > 0)
    return stat, int((p > 0).sum()) - 1


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


# -- the rule on toy distributions -----------------------------------------------------------------


def _toy(seed: int, v: int) -> torch.Tensor:
    x = torch.rand(v, generator=torch.Generator().manual_seed(seed)) + 0.05
    return x / x.sum()


@pytest.mark.parametrize("one_hot", [False, True], ids=["sampled-draft", "deterministic-draft"])
def test_first_token_is_distributed_as_the_target(one_hot: bool) -> None:
    """20,000 verifications of one draft: the emitted token follows p (chi-square, α = 0.001)
    whether the draft was drawn from a different q or fixed (one-hot q, as lookup's)."""
    p, q = _toy(1, 6), _toy(2, 6)
    sampler = make_sampler(replace(PLAIN, seed=11))
    drafts = torch.Generator().manual_seed(5)
    counts: Counter = Counter()
    for _ in range(20_000):
        if one_hot:
            draft = Draft([2])
        else:
            x = int(torch.multinomial(q, 1, generator=drafts))
            draft = Draft([x], [q])
        out, n = accept(lambda i: p.log(), draft, sampler, [])
        counts[out[0]] += 1
        assert len(out) == n + 1
    stat, df = chi2_goodness(counts, p)
    assert stat < CHI2_001[df], (stat, counts)


def test_bonus_token_after_all_accepted_is_from_the_next_distribution() -> None:
    """q = p accepts every draft (u ≤ 1); the bonus then follows the next row's p."""
    p0, p1 = _toy(3, 5), _toy(4, 5)
    sampler = make_sampler(SamplingParams(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, seed=2))
    counts: Counter = Counter()
    for _ in range(10_000):
        x = sampler.draw(p0)
        out, n = accept(lambda i: (p0 if i == 0 else p1).log(), Draft([x], [p0]), sampler, [])
        assert n == 1 and out[0] == x
        counts[out[1]] += 1
    stat, df = chi2_goodness(counts, p1)
    assert stat < CHI2_001[df], (stat, counts)


def test_greedy_keeps_drafts_while_they_are_the_argmax() -> None:
    rows = [torch.tensor([0.0, 3.0, 1.0]), torch.tensor([2.0, 0.0, 1.0]), torch.tensor([0.0, 0.0, 5.0])]
    greedy = make_sampler(SamplingParams(temperature=0))
    assert accept(lambda i: rows[i], Draft([1, 0]), greedy, []) == ([1, 0, 2], 2)  # + bonus
    assert accept(lambda i: rows[i], Draft([1, 2]), greedy, []) == ([1, 0], 1)  # second rejected
    assert accept(lambda i: rows[i], Draft([2, 0]), greedy, []) == ([1], 0)  # first rejected


def test_lookup_proposes_what_followed_the_latest_match() -> None:
    lookup = Lookup()
    text = [5, 6, 7, 8, 9, 1, 5, 6, 7]
    assert lookup.lookup(text, 3) == [8, 9, 1]  # 3-gram 5 6 7
    assert lookup.lookup([*text, 8, 4, 2, 7], 2) == [8, 4]  # 1-gram 7: its latest match
    assert Lookup().lookup([1, 2, 3], 4) == []


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


# -- the real model ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def backend(default_model_path, tiny_llama):
    """SmolLM2 in float32 (greedy is exactly reproducible there), with the 2-layer random-weight
    model that shares its vocabulary as the draft model."""
    from localllm.backends.torch.backend import TorchBackend

    return TorchBackend(default_model_path, n_ctx=1024, dtype="f32", kv_cache="f32", threads=2,
                        speculative="draft:tiny", draft=("tiny", tiny_llama))  # fmt: skip


PROMPTS = [
    "The capital of France is Paris. The capital of Germany is Berlin. The capital of France is",
    "def add(a, b):\n    return a + b\n\n\ndef add(a, b):\n",
    "Once upon a time, a little fox lived in the woods.",
]


def generate(backend, prompt: str, n: int, *, drafter=None, pace=None, sampling=None, keep=False):
    """(tokens, the Steps of every decode pass) through the slot machinery."""
    seq = Seq(backend.tokenize(prompt), sampling or SamplingParams(temperature=0, max_tokens=n),
              speculative="off")  # fmt: skip
    backend.admit(seq)
    try:
        seq.state.drafter, seq.state.pace = drafter, pace
        if pace is not None:
            pace.plain(1.0)  # speculate from the first decode pass
        out = [s.token for s in backend.step({seq: 0})[seq]]
        passes = []
        while len(out) < n:
            steps = backend.step({seq: 0})[seq]
            passes.append(steps)
            out.extend(s.token for s in steps)
        return out[:n], passes
    finally:
        backend.release(seq, keep=keep)


class SameModel:
    """A drafter that proposes what the target itself would say (a draft model identical to it)."""

    def __init__(self, backend) -> None:
        self.inner = DraftModel(backend.model, capacity=backend.n_ctx, dtype=backend.kv_dtype,
                                device=backend.device)  # fmt: skip

    def propose(self, slot, k):
        return self.inner.propose(slot, k)


@pytest.mark.parametrize("which", range(len(PROMPTS)), ids=["facts", "code", "story"])
def test_greedy_output_is_plain_greedy_for_every_drafter(backend, which: int) -> None:
    """fp32, 32 tokens: lookup, layer skip (two skip sets), a random-weight draft model (rejects
    at the first token nearly always) and the model as its own draft (accepts everything) all
    give plain greedy's tokens; each drafter meets k = 1, 3 and 8 over the three prompts."""
    prompt, n = PROMPTS[which], 32
    plain, _ = generate(backend, prompt, n)
    drafters = {
        "lookup": Lookup(),
        "self-few": LayerSkip(backend.model, (3, 4, 5), device=backend.device),
        "self-many": LayerSkip(backend.model, tuple(range(4, 26)), device=backend.device),
        "draft-random": DraftModel(backend.draft_model, capacity=backend.n_ctx,
                                   dtype=backend.kv_dtype, device=backend.device),  # fmt: skip
        "draft-same": SameModel(backend),
    }
    for i, (name, drafter) in enumerate(drafters.items()):
        k = (1, 3, 8)[(i + which) % 3]
        got, passes = generate(backend, prompt, n, drafter=drafter, pace=Pace(k, k))
        assert got == plain, (name, k)
        firsts = [p[0] for p in passes if p[0].drafted]
        if name == "draft-same":
            assert firsts and all(s.accepted == s.drafted for s in firsts), name  # all accepted
            assert len(passes) <= -(-n // (k + 1)) + 1
        if name == "draft-random":
            assert any(s.accepted == 0 for s in firsts), name  # a first-token rejection


def test_greedy_with_penalties_is_plain(backend) -> None:
    sampling = SamplingParams(temperature=0, repeat_penalty=1.3, frequency_penalty=0.2, max_tokens=40)
    plain, _ = generate(backend, PROMPTS[1], 40, sampling=sampling)
    for drafter in (Lookup(), LayerSkip(backend.model, (3, 4, 5, 16, 17), device=backend.device)):
        got, _ = generate(backend, PROMPTS[1], 40, drafter=drafter, pace=Pace(4, 4), sampling=sampling)
        assert got == plain


@pytest.mark.parametrize("kv", ["f32", "int8", "int4"])
def test_a_draft_leaves_the_caches_as_they_were(default_model_path, kv: str) -> None:
    """Layer-skip drafting writes into the kept layers' caches; after it every cache's state is
    bit for bit what it was (the int4 cache with its residual crossing a group border)."""
    from localllm.backends.torch.backend import TorchBackend

    b = TorchBackend(default_model_path, n_ctx=512, dtype="f32", threads=2, kv_cache=kv)
    seq = Seq(list(range(100, 100 + 190)), SamplingParams(temperature=0), speculative="off")
    b.admit(seq)
    try:
        slot = seq.state
        b.step({seq: 0})  # 190 tokens: KIVI quantizes none yet; 6 drafts will quantize a group
        before = [tuple(t.clone() for t in _flat(c.state)) for c in slot.caches]
        offsets = [c.offset for c in slot.caches]
        with torch.inference_mode():
            draft = LayerSkip(b.model, (3, 4, 5, 16), device=b.device).propose(slot, 6)
        assert len(draft.tokens) == 6
        assert [c.offset for c in slot.caches] == offsets
        for c, want in zip(slot.caches, before):
            got = _flat(c.state)
            assert len(got) == len(want) and all(torch.equal(x, y) for x, y in zip(got, want))
    finally:
        b.release(seq, keep=False)


def _flat(state) -> list[torch.Tensor]:
    """The tensors of a cache's state, empty ones left out (buffers a store made but holds
    nothing in)."""
    if isinstance(state, torch.Tensor):
        return [state] if state.numel() else []
    return [t for s in state for t in _flat(s)]


def test_rolled_back_caches_equal_a_run_that_never_drafted(backend) -> None:
    """After 30 tokens with rejections along the way, each layer's cache holds as many tokens as
    a plain run's, with the same keys and values (to float32 rounding: the verification pass
    computes several positions in one matmul)."""
    prompt = PROMPTS[0]

    def caches_after(drafter):
        seq = Seq(backend.tokenize(prompt), SamplingParams(temperature=0, max_tokens=30),
                  speculative="off")  # fmt: skip
        backend.admit(seq)
        try:
            slot = seq.state
            slot.drafter, slot.pace = drafter, Pace(4, 4) if drafter else None
            if drafter:
                slot.pace.plain(1.0)
            n, rejected = 0, 0
            while n < 30:
                steps = backend.step({seq: 0})[seq]
                n += len(steps)
                rejected += sum(s.drafted - s.accepted for s in steps)
            tokens = list(slot.tokens)
            return tokens, [c.state for c in slot.caches], rejected
        finally:
            backend.release(seq, keep=False)

    plain_tokens, plain, _ = caches_after(None)
    tokens, spec, rejected = caches_after(LayerSkip(backend.model, tuple(range(6, 22)),
                                                    device=backend.device))  # fmt: skip
    assert rejected > 0
    m = min(len(tokens), len(plain_tokens))
    assert tokens[:m] == plain_tokens[:m]
    for (k1, v1), (k2, v2) in zip(plain, spec):
        assert torch.allclose(k1[:, :, :m], k2[:, :, :m], atol=1e-4)
        assert torch.allclose(v1[:, :, :m], v2[:, :, :m], atol=1e-4)


def test_sampling_the_first_two_tokens_matches_plain(default_model_path) -> None:
    """Temperature 1 with top-k 3 from a fixed prompt: the joint distribution of the first two
    tokens (the second verified against a sampled layer-skip draft) is the same as plain
    sampling's: Pearson's homogeneity test over the 2 x 9 table, α = 0.001, 300 draws each,
    fixed seeds. (The CPU's default precision: lossless sampling needs no fp32.)"""
    from localllm.backends.torch.backend import TorchBackend

    b = TorchBackend(default_model_path, n_ctx=256, threads=2)
    prompt = "My favourite colour is"
    params = dict(temperature=1.0, top_k=3, top_p=1.0, min_p=0.0, max_tokens=3)
    plain, spec = Counter(), Counter()
    for i in range(300):
        sampling = SamplingParams(**params, seed=1000 + i)
        got, _ = generate(b, prompt, 2, sampling=sampling, keep=True)
        plain[tuple(got)] += 1
        drafter = LayerSkip(b.model, (3, 4, 5, 16, 17), device=b.device)
        got, passes = generate(b, prompt, 2, sampling=sampling, drafter=drafter, pace=Pace(2, 2),
                               keep=True)  # fmt: skip
        assert passes[0][0].drafted  # the second token came out of a verification
        spec[tuple(got)] += 1
    stat, df = chi2_homogeneity(plain, spec)
    assert df <= 8 and stat < CHI2_001[max(df, 3)], (stat, plain, spec)


def test_tuned_config_is_kept_per_model_and_device(backend, tmp_path, monkeypatch) -> None:
    """`cached_or_tuned` searches once, then reads what it stored (the search is not run again)."""
    calls = []
    found = tune.SelfConfig(skip=(3, 4), k=2, pays=True, speedup=1.3, acceptance=0.9)
    monkeypatch.setattr(tune, "tune", lambda b, report=None: calls.append(b) or found)
    monkeypatch.setattr(backend, "tuned_path", tmp_path / "tuned" / "x.json")
    assert tune.cached_or_tuned(backend) == found
    assert tune.cached_or_tuned(backend) == found and len(calls) == 1
    (tmp_path / "tuned" / "x.json").write_text("{not json")
    assert tune.cached_or_tuned(backend) == found and len(calls) == 2  # a damaged file: again


def test_the_search_measures_and_reports(backend) -> None:
    """A small search on the real model: every row measured beside plain decoding; the fastest
    row, where it beat plain by `tune.PAYS`, measured again, and chosen only where the median of
    its measurements beats plain by `tune.PAYS`; greedy text stayed the same in every row (fp32)."""
    lines: list[str] = []
    config = tune.tune(backend, report=lines.append, gen_tokens=12, max_skip=0.1, tries=2, measure=2,
                       confirm=2)  # fmt: skip
    assert len(config.table) == 2 and all(r["same_text"] for r in config.table)
    assert all(r["tokens_per_s"] > 0 and r["plain_tokens_per_s"] > 0 for r in config.table)
    assert [len(g["skip"]) for g in config.grown] == list(range(1, len(config.grown) + 1))  # one more each
    assert config.grown and all(set(a["skip"]) < set(b["skip"]) for a, b in zip(config.grown, config.grown[1:]))
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


@pytest.mark.parametrize(("again", "accepted", "pays"),
                         [((0.9, 1.0), True, False), ((1.2, 1.3), True, True), ((1.2, 1.3), False, False)])  # fmt: skip
def test_one_lucky_measurement_does_not_make_a_skip_set_pay(backend, monkeypatch, again, accepted,
                                                            pays) -> None:  # fmt: skip
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

    monkeypatch.setattr(tune, "_generate", scripted)
    config = tune.tune(backend, gen_tokens=8, max_skip=0.1, tries=2, measure=2, confirm=2)
    assert [r["speedup"] for r in config.table] == [1.25, pytest.approx(0.909, abs=1e-3)]
    assert (config.table[0]["best_case"] > 1) is accepted
    if not accepted:
        assert "confirmed" not in config.table[0] and not config.pays
        return
    assert config.table[0]["confirmed"] == [1.25, *again]
    assert config.pays is pays
    if pays:
        assert list(config.skip) == config.table[0]["skip"] and config.speedup == pytest.approx(1.25)
    else:
        assert config.skip == () and config.speedup == 1.0


def test_a_refused_combination_takes_no_slot(backend) -> None:
    """StreamingLLM with drafts is refused in one line, and the slot stays free."""
    from localllm.errors import LocalLLMError
    from localllm.types import ContextPolicy

    for _ in range(2):
        with pytest.raises(LocalLLMError, match="cannot run with --streaming"):
            backend.admit(Seq([1, 2, 3], SamplingParams(), ContextPolicy(4, 64), speculative="lookup"))
    seq = Seq([1, 2, 3], SamplingParams(), speculative="lookup")
    backend.admit(seq)
    backend.release(seq)
