"""Drafting with a draft head (issue 36, `--speculative head`): the runner keeps the target's
features of every position it evaluates and the head's own cache over them (`HeadState`), so a
round of drafting reads what one pass of the head over the whole sequence reads; rejected drafts
and trims leave it as a run that never drafted them would; greedy output with a head is plain
greedy output (fp32, the default model, a head trained on it); sampled output is distributed as
plain sampling's; `auto` takes the head where the model has one; a model without one is one
line."""

from __future__ import annotations

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
from engine.test_speculative import Rounds as Logged  # noqa: E402
from engine.test_speculative import chi2_homogeneity  # noqa: E402

from localllm.backends.base import Piece  # noqa: E402
from localllm.backends.torch.draft_head import DraftHead, features  # noqa: E402
from localllm.backends.torch.runner import TorchRunner  # noqa: E402
from localllm.backends.torch.train_draft import save_head  # noqa: E402
from localllm.engine import Model, load  # noqa: E402
from localllm.engine.speculative import HeadDrafter, Pace  # noqa: E402
from localllm.errors import LocalLLMError  # noqa: E402
from localllm.server.metrics import Metrics  # noqa: E402
from localllm.types import ContextPolicy, Request  # noqa: E402

P_MIN = 1e-3
DIGEST = "d" * 64


def random_head(model: Any, seed: int = 0, vocab: torch.Tensor | None = None) -> DraftHead:
    a = model.args
    torch.manual_seed(seed)
    head = DraftHead(a.dim, a.n_heads, a.n_kv_heads, 2 * a.dim,
                     torch.arange(a.vocab_size) if vocab is None else vocab,
                     head_dim=a.head_dim, rope_base=a.rope_base, eps=a.norm_eps)  # fmt: skip
    with torch.no_grad():  # larger than the default start: drafts that differ from token to token
        for p in head.parameters():
            if p.dim() > 1:
                p.mul_(4.0)
    return head.eval()


@pytest.fixture(scope="module")
def runner(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[TorchRunner]:
    """The 2-layer random Llama (the default model's vocabulary) in f32, two slots, drafting
    with a random head over half the vocabulary."""
    r = TorchRunner(tiny_llama, n_ctx=256, n_slots=2, dtype="f32", kv_cache="f32", threads=2)
    path = save_head(random_head(r.model, vocab=torch.arange(0, r.n_vocab, 2)),
                     tmp_path_factory.mktemp("head") / "head.safetensors", DIGEST)  # fmt: skip
    r.use_head(path, DIGEST)
    yield r
    r.close()


def reference(r: TorchRunner, seq: list[int], last: int, drafts: list[int]) -> list[np.ndarray]:
    """The head's logits (n_vocab,) of one pass over the whole sequence `seq` (its features
    from a fresh pass of the target) with `last` after it, then over each draft in turn."""
    head, rows = r._head, r._head_rows
    with torch.no_grad():
        h, _ = features(r.model, torch.tensor([seq]))
        nxt = torch.tensor([[*seq[1:], last]])
        g, cache = head(r.model.embed(nxt), h, 0, None)
        g = g[:, -1:]
        out = [head.logits(g[0, 0], rows)]
        for i, d in enumerate(drafts):
            g, cache = head(r.model.embed(torch.tensor([[d]])), g, len(seq) + i, cache)
            out.append(head.logits(g[0, 0], rows))
    full = []
    for z in out:
        row = np.full(r.n_vocab, -np.inf, dtype=np.float32)
        row[head.vocab.numpy()] = z.numpy()
        full.append(row)
    return full


def close(a: np.ndarray, b: np.ndarray) -> None:
    assert np.array_equal(np.isinf(a), np.isinf(b))
    a, b = a[np.isfinite(a)], b[np.isfinite(b)]
    np.testing.assert_allclose(a, b, rtol=1e-4, atol=2e-5 * float(np.abs(b).max()))  # float32


def test_a_round_reads_what_one_pass_over_the_sequence_reads(runner: TorchRunner) -> None:
    """Prompt in two pieces, a round of three drafts, a verification that keeps one of them,
    a second round: every draft's logits are those of one head pass over the whole sequence
    so far (the target's own features, the drafts fed back as EAGLE feeds them)."""
    r, slot = runner, 0
    r.clear(slot)
    prompt = list(range(1000, 1040))
    r.forward([Piece(slot, prompt[:25], 0)])
    r.forward([Piece(slot, prompt[25:], 1)])
    last = 7
    got = [r.head_logits(slot, last)]
    drafts = [int(got[0].argmax())]
    for _ in range(2):
        got.append(r.head_logits(slot, drafts[-1]))
        drafts.append(int(got[-1].argmax()))
    r.head_done(slot)
    want = reference(r, prompt, last, drafts[:2])
    for a, b in zip(got, want):
        close(a, b)
    assert np.isinf(got[0][1::2]).all()  # outside the head's vocabulary: never drafted
    # the target verifies [last, d1, d2, d3], keeps d1 and rejects the rest
    r.forward([Piece(slot, [last, *drafts], 4)])
    assert r.trim(slot, 2)
    seq, nxt = [*prompt, last, drafts[0]], 11
    got = [r.head_logits(slot, nxt)]
    got.append(r.head_logits(slot, int(got[0].argmax())))
    r.head_done(slot)
    for a, b in zip(got, reference(r, seq, nxt, [int(got[0].argmax())])):
        close(a, b)
    # a second round with nothing evaluated since the first: the same logits again
    close(r.head_logits(slot, nxt), got[0])
    r.head_done(slot)


def test_a_trim_keeps_the_entries_before_it_and_a_clear_forgets_all(runner: TorchRunner) -> None:
    """Trimmed below what the head read, the head keeps its entries of the positions still
    held (but the last, which read a token now gone) and reads on after them; cleared, it
    holds nothing."""
    r, slot = runner, 1
    r.clear(slot)
    prompt = list(range(2000, 2030))
    r.forward([Piece(slot, prompt, 1)])
    assert r.head_logits(slot, 5) is not None
    r.head_done(slot)
    r.trim(slot, 10)  # 20 positions stay; the entry of position 19 read prompt[20]: it goes
    assert r.head_logits(slot, 5) is None  # nothing new to read, and no entry to go on from
    r.head_done(slot)
    r.forward([Piece(slot, [5, 6, 7], 1)])  # positions 20 .. 22
    head = r._head
    with torch.no_grad():
        h, _ = features(r.model, torch.tensor([[*prompt[:20], 5, 6, 7]]))
        nxt = torch.tensor([[*prompt[1:20], 5, 6, 7, 9]])
        x, q, k, v = head._project(r.model.embed(nxt), h, torch.arange(23))
        seen = torch.ones(23, 23, dtype=torch.bool).tril()
        seen[:, 19] = False
        seen[19, 19] = True
        g = head._finish(x, q, k, v, seen)
    close(r.head_logits(slot, 9), reference_row(r, g[0, -1]))
    r.head_done(slot)
    r.clear(slot)
    assert r.head_logits(slot, 9) is None  # a cleared slot's head holds nothing
    r.head_done(slot)


def reference_row(r: TorchRunner, g: torch.Tensor) -> np.ndarray:
    row = np.full(r.n_vocab, -np.inf, dtype=np.float32)
    with torch.no_grad():
        row[r._head.vocab.numpy()] = r._head.logits(g, r._head_rows).numpy()
    return row


def test_the_prefix_cache_keeps_the_heads_entries_of_a_span(runner: TorchRunner) -> None:
    """A span saved from one slot and restored into another brings the head's entries of its
    positions along: the other slot's first round reads them (all but the span's last, which
    read a token past it) as one pass over the whole sequence with that one entry left out."""
    r = runner
    prompt = list(range(3000, 3040))
    r.clear(0)
    r.forward([Piece(0, prompt, 1)])
    r.head_logits(0, 7)
    r.head_done(0)
    span = r.save(0, 0, 30)
    assert span.head is not None and span.head[0].tolist() == list(range(30))
    first, rest = r.split(span, 20)
    assert first.head[0].tolist() == list(range(20)) and rest.head[0].tolist() == list(range(20, 30))
    r.clear(1)
    assert r.restore(1, [(first, 20), (rest, 10)])
    r.forward([Piece(1, prompt[30:], 1)])
    got = r.head_logits(1, 7)
    r.head_done(1)
    head = r._head
    with torch.no_grad():
        h, _ = features(r.model, torch.tensor([prompt]))
        x, q, k, v = head._project(r.model.embed(torch.tensor([[*prompt[1:], 7]])), h, torch.arange(40))
        seen = torch.ones(40, 40, dtype=torch.bool).tril()
        seen[:, 29] = False  # the span's last entry read prompt[30]: not kept with it
        seen[29, 29] = True
        g = head._finish(x, q, k, v, seen)
    close(got, reference_row(r, g[0, -1]))
    for h_ in (span, first, rest):
        r.release(h_)


def test_a_failed_forward_leaves_no_features(runner: TorchRunner) -> None:
    r, slot = runner, 0
    r.clear(slot)
    r.forward([Piece(slot, [1, 2, 3], 1)])
    waiting = r._heads[slot].waiting
    with pytest.raises(Exception, match="context"):
        r.forward([Piece(slot, list(range(300)), 1)])  # past the context: refused, nothing kept
    assert r._heads[slot].waiting == waiting and r.held(slot) == 3


def test_a_head_of_another_model_is_refused_in_one_line(tiny_llama: Path, tmp_path: Path) -> None:
    r = TorchRunner(tiny_llama, n_ctx=64, n_slots=1, dtype="f32", threads=2)
    try:
        path = save_head(random_head(r.model), tmp_path / "h.safetensors", "e" * 64)
        with pytest.raises(LocalLLMError, match="trained for another model"):
            r.use_head(path, DIGEST)
    finally:
        r.close()


# -- through the engine ------------------------------------------------------------------------


class Rounds(Logged):
    """Drafts `k_max` every pass, never switches off, and notes each round: what is tested is
    the drafting, not whether it pays here."""

    def __init__(self, k_max: int) -> None:
        super().__init__(k_max, k_max, give_up=False)

    def verified(self, drafted: int, accepted: int, seconds: float, tokens: int = 0) -> None:
        super().verified(drafted, accepted, seconds, tokens)
        self.on = True


@pytest.fixture(scope="module")
def trained(default_model_path: Path, corpus_dir: Path,
            tmp_path_factory: pytest.TempPathFactory) -> Iterator[Model]:  # fmt: skip
    """SmolLM2 in f32 with a head trained on it for a fixed budget of the repository's corpus
    (the same head on every machine), eight slots."""
    from localllm.backends.torch.train_draft import train

    home = tmp_path_factory.mktemp("home")
    with in_home(home):
        m = load("smollm2", backend="torch", ctx=512, dtype="f32", kv_cache="f32", threads=2,
                 parallel=8)  # fmt: skip
    text = m.tokenize((corpus_dir / "alice.txt").read_text(encoding="utf-8"), add_special=False)
    m.run_here(lambda: train(m.runner.model, text, m.head_path, digest=m.digest, tokens=60 * 4 * 128,
                             seq=128, batch=4, n_draft_vocab=4096, lr=2e-3))  # fmt: skip
    m.use_head()
    yield m
    m.close()


def generate(m: Model, prompt: str, n: int, pace: Pace | None = None, drafter: Any = None,
             **kw: Any) -> Any:  # fmt: skip
    if pace is None:
        return m.complete(prompt, max_tokens=n, temperature=0, ignore_eos=True, speculative="off", **kw)

    def forced(spec: str | None, policy: ContextPolicy) -> tuple[Any, Pace]:
        pace.plain(1.0)
        return drafter or HeadDrafter(m.runner), pace

    m._drafter = forced  # type: ignore[method-assign]
    try:
        return m.complete(prompt, max_tokens=n, temperature=0, ignore_eos=True, speculative="head", **kw)
    finally:
        del m._drafter


PROMPTS = [
    "Alice was beginning to get very tired of sitting by her sister on the bank,",
    "Explain how a rainbow forms.",
    "def fib(n):\n",
    "The Queen of Hearts, she made some tarts,",
    "Write a short poem about the sea.",
]


@pytest.mark.parametrize(
    ("which", "tree"),
    [*((w, False) for w in range(len(PROMPTS))), (0, True), (1, True),
     *(pytest.param(w, True, marks=pytest.mark.slow) for w in range(2, len(PROMPTS)))],
    ids=lambda v: {False: "chain", True: "tree"}.get(v, str(v)) if isinstance(v, bool) else str(v),
)  # fmt: skip
def test_greedy_with_a_head_is_plain_greedy(trained: Model, which: int, tree: bool) -> None:
    """fp32, 128 tokens, five prompts, k = 2..6 (a chain; or a tree that deep, 4 branches a
    node, 15 nodes: two prompts here, all five under -m slow): the tokens of plain greedy
    decoding, with drafts both kept and rejected along the way."""
    prompt, n, k = PROMPTS[which], 128, 2 + which
    plain = generate(trained, prompt, n)
    pace = Rounds(k)
    drafter = HeadDrafter(trained.runner, width=4, nodes=15) if tree else None
    got = generate(trained, prompt, n, pace, drafter)
    if tree:
        assert drafter.trees == len(pace.log)
    assert got.token_ids == plain.token_ids
    sp = got.speculative
    assert sp is not None and sp.rounds == len(pace.log) > 0
    assert sp.passes + sp.accepted == n - 1
    assert any(a for _, a in pace.log), pace.log  # some drafts kept
    assert any(a < d for d, a in pace.log), pace.log  # some rejected
    # per draft position: rounds that drafted there, and that kept the draft there
    most = max(d for d, _ in pace.log)
    assert sp.drafted_at == tuple(sum(d > i for d, _ in pace.log) for i in range(most))
    assert sp.accepted_at == tuple(sum(a > i for _, a in pace.log) for i in range(most))
    assert sum(sp.accepted_at) == sp.accepted and sum(sp.drafted_at) == sp.drafted
    metrics = Metrics(lambda: [], lambda *_: 0)
    metrics.observe("smollm2", got)
    text = metrics.render().decode()
    for i, n in enumerate(sp.accepted_at):
        if n:
            assert f'localllm_speculative_accepted_at_position_total{{model="smollm2",position="{i + 1}"}} {float(n)}' in text


def test_prompt_lookup_drafts_where_the_answer_copies(trained: Model) -> None:
    """An answer that copies its prompt: where the last tokens occurred before, prompt lookup
    drafts (the head elsewhere), and the output is still plain greedy's."""
    prompt = ("Repeat this list exactly: apples, pears, plums, cherries, grapes, lemons, limes, "
              "oranges, peaches, apricots, figs, dates.\nThe list: apples,")
    plain = generate(trained, prompt, 48)
    drafter = HeadDrafter(trained.runner, lookup=True)
    got = generate(trained, prompt, 48, Rounds(8), drafter)
    assert got.token_ids == plain.token_ids
    assert drafter.copied > 0 and got.speculative.accepted > drafter.copied


def test_the_trained_head_agrees_with_the_model(trained: Model) -> None:
    """The fixture's short training already drafts a good share of the model's next tokens
    (a random head: ~0)."""
    meta = trained.runner.head_info
    assert meta["agree"] > 0.25, meta


def test_auto_takes_the_head_where_there_is_one(trained: Model, tmp_path: Path) -> None:
    assert trained.resolve("auto") == "head"
    assert trained.resolve("lookup") == "lookup"
    got = trained.complete(PROMPTS[0], max_tokens=24, temperature=0, speculative="auto")
    assert got.speculative is not None and got.speculative.mode == "head"
    trained.head_path, saved = tmp_path / "none.safetensors", trained.head_path
    try:
        assert trained.resolve("auto") == "lookup"
    finally:
        trained.head_path = saved


def test_a_model_without_a_head_says_how_to_train_one(default_model_path: Path) -> None:
    with pytest.raises(LocalLLMError, match="train-draft smollm2"):
        load("smollm2", backend="torch", ctx=256, threads=2, speculative="head")
    with load("smollm2", backend="torch", ctx=256, threads=2) as m:
        assert m.resolve("auto") == "lookup"
        s = m.submit(Request(prompt="Hi", speculative="head", sampling=m.sampling(max_tokens=4)))
        with pytest.raises(LocalLLMError, match="no draft head yet: `localllm train-draft smollm2"):
            s.wait()
        assert m.complete("Hi", max_tokens=2).usage.completion_tokens == 2  # the model lives on


@pytest.mark.parametrize("width", [1, pytest.param(2, marks=pytest.mark.slow)], ids=["chain", "tree"])
def test_sampling_with_a_head_is_distributed_as_plain(trained: Model, width: int) -> None:
    """Temperature 1, top-k 3: the joint distribution of the first three tokens (the second
    and third out of a verification of two levels of head drafts — a chain, or (-m slow; the
    tree's rule is checked over 20,000 draws in test_draft_trees.py) a tree of two draws a
    node — a kept or rejected first draft, and the bonus) matches plain sampling's, Pearson's
    homogeneity test, p > 0.001, 300 draws each."""
    prompt = ("Alice was beginning to get very tired of sitting by her sister on the bank, and of "
              "having nothing to do: once or twice she had peeped into the book her sister was "
              "reading, but it had no")  # text the head was trained on: it drafts well here
    params = {"temperature": 1.0, "top_k": 3, "top_p": 1.0, "min_p": 0.0, "max_tokens": 3,
              "ignore_eos": True}  # fmt: skip

    def head(spec: str | None, policy: ContextPolicy) -> tuple[Any, Pace]:
        pace = Rounds(2)
        pace.plain(1.0)
        return HeadDrafter(trained.runner, width=width, nodes=6), pace

    trained._drafter = head  # type: ignore[method-assign]
    try:
        streams = [(mode, trained.submit(Request(prompt=prompt, speculative=mode,
                                                 sampling=trained.sampling(**params, seed=5000 + i))))
                   for i in range(300) for mode in ("off", "head")]  # fmt: skip
        firsts = {"off": Counter(), "head": Counter()}  # (t0, t1): t1 verified a first draft
        seconds = {"off": Counter(), "head": Counter()}  # (t1, t2): t2 a second draft or a bonus
        kept = 0
        for mode, stream in streams:
            got = stream.wait()
            firsts[mode][tuple(got.token_ids[0:2])] += 1
            seconds[mode][tuple(got.token_ids[1:3])] += 1
            if mode == "head":
                assert got.speculative.rounds >= 1
                kept += got.speculative.accepted
    finally:
        del trained._drafter
    for table in (firsts, seconds):
        stat, df = chi2(table["off"], table["head"])
        assert df >= 3 and chi2_sf(stat, df) > P_MIN, (stat, table)
    assert kept > 50, kept  # drafts were kept often enough for the bonus token to be tested


def chi2(a: Counter, b: Counter) -> tuple[float, int]:
    """Pearson's homogeneity test over the 2 x cells table, cells seen fewer than 10 times in
    all pooled into one (the test's approximation needs expected counts of 5 or more)."""
    rare = {c for c in set(a) | set(b) if a.get(c, 0) + b.get(c, 0) < 10}
    return chi2_homogeneity(_pooled(a, rare), _pooled(b, rare))


def _pooled(counts: Counter, rare: set) -> Counter:
    out: Counter = Counter()
    for c, n in counts.items():
        out[(-1,) if c in rare else c] += n  # one cell for the rare ones (token ids are ≥ 0)
    return out



def test_recommend_measures_head_where_a_model_has_one(default_model_path: Path) -> None:
    from localllm.engine.core import head_path
    from localllm.models_registry.catalog import ensure_local
    from localllm.models_registry.store import Store
    from localllm.recommend import Setting, candidates

    store = Store()
    record = ensure_local("smollm2", store)
    assert (record, Setting("torch", "f16", "head")) not in candidates([record], ["torch"])
    path = head_path(store.home, record.digest)
    path.parent.mkdir(parents=True)
    path.write_bytes(b"a head")
    got = candidates([record], ["torch"])
    assert (record, Setting("torch", "f16", "head")) in got
    assert (record, Setting("torch", "f16", "lookup")) in got


# -- draft trees: one pass verifies every branch -------------------------------------------------

TREE = [-1, 0, 0, 1, 1, 2, 3, 5, 5, 7]  # a crafted tree of 10: token j follows token TREE[j]


def branch(j: int) -> list[int]:
    """The tree's tokens from its first down to j (indices)."""
    path = [j]
    while TREE[path[-1]] >= 0:
        path.append(TREE[path[-1]])
    return path[::-1]


@pytest.mark.parametrize("dtype", ["f16", "f32"])
def test_a_tree_is_verified_as_each_of_its_branches(tiny_llama: Path, dtype: str) -> None:
    """Every node's row of one tree pass is the last row of a chain of its branch — bit for bit
    where the projections round each row alike whatever the rows beside it (fp16 weights: the
    CPU default's kind), to float32 rounding in f32 (MKL rounds by row count) — and keeping a
    path leaves the cache as a chain of that path would."""
    r = TorchRunner(tiny_llama, n_ctx=256, n_slots=2, dtype=dtype, kv_cache="f16", threads=2, compile="off")
    try:
        prompt = list(range(500, 570))  # past a 64-position block: the tree spans two
        tokens = [9, *range(2000, 2009)]
        for s in (0, 1):
            r.forward([Piece(s, prompt, 0)])
        assert r.tree_tokens(0) == 16
        rows = r.forward([Piece(0, tokens, len(tokens), parents=TREE)]).logits
        same = np.array_equal if dtype == "f16" else close
        for j in range(len(tokens)):
            path = branch(j)
            want = r.forward([Piece(1, [tokens[i] for i in path], len(path))]).logits[-1]
            r.trim(1, len(path))
            same(rows[j], want)
        path = branch(9)  # [0, 2, 5, 7, 9]
        r.keep(0, len(prompt), path)
        r.forward([Piece(1, [tokens[i] for i in path], 0)])
        assert r.held(0) == r.held(1) == len(prompt) + len(path)
        same(r.forward([Piece(0, [77, 78], 2)]).logits, r.forward([Piece(1, [77, 78], 2)]).logits)
        with pytest.raises(ValueError, match="rise from its first"):
            r.keep(0, len(prompt), [1, 2])
        with pytest.raises(ValueError, match="cannot verify a tree"):
            r.forward([Piece(0, list(range(17)), 17, parents=[-1, *range(16)])])  # more than 16
    finally:
        r.close()


def test_a_tree_is_refused_where_caches_group_tokens(tiny_llama: Path) -> None:
    r = TorchRunner(tiny_llama, n_ctx=128, n_slots=1, dtype="f32", kv_cache="int4", threads=2, compile="off")
    try:
        r.forward([Piece(0, [1, 2, 3], 1)])
        assert r.tree_tokens(0) == 0  # KIVI's groups: chains only
        with pytest.raises(ValueError, match="cannot verify a tree"):
            r.forward([Piece(0, [4, 5, 6], 3, parents=[-1, 0, 0])])
        assert r.held(0) == 3
    finally:
        r.close()


def test_the_head_drafts_a_tree_as_chains_of_its_branches(runner: TorchRunner) -> None:
    """Entries made several at a time, each on its own parent (`head_expand`), give the logits
    a chain drafting each branch in turn gives."""
    r, slot = runner, 0
    r.clear(slot)
    r.forward([Piece(slot, list(range(1000, 1030)), 1)])
    root = r.head_logits(slot, 7)
    a, b = (int(x) for x in np.argsort(-root)[:2])
    level1 = r.head_expand(slot, [a, b], [-1, -1])
    c = int(level1[1].argmax())
    level2 = r.head_expand(slot, [c, 11], [1, 0])  # after b, and after a
    r.head_done(slot)
    for path, got in (([a], level1[0]), ([b], level1[1]), ([b, c], level2[0]), ([a, 11], level2[1])):
        close(r.head_logits(slot, 7), root)
        for t in path[:-1]:
            r.head_logits(slot, t)
        close(r.head_logits(slot, path[-1]), got)
        r.head_done(slot)
