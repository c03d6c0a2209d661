"""Safe by default: bind, key, Host header, CORS, body cap, malformed requests — and alive after."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time

import httpx
import pytest
from servers import fake_server

from localllm.errors import LocalLLMError
from localllm.server.config import DEFAULT_HOST, DEFAULT_PORT, ServerConfig, read_api_key

CHAT = {"model": "fake", "messages": [{"role": "user", "content": "say:hello"}]}


def alive(url: str, **headers: str) -> None:
    r = httpx.post(url + "/v1/chat/completions", json=CHAT, headers=headers, timeout=10)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["message"]["content"] == "hello"


def openai_error(r: httpx.Response, status: int) -> dict:
    assert r.status_code == status, r.text
    body = r.json()
    assert set(body) == {"error"} and {"message", "type", "param", "code"} <= set(body["error"])
    assert "Traceback" not in r.text and "/tmp" not in r.text and "/home" not in r.text
    return body["error"]


def test_defaults_bind_loopback_on_the_product_port() -> None:
    c = ServerConfig()
    assert (c.host, c.port) == (DEFAULT_HOST, DEFAULT_PORT) == ("127.0.0.1", 11435)
    assert c.loopback and c.api_key is None and c.cors == ()


@pytest.mark.parametrize("host", ["0.0.0.0", "::", "192.168.1.10", "example.org"])
def test_a_non_loopback_bind_needs_a_key(host: str) -> None:
    with pytest.raises(LocalLLMError, match="without an API key"):
        ServerConfig(host=host)
    assert not ServerConfig(host=host, api_key="k").loopback


def test_serve_on_all_interfaces_without_a_key_refuses_to_start(localllm_home) -> None:
    env = {"LOCALLLM_HOME": str(localllm_home), "PATH": "/usr/bin:/bin"}
    r = subprocess.run([sys.executable, "-m", "localllm", "serve", "--host", "0.0.0.0", "--port", "0"],
                       capture_output=True, text=True, timeout=60, env=env)  # fmt: skip
    assert r.returncode == 1
    assert r.stderr.count("\n") == 1 and "without an API key" in r.stderr and "Traceback" not in r.stderr


def test_api_key_sources(tmp_path, monkeypatch) -> None:
    f = tmp_path / "key"
    f.write_text("s3cret\n")
    assert read_api_key(None, f) == "s3cret"
    assert read_api_key("a", None) == "a"
    monkeypatch.setenv("LOCALLLM_API_KEY", "from-env")
    assert read_api_key(None, None) == "from-env"
    with pytest.raises(LocalLLMError, match="not both"):
        read_api_key("a", f)
    (tmp_path / "empty").write_text("\n")
    with pytest.raises(LocalLLMError, match="empty"):
        read_api_key(None, tmp_path / "empty")


def test_the_key_is_required_everywhere_but_health_and_root() -> None:
    with fake_server(api_key="s3cret") as s:
        assert httpx.get(s.url + "/health").status_code == 200
        for path in ("/v1/models", "/metrics"):
            err = openai_error(httpx.get(s.url + path), 401)
            assert err["code"] == "missing_api_key"
        for path in ("/api/tags", "/api/ps"):  # Ollama's routes, Ollama's shape
            r = httpx.get(s.url + path)
            assert r.status_code == 401 and r.json() == {"error": r.json()["error"]}
            assert "API key is required" in r.json()["error"]
        assert httpx.get(s.url + "/").status_code == 200  # Ollama clients' "is it up"
        r = httpx.post(s.url + "/v1/chat/completions", json=CHAT, headers={"Authorization": "Bearer nope"})
        assert openai_error(r, 401)["code"] == "invalid_api_key"
        r = httpx.get(s.url + "/v1/models", headers={"x-api-key": "s3cret-but-longer"})
        openai_error(r, 401)
        alive(s.url, Authorization="Bearer s3cret")
        alive(s.url, **{"x-api-key": "s3cret"})


def test_foreign_host_headers_are_refused_on_loopback() -> None:
    with fake_server() as s:
        for host in ("evil.example", "evil.example:11435", "127.0.0.1.evil.example", ""):
            r = httpx.get(s.url + "/v1/models", headers={"Host": host})
            assert openai_error(r, 403)["code"] == "host_not_allowed", host
        for host in ("localhost", "127.0.0.1:11435", "[::1]:80", "localhost:8080"):
            assert httpx.get(s.url + "/v1/models", headers={"Host": host}).status_code == 200, host
        alive(s.url)


def test_any_host_is_fine_when_not_on_loopback_but_the_key_is_needed() -> None:
    with fake_server(host="0.0.0.0", api_key="k") as s:
        url = s.url.replace("0.0.0.0", "127.0.0.1")
        r = httpx.get(url + "/v1/models", headers={"Host": "my-box.lan", "Authorization": "Bearer k"})
        assert r.status_code == 200


PREFLIGHT = {"Origin": "https://evil.example", "Access-Control-Request-Method": "POST",
             "Access-Control-Request-Headers": "content-type"}  # fmt: skip


def test_no_cors_headers_by_default() -> None:
    with fake_server() as s:
        r = httpx.options(s.url + "/v1/chat/completions", headers=PREFLIGHT)
        assert not any(k.lower().startswith("access-control-") for k in r.headers)
        r = httpx.post(s.url + "/v1/chat/completions", json=CHAT, headers={"Origin": "https://evil.example"})
        assert r.status_code == 200 and "access-control-allow-origin" not in r.headers


def test_cors_only_for_the_origins_named() -> None:
    with fake_server(cors=("http://localhost:3000",)) as s:
        r = httpx.options(s.url + "/v1/chat/completions", headers=PREFLIGHT)
        assert "access-control-allow-origin" not in r.headers
        ok = dict(PREFLIGHT, Origin="http://localhost:3000")
        r = httpx.options(s.url + "/v1/chat/completions", headers=ok)
        assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "http://localhost:3000"


def _raw(url: str, head: str, body: bytes = b"", chunks: list[bytes] | None = None) -> bytes:
    host, port = url.removeprefix("http://").rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=30) as sock:
        sock.sendall(head.encode() + body)
        try:
            for c in chunks or []:
                sock.sendall(f"{len(c):x}\r\n".encode() + c + b"\r\n")
        except OSError:
            pass  # the server answered and closed before the whole body went
        out = b""
        while not out.endswith(b"}") and len(out) < 100000:
            piece = sock.recv(65536)
            if not piece:
                break
            out += piece
    return out


def test_a_100_mb_body_is_413_at_once() -> None:
    with fake_server() as s:
        t0 = time.monotonic()
        head = (f"POST /v1/chat/completions HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
                f"Content-Length: {100 * 1024 * 1024}\r\n\r\n")  # fmt: skip
        out = _raw(s.url, head, b'{"model": "fake", "messages": [')
        assert out.startswith(b"HTTP/1.1 413"), out[:200]
        assert b"request_too_large" in out
        assert time.monotonic() - t0 < 20  # answered without reading 100 MB
        alive(s.url)


def test_a_chunked_body_over_the_cap_is_413() -> None:
    with fake_server(max_body=4096) as s:
        head = ("POST /v1/chat/completions HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
                "Transfer-Encoding: chunked\r\n\r\n")  # fmt: skip
        out = _raw(s.url, head, chunks=[b"x" * 3000, b"x" * 3000, b""])
        assert out.startswith(b"HTTP/1.1 413"), out[:200]
        alive(s.url)


BAD = [
    (b"{not json", "not valid JSON"),
    (b"[1, 2]", "JSON object"),
    (json.dumps({"messages": "hi"}).encode(), "messages"),
    (json.dumps({"messages": []}).encode(), "messages"),
    (json.dumps({"messages": [{"role": "wizard", "content": "x"}]}).encode(), "role"),
    (json.dumps({"messages": [{"role": "user", "content": 5}]}).encode(), "content"),
    (json.dumps(CHAT | {"temperature": "hot"}).encode(), "temperature"),
    (json.dumps(CHAT | {"temperature": 7}).encode(), "temperature"),
    (json.dumps(CHAT | {"max_tokens": -1}).encode(), "max_tokens"),
    (json.dumps(CHAT | {"max_tokens": 1.5}).encode(), "max_tokens"),
    (json.dumps(CHAT | {"stream": "yes"}).encode(), "stream"),
    (json.dumps(CHAT | {"stop": [1, 2]}).encode(), "stop"),
    (json.dumps(CHAT | {"n": 2}).encode(), "n must be 1"),
    (json.dumps(CHAT | {"logit_bias": {"1": 5}}).encode(), "logit_bias"),
    (json.dumps(CHAT | {"tool_choice": "required"}).encode(), "tools"),
    (json.dumps(CHAT | {"response_format": {"type": "yaml"}}).encode(), "response_format"),
    (json.dumps(CHAT | {"kv_cache": "q3_weird"}).encode(), "KV cache"),
    (json.dumps(CHAT | {"max_tokens": 10**9}).encode(), "exceeds the context"),
    (json.dumps(CHAT | {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}).encode(),
     "image_url must be a base64 image or a data: URL"),
    (json.dumps(CHAT | {"messages": [{"role": "user", "content": [{"type": "input_audio"}]}]}).encode(),
     "'input_audio' parts are not supported"),
]


def test_malformed_requests_are_400_fast_and_the_server_lives() -> None:
    with fake_server() as s, httpx.Client(base_url=s.url, timeout=10) as c:
        for body, said in BAD:
            r = c.post("/v1/chat/completions", content=body, headers={"content-type": "application/json"})
            err = openai_error(r, 400)
            assert said.lower() in err["message"].lower(), (body, err)
        r = c.post("/v1/completions", json={"model": "fake", "prompt": 12})
        assert "prompt" in openai_error(r, 400)["message"]
        r = c.post("/v1/chat/completions", json=CHAT | {"model": "no-such-model"})
        assert openai_error(r, 404)["code"] == "model_not_found"
        assert openai_error(c.get("/v1/nothing-here"), 404)["type"] == "not_found_error"
        # no download or deletion over HTTP: refused by name, in Ollama's shape
        r = c.post("/api/pull", json={"model": "x"})
        assert r.status_code == 400 and "localllm pull" in r.json()["error"]
        r = c.request("DELETE", "/api/delete", json={"model": "x"})
        assert r.status_code == 400 and "localllm rm" in r.json()["error"]
        alive(s.url)


def test_errors_name_no_local_paths() -> None:
    from localllm.server.app import scrub

    said = scrub("cannot read /home/alice/.local/share/localllm/blobs/sha256-ab: broken\nsecond line")
    assert said == "cannot read sha256-ab: broken"
    assert scrub(r"bad file C:\Users\bob\models\x.gguf") == "bad file x.gguf"


def test_the_grafana_dashboard_reads_metrics_the_server_has() -> None:
    import re
    from pathlib import Path

    dash = json.loads((Path(__file__).parents[2] / "packaging" / "grafana" / "localllm-dashboard.json").read_text())
    exprs = [t["expr"] for p in dash["panels"] for t in p["targets"]]
    names = {re.sub(r"_(bucket|sum|count)$", "", n) for e in exprs for n in re.findall(r"localllm_[a-z_]+", e)}
    assert len(names) >= 10
    with fake_server() as s:
        alive(s.url)
        text = httpx.get(s.url + "/metrics").text
    have = set(re.findall(r"^# TYPE (localllm_[a-z_]+)", text, re.M))
    have |= {n.removesuffix("_created") for n in have} | {n + "_total" for n in have}
    assert names <= have, names - have
