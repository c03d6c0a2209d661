"""Which backend `auto` picks for a file, and why: llama.cpp when its probe passes and it reads the
file, else the torch engine when it runs here and reads the file, else one line naming every reason."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from localllm import backends
from localllm.backends import Availability
from localllm.cli import main
from localllm.errors import BackendUnavailable, LocalLLMError
from localllm.types import LoadOptions

from ggufs import copy_gguf


@pytest.fixture
def no_llamacpp(monkeypatch: pytest.MonkeyPatch) -> None:
    """llama.cpp's probe refuses (as on a machine where its build dies with SIGILL)."""
    spec = backends.get("llama.cpp")
    sick = dataclasses.replace(spec, available=lambda: Availability(
        False, "its first evaluation died with SIGILL", "scripts/llamacpp-build"))  # fmt: skip
    monkeypatch.setitem(backends._SPECS, "llama.cpp", sick)


@pytest.fixture
def no_torch(monkeypatch: pytest.MonkeyPatch) -> None:
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "torch" else real(name, *a))  # fmt: skip


def test_auto_prefers_llamacpp_and_says_why(default_model_path: Path) -> None:
    spec, why = backends.select("auto", default_model_path)
    assert spec.name == "llama.cpp" and why.startswith("auto: llama.cpp runs here"), why


def test_auto_falls_back_to_torch_and_says_why(default_model_path: Path, no_llamacpp: None) -> None:
    spec, why = backends.select("auto", default_model_path)
    assert spec.name == "torch"
    assert why.startswith("auto: torch runs here (torch is installed)")
    assert "llama.cpp cannot run on this machine: its first evaluation died with SIGILL" in why


def test_a_file_torch_cannot_read_is_said(tmp_path: Path, default_model_path: Path,
                                          no_llamacpp: None) -> None:  # fmt: skip
    odd = copy_gguf(default_model_path, tmp_path / "odd.gguf", {"general.architecture": "oddarch"})
    with pytest.raises(BackendUnavailable) as e:
        backends.select("auto", odd)
    said = str(e.value)
    assert "llama.cpp cannot run on this machine: its first evaluation died with SIGILL" in said
    assert "torch cannot load this file: it has no oddarch architecture (it has llama, " in said
    with pytest.raises(BackendUnavailable, match="the torch backend cannot load this file: it has "
                                                 "no oddarch architecture"):  # fmt: skip
        backends.select("torch", odd)


def test_without_torch_the_fix_is_named(default_model_path: Path, no_torch: None) -> None:
    a = backends.get("torch").available()
    assert not a.ok and a.message() == "torch is not installed; fix: pip install 'localllm[torch]'"
    spec, why = backends.select("auto", default_model_path)
    assert spec.name == "llama.cpp"
    with pytest.raises(BackendUnavailable, match="torch cannot run on this machine: torch is not "
                                                 "installed; fix: pip install 'localllm"):  # fmt: skip
        backends.select("torch", default_model_path)


def test_nothing_runs(default_model_path: Path, no_llamacpp: None, no_torch: None) -> None:
    with pytest.raises(BackendUnavailable) as e:
        backends.select("auto", default_model_path)
    assert str(e.value).count("cannot run on this machine") == 2


def test_show_names_the_backend_and_why(localllm_home: Path, capsys: pytest.CaptureFixture[str],
                                        no_llamacpp: None) -> None:  # fmt: skip
    with pytest.raises(SystemExit) as exit_:
        main(["show", "smollm2", "--json"])
    assert exit_.value.code == 0
    data = json.loads(capsys.readouterr().out)
    b = data["backend"]
    assert b["name"] == "torch" and b["available"] is True
    assert b["reason"].startswith("auto: torch runs here") and "SIGILL" in b["reason"]
    assert b["capabilities"]["dtypes"] == ["f32", "bf16", "f16", "int4"]
    # the estimate is the torch engine's: fp16 weights (plus the embedding's rows for lookups)
    info = data["info"]
    assert data["memory"]["weights_bytes"] == 2 * info["parameters"] + info["vocab_size"] * info["n_embd"] * 2


OPENED: list[str] = []


def refuse(path: Path, options: object, **kw: object) -> object:
    """A llama.cpp factory whose first load of the file refuses it (as llama.cpp's check does
    where its kernels compute wrong numbers for a model)."""
    OPENED.append("llama.cpp")
    raise LocalLLMError(f"{kw['name']}: llama.cpp computes wrong numbers for it on this "
                        "machine: a prompt batch and token-by-token evaluation differ")  # fmt: skip


def _refusing_llamacpp(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """llama.cpp runs here but refuses the file as it opens it; returns the opened backends."""
    OPENED.clear()
    sick = dataclasses.replace(backends.get("llama.cpp"), factory=f"{__name__}:refuse",
                               available=lambda: Availability(True, "probe passed"))  # fmt: skip
    monkeypatch.setitem(backends._SPECS, "llama.cpp", sick)
    return OPENED


def test_auto_moves_on_when_llamacpp_refuses_the_file(localllm_home: Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    from localllm.engine import load

    opened = _refusing_llamacpp(monkeypatch)
    with load("smollm2", ctx=256, parallel=1) as m:
        assert m.backend.name == "torch" and opened == ["llama.cpp"]
        assert m.backend_why.startswith("auto: torch runs here")
        assert "llama.cpp failed on this file: llama.cpp computes wrong numbers" in m.backend_why
        assert m.complete("Hi", max_tokens=2, temperature=0).text


def test_auto_takes_the_backend_that_honours_the_options(localllm_home: Path,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    """llama.cpp runs here, but it has no int4 KV cache and no H2O: auto loads torch instead,
    without opening llama.cpp, and says why."""
    from localllm.engine import load

    opened = _refusing_llamacpp(monkeypatch)  # it would refuse the file too: it must not be tried
    for kw in ({"kv_cache": "k=int4,v=int8"}, {"evict": "h2o:64"}):
        with load("smollm2", ctx=256, parallel=1, **kw) as m:
            assert m.backend.name == "torch" and opened == []
            assert m.backend_why.startswith("auto: torch runs here")
            assert "the llama.cpp backend has no" in m.backend_why
            assert m.complete("Hi", max_tokens=2, temperature=0).text
    assert backends.describe("auto", LoadOptions(kv_cache="int2")).name == "torch"
    assert backends.describe("auto", LoadOptions(kv_cache="q8_0")).name == "llama.cpp"


def test_a_named_backend_that_refuses_the_file_is_one_error(localllm_home: Path,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    from localllm.engine import load

    _refusing_llamacpp(monkeypatch)
    with pytest.raises(LocalLLMError) as e:
        load("smollm2", backend="llama.cpp")
    said = str(e.value)
    assert said.startswith("smollm2:") and ": llama.cpp computes wrong numbers" in said, said
    assert said.count("smollm2") == 1, said  # named once, not once per layer it passed through


def test_when_every_backend_refuses_the_file_each_reason_is_said(
    localllm_home: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from localllm.engine import load

    _refusing_llamacpp(monkeypatch)
    torch_spec = dataclasses.replace(backends.get("torch"), factory=f"{__name__}:refuse_torch")
    monkeypatch.setitem(backends._SPECS, "torch", torch_spec)
    with pytest.raises(LocalLLMError) as e:
        load("smollm2")
    said = str(e.value)
    assert said.startswith("smollm2:") and said.count("smollm2") == 1, said
    assert "llama.cpp failed: llama.cpp computes wrong numbers" in said, said
    assert "torch failed: out of memory on cpu" in said, said


def refuse_torch(path: Path, options: object, **kw: object) -> object:
    raise LocalLLMError("out of memory on cpu")


def test_a_torch_older_than_the_engine_needs_is_one_line() -> None:
    from localllm.backends import torch_too_old

    assert torch_too_old("2.4.1+cpu") == (
        "torch 2.4.1+cpu is too old for the torch engine (it needs 2.5 or newer: SDPA's enable_gqa)")
    for ok in ("2.5.0", "2.13.0+cpu", "3.0.0a0", "2.10.0.dev20260101"):
        assert torch_too_old(ok) is None, ok
