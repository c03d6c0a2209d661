"""Do a model file's hyperparameters agree with its tensors? Checked before anything registers it.

A GGUF can be perfectly well-formed (`gguf_file.py` accepts it) and still describe a model that
cannot exist: `llama.block_count` 0, more KV heads than heads, a vocabulary shorter than the
embedding table, a special token id past the vocabulary. llama.cpp meets some of these with a
`GGML_ASSERT` that aborts the whole process (block count 0 or over 512, more experts used than
there are, an unknown rope scaling type), others with an unhelpful error deep in loading, and some
(token scores shorter than the vocabulary) with reads past the end of an array. `check_model`
refuses such a file up front with one `InconsistentModel` (a `GGUFFormatError`) naming the file and the reason.

What is checked, for every architecture (llama.cpp reads these keys the same way for all):
- `{arch}.*` keys exist and no key belongs to another architecture llama.cpp knows;
- block count in 1..512 and equal to the `blk.N` layers present (N in 0..count-1);
- context and embedding length > 0; head counts (scalar or per layer) divide, rope dimensions fit
  the head; rope scaling type known; expert counts agree with each other and with `*_exps` tensors;
- the vocabulary: token list length equals `token_embd` rows, token types and scores as long as
  the list, every `tokenizer.ggml.*_token_id` inside it.
For architectures whose tensors have llama.cpp's standard shapes (`_STANDARD`: Llama, Qwen, Gemma,
...), the embedding length, head dimensions and feed-forward lengths are also checked against
`token_embd`, `output`, `attn_q/k/v/output`, `attn_qkv` and `ffn_gate/up/down`. Architectures not
listed there are not refused for lack of knowledge: only the generic checks apply.

GGUF shapes are innermost first: `attn_q.weight` of a Llama is (n_embd, n_head * head_dim).
The check reads only the parsed header: no tensor data, no hashing.
"""

from __future__ import annotations

import re
from array import array
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from localllm.errors import GGUFFormatError, InconsistentModel
from localllm.gguf_file import GGUFFile
from localllm.model_info import ModelInfo, model_info

MAX_LAYERS = 512  # LLAMA_MAX_LAYERS (llama-hparams.h): more aborts llama.cpp
MAX_EXPERTS = 1024  # LLAMA_MAX_EXPERTS in the llama.cpp llama-cpp-python vendors
MAX_HEADS = 1 << 16
ROPE_SCALING_TYPES = ("none", "linear", "yarn", "longrope")  # others abort llama.cpp

# Tensors built with llama.cpp's standard shapes (src/models/<arch>.cpp): token_embd and output
# (n_embd, n_vocab); attn_q (n_embd, head_dim_k * n_head); attn_k/v (n_embd, head_dim * n_head_kv);
# attn_output (head_dim_k * n_head, n_embd); ffn_gate/up (n_embd, n_ff), ffn_down (n_ff, n_embd).
_STANDARD = frozenset({
    "llama", "mistral3", "smollm3", "granite", "exaone", "internlm2", "olmo2", "stablelm",
    "starcoder2", "qwen2", "qwen3", "qwen2moe", "qwen3moe", "gemma", "gemma2", "gemma3",
})  # fmt: skip
# ...of which these build their attention with one head size for K and V (GGML_ASSERT otherwise).
_SAME_KV_HEAD_DIM = _STANDARD - {"gemma", "gemma2", "gemma3"}
# llama.cpp throws "invalid n_rot" unless rope.dimension_count equals the key head size.
_FULL_ROPE = frozenset({"llama", "deci", "falcon", "llama-embed"})
# Layers here may have no tensors at all (Deci's no-op blocks), so gaps in blk.N are allowed.
_SPARSE_LAYERS = frozenset({"deci"})

# Architecture names llama.cpp knows (src/llama-arch.cpp LLM_ARCH_NAMES), to spot keys that belong
# to another model. `clip` is left out: a vision tower's `clip.*` keys may ride along.
_ARCHITECTURE_NAMES = """
    llama llama4 deci falcon grok gpt2 gptj gptneox mpt baichuan starcoder refact bert modern-bert
    nomic-bert nomic-bert-moe neo-bert jina-bert-v2 jina-bert-v3 eurobert bloom stablelm qwen qwen2
    qwen2moe qwen2vl qwen3 qwen3moe qwen3next qwen3vl qwen3vlmoe qwen35 qwen35moe qwen4exp phi2
    phi3 phimoe plamo plamo2 plamo3 codeshell orion internlm2 minicpm minicpm3 gemma gemma2 gemma3
    gemma3n gemma4 gemma4-assistant gemma-embedding starcoder2 mamba mamba2 maple jamba falcon-h1
    xverse command-r cohere2 cohere2moe dbrx olmo olmo2 olmoe muse-glimmer openelm arctic deepseek
    deepseek2 deepseek2-ocr deepseek32 deepseek4 chatglm glm4 glm4moe glm-dsa bitnet t5 t5encoder
    jais jais2 nemotron nemotron_h nemotron_h_moe exaone exaone4 exaone-moe rwkv6 rwkv6qwen2 rwkv7
    arwkv7 granite granitemoe granitehybrid graniteswitch granite_swa chameleon wavtokenizer-dec
    plm bailingmoe bailingmoe2 bailingmoe3 dots1 dots3note arcee afmoe laguna ernie4_5
    ernie4_5-moe hunyuan-moe hunyuan-dense hunyuan_vl hy_v3 hy_v4 smollm3 gpt-oss lfm2 lfm2moe
    dream smallthinker llada llada-moe seed_oss grovemoe apertus minimax-01 hrm_text minimax-m2
    minimax-m3 cogvlm rnd1 pangu-embedded mistral3 eagle3 dflash mistral4 paddleocr mimo2 step35
    spark2_5 llama-embed maincoder kimi-linear kimi-k3 glm5-next talkie mellum nanbeige qwen3tts
    pockettts
"""
_ARCHITECTURES = frozenset(_ARCHITECTURE_NAMES.split())

_BLOCK = re.compile(r"blk\.(\d+)\.(.+)")
_EXPERTS = re.compile(r"ffn_(?:up|gate|down|gate_up)_exps\.weight")
_TOKEN_ID = re.compile(r"tokenizer\.ggml\.\w+_token_id")
_Lists = (Sequence, array)  # metadata arrays: StringArray, array.array
_NULL_TOKEN = (-1, 0xFFFFFFFF)  # LLAMA_TOKEN_NULL, written signed or unsigned: "no such token"


def check_model(gf: GGUFFile) -> None:
    """Refuse a file whose hyperparameters and tensors disagree.

    Args:
        gf: the parsed file (header only is read).

    Raises:
        GGUFFormatError: naming the file and the first inconsistency found.
    """
    _Check(gf).run()


def read_checked_info(path: str) -> ModelInfo:
    """Parse `path`, refuse it unless it is consistent (`check_model`), and describe it."""
    with GGUFFile(path) as gf:
        check_model(gf)
        return model_info(gf)


class _Check:
    def __init__(self, gf: GGUFFile) -> None:
        self.gf = gf
        self.arch = gf.architecture
        self.meta = gf.metadata

    def fail(self, reason: str) -> GGUFFormatError:
        return InconsistentModel(self.gf.path, reason)

    def key(self, suffix: str) -> str:
        return f"{self.arch}.{suffix}"

    # -- reading values --------------------------------------------------------------------------

    def count(self, suffix: str, default: int | None = None, *, cap: int = 1 << 40) -> int:
        """A non-negative integer `{arch}.{suffix}`; `default` when absent (None: required)."""
        key = self.key(suffix)
        v = self.meta.get(key, default)
        if v is None:
            raise self.fail(f"{key} is missing")
        if isinstance(v, bool) or not isinstance(v, int) or not 0 <= v <= cap:
            raise self.fail(f"{key} has an impossible value {_short(v)}")
        return v

    def per_layer(
        self, suffix: str, n_layer: int, default: tuple[int, ...] | None
    ) -> tuple[int, ...] | None:
        """A scalar or one value per layer (llama.cpp `get_key_or_arr`), as one value per layer."""
        key = self.key(suffix)
        v = self.meta.get(key)
        if v is None:
            return default
        if isinstance(v, int) and not isinstance(v, bool):
            values: Sequence[Any] = (v,) * n_layer
        elif isinstance(v, _Lists) and not isinstance(v, str):
            if len(v) != n_layer:
                raise self.fail(f"{key} has {len(v)} values for {n_layer} layers")
            values = v
        else:
            raise self.fail(f"{key} has an impossible value {_short(v)}")
        if not all(isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in values):
            raise self.fail(f"{key} has an impossible value {_short(v)}")
        return tuple(values)

    # -- the checks ------------------------------------------------------------------------------

    def run(self) -> None:
        self.architecture_keys()
        n_layer = self.count("block_count", cap=1 << 32)
        if n_layer == 0:
            raise self.fail(f"{self.key('block_count')} is 0: a model needs at least one layer")
        if n_layer > MAX_LAYERS:
            raise self.fail(
                f"{self.key('block_count')} is {n_layer}, more than llama.cpp's {MAX_LAYERS}"
            )
        blocks = self.blocks(n_layer)
        if self.count("context_length") == 0:
            raise self.fail(f"{self.key('context_length')} is 0")
        n_embd = self.count("embedding_length")
        if n_embd == 0:
            raise self.fail(f"{self.key('embedding_length')} is 0")
        n_vocab = self.vocabulary()
        if self.arch in _STANDARD:
            self.embedding_shapes(n_embd, n_vocab)
        attention = self.attention(n_layer, n_embd)
        self.rope_scaling()
        n_expert = self.experts(n_layer, blocks)
        if self.arch in _STANDARD:
            self.layer_shapes(n_layer, n_embd, n_expert, attention, blocks)

    def architecture_keys(self) -> None:
        own = f"{self.arch}."
        foreign: dict[str, str] = {}
        has_own = False
        for key in self.meta:
            if key.startswith(own):
                has_own = True
                continue
            prefix = key.split(".", 1)[0]
            if prefix != self.arch and prefix in _ARCHITECTURES and "." in key:
                foreign.setdefault(prefix, key)
        if not has_own:
            seen = f" (its hyperparameters are {', '.join(p + '.*' for p in foreign)})"
            raise self.fail(
                f"general.architecture is {self.arch!r} but no {own}* keys are present"
                + (seen if foreign else "")
            )
        if foreign:
            prefix, key = next(iter(foreign.items()))
            raise self.fail(f"key {key} belongs to architecture {prefix!r}, not {self.arch!r}")

    def blocks(self, n_layer: int) -> dict[int, dict[str, tuple[int, ...]]]:
        """Tensors per layer: {N: {"attn_q.weight": shape, ...}} from the `blk.N.` names."""
        blocks: dict[int, dict[str, tuple[int, ...]]] = {}
        for name, t in self.gf.tensors.items():
            m = _BLOCK.fullmatch(name)
            if m is None:
                continue
            i = int(m[1])
            if i >= n_layer:
                raise self.fail(
                    f"tensor {name} is for layer {i}, but {self.key('block_count')} is {n_layer}"
                )
            blocks.setdefault(i, {})[m[2]] = t.shape
        if blocks and self.arch not in _SPARSE_LAYERS and len(blocks) != n_layer:
            missing = min(set(range(n_layer)) - blocks.keys())
            raise self.fail(
                f"{self.key('block_count')} is {n_layer}, but the file has tensors for "
                f"{len(blocks)} layers (none for layer {missing})"
            )
        return blocks

    def attention(self, n_layer: int, n_embd: int) -> _Attention | None:
        heads = self.per_layer("attention.head_count", n_layer, None)
        if heads is None:
            if self.arch in _STANDARD:
                raise self.fail(f"{self.key('attention.head_count')} is missing")
            return None  # recurrent models have no attention
        kv = self.per_layer("attention.head_count_kv", n_layer, heads)
        assert kv is not None
        hk, hkv = self.key("attention.head_count"), self.key("attention.head_count_kv")
        for i, (h, k) in enumerate(zip(heads, kv)):
            where = "" if len(set(heads)) == 1 and len(set(kv)) == 1 else f" in layer {i}"
            if h > MAX_HEADS or k > MAX_HEADS:
                raise self.fail(f"{hk} or {hk}_kv is impossibly large{where}")
            if self.arch in _STANDARD and h == 0:
                raise self.fail(f"{hk} is 0{where}")
            if self.arch in _STANDARD and k == 0:
                raise self.fail(f"{hkv} is 0{where}")
            if h and k and h % k:
                raise self.fail(f"{hk} {h} is not a multiple of {hkv} {k}{where}")
        if heads[0] == 0:  # llama.cpp reads head sizes only when layer 0 has heads
            return None
        # head sizes default to n_embd / n_head of layer 0, as llama.cpp computes them
        hd_k = self.count("attention.key_length", n_embd // heads[0])
        hd_v = self.count("attention.value_length", n_embd // heads[0])
        hd_k_swa = self.count("attention.key_length_swa", hd_k)
        hd_v_swa = self.count("attention.value_length_swa", hd_v)
        if self.arch in _STANDARD and (hd_k == 0 or hd_v == 0):
            raise self.fail(f"the attention head size is 0 ({hk} > {self.key('embedding_length')})")
        n_rot = self.count("rope.dimension_count", hd_k)
        n_rot_swa = self.count("rope.dimension_count_swa", n_rot)
        rope = self.key("rope.dimension_count")
        if n_rot > hd_k:
            raise self.fail(f"{rope} {n_rot} is larger than the attention head size {hd_k}")
        if n_rot_swa > hd_k_swa:
            raise self.fail(f"{rope}_swa {n_rot_swa} is larger than the head size {hd_k_swa}")
        if self.arch in _FULL_ROPE and n_rot != hd_k:
            raise self.fail(f"{rope} {n_rot} differs from the attention head size {hd_k}")
        if self.arch in _SAME_KV_HEAD_DIM and (hd_k != hd_v or hd_k_swa != hd_v_swa):
            raise self.fail(
                f"{self.key('attention.key_length')} {hd_k} and value_length {hd_v} differ"
            )
        return _Attention(heads, kv, frozenset({hd_k, hd_k_swa}), frozenset({hd_v, hd_v_swa}))

    def rope_scaling(self) -> None:
        key = self.key("rope.scaling.type")
        v = self.meta.get(key)
        if v is not None and v not in ROPE_SCALING_TYPES:
            raise self.fail(
                f"{key} is {_short(v)} (llama.cpp knows {', '.join(ROPE_SCALING_TYPES)})"
            )

    def experts(self, n_layer: int, blocks: dict[int, dict[str, tuple[int, ...]]]) -> int:
        """Expert counts agree with each other and with the `*_exps` tensors (llama.cpp asserts)."""
        kc, ku = self.key("expert_count"), self.key("expert_used_count")
        n_expert = self.count("expert_count", 0)
        if n_expert > MAX_EXPERTS:
            raise self.fail(f"{kc} is {n_expert}, more than llama.cpp's {MAX_EXPERTS}")
        used = max(self.per_layer("expert_used_count", n_layer, (0,)) or (0,))
        if used > n_expert:
            raise self.fail(f"{ku} {used} is more than {kc} {n_expert}")
        if n_expert and not used:
            raise self.fail(f"{kc} is {n_expert} but {ku} is 0 or missing")
        groups = self.count("expert_group_count", 0)
        group_used = self.count("expert_group_used_count", 0)
        gk = self.key("expert_group_count")
        if groups and (groups >= n_expert or (groups > 1 and n_expert % groups)):
            raise self.fail(f"{gk} {groups} does not divide {kc} {n_expert} into groups")
        if groups > 1 and not 0 < group_used < groups:
            gu = self.key("expert_group_used_count")
            raise self.fail(f"{gu} {group_used} is not in 1..{groups - 1}")
        for i, tensors in sorted(blocks.items()):
            for suffix, shape in tensors.items():
                if _EXPERTS.fullmatch(suffix) and (len(shape) != 3 or shape[2] != n_expert):
                    raise self.fail(
                        f"tensor blk.{i}.{suffix} holds {shape[-1]} experts, {kc} is {n_expert}"
                    )
        return n_expert

    def vocabulary(self) -> int | None:
        """The token count, checked against token_embd and the tokenizer's other arrays."""
        tokens = self.meta.get("tokenizer.ggml.tokens")
        if tokens is None:
            return None  # no tokenizer in the file: llama.cpp loads it without a vocabulary
        if isinstance(tokens, str) or not isinstance(tokens, Sequence):
            raise self.fail("tokenizer.ggml.tokens is not a list of strings")
        n_vocab = len(tokens)
        if n_vocab == 0:
            raise self.fail("tokenizer.ggml.tokens is empty")
        for key in ("tokenizer.ggml.token_type", "tokenizer.ggml.scores"):
            v = self.meta.get(key)
            if v is None:
                continue
            if isinstance(v, str) or not isinstance(v, _Lists):
                raise self.fail(f"{key} is not a list")
            if len(v) != n_vocab:
                raise self.fail(f"{key} has {len(v)} entries for {n_vocab} tokens")
        embd = self.gf.tensors.get("token_embd.weight")
        if embd is not None and len(embd.shape) == 2 and embd.shape[1] != n_vocab:
            raise self.fail(
                f"tokenizer.ggml.tokens has {n_vocab} tokens but token_embd.weight has "
                f"{embd.shape[1]} rows"
            )
        for key, v in self.meta.items():
            if not _TOKEN_ID.fullmatch(key):
                continue
            if isinstance(v, bool) or not isinstance(v, int):
                raise self.fail(f"{key} is not a token id: {_short(v)}")
            if not 0 <= v < n_vocab and v not in _NULL_TOKEN:
                raise self.fail(f"{key} {v} is outside the vocabulary of {n_vocab} tokens")
        return n_vocab

    def embedding_shapes(self, n_embd: int, n_vocab: int | None) -> None:
        """Standard architectures: token_embd and output are (n_embd, n_vocab)."""
        ke = self.key("embedding_length")
        for name in ("token_embd.weight", "output.weight"):
            t = self.gf.tensors.get(name)
            if t is not None and t.shape[0] != n_embd:
                raise self.fail(f"{ke} is {n_embd} but {name} has rows of {t.shape[0]}")
            if t is not None and n_vocab is not None and t.shape[1:] != (n_vocab,):
                raise self.fail(f"{name} has shape {list(t.shape)} for {n_vocab} tokens")

    def layer_shapes(
        self,
        n_layer: int,
        n_embd: int,
        n_expert: int,
        att: _Attention | None,
        blocks: dict[int, dict[str, tuple[int, ...]]],
    ) -> None:
        """Standard architectures: every layer's weights follow from the hyperparameters."""
        ke = self.key("embedding_length")
        ff = self.per_layer("feed_forward_length", n_layer, None)
        kff = self.key("feed_forward_length")
        for i in range(n_layer):
            tensors = blocks.get(i, {})
            if att is not None:
                self.attention_shapes(i, tensors, n_embd, att)
            n_ff = ff[i] if ff is not None else None
            for suffix, expected in (
                ("ffn_gate.weight", (n_embd, n_ff)),
                ("ffn_up.weight", (n_embd, n_ff)),
                ("ffn_down.weight", (n_ff, n_embd)),
            ):
                shape = tensors.get(suffix)
                if shape is None:
                    continue
                if n_ff is None:
                    raise self.fail(f"{kff} is missing but blk.{i}.{suffix} exists")
                if shape != expected:
                    raise self.fail(
                        f"blk.{i}.{suffix} has shape {list(shape)}, but {ke} {n_embd} and "
                        f"{kff} {n_ff} give {list(expected)}"
                    )
            router = tensors.get("ffn_gate_inp.weight")
            if router is not None and router != (n_embd, n_expert):
                raise self.fail(
                    f"blk.{i}.ffn_gate_inp.weight has shape {list(router)}, "
                    f"expected {[n_embd, n_expert]}"
                )

    def attention_shapes(
        self, i: int, tensors: dict[str, tuple[int, ...]], n_embd: int, att: _Attention
    ) -> None:
        h, k = att.heads[i], att.kv[i]
        ke = self.key("embedding_length")
        what = f"{ke} {n_embd}, head_count {h}, head_count_kv {k}, head size"
        q_out = {d * h for d in att.hd_k}
        checks = (
            ("attn_q.weight", 0, {n_embd}, 1, q_out),
            ("attn_k.weight", 0, {n_embd}, 1, {d * k for d in att.hd_k}),
            ("attn_v.weight", 0, {n_embd}, 1, {d * k for d in att.hd_v}),
            ("attn_output.weight", 1, {n_embd}, 0, q_out),
            (
                "attn_qkv.weight",
                0,
                {n_embd},
                1,
                {dk * h + dk * k + dv * k for dk in att.hd_k for dv in att.hd_v},
            ),
        )
        for suffix, embd_axis, embd_ok, head_axis, head_ok in checks:
            shape = tensors.get(suffix)
            if shape is None:
                continue
            if len(shape) != 2 or shape[embd_axis] not in embd_ok:
                raise self.fail(f"blk.{i}.{suffix} has shape {list(shape)}, but {ke} is {n_embd}")
            if shape[head_axis] not in head_ok:
                sizes = "/".join(str(d) for d in sorted(att.hd_k | att.hd_v))
                raise self.fail(
                    f"blk.{i}.{suffix} has shape {list(shape)}, which does not follow from "
                    f"{what} {sizes}"
                )


@dataclass(frozen=True)
class _Attention:
    """Per-layer head counts and the head sizes a layer may have (full or sliding window)."""

    heads: tuple[int, ...]
    kv: tuple[int, ...]
    hd_k: frozenset[int]
    hd_v: frozenset[int]


def _short(v: Any) -> str:
    """A value for a message: arrays by their length, long text cut."""
    if isinstance(v, _Lists) and not isinstance(v, str):
        return f"<list of {len(v)}>"
    text = repr(v)
    return text if len(text) <= 60 else text[:57] + "..."
