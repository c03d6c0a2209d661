"""Hardened GGUF reading: metadata and the tensor index, for every caller.

Every GGUF is hostile until read here. Before anything is allocated, each count, length, dimension
product and tensor extent is checked against the file size and sane caps, so a 2^63 array length or a
string that claims more bytes than the file has fails at once instead of hanging or eating memory.
Every failure is one `GGUFFormatError(path, reason)`.

The file is memory-mapped and parsed lazily: reading metadata never touches tensor data. Metadata
values are copied out of the map (numeric arrays as `array.array`, string arrays as a lazily decoded
`StringArray`), so they stay valid after `close()` and cost at most about twice the header's bytes.

Layout (GGUF v2/v3, little- or big-endian):
    magic "GGUF" | u32 version | u64 n_tensors | u64 n_kv
    n_kv × (string key | u32 value type | value)
    n_tensors × (string name | u32 n_dims | n_dims × u64 ne | u32 ggml type | u64 offset)
    padding to `general.alignment` (default 32) | tensor data (offsets relative to here)
"""

from __future__ import annotations

import contextlib
import mmap
import os
import stat
import struct
import sys
from array import array
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from enum import IntEnum
from typing import Any, overload

from localllm.errors import GGUFFormatError, LocalLLMError

GGUF_MAGIC = b"GGUF"
SUPPORTED_VERSIONS = (2, 3)
DEFAULT_ALIGNMENT = 32
MAX_ALIGNMENT = 1 << 20
MAX_STRING_BYTES = 1 << 26  # 64 MiB: no real key, template or token is near this
MAX_DIMS = 4  # GGML_MAX_DIMS
MAX_TENSOR_NAME_BYTES = 63  # GGML_MAX_NAME is 64 including the NUL
MAX_ELEMENTS = 1 << 62

# The smallest possible encodings, used to reject impossible counts before looping over them.
_MIN_KV_BYTES = 8 + 1 + 4 + 1  # key length, 1-byte key, value type, 1-byte value
_MIN_TENSOR_INFO_BYTES = 8 + 1 + 4 + 4 + 8  # name length, 1-byte name, n_dims, type, offset


class ValueType(IntEnum):
    UINT8 = 0
    INT8 = 1
    UINT16 = 2
    INT16 = 3
    UINT32 = 4
    INT32 = 5
    FLOAT32 = 6
    BOOL = 7
    STRING = 8
    ARRAY = 9
    UINT64 = 10
    INT64 = 11
    FLOAT64 = 12


# struct format and array typecode per scalar type (bools are stored as one byte)
_SCALAR: dict[ValueType, tuple[str, str]] = {
    ValueType.UINT8: ("B", "B"),
    ValueType.INT8: ("b", "b"),
    ValueType.UINT16: ("H", "H"),
    ValueType.INT16: ("h", "h"),
    ValueType.UINT32: ("I", "I"),
    ValueType.INT32: ("i", "i"),
    ValueType.FLOAT32: ("f", "f"),
    ValueType.BOOL: ("B", "B"),
    ValueType.UINT64: ("Q", "Q"),
    ValueType.INT64: ("q", "q"),
    ValueType.FLOAT64: ("d", "d"),
}


@dataclass(frozen=True)
class GGMLType:
    """A tensor element type: `block_size` elements take `type_size` bytes."""

    id: int
    name: str
    block_size: int
    type_size: int

    def nbytes(self, n_elements: int) -> int:
        return n_elements // self.block_size * self.type_size


# ggml's type table (ggml.h `enum ggml_type`); ids of removed types are absent on purpose.
GGML_TYPES: dict[int, GGMLType] = {
    t.id: t
    for t in (
        GGMLType(0, "F32", 1, 4),
        GGMLType(1, "F16", 1, 2),
        GGMLType(2, "Q4_0", 32, 18),
        GGMLType(3, "Q4_1", 32, 20),
        GGMLType(6, "Q5_0", 32, 22),
        GGMLType(7, "Q5_1", 32, 24),
        GGMLType(8, "Q8_0", 32, 34),
        GGMLType(9, "Q8_1", 32, 36),
        GGMLType(10, "Q2_K", 256, 84),
        GGMLType(11, "Q3_K", 256, 110),
        GGMLType(12, "Q4_K", 256, 144),
        GGMLType(13, "Q5_K", 256, 176),
        GGMLType(14, "Q6_K", 256, 210),
        GGMLType(15, "Q8_K", 256, 292),
        GGMLType(16, "IQ2_XXS", 256, 66),
        GGMLType(17, "IQ2_XS", 256, 74),
        GGMLType(18, "IQ3_XXS", 256, 98),
        GGMLType(19, "IQ1_S", 256, 50),
        GGMLType(20, "IQ4_NL", 32, 18),
        GGMLType(21, "IQ3_S", 256, 110),
        GGMLType(22, "IQ2_S", 256, 82),
        GGMLType(23, "IQ4_XS", 256, 136),
        GGMLType(24, "I8", 1, 1),
        GGMLType(25, "I16", 1, 2),
        GGMLType(26, "I32", 1, 4),
        GGMLType(27, "I64", 1, 8),
        GGMLType(28, "F64", 1, 8),
        GGMLType(29, "IQ1_M", 256, 56),
        GGMLType(30, "BF16", 1, 2),
        GGMLType(34, "TQ1_0", 256, 54),
        GGMLType(35, "TQ2_0", 256, 66),
        GGMLType(39, "MXFP4", 32, 17),
    )
}
GGML_TYPE_BY_NAME: dict[str, GGMLType] = {t.name: t for t in GGML_TYPES.values()}

# `general.file_type` (llama.h `enum llama_ftype`): what a quantization is called.
FILE_TYPES: dict[int, str] = {
    0: "F32", 1: "F16", 2: "Q4_0", 3: "Q4_1", 7: "Q8_0", 8: "Q5_0", 9: "Q5_1",
    10: "Q2_K", 11: "Q3_K_S", 12: "Q3_K_M", 13: "Q3_K_L", 14: "Q4_K_S", 15: "Q4_K_M",
    16: "Q5_K_S", 17: "Q5_K_M", 18: "Q6_K", 19: "IQ2_XXS", 20: "IQ2_XS", 21: "Q2_K_S",
    22: "IQ3_XS", 23: "IQ3_XXS", 24: "IQ1_S", 25: "IQ4_NL", 26: "IQ3_S", 27: "IQ3_M",
    28: "IQ2_S", 29: "IQ2_M", 30: "IQ4_XS", 31: "IQ1_M", 32: "BF16", 36: "TQ1_0",
    37: "TQ2_0", 38: "MXFP4_MOE",
}  # fmt: skip


class StringArray(Sequence[str]):
    """A GGUF string array, decoded on access. Holds its raw bytes and one offset per item."""

    __slots__ = ("_data", "_starts")

    def __init__(self, data: bytes, starts: array) -> None:
        self._data = data  # the whole array as stored: (u64 length, bytes) × n
        self._starts = starts  # where each item's bytes begin in `_data`

    def __len__(self) -> int:
        return len(self._starts)

    def _item(self, i: int) -> str:
        start = self._starts[i]
        end = self._starts[i + 1] - 8 if i + 1 < len(self._starts) else len(self._data)
        return self._data[start:end].decode("utf-8", "surrogateescape")

    @overload
    def __getitem__(self, i: int) -> str: ...
    @overload
    def __getitem__(self, i: slice) -> list[str]: ...
    def __getitem__(self, i: int | slice) -> str | list[str]:
        if isinstance(i, slice):
            return [self._item(j) for j in range(*i.indices(len(self)))]
        if i < 0:
            i += len(self)
        if not 0 <= i < len(self):
            raise IndexError(i)
        return self._item(i)

    def __iter__(self) -> Iterator[str]:
        return (self._item(i) for i in range(len(self)))

    def tolist(self) -> list[str]:
        return list(self)

    def __repr__(self) -> str:
        return f"StringArray(n={len(self)})"


@dataclass(frozen=True)
class TensorInfo:
    """One tensor of the index. `shape` is in ggml order: shape[0] varies fastest."""

    name: str
    shape: tuple[int, ...]
    ggml_type: GGMLType
    offset: int  # absolute position in the file
    nbytes: int

    @property
    def n_elements(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n


class _Cursor:
    """Bounds-checked reads from the mapped header. Every read checks the file size first."""

    def __init__(self, buf: Any, size: int, path: str, byte_order: str = "<") -> None:
        self.buf, self.size, self.path, self.pos = buf, size, path, 0
        self.set_byte_order(byte_order)

    def set_byte_order(self, byte_order: str) -> None:
        self.byte_order = byte_order
        self._u32 = struct.Struct(byte_order + "I")
        self._u64 = struct.Struct(byte_order + "Q")

    def fail(self, reason: str) -> GGUFFormatError:
        return GGUFFormatError(self.path, reason)

    def need(self, n: int, what: str) -> None:
        if n > self.size - self.pos:
            raise self.fail(
                f"truncated: {what} needs {n} bytes at offset {self.pos}, file has {self.size}"
            )

    def take(self, n: int, what: str) -> bytes:
        self.need(n, what)
        out = bytes(self.buf[self.pos : self.pos + n])
        self.pos += n
        return out

    def u32(self, what: str) -> int:
        self.need(4, what)
        (v,) = self._u32.unpack_from(self.buf, self.pos)
        self.pos += 4
        return v

    def u64(self, what: str) -> int:
        self.need(8, what)
        (v,) = self._u64.unpack_from(self.buf, self.pos)
        self.pos += 8
        return v

    def raw_string(self, what: str, limit: int = MAX_STRING_BYTES) -> bytes:
        n = self.u64(f"length of {what}")
        if n > limit:
            raise self.fail(f"{what} claims {n} bytes (limit {limit})")
        return self.take(n, what)

    def text(self, what: str, limit: int = MAX_STRING_BYTES) -> str:
        raw = self.raw_string(what, limit)
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            raise self.fail(f"{what} is not valid UTF-8") from None

    def value(self, vtype: int, key: str, in_array: bool = False) -> Any:
        if vtype == ValueType.STRING:
            return self.raw_string(f"value of {key!r}").decode("utf-8", "surrogateescape")
        if vtype == ValueType.ARRAY:
            if in_array:
                raise self.fail(f"nested arrays are not supported (key {key!r})")
            return self.array(key)
        if vtype not in _SCALAR:
            raise self.fail(f"unknown value type {vtype} for key {key!r}")
        fmt = _SCALAR[ValueType(vtype)][0]
        size = struct.calcsize(fmt)
        self.need(size, f"value of {key!r}")
        (v,) = struct.unpack_from(self.byte_order + fmt, self.buf, self.pos)
        self.pos += size
        return bool(v) if vtype == ValueType.BOOL else v

    def array(self, key: str) -> array | StringArray:
        itype = self.u32(f"item type of {key!r}")
        count = self.u64(f"item count of {key!r}")
        remaining = self.size - self.pos
        if itype == ValueType.STRING:
            if count > remaining // 8:
                raise self.fail(f"array {key!r} claims {count} strings, file has room for fewer")
            return self.string_array(count, key)
        if itype == ValueType.ARRAY:
            raise self.fail(f"nested arrays are not supported (key {key!r})")
        if itype not in _SCALAR:
            raise self.fail(f"unknown item type {itype} in array {key!r}")
        fmt, code = _SCALAR[ValueType(itype)]
        size = struct.calcsize(fmt)
        if count > remaining // size:
            raise self.fail(f"array {key!r} claims {count} items, file has room for fewer")
        out = array(code)
        out.frombytes(self.buf[self.pos : self.pos + count * size])
        if (self.byte_order == ">") != (sys.byteorder == "big"):
            out.byteswap()
        self.pos += count * size
        return out

    def string_array(self, count: int, key: str) -> StringArray:
        start = pos = self.pos
        buf, end, unpack = self.buf, self.size, self._u64.unpack_from
        starts = array("Q")
        for i in range(count):
            if pos + 8 > end:
                raise self.fail(f"truncated: item {i} of array {key!r} at offset {pos}")
            (n,) = unpack(buf, pos)
            pos += 8
            if n > MAX_STRING_BYTES or n > end - pos:
                raise self.fail(f"item {i} of array {key!r} claims {n} bytes at offset {pos}")
            starts.append(pos - start)
            pos += n
        self.pos = pos
        return StringArray(bytes(buf[start:pos]), starts)


class GGUFFile:
    """A parsed GGUF file: `metadata`, `tensors` (in file order) and access to tensor bytes.

    Use as a context manager, or call `close()`; metadata stays usable after closing.
    """

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = os.fspath(path)
        self._map: mmap.mmap | None = None
        try:
            fd = os.open(self.path, os.O_RDONLY)
        except FileNotFoundError:
            raise LocalLLMError(f"no such file: {self.path}") from None
        except OSError as e:
            raise LocalLLMError(f"cannot open {self.path}: {e.strerror}") from None
        try:
            st = os.fstat(fd)
            if stat.S_ISDIR(st.st_mode):
                raise LocalLLMError(f"{self.path} is a directory, not a GGUF file")
            if not stat.S_ISREG(st.st_mode):
                raise GGUFFormatError(self.path, "not a regular file")
            self.file_size = st.st_size
            if self.file_size == 0:
                raise GGUFFormatError(self.path, "the file is empty")
            self._map = mmap.mmap(fd, 0, access=mmap.ACCESS_READ)
        except OSError as e:
            raise GGUFFormatError(self.path, f"cannot map the file: {e.strerror}") from None
        finally:
            os.close(fd)
        try:
            self._parse()
        except GGUFFormatError:
            self.close()
            raise
        except Exception as e:  # a bug here must still be one line naming the file
            self.close()
            raise GGUFFormatError(self.path, f"unreadable header ({type(e).__name__}: {e})") from e

    # -- parsing -----------------------------------------------------------------------------

    def _parse(self) -> None:
        c = _Cursor(self._map, self.file_size, self.path)
        magic = c.take(4, "magic")
        if magic != GGUF_MAGIC:
            raise c.fail(f"wrong magic bytes {magic!r} (expected {GGUF_MAGIC!r})")
        raw = c.take(4, "version")
        little, big = int.from_bytes(raw, "little"), int.from_bytes(raw, "big")
        if little in SUPPORTED_VERSIONS:
            self.version, self.byte_order = little, "<"
        elif big in SUPPORTED_VERSIONS:
            self.version, self.byte_order = big, ">"
            c.set_byte_order(">")
        elif little == 1:
            raise c.fail("GGUF version 1 is obsolete and not supported; convert the model again")
        else:
            raise c.fail(f"unsupported GGUF version {little}")

        n_tensors = c.u64("tensor count")
        n_kv = c.u64("metadata count")
        room = self.file_size - c.pos
        if n_kv > room // _MIN_KV_BYTES:
            raise c.fail(f"metadata count {n_kv} is impossible in a file of {self.file_size} bytes")
        if n_tensors > room // _MIN_TENSOR_INFO_BYTES:
            raise c.fail(
                f"tensor count {n_tensors} is impossible in a file of {self.file_size} bytes"
            )

        metadata: dict[str, Any] = {}
        spans: dict[str, tuple[int, int]] = {}
        for i in range(n_kv):
            start = c.pos
            key = c.text(f"key #{i}", limit=1 << 16)
            if not key:
                raise c.fail(f"key #{i} is empty")
            if key in metadata:
                raise c.fail(f"duplicate key {key!r}")
            metadata[key] = c.value(c.u32(f"type of {key!r}"), key)
            spans[key] = (start, c.pos)
        self.metadata = metadata
        self.kv_spans = spans  # where each entry's bytes lie: to copy metadata verbatim

        alignment = metadata.get("general.alignment", DEFAULT_ALIGNMENT)
        if (
            not isinstance(alignment, int)
            or isinstance(alignment, bool)
            or not 0 < alignment <= MAX_ALIGNMENT
            or alignment & (alignment - 1)
        ):
            raise c.fail(f"bad general.alignment {alignment!r} (must be a power of two)")
        self.alignment = alignment

        infos: list[tuple[str, tuple[int, ...], GGMLType, int, int]] = []
        seen: set[str] = set()
        for i in range(n_tensors):
            name = c.text(f"name of tensor #{i}", limit=MAX_TENSOR_NAME_BYTES)
            if not name:
                raise c.fail(f"tensor #{i} has an empty name")
            if name in seen:
                raise c.fail(f"duplicate tensor {name!r}")
            seen.add(name)
            n_dims = c.u32(f"dimension count of {name!r}")
            if n_dims > MAX_DIMS:
                raise c.fail(f"tensor {name!r} has {n_dims} dimensions (at most {MAX_DIMS})")
            shape = tuple(c.u64(f"dimension of {name!r}") for _ in range(n_dims))
            n_el = 1
            for d in shape:
                if d == 0:
                    raise c.fail(f"tensor {name!r} has a zero dimension {shape}")
                n_el *= d
                if n_el > MAX_ELEMENTS:
                    raise c.fail(f"tensor {name!r} has an impossible shape {shape}")
            type_id = c.u32(f"type of {name!r}")
            gtype = GGML_TYPES.get(type_id)
            if gtype is None:
                raise c.fail(f"tensor {name!r} has unknown type {type_id}")
            if shape and shape[0] % gtype.block_size:
                raise c.fail(
                    f"tensor {name!r}: row of {shape[0]} is not a multiple of the "
                    f"{gtype.name} block size {gtype.block_size}"
                )
            offset = c.u64(f"offset of {name!r}")
            if offset % alignment:
                raise c.fail(f"tensor {name!r} offset {offset} is not aligned to {alignment}")
            infos.append((name, shape, gtype, offset, gtype.nbytes(n_el)))

        self.data_offset = -(-c.pos // alignment) * alignment
        tensors: dict[str, TensorInfo] = {}
        for name, shape, gtype, offset, nbytes in infos:
            start = self.data_offset + offset
            if start + nbytes > self.file_size:
                raise c.fail(
                    f"tensor {name!r} extends past the end of the file "
                    f"(needs {start + nbytes} bytes, file has {self.file_size})"
                )
            tensors[name] = TensorInfo(name, shape, gtype, start, nbytes)
        by_offset = sorted(tensors.values(), key=lambda t: t.offset)
        for a, b in zip(by_offset, by_offset[1:]):
            if b.offset < a.offset + a.nbytes:
                raise c.fail(f"tensors {a.name!r} and {b.name!r} overlap")
        self.tensors = tensors

    # -- access --------------------------------------------------------------------------------

    def tensor_bytes(self, name: str) -> memoryview:
        """The raw bytes of one tensor, a view into the map (valid until `close()`)."""
        if self._map is None:
            raise ValueError("GGUF file is closed")
        t = self.tensors[name]
        return memoryview(self._map)[t.offset : t.offset + t.nbytes]

    def kv_bytes(self, key: str) -> bytes:
        """One metadata entry exactly as the file holds it (key, type and value), to copy it."""
        if self._map is None:
            raise ValueError("GGUF file is closed")
        a, b = self.kv_spans[key]
        return bytes(self._map[a:b])

    def get(self, key: str, default: Any = None) -> Any:
        return self.metadata.get(key, default)

    @property
    def architecture(self) -> str:
        arch = self.metadata.get("general.architecture")
        if not isinstance(arch, str) or not arch:
            raise GGUFFormatError(self.path, "general.architecture is missing")
        return arch

    def arch_get(self, suffix: str, default: Any = None) -> Any:
        """`{architecture}.{suffix}`, e.g. `arch_get("block_count")`."""
        return self.metadata.get(f"{self.architecture}.{suffix}", default)

    def close(self) -> None:
        if self._map is not None:
            # a tensor view still alive keeps the map open until it dies
            with contextlib.suppress(BufferError):
                self._map.close()
            self._map = None

    def __enter__(self) -> GGUFFile:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return (
            f"GGUFFile({os.path.basename(self.path)!r}, v{self.version}, "
            f"{len(self.metadata)} keys, {len(self.tensors)} tensors)"
        )


def read_gguf(path: str | os.PathLike[str]) -> GGUFFile:
    """Parse a GGUF's header and close the file: metadata and tensor index only."""
    with GGUFFile(path) as f:
        return f
