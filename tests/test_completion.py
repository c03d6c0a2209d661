"""Shell completion (Typer's) for bash, zsh and fish: the scripts `--show-completion` prints, the
answers `localllm` gives each shell's protocol, bash running its script for real, and
`--install-completion` writing into a home. Formats as Homebrew's `shell_parameter_format: :typer`
asks for them (SHELL set, shell detection off, the shell named)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

BIN = Path(sys.executable).parent  # the venv's bin: `localllm` is there


def localllm(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    full = dict(os.environ, PATH=f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}") | (env or {})
    return subprocess.run([str(BIN / "localllm"), *args], capture_output=True, text=True, timeout=60, env=full)


def script(shell: str) -> str:
    p = localllm("--show-completion", shell, env={"SHELL": shell, "_TYPER_COMPLETE_TEST_DISABLE_SHELL_DETECTION": "1"})
    assert p.returncode == 0, p.stderr
    return p.stdout


@pytest.mark.parametrize("shell", ["bash", "zsh", "fish"])
def test_each_shell_gets_its_script(shell: str) -> None:
    text = script(shell)
    assert f"_LOCALLLM_COMPLETE=complete_{shell}" in text
    assert {"bash": "complete -o default -F _localllm_completion localllm", "zsh": "compdef _localllm_completion localllm",
            "fish": "complete --command localllm"}[shell] in text  # fmt: skip


def test_the_protocols_answer_commands_and_options() -> None:
    bash = localllm(env={"_LOCALLLM_COMPLETE": "complete_bash", "COMP_WORDS": "localllm se", "COMP_CWORD": "1"})
    assert bash.stdout.split() == ["serve"]
    bash = localllm(env={"_LOCALLLM_COMPLETE": "complete_bash", "COMP_WORDS": "localllm run --kv", "COMP_CWORD": "2"})
    assert bash.stdout.split() == ["--kv-cache"]
    zsh = localllm(env={"_LOCALLLM_COMPLETE": "complete_zsh", "_TYPER_COMPLETE_ARGS": "localllm qua"})
    assert '"quantize":' in zsh.stdout
    fish = localllm(env={"_LOCALLLM_COMPLETE": "complete_fish", "_TYPER_COMPLETE_ARGS": "localllm pu",
                         "_TYPER_COMPLETE_FISH_ACTION": "get-args"})  # fmt: skip
    assert fish.stdout.startswith("pull\t")


def test_bash_runs_the_script_and_completes(tmp_path: Path) -> None:
    bash = shutil.which("bash")
    assert bash, "bash is not installed"
    (tmp_path / "localllm.bash").write_text(script("bash"))
    line = ('source "$1"; COMP_WORDS=(localllm show --j); COMP_CWORD=2; _localllm_completion localllm; '
            'printf "%s\\n" "${COMPREPLY[@]}"')  # fmt: skip
    p = subprocess.run([bash, "-c", line, "bash", str(tmp_path / "localllm.bash")], capture_output=True, text=True,
                       timeout=60, env=dict(os.environ, PATH=f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}"))  # fmt: skip
    assert p.returncode == 0 and p.stdout.split() == ["--json"], p.stdout + p.stderr


def test_install_completion_writes_into_the_home(tmp_path: Path) -> None:
    env = {"HOME": str(tmp_path), "SHELL": "bash", "_TYPER_COMPLETE_TEST_DISABLE_SHELL_DETECTION": "1"}
    p = localllm("--install-completion", "bash", env=env)
    assert p.returncode == 0 and "bash completion installed in" in p.stdout, p.stdout + p.stderr
    installed = tmp_path / ".bash_completions" / "localllm.sh"
    assert "_LOCALLLM_COMPLETE=complete_bash" in installed.read_text()
    assert ".bash_completions/localllm.sh" in (tmp_path / ".bashrc").read_text()  # sourced at start-up
