"""What every bench script shares: a log line on stderr, and the machine a result was measured on."""

from __future__ import annotations

import os
import platform
import sys
from pathlib import Path


def log(*a: object) -> None:
    print(*a, file=sys.stderr, flush=True)


def machine() -> dict:
    """CPU model, torch version and vector ISA, torch's threads (asked on the engine's compute
    thread, where the engine's torch work runs) and the load average."""
    import torch

    from localllm.backends.torch.backend import on_compute_thread

    cpu = next((ln.split(":", 1)[1].strip() for ln in Path("/proc/cpuinfo").read_text().splitlines()
                if ln.startswith("model name")), platform.processor())  # fmt: skip
    return {"cpu": cpu, "torch": torch.__version__,
            "threads": on_compute_thread(torch.get_num_threads)(),
            "capability": torch.backends.cpu.get_cpu_capability(), "load": os.getloadavg()}  # fmt: skip
