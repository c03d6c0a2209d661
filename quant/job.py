"""`localllm quantize` as one call, for the CLI and the app alike: the source by name or path, the
result registered in the store (or written to a path), and the quality report when a text is given."""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from localllm.errors import LocalLLMError
from localllm.quant.mix import FILE_TYPES, default_type
from localllm.quant.writer import QuantizeResult, TensorDone, quantize_file

__all__ = ["METHODS", "QuantizeJob", "run_quantize"]

METHODS = ("plain", "gptq", "awq", "awq+gptq")


@dataclass
class QuantizeJob:
    result: QuantizeResult
    where: str  # the registered name, or the output path
    source: str  # the source's file name
    report: dict[str, Any] | None = None


def run_quantize(store: Any, src: str, file_type: str, *, output: Path | None = None,
                 name: str | None = None, engine: str = "auto", allow_requantize: bool = False,
                 eval_text: Path | None = None, eval_limit: int = 1024,
                 calibrate: Path | None = None, calibrate_tokens: int = 4096,
                 save_imatrix: Path | None = None, method: str = "plain",
                 on_tensor: Callable[[TensorDone], None] | None = None,
                 cancel: threading.Event | None = None,
                 on_phase: Callable[[str], None] | None = None) -> QuantizeJob:  # fmt: skip
    """Quantize the model `src` (a store name or a GGUF path) to `file_type`. `calibrate`: a
    text to collect an importance matrix on (kept at `save_imatrix` when given), or an importance
    matrix file (llama-imatrix's GGUF or `.dat`). `method`: "plain" (llama.cpp's rounding) or
    "gptq" (error-correcting, `gptq`), "awq" (activation-aware scales folded into the norms,
    `awq`) or "awq+gptq" (the scales, then GPTQ on the scaled matrices) — each needs a --calibrate
    text, whose activations give each matrix its Hessian."""
    from localllm.models_registry.catalog import ensure_local
    from localllm.models_registry.names import name_from_file, parse_name
    from localllm.models_registry.store import sha256_file

    if output is not None and name is not None:
        raise LocalLLMError("give an output path or a name, not both")
    given = Path(src).expanduser()
    source_name = None
    if given.is_file():
        path, base = given, name_from_file(given)
    else:
        record = ensure_local(src, store)
        path, base, source_name = store.path_of(record), parse_name(record.name).name, record.name
    if eval_text is not None and not Path(eval_text).is_file():
        raise LocalLLMError(f"no such text file: {eval_text}")
    kind = file_type.upper()
    if method not in METHODS:
        raise LocalLLMError(f"unknown --method {method} (known: {', '.join(METHODS)})")
    imatrix = hessians = values = None
    if method != "plain" and engine == "llama.cpp":
        raise LocalLLMError(f"--method {method} is our quantizer's: it needs --engine localllm (or auto)")
    if method != "plain" and calibrate is None:
        raise LocalLLMError(f"--method {method} needs --calibrate TEXT: the activations its Hessians come "
                            "from (e.g. a few thousand tokens of text like the model's use)")  # fmt: skip
    if "gptq" in method and kind in FILE_TYPES:
        from localllm.quant.gptq import TYPES as GPTQ_TYPES

        if default_type(kind) not in GPTQ_TYPES:  # no grid to feed the error through: say so, not round plainly
            raise LocalLLMError(f"--method {method} has no grid for {kind}'s {default_type(kind)} blocks (it writes "
                                f"{', '.join(GPTQ_TYPES)}): use --method plain or awq with --calibrate")  # fmt: skip
    if calibrate is not None:
        from localllm.quant import imatrix as imatrix_file

        if imatrix_file.is_imatrix(calibrate):  # one llama-imatrix (or --save-imatrix) made
            if method != "plain":
                raise LocalLLMError(f"--method {method} needs a text to --calibrate on: {Path(calibrate).name} "
                                    "is an importance matrix, which keeps no Hessians")  # fmt: skip
            imatrix = imatrix_file.read(calibrate).means()
        else:
            from localllm.evaluate import read_text
            from localllm.quant.calibrate import CHUNK, collect_imatrix

            if on_phase:
                on_phase("calibrating")
            rows: dict[str, int] = {}
            hessians = {} if method != "plain" else None
            imatrix = collect_imatrix(path, read_text(Path(calibrate)), tokens=calibrate_tokens, rows=rows,
                                      hessians=hessians)  # fmt: skip
            if save_imatrix is not None:  # for llama-quantize --imatrix, or another run of ours
                imatrix_file.write(save_imatrix, imatrix_file.Imatrix.from_means(
                    imatrix, rows, dataset=Path(calibrate).name, chunk_size=CHUNK))  # fmt: skip
            if "awq" in method:  # the scaled tensors; their inputs' statistics under the scales
                from localllm.quant.awq import fold, rescaled

                if on_phase:
                    on_phase("searching scales")
                values, scales, _ = fold(str(path), kind, hessians or {})
                imatrix = {**imatrix, **rescaled(imatrix, scales)}
                hessians = {**hessians, **rescaled(hessians, scales)} if "gptq" in method else None
    elif save_imatrix is not None:
        raise LocalLLMError("--save-imatrix keeps the matrix --calibrate TEXT collects: give --calibrate")
    target = output if output is not None else store.temp_path()
    stop = cancel.is_set if cancel is not None else None
    result = quantize_file(path, target, kind, engine=engine, allow_requantize=allow_requantize,
                           on_tensor=on_tensor, cancel=stop, imatrix=imatrix, hessians=hessians,
                           values=values)  # fmt: skip
    where = str(result.path)
    if output is None:
        if on_phase:
            on_phase("registering")
        record = store.adopt(result.path, name or f"{base}:{kind.lower()}",
                             source=f"quantize:{path.name}:{kind}", digest=sha256_file(result.path))  # fmt: skip
        where = record.name
    job = QuantizeJob(result, where, path.name)
    if eval_text is not None:  # both sides by name, through the store (hard links, no copies)
        from localllm.quant.report import quality_report, save_report

        if on_phase:
            on_phase("measuring quality")
        out_name = where if output is None else store.import_file(result.path).name
        source_name = source_name or store.import_file(path).name
        job.report = quality_report(out_name, source_name, Path(eval_text), limit=eval_limit,
                                    file_type=kind, bits_per_weight=result.bits_per_weight)  # fmt: skip
        save_report(store.home, job.report)
    return job
