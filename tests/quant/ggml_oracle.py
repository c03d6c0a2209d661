"""llama.cpp's own quantization of a float32 array: `ggml_quantize_chunk` in the libggml-base that
llama-cpp-python ships (what `llama_model_quantize` calls per tensor), through ctypes."""

from __future__ import annotations

import ctypes
from functools import cache
from pathlib import Path

import numpy as np

from conftest import need

# ggml's type ids (ggml.h)
IDS = {"F32": 0, "F16": 1, "Q4_0": 2, "Q4_1": 3, "Q5_0": 6, "Q5_1": 7, "Q8_0": 8, "Q2_K": 10, "Q3_K": 11,
       "Q4_K": 12, "Q5_K": 13, "Q6_K": 14, "IQ2_XXS": 16, "IQ2_XS": 17, "IQ3_XXS": 18, "IQ1_S": 19, "IQ4_NL": 20, "IQ3_S": 21, "IQ2_S": 22, "IQ4_XS": 23, "IQ1_M": 29,
       "BF16": 30}  # fmt: skip


@cache
def _lib() -> ctypes.CDLL:
    need("llama_cpp", "pip install -e '.[dev]' (llama-cpp-python is the quantization oracle)")
    import llama_cpp

    folder = Path(llama_cpp.__file__).parent / "lib"
    found = sorted(folder.glob("libggml-base.*"))
    if not found:
        raise RuntimeError(f"no libggml-base in {folder}: reinstall llama-cpp-python")
    lib = ctypes.CDLL(str(found[0]))
    lib.ggml_quantize_chunk.restype = ctypes.c_size_t
    lib.ggml_quantize_chunk.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p,
                                        ctypes.c_int64, ctypes.c_int64, ctypes.c_int64,
                                        ctypes.c_void_p]  # fmt: skip
    lib.ggml_quantize_init.argtypes = [ctypes.c_int]
    return lib


def ggml_quantize(x: np.ndarray, type_name: str, row_bytes: int,
                  imatrix: np.ndarray | None = None) -> np.ndarray:  # fmt: skip
    """(rows, n) float32 → (rows, row_bytes) uint8, as llama.cpp quantizes it; `imatrix`: (n,)
    importance of each column (llama.cpp's quant_weights), else none."""
    x = np.ascontiguousarray(x, dtype=np.float32)
    rows, n = x.shape
    out = np.zeros((rows, row_bytes), np.uint8)
    lib = _lib()
    lib.ggml_quantize_init(IDS[type_name])
    qw = None
    if imatrix is not None:
        imatrix = np.ascontiguousarray(imatrix, dtype=np.float32)
        assert imatrix.shape == (n,)
        qw = imatrix.ctypes.data
    written = lib.ggml_quantize_chunk(IDS[type_name], x.ctypes.data, out.ctypes.data, 0, rows, n, qw)
    assert written == out.nbytes, (written, out.nbytes)
    return out
