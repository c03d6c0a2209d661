"""A small Hugging Face hub on loopback, for pulls without a network.

It answers what `huggingface_hub` and `localllm pull` ask for:
    GET  /api/models/ORG/REPO[/revision/REV]?blobs=true   model info with siblings (size, blobId, lfs.sha256)
    GET|HEAD /ORG/REPO/resolve/REV/PATH                     the bytes, with ETag, X-Repo-Commit, Range (206)
    GET  /cdn/SHA256                                        the bytes again (the target of a redirect)
and injects faults per file (`Fault`). Every request is logged with its headers. Bodies are sent
with `socket.sendfile` when no fault shapes them, so the benchmark measures the client, not us.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import socket
import struct
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote, urlsplit


@dataclass
class Fault:
    wrong_bytes: bool = False  # same size, some bytes flipped
    reset_after: int | None = None  # send this many body bytes, then reset the connection
    reset_times: int = 1  # how many responses get reset
    fail_first: int = 0  # answer HTTP 500 this many times first
    redirect_to: str | None = None  # base URL of another server: 302 to {it}/cdn/{sha256}
    rate: float | None = None  # bytes per second
    ignore_range: bool = False


@dataclass
class HubFile:
    path: Path  # where the bytes are on disk
    size: int
    sha256: str
    git_oid: str
    lfs: bool = True


@dataclass
class Request:
    method: str
    path: str
    headers: dict[str, str]
    raw: str = ""  # the request target as sent: `http://host/...` when it came through a proxy


@dataclass
class Repo:
    commit: str
    files: dict[str, HubFile] = field(default_factory=dict)
    extra_siblings: list[dict] = field(default_factory=list)  # raw, possibly hostile entries


def file_digests(path: Path) -> tuple[str, str, int]:
    data = path.read_bytes()
    oid = hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()
    return hashlib.sha256(data).hexdigest(), oid, len(data)


class FakeHub:
    def __init__(self) -> None:
        self.repos: dict[str, Repo] = {}
        self.by_sha: dict[str, HubFile] = {}
        self.faults: dict[str, Fault] = {}  # by file path in the repo, or by sha256 for /cdn/
        self.requests: list[Request] = []
        self._lock = threading.Lock()
        self.server = _QuietServer(("127.0.0.1", 0), _handler(self))
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self._thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self) -> FakeHub:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.shutdown()
        self.server.server_close()

    def add(self, repo: str, name: str, path: Path, *, lfs: bool = True) -> HubFile:
        sha, oid, size = file_digests(path)
        f = HubFile(path, size, sha, oid, lfs)
        r = self.repos.setdefault(repo, Repo(hashlib.sha1(repo.encode()).hexdigest()))
        r.files[name] = f
        self.by_sha[sha] = f
        return f

    def new_commit(self, repo: str) -> str:
        r = self.repos[repo]
        r.commit = hashlib.sha1(r.commit.encode()).hexdigest()
        return r.commit

    def log(self, req: Request) -> None:
        with self._lock:
            self.requests.append(req)

    def downloads(self, name: str = "") -> list[Request]:
        """GET requests for file bytes (resolve/ or cdn/), optionally of one file name."""
        return [r for r in self.requests if r.method == "GET" and ("/resolve/" in r.path or
                r.path.startswith("/cdn/")) and r.path.endswith(name)]  # fmt: skip


class _QuietServer(ThreadingHTTPServer):
    def handle_error(self, request: object, client_address: object) -> None:
        pass  # a client that hangs up mid-body (cancel, kill) is what the tests do on purpose


def _handler(hub: FakeHub) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args: object) -> None:
            pass

        def do_HEAD(self) -> None:
            self._serve(head=True)

        def do_GET(self) -> None:
            self._serve(head=False)

        def _json(self, code: int, data: object, error_code: str | None = None) -> None:
            body = json.dumps(data).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            if error_code:
                self.send_header("X-Error-Code", error_code)
                self.send_header("X-Error-Message", error_code)
            self.end_headers()
            self.wfile.write(body)

        def _serve(self, head: bool) -> None:
            url = urlsplit(self.path)
            path = unquote(url.path)
            headers = {k.lower(): v for k, v in self.headers.items()}
            hub.log(Request(self.command, path, headers, raw=self.path))
            parts = path.strip("/").split("/")
            if parts[:2] == ["api", "models"] and len(parts) >= 4:
                return self._model_info(parts[2:])
            if parts[0] == "cdn" and len(parts) == 2:
                f = hub.by_sha.get(parts[1])
                if f is None:
                    return self._json(404, {"error": "no such blob"})
                return self._file(f, hub.faults.get(parts[1], Fault()), None, head)
            if len(parts) >= 5 and parts[2] == "resolve":
                repo = hub.repos.get("/".join(parts[:2]))
                if repo is None:
                    return self._json(404, {"error": "repo"}, "RepoNotFound")
                if parts[3] not in (repo.commit, "main"):
                    return self._json(404, {"error": "revision"}, "RevisionNotFound")
                name = "/".join(parts[4:])
                f = repo.files.get(name)
                if f is None:
                    return self._json(404, {"error": "entry"}, "EntryNotFound")
                return self._file(f, hub.faults.get(name, Fault()), repo.commit, head)
            return self._json(404, {"error": "not found"})

        def _model_info(self, parts: list[str]) -> None:
            repo_id = "/".join(parts[:2])
            repo = hub.repos.get(repo_id)
            if repo is None:
                return self._json(404, {"error": "Repository not found"}, "RepoNotFound")
            if len(parts) >= 4 and parts[2] == "revision" and parts[3] not in ("main", repo.commit):
                return self._json(404, {"error": "Invalid rev id"}, "RevisionNotFound")
            siblings = []
            for name, f in repo.files.items():
                s = {"rfilename": name, "size": f.size, "blobId": f.git_oid}
                if f.lfs:
                    s["lfs"] = {"sha256": f.sha256, "size": f.size, "pointerSize": 134}
                siblings.append(s)
            siblings += repo.extra_siblings
            self._json(200, {"_id": repo.commit[:24], "id": repo_id, "modelId": repo_id,
                             "sha": repo.commit, "private": False, "siblings": siblings})  # fmt: skip

        def _file(self, f: HubFile, fault: Fault, commit: str | None, head: bool) -> None:
            if fault.fail_first > 0 and not head:
                fault.fail_first -= 1
                return self._json(500, {"error": "Internal Error"})
            if fault.redirect_to and not head:
                self.send_response(302)
                self.send_header("Location", f"{fault.redirect_to}/cdn/{f.sha256}?sig=abc")
                self.send_header("Content-Length", "0")
                self.end_headers()
                return
            start, end = 0, f.size - 1
            rng = self.headers.get("Range")
            partial = False
            if rng and not fault.ignore_range:
                spec = rng.removeprefix("bytes=")
                a, _, b = spec.partition("-")
                start = int(a)
                end = int(b) if b else f.size - 1
                if start >= f.size:
                    self.send_response(416)
                    self.send_header("Content-Range", f"bytes */{f.size}")
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                    return
                partial = True
            self.send_response(206 if partial else 200)
            self.send_header("Content-Length", str(end - start + 1))
            self.send_header("Accept-Ranges", "bytes")
            self.send_header("ETag", f'"{f.sha256}"')
            if f.lfs:
                self.send_header("X-Linked-Etag", f'"{f.sha256}"')
                self.send_header("X-Linked-Size", str(f.size))
            if commit:
                self.send_header("X-Repo-Commit", commit)
            if partial:
                self.send_header("Content-Range", f"bytes {start}-{end}/{f.size}")
            self.end_headers()
            if head:
                return
            count = end - start + 1
            plain = not (fault.wrong_bytes or fault.reset_after is not None or fault.rate)
            with open(f.path, "rb") as fh:
                if plain:
                    self.wfile.flush()
                    self.connection.sendfile(fh, start, count)
                    return
                fh.seek(start)
                sent = 0
                step = 64 << 10
                t0 = time.monotonic()
                while sent < count:
                    data = bytearray(fh.read(min(step, count - sent)))
                    if fault.wrong_bytes:
                        for i in range(0, len(data), 4096):
                            data[i] ^= 0xFF
                    if (
                        fault.reset_after is not None
                        and fault.reset_times > 0
                        and start + sent + len(data) > fault.reset_after
                    ):
                        cut = max(0, fault.reset_after - start - sent)
                        self.wfile.write(data[:cut])
                        self.wfile.flush()
                        fault.reset_times -= 1
                        time.sleep(0.3)  # let the client read what was sent, then drop the line
                        return self._reset()
                    self.wfile.write(data)
                    sent += len(data)
                    if fault.rate:
                        ahead = sent / fault.rate - (time.monotonic() - t0)
                        if ahead > 0:
                            time.sleep(ahead)

        def _reset(self) -> None:
            """Close with RST (SO_LINGER 0), as a dropped connection looks to the client."""
            self.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            self.close_connection = True
            self.connection.close()

        def finish(self) -> None:
            with contextlib.suppress(OSError):
                super().finish()

    return Handler
