"""`localllm doctor`: a short list of checks of this machine and the store, each with a fix.

Every check gives a `Check`: `ok` True (✓), False (✗, with a one-line `fix`) or None (–, an
optional part that is not installed, which is not a failure). The report is ok when no check
failed. Checks in order, by name, with the keys of their `data`:

    python           Python, OS, machine and the CPU's instruction sets that matter to llama.cpp
                     version, implementation, os, os_release, machine, cpu_isa
    llama_cpp        llama-cpp-python: version, build, llama.cpp's system info, GPU offload and
                     ggml's devices; fails, with the one command that rebuilds it, when a GPU is
                     here and the build has no GPU backend
                     version, build, system_info, backends, blas, gpu_offload, devices ([{name,
                     description, backend, type, total_bytes, free_bytes}])
    llama_cpp_probe  llama.cpp evaluates a tiny model in a child (cached; --deep runs it again)
                     ok, reason, cached
    backends         every --backend name in the registry: runs here or why not, and what it can
                     do; fails when none runs (`run` and the app need one)
                     auto (the backend `auto` picks, or null), backends ([{name, available,
                     reason, capabilities (null for a name this build cannot describe)}])
    torch            torch version and devices (cuda, mps, cpu); ok None when not installed
                     version, cuda_version, cuda (device names), mps
    memory           free RAM (below 512 MiB fails), and each GPU's free memory (the device
                     inventory: nvidia-smi, Apple's unified memory, or LOCALLLM_DEVICES)
                     free_bytes, total_bytes, gpu (null or the first of gpus), gpus ([{device,
                     name, free_bytes, total_bytes}])
    disk             free disk space where the store lives (below 1 GiB fails)
                     path, free_bytes, total_bytes
    store            every index entry has its file with the recorded size (--deep: and sha256)
                     path, models, blobs, references, hashed, damaged ({name: why})
    huggingface      a token present (never shown, not even in part), HF_ENDPOINT, HF_HUB_OFFLINE
                     token (bool), token_source (the variable or the token file), endpoint, offline
    store_write      a file can be created in the store folder
                     path
    conversations    the app's database is a readable SQLite file this localllm can write
                     path, conversations (count, or null)

Nothing here imports llama_cpp or torch: an unusable llama.cpp build can kill the process that
loads it (SIGILL on a CPU without the instructions it was built for), and a broken torch install
can too. Both are asked in child processes: llama.cpp through `localllm.backends.llamacpp_guard`,
torch through `_torch_facts`. `--json` prints `Report.to_dict()`:

    {"ok": bool, "deep": bool,
     "checks": [{"name": str, "ok": bool | null, "detail": str, "fix": str | null, "data": {}}]}

Names and data keys are stable; a check whose own code fails is ✗ with empty data.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import platform
import shutil
import sqlite3
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from localllm.errors import LocalLLMError
from localllm.model_info import human_bytes
from localllm.models_registry.store import Store, sha256_file

MIN_FREE_MEMORY = 512 << 20  # the default model needs ~300 MB (weights, 4K KV cache, compute)
MIN_FREE_DISK = 1 << 30  # room for the smallest catalog models and store.SPACE_MARGIN beside them
TORCH_TIMEOUT_S = 120  # importing torch cold, with CUDA, takes seconds to tens of seconds
HF_DEFAULT_ENDPOINT = "https://huggingface.co"
_TRUE = {"1", "on", "yes", "true"}  # what huggingface_hub reads as true in HF_HUB_OFFLINE


@dataclass(frozen=True)
class Check:
    """One line of the report."""

    name: str
    ok: bool | None  # None: an optional part that is not installed (not a failure)
    detail: str
    fix: str | None = None
    data: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "ok": self.ok,
            "detail": self.detail,
            "fix": self.fix,
            "data": self.data,
        }

    def line(self, marks: tuple[str, str, str, str] = ("✓", "✗", "–", "—")) -> str:
        """`✓ name: detail`, `✗ name: detail — fix: ...` or `– name: detail`."""
        good, bad, neutral, dash = marks
        mark = good if self.ok else neutral if self.ok is None else bad
        text = f"{mark} {self.name}: {self.detail}"
        if self.ok is False and self.fix:
            text += f" {dash} fix: {self.fix}"
        return text


@dataclass(frozen=True)
class Report:
    checks: list[Check]
    deep: bool = False

    @property
    def ok(self) -> bool:
        return all(c.ok is not False for c in self.checks)

    @property
    def failed(self) -> list[Check]:
        return [c for c in self.checks if c.ok is False]

    def to_dict(self) -> dict[str, Any]:
        return {"ok": self.ok, "deep": self.deep, "checks": [c.to_dict() for c in self.checks]}


def run_checks(*, deep: bool = False, on_check: Callable[[Check], None] | None = None) -> Report:
    """Run every check in order; `on_check` sees each one as soon as it is done.

    Args:
        deep: run the llama.cpp probe afresh and re-hash every model file (slow on big stores).
        on_check: called with each finished check (the CLI prints lines as they come).
    """
    checks = []
    for check in iter_checks(deep=deep):
        checks.append(check)
        if on_check is not None:
            on_check(check)
    return Report(checks, deep=deep)


def iter_checks(*, deep: bool = False) -> Iterator[Check]:
    store = Store()
    steps: list[tuple[str, Callable[[], Check]]] = [
        ("python", check_python),
        ("llama_cpp", check_llama_cpp),
        ("llama_cpp_probe", lambda: check_llama_cpp_probe(store.home, refresh=deep)),
        ("backends", check_backends),  # after the probe: its verdict is cached by then
        ("torch", check_torch),
        ("memory", check_memory),
        ("disk", lambda: check_disk(store.home)),
        ("store", lambda: check_store(store, deep=deep)),
        ("huggingface", check_huggingface),
        ("store_write", lambda: check_store_write(store.home)),
        ("conversations", check_conversations),
    ]
    for name, step in steps:
        try:
            yield step()
        except Exception as e:  # a doctor reports what broke; it must not crash
            yield Check(
                name,
                False,
                f"the check itself failed: {type(e).__name__}: {e}",
                fix="report this at the localllm issue tracker with this line",
            )


# -- platform ----------------------------------------------------------------------------------


# CPU flags (as /proc/cpuinfo names them) that decide which llama.cpp builds run here: a build
# that uses one the CPU lacks dies with SIGILL. Shown upper-case, as llama.cpp's system info does.
_ISA_FLAGS = ("avx", "avx2", "fma", "f16c", "avx_vnni", "avx512f", "avx512_vnni", "avx512_bf16",
              "amx_int8", "amx_bf16", "asimd", "asimddp", "i8mm", "sve", "sve2")  # fmt: skip


def cpu_isa() -> list[str]:
    """The instruction-set extensions of this CPU that matter to llama.cpp (Linux; else [])."""
    from localllm.backends.llamacpp_guard import cpu_flags  # reads /proc/cpuinfo, no llama_cpp

    have = set(cpu_flags().split())
    return [f.upper() for f in _ISA_FLAGS if f in have]


def check_python() -> Check:
    version = platform.python_version()
    data = {
        "version": version,
        "implementation": platform.python_implementation(),
        "os": platform.system(),
        "os_release": platform.release(),
        "machine": platform.machine(),
        "cpu_isa": cpu_isa(),
    }
    detail = (
        f"{data['implementation']} {version} on {data['os']} {data['os_release']} {data['machine']}"
    )
    if data["cpu_isa"]:
        detail += f" (CPU: {' '.join(data['cpu_isa'])})"
    return Check("python", True, detail, data=data)  # pip refuses Pythons older than 3.11


# -- llama.cpp ---------------------------------------------------------------------------------


def parse_system_info(text: str) -> dict[str, list[str]]:
    """llama.cpp's system info → {backend: [enabled features]}.

    The text looks like `CPU : SSE3 = 1 | AVX2 = 1 | AVX512 = 0 | ... | CUDA : ARCHS = 890 | ...`:
    a `NAME :` starts a backend, `KEY = 1` is an enabled feature, other values are kept as
    `KEY=VALUE`, `KEY = 0` is dropped.
    """
    backends: dict[str, list[str]] = {}
    current: list[str] | None = None
    for part in text.split("|"):
        part = part.strip()
        if not part:
            continue
        if " : " in part or part.endswith(" :"):
            name, _, part = part.partition(":")
            current = backends.setdefault(name.strip(), [])
            part = part.strip()
            if not part:
                continue
        if current is None:
            current = backends.setdefault("", [])
        key, eq, value = (s.strip() for s in part.partition("="))
        if not eq or value == "1":
            current.append(key)
        elif value != "0":
            current.append(f"{key}={value}")
    return backends


def check_llama_cpp() -> Check:
    from localllm.backends import llamacpp_guard

    info = llamacpp_guard.build_info()  # asked in a child process
    if info is None:
        return Check(
            "llama_cpp",
            False,
            "llama-cpp-python is not installed",
            fix=llamacpp_guard.INSTALL_FIX,
        )
    if info.get("error"):  # the child that reads the build facts crashed or failed
        return Check(
            "llama_cpp",
            False,
            f"llama-cpp-python {info.get('version')} is installed but {info['error']}",
            fix=llamacpp_guard.REBUILD_FIX,
            data={"version": info.get("version"), "build": info.get("build"),
                  "system_info": None, "backends": {}, "blas": None, "gpu_offload": None,
                  "devices": []},
        )  # fmt: skip
    system_info = str(info.get("system_info") or "")
    backends = parse_system_info(system_info)
    gpu = info.get("gpu_offload")
    features = "; ".join(
        f"{name or 'features'}: {' '.join(feats) or '-'}" for name, feats in backends.items()
    )
    blas = any(
        "BLAS" in name.upper() or "BLAS" in " ".join(f).upper() for name, f in backends.items()
    )
    gpu_text = "yes" if gpu else "no" if gpu is not None else "unknown"
    ggml = [d for d in info.get("devices") or () if isinstance(d, dict)]
    listed = ", ".join(f"{d.get('name')} ({d.get('backend')}: {d.get('description')}, "
                       f"{human_bytes(int(d.get('total_bytes') or 0))})" for d in ggml)  # fmt: skip
    detail = (
        f"{info.get('version') or 'unknown version'} ({info.get('build') or 'unknown'} build); "
        f"{features or 'no system info'}; BLAS: {'yes' if blas else 'no'}; GPU offload: {gpu_text}"
        + (f"; devices: {listed}" if ggml else "")
    )
    data = {
        "version": info.get("version"),
        "build": info.get("build"),
        "system_info": system_info,
        "backends": backends,
        "blas": blas,
        "gpu_offload": gpu,
        "devices": ggml,
    }
    missing = _unused_gpus(gpu)
    if missing is not None:  # a GPU is here and the build cannot use it: the one command
        seen, fix = missing
        return Check("llama_cpp", False, f"{detail}; but this machine has {seen}, which this "
                     "build cannot use", fix=fix, data=data)  # fmt: skip
    return Check("llama_cpp", True, detail, data=data)


def _unused_gpus(gpu_offload: bool | None) -> tuple[str, str] | None:
    """(the GPUs, the command that rebuilds llama.cpp for them) when the device inventory sees a
    GPU and the build has no GPU backend; else None."""
    from localllm import llamacpp_build
    from localllm.devices import inventory

    if gpu_offload is not False:
        return None
    try:
        gpus = inventory().gpus
    except LocalLLMError:
        return None
    if not gpus:
        return None
    seen = ", ".join(f"{g.name} ({g.kind})" for g in gpus)
    flavour = gpus[0].kind  # the build flavours are named as the device kinds
    try:
        _, why = llamacpp_build.choose(flavour, llamacpp_build.probe())
    except ValueError as e:  # its toolkit is what is missing: what to install
        return seen, str(e)
    return seen, f"{llamacpp_build.rebuild_command(flavour)} ({why})"


def check_llama_cpp_probe(home: Path, *, refresh: bool) -> Check:
    from localllm.backends import llamacpp_guard

    if llamacpp_guard.library_key() is None:
        return Check(
            "llama_cpp_probe",
            None,
            "not run: llama-cpp-python is not installed",
            data={"ok": None, "reason": None, "cached": None},
        )
    verdict = llamacpp_guard.probe(home, refresh=refresh)  # a child runs llama.cpp, never us
    data = {"ok": verdict.ok, "reason": verdict.reason, "cached": verdict.cached}
    if verdict.cached:
        when = "cached verdict; --deep runs it again"
    else:
        when = f"probed just now in {verdict.seconds:.1f} s"
    if verdict.ok:
        return Check(
            "llama_cpp_probe", True, f"llama.cpp evaluates a test model here ({when})", data=data
        )
    return Check(
        "llama_cpp_probe",
        False,
        f"{verdict.reason or 'llama.cpp does not run here'} ({when})",
        fix=verdict.fix or llamacpp_guard.REBUILD_FIX,
        data=data,
    )


# -- the registry ------------------------------------------------------------------------------


def check_backends() -> Check:
    """What each backend name means here, from the registry (each probe runs in a child)."""
    from localllm import backends

    rows: list[dict[str, Any]] = []
    for name in backends.names():
        if name == "auto":
            continue
        try:
            spec = backends.get(name)
        except LocalLLMError as e:  # a name this build knows of but cannot load
            rows.append({"name": name, "available": False, "reason": str(e), "capabilities": None})
            continue
        a = spec.available()
        rows.append({"name": name, "available": a.ok, "reason": a.message(),
                     "capabilities": spec.capabilities.to_dict()})  # fmt: skip
    try:
        auto: str | None = backends.choose("auto").name  # cached verdicts by now
    except LocalLLMError:
        auto = None
    said = "; ".join(f"{r['name']}: " + ("runs here" if r["available"] else r["reason"])
                     for r in rows)  # fmt: skip
    data = {"auto": auto, "backends": rows}
    if auto is None:
        return Check("backends", False, f"no backend runs here ({said})",
                     fix="see the llama_cpp lines above", data=data)  # fmt: skip
    return Check("backends", True, f"auto uses {auto}; {said}", data=data)


# -- torch -------------------------------------------------------------------------------------

_TORCH_CODE = """
import json, os, shutil, torch
kernels = []  # the CPU kernels the torch engine's default precision takes, where this torch has them
try:
    from localllm.backends.torch.quantized import fbgemm_fp16_available, fp16_row_quantum, int4_available
    kernels += ["int4 matmul"] if int4_available() else []
    if fbgemm_fp16_available():  # rows padded where its kernels round a short last block apart
        q = fp16_row_quantum()
        kernels += ["fbgemm fp16" + (f" (rows in multiples of {q}, for batch-invariant bits)" if q > 1 else "")]
except Exception:
    pass
cuda = torch.cuda.is_available()
mps = getattr(torch.backends, "mps", None)
print(json.dumps({
    "version": torch.__version__,
    "cuda_version": torch.version.cuda,
    "cuda": [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())] if cuda else [],
    "mps": bool(mps is not None and mps.is_available()),
    "kernels": kernels,
    # inductor's C++ compiler, which a compiled step (--compile) needs on the CPU
    "compiler": next(filter(None, map(shutil.which, [os.environ.get("CXX") or "g++", "clang++"])), None),
}))
"""


def _torch_facts() -> dict[str, Any]:
    """Import torch in a child process (a broken install must not take the doctor down)."""
    p = subprocess.run(
        [sys.executable, "-c", _TORCH_CODE],
        capture_output=True,
        text=True,
        timeout=TORCH_TIMEOUT_S,
    )
    if p.returncode != 0:
        lines = [ln for ln in p.stderr.strip().splitlines() if ln.strip()]
        why = lines[-1] if lines else f"exit status {p.returncode}"
        raise RuntimeError(why)
    return json.loads(p.stdout.strip().splitlines()[-1])


def check_torch() -> Check:
    data: dict[str, Any] = {"version": None, "cuda_version": None, "cuda": [], "mps": False, "kernels": [],
                            "compiler": None}
    if importlib.util.find_spec("torch") is None:
        return Check(
            "torch",
            None,
            "not installed (optional, for the torch engine: pip install 'localllm[torch]')",
            data=data,
        )
    try:
        facts = _torch_facts()
    except (RuntimeError, OSError, subprocess.TimeoutExpired, ValueError, IndexError) as e:
        return Check(
            "torch",
            False,
            f"installed but does not import: {e}",
            fix="reinstall it: pip install --force-reinstall 'localllm[torch]'",
            data=data,
        )
    devices = [f"cuda:{i} ({name})" for i, name in enumerate(facts["cuda"])]
    if facts["mps"]:
        devices.append("mps")
    devices.append("cpu")
    cuda = f", CUDA {facts['cuda_version']}" if facts.get("cuda_version") else ""
    data.update((k, facts.get(k, v)) for k, v in data.items())
    from localllm.backends import TORCH_FIX, torch_too_old

    old = torch_too_old(str(facts["version"]))
    if old:
        return Check("torch", False, old, fix=TORCH_FIX, data=data)
    kernels = f"; CPU kernels: {', '.join(data['kernels'])}" if data["kernels"] else ""
    compiled = "; compiled step: " + ("on CUDA by default, " if facts["cuda"] else "") + (
        f"on the CPU with --compile ({data['compiler']})" if data["compiler"]
        else "on the CPU it needs a C++ compiler (apt install g++)")  # fmt: skip
    return Check("torch", True, f"{facts['version']}{cuda}; devices: {', '.join(devices)}{kernels}"
                                f"{compiled}", data=data)  # fmt: skip


# -- memory and disk ---------------------------------------------------------------------------


def check_memory() -> Check:
    from localllm.devices import inventory
    from localllm.memory import available_memory

    ram = available_memory("cpu")
    data: dict[str, Any] = {"free_bytes": ram.bytes, "total_bytes": ram.total, "gpu": None,
                            "gpus": []}  # fmt: skip
    detail = f"RAM {human_bytes(ram.bytes)} free of {human_bytes(ram.total)}"
    for g in inventory().gpus:  # nvidia-smi, Apple's unified memory; no torch import here
        entry = {"device": g.id, "name": g.name, "free_bytes": g.free_bytes, "total_bytes": g.total_bytes}
        data["gpus"].append(entry)
        data["gpu"] = data["gpu"] or entry
        detail += f"; {g.id} ({g.name}) {human_bytes(g.free_bytes)} free of {human_bytes(g.total_bytes)}"
    if ram.bytes < MIN_FREE_MEMORY:
        return Check(
            "memory",
            False,
            detail + f" (less than {human_bytes(MIN_FREE_MEMORY)})",
            fix="close other programs; even the default model needs about 300 MB",
            data=data,
        )
    return Check("memory", True, detail, data=data)


def _existing(path: Path) -> Path:
    """`path`, or its nearest ancestor that exists (the store folder is made on first use)."""
    path = path.absolute()
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def check_disk(home: Path) -> Check:
    where = _existing(home)
    usage = shutil.disk_usage(where)
    data = {"path": str(home), "free_bytes": usage.free, "total_bytes": usage.total}
    detail = f"{human_bytes(usage.free)} free of {human_bytes(usage.total)} at {home}"
    if usage.free < MIN_FREE_DISK:
        return Check(
            "disk",
            False,
            detail,
            fix="free some space, or set LOCALLLM_HOME to a folder on a larger disk",
            data=data,
        )
    return Check("disk", True, detail, data=data)


# -- the store ---------------------------------------------------------------------------------


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}{'s' * (n != 1)}"


def _file_problem(path: Path, size: int) -> str | None:
    """Why the file at `path` cannot hold `size` recorded bytes, or None."""
    try:
        st = path.stat()
    except FileNotFoundError:
        return f"{path.name} is missing"
    except OSError as e:
        return f"cannot read {path.name}: {e.strerror or e}"
    if not path.is_file():
        return f"{path.name} is not a file"
    if st.st_size != size:
        return f"{path.name} has {st.st_size:,} bytes, the index says {size:,}"
    return None


def check_store(store: Store, *, deep: bool) -> Check:
    """Every index entry has its file with the recorded size; with `deep`, its sha256 too."""
    data: dict[str, Any] = {"path": str(store.home), "models": None, "blobs": None,
                            "references": None, "hashed": deep, "damaged": {}}  # fmt: skip
    if store.home.exists() and not store.home.is_dir():
        return Check(
            "store",
            False,
            f"{store.home} is not a folder",
            fix="move that file aside, or set LOCALLLM_HOME to a folder",
            data=data,
        )
    try:
        with open(store.index_path, "rb"):
            pass
    except FileNotFoundError:
        pass  # no index yet: no models
    except OSError as e:
        return Check(
            "store",
            False,
            f"cannot read {store.index_path}: {e.strerror or e}",
            fix=f"make it readable: chmod u+r {store.index_path}",
            data=data,
        )
    try:
        records = store.list()
    except LocalLLMError as e:  # the index is there but damaged
        return Check(
            "store",
            False,
            str(e),
            fix=f"move {store.index_path.name} aside and import the models again "
            f"(`localllm import {store.blobs}/sha256-...` keeps each blob)",
            data=data,
        )
    blobs = sum(r.ref is None for r in records)
    data.update(models=len(records), blobs=blobs, references=len(records) - blobs)
    if not records:
        return Check("store", True, f"no models yet in {store.home}", data=data)
    problems: dict[str, str] = {}
    hashed: dict[Path, str] = {}  # several names may share one file: hash it once
    for r in records:
        try:
            path = store.path_of(r)  # a reference that is gone or changed raises here
        except LocalLLMError as e:
            problems[r.name] = str(e).split(";")[0]
            continue
        why = _file_problem(path, r.size)
        if why is None and deep:
            try:
                digest = hashed.get(path) or hashed.setdefault(path, sha256_file(path))
            except OSError as e:
                why = f"cannot read {path.name}: {e.strerror or e}"
            else:
                if digest != r.digest:
                    why = f"{path.name} is damaged: its sha256 is {digest[:12]}…"
        if why is not None:
            problems[r.name] = why
    data["damaged"] = problems
    kinds = f"{_count(blobs, 'blob')}, {len(records) - blobs} by reference"
    if problems:
        names = sorted(problems)
        return Check(
            "store",
            False,
            f"{len(problems)} of {len(records)} models damaged: "
            + "; ".join(f"{n} ({problems[n]})" for n in names),
            fix=f"`localllm rm {names[0]}`, then pull or import it again"
            + (" (likewise for the others)" if len(names) > 1 else ""),
            data=data,
        )
    how = (
        "sha256 verified"
        if deep
        else "recorded sizes match (`localllm doctor --deep` checks sha256)"
    )
    return Check("store", True, f"{_count(len(records), 'model')} ({kinds}): {how}", data=data)


def _try_create(folder: Path) -> str | None:
    """Create and delete a temporary file in `folder` (or in its nearest existing ancestor,
    which must let us make the missing folders). Returns why it failed, or None.

    An attempt rather than os.access: access() says yes to root on a read-only mount, and
    no for ACLs that would in fact allow the write.
    """
    where = _existing(folder)
    if where != folder.absolute() and not where.is_dir():
        return f"{where} is a file, so {folder} cannot be made"
    if where == folder.absolute() and not where.is_dir():
        return f"{folder} is not a folder"
    try:
        fd, tmp = tempfile.mkstemp(prefix=".doctor-", dir=where)
    except OSError as e:
        return f"cannot create files in {where}: {e.strerror or e}"
    os.close(fd)
    with contextlib.suppress(OSError):
        os.unlink(tmp)
    return None


def check_store_write(home: Path) -> Check:
    why = _try_create(home)
    if why is not None:
        return Check(
            "store_write",
            False,
            why,
            fix=f"make {home} a writable folder, or set LOCALLLM_HOME to one",
            data={"path": str(home)},
        )
    made = "" if home.exists() else " (it will be made on first use)"
    return Check("store_write", True, f"{home} is writable{made}", data={"path": str(home)})


def _conversations_path() -> Path:
    from localllm.conversations import default_db_path  # sqlite only: no textual import

    return default_db_path()


def check_conversations() -> Check:
    path = _conversations_path()
    data: dict[str, Any] = {"path": str(path), "conversations": None}
    folder_problem = _try_create(path.parent)
    fix_move = f"move {path} aside (the app starts a new database)"
    if not path.exists():
        if folder_problem is not None:
            return Check(
                "conversations",
                False,
                f"cannot create {path}: {folder_problem}",
                fix=f"make {path.parent} a writable folder, or set LOCALLLM_HOME to one",
                data=data,
            )
        return Check("conversations", True, f"none yet; {path} can be created", data=data)
    if not path.is_file():
        return Check("conversations", False, f"{path} is not a file", fix=fix_move, data=data)
    try:
        os.close(os.open(path, os.O_RDWR))  # opens for writing; writes nothing
    except OSError as e:
        return Check(
            "conversations",
            False,
            f"{path} is not writable: {e.strerror or e}",
            fix=f"chmod u+w {path}",
            data=data,
        )
    if folder_problem is not None:  # SQLite's WAL needs its -wal and -shm files beside it
        return Check(
            "conversations",
            False,
            f"{path} cannot be written: {folder_problem}",
            fix=f"make {path.parent} writable",
            data=data,
        )
    try:
        count, busy = _read_conversations(path)
    except _NewerSchema as e:
        return Check("conversations", False, f"{path} was {e}", fix="upgrade localllm", data=data)
    except sqlite3.Error as e:
        return Check("conversations", False, f"{path} is damaged: {e}", fix=fix_move, data=data)
    data["conversations"] = count
    note = " (in use by another localllm)" if busy else ""
    return Check(
        "conversations", True, f"{path}: {_count(count, 'conversation')}, writable{note}", data=data
    )


class _NewerSchema(sqlite3.DatabaseError):
    """A conversations database from a newer localllm: not damaged, just not ours to read."""


def _read_conversations(path: Path) -> tuple[int, bool]:
    """Check the database's integrity, count conversations and take (then drop) a write lock.

    Returns (count, busy): busy when another connection holds the write lock right now. Raises
    sqlite3.Error for a damaged file or one from a newer localllm.
    """
    from localllm.conversations import SCHEMA_VERSION

    conn = sqlite3.connect(f"file:{path}?mode=rw", uri=True, timeout=2)
    try:
        (verdict,) = conn.execute("PRAGMA quick_check").fetchone()
        if verdict != "ok":
            raise sqlite3.DatabaseError(str(verdict))
        (version,) = conn.execute("PRAGMA user_version").fetchone()
        if version > SCHEMA_VERSION:
            raise _NewerSchema(
                f"written by a newer localllm (schema {version}, this one reads {SCHEMA_VERSION})"
            )
        count = 0
        if version > 0:  # 0: an empty file the app has not set up yet
            (count,) = conn.execute("SELECT count(*) FROM conversations").fetchone()
        busy = False
        try:
            conn.execute("BEGIN IMMEDIATE")  # a write lock, released at once: writes nothing
            conn.rollback()
        except sqlite3.OperationalError as e:
            if "locked" not in str(e) and "busy" not in str(e):
                raise
            busy = True
        return int(count), busy
    finally:
        conn.close()


# -- Hugging Face ------------------------------------------------------------------------------


def _token_source() -> str | None:
    """Where a Hugging Face token comes from (an env var's name or the token file), never it."""
    for var in ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN"):
        if os.environ.get(var, "").strip():
            return var
    hf_home = Path(
        os.environ.get("HF_HOME")
        or Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "huggingface"
    )
    token_file = Path(os.environ.get("HF_TOKEN_PATH") or hf_home / "token").expanduser()
    with contextlib.suppress(OSError):
        if token_file.is_file() and token_file.read_text().strip():
            return str(token_file)
    return None


def _safe_url(url: str) -> str:
    """`url` without any user:password part (an endpoint may carry credentials)."""
    parts = urlsplit(url)
    if "@" not in parts.netloc:
        return url
    return parts._replace(netloc="***@" + parts.netloc.rpartition("@")[2]).geturl()


def check_huggingface() -> Check:
    source = _token_source()
    endpoint = os.environ.get("HF_ENDPOINT", "").strip()
    offline = os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in _TRUE
    shown = _safe_url(endpoint) if endpoint else f"{HF_DEFAULT_ENDPOINT} (default)"
    token = f"set ({source})" if source else "none (public models only)"
    detail = (
        f"token: {token}; endpoint: {shown}; "
        f"offline: {'yes (pull uses stored models only)' if offline else 'no'}"
    )
    data = {"token": source is not None, "token_source": source, "offline": offline,
            "endpoint": _safe_url(endpoint) if endpoint else HF_DEFAULT_ENDPOINT}  # fmt: skip
    if endpoint:
        parts = urlsplit(endpoint)
        if parts.scheme not in ("http", "https") or not parts.netloc:
            return Check(
                "huggingface",
                False,
                detail,
                fix="set HF_ENDPOINT to a URL such as https://huggingface.co, or unset it",
                data=data,
            )
    return Check("huggingface", True, detail, data=data)


def text_marks(encoding: str | None) -> tuple[str, str, str, str]:
    """✓ ✗ – — where the output can show them, else ASCII stand-ins."""
    try:
        "✓✗–—".encode(encoding or "ascii")
    except (UnicodeEncodeError, LookupError):
        return ("ok", "FAIL", "-", "--")
    return ("✓", "✗", "–", "—")
