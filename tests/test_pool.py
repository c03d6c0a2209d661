"""The model pool with a fake loader: sharing, counts, idle unloading, memory, threads."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest

from localllm.errors import DoesNotFit, LocalLLMError
from localllm.pool import ModelPool
from localllm.types import LoadOptions

GIB = 1 << 30


class FakeModel:
    def __init__(self, name: str, options: LoadOptions) -> None:
        self.name, self.options = name, options
        self.closed = 0

    def close(self) -> None:
        self.closed += 1


class Loader:
    """Records loads; optionally slow, or failing for one name."""

    def __init__(self, delay: float = 0.0, fail: str | None = None) -> None:
        self.delay, self.fail = delay, fail
        self.loads: list[tuple[str, LoadOptions]] = []
        self.lock = threading.Lock()

    def __call__(self, name: str, options: LoadOptions) -> FakeModel:
        with self.lock:
            self.loads.append((name, options))
        time.sleep(self.delay)
        if name == self.fail:
            raise LocalLLMError(f"{name}: cannot load it")
        return FakeModel(name, options)


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def eventually(cond, timeout: float = 10.0) -> None:  # noqa: ANN001
    end = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < end, "timed out"
        time.sleep(0.01)


def sizes(table: dict[str, int], free: int = 8 * GIB):  # noqa: ANN201
    """A fit function: each name needs its size; the machine has `free` bytes."""
    return lambda name, options: (table[name], free)


def test_same_key_shares_one_model_and_counts_references() -> None:
    loader = Loader()
    pool = ModelPool(loader, fit=None)
    a = pool.acquire("m")
    b = pool.acquire("m", LoadOptions())
    assert a is b and len(loader.loads) == 1
    (info,) = pool.loaded()
    assert info.refs == 2 and info.idle_s is None
    pool.release(a)
    assert pool.loaded()[0].refs == 1 and not a.closed
    pool.release(b)
    assert pool.loaded()[0].refs == 0 and not a.closed  # idle, still loaded (idle_s = 300)
    with pytest.raises(ValueError, match="did not hand out"):
        pool.release(a)  # released twice
    assert pool.acquire("m") is a and len(loader.loads) == 1  # reused, not loaded again
    pool.close()
    assert a.closed == 1 and pool.loaded() == []
    with pytest.raises(LocalLLMError, match="closed"):
        pool.acquire("m")


def test_other_options_load_another_model() -> None:
    loader = Loader()
    with ModelPool(loader, fit=None) as pool:
        a = pool.acquire("m", LoadOptions(ctx=2048))
        b = pool.acquire("m", LoadOptions(ctx=4096))
        c = pool.acquire("m", LoadOptions(ctx=2048, kv_cache="f16"))  # the same options, spelled out
        assert a is not b and a is c
        assert [o.ctx for _n, o in loader.loads] == [2048, 4096]
        assert sorted((x.options.ctx, x.refs) for x in pool.loaded()) == [(2048, 2), (4096, 1)]


def test_idle_timeout_zero_unloads_at_the_last_release() -> None:
    with ModelPool(Loader(), idle_s=0, fit=None) as pool:
        a = pool.acquire("m")
        pool.acquire("m")
        pool.release(a)
        assert not a.closed
        pool.release(a)
        assert a.closed == 1 and pool.loaded() == []
        assert pool.acquire("m") is not a  # loaded afresh


def test_idle_models_unload_after_the_timeout() -> None:
    clock = Clock()
    loader = Loader()
    with ModelPool(loader, idle_s=300, fit=None, clock=clock) as pool:
        a = pool.acquire("a")
        b = pool.acquire("b")
        pool.release(a)
        clock.now += 200
        pool.release(b)
        assert pool.sweep() == []
        clock.now += 150  # a: 350 s idle, b: 150 s
        pool.sweep()  # (or the pool's own timer thread, which may wake first)
        eventually(lambda: a.closed)
        assert [x.name for x in pool.loaded()] == ["b"] and not b.closed
        clock.now += 200
        c = pool.acquire("c")  # acquiring sweeps too
        eventually(lambda: b.closed)
        assert [x.name for x in pool.loaded()] == ["c"]
        pool.release(c)


def test_idle_unloading_runs_by_itself() -> None:
    with ModelPool(Loader(), idle_s=0.2, fit=None) as pool:
        a = pool.acquire("m")
        pool.release(a)
        eventually(lambda: a.closed)
        assert pool.loaded() == []


def test_memory_unloads_idle_models_then_refuses_in_one_line() -> None:
    loader = Loader()
    fit = sizes({"small": 2 * GIB, "big": 5 * GIB, "huge": 7 * GIB}, free=8 * GIB)
    with ModelPool(loader, fit=fit) as pool:
        s = pool.acquire("small")
        b = pool.acquire("big")  # 2 + 5 of 8: fits beside it
        assert not s.closed
        with pytest.raises(DoesNotFit) as e:
            pool.acquire("huge")  # 7 > 8 - (2 + 5 in use): nothing idle to unload
        msg = str(e.value)
        assert "\n" not in msg and "huge needs 7.0 GiB" in msg and "(big, small)" in msg, msg
        assert [n for n, _ in loader.loads] == ["small", "big"]  # refused before loading
        assert not s.closed and not b.closed  # models in use are never unloaded for another
        pool.release(s)
        with pytest.raises(DoesNotFit):
            pool.acquire("huge")  # unloading small would not be enough: keep it
        assert not s.closed
        pool.release(b)
        h = pool.acquire("huge")  # now the idle ones make room, least recently used first
        assert s.closed and b.closed and [x.name for x in pool.loaded()] == ["huge"]
        assert pool.loaded()[0].held_bytes == 7 * GIB
        pool.release(h)


def test_memory_unloads_only_as_many_idle_models_as_needed() -> None:
    clock = Clock()
    fit = sizes({"a": 3 * GIB, "b": 3 * GIB, "c": 3 * GIB}, free=8 * GIB)
    with ModelPool(Loader(), fit=fit, clock=clock) as pool:
        a, b = pool.acquire("a"), pool.acquire("b")
        pool.release(b)
        clock.now += 1
        pool.release(a)  # b has been idle longer
        pool.acquire("c")
        assert b.closed and not a.closed


def test_a_failed_load_is_not_kept() -> None:
    loader = Loader(fail="bad")
    with ModelPool(loader, fit=None) as pool:
        for _ in range(2):
            with pytest.raises(LocalLLMError, match="bad: cannot load it"):
                pool.acquire("bad")
        assert pool.loaded() == [] and len(loader.loads) == 2


def test_concurrent_acquires_load_once() -> None:
    loader = Loader(delay=0.2)
    with ModelPool(loader, fit=None) as pool:
        got: list[FakeModel] = []
        lock = threading.Lock()

        def take(name: str) -> None:
            m = pool.acquire(name)
            with lock:
                got.append(m)

        threads = [threading.Thread(target=take, args=("ab"[i % 2],)) for i in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(10)
        assert len(got) == 8 and len({id(m) for m in got}) == 2
        assert sorted(n for n, _ in loader.loads) == ["a", "b"]
        assert {x.name: x.refs for x in pool.loaded()} == {"a": 4, "b": 4}
        for m in got:
            pool.release(m)
        assert all(x.refs == 0 for x in pool.loaded())


def test_concurrent_waiters_share_a_failure() -> None:
    loader = Loader(delay=0.2, fail="bad")
    with ModelPool(loader, fit=None) as pool:
        errors: list[str] = []

        def take() -> None:
            try:
                pool.acquire("bad")
            except LocalLLMError as e:
                errors.append(str(e))

        threads = [threading.Thread(target=take) for _ in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(10)
        assert errors == ["bad: cannot load it"] * 4 and len(loader.loads) == 1


def test_a_loaded_model_does_not_wait_for_another_load() -> None:
    started = threading.Event()

    def loader(name: str, options: LoadOptions) -> FakeModel:
        if name == "slow":
            started.set()
            time.sleep(1.0)
        return FakeModel(name, options)

    with ModelPool(loader, fit=None) as pool:
        fast = pool.acquire("fast")
        t = threading.Thread(target=pool.acquire, args=("slow",))
        t.start()
        started.wait(5)
        t0 = time.monotonic()
        assert pool.acquire("fast") is fast
        assert time.monotonic() - t0 < 0.5
        t.join(5)


def test_use_releases() -> None:
    with ModelPool(Loader(), idle_s=0, fit=None) as pool:
        with pool.use("m") as m:
            assert pool.loaded()[0].refs == 1
        assert m.closed


def test_registry_fit_estimates_stored_models(tiny_llama: Path) -> None:
    from localllm.models_registry.store import Store
    from localllm.pool import registry_fit

    Store().add_file(tiny_llama, "tiny", source="x")
    fit = registry_fit()
    need, free = fit("tiny", LoadOptions(ctx=128, parallel=1))
    assert 0 < need < 256 << 20 and free > 0
    assert fit("not-stored", LoadOptions()) is None  # the loader decides (it may register it)


def test_a_catalog_name_and_its_full_name_are_one_model() -> None:
    loader = Loader()
    with ModelPool(loader, fit=None) as pool:
        a = pool.acquire("smollm2")
        b = pool.acquire("smollm2:135m-instruct-q4_1")
        assert a is b and len(loader.loads) == 1
        assert loader.loads[0][0] == "smollm2:135m-instruct-q4_1"
        c = pool.acquire("no-such-model")  # unknown names are keyed as given; the load decides
        assert c.name == "no-such-model"
        for m in (a, b, c):
            pool.release(m)
