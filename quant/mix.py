"""Per-tensor type choice of llama.cpp's quantizer (`llama_model_quantize`) for a file type.

A port of `src/llama-quant.cpp` (llama.cpp as vendored by llama-cpp-python 0.3.36) for the file
types in `FILE_TYPES`, with default parameters — not `pure`, the output tensor quantized, no tensor
type overrides, no `only_copy` — with or without an importance matrix. The parts, and the C they port:

- `FILE_TYPES`, `default_type`: `enum llama_ftype` (llama.h), `llama_ftype_get_default_type`.
- `_allows_quantization`: `tensor_allows_quantization` — only tensors of 2 or more dimensions
  (`ggml_n_dims`) whose name ends in "weight", never norms (`*_norm.weight`), MoE routers and a few
  small special tensors; every other tensor keeps its source type.
- `_category`: `tensor_get_category` (substring matches, in its order).
- `_type_impl`: `llama_tensor_get_type_impl` — output.weight (and token_embd.weight when there is no
  output.weight: tied embeddings) → Q6_K, or Q8_0 when its rows do not fit the default type's
  block; attn_v and ffn_down → more bits in the layers `use_more_bits` picks (Q4_K_M, Q5_K_M) or in
  the first layers (Q4_K_S); Q2_K's and Q3_K_*'s attn_v (by GQA), ffn_down and attn_output bumps;
  IQ4_NL's and IQ4_XS's (attn_v by GQA, the first eighth of ffn_down without an importance
  matrix); the i-quant file types' (IQ2_XXS/XS/S/M: output Q5_K, token_embd Q2_K or IQ3_S, attn_v
  Q2_K / IQ3_S / Q4_K by GQA and experts, the first eighth of ffn_down; IQ3_XXS: attn_q/k IQ2_S,
  attn_v and attn_output IQ3_S, ffn_down Q3_K/Q4_K without an importance matrix; IQ3_XS: attn_q/k
  and the middle layers' ffn_gate/ffn_up IQ3_XXS, counted per category; IQ3_S / IQ3_M; Q2_K_S;
  IQ1_S / IQ1_M: as IQ2_XXS, attn_output IQ2_XXS); the 8-expert and 70B-model bumps. Branches only
  for other file types (MXFP4, TQ*, Q2_0) and for Falcon / GLM5-next / BailingMoE3 are left out.
- `needs_imatrix`: `tensor_requires_imatrix` — IQ1_S/M, IQ2_XXS/XS/S and IQ3_XXS tensors, and Q2_K
  ones in a Q2_K_S file, but token_embd and output.
- `_fallback`: `tensor_type_fallback` — a row length ne[0] that is not a multiple of the block size:
  Q2_K, Q3_K → Q4_0, Q4_K → Q5_0, Q5_K → Q5_1, Q6_K → Q8_0, IQ4_XS → IQ4_NL; a 32-block type
  stays; then F16 if
  even that does not fit.
- `_get_type`: `llama_tensor_get_type` — the rules and the fallback apply only when the file type's
  default type is quantized; F16 / F32 files take the default type for every quantizable tensor.
- `choose_types`: `llama_model_quantize_impl` with `init_quantize_state_counters` — tensors are
  visited in the loader's `weights_map` order (`weight_name_comparer`: by the N of "blk.N.", tensors
  outside blocks (-1) first, then by name), not file order; that order drives the running counters
  `i_attention_wv` and `i_ffn_down`. `n_attention_wv` counts the attn_v-like tensors,
  `n_ffn_down` is the block count. The written file's `general.file_type` is the ftype number
  (`FILE_TYPES[file_type]`) and `general.quantization_version` 2.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

from localllm.quant import BLOCK

__all__ = ["FILE_TYPES", "IMATRIX_FILE_TYPES", "NEEDS_IMATRIX", "choose_types", "default_type", "needs_imatrix"]

# enum llama_ftype (llama.h)
FILE_TYPES: dict[str, int] = {
    "F32": 0, "F16": 1, "Q4_0": 2, "Q4_1": 3, "Q8_0": 7, "Q5_0": 8, "Q5_1": 9,
    "Q2_K": 10, "Q3_K_S": 11, "Q3_K_M": 12, "Q3_K_L": 13,
    "Q4_K_S": 14, "Q4_K_M": 15, "Q5_K_S": 16, "Q5_K_M": 17, "Q6_K": 18, "IQ2_XXS": 19, "IQ2_XS": 20,
    "Q2_K_S": 21, "IQ3_XS": 22, "IQ3_XXS": 23, "IQ1_S": 24, "IQ4_NL": 25, "IQ3_S": 26, "IQ3_M": 27, "IQ2_S": 28,
    "IQ2_M": 29, "IQ4_XS": 30, "IQ1_M": 31, "BF16": 32,
}  # fmt: skip

# llama_ftype_get_default_type
_DEFAULT_TYPE = {
    "F32": "F32", "F16": "F16", "BF16": "BF16", "Q4_0": "Q4_0", "Q4_1": "Q4_1", "Q5_0": "Q5_0",
    "Q5_1": "Q5_1", "Q8_0": "Q8_0", "Q2_K": "Q2_K", "Q3_K_S": "Q3_K", "Q3_K_M": "Q3_K", "Q3_K_L": "Q3_K",
    "Q4_K_S": "Q4_K", "Q4_K_M": "Q4_K", "Q5_K_S": "Q5_K", "Q5_K_M": "Q5_K", "Q6_K": "Q6_K",
    "IQ4_NL": "IQ4_NL", "IQ4_XS": "IQ4_XS", "IQ2_XXS": "IQ2_XXS", "IQ2_XS": "IQ2_XS", "Q2_K_S": "Q2_K",
    "IQ3_XS": "IQ3_S", "IQ3_XXS": "IQ3_XXS", "IQ3_S": "IQ3_S", "IQ3_M": "IQ3_S", "IQ2_S": "IQ2_XS",
    "IQ2_M": "IQ2_S", "IQ1_S": "IQ1_S", "IQ1_M": "IQ1_M",
}  # fmt: skip

# ggml_blck_size of the types these file types can produce
_BLOCK = {t: per for t, (per, _) in BLOCK.items()}
_NOT_QUANTIZED = ("F32", "F16", "BF16")

# tensor_type_fallback's table for the 256-block types reachable here
_FALLBACK = {"Q2_K": "Q4_0", "Q3_K": "Q4_0", "Q4_K": "Q5_0", "Q5_K": "Q5_1", "Q6_K": "Q8_0",
             "IQ4_XS": "IQ4_NL", "IQ2_XXS": "IQ4_NL", "IQ2_XS": "IQ4_NL", "IQ2_S": "IQ4_NL",
             "IQ3_XXS": "IQ4_NL", "IQ3_S": "IQ4_NL", "IQ1_S": "IQ4_NL",
             "IQ1_M": "IQ4_NL"}  # fmt: skip

# the file types of llama.cpp's 1- and 2-bit i-quant branch
_IQ2 = ("IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ2_M", "IQ1_S", "IQ1_M")
# the file types whose output (and tied token_embd) is Q5_K rather than Q6_K
_LOW_OUTPUT = ("IQ2_XXS", "IQ2_XS", "IQ3_XXS", "IQ2_S", "IQ2_M", "IQ1_S", "IQ1_M")

# tensor_requires_imatrix: ggml refuses to quantize these types without an importance matrix (and
# Q2_K in a Q2_K_S file)
NEEDS_IMATRIX = ("IQ3_XXS", "IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ1_S", "IQ1_M")
# the file types that put one of those in a model's layers: quantized only with an importance matrix
IMATRIX_FILE_TYPES = ("IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ2_M", "IQ3_XXS", "IQ3_XS", "Q2_K_S", "IQ1_S", "IQ1_M")

# archs whose rules (not ported) differ from the generic ones for these file types
_UNPORTED_ARCHS = ("falcon", "glm5-next", "bailingmoe3")

# tensor_allows_quantization: substrings that keep a tensor as it is (whatever the arch)
_KEEP_SUBSTRINGS = (
    "_norm.weight", "ffn_gate_inp.weight", "ffn_gate_tid2eid.weight", "altup", "laurel",
    "per_layer_model_proj", "ssm_conv1d", "shortconv.conv.weight", "indexer.k_proj.weight",
    "indexer.q_proj.weight", "time_mix_first.weight", "time_mix_w0.weight", "time_mix_w1.weight",
    "time_mix_w2.weight", "time_mix_v0.weight", "time_mix_v1.weight", "time_mix_v2.weight",
    "time_mix_a0.weight", "time_mix_a1.weight", "time_mix_a2.weight", "time_mix_g1.weight",
    "time_mix_g2.weight", "time_mix_decay_w1.weight", "time_mix_decay_w2.weight",
    "time_mix_lerp_fused.weight", "attn_rel_b.weight", ".position_embd", "sam.pos_embd",
    "sam.neck.", "sam.net_", ".rel_pos", ".patch_embd", ".patch_merger", "a.rvq.codebook",
    "mm.a.code_embd",
)  # fmt: skip
# LLM_TN(arch)(LLM_TENSOR_POS_EMBD / LLM_TENSOR_TOKEN_TYPES, "weight")
_KEEP_NAMES = ("position_embd.weight", "token_types.weight")

_BLK = re.compile(r"blk\.\s*([+-]?\d+)")


def _ftype(file_type: str) -> str:
    if file_type not in FILE_TYPES:
        raise ValueError(f"unknown file type {file_type!r} (known: {', '.join(FILE_TYPES)})")
    return file_type


def needs_imatrix(types: dict[str, str], file_type: str = "") -> list[str]:
    """`tensor_requires_imatrix`: the tensors (name → chosen type) that llama.cpp quantizes only with
    an importance matrix — every one of the very-low-bit types, and Q2_K in a Q2_K_S file, but
    token_embd / output."""
    wanted = NEEDS_IMATRIX + (("Q2_K",) if file_type.upper() == "Q2_K_S" else ())
    return [name for name, t in types.items() if t in wanted
            and name not in ("token_embd.weight", "per_layer_token_embd.weight", "output.weight")]  # fmt: skip


def default_type(file_type: str) -> str:
    """The ggml type most tensors of `file_type` get (`llama_ftype_get_default_type`)."""
    return _DEFAULT_TYPE[_ftype(file_type)]


def _n_dims(shape: Sequence[int]) -> int:
    """`ggml_n_dims`: 1 + the index of the last dimension above 1 (at least 1)."""
    for i in range(len(shape) - 1, 0, -1):
        if shape[i] > 1:
            return i + 1
    return 1


def _layer(name: str) -> int | None:
    """What `sscanf(name, "blk.%d.", &i)` reads, or None."""
    m = _BLK.match(name)
    return int(m.group(1)) if m else None


def _allows_quantization(name: str, shape: Sequence[int]) -> bool:
    """`tensor_allows_quantization` (quantize_output_tensor true, only_copy false)."""
    if _n_dims(shape) < 2:
        return False
    if not name.endswith("weight"):
        return False
    if name in _KEEP_NAMES:
        return False
    return not any(s in name for s in _KEEP_SUBSTRINGS)


def _category(name: str) -> str:
    """`tensor_get_category`."""
    if name == "output.weight":
        return "OUTPUT"
    if name in ("token_embd.weight", "per_layer_token_embd.weight"):
        return "TOKEN_EMBD"
    for sub, cat in (
        ("attn_qkv.weight", "ATTENTION_QKV"), ("attn_kv_b.weight", "ATTENTION_KV_B"),
        ("attn_v.weight", "ATTENTION_V"), ("attn_k.weight", "ATTENTION_K"),
        ("attn_q.weight", "ATTENTION_Q"), ("attn_output.weight", "ATTENTION_OUTPUT"),
        ("ffn_up", "FFN_UP"), ("ffn_gate", "FFN_GATE"), ("ffn_down", "FFN_DOWN"),
    ):  # fmt: skip
        if sub in name:
            return cat
    return "OTHER"


def _is_attn_v(category: str) -> bool:
    """`category_is_attn_v`."""
    return category in ("ATTENTION_V", "ATTENTION_QKV", "ATTENTION_KV_B")


def _use_more_bits(i_layer: int, n_layers: int) -> bool:
    """The lambda in `llama_tensor_get_type_impl` (C integer division; the third test only runs
    when i_layer >= n_layers/8, so Python's % agrees with C's)."""
    return (
        i_layer < n_layers // 8
        or i_layer >= 7 * n_layers // 8
        or (i_layer - n_layers // 8) % 3 == 2
    )


def _is_70b(arch: str, n_layer: int, n_head: int, n_head_kv: int, n_expert: int) -> bool:
    """`model.type == LLM_TYPE_70B`, from each arch's `load_arch_hparams`."""
    if arch == "llama":
        return n_expert != 8 and n_layer == 80 and n_head != n_head_kv
    if arch in ("qwen2", "deci", "olmo"):
        return n_layer == 80
    if arch == "jais2":
        return n_layer == 68
    return False


class _State:
    """`quantize_state_impl`: the counters and what the rules read from the model."""

    def __init__(self, ftype: str, arch: str, n_layer: int, n_expert: int, is_70b: bool,
                 n_attention_wv: int, tied: bool, has_imatrix: bool = False, n_gqa: int = 1) -> None:  # fmt: skip
        self.ftype = ftype
        self.n_gqa = n_gqa  # hparams.n_gqa(): query heads per KV head
        self.has_imatrix = has_imatrix
        self.arch = arch
        self.n_layer = n_layer
        self.n_expert = n_expert
        self.is_70b = is_70b
        self.n_attention_wv = n_attention_wv
        self.n_ffn_down = n_layer  # hparams.n_layer_all
        self.i_attention_wv = 0
        self.i_ffn_down = 0
        self.i_ffn_gate = 0
        self.i_ffn_up = 0
        self.has_tied_embeddings = tied

    def layer_info(self, i_layer: int, name: str) -> tuple[int, int]:
        """The `layer_info` lambda: with experts, the layer comes from the name."""
        if max(1, self.n_expert) > 1:
            parsed = _layer(name)
            if parsed is None:
                raise ValueError(f"Failed to determine layer for tensor {name}")
            if not 0 <= parsed < self.n_ffn_down:
                raise ValueError(
                    f"Bad layer {parsed} for tensor {name}. Must be in [0, {self.n_ffn_down})"
                )
            i_layer = parsed
        return i_layer, self.n_ffn_down


def _type_impl(qs: _State, new_type: str, name: str, ne0: int, category: str) -> str:
    """`llama_tensor_get_type_impl`, the branches these file types reach."""
    ftype = qs.ftype
    if category == "OUTPUT" or (qs.has_tied_embeddings and category == "TOKEN_EMBD"):
        # tied embeddings: token_embd is also the output, so it gets the output's type
        if ne0 % _BLOCK[new_type] != 0:
            new_type = "Q8_0"
        elif ftype in _LOW_OUTPUT:
            new_type = "Q5_K"
        elif new_type != "Q8_0":
            new_type = "Q6_K"
    elif category == "TOKEN_EMBD":
        if ftype in ("IQ2_XXS", "IQ2_XS", "IQ1_S", "IQ1_M"):
            new_type = "Q2_K"
        elif ftype in ("IQ2_S", "IQ2_M", "IQ3_XXS"):
            new_type = "IQ3_S"
    elif ftype in _IQ2:
        s_types = ftype in ("IQ2_S", "IQ2_M")
        if _is_attn_v(category):
            new_type = "Q4_K" if qs.n_gqa >= 4 or qs.n_expert >= 4 else "IQ3_S" if s_types else "Q2_K"
            qs.i_attention_wv += 1
        elif qs.n_expert == 8 and category == "ATTENTION_K":
            new_type = "Q4_K"
        elif category == "FFN_DOWN":
            if qs.i_ffn_down < qs.n_ffn_down // 8:
                new_type = "IQ3_S" if s_types else "Q2_K"
            qs.i_ffn_down += 1
        elif category == "ATTENTION_OUTPUT":
            if qs.n_expert == 8:
                new_type = "Q5_K"
            elif ftype in ("IQ1_S", "IQ1_M"):
                new_type = "IQ2_XXS"
            elif s_types:
                new_type = "IQ3_S"
    elif _is_attn_v(category):  # attn_qkv and attn_kv_b too: their own branch below is dead
        if ftype == "Q2_K":
            new_type = "Q4_K" if qs.n_gqa >= 4 else "Q3_K"
        elif ftype == "Q2_K_S" and qs.n_gqa >= 4:
            new_type = "Q4_K"
        elif ftype == "IQ3_XXS":
            new_type = "Q4_K" if qs.n_gqa >= 4 else "IQ3_XXS" if qs.has_imatrix else "IQ3_S"
        elif ftype in ("IQ3_XS", "IQ3_S") and qs.n_gqa >= 4 or ftype == "IQ3_M":
            new_type = "Q4_K"
        elif ftype == "Q3_K_M":
            new_type = "Q5_K" if qs.i_attention_wv < 2 else "Q4_K"
        elif ftype == "Q3_K_L" or (ftype in ("IQ4_NL", "IQ4_XS") and qs.n_gqa >= 4):
            new_type = "Q5_K"
        elif ftype in ("Q4_K_M", "Q5_K_M") and _use_more_bits(qs.i_attention_wv, qs.n_attention_wv):
            new_type = "Q6_K"
        elif ftype == "Q4_K_S" and qs.i_attention_wv < 4:
            new_type = "Q5_K"
        if qs.is_70b and new_type in ("Q3_K", "Q4_K"):
            new_type = "Q5_K"
        if qs.n_expert == 8:
            new_type = "Q8_0"
        qs.i_attention_wv += 1
    elif category == "ATTENTION_K":
        if qs.n_expert == 8:
            new_type = "Q8_0"
        elif ftype == "IQ3_XS":
            new_type = "IQ3_XXS"
        elif ftype == "IQ3_XXS":
            new_type = "IQ2_S"
    elif category == "ATTENTION_Q":
        if ftype == "IQ3_XS":
            new_type = "IQ3_XXS"
        elif ftype == "IQ3_XXS":
            new_type = "IQ2_S"
    elif category == "FFN_DOWN":
        i_layer, n_layer = qs.layer_info(qs.i_ffn_down, name)
        if ftype == "Q2_K":
            new_type = "Q3_K"
        elif ftype == "Q2_K_S":
            if i_layer < n_layer // 8:
                new_type = "Q4_K"
        elif ftype == "IQ3_XXS" and not qs.has_imatrix:
            new_type = "Q4_K" if i_layer < n_layer // 8 else "Q3_K"
        elif ftype == "Q3_K_M":  # (falcon's Q3_K branch: falcon is not ported)
            new_type = "Q5_K" if i_layer < n_layer // 16 else "Q4_K"
        elif ftype == "IQ3_M" and (i_layer < n_layer // 8 or (qs.n_expert == 8 and _use_more_bits(i_layer, n_layer))):
            new_type = "Q4_K"
        elif ftype == "Q3_K_L":
            new_type = "Q5_K"
        elif ftype == "Q4_K_M":
            if _use_more_bits(i_layer, n_layer):
                new_type = "Q6_K"
        elif i_layer < n_layer // 8 and ftype in ("IQ4_NL", "IQ4_XS") and not qs.has_imatrix:
            new_type = "Q5_K"
        elif ftype == "Q5_K_M" and _use_more_bits(i_layer, n_layer):
            new_type = "Q6_K"
        elif ftype == "Q4_K_S" and i_layer < n_layer // 8:
            new_type = "Q5_K"
        elif ftype in ("Q4_0", "Q5_0") and qs.has_imatrix and i_layer < n_layer // 8:
            # llama.cpp: "guard against craziness in the first few ffn_down layers", with an
            # importance matrix only (so a plain quantization stays what it always was)
            new_type = "Q4_1" if ftype == "Q4_0" else "Q5_1"
        qs.i_ffn_down += 1
    elif category == "ATTENTION_OUTPUT":
        if qs.n_expert == 8:
            if ftype in ("Q2_K", "IQ3_XS", "IQ3_XXS", "Q3_K_S", "Q3_K_M", "IQ4_NL", "Q4_K_S", "Q4_K_M", "IQ3_S",
                         "IQ3_M", "IQ4_XS"):  # fmt: skip
                new_type = "Q5_K"
        elif ftype in ("Q2_K", "IQ3_XXS", "Q3_K_M", "Q3_K_L", "IQ3_M"):
            new_type = {"Q2_K": "Q3_K", "IQ3_XXS": "IQ3_S", "Q3_K_M": "Q4_K", "Q3_K_L": "Q5_K", "IQ3_M": "Q4_K"}[ftype]
    elif category in ("FFN_GATE", "FFN_UP"):
        # IQ3_XS's middle layers go to IQ3_XXS (counted per category, like ffn_down)
        counter = "i_ffn_gate" if category == "FFN_GATE" else "i_ffn_up"
        i_layer, n_layer = qs.layer_info(getattr(qs, counter), name)
        if ftype == "IQ3_XS" and n_layer // 8 <= i_layer < 7 * n_layer // 8:
            new_type = "IQ3_XXS"
        setattr(qs, counter, getattr(qs, counter) + 1)
    return new_type


def _fallback(new_type: str, ne0: int) -> str:
    """`tensor_type_fallback`."""
    block = _BLOCK[new_type]
    if ne0 % block == 0:
        return new_type
    ret = _FALLBACK.get(new_type, new_type)  # a 32-block type has nothing smaller to go to
    if ne0 % _BLOCK[ret] != 0:
        ret = "F16"
    return ret


def _get_type(qs: _State, name: str, shape: Sequence[int], src_type: str, default: str) -> str:
    """`llama_tensor_get_type` (no token_embedding_type / output_tensor_type / overrides)."""
    if not _allows_quantization(name, shape):
        return src_type
    new_type = default
    if new_type not in _NOT_QUANTIZED:  # ggml_is_quantized(default_type)
        new_type = _type_impl(qs, new_type, name, shape[0], _category(name))
        new_type = _fallback(new_type, shape[0])
    return new_type


def choose_types(
    file_type: str,
    tensors: list[tuple[str, tuple[int, ...], str]],
    *,
    arch: str,
    n_layer: int,
    n_head: int,
    n_head_kv: int,
    n_expert: int = 0,
    has_imatrix: bool = False,
) -> dict[str, str]:
    """name → the ggml type `llama_model_quantize` gives each tensor for `file_type`.

    `tensors`: (name, shape as GGUF ne — ne[0] the row length — , source type name) in file order;
    `n_layer` is the block count, `n_expert` the expert count (0 without experts); `has_imatrix`:
    quantized with an importance matrix (its rules differ for Q4_0 and Q5_0).
    """
    ftype = _ftype(file_type)
    if arch in _UNPORTED_ARCHS:
        raise ValueError(f"llama.cpp's quantization rules for arch {arch!r} are not ported")
    names = [name for name, _, _ in tensors]
    if len(set(names)) != len(names):
        raise ValueError("duplicate tensor names")

    # init_quantize_state_counters
    categories = [_category(name) for name in names]
    qs = _State(
        ftype, arch, n_layer, n_expert, _is_70b(arch, n_layer, n_head, n_head_kv, n_expert),
        n_attention_wv=sum(_is_attn_v(c) for c in categories),
        tied="OUTPUT" not in categories, has_imatrix=has_imatrix,
        n_gqa=n_head // n_head_kv if n_head_kv else 0,
    )  # fmt: skip

    # the loader's weights_map order (weight_name_comparer)
    def visit_key(entry: tuple[str, tuple[int, ...], str]) -> tuple[int, bytes]:
        layer = _layer(entry[0])
        return (-1 if layer is None else layer, entry[0].encode())

    default = _DEFAULT_TYPE[ftype]
    chosen = {name: _get_type(qs, name, shape, src, default)
              for name, shape, src in sorted(tensors, key=visit_key)}  # fmt: skip
    return {name: chosen[name] for name in names}
