"""llama.cpp's importance-matrix files, both ways: what `llama-imatrix` writes, read by
`quantize --calibrate FILE.imatrix`; and ours written (`--save-imatrix`) for `llama-quantize
--imatrix`. Both formats llama.cpp reads (its `common/imatrix-loader.cpp`, llama-cpp-python 0.3.36):

- GGUF (the default): `general.type` "imatrix", `imatrix.datasets` (strings),
  `imatrix.chunk_count` and `imatrix.chunk_size` (u32: without the three keys llama-quantize
  refuses the file), and per weight matrix NAME two F32 tensors: `NAME.in_sum2` (ne = [columns,
  experts]: Σ x² of each input column) and `NAME.counts` (ne = [1, experts]: the rows summed).
  The quantizer uses in_sum2 / count (1 where a count is 0: an expert that saw no token).
- legacy `.dat`: i32 n_entries, then per entry i32 name length, the name, i32 ncall, i32 nval,
  nval f32 of (Σx² / count) × ncall; then, optionally, i32 chunk count, i32 length and the dataset
  name. The quantizer divides by ncall.

`read` gives what the quantizer is given (name → mean square per column, experts one after the
other), exactly as llama-quantize computes it from the file.
"""

from __future__ import annotations

import os
import struct
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from localllm.errors import LocalLLMError

__all__ = ["Imatrix", "is_imatrix", "read", "write"]

SUM2, COUNTS = ".in_sum2", ".counts"
_MAX_ENTRIES = 1 << 20
_MAX_NAME = 1 << 12


@dataclass
class Imatrix:
    """Name → (experts × columns) Σx² and (experts,) counts, as `llama-imatrix` keeps them."""

    sums: dict[str, np.ndarray]  # (experts, columns) float32
    counts: dict[str, np.ndarray]  # (experts,) float32
    datasets: list[str] = field(default_factory=list)
    chunk_count: int = 0
    chunk_size: int = 0
    legacy: bool = False

    def means(self) -> dict[str, np.ndarray]:
        """What the quantizer is given: Σx² / count per expert (1 where nothing was seen),
        flattened, float32 — llama-quantize's `load_imatrix`, computed as it computes it."""
        out = {}
        for name, s in self.sums.items():
            c = self.counts[name]
            if self.legacy:  # sums hold mean × ncall: divide by ncall (none: as they are)
                ncall = float(c[0]) if c.size else 0.0
                out[name] = (s / np.float32(ncall) if ncall > 0 else s).astype(np.float32).reshape(-1)
                continue
            # llama.cpp reads each count with lround, then divides by it as a float
            counts = np.copysign(np.floor(np.abs(c.astype(np.float64)) + 0.5), c).astype(np.float32)
            rows = [s[j] / counts[j] if counts[j] > 0 else np.ones_like(s[j]) for j in range(len(c))]
            out[name] = np.concatenate(rows).astype(np.float32)
        return out

    @classmethod
    def from_means(cls, means: dict[str, np.ndarray], rows: dict[str, int], *, dataset: str = "",
                   chunk_size: int = 512) -> Imatrix:  # fmt: skip
        """Ours (`calibrate.collect_imatrix`: name → mean square per column over `rows[name]`
        rows) as llama-imatrix would have kept it: Σx² = mean × count."""
        sums = {n: (np.asarray(m, np.float64) * rows[n]).astype(np.float32).reshape(1, -1)
                for n, m in means.items()}  # fmt: skip
        counts = {n: np.array([rows[n]], np.float32) for n in means}
        most = max(rows.values(), default=0)
        return cls(sums, counts, [dataset] if dataset else [], -(-most // chunk_size), chunk_size)


def is_imatrix(path: str | os.PathLike[str]) -> bool:
    """Whether `path` is meant as an importance-matrix file (a GGUF, or a `.dat`), not a text
    to calibrate on."""
    p = Path(path)
    if p.suffix.lower() == ".dat":
        return True
    try:
        with open(p, "rb") as f:
            return f.read(4) == b"GGUF"  # a GGUF that is no imatrix: read() says so
    except OSError:
        return False


def read(path: str | os.PathLike[str]) -> Imatrix:
    """An importance-matrix file in either format; one line naming the file if it is not one."""
    p = Path(path)
    try:
        with open(p, "rb") as f:
            magic = f.read(4)
    except OSError as e:
        raise LocalLLMError(f"cannot read the importance matrix {p}: {e.strerror}") from None
    return _read_gguf(p) if magic == b"GGUF" else _read_legacy(p)


def _read_gguf(p: Path) -> Imatrix:
    from localllm.errors import GGUFFormatError
    from localllm.gguf_file import GGUFFile

    try:
        with GGUFFile(p) as g:
            meta = g.metadata
            missing = [k for k in ("imatrix.datasets", "imatrix.chunk_count", "imatrix.chunk_size") if k not in meta]
            if missing:  # llama-quantize: "missing imatrix metadata"
                raise LocalLLMError(f"{p} is not an importance matrix (no {', '.join(missing)})")
            sums: dict[str, np.ndarray] = {}
            counts: dict[str, np.ndarray] = {}
            for name, t in g.tensors.items():
                for suffix, into in ((SUM2, sums), (COUNTS, counts)):
                    if name.endswith(suffix):
                        if t.ggml_type.name != "F32":
                            raise LocalLLMError(f"{p}: {name} is {t.ggml_type.name}, not F32")
                        a = np.frombuffer(g.tensor_bytes(name), dtype="<f4").astype(np.float32)
                        cols = int(t.shape[0])
                        into[name.removesuffix(suffix)] = a.reshape(-1, cols) if suffix == SUM2 else a
            datasets = [str(d) for d in meta["imatrix.datasets"]]
            chunk_count, chunk_size = int(meta["imatrix.chunk_count"]), int(meta["imatrix.chunk_size"])
    except GGUFFormatError as e:
        raise LocalLLMError(str(e)) from None
    if not sums or set(sums) != set(counts):
        odd = sorted(set(sums) ^ set(counts))
        raise LocalLLMError(f"{p}: no importance data" if not sums else f"{p}: sums without counts for {odd[0]}")
    for name, s in sums.items():
        if s.shape[0] != counts[name].size:
            raise LocalLLMError(f"{p}: {name} has {s.shape[0]} rows of sums and {counts[name].size} counts")
    return Imatrix(sums, counts, datasets, chunk_count, chunk_size)


def _read_legacy(p: Path) -> Imatrix:
    data = p.read_bytes()
    at = 0

    def take(fmt: str, what: str) -> tuple:
        nonlocal at
        size = struct.calcsize(fmt)
        if at + size > len(data):
            raise LocalLLMError(f"{p} is not an importance matrix: it ends inside {what}")
        out = struct.unpack_from(fmt, data, at)
        at += size
        return out

    (n,) = take("<i", "the entry count")
    if not 0 < n <= _MAX_ENTRIES:
        raise LocalLLMError(f"{p} is not an importance matrix ({n} entries)")
    sums: dict[str, np.ndarray] = {}
    counts: dict[str, np.ndarray] = {}
    for i in range(n):
        (length,) = take("<i", f"entry {i}'s name length")
        if not 0 < length <= _MAX_NAME:
            raise LocalLLMError(f"{p} is not an importance matrix (entry {i}: a name of {length} bytes)")
        (raw,) = take(f"<{length}s", f"entry {i}'s name")
        ncall, nval = take("<ii", f"entry {i}'s counts")
        if not 0 < nval <= (len(data) - at) // 4:
            raise LocalLLMError(f"{p} is not an importance matrix (entry {i}: {nval} values)")
        name = raw.split(b"\0", 1)[0].decode("utf-8", "replace")
        sums[name] = np.frombuffer(data, "<f4", nval, at).astype(np.float32).reshape(1, -1)
        counts[name] = np.array([ncall], np.float32)
        at += 4 * nval
    chunk_count, datasets = 0, []
    if at + 8 <= len(data):  # optional: the chunk count and the dataset's name
        chunk_count, length = struct.unpack_from("<ii", data, at)
        if 0 < length <= len(data) - at - 8:
            datasets.append(data[at + 8 : at + 8 + length].decode("utf-8", "replace"))
    return Imatrix(sums, counts, datasets, chunk_count, 0, legacy=True)


def write(path: str | os.PathLike[str], m: Imatrix, *, legacy: bool | None = None) -> Path:
    """Write `m` as llama-imatrix does: GGUF, or the legacy format for a `.dat` path (or
    `legacy`); temp file, fsync, rename."""
    p = Path(path)
    legacy = p.suffix.lower() == ".dat" if legacy is None else legacy
    tmp = p.with_name(f".{p.name}.tmp-{os.getpid()}")
    try:
        if legacy:
            _write_legacy(tmp, m)
        else:
            _write_gguf(tmp, m)
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.replace(tmp, p)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return p


def _write_gguf(p: Path, m: Imatrix) -> None:
    import gguf

    w = gguf.GGUFWriter(str(p), arch="imatrix")  # the arch key is not read; general.type is
    w.add_type("imatrix")
    w.add_array("imatrix.datasets", list(m.datasets))
    w.add_uint32("imatrix.chunk_count", int(m.chunk_count))
    w.add_uint32("imatrix.chunk_size", int(m.chunk_size))
    for name in sorted(m.sums):  # llama-imatrix: deterministic name order
        w.add_tensor(name + SUM2, np.ascontiguousarray(m.sums[name], np.float32))
        w.add_tensor(name + COUNTS, np.ascontiguousarray(m.counts[name], np.float32).reshape(-1, 1))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def _write_legacy(p: Path, m: Imatrix) -> None:
    chunk = m.chunk_size or 512
    with open(p, "wb") as f:
        f.write(struct.pack("<i", len(m.sums)))
        for name in sorted(m.sums):
            raw = name.encode()
            c = m.counts[name]
            ncall = int(-(-int(c.max()) // chunk))  # llama-imatrix: ceiling of tokens / chunk size
            s = m.sums[name]
            per = np.where(c[:, None] > 0, s / np.maximum(c[:, None], 1), 1.0) * ncall
            f.write(struct.pack("<i", len(raw)) + raw + struct.pack("<ii", ncall, s.size))
            f.write(per.astype("<f4").tobytes())
        dataset = (m.datasets[-1] if m.datasets else "").encode()
        f.write(struct.pack("<ii", int(m.chunk_count), len(dataset)) + dataset)
