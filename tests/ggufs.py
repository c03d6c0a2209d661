"""GGUF files for tests: tiny random-weight Llama models that llama.cpp loads, and raw hostile bytes.

`write_tiny_llama` writes real GGUF with `gguf`'s writer (an implementation we did not write), and
borrows the default model's tokenizer so llama.cpp can tokenize and run it. `RawGGUF` assembles
headers byte by byte, so a test can state any count or length, however impossible.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from localllm.gguf_file import GGUFFile, ValueType

TOKENIZER_KEYS = (
    "tokenizer.ggml.model",
    "tokenizer.ggml.pre",
    "tokenizer.ggml.tokens",
    "tokenizer.ggml.token_type",
    "tokenizer.ggml.merges",
    "tokenizer.ggml.bos_token_id",
    "tokenizer.ggml.eos_token_id",
    "tokenizer.ggml.unknown_token_id",
    "tokenizer.ggml.padding_token_id",
    "tokenizer.ggml.add_bos_token",
    "tokenizer.ggml.add_space_prefix",
    "tokenizer.chat_template",
)


def tokenizer_metadata(model_path: Path) -> dict[str, Any]:
    with GGUFFile(model_path) as gf:
        return {k: gf.metadata[k] for k in TOKENIZER_KEYS if k in gf.metadata}


def _add_shape(w: Any, name: str, n_ctx: int, n_embd: int, n_layer: int, n_ff: int, n_head: int,
               n_kv_head: int) -> None:  # fmt: skip
    """A writer's name and network shape keys."""
    w.add_name(name)
    w.add_context_length(n_ctx)
    w.add_embedding_length(n_embd)
    w.add_block_count(n_layer)
    w.add_feed_forward_length(n_ff)
    w.add_head_count(n_head)
    w.add_head_count_kv(n_kv_head)


def write_tiny_llama(
    path: Path,
    tokenizer: dict[str, Any],
    *,
    n_embd: int = 64,
    n_layer: int = 2,
    n_head: int = 4,
    n_kv_head: int = 2,
    n_ff: int = 128,
    n_ctx: int = 256,
    seed: int = 0,
    dtype: type = np.float16,
    split_max_tensors: int = 0,
    rope_base: float = 10000.0,
    q4_0: bool = False,
) -> Path:
    """A Llama-architecture GGUF with random weights and the given tokenizer metadata.

    With `split_max_tensors`, written as `STEM-0000i-of-0000N.gguf` parts (returns the first).
    With `q4_0`, the projections are Q4_0 blocks of random codes with d = 0.002 (weights within
    ±0.016; bench/torch_cuda.py's 1B-class model).
    """
    import gguf

    rng = np.random.default_rng(seed)
    n_vocab = len(tokenizer["tokenizer.ggml.tokens"])
    head_dim = n_embd // n_head
    w = gguf.GGUFWriter(str(path), arch="llama", split_max_tensors=split_max_tensors)
    _add_shape(w, "tiny-llama-test", n_ctx, n_embd, n_layer, n_ff, n_head, n_kv_head)
    w.add_rope_dimension_count(head_dim)
    w.add_rope_freq_base(rope_base)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_file_type(1 if dtype == np.float16 else 0)
    w.add_tokenizer_model(tokenizer["tokenizer.ggml.model"])
    if "tokenizer.ggml.pre" in tokenizer:
        w.add_tokenizer_pre(tokenizer["tokenizer.ggml.pre"])
    w.add_token_list(list(tokenizer["tokenizer.ggml.tokens"]))
    w.add_token_types(list(tokenizer["tokenizer.ggml.token_type"]))
    if "tokenizer.ggml.merges" in tokenizer:
        w.add_token_merges(list(tokenizer["tokenizer.ggml.merges"]))
    for key, add in (
        ("tokenizer.ggml.bos_token_id", w.add_bos_token_id),
        ("tokenizer.ggml.eos_token_id", w.add_eos_token_id),
        ("tokenizer.ggml.unknown_token_id", w.add_unk_token_id),
        ("tokenizer.ggml.padding_token_id", w.add_pad_token_id),
        ("tokenizer.ggml.add_bos_token", w.add_add_bos_token),
        ("tokenizer.ggml.add_space_prefix", w.add_add_space_prefix),
        ("tokenizer.chat_template", w.add_chat_template),
    ):
        if key in tokenizer:
            add(tokenizer[key])

    def t(*shape: int, scale: float = 0.02) -> np.ndarray:
        return (rng.standard_normal(shape) * scale).astype(dtype)

    d = np.frombuffer(np.float16(0.002).tobytes(), dtype=np.uint8)

    def proj(name: str, rows: int, cols: int) -> None:
        if not q4_0:
            w.add_tensor(name, t(rows, cols))
            return
        blocks = np.empty((rows * cols // 32, 18), dtype=np.uint8)  # f16 d, 16 bytes of codes
        blocks[:, :2] = d
        blocks[:, 2:] = rng.integers(0, 256, (blocks.shape[0], 16), dtype=np.uint8)
        w.add_tensor(name, blocks.reshape(rows, -1), raw_dtype=gguf.GGMLQuantizationType.Q4_0)

    ones = np.ones(n_embd, dtype=np.float32)
    w.add_tensor("token_embd.weight", t(n_vocab, n_embd))
    for i in range(n_layer):
        w.add_tensor(f"blk.{i}.attn_norm.weight", ones)
        proj(f"blk.{i}.attn_q.weight", n_embd, n_embd)
        proj(f"blk.{i}.attn_k.weight", n_kv_head * head_dim, n_embd)
        proj(f"blk.{i}.attn_v.weight", n_kv_head * head_dim, n_embd)
        proj(f"blk.{i}.attn_output.weight", n_embd, n_embd)
        w.add_tensor(f"blk.{i}.ffn_norm.weight", ones)
        proj(f"blk.{i}.ffn_gate.weight", n_ff, n_embd)
        proj(f"blk.{i}.ffn_up.weight", n_ff, n_embd)
        proj(f"blk.{i}.ffn_down.weight", n_embd, n_ff)
    w.add_tensor("output_norm.weight", ones)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    if split_max_tensors:
        return sorted(path.parent.glob(f"{path.stem}-00001-of-*.gguf"))[0]
    return path


def write_small(path: Path, *, big_endian: bool = False) -> Path:
    """A small valid GGUF (~1 KB) with every value type and three tensors, for exhaustive fuzzing."""
    import gguf

    endian = gguf.GGUFEndian.BIG if big_endian else gguf.GGUFEndian.LITTLE
    w = gguf.GGUFWriter(str(path), arch="llama", endianess=endian)
    w.add_name("small")
    w.add_uint8("test.u8", 7)
    w.add_int16("test.i16", -3)
    w.add_uint32("llama.block_count", 1)
    w.add_uint32("llama.embedding_length", 32)
    w.add_uint32("llama.attention.head_count", 2)
    w.add_int64("test.i64", -(1 << 40))
    w.add_float32("test.f32", 0.5)
    w.add_float64("test.f64", 1.25)
    w.add_bool("test.bool", True)
    w.add_array("test.ints", [1, 2, 3, 4])
    w.add_array("test.strings", ["a", "bc", "", "déjà"])
    rng = np.random.default_rng(1)
    w.add_tensor(
        "a.weight", rng.standard_normal((2, 32)).astype(np.float32), tensor_endianess=endian
    )
    w.add_tensor("b.weight", rng.standard_normal(16).astype(np.float16), tensor_endianess=endian)
    q = gguf.quants.quantize(
        rng.standard_normal((2, 32)).astype(np.float32), gguf.GGMLQuantizationType.Q8_0
    )
    w.add_tensor("c.weight", q, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@dataclass
class RawGGUF:
    """GGUF bytes assembled by hand: every count and length is whatever the test says."""

    version: int = 3
    magic: bytes = b"GGUF"
    kvs: list[bytes] = field(default_factory=list)
    tensors: list[bytes] = field(default_factory=list)
    n_kv: int | None = None  # None: the true count
    n_tensors: int | None = None
    data: bytes = b""
    alignment: int = 32

    @staticmethod
    def string(s: str | bytes, length: int | None = None) -> bytes:
        b = s.encode() if isinstance(s, str) else s
        return struct.pack("<Q", len(b) if length is None else length) + b

    def kv(self, key: str, vtype: int, payload: bytes) -> RawGGUF:
        self.kvs.append(self.string(key) + struct.pack("<I", vtype) + payload)
        return self

    def kv_u32(self, key: str, v: int) -> RawGGUF:
        return self.kv(key, ValueType.UINT32, struct.pack("<I", v))

    def kv_str(self, key: str, v: str) -> RawGGUF:
        return self.kv(key, ValueType.STRING, self.string(v))

    def tensor(
        self, name: str, shape: tuple[int, ...], ggml_type: int = 0, offset: int = 0
    ) -> RawGGUF:
        self.tensors.append(
            self.string(name)
            + struct.pack("<I", len(shape))
            + b"".join(struct.pack("<Q", d) for d in shape)
            + struct.pack("<IQ", ggml_type, offset)
        )
        return self

    def build(self) -> bytes:
        head = self.magic + struct.pack(
            "<IQQ",
            self.version,
            len(self.tensors) if self.n_tensors is None else self.n_tensors,
            len(self.kvs) if self.n_kv is None else self.n_kv,
        )
        out = head + b"".join(self.kvs) + b"".join(self.tensors)
        pad = -len(out) % self.alignment
        return out + b"\0" * pad + self.data

    def write(self, path: Path) -> Path:
        path.write_bytes(self.build())
        return path


def copy_gguf(src: Path, dst: Path, changes: dict[str, object]) -> Path:
    """A copy of a GGUF with some metadata values replaced (tensors copied byte for byte)."""
    import gguf

    reader = gguf.GGUFReader(src)
    arch = changes.get("general.architecture", reader.get_field("general.architecture").contents())
    writer = gguf.GGUFWriter(str(dst), arch=str(arch))
    for f in reader.fields.values():
        if f.name.startswith("GGUF.") or f.name == "general.architecture":
            continue
        value = changes.get(f.name, f.contents())
        name = f.name
        if name.startswith(f"{reader.get_field('general.architecture').contents()}."):
            name = f"{arch}." + name.split(".", 1)[1]
        vtype = f.types[0]
        if vtype == gguf.GGUFValueType.ARRAY:
            writer.add_key_value(name, value, vtype, sub_type=f.types[-1])
        else:
            writer.add_key_value(name, value, vtype)
    for key, value in changes.items():
        if key not in reader.fields and key != "general.architecture":
            if isinstance(value, float):
                writer.add_float32(key, value)
            elif isinstance(value, int) and not isinstance(value, bool):
                writer.add_int32(key, value)
            else:
                writer.add_string(key, str(value))
    for t in reader.tensors:
        writer.add_tensor(t.name, t.data, raw_dtype=t.tensor_type)  # byte shape for quant types
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return dst


def byte_tokens() -> list[str]:
    """GPT-2's byte-level alphabet: the token text of each byte 0..255 (`bytes_to_unicode`)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    extra = iter(range(256, 512))
    return [chr(b) if b in printable else chr(next(extra)) for b in range(256)]


def write_scripted_qwen3(path: Path, chain: list[str], template: str, *, n_embd: int = 64,
                         seed: int = 0, controls: Sequence[str] = (), words: Sequence[str] = (),
                         eos: str = "<|im_end|>") -> Path:  # fmt: skip
    """A Qwen3-architecture GGUF that answers by a script, whatever the prompt: every block adds
    nothing (attention and feed-forward outputs are zero), so the last hidden state is the last
    token's embedding, and the output head maps each token of `chain` to the next one. A prompt
    that ends in `chain[0]` makes greedy decoding produce the rest of `chain`.

    The vocabulary is GPT-2's 256 byte tokens (and one merge no text uses) and, as Qwen3's GGUF files have them,
    `<|im_start|>`, `<|im_end|>` (control; the end of generation) and `<think>`, `</think>` (user
    defined: text the detokenizer writes out); then `controls` (more control tokens) and `words`
    (normal tokens no merge makes: the script can say a word whose letters repeat)."""
    import gguf

    alphabet = byte_tokens()
    merged = alphabet[0] + alphabet[1]  # one merge (llama.cpp wants some), of bytes no text has
    tokens = [*alphabet, "<|im_start|>", "<|im_end|>", "<think>", "</think>", *controls, *words, merged]
    types = ([gguf.TokenType.NORMAL] * 256 + [gguf.TokenType.CONTROL] * 2
             + [gguf.TokenType.USER_DEFINED] * 2 + [gguf.TokenType.CONTROL] * len(controls)
             + [gguf.TokenType.NORMAL] * (len(words) + 1))  # fmt: skip
    n_vocab, n_head, n_kv, head_dim, n_ff, n_layer = len(tokens), 4, 2, 16, 128, 2
    # a special token by its text, any other step by its one byte
    ids = [tokens.index(t) if t in tokens[256:-1] else t.encode()[0] for t in chain]
    assert all(len(t.encode()) == 1 or t in tokens[256:-1] for t in chain), chain
    rng = np.random.default_rng(seed)
    embd = rng.standard_normal((n_vocab, n_embd)).astype(np.float32)
    out = rng.standard_normal((n_vocab, n_embd)).astype(np.float32) * 0.01
    for prev, nxt in zip(ids, ids[1:], strict=False):
        out[nxt] = embd[prev]  # logit of `nxt` after `prev`: |e_prev|² against ~N(0, |e|) for others
    w = gguf.GGUFWriter(str(path), arch="qwen3")
    w.add_name("scripted-qwen3")
    w.add_context_length(512)
    w.add_embedding_length(n_embd)
    w.add_block_count(n_layer)
    w.add_feed_forward_length(n_ff)
    w.add_head_count(n_head)
    w.add_head_count_kv(n_kv)
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_rope_freq_base(1000000.0)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_file_type(gguf.LlamaFileType.ALL_F32)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("qwen2")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges([f"{alphabet[0]} {alphabet[1]}"])
    w.add_eos_token_id(tokens.index(eos))
    w.add_add_bos_token(False)
    w.add_chat_template(template)

    def small(*shape: int) -> np.ndarray:
        return (rng.standard_normal(shape) * 0.1).astype(np.float32)

    ones = np.ones(n_embd, dtype=np.float32)
    w.add_tensor("token_embd.weight", embd)
    for i in range(n_layer):
        w.add_tensor(f"blk.{i}.attn_norm.weight", ones)
        w.add_tensor(f"blk.{i}.attn_q.weight", small(n_head * head_dim, n_embd))
        w.add_tensor(f"blk.{i}.attn_k.weight", small(n_kv * head_dim, n_embd))
        w.add_tensor(f"blk.{i}.attn_v.weight", small(n_kv * head_dim, n_embd))
        w.add_tensor(f"blk.{i}.attn_q_norm.weight", np.ones(head_dim, dtype=np.float32))
        w.add_tensor(f"blk.{i}.attn_k_norm.weight", np.ones(head_dim, dtype=np.float32))
        w.add_tensor(f"blk.{i}.attn_output.weight", np.zeros((n_embd, n_head * head_dim), np.float32))
        w.add_tensor(f"blk.{i}.ffn_norm.weight", ones)
        w.add_tensor(f"blk.{i}.ffn_gate.weight", small(n_ff, n_embd))
        w.add_tensor(f"blk.{i}.ffn_up.weight", small(n_ff, n_embd))
        w.add_tensor(f"blk.{i}.ffn_down.weight", np.zeros((n_embd, n_ff), np.float32))
    w.add_tensor("output_norm.weight", ones)
    w.add_tensor("output.weight", out)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def write_header_only(
    path: Path,
    *,
    arch: str = "llama",
    n_layer: int,
    n_embd: int,
    n_head: int,
    n_kv_head: int,
    n_ff: int,
    n_vocab: int,
    n_expert: int = 0,
    n_expert_used: int = 0,
    n_ctx: int = 32768,
) -> Path:
    """A full-size model's GGUF whose tensor data is a hole (a sparse file: no disk used): its
    header and tensor index are real (`gguf`'s writer), so a planner sees a 7B's or a 32B's bytes
    per layer. Projections are Q4_K (144 bytes per 256 weights), norms f32, the embedding Q6_K
    and the output matrix Q6_K (210 bytes per 256), as llama.cpp's Q4_K_M mostly makes them."""
    import gguf

    Q = gguf.GGMLQuantizationType
    w = gguf.GGUFWriter(str(path), arch=arch)
    _add_shape(w, f"header-only-{arch}-{n_layer}L", n_ctx, n_embd, n_layer, n_ff, n_head, n_kv_head)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_file_type(15)  # MOSTLY_Q4_K_M
    w.add_vocab_size(n_vocab)
    if n_expert:
        w.add_expert_count(n_expert)
        w.add_expert_used_count(n_expert_used)
        w.add_expert_feed_forward_length(n_ff)
    head_dim = n_embd // n_head
    size = 0

    def tensor(name: str, shape: tuple[int, ...], qtype: Any) -> None:
        nonlocal size
        block, per = gguf.GGML_QUANT_SIZES[qtype]
        nbytes = int(np.prod(shape[:-1])) * shape[-1] // block * per
        w.add_tensor_info(name, (*shape[:-1], shape[-1] // block * per), np.dtype(np.uint8),
                          nbytes, raw_dtype=qtype)  # fmt: skip
        size += -(-nbytes // 32) * 32

    tensor("token_embd.weight", (n_vocab, n_embd), Q.Q6_K)
    for i in range(n_layer):
        tensor(f"blk.{i}.attn_norm.weight", (n_embd,), Q.F32)
        tensor(f"blk.{i}.attn_q.weight", (n_head * head_dim, n_embd), Q.Q4_K)
        tensor(f"blk.{i}.attn_k.weight", (n_kv_head * head_dim, n_embd), Q.Q4_K)
        tensor(f"blk.{i}.attn_v.weight", (n_kv_head * head_dim, n_embd), Q.Q6_K)
        tensor(f"blk.{i}.attn_output.weight", (n_embd, n_head * head_dim), Q.Q4_K)
        tensor(f"blk.{i}.ffn_norm.weight", (n_embd,), Q.F32)
        if n_expert:
            tensor(f"blk.{i}.ffn_gate_inp.weight", (n_expert, n_embd), Q.F32)
            tensor(f"blk.{i}.ffn_gate_exps.weight", (n_expert, n_ff, n_embd), Q.Q4_K)
            tensor(f"blk.{i}.ffn_up_exps.weight", (n_expert, n_ff, n_embd), Q.Q4_K)
            tensor(f"blk.{i}.ffn_down_exps.weight", (n_expert, n_embd, n_ff), Q.Q6_K)
        else:
            tensor(f"blk.{i}.ffn_gate.weight", (n_ff, n_embd), Q.Q4_K)
            tensor(f"blk.{i}.ffn_up.weight", (n_ff, n_embd), Q.Q4_K)
            tensor(f"blk.{i}.ffn_down.weight", (n_embd, n_ff), Q.Q6_K)
    tensor("output_norm.weight", (n_embd,), Q.F32)
    tensor("output.weight", (n_vocab, n_embd), Q.Q6_K)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    w.close()
    with open(path, "r+b") as f:  # the data section: a hole of the tensors' size
        header = f.seek(0, 2)
        f.truncate(-(-header // 32) * 32 + size)
    return path
