"""Writing quantized GGUFs: tensor data byte-identical to llama.cpp's own quantizer for whole files,
metadata carried over, outputs that load and generate in both engines, and every failure leaving no
file at the output name (kill, disk full, bad or already quantized source, cancel)."""

from __future__ import annotations

import errno
import os
import re
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

from localllm.errors import LocalLLMError
from localllm.gguf_file import GGUFFile
from localllm.quant import writer as qwriter
from localllm.quant.mix import FILE_TYPES
from localllm.quant.writer import quantize_file

from conftest import need
from ggufs import tokenizer_metadata, write_tiny_llama


@pytest.fixture(scope="module")
def f32_llama(default_model_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An F32 llama with K-quant-friendly rows (256, 512), 8 layers for use_more_bits."""
    need("gguf", "pip install -e '.[dev]'")
    path = tmp_path_factory.mktemp("f32") / "tiny-f32.gguf"
    return write_tiny_llama(path, tokenizer_metadata(default_model_path), n_embd=256, n_layer=8,
                            n_head=4, n_kv_head=2, n_ff=512, dtype=np.float32)  # fmt: skip


def tensor_data(path: Path) -> dict[str, tuple[str, bytes]]:
    with GGUFFile(path) as f:
        return {n: (t.ggml_type.name, bytes(f.tensor_bytes(n))) for n, t in f.tensors.items()}


@pytest.mark.parametrize("file_type", ["Q4_K_M", "Q4_K_S", "Q5_K_M", "Q5_K_S", "Q6_K", "Q8_0",
                                       "Q4_0", "F16"])  # fmt: skip
def test_whole_file_byte_identical_to_llamacpp(f32_llama: Path, tmp_path: Path, file_type: str) -> None:
    need("llama_cpp", "pip install -e '.[dev]'")
    ours = quantize_file(f32_llama, tmp_path / "ours.gguf", file_type, engine="localllm")
    theirs = quantize_file(f32_llama, tmp_path / "theirs.gguf", file_type, engine="llama.cpp")
    assert ours.engine == "localllm" and theirs.engine == "llama.cpp"
    a, b = tensor_data(ours.path), tensor_data(theirs.path)
    assert set(a) == set(b)  # llama.cpp writes them in its own order; ours keeps the source's
    differ = [n for n in a if a[n] != b[n]]
    assert not differ, f"{file_type}: {len(differ)} tensors differ, e.g. {differ[:3]}"
    assert len({t for t, _ in a.values()}) >= 2  # a mix: norms stay F32 at least
    with GGUFFile(ours.path) as f, GGUFFile(f32_llama) as src:
        assert f.metadata["general.file_type"] == FILE_TYPES[file_type]
        assert f.metadata["general.quantization_version"] == 2
        for key, value in src.metadata.items():  # everything else carried over
            if key not in ("general.file_type", "general.quantization_version"):
                got = f.metadata[key]
                if hasattr(value, "tolist"):  # string and number arrays
                    got, value = got.tolist(), value.tolist()
                assert got == value, key


def test_outputs_load_and_generate_in_both_engines(f32_llama: Path, tmp_path: Path) -> None:
    from localllm.engine import load
    from localllm.models_registry.store import Store

    out = quantize_file(f32_llama, tmp_path / "q.gguf", "Q4_K_M")
    Store().import_file(out.path, "tiny-q4km")
    for backend in ("llama.cpp", "torch"):
        with load("tiny-q4km", backend=backend, device="cpu", ctx=128) as m:
            r = m.complete("Hello", max_tokens=4, temperature=0)
        assert 1 <= r.usage.completion_tokens <= 4 and isinstance(r.text, str), backend


def test_an_already_quantized_source_is_refused_unless_allowed(default_model_path: Path,
                                                              tmp_path: Path) -> None:  # fmt: skip
    dst = tmp_path / "re.gguf"
    with pytest.raises(LocalLLMError, match="already quantized .*--allow-requantize"):
        quantize_file(default_model_path, dst, "Q8_0")
    assert not dst.exists() and not list(tmp_path.iterdir())


def test_a_bad_source_is_one_clear_line(tmp_path: Path, f32_llama: Path) -> None:
    bad = tmp_path / "cut.gguf"
    bad.write_bytes(f32_llama.read_bytes()[:5000])
    with pytest.raises(LocalLLMError) as e:
        quantize_file(bad, tmp_path / "out.gguf", "Q4_K_M")
    assert "cut.gguf" in str(e.value) and "\n" not in str(e.value)
    with pytest.raises(LocalLLMError, match="unknown quantization type Q3_XL"):
        quantize_file(f32_llama, tmp_path / "out.gguf", "Q3_XL")
    assert not (tmp_path / "out.gguf").exists()


def test_not_enough_space_is_refused_before_writing(f32_llama: Path, tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    monkeypatch.setattr(qwriter.shutil, "disk_usage", lambda _: type("U", (), {"free": 1 << 20})())
    with pytest.raises(LocalLLMError, match="not enough free space .* MiB are free"):
        quantize_file(f32_llama, tmp_path / "out.gguf", "Q4_K_M")
    assert not list(tmp_path.iterdir())


def test_a_full_disk_mid_way_keeps_nothing(f32_llama: Path, tmp_path: Path,
                                           monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    real = qwriter._put
    calls = []

    def full(fh, data):  # type: ignore[no-untyped-def]
        calls.append(1)
        if len(calls) == 9:  # a few tensors in
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(fh, data)

    monkeypatch.setattr(qwriter, "_put", full)
    with pytest.raises(LocalLLMError, match="disk filled up .*nothing was kept"):
        quantize_file(f32_llama, tmp_path / "out.gguf", "Q8_0")
    assert len(calls) == 9 and not list(tmp_path.iterdir())


def test_cancel_keeps_nothing(f32_llama: Path, tmp_path: Path) -> None:
    seen = []
    with pytest.raises(qwriter.Cancelled):
        quantize_file(f32_llama, tmp_path / "out.gguf", "Q8_0", on_tensor=seen.append,
                      cancel=lambda: len(seen) >= 3)  # fmt: skip
    assert len(seen) == 3 and [e.index for e in seen] == [1, 2, 3]
    assert seen[0].total == len(GGUFFile(f32_llama).tensors)
    assert not list(tmp_path.iterdir())


def test_a_kill_mid_way_leaves_no_output_and_the_next_run_cleans_up(f32_llama: Path,
                                                                    tmp_path: Path) -> None:  # fmt: skip
    dst = tmp_path / "out.gguf"
    child = textwrap.dedent(f"""
        import os, signal
        from localllm.quant.writer import quantize_file
        def on_tensor(e):
            if e.index == 4:
                os.kill(os.getpid(), signal.SIGKILL)
        quantize_file({str(f32_llama)!r}, {str(dst)!r}, "Q8_0", on_tensor=on_tensor)
    """)
    done = subprocess.run([sys.executable, "-c", child], capture_output=True, timeout=300)
    assert done.returncode == -signal.SIGKILL, done.stderr.decode()[-500:]
    assert not dst.exists()
    left = list(tmp_path.iterdir())
    assert len(left) == 1 and left[0].name.startswith(".out.gguf.tmp-")  # the dead run's partial file
    quantize_file(f32_llama, dst, "Q8_0")
    assert [p.name for p in tmp_path.iterdir()] == ["out.gguf"]  # the next run removed it
    os.stat(dst)


def test_cli_quantize_registers_in_the_store(f32_llama: Path, tmp_path: Path) -> None:
    import json

    done = subprocess.run([sys.executable, "-m", "localllm", "quantize", str(f32_llama),
                           "--type", "q8_0", "--json"], capture_output=True, text=True,
                          timeout=300, env={**os.environ})  # fmt: skip
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout)
    assert out["model"] == "tiny-f32:q8_0" and out["type"] == "Q8_0" and out["engine"] == "localllm"
    assert out["tensor_types"]["Q8_0"] >= 1 and 8 < out["bits_per_weight"] < 9
    listed = subprocess.run([sys.executable, "-m", "localllm", "list", "--json"], capture_output=True,
                            text=True, timeout=60)  # fmt: skip
    assert "tiny-f32:q8_0" in listed.stdout


def test_cli_refuses_an_iquant_without_a_calibration_text(f32_llama: Path) -> None:
    """One line naming the option, exit 1, nothing registered."""
    done = subprocess.run([sys.executable, "-m", "localllm", "quantize", str(f32_llama), "--type", "iq2_xs"],
                          capture_output=True, text=True, timeout=120)  # fmt: skip
    assert done.returncode == 1
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "IQ2_XS needs an importance matrix" in lines[0] and "--calibrate" in lines[0]
    listed = subprocess.run([sys.executable, "-m", "localllm", "list", "--json"], capture_output=True,
                            text=True, timeout=60)  # fmt: skip
    assert "iq2_xs" not in listed.stdout


def test_gptq_on_a_type_without_a_grid_is_refused_before_calibrating(f32_llama: Path, tmp_path: Path) -> None:
    from localllm.errors import LocalLLMError
    from localllm.quant.job import run_quantize

    text = tmp_path / "never-read.txt"  # does not exist: the refusal comes first
    for method in ("gptq", "awq+gptq"):
        with pytest.raises(LocalLLMError, match=rf"--method {re.escape(method)} has no grid for IQ2_XS's IQ2_XS"):
            run_quantize(None, str(f32_llama), "IQ2_XS", calibrate=text, method=method)


def test_worker_processes_write_the_same_bytes(f32_llama: Path, tmp_path: Path,
                                               monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    """Large models go through one worker process per core: the same bytes, in order; a cancel
    ends the workers and keeps nothing."""
    here = quantize_file(f32_llama, tmp_path / "here.gguf", "Q4_K_M")
    monkeypatch.setattr(qwriter, "PROCESS_VALUES", 0)
    monkeypatch.setattr(qwriter.os, "cpu_count", lambda: 3)  # more workers than cores is fine
    there = quantize_file(f32_llama, tmp_path / "there.gguf", "Q4_K_M")
    assert here.path.read_bytes() == there.path.read_bytes()
    seen = []
    with pytest.raises(qwriter.Cancelled):
        quantize_file(f32_llama, tmp_path / "out.gguf", "Q8_0", on_tensor=seen.append,
                      cancel=lambda: len(seen) >= 5)  # fmt: skip
    assert sorted(p.name for p in tmp_path.iterdir()) == ["here.gguf", "there.gguf"]


def test_an_importance_matrix_reaches_every_tensor_it_names(f32_llama: Path, tmp_path: Path,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    """Each named tensor is quantized as llama.cpp quantizes it with those column weights (in
    this process and in the workers alike); the others as without."""
    from localllm.quant import row_bytes

    from ggml_oracle import ggml_quantize

    rng = np.random.default_rng(5)
    with GGUFFile(f32_llama) as src:
        named = {n: rng.uniform(0.1, 4, t.shape[0]).astype(np.float32)
                 for n, t in src.tensors.items() if n.endswith(("ffn_down.weight", "attn_q.weight"))}  # fmt: skip
        values = {n: np.frombuffer(src.tensor_bytes(n), np.float32).reshape(-1, src.tensors[n].shape[0]).copy()
                  for n in src.tensors}  # fmt: skip
    plain = quantize_file(f32_llama, tmp_path / "plain.gguf", "Q4_K_M")
    here = quantize_file(f32_llama, tmp_path / "here.gguf", "Q4_K_M", imatrix=named)
    monkeypatch.setattr(qwriter, "PROCESS_VALUES", 0)
    there = quantize_file(f32_llama, tmp_path / "there.gguf", "Q4_K_M", imatrix=named)
    assert here.path.read_bytes() == there.path.read_bytes()
    a, p = tensor_data(here.path), tensor_data(plain.path)
    for name, (kind, data) in a.items():
        if name in named:
            want = ggml_quantize(values[name], kind, row_bytes(kind, values[name].shape[1]), named[name])
            assert data == want.tobytes(), name
            assert data != p[name][1], name
        else:
            assert data == p[name][1], name
