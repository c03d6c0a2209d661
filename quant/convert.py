"""Hugging Face checkpoints (safetensors) to GGUF: `localllm convert HF_DIR --output OUT.gguf`.

Llama, Mistral (and Mixtral's experts), Qwen2, Qwen3, Phi-3 and Gemma 3 (text) causal LMs with a
byte-level BPE tokenizer (`tokenizer.json`: Llama 3,
Qwen2, SmolLM, Mistral Nemo's tekken) or a SentencePiece one (`tokenizer.model`, or its
byte-fallback BPE in `tokenizer.json`: Llama 1/2, Mistral 7B v0.1-v0.3). What llama.cpp's
converter writes for them, done here:

- hyperparameters from `config.json` into the architecture's keys;
- tensors renamed to GGUF's names; for `llama` the q and k rows permuted for llama.cpp's
  adjacent-pair RoPE (what the torch engine undoes as it loads); Qwen2's q/k/v biases kept;
  Qwen3's per-head q/k norms and its own head_dim (key/value_length); Phi-3's fused q|k|v and
  gate|up kept fused, as llama.cpp's phi3 reads them; Gemma 3's norms stored as 1 + w (llama.cpp
  multiplies by the weight), its sliding window, which layers slide and their RoPE base;
- the vocabulary (tokens by id, added tokens marked control or user-defined; merges and the
  pre-tokenizer named the way llama.cpp names it — by hashing the tokenization of its check text,
  as its converter does — for byte-level BPE; scores and token types for SentencePiece), special
  token ids and the chat template from `tokenizer_config.json`;
- matrices in the output type (f32, f16, bf16 or q8_0 through `localllm.quant`), vectors in f32.

The file is written beside the output and renamed when complete and re-read.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
from collections.abc import Callable, Iterator
from hashlib import sha256
from pathlib import Path
from typing import Any

import numpy as np

from localllm.errors import LocalLLMError

__all__ = ["OUTTYPES", "convert"]

OUTTYPES = {"f32": ("F32", 0), "f16": ("F16", 1), "bf16": ("BF16", 32), "q8_0": ("Q8_0", 7)}
ARCHS = {"LlamaForCausalLM": "llama", "MistralForCausalLM": "llama", "MixtralForCausalLM": "llama",
         "Qwen2ForCausalLM": "qwen2",
         "Qwen3ForCausalLM": "qwen3", "Phi3ForCausalLM": "phi3", "Gemma3ForCausalLM": "gemma3"}  # fmt: skip

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

TOKEN_NORMAL, TOKEN_UNKNOWN, TOKEN_CONTROL, TOKEN_USER_DEFINED, TOKEN_UNUSED, TOKEN_BYTE = 1, 2, 3, 4, 5, 6


def looks_special(text: str) -> bool:
    """An added token llama.cpp's converter makes a control token though it is not marked
    special (its `does_token_look_special`)."""
    return (text in ("<pad>", "<mask>", "<2mass>", "[@BOS@]")
            or (text.startswith("<|") and text.endswith("|>"))
            or (text.startswith("<\uff5c") and text.endswith("\uff5c>"))
            or (text.startswith("<unused") and text.endswith(">")))  # fmt: skip

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
    "layers.{n}.self_attn.q_norm.weight": "blk.{n}.attn_q_norm.weight",  # Qwen3: RMS norm per head
    "layers.{n}.self_attn.k_norm.weight": "blk.{n}.attn_k_norm.weight",
    "layers.{n}.self_attn.qkv_proj.weight": "blk.{n}.attn_qkv.weight",  # Phi-3: q|k|v fused
    "layers.{n}.mlp.gate_up_proj.weight": "blk.{n}.ffn_up.weight",  # Phi-3: gate|up, as llama.cpp
    "layers.{n}.block_sparse_moe.gate.weight": "blk.{n}.ffn_gate_inp.weight",  # Mixtral's router
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


# Mixtral's experts: one tensor per expert and matrix, stacked into llama.cpp's 3-D ones
_EXPERT = re.compile(r"(?:model\.)?layers\.(\d+)\.block_sparse_moe\.experts\.(\d+)\.(w[123])\.weight")
_EXPERT_NAMES = {"w1": "ffn_gate_exps", "w2": "ffn_down_exps", "w3": "ffn_up_exps"}

# Gemma 3 norms around both halves of a block: post_attention_layernorm is the attention's
# post-norm there, not the feed-forward's pre-norm
_ARCH_NAMES = {"gemma3": {
    "layers.{n}.post_attention_layernorm.weight": "blk.{n}.post_attention_norm.weight",
    "layers.{n}.pre_feedforward_layernorm.weight": "blk.{n}.ffn_norm.weight",
    "layers.{n}.post_feedforward_layernorm.weight": "blk.{n}.post_ffw_norm.weight",
}}  # fmt: skip


def gguf_name(hf: str, arch: str = "llama") -> str | None:
    """The GGUF name of a Hugging Face tensor name, or None for one llama.cpp does not keep."""
    if hf == "lm_head.weight":
        return "output.weight"
    names = _NAMES | _ARCH_NAMES.get(arch, {})
    name = hf.removeprefix("model.")
    parts = name.split(".")
    if len(parts) > 2 and parts[0] == "layers" and parts[1].isdigit():
        pattern = ".".join(["layers", "{n}", *parts[2:]])
        target = names.get(pattern)
        return target.format(n=parts[1]) if target else None
    return names.get(name)


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


def _varint(buf: bytes, at: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        if at >= len(buf) or shift > 63:
            raise ValueError("a varint runs past the end")
        b = buf[at]
        value |= (b & 0x7F) << shift
        at, shift = at + 1, shift + 7
        if b < 0x80:
            return value, at


def _fields(buf: bytes) -> Iterator[tuple[int, int, Any]]:
    """(field number, wire type, value) of one protobuf message: ints for varints, bytes for
    length-delimited fields and for 32/64-bit ones; groups are not part of a SentencePiece model."""
    at = 0
    while at < len(buf):
        key, at = _varint(buf, at)
        field, wire = key >> 3, key & 7
        if wire == 0:
            value, at = _varint(buf, at)
        elif wire in (1, 5):
            size = 8 if wire == 1 else 4
            value, at = buf[at:at + size], at + size
        elif wire == 2:
            size, at = _varint(buf, at)
            value, at = buf[at:at + size], at + size
        else:
            raise ValueError(f"wire type {wire}")
        if at > len(buf):
            raise ValueError("a field runs past the end")
        yield field, wire, value


def read_sentencepiece(path: Path) -> list[tuple[str, float, int]]:
    """The pieces of a SentencePiece `tokenizer.model` as (text, score, type), read from its
    protobuf directly (ModelProto field 1; each piece: 1 text, 2 score, 3 type, NORMAL when
    absent) — the sentencepiece package is not needed. Types are SentencePiece's, which GGUF's
    token types copy: 1 normal, 2 unknown, 3 control, 4 user-defined, 5 unused, 6 byte."""
    try:
        buf = path.read_bytes()
        pieces = []
        for field, wire, value in _fields(buf):
            if field != 1 or wire != 2:
                continue
            text, score, kind = None, 0.0, 1
            for f, w, v in _fields(value):
                if f == 1 and w == 2:
                    text = v.decode("utf-8")
                elif f == 2 and w == 5:
                    score = float(np.frombuffer(v, "<f4")[0])
                elif f == 3 and w == 0:
                    kind = int(v)
            if text is None or not 1 <= kind <= 6:
                raise ValueError("a piece without text or with an unknown type")
            pieces.append((text, score, kind))
    except (OSError, ValueError, UnicodeDecodeError) as e:
        raise LocalLLMError(f"{path} is not a SentencePiece model ({e})") from None
    if not pieces:
        raise LocalLLMError(f"{path} is not a SentencePiece model (it holds no pieces)")
    return pieces


def _spm_vocab(folder: Path, config: dict[str, Any], cfg: dict[str, Any]) -> dict[str, Any]:
    """A SentencePiece vocabulary (Llama 1/2, Mistral 7B v0.1-v0.3): llama.cpp's `llama`
    tokenizer model, whose tokenizer merges the adjacent pair whose joined text has the highest
    score. From `tokenizer.model` as llama.cpp's converter reads it (its scores; user-defined
    pieces kept normal, as it keeps them), else from `tokenizer.json`'s byte-fallback BPE."""
    if (folder / "tokenizer.model").is_file():
        pieces = read_sentencepiece(folder / "tokenizer.model")
        pieces = [(t, s, TOKEN_NORMAL if k == TOKEN_USER_DEFINED else k) for t, s, k in pieces]
    else:
        tok = _read_json(folder / "tokenizer.json", "the tokenizer")
        model = tok["model"]
        vocab: dict[str, int] = model["vocab"]
        # llama.cpp's converter writes -1000 for every score here, which leaves its tokenizer
        # merging leftmost-first; a merge's rank gives each piece the order the tokenizer ranks it in
        rank: dict[str, int] = {}
        for i, m in enumerate(model.get("merges", [])):
            a, b = m.split(" ", 1) if isinstance(m, str) else m
            rank.setdefault(a + b, i)
        pieces = [("", -1000.0, TOKEN_UNUSED)] * (max(vocab.values()) + 1)
        for text, i in vocab.items():
            byte = len(text) == 6 and text.startswith("<0x") and text.endswith(">")
            pieces[i] = (text, -float(rank[text]) if text in rank else -1000.0,
                         TOKEN_BYTE if byte else TOKEN_NORMAL)  # fmt: skip
        if isinstance(model.get("unk_token"), str) and model["unk_token"] in vocab:
            i = vocab[model["unk_token"]]
            pieces[i] = (pieces[i][0], pieces[i][1], TOKEN_UNKNOWN)
    tok_json = folder / "tokenizer.json"
    added = _read_json(tok_json, "the tokenizer").get("added_tokens", []) if tok_json.is_file() else []
    decoder = {int(k): v for k, v in (cfg.get("added_tokens_decoder") or {}).items()}
    for a in added:
        decoder.setdefault(int(a["id"]), a)
    size = max(len(pieces), int(config.get("vocab_size", 0)), *(i + 1 for i in decoder))
    tokens = [f"[PAD{i}]" for i in range(size)]
    scores, types = [-10000.0] * size, [TOKEN_UNUSED] * size
    for i, (text, score, kind) in enumerate(pieces):
        if text:
            tokens[i], scores[i], types[i] = text, score, kind
    for i, a in sorted(decoder.items()):
        text = a["content"]
        if a.get("special") or looks_special(text):
            types[i] = TOKEN_CONTROL
        else:
            text, types[i] = text.replace("\u2581", " "), TOKEN_USER_DEFINED
        tokens[i], scores[i] = text, -1000.0
    out: dict[str, Any] = {"tokenizer.ggml.model": "llama", "tokenizer.ggml.pre": "default",
                           "tokenizer.ggml.tokens": tokens, "tokenizer.ggml.scores": scores,
                           "tokenizer.ggml.token_type": types}  # fmt: skip
    if isinstance(cfg.get("add_prefix_space"), bool):
        out["tokenizer.ggml.add_space_prefix"] = cfg["add_prefix_space"]
    return out


def _bpe_vocab(folder: Path, config: dict[str, Any], tok: dict[str, Any]) -> dict[str, Any]:
    """A byte-level BPE vocabulary (Llama 3, Qwen2, SmolLM, Mistral Nemo): llama.cpp's `gpt2`
    tokenizer model with its merges and the pre-tokenizer named by its check hash."""
    model = tok["model"]
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
    return {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": pre, "tokenizer.ggml.tokens": tokens,
            "tokenizer.ggml.token_type": types, "tokenizer.ggml.merges": merges}  # fmt: skip


def _vocab(folder: Path, config: dict[str, Any]) -> dict[str, Any]:
    """The tokenizer's files → GGUF tokenizer keys, in the order llama.cpp's converter tries
    them: a SentencePiece `tokenizer.model`, else `tokenizer.json` (byte-fallback BPE is
    SentencePiece's; byte-level BPE is GPT-2's), then the special tokens and chat template."""
    cfg = _read_json(folder / "tokenizer_config.json", "the tokenizer's settings", required=False)
    if (folder / "tokenizer.model").is_file():
        out = _spm_vocab(folder, config, cfg)
    else:
        tok = _read_json(folder / "tokenizer.json", "the tokenizer")
        model = tok.get("model") or {}
        if model.get("type") != "BPE" or not isinstance(model.get("vocab"), dict):
            raise LocalLLMError(f"only BPE tokenizers are converted; this one is {model.get('type')}")
        out = _spm_vocab(folder, config, cfg) if model.get("byte_fallback") else _bpe_vocab(folder, config, tok)
    tokens = out["tokenizer.ggml.tokens"]
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
    # Gemma 3 (transformers 5): one set per layer type; global layers' theta, local layers' apart
    local = rope.get("sliding_attention") if isinstance(rope.get("sliding_attention"), dict) else None
    rope = rope.get("full_attention", rope) if isinstance(rope.get("full_attention"), dict) else rope
    for r in (rope, local or {}):
        kind = r.get("rope_type", r.get("type"))
        if kind not in (None, "default"):
            raise LocalLLMError(f"RoPE scaling {kind} is not converted")
    rope_theta = float(config.get("rope_theta") or rope.get("rope_theta") or 10000.0)
    theta_swa = (local or {}).get("rope_theta") or config.get("rope_local_base_freq")
    n_head = int(config["num_attention_heads"])
    n_kv = int(config.get("num_key_value_heads") or n_head)
    dim = int(config["hidden_size"])
    head_dim = int(config.get("head_dim") or dim // n_head)
    # rotated dimensions per head: Phi-3 names a share of them (llama.cpp: int(share · dim) // heads)
    share = float(rope.get("partial_rotary_factor") or config.get("partial_rotary_factor") or 1.0)
    rope_dims = int(share * dim) // n_head if share != 1.0 else head_dim
    n_layer = int(config["num_hidden_layers"])
    if arch == "gemma3":
        # llama.cpp scales Gemma 3's attention by 1/sqrt(head_dim) (by hidden/heads at 62 layers)
        scalar = config.get("query_pre_attn_scalar")
        expected = dim // n_head if n_layer == 62 else head_dim
        if scalar is not None and int(scalar) != expected:
            raise LocalLLMError(f"query_pre_attn_scalar {scalar} is not the {expected} llama.cpp "
                                "scales this Gemma 3's attention by")  # fmt: skip
        if config.get("hidden_activation", "gelu_pytorch_tanh") != "gelu_pytorch_tanh":
            raise LocalLLMError(f"Gemma 3 with {config.get('hidden_activation')} is not converted")
    files = _safetensors(folder)
    vocab = _vocab(folder, config)
    out_type, file_type = OUTTYPES[outtype]

    # names, shapes and types first (the header precedes the data); values are read twice
    plan: dict[str, tuple[tuple[int, ...], str]] = {}
    sources: dict[str, list[tuple[Path, str]]] = {}  # one source, or an expert each (stacked)
    experts: dict[str, dict[int, tuple[Path, str, tuple[int, ...]]]] = {}
    for key, path, shape in _shapes(files):
        if m := _EXPERT.fullmatch(key):
            experts.setdefault(f"blk.{m[1]}.{_EXPERT_NAMES[m[3]]}.weight", {})[int(m[2])] = (path, key, shape)
            continue
        name = gguf_name(key, arch)
        if name is None:
            if key.endswith("rotary_emb.inv_freq"):
                continue
            raise LocalLLMError(f"the checkpoint's tensor {key} has no place in a {arch} GGUF")
        ne = tuple(reversed(shape))
        # the MoE router stays F32 (llama.cpp's converter keeps it so)
        kind = out_type if len(shape) == 2 and not name.endswith("ffn_gate_inp.weight") else "F32"
        if kind == "Q8_0" and ne[0] % 32:
            kind = "F16"
        plan[name], sources[name] = (ne, kind), [(path, key)]
    n_expert = int(config.get("num_local_experts") or 0)
    for name, by_index in sorted(experts.items()):
        shapes = {shape for _, _, shape in by_index.values()}
        if sorted(by_index) != list(range(n_expert)) or len(shapes) != 1:
            raise LocalLLMError(f"the checkpoint's experts for {name} are not experts 0..{n_expert - 1} "
                                "of one shape")  # fmt: skip
        (shape,) = shapes
        kind = out_type if not (out_type == "Q8_0" and shape[-1] % 32) else "F16"
        plan[name] = (tuple(reversed((n_expert, *shape))), kind)
        sources[name] = [(p, k) for p, k, _ in (by_index[e] for e in range(n_expert))]
    if "token_embd.weight" not in plan:
        raise LocalLLMError("the checkpoint has no model.embed_tokens.weight")
    n_tokens, rows = len(vocab["tokenizer.ggml.tokens"]), plan["token_embd.weight"][0][1]
    if n_tokens != rows:
        raise LocalLLMError(f"the tokenizer has {n_tokens} tokens but the embedding {rows} rows")
    if config.get("tie_word_embeddings") is False and "output.weight" not in plan:
        raise LocalLLMError("the checkpoint unties its embeddings but has no lm_head.weight")
    if arch == "phi3" and "output.weight" not in plan:  # llama.cpp's phi3 has no tied head
        raise LocalLLMError("a Phi-3 checkpoint needs its own lm_head.weight (llama.cpp's phi3 reads one)")

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
        w.add_rope_dimension_count(rope_dims)
        w.add_rope_freq_base(rope_theta)
        w.add_layer_norm_rms_eps(float(config.get("rms_norm_eps", 1e-5)))
        w.add_vocab_size(len(vocab["tokenizer.ggml.tokens"]))
        if head_dim != dim // n_head:
            w.add_key_length(head_dim)
            w.add_value_length(head_dim)
        if arch == "gemma3" and config.get("sliding_window"):
            w.add_sliding_window(int(config["sliding_window"]))
            types = config.get("layer_types")
            if isinstance(types, list) and len(types) == n_layer:  # which layers slide
                w.add_sliding_window_pattern([t == "sliding_attention" for t in types])
            if theta_swa:
                w.add_float32(f"{arch}.rope.freq_base_swa", float(theta_swa))
        if n_expert:
            w.add_expert_count(n_expert)
            w.add_expert_used_count(int(config.get("num_experts_per_tok") or 2))
        if arch == "gemma3" and config.get("final_logit_softcapping"):
            w.add_final_logit_softcapping(float(config["final_logit_softcapping"]))
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
            parts = [_values(p, k) for p, k in sources[name]]
            x = parts[0] if len(parts) == 1 else np.stack(parts)
            if arch == "llama" and name.endswith(("attn_q.weight", "attn_k.weight")):
                x = permute_qk(x, n_head if "attn_q" in name else n_kv)
            if arch == "gemma3" and name.endswith("norm.weight"):  # Gemma scales by 1 + w
                x = x.astype(np.float32) + np.float32(1)
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
