"""`localllm doctor`: each check passes on a healthy setup and fails, with a fix, on a broken one."""

from __future__ import annotations

import errno
import functools
import json
import os
import shutil
import sqlite3
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from localllm import devices, doctor
from localllm.cli import main
from localllm.models_registry.store import Store

from conftest import SIGILL_SELF, python_command

NAMES = ["python", "llama_cpp", "llama_cpp_probe", "backends", "torch", "memory", "disk", "store",
         "huggingface", "store_write", "conversations"]  # fmt: skip
HEAVY = ("torch", "llama_cpp", "textual")
DATA_KEYS = {  # documented in localllm/doctor.py: the same keys whether a check passes or fails
    "python": {"version", "implementation", "os", "os_release", "machine", "cpu_isa"},
    "llama_cpp": {"version", "build", "system_info", "backends", "blas", "gpu_offload", "devices"},
    "llama_cpp_probe": {"ok", "reason", "cached"},
    "backends": {"auto", "backends"},
    "torch": {"version", "cuda_version", "cuda", "mps", "kernels", "compiler"},
    "memory": {"free_bytes", "total_bytes", "gpu", "gpus"},
    "disk": {"path", "free_bytes", "total_bytes"},
    "store": {"path", "models", "blobs", "references", "hashed", "damaged"},
    "huggingface": {"token", "token_source", "endpoint", "offline"},
    "store_write": {"path"},
    "conversations": {"path", "conversations"},
}
SIGILL_PROBE = python_command(SIGILL_SELF)
TORCH_CHILD = doctor._torch_facts
TORCH_CHILD_ONCE = functools.cache(TORCH_CHILD)


@pytest.fixture(autouse=True)
def fast_probe(monkeypatch: pytest.MonkeyPatch) -> None:
    """`true` stands in for the llama.cpp probe child (2-3 s a run); the tests about the probe
    use the `real_probe` fixture or set their own command."""
    monkeypatch.setenv("LOCALLLM_LLAMACPP_PROBE", "true")


@pytest.fixture(autouse=True)
def torch_child_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """The torch check's child (importing torch and probing its kernels: 5-10 s a run) runs once
    for the whole file; test_torch_absent_broken_and_present runs its own children."""
    monkeypatch.setattr(doctor, "_torch_facts", TORCH_CHILD_ONCE)


@pytest.fixture
def real_probe(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("LOCALLLM_LLAMACPP_PROBE")


def run(args: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    with pytest.raises(SystemExit) as exc:
        main(args)
    out, err = capsys.readouterr()
    return exc.value.code, out, err


def lines_by_name(out: str) -> dict[str, str]:
    """`✓ store: ...` → {"store": "✓ store: ..."}; every stdout line must be a check line."""
    found = {}
    for line in out.splitlines():
        mark, name = line.split(" ", 1)[0], line.split(" ", 2)[1].rstrip(":")
        assert mark in ("✓", "✗", "–"), line
        found[name] = line
    return found


def import_copy(tiny_llama: Path, tmp_path: Path, name: str = "tiny") -> Path:
    """Import a private copy of the tiny model and return its blob. The store hard-links what it
    imports, so damaging the blob of the shared fixture file would damage the fixture itself."""
    copy = tmp_path / "copy.gguf"
    shutil.copyfile(tiny_llama, copy)
    store = Store()
    return store.path_of(store.add_file(copy, name, source=f"file:{copy}"))


def assert_failed(rc: int, out: str, err: str, name: str) -> str:
    """Exit 1, the named check is ✗ with a fix, and stderr is one line naming it."""
    assert rc == 1, (out, err)
    line = lines_by_name(out)[name]
    assert line.startswith(f"✗ {name}: ") and " — fix: " in line, line
    assert err.startswith("error: ") and err.count("\n") == 1 and name in err, err
    assert "Traceback" not in out + err
    return line


def test_healthy_store_passes(
    tiny_llama: Path, capsys: pytest.CaptureFixture[str], localllm_home: Path, real_probe: None
) -> None:
    Store().add_file(tiny_llama, "tiny", source="x")
    rc, out, err = run(["doctor"], capsys)
    assert rc == 0, out + err
    assert err == ""
    lines = lines_by_name(out)
    assert list(lines) == NAMES
    assert all(line[0] in "✓–" for line in lines.values()), out
    assert lines["store"] == (
        "✓ store: 1 model (1 blob, 0 by reference): recorded sizes match "
        "(`localllm doctor --deep` checks sha256)"
    )
    assert "probed just now" in lines["llama_cpp_probe"]
    assert f"{localllm_home} is writable" in lines["store_write"]
    assert "none yet" in lines["conversations"]
    # the verdict is cached in the store; a second run reads it, --deep probes again
    assert "cached verdict" in lines_by_name(run(["doctor"], capsys)[1])["llama_cpp_probe"]
    rc, out, _ = run(["doctor", "--deep"], capsys)
    assert rc == 0 and "probed just now" in lines_by_name(out)["llama_cpp_probe"]
    assert "1 model (1 blob, 0 by reference): sha256 verified" in lines_by_name(out)["store"]


def test_json_shape(tiny_llama: Path, capsys: pytest.CaptureFixture[str]) -> None:
    Store().add_file(tiny_llama, "tiny", source="x")
    rc, out, err = run(["doctor", "--json"], capsys)
    assert rc == 0, err
    report = json.loads(out)
    assert set(report) == {"ok", "deep", "checks"}
    assert report["ok"] is True and report["deep"] is False
    assert [c["name"] for c in report["checks"]] == NAMES == list(DATA_KEYS)
    for c in report["checks"]:
        assert set(c) == {"name", "ok", "detail", "fix", "data"}, c
        assert c["ok"] in (True, None) and c["fix"] is None, c
        assert isinstance(c["detail"], str) and set(c["data"]) == DATA_KEYS[c["name"]], c
    checks = {c["name"]: c for c in report["checks"]}
    assert checks["store"]["data"] == {"path": str(Store().home), "models": 1, "blobs": 1,
                                       "references": 0, "hashed": False, "damaged": {}}  # fmt: skip
    assert set(checks["llama_cpp"]["data"]) == {"version", "build", "system_info", "backends",
                                                "blas", "gpu_offload", "devices"}  # fmt: skip
    # ggml's own device list, through its device API: this build's CPU at least
    assert any(d["type"] == "cpu" and d["total_bytes"] > 0 for d in checks["llama_cpp"]["data"]["devices"])
    assert checks["llama_cpp"]["data"]["version"]
    assert checks["disk"]["data"]["free_bytes"] > 0
    assert checks["memory"]["data"]["free_bytes"] > 0
    assert checks["python"]["data"]["version"] == ".".join(map(str, sys.version_info[:3]))
    flags = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    assert ("AVX2" in checks["python"]["data"]["cpu_isa"]) == (" avx2" in flags)


def test_json_failure_exit_code(
    tiny_llama: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    import_copy(tiny_llama, tmp_path).unlink()
    rc, out, err = run(["doctor", "--json"], capsys)
    assert rc == 1 and err == "error: 1 of 11 checks failed: store\n"
    report = json.loads(out)
    [bad] = [c for c in report["checks"] if c["ok"] is False]
    assert report["ok"] is False and bad["name"] == "store" and bad["fix"]
    assert list(bad["data"]["damaged"]) == ["tiny:latest"]


def test_missing_blob(tiny_llama: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    blob = import_copy(tiny_llama, tmp_path)
    blob.unlink()
    line = assert_failed(*run(["doctor"], capsys), "store")
    assert f"1 of 1 models damaged: tiny:latest ({blob.name} is missing)" in line
    assert "fix: `localllm rm tiny:latest`, then pull or import it again" in line


def test_truncated_blob(
    tiny_llama: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    blob = import_copy(tiny_llama, tmp_path)
    size = blob.stat().st_size
    os.truncate(blob, size - 100)
    line = assert_failed(*run(["doctor"], capsys), "store")
    assert f"has {size - 100:,} bytes, the index says {size:,}" in line


def test_same_size_corruption_needs_deep(
    tiny_llama: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    blob = import_copy(tiny_llama, tmp_path)
    Store().add_file(blob, "alias", source="x")  # two names, one blob: damaged under both
    with open(blob, "r+b") as f:
        f.seek(-10, os.SEEK_END)
        byte = f.read(1)
        f.seek(-10, os.SEEK_END)
        f.write(bytes([byte[0] ^ 0xFF]))
    rc, out, err = run(["doctor"], capsys)
    assert rc == 0, out + err
    assert lines_by_name(out)["store"].startswith("✓ store: 2 models")
    line = assert_failed(*run(["doctor", "--deep"], capsys), "store")
    assert "2 of 2 models damaged: alias:latest (" in line and "its sha256 is" in line
    assert "(likewise for the others)" in line


def test_reference_gone_or_changed(
    tiny_llama: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    other = tmp_path / "other-tool" / "model.gguf"
    other.parent.mkdir()
    shutil.copyfile(tiny_llama, other)
    Store().add_reference(other, "ref", source="ollama:x")
    rc, out, _ = run(["doctor"], capsys)
    assert rc == 0 and "1 model (0 blobs, 1 by reference)" in lines_by_name(out)["store"]
    os.utime(other, ns=(0, 0))
    line = assert_failed(*run(["doctor"], capsys), "store")
    assert "ref:latest (model ref:latest refers to" in line and "has changed" in line
    other.unlink()
    assert "which is gone" in assert_failed(*run(["doctor"], capsys), "store")


def test_damaged_index(capsys: pytest.CaptureFixture[str], localllm_home: Path) -> None:
    localllm_home.mkdir()
    (localllm_home / "index.json").write_text("{not json")
    line = assert_failed(*run(["doctor"], capsys), "store")
    assert "is damaged" in line and "move index.json aside" in line
    (localllm_home / "index.json").unlink()
    (localllm_home / "index.json").mkdir()  # unreadable, even for root
    line = assert_failed(*run(["doctor"], capsys), "store")
    assert "cannot read" in line and "Is a directory" in line and "fix: make it readable" in line


def test_store_path_is_a_file(capsys: pytest.CaptureFixture[str], localllm_home: Path) -> None:
    # Tests run as root, for whom chmod does not stop writes. A file where the store folder
    # should be stops everyone, root included: a real failure, nothing injected.
    localllm_home.write_text("not a folder")
    rc, out, err = run(["doctor"], capsys)
    lines = lines_by_name(out)
    checks = json.loads(run(["doctor", "--json"], capsys)[1])["checks"]
    assert {c["name"]: set(c["data"]) for c in checks} == DATA_KEYS
    assert_failed(rc, out, err, "store_write")
    assert f"{localllm_home} is not a folder" in lines["store_write"]
    assert lines["conversations"].startswith("✗ conversations: cannot create")
    assert lines["store"].startswith(f"✗ store: {localllm_home} is not a folder — fix: move")


def test_read_only_store_folder(
    capsys: pytest.CaptureFixture[str], localllm_home: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # What `chmod a-w` does to a user who is not root: creating a file in the folder fails with
    # EACCES. As root chmod cannot make that happen, so the failure is injected at the one call
    # the check makes (tempfile.mkstemp in the store folder); everything else runs for real.
    localllm_home.mkdir()
    real_mkstemp = tempfile.mkstemp

    def mkstemp(*args: object, dir: str | None = None, **kw: object) -> tuple[int, str]:
        if dir is not None and Path(dir) == localllm_home:
            raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), str(dir))
        return real_mkstemp(*args, dir=dir, **kw)

    monkeypatch.setattr(doctor.tempfile, "mkstemp", mkstemp)
    rc, out, err = run(["doctor"], capsys)
    line = assert_failed(rc, out, err, "store_write")
    assert f"cannot create files in {localllm_home}: Permission denied" in line
    assert "fix: make" in line and "LOCALLLM_HOME" in line
    assert lines_by_name(out)["conversations"].startswith("✗ conversations:")


def test_conversations_database(capsys: pytest.CaptureFixture[str], localllm_home: Path) -> None:
    from localllm.conversations import Conversations

    with Conversations() as conversations:
        conversations.create("tiny:latest")
    rc, out, _ = run(["doctor"], capsys)
    assert rc == 0
    assert lines_by_name(out)["conversations"] == (
        f"✓ conversations: {localllm_home / 'conversations.db'}: 1 conversation, writable"
    )


def test_conversations_in_use(capsys: pytest.CaptureFixture[str], localllm_home: Path) -> None:
    from localllm.conversations import Conversations

    Conversations().close()
    writer = sqlite3.connect(localllm_home / "conversations.db")
    writer.execute("BEGIN IMMEDIATE")  # the app in the middle of saving an answer
    try:
        rc, out, err = run(["doctor"], capsys)
    finally:
        writer.rollback()
        writer.close()
    assert rc == 0, out + err
    assert lines_by_name(out)["conversations"].endswith(
        "0 conversations, writable (in use by another localllm)"
    )


def test_conversations_damaged(capsys: pytest.CaptureFixture[str], localllm_home: Path) -> None:
    db = localllm_home / "conversations.db"
    localllm_home.mkdir()
    db.write_bytes(b"this is not an SQLite database" * 100)
    line = assert_failed(*run(["doctor"], capsys), "conversations")
    assert "is damaged: file is not a database" in line and "move" in line
    db.unlink()
    db.mkdir()  # a folder where the file should be: cannot be written, not even by root
    line = assert_failed(*run(["doctor"], capsys), "conversations")
    assert f"{db} is not a file" in line


def test_conversations_newer_schema(
    capsys: pytest.CaptureFixture[str], localllm_home: Path
) -> None:
    from localllm.conversations import SCHEMA_VERSION

    localllm_home.mkdir()
    conn = sqlite3.connect(localllm_home / "conversations.db")
    conn.execute(f"PRAGMA user_version = {SCHEMA_VERSION + 1}")
    conn.close()
    line = assert_failed(*run(["doctor"], capsys), "conversations")
    assert "written by a newer localllm" in line and "fix: upgrade localllm" in line


def test_token_never_printed(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    secret = "hf_secretDoNotPrintMe1234567890"
    monkeypatch.setenv("HF_TOKEN", secret)
    monkeypatch.setenv("HF_ENDPOINT", "https://user:pa55word@mirror.example.org/hub")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    for args in (["doctor"], ["doctor", "--json"], ["doctor", "--deep"]):
        rc, out, err = run(args, capsys)
        assert rc == 0, out + err
        for leaked in (secret, secret[3:12], secret[-8:], "pa55word"):
            assert leaked not in out + err, args
    line = lines_by_name(run(["doctor"], capsys)[1])["huggingface"]
    assert line == (
        "✓ huggingface: token: set (HF_TOKEN); endpoint: https://***@mirror.example.org/hub; "
        "offline: yes (pull uses stored models only)"
    )


def test_huggingface_defaults_and_bad_endpoint(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    for var in ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN", "HF_ENDPOINT", "HF_HUB_OFFLINE"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))  # no token file there
    monkeypatch.delenv("HF_TOKEN_PATH", raising=False)
    line = lines_by_name(run(["doctor"], capsys)[1])["huggingface"]
    assert line == (
        "✓ huggingface: token: none (public models only); "
        "endpoint: https://huggingface.co (default); offline: no"
    )
    monkeypatch.setenv("HF_ENDPOINT", "mirror.example.org")
    line = assert_failed(*run(["doctor"], capsys), "huggingface")
    assert "fix: set HF_ENDPOINT to a URL" in line


def test_probe_crash_fails(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("LOCALLLM_LLAMACPP_PROBE", SIGILL_PROBE)
    line = assert_failed(*run(["doctor"], capsys), "llama_cpp_probe")
    assert "SIGILL" in line and "illegal instruction" in line and "probed just now" in line
    assert "fix: rebuild llama-cpp-python" in line
    line = assert_failed(*run(["doctor"], capsys), "llama_cpp_probe")
    assert "SIGILL" in line and "cached verdict" in line
    rc, out, err = run(["doctor", "--json", "--deep"], capsys)
    # the torch engine (installed for the tests) is what `run` and the app fall back to
    assert rc == 1 and err == "error: 1 of 11 checks failed: llama_cpp_probe\n"
    checks = {c["name"]: c for c in json.loads(out)["checks"]}
    assert checks["llama_cpp_probe"]["ok"] is False
    assert checks["llama_cpp_probe"]["data"]["cached"] is False
    assert checks["backends"]["ok"] is True and checks["backends"]["data"]["auto"] == "torch"


def test_doctor_process_imports_nothing_heavy(tiny_llama: Path, real_probe: None) -> None:
    """llama.cpp and torch are asked in child processes: a crash there cannot take doctor down."""
    Store().add_file(tiny_llama, "tiny", source="x")
    code = (
        "import sys\n"
        "sys.argv = ['localllm', 'doctor', '--deep']\n"
        "from localllm.cli import main\n"
        "try:\n    main()\nexcept SystemExit as e:\n    assert e.code == 0, e.code\n"
        f"print('HEAVY', sorted(m for m in {HEAVY!r} if m in sys.modules))\n"
    )
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stdout + p.stderr
    assert "HEAVY []" in p.stdout, p.stdout[-500:]


def test_torch_absent_broken_and_present(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setattr(doctor, "_torch_facts", TORCH_CHILD)  # a child each time: the fakes below
    real_find_spec = doctor.importlib.util.find_spec
    with monkeypatch.context() as m:
        m.setattr(doctor.importlib.util, "find_spec",
                  lambda name, *a: None if name == "torch" else real_find_spec(name, *a))  # fmt: skip
        check = doctor.check_torch()
    assert check.ok is None and check.line() == (
        "– torch: not installed (optional, for the torch engine: pip install 'localllm[torch]')"
    )
    # A torch package that fails to import, then a minimal one that imports: both are imported
    # in the child process the check starts, which sees the fake package through PYTHONPATH.
    fake = tmp_path / "fake" / "torch"
    fake.mkdir(parents=True)
    monkeypatch.syspath_prepend(str(fake.parent))
    monkeypatch.setenv("PYTHONPATH", str(fake.parent))
    (fake / "__init__.py").write_text("raise ImportError('libcudart.so.12: cannot open')\n")
    check = doctor.check_torch()
    assert check.ok is False and "libcudart.so.12: cannot open" in check.detail
    assert set(check.data) == DATA_KEYS["torch"]
    assert "pip install --force-reinstall" in (check.fix or "")
    (fake / "__init__.py").write_text(
        "from types import SimpleNamespace as N\n__version__ = '9.9.9'\n"
        "version = N(cuda=None)\ncuda = N(is_available=lambda: False)\n"
        "backends = N(mps=N(is_available=lambda: True))\n"
    )
    monkeypatch.setenv("CXX", "no-such-compiler")
    monkeypatch.setenv("PATH", str(tmp_path / "no-bin"))  # no g++ or clang++ either
    check = doctor.check_torch()
    assert check.ok is True and check.detail == (
        "9.9.9; devices: mps, cpu; compiled step: on the CPU it needs a C++ compiler (apt install g++)")
    assert check.data == {"version": "9.9.9", "cuda_version": None, "cuda": [], "mps": True, "kernels": [],
                          "compiler": None}
    (fake / "__init__.py").write_text((fake / "__init__.py").read_text().replace("9.9.9", "2.4.1+cpu"))
    check = doctor.check_torch()  # older than the torch engine needs: said, with the fix
    assert check.ok is False and check.detail == (
        "torch 2.4.1+cpu is too old for the torch engine (it needs 2.5 or newer: SDPA's enable_gqa)")
    assert check.fix == "pip install 'torch>=2.5'"


def test_a_gpu_the_build_cannot_use_gets_the_rebuild_command(monkeypatch: pytest.MonkeyPatch) -> None:
    """A CPU build (this one) on a machine with an NVIDIA GPU (described): the check fails with the
    one command that rebuilds llama.cpp for it; with no GPU toolkit, with what to install."""
    from localllm import llamacpp_build

    monkeypatch.setenv("LOCALLLM_DEVICES", '[{"kind": "cuda", "name": "NVIDIA GeForce RTX 4090", '
                       '"total": "24 GiB"}, {"kind": "cpu"}]')  # fmt: skip
    toolkit = llamacpp_build.Probes(system="Linux", machine="x86_64", nvcc="/usr/local/cuda/bin/nvcc",
                                    nvcc_version="12.4", nvidia_driver="550.54", compute_caps=("8.9",),
                                    gpu_names=("NVIDIA GeForce RTX 4090",))  # fmt: skip
    monkeypatch.setattr(llamacpp_build, "probe", lambda env=None: toolkit)
    check = doctor.check_llama_cpp()
    assert check.ok is False and "GPU offload: no" in check.detail
    assert "this machine has NVIDIA GeForce RTX 4090 (cuda), which this build cannot use" in check.detail
    assert check.fix.startswith("LOCALLLM_LLAMACPP_BUILD=cuda ") and "llamacpp-build" in check.fix
    assert check.data["devices"][0]["type"] == "cpu"  # ggml sees only the CPU: the build is CPU-only
    monkeypatch.setattr(llamacpp_build, "probe", lambda env=None: llamacpp_build.Probes(
        system="Linux", machine="x86_64"))  # fmt: skip
    check = doctor.check_llama_cpp()
    assert check.ok is False and "needs nvcc" in check.fix  # what to install first
    memory = doctor.check_memory()
    assert memory.data["gpus"] == [memory.data["gpu"]] and memory.data["gpu"]["name"] == "NVIDIA GeForce RTX 4090"
    assert "cuda:0 (NVIDIA GeForce RTX 4090) 24.0 GiB free of 24.0 GiB" in memory.detail


def test_low_memory_fails(monkeypatch: pytest.MonkeyPatch) -> None:
    from localllm import memory

    monkeypatch.setattr(memory, "available_memory",
                        lambda device="auto": memory.Available("cpu", 100 << 20, 8 << 30))  # fmt: skip
    check = doctor.check_memory()
    assert check.ok is False and "RAM 100.0 MiB free of 8.0 GiB" in check.detail
    assert check.fix and "close other programs" in check.fix


def test_parse_system_info() -> None:
    text = (
        "CPU : SSE3 = 1 | AVX = 1 | AVX2 = 1 | AVX512 = 0 | AMX_INT8 = 1 | REPACK = 1 | "
        "CUDA : ARCHS = 890 | USE_GRAPHS = 1 | PEER_MAX_BATCH_SIZE = 128 | BLAS : ACCELERATE = 1 |"
    )
    assert doctor.parse_system_info(text) == {
        "CPU": ["SSE3", "AVX", "AVX2", "AMX_INT8", "REPACK"],
        "CUDA": ["ARCHS=890", "USE_GRAPHS", "PEER_MAX_BATCH_SIZE=128"],
        "BLAS": ["ACCELERATE"],
    }


def test_ascii_terminal_marks() -> None:
    check = doctor.Check("store", False, "1 of 1 models damaged", fix="`localllm rm x`")
    assert check.line(doctor.text_marks("ascii")) == (
        "FAIL store: 1 of 1 models damaged -- fix: `localllm rm x`"
    )
    assert doctor.text_marks("utf-8") == ("✓", "✗", "–", "—")


def test_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    rc, _, err = run(["doctor", "--nope"], capsys)
    assert rc == 2 and "--nope" in err


def test_gpu_memory_from_nvidia_smi(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    # No GPU here: a stand-in nvidia-smi on PATH answers the query the way the real one does.
    smi = tmp_path / "bin" / "nvidia-smi"
    smi.parent.mkdir()
    smi.write_text("#!/bin/sh\necho 'NVIDIA H100 80GB HBM3, 81559, 81000'\n")
    smi.chmod(0o755)
    monkeypatch.setenv("PATH", f"{smi.parent}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.delenv("LOCALLLM_DEVICES")  # detect this machine (conftest describes it GPU-less)
    monkeypatch.setattr(devices, "_detected", None)
    monkeypatch.delitem(sys.modules, "torch", raising=False)  # else devices.py asks torch instead
    check = doctor.check_memory()
    assert check.ok is True and check.detail.endswith("; cuda:0 (NVIDIA H100 80GB HBM3) 79.1 GiB free of 79.6 GiB")
    assert check.data["gpu"] == {"device": "cuda:0", "name": "NVIDIA H100 80GB HBM3",
                                 "free_bytes": 81000 << 20, "total_bytes": 81559 << 20}  # fmt: skip
    assert devices.inventory().gpus[0].bandwidth == 3350e9  # the datasheet's, by its name


def test_a_check_that_breaks_is_reported(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    def broken() -> doctor.Check:
        raise RuntimeError("psutil is confused")

    monkeypatch.setattr(doctor, "check_memory", broken)
    rc, out, err = run(["doctor"], capsys)
    line = assert_failed(rc, out, err, "memory")
    assert "the check itself failed: RuntimeError: psutil is confused" in line
    assert list(lines_by_name(out)) == NAMES  # the other checks still ran


def test_backends_check_lists_the_registry(capsys: pytest.CaptureFixture[str]) -> None:
    rc, out, _ = run(["doctor", "--json"], capsys)
    [check] = [c for c in json.loads(out)["checks"] if c["name"] == "backends"]
    assert check["ok"] is True and check["data"]["auto"] == "llama.cpp"
    rows = {r["name"]: r for r in check["data"]["backends"]}
    assert rows["llama.cpp"]["available"] is True
    assert "q8_0" in rows["llama.cpp"]["capabilities"]["kv_cache_types"]
    assert rows["torch"]["available"] is True, rows["torch"]  # the dev install has torch
    assert rows["torch"]["capabilities"]["dtypes"] == ["f32", "bf16", "f16", "int4"]
    assert check["detail"] == "auto uses llama.cpp; llama.cpp: runs here; torch: runs here"
