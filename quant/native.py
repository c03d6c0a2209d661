"""The compiled quantizer (`kernel.c`): built with the system's C compiler on first use, cached,
loaded with ctypes, run on every core.

Only the types and the cases it has: F16, BF16, and Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q2_K ... Q6_K
without an importance matrix (ggml's reference quantization, byte for byte), IQ4_NL and IQ4_XS
with or without one. Everything else, and everything where no compiler is found or the build
fails, goes through the numpy ports, which give the same bytes more slowly: `quantize_rows` then
returns None and `why_not()` says why.

The library is cached under `$XDG_CACHE_HOME/localllm` (else `~/.cache/localllm`), named by a hash
of the source, the compiler, its flags and the machine, and written to a temporary name first, so a build
that is killed, or two processes building at once, never leave a broken file at that name.
`LOCALLLM_QUANT_KERNEL=0` turns it off (numpy only).
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

__all__ = ["TYPES", "WEIGHTED", "available", "has", "quantize_rows", "why_not"]

TYPES = {"Q4_0": (0, 32, 18), "Q4_1": (1, 32, 20), "Q5_0": (2, 32, 22), "Q5_1": (3, 32, 24),
         "Q8_0": (4, 32, 34), "Q4_K": (5, 256, 144), "Q5_K": (6, 256, 176), "Q6_K": (7, 256, 210),
         "BF16": (8, 1, 2), "Q2_K": (9, 256, 84), "Q3_K": (10, 256, 110),
         "F16": (11, 1, 2), "IQ4_NL": (12, 32, 18), "IQ4_XS": (13, 256, 136)}  # fmt: skip
WEIGHTED = ("IQ4_NL", "IQ4_XS")  # the types it quantizes with an importance matrix too
# no FMA contraction, no fast-math: the float32 operations of ggml's reference, each rounded
FLAGS = ["-O2", "-fPIC", "-shared", "-ffp-contract=off", "-fno-fast-math", "-std=c99"]
SOURCE = Path(__file__).with_name("kernel.c")
# values per call: big enough that the call's cost vanishes, small enough to spread over cores
PIECE = 1 << 18

_lock = threading.Lock()
_state: dict[str, object] = {}


def _cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "localllm"


def _compiler() -> str | None:
    return os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")


def _build() -> tuple[ctypes.CDLL | None, str]:
    if os.environ.get("LOCALLLM_QUANT_KERNEL", "1") == "0":
        return None, "turned off by LOCALLLM_QUANT_KERNEL=0"
    if sys.platform == "win32":
        return None, "not built on Windows"
    cc = _compiler()
    if cc is None:
        return None, "no C compiler (cc, gcc or clang) found"
    source = SOURCE.read_bytes()
    key = hashlib.sha256(source + " ".join([cc, *FLAGS, platform.machine(), sys.platform]).encode()).hexdigest()[:16]
    lib = _cache_dir() / f"quant-kernel-{key}.so"
    if not lib.is_file():
        try:
            lib.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(prefix=lib.name, suffix=".tmp", dir=lib.parent)
            os.close(fd)
        except OSError as e:
            return None, f"cannot write to {lib.parent}: {e.strerror or e}"
        try:
            run = subprocess.run([cc, *FLAGS, "-o", tmp, str(SOURCE), "-lm"], capture_output=True, text=True,
                                 timeout=120)  # fmt: skip
            if run.returncode != 0:
                last = (run.stderr.strip().splitlines() or [f"exit status {run.returncode}"])[-1]
                return None, f"the build with {cc} failed: {last}"
            os.replace(tmp, lib)
        except (OSError, subprocess.TimeoutExpired) as e:
            return None, f"the build with {cc} failed: {e}"
        finally:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
    try:
        dll = ctypes.CDLL(str(lib))
    except OSError as e:
        return None, f"cannot load {lib}: {e}"
    fn = dll.localllm_quantize
    fn.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p]
    fn.restype = ctypes.c_int
    return dll, ""


def _library() -> ctypes.CDLL | None:
    with _lock:
        if "dll" not in _state:
            _state["dll"], _state["why"] = _build()
        return _state["dll"]  # type: ignore[return-value]


def available() -> bool:
    return _library() is not None


def why_not() -> str:
    """Why the compiled quantizer is not used ("" when it is)."""
    _library()
    return str(_state.get("why", ""))


def has(type_name: str, weighted: bool = False) -> bool:
    """Whether the compiled quantizer is here and quantizes `type_name` (with an importance matrix
    when `weighted`)."""
    return type_name in (WEIGHTED if weighted else TYPES) and available()


def quantize_rows(rows: np.ndarray, type_name: str, workers: int = 0,
                  importance: np.ndarray | None = None) -> np.ndarray | None:  # fmt: skip
    """(R, n) float32 → (R, row bytes) uint8, or None where the compiled quantizer cannot do it
    (the caller then uses the numpy port). `importance`: (n,) per column, for the `WEIGHTED`
    types. `workers`: threads (0: one per core); ctypes lets go of the GIL during each call."""
    if type_name not in (WEIGHTED if importance is not None else TYPES) or rows.ndim != 2:
        return None
    code, block, size = TYPES[type_name]
    n_rows, n = rows.shape
    if n % block:
        return None
    dll = _library()
    if dll is None:
        return None
    x = np.ascontiguousarray(rows, dtype=np.float32)
    qw = None if importance is None else np.ascontiguousarray(importance, dtype=np.float32).reshape(-1)
    if qw is not None and qw.shape != (n,):
        raise ValueError(f"the importance matrix has {qw.size} columns, the rows {n}")
    out = np.empty((n_rows, n // block * size), np.uint8)
    step = max(1, PIECE // n)  # rows per call
    starts = range(0, n_rows, step)

    def one(r: int) -> None:
        k = min(step, n_rows - r)
        if dll.localllm_quantize(code, x[r].ctypes.data, out[r].ctypes.data, k, n,
                                 None if qw is None else qw.ctypes.data) != 0:  # fmt: skip
            raise RuntimeError(f"the compiled quantizer has no {type_name}")

    workers = min(len(starts), workers or os.cpu_count() or 1)
    if workers <= 1:
        for r in starts:
            one(r)
    else:
        list(_pool(workers).map(one, starts))
    return out


def _pool(workers: int) -> ThreadPoolExecutor:
    """One pool for the process (a tensor's worth of calls is milliseconds: starting threads for
    each tensor cost 10% of a small model's time)."""
    with _lock:
        pool = _state.get("pool")
        if not isinstance(pool, ThreadPoolExecutor) or _state.get("workers") != workers:
            if isinstance(pool, ThreadPoolExecutor):
                pool.shutdown(wait=False)
            pool = _state["pool"] = ThreadPoolExecutor(workers, thread_name_prefix="localllm-quant")
            _state["workers"] = workers
        return pool
