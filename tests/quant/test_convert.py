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
    from transformers import (
        Gemma3ForCausalLM,
        Gemma3TextConfig,
        LlamaConfig,
        LlamaForCausalLM,
        MixtralConfig,
        MixtralForCausalLM,
        Phi3Config,
        Phi3ForCausalLM,
        Qwen2Config,
        Qwen2ForCausalLM,
        Qwen3Config,
        Qwen3ForCausalLM,
    )

    torch.manual_seed(0)
    cls, cfg_cls = {"llama": (LlamaForCausalLM, LlamaConfig), "qwen2": (Qwen2ForCausalLM, Qwen2Config),
                    "qwen3": (Qwen3ForCausalLM, Qwen3Config), "phi3": (Phi3ForCausalLM, Phi3Config),
                    "gemma3": (Gemma3ForCausalLM, Gemma3TextConfig),
                    "mixtral": (MixtralForCausalLM, MixtralConfig)}[arch]  # fmt: skip
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
                                            ("qwen2", {"tie_word_embeddings": False}),
                                            # per-head q/k norms, a head_dim of its own (32, not 64/4)
                                            ("qwen3", {"tie_word_embeddings": True, "head_dim": 32}),
                                            # fused q|k|v and gate|up (Phi3Config's pad id 32000 is past
                                            # this vocabulary: 0 instead)
                                            ("phi3", {"tie_word_embeddings": False, "pad_token_id": 0}),
                                            # norms as 1 + w, post-norms, a sliding window shorter
                                            # than the text on the first layer, global RoPE base 1e6
                                            ("gemma3", {"tie_word_embeddings": True, "pad_token_id": 0,
                                                        "head_dim": 32, "query_pre_attn_scalar": 32,
                                                        "sliding_window": 8,
                                                        "layer_types": ["sliding_attention", "full_attention"]}),
                                            # 4 experts a layer, 2 of them per token: stacked into
                                            # llama.cpp's 3-D expert tensors, the router kept F32
                                            ("mixtral", {"tie_word_embeddings": False, "num_local_experts": 4,
                                                         "num_experts_per_tok": 2})])  # fmt: skip
def test_logits_match_transformers(arch: str, over: dict, hf_tokenizer: Path, tmp_path: Path) -> None:
    from transformers import AutoTokenizer

    model = checkpoint(tmp_path / "ckpt", hf_tokenizer, arch, **over)
    out = convert(tmp_path / "ckpt", tmp_path / "out.gguf", "f32")
    hf_ids = AutoTokenizer.from_pretrained(tmp_path / "ckpt")(TEXT, add_special_tokens=False)["input_ids"]
    ours, tokens = llamacpp_logits(out, hf_ids)
    assert tokens == hf_ids  # llama.cpp tokenizes as the checkpoint's tokenizer does
    if arch == "gemma3":  # compare what the file holds, not ggml's GELU approximation
        exact = float(np.abs(ours - hf_logits(model, hf_ids)).max())
        import torch

        class GgmlGelu(torch.nn.Module):
            def forward(self, x: torch.Tensor) -> torch.Tensor:
                return ggml_gelu(x)  # type: ignore[return-value]

        for layer in model.model.layers:  # type: ignore[attr-defined]
            layer.mlp.act_fn = GgmlGelu()
        print(f"gemma3: max |Δ logits| {exact:.5f} against exact GELU")
    delta = float(np.abs(ours - hf_logits(model, hf_ids)).max())
    print(f"{arch}: max |Δ logits| {delta:.6f}")
    assert delta <= 1e-3, f"{arch}: max |Δ logits| {delta}"


def ggml_gelu(x: object) -> object:
    """GELU as ggml's CPU backend computes it on f32 (GGML_GELU_FP16): the tanh approximation of
    the input rounded to f16, read from a table of f16 results; 0 at or below -10, x at or above
    10. (Exact GELU puts a tiny Gemma 3's logits ~1e-3 from llama.cpp's.)"""
    import torch

    t = x.half().float()  # type: ignore[attr-defined]
    y = torch.nn.functional.gelu(t, approximate="tanh").half().float()
    return torch.where(x <= -10, torch.zeros_like(x), torch.where(x >= 10, x, y))  # type: ignore[operator]


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


# SentencePiece vocabularies (Llama 2, Mistral 7B v0.1-v0.3): llama.cpp's `llama` tokenizer model.
# The tokenizer is trained here on the corpus with Llama 2's settings (BPE, byte fallback, digits
# split, no normalization); sentencepiece and transformers' tokenizer built from it are the oracles.
SPM_TEXT = ("Hello world. 3.14 🦙 x  double  spaces\n\nnew line\tTab ¿Qué? 我想 ROMEO: O, she doth "
            "teach the torches to burn bright! Ünïcödé — naïve café")  # fmt: skip


@pytest.fixture(scope="module")
def spm_model(corpus_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 1,000-piece SentencePiece BPE model (`tokenizer.model`) with a user-defined and a
    control piece, and the tokenizer files transformers saves for it, in one folder."""
    need("sentencepiece", "pip install -e '.[dev]' (sentencepiece trains the test tokenizer)")
    need("google.protobuf", "pip install -e '.[dev]' (transformers reads tokenizer.model with protobuf)")
    import io

    import sentencepiece as spm
    from transformers import AutoTokenizer

    text = (corpus_dir / "tinyshakespeare.txt").read_text(encoding="utf-8")[:300_000]
    lines = [line for line in text.splitlines() if line.strip()] + ["naïve café Ünïcödé 我想 ¿Qué?"]
    model = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(lines), model_writer=model, vocab_size=1000, model_type="bpe",
        byte_fallback=True, split_digits=True, normalization_rule_name="identity",
        remove_extra_whitespaces=False, allow_whitespace_only_pieces=True, character_coverage=1.0,
        unk_id=0, bos_id=1, eos_id=2, pad_id=-1, user_defined_symbols=["<tool>"],
        control_symbols=["<ctrl>"], num_threads=1, minloglevel=2,
    )  # fmt: skip
    folder = tmp_path_factory.mktemp("spm")
    (folder / "tokenizer.model").write_bytes(model.getvalue())
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "LlamaTokenizer", "legacy": False, "add_bos_token": True,
        "bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>",
        "chat_template": "{% for m in messages %}[INST] {{ m['content'] }} [/INST]{% endfor %}"}))  # fmt: skip
    AutoTokenizer.from_pretrained(folder).save_pretrained(folder)  # tokenizer.json beside it
    return folder


def spm_checkpoint(folder: Path, spm_model: Path, arch: str, with_model_file: bool, vocab_size: int = 1000) -> object:
    """A random tiny Llama or Mistral with the SentencePiece tokenizer: `tokenizer.model` and
    transformers' files (as Llama 2 checkpoints ship), or transformers' files alone (as
    transformers 5 saves them: byte-fallback BPE in tokenizer.json)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM

    torch.manual_seed(1)
    cls, cfg_cls = (LlamaForCausalLM, LlamaConfig) if arch == "llama" else (MistralForCausalLM, MistralConfig)
    config = cfg_cls(vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                     rms_norm_eps=1e-6, tie_word_embeddings=False)  # fmt: skip
    model = cls(config).float().eval()
    model.save_pretrained(folder, safe_serialization=True)
    for f in spm_model.iterdir():
        if with_model_file or f.name != "tokenizer.model":
            (folder / f.name).write_bytes(f.read_bytes())
    return model


@pytest.mark.parametrize(("arch", "with_model_file"), [("llama", True), ("llama", False), ("mistral", True)])
def test_sentencepiece_checkpoints(arch: str, with_model_file: bool, spm_model: Path, tmp_path: Path) -> None:
    """llama.cpp tokenizes the converted file as sentencepiece and transformers do, and its
    logits match transformers' (fp32, max |Δ| ≤ 1e-3)."""
    import sentencepiece as spm
    from transformers import AutoTokenizer

    model = spm_checkpoint(tmp_path / "ckpt", spm_model, arch, with_model_file)
    out = convert(tmp_path / "ckpt", tmp_path / "out.gguf", "f32")
    sp_ids = spm.SentencePieceProcessor(model_file=str(spm_model / "tokenizer.model")).encode(SPM_TEXT)
    hf_ids = AutoTokenizer.from_pretrained(tmp_path / "ckpt")(SPM_TEXT, add_special_tokens=False)["input_ids"]
    assert hf_ids == sp_ids
    need("llama_cpp", "pip install -e '.[dev]'")
    from llama_cpp import Llama

    llm = Llama(str(out), n_ctx=256, logits_all=True, verbose=False, n_threads=2, type_k=0, type_v=0)
    try:
        assert llm.tokenize(SPM_TEXT.encode(), add_bos=False, special=False) == sp_ids
        # BOS from tokenizer_config.json; the control and user-defined pieces are single tokens
        assert llm.tokenize(b"<s>Hi<ctrl>", add_bos=True, special=True)[:2] == [1, 1]
        assert 3 in llm.tokenize(b"a<ctrl>b", add_bos=False, special=True)
        assert 4 in llm.tokenize(b"a <tool> b", add_bos=False, special=True)
        assert llm.detokenize(sp_ids).decode().lstrip(" ") == SPM_TEXT
        llm.eval(sp_ids)
        ours = np.array(llm.scores[: len(sp_ids)], dtype=np.float32)
    finally:
        llm.close()
    delta = float(np.abs(ours - hf_logits(model, sp_ids)).max())
    assert delta <= 1e-3, f"{arch}: max |Δ logits| {delta}"
    from localllm.gguf_file import GGUFFile

    with GGUFFile(out) as f:
        md = f.metadata
        assert (md["tokenizer.ggml.model"], md["tokenizer.ggml.pre"]) == ("llama", "default")
        assert (md["tokenizer.ggml.bos_token_id"], md["tokenizer.ggml.eos_token_id"]) == (1, 2)
        assert md["tokenizer.ggml.unknown_token_id"] == 0
        assert md["tokenizer.chat_template"].startswith("{% for m in messages %}[INST]")
        types = list(md["tokenizer.ggml.token_type"])
        # <unk>, <s>, <ctrl> control (special in added_tokens_decoder, as llama.cpp's converter
        # marks them), <tool> user-defined, <0x00> a byte, the rest normal
        assert types[:6] == [3, 3, 3, 3, 4, 6] and set(types[261:]) == {1}


def test_sentencepiece_file_in_the_torch_engine(spm_model: Path, tmp_path: Path) -> None:
    """The converted file also loads in the torch engine, which tokenizes it as sentencepiece
    does and computes transformers' logits."""
    import sentencepiece as spm

    from localllm.engine import load
    from localllm.models_registry.store import Store

    model = spm_checkpoint(tmp_path / "ckpt", spm_model, "llama", True)
    out = convert(tmp_path / "ckpt", tmp_path / "out.gguf", "f16")
    Store().import_file(out, "spm-tiny")
    sp_ids = spm.SentencePieceProcessor(model_file=str(spm_model / "tokenizer.model")).encode(SPM_TEXT)
    with load("spm-tiny", backend="torch", device="cpu", dtype="f32", ctx=256) as m:
        assert m.backend.tokenize(SPM_TEXT, add_special=False) == sp_ids  # type: ignore[attr-defined]
        r = m.complete("Hello", max_tokens=3, temperature=0)
    assert 1 <= r.usage.completion_tokens <= 3
    del model


def test_sentencepiece_vocab_padded_to_the_embedding(spm_model: Path, tmp_path: Path) -> None:
    """An embedding with more rows than pieces (vocab_size rounded up, as many checkpoints do)
    gets [PADn] tokens, as llama.cpp's converter writes; llama.cpp loads it."""
    spm_checkpoint(tmp_path / "ckpt", spm_model, "llama", True, vocab_size=1024)
    out = convert(tmp_path / "ckpt", tmp_path / "out.gguf", "f32")
    from localllm.gguf_file import GGUFFile

    with GGUFFile(out) as f:
        tokens = list(f.metadata["tokenizer.ggml.tokens"])
        types = list(f.metadata["tokenizer.ggml.token_type"])
    assert len(tokens) == 1024 and tokens[1000:1002] == ["[PAD1000]", "[PAD1001]"] and types[1023] == 5
    ids, _ = llamacpp_logits_of(out, [1, 400, 500])
    assert ids.shape == (3, 1024)


def llamacpp_logits_of(path: Path, ids: list[int]) -> tuple[np.ndarray, None]:
    need("llama_cpp", "pip install -e '.[dev]'")
    from llama_cpp import Llama

    llm = Llama(str(path), n_ctx=64, logits_all=True, verbose=False, n_threads=2)
    try:
        llm.eval(ids)
        return np.array(llm.scores[: len(ids)], dtype=np.float32), None
    finally:
        llm.close()


def test_hostile_sentencepiece_files_are_one_line(spm_model: Path, tmp_path: Path) -> None:
    from localllm.quant.convert import read_sentencepiece

    good = (spm_model / "tokenizer.model").read_bytes()
    pieces = read_sentencepiece(spm_model / "tokenizer.model")
    assert len(pieces) == 1000 and pieces[0] == ("<unk>", 0.0, 2) and pieces[4][2] == 4
    rng = np.random.default_rng(0)
    bad = tmp_path / "tokenizer.model"
    for blob in (b"", b"\xff" * 12, good[: len(good) // 2], rng.bytes(4096), b"\x0a\xff\xff\xff\xff\x0f"):
        bad.write_bytes(blob)
        with pytest.raises(LocalLLMError, match="is not a SentencePiece model"):
            read_sentencepiece(bad)
    spm_checkpoint(tmp_path / "ckpt", spm_model, "llama", True)
    (tmp_path / "ckpt" / "tokenizer.model").write_bytes(good[:100])
    with pytest.raises(LocalLLMError, match="is not a SentencePiece model"):
        convert(tmp_path / "ckpt", tmp_path / "o.gguf")
    spm_checkpoint(tmp_path / "ckpt2", spm_model, "llama", True, vocab_size=900)
    with pytest.raises(LocalLLMError, match="the tokenizer has 1000 tokens but the embedding 900 rows"):
        convert(tmp_path / "ckpt2", tmp_path / "o.gguf")
    assert not (tmp_path / "o.gguf").exists()


def test_a_phi3_checkpoint_without_its_own_head_is_refused(hf_tokenizer: Path, tmp_path: Path) -> None:
    """llama.cpp's phi3 reads an output matrix of its own: a tied Phi-3 is one line, no file."""
    checkpoint(tmp_path / "ckpt", hf_tokenizer, "phi3", tie_word_embeddings=True, pad_token_id=0)
    with pytest.raises(LocalLLMError, match="a Phi-3 checkpoint needs its own lm_head.weight"):
        convert(tmp_path / "ckpt", tmp_path / "out.gguf", "f32")
    assert not (tmp_path / "out.gguf").exists()
