"""The importance matrix of `quantize --calibrate TEXT`: the torch engine runs the model over the
text and, for every weight matrix, averages the square of each input column's activation — what
llama.cpp's `llama-imatrix` collects (its file holds Σx² and the count; the quantizer is given the
mean). Columns that carry large activations then weigh more in the scale search, so they are
rounded more carefully.

The torch engine fuses q|k|v and gate|up into one projection each: they read the same input, so
attn_q, attn_k and attn_v share one vector, as ffn_gate and ffn_up do (llama.cpp's are equal too).
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from localllm.errors import LocalLLMError

__all__ = ["CHUNK", "collect_imatrix"]

DEFAULT_TOKENS = 4096  # of the text
CHUNK = 512  # tokens per evaluation, each on fresh caches (as llama-imatrix's chunks)


def _targets(model: Any, tied: bool) -> dict[Any, tuple[str, ...]]:
    """Projection module → the GGUF weight names that read its input."""
    out: dict[Any, tuple[str, ...]] = {}
    for i, layer in enumerate(model.layers):
        att, ffn = getattr(layer, "attention", None), getattr(layer, "feed_forward", None)
        if not all(hasattr(m, a) for m, a in ((att, "wqkv"), (att, "wo"), (ffn, "w13"), (ffn, "w2"))):
            raise LocalLLMError("--calibrate covers the Llama family (llama, qwen2, qwen3) and Gemma 3 for now; "
                                "this architecture's layers are built otherwise")  # fmt: skip
        b = f"blk.{i}."
        out[att.wqkv] = (b + "attn_q.weight", b + "attn_k.weight", b + "attn_v.weight")
        out[att.wo] = (b + "attn_output.weight",)
        out[ffn.w13] = (b + "ffn_gate.weight", b + "ffn_up.weight")
        out[ffn.w2] = (b + "ffn_down.weight",)
    out[model.output] = ("token_embd.weight" if tied else "output.weight",)
    return out


def collect_imatrix(path: str | Path, text: str, *, tokens: int = DEFAULT_TOKENS,
                    progress: Callable[[int, int], None] | None = None,
                    rows: dict[str, int] | None = None,
                    hessians: dict[str, np.ndarray] | None = None) -> dict[str, np.ndarray]:  # fmt: skip
    """Tensor name → mean squared activation of each input column over the first `tokens`
    tokens of `text` (float32, one value per column); `rows`, when given, gets each name's
    count of rows averaged (what an imatrix file keeps beside the sums); `hessians`, when given,
    each name's mean outer product of its input, E[x xᵀ] (float32 (n, n), shared by the names
    that read one input) — `--method gptq`'s Hessians, whose diagonal is the importance."""
    if importlib.util.find_spec("torch") is None:
        raise LocalLLMError("--calibrate runs the torch engine: pip install 'localllm[torch]'")
    from localllm.backends.base import Piece
    from localllm.backends.torch.runner import TorchRunner
    from localllm.gguf_file import read_gguf

    tied = "output.weight" not in read_gguf(path).tensors
    runner = TorchRunner(path, n_ctx=CHUNK, n_slots=1, max_batch=CHUNK, dtype="f32", device="cpu")
    ids = runner.tokenize(text, add_special=False)[:tokens]
    if len(ids) < 2:
        runner.close()
        raise LocalLLMError("the calibration text has fewer than 2 tokens")
    sums: dict[Any, Any] = {}
    counts: dict[Any, int] = {}
    grams: dict[Any, Any] = {}
    targets = _targets(runner.model, tied)

    def hook(module: Any, args: tuple[Any, ...]) -> None:
        x = args[0].detach().reshape(-1, args[0].shape[-1]).double()
        sums[module] = sums.get(module, 0) + (x * x).sum(0)
        counts[module] = counts.get(module, 0) + x.shape[0]
        if hessians is not None:
            grams[module] = grams.get(module, 0) + x.T @ x

    handles = [m.register_forward_pre_hook(hook) for m in targets]
    try:
        bos = [runner.tokenizer.bos_id] if (runner.tokenizer.bos_id or -1) >= 0 else []
        size = runner.n_ctx - len(bos)  # CHUNK, or the model's context when shorter
        for start in range(0, len(ids), size):
            chunk = bos + ids[start : start + size]
            runner.clear(0)  # fresh caches for every chunk
            # every position's logits: the output head reads every position too
            runner.forward([Piece(0, chunk, len(chunk))])
            if progress is not None:
                progress(min(start + size, len(ids)), len(ids))
    finally:
        for handle in handles:
            handle.remove()
        runner.close()
    out: dict[str, np.ndarray] = {}
    for module, names in targets.items():
        if module in sums:
            mean = (sums[module] / counts[module]).float().numpy()
            for name in names:
                out[name] = mean
                if rows is not None:
                    rows[name] = counts[module]
            if hessians is not None:
                gram = (grams.pop(module) / counts[module]).float().numpy()
                for name in names:
                    hessians[name] = gram
    return out
