"""`localllm serve` as a user runs it: it loads, says where it listens, answers, `localllm ps` finds
it without being told where, Ctrl-C stops it cleanly (exit 130, as any interrupted command); a port in use is one line."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx


def _default_sigint() -> None:
    signal.signal(signal.SIGINT, signal.SIG_DFL)  # whatever the test runner's disposition was


def test_serve_answers_ps_finds_it_and_ctrl_c_stops_it(localllm_home: Path, default_model_path: Path) -> None:
    env = dict(os.environ, LOCALLLM_HOME=str(localllm_home))
    p = subprocess.Popen([sys.executable, "-m", "localllm", "serve", "--port", "0", "--model", "smollm2",
                          "--backend", "llama.cpp", "--ctx", "1024", "--parallel", "2"],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                         preexec_fn=_default_sigint)  # fmt: skip
    try:
        line = p.stderr.readline()
        assert line.startswith("localllm http://127.0.0.1:"), line
        url = line.split()[1]
        assert httpx.get(url + "/health").json() == {"status": "ok"}
        r = httpx.post(url + "/v1/chat/completions", timeout=60,
                       json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4})  # fmt: skip
        assert r.status_code == 200 and r.json()["model"] == "smollm2:135m-instruct-q4_1"
        ps = subprocess.run([sys.executable, "-m", "localllm", "ps", "--json"], capture_output=True, text=True,
                            env=env, timeout=60)  # fmt: skip
        assert ps.returncode == 0, ps.stderr
        data = json.loads(ps.stdout)
        assert data["url"] == url and data["models"][0]["localllm"]["parallel"] == 2
        assert (localllm_home / "server.json").exists()
        p.send_signal(signal.SIGINT)
        assert p.wait(30) == 130  # PRODUCT.md: interrupted
        assert not (localllm_home / "server.json").exists()
        rest = p.stderr.read()
        assert "Traceback" not in rest and rest.strip().endswith("interrupted")
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()


def test_a_port_in_use_is_one_line(localllm_home: Path) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen(1)
        port = s.getsockname()[1]
        t0 = time.monotonic()
        r = subprocess.run([sys.executable, "-m", "localllm", "serve", "--port", str(port)], capture_output=True,
                           text=True, timeout=60, env=dict(os.environ, LOCALLLM_HOME=str(localllm_home)))  # fmt: skip
    assert r.returncode == 1 and r.stderr.strip() == f"error: cannot listen on 127.0.0.1:{port}: the port is in use"
    assert time.monotonic() - t0 < 60
