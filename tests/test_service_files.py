"""packaging/'s service files run `localllm serve` as a user's login session would: the systemd user
unit passes `systemd-analyze verify`, the launchd plist parses, and the command line each one holds
starts a server on loopback that requires the key from the key file, writes its log where the file
says, and stops cleanly on SIGTERM (what `systemctl --user stop` and `launchctl bootout` send):
exit 0, so neither restarts it. Only the port is changed, to a free one."""

from __future__ import annotations

import os
import plistlib
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

ROOT = Path(__file__).resolve().parents[1]
UNIT = ROOT / "packaging" / "systemd" / "localllm.service"
PLIST = ROOT / "packaging" / "launchd" / "dev.localllm.serve.plist"
PORT = "11435"  # what both files say; the tests swap in a free one
KEY = "test-key-0123456789"


def unit_service_section() -> dict[str, list[str]]:
    """[Service] of the unit: key → values in order (systemd allows a key more than once)."""
    out: dict[str, list[str]] = {}
    section = None
    for line in UNIT.read_text(encoding="utf-8").splitlines():
        line = line.strip()
        if not line or line.startswith(("#", ";")):
            continue
        if line.startswith("["):
            section = line
        elif section == "[Service]":
            k, _, v = line.partition("=")
            out.setdefault(k.strip(), []).append(v.strip())
    return out


def free_port() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return str(s.getsockname()[1])


@pytest.fixture
def user_home(tmp_path: Path) -> Path:
    """A home where pipx would have put `localllm` (here: this venv's) and the key file exists."""
    home = tmp_path / "home"
    (home / ".local" / "bin").mkdir(parents=True)
    (home / ".local" / "bin" / "localllm").symlink_to(Path(sys.executable).with_name("localllm"))
    (home / ".config" / "localllm").mkdir(parents=True)
    key = home / ".config" / "localllm" / "api-key"
    key.write_text(KEY + "\n")
    key.chmod(0o600)
    return home


def serve_and_stop(argv: list[str], env: dict[str, str], port: str) -> tuple[int, str]:
    """Start argv, check the server it starts, SIGTERM it; (exit code, its stderr if piped)."""
    p = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 90
        while True:
            assert p.poll() is None, "the server exited: " + p.stderr.read()
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, "no /health within 90 s"
            time.sleep(0.2)
        assert httpx.get(url + "/v1/models", timeout=10).status_code == 401  # the key is required
        r = httpx.get(url + "/v1/models", headers={"Authorization": f"Bearer {KEY}"}, timeout=10)
        assert r.status_code == 200, r.text
        p.send_signal(signal.SIGTERM)
        code = p.wait(15)  # the unit's TimeoutStopSec
        return code, p.stderr.read()
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()


def test_the_systemd_unit_verifies(user_home: Path, tmp_path: Path) -> None:
    analyze = shutil.which("systemd-analyze")
    if analyze is None:
        pytest.fail("systemd-analyze is not installed: apt-get install systemd", pytrace=False)
    runtime = tmp_path / "run"
    runtime.mkdir(mode=0o700)
    unit_dir = tmp_path / "units"
    unit_dir.mkdir()
    shutil.copy(UNIT, unit_dir / UNIT.name)
    env = dict(os.environ, HOME=str(user_home), XDG_RUNTIME_DIR=str(runtime))
    p = subprocess.run([analyze, "verify", "--user", str(unit_dir / UNIT.name)], capture_output=True,
                       text=True, timeout=60, env=env)  # fmt: skip
    # verify exits 0 on unknown keys and bad values too: any word from it is a finding
    assert (p.returncode, p.stderr.strip(), p.stdout.strip()) == (0, "", "")


def test_the_systemd_units_command_serves_with_the_key_and_stops_cleanly(user_home: Path, tmp_path: Path) -> None:
    service = unit_service_section()
    assert service["Restart"] == ["on-failure"] and service["StandardOutput"] == ["journal"]
    [exec_start] = service["ExecStart"]
    argv = shlex.split(exec_start.replace("%h", str(user_home)))
    assert argv[1:3] == ["serve", "--host"] and argv[3] == "127.0.0.1"  # loopback
    port = free_port()
    argv[argv.index("--port") + 1] = port
    env = {"HOME": str(user_home), "PATH": "/usr/bin:/bin", "LOCALLLM_HOME": str(tmp_path / "store")}
    env |= dict(e.split("=", 1) for e in service.get("Environment", []))
    code, err = serve_and_stop(argv, env, port)
    assert code == 0, err  # SIGTERM is a clean stop: Restart=on-failure leaves it stopped
    assert err.startswith(f"localllm http://127.0.0.1:{port} ") and "API key required" in err
    assert "Traceback" not in err
    assert not (tmp_path / "store" / "server.json").exists(), "the running-server note was left behind"


def test_without_its_key_file_the_unit_fails_in_one_line(user_home: Path, tmp_path: Path) -> None:
    (user_home / ".config" / "localllm" / "api-key").unlink()
    [exec_start] = unit_service_section()["ExecStart"]
    argv = shlex.split(exec_start.replace("%h", str(user_home)))
    p = subprocess.run(argv, capture_output=True, text=True, timeout=60,
                       env={"HOME": str(user_home), "PATH": "/usr/bin:/bin", "LOCALLLM_HOME": str(tmp_path / "s")})  # fmt: skip
    assert p.returncode == 1 and p.stderr == "error: cannot read the API key file api-key: FileNotFoundError\n"


def test_the_launchd_agent_serves_logs_to_its_file_and_stops_cleanly(user_home: Path, tmp_path: Path) -> None:
    with PLIST.open("rb") as f:
        plist = plistlib.load(f)  # an XML parse: a malformed plist fails here
    assert plist["Label"] == PLIST.stem and plist["RunAtLoad"] is True
    assert plist["KeepAlive"] == {"SuccessfulExit": False}  # restart on failure only
    argv = list(plist["ProgramArguments"])
    assert argv[:2] == ["/bin/sh", "-c"] and argv[2].count(PORT) == 1
    port = free_port()
    argv[2] = argv[2].replace(PORT, port)
    # launchd gives a user agent HOME, a minimal PATH and the plist's variables
    env = {"HOME": str(user_home), "PATH": "/usr/bin:/bin:/usr/sbin:/sbin", "LOCALLLM_HOME": str(tmp_path / "store")}
    env |= plist.get("EnvironmentVariables", {})
    code, err = serve_and_stop(argv, env, port)
    assert code == 0 and err == ""  # everything went to the log file
    log = (user_home / "Library" / "Logs" / "localllm" / "serve.log").read_text()
    assert log.startswith(f"localllm http://127.0.0.1:{port} ") and "API key required" in log
