"""The torch engine against llama.cpp (the oracle) on both packaged models, teacher-forced over the
first 1,000 tokens of alice.txt (SmolLM2; 2,000 under `-m slow`) or 2,000 (Gemma 3): top-1
agreement, KL(llama.cpp ‖ torch) and perplexity.

llama.cpp quantizes activations for its quantized matmuls, so the two are not bit-identical. The
issue's bars: mean KL ≤ 0.02 nats and perplexities within 1% hold (SmolLM2: KL 0.003, 0.14%); its
top-1 ≥ 98% does not: ours agrees with llama.cpp on 96.3% of the 2,000 positions, and so does Hugging
Face transformers' own model of the same file (96.2% over the first 1,000, where ours has 96.2% too),
every disagreement at a near-tie (top-two margin ≤ 0.28 nats, against a median of 0.82). llama.cpp
does not agree with itself more: its token-by-token path against its batches of 512 has 95.8% top-1
(SmolLM2) and 95.0% (Gemma 3), where ours has 96.1% and 95.8% (bench/llamacpp_agreement.py, one
run on an AVX-512 EPYC). So top-1 is held at 95% here: a wrong weight or a wrong layer costs far
more than that (tests/backends/torch/test_models.py holds the math to transformers at 1e-4). The CPU's default path (int4: the file's
4-bit feed-forward matrices in torch's int4 matmul, the rest fp16 weights, f32 sums) is held
against our own f32 path: KL ≤ 0.01 nats, top-1 ≥ 99% (measured: KL 1.5e-4, top-1 99.2%).
The numbers above are over 2,000 tokens; the default suite holds the same bars over the first 1,000
for SmolLM2 (2,000 under `-m slow`) and over 2,000 for Gemma 3 (see its test).
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest

from conftest import need

need("torch", "pip install -e '.[dev]' (torch: pip install torch==2.13.0 first)")
need("llama_cpp", "pip install -e '.[dev]' (llama-cpp-python is the oracle)")

import torch  # noqa: E402

from localllm.backends.base import Piece  # noqa: E402
from localllm.backends.torch.runner import TorchRunner  # noqa: E402

N = 1000  # positions of the default suite; the slow test takes 2,000
CHUNK = 250


def _stats(ref: np.ndarray, ours: np.ndarray, targets: np.ndarray) -> dict[str, float]:
    """Per-row sums for rows of logits (T, V): agreement, KL(ref ‖ ours), NLLs of the next token."""
    r = torch.from_numpy(np.ascontiguousarray(ref)).float().log_softmax(-1)
    o = torch.from_numpy(ours).float().log_softmax(-1)
    t = torch.from_numpy(targets)
    return {
        "agree": float((r.argmax(-1) == o.argmax(-1)).sum()),
        "kl": float((r.exp() * (r - o)).sum(-1).sum()),
        "nll_ref": float(-r.gather(-1, t[:, None]).sum()),
        "nll_ours": float(-o.gather(-1, t[:, None]).sum()),
    }


def _our_logits(runner: TorchRunner, ids: list[int]):  # noqa: ANN202 - yields (start, logits)
    """Every position's logits, teacher-forced through slot 0 in pieces of CHUNK tokens."""
    runner.clear(0)
    for i in range(0, len(ids), CHUNK):
        piece = ids[i : i + CHUNK]
        yield i, runner.forward([Piece(0, piece, len(piece))]).logits


def _runner(path: Path, dtype: str, n: int = N) -> TorchRunner:
    return TorchRunner(path, n_ctx=n, max_batch=CHUNK, dtype=dtype, kv_cache="f32", device="cpu")


def _compare(path: Path, corpus_dir: Path, dtypes: tuple[str, ...], n: int = N,
             ref_path: Path | None = None) -> dict[str, dict[str, float]]:  # fmt: skip
    """Ours on `path` against llama.cpp on `ref_path` (default: the same file)."""
    import llama_cpp

    text = (corpus_dir / "alice.txt").read_text()
    ref = llama_cpp.Llama(model_path=str(ref_path or path), n_ctx=n, n_batch=512, n_ubatch=512,
                          logits_all=True, verbose=False, n_threads=2)  # fmt: skip
    ids = ref.tokenize(text.encode(), add_bos=True, special=False)[:n]
    ref.eval(ids)
    scores = ref.scores  # (n_ctx, V): rows past n are unused
    targets = np.array(ids[1:] + [0])
    results = {}
    for dtype in dtypes:
        runner = _runner(path, dtype, n)
        assert runner.tokenize(text[:5000], add_special=True)[:300] == ids[:300]  # same tokens
        tot = dict.fromkeys(("agree", "kl", "nll_ref", "nll_ours"), 0.0)
        for start, ours in _our_logits(runner, ids):
            rows = min(len(ours), n - 1 - start)  # the last position has no next token
            s = _stats(scores[start : start + rows], ours[:rows], targets[start : start + rows])
            tot = {k: tot[k] + s[k] for k in tot}
        runner.close()
        m = n - 1
        results[dtype] = {"top1": tot["agree"] / m, "kl": tot["kl"] / m,
                          "ppl_ref": math.exp(tot["nll_ref"] / m),
                          "ppl_ours": math.exp(tot["nll_ours"] / m)}  # fmt: skip
    ref.close()
    return results


def _assert_bars(r: dict[str, float], what: str) -> None:
    assert r["top1"] >= 0.95, (what, r)  # the issue asks 98%: see the module's docstring
    assert r["kl"] <= 0.02, (what, r)
    assert abs(r["ppl_ours"] / r["ppl_ref"] - 1) <= 0.01, (what, r)


def test_default_model_matches_llamacpp(default_model_path: Path, corpus_dir: Path) -> None:
    r = _compare(default_model_path, corpus_dir, ("f32",))
    _assert_bars(r["f32"], "SmolLM2 f32")


def test_gemma_matches_llamacpp(gemma_model_path: Path, corpus_dir: Path) -> None:
    """Over 2,000 tokens, as the bars were measured: Gemma 3's perplexity is 0.63% from
    llama.cpp's there (18.698 against 18.816, KL 0.0047, top-1 95.7%), but 0.9% over the first
    1,500 and 1.4% over the first 1,000 (22.088 against 22.402, KL 0.005), the same on an AVX2
    and an AVX-512 EPYC: a short text's perplexity sits on a few near-ties."""
    r = _compare(gemma_model_path, corpus_dir, ("f32",), 2000)
    _assert_bars(r["f32"], "Gemma 3 f32")


@pytest.mark.slow
def test_the_default_model_matches_llamacpp_over_2000_tokens(default_model_path: Path, corpus_dir: Path) -> None:
    _assert_bars(_compare(default_model_path, corpus_dir, ("f32",), 2000)["f32"], "SmolLM2 f32")


def test_cpu_default_path_stays_close_to_f32(default_model_path: Path, corpus_dir: Path) -> None:
    """The CPU default (int4) against our own f32 path, over the same 2,000 tokens."""
    text = (corpus_dir / "alice.txt").read_text()
    f32 = _runner(default_model_path, "f32")
    fast = _runner(default_model_path, "auto")
    ids = f32.tokenize(text)[:N]
    targets = np.array(ids[1:] + [0])
    tot = dict.fromkeys(("agree", "kl", "nll_ref", "nll_ours"), 0.0)
    for (start, a), (_, b) in zip(_our_logits(f32, ids), _our_logits(fast, ids)):
        n = min(len(a), N - 1 - start)
        s = _stats(a[:n], b[:n], targets[start : start + n])
        tot = {k: tot[k] + s[k] for k in tot}
    m = N - 1
    assert tot["agree"] / m >= 0.99, tot
    assert tot["kl"] / m <= 0.01, tot


@pytest.fixture(scope="module")
def smol_f32(default_model_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    from localllm.quant.writer import quantize_file

    out = tmp_path_factory.mktemp("smol") / "smollm2-f32.gguf"
    return quantize_file(default_model_path, out, "F32", allow_requantize=True).path


@pytest.mark.parametrize("file_type", ["Q3_K_S", "IQ4_XS"])
def test_the_lower_bit_types_match_llamacpp(file_type: str, smol_f32: Path, corpus_dir: Path,
                                            tmp_path: Path) -> None:  # fmt: skip
    """The default model quantized to types the torch engine reads since issue 38 runs in it as in
    llama.cpp: Q3_K_S (its ffn_down Q3_K), IQ4_XS (IQ4_XS, and IQ4_NL where rows of 576 have no
    super-block). No mix of this llama.cpp gives SmolLM2 a Q2_K tensor (its Q2_K falls back to Q4_0
    and Q3_K): Q2_K's decoder is held to ggml's by tests/backends/torch/test_weights.py.

    llama.cpp runs the file's F32 copy (the same values): on the IQ4 file itself its matmuls
    round the activations to 8 bits, which moved its perplexity 1.2% from ours (27.65 against
    27.32, KL 0.005, top-1 95.8%); against its F32 path ours holds the module's bars."""
    from localllm.gguf_file import GGUFFile
    from localllm.quant.writer import quantize_file

    path = quantize_file(smol_f32, tmp_path / f"{file_type}.gguf", file_type, engine="llama.cpp").path
    with GGUFFile(path) as f:
        types = {t.ggml_type.name for t in f.tensors.values()}
    assert types & {"Q3_K", "IQ4_NL", "IQ4_XS"}, types
    same = quantize_file(path, tmp_path / "values.gguf", "F32", allow_requantize=True).path
    _assert_bars(_compare(path, corpus_dir, ("f32",), 300, ref_path=same)["f32"], f"SmolLM2 {file_type}")
