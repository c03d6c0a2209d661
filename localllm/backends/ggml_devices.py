"""ggml's device API, which llama-cpp-python does not wrap: the devices a llama.cpp build can use
(`doctor`), and the CPU's buffer type (`--cpu-moe`'s tensor overrides keep experts in RAM).

Called through ctypes on the `libggml` that llama-cpp-python ships (its own copy, the one its
`libllama` is linked with), after `llama_backend_init` has registered the backends.
"""

from __future__ import annotations

import ctypes
import functools
import sys
from pathlib import Path
from typing import Any

# enum ggml_backend_dev_type
DEVICE_TYPES = {0: "cpu", 1: "gpu", 2: "igpu", 3: "accel"}


@functools.cache
def libggml() -> ctypes.CDLL:
    import llama_cpp

    lib_dir = Path(llama_cpp.__file__).parent / "lib"
    name = {"darwin": "libggml.dylib", "win32": "ggml.dll"}.get(sys.platform, "libggml.so")
    lib = ctypes.CDLL(str(lib_dir / name))
    lib.ggml_backend_dev_count.restype = ctypes.c_size_t
    lib.ggml_backend_dev_get.argtypes = [ctypes.c_size_t]
    lib.ggml_backend_dev_get.restype = ctypes.c_void_p
    for f in ("ggml_backend_dev_name", "ggml_backend_dev_description"):
        getattr(lib, f).argtypes = [ctypes.c_void_p]
        getattr(lib, f).restype = ctypes.c_char_p
    lib.ggml_backend_dev_type.argtypes = [ctypes.c_void_p]
    lib.ggml_backend_dev_type.restype = ctypes.c_int
    lib.ggml_backend_dev_memory.argtypes = [ctypes.c_void_p, ctypes.POINTER(ctypes.c_size_t),
                                            ctypes.POINTER(ctypes.c_size_t)]  # fmt: skip
    lib.ggml_backend_dev_memory.restype = None
    lib.ggml_backend_dev_backend_reg.argtypes = [ctypes.c_void_p]
    lib.ggml_backend_dev_backend_reg.restype = ctypes.c_void_p
    lib.ggml_backend_reg_name.argtypes = [ctypes.c_void_p]
    lib.ggml_backend_reg_name.restype = ctypes.c_char_p
    lib.ggml_backend_dev_by_type.argtypes = [ctypes.c_int]
    lib.ggml_backend_dev_by_type.restype = ctypes.c_void_p
    lib.ggml_backend_dev_buffer_type.argtypes = [ctypes.c_void_p]
    lib.ggml_backend_dev_buffer_type.restype = ctypes.c_void_p
    return lib


def _text(b: bytes | None) -> str:
    return (b or b"").decode("utf-8", "replace")


def list_devices() -> list[dict[str, Any]]:
    """Every device ggml registered: name, description, backend, type, total and free bytes."""
    lib = libggml()
    out = []
    for i in range(lib.ggml_backend_dev_count()):
        dev = lib.ggml_backend_dev_get(i)
        free, total = ctypes.c_size_t(0), ctypes.c_size_t(0)
        lib.ggml_backend_dev_memory(dev, ctypes.byref(free), ctypes.byref(total))
        reg = lib.ggml_backend_dev_backend_reg(dev)
        out.append({"name": _text(lib.ggml_backend_dev_name(dev)),
                    "description": _text(lib.ggml_backend_dev_description(dev)),
                    "backend": _text(lib.ggml_backend_reg_name(reg)) if reg else "",
                    "type": DEVICE_TYPES.get(lib.ggml_backend_dev_type(dev), "unknown"),
                    "total_bytes": int(total.value), "free_bytes": int(free.value)})  # fmt: skip
    return out


class BuftOverride(ctypes.Structure):
    """llama.cpp's `struct llama_model_tensor_buft_override` (a NULL pattern ends the list)."""

    _fields_ = [("pattern", ctypes.c_char_p), ("buft", ctypes.c_void_p)]


def cpu_moe_overrides(n_layers: int) -> ctypes.Array[BuftOverride] | None:
    """The overrides that keep the MoE experts of layers 0..n-1 in RAM (as llama.cpp's
    `--n-cpu-moe N`); None for none. Keep the array alive while the model loads."""
    if n_layers <= 0:
        return None
    lib = libggml()
    cpu = lib.ggml_backend_dev_by_type(0)
    buft = lib.ggml_backend_dev_buffer_type(cpu) if cpu else None
    if not buft:
        raise RuntimeError("ggml has no CPU device")  # a build without its CPU backend
    arr = (BuftOverride * (n_layers + 1))()
    for i in range(n_layers):
        arr[i].pattern = moe_pattern(i).encode()
        arr[i].buft = buft
    return arr


def moe_pattern(layer: int) -> str:
    """The tensor-name pattern of one layer's experts (llama.cpp's LLM_FFN_EXPS_REGEX per layer)."""
    return rf"blk\.{layer}\.ffn_(up|down|gate|gate_up)_exps"
