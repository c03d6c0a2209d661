"""Hugging Face checkpoints (safetensors) to GGUF: `localllm convert HF_DIR --output OUT.gguf`.

Llama, Mistral and Qwen2 causal LMs with a byte-level BPE tokenizer (`tokenizer.json`: Llama 3,
Qwen2, SmolLM, Mistral Nemo's tekken). What llama.cpp's converter writes for them, done here:

- hyperparameters from `config.json` into the architecture's keys;
- tensors renamed to GGUF's names; for `llama` the q and k rows permuted for llama.cpp's
  adjacent-pair RoPE (what the torch engine undoes as it loads); Qwen2's q/k/v biases kept;
- the vocabulary (tokens by id, added tokens marked control or user-defined, merges), the
  pre-tokenizer named the way llama.cpp names it — by hashing the tokenization of its check text,
  as its converter does — special token ids and the chat template from `tokenizer_config.json`;
- matrices in the output type (f32, f16, bf16 or q8_0 through `localllm.quant`), vectors in f32.

The file is written beside the output and renamed when complete and re-read.
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Callable, Iterator
from hashlib import sha256
from pathlib import Path
from typing import Any

import numpy as np

from localllm.errors import LocalLLMError

__all__ = ["OUTTYPES", "convert"]

OUTTYPES = {"f32": ("F32", 0), "f16": ("F16", 1), "bf16": ("BF16", 32), "q8_0": ("Q8_0", 7)}
ARCHS = {"LlamaForCausalLM": "llama", "MistralForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2"}

# llama.cpp's pre-tokenizer check: the text its converter tokenizes, and the names it gives the
# sha256 of the resulting ids (llama.cpp conversion/base.py, `get_vocab_base_pre`) for the
# tokenizers of the families converted here
CHECK_TEXT = (
    "\n \n\n \n\n\n \t \t\t \t\n  \n   \n    \n     \n🚀 (normal) 😶\u200d🌫️ (multiple emojis "
    "concatenated) ✅ 🦙🦙 3 33 333 3333 33333 333333 3333333 33333333 3.3 3..3 3...3 "
    "កាន់តែពិសេសអាច😁 ?我想在apple工作1314151天～ ------======= нещо на Български "
    "''''''```````\"\"\"\"......!!!!!!?????? I've been 'told he's there, 'RE you sure? 'M not "
    "sure I'll make it, 'D you like some tea? We'Ve a'lL"
)
PRE_TOKENIZERS = {
    "0ef9807a4087ebef797fc749390439009c3b9eda9ad1a097abbe738f486c01e5": "llama-bpe",  # Llama 3
    "e636dc30a262dcc0d8c323492e32ae2b70728f4df7dfe9737d9f920a282b8aea": "qwen2",  # Qwen1.5/2/2.5
    "d4540891389ea895b53b399da6ac824becc30f2fba0e9ddbb98f92e55ca0e97c": "qwen2",  # Qwen3
    "855059429035d75a914d1eda9f10a876752e281a054a7a3d421ef0533e5b6249": "smollm",  # SmolLM, SmolLM2
    "63b97e4253352e6f357cc59ea5b583e3a680eaeaf2632188c2b952de2588485e": "tekken",  # Mistral Nemo
    "3ce83efda5659b07b1ad37ca97ca5797ea4285d9b9ab0dc679e4a720c9da7454": "gpt-2",  # GPT-2
}

TOKEN_NORMAL, TOKEN_CONTROL, TOKEN_USER_DEFINED, TOKEN_UNUSED = 1, 3, 4, 5

# Hugging Face name (after `model.`) → GGUF name; {n} is the layer
_NAMES = {
    "embed_tokens.weight": "token_embd.weight",
    "norm.weight": "output_norm.weight",
    "layers.{n}.input_layernorm.weight": "blk.{n}.attn_norm.weight",
    "layers.{n}.post_attention_layernorm.weight": "blk.{n}.ffn_norm.weight",
    "layers.{n}.self_attn.q_proj.weight": "blk.{n}.attn_q.weight",
    "layers.{n}.self_attn.k_proj.weight": "blk.{n}.attn_k.weight",
    "layers.{n}.self_attn.v_proj.weight": "blk.{n}.attn_v.weight",
    "layers.{n}.self_attn.o_proj.weight": "blk.{n}.attn_output.weight",
    "layers.{n}.self_attn.q_proj.bias": "blk.{n}.attn_q.bias",
    "layers.{n}.self_attn.k_proj.bias": "blk.{n}.attn_k.bias",
    "layers.{n}.self_attn.v_proj.bias": "blk.{n}.attn_v.bias",
    "layers.{n}.mlp.gate_proj.weight": "blk.{n}.ffn_gate.weight",
    "layers.{n}.mlp.up_proj.weight": "blk.{n}.ffn_up.weight",
    "layers.{n}.mlp.down_proj.weight": "blk.{n}.ffn_down.weight",
}


def _read_json(path: Path, what: str, required: bool = True) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        if required:
            raise LocalLLMError(f"{path.parent} has no {path.name} ({what})") from None
        return {}
    except (OSError, ValueError) as e:
        raise LocalLLMError(f"{path} is unreadable: {e}") from None
    if not isinstance(data, dict):
        raise LocalLLMError(f"{path} does not hold a JSON object")
    return data


def gguf_name(hf: str) -> str | None:
    """The GGUF name of a Hugging Face tensor name, or None for one llama.cpp does not keep."""
    if hf == "lm_head.weight":
        return "output.weight"
    name = hf.removeprefix("model.")
    parts = name.split(".")
    if len(parts) > 2 and parts[0] == "layers" and parts[1].isdigit():
        pattern = ".".join(["layers", "{n}", *parts[2:]])
        target = _NAMES.get(pattern)
        return target.format(n=parts[1]) if target else None
    return _NAMES.get(name)


def permute_qk(w: np.ndarray, n_head: int) -> np.ndarray:
    """Rows of each head from Hugging Face's half-split RoPE order into llama.cpp's adjacent
    pairs: per head, rows (half j, i) → (i, j) — the inverse of what the torch engine applies."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _safetensors(folder: Path) -> list[Path]:
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise LocalLLMError(f"{folder} has no .safetensors files (PyTorch .bin checkpoints are "
                            "not read: they can run code when loaded)")  # fmt: skip
    return files


def _shapes(files: list[Path]) -> Iterator[tuple[str, Path, tuple[int, ...]]]:
    """(name, file, shape) of every tensor of the checkpoint, without reading the values."""
    from safetensors import safe_open

    for path in files:
        with safe_open(str(path), framework="pt") as f:
            for key in f.keys():  # noqa: SIM118 - safe_open is not a mapping
                yield key, path, tuple(f.get_slice(key).get_shape())


def _values(path: Path, key: str) -> np.ndarray:
    """One tensor as float32 numpy (bf16 and f16 widened exactly)."""
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as f:
        return f.get_tensor(key).float().numpy()


def _vocab(folder: Path, config: dict[str, Any]) -> dict[str, Any]:
    """tokenizer.json (byte-level BPE) and tokenizer_config.json → GGUF tokenizer keys."""
    tok = _read_json(folder / "tokenizer.json", "the tokenizer")
    model = tok.get("model") or {}
    if model.get("type") != "BPE" or model.get("byte_fallback"):
        raise LocalLLMError(
            "only byte-level BPE tokenizers (Llama 3, Qwen2, SmolLM, Mistral Nemo) are converted; "
            "this one is " + ("SentencePiece-style BPE" if model.get("byte_fallback") else str(model.get("type")))
        )
    vocab: dict[str, int] = model["vocab"]
    added = {int(a["id"]): a for a in tok.get("added_tokens", [])}
    size = max([*vocab.values(), *added, int(config.get("vocab_size", 0)) - 1]) + 1
    tokens = [f"[PAD{i}]" for i in range(size)]
    types = [TOKEN_UNUSED] * size  # ids no token has: llama.cpp's converter pads them so too
    for text, i in vocab.items():
        tokens[i], types[i] = text, TOKEN_NORMAL
    for i, a in added.items():
        tokens[i] = a["content"]
        types[i] = TOKEN_CONTROL if a.get("special") else TOKEN_USER_DEFINED
    merges = [m if isinstance(m, str) else " ".join(m) for m in model.get("merges", [])]
    from tokenizers import Tokenizer

    ids = Tokenizer.from_file(str(folder / "tokenizer.json")).encode(CHECK_TEXT, add_special_tokens=False).ids
    digest = sha256(str(ids).encode()).hexdigest()
    pre = PRE_TOKENIZERS.get(digest)
    if pre is None:
        raise LocalLLMError(
            f"llama.cpp would not know this tokenizer's pre-tokenizer (check hash {digest[:16]}…): "
            "only Llama 3, Qwen2, SmolLM, Mistral Nemo and GPT-2 style ones are converted"
        )
    cfg = _read_json(folder / "tokenizer_config.json", "the tokenizer's settings", required=False)
    out: dict[str, Any] = {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": pre,
                           "tokenizer.ggml.tokens": tokens, "tokenizer.ggml.token_type": types,
                           "tokenizer.ggml.merges": merges}  # fmt: skip
    by_text = {t: i for i, t in enumerate(tokens)}

    def token_id(key: str) -> int | None:
        v = cfg.get(key)
        if isinstance(v, dict):
            v = v.get("content")
        return by_text.get(v) if isinstance(v, str) else None

    for key, gguf_key in (("bos_token", "bos_token_id"), ("eos_token", "eos_token_id"),
                          ("unk_token", "unknown_token_id"), ("pad_token", "padding_token_id")):  # fmt: skip
        i = token_id(key)
        if i is None and key in ("bos_token", "eos_token"):
            i = config.get(f"{key}_id") if isinstance(config.get(f"{key}_id"), int) else None
        if i is not None:
            out[f"tokenizer.ggml.{gguf_key}"] = int(i)
    if isinstance(cfg.get("add_bos_token"), bool):
        out["tokenizer.ggml.add_bos_token"] = cfg["add_bos_token"]
    template = cfg.get("chat_template")
    jinja = folder / "chat_template.jinja"  # where transformers 5 saves it
    if not isinstance(template, str) and jinja.is_file():
        template = jinja.read_text(encoding="utf-8")
    if isinstance(template, str):
        out["tokenizer.chat_template"] = template
    return out


def convert(folder: str | os.PathLike[str], output: str | os.PathLike[str], outtype: str = "f16",
            on_tensor: Callable[[int, int, str], None] | None = None) -> Path:  # fmt: skip
    """Write `output` (GGUF) from the checkpoint in `folder`. Returns the path written."""
    import gguf

    from localllm.quant import quantize, row_bytes
    from localllm.quant.writer import temp_beside, verify  # the same temporary-file discipline

    folder, output = Path(folder).expanduser(), Path(output).expanduser()
    if outtype not in OUTTYPES:
        raise LocalLLMError(f"--outtype must be one of {', '.join(OUTTYPES)}, not {outtype}")
    if not folder.is_dir():
        raise LocalLLMError(f"{folder} is not a folder (a Hugging Face checkpoint)")
    config = _read_json(folder / "config.json", "the model's configuration")
    archs = config.get("architectures") or []
    arch = next((ARCHS[a] for a in archs if a in ARCHS), None)
    if arch is None:
        raise LocalLLMError(f"cannot convert {', '.join(archs) or 'an unnamed architecture'}: "
                            f"only {', '.join(ARCHS)}")  # fmt: skip
    # RoPE: `rope_theta` at the top (transformers 4), or in `rope_parameters` / `rope_scaling`
    # with its type (transformers 5 saves it there)
    rope = config.get("rope_parameters") or config.get("rope_scaling") or {}
    rope = rope if isinstance(rope, dict) else {}
    kind = rope.get("rope_type", rope.get("type"))
    if kind not in (None, "default"):
        raise LocalLLMError(f"RoPE scaling {kind} is not converted")
    rope_theta = float(config.get("rope_theta") or rope.get("rope_theta") or 10000.0)
    n_head = int(config["num_attention_heads"])
    n_kv = int(config.get("num_key_value_heads") or n_head)
    dim = int(config["hidden_size"])
    head_dim = int(config.get("head_dim") or dim // n_head)
    n_layer = int(config["num_hidden_layers"])
    files = _safetensors(folder)
    vocab = _vocab(folder, config)
    out_type, file_type = OUTTYPES[outtype]

    # names, shapes and types first (the header precedes the data); values are read twice
    plan: dict[str, tuple[tuple[int, ...], str]] = {}
    sources: dict[str, tuple[Path, str]] = {}
    for key, path, shape in _shapes(files):
        name = gguf_name(key)
        if name is None:
            if key.endswith("rotary_emb.inv_freq"):
                continue
            raise LocalLLMError(f"the checkpoint's tensor {key} has no place in a {arch} GGUF")
        ne = tuple(reversed(shape))
        kind = out_type if len(shape) == 2 else "F32"
        if kind == "Q8_0" and ne[0] % 32:
            kind = "F16"
        plan[name], sources[name] = (ne, kind), (path, key)
    if "token_embd.weight" not in plan:
        raise LocalLLMError("the checkpoint has no model.embed_tokens.weight")
    if config.get("tie_word_embeddings") is False and "output.weight" not in plan:
        raise LocalLLMError("the checkpoint unties its embeddings but has no lm_head.weight")

    output.parent.mkdir(parents=True, exist_ok=True)
    tmp = temp_beside(output)
    try:
        w = gguf.GGUFWriter(tmp, arch)
        w.add_name(config.get("_name_or_path") or folder.name)
        w.add_context_length(int(config.get("max_position_embeddings", 4096)))
        w.add_embedding_length(dim)
        w.add_block_count(n_layer)
        w.add_feed_forward_length(int(config["intermediate_size"]))
        w.add_head_count(n_head)
        w.add_head_count_kv(n_kv)
        w.add_rope_dimension_count(head_dim)
        w.add_rope_freq_base(rope_theta)
        w.add_layer_norm_rms_eps(float(config.get("rms_norm_eps", 1e-5)))
        w.add_vocab_size(len(vocab["tokenizer.ggml.tokens"]))
        if head_dim != dim // n_head:
            w.add_key_length(head_dim)
            w.add_value_length(head_dim)
        w.add_file_type(file_type)
        w.add_quantization_version(2)
        for key, value in vocab.items():
            if isinstance(value, list):
                w.add_array(key, value)
            elif isinstance(value, bool):
                w.add_bool(key, value)
            elif isinstance(value, int):
                w.add_uint32(key, value)
            else:
                w.add_string(key, value)
        for name, (ne, kind) in plan.items():
            rows = int(np.prod(ne[1:], dtype=np.int64)) if len(ne) > 1 else 1
            w.add_tensor_info(name, tuple(reversed(ne)), np.dtype(np.float32), rows * row_bytes(kind, ne[0]),
                              raw_dtype=gguf.GGMLQuantizationType[kind])  # fmt: skip
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_ti_data_to_file()
        for i, (name, (_, kind)) in enumerate(plan.items(), 1):
            x = _values(*sources[name])
            if arch == "llama" and name.endswith(("attn_q.weight", "attn_k.weight")):
                x = permute_qk(x, n_head if "attn_q" in name else n_kv)
            w.write_tensor_data(quantize(x.reshape(-1, x.shape[-1]), kind).reshape(-1))
            if on_tensor is not None:
                on_tensor(i, len(plan), name)
        w.close()
        verify(tmp, plan)
        os.replace(tmp, output)
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise
    return output
