"""Hardened GGUF reading: agrees with gguf-py on real files; every hostile input is one GGUFFormatError."""

from __future__ import annotations

import random
import struct
import time
import tracemalloc
from collections.abc import Callable
from pathlib import Path

import pytest

from localllm.errors import GGUFFormatError, LocalLLMError
from localllm.gguf_file import (
    FILE_TYPES,
    GGML_TYPES,
    GGUFFile,
    StringArray,
    ValueType,
    read_gguf,
)

from ggufs import RawGGUF

U64_HUGE = 1 << 63


def _plain(v: object) -> object:
    if isinstance(v, StringArray):
        return v.tolist()
    if hasattr(v, "tolist"):
        return v.tolist()
    return v


def _reference(path: Path) -> tuple[dict, dict]:
    """What gguf-py (an independent reader) sees: metadata values and the tensor index."""
    import gguf

    r = gguf.GGUFReader(str(path))
    meta = {}
    for key, f in r.fields.items():
        if key.startswith("GGUF."):
            continue
        v = f.contents()
        meta[key] = v
    tensors = {
        t.name: ([int(d) for d in t.shape], int(t.tensor_type), int(t.data_offset), int(t.n_bytes))
        for t in r.tensors
    }
    return meta, tensors


@pytest.mark.parametrize(
    "which", ["default_model_path", "gemma_model_path", "tiny_llama", "small_gguf"]
)
def test_matches_gguf_py(which: str, request: pytest.FixtureRequest) -> None:
    path = request.getfixturevalue(which)
    ref_meta, ref_tensors = _reference(path)
    with GGUFFile(path) as gf:
        assert gf.version == 3
        assert {k: _plain(v) for k, v in gf.metadata.items()} == ref_meta
        ours = {
            t.name: (list(t.shape), t.ggml_type.id, t.offset, t.nbytes) for t in gf.tensors.values()
        }
        assert ours == ref_tensors
        assert list(gf.tensors) == list(ref_tensors)  # file order kept


def test_big_endian_reads_the_same(small_gguf: Path, tmp_path: Path) -> None:
    from ggufs import write_small

    be = read_gguf(write_small(tmp_path / "be.gguf", big_endian=True))
    le = read_gguf(small_gguf)
    assert be.byte_order == ">" and le.byte_order == "<"
    assert {k: _plain(v) for k, v in be.metadata.items()} == {
        k: _plain(v) for k, v in le.metadata.items()
    }


def test_type_tables_match_gguf_py() -> None:
    import gguf

    for t in GGML_TYPES.values():
        qt = gguf.GGMLQuantizationType(t.id)
        assert qt.name == t.name
        if t.name != "Q8_1":  # gguf-py still says 40 bytes; ggml's block_q8_1 is 2 halves + 32 = 36
            assert gguf.GGML_QUANT_SIZES[qt] == (t.block_size, t.type_size)
    for ft, name in FILE_TYPES.items():
        assert gguf.LlamaFileType(ft).name == f"MOSTLY_{name}" or name == "F32"


def test_tensor_bytes_and_metadata_survive_close(small_gguf: Path) -> None:
    import numpy as np

    with GGUFFile(small_gguf) as gf:
        raw = bytes(gf.tensor_bytes("b.weight"))
        strings = gf.metadata["test.strings"]
    assert np.frombuffer(raw, dtype=np.float16).shape == (16,)
    assert strings.tolist() == ["a", "bc", "", "déjà"] and strings[-1] == "déjà"
    with pytest.raises(ValueError):
        gf.tensor_bytes("b.weight")


# -- hostile input ----------------------------------------------------------------------------


def _read_bounded(path: Path, trace_memory: bool = True) -> GGUFFile | GGUFFormatError:
    """Parse `path`: a GGUFFile or the GGUFFormatError, within 1 s and (when traced) with peak
    memory bounded by the file size. tracemalloc slows parsing many-fold, so time is taken on an
    untraced parse and memory on a second, traced one."""
    outcome: list[GGUFFile | GGUFFormatError] = []
    for traced in (False, True) if trace_memory else (False,):
        if traced:
            tracemalloc.start()
        t0 = time.perf_counter()
        try:
            outcome.append(read_gguf(path))
        except GGUFFormatError as e:
            outcome.append(e)
        finally:
            elapsed = time.perf_counter() - t0
            if traced:
                _, peak = tracemalloc.get_traced_memory()
                tracemalloc.stop()
                assert peak < 2 * path.stat().st_size + (1 << 20), f"peak {peak} bytes"
            else:
                assert elapsed < 1.0, f"took {elapsed:.2f}s"
    return outcome[0]


def _assert_rejected(path: Path, reason: str, trace_memory: bool = True) -> GGUFFormatError:
    """GGUFFormatError naming the file and the reason, in one line."""
    err = _read_bounded(path, trace_memory)
    assert isinstance(err, GGUFFormatError), f"{path.name} was accepted"
    assert path.name in str(err) and reason in str(err), str(err)
    assert "\n" not in str(err)
    return err


def _valid_prefix() -> RawGGUF:
    return RawGGUF().kv_str("general.architecture", "llama")


HOSTILE: dict[str, tuple[Callable[[], bytes], str]] = {
    "empty": (lambda: b"", "empty"),
    "three bytes": (lambda: b"GGU", "truncated"),
    "wrong magic": (lambda: RawGGUF(magic=b"GGML").build(), "wrong magic"),
    "version 1": (lambda: RawGGUF(version=1).build(), "version 1"),
    "unknown version": (lambda: RawGGUF(version=99).build(), "unsupported GGUF version 99"),
    "kv count 2^63": (lambda: RawGGUF(n_kv=U64_HUGE).build(), "metadata count"),
    "tensor count 2^63": (lambda: RawGGUF(n_tensors=U64_HUGE).build(), "tensor count"),
    "kv count past the data": (
        lambda: RawGGUF(n_kv=3, data=bytes(64)).kv_u32("a", 1).build(),
        "key #1",
    ),
    "key length 2^63": (
        lambda: b"GGUF" + struct.pack("<IQQQ", 3, 0, 1, U64_HUGE) + b"abc" + bytes(64),
        "claims",
    ),
    "string length 2^63 with 3 bytes": (
        lambda: _valid_prefix().kv("x", ValueType.STRING, RawGGUF.string(b"abc", U64_HUGE)).build(),
        "claims",
    ),
    "array length 2^63": (
        lambda: (
            _valid_prefix()
            .kv("x", ValueType.ARRAY, struct.pack("<IQ", ValueType.UINT8, U64_HUGE))
            .build()
        ),
        "claims",
    ),
    "string array length 2^63": (
        lambda: (
            _valid_prefix()
            .kv("x", ValueType.ARRAY, struct.pack("<IQ", ValueType.STRING, U64_HUGE))
            .build()
        ),
        "claims",
    ),
    "nested array": (
        lambda: (
            _valid_prefix()
            .kv(
                "x",
                ValueType.ARRAY,
                struct.pack("<IQ", ValueType.ARRAY, 1) + struct.pack("<IQ", 0, 0),
            )
            .build()
        ),
        "nested arrays",
    ),
    "unknown value type": (
        lambda: _valid_prefix().kv("x", 77, b"\0" * 8).build(),
        "unknown value type",
    ),
    "duplicate key": (
        lambda: _valid_prefix().kv_u32("k", 1).kv_u32("k", 2).build(),
        "duplicate key",
    ),
    "key not utf-8": (lambda: _raw_key(b"\xff\xfe"), "not valid UTF-8"),
    "bad alignment": (lambda: _valid_prefix().kv_u32("general.alignment", 24).build(), "alignment"),
    "zero alignment": (lambda: _valid_prefix().kv_u32("general.alignment", 0).build(), "alignment"),
    "dimension product overflows": (
        lambda: _valid_prefix().tensor("t", (1 << 32, 1 << 32, 1 << 32)).build(),
        "impossible shape",
    ),
    "too many dimensions": (
        lambda: _valid_prefix().tensor("t", (1, 1, 1, 1, 1)).build(),
        "dimensions",
    ),
    "zero dimension": (lambda: _valid_prefix().tensor("t", (4, 0)).build(), "zero dimension"),
    "unknown tensor type": (
        lambda: _valid_prefix().tensor("t", (4,), ggml_type=4).build(),
        "unknown type",
    ),
    "row not a block multiple": (
        lambda: _valid_prefix().tensor("t", (33,), ggml_type=8).build(),
        "block size",
    ),
    "offset past the end": (
        lambda: _valid_prefix().tensor("t", (8,), offset=1 << 40).build(),
        "past the end",
    ),
    "data past the end": (lambda: _valid_prefix().tensor("t", (1 << 20,)).build(), "past the end"),
    "unaligned offset": (lambda: _tensor_file(offsets=(4,)), "not aligned"),
    "overlapping tensors": (lambda: _tensor_file(offsets=(0, 0)), "overlap"),
    "duplicate tensor": (
        lambda: _tensor_file(offsets=(0, 32), names=("t", "t")),
        "duplicate tensor",
    ),
    "long tensor name": (lambda: _valid_prefix().tensor("x" * 64, (8,)).build(), "claims"),
}


def _raw_key(key: bytes) -> bytes:
    r = RawGGUF()
    r.kvs.append(RawGGUF.string(key) + struct.pack("<II", ValueType.UINT32, 1))
    return r.build()


def _tensor_file(offsets: tuple[int, ...], names: tuple[str, ...] | None = None) -> bytes:
    r = _valid_prefix()
    for i, off in enumerate(offsets):
        r.tensor(names[i] if names else f"t{i}", (8,), offset=off)
    r.data = b"\0" * 64
    return r.build()


@pytest.mark.parametrize("case", sorted(HOSTILE))
def test_hostile_headers(case: str, tmp_path: Path) -> None:
    make, reason = HOSTILE[case]
    path = tmp_path / "hostile.gguf"
    path.write_bytes(make())
    _assert_rejected(path, reason)


def test_missing_file_and_directory(tmp_path: Path) -> None:
    with pytest.raises(LocalLLMError, match="no such file"):
        read_gguf(tmp_path / "nope.gguf")
    with pytest.raises(LocalLLMError, match="is a directory"):
        read_gguf(tmp_path)


def _snapshot(gf: GGUFFile) -> tuple:
    return (
        {k: _plain(v) for k, v in gf.metadata.items()},
        [(t.name, t.shape, t.ggml_type.id, t.offset, t.nbytes) for t in gf.tensors.values()],
    )


def test_truncated_at_every_offset(small_gguf: Path, tmp_path: Path) -> None:
    data = small_gguf.read_bytes()
    whole = _snapshot(read_gguf(small_gguf))
    last_tensor_end = max(t.offset + t.nbytes for t in read_gguf(small_gguf).tensors.values())
    path = tmp_path / "cut.gguf"
    errors = reads = 0
    for n in range(len(data)):
        path.write_bytes(data[:n])
        try:
            gf = read_gguf(path)
        except GGUFFormatError:
            errors += 1
            continue
        # only cuts in the padding after the last tensor can still be read, and then correctly
        assert n >= last_tensor_end, n
        assert _snapshot(gf) == whole
        reads += 1
    assert errors + reads == len(data) and errors >= last_tensor_end


def test_truncated_real_model_header(tiny_llama: Path, tmp_path: Path) -> None:
    """Cuts inside a real vocabulary (49,152 tokens, 48,900 merges) fail fast, with bounded memory."""
    data = tiny_llama.read_bytes()
    header_end = min(t.offset for t in read_gguf(tiny_llama).tensors.values())
    rng = random.Random(7)
    path = tmp_path / "cut.gguf"
    for i, n in enumerate(sorted(rng.sample(range(header_end + 64), 60))):
        path.write_bytes(data[:n])
        _assert_rejected(path, "", trace_memory=i % 6 == 0)


def _check_invariants(gf: GGUFFile) -> None:
    spans = sorted((t.offset, t.offset + t.nbytes) for t in gf.tensors.values())
    for a, b in zip(spans, spans[1:]):
        assert a[1] <= b[0]
    assert all(end <= gf.file_size for _, end in spans)
    for v in gf.metadata.values():
        _plain(v)  # every value is materialisable


@pytest.mark.parametrize("which", ["small_gguf", "tiny_llama"])
def test_300_seeded_bit_flips(which: str, request: pytest.FixtureRequest, tmp_path: Path) -> None:
    src: Path = request.getfixturevalue(which)
    data = bytearray(src.read_bytes())
    header_end = min(t.offset for t in read_gguf(src).tensors.values())
    rng = random.Random(2024)
    path = tmp_path / "flipped.gguf"
    outcome = {"error": 0, "read": 0}
    small = len(data) < 1 << 16
    for i in range(300):
        bit = rng.randrange(header_end * 8)
        flipped = bytearray(data)
        flipped[bit // 8] ^= 1 << (bit % 8)
        path.write_bytes(flipped)
        result = _read_bounded(path, trace_memory=small or i % 20 == 0)
        if isinstance(result, GGUFFormatError):
            assert path.name in str(result)
            outcome["error"] += 1
        else:
            _check_invariants(result)
            outcome["read"] += 1
    print(f"bit flips in {which}: {outcome}")
    assert outcome["error"] + outcome["read"] == 300
