"""The llama.cpp runner on its own: forward passes over slots and the cache operations.

llama.cpp is the oracle: the same tokens evaluated in one piece, in chunks, beside another slot's,
after a trim or a restored state must give the same logits (within the rounding its CPU kernels
give a row of a larger batch).
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from localllm.backends.base import RUNNER_MEMBERS, Piece
from localllm.backends.llamacpp import LlamaCppRunner
from localllm.errors import ContextOverflow, LocalLLMError
from localllm.types import ContextPolicy

TEXT = ("The old lighthouse keeper climbed the spiral stairs every evening at dusk, carrying a "
        "lantern and a flask of tea. From the top he could see the whole bay, the fishing boats "
        "coming home, and the gulls circling over the harbour wall.")  # fmt: skip
OTHER = "def fibonacci(n):\n    a, b = 0, 1\n    for _ in range(n):\n        a, b = b, a + b\n"
ATOL = 0.3  # logits: llama.cpp's kernels round a row of a larger batch otherwise (flash attention)
MAX_BATCH = 32


@pytest.fixture(scope="module")
def runner(default_model_path: Path) -> Iterator[LlamaCppRunner]:
    r = LlamaCppRunner(default_model_path, n_ctx=256, n_slots=3, max_batch=MAX_BATCH,
                       n_threads=2, n_gpu_layers=0)  # fmt: skip
    yield r
    r.close()


@pytest.fixture
def run(runner: LlamaCppRunner) -> LlamaCppRunner:
    """The runner with every slot empty and no policy."""
    for s in range(runner.n_slots):
        runner.clear(s)
    return runner


def ids_of(runner: LlamaCppRunner, text: str) -> list[int]:
    return runner.tokenize(text, add_special=True)


def close(a: np.ndarray, b: np.ndarray, atol: float = ATOL) -> None:
    assert a.shape == b.shape
    assert np.abs(a - b).max() <= atol, np.abs(a - b).max()
    assert (a.argmax(-1) == b.argmax(-1)).all()


def last_logits(runner: LlamaCppRunner, slot: int, ids: list[int], chunk: int) -> np.ndarray:
    """Evaluate `ids` in pieces of `chunk` tokens; the last token's logits."""
    for i in range(0, len(ids), chunk):
        part = ids[i : i + chunk]
        got = runner.forward([Piece(slot, part, 1 if i + chunk >= len(ids) else 0)]).logits
    assert got.shape == (1, runner.n_vocab) and got.dtype == np.float32
    return got[0]


def test_the_runner_has_every_member_the_engine_reads(runner: LlamaCppRunner) -> None:
    missing = [m for m in RUNNER_MEMBERS if not hasattr(runner, m)]
    assert missing == []
    assert (runner.device, runner.device_name, runner.dtype) == ("cpu", "CPU", "auto")
    assert runner.n_layers == 30 and runner.n_vocab == 49152
    assert runner.prefix_kind == "full" and runner.scoring_chunk == runner.max_batch == MAX_BATCH
    assert runner.decode_weight_bytes() is None and runner.kv_stats(0) == {}


def test_one_piece_or_chunks_give_the_same_logits(run: LlamaCppRunner) -> None:
    ids = ids_of(run, TEXT)
    assert MAX_BATCH < len(ids) < 2 * 256
    whole = last_logits(run, 0, ids, len(ids))  # over max_batch: split across decodes
    assert run.held(0) == len(ids)
    run.clear(0)
    close(last_logits(run, 0, ids, 7), whole)
    run.clear(0)
    close(last_logits(run, 0, ids, 1), whole)


def test_every_row_when_asked(run: LlamaCppRunner) -> None:
    ids = ids_of(run, TEXT)[:40]
    rows = run.forward([Piece(0, ids, len(ids))]).logits
    assert rows.shape == (len(ids), run.n_vocab)
    run.clear(0)
    close(last_logits(run, 0, ids[:10], 10), rows[9])
    run.clear(0)
    tail = run.forward([Piece(0, ids[:30], 0)]).logits
    assert tail.shape == (0, run.n_vocab)
    close(run.forward([Piece(0, ids[30:], 3)]).logits, rows[-3:])


def test_two_slots_in_one_forward_as_each_alone(run: LlamaCppRunner) -> None:
    a, b = ids_of(run, TEXT)[:20], ids_of(run, OTHER)[:12]
    alone_a = run.forward([Piece(0, a, 2)]).logits
    alone_b = run.forward([Piece(2, b, 1)]).logits
    run.clear(0)
    run.clear(2)
    both = run.forward([Piece(2, b, 1), Piece(0, a, 2)]).logits  # rows in the caller's order
    close(both[0:1], alone_b)
    close(both[1:3], alone_a)
    assert (run.held(0), run.held(1), run.held(2)) == (20, 0, 12)
    # a decode step for both
    step = run.forward([Piece(0, [a[-1]]), Piece(2, [b[-1]])]).logits
    assert step.shape == (2, run.n_vocab) and (run.held(0), run.held(2)) == (21, 13)


def test_trim_then_forward_again(run: LlamaCppRunner) -> None:
    ids = ids_of(run, TEXT)[:24]
    run.forward([Piece(0, ids[:20], 0)])
    draft = ids[20:24]
    first = run.forward([Piece(0, draft, len(draft))]).logits
    assert run.trim(0, 3, exact=True) is True and run.held(0) == 21
    again = run.forward([Piece(0, draft[1:], 3)]).logits
    close(again, first[1:], atol=1e-3)
    with pytest.raises(LocalLLMError):
        run.trim(0, 99)
    with pytest.raises(LocalLLMError, match="layers"):
        run.trim(0, 1, skip=frozenset({3}))
    with pytest.raises(LocalLLMError, match="layers"):
        run.forward([Piece(0, [1])], skip=frozenset({3}))
    assert run.held(0) == 24


def test_refused_forward_leaves_every_slot_as_it_was(run: LlamaCppRunner) -> None:
    ids = ids_of(run, TEXT)[:16]
    run.forward([Piece(0, ids, 0)])
    with pytest.raises(LocalLLMError, match="vocabulary"):
        run.forward([Piece(1, [1, 2, 3]), Piece(0, [run.n_vocab + 5])])
    with pytest.raises(ContextOverflow, match="do not fit the context of 256"):
        run.forward([Piece(1, [1, 2, 3]), Piece(0, [1] * (256 - 16 + 1))])
    assert (run.held(0), run.held(1)) == (16, 0)


def test_failed_decode_removes_what_the_call_added(
    run: LlamaCppRunner, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A second `llama_decode` fails after the first one filled cells of both slots: every cell
    this call added goes, and the slots go on as if it never ran."""
    a, b = ids_of(run, TEXT), ids_of(run, OTHER)
    run.forward([Piece(0, a[:8], 0), Piece(1, b[:4], 0)])
    expect_a = run.forward([Piece(0, a[8:28], 1)]).logits
    expect_b = run.forward([Piece(1, b[4:24], 1)]).logits
    assert run.trim(0, 20) and run.trim(1, 20)
    batch = type(run._batch)
    real, calls = batch.decode, []

    def second_fails(self, ctx, n):  # noqa: ANN001, ANN202
        calls.append(n)
        return real(self, ctx, n) if len(calls) == 1 else -1

    monkeypatch.setattr(batch, "decode", second_fails)
    with pytest.raises(LocalLLMError, match="llama_decode returned -1"):
        run.forward([Piece(1, b[4:24], 1), Piece(0, a[8:28], 1)])  # 40 tokens: two decodes
    monkeypatch.undo()
    assert calls == [MAX_BATCH, 40 - MAX_BATCH]  # the first: all of slot 0's, 12 of slot 1's
    assert (run.held(0), run.held(1)) == (8, 4)
    close(run.forward([Piece(0, a[8:28], 1)]).logits, expect_a, atol=1e-3)
    close(run.forward([Piece(1, b[4:24], 1)]).logits, expect_b, atol=1e-3)


def test_streaming_policy_shifts_and_says_so(run: LlamaCppRunner) -> None:
    policy = ContextPolicy(4, 32)
    run.clear(0, policy)
    ids = (ids_of(run, TEXT) * 2)[:100]
    fed, forgotten = 0, 0
    out = run.forward([Piece(0, ids[:60], 1)])  # in parts of 16, shifting before those that need it
    fed += 60
    forgotten += out.shifted.get(0, 0)
    assert out.logits.shape == (1, run.n_vocab)
    assert forgotten > 0 and run.held(0) == fed - forgotten <= 36
    for t in ids[60:]:
        out = run.forward([Piece(0, [t])])
        fed += 1
        forgotten += out.shifted.get(0, 0)
        assert set(out.shifted) <= {0} and run.held(0) <= 36
        assert np.isfinite(out.logits).all()
    assert run.held(0) == fed - forgotten
    # a shift forgets at least a quarter of the window at once (llama.cpp's context shift)
    run.clear(0, policy)
    run.forward([Piece(0, ids[:36], 0)])
    assert run.forward([Piece(0, [ids[36]])]).shifted == {0: 8}
    run.clear(0)  # no policy: the next piece that does not fit is refused
    with pytest.raises(ContextOverflow):
        run.forward([Piece(0, [1] * 257)])


def test_save_and_restore_give_the_same_next_logits(run: LlamaCppRunner) -> None:
    ids = ids_of(run, TEXT)[:30]
    run.forward([Piece(0, ids, 0)])
    assert run.save(0, 0, 20) is None  # a state holds the whole sequence: only its end
    handle = run.save(0, 0, len(ids))
    assert handle is not None and handle.nbytes > 0
    expect = run.forward([Piece(0, [ids[0]], 1)]).logits
    assert run.restore(1, [(handle, len(ids))]) is True and run.held(1) == len(ids)
    close(run.forward([Piece(1, [ids[0]], 1)]).logits, expect, atol=1e-3)
    # keep only the first 12 of the state's positions and evaluate the rest again
    assert run.restore(2, [(handle, 12)]) is True and run.held(2) == 12
    close(run.forward([Piece(2, ids[12:] + [ids[0]], 1)]).logits, expect)
    assert run.restore(2, [(object(), 3)]) is False and run.held(2) == 0
    with pytest.raises(LocalLLMError):
        run.split(handle, 3)


def test_kv_bytes_follow_what_the_slots_hold(run: LlamaCppRunner) -> None:
    assert run.kv_bytes() == 0
    run.forward([Piece(0, [1] * 10, 0)])
    ten = run.kv_bytes()
    run.forward([Piece(1, [1] * 20, 0)])
    assert ten > 0 and run.kv_bytes() > 2.5 * ten


def _imports(path: Path) -> set[str]:
    """Every module a file imports, function-level imports included (TYPE_CHECKING excluded)."""
    tree = ast.parse(path.read_text())
    skip = {id(n) for node in ast.walk(tree) if isinstance(node, ast.If)
            and "TYPE_CHECKING" in ast.unparse(node.test) for n in ast.walk(node)}  # fmt: skip
    found: set[str] = set()
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            found.add(node.module)
            found.update(f"{node.module}.{a.name}" for a in node.names)
    return found


def test_runner_imports_no_engine_and_no_cycle() -> None:
    import localllm.backends.llamacpp as mod

    folder = Path(mod.__file__).parent
    names = {
        n: _imports(folder / f"{n}.py") for n in ("llamacpp", "llamacpp_guard", "llamacpp_child")
    }
    bad = (
        "localllm.engine",
        "localllm.speculation",
        "localllm.models_registry",
        "localllm.prefix_cache",
    )
    assert not [m for m in names["llamacpp"] if m.startswith(bad)]
    edges = {a: {b for b in names if f"localllm.backends.{b}" in names[a]} for a in names}
    assert edges == {"llamacpp": {"llamacpp_guard"}, "llamacpp_guard": set(),
                     "llamacpp_child": {"llamacpp", "llamacpp_guard"}}  # fmt: skip
