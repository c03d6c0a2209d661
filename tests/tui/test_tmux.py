"""The real `localllm` binary in tmux, as a person sees it: Models with smollm2, chat, an answer."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest


def test_tmux_smoke(default_model_path: Path, localllm_home: Path) -> None:
    if shutil.which("tmux") is None:
        pytest.fail("tmux is not installed: apt-get install tmux", pytrace=False)
    from localllm.models_registry.catalog import ensure_local
    from localllm.models_registry.store import Store

    ensure_local("smollm2", Store())  # registered from the package, as `localllm run` would
    session = f"localllm-test-{os.getpid()}"
    exe = Path(sys.executable).with_name("localllm")
    env = f"LOCALLLM_HOME={localllm_home} TERM=xterm-256color"
    subprocess.run(["tmux", "new-session", "-d", "-s", session, "-x", "100", "-y", "30",
                    f"env {env} {exe}"], check=True)  # fmt: skip

    def screen() -> str:
        return subprocess.run(["tmux", "capture-pane", "-p", "-t", session], capture_output=True,
                              text=True).stdout  # fmt: skip

    def wait(text: str, timeout: float = 60) -> str:
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            shot = screen()
            if text in shot:
                return shot
            time.sleep(0.2)
        raise AssertionError(f"never saw {text!r}:\n{screen()}")

    def keys(*k: str) -> None:
        subprocess.run(["tmux", "send-keys", "-t", session, *k], check=True)

    try:
        shot = wait("smollm2:135m-instruct-q4_1")
        assert "Models" in shot and "llama" in shot
        keys("Enter")
        wait("Message (Enter to send")
        keys("Say hello", "Enter")
        shot = wait("tokens/s", timeout=120)
        assert "/4,096" in shot  # the context meter (a long answer may scroll the labels away)
        print(shot)  # what a person saw (pytest -s shows it)
        keys("C-q")
        end = time.monotonic() + 10
        while (
            time.monotonic() < end
            and subprocess.run(
                ["tmux", "has-session", "-t", session], capture_output=True
            ).returncode
            == 0
        ):
            time.sleep(0.2)
    finally:
        subprocess.run(["tmux", "kill-session", "-t", session], capture_output=True)
