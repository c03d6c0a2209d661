"""`localllm import --scan`, `list` and `rm` as a user runs them: a real process, real folders."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path


def cli(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "localllm", *args], capture_output=True,
                          text=True, env=env, timeout=120)  # fmt: skip


def test_scan_list_rm_leave_other_tools_files(tmp_path: Path, tiny_llama: Path) -> None:
    home = tmp_path / "user"
    ollama = tmp_path / "ollama"
    digest = hashlib.sha256(tiny_llama.read_bytes()).hexdigest()
    blob = ollama / "blobs" / f"sha256-{digest}"
    blob.parent.mkdir(parents=True)
    shutil.copyfile(tiny_llama, blob)
    manifest = ollama / "manifests/registry.ollama.ai/library/tinyllama/1b"
    manifest.parent.mkdir(parents=True)
    manifest.write_text(json.dumps({"layers": [{"mediaType": "application/vnd.ollama.image.model",
                                                "digest": f"sha256:{digest}",
                                                "size": blob.stat().st_size}]}))  # fmt: skip
    lms = home / ".lmstudio/models/someone/Tiny-GGUF/tiny-Q8_0.gguf"
    lms.parent.mkdir(parents=True)
    lms.write_bytes(tiny_llama.read_bytes()[:-1000] + b"\x00" * 1000)  # other bytes, still GGUF
    bad = home / ".lmstudio/models/someone/Broken-GGUF/broken-Q4_0.gguf"
    bad.parent.mkdir(parents=True)
    bad.write_bytes(tiny_llama.read_bytes()[:5000])  # truncated: must be skipped
    env = os.environ | {"HOME": str(home), "OLLAMA_MODELS": str(ollama),
                        "HF_HUB_CACHE": str(tmp_path / "no-hf-cache")}  # fmt: skip
    before = {p: (p.read_bytes(), p.stat().st_mtime_ns) for p in (blob, lms, bad)}

    p = cli("import", "--scan", env=env)
    assert p.returncode == 0, p.stderr
    lines = p.stdout.splitlines()
    assert any(x.startswith("registered") and "tinyllama:1b" in x for x in lines), p.stdout
    assert any(x.startswith("registered") and "someone/tiny:f16" in x for x in lines), p.stdout
    assert any(x.startswith("skipped") and "broken-Q4_0.gguf" in x for x in lines), p.stdout
    assert lines[-1] == "2 registered by reference (no copies), 0 already known, 1 skipped"

    listing = json.loads(cli("list", "--json", env=env).stdout)
    by_name = {m["name"]: m for m in listing}
    assert by_name["tinyllama:1b"]["source"].startswith("ollama:")
    assert by_name["tinyllama:1b"]["reference"] == str(blob)
    assert by_name["someone/tiny:f16"]["source"].startswith("lmstudio:")
    store_blobs = Path(os.environ["LOCALLLM_HOME"]) / "blobs"
    assert not list(store_blobs.glob("sha256-*"))  # by reference: no copies, no links
    text = cli("list", env=env).stdout
    assert "ollama:" in text and "lmstudio:" in text

    again = cli("import", "--scan", "--json", env=env)
    statuses = sorted(r["status"] for r in json.loads(again.stdout))
    assert statuses == ["already", "already", "skipped"]

    for name in ("tinyllama:1b", "someone/tiny:f16"):
        r = cli("rm", name, "--yes", env=env)
        assert r.returncode == 0 and "left in place" in r.stdout, r.stderr
    assert cli("list", "--json", env=env).stdout.strip() == "[]"
    for path, (data, mtime) in before.items():
        assert path.read_bytes() == data and path.stat().st_mtime_ns == mtime, path


def test_import_needs_path_or_scan(tmp_path: Path) -> None:
    env = dict(os.environ)
    assert cli("import", env=env).returncode == 2
    assert cli("import", str(tmp_path / "x.gguf"), "--scan", env=env).returncode == 2
    p = cli("import", str(tmp_path / "missing.gguf"), env=env)
    assert p.returncode == 1 and p.stderr.startswith("error: no such file")
