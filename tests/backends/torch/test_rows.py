"""Slots' caches as rows of one shared buffer per layer (`cache.Rows`): a decode step of several
slots attends in one call, each row masked to its length, and gives what each sequence gets on its
own; the rows grow together, are counted once, and are freed when no slot is in use."""

from __future__ import annotations

from pathlib import Path

import pytest

from conftest import need

need("torch", "pip install -e '.[dev]' (torch: pip install torch==2.13.0 first)")

import torch  # noqa: E402

from localllm.backends.torch.backend import TorchBackend, on_compute_thread  # noqa: E402
from localllm.backends.torch.cache import KVCache, Rows  # noqa: E402
from localllm.backends.torch.models import base  # noqa: E402


@pytest.fixture(scope="module")
def backend(tiny_llama: Path) -> TorchBackend:
    return TorchBackend(tiny_llama, n_ctx=600, n_slots=4, dtype="f32", kv_cache="f32", threads=2)


@on_compute_thread
@torch.inference_mode()
def decode_together_and_alone(be: TorchBackend, lengths: dict[int, int], steps: int) -> float:
    """Prompts of `lengths[slot]` tokens in those slots; then `steps` decode steps of all of them
    together (shared rows) and of each alone (buffers of its own). Returns the largest logit
    difference; asserts that the batched path was the one taken."""
    g = torch.Generator().manual_seed(sum(lengths.values()))
    prompts = {s: torch.randint(0, 1000, (1, n), generator=g) for s, n in lengths.items()}
    order = list(lengths)  # the caller's order: not necessarily the slots'
    shared = {s: be.new_caches(None, s) for s in order}
    alone = {s: be.new_caches() for s in order}
    assert all(c.rows is not None for c in shared[order[0]]) and alone[order[0]][0].rows is None
    for s in order:
        be.model(prompts[s], [shared[s]])
        be.model(prompts[s], [alone[s]])
    tokens = {s: torch.randint(0, 1000, (steps,), generator=g) for s in order}
    worst = 0.0
    calls = []
    real = base._attend_rows

    def spy(*args, **kwargs):  # type: ignore[no-untyped-def]
        out = real(*args, **kwargs)
        calls.append(out is not None)
        return out

    base._attend_rows = spy
    try:
        for i in range(steps):
            x = torch.stack([tokens[s][i : i + 1] for s in order])  # (B, 1)
            together = be.model.logits(be.model(x, [shared[s] for s in order])[:, -1])
            for row, s in enumerate(order):
                own = be.model.logits(be.model(x[row : row + 1], [alone[s]])[:, -1])
                worst = max(worst, (together[row] - own[0]).abs().max().item())
    finally:
        base._attend_rows = real
    assert calls and all(calls), "a decode step of slots' caches attended row by row"
    for s in order:
        assert shared[s][0].offset == alone[s][0].offset == lengths[s] + steps
        # the same keys in its row (the batched projection may round its last bits otherwise)
        assert torch.allclose(shared[s][0].state[0], alone[s][0].state[0], atol=1e-5)
    return worst


def test_slots_decoding_together_match_each_alone(backend: TorchBackend) -> None:
    # slots out of order, one in between idle (its stale row must not leak into the others)
    assert decode_together_and_alone(backend, {2: 37, 0: 5, 3: 120}, steps=6) < 1e-4


def test_rows_grow_for_the_longest_slot_keeping_the_others() -> None:
    # 250 + 12 crosses the first 256-token step: every row is copied into the grown buffers
    g = torch.Generator().manual_seed(3)
    rows = Rows(3, 2, 8, 1024, dtype=torch.float32)
    lengths = {2: 250, 0: 3}
    shared = [KVCache(2, 8, 1024, dtype=torch.float32, rows=rows, slot=s) for s in lengths]
    alone = [KVCache(2, 8, 1024, dtype=torch.float32) for _ in lengths]
    for a, b, n in zip(shared, alone, lengths.values()):
        k, v = torch.randn(1, 2, n, 8, generator=g), torch.randn(1, 2, n, 8, generator=g)
        a.update_and_fetch(k, v)
        b.update_and_fetch(k, v)
    assert rows.allocated == 256
    for _ in range(12):
        q = torch.randn(2, 1, 4, 8, generator=g)
        k, v = torch.randn(2, 1, 2, 8, generator=g), torch.randn(2, 1, 2, 8, generator=g)
        masks = base.Masks([c.offset for c in shared], 1, q.device)
        together = base.attend(q, k, v, shared, masks)
        each = [base.attend(q[i : i + 1], k[i : i + 1], v[i : i + 1], [alone[i]],
                            base.Masks([alone[i].offset], 1, q.device)) for i in range(2)]  # fmt: skip
        assert torch.allclose(together, torch.cat(each), atol=1e-6)
    assert rows.allocated == 512 and [c.offset for c in shared] == [262, 15]
    for a, b in zip(shared, alone):
        assert torch.equal(a.state[0], b.state[0]) and torch.equal(a.state[1], b.state[1])


def test_rows_are_counted_once_and_freed_when_no_slot_is_used(backend: TorchBackend) -> None:
    backend.drop_caches()
    assert backend._rows is None and backend.kv_bytes() == 0
    caches = backend.new_caches(None, 1)
    for c in caches:
        c.update_and_fetch(torch.zeros(1, c.n_kv, 3, c.head_dim), torch.zeros(1, c.n_kv, 3, c.head_dim))
    rows = backend._rows
    assert rows is not None
    per_layer = 4 * 2 * caches[0].n_kv * 256 * caches[0].head_dim * 4  # 4 slots, K and V, f32
    backend._slots[1].caches = caches
    assert backend.kv_bytes() == len(rows) * per_layer
    assert sum(c.nbytes for c in caches) == len(rows) * per_layer // 4  # a slot's share
    backend._slots[1].caches = []
    backend.drop_caches()
    assert backend._rows is None


def test_a_window_that_would_hide_keys_attends_row_by_row() -> None:
    rows = Rows(2, 1, 4, 64, dtype=torch.float32)
    caches = [KVCache(1, 4, 64, dtype=torch.float32, rows=rows, slot=s) for s in (0, 1)]
    for c, n in zip(caches, (10, 3)):
        c.update_and_fetch(torch.randn(1, 1, n, 4), torch.randn(1, 1, n, 4))
    q, k, v = torch.randn(2, 1, 2, 4), torch.randn(2, 1, 1, 4), torch.randn(2, 1, 1, 4)
    assert base._attend_rows(q, k, v, caches, window=8, scale=None, gqa=True) is None
    assert [c.offset for c in caches] == [10, 3]  # nothing was written
    out = base._attend_rows(q, k, v, caches, window=16, scale=None, gqa=True)
    assert out is not None and out.shape == (2, 1, 8) and [c.offset for c in caches] == [11, 4]
