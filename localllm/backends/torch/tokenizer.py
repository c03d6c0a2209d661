"""The GGUF vocabulary as a tokenizer that needs no llama.cpp, on Hugging Face `tokenizers`.

It gives the ids llama.cpp gives, because it follows llama.cpp's own rules (src/llama-vocab.cpp)
rather than the tokenizer the model was trained with where the two differ:

- special tokens written in the text are found first, longest first, each one splitting every
  remaining stretch of text at its occurrences (`tokenizer_st_partition`): control, user-defined
  and unknown tokens, including those llama.cpp promotes to control by their text (`<|im_end|>`...);
- `tokenizer.ggml.model` "gpt2": byte-level BPE over the file's merges, after the pre-tokenizer
  regexes llama.cpp picks for `tokenizer.ggml.pre`, applied one after the other, each to the
  pieces the previous one left (as `unicode_regex_split` does). SmolLM's "smollm" isolates every
  digit first, so two spaces before a number stay one token, which a plain GPT-2 regex splits;
- `tokenizer.ggml.model` "llama" (SentencePiece, e.g. Gemma): spaces become "▁", then adjacent
  symbols merge while their concatenation is a token, highest score first (`llm_tokenizer_spm`),
  with unknown characters as <0xNN> byte tokens. That is BPE with one merge per way of cutting a
  token into two tokens, ranked by the token's score, which is how it is built here.

Nothing is cached on disk; the merges of a 262k SentencePiece vocabulary take a couple of seconds.
"""

from __future__ import annotations

import codecs
import os
import re
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from tokenizers import Regex, Tokenizer, models, pre_tokenizers

from localllm.errors import LocalLLMError
from localllm.gguf_file import GGUFFile


class TokenizerError(LocalLLMError):
    """A vocabulary this tokenizer cannot handle: one line naming the file and the reason."""


# -- llama.cpp's tables ----------------------------------------------------------------------

# llama_token_attr bits (llama.h) and what `tokenizer.ggml.token_type` (llama_token_type) maps to
UNKNOWN, UNUSED, NORMAL, CONTROL, USER_DEFINED, BYTE = 1, 2, 4, 8, 16, 32
LSTRIP, RSTRIP = 128, 256
_TYPE_ATTR = {1: NORMAL, 2: UNKNOWN, 3: CONTROL, 4: USER_DEFINED, 5: UNUSED, 6: BYTE}
_PARTITIONED = CONTROL | USER_DEFINED | UNKNOWN  # found in the text before the model runs
_SILENT = CONTROL | UNKNOWN  # pieces that print as nothing unless asked for special text

# The pre-tokenizer regexes of `llm_tokenizer_bpe`, by llama.cpp's pre-tokenizer type, as llama.cpp
# writes them (its (?:'[sS]|...) spelling of (?i:'s|...) included). Where llama.cpp runs a
# hand-written splitter instead (gpt2, llama3, qwen2, qwen35), that splitter implements the regex.
_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
_CONTRACTIONS = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])"
_LLAMA3 = (
    _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
    r"|\s+(?!\S)|\s+"
)
_QWEN2 = (
    _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
    r"|\s+(?!\S)|\s+"
)
_CJK = "[\u4e00-\u9fa5\u0800-\u4e00\uac00-\ud7ff]+"  # CJK ideographs, Hangul
_DEEPSEEK3 = (
    "[!\"#$%&'()*+,\\-./:;<=>?@\\[\\\\\\]^_`{|}~][A-Za-z]+|[^\r\n\\p{L}\\p{P}\\p{S}]?"
    "[\\p{L}\\p{M}]+| ?[\\p{P}\\p{S}]+[\r\n]*|\\s*[\r\n]+|\\s+(?!\\S)|\\s+"
)
_UPPER_LOWER = r"((?=[\p{L}])([^a-z]))*((?=[\p{L}])([^A-Z]))+"  # llama.cpp's form of [Lu..]*[Ll..]+
_LOWER_UPPER = r"((?=[\p{L}])([^a-z]))+((?=[\p{L}])([^A-Z]))*"
_PORO = " ?[^(\\s|.,!?\u2026\u3002\uff0c\u3001\u0964\u06d4\u060c)]+"
PRE_TOKENIZERS: dict[str, tuple[str, ...]] = {
    "default": (r"[\p{P}\$\+<=>\^~\|]+", _GPT2, r"\p{N}+", "[0-9][0-9][0-9]"),
    "gpt2": (_GPT2,),
    "smollm": (r"\p{N}", _GPT2),
    "llama3": (_LLAMA3,),
    "jais2": (
        _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
        r"|\s*[\r\n]+|\s{512}(?!\S)|\s{256}(?!\S)|\s{128}(?!\S)|\s{64}(?!\S)|\s{32}(?!\S)"
        r"|\s{16}(?!\S)|\s{8}(?!\S)|\s{4}(?!\S)|\s{1,2}(?!\S)|\s{1}",
    ),
    "qwen2": (_QWEN2,),
    "qwen35": (
        _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*"
        r"|\s*[\r\n]+|\s+(?!\S)|\s+",
    ),
    "deepseek-llm": (
        "[\r\n]",
        "\\s?[A-Za-z\u00b5\u00c0-\u00d6\u00d8-\u00f6\u00f8-\u01ba\u01bc-\u01bf\u01c4-\u0293"
        "\u0295-\u02af\u0370-\u0373\u0376\u0377\u037b-\u037d\u037f\u0386\u0388-\u038a"
        "\u038c\u038e-\u03a1\u03a3-\u03f5\u03f7-\u0481\u048a-\u052f\u0531-\u0556"
        "\u10a0-\u10c5\u13a0-\u13f5\u13f8-\u13fd\u1c90-\u1cba\u1cbd-\u1cbf\u1d00-\u1d2b"
        "\u1d6b-\u1d77\u1d79-\u1d9a\u1e00-\u1f15\u1f18-\u1f1d\u1f20-\u1f45\u1f48-\u1f4d"
        "\u1f50-\u1f57\u1f59\u1f5b\u1f5d\u1f5f-\u1f7d\u1f80-\u1fb4\u1fb6-\u1fbc\u1fbe"
        "\u1fc2-\u1fc4\u1fc6-\u1fcc\u1fd0-\u1fd3\u1fd6-\u1fdb\u1fe0-\u1fec\u1ff2-\u1ff4"
        "\u1ff6-\u1ffc\u2102\u2107\u210a-\u2113\u2115\u2119-\u211d\u2124\u2126\u2128"
        "\u212a-\u212d\u212f-\u2134\u2139\u213c-\u213f\u2145-\u2149\u214e\u2183\u2184"
        "\u2c00-\u2c7b\u2c7e-\u2ce4\u2ceb-\u2cee\u2cf2\u2cf3\ua640-\ua66d\ua680-\ua69b"
        "\ua722-\ua76f\ua771-\ua787\ua78b-\ua78e\uab70-\uabbf\ufb00-\ufb06\ufb13-\ufb17"
        "\uff21-\uff3a\uff41-\uff5a\U00010400-\U0001044f\U000104b0-\U000104d3"
        "\U000104d8-\U000104fb\U00010c80-\U00010cb2\U00010cc0-\U00010cf2"
        "\U000118a0-\U000118df\U0001e900-\U0001e943]+",
        "\\s?[!-/:-~\uff01-\uff0f\uff1a-\uff5e\u2018-\u201f\u3000-\u3002]+",
        r"\s+$",
        _CJK,
        r"\p{N}+",
    ),
    "deepseek-coder": ("[\r\n]", r"\s?\p{L}+", r"\s?\p{P}+", _CJK, r"\p{N}"),
    "deepseek3": (r"\p{N}{1,3}", "[\u4e00-\u9fa5\u3040-\u309f\u30a0-\u30ff]+", _DEEPSEEK3),
    "falcon": (r"[\p{P}\$\+<=>\^~\|`]+", _GPT2, "[0-9][0-9][0-9]"),
    "poro": (_PORO,),
    "viking": (_PORO, r"\p{N}"),
    "tekken": (
        r"[^\r\n\p{L}\p{N}]?"
        + _UPPER_LOWER
        + r"|[^\r\n\p{L}\p{N}]?"
        + _LOWER_UPPER
        + r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+",
    ),
    "gpt4o": (
        r"[^\r\n\p{L}\p{N}]?"
        + _UPPER_LOWER
        + _CONTRACTIONS
        + r"?|[^\r\n\p{L}\p{N}]?"
        + _LOWER_UPPER
        + _CONTRACTIONS
        + r"?|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+"
        r"|\s+(?!\S)|\s+",
    ),
    "seed-coder": (
        _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1}| ?[^\s\p{L}\p{N}\r\n]+|\s*[\r\n]+"
        r"|\s+(?!\S)|\s+",
    ),
    "bailingmoe": (
        r"'(?:[sSdDmMtT]|[lL][lL]|[vV][eE]|[rR][eE])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
        r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]|\s+(?!\S)|\s+",
    ),
    "ufakzeka": (
        r"[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
    ),
    "exaone-moe": (
        _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?(?:\p{L}\p{M}*(?: \p{L}\p{M}*)*)+|\p{N}"
        r"| ?[^\s\p{L}\p{N}]+[\r\n/]?|\s*[\r\n]|\s+(?!\S)|\s+",
    ),
    "minicpm5": (
        r"\p{N}{1,3}",
        _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}+| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
        r"|\s+(?!\S)|\s+",
    ),
}

# `tokenizer.ggml.pre` → the type above (llama_vocab::impl::load)
_PRE_NAMES: dict[str, str] = {
    "default": "default",
    **dict.fromkeys(["llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral",
                     "midm-2.0", "lfm2", "jina-v5-nano", "dbrx", "smaug-bpe", "chatglm-bpe",
                     "glm4", "glm5"], "llama3"),
    **dict.fromkeys(["gpt-2", "phi-2", "jina-es", "jina-de", "gigachat", "jina-v2-es",
                     "jina-v2-de", "a.x-4.0", "mellum", "modern-bert", "jina-v1-en",
                     "jina-v2-code", "roberta-bpe", "mpt", "olmo", "jais", "trillion",
                     "granite-docling", "exaone4"], "gpt2"),
    **dict.fromkeys(["smollm", "starcoder", "refact", "command-r", "codeshell", "exaone",
                     "minerva-7b", "mellum2"], "smollm"),
    **dict.fromkeys(["qwen2", "deepseek-r1-qwen", "kormo", "f2llmv2", "megrez", "stablelm2",
                     "hunyuan", "solar-open", "grok-2"], "qwen2"),
    "qwen35": "qwen35", "jais-2": "jais2",
    "deepseek-llm": "deepseek-llm", "deepseek-coder": "deepseek-coder",
    **dict.fromkeys(["deepseek-v3", "hunyuan-dense", "hy_v4", "joyai-llm"], "deepseek3"),
    "falcon": "falcon",
    **dict.fromkeys(["poro-chat", "bloom", "gpt3-finnish"], "poro"),
    "viking": "viking", "tekken": "tekken",
    **dict.fromkeys(["gpt-4o", "llama4", "kanana2", "talkie", "minimax-m2"], "gpt4o"),
    "seed-coder": "seed-coder",
    **dict.fromkeys(["bailingmoe", "bailingmoe2", "llada-moe"], "bailingmoe"),
    "ufakzeka": "ufakzeka", "exaone-moe": "exaone-moe", "minicpm5": "minicpm5",
}  # fmt: skip
_IGNORE_MERGES = {"llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral", "midm-2.0",
                  "lfm2", "jina-v5-nano", "minicpm5", "glm4", "glm5", "tekken"}  # fmt: skip
_ADDS_BOS = {"llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral", "midm-2.0",
             "lfm2", "jina-v5-nano", "tekken"}  # fmt: skip
_NO_BOS = {"chatglm-bpe", "glm4", "glm5"}

# Texts llama.cpp recognises when the file names no id (llama_vocab::impl::load)
_EOT_TEXTS = ("<|eot_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>", "<|endoftext|>",
              "<|end_of_text|>", "<EOT>", "_<EOT>", "[EOT]", "<｜end▁of▁sentence｜>",
              "<end_of_utterance>")  # fmt: skip
_FIM_TEXTS = {  # metadata key suffix → texts
    "fim_pre": ("<|fim_prefix|>", "<fim-prefix>", "<fim_prefix>", "<｜fim▁begin｜>", "<PRE>",
                "▁<PRE>", "<|code_prefix|>", "<|prefix|>"),
    "fim_suf": ("<|fim_suffix|>", "<fim-suffix>", "<fim_suffix>", "<｜fim▁hole｜>", "<SUF>",
                "▁<SUF>", "<|code_suffix|>", "<|suffix|>"),
    "fim_mid": ("<|fim_middle|>", "<fim-middle>", "<fim_middle>", "<｜fim▁end｜>", "<MID>",
                "▁<MID>", "<|code_middle|>", "<|middle|>"),
    "fim_pad": ("<|fim_pad|>", "<fim-pad>", "<fim_pad>", "<PAD>", "[PAD]"),
    "fim_rep": ("<|fim_repo|>", "<|repo_name|>", "<fim-repo>", "<REPO>", "<reponame>"),
    "fim_sep": ("<|file_sep|>",),
}  # fmt: skip
_EOG_TEXTS = ("<|eot_id|>", "<|im_end|>", "<|end|>", "<|return|>", "<|call|>", "<|flush|>",
              "<|calls|>", "<end_of_turn>", "<|endoftext|>", "</s>", "<|eom_id|>", "<EOT>",
              "_<EOT>", "[EOT]", "[EOS]", "<|end_of_text|>", "<end_of_utterance>", "<eos>",
              "<turn|>", "<|tool_response>", "<｜end▁of▁sentence｜>", "[e~[")  # fmt: skip

_SPACE = "▁"  # U+2581, SentencePiece's visible space
_C_SPACE = " \t\n\v\f\r"  # C isspace(), what llama.cpp strips around lstrip/rstrip tokens


def _byte_chars() -> list[str]:
    """GPT-2's byte → character map: byte-level vocabularies spell byte b as chars[b]."""
    chars, extra = [], 0
    for b in range(256):
        if 0x21 <= b <= 0x7E or 0xA1 <= b <= 0xAC or 0xAE <= b <= 0xFF:
            chars.append(chr(b))
        else:
            chars.append(chr(256 + extra))
            extra += 1
    return chars


_BYTE_OF = {c: b for b, c in enumerate(_byte_chars())}


def _trie_regex(words: Iterable[str]) -> str:
    """A regex matching exactly `words`, longest first, as a trie (fast even for thousands)."""
    trie: dict[str, Any] = {}
    for w in words:
        node = trie
        for ch in w:
            node = node.setdefault(ch, {})
        node[""] = {}

    def emit(node: dict[str, Any]) -> str:
        alts = [re.escape(ch) + emit(child) for ch, child in node.items() if ch]
        if not alts:
            return ""
        body = alts[0] if len(alts) == 1 else "(?:" + "|".join(alts) + ")"
        return f"(?:{body})?" if "" in node else body

    return emit(trie)


def _spm_merges(vocab: dict[str, int], scores: Sequence[float]) -> list[tuple[str, str]]:
    """Every (left, right) whose halves and concatenation are tokens, the best token's first.

    Walking the tokens in sorted order keeps a stack of the tokens that are prefixes of the
    current one, so only real prefixes are tried (about three per token, not every cut).
    """
    prefixes: dict[int, tuple[str, tuple[str, ...]]] = {}
    stack: list[str] = []
    for t in sorted(vocab):
        while stack and not t.startswith(stack[-1]):
            stack.pop()
        if stack:
            prefixes[vocab[t]] = (t, tuple(stack))
        stack.append(t)
    merges: list[tuple[str, str]] = []
    # highest score first (llama.cpp's queue order); equal scores by id
    for i in sorted(sorted(prefixes), key=scores.__getitem__, reverse=True):
        t, lefts = prefixes[i]
        for left in lefts:
            right = t[len(left) :]
            if right in vocab:
                merges.append((left, right))
    return merges


# -- the tokenizer ---------------------------------------------------------------------------


class GGUFTokenizer:
    """Tokenizes like llama.cpp's `llama_tokenize(..., parse_special=True)` for one GGUF vocabulary.

    Token methods mirror the llama.cpp backend's: `encode` (its `tokenize`), `token_bytes`,
    `decode` (its `detokenize`), `is_end`, plus `piece`, `bos_id`, `eos_id`, `n_vocab`.
    """

    def __init__(self, metadata: Mapping[str, Any], *, name: str = "model") -> None:
        self.name = name
        kind = metadata.get("tokenizer.ggml.model")
        if "tokenizer.ggml.tokens" not in metadata or kind is None:
            raise self._error("has no tokenizer (tokenizer.ggml.model / tokenizer.ggml.tokens)")
        if kind not in ("gpt2", "llama"):
            raise self._error(
                f"tokenizer.ggml.model is {kind!r}; the torch engine tokenizes 'gpt2' (byte-level "
                "BPE) and 'llama' (SentencePiece) vocabularies"
            )
        self.kind: str = kind
        tokens = list(metadata["tokenizer.ggml.tokens"])
        for i, t in enumerate(tokens):
            if not t:  # as llama.cpp renames them, so no empty string is ever matched
                tokens[i] = f"[EMPTY_{i}]"
        self.tokens: list[str] = tokens
        n = len(tokens)
        types = metadata.get("tokenizer.ggml.token_type")
        attr = [_TYPE_ATTR.get(t, 0) for t in types[:n]] if types is not None else [NORMAL] * n
        attr += [0] * (n - len(attr))
        self._attr = attr
        self._vocab = {t: i for i, t in enumerate(tokens)}  # a repeated text: the last id wins

        # defaults of the vocabulary type, then the pre-tokenizer's, then the file's keys
        pre = str(metadata.get("tokenizer.ggml.pre") or "default")
        ids: dict[str, int | None] = dict.fromkeys(
            ["bos", "eos", "eot", "eom", "unk", "fim_pre", "fim_suf", "fim_mid", "fim_pad",
             "fim_rep", "fim_sep"]
        )  # fmt: skip
        if kind == "llama":
            ids.update(bos=1, eos=2, unk=0)
            self.add_bos, self.add_space_prefix, self.pre = True, True, None
        else:
            if pre not in _PRE_NAMES:
                raise self._error(
                    f"tokenizer.ggml.pre is {pre!r}, a pre-tokenizer the torch engine does not "
                    f"know (it knows {len(_PRE_NAMES)}, among them smollm, llama-bpe, qwen2, "
                    "gpt-2, deepseek-v3, tekken and default)"
                )
            ids.update(bos=None if pre in _NO_BOS else 11, eos=11)
            self.add_bos, self.add_space_prefix, self.pre = pre in _ADDS_BOS, False, pre
        for key in ids:
            if ids[key] is not None and ids[key] >= n:  # type: ignore[operator]
                ids[key] = None
        keys = {"unk": "unknown"}
        for key in ids:
            value = metadata.get(f"tokenizer.ggml.{keys.get(key, key)}_token_id")
            if isinstance(value, int) and 0 <= value < n:
                ids[key] = value
        for key, old in (("fim_pre", "prefix"), ("fim_suf", "suffix"), ("fim_mid", "middle")):
            value = metadata.get(f"tokenizer.ggml.{old}_token_id")
            if isinstance(value, int) and 0 <= value < n:
                ids[key] = value
        self.add_bos = bool(metadata.get("tokenizer.ggml.add_bos_token", self.add_bos))
        self.add_eos = bool(metadata.get("tokenizer.ggml.add_eos_token", False))
        self.add_space_prefix = bool(
            metadata.get("tokenizer.ggml.add_space_prefix", self.add_space_prefix)
        )
        self.bos_id: int | None = ids["bos"]
        self.eos_id: int | None = ids["eos"]
        self._eog = self._end_tokens(ids)
        self._strip_by_model_name(str(metadata.get("general.name") or "").lower())

        # special tokens: longest (in bytes) first, as llama.cpp's partition tries them
        special = [i for i in range(n) if attr[i] & _PARTITIONED]
        special.sort(key=lambda i: -len(tokens[i].encode("utf-8", "surrogateescape")))
        self._special: dict[str, int] = {}
        for i in special:
            self._special.setdefault(tokens[i], i)
        self._special_order = {t: k for k, t in enumerate(self._special)}
        self._special_re: re.Pattern[str] | None = None  # compiled on first use
        self._prefixes: dict[str, list[str]] = {}
        self._bytes: list[bytes | None] = [None] * n
        self._hf = self._build_hf(metadata)

    @classmethod
    def from_gguf(
        cls, f: GGUFFile | Mapping[str, Any], *, name: str | None = None
    ) -> GGUFTokenizer:
        """The tokenizer of an open GGUF file (or of its metadata dict)."""
        if isinstance(f, GGUFFile):
            return cls(f.metadata, name=name or os.path.basename(f.path))
        return cls(f, name=name or str(f.get("general.name") or "model"))

    def _error(self, reason: str) -> TokenizerError:
        return TokenizerError(f"{self.name}: {reason}")

    # -- building ----------------------------------------------------------------------------

    def _end_tokens(self, ids: dict[str, int | None]) -> frozenset[int]:
        """llama.cpp's end-of-generation set, marking tokens control as it does on the way."""
        attr, vocab = self._attr, self._vocab

        def detect(key: str, texts: Sequence[str]) -> None:
            if ids[key] is None:
                for t in texts:
                    if t in vocab:
                        ids[key] = vocab[t]
                        attr[vocab[t]] |= CONTROL
                        break

        detect("eot", _EOT_TEXTS)
        detect("eom", ("<|eom_id|>",))
        for key, texts in _FIM_TEXTS.items():
            detect(key, texts)
        for i, t in enumerate(self.tokens):  # control tokens named "unused" are unused
            if attr[i] & CONTROL and "unused" in t:
                attr[i] |= UNUSED
        eog = {ids[k] for k in ("fim_pad", "fim_rep", "fim_sep") if ids[k] is not None}
        for t in _EOG_TEXTS:
            if t in vocab:
                eog.add(vocab[t])
                attr[vocab[t]] |= CONTROL
        for t in ("<|channel|>", "<|message|>", "<|start|>", "<|constrain|>"):  # gpt-oss
            if t in vocab:
                attr[vocab[t]] = USER_DEFINED
        eog |= {ids[k] for k in ("eos", "eot", "eom") if ids[k] is not None}  # type: ignore[misc]
        texts = {self.tokens[i]: i for i in eog}
        has_call = "<|call|>" in texts or "<|calls|>" in texts
        if "<|end|>" in texts and has_call and ("<|return|>" in texts or "<|flush|>" in texts):
            # o200k_harmony and solar-open: <|end|> ends a message, not the generation
            eog.discard(texts["<|end|>"])
            attr[texts["<|end|>"]] = USER_DEFINED
        if "</s>" in texts and ("<|tool_response>" in texts or "<|plamo:eos|>" in texts):
            eog.discard(texts["</s>"])
            attr[texts["</s>"]] = NORMAL
        return frozenset(eog)  # type: ignore[arg-type]

    def _strip_by_model_name(self, model_name: str) -> None:
        """Phi-3's special tokens swallow the whitespace after them (llama.cpp sets this by name)."""
        if "phi-3" not in model_name and "phi3" not in model_name:
            return
        for i, a in enumerate(self._attr):
            if a & _PARTITIONED:
                self._attr[i] |= RSTRIP
        for t, on in (("</s>", True), ("<unk>", False), ("<s>", False), ("<|endoftext|>", False)):
            if t in self._vocab:
                i = self._vocab[t]
                self._attr[i] = self._attr[i] | RSTRIP if on else self._attr[i] & ~RSTRIP

    def _build_hf(self, metadata: Mapping[str, Any]) -> Tokenizer:
        """The Hugging Face BPE model, plus stand-ins where llama.cpp merges text that is no token.

        llama.cpp merges symbols by their text alone: a character inside tokens need not be a
        token itself (SentencePiece), nor a merge's halves or result (BPE). Such texts get ids past
        the vocabulary here, and `encode` turns a stand-in left unmerged into what llama.cpp
        emits for it: its bytes' tokens.
        """
        vocab = self._vocab
        try:  # text that cannot cross into Rust (undecodable bytes in the file) is left out
            "".join(vocab).encode("utf-8")
        except UnicodeEncodeError:
            vocab = {t: i for t, i in vocab.items() if _is_utf8(t)}
        n, extra = len(self.tokens), {}

        def known(t: str) -> None:
            if t not in vocab and t not in extra:
                extra[t] = n + len(extra)

        if self.kind == "llama":
            for ch in set("".join(vocab)):
                known(ch)
            scores = metadata.get("tokenizer.ggml.scores")
            if scores is None:
                scores = [0.0] * n
            scores = [*scores[:n], *[0.0] * (n - len(scores))]
            scores += [0.0] * len(extra)
            hf_vocab = {**vocab, **extra}
            model = models.BPE(hf_vocab, _spm_merges(hf_vocab, scores), byte_fallback=True)
            self._stand_ins = {i: self._byte_ids(t.encode("utf-8")) for t, i in extra.items()}
            return Tokenizer(model)
        merges = []
        for m in metadata.get("tokenizer.ggml.merges") or ():
            cut = m.find(" ", 1)
            if cut > 0 and _is_utf8(m):
                left, right = m[:cut], m[cut + 1 :]
                for t in (left, right, left + right):
                    known(t)
                merges.append((left, right))
        hf_vocab = {**vocab, **extra}
        ignore = self.pre in _IGNORE_MERGES
        tok = Tokenizer(models.BPE(hf_vocab, merges, ignore_merges=ignore))
        # an unknown merged symbol: llama.cpp looks up each of its bytes as a one-byte token
        one = [bytes([b]).decode("utf-8", "surrogateescape") for b in range(256)]
        self._stand_ins = {
            i: [self._vocab[one[b]] for b in t.encode("utf-8") if one[b] in self._vocab]
            for t, i in extra.items()
        }
        splits = [
            pre_tokenizers.Split(Regex(r), behavior="isolated")
            for r in PRE_TOKENIZERS[_PRE_NAMES[self.pre]]  # type: ignore[index]
        ]
        tok.pre_tokenizer = pre_tokenizers.Sequence(
            [*splits, pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
        )
        return tok

    def _byte_ids(self, data: bytes) -> list[int]:
        """SentencePiece byte fallback: <0xNN>, else the byte as a one-character token."""
        out = []
        for b in data:
            t = self._vocab.get(f"<0x{b:02X}>", self._vocab.get(chr(b)))
            if t is not None:
                out.append(t)
        return out

    # -- text → ids ----------------------------------------------------------------------------

    @property
    def n_vocab(self) -> int:
        return len(self.tokens)

    def encode(self, text: str, *, add_special: bool = True) -> list[int]:
        """Token ids of `text`, special tokens written in it included, like llama.cpp's
        `tokenize(text, add_special, parse_special=True)`: BOS/EOS only if the file asks."""
        out: list[int] = []
        if add_special and self.add_bos:
            if self.bos_id is None:
                raise self._error("the vocabulary asks for a BOS token but has none")
            out.append(self.bos_id)
        parts = self._partition(text)
        if self.kind == "llama":  # SentencePiece: "▁" for spaces, one after a special token
            prev_special = True
            for k, p in enumerate(parts):
                if isinstance(p, str):
                    if self.add_space_prefix and prev_special:
                        p = " " + p
                    parts[k] = p.replace(" ", _SPACE)
                prev_special = not isinstance(p, str)
        texts = [p for p in parts if isinstance(p, str)]
        if texts:  # one call: each stretch of text is a "word" the pre-tokenizer still splits
            enc = self._hf.encode(texts, is_pretokenized=True, add_special_tokens=False)
            by_text: list[list[int]] = [[] for _ in texts]
            n = len(self.tokens)
            for tid, w in zip(enc.ids, enc.word_ids, strict=True):
                if tid < n:
                    by_text[w].append(tid)
                else:
                    by_text[w].extend(self._stand_ins[tid])
            words = iter(by_text)
            for p in parts:
                if isinstance(p, str):
                    out.extend(next(words))
                else:
                    out.append(p)
        else:
            out.extend(parts)  # type: ignore[arg-type]
        if add_special and self.add_eos:
            if self.eos_id is None:
                raise self._error("the vocabulary asks for an EOS token but has none")
            out.append(self.eos_id)
        return out

    def _partition(self, text: str) -> list[str | int]:
        """Split `text` at special tokens exactly as llama.cpp's `tokenizer_st_partition`: each
        special token, longest first, splits every remaining stretch of text at its occurrences."""
        if not text:
            return []
        if not self._special:
            return [text]
        if self._special_re is None:
            self._special_re = re.compile("(?=(" + _trie_regex(self._special) + "))")
        # the longest special token starting at each position; the shorter ones are its prefixes
        longest = {m.group(1) for m in self._special_re.finditer(text)}
        if not longest:
            return [text]
        present: set[str] = set()
        for t in longest:
            present.update(self._special_prefixes(t))
        parts: list[str | int] = [text]
        for t in sorted(present, key=self._special_order.__getitem__):
            tid = self._special[t]
            lstrip, rstrip = self._attr[tid] & LSTRIP, self._attr[tid] & RSTRIP
            split: list[str | int] = []
            for p in parts:
                if not isinstance(p, str) or t not in p:
                    split.append(p)
                    continue
                start = 0
                while (at := p.find(t, start)) >= 0:
                    left = p[start:at]
                    if left and lstrip:
                        left = left.rstrip(_C_SPACE)
                    if left:
                        split.append(left)
                    split.append(tid)
                    start = at + len(t)
                    if rstrip:
                        while start < len(p) and p[start] in _C_SPACE:
                            start += 1
                if start < len(p):
                    split.append(p[start:])
            parts = split
        return parts

    def _special_prefixes(self, t: str) -> list[str]:
        if t not in self._prefixes:
            self._prefixes[t] = [t[:k] for k in range(1, len(t) + 1) if t[:k] in self._special]
        return self._prefixes[t]

    # -- ids → text ----------------------------------------------------------------------------

    def token_bytes(self, token: int) -> bytes:
        """The bytes of one token as llama.cpp's `llama_token_to_piece(..., special=False)`:
        control tokens are empty; a stream of these concatenates to the generated text."""
        if not 0 <= token < len(self.tokens):
            raise IndexError(f"token id {token} is outside the vocabulary (0..{self.n_vocab - 1})")
        piece = self._bytes[token]
        if piece is None:
            piece = self._bytes[token] = self._piece_bytes(token, special=False)
        return piece

    def piece(self, token: int) -> str:
        """One token's text with special tokens spelled out ("<|im_start|>", "<bos>")."""
        if not 0 <= token < len(self.tokens):
            raise IndexError(f"token id {token} is outside the vocabulary (0..{self.n_vocab - 1})")
        return self._piece_bytes(token, special=True).decode("utf-8", "replace")

    def _piece_bytes(self, token: int, *, special: bool) -> bytes:
        a, text = self._attr[token], self.tokens[token]
        if a & _SILENT and not special:
            return b""
        if a & (_SILENT | USER_DEFINED):
            return text.encode("utf-8", "surrogateescape")
        if a & NORMAL:
            if self.kind == "llama":
                return text.replace(_SPACE, " ").encode("utf-8", "surrogateescape")
            return _byte_decode(text)
        if a & BYTE:
            return bytes([int(text[3:5], 16)])
        return b""  # unused and undefined tokens print as nothing

    def decode(self, tokens: Sequence[int]) -> str:
        """Text of `tokens` as the llama.cpp backend's `detokenize`: special tokens print as
        nothing, and a leading space after BOS (SentencePiece's prefix) is dropped."""
        data = b"".join(self.token_bytes(t) for t in tokens)
        if tokens and tokens[0] == self.bos_id and data[:1] == b" ":
            data = data[1:]
        return data.decode("utf-8", "replace")

    def is_end(self, token: int) -> bool:
        """Whether `token` ends generation (llama.cpp's `llama_vocab_is_eog`)."""
        return token in self._eog

    @property
    def end_ids(self) -> frozenset[int]:
        return self._eog

    def stream(self) -> StreamDecoder:
        return StreamDecoder(self)


class StreamDecoder:
    """Generated tokens → text, holding back the bytes of a character not yet complete."""

    def __init__(self, tokenizer: GGUFTokenizer) -> None:
        self.tokenizer = tokenizer
        self._utf8 = codecs.getincrementaldecoder("utf-8")("replace")

    def feed(self, token: int) -> str:
        """The characters this token completes (may be "" mid-character)."""
        return self._utf8.decode(self.tokenizer.token_bytes(token))

    def flush(self) -> str:
        """What is left: an unfinished character becomes U+FFFD."""
        out = self._utf8.decode(b"", final=True)
        self._utf8.reset()
        return out


def _is_utf8(t: str) -> bool:
    try:
        t.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _byte_decode(text: str) -> bytes:
    """A byte-level BPE token's bytes (llama.cpp's `llama_decode_text`, its odd fallback too)."""
    try:
        return bytes([_BYTE_OF[c] for c in text])
    except KeyError:
        out = bytearray()
        for c in text:
            if c in _BYTE_OF:
                out.append(_BYTE_OF[c])
            else:
                utf8 = c.encode("utf-8", "surrogateescape")
                out += b"[UNK_BYTE_0x" + utf8.hex().encode() + text.encode("utf-8") + b"]"
        return bytes(out)
