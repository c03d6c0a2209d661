"""The real `localllm` binary in tmux, as a person sees it (`tmux capture-pane`)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest


def _answer_started(shot: str) -> bool:
    lines = shot.splitlines()
    starts = [i for i, ln in enumerate(lines) if ln.strip() == "assistant"]
    return bool(starts) and any(ln.strip() for ln in lines[starts[-1] + 1 : starts[-1] + 3])


class Tmux:
    def __init__(self, command: str, home: Path) -> None:
        if shutil.which("tmux") is None:
            pytest.fail("tmux is not installed: apt-get install tmux", pytrace=False)
        self.session = f"localllm-test-{os.getpid()}-{time.monotonic_ns()}"
        exe = Path(sys.executable).with_name("localllm")
        env = f"LOCALLLM_HOME={home} TERM=xterm-256color"
        subprocess.run(["tmux", "new-session", "-d", "-s", self.session, "-x", "100", "-y", "30",
                        f"env {env} {exe} {command}"], check=True)  # fmt: skip

    def screen(self) -> str:
        return subprocess.run(["tmux", "capture-pane", "-p", "-t", self.session],
                              capture_output=True, text=True).stdout  # fmt: skip

    def wait(self, text: str, timeout: float = 60) -> str:
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            shot = self.screen()
            if text in shot:
                return shot
            time.sleep(0.2)
        raise AssertionError(f"never saw {text!r}:\n{self.screen()}")

    def answer(self, prompt: str) -> str:
        """Ask; once the answer streams, stop it; return the screen with its status line.

        The app samples (temperature 0.8, no token limit): one answer in a few is a long ramble,
        and on a busy 2-core machine it can outlast any fixed wait. Stopping it is what a person
        does, and the status line (tokens/s, the context meter, "stopped") follows either way.
        """
        self.keys(prompt, "Enter")
        end = time.monotonic() + 120
        while not _answer_started(self.screen()):
            assert time.monotonic() < end, f"no answer began:\n{self.screen()}"
            time.sleep(0.2)
        self.keys("Escape")
        return self.wait("tokens/s", timeout=120)

    def keys(self, *k: str) -> None:
        subprocess.run(["tmux", "send-keys", "-t", self.session, *k], check=True)

    def alive(self) -> bool:
        return subprocess.run(["tmux", "has-session", "-t", self.session],
                              capture_output=True).returncode == 0  # fmt: skip

    def quit(self) -> None:
        self.keys("C-q")
        end = time.monotonic() + 10
        while time.monotonic() < end and self.alive():
            time.sleep(0.2)
        assert not self.alive(), "Ctrl+Q did not quit"

    def close(self) -> None:
        subprocess.run(["tmux", "kill-session", "-t", self.session], capture_output=True)


def test_models_then_chat(default_model_path: Path, localllm_home: Path) -> None:
    """`localllm`: the Models table with smollm2, Enter, "Say hello", an answer, Ctrl+Q."""
    from localllm.models_registry.catalog import ensure_local
    from localllm.models_registry.store import Store

    ensure_local("smollm2", Store())  # registered from the package, as `localllm run` would
    t = Tmux("", localllm_home)
    try:
        shot = t.wait("smollm2:135m-instruct-q4_1")
        assert "Models" in shot and "llama" in shot
        t.keys("Enter")
        t.wait("Message (Enter to send")
        shot = t.answer("Say hello")
        assert "/4,096" in shot  # the context meter (a long answer may scroll the labels away)
        print(shot)  # what a person saw (pytest -s shows it)
        t.quit()
    finally:
        t.close()


def test_readme_main_command_on_a_fresh_store(
    default_model_path: Path, localllm_home: Path
) -> None:
    """The README's main job, `localllm chat smollm2`, with nothing registered yet."""
    t = Tmux("chat smollm2", localllm_home)
    try:
        t.wait("Message (Enter to send")
        shot = t.answer("Say hello")
        assert "smollm2" in shot and "/4,096" in shot
        t.keys("C-o")  # to Models: the default model is registered now (it was "built in")
        shot = t.wait("smollm2:135m-instruct-q4_1  llama")  # a Local row (Available has no Arch)
        assert "built in, ready" not in shot
        t.quit()
    finally:
        t.close()


def test_first_screen_on_a_fresh_store(default_model_path: Path, localllm_home: Path) -> None:
    """`localllm` with nothing stored: the built-in model and the catalog; Enter chats."""
    t = Tmux("", localllm_home)
    try:
        for part in ("built in, ready", "Nothing downloaded yet", "qwen2.5:0.5b-q4_k_m"):
            t.wait(part)  # each in turn: the screen fills in over a few frames
        t.keys("Enter")  # registers smollm2 from its package, then opens the chat
        t.wait("Message (Enter to send")
        shot = t.answer("Say hello")
        assert "smollm2:135m-instruct-q4_1" in shot
        t.quit()
    finally:
        t.close()
