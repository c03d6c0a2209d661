"""What every bench script shares: a log line on stderr, the machine a result was measured on,
where results go, and the corpus texts they read.

Results: `bench/results/NAME.json`, or `bench/results/quick/NAME.json` for a `--quick` smoke run
(so a smoke run never overwrites a measurement); `LOCALLLM_BENCH_RESULTS` moves both (the test
of the suite writes into a temporary folder)."""

from __future__ import annotations

import json
import os
import platform
import sys
import time
from pathlib import Path
from typing import Any

BENCH = Path(__file__).resolve().parent


def corpus_dir() -> Path:
    """The repository's public-domain texts (`tests/data/corpus`, the folder the tests read;
    `LOCALLLM_CORPUS` names another), or exit with one line saying where they were looked for."""
    path = Path(os.environ.get("LOCALLLM_CORPUS") or BENCH.parent / "tests" / "data" / "corpus")
    if not (path / "tinyshakespeare.txt").is_file():
        sys.exit(f"corpus not found at {path}: unset LOCALLLM_CORPUS to use tests/data/corpus")
    return path


def log(*a: object) -> None:
    print(*a, file=sys.stderr, flush=True)


def results_dir(quick: bool = False) -> Path:
    """Where results are written: bench/results (LOCALLLM_BENCH_RESULTS), quick/ below it."""
    base = Path(os.environ.get("LOCALLLM_BENCH_RESULTS") or BENCH / "results")
    return base / "quick" if quick else base


def results_path(name: str, quick: bool = False) -> Path:
    """`NAME.json` in results_dir(quick), the folder made."""
    d = results_dir(quick)
    d.mkdir(parents=True, exist_ok=True)
    return d / f"{name}.json"


def save(name: str, data: dict[str, Any], quick: bool = False) -> Path:
    """Write `data` as NAME.json (temp file, rename), with the machine and the time added where
    the script did not set them."""
    if not isinstance(data.get("machine"), dict):  # some scripts put platform.machine() there
        data["machine"] = machine() | ({"arch": data["machine"]} if data.get("machine") else {})
    data.setdefault("when", time.strftime("%Y-%m-%d %H:%M"))
    data["quick"] = quick
    path = results_path(name, quick)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_text(json.dumps(data, indent=2, default=str) + "\n")
    os.replace(tmp, path)
    log(f"wrote {path}")
    return path


def machine() -> dict:
    """CPU model, cores, memory, torch version and vector ISA, torch's threads (asked on the
    engine's compute thread, where the engine's torch work runs), the GPU and the load average."""
    cpu = next((ln.split(":", 1)[1].strip() for ln in Path("/proc/cpuinfo").read_text().splitlines()
                if ln.startswith("model name")), platform.processor())  # fmt: skip
    out: dict[str, Any] = {"cpu": cpu, "cores": os.cpu_count(), "load": os.getloadavg()}
    try:
        import psutil

        out["memory_bytes"] = psutil.virtual_memory().total
    except ImportError:
        pass
    try:
        import torch

        from localllm.backends.torch.runner import on_compute_thread

        out |= {"torch": torch.__version__, "threads": on_compute_thread(torch.get_num_threads)(),
                "capability": torch.backends.cpu.get_cpu_capability()}  # fmt: skip
        if torch.cuda.is_available():
            out["gpu"] = torch.cuda.get_device_name(0)
    except ImportError:
        pass
    return out
