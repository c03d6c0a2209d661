"""The compiled quantizer's build: cached once per source and machine, and where it cannot be built
(no compiler, a failing build, turned off) `quantize` still gives the same bytes through numpy and
says why."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest

from localllm.quant import native, quantize


@pytest.fixture
def fresh(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """No library loaded yet in this process, and an empty cache folder."""
    monkeypatch.setattr(native, "_state", {})
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    return tmp_path / "cache" / "localllm"


def _sample() -> np.ndarray:
    return (np.random.default_rng(5).standard_normal((8, 512)) * 0.02).astype(np.float32)


def test_built_once_then_reused(fresh: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    x = _sample()
    assert native.available(), f"{native.why_not()}: install a C compiler (apt install gcc)"
    built = list(fresh.glob("quant-kernel-*.so"))
    assert len(built) == 1 and not list(fresh.glob("*.tmp"))
    first = native.quantize_rows(x, "Q4_K")
    stamp = built[0].stat().st_mtime_ns
    monkeypatch.setattr(native, "_state", {})  # a new process: it finds the cached library
    assert np.array_equal(native.quantize_rows(x, "Q4_K"), first)
    assert built[0].stat().st_mtime_ns == stamp and len(list(fresh.glob("quant-kernel-*.so"))) == 1


@pytest.mark.parametrize(
    ("env", "said"),
    [({"CC": "/nonexistent/cc"}, "the build with /nonexistent/cc failed"),
     ({"LOCALLLM_QUANT_KERNEL": "0"}, "turned off by LOCALLLM_QUANT_KERNEL=0")],
)  # fmt: skip
def test_without_it_numpy_gives_the_same_bytes(env: dict[str, str], said: str, fresh: Path,
                                               monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    x = _sample()
    compiled = {t: quantize(x, t) for t in ("Q8_0", "Q5_0", "Q4_K", "Q6_K")}
    assert native.available(), native.why_not()
    monkeypatch.setattr(native, "_state", {})
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    assert not native.available() and native.why_not().startswith(said), native.why_not()
    assert native.quantize_rows(x, "Q4_K") is None
    for t, want in compiled.items():
        assert np.array_equal(quantize(x, t), want), t


def test_a_failed_build_leaves_nothing_at_the_name(fresh: Path, monkeypatch: pytest.MonkeyPatch,
                                                   tmp_path: Path) -> None:  # fmt: skip
    """A compiler that fails (or is killed) mid-build: no library, no temporary file, one reason."""
    fake = tmp_path / "cc"
    fake.write_text("#!/bin/sh\necho 'kernel.c:1: error: out of memory' >&2\nexit 1\n")
    fake.chmod(0o755)
    monkeypatch.setenv("CC", str(fake))
    assert not native.available()
    assert native.why_not() == f"the build with {fake} failed: kernel.c:1: error: out of memory"
    assert os.listdir(fresh) == []


def test_what_it_does_not_have_goes_to_numpy(fresh: Path) -> None:
    x = _sample()
    assert native.quantize_rows(x, "IQ2_XXS") is None  # not compiled: the numpy port
    assert native.quantize_rows(x, "Q4_K", importance=np.ones(512, np.float32)) is None  # nor Q4_K's weighted search
    assert native.quantize_rows(x[:, :500], "Q8_0") is None  # rows that are not whole blocks
    assert native.quantize_rows(x[:0], "Q8_0").shape == (0, 16 * 34)
