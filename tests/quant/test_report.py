"""The quality report: `quantize --eval` measures the result against its source (perplexity, KL,
top-1 agreement, size, bits per weight), keeps it beside the model, and `show` displays it."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from localllm.cli import main

from conftest import need
from ggufs import tokenizer_metadata, write_tiny_llama


@pytest.fixture(scope="module")
def f16_llama(default_model_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    need("gguf", "pip install -e '.[dev]'")
    path = tmp_path_factory.mktemp("f16") / "tiny-f16.gguf"
    return write_tiny_llama(path, tokenizer_metadata(default_model_path), n_embd=256, n_layer=4,
                            n_head=4, n_kv_head=2, n_ff=512, dtype=np.float16)  # fmt: skip


def run_json(capsys: pytest.CaptureFixture[str], *args: str) -> dict:
    capsys.readouterr()
    with pytest.raises(SystemExit) as e:
        main([*args, "--json"])
    out = capsys.readouterr()
    assert e.value.code in (0, None), out.err
    return json.loads(out.out)


def test_quantize_eval_reports_and_show_displays_it(f16_llama: Path, corpus_dir: Path,
                                                    capsys: pytest.CaptureFixture[str]) -> None:  # fmt: skip
    text = corpus_dir / "alice.txt"
    q4 = run_json(capsys, "quantize", str(f16_llama), "--type", "Q4_0", "--eval", str(text),
                  "--eval-limit", "96")  # fmt: skip
    q8 = run_json(capsys, "quantize", str(f16_llama), "--type", "Q8_0", "--eval", str(text),
                  "--eval-limit", "96")  # fmt: skip
    for r, kind in ((q4, "Q4_0"), (q8, "Q8_0")):
        rep = r["quality"]
        assert rep["model"] == r["model"] == f"tiny-f16:{kind.lower()}" and rep["tokens"] == 95
        assert rep["source"] == "tiny-f16:latest" and rep["text"] == "alice.txt"
        assert rep["kl_mean"] >= 0 and rep["kl_p99"] >= rep["kl_mean"]
        assert 0 < rep["top1_agreement"] <= 1 and rep["perplexity"] > 1
        assert rep["bits_per_weight"] == pytest.approx(r["bits_per_weight"], abs=1e-3)
        assert rep["file_bytes"] < rep["source_bytes"]
    # fewer bits, further from the source
    assert q4["quality"]["kl_mean"] > q8["quality"]["kl_mean"]
    assert q4["quality"]["source_perplexity"] == pytest.approx(q8["quality"]["source_perplexity"])
    shown = run_json(capsys, "show", "tiny-f16:q4_0")
    assert shown["quality"] == q4["quality"]
    capsys.readouterr()
    with pytest.raises(SystemExit):
        main(["show", "tiny-f16:q4_0"])
    text_out = capsys.readouterr().out
    assert "Quality (Q4_0" in text_out and "KL divergence" in text_out and "top-1 agreement" in text_out
