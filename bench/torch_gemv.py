"""Decode-step matrix products on CPU: fp32 against the quantized kernels torch ships, one run.

    .venv/bin/python bench/torch_gemv.py [--threads 2] [--runs 7] [--models smollm2,gemma3]
                                          [--rows 1,4,8] [--prefill 256] [--skip-compiled]

A decode step multiplies M rows (one per sequence) by every weight matrix once. This allocates
every layer's matrices separately at the real shapes (so they stream from memory as in a real
model, not from cache), random N(0, 0.02) weights, and times the whole set per candidate:

    fp32          F.linear, the baseline
    bf16          F.linear on bf16 weights and inputs (oneDNN accumulates in fp32)
    fp16w         fbgemm `quantized::linear_dynamic_fp16`: fp16 weights, fp32 inputs and sums
    int8dyn       fbgemm `quantized::linear_dynamic`: int8 per-output-channel weights; each call
                  quantizes its input to uint8 (one scale for the whole input), int32 sums
    int8pack      `torch._weight_int8pack_mm` (int8 per-channel weights; fp32 / bf16 inputs)
    int4pack_gG   `aten._weight_int4pack_mm_for_cpu`, groups of G, bf16 inputs
    int8compiled  torch.compile (inductor C++) of `(x[..., None, :] * w.float()).sum(-1) * scale`

Candidates run round-robin and each figure is the median of --runs passes (minimum also kept),
so load from other processes hits them alike. --prefill times the layers (no head: prefill
needs the head for the last row only) at that many rows. Writes bench/results/torch_gemv.json.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

RESULTS = Path(__file__).parent / "results"

# (out, in) of one layer's projections as the models build them (q, k, v fused into wqkv; gate
# and up into w13), and the output head. SmolLM2-135M: dim 576, 9 heads of 64, 3 kv heads,
# ffn 1536, 30 layers, vocab 49152. Gemma-3-270m: dim 640, 4 heads of 256, 1 kv head, ffn 2048,
# 18 layers, vocab 262144.
MODELS = {
    "smollm2": {
        "layers": 30,
        "layer": [(576 + 2 * 192, 576), (576, 576), (2 * 1536, 576), (576, 1536)],
        "head": (49152, 576),
    },
    "gemma3": {
        "layers": 18,
        "layer": [(1024 + 2 * 256, 640), (640, 1024), (2 * 2048, 640), (640, 2048)],
        "head": (262144, 640),
    },
}

Op = Callable[[torch.Tensor], torch.Tensor]
# A candidate: (name, bytes per weight, prepare(weight fp32 (out, in)) -> op(x (M, in))).
Candidate = tuple[str, float, Callable[[torch.Tensor], Op]]


def quantize_int8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-output-channel int8: w ≈ q * scale[:, None]."""
    scale = (w.abs().amax(dim=1) / 127).clamp(min=1e-12)
    return torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8), scale


def prep_fp32(w: torch.Tensor) -> Op:
    return lambda x: F.linear(x, w)


def prep_bf16(w: torch.Tensor) -> Op:
    wb = w.to(torch.bfloat16)
    return lambda x: F.linear(x.to(torch.bfloat16), wb).float()


def prep_fp16w(w: torch.Tensor) -> Op:
    packed = torch.ops.quantized.linear_prepack_fp16(w, None)
    return lambda x: torch.ops.quantized.linear_dynamic_fp16(x, packed)


def prep_int8dyn(w: torch.Tensor) -> Op:
    q, scale = quantize_int8(w)
    zero = torch.zeros(w.shape[0], dtype=torch.long)
    qw = torch._make_per_channel_quantized_tensor(q, scale.double(), zero, 0)
    packed = torch.ops.quantized.linear_prepack(qw, None)
    return lambda x: torch.ops.quantized.linear_dynamic(x, packed)


def prep_int8pack(w: torch.Tensor, dtype: torch.dtype) -> Op:
    q, scale = quantize_int8(w)
    scale = scale.to(dtype)
    return lambda x: torch._weight_int8pack_mm(x.to(dtype), q, scale).float()


def prep_int4pack(w: torch.Tensor, group: int) -> Op:
    n, k = w.shape
    wg = w.reshape(n, k // group, group)
    lo, hi = wg.amin(-1), wg.amax(-1)
    scale = ((hi - lo) / 15).clamp(min=1e-8)
    q = torch.round((wg - lo[..., None]) / scale[..., None]).clamp(0, 15).to(torch.int32)
    # the kernel computes (q - 8) * scale + zero
    scales_zeros = torch.stack([scale, lo + 8 * scale], -1).transpose(0, 1).contiguous()
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.reshape(n, k), 1)
    sz = scales_zeros.to(torch.bfloat16)
    return lambda x: torch.ops.aten._weight_int4pack_mm_for_cpu(
        x.to(torch.bfloat16), packed, group, sz
    ).float()


def _rowdot(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return (x.unsqueeze(-2) * q.to(x.dtype)).sum(-1) * scale


_compiled_rowdot = None


def prep_int8compiled(w: torch.Tensor) -> Op:
    global _compiled_rowdot
    if _compiled_rowdot is None:
        torch._dynamo.config.recompile_limit = 64
        _compiled_rowdot = torch.compile(_rowdot, dynamic=False)
    q, scale = quantize_int8(w)
    return lambda x: _compiled_rowdot(x, q, scale)


def candidates(skip_compiled: bool) -> list[Candidate]:
    out: list[Candidate] = [
        ("fp32", 4, prep_fp32),
        ("bf16", 2, prep_bf16),
        ("fp16w", 2, prep_fp16w),
        ("int8dyn", 1, prep_int8dyn),
        ("int8pack_fp32", 1, lambda w: prep_int8pack(w, torch.float32)),
        ("int8pack_bf16", 1, lambda w: prep_int8pack(w, torch.bfloat16)),
    ]
    for g in (32, 64, 128):
        out.append((f"int4pack_g{g}", 0.5 + 4 / g, lambda w, g=g: prep_int4pack(w, g)))
    if not skip_compiled:
        out.append(("int8compiled", 1, prep_int8compiled))
    return out


def pass_time(ops: list[tuple[Op, torch.Tensor]]) -> float:
    t0 = time.perf_counter()
    for op, x in ops:
        op(x)
    return time.perf_counter() - t0


def bench_model(
    name: str, spec: dict, rows: list[int], runs: int, prefill: int, skip_compiled: bool
) -> dict:
    torch.manual_seed(0)
    shapes = [s for _ in range(spec["layers"]) for s in spec["layer"]]
    weights = [torch.randn(s) * 0.02 for s in shapes]
    head = torch.randn(spec["head"]) * 0.02
    n_params = sum(w.numel() for w in weights) + head.numel()
    result: dict = {
        "params": n_params,
        "layers": spec["layers"],
        "head": list(spec["head"]),
        "candidates": {},
    }
    print(f"\n{name}: {n_params / 1e6:.1f} M weights per decode step")
    prepared: dict[str, tuple[float, list[Op], Op]] = {}
    for cname, bpw, prep in candidates(skip_compiled):
        t0 = time.perf_counter()
        try:
            prepared[cname] = (bpw, [prep(w) for w in weights], prep(head))
        except Exception as e:  # noqa: BLE001 - a kernel this torch lacks is a result too
            result["candidates"][cname] = {"error": f"{type(e).__name__}: {e}"[:300]}
            print(f"  {cname}: unavailable ({type(e).__name__})")
            continue
        result["candidates"][cname] = {
            "bytes_per_weight": bpw,
            "prepare_s": round(time.perf_counter() - t0, 2),
        }
    for m in rows + ([prefill] if prefill else []):
        with_head = m != prefill
        xs = {k: torch.randn(m, k) for k in {s[1] for s in shapes}}
        passes: dict[str, list[float]] = {c: [] for c in prepared}
        for cname, (_, ops, head_op) in list(prepared.items()):
            chain = [(op, xs[w.shape[1]]) for op, w in zip(ops, weights)]
            if with_head:
                chain.append((head_op, xs[head.shape[1]]))
            try:
                t0 = time.perf_counter()
                pass_time(chain)  # warm-up; compiles the compiled candidate for this M
                first = time.perf_counter() - t0
            except Exception as e:  # noqa: BLE001
                result["candidates"][cname][f"m{m}_error"] = f"{type(e).__name__}: {e}"[:300]
                print(f"  {cname} M={m}: failed ({type(e).__name__}: {e})"[:200])
                del prepared[cname], passes[cname]
                continue
            if cname == "int8compiled":
                result["candidates"][cname][f"m{m}_first_pass_s"] = round(first, 2)
        n_runs = runs if with_head else max(2, runs // 3)
        for _ in range(n_runs):
            for cname, (_, ops, head_op) in prepared.items():
                chain = [(op, xs[w.shape[1]]) for op, w in zip(ops, weights)]
                if with_head:
                    chain.append((head_op, xs[head.shape[1]]))
                passes[cname].append(pass_time(chain))
        base = statistics.median(passes["fp32"])
        label = f"M={m}" + ("" if with_head else " (prefill, layers only)")
        print(f"  {label}")
        for cname, ts in passes.items():
            bpw = prepared[cname][0]
            med = statistics.median(ts)
            n_w = n_params if with_head else n_params - head.numel()
            row = {
                "ms": round(med * 1e3, 2),
                "min_ms": round(min(ts) * 1e3, 2),
                "steps_per_s": round(1 / med, 1),
                "tokens_per_s": round(m / med, 1),
                "weight_GB_per_s": round(n_w * bpw / med / 1e9, 2),
                "speedup_vs_fp32": round(base / med, 2),
            }
            result["candidates"][cname][f"m{m}"] = row
            print(
                f"    {cname:<14} {row['ms']:8.2f} ms (min {row['min_ms']:7.2f})"
                f"  {row['tokens_per_s']:7.1f} tok/s  {row['weight_GB_per_s']:5.1f} GB/s"
                f"  x{row['speedup_vs_fp32']:.2f}",
                flush=True,
            )
    return result


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--runs", type=int, default=7)
    ap.add_argument("--models", default="smollm2,gemma3")
    ap.add_argument("--rows", default="1,4,8")
    ap.add_argument("--prefill", type=int, default=256, help="0 skips the prefill timing")
    ap.add_argument("--skip-compiled", action="store_true")
    ap.add_argument("--out", default=str(RESULTS / "torch_gemv.json"))
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    rows = [int(r) for r in args.rows.split(",")]
    out = {
        "how": "median of --runs passes over every weight matrix of the model (distinct tensors "
        "per layer, random weights), candidates interleaved; tokens_per_s = M / pass time",
        "torch": torch.__version__,
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "machine": platform.processor() or platform.machine(),
        "cpus": os.cpu_count(),
        "threads": args.threads,
        "runs": args.runs,
        "cxx_compiler": shutil.which(os.environ.get("CXX", "g++")),
        "quantized_engine": torch.backends.quantized.engine,
        "models": {},
    }
    for name in args.models.split(","):
        out["models"][name] = bench_model(
            name, MODELS[name], rows, args.runs, args.prefill, args.skip_compiled
        )
    Path(args.out).parent.mkdir(exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=2) + "\n")
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
