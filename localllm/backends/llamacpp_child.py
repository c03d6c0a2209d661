"""The child side of the llama.cpp guard: what runs in the process that may die.

`localllm.backends.llamacpp_guard` starts this module in a child process (`python -m
localllm.backends.llamacpp_child ...`) and judges how it ended; only here does llama.cpp compute
before the guard's verdict. It imports the runner and the guard; neither imports it.

    probe DIR          evaluate a tiny model written into DIR (can llama.cpp compute here at all?)
    load PATH LAYERS   load a model file as the runner would and evaluate a few tokens
    info               build facts, as JSON
"""

from __future__ import annotations

import json
import sys
from collections.abc import Sequence
from pathlib import Path

from localllm.backends.base import Piece
from localllm.backends.llamacpp import LlamaCppRunner, quiet_llama_log
from localllm.backends.llamacpp_guard import logits_disagree, no_core_files, write_probe_model
from localllm.errors import LocalLLMError


def child_probe(folder: str) -> int:
    """Evaluate the tiny model the way the runner would: it must run and compute right numbers."""
    path = write_probe_model(Path(folder) / "probe.gguf")
    runner = LlamaCppRunner(path, n_ctx=128, n_gpu_layers=0)
    try:
        problem = batch_vs_single(runner, [1] + [3 + (i * 37) % 256 for i in range(23)])
    finally:
        runner.close()
    if problem:
        print(f"error: llama.cpp computes wrong numbers on this machine: {problem}")
        return 3
    return 0


def child_load(path: str, n_gpu_layers: str) -> int:
    """Load the model as the runner would and evaluate a few tokens."""
    try:
        runner = LlamaCppRunner(path, n_ctx=128, n_gpu_layers=int(n_gpu_layers))
    except LocalLLMError as e:
        print(json.dumps({"reason": str(e)}))
        return 3
    try:
        ids = runner.tokenize("Hello, world! How are you?", add_special=True)[:8] or [0]
        problem = batch_vs_single(runner, ids)
    finally:
        runner.close()
    if problem:
        reason = f"llama.cpp computes wrong numbers for it on this machine: {problem}"
        print(json.dumps({"reason": reason}))
        return 3
    return 0


def batch_vs_single(runner: LlamaCppRunner, ids: Sequence[int]) -> str:
    """Evaluate `ids` in slot 0 as one piece (the matrix-matrix kernels), then one token at a time
    (the matrix-vector kernels); "" when the next-token logits agree, else why not."""
    runner.clear(0)
    batch = runner.forward([Piece(0, list(ids), 1)]).logits[-1]
    runner.clear(0)
    for t in ids:
        single = runner.forward([Piece(0, [t], 1)]).logits[-1]
    runner.clear(0)
    return logits_disagree(batch.tolist(), single.tolist())


def child_info() -> int:
    from localllm.backends.ggml_devices import list_devices

    llama_cpp = quiet_llama_log()
    llama_cpp.llama_backend_init()  # registers the build's backends and their devices
    print(json.dumps({
        "system_info": llama_cpp.llama_print_system_info().decode("utf-8", "replace").strip(),
        "gpu_offload": bool(llama_cpp.llama_supports_gpu_offload()),
        "devices": list_devices(),
    }))  # fmt: skip
    return 0


def main(argv: list[str]) -> int:
    no_core_files()
    if argv[:1] == ["probe"] and len(argv) == 2:
        return child_probe(argv[1])
    if argv[:1] == ["load"] and len(argv) == 3:
        return child_load(argv[1], argv[2])
    if argv == ["info"]:
        return child_info()
    print(__doc__, file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
