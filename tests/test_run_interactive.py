"""`localllm run` as a person uses it: Ctrl-C mid-answer exits 130 cleanly; the REPL on a terminal."""

from __future__ import annotations

import os
import pty
import select
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest


def _default_sigint() -> None:
    """In the child: Ctrl-C's default disposition, whatever the test runner inherited (a runner
    started in the background of a shell without job control ignores SIGINT, and so would the
    child)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def test_ctrl_c_stops_generation_with_exit_130(default_model_path: Path) -> None:
    p = subprocess.Popen(
        [sys.executable, "-m", "localllm", "run", "smollm2", "Write a very long story about the sea.",
         "--max-tokens", "2000", "--temperature", "0"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, preexec_fn=_default_sigint,
    )  # fmt: skip
    assert p.stdout.read(20)  # it is streaming
    p.send_signal(signal.SIGINT)
    out, err = p.communicate(timeout=30)
    assert p.returncode == 130, err
    assert b"Traceback" not in err and err.strip().endswith(b"interrupted")


def _read_until(fd: int, needle: bytes, timeout: float = 60) -> bytes:
    buf = b""
    end = time.monotonic() + timeout
    while needle not in buf:
        left = end - time.monotonic()
        assert left > 0, f"never saw {needle!r}; got {buf[-500:]!r}"
        if select.select([fd], [], [], left)[0]:
            try:
                chunk = os.read(fd, 4096)
            except OSError:
                chunk = b""
            assert chunk, f"the REPL ended before {needle!r}; got {buf[-500:]!r}"
            buf += chunk
    return buf


def _drain(fd: int, seconds: float) -> bytes:
    """Whatever `fd` gives within `seconds` (until EOF)."""
    buf, end = b"", time.monotonic() + seconds
    while (left := end - time.monotonic()) > 0 and select.select([fd], [], [], left)[0]:
        try:
            chunk = os.read(fd, 4096)
        except OSError:
            break
        if not chunk:
            break
        buf += chunk
    return buf


def test_repl_on_a_terminal(default_model_path: Path) -> None:
    pid, fd = pty.fork()
    if pid == 0:
        _default_sigint()  # ^C on the terminal must reach the REPL as Ctrl-C
        os.execv(sys.executable, [sys.executable, "-m", "localllm", "run", "smollm2", "--temperature", "0",
                                  "--max-tokens", "400"])  # fmt: skip
    try:
        _read_until(fd, b">>> ")
        os.write(fd, b"Write a long poem about rain.\n")
        _read_until(fd, b"rain", timeout=60)
        os.write(fd, b"\x03")  # Ctrl-C stops this answer, not the REPL
        _read_until(fd, b">>> ")
        os.write(fd, b"What is 2+2?\n")
        _read_until(fd, b">>> ")
        os.write(fd, b"/bye\n")
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0
    finally:
        os.close(fd)


def test_ctrl_c_right_after_enter_stops_the_answer(default_model_path: Path) -> None:
    """Ctrl-C pressed just after Enter lands while the prompt is prepared — once in the fork that
    renders the chat template, whose callbacks swallowed the KeyboardInterrupt and let a 4,000-token
    answer run on. Pressed at a spread of moments, every one must bring the prompt back."""
    pid, fd = pty.fork()
    if pid == 0:
        _default_sigint()
        # faulthandler: on SIGABRT the REPL prints every thread's stack (below, when it hangs)
        os.execve(sys.executable, [sys.executable, "-m", "localllm", "run", "smollm2", "--temperature", "0",
                                   "--max-tokens", "4000"], {**os.environ, "PYTHONFAULTHANDLER": "1"})  # fmt: skip
    try:
        _read_until(fd, b">>> ")
        for delay in (0, 0, 0.001, 0.002, 0.003, 0.005, 0.005, 0.008, 0.01, 0.02, 0.05):
            os.write(fd, b"Write a long poem about rain.\n")
            _read_until(fd, b"rain.", timeout=10)  # the echo
            time.sleep(delay)
            os.write(fd, b"\x03")
            try:
                _read_until(fd, b">>> ", timeout=60)
            except AssertionError as e:  # which moment lost the Ctrl-C, and where the REPL is
                os.kill(pid, signal.SIGABRT)
                stacks = _drain(fd, 5).decode(errors="replace")[-8000:]
                raise AssertionError(f"Ctrl-C {delay * 1000:g} ms after Enter: {e}\nthe REPL's threads:\n{stacks}") from None
        os.write(fd, b"/bye\n")
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0
    finally:
        os.close(fd)


def test_a_ctrl_c_between_an_answer_and_the_next_prompt_keeps_the_repl() -> None:
    """The gap after an answer (the history update) once let a Ctrl-C end the REPL with exit 130
    (a CI run's flake of test_repl_on_a_terminal); here the interrupt lands there on purpose."""
    from types import SimpleNamespace

    from localllm.repl import Chat, Lines
    from localllm.types import LoadOptions, SamplingParams

    class InterruptedOnce(list):
        hit = False

        def __iadd__(self, other):  # noqa: ANN001, ANN204 - list's own signature
            if not InterruptedOnce.hit:
                InterruptedOnce.hit = True
                raise KeyboardInterrupt
            return super().__iadd__(other)

    lines = iter(["hi", "again", "/bye"])
    asked: list[str] = []
    llm = SimpleNamespace(name="m", sampling=lambda **kw: SamplingParams.from_kwargs(**kw))
    chat = Chat(llm, LoadOptions(), None,
                lambda llm, r: asked.append(r.messages[-1]["content"]) or SimpleNamespace(text="ok", reasoning=None),
                history=InterruptedOnce())  # fmt: skip
    try:
        chat.loop(Lines(lambda prompt: next(lines)))
    except KeyboardInterrupt:  # uncaught, it would stop the whole test session
        pytest.fail("the Ctrl-C escaped the REPL (the command would exit 130)")
    assert asked == ["hi", "again"] and InterruptedOnce.hit
    assert [m["content"] for m in chat.history] == ["again", "ok"]
