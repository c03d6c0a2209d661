"""How llama-cpp-python is built for this machine: which flavour (CPU, CUDA, Metal, Vulkan, ROCm)
and the CMake arguments for it.

Standard library only, and nothing from localllm: scripts/llamacpp-build runs this file by path
(`python3 -I localllm/llamacpp_build.py --plan`) before localllm is installed. The probing is kept
apart from the choice (`probe()` vs `choose()` / `cmake_args()`), so the choice is a pure function
of a `Probes` that a test can write by hand.
"""

from __future__ import annotations

import os
import platform
import re
import shlex
import shutil
import subprocess
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

# The llama-cpp-python release localllm builds: the one place that says it (scripts/llamacpp-build
# reads it with --version).
VERSION = "0.3.36"
FLAVOURS = ("auto", "cpu", "portable", "native", "cuda", "metal", "vulkan", "rocm")
PROBE_TIMEOUT_S = 5.0

# The portable build's x86 switches, in scripts/llamacpp-build's historical order: the wheel cache
# key hashes the resulting string, so changing the order or spacing would orphan every cached wheel.
_X86_SWITCHES = (
    ("SSE42", "sse4_2"), ("AVX", "avx"), ("AVX2", "avx2"), ("FMA", "fma"), ("F16C", "f16c"),
    ("BMI2", "bmi2"), ("AVX_VNNI", "avx_vnni"), ("AVX512", "avx512f"),
    ("AVX512_VBMI", "avx512vbmi"), ("AVX512_VNNI", "avx512_vnni"), ("AVX512_BF16", "avx512_bf16"),
)  # fmt: skip
# Off: some hypervisors advertise AMX in CPUID but trap its tile instructions (SIGILL).
_AMX_OFF = "-DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF"
_NVCC_WHERE = "none on PATH, $CUDA_HOME/bin or /usr/local/cuda/bin"


@dataclass(frozen=True)
class Probes:
    """What this machine offers a llama.cpp build; `probe()` fills it, tests write it by hand.
    cuda_architectures / amdgpu_targets are the user's overrides (LOCALLLM_CUDA_ARCHITECTURES,
    LOCALLLM_AMDGPU_TARGETS), kept here so choose() and cmake_args() read no environment."""

    system: str = ""  # uname -s: Linux, Darwin
    machine: str = ""  # uname -m: x86_64, arm64, aarch64
    cpu_flags: frozenset[str] = frozenset()  # /proc/cpuinfo's first "flags" line (Linux only)
    nvcc: str | None = None
    nvcc_version: str | None = None  # "12.4"
    # cuBLAS's header beside nvcc (llama.cpp's CUDA backend links cuBLAS; some images carry nvcc
    # alone and CMake then fails): None when not probed (a hand-made Probes), read as present
    cublas: bool | None = None
    nvidia_driver: str | None = None  # "550.54.15": nvidia-smi sees at least one GPU
    compute_caps: tuple[str, ...] = ()  # ("8.6", "8.9"), one per GPU
    gpu_names: tuple[str, ...] = ()
    vulkan: bool = False  # the Vulkan SDK: glslc, and VULKAN_SDK or /usr/include/vulkan/vulkan.h
    vulkan_devices: bool = False  # vulkaninfo --summary lists a GPU, not only llvmpipe (a CPU)
    rocm: str | None = None  # hipcc
    rocm_targets: tuple[str, ...] = ()  # ("gfx1100",) from rocminfo
    cuda_architectures: str | None = None
    amdgpu_targets: str | None = None


def _run(argv: list[str], env: Mapping[str, str]) -> str | None:
    """A probe command's stdout; None when it is missing, fails or hangs (probing never raises)."""
    try:
        done = subprocess.run(argv, capture_output=True, text=True, errors="replace", env=dict(env),
                              timeout=PROBE_TIMEOUT_S, stdin=subprocess.DEVNULL)  # fmt: skip
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout if done.returncode == 0 else None


def _which(name: str, env: Mapping[str, str], *dirs: str | None) -> str | None:
    """`name` on env's PATH, else in the first of `dirs` (None entries skipped) that holds it."""
    found = shutil.which(name, path=env.get("PATH", os.defpath))
    if found:
        return found
    for d in dirs:
        if d and os.path.isfile(c := os.path.join(d, name)) and os.access(c, os.X_OK):
            return c
    return None


def parse_cpuinfo(text: str) -> frozenset[str]:
    """The CPU flags of /proc/cpuinfo's first "flags" line (as `grep -m1 '^flags'` read them)."""
    for line in text.splitlines():
        if line.startswith("flags"):
            return frozenset(line.partition(":")[2].split())
    return frozenset()


def _cpu_flags() -> frozenset[str]:
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            return parse_cpuinfo(f.read())
    except OSError:
        return frozenset()


def _has_cublas(nvcc: str, cuda_home: str | None) -> bool:
    """cublas_v2.h in the toolkit nvcc belongs to, CUDA_HOME's, /usr/local/cuda's or /usr/include."""
    root = os.path.dirname(os.path.dirname(os.path.realpath(nvcc)))
    tops = [root, cuda_home, "/usr/local/cuda"]
    dirs = [os.path.join(t, sub) for t in tops if t for sub in ("include", "targets/x86_64-linux/include",
                                                              "targets/sbsa-linux/include")]  # fmt: skip
    return any(os.path.exists(os.path.join(d, "cublas_v2.h")) for d in [*dirs, "/usr/include"])


def probe(env: Mapping[str, str] = os.environ) -> Probes:
    """The real machine, each tool given 5 s; a tool that is missing or fails reads as absent."""
    # subprocess looks a bare name up on env's PATH (a test's fake uname), not this process's
    system = (_run(["uname", "-s"], env) or platform.system()).strip()
    machine = (_run(["uname", "-m"], env) or platform.machine()).strip()

    cuda_home = env.get("CUDA_HOME")
    nvcc = _which("nvcc", env, cuda_home and os.path.join(cuda_home, "bin"), "/usr/local/cuda/bin")
    nvcc_version = None
    out = _run([nvcc, "--version"], env) if nvcc is not None else None
    if out and (m := re.search(r"release (\d+\.\d+)", out)):
        nvcc_version = m.group(1)
    cublas = nvcc is not None and _has_cublas(nvcc, cuda_home)

    driver, caps, names = None, [], []
    if (smi := _which("nvidia-smi", env)) is not None:
        query = [smi, "--query-gpu=driver_version,compute_cap,name", "--format=csv,noheader"]
        for line in (_run(query, env) or "").splitlines():
            parts = [s.strip() for s in line.split(",", 2)]
            if len(parts) == 3 and re.fullmatch(r"\d+\.\d+", parts[1]):
                driver = driver or parts[0]
                caps.append(parts[1])
                names.append(parts[2])

    headers = bool(env.get("VULKAN_SDK")) or os.path.exists("/usr/include/vulkan/vulkan.h")
    vulkan = _which("glslc", env) is not None and headers
    vulkan_devices = False
    if (vulkaninfo := _which("vulkaninfo", env)) is not None:
        kinds = re.findall(r"deviceType\s*=\s*(\S+)", _run([vulkaninfo, "--summary"], env) or "")
        vulkan_devices = any("CPU" not in k for k in kinds)

    rocm_bin = [env.get("ROCM_PATH") and os.path.join(env["ROCM_PATH"], "bin"), "/opt/rocm/bin"]
    hipcc = _which("hipcc", env, *rocm_bin)
    targets: list[str] = []
    if (rocminfo := _which("rocminfo", env, *rocm_bin)) is not None:
        out = _run([rocminfo], env) or ""
        targets = sorted(set(re.findall(r"^\s*Name:\s+(gfx[0-9a-z]+)\s*$", out, re.MULTILINE)))

    return Probes(
        system=system, machine=machine,
        cpu_flags=_cpu_flags() if system == "Linux" else frozenset(),
        nvcc=nvcc, nvcc_version=nvcc_version, cublas=cublas, nvidia_driver=driver,
        compute_caps=tuple(caps),
        gpu_names=tuple(names), vulkan=vulkan, vulkan_devices=vulkan_devices, rocm=hipcc,
        rocm_targets=tuple(targets),
        cuda_architectures=env.get("LOCALLLM_CUDA_ARCHITECTURES") or None,
        amdgpu_targets=env.get("LOCALLLM_AMDGPU_TARGETS") or None,
    )  # fmt: skip


def _x86_linux(p: Probes) -> bool:
    return p.system == "Linux" and p.machine == "x86_64"


def _cuda_what(p: Probes) -> str:
    """nvcc, the driver and the GPUs, for a reason line."""
    what = f"nvcc {p.nvcc_version or '(version unknown)'}"
    if p.nvidia_driver:
        gpus = ", ".join(f"{n} (compute {c})" for n, c in zip(p.gpu_names, p.compute_caps))
        what += f", NVIDIA driver {p.nvidia_driver}, {gpus}"
    else:
        what += ", no NVIDIA GPU visible"
    if p.cuda_architectures:
        what += f"; architectures {p.cuda_architectures} from LOCALLLM_CUDA_ARCHITECTURES"
    return what


def _rocm_what(p: Probes) -> str:
    what = f"hipcc, AMD GPU {', '.join(p.rocm_targets)}" if p.rocm_targets else "hipcc"
    if p.amdgpu_targets:
        what += f"; targets {p.amdgpu_targets} from LOCALLLM_AMDGPU_TARGETS"
    return what


def _portable_what(p: Probes) -> str:
    if _x86_linux(p):
        return "GGML_NATIVE=OFF, this CPU's instruction sets one by one, AMX off"
    return "llama.cpp's default build (off x86-64 Linux)"


def _why_cpu(p: Probes) -> str:
    """Why auto found no GPU build to make: each toolkit that is half there, else that none is."""
    notes = []
    if p.nvcc and not p.nvidia_driver:
        notes.append("nvcc found but no NVIDIA driver (nvidia-smi sees no GPU)")
    if p.nvcc and p.nvidia_driver and p.cublas is False:
        notes.append(f"NVIDIA GPU and nvcc but no cuBLAS ({_NO_CUBLAS})")
    if p.nvidia_driver and not p.nvcc:
        notes.append(f"NVIDIA GPU {', '.join(p.gpu_names)} but no nvcc (install the CUDA toolkit)")
    if p.rocm and not p.rocm_targets:
        notes.append("hipcc found but rocminfo sees no AMD GPU")
    if p.rocm_targets and not p.rocm:
        notes.append(f"AMD GPU {', '.join(p.rocm_targets)} but no hipcc (install ROCm's HIP SDK)")
    if p.vulkan and not p.vulkan_devices:
        notes.append("Vulkan SDK found but vulkaninfo lists no GPU")
    if p.vulkan_devices and not p.vulkan:
        notes.append("a Vulkan GPU but no Vulkan SDK (glslc and headers)")
    if not notes:
        none = "no GPU toolkit (nvcc, hipcc, Vulkan SDK)"
        notes.append("Intel Mac" if p.system == "Darwin" else none)
    return "; ".join(notes) + ": CPU build"


_NO_CUBLAS = ("no cublas_v2.h beside nvcc, in CUDA_HOME, /usr/local/cuda or /usr/include: "
              "install the full CUDA toolkit (its libcublas development files)")


def _unknown(name: str) -> ValueError:
    return ValueError(f"unknown llama.cpp build flavour '{name}': one of {', '.join(FLAVOURS)}")


def choose(requested: str, p: Probes) -> tuple[str, str]:
    """The flavour to build and a one-line reason. `auto` builds for a GPU only when both its
    toolkit and a device are here (a CI runner with nvcc but no GPU keeps the portable CPU wheel);
    an explicit GPU flavour without its toolkit is a ValueError saying what to install."""
    name = (requested or "auto").strip().lower()
    if name not in FLAVOURS:
        raise _unknown(requested)
    if name == "auto":
        if p.system == "Darwin" and p.machine == "arm64":
            return "metal", "Apple silicon"
        if p.nvcc and p.nvidia_driver and p.compute_caps and p.cublas is not False:
            return "cuda", _cuda_what(p)
        if p.rocm and p.rocm_targets:
            return "rocm", _rocm_what(p)
        if p.vulkan and p.vulkan_devices:
            return "vulkan", "Vulkan SDK (glslc, headers) and a Vulkan GPU"
        return "portable", _why_cpu(p)
    if name in ("cpu", "portable"):
        return "portable", f"requested: {_portable_what(p)}"
    if name == "native":
        return "native", "requested: llama.cpp's default, -march=native (AMX included)"
    if name == "cuda":
        if not p.nvcc:
            raise ValueError(f"cuda build needs nvcc (the CUDA toolkit): {_NVCC_WHERE}")
        if p.cublas is False:
            raise ValueError(f"cuda build needs cuBLAS: {_NO_CUBLAS}")
        if not p.compute_caps and not p.cuda_architectures:
            raise ValueError("cuda build without a visible NVIDIA GPU needs its architectures: "
                             "set LOCALLLM_CUDA_ARCHITECTURES (e.g. 89 for an RTX 4090)")  # fmt: skip
        return "cuda", f"requested: {_cuda_what(p)}"
    if name == "metal":
        if p.system != "Darwin":
            here = f"{p.system or '?'} {p.machine}".rstrip()
            raise ValueError(f"metal build needs macOS: this is {here}")
        return "metal", "requested: Metal"
    if name == "vulkan":
        if not p.vulkan:
            raise ValueError("vulkan build needs the Vulkan SDK: glslc on PATH and the headers "
                             "(VULKAN_SDK set, or /usr/include/vulkan/vulkan.h)")  # fmt: skip
        gpu = "a Vulkan GPU" if p.vulkan_devices else "no Vulkan GPU listed"
        return "vulkan", f"requested: Vulkan SDK, {gpu}"
    # rocm
    if not p.rocm:
        raise ValueError("rocm build needs hipcc (ROCm's HIP SDK): none on PATH, $ROCM_PATH/bin "
                         "or /opt/rocm/bin")  # fmt: skip
    if not p.rocm_targets and not p.amdgpu_targets:
        raise ValueError("rocm build without a visible AMD GPU needs its targets: "
                         "set LOCALLLM_AMDGPU_TARGETS (e.g. gfx1100)")  # fmt: skip
    return "rocm", f"requested: {_rocm_what(p)}"


def _cpu_args(p: Probes) -> str:
    """The portable CPU switches, byte for byte what scripts/llamacpp-build always made."""
    if not _x86_linux(p):
        return ""
    on = [f"-DGGML_{name}={'ON' if flag in p.cpu_flags else 'OFF'}" for name, flag in _X86_SWITCHES]
    return " ".join(["-DGGML_NATIVE=OFF", *on, _AMX_OFF])


def _numeric(arch: str) -> tuple[int, str]:
    digits = re.match(r"\d+", arch)
    return (int(digits.group()) if digits else 0, arch)


def cmake_args(flavour: str, p: Probes, extra: str = "") -> str:
    """The CMake arguments for a chosen flavour; `extra` (LOCALLLM_LLAMACPP_CMAKE_ARGS) goes last,
    after one space, as the bash script always appended it. GPU flavours keep the portable CPU
    switches, so their CPU side stays AMX-safe."""
    name = "portable" if flavour == "cpu" else flavour
    if name == "portable":
        parts = [_cpu_args(p)]
    elif name == "native":
        parts = []
    elif name == "cuda":
        archs = p.cuda_architectures or ";".join(
            sorted({c.replace(".", "") for c in p.compute_caps}, key=_numeric))
        if not archs:
            raise ValueError("cuda build needs its architectures: set LOCALLLM_CUDA_ARCHITECTURES")
        parts = [_cpu_args(p), "-DGGML_CUDA=ON", f"-DCMAKE_CUDA_ARCHITECTURES={archs}"]
    elif name == "metal":
        parts = ["-DGGML_METAL=ON"]
    elif name == "vulkan":
        parts = [_cpu_args(p), "-DGGML_VULKAN=ON"]
    elif name == "rocm":
        targets = p.amdgpu_targets or ";".join(p.rocm_targets)
        if not targets:
            raise ValueError("rocm build needs its targets: set LOCALLLM_AMDGPU_TARGETS")
        parts = [_cpu_args(p), "-DGGML_HIP=ON", f"-DAMDGPU_TARGETS={targets}"]
    else:
        raise ValueError(f"no CMake arguments for '{flavour}': choose() resolves it first")
    args = " ".join(x for x in parts if x)
    return args + (f" {extra}" if extra else "")


def rebuild_command(flavour: str) -> str:
    """One shell command that rebuilds llama-cpp-python as `flavour` for this interpreter: the
    script in a source checkout (it caches wheels and records the build), else pip with the
    flavour's CMake arguments for this machine. ValueError as choose() raises it."""
    if flavour not in FLAVOURS:
        raise _unknown(flavour)
    python = shlex.quote(sys.executable)
    root = Path(__file__).resolve().parent.parent
    script = root / "scripts" / "llamacpp-build"
    if script.is_file():
        here = Path.cwd().resolve() == root
        where = "scripts/llamacpp-build" if here else shlex.quote(str(script))
        return f"LOCALLLM_LLAMACPP_BUILD={flavour} {where} {python}"
    p = probe()
    resolved, _ = choose(flavour, p)
    args = cmake_args(resolved, p, os.environ.get("LOCALLLM_LLAMACPP_CMAKE_ARGS", ""))
    return (f'CMAKE_ARGS="{args}" {python} -m pip install --force-reinstall --no-deps '
            f"--no-binary llama-cpp-python --no-cache-dir llama-cpp-python=={VERSION}")  # fmt: skip


USAGE = """usage: llamacpp_build.py (--print-args | --choose | --plan) [FLAVOUR] | --version
FLAVOUR defaults to $LOCALLLM_LLAMACPP_BUILD, else auto; one of: """ + ", ".join(FLAVOURS)


def main(argv: list[str] | None = None) -> int:
    """--print-args: the CMake arguments; --choose: "FLAVOUR<TAB>reason"; --plan: the version,
    flavour, reason and arguments on four lines (scripts/llamacpp-build reads them in one run);
    --version: the llama-cpp-python version. Errors: one line on stderr, exit 2."""
    args = sys.argv[1:] if argv is None else argv
    if args == ["--version"]:
        print(VERSION)
        return 0
    if len(args) not in (1, 2) or args[0] not in ("--print-args", "--choose", "--plan"):
        print(USAGE, file=sys.stderr)
        return 2
    requested = args[1] if len(args) == 2 else os.environ.get("LOCALLLM_LLAMACPP_BUILD") or "auto"
    p = probe()
    try:
        flavour, reason = choose(requested, p)
        cmake = cmake_args(flavour, p, os.environ.get("LOCALLLM_LLAMACPP_CMAKE_ARGS", ""))
    except ValueError as e:
        print(f"llamacpp-build: {e}", file=sys.stderr)
        return 2
    if args[0] == "--print-args":
        print(cmake)
    elif args[0] == "--choose":
        print(f"{flavour}\t{reason}")
    else:
        print(VERSION, flavour, reason, cmake, sep="\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
