"""llama.cpp never takes the process down: the probe, the first load in a child, the log, templates.

A probe command that kills itself with SIGILL stands for a build that uses instructions the CPU
traps (AMX under some hypervisors); one that sleeps stands for a hang. Each child resets the
signal's disposition itself, so the result does not depend on what the test runner inherited.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from localllm.backends import llamacpp_guard as guard
from localllm.errors import BackendUnavailable, LocalLLMError
from localllm.models_registry.store import Store

from conftest import SIGILL_SELF, python_command
from ggufs import copy_gguf


def counting_command(tmp_path: Path, body: str) -> tuple[str, Path]:
    """A shell command that notes each run in a file, then runs `body` in Python."""
    count = tmp_path / "probe-runs"
    code = f"open({str(count)!r}, 'a').write('x'); {body}"
    return python_command(code), count


def runs(count: Path) -> int:
    return len(count.read_text()) if count.exists() else 0


def cli(args: list[str], timeout: float = 120, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "localllm", *args], capture_output=True,
                          text=True, timeout=timeout, env=os.environ | env)  # fmt: skip


def assert_one_line(p: subprocess.CompletedProcess[str], *texts: str) -> None:
    assert p.returncode == 1, (p.returncode, p.stdout, p.stderr)
    assert p.stderr.startswith("error: ") and p.stderr.count("\n") == 1, p.stderr
    assert "Traceback" not in p.stderr + p.stdout
    for t in texts:
        assert t in p.stderr, p.stderr


# -- the probe -----------------------------------------------------------------------------------


def test_real_probe_passes_and_is_cached(localllm_home: Path) -> None:
    """The build installed here evaluates the tiny model; the second call reads the store."""
    v = guard.probe()
    assert v.ok, v.message()
    assert not v.cached
    cache = json.loads((localllm_home / guard.CACHE_FILE).read_text())
    assert cache["probe"]["ok"] is True and cache["probe"]["key"] == guard.library_key()
    again = guard.probe()
    assert again.ok and again.cached


def test_probe_model_is_a_gguf_llama_cpp_and_our_reader_accept(tmp_path: Path) -> None:
    from localllm.gguf_file import GGUFFile
    from localllm.model_info import model_info

    path = guard.write_probe_model(tmp_path / "probe.gguf")
    with GGUFFile(path) as gf:
        info = model_info(gf)
    assert (info.architecture, info.n_layers, info.vocab_size) == ("llama", 2, 259)
    from localllm.backends import llamacpp_child

    # the child's work, here in the test process
    assert llamacpp_child.main(["probe", str(tmp_path)]) == 0


def test_sigill_probe_is_one_line_exit_1_and_cached(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, localllm_home: Path
) -> None:
    command, count = counting_command(tmp_path, SIGILL_SELF)
    monkeypatch.setenv("LOCALLLM_LLAMACPP_PROBE", command)
    llama = ["run", "smollm2", "--backend", "llama.cpp", "Say hello"]
    p = cli(llama, LOCALLLM_LLAMACPP_PROBE=command)
    assert_one_line(p, "llama.cpp cannot run on this machine", "SIGILL", "illegal instruction",
                    "fix:", "llamacpp-build")  # fmt: skip
    assert runs(count) == 1
    # the verdict is cached in the store: no second probe, same line
    p2 = cli(llama, LOCALLLM_LLAMACPP_PROBE=command)
    assert p2.stderr == p.stderr and p2.returncode == 1
    assert runs(count) == 1
    # the Python API says the same, as an exception a caller can catch
    import localllm

    with pytest.raises(BackendUnavailable, match="SIGILL"):
        localllm.load("smollm2", backend="llama.cpp")
    assert runs(count) == 1
    # auto falls back to the torch engine, and --stats says why
    p3 = cli(["run", "smollm2", "--max-tokens", "4", "--stats", "Say hello"],
             LOCALLLM_LLAMACPP_PROBE=command)  # fmt: skip
    assert p3.returncode == 0, p3.stderr
    assert "backend torch on cpu, int4" in p3.stderr
    assert "llama.cpp cannot run on this machine: " in p3.stderr and "SIGILL" in p3.stderr
    assert runs(count) == 1


def test_hanging_probe_is_killed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    command, count = counting_command(tmp_path, "import time; time.sleep(600)")
    monkeypatch.setenv("LOCALLLM_LLAMACPP_PROBE", command)
    t0 = time.monotonic()
    v = guard.probe(timeout=2)
    assert time.monotonic() - t0 < 60  # killed, not waited for (the bound is loose on purpose)
    assert not v.ok and "hung" in v.reason and v.fix
    assert runs(count) == 1
    assert guard.probe().cached and runs(count) == 1


def test_probe_runs_again_after_the_library_changes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    lib = tmp_path / "libggml-cpu.so"
    lib.write_bytes(b"one")
    monkeypatch.setattr(guard, "library_files", lambda: [lib])
    command, count = counting_command(tmp_path, SIGILL_SELF)
    monkeypatch.setenv("LOCALLLM_LLAMACPP_PROBE", command)
    assert not guard.probe().ok and runs(count) == 1
    assert guard.probe().cached and runs(count) == 1
    lib.write_bytes(b"rebuilt")  # another size and mtime: a rebuilt library
    v = guard.probe()
    assert not v.cached and runs(count) == 2


def test_failing_probe_quotes_the_child(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    command, _ = counting_command(
        tmp_path, "import sys; print('ggml: error: no backend found', file=sys.stderr); sys.exit(3)"
    )
    monkeypatch.setenv("LOCALLLM_LLAMACPP_PROBE", command)
    v = guard.probe()
    assert not v.ok and "no backend found" in v.reason and "\n" not in v.message()


# -- the first load of each file -------------------------------------------------------------------


def test_first_load_runs_once_per_file(
    tiny_llama: Path, monkeypatch: pytest.MonkeyPatch, localllm_home: Path
) -> None:
    record = Store().add_file(tiny_llama, "tiny", source="test")
    calls: list[list[str]] = []
    real_run = guard._run

    def spy(args, timeout, env=None):  # noqa: ANN001, ANN202
        calls.append(args)
        return real_run(args, timeout, env)

    monkeypatch.setattr(guard, "_run", spy)
    path = Store().path_of(record)
    guard.check_load(path, record.digest, record.name)
    guard.check_load(path, record.digest, record.name)
    assert len(calls) == 1 and calls[0][-3] == "load"
    loads = json.loads((localllm_home / guard.CACHE_FILE).read_text())["loads"]
    assert loads[record.digest]["ok"] is True


def test_a_file_llama_cpp_aborts_on_is_refused_not_fatal(
    tiny_llama: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """llama.cpp aborts (SIGABRT) on some well-formed files; here that is one line, twice."""
    from localllm.backends.llamacpp_guard import _Exit

    calls = []

    def abort(args, timeout, env=None):  # noqa: ANN001, ANN202
        calls.append(args)
        return _Exit(-6, "", "GGML_ASSERT(n_embd_head_k % ggml_blck_size(type) == 0) failed\n")

    monkeypatch.setattr(guard, "_run", abort)
    for _ in range(2):
        with pytest.raises(LocalLLMError) as e:
            guard.check_load(tiny_llama, "ab" * 32, "broken:latest")
        msg = str(e.value)
        assert msg.startswith("broken:latest: llama.cpp crashed with SIGABRT") and "\n" not in msg
        assert "GGML_ASSERT" in msg
    assert len(calls) == 1  # the refusal is remembered for this file and library


def test_real_abort_in_a_child(tmp_path: Path, tiny_llama: Path) -> None:
    """A file that makes llama.cpp itself abort: the child dies, this process says one line."""
    broken = copy_gguf(tiny_llama, tmp_path / "abort.gguf", {"llama.attention.head_count": 3})
    with pytest.raises(LocalLLMError) as e:
        guard.check_load(broken, "cd" * 32, "abort:latest")
    msg = str(e.value)
    assert msg.startswith("abort:latest: llama.cpp ") and "\n" not in msg
    assert "Traceback" not in msg and str(broken) not in msg


# -- what a user sees when a load fails ------------------------------------------------------------


def test_load_failure_names_the_model_and_llama_cpp_reason(
    tmp_path: Path, tiny_llama: Path
) -> None:
    """Not `ValueError: Failed to load model from file: <blob path>`."""
    odd = copy_gguf(tiny_llama, tmp_path / "odd.gguf", {"general.architecture": "oddarch"})
    imported = cli(["import", str(odd), "--name", "odd"])
    if imported.returncode != 0:  # refused at import: a one-line reason is also right
        assert_one_line(imported, "odd")
        return
    p = cli(["run", "odd", "hi"])
    assert_one_line(p, "odd:latest", "llama.cpp cannot load it", "oddarch")
    assert "ValueError" not in p.stderr and "blobs" not in p.stderr


def test_llama_cpp_log_goes_to_the_store_not_the_terminal(
    gemma_model_path: Path, localllm_home: Path
) -> None:
    """Gemma 3's sliding-window cache makes llama.cpp log warnings; `run` prints only the answer."""
    assert cli(["import", str(gemma_model_path), "--name", "gemma"]).returncode == 0
    p = cli(["run", "gemma", "Say hello", "--max-tokens", "8", "--temperature", "0"])
    assert p.returncode == 0, p.stderr
    for text in (p.stdout, p.stderr):
        assert "llama_" not in text and "ggml_" not in text and "n_ctx" not in text, text
    log = (localllm_home / "logs" / "llama.cpp.log").read_text()
    assert "llama_" in log or "load" in log
    assert len(log.splitlines()) > 5


# -- templates -------------------------------------------------------------------------------------

HOSTILE_TEMPLATES = {
    # jinja2's stock sandbox folds constants while compiling: that compile runs for hours
    "folded power": "{{ 7 ** 999999999 }}{% for m in messages %}{{ m.content }}{% endfor %}",
    "folded repeat": "{{ 'a' * 10000000000 }}",
    "endless loop": "{% for i in range(10**8) %}{% for j in range(10**8) %}x{% endfor %}{% endfor %}",
    "escape": "{{ ''.__class__.__mro__[1].__subclasses__() }}",
}


@pytest.fixture(scope="module")
def hostile_copies(default_model_path: Path, tmp_path_factory: pytest.TempPathFactory) -> dict:
    folder = tmp_path_factory.mktemp("hostile")
    return {
        name: copy_gguf(default_model_path, folder / f"t{i}.gguf", {"tokenizer.chat_template": t})
        for i, (name, t) in enumerate(HOSTILE_TEMPLATES.items())
    }


@pytest.mark.parametrize("name", list(HOSTILE_TEMPLATES))
def test_hostile_template_through_import_and_run(name: str, hostile_copies: dict) -> None:
    assert cli(["import", str(hostile_copies[name]), "--name", "evil"]).returncode == 0
    t0 = time.monotonic()
    p = cli(["run", "evil", "hi", "--max-tokens", "4"], timeout=90)
    assert_one_line(p, "template")
    assert time.monotonic() - t0 < 60


def test_loading_compiles_no_template_in_this_process(
    hostile_copies: dict, monkeypatch: pytest.MonkeyPatch
) -> None:
    """llama-cpp-python would compile every template in the file; ours keeps the text only."""
    import jinja2

    compiled: list[str] = []
    original = jinja2.Environment.compile

    def spy(self, source, *a, **k):  # noqa: ANN001, ANN002, ANN003, ANN202
        compiled.append(str(source)[:40])
        if "7 ** 999999999" in str(source):
            raise AssertionError("a model's template was compiled in the test process")
        return original(self, source, *a, **k)

    monkeypatch.setattr(jinja2.Environment, "compile", spy)
    from localllm.backends.llamacpp import LlamaCppRunner

    b = LlamaCppRunner(hostile_copies["folded power"], n_ctx=256)
    try:
        assert "7 ** 999999999" in b.chat_template.source
        assert compiled == []
    finally:
        b.close()


def test_show_says_which_backend_and_why(tmp_path: Path, localllm_home: Path) -> None:
    p = cli(["show", "smollm2", "--json"])
    assert p.returncode == 0, p.stderr
    backend = json.loads(p.stdout)["backend"]
    assert backend["name"] == "llama.cpp" and backend["available"] is True
    assert backend["reason"].startswith("auto: llama.cpp runs here ("), backend["reason"]
    assert backend["capabilities"]["batching"] is True
    command, _ = counting_command(tmp_path, SIGILL_SELF)
    p = cli(["show", "smollm2"], LOCALLLM_LLAMACPP_PROBE=command)
    assert p.returncode == 0, p.stderr  # show informs; it does not fail
    line = next(ln for ln in p.stdout.splitlines() if ln.strip().startswith("backend"))
    assert "torch (auto: torch runs here" in line, line
    assert "llama.cpp cannot run on this machine" in line and "SIGILL" in line


def test_hostile_template_through_the_python_api(hostile_copies: dict) -> None:
    import localllm
    from localllm.errors import TemplateError

    Store().add_file(hostile_copies["endless loop"], "evil", source="test")
    with localllm.load("evil", ctx=256) as llm:
        t0 = time.monotonic()
        with pytest.raises(TemplateError) as e:
            llm.chat([{"role": "user", "content": "hi"}], max_tokens=4)
        assert time.monotonic() - t0 < 60 and "\n" not in str(e.value)
        # the model still answers a raw prompt: one bad template costs nothing else
        assert llm.complete("Once upon a time", max_tokens=2).usage.completion_tokens == 2


def test_logits_disagree() -> None:
    same = [0.5, 3.0, -1.0]
    assert guard.logits_disagree(same, list(same)) == ""
    assert guard.logits_disagree([0.5, 3.0, -1.001], same) == ""  # rounding between kernels
    assert guard.logits_disagree([0.5, 3.0, -0.5], same) == ""  # KL 0.006 nats: noise
    assert "differ by" in guard.logits_disagree([4.0, 3.0, -1.0], same)  # another argmax
    assert guard.logits_disagree([2.9, 3.0, -1.0], [3.0, 2.9, -1.0]) == ""  # a near-tie flipped
    assert "differ by" in guard.logits_disagree([3.0, 1.9, -1.0], [1.9, 3.0, -1.0])  # 1.1 nats behind
    said = guard.logits_disagree([0.5, 3.0, 2.5], same)  # same argmax, KL 0.37 nats
    assert "differ by 3.5 (scale 3; KL 0.37 nats)" in said, said
    assert "not finite" in guard.logits_disagree([float("nan"), 3.0, -1.0], same)


def test_wrong_numbers_are_refused_at_first_load(
    tiny_llama: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A kernel that computes wrong numbers for a model makes its first load fail, with the why."""
    monkeypatch.setattr(guard, "_run", lambda args, timeout, env=None: guard._Exit(
        3, json.dumps({"reason": "llama.cpp computes wrong numbers for it on this machine: "
                                 "a prompt batch and token-by-token evaluation differ by 0.58"}), ""
    ))  # fmt: skip
    with pytest.raises(LocalLLMError, match=r"^tiny:latest: llama.cpp computes wrong numbers"):
        guard.check_load(tiny_llama, "ef" * 32, "tiny:latest")
