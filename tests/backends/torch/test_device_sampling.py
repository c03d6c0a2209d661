"""The engine's device sampler (`engine.device_sampling.choose`) against its host sampler (the
oracle, itself checked against llama.cpp's chain in tests/engine/test_sampling.py): for every
chain, the same tokens from the same logits and the same seeded uniforms, whole batches of rows
with different parameters at once, ties broken alike; and the torch runner keeps the rows the
engine samples on its device, so a decode step moves token ids, not logits."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from conftest import need

need("torch", "pip install -e '.[dev]' (torch: pip install torch==2.13.0 first)")

import torch  # noqa: E402

from localllm.backends.base import Piece  # noqa: E402
from localllm.engine.device_sampling import choose  # noqa: E402
from localllm.engine.sampling import Sampler  # noqa: E402
from localllm.types import SamplingParams  # noqa: E402

V = 2000
PLAIN = {"temperature": 1.0, "top_k": 0, "top_p": 1.0, "min_p": 0.0}
CHAINS = [
    {"temperature": 0.0},
    {"top_k": 1}, {"top_k": 7}, {"top_k": 40}, {"top_k": V}, {"top_k": V + 5},
    {"top_p": 0.05}, {"top_p": 0.5}, {"top_p": 0.95},
    {"min_p": 0.05}, {"min_p": 0.5},
    {"temperature": 0.3}, {"temperature": 1.7},
    {"temperature": 0.8, "top_k": 40, "top_p": 0.95, "min_p": 0.05},
    {"temperature": 5.0, "top_k": 100, "min_p": 0.2},
]  # fmt: skip


def host_and_device(logits: np.ndarray, chains: list[dict], seed: int) -> tuple[list[int], list[int]]:
    """Row i drawn with chains[i % len(chains)] by the host sampler and, from twin samplers
    seeded alike, by `choose` over the whole batch at once."""
    params = [SamplingParams(**(PLAIN | chains[i % len(chains)]), seed=seed + i)
              for i in range(len(logits))]  # fmt: skip
    host = [Sampler(p)(row) for p, row in zip(params, logits)]
    choices = [Sampler(p).choice() for p in params]
    return host, choose(torch.from_numpy(logits), choices).tolist()  # type: ignore[arg-type]


def test_every_chain_draws_what_the_host_draws() -> None:
    rng = np.random.default_rng(0)
    for round_ in range(20):
        logits = (rng.standard_normal((len(CHAINS) * 2, V)) * 3).astype(np.float32)
        host, device = host_and_device(logits, CHAINS, seed=100 * round_)
        assert device == host, round_


def test_ties_go_by_token_id_on_both_sides() -> None:
    """Logits on a coarse grid (bf16 logits on a GPU tie often): ties at the top-k edge and
    inside the kept set are ordered by token id, so the same uniform picks the same token."""
    rng = np.random.default_rng(1)
    for round_ in range(20):
        logits = np.round(rng.standard_normal((len(CHAINS), V)) * 2).astype(np.float32)
        host, device = host_and_device(logits, CHAINS, seed=7 * round_)
        assert device == host, round_
    # a tie at the edge of top-k: the lowest ids of the tied ones stay
    ids, _ = Sampler(SamplingParams(temperature=1.0, top_k=3)).candidates(
        np.array([0, 5, 1, 5, 5, 5, 2], dtype=np.float32))  # fmt: skip
    assert ids.tolist() == [1, 3, 4]


def test_greedy_is_the_first_largest_and_draws_nothing() -> None:
    logits = torch.tensor([[1.0, 3.0, 3.0, 2.0], [0.0, -1.0, 0.0, -2.0]])
    greedy = Sampler(SamplingParams(temperature=0.0))
    choice = greedy.choice()
    assert choice is not None and choice.u is None and greedy.rng is None
    assert choose(logits, [choice, choice]).tolist() == [1, 0]


def test_penalties_stay_on_the_host() -> None:
    assert Sampler(SamplingParams(temperature=0.7, repeat_penalty=1.1)).choice() is None
    assert Sampler(SamplingParams(temperature=0.0, presence_penalty=0.5)).choice() is None


def test_rewind_takes_back_a_draw() -> None:
    s = Sampler(SamplingParams(temperature=0.8, seed=3))
    mark = s.mark()
    first = s.choice()
    s.rewind(mark)
    assert s.choice() == first


def test_the_parameters_reach_the_device_in_one_copy(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every row's parameters go over as one tensor, whatever the batch (no copy per row, no
    sync per row: the caller moves the ids once)."""
    from localllm.engine import device_sampling as sampling

    copies: list[tuple[int, ...]] = []
    real = sampling._to

    def counted(dev: torch.device, rows: list[list[float]], dtype: torch.dtype) -> torch.Tensor:
        copies.append((len(rows), len(rows[0])))
        return real(dev, rows, dtype)

    monkeypatch.setattr(sampling, "_to", counted)
    logits = torch.randn(8, V)
    choices = [Sampler(SamplingParams(temperature=0.9, top_k=k, seed=i)).choice()
               for i, k in enumerate((0, 5, 40, 0, 1, 7, 40, 3))]  # fmt: skip
    assert len(choose(logits, choices)) == 8  # type: ignore[arg-type]
    assert copies == [(8, 6)]


def test_the_runner_keeps_the_rows_asked_for_on_its_device(default_model_path: Path) -> None:
    """Two slots read the same prompt; one asks for its logits, the other keeps its row on the
    device: no host row comes back for the second, its device row is the first's, and the
    engine's device draw from it is the host sampler's draw from the first with the same seed."""
    from localllm.backends.torch.runner import TorchRunner

    runner = TorchRunner(default_model_path, n_ctx=64, n_slots=2, compile="off")
    try:
        prompt = runner.tokenize("The quick brown fox")
        params = SamplingParams(temperature=0.9, top_k=40, top_p=0.95, seed=11)
        f = runner.forward([Piece(0, prompt, 1), Piece(1, prompt, 1, True)])
        assert f.logits.shape == (1, runner.n_vocab) and f.device_rows.shape == (1, runner.n_vocab)
        assert torch.equal(f.device_rows.float(), torch.from_numpy(f.logits))
        assert choose(f.device_rows, [Sampler(params).choice()]).tolist() == [Sampler(params)(f.logits[0])]
        with pytest.raises(ValueError, match="one row of logits"):
            runner.forward([Piece(0, [5, 6], 2, True)])
    finally:
        runner.close()


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory):  # noqa: ANN201
    from localllm.engine import load

    from conftest import in_home

    with in_home(tmp_path_factory.mktemp("home")):
        m = load("smollm2", backend="torch", ctx=512, parallel=4)
    yield m
    m.close()


def _ask(m, text: str, **kw) -> tuple[int, ...]:  # noqa: ANN001
    from localllm.types import Request

    request = Request(messages=({"role": "user", "content": text},),
                      sampling=SamplingParams(max_tokens=24, **kw))  # fmt: skip
    return m.submit(request).wait().token_ids


def test_the_engine_draws_the_same_tokens_on_the_device_and_on_the_host(
    engine, monkeypatch: pytest.MonkeyPatch  # noqa: ANN001
) -> None:
    """Seeded and greedy answers are the same whichever side samples; with the device
    sampling, decode steps bring back no logits at all (one transfer of ids)."""
    runner = engine.runner
    rows: list[int] = []
    forward = runner.forward

    def counted(pieces, **kw):  # noqa: ANN001, ANN003, ANN202
        f = forward(pieces, **kw)
        if all(len(p.tokens) == 1 for p in pieces):
            rows.append(f.logits.shape[0])
        return f

    monkeypatch.setattr(runner, "forward", counted)
    asks = [("Tell me about the sea.", {"temperature": 0.8, "top_k": 40, "top_p": 0.95, "seed": 5}),
            ("Name three rivers.", {"temperature": 1.1, "min_p": 0.05, "seed": 9}),
            ("Count to five.", {"temperature": 0.0})]  # fmt: skip
    engine.drop_caches()
    device = [_ask(engine, text, **kw) for text, kw in asks]
    assert rows and not any(rows), rows  # no logits came to the host for a decode step
    monkeypatch.setattr(runner, "logits_on_device", False)
    engine.drop_caches()
    host = [_ask(engine, text, **kw) for text, kw in asks]
    assert device == host
    assert all(len(t) > 4 for t in device)


def test_a_failed_step_takes_back_its_draws(engine, monkeypatch: pytest.MonkeyPatch) -> None:  # noqa: ANN001
    """A step that raised (here: no free KV block, once) drew uniforms for sequences that go on:
    they are taken back, so a seeded answer is the same as without the failure."""
    import threading

    from localllm.errors import OutOfBlocks
    from localllm.types import Request

    seeded = {"temperature": 0.9, "top_k": 40, "seed": 21}
    engine.drop_caches()
    alone = _ask(engine, "Write about the moon.", **seeded)
    runner, forward, failed = engine.runner, engine.runner.forward, threading.Event()

    def once(pieces, **kw):  # noqa: ANN001, ANN003, ANN202
        if not failed.is_set() and sum(1 for p in pieces if p.logits) == 2:
            failed.set()  # the step where the second prompt ends beside the first's decoding
            raise OutOfBlocks("no free block (test)")
        return forward(pieces, **kw)

    monkeypatch.setattr(runner, "forward", once)
    engine.drop_caches()
    first = engine.submit(Request(messages=({"role": "user", "content": "Write about the moon."},),
                                  sampling=SamplingParams(max_tokens=24, **seeded)))  # fmt: skip
    next(iter(first))  # it is decoding
    second = _ask(engine, "Say hello.", temperature=0.0)
    assert failed.is_set() and second
    assert first.wait().token_ids == alone
