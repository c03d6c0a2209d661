"""The machine's compute devices: what `doctor`, `show`, the offload planner and both engines'
estimates read, from one place.

An inventory is detected (nvidia-smi for NVIDIA GPUs, the unified memory of Apple silicon, psutil
for RAM; torch only when it is already imported) or described: `LOCALLLM_DEVICES` or
`show --devices FILE.json` hold the same JSON, a list of devices

    [{"kind": "cuda", "name": "RTX 4090", "total": "24 GiB", "free": "23.1 GiB",
      "bandwidth": "1008 GB/s"}, {"kind": "cpu", "total": "64 GiB", "free": 60000000000}]

(bytes as numbers or with a unit; `free` defaults to `total`; `bandwidth` is optional), which is
how a user asks "will this fit on a 24 GB card?" and how tests inject machines. A described
inventory without a "cpu" entry, or with one that gives no sizes, gets this machine's RAM
(`[{"kind": "cpu"}]`: this machine without its GPUs).
"""

from __future__ import annotations

import functools
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from localllm.errors import LocalLLMError

ENV = "LOCALLLM_DEVICES"
KINDS = ("cuda", "rocm", "metal", "vulkan", "cpu")  # GPU kinds first
_MAX_DEVICES = 16  # llama.cpp's LLAMA_MAX_DEVICES

# Memory bandwidth (bytes/s) of common cards, by a word of their name, for the planner's expected
# decode rate when an inventory does not say (vendors' datasheets). Decode reads every offloaded
# weight once per token, so rate ≈ bandwidth / bytes; a card not here gets no rate, not a guess.
_BANDWIDTH_GB_S = (
    ("H200", 4800), ("H100 PCIe", 2000), ("H100", 3350), ("A100-SXM4-80GB", 2039), ("A100", 1555),
    ("L40S", 864), ("L40", 864), ("L4", 300), ("A10G", 600), ("A10", 600), ("T4", 320),
    ("RTX 6000 Ada", 960), ("RTX A6000", 768),
    ("5090", 1792), ("5080", 960), ("5070 Ti", 896), ("5070", 672), ("5060 Ti", 448),
    ("4090", 1008), ("4080", 717), ("4070 Ti", 504), ("4070", 504), ("4060 Ti", 288), ("4060", 272),
    ("3090", 936), ("3080 Ti", 912), ("3080", 760), ("3070", 448), ("3060 Ti", 448), ("3060", 360), ("3050", 224),
    ("M4 Max", 546), ("M4 Pro", 273), ("M4", 120), ("M3 Ultra", 819), ("M3 Max", 400),
    ("M3 Pro", 150), ("M3", 100), ("M2 Ultra", 800), ("M2 Max", 400), ("M2 Pro", 200), ("M2", 100),
    ("M1 Ultra", 800), ("M1 Max", 400), ("M1 Pro", 200), ("M1", 68),
)  # fmt: skip


@dataclass(frozen=True)
class Device:
    """One device: a GPU (kind cuda, rocm, metal, vulkan) or the CPU's RAM."""

    kind: str
    name: str
    total_bytes: int
    free_bytes: int
    bandwidth: float | None = None  # bytes per second, when known
    index: int = 0  # among the devices of its kind
    unified: bool = False  # shares its memory with the CPU (Apple silicon)

    @property
    def id(self) -> str:
        return "cpu" if self.kind == "cpu" else f"{self.kind}:{self.index}"

    @property
    def gpu(self) -> bool:
        return self.kind != "cpu"

    @property
    def label(self) -> str:
        """How plans name it: "GPU 0", "CPU"."""
        return "CPU" if self.kind == "cpu" else f"GPU {self.index}"

    def to_dict(self) -> dict[str, Any]:
        return {"kind": self.kind, "name": self.name, "id": self.id, "total_bytes": self.total_bytes,
                "free_bytes": self.free_bytes, "bandwidth": self.bandwidth,
                "unified": self.unified}  # fmt: skip


@dataclass(frozen=True)
class Inventory:
    devices: tuple[Device, ...]  # GPUs in index order, then the CPU
    source: str  # "detected", or where the description came from

    @property
    def gpus(self) -> tuple[Device, ...]:
        return tuple(d for d in self.devices if d.gpu)

    @property
    def cpu(self) -> Device:
        return next(d for d in self.devices if not d.gpu)

    def to_dict(self) -> dict[str, Any]:
        return {"source": self.source, "devices": [d.to_dict() for d in self.devices]}


_UNITS = {"": 1, "b": 1, "k": 1000, "kb": 1000, "kib": 1024, "m": 1000**2, "mb": 1000**2,
          "mib": 1024**2, "g": 1000**3, "gb": 1000**3, "gib": 1024**3, "t": 1000**4,
          "tb": 1000**4, "tib": 1024**4}  # fmt: skip


def parse_size(value: Any, what: str) -> int:
    """Bytes from a number or a string with a unit ("24 GiB", "23.5GB", 8e9)."""
    if isinstance(value, bool):
        raise LocalLLMError(f"{what}: a size is a number of bytes or e.g. \"24 GiB\", not {value!r}")
    if isinstance(value, int | float):
        n = float(value)
    else:
        m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:e[0-9]+)?)\s*([a-zA-Z]*)\s*", str(value))
        unit = m.group(2).lower() if m else ""
        if m is None or unit not in _UNITS:
            raise LocalLLMError(f"{what}: {value!r} is not a size (e.g. 24 GiB, 8000000000)")
        n = float(m.group(1)) * _UNITS[unit]
    if not 0 <= n < 1 << 60:
        raise LocalLLMError(f"{what}: {value!r} is not a size a device has")
    return int(n)


def _bandwidth(value: Any, what: str) -> float:
    """Bytes per second from a number or "1008 GB/s"."""
    text = value if not isinstance(value, str) else value.strip().removesuffix("/s")
    return float(parse_size(text, what))


def known_bandwidth(name: str) -> float | None:
    """A card's datasheet bandwidth (bytes/s) by its name, or None."""
    for word, gb_s in _BANDWIDTH_GB_S:
        if re.search(rf"(?<![0-9A-Za-z]){re.escape(word)}(?![0-9A-Za-z])", name):
            return gb_s * 1e9
    return None


def describe(data: Any, source: str) -> Inventory:
    """An inventory from its JSON description (see the module's docstring); one line if wrong."""
    if isinstance(data, dict) and "devices" in data:
        data = data["devices"]
    if not isinstance(data, list) or not data:
        raise LocalLLMError(f"{source}: a device description is a non-empty JSON list of devices")
    if len(data) > _MAX_DEVICES + 1:
        raise LocalLLMError(f"{source}: at most {_MAX_DEVICES} GPUs and the CPU")
    counts: dict[str, int] = {}
    devices: list[Device] = []
    for i, d in enumerate(data):
        where = f"{source}: device {i}"
        if not isinstance(d, dict):
            raise LocalLLMError(f"{where} is not an object with kind, total and free")
        kind = str(d.get("kind", "")).lower()
        if kind not in KINDS:
            raise LocalLLMError(f"{where}: kind must be one of {', '.join(KINDS)}, not {d.get('kind')!r}")
        if kind == "cpu" and "total" not in d and "free" not in d:  # this machine's RAM
            ram = _cpu()
            devices.append(Device("cpu", str(d.get("name") or ram.name), ram.total_bytes,
                                  ram.free_bytes, _bandwidth(d["bandwidth"], f"{where} bandwidth")
                                  if d.get("bandwidth") is not None else ram.bandwidth))  # fmt: skip
            counts["cpu"] = counts.get("cpu", 0) + 1
            continue
        if "total" not in d:
            raise LocalLLMError(f"{where}: total (bytes) is missing")
        total = parse_size(d["total"], f"{where} total")
        free = parse_size(d.get("free", total), f"{where} free")
        if free > total:
            raise LocalLLMError(f"{where}: free ({free:,} bytes) is more than total ({total:,})")
        name = str(d.get("name") or ("CPU" if kind == "cpu" else kind.upper()))
        bw = d.get("bandwidth")
        bandwidth = _bandwidth(bw, f"{where} bandwidth") if bw is not None else known_bandwidth(name)
        devices.append(Device(kind, name, total, free, bandwidth, counts.get(kind, 0),
                              unified=bool(d.get("unified", kind == "metal"))))  # fmt: skip
        counts[kind] = counts.get(kind, 0) + 1
    if counts.get("cpu", 0) > 1:
        raise LocalLLMError(f"{source}: one cpu entry at most")
    if "cpu" not in counts:  # the RAM a unified GPU shares, else this machine's
        shared = next((d for d in devices if d.unified), None)
        devices.append(Device("cpu", "CPU", shared.total_bytes, shared.free_bytes, shared.bandwidth)
                       if shared else _cpu())  # fmt: skip
    # numbered as llama.cpp numbers its GPUs: in the order listed, whatever their kind
    gpus = [Device(d.kind, d.name, d.total_bytes, d.free_bytes, d.bandwidth, n, d.unified)
            for n, d in enumerate(d for d in devices if d.gpu)]  # fmt: skip
    return Inventory((*gpus, next(d for d in devices if not d.gpu)), source)


def read_description(path: str | os.PathLike[str]) -> Inventory:
    """`show --devices FILE.json`."""
    try:
        text = Path(path).read_text()
    except OSError as e:
        raise LocalLLMError(f"cannot read the device description {path}: {e.strerror}") from None
    try:
        data = json.loads(text)
    except ValueError as e:
        raise LocalLLMError(f"{path} is not JSON ({e})") from None
    return describe(data, str(path))


def inventory(path: str | os.PathLike[str] | None = None, *, fresh: bool = False) -> Inventory:
    """The devices to plan for: `path`'s description, else `LOCALLLM_DEVICES` (a JSON text, or the
    path of a file holding it), else what this machine has (kept for a few seconds, so a screen
    that asks once per row does not run nvidia-smi per row; `fresh` asks again)."""
    if path is not None:
        return read_description(path)
    env = os.environ.get(ENV, "").strip()
    if env:
        if env.startswith(("[", "{")):
            try:
                return describe(json.loads(env), ENV)
            except ValueError as e:
                raise LocalLLMError(f"{ENV} is not JSON ({e})") from None
        return read_description(env)
    global _detected
    if fresh or _detected is None or time.monotonic() - _detected[0] > _KEEP_S:
        _detected = (time.monotonic(), detect())
    return _detected[1]


_KEEP_S = 5.0
_detected: tuple[float, Inventory] | None = None


def detect() -> Inventory:
    """This machine's devices. NVIDIA GPUs through torch when it is already imported (paid for),
    else nvidia-smi; Apple silicon's GPU is its RAM (unified; Metal's working set is about three
    quarters of it, which the planner allows)."""
    gpus = _nvidia()
    cpu = _cpu()
    if not gpus and platform.system() == "Darwin" and platform.machine() == "arm64":
        chip = _sysctl("machdep.cpu.brand_string") or "Apple silicon"
        gpus = [Device("metal", chip, cpu.total_bytes, cpu.free_bytes, known_bandwidth(chip),
                       unified=True)]  # the planner gives Metal three quarters of it at most
    return Inventory((*gpus, cpu), "detected")


def _cpu() -> Device:
    import psutil

    vm = psutil.virtual_memory()
    return Device("cpu", _cpu_name(), int(vm.total), int(vm.available), cpu_bandwidth())


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.partition(":")[2].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "CPU"


@functools.cache
def cpu_bandwidth() -> float:
    """RAM bandwidth (bytes/s) as one thread copying 32 MiB measures it, best of three (a tenth
    of a second, once per process): the planner's CPU side of an expected decode rate."""
    import numpy as np

    src = np.ones(32 << 20, dtype=np.uint8)
    dst = np.empty_like(src)
    best = float("inf")
    for _ in range(3):
        t = time.perf_counter()
        np.copyto(dst, src)
        best = min(best, time.perf_counter() - t)
    return 2 * src.nbytes / max(best, 1e-9)  # each byte read once and written once


def _sysctl(key: str) -> str | None:
    try:
        return subprocess.run(["sysctl", "-n", key], capture_output=True, text=True, timeout=5,
                              check=True).stdout.strip() or None  # fmt: skip
    except (OSError, subprocess.SubprocessError):
        return None


def _nvidia() -> list[Device]:
    torch = sys.modules.get("torch")
    if torch is not None and getattr(torch, "version", None) is not None and torch.version.cuda:
        if not torch.cuda.is_available():
            return []
        out = []
        for i in range(torch.cuda.device_count()):
            free, total = torch.cuda.mem_get_info(i)
            name = torch.cuda.get_device_name(i)
            out.append(Device("cuda", name, int(total), int(free), known_bandwidth(name), i))
        return out
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return []
    try:
        lines = subprocess.run(
            [smi, "--query-gpu=name,memory.total,memory.free", "--format=csv,noheader,nounits"],
            capture_output=True, text=True, timeout=5, check=True,
        ).stdout.splitlines()  # fmt: skip
    except (OSError, subprocess.SubprocessError):
        return []
    out = []
    for line in lines:
        parts = [p.strip() for p in line.rsplit(",", 2)]
        try:
            name, total, free = parts[0], int(parts[1]) << 20, int(parts[2]) << 20
        except (ValueError, IndexError):
            continue
        out.append(Device("cuda", name, total, free, known_bandwidth(name), len(out)))
    return out
