"""The torch runner on its own: forward passes over slots and the cache operations the engine
uses (`localllm.backends.base.Runner`), on the tiny random Llama with float32 weights and caches.

The oracle is the runner itself evaluating the same tokens another way: in one piece or in
chunks, alone or beside another slot, after a trim or a restored prefix, must give the same
logits (bit for bit where the computation is the same; within float32 rounding where only the
chunking differs).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from conftest import need

need("torch", "pip install -e '.[dev]' (torch: pip install torch==2.13.0 first)")

import torch  # noqa: E402

from localllm.backends.base import RUNNER_MEMBERS, Piece  # noqa: E402
from localllm.backends.torch.cache import KVCache  # noqa: E402
from localllm.backends.torch.runner import TorchRunner, open_runner  # noqa: E402
from localllm.errors import ContextOverflow, LocalLLMError  # noqa: E402
from localllm.types import ContextPolicy, LoadOptions  # noqa: E402

ATOL = 1e-4  # float32 logits of the same tokens evaluated in other chunks


@pytest.fixture(scope="module")
def runner(tiny_llama: Path) -> Iterator[TorchRunner]:
    r = TorchRunner(tiny_llama, n_ctx=256, n_slots=3, max_batch=32, dtype="f32", kv_cache="f32",
                    threads=2)  # fmt: skip
    yield r
    r.close()


@pytest.fixture
def run(runner: TorchRunner) -> TorchRunner:
    """The runner with every slot empty and no policy."""
    for s in range(runner.n_slots):
        runner.clear(s)
    return runner


def ids(n: int, seed: int = 0) -> list[int]:
    return [int(t) for t in np.random.default_rng(seed).integers(0, 1000, n)]


def test_the_runner_has_every_member_the_engine_reads(runner: TorchRunner) -> None:
    assert [m for m in RUNNER_MEMBERS if not hasattr(runner, m)] == []
    assert (runner.name, runner.device, runner.dtype) == ("torch", "cpu", "f32")
    assert runner.device_name.startswith("cpu-")
    assert runner.n_layers == 2 and runner.n_vocab == runner.tokenizer.n_vocab
    assert runner.prefix_kind == "edge" and runner.scoring_chunk == runner.max_batch == 32
    assert runner.prefix_budget > 0 and runner.decode_weight_bytes() > 0
    assert set(runner.kv_stats(0)) == {"kv_bytes_per_token", "kv_residual_bytes", "kv_peak_bytes",
                                       "kv_step_bytes"}  # fmt: skip


def test_open_runner_takes_the_load_options(tiny_llama: Path) -> None:
    opts = LoadOptions(backend="torch", device="cpu", dtype="f32", ctx=128, parallel=2, threads=2,
                       kv_cache="int8")  # fmt: skip
    r = open_runner(tiny_llama, opts, name="tiny", digest="0" * 64)
    assert (r.n_ctx, r.n_slots, r.n_threads, r.kv_types) == (128, 2, 2, ("int8", "int8"))
    assert r.prefix_budget > 0 and r.scoring_chunk == r.max_batch  # int8 blocks are shared as written
    r.close()


def test_logits_come_for_each_pieces_last_tokens_in_piece_order(run: TorchRunner) -> None:
    a, b, c = ids(40, 1), ids(9, 2), ids(1, 3)
    f = run.forward([Piece(2, a, 0), Piece(0, b, 3), Piece(1, c, 1)])
    assert f.logits.shape == (4, run.n_vocab) and f.logits.dtype == np.float32 and f.shifted == {}
    assert [run.held(s) for s in range(3)] == [9, 1, 40]
    # the same pieces evaluated one by one, from empty slots
    for s in range(3):
        run.clear(s)
    b_alone = run.forward([Piece(0, b, len(b))]).logits
    c_alone = run.forward([Piece(1, c, 1)]).logits
    # MKL rounds 3 rows of logits otherwise than 9: close, not equal; the one-token piece is the same
    assert np.abs(f.logits[:3] - b_alone[-3:]).max() <= ATOL
    assert np.array_equal(f.logits[3:], c_alone)
    assert run.forward([Piece(2, a, 0)]).logits.shape == (0, run.n_vocab)


def test_chunks_of_a_piece_give_the_same_logits_as_one_piece(run: TorchRunner) -> None:
    text = ids(100)
    whole = run.forward([Piece(0, text, len(text))]).logits  # over max_batch: 4 model calls
    assert whole.shape == (100, run.n_vocab) and run.held(0) == 100
    run.clear(0)
    parts = [run.forward([Piece(0, text[i : i + 7], 7)]).logits for i in range(0, 98, 7)]
    parts.append(run.forward([Piece(0, text[98:], 2)]).logits)
    assert np.abs(np.concatenate(parts) - whole).max() <= ATOL


def test_a_piece_that_does_not_fit_raises_before_anything_is_evaluated(run: TorchRunner) -> None:
    run.forward([Piece(0, ids(200), 0)])
    with pytest.raises(ContextOverflow, match="257 tokens do not fit the context of 256"):
        run.forward([Piece(1, ids(5), 1), Piece(0, ids(57), 1)])
    assert (run.held(0), run.held(1)) == (200, 0)
    with pytest.raises(ValueError, match="two pieces for slot 0"):
        run.forward([Piece(0, [1], 1), Piece(0, [2], 1)])
    with pytest.raises(ValueError, match="cannot give 3 logits"):
        run.forward([Piece(1, [1, 2], 3)])


def test_a_failed_forward_leaves_every_slot_as_it_was(run: TorchRunner, monkeypatch) -> None:  # noqa: ANN001
    run.forward([Piece(0, ids(20), 0), Piece(1, ids(30), 0)])
    before = [[c.state[0].clone() for c in run._caches[s]] for s in (0, 1)]
    layer = run.model.layers[1]
    real = layer.forward
    calls = []

    def fail_on_the_second_piece(*a, **kw):  # noqa: ANN002, ANN003, ANN202
        calls.append(1)
        if len(calls) == 2:  # the first piece went through every layer: it must be undone
            raise RuntimeError("boom")
        return real(*a, **kw)

    monkeypatch.setattr(layer, "forward", fail_on_the_second_piece)
    with pytest.raises(RuntimeError, match="boom"):
        run.forward([Piece(0, ids(5, 9), 1), Piece(1, ids(4, 8), 1)])
    assert (run.held(0), run.held(1)) == (20, 30)
    assert all(c.offset == n for s, n in ((0, 20), (1, 30)) for c in run._caches[s])

    def oom(*a, **kw):  # noqa: ANN002, ANN003, ANN202
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate ...")

    monkeypatch.setattr(layer, "forward", oom)
    with pytest.raises(LocalLLMError, match=r"^the torch engine ran out of memory on cpu evaluating "
                                            r"2 tokens; try a smaller --ctx or --parallel$"):  # fmt: skip
        run.forward([Piece(0, [1], 1), Piece(1, [2], 1)])
    monkeypatch.undo()
    assert (run.held(0), run.held(1)) == (20, 30)
    for s in (0, 1):
        for c, k in zip(run._caches[s], before[s]):
            assert torch.equal(c.state[0], k)


def test_trim_forgets_the_last_positions_exactly(run: TorchRunner) -> None:
    text = ids(30)
    run.forward([Piece(0, text, 0)])
    want = run.forward([Piece(0, [7], 1)]).logits
    run.forward([Piece(0, [8, 9, 10], 3)])  # a rejected draft
    assert run.trim(0, 4, exact=True) and run.held(0) == 30
    assert np.array_equal(run.forward([Piece(0, [7], 1)]).logits, want)
    assert run.trim(0, 0) and run.held(0) == 31


def test_a_layer_skip_draft_is_undone_by_trim_with_the_same_skip(run: TorchRunner) -> None:
    text = ids(30)
    run.forward([Piece(0, text, 0)])
    want = run.forward([Piece(0, [7], 1)]).logits
    run.trim(0, 1)
    skip = frozenset({1})
    full = run.forward([Piece(0, [7], 1)]).logits
    run.trim(0, 1)
    draft = [run.forward([Piece(0, [t], 1)], skip=skip).logits for t in (7, 8, 9)]
    assert not np.array_equal(draft[0], full)  # a shallower model
    assert [c.offset for c in run._caches[0]] == [33, 30]  # only the kept layer's cache grew
    assert run.trim(0, 3, skip=skip)
    assert [c.offset for c in run._caches[0]] == [30, 30]
    assert np.array_equal(run.forward([Piece(0, [7], 1)]).logits, want)


def test_an_inexact_trim_clears_the_slot(run: TorchRunner) -> None:
    """What a context shift forgot cannot come back: a trim past it is not exact, so the slot is
    cleared (its policy kept) and the engine evaluates the prompt afresh."""
    run.clear(0, ContextPolicy(4, 28))
    f = run.forward([Piece(0, ids(40), 1)])  # in chunks of 14: the last one shifts 8
    assert f.shifted == {0: 8} and run.held(0) == 32
    assert run.trim(0, 2, exact=True) and run.held(0) == 30  # after the shift: exact
    assert not run.trim(0, 20, exact=True) and run.held(0) == 0
    f = run.forward([Piece(0, ids(40), 1)])
    assert f.shifted == {0: 8}  # the policy stayed


def test_a_saved_prefix_restores_into_another_slot(run: TorchRunner) -> None:
    text = ids(50)
    run.forward([Piece(0, text, 0)])
    want = run.forward([Piece(0, [5], 1)]).logits
    whole = run.save(0, 0, 50)
    head, tail = run.split(whole, 20)
    assert head.nbytes == tail.nbytes == whole.nbytes  # each the one block (shared) its positions are in
    run.forward([Piece(1, ids(10, 4), 0)])  # the restore replaces what slot 1 held
    assert run.restore(1, [(head, 20), (tail, 30)]) and run.held(1) == 50
    assert np.array_equal(run.forward([Piece(1, [5], 1)]).logits, want)
    assert run.restore(2, [(head, 12)]) and run.held(2) == 12  # a shorter prefix of a block
    with pytest.raises(ValueError, match="positions"):
        run.save(0, 40, 60)
    for h in (whole, head, tail):
        run.release(h)


def test_streaming_shifts_are_reported_and_a_restore_refused(run: TorchRunner) -> None:
    run.clear(0, ContextPolicy(4, 28))
    f = run.forward([Piece(0, ids(30), 1)])  # in chunks of 14 (half the window)
    shifted = f.shifted.get(0, 0)
    for t in ids(20, 5):
        f = run.forward([Piece(0, [t], 1)])
        shifted += f.shifted.get(0, 0)
    assert run.held(0) <= 32 and shifted == 50 - run.held(0)
    assert not isinstance(run._caches[0][0], KVCache)
    with pytest.raises(LocalLLMError, match="only plain float caches"):
        run.save(0, 0, 4)
    assert not run.restore(0, []) and run.held(0) == 0  # a StreamingLLM slot takes no prefix


def test_kv_stats_follow_the_slot(run: TorchRunner) -> None:
    assert run.kv_stats(0)["kv_peak_bytes"] == 0
    run.forward([Piece(0, ids(40), 0)])
    stats = run.kv_stats(0)
    a = run.model.args
    assert stats["kv_bytes_per_token"] == a.n_layers * 2 * a.n_kv_heads * a.head_dim * 4
    assert stats["kv_peak_bytes"] == sum(c.nbytes for c in run._caches[0]) > 0
    run.clear(0)
    assert run.kv_stats(0)["kv_peak_bytes"] == 0


def test_embeddings_are_unit_vectors_and_leave_the_slots_alone(run: TorchRunner) -> None:
    run.forward([Piece(0, ids(10), 0)])
    a, b = run.embed(["a cat", "a cat"])
    assert np.allclose(a, b) and abs(np.linalg.norm(a) - 1) < 1e-5
    assert run.held(0) == 10


def test_a_window_wider_than_the_context_is_the_contexts(tiny_llama: Path) -> None:
    """--streaming 4:1020 with a 64-token context keeps 4 + 60: a long piece goes in chunks of
    half of that, and the slot ends holding 64; sinks that fill the context are refused."""
    r = TorchRunner(tiny_llama, n_ctx=64, max_batch=256, dtype="f32", threads=2)
    r.clear(0, ContextPolicy(4, 1020))
    f = r.forward([Piece(0, ids(200), 1)])
    assert r.held(0) == 64 and f.shifted == {0: 136}
    with pytest.raises(LocalLLMError, match="keeps 64 sink tokens but the context holds 64"):
        r.clear(0, ContextPolicy(64, 8))
    r.close()


@pytest.mark.parametrize(("device", "macos14", "want"), [
    ("cpu", True, ("int4", torch.float32)), ("cuda", True, ("bf16", torch.bfloat16)),
    ("mps", True, ("bf16", torch.bfloat16)), ("mps", False, ("f16", torch.float16)),
])  # fmt: skip
def test_each_device_has_its_default_precision(device: str, macos14: bool, want: tuple,
                                               monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    """Decided without the device (the CUDA and Metal branches run here on the CPU)."""
    from localllm.backends.torch.runner import resolve_dtype

    monkeypatch.setattr(torch.backends.mps, "is_macos_or_newer", lambda *a: macos14)
    assert resolve_dtype("auto", torch.device(device)) == want
    if device == "mps" and not macos14:
        with pytest.raises(LocalLLMError, match="bf16 on Apple Metal needs macOS 14"):
            resolve_dtype("bf16", torch.device(device))


def test_int4_on_a_gpu_computes_in_bf16(monkeypatch: pytest.MonkeyPatch) -> None:
    """int4 is not the CPU's alone: on CUDA and Metal (macOS 14) its 4-bit matrices go to
    tinygemm's kernel and the rest computes in bf16; older macOS says what to use instead."""
    from localllm.backends.torch.runner import resolve_dtype

    monkeypatch.setattr(torch.backends.mps, "is_macos_or_newer", lambda *a: True)
    assert resolve_dtype("int4", torch.device("cpu")) == ("int4", torch.float32)
    assert resolve_dtype("int4", torch.device("cuda")) == ("int4", torch.bfloat16)
    assert resolve_dtype("int4", torch.device("mps")) == ("int4", torch.bfloat16)
    monkeypatch.setattr(torch.backends.mps, "is_macos_or_newer", lambda *a: False)
    with pytest.raises(LocalLLMError, match="int4 on Apple Metal computes in bf16, which needs macOS 14"):
        resolve_dtype("int4", torch.device("mps"))


def test_a_kv_cache_type_the_device_cannot_hold_is_one_line() -> None:
    from localllm.backends.torch.runner import check_kv_types

    assert check_kv_types(("fp8", "int8"), torch.device("cpu")) == ("fp8", "int8")
    with pytest.raises(LocalLLMError, match="Apple Metal has no float8 in torch: use --kv-cache int8"):
        check_kv_types(("f16", "fp8"), torch.device("mps"))
    with pytest.raises(LocalLLMError, match="the torch backend has no q8_0 KV cache"):
        check_kv_types(("q8_0", "q8_0"), torch.device("cpu"))
