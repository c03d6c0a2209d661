"""All of the torch runner's work runs on one thread (`runner.on_compute_thread`): OpenMP gives each
thread that starts parallel work its own team, and two teams on the same cores slowed decoding by half."""

from __future__ import annotations

import os
import signal
import threading

import pytest

from conftest import need

need("torch", "pip install -e '.[dev]' (torch: pip install torch==2.13.0 first)")

from localllm.backends.torch import runner  # noqa: E402


@runner.on_compute_thread
def where() -> str:
    return threading.current_thread().name


@runner.on_compute_thread
def nested() -> tuple[str, str]:
    return threading.current_thread().name, where()  # no deadlock: already on the thread


@runner.on_compute_thread
def fails() -> None:
    raise ValueError("raised on the torch thread")


def test_every_caller_lands_on_the_same_thread() -> None:
    names = [where()]
    t = threading.Thread(target=lambda: names.append(where()))
    t.start()
    t.join()
    assert len(set(names)) == 1 and names[0].startswith("localllm-torch"), names
    assert names[0] != threading.current_thread().name
    assert nested() == (names[0], names[0])


def test_exceptions_reach_the_caller() -> None:
    with pytest.raises(ValueError, match="raised on the torch thread"):
        fails()


def test_a_forked_child_gets_its_own_thread() -> None:
    where()  # the parent's thread exists
    pid = os.fork()
    if pid == 0:  # the child: the parent's thread is not here; a call must still return
        signal.alarm(20)
        try:
            os._exit(0 if where().startswith("localllm-torch") else 1)
        finally:
            os._exit(2)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0


def test_the_runner_loads_and_evaluates_there(default_model_path) -> None:  # noqa: ANN001
    """Model loading, every forward pass, trim and clear run on the torch thread, whichever
    thread calls."""
    from localllm.backends.base import Piece
    from localllm.backends.torch import models

    seen: list[str] = []

    def record(fn):  # noqa: ANN001, ANN202
        def wrapped(*a, **kw):  # noqa: ANN002, ANN003, ANN202
            seen.append(threading.current_thread().name)
            return fn(*a, **kw)

        return wrapped

    real_build = models.build_model
    models.build_model = record(real_build)
    try:
        r = runner.TorchRunner(default_model_path, n_ctx=64, dtype="f32", device="cpu")
    finally:
        models.build_model = real_build
    r.model.forward = record(r.model.forward)
    done: list[object] = []

    def use() -> None:
        f = r.forward([Piece(0, r.tokenize("Hello"), 1)])
        r.forward([Piece(0, [int(f.logits[0].argmax())], 1)])
        done.append(r.trim(0, 1))
        r.clear(0)

    t = threading.Thread(target=use)
    t.start()
    t.join()
    assert done == [True] and r.held(0) == 0
    assert len(seen) >= 3 and set(seen) == {where()}, seen
    r.close()
