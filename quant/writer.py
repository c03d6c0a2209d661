"""Writing a quantized GGUF: one tensor at a time into a temporary file beside the output, re-opened
and checked, then renamed — a kill at any moment leaves no file at the output name.

    quantize_file(src, dst, "Q4_K_M", on_tensor=...)   → QuantizeResult

Metadata is carried over from the source (every key, in order) with `general.file_type` and
`general.quantization_version` updated. Tensor types come from `mix.choose_types` (llama.cpp's rules);
values from `localllm.quant.quantize` (engine "localllm") or llama.cpp's own `llama_model_quantize`
(engine "llama.cpp"; "auto" takes ours when it has every type the mix needs).
"""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
import struct
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from localllm.errors import LocalLLMError
from localllm.gguf_file import GGUFFile
from localllm.quant import BLOCK, quantize, row_bytes

__all__ = ["QUANTIZATION_VERSION", "QuantizeResult", "TensorDone", "quantize_file"]

QUANTIZATION_VERSION = 2  # ggml's GGML_QNT_VERSION: the block layouts written here
FLOATS = ("F32", "F16", "BF16")
# headroom beyond the tensors' bytes when checking free space (header, alignment padding)
SLACK = 16 * 2**20


@dataclass(frozen=True)
class TensorDone:
    """One tensor written: the `index`-th of `total` (from 1)."""

    index: int
    total: int
    name: str
    type_name: str
    nbytes: int
    seconds: float


@dataclass
class QuantizeResult:
    path: Path
    file_type: str
    engine: str
    types: dict[str, str]  # tensor → type written
    nbytes: int  # the output file's size
    tensor_bytes: int  # of which tensor data
    n_params: int
    seconds: float
    warnings: list[str] = field(default_factory=list)

    @property
    def bits_per_weight(self) -> float:
        """Over the tensors' bytes, as llama.cpp reports it (the header is left out)."""
        return self.tensor_bytes * 8 / max(1, self.n_params)


def _values(f: GGUFFile, name: str) -> np.ndarray:
    """A tensor's values as float32, rows of ne[0]."""
    t = f.tensors[name]
    raw = np.frombuffer(f.tensor_bytes(name), dtype=np.uint8)
    n0 = t.shape[0] if t.shape else 1
    kind = t.ggml_type.name
    if kind == "F32":
        x = raw.view("<f4").astype(np.float32, copy=False)  # the map itself (read-only): no copy
    elif kind == "F16":
        x = raw.view("<f2").astype(np.float32)
    else:
        from gguf import GGMLQuantizationType
        from gguf.quants import dequantize

        try:
            x = dequantize(raw, GGMLQuantizationType[kind]).astype(np.float32, copy=False)
        except (KeyError, NotImplementedError):
            raise LocalLLMError(f"cannot read tensor {name}: its type {kind} has no dequantizer") from None
    return x.reshape(-1, n0)


def _source_is_quantized(f: GGUFFile) -> str | None:
    """The first matrix stored in a quantized type (name and type), or None."""
    for t in f.tensors.values():
        if len(t.shape) >= 2 and t.ggml_type.name not in FLOATS:
            return f"{t.name} is {t.ggml_type.name}"
    return None


def _check_space(folder: Path, need: int) -> None:
    free = shutil.disk_usage(folder).free
    if free < need + SLACK:
        raise LocalLLMError(
            f"not enough free space in {folder}: the quantized file needs about "
            f"{(need + SLACK) / 2**20:.0f} MiB, {free / 2**20:.0f} MiB are free"
        )


def _kv_u32(key: str, value: int) -> bytes:
    k = key.encode()
    return struct.pack("<Q", len(k)) + k + struct.pack("<II", 4, value)  # GGUF value type 4: u32


def _header(f: GGUFFile, plan: dict[str, tuple[tuple[int, ...], str]], file_type: int) -> bytes:
    """The output's header: every metadata entry of the source copied byte for byte, in order,
    `general.file_type` and `general.quantization_version` (re)written; the planned tensors' infos
    with aligned offsets; padding to the alignment."""
    from gguf import GGMLQuantizationType

    new = {"general.quantization_version": _kv_u32("general.quantization_version", QUANTIZATION_VERSION),
           "general.file_type": _kv_u32("general.file_type", file_type)}  # fmt: skip
    entries = [new.pop(k) if k in new else f.kv_bytes(k) for k in f.metadata]
    entries += new.values()  # those the source lacked
    align = f.alignment
    out = bytearray(b"GGUF" + struct.pack("<IQQ", 3, len(plan), len(entries)))
    for e in entries:
        out += e
    pos = 0
    for name, (shape, type_name) in plan.items():
        k = name.encode()
        out += struct.pack("<Q", len(k)) + k + struct.pack("<I", len(shape))
        out += struct.pack(f"<{len(shape)}Q", *shape)
        out += struct.pack("<IQ", GGMLQuantizationType[type_name].value, pos)
        pos += -(-_nbytes(shape, type_name) // align) * align
    out += b"\0" * (-len(out) % align)
    return bytes(out)


def _nbytes(shape: tuple[int, ...], type_name: str) -> int:
    rows = int(np.prod(shape[1:], dtype=np.int64)) if len(shape) > 1 else 1
    return rows * row_bytes(type_name, shape[0])


def _put(fh: Any, data: bytes | memoryview) -> None:
    """One write of the output (its own function: a test makes the disk fill up here)."""
    fh.write(data)


def verify(path: Path, want: dict[str, tuple[tuple[int, ...], str]]) -> None:
    """Re-open the written file: the same tensors, shapes, types and sizes as planned."""
    with GGUFFile(path) as out:
        if set(out.tensors) != set(want):  # (llama.cpp writes them in its own order)
            raise LocalLLMError(
                f"the written file holds {len(out.tensors)} tensors, not the {len(want)} planned"
            )
        for name, (shape, type_name) in want.items():
            t = out.tensors[name]
            if t.shape != shape or t.ggml_type.name != type_name:
                raise LocalLLMError(
                    f"the written {name} is {t.ggml_type.name} {t.shape}, not {type_name} {shape}"
                )
            rows = int(np.prod(shape[1:], dtype=np.int64)) if len(shape) > 1 else 1
            if t.nbytes != rows * row_bytes(type_name, shape[0]):
                raise LocalLLMError(f"the written {name} has {t.nbytes} bytes")


def temp_beside(dst: Path) -> Path:
    """A fresh temporary name beside `dst` (the store's convention, so its `gc` knows it), after
    removing those of earlier runs for the same output whose process is dead (killed mid-way)."""
    from localllm.models_registry.store import pid_alive, temp_path, temp_writer

    for old in dst.parent.glob(f".{dst.name}.tmp-*"):
        pid = temp_writer(old.name)
        if pid is not None and not pid_alive(pid):
            with contextlib.suppress(OSError):
                old.unlink()
    return temp_path(dst.parent, prefix=f".{dst.name}")


def make_plan(f: GGUFFile, file_type: str,
              has_imatrix: bool = False) -> dict[str, tuple[tuple[int, ...], str]]:  # fmt: skip
    """Every tensor's shape and the type `file_type` gives it (`mix.choose_types`), in file order."""
    from localllm.quant.mix import choose_types

    tensors = [(t.name, t.shape, t.ggml_type.name) for t in f.tensors.values()]
    try:
        types = choose_types(
            file_type, tensors, arch=f.architecture,
            n_layer=int(f.arch_get("block_count", 0) or 0),
            n_head=int(f.arch_get("attention.head_count", 0) or 0),
            n_head_kv=int(f.arch_get("attention.head_count_kv", 0) or f.arch_get("attention.head_count", 0) or 0),
            n_expert=int(f.arch_get("expert_count", 0) or 0), has_imatrix=has_imatrix,
        )  # fmt: skip
    except ValueError as e:
        raise LocalLLMError(str(e)) from None
    return {name: (shape, types[name]) for name, shape, _ in tensors}


def estimate_bytes(src: str | os.PathLike[str], file_type: str) -> int:
    """The tensor bytes `src` quantized to `file_type` will hold (what its weights need in memory)."""
    with GGUFFile(src) as f:
        return sum(_nbytes(s, t) for s, t in make_plan(f, file_type.upper()).values() if t in BLOCK)


def quantize_file(
    src: str | os.PathLike[str],
    dst: str | os.PathLike[str],
    file_type: str,
    *,
    engine: str = "auto",
    allow_requantize: bool = False,
    on_tensor: Callable[[TensorDone], None] | None = None,
    cancel: Callable[[], bool] | None = None,
    imatrix: Mapping[str, np.ndarray] | None = None,
    hessians: Mapping[str, np.ndarray] | None = None,
    values: Mapping[str, np.ndarray] | None = None,
) -> QuantizeResult:
    """Quantize the GGUF `src` to `file_type` (a llama.cpp mix: Q4_K_M, Q8_0, ...) at `dst`.

    `imatrix`: tensor name → the importance of each of its input columns (`calibrate`); the
    tensors it names are quantized with it, as llama.cpp does with an importance matrix.
    `hessians`: tensor name → its input's E[x xᵀ] (`--method gptq`): the K-quant tensors it names
    are quantized by GPTQ (`gptq`) into the same blocks; our engine only. `values`: tensor name →
    float32 values written instead of the file's (`--method awq`'s scaled tensors)."""
    from localllm.quant.mix import FILE_TYPES

    t0 = time.perf_counter()
    src, dst = Path(src), Path(dst)
    file_type = file_type.upper()
    if file_type not in FILE_TYPES:
        raise LocalLLMError(f"unknown quantization type {file_type} (known: {', '.join(FILE_TYPES)})")
    if engine not in ("auto", "localllm", "llama.cpp"):
        raise LocalLLMError(f"unknown quantization engine {engine} (auto, localllm, llama.cpp)")
    if dst.resolve() == src.resolve():
        raise LocalLLMError("the output would overwrite the source: give another path")
    warnings: list[str] = []
    with GGUFFile(src) as f:
        quantized = _source_is_quantized(f)
        if quantized and not allow_requantize:
            raise LocalLLMError(
                f"{src.name} is already quantized ({quantized}): quantizing it again loses more "
                "quality than quantizing the original; pass --allow-requantize to do it anyway"
            )
        if quantized:
            warnings.append(f"requantizing an already quantized model ({quantized}): quality suffers")
        plan = make_plan(f, file_type, has_imatrix=bool(imatrix))
        _check_imatrix(plan, imatrix or {}, file_type)
        missing = sorted({t for _, t in plan.values() if t not in BLOCK})
        if (hessians or values) and (engine == "llama.cpp" or missing):
            raise LocalLLMError(f"--method {'gptq' if hessians else 'awq'} is our quantizer's: it needs --engine localllm"
                                + (f" and has none for {', '.join(missing)}" if missing else ""))
        if engine == "auto":
            engine = "llama.cpp" if missing else "localllm"
        elif engine == "localllm" and missing:
            raise LocalLLMError(f"--engine localllm has no quantizer for {', '.join(missing)}; "
                                "use --engine llama.cpp")  # fmt: skip
        n_params = sum(int(np.prod(s, dtype=np.int64)) for s, _ in plan.values())
        need = sum(_nbytes(s, t) for s, t in plan.values() if t in BLOCK)
        dst.parent.mkdir(parents=True, exist_ok=True)
        _check_space(dst.parent, need)
        tmp = temp_beside(dst)
        try:
            if engine == "llama.cpp":
                f.close()
                _llamacpp_quantize(src, tmp, FILE_TYPES[file_type], allow_requantize, imatrix)
                done = TensorDone(len(plan), len(plan), "", "", need, time.perf_counter() - t0)
                if on_tensor:
                    on_tensor(done)
            else:
                _write(f, tmp, plan, FILE_TYPES[file_type], on_tensor, cancel, imatrix or {}, hessians or {},
                       values or {})
            verify(tmp, plan)
            os.replace(tmp, dst)
        except BaseException as e:
            with contextlib.suppress(OSError):
                tmp.unlink()
            if isinstance(e, OSError) and e.errno == errno.ENOSPC:
                raise LocalLLMError(f"the disk filled up writing {dst.name}: nothing was kept") from None
            raise
    return QuantizeResult(dst, file_type, engine, {n: t for n, (_, t) in plan.items()},
                          dst.stat().st_size, need, n_params, time.perf_counter() - t0,
                          warnings)  # fmt: skip


def _check_imatrix(plan: dict[str, tuple[tuple[int, ...], str]], imatrix: Mapping[str, np.ndarray],
                   file_type: str) -> None:  # fmt: skip
    """Refuse, before writing anything, a very-low-bit tensor with no importance matrix (llama.cpp
    bails out mid-file: "the result will be garbage")."""
    from localllm.quant.mix import needs_imatrix

    lacking = [n for n in needs_imatrix({n: t for n, (_, t) in plan.items()}, file_type) if n not in imatrix]
    if lacking:
        what = "has no entry for " + lacking[0] if imatrix else "needs an importance matrix"
        raise LocalLLMError(f"{file_type} {what} ({plan[lacking[0]][1]} tensors would be garbage without one): "
                            f"give --calibrate TEXT, e.g. `localllm quantize MODEL --type {file_type} "
                            "--calibrate text.txt`, or an .imatrix file from llama-imatrix")  # fmt: skip


class Cancelled(LocalLLMError):
    """The caller asked to stop; nothing was written at the output name."""


def _write(f: GGUFFile, tmp: Path, plan: dict[str, tuple[tuple[int, ...], str]], file_type: int,
           on_tensor: Callable[[TensorDone], None] | None, cancel: Callable[[], bool] | None,
           imatrix: Mapping[str, np.ndarray], hessians: Mapping[str, np.ndarray],
           values: Mapping[str, np.ndarray]) -> None:  # fmt: skip
    if f.byte_order != "<":
        raise LocalLLMError(f"{Path(f.path).name} is a big-endian GGUF: only little-endian ones are quantized")
    align = f.alignment
    total = len(plan)
    with open(tmp, "xb") as fh:
        _put(fh, _header(f, plan, file_type))
        t = time.perf_counter()
        for i, (name, data) in enumerate(_tensors_out(f, plan, cancel, imatrix, hessians, values), 1):
            shape, type_name = plan[name]
            if len(data) != _nbytes(shape, type_name):
                raise LocalLLMError(f"{name}: {len(data)} bytes quantized, {_nbytes(shape, type_name)} planned")
            _put(fh, data)
            _put(fh, b"\0" * (-len(data) % align))
            if on_tensor is not None:
                on_tensor(TensorDone(i, total, name, type_name, len(data), time.perf_counter() - t))
            t = time.perf_counter()
        fh.flush()
        os.fsync(fh.fileno())


# values for numpy to quantize (types the compiled quantizer lacks) above which tensors are
# quantized in worker processes (`worker`), one per core: numpy spends most of a K-quant in short
# calls that keep the GIL (threads gained 0-20% here), ~100 ns a value, and a worker costs ~0.5 s
# to start
PROCESS_VALUES = 8 * 2**20


def quantized_bytes(f: GGUFFile, name: str, type_name: str, importance: np.ndarray | None = None,
                    hessian: np.ndarray | None = None, values: np.ndarray | None = None) -> bytes | memoryview:  # fmt: skip
    """One tensor's bytes in `type_name` (its own bytes when it already is and `values` does not
    replace them); with `hessian` (its input's E[x xᵀ]) by GPTQ where `type_name` has a grid — but
    not the token embedding: its rows are looked up, not multiplied, so rounding its values with
    feedback would only move them."""
    if values is None and f.tensors[name].ggml_type.name == type_name:
        return f.tensor_bytes(name)
    values = _values(f, name) if values is None else values
    from localllm.quant import gptq

    if hessian is not None and type_name in gptq.TYPES and name != "token_embd.weight":
        return gptq.quantize_gptq(values.reshape(-1, values.shape[-1]), hessian, type_name).reshape(-1).data
    n0 = values.shape[-1]
    if importance is not None and np.size(importance) != n0:  # one row per expert, as llama.cpp's (ne0·ne2)
        shape = f.tensors[name].shape
        experts = int(shape[2]) if len(shape) >= 3 else 1
        if np.size(importance) != n0 * experts:
            raise LocalLLMError(f"the importance matrix of {name} has {np.size(importance)} values; its rows "
                                f"need {n0}" + (f" for each of {experts} experts" if experts > 1 else ""))  # fmt: skip
        per = np.asarray(importance, np.float32).reshape(experts, n0)
        slices = values.reshape(experts, -1, n0)
        return np.concatenate([quantize(v, type_name, w) for v, w in zip(slices, per, strict=True)]).reshape(-1).data
    return quantize(values, type_name, importance).reshape(-1).data


def _tensors_out(f: GGUFFile, plan: dict[str, tuple[tuple[int, ...], str]],
                 cancel: Callable[[], bool] | None, imatrix: Mapping[str, np.ndarray],
                 hessians: Mapping[str, np.ndarray] | None = None,
                 replaced: Mapping[str, np.ndarray] | None = None) -> Iterator[tuple[str, bytes | memoryview]]:  # fmt: skip
    """Each planned tensor's output bytes, in plan order: in this process for small models, the
    compiled quantizer's types (`native`: C on a thread per core), GPTQ (its matrix products take
    every core already) and `replaced` values, else by worker processes, tensor i by worker i mod N."""

    def stop() -> None:
        if cancel is not None and cancel():
            raise Cancelled("quantization cancelled: nothing was written at the output name")

    from localllm.quant import native

    work = [(n, t) for n, (_, t) in plan.items()]
    # the values numpy would quantize: the compiled quantizer's run on threads in this process
    values = sum(f.tensors[n].n_elements for n, t in work
                 if f.tensors[n].ggml_type.name != t and not native.has(t, weighted=n in imatrix))  # fmt: skip
    n = min(os.cpu_count() or 1, len(work))
    if n <= 1 or values < PROCESS_VALUES or hessians or replaced:
        for name, type_name in work:
            stop()
            yield name, quantized_bytes(f, name, type_name, imatrix.get(name), (hessians or {}).get(name),
                                        (replaced or {}).get(name))  # fmt: skip
        return
    import subprocess
    import sys
    import tempfile

    # stderr to files: a pipe nobody reads could fill and stop a worker mid-write
    with contextlib.ExitStack() as stack:
        errs = [stack.enter_context(tempfile.TemporaryFile()) for _ in range(n)]
        args = [f.path]
        if imatrix:  # the workers read it from a file
            folder = stack.enter_context(tempfile.TemporaryDirectory(prefix="localllm-imatrix-"))
            args.append(os.path.join(folder, "imatrix.npz"))
            np.savez(args[1], **{k: np.asarray(v, np.float32) for k, v in imatrix.items()})
        procs = [subprocess.Popen([sys.executable, "-m", "localllm.quant.worker", *args],
                                  stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=e)
                 for e in errs]  # fmt: skip
        stack.callback(_end, procs)
        for i, p in enumerate(procs):
            assert p.stdin is not None
            p.stdin.write("".join(f"{name}\t{t}\n" for name, t in work[i::n]).encode())
            p.stdin.close()
        for i, (name, _) in enumerate(work):
            stop()
            p = procs[i % n]
            assert p.stdout is not None
            head = p.stdout.read(8)
            size = struct.unpack("<Q", head)[0] if len(head) == 8 else -1
            data = p.stdout.read(size) if size >= 0 else b""
            if size < 0 or len(data) != size:
                status = p.wait()
                errs[i % n].seek(0)
                err = errs[i % n].read().decode(errors="replace").strip()
                last = err.splitlines()[-1] if err else f"exit status {status}"
                raise LocalLLMError(f"a quantizing worker failed on {name}: {last}")
            yield name, data


def _end(procs: list[Any]) -> None:
    for p in procs:
        if p.poll() is None:
            p.kill()
        p.wait()
        if p.stdout is not None:
            p.stdout.close()


def _imatrix_entries(llama_cpp: Any, imatrix: Mapping[str, np.ndarray]) -> tuple[Any, list[np.ndarray]]:
    """llama.cpp's `llama_model_imatrix_data` array (name, data, size; a NULL name ends it) for
    an importance matrix, and the float32 arrays it points into."""
    import ctypes

    arrays = [np.ascontiguousarray(v, dtype=np.float32).reshape(-1) for v in imatrix.values()]
    entries = (llama_cpp.llama_model_imatrix_data * (len(arrays) + 1))()
    for e, name, a in zip(entries, imatrix, arrays, strict=False):
        e.name = name.encode()
        e.data = a.ctypes.data_as(ctypes.POINTER(ctypes.c_float))
        e.size = a.size
    return entries, arrays


def _llamacpp_quantize(src: Path, dst: Path, ftype: int, allow_requantize: bool,
                       imatrix: Mapping[str, np.ndarray] | None = None) -> None:  # fmt: skip
    """llama.cpp's `llama_model_quantize` (through llama-cpp-python), default parameters; with
    `imatrix` (tensor name → importance per input column) as llama.cpp's importance matrix."""
    import ctypes

    try:
        import llama_cpp
    except ImportError:
        raise LocalLLMError("--engine llama.cpp needs llama-cpp-python: pip install 'localllm[llamacpp]'") from None
    from localllm.backends.llamacpp_guard import probe

    verdict = probe()  # a child evaluates first: a build that dies on this CPU must not take us along
    if not verdict.ok:
        raise LocalLLMError(f"--engine llama.cpp: {verdict.message()}")
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = ftype
    params.nthread = os.cpu_count() or 1
    params.allow_requantize = allow_requantize
    keep = _imatrix_entries(llama_cpp, imatrix) if imatrix else None  # alive while it quantizes
    if keep is not None:
        params.imatrix = ctypes.cast(keep[0], type(params.imatrix))
    rc = llama_cpp.llama_model_quantize(os.fsencode(src), os.fsencode(dst), ctypes.byref(params))
    if rc != 0:
        raise LocalLLMError(f"llama.cpp could not quantize {src.name} (code {rc})")
