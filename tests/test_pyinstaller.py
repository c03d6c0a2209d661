"""packaging/pyinstaller/localllm.spec builds one file that runs without this venv: `--version`
(with the llama.cpp recipe it was built with), `list`, `doctor --json` (the llama.cpp probe runs
in a child of the binary itself: `-m` is answered by the entry point), and an answer from the
default model identical to the installed command's (greedy, the same llama.cpp). Slow: the build
takes minutes (`pytest -m slow tests/test_pyinstaller.py`)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import need

ROOT = Path(__file__).resolve().parents[1]
SPEC = ROOT / "packaging" / "pyinstaller" / "localllm.spec"

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def binary(tmp_path_factory: pytest.TempPathFactory) -> Path:
    need("PyInstaller", "pip install -e '.[pyinstaller]'")
    out = tmp_path_factory.mktemp("pyinstaller")
    p = subprocess.run([sys.executable, "-m", "PyInstaller", "--noconfirm", "--log-level", "WARN",
                        "--distpath", str(out / "dist"), "--workpath", str(out / "build"), str(SPEC)],
                       capture_output=True, text=True, timeout=1800, cwd=out)  # fmt: skip
    assert p.returncode == 0, p.stderr[-4000:]
    exe = out / "dist" / "localllm"
    assert exe.is_file() and os.access(exe, os.X_OK)
    return exe


def run(exe: Path | str, *args: str, home: Path) -> subprocess.CompletedProcess[str]:
    # no venv on PATH, no PYTHONPATH: the binary carries what it runs
    env = {"PATH": "/usr/bin:/bin", "HOME": str(home.parent), "LOCALLLM_HOME": str(home), "LANG": "C.UTF-8"}
    return subprocess.run([str(exe), *args], capture_output=True, text=True, timeout=300, env=env, cwd=home.parent)


def test_the_binary_reports_lists_and_checks(binary: Path, tmp_path: Path) -> None:
    from localllm import __version__

    home = tmp_path / "home"
    p = run(binary, "--version", home=home)
    assert p.returncode == 0, p.stderr
    lines = p.stdout.splitlines()
    assert lines[0].startswith(f"localllm {__version__} (Python ")
    # the same llama-cpp-python, llama.cpp and build recipe as the venv it was built from
    installed = subprocess.run([str(Path(sys.executable).with_name("localllm")), "--version"], capture_output=True,
                               text=True, timeout=60).stdout.splitlines()  # fmt: skip
    assert lines[1:-1] == installed[1:-1] and ", llama.cpp " in lines[1]
    assert "torch: not installed" in p.stdout  # left out unless LOCALLLM_FREEZE_TORCH=1
    p = run(binary, "list", home=home)
    assert p.returncode == 0 and "No local models" in p.stdout, p.stderr
    p = run(binary, "doctor", "--json", home=home)
    checks = {c["name"]: c for c in json.loads(p.stdout)["checks"]}
    assert checks["llama_cpp"]["ok"] is True and checks["llama_cpp_probe"]["ok"] is True, checks["llama_cpp_probe"]
    assert checks["backends"]["data"]["auto"] == "llama.cpp"


def test_the_binary_answers_as_the_installed_command_does(binary: Path, default_model_path: Path,
                                                          tmp_path: Path) -> None:  # fmt: skip
    ask = ("run", "smol", "Name three colours.", "--max-tokens", "16", "--temperature", "0", "--backend", "llama.cpp")
    answers = []
    for i, exe in enumerate((binary, Path(sys.executable).with_name("localllm"))):
        home = tmp_path / f"home{i}"
        p = run(exe, "import", str(default_model_path), "--name", "smol", home=home)
        assert p.returncode == 0, p.stderr
        p = run(exe, *ask, home=home)
        assert p.returncode == 0, p.stderr
        answers.append(p.stdout)
    assert answers[0].strip() and answers[0] == answers[1]
