"""Join a split GGUF (`NAME-00001-of-0000N.gguf`, as written by `llama-gguf-split`) into one file.

Each part is a GGUF of its own: the first holds the model's metadata, every part holds some tensors
and `split.no`, `split.count`, `split.tensors.count`. The joined file has the first part's metadata
without the `split.*` keys (copied byte for byte), the tensors of all parts in order, each at an
offset aligned the way the first part declares, and the same tensor bytes.

Every part is parsed by the hardened reader first, and the parts must agree with each other (count,
numbering, tensor total, no tensor twice): a part from another model or a renamed file is refused.
"""

from __future__ import annotations

import os
import struct
from collections.abc import Sequence

from localllm.errors import GGUFFormatError, LocalLLMError
from localllm.gguf_file import GGUF_MAGIC, GGUFFile

SPLIT_KEYS = ("split.no", "split.count", "split.tensors.count")
_COPY = 8 << 20


def split_info(gf: GGUFFile) -> tuple[int, int, int] | None:
    """(split.no, split.count, split.tensors.count) of a part, or None for an unsplit file."""
    if "split.count" not in gf.metadata:
        return None
    vals = [gf.metadata.get(k) for k in SPLIT_KEYS]
    if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in vals):
        raise GGUFFormatError(gf.path, f"bad split keys {dict(zip(SPLIT_KEYS, vals))}")
    return vals[0], vals[1], vals[2]


def merge_split(parts: Sequence[str | os.PathLike[str]], out: str | os.PathLike[str]) -> None:
    """Write the parts, given in order, as one GGUF at `out` (created; must not exist)."""
    files = [GGUFFile(p) for p in parts]
    try:
        _check(files)
        first = files[0]
        align = first.alignment
        kv = [(k, first.kv_spans[k]) for k in first.metadata if k not in SPLIT_KEYS]
        tensors = [t for gf in files for t in gf.tensors.values()]

        header = bytearray()
        header += GGUF_MAGIC + struct.pack("<IQQ", first.version, len(tensors), len(kv))
        for _key, (a, b) in kv:
            header += first._map[a:b]
        offsets, pos = [], 0
        for t in tensors:
            offsets.append(pos)
            pos += -(-t.nbytes // align) * align
        for t, off in zip(tensors, offsets):
            name = t.name.encode()
            header += struct.pack("<Q", len(name)) + name + struct.pack("<I", len(t.shape))
            header += struct.pack(f"<{len(t.shape)}Q", *t.shape)
            header += struct.pack("<IQ", t.ggml_type.id, off)
        header += b"\0" * (-len(header) % align)

        by_name = {t.name: gf for gf in files for t in gf.tensors.values()}
        with open(out, "xb") as f:
            f.write(header)
            for t in tensors:
                src = by_name[t.name]._map
                for a in range(t.offset, t.offset + t.nbytes, _COPY):
                    f.write(src[a : min(a + _COPY, t.offset + t.nbytes)])
                f.write(b"\0" * (-t.nbytes % align))
            f.flush()
            os.fsync(f.fileno())
    finally:
        for gf in files:
            gf.close()


def _check(files: list[GGUFFile]) -> None:
    n = len(files)
    total = 0
    seen: set[str] = set()
    for i, gf in enumerate(files):
        if gf.byte_order != "<":
            raise GGUFFormatError(gf.path, "joining big-endian split files is not supported")
        info = split_info(gf)
        if info is None:
            raise GGUFFormatError(gf.path, "not part of a split GGUF (no split.count)")
        no, count, n_tensors = info
        if no != i or count != n:
            raise GGUFFormatError(
                gf.path, f"part {no + 1} of {count}, but it was given as part {i + 1} of {n}"
            )
        if n_tensors != split_info(files[0])[2]:
            raise GGUFFormatError(gf.path, "its tensor count disagrees with the first part's")
        for name in gf.tensors:
            if name in seen:
                raise GGUFFormatError(gf.path, f"tensor {name!r} is in two parts")
            seen.add(name)
        total += len(gf.tensors)
    if total != split_info(files[0])[2]:
        raise LocalLLMError(
            f"the parts hold {total} tensors but the first part declares {split_info(files[0])[2]}"
        )
