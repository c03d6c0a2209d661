"""llama.cpp's importance-matrix files both ways (`localllm.quant.imatrix`): files laid out as
llama-imatrix writes them (GGUF and the legacy .dat, built here by hand from its source's layout)
are read as llama-quantize reads them; ours are written in those layouts; and a matrix read from
a file quantizes to the same bytes in our quantizer and in llama.cpp's."""

from __future__ import annotations

import json
import struct
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from localllm.errors import LocalLLMError
from localllm.gguf_file import GGUFFile
from localllm.quant import imatrix as im

from conftest import need


def llama_imatrix_gguf(path: Path, entries: dict[str, tuple[np.ndarray, list[float]]]) -> Path:
    """A GGUF as llama-imatrix's save_imatrix writes it: general.type, the three imatrix keys,
    and per matrix NAME.in_sum2 (ne [columns, experts]) and NAME.counts (ne [1, experts]), F32,
    in name order."""
    need("gguf", "pip install -e '.[dev]'")
    import gguf

    w = gguf.GGUFWriter(str(path), arch="llama")
    w.add_type("imatrix")
    w.add_array("imatrix.datasets", ["wiki.train.raw"])
    w.add_uint32("imatrix.chunk_count", 100)
    w.add_uint32("imatrix.chunk_size", 512)
    for name in sorted(entries):
        sums, counts = entries[name]
        w.add_tensor(f"{name}.in_sum2", sums.astype(np.float32))
        w.add_tensor(f"{name}.counts", np.array(counts, np.float32).reshape(-1, 1))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def legacy_dat(path: Path, entries: dict[str, tuple[int, np.ndarray]], tail: bool = True) -> Path:
    """save_imatrix_legacy's layout: n, then (len, name, ncall, nval, values), then the chunk
    count and the dataset's name."""
    out = struct.pack("<i", len(entries))
    for name, (ncall, values) in entries.items():
        out += struct.pack("<i", len(name)) + name.encode() + struct.pack("<ii", ncall, values.size)
        out += values.astype("<f4").tobytes()
    if tail:
        out += struct.pack("<ii", 42, 9) + b"train.txt"
    path.write_bytes(out)
    return path


def test_a_llama_imatrix_gguf_reads_as_llama_quantize_reads_it(tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    dense = rng.random((1, 64)).astype(np.float32) * 100
    experts = rng.random((3, 32)).astype(np.float32) * 10
    f = llama_imatrix_gguf(tmp_path / "m.imatrix", {
        "blk.0.attn_q.weight": (dense, [512.0]),
        "blk.0.ffn_down_exps.weight": (experts, [100.0, 0.0, 7.0]),  # expert 1 saw no token
    })  # fmt: skip
    assert im.is_imatrix(f)
    m = im.read(f)
    assert (m.datasets, m.chunk_count, m.chunk_size, m.legacy) == (["wiki.train.raw"], 100, 512, False)
    means = m.means()
    np.testing.assert_array_equal(means["blk.0.attn_q.weight"], dense[0] / np.float32(512))
    want = np.concatenate([experts[0] / np.float32(100), np.ones(32, np.float32), experts[2] / np.float32(7)])
    np.testing.assert_array_equal(means["blk.0.ffn_down_exps.weight"], want)


def test_a_legacy_dat_reads_as_llama_quantize_reads_it(tmp_path: Path) -> None:
    values = np.arange(1, 9, dtype=np.float32) * 3
    f = legacy_dat(tmp_path / "old.dat", {"blk.0.ffn_up.weight": (4, values), "output.weight": (0, values)})
    m = im.read(f)
    assert m.legacy and m.datasets == ["train.txt"] and m.chunk_count == 42
    means = m.means()
    np.testing.assert_array_equal(means["blk.0.ffn_up.weight"], values / np.float32(4))  # ÷ ncall
    np.testing.assert_array_equal(means["output.weight"], values)  # ncall 0: as stored
    no_tail = im.read(legacy_dat(tmp_path / "short.dat", {"a.weight": (1, values)}, tail=False))
    assert no_tail.datasets == [] and no_tail.chunk_count == 0


@pytest.mark.parametrize("suffix", [".imatrix", ".dat"])
def test_ours_round_trips_in_both_layouts(tmp_path: Path, suffix: str) -> None:
    rng = np.random.default_rng(1)
    means = {f"blk.{i}.attn_q.weight": rng.random(64).astype(np.float32) for i in range(3)}
    rows = dict.fromkeys(means, 1300)
    f = im.write(tmp_path / f"ours{suffix}", im.Imatrix.from_means(means, rows, dataset="alice.txt"))
    m = im.read(f)
    assert m.legacy == (suffix == ".dat") and m.datasets == ["alice.txt"] and m.chunk_count == 3
    for name, want in im.read(f).means().items():
        np.testing.assert_allclose(want, means[name], rtol=2e-7)  # float32 sums, then ÷ count
    if suffix == ".imatrix":  # what llama-quantize checks: the three keys, F32 pairs
        with GGUFFile(f) as g:
            assert g.metadata["general.type"] == "imatrix" and g.metadata["imatrix.chunk_size"] == 512
            t = g.tensors["blk.0.attn_q.weight.in_sum2"]
            assert t.ggml_type.name == "F32" and tuple(t.shape) == (64, 1)
            assert tuple(g.tensors["blk.0.attn_q.weight.counts"].shape) == (1, 1)
        assert list(tmp_path.glob(".*tmp*")) == []


def test_files_that_are_not_importance_matrices_are_one_line(tmp_path: Path, default_model_path: Path) -> None:
    values = np.ones(8, np.float32)
    whole = legacy_dat(tmp_path / "x.dat", {"a.weight": (1, values)}).read_bytes()
    cases = {
        "cut.dat": whole[:30],  # ends inside the values
        "empty.dat": b"",
        "huge.dat": struct.pack("<i", 1 << 30),
        "name.dat": struct.pack("<ii", 1, -5),
    }
    for name, data in cases.items():
        (tmp_path / name).write_bytes(data)
        with pytest.raises(LocalLLMError) as e:
            im.read(tmp_path / name)
        assert "not an importance matrix" in str(e.value) and "\n" not in str(e.value), name
    with pytest.raises(LocalLLMError, match="is not an importance matrix \\(no imatrix.datasets"):
        im.read(default_model_path)  # a model, not a matrix
    with pytest.raises(LocalLLMError, match="cannot read the importance matrix"):
        im.read(tmp_path / "missing.imatrix")


def test_a_saved_matrix_quantizes_the_same_in_llamacpp_and_ours(tiny_llama: Path, corpus_dir: Path,
                                                               tmp_path: Path) -> None:  # fmt: skip
    """--calibrate TEXT --save-imatrix F keeps llama.cpp's layout; --calibrate F then gives
    the same file whether our quantizer or llama.cpp's is handed the matrix read from it."""
    def run(*extra: str) -> dict:
        done = subprocess.run([sys.executable, "-m", "localllm", "quantize", str(tiny_llama), "--type",
                               "Q4_K_M", "--json", *extra], capture_output=True, text=True, timeout=300)  # fmt: skip
        assert done.returncode == 0, done.stderr
        return json.loads(done.stdout)

    saved = tmp_path / "tiny.imatrix"
    run("--output", str(tmp_path / "text.gguf"), "--calibrate", str(corpus_dir / "alice.txt"),
        "--calibrate-tokens", "256", "--save-imatrix", str(saved))
    m = im.read(saved)
    assert m.datasets == ["alice.txt"] and "blk.0.attn_q.weight" in m.sums
    run("--output", str(tmp_path / "ours.gguf"), "--calibrate", str(saved))
    run("--output", str(tmp_path / "theirs.gguf"), "--calibrate", str(saved), "--engine", "llama.cpp")
    with GGUFFile(tmp_path / "ours.gguf") as a, GGUFFile(tmp_path / "theirs.gguf") as b:
        assert [n for n in a.tensors if bytes(a.tensor_bytes(n)) != bytes(b.tensor_bytes(n))] == []
    done = subprocess.run([sys.executable, "-m", "localllm", "quantize", str(tiny_llama), "--type", "Q4_0",
                           "--output", str(tmp_path / "x.gguf"), "--save-imatrix", str(saved)],
                          capture_output=True, text=True, timeout=120)  # fmt: skip
    assert done.returncode == 1 and "--save-imatrix keeps the matrix --calibrate TEXT collects" in done.stderr
