"""llama.cpp build flavours: which one `auto` picks and why, the CMake arguments of each (portable's
byte for byte what the bash script always made, so cached wheels keep their keys), the probes read
from fake nvcc / nvidia-smi / uname / rocminfo / vulkaninfo, and scripts/llamacpp-build driven
through them. Nothing here builds anything or touches the network."""

from __future__ import annotations

import dataclasses
import hashlib
import os
import shlex
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from localllm import llamacpp_build as lb
from localllm.llamacpp_build import FLAVOURS, VERSION, Probes, choose, cmake_args, parse_cpuinfo

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "scripts" / "llamacpp-build"
BASH = shutil.which("bash")

# One /proc/cpuinfo flags line, and the arguments the old bash code made for it (written out by
# hand from its `has` calls, in its order: ON where the flag is listed, AMX always OFF).
FLAGS_LINE = ("flags\t\t: fpu vme sse sse2 ssse3 sse4_1 sse4_2 avx f16c fma bmi1 bmi2 avx2 avx512f "
              "avx512bw avx512_vnni amx_tile amx_int8 amx_bf16 hypervisor")  # fmt: skip
PORTABLE = (
    "-DGGML_NATIVE=OFF -DGGML_SSE42=ON -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON "
    "-DGGML_BMI2=ON -DGGML_AVX_VNNI=OFF -DGGML_AVX512=ON -DGGML_AVX512_VBMI=OFF "
    "-DGGML_AVX512_VNNI=ON -DGGML_AVX512_BF16=OFF -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF "
    "-DGGML_AMX_BF16=OFF"
)
LINUX = Probes(system="Linux", machine="x86_64",
               cpu_flags=parse_cpuinfo(f"processor : 0\n{FLAGS_LINE}\n"))  # fmt: skip
NVCC = {"nvcc": "/usr/local/cuda/bin/nvcc", "nvcc_version": "12.4"}
TWO_GPUS = {"nvidia_driver": "550.54.15", "compute_caps": ("8.9", "8.6", "8.9"),
            "gpu_names": ("NVIDIA GeForce RTX 4090", "NVIDIA RTX A6000", "NVIDIA GeForce RTX 4090")}  # fmt: skip


def linux(**kw: Any) -> Probes:
    return dataclasses.replace(LINUX, **kw)


# -- the choice and the arguments, from hand-made probes -----------------------------------------


def test_portable_is_the_old_bash_string() -> None:
    assert cmake_args("portable", LINUX) == PORTABLE
    assert choose("portable", LINUX)[0] == "portable"
    # cpu is its alias: the same name (so the same wheel key) and the same arguments
    assert choose("cpu", LINUX)[0] == "portable" and cmake_args("cpu", LINUX) == PORTABLE
    # the first flags line only, as grep -m1 read it; none at all: every switch OFF
    assert parse_cpuinfo(f"{FLAGS_LINE}\nflags : avx512vbmi\n") == LINUX.cpu_flags
    assert cmake_args("portable", linux(cpu_flags=frozenset())) == PORTABLE.replace("=ON", "=OFF")
    # off x86-64 Linux: llama.cpp's default build, as the bash script made it
    assert cmake_args("portable", linux(machine="aarch64")) == ""
    assert cmake_args("portable", Probes(system="Darwin", machine="x86_64")) == ""
    assert cmake_args("native", LINUX) == ""


def test_extra_args_follow_after_one_space_as_before() -> None:
    assert cmake_args("portable", LINUX, "-DGGML_BLAS=ON") == PORTABLE + " -DGGML_BLAS=ON"
    assert cmake_args("native", LINUX, "-DGGML_BLAS=ON") == " -DGGML_BLAS=ON"  # the old key's string
    assert cmake_args("native", LINUX, "") == ""


def test_auto_builds_cuda_with_nvcc_and_a_driver_that_sees_gpus() -> None:
    p = linux(**NVCC, **TWO_GPUS)
    flavour, reason = choose("auto", p)
    assert flavour == "cuda"
    for part in ("nvcc 12.4", "550.54.15", "NVIDIA GeForce RTX 4090", "NVIDIA RTX A6000", "8.6", "8.9"):
        assert part in reason, reason
    # the CPU side stays portable (AMX off); the architectures unique, sorted, without the dot
    assert cmake_args("cuda", p) == f"{PORTABLE} -DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=86;89"
    # numerically sorted: Blackwell's 12.0 after Ada's 8.9
    assert cmake_args("cuda", linux(**NVCC, nvidia_driver="570", compute_caps=("12.0", "8.9"),
                                    gpu_names=("a", "b"))).endswith("=89;120")  # fmt: skip


def test_auto_with_nvcc_but_no_driver_stays_on_the_cpu_and_says_why() -> None:
    flavour, reason = choose("auto", linux(**NVCC))
    assert flavour == "portable"
    assert reason == "nvcc found but no NVIDIA driver (nvidia-smi sees no GPU): CPU build"
    assert choose("", linux(**NVCC)) == (flavour, reason)  # an empty request is auto
    # a GPU without the toolkit, and nothing at all, are said too
    assert "no nvcc" in choose("auto", linux(**TWO_GPUS))[1]
    assert choose("auto", LINUX) == ("portable", "no GPU toolkit (nvcc, hipcc, Vulkan SDK): CPU build")


def test_cuda_needs_cublas_beside_nvcc() -> None:
    """An image with nvcc alone (this one: CUDA 13's nvcc, no cuBLAS) makes CMake fail on
    CUDA::cublas: auto keeps the CPU build and says why, an explicit cuda says what to install."""
    p = linux(**NVCC, **TWO_GPUS, cublas=False)
    flavour, reason = choose("auto", p)
    assert flavour == "portable" and "NVIDIA GPU and nvcc but no cuBLAS (no cublas_v2.h" in reason
    with pytest.raises(ValueError, match="cuda build needs cuBLAS: .* install the full CUDA toolkit"):
        choose("cuda", p)
    assert choose("auto", linux(**NVCC, **TWO_GPUS, cublas=True))[0] == "cuda"


def test_explicit_cuda_needs_nvcc_and_without_a_gpu_its_architectures() -> None:
    with pytest.raises(ValueError) as e:
        choose("cuda", linux(**TWO_GPUS))
    assert str(e.value) == ("cuda build needs nvcc (the CUDA toolkit): none on PATH, "
                            "$CUDA_HOME/bin or /usr/local/cuda/bin")  # fmt: skip
    with pytest.raises(ValueError, match="set LOCALLLM_CUDA_ARCHITECTURES"):
        choose("cuda", linux(**NVCC))
    # LOCALLLM_CUDA_ARCHITECTURES (probe() reads it into the Probes): a CUDA build on a GPU-less
    # build machine, and it wins over the detected GPUs too
    p = linux(**NVCC, cuda_architectures="75;80")
    flavour, reason = choose("cuda", p)
    assert flavour == "cuda" and "LOCALLLM_CUDA_ARCHITECTURES" in reason
    assert cmake_args("cuda", p).endswith(" -DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=75;80")
    assert cmake_args("cuda", linux(**NVCC, **TWO_GPUS, cuda_architectures="90")).endswith("=90")
    # and auto does not build for CUDA on its say-so alone: no GPU here, no CUDA build
    assert choose("auto", p)[0] == "portable"


def test_apple_silicon_builds_metal() -> None:
    mac = Probes(system="Darwin", machine="arm64")
    assert choose("auto", mac) == ("metal", "Apple silicon")
    assert cmake_args("metal", mac) == "-DGGML_METAL=ON"
    assert choose("metal", mac)[0] == "metal"
    with pytest.raises(ValueError, match="metal build needs macOS: this is Linux x86_64"):
        choose("metal", LINUX)


def test_rocm_with_hipcc_and_a_gfx_target() -> None:
    p = linux(rocm="/opt/rocm/bin/hipcc", rocm_targets=("gfx1030", "gfx1100"))
    flavour, reason = choose("auto", p)
    assert flavour == "rocm" and "gfx1030, gfx1100" in reason
    assert cmake_args("rocm", p) == f"{PORTABLE} -DGGML_HIP=ON -DAMDGPU_TARGETS=gfx1030;gfx1100"
    assert choose("auto", linux(rocm="/opt/rocm/bin/hipcc"))[1].startswith(
        "hipcc found but rocminfo sees no AMD GPU")
    with pytest.raises(ValueError, match="rocm build needs hipcc"):
        choose("rocm", LINUX)
    with pytest.raises(ValueError, match="LOCALLLM_AMDGPU_TARGETS"):
        choose("rocm", linux(rocm="/opt/rocm/bin/hipcc"))


def test_vulkan_needs_the_sdk_and_for_auto_a_device() -> None:
    p = linux(vulkan=True, vulkan_devices=True)
    assert choose("auto", p)[0] == "vulkan"
    assert cmake_args("vulkan", p) == f"{PORTABLE} -DGGML_VULKAN=ON"
    assert choose("auto", linux(vulkan=True)) == (
        "portable", "Vulkan SDK found but vulkaninfo lists no GPU: CPU build")
    assert choose("vulkan", linux(vulkan=True))[0] == "vulkan"  # explicit: building is enough
    with pytest.raises(ValueError, match="vulkan build needs the Vulkan SDK: glslc"):
        choose("vulkan", linux(vulkan_devices=True))


def test_auto_order_metal_cuda_rocm_vulkan() -> None:
    everything = linux(**NVCC, **TWO_GPUS, rocm="hipcc", rocm_targets=("gfx1100",), vulkan=True,
                       vulkan_devices=True)  # fmt: skip
    assert choose("auto", everything)[0] == "cuda"
    assert choose("auto", linux(rocm="hipcc", rocm_targets=("gfx1100",), vulkan=True,
                                vulkan_devices=True))[0] == "rocm"  # fmt: skip
    # an explicit flavour is taken even where auto would pick another
    assert choose("vulkan", everything)[0] == "vulkan"
    assert choose("native", everything) == ("native", choose("native", LINUX)[1])


def test_unknown_flavour_names_the_known_ones() -> None:
    with pytest.raises(ValueError) as e:
        choose("bogus", LINUX)
    assert str(e.value) == f"unknown llama.cpp build flavour 'bogus': one of {', '.join(FLAVOURS)}"
    with pytest.raises(ValueError):
        cmake_args("auto", LINUX)  # choose() resolves auto first
    assert choose("CUDA", linux(**NVCC, **TWO_GPUS))[0] == "cuda"  # case does not matter


def test_rebuild_command_uses_the_script_in_a_checkout(monkeypatch: pytest.MonkeyPatch,
                                                      tmp_path: Path) -> None:  # fmt: skip
    python = shlex.quote(sys.executable)
    monkeypatch.chdir(ROOT)
    assert lb.rebuild_command("cuda") == f"LOCALLLM_LLAMACPP_BUILD=cuda scripts/llamacpp-build {python}"
    monkeypatch.chdir(tmp_path)
    assert lb.rebuild_command("portable") == (
        f"LOCALLLM_LLAMACPP_BUILD=portable {shlex.quote(str(SCRIPT))} {python}")
    with pytest.raises(ValueError, match="unknown"):
        lb.rebuild_command("bogus")


def test_rebuild_command_is_pip_outside_a_checkout(monkeypatch: pytest.MonkeyPatch,
                                                  tmp_path: Path) -> None:  # fmt: skip
    # an installed package: no scripts/llamacpp-build beside the package's folder
    monkeypatch.setattr(lb, "__file__", str(tmp_path / "site-packages" / "localllm" / "llamacpp_build.py"))
    monkeypatch.setattr(lb, "probe", lambda env=None: linux(**NVCC, **TWO_GPUS))
    monkeypatch.delenv("LOCALLLM_LLAMACPP_CMAKE_ARGS", raising=False)
    pip = (f"{shlex.quote(sys.executable)} -m pip install --force-reinstall --no-deps --no-binary "
           f"llama-cpp-python --no-cache-dir llama-cpp-python=={VERSION}")  # fmt: skip
    assert lb.rebuild_command("portable") == f'CMAKE_ARGS="{PORTABLE}" {pip}'
    assert lb.rebuild_command("auto") == (
        f'CMAKE_ARGS="{PORTABLE} -DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=86;89" {pip}')
    monkeypatch.setattr(lb, "probe", lambda env=None: LINUX)
    with pytest.raises(ValueError, match="nvcc"):
        lb.rebuild_command("cuda")


def test_the_version_is_kept_in_the_module_only(capsys: pytest.CaptureFixture[str]) -> None:
    assert lb.main(["--version"]) == 0 and capsys.readouterr().out == f"{VERSION}\n"
    assert "VERSION=0" not in SCRIPT.read_text() and VERSION not in SCRIPT.read_text()


# -- probe() and the script, with fake tools on PATH ---------------------------------------------


def fake(folder: Path, name: str, body: str) -> None:
    folder.mkdir(exist_ok=True)
    (folder / name).write_text(f"#!/bin/sh\n{body}\n")
    (folder / name).chmod(0o755)


def fake_uname(folder: Path, system: str = "Linux", machine: str = "x86_64") -> None:
    fake(folder, "uname", f'case "$1" in -m) echo {machine} ;; *) echo {system} ;; esac')


def fake_nvcc(folder: Path, cublas: bool = True) -> None:
    """nvcc in FOLDER, and (cublas) the toolkit's cuBLAS header beside it, in FOLDER/../include."""
    fake(folder, "nvcc", "echo 'nvcc: NVIDIA (R) Cuda compiler driver'\n"
                         "echo 'Cuda compilation tools, release 12.4, V12.4.131'")  # fmt: skip
    if cublas:
        (folder.parent / "include").mkdir(exist_ok=True)
        (folder.parent / "include" / "cublas_v2.h").write_text("/* cuBLAS */\n")


def fake_smi(folder: Path) -> None:
    fake(folder, "nvidia-smi", "echo '550.54.15, 8.9, NVIDIA GeForce RTX 4090'")


def tools(tmp_path: Path, *names: str) -> Path:
    """A folder of links to these real commands only: with the fakes, the whole PATH (so no real
    nvidia-smi, hipcc or glslc of the machine running the tests is seen)."""
    folder = tmp_path / "tools"
    folder.mkdir(exist_ok=True)
    for name in names:
        real = shutil.which(name)
        assert real, name
        if not (folder / name).exists():
            (folder / name).symlink_to(real)
    return folder


def run_script(tmp_path: Path, fakes: Path, *args: str, **env: str) -> subprocess.CompletedProcess[str]:
    """scripts/llamacpp-build with PATH = the fakes + a few real tools, the module run by this Python."""
    path = f"{fakes}:{tools(tmp_path, 'dirname', 'sha256sum', 'cut', 'ls', 'head')}"
    return subprocess.run([BASH, str(SCRIPT), *args], capture_output=True, text=True, timeout=60,
                          env={"PATH": path, "HOME": str(tmp_path), "PYTHON": sys.executable, **env})  # fmt: skip


needs_bash = pytest.mark.skipif(BASH is None or sys.platform == "win32", reason="a POSIX shell")


@needs_bash
def test_probe_reads_the_fake_tools(tmp_path: Path) -> None:
    bin_ = tmp_path / "bin"
    fake_uname(bin_)
    fake_nvcc(bin_)
    fake(bin_, "nvidia-smi", "echo '550.54.15, 8.9, NVIDIA GeForce RTX 4090'\n"
                             "echo '550.54.15, 8.6, NVIDIA RTX A6000'")  # fmt: skip
    fake(bin_, "hipcc", "exit 0")
    fake(bin_, "rocminfo", "echo '  Name:                    AMD Ryzen 9 7950X'\n"
                           "echo '  Name:                    gfx1100'\n"
                           "echo '      Name:                    amdgcn-amd-amdhsa--gfx1100'")  # fmt: skip
    fake(bin_, "glslc", "exit 0")
    fake(bin_, "vulkaninfo", "echo 'deviceType = PHYSICAL_DEVICE_TYPE_CPU'\n"
                             "echo 'deviceType = PHYSICAL_DEVICE_TYPE_DISCRETE_GPU'")  # fmt: skip
    p = lb.probe({"PATH": str(bin_), "VULKAN_SDK": "/sdk", "LOCALLLM_CUDA_ARCHITECTURES": "90"})
    assert (p.system, p.machine) == ("Linux", "x86_64")
    assert (p.nvcc, p.nvcc_version, p.cublas) == (str(bin_ / "nvcc"), "12.4", True)
    assert p.nvidia_driver == "550.54.15" and p.compute_caps == ("8.9", "8.6")
    assert p.gpu_names == ("NVIDIA GeForce RTX 4090", "NVIDIA RTX A6000")
    assert p.rocm == str(bin_ / "hipcc") and p.rocm_targets == ("gfx1100",)
    assert p.vulkan and p.vulkan_devices and p.cuda_architectures == "90"
    # llvmpipe alone (a CPU device) is no Vulkan GPU; no VULKAN_SDK and no headers: no SDK
    fake(bin_, "vulkaninfo", "echo 'deviceType = PHYSICAL_DEVICE_TYPE_CPU'")
    p = lb.probe({"PATH": str(bin_)})
    assert not p.vulkan_devices
    assert p.vulkan == os.path.exists("/usr/include/vulkan/vulkan.h")


@needs_bash
def test_probe_never_raises(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    bin_ = tmp_path / "bin"
    sleep = shutil.which("sleep")
    assert sleep
    fake(bin_, "nvcc", f"exec {sleep} 5")  # hangs: given up after the time limit
    fake(bin_, "nvidia-smi", "echo 'NVIDIA-SMI has failed: no driver' ; exit 9")
    fake(bin_, "rocminfo", "exit 1")
    fake(bin_, "uname", "exit 1")  # failing: platform's answer instead
    monkeypatch.setattr(lb, "PROBE_TIMEOUT_S", 0.3)
    p = lb.probe({"PATH": str(bin_)})
    assert p.nvcc == str(bin_ / "nvcc") and p.nvcc_version is None
    assert p.nvidia_driver is None and p.compute_caps == () and p.rocm_targets == ()
    assert p.system and p.machine
    assert isinstance(lb.probe({"PATH": ""}), Probes)  # nothing on PATH at all


@needs_bash
def test_script_builds_cuda_where_nvcc_and_a_gpu_are(tmp_path: Path) -> None:
    bin_ = tmp_path / "bin"
    fake_uname(bin_)
    fake_nvcc(bin_)
    fake_smi(bin_)
    p = run_script(tmp_path, bin_, "--print-args")
    assert p.returncode == 0, p.stderr
    assert "-DGGML_CUDA=ON" in p.stdout and "-DCMAKE_CUDA_ARCHITECTURES=89" in p.stdout
    assert "-DGGML_AMX_TILE=OFF" in p.stdout and p.stdout.count("\n") == 1
    assert p.stderr.startswith("llama.cpp build: cuda (nvcc 12.4, NVIDIA driver 550.54.15, "
                               "NVIDIA GeForce RTX 4090 (compute 8.9))")  # fmt: skip


@needs_bash
def test_script_keeps_the_cpu_build_with_nvcc_but_no_driver(tmp_path: Path) -> None:
    bin_ = tmp_path / "bin"
    fake_uname(bin_)
    fake_nvcc(bin_)
    p = run_script(tmp_path, bin_, "--print-args")
    assert p.returncode == 0, p.stderr
    assert "GGML_CUDA" not in p.stdout and p.stdout.startswith("-DGGML_NATIVE=OFF -DGGML_SSE42=")
    assert p.stderr == ("llama.cpp build: portable (nvcc found but no NVIDIA driver "
                        "(nvidia-smi sees no GPU): CPU build)\n")  # fmt: skip


@needs_bash
def test_script_metal_on_a_mac_and_one_line_for_a_bad_flavour(tmp_path: Path) -> None:
    bin_ = tmp_path / "bin"
    fake_uname(bin_, "Darwin", "arm64")
    p = run_script(tmp_path, bin_, "--print-args", LOCALLLM_LLAMACPP_BUILD="metal")
    assert (p.returncode, p.stdout) == (0, "-DGGML_METAL=ON\n"), p.stderr
    p = run_script(tmp_path, bin_, "--print-args", LOCALLLM_LLAMACPP_BUILD="bogus")
    assert p.returncode == 2 and p.stdout == ""
    assert p.stderr.count("\n") == 1 and "'bogus'" in p.stderr and ", ".join(FLAVOURS) in p.stderr
    # building (not --print-args) stops the same way, before anything is installed
    # (vulkan: no glslc on this PATH, whatever the machine has in fixed places)
    p = run_script(tmp_path, bin_, LOCALLLM_LLAMACPP_BUILD="vulkan")
    assert p.returncode == 2 and p.stderr.count("\n") == 1
    assert p.stderr.startswith("llamacpp-build: vulkan build needs the Vulkan SDK")


@needs_bash
def test_the_wheel_key_hashes_the_resolved_flavour(tmp_path: Path) -> None:
    """auto that resolves to portable (and cpu) finds the wheel a portable build left: the key is
    sha256("VERSION|flavour|args|tag")[:16], as it always was."""
    if shutil.which("sha256sum") is None:
        pytest.skip("sha256sum")
    bin_ = tmp_path / "bin"
    fake_uname(bin_)
    prefix = tmp_path / "venv"
    prefix.mkdir()
    # the Python being installed into: answers the script's three questions, logs pip
    fake(bin_, "target-python", f'''case "$*" in
  *cache_tag*) echo "cpython-311 linux-x86_64" ;;
  *sys.prefix*) echo "{prefix}" ;;
  *importlib.metadata*) exit 1 ;;
  *"pip install"*) echo "$*" >> "{prefix}/pip.log" ;;
  *) echo "unexpected: $*" >> "{prefix}/pip.log"; exit 1 ;;
esac''')
    args = lb.cmake_args("portable", lb.probe({"PATH": str(bin_)}))
    key = hashlib.sha256(f"{VERSION}|portable|{args}|cpython-311 linux-x86_64".encode()).hexdigest()[:16]
    cache = tmp_path / "wheels"
    wheel = cache / f"llama-cpp-python-{VERSION}-{key}" / f"llama_cpp_python-{VERSION}-py3-none-any.whl"
    wheel.parent.mkdir(parents=True)
    wheel.write_bytes(b"")
    for requested in ("auto", "cpu", "portable"):
        (prefix / "localllm-llamacpp-build").unlink(missing_ok=True)
        p = run_script(tmp_path, bin_, str(bin_ / "target-python"), LOCALLLM_WHEEL_CACHE=str(cache),
                       LOCALLLM_LLAMACPP_BUILD=requested)  # fmt: skip
        assert p.returncode == 0, p.stderr
        assert p.stderr.startswith("llama.cpp build: portable (") and "building" not in p.stderr
        assert (prefix / "localllm-llamacpp-build").read_text() == f"{key} portable {args}\n"
    log = (prefix / "pip.log").read_text()
    assert "unexpected" not in log and log.count(str(wheel)) == 6
    # installed already (the marker's key and the version): nothing to do, nothing said
    fake(bin_, "target-python", (bin_ / "target-python").read_text().replace(
        "*importlib.metadata*) exit 1", "*importlib.metadata*) exit 0"))
    p = run_script(tmp_path, bin_, str(bin_ / "target-python"), LOCALLLM_WHEEL_CACHE=str(cache))
    assert (p.returncode, p.stderr) == (0, "")
