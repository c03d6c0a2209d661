"""The torch engine's tokenizer against llama.cpp's own, loaded vocabulary-only, as the oracle."""

from __future__ import annotations

import ctypes
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from localllm.chat import template_for
from localllm.gguf_file import GGUFFile

from conftest import need

MODELS = ["smollm2", "gemma3"]

# Strings that have tripped tokenizers up: each is compared with llama.cpp, with and without BOS.
TRICKY = [
    "",
    " ",
    "Hello world",
    " leading space",
    "trailing space ",
    "two  spaces  1 and  12 and   123 ",  # smollm: two spaces before a digit stay one token
    "x  1\n  2\n\n   3",
    "tabs\tand\t\ttabs\t\t\t\t1",
    "a" + " " * 40 + "b" + "\n" * 40 + "c" + "\t" * 40,
    "windows\r\nline\r\n\r\nends\r",
    "I'm sure it's fine, we'll see; they've said I'd've THEY'RE WE'LL I'M 'tis",
    "numbers 0 1 12 123 1234 12345 3.14159 1,000,000 -42 1e-9 ٣٤٥ ４２ ½ ⅷ",
    "naïve café résumé Zürich déjà vu, decomposed: cafe\u0301 nai\u0308ve",
    "日本語のテキストと中文文本，한국어 텍스트。 𠀀𠀁 ＡＢＣ",
    "emoji: 🦙🔥👍🏽 👨‍👩‍👧‍👦 🇫🇷 ❤️ ✨",
    "unicode spaces:\u00a0nbsp\u3000ideographic\u2009thin\u200bzwsp\u0085nel\u2028ls",
    "controls \x00\x01\x07\x1b[0m \x7f and private \ue000 and unassigned \u0378",
    "Ελληνικά Русский текст עברית العربية हिन्दी ไทย",
    "def f(x):\n    return {'a': [1, 2, 3]}  # comment\n\n\tif x >= 10 and y != 2: pass\n",
    "<html><body><table><tr><td>cell</td></tr></table></body></html>",
    "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n",
    "<start_of_turn>user\nhi<end_of_turn>\n<start_of_turn>model\n",
    "<bos><eos></s><s><unk><pad><mask> <|endoftext|>",
    "half specials: <|im_sta <start_of_tu <|endoftext| end_of_turn>",
    "glued<|im_end|>glued<end_of_turn>glued  <|im_start|>  spaced",
    "<0x41> literal byte-token text and ▁ visible spaces ▁▁ and <unused0>",
    "ALLCAPS camelCase snake_case kebab-case PascalCase x86_64 iPhone",
    "https://example.com/path?q=1&r=2#frag user@example.com",
    "\n\n\nstarts with newlines",
]

CHATS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [
        {"role": "system", "content": "You are terse.  Answer in   one line.\n\n\tThanks."},
        {"role": "user", "content": "Écris 12  345 en 日本語 🦙, s'il te plaît!"},
        {"role": "assistant", "content": "```python\nprint('hi')  # 2 spaces\n```"},
        {"role": "user", "content": "Say <|im_end|> and <end_of_turn> back\t\t\tto me.\n\n\n"},
    ],
]


# -- oracle ------------------------------------------------------------------------------------


def _llama_cpp() -> Any:  # noqa: ANN401 - the module
    need("llama_cpp", "pip install -e '.[dev]' (llama-cpp-python is the tokenizer oracle)")
    need("tokenizers", "pip install -e '.[dev]' (Hugging Face tokenizers)")
    import llama_cpp

    return llama_cpp


class Oracle:
    """llama.cpp's tokenizer for one file, through the calls the llama.cpp backend makes."""

    def __init__(self, path: Path) -> None:
        self.lib = _llama_cpp()
        self.llm = self.lib.Llama(model_path=str(path), vocab_only=True, verbose=False)
        self.vocab = self.llm._model.vocab
        self.buf = ctypes.create_string_buffer(256)
        self.ids = (self.lib.llama_token * 4096)()

    def encode(self, text: str, add_special: bool = True) -> list[int]:
        # the call `Llama.tokenize` makes (add_bos=add_special, special=True), without its
        # per-call allocations
        data = text.encode("utf-8")
        args = (self.vocab, data, len(data))
        n = self.lib.llama_tokenize(*args, self.ids, len(self.ids), add_special, True)
        if n < 0:
            self.ids = (self.lib.llama_token * -n)()
            n = self.lib.llama_tokenize(*args, self.ids, -n, add_special, True)
        return self.ids[:n]

    def piece(self, token: int, special: bool = False) -> bytes:
        n = self.lib.llama_token_to_piece(self.vocab, token, self.buf, len(self.buf), 0, special)
        if n < 0:
            self.buf = ctypes.create_string_buffer(-n)
            n = self.lib.llama_token_to_piece(self.vocab, token, self.buf, -n, 0, special)
        return self.buf.raw[:n]

    def decode(self, tokens: list[int]) -> str:
        # llama-cpp-python's detokenize (the backend's): pieces joined, a space after BOS dropped
        data = b"".join(self.piece(t) for t in tokens)
        if tokens and tokens[0] == self.llm.token_bos() and data[:1] == b" ":
            data = data[1:]
        return data.decode("utf-8", "replace")

    def is_eog(self, token: int) -> bool:
        return bool(self.lib.llama_vocab_is_eog(self.vocab, token))

    def close(self) -> None:
        self.llm.close()


@pytest.fixture(scope="module")
def built() -> Iterator[dict[Path, tuple[Any, Oracle]]]:
    """Tokenizers built once per file for the module: (ours, llama.cpp's) by path."""
    pairs: dict[Path, tuple[Any, Oracle]] = {}
    yield pairs
    for _, oracle in pairs.values():
        oracle.close()


def _pair(built: dict[Path, tuple[Any, Oracle]], path: Path) -> tuple[Any, Oracle]:
    if path not in built:
        from localllm.backends.torch.tokenizer import GGUFTokenizer

        oracle = Oracle(path)
        with GGUFFile(path) as f:
            built[path] = (GGUFTokenizer.from_gguf(f), oracle)
    return built[path]


@pytest.fixture(params=MODELS)
def model(
    request: pytest.FixtureRequest, built: dict[Path, tuple[Any, Oracle]]
) -> tuple[Any, Oracle, Path]:
    """(our tokenizer, llama.cpp's, the file) for each packaged model."""
    fixture = "default_model_path" if request.param == "smollm2" else "gemma_model_path"
    path = request.getfixturevalue(fixture)
    return (*_pair(built, path), path)


def _first_difference(ours: list[int], ref: list[int]) -> str:
    i = next((i for i, (a, b) in enumerate(zip(ours, ref)) if a != b), min(len(ours), len(ref)))
    return f"first difference at token {i}: ours {ours[i : i + 6]} llama.cpp {ref[i : i + 6]}"


def _assert_same(tok: Any, ref: Oracle, text: str, add_special: bool = True) -> None:
    ours, theirs = tok.encode(text, add_special=add_special), ref.encode(text, add_special)
    assert ours == theirs, f"{text[:60]!r}: {_first_difference(ours, theirs)}"


# -- encoding ----------------------------------------------------------------------------------


def test_whole_corpus_files(model: tuple[Any, Oracle, Path], corpus_dir: Path) -> None:
    tok, ref, path = model
    files = sorted(corpus_dir.glob("*.txt"))
    assert len(files) >= 3
    for f in files:
        text = f.read_text(encoding="utf-8")
        ours = tok.encode(text)
        if tok.kind == "llama" and len(text) > 200_000:
            # llama.cpp's special-token partition is quadratic in newlines (4 minutes for
            # tinyshakespeare on Gemma). Gemma's newline runs are special tokens, so cutting after a
            # whole run changes nothing: the oracle tokenizes the pieces and joins them.
            cuts = [m.end() for m in re.finditer(r"\n+", text)][200::200]
            pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]
            theirs = ref.encode(pieces[0]) + [
                t for p in pieces[1:] for t in ref.encode(p, add_special=False)
            ]
        else:
            theirs = ref.encode(text)
        assert ours == theirs, f"{path.name} on {f.name}: {_first_difference(ours, theirs)}"
        assert len(ours) > len(text) // 8


@pytest.mark.slow
def test_gemma_whole_tinyshakespeare(
    gemma_model_path: Path, corpus_dir: Path, built: dict[Path, tuple[Any, Oracle]]
) -> None:
    tok, ref = _pair(built, gemma_model_path)
    text = (corpus_dir / "tinyshakespeare.txt").read_text(encoding="utf-8")
    _assert_same(tok, ref, text)


def test_corpus_paragraphs_and_lines(model: tuple[Any, Oracle, Path], corpus_dir: Path) -> None:
    tok, ref, _ = model
    pieces: set[str] = set()
    for f in sorted(corpus_dir.glob("*.txt")):
        text = f.read_text(encoding="utf-8")
        pieces.update(text.split("\n\n"))
        lines = sorted(set(text.splitlines()))
        pieces.update(lines if len(lines) < 10_000 else lines[::4])  # tinyshakespeare: a quarter
    pieces.discard("")
    ordered = sorted(pieces)
    assert len(ordered) > 20_000
    # Each piece on its own, 100 per call: between two special tokens a stretch of text is
    # tokenized alone, by llama.cpp as by us, so joining pieces with EOS checks every piece.
    sep = tok.piece(tok.eos_id)
    for k in range(0, len(ordered), 100):
        chunk = ordered[k : k + 100]
        text = sep.join(chunk)
        ours, theirs = tok.encode(text, add_special=False), ref.encode(text, False)
        if ours != theirs:
            for p in chunk:
                _assert_same(tok, ref, p, add_special=False)
            raise AssertionError(f"pieces {k}..{k + 99}: {_first_difference(ours, theirs)}")
        assert ours.count(tok.eos_id) == len(chunk) - 1
    for p in ordered[:: len(ordered) // 500]:  # and some as separate calls, as a prompt would be
        _assert_same(tok, ref, p)


@pytest.mark.parametrize("add_special", [True, False])
def test_tricky_strings(model: tuple[Any, Oracle, Path], add_special: bool) -> None:
    tok, ref, _ = model
    for text in TRICKY:
        _assert_same(tok, ref, text, add_special)


def test_chat_prompts(model: tuple[Any, Oracle, Path]) -> None:
    tok, ref, path = model
    with GGUFFile(path) as f:
        template = template_for(
            f.metadata, bos_token=tok.piece(tok.bos_id), eos_token=tok.piece(tok.eos_id)
        )
    specials = 0
    for messages in CHATS:
        prompt = template.render(messages)
        for add_special in (True, False):
            _assert_same(tok, ref, prompt, add_special)
        ids = tok.encode(prompt, add_special=False)
        specials += sum(tok.piece(t) != tok.token_bytes(t).decode("utf-8", "replace") for t in ids)
        assert tok.decode(ids) == ref.decode(ids)
    assert specials >= 4  # the turn markers were parsed as single special tokens


def test_two_spaces_before_a_number_stay_one_token(
    default_model_path: Path, built: dict[Path, tuple[Any, Oracle]]
) -> None:
    # transformers' GGUF conversion (a plain GPT-2 regex) splits "  1" as " " + " 1" here
    tok, ref = _pair(built, default_model_path)
    ids = tok.encode("a  1", add_special=False)
    assert ids == ref.encode("a  1", False)
    assert [tok.token_bytes(t) for t in ids] == [b"a", b"  ", b"1"]


# -- vocabulary facts --------------------------------------------------------------------------


def test_ids_and_end_tokens(model: tuple[Any, Oracle, Path]) -> None:
    tok, ref, _ = model
    assert tok.n_vocab == ref.llm.n_vocab()
    assert tok.bos_id == ref.llm.token_bos()
    assert tok.eos_id == ref.llm.token_eos()
    assert tok.add_bos == bool(ref.lib.llama_vocab_get_add_bos(ref.vocab))
    ends = [t for t in range(tok.n_vocab) if ref.is_eog(t)]
    assert ends == sorted(tok.end_ids)
    assert all(tok.is_end(t) for t in ends) and not tok.is_end(ends[0] - 1)
    names = {tok.piece(t) for t in ends}
    assert names & {"<|im_end|>", "<end_of_turn>"}


def test_token_bytes_and_pieces_of_every_id(model: tuple[Any, Oracle, Path]) -> None:
    tok, ref, _ = model
    for t in range(tok.n_vocab):
        assert tok.token_bytes(t) == ref.piece(t), t
    for t in range(0, tok.n_vocab, 7):  # the special=True spelling, on a sample
        assert tok.piece(t) == ref.piece(t, special=True).decode("utf-8", "replace"), t
    with pytest.raises(IndexError):
        tok.token_bytes(tok.n_vocab)


def test_decode_round_trips(model: tuple[Any, Oracle, Path], corpus_dir: Path) -> None:
    tok, ref, _ = model
    texts = [f.read_text(encoding="utf-8")[:50_000] for f in sorted(corpus_dir.glob("*.txt"))]
    for text in texts + [t for t in TRICKY if "<" not in t]:
        for add_special in (True, False):
            ids = tok.encode(text, add_special=add_special)
            assert tok.decode(ids) == ref.decode(ids)
            # the backend's detokenize drops the space after BOS (SentencePiece's prefix)
            after_bos = ids[:1] == [tok.bos_id] and text.startswith(" ")
            assert tok.decode(ids) == (text[1:] if after_bos else text)


def test_stream_decoder_splits_characters(model: tuple[Any, Oracle, Path]) -> None:
    from localllm.backends.torch.tokenizer import StreamDecoder

    tok, _, _ = model
    text = "Ça va? 🦙🔥👍🏽 — 日本語 𠀀 ＡＢＣ naïve\u0301 👨‍👩‍👧‍👦 end"
    ids = tok.encode(text, add_special=False)
    stream = StreamDecoder(tok)
    outs = [stream.feed(t) for t in ids]
    assert "".join(outs) + stream.flush() == text == tok.decode(ids)
    assert "\ufffd" not in "".join(outs)
    # some token ends inside a character: its text waits for the next one
    assert any(o == "" and tok.token_bytes(t) for o, t in zip(outs, ids, strict=True)), (
        "no token split a character: the test text needs rarer characters"
    )
    # an unfinished character at the end comes out as U+FFFD on flush
    lead = next(t for t in ids if tok.token_bytes(t)[:1] == b"\xf0" and len(tok.token_bytes(t)) < 4)
    stream = tok.stream()
    assert stream.feed(lead) == ""
    assert stream.flush() == "\ufffd"


# -- other vocabularies: small GGUFs that llama.cpp loads vocabulary-only ---------------------


def _write_vocab(path: Path, meta: dict[str, Any]) -> Path:
    need("gguf", "pip install -e '.[dev]' (the gguf package writes test files)")
    import gguf

    w = gguf.GGUFWriter(str(path), arch="llama")
    w.add_name(meta.get("general.name", "tokenizer-test"))
    for key, value in (("block_count", 1), ("context_length", 256), ("embedding_length", 64),
                       ("feed_forward_length", 128), ("attention.head_count", 4)):  # fmt: skip
        w.add_uint32(f"llama.{key}", value)
    w.add_tokenizer_model(meta["tokenizer.ggml.model"])
    if meta.get("tokenizer.ggml.pre") is not None:
        w.add_tokenizer_pre(meta["tokenizer.ggml.pre"])
    w.add_token_list(meta["tokenizer.ggml.tokens"])
    w.add_token_types(meta["tokenizer.ggml.token_type"])
    if "tokenizer.ggml.scores" in meta:
        w.add_token_scores(meta["tokenizer.ggml.scores"])
    if "tokenizer.ggml.merges" in meta:
        w.add_token_merges(meta["tokenizer.ggml.merges"])
    for key in ("bos", "eos"):
        w.add_uint32(f"tokenizer.ggml.{key}_token_id", meta[f"tokenizer.ggml.{key}_token_id"])
    for key in ("add_bos_token", "add_eos_token", "add_space_prefix"):
        if f"tokenizer.ggml.{key}" in meta:
            w.add_bool(f"tokenizer.ggml.{key}", meta[f"tokenizer.ggml.{key}"])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def _small_bpe(path: Path, n: int = 6000) -> dict[str, Any]:
    """The default model's first `n` tokens and the merges among them: a smaller, whole BPE."""
    with GGUFFile(path) as f:
        m = f.metadata
        tokens = m["tokenizer.ggml.tokens"][:n]
        ids = {t: i for i, t in enumerate(tokens)}
        merges = [
            x for x in m["tokenizer.ggml.merges"].tolist()
            if all(p in ids for p in x.split(" ", 1)) and x.replace(" ", "", 1) in ids
        ]  # fmt: skip
        return {
            "tokenizer.ggml.model": "gpt2", "tokenizer.ggml.tokens": tokens,
            "tokenizer.ggml.token_type": list(m["tokenizer.ggml.token_type"][:n]),
            "tokenizer.ggml.merges": merges, "tokenizer.ggml.bos_token_id": 1,
            "tokenizer.ggml.eos_token_id": 2,
        }  # fmt: skip


def _small_spm(path: Path, n: int = 20000) -> dict[str, Any]:
    """Gemma's first `n` tokens (specials, the 256 bytes, the best-scored pieces) with scores.

    Some characters inside these tokens ("▁" itself) are not tokens here: llama.cpp still merges
    them, which the tokenizer must follow."""
    with GGUFFile(path) as f:
        m = f.metadata
        return {
            "tokenizer.ggml.model": "llama",
            "tokenizer.ggml.tokens": m["tokenizer.ggml.tokens"][:n],
            "tokenizer.ggml.token_type": list(m["tokenizer.ggml.token_type"][:n]),
            "tokenizer.ggml.scores": list(m["tokenizer.ggml.scores"][:n]),
            "tokenizer.ggml.bos_token_id": 2, "tokenizer.ggml.eos_token_id": 1,
        }  # fmt: skip


SAMPLE = "\n".join(TRICKY[1:]) + "\nThe year 1851: 'Call me Ishmael.' He'd said—“quietly”—400 ft.\n"

BPE_VARIANTS = {
    "gpt-2": {"tokenizer.ggml.pre": "gpt-2"},
    "llama-bpe": {"tokenizer.ggml.pre": "llama-bpe"},
    "qwen2": {"tokenizer.ggml.pre": "qwen2"},
    "default": {"tokenizer.ggml.pre": "default"},
    "no pre key": {"tokenizer.ggml.pre": None},
    "starcoder": {"tokenizer.ggml.pre": "starcoder"},
    "qwen35": {"tokenizer.ggml.pre": "qwen35"},
    "deepseek-llm": {"tokenizer.ggml.pre": "deepseek-llm"},
    "deepseek-coder": {"tokenizer.ggml.pre": "deepseek-coder"},
    "deepseek-v3": {"tokenizer.ggml.pre": "deepseek-v3"},
    "falcon": {"tokenizer.ggml.pre": "falcon"},
    "poro-chat": {"tokenizer.ggml.pre": "poro-chat"},
    "viking": {"tokenizer.ggml.pre": "viking"},
    "tekken": {"tokenizer.ggml.pre": "tekken"},
    "gpt-4o": {"tokenizer.ggml.pre": "gpt-4o"},
    "chatglm-bpe": {"tokenizer.ggml.pre": "chatglm-bpe"},
    "jais-2": {"tokenizer.ggml.pre": "jais-2"},
    "seed-coder": {"tokenizer.ggml.pre": "seed-coder"},
    "bailingmoe": {"tokenizer.ggml.pre": "bailingmoe"},
    "exaone-moe": {"tokenizer.ggml.pre": "exaone-moe"},
    "minicpm5": {"tokenizer.ggml.pre": "minicpm5"},
    "phi-3 strips after specials": {  # llama.cpp looks these up in a "phi-3" vocabulary
        "tokenizer.ggml.pre": "smollm",
        "general.name": "Phi-3 mini",
        "extra": ["</s>", "<unk>", "<s>"],
        "tokenizer.ggml.add_bos_token": True,
        "tokenizer.ggml.add_eos_token": True,
    },  # fmt: skip
}
SPM_VARIANTS = {  # a SentencePiece vocabulary's defaults: BOS, a space before the text
    "llama defaults": {},
    "gemma (no space prefix)": {"tokenizer.ggml.add_space_prefix": False},
    "eos, no bos": {"tokenizer.ggml.add_bos_token": False, "tokenizer.ggml.add_eos_token": True},
}


@pytest.mark.parametrize(
    "kind, variant",
    [("bpe", v) for v in BPE_VARIANTS] + [("spm", v) for v in SPM_VARIANTS],
)
def test_vocabulary_variants(
    kind: str, variant: str, request: pytest.FixtureRequest, tmp_path: Path
) -> None:
    from localllm.backends.torch.tokenizer import GGUFTokenizer

    if kind == "bpe":
        meta = _small_bpe(request.getfixturevalue("default_model_path"))
        meta.update(BPE_VARIANTS[variant])
        for t in meta.pop("extra", []):  # control tokens at the end
            meta["tokenizer.ggml.tokens"].append(t)
            meta["tokenizer.ggml.token_type"].append(3)
    else:
        meta = _small_spm(request.getfixturevalue("gemma_model_path"))
        meta.update(SPM_VARIANTS[variant])
    path = _write_vocab(tmp_path / "vocab.gguf", meta)
    with GGUFFile(path) as f:
        tok = GGUFTokenizer.from_gguf(f)
    ref = Oracle(path)
    try:
        for text in [SAMPLE, *TRICKY, "<|im_start|>  x  <|im_end|> \n y"]:
            for add_special in (True, False):
                _assert_same(tok, ref, text, add_special)
        assert [tok.token_bytes(t) for t in range(tok.n_vocab)] == [
            ref.piece(t) for t in range(tok.n_vocab)
        ]
        assert sorted(tok.end_ids) == [t for t in range(tok.n_vocab) if ref.is_eog(t)]
    finally:
        ref.close()


# -- refusals ----------------------------------------------------------------------------------


def test_unknown_pre_tokenizer_is_one_line(default_model_path: Path) -> None:
    from localllm.backends.torch.tokenizer import GGUFTokenizer, TokenizerError

    with GGUFFile(default_model_path) as f:
        meta = dict(f.metadata)
    meta["tokenizer.ggml.pre"] = "no-such-pre"
    with pytest.raises(TokenizerError) as e:
        GGUFTokenizer.from_gguf(meta, name="x.gguf")
    assert "\n" not in str(e.value)
    assert str(e.value).startswith("x.gguf: ") and "'no-such-pre'" in str(e.value)
    assert "smollm" in str(e.value)  # it names what it knows

    meta["tokenizer.ggml.model"] = "bert"
    with pytest.raises(TokenizerError, match=r"^x\.gguf: tokenizer\.ggml\.model is 'bert'"):
        GGUFTokenizer.from_gguf(meta, name="x.gguf")
    del meta["tokenizer.ggml.tokens"]
    with pytest.raises(TokenizerError, match="has no tokenizer"):
        GGUFTokenizer.from_gguf(meta, name="x.gguf")
