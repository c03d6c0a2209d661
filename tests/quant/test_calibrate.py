"""`--calibrate`: the importance matrix is each matrix's mean squared input activation over the
text (checked against the model's own hidden states), it covers every quantized matrix, and it
changes what the quantizer writes."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from localllm.gguf_file import GGUFFile

from conftest import need


def test_imatrix_is_the_mean_squared_input_of_each_matrix(tiny_llama: Path, corpus_dir: Path) -> None:
    need("torch", "pip install -e '.[dev]'")
    import torch

    from localllm.backends.torch.runner import TorchRunner
    from localllm.quant.calibrate import collect_imatrix

    text = (corpus_dir / "alice.txt").read_text()[:3000]
    imatrix = collect_imatrix(tiny_llama, text, tokens=200)
    with GGUFFile(tiny_llama) as f:
        matrices = {n: t.shape[0] for n, t in f.tensors.items() if len(t.shape) == 2}
    assert set(imatrix) == set(matrices)  # every matrix, the tied embedding as the output head
    for name, cols in matrices.items():
        v = imatrix[name]
        assert v.shape == (cols,) and v.dtype == np.float32 and (v >= 0).all() and v.max() > 0, name
    assert np.array_equal(imatrix["blk.0.attn_q.weight"], imatrix["blk.0.attn_v.weight"])
    # the output head reads the final normed hidden states: their mean square per column
    be = TorchRunner(tiny_llama, n_ctx=512, dtype="f32", device="cpu")
    ids = be.tokenize(text, add_special=False)[:200]
    bos = [be.tokenizer.bos_id] if (be.tokenizer.bos_id or -1) >= 0 else []
    with torch.inference_mode():
        h = be.model(torch.tensor([bos + ids]), [be.new_caches()])[0].double()
    want = (h * h).mean(0).float().numpy()
    np.testing.assert_allclose(imatrix["token_embd.weight"], want, rtol=1e-4)
    assert np.array_equal(collect_imatrix(tiny_llama, text, tokens=200)["blk.1.ffn_down.weight"],
                          imatrix["blk.1.ffn_down.weight"])  # fmt: skip


def test_quantize_with_calibrate(tiny_llama: Path, corpus_dir: Path, tmp_path: Path) -> None:
    import json
    import subprocess
    import sys

    def run(*extra: str) -> dict:
        done = subprocess.run([sys.executable, "-m", "localllm", "quantize", str(tiny_llama), "--type",
                               "Q4_0", "--json", *extra], capture_output=True, text=True, timeout=300)  # fmt: skip
        assert done.returncode == 0, done.stderr
        return json.loads(done.stdout)

    plain = run("--output", str(tmp_path / "plain.gguf"))
    calibrated = run("--output", str(tmp_path / "cal.gguf"), "--calibrate", str(corpus_dir / "alice.txt"),
                     "--calibrate-tokens", "256")  # fmt: skip
    assert plain["bytes"] == calibrated["bytes"]
    with GGUFFile(tmp_path / "plain.gguf") as a, GGUFFile(tmp_path / "cal.gguf") as b:
        differ = [n for n in a.tensors if bytes(a.tensor_bytes(n)) != bytes(b.tensor_bytes(n))]
        assert {t.ggml_type.name for n, t in b.tensors.items() if n in differ} <= {"Q4_0", "Q6_K", "Q8_0"}
        assert any(n.startswith("blk.") for n in differ)
    # llama.cpp's quantizer given the same importance matrix writes the same file
    run("--output", str(tmp_path / "theirs.gguf"), "--calibrate", str(corpus_dir / "alice.txt"),
        "--calibrate-tokens", "256", "--engine", "llama.cpp")
    with GGUFFile(tmp_path / "cal.gguf") as a, GGUFFile(tmp_path / "theirs.gguf") as b:
        assert [n for n in a.tensors if bytes(a.tensor_bytes(n)) != bytes(b.tensor_bytes(n))] == []
