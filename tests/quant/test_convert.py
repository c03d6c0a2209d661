"""`localllm convert`: Hugging Face checkpoints to GGUF that llama.cpp loads, tokenizes like the
checkpoint's tokenizer, and computes the same logits as transformers (fp32: max |Δ| ≤ 1e-3) — for
random tiny Llama and Qwen2 configs and for the default model's own weights saved by transformers."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from localllm.errors import LocalLLMError
from localllm.quant.convert import convert

from conftest import need

TEXT = "The quick brown fox jumps over the lazy dog. 3.14 ¿Qué? 我想 🦙"


@pytest.fixture(scope="module")
def hf_tokenizer(default_model_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The default model's tokenizer as transformers saves it (tokenizer.json, its config)."""
    need("transformers", "pip install -e '.[dev]' (transformers is the conversion's oracle)")
    from transformers import AutoTokenizer

    folder = tmp_path_factory.mktemp("tok")
    tok = AutoTokenizer.from_pretrained(default_model_path.parent, gguf_file=default_model_path.name)
    tok.save_pretrained(folder)
    return folder


def checkpoint(folder: Path, tokenizer: Path, arch: str, **over: object) -> object:
    """A random tiny model of `arch` saved as safetensors beside the tokenizer's files."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    cls, cfg_cls = ((LlamaForCausalLM, LlamaConfig) if arch == "llama"
                    else (Qwen2ForCausalLM, Qwen2Config))  # fmt: skip
    vocab = len(json.loads((tokenizer / "tokenizer.json").read_text())["model"]["vocab"])
    config = cfg_cls(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                     rms_norm_eps=1e-6, rope_theta=10000.0, **over)  # fmt: skip
    model = cls(config).float().eval()
    with torch.no_grad():  # random norms and biases too: every tensor must land in its place
        for name, p in model.named_parameters():
            if name.endswith(("norm.weight", "bias")):
                p.copy_(torch.randn_like(p) * 0.1 + (1.0 if "norm" in name else 0.0))
    model.save_pretrained(folder, safe_serialization=True)
    for f in tokenizer.iterdir():
        (folder / f.name).write_bytes(f.read_bytes())
    return model


def llamacpp_logits(path: Path, ids: list[int]) -> tuple[np.ndarray, list[int]]:
    need("llama_cpp", "pip install -e '.[dev]'")
    from llama_cpp import Llama

    # an f32 KV cache: llama.cpp's default f16 one alone moves the 30-layer model's logits ~0.03
    llm = Llama(str(path), n_ctx=256, logits_all=True, verbose=False, n_threads=2, type_k=0, type_v=0)
    try:
        tokens = llm.tokenize(TEXT.encode(), add_bos=False, special=False)
        llm.eval(ids)
        return np.array(llm.scores[: len(ids)], dtype=np.float32), tokens
    finally:
        llm.close()


def hf_logits(model: object, ids: list[int]) -> np.ndarray:
    import torch

    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float().numpy()  # type: ignore[operator]


@pytest.mark.parametrize(("arch", "over"), [("llama", {"tie_word_embeddings": True}),
                                            ("llama", {"tie_word_embeddings": False}),
                                            ("qwen2", {"tie_word_embeddings": False})])  # fmt: skip
def test_logits_match_transformers(arch: str, over: dict, hf_tokenizer: Path, tmp_path: Path) -> None:
    from transformers import AutoTokenizer

    model = checkpoint(tmp_path / "ckpt", hf_tokenizer, arch, **over)
    out = convert(tmp_path / "ckpt", tmp_path / "out.gguf", "f32")
    hf_ids = AutoTokenizer.from_pretrained(tmp_path / "ckpt")(TEXT, add_special_tokens=False)["input_ids"]
    ours, tokens = llamacpp_logits(out, hf_ids)
    assert tokens == hf_ids  # llama.cpp tokenizes as the checkpoint's tokenizer does
    delta = float(np.abs(ours - hf_logits(model, hf_ids)).max())
    assert delta <= 1e-3, f"{arch}: max |Δ logits| {delta}"


def test_default_model_weights_round_trip(default_model_path: Path, hf_tokenizer: Path,
                                          tmp_path: Path) -> None:  # fmt: skip
    """SmolLM2's dequantized weights, built by transformers from the GGUF and saved as a
    checkpoint, converted back: llama.cpp's logits match transformers' on that checkpoint."""
    import torch
    from transformers import AutoModelForCausalLM

    loaded = AutoModelForCausalLM.from_pretrained(default_model_path.parent, gguf_file=default_model_path.name,
                                                  dtype=torch.float32)  # fmt: skip
    config = loaded.config  # a GGUF-loaded model will not save itself: the same weights, fresh
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    model = type(loaded)(config).float().eval()
    model.load_state_dict(loaded.state_dict())
    model.save_pretrained(tmp_path / "ckpt", safe_serialization=True)
    for f in hf_tokenizer.iterdir():
        (tmp_path / "ckpt" / f.name).write_bytes(f.read_bytes())
    out = convert(tmp_path / "ckpt", tmp_path / "smollm2-f32.gguf", "f32")
    ids = [1, 504, 2365, 6354, 16438, 27003, 690, 260, 23790, 2767, 30]
    ours, _ = llamacpp_logits(out, ids)
    delta = float(np.abs(ours - hf_logits(model, ids)).max())
    assert delta <= 1e-3, f"max |Δ logits| {delta}"
    from localllm.gguf_file import GGUFFile

    with GGUFFile(out) as f, GGUFFile(default_model_path) as orig:
        assert f.metadata["tokenizer.ggml.pre"] == orig.metadata["tokenizer.ggml.pre"] == "smollm"
        assert f.metadata["tokenizer.chat_template"] == orig.metadata["tokenizer.chat_template"]
        assert f.metadata["tokenizer.ggml.eos_token_id"] == orig.metadata["tokenizer.ggml.eos_token_id"]


@pytest.mark.parametrize("outtype", ["f16", "bf16", "q8_0"])
def test_other_outtypes_load_and_generate(outtype: str, hf_tokenizer: Path, tmp_path: Path) -> None:
    from localllm.engine import load
    from localllm.models_registry.store import Store

    model = checkpoint(tmp_path / "ckpt", hf_tokenizer, "llama")
    out = convert(tmp_path / "ckpt", tmp_path / f"out-{outtype}.gguf", outtype)
    ids = [1, 504, 2365, 6354, 16438]
    ours, _ = llamacpp_logits(out, ids)
    delta = float(np.abs(ours - hf_logits(model, ids)).max())
    assert delta <= {"f16": 0.02, "bf16": 0.1, "q8_0": 0.1}[outtype], delta
    Store().import_file(out, f"conv-{outtype}")
    with load(f"conv-{outtype}", backend="torch", device="cpu", ctx=64) as m:
        r = m.complete("Hello", max_tokens=3, temperature=0)
    assert 1 <= r.usage.completion_tokens <= 3


def test_refusals_are_one_line(hf_tokenizer: Path, tmp_path: Path) -> None:
    with pytest.raises(LocalLLMError, match="not a folder"):
        convert(tmp_path / "missing", tmp_path / "o.gguf")
    (tmp_path / "c").mkdir()
    with pytest.raises(LocalLLMError, match="has no config.json"):
        convert(tmp_path / "c", tmp_path / "o.gguf")
    (tmp_path / "c" / "config.json").write_text(json.dumps({"architectures": ["GPTNeoXForCausalLM"]}))
    with pytest.raises(LocalLLMError, match="cannot convert GPTNeoXForCausalLM"):
        convert(tmp_path / "c", tmp_path / "o.gguf")
    checkpoint(tmp_path / "ok", hf_tokenizer, "llama")
    with pytest.raises(LocalLLMError, match="--outtype must be one of"):
        convert(tmp_path / "ok", tmp_path / "o.gguf", "q4_0")
    for f in (tmp_path / "ok").glob("*.safetensors"):
        f.unlink()
    with pytest.raises(LocalLLMError, match="no .safetensors"):
        convert(tmp_path / "ok", tmp_path / "o.gguf")
    assert not (tmp_path / "o.gguf").exists()
