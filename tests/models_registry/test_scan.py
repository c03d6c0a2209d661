"""Scanning other tools' model folders and registering what is there by reference."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path

import pytest

from localllm.errors import StoreError
from localllm.gguf_file import GGUFFile
from localllm.models_registry import scan as scan_mod
from localllm.models_registry import store as store_mod
from localllm.models_registry.scan import ScanRoots, register_found, scan
from localllm.models_registry.store import Store

COMMIT_MAIN = "a" * 40
COMMIT_OLD = "b" * 40


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def other_bytes(src: Path, dst: Path) -> Path:
    """A copy of `src` with its last tensor byte changed: still a valid GGUF, another sha256."""
    data = bytearray(src.read_bytes())
    data[-1] ^= 0x01
    dst.parent.mkdir(parents=True, exist_ok=True)
    dst.write_bytes(bytes(data))
    return dst


def truncated(src: Path, dst: Path) -> Path:
    dst.parent.mkdir(parents=True, exist_ok=True)
    dst.write_bytes(src.read_bytes()[: src.stat().st_size // 2])
    return dst


def make_hf(
    root: Path,
    org: str,
    repo: str,
    src: Path,
    filename: str,
    *,
    commit: str = COMMIT_MAIN,
    main: str | None = COMMIT_MAIN,
) -> Path:
    """The hub cache layout: the bytes in blobs/<sha256>, a relative symlink in the snapshot."""
    repo_dir = root / f"models--{org}--{repo}"
    digest = sha256(src)
    blob = repo_dir / "blobs" / digest
    blob.parent.mkdir(parents=True, exist_ok=True)
    if not blob.exists():
        shutil.copyfile(src, blob)
    link = repo_dir / "snapshots" / commit / filename
    link.parent.mkdir(parents=True, exist_ok=True)
    link.symlink_to(os.path.relpath(blob, link.parent))
    if main is not None:
        (repo_dir / "refs").mkdir(exist_ok=True)
        (repo_dir / "refs" / "main").write_text(main)
    return link


def write_manifest(root: Path, name: tuple[str, str, str, str], content: bytes | dict) -> Path:
    path = root / "manifests" / Path(*name)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(content if isinstance(content, bytes) else json.dumps(content).encode())
    return path


def model_manifest(digest: str, size: int) -> dict:
    return {
        "schemaVersion": 2,
        "mediaType": "application/vnd.docker.distribution.manifest.v2+json",
        "config": {"mediaType": "application/vnd.docker.container.image.v1+json",
                   "digest": "sha256:" + "c" * 64, "size": 10},
        "layers": [
            {"mediaType": "application/vnd.ollama.image.model", "digest": digest, "size": size},
            {"mediaType": "application/vnd.ollama.image.template",
             "digest": "sha256:" + "d" * 64, "size": 5},
        ],
    }  # fmt: skip


def make_ollama(
    root: Path,
    src: Path,
    name: tuple[str, str, str, str] = ("registry.ollama.ai", "library", "tinyllama", "1b"),
) -> Path:
    """Ollama's layout: blobs/sha256-<hex> and a docker-style manifest naming it."""
    digest = sha256(src)
    blob = root / "blobs" / f"sha256-{digest}"
    blob.parent.mkdir(parents=True, exist_ok=True)
    if not blob.exists():
        shutil.copyfile(src, blob)
    write_manifest(root, name, model_manifest(f"sha256:{digest}", blob.stat().st_size))
    return blob


def make_lmstudio(root: Path, src: Path, rel: str) -> Path:
    path = root / rel
    path.parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(src, path)
    return path


def roots(tmp_path: Path, **over: tuple[Path, ...]) -> ScanRoots:
    """Roots inside tmp_path only, so no test ever looks at the real machine's folders."""
    base = {
        "huggingface": (tmp_path / "hf",),
        "ollama": (tmp_path / "ollama",),
        "lmstudio": (tmp_path / "lms",),
    }
    return ScanRoots(**(base | over))


@pytest.fixture
def three_tools(tmp_path: Path, tiny_llama: Path) -> dict[str, Path]:
    return {
        "huggingface": make_hf(tmp_path / "hf", "org", "Tiny-GGUF", tiny_llama, "tiny-f16.gguf"),
        "ollama": make_ollama(tmp_path / "ollama", tiny_llama),
        "lmstudio": make_lmstudio(
            tmp_path / "lms", tiny_llama, "publisher/Tiny-Llama-GGUF/Tiny-Llama-F16.gguf"
        ),
    }


def test_each_tool_is_found_and_registered_by_reference(
    tmp_path: Path, tiny_llama: Path, three_tools: dict[str, Path]
) -> None:
    found = scan(roots(tmp_path))
    assert [(f.origin, f.suggested_name, f.skipped) for f in found] == [
        ("huggingface", "hf.co/org/Tiny-GGUF/tiny-f16.gguf", None),
        ("ollama", "tinyllama:1b", None),
        ("lmstudio", "publisher/tiny-llama:f16", None),
    ]
    # the tools that name files by sha256 are trusted for it; LM Studio files are hashed later
    assert [f.digest for f in found] == [sha256(tiny_llama), sha256(tiny_llama), None]

    store = Store()
    results = register_found(store, found)
    assert [(r.status, r.name) for r in results] == [
        ("registered", "hf.co/org/Tiny-GGUF/tiny-f16.gguf:latest"),
        ("registered", "tinyllama:1b"),
        ("registered", "publisher/tiny-llama:f16"),
    ]
    assert list(store.blobs.iterdir()) == []  # nothing copied or linked into the store
    by_origin = {r.source.split(":", 1)[0]: r for r in store.list()}
    assert set(by_origin) == {"huggingface", "ollama", "lmstudio"}
    for origin, original in three_tools.items():
        record = by_origin[origin]
        assert store.path_of(record) == Path(os.path.realpath(original))
        assert record.ref == os.path.realpath(original)
        assert record.digest == sha256(tiny_llama) and record.size == tiny_llama.stat().st_size
        assert record.info.architecture == "llama"
    # the HF snapshot entry is a symlink: the reference is the blob it points at
    assert Path(by_origin["huggingface"].ref).parent.name == "blobs"
    assert json.loads(json.dumps(results[0].to_dict())) == {
        "status": "registered",
        "name": "hf.co/org/Tiny-GGUF/tiny-f16.gguf:latest",
        "path": str(three_tools["huggingface"]),
        "origin": "huggingface",
        "reason": "",
    }


def test_known_digests_are_not_hashed(
    tmp_path: Path, tiny_llama: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    make_hf(tmp_path / "hf", "org", "Tiny-GGUF", tiny_llama, "tiny.gguf")
    make_ollama(tmp_path / "ollama", tiny_llama)

    def no_hashing(path: Path) -> str:
        raise AssertionError(f"hashed {path}")

    monkeypatch.setattr(store_mod, "sha256_file", no_hashing)
    results = register_found(Store(), scan(roots(tmp_path)))
    assert [r.status for r in results] == ["registered", "registered"]


def test_rm_leaves_the_other_tools_files_alone(
    tmp_path: Path, three_tools: dict[str, Path]
) -> None:
    before = {p: (p.read_bytes(), os.stat(p).st_mtime_ns) for p in three_tools.values()}
    store = Store()
    register_found(store, scan(roots(tmp_path)))
    assert len(store.list()) == 3
    for record in store.list():
        store.remove(record.name)
    store.gc()
    assert store.list() == []
    for p, (data, mtime) in before.items():
        assert p.read_bytes() == data and os.stat(p).st_mtime_ns == mtime
    # and the tool's other files (Ollama's manifest, HF's refs) are untouched too
    assert (tmp_path / "ollama/manifests/registry.ollama.ai/library/tinyllama/1b").is_file()
    assert (tmp_path / "hf/models--org--Tiny-GGUF/refs/main").read_text() == COMMIT_MAIN


def test_scanning_twice_registers_nothing_new(tmp_path: Path, three_tools: dict[str, Path]) -> None:
    store = Store()
    first = register_found(store, scan(roots(tmp_path)))
    assert {r.status for r in first} == {"registered"}
    index = store.index_path.read_bytes()
    second = register_found(store, scan(roots(tmp_path)))
    assert [(r.status, r.name) for r in second] == [("already", r.name) for r in first]
    assert store.index_path.read_bytes() == index


def test_missing_roots_give_nothing(tmp_path: Path) -> None:
    nowhere = ScanRoots(
        huggingface=(tmp_path / "no-hf",),
        ollama=(tmp_path / "no-ollama", tmp_path / "a-file"),
        lmstudio=(tmp_path / "no-lms",),
    )
    (tmp_path / "a-file").write_text("not a folder")
    assert scan(nowhere) == []
    assert register_found(Store(), []) == []
    assert scan(ScanRoots(huggingface=(), ollama=(), lmstudio=())) == []


@pytest.mark.parametrize(
    "digest",
    [
        "sha256:../../etc/passwd",
        "sha256:../../../outside.gguf",
        "../outside.gguf",
        "sha256:" + "A" * 64,  # upper case: not how Ollama writes digests
        "sha512:" + "0" * 64,
        "0" * 64,  # no `sha256:` prefix
        "sha256:" + "0" * 63 + "/",
        123,
        None,
    ],
)
def test_ollama_hostile_digest_is_skipped_and_nothing_outside_is_read(
    digest: object, tmp_path: Path, tiny_llama: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    root = tmp_path / "ollama"
    (root / "blobs").mkdir(parents=True)
    shutil.copyfile(tiny_llama, tmp_path / "outside.gguf")  # what a traversal would reach
    write_manifest(
        root, ("registry.ollama.ai", "library", "evil", "latest"), model_manifest(digest, 10)
    )
    read: list[str] = []
    real_read = scan_mod.read_checked_info
    monkeypatch.setattr(scan_mod, "read_checked_info", lambda p: read.append(p) or real_read(p))
    found = scan(roots(tmp_path))
    assert len(found) == 1 and "bad model digest" in found[0].skipped
    assert read == []
    results = register_found(Store(), found)
    assert [r.status for r in results] == ["skipped"]
    assert Store().list() == []


def test_ollama_blob_symlinked_outside_is_skipped(tmp_path: Path, tiny_llama: Path) -> None:
    root = tmp_path / "ollama"
    outside = shutil.copyfile(tiny_llama, tmp_path / "outside.gguf")
    digest = sha256(tiny_llama)
    (root / "blobs").mkdir(parents=True)
    (root / "blobs" / f"sha256-{digest}").symlink_to(outside)
    write_manifest(
        root,
        ("registry.ollama.ai", "library", "evil", "latest"),
        model_manifest(f"sha256:{digest}", outside.stat().st_size),
    )
    found = scan(roots(tmp_path))
    assert [f.skipped for f in found] == ["model blob resolves outside the blobs folder"]
    assert [r.status for r in register_found(Store(), found)] == ["skipped"]


def test_bad_ollama_manifests_are_skipped_not_fatal(tmp_path: Path, tiny_llama: Path) -> None:
    root = tmp_path / "ollama"
    blob = make_ollama(root, tiny_llama)  # one good model beside the bad manifests
    digest = "sha256:" + blob.name[7:]
    size = blob.stat().st_size
    host = "registry.ollama.ai"
    bad = {
        "huge": b'{"layers": []' + b" " * (1 << 20) + b"}",
        "notjson": b"\x00\xff not json",
        "list": b"[1, 2, 3]",
        "nolayers": json.dumps({"layers": "nope"}).encode(),
        "nomodel": json.dumps({"layers": [{"mediaType": "x", "digest": digest}]}).encode(),
        "missing": json.dumps(model_manifest("sha256:" + "e" * 64, 1)).encode(),
        "wrongsize": json.dumps(model_manifest(digest, size + 1)).encode(),
        "deep": b"[" * 100_000,
    }
    for tag, content in bad.items():
        write_manifest(root, (host, "library", "bad", tag), content)
    found = scan(roots(tmp_path))
    reasons = {f.suggested_name: f.skipped for f in found}
    assert reasons.pop("tinyllama:1b") is None
    assert set(reasons) == {f"bad:{tag}" for tag in bad}
    assert "too large" in reasons["bad:huge"]
    assert "not JSON" in reasons["bad:notjson"] and "not JSON" in reasons["bad:deep"]
    assert "malformed" in reasons["bad:list"] and "malformed" in reasons["bad:nolayers"]
    assert "no model layer" in reasons["bad:nomodel"]
    assert "missing" in reasons["bad:missing"]
    assert "manifest says" in reasons["bad:wrongsize"]
    results = register_found(Store(), found)
    assert [r.name for r in results if r.status == "registered"] == ["tinyllama:1b"]
    assert all("\n" not in r.reason and r.reason for r in results if r.status == "skipped")


def test_ollama_names(tmp_path: Path, tiny_llama: Path) -> None:
    root = tmp_path / "ollama"
    for name in [
        ("registry.ollama.ai", "library", "llama3.2", "3b"),
        ("registry.ollama.ai", "library", "llama3.2", "latest"),
        ("registry.ollama.ai", "someone", "Model", "Q4"),
        ("hf.co", "bartowski", "Llama-3.2-1B-Instruct-GGUF", "q4_k_m"),
        ("my.registry:5000", "team", "thing", "v1"),
    ]:
        make_ollama(root, tiny_llama, name)
    found = scan(roots(tmp_path))
    assert [f.suggested_name for f in found] == [
        "hf.co/bartowski/Llama-3.2-1B-Instruct-GGUF:Q4_K_M",
        "thing:v1",
        "llama3.2:3b",
        "llama3.2:latest",
        "someone/model:q4",
    ]
    store = Store()
    results = register_found(store, found)
    assert all(r.status == "registered" for r in results)  # tags of one blob become aliases
    assert len({store.path_of(r) for r in store.list()}) == 1
    assert list(store.blobs.iterdir()) == []


@pytest.mark.parametrize("origin", ["huggingface", "ollama", "lmstudio"])
def test_corrupt_gguf_is_skipped_with_a_reason(
    origin: str, tmp_path: Path, tiny_llama: Path
) -> None:
    bad = truncated(tiny_llama, tmp_path / "src" / "cut.gguf")
    if origin == "huggingface":
        make_hf(tmp_path / "hf", "org", "Repo", bad, "cut.gguf")
    elif origin == "ollama":
        make_ollama(tmp_path / "ollama", bad)
    else:
        make_lmstudio(tmp_path / "lms", bad, "pub/repo/cut.gguf")
    found = scan(roots(tmp_path))
    assert len(found) == 1 and found[0].origin == origin
    assert found[0].skipped.startswith("not a valid GGUF file: ")
    assert "\n" not in found[0].skipped
    results = register_found(Store(), found)
    assert [(r.status, r.reason) for r in results] == [("skipped", found[0].skipped)]
    assert Store().list() == []


def test_a_file_that_turns_bad_after_the_scan_is_skipped(tmp_path: Path, tiny_llama: Path) -> None:
    path = make_lmstudio(tmp_path / "lms", tiny_llama, "pub/repo/m.gguf")
    found = scan(roots(tmp_path))
    assert found[0].ok
    truncated(tiny_llama, path)
    results = register_found(Store(), found)
    assert results[0].status == "skipped" and "not a valid GGUF" in results[0].reason
    assert Store().list() == []


def test_referenced_file_that_vanishes_or_changes(tmp_path: Path, tiny_llama: Path) -> None:
    changed = make_lmstudio(tmp_path / "lms", tiny_llama, "pub/one/m-F16.gguf")
    gone = make_lmstudio(tmp_path / "lms", tiny_llama, "pub/two/m-F16.gguf")
    store = Store()
    assert {r.status for r in register_found(store, scan(roots(tmp_path)))} == {"registered"}
    other_bytes(tiny_llama, changed)  # same size, new bytes, new mtime
    os.utime(changed, ns=(0, os.stat(changed).st_mtime_ns + 1_000_000))
    gone.unlink()
    one, two = store.get("pub/one:f16"), store.get("pub/two:f16")
    with pytest.raises(StoreError) as e:
        store.path_of(one)
    msg = str(e.value)
    assert "\n" not in msg and "changed since it was imported" in msg
    assert str(changed) in msg and "localllm rm pub/one:f16" in msg
    with pytest.raises(StoreError, match=r"which is gone; `localllm rm pub/two:f16`"):
        store.path_of(two)
    # a later scan registers the changed file again under its name
    results = register_found(store, scan(roots(tmp_path)))
    assert [(r.status, r.name) for r in results] == [("registered", "pub/one:f16")]
    assert "changed" in results[0].reason
    assert store.path_of(store.get("pub/one:f16")) == changed
    assert store.get("pub/one:f16").digest == sha256(changed)


def test_name_taken_by_another_model_gets_a_variant(tmp_path: Path, tiny_llama: Path) -> None:
    store = Store()
    store.add_file(other_bytes(tiny_llama, tmp_path / "x" / "other.gguf"), "tinyllama:1b",
                   source="file:x")  # fmt: skip
    make_ollama(tmp_path / "ollama", tiny_llama)
    results = register_found(store, scan(roots(tmp_path)))
    assert [(r.status, r.name) for r in results] == [("registered", "tinyllama:1b-2")]
    assert store.get("tinyllama:1b").ref is None  # the existing model is untouched
    again = register_found(store, scan(roots(tmp_path)))
    assert [(r.status, r.name) for r in again] == [("already", "tinyllama:1b-2")]


def test_same_bytes_already_in_the_store_is_already(tmp_path: Path, tiny_llama: Path) -> None:
    store = Store()
    store.add_file(tiny_llama, "tinyllama:1b", source="file:x")
    make_ollama(tmp_path / "ollama", tiny_llama)
    results = register_found(store, scan(roots(tmp_path)))
    assert [(r.status, r.name) for r in results] == [("already", "tinyllama:1b")]
    assert store.get("tinyllama:1b").ref is None


def test_hf_prefers_main_and_registers_each_blob_once(tmp_path: Path, tiny_llama: Path) -> None:
    hf = tmp_path / "hf"
    old = other_bytes(tiny_llama, tmp_path / "src" / "old.gguf")
    make_hf(hf, "org", "Repo", tiny_llama, "m.gguf", commit=COMMIT_MAIN)
    make_hf(hf, "org", "Repo", tiny_llama, "copy.gguf", commit=COMMIT_MAIN)  # same blob again
    make_hf(hf, "org", "Repo", old, "m.gguf", commit=COMMIT_OLD)
    make_hf(hf, "org", "Repo", tiny_llama, "sub/m.gguf", commit=COMMIT_OLD)  # same blob again
    os.utime(hf / "models--org--Repo/snapshots" / COMMIT_OLD, (4e9, 4e9))  # newer than main
    found = scan(roots(tmp_path))
    assert [(f.suggested_name, f.digest) for f in found] == [
        ("hf.co/org/Repo/copy.gguf", sha256(tiny_llama)),
        ("hf.co/org/Repo/m.gguf:" + COMMIT_OLD[:12], sha256(old)),
    ]
    store = Store()
    assert {r.status for r in register_found(store, found)} == {"registered"}
    assert store.path_of(store.get("hf.co/org/Repo/copy.gguf")).name == sha256(tiny_llama)


def test_hf_odd_repos(tmp_path: Path, tiny_llama: Path) -> None:
    hf = tmp_path / "hf"
    make_hf(hf, "gpt2", "", tiny_llama, "x.gguf")  # models--gpt2-- : odd but harmless
    make_hf(hf, "org", "Repo", tiny_llama, "model.bin")  # not a GGUF name: ignored
    (hf / "datasets--org--data" / "snapshots" / COMMIT_MAIN).mkdir(parents=True)
    repo = hf / "models--solo"
    (repo / "snapshots" / COMMIT_MAIN).mkdir(parents=True)
    (repo / "snapshots" / COMMIT_MAIN / "Solo Model.gguf").write_bytes(tiny_llama.read_bytes())
    found = scan(roots(tmp_path))
    names = sorted(f.suggested_name for f in found)
    assert names == ["gpt2:x", "solo:solo-model"]
    solo = next(f for f in found if f.suggested_name == "solo:solo-model")
    assert solo.digest is None  # not an LFS blob: hashed at registration
    store = Store()
    assert {r.status for r in register_found(store, found)} == {"registered"}
    assert store.get("solo:solo-model").digest == sha256(tiny_llama)


def test_lmstudio_skips_split_parts_projectors_and_symlinked_folders(
    tmp_path: Path, tiny_llama: Path
) -> None:
    lms = tmp_path / "lms"
    for part in ("00001", "00002", "00003"):
        make_lmstudio(lms, tiny_llama, f"pub/big/big-Q4_K_M-{part}-of-00003.gguf")
    make_lmstudio(lms, tiny_llama, "pub/vision/mmproj-vision-f16.gguf")
    make_lmstudio(lms, tiny_llama, "pub/vision/vision-F16.gguf")
    elsewhere = make_lmstudio(tmp_path / "elsewhere", tiny_llama, "pub/far/far.gguf")
    (lms / "linked").symlink_to(elsewhere.parent.parent, target_is_directory=True)
    make_lmstudio(lms, tiny_llama, "a/b/c/d/e/too-deep.gguf")
    found = scan(roots(tmp_path))
    assert [(f.suggested_name, f.skipped) for f in found] == [
        ("pub/vision:f16", None),
        ("", "split GGUF (3 parts): not supported by scan yet"),
    ]
    assert found[1].path.name == "big-Q4_K_M-00001-of-00003.gguf"
    results = register_found(Store(), found)
    assert [r.status for r in results] == ["registered", "skipped"]


def test_roots_from_environment(tmp_path: Path) -> None:
    env = {"HOME": str(tmp_path / "u"), "HF_HOME": "/x/hfhome", "OLLAMA_MODELS": "/x/ollama"}
    r = ScanRoots.from_env(env)
    assert r.huggingface == (Path("/x/hfhome/hub"),)
    assert r.ollama[0] == Path("/x/ollama")
    assert r.lmstudio == (tmp_path / "u/.lmstudio/models", tmp_path / "u/.cache/lm-studio/models")
    env["HF_HUB_CACHE"] = "/x/hubcache"
    assert ScanRoots.from_env(env).huggingface == (Path("/x/hubcache"),)
    bare = ScanRoots.from_env({"HOME": str(tmp_path / "u")})
    assert bare.huggingface == (tmp_path / "u/.cache/huggingface/hub",)
    assert bare.ollama[0] == tmp_path / "u/.ollama/models"


def zero_layers(src: Path, dst: Path) -> Path:
    """`src` with `llama.block_count` patched to 0: a well-formed GGUF llama.cpp aborts on."""
    data = bytearray(src.read_bytes())
    with GGUFFile(src) as gf:
        _start, end = gf.kv_spans["llama.block_count"]
    data[end - 4 : end] = bytes(4)  # the u32 value ends the entry
    dst.parent.mkdir(parents=True, exist_ok=True)
    dst.write_bytes(data)
    return dst


@pytest.mark.parametrize("origin", ["huggingface", "ollama", "lmstudio"])
def test_inconsistent_model_is_skipped_with_the_reason(
    origin: str, tmp_path: Path, tiny_llama: Path
) -> None:
    bad = zero_layers(tiny_llama, tmp_path / "src" / "zero.gguf")
    if origin == "huggingface":
        make_hf(tmp_path / "hf", "org", "Repo", bad, "zero.gguf")
    elif origin == "ollama":
        make_ollama(tmp_path / "ollama", bad)
    else:
        make_lmstudio(tmp_path / "lms", bad, "pub/repo/zero.gguf")
    make_lmstudio(tmp_path / "lms", tiny_llama, "pub/good/good-F16.gguf")
    found = scan(roots(tmp_path))
    skipped = [f for f in found if not f.ok]
    assert [f.origin for f in skipped] == [origin]
    assert skipped[0].skipped == (
        "inconsistent model file: llama.block_count is 0: a model needs at least one layer"
    )
    results = register_found(Store(), found)
    assert sorted(r.status for r in results) == ["registered", "skipped"]
    assert [r.name for r in Store().list()] == ["pub/good:f16"]
    assert list(Store().blobs.iterdir()) == []


def test_a_file_made_inconsistent_after_the_scan_is_skipped(
    tmp_path: Path, tiny_llama: Path
) -> None:
    path = make_lmstudio(tmp_path / "lms", tiny_llama, "pub/repo/m.gguf")
    found = scan(roots(tmp_path))
    assert found[0].ok
    zero_layers(tiny_llama, path)  # add_reference checks again: the file is not trusted twice
    results = register_found(Store(), found)
    assert results[0].status == "skipped" and "llama.block_count is 0" in results[0].reason
    assert Store().list() == []
