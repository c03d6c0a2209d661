"""The store: content-addressed, verified before registration, atomic, consistent after any fault."""

from __future__ import annotations

import errno
import hashlib
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from localllm.errors import GGUFFormatError, InvalidName, LocalLLMError, ModelNotFound, StoreError
from localllm.gguf_file import GGUFFile
from localllm.models_registry import store as store_mod
from localllm.models_registry.store import Store, default_home


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def assert_consistent(store: Store) -> None:
    """Every name points at a blob whose bytes hash to its digest; no stray files remain."""
    records = store.list()
    if not store.home.exists():  # nothing was ever written: consistent by definition
        assert records == []
        return
    for r in records:
        p = store.path_of(r)
        assert p.is_file(), r.name
        assert sha256(p) == r.digest and p.stat().st_size == r.size
    blobs = sorted(p.name for p in store.blobs.iterdir()) if store.blobs.exists() else []
    assert blobs == sorted({f"sha256-{r.digest}" for r in records}), blobs
    assert not [p for p in store.home.iterdir() if ".tmp-" in p.name]


def test_home_from_environment(localllm_home: Path) -> None:
    assert default_home() == localllm_home
    assert Store().home == localllm_home


def test_import_links_and_lists(tiny_llama: Path) -> None:
    store = Store()
    r = store.add_file(tiny_llama, "tiny", source="file:x")
    assert r.name == "tiny:latest" and r.digest == sha256(tiny_llama)
    blob = store.path_of(r)
    assert os.stat(blob).st_ino == os.stat(tiny_llama).st_ino  # a hard link, not a copy
    assert r.info.architecture == "llama" and r.info.n_layers == 2
    assert [x.name for x in store.list()] == ["tiny:latest"]
    assert store.get("tiny") == r and store.get("tiny:latest") == r
    assert_consistent(store)


def test_import_copies_across_filesystems(
    tiny_llama: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def cross_device(src: object, dst: object) -> None:
        raise OSError(errno.EXDEV, "Invalid cross-device link")

    monkeypatch.setattr(store_mod.os, "link", cross_device)
    store = Store()
    r = store.add_file(tiny_llama, "tiny", source="file:x")
    assert os.stat(store.path_of(r)).st_ino != os.stat(tiny_llama).st_ino
    assert_consistent(store)


def test_parts_are_joined_and_verified(tiny_llama: Path, tmp_path: Path) -> None:
    data = tiny_llama.read_bytes()
    parts = []
    for i, chunk in enumerate((data[:1000], data[1000:500_000], data[500_000:])):
        parts.append(tmp_path / f"part{i}")
        parts[-1].write_bytes(chunk)
    store = Store()
    r = store.add_file(parts, "joined", source="parts", expected_sha256=sha256(tiny_llama))
    assert store.path_of(r).read_bytes() == data
    assert_consistent(store)


def test_sha256_mismatch_registers_nothing(tiny_llama: Path) -> None:
    store = Store()
    with pytest.raises(StoreError, match="sha256 mismatch"):
        store.add_file(tiny_llama, "tiny", source="x", expected_sha256="0" * 64)
    assert store.list() == []
    assert_consistent(store)


def test_hostile_file_registers_nothing(tmp_path: Path) -> None:
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUF\x03\x00\x00\x00" + b"\xff" * 40)
    store = Store()
    with pytest.raises(GGUFFormatError):
        store.add_file(bad, "bad", source="x")
    assert store.list() == []
    assert_consistent(store)


def test_names_that_could_be_paths_are_refused(tiny_llama: Path, localllm_home: Path) -> None:
    store = Store()
    for name in (
        "../evil",
        "/etc/passwd",
        "a/../../b",
        "a\\b",
        "x:../y",
        "na me",
        "nul\0l",
        "ünï",
        "",
    ):
        with pytest.raises(InvalidName):
            store.add_file(tiny_llama, name, source="x")
    assert not localllm_home.exists() or store.list() == []


def test_two_names_share_one_blob_and_rm_keeps_it(tiny_llama: Path) -> None:
    store = Store()
    a = store.add_file(tiny_llama, "a", source="x")
    b = store.add_file(tiny_llama, "b:v1", source="x")
    assert a.digest == b.digest
    store.remove("a")
    assert store.path_of(b).is_file()
    assert_consistent(store)
    store.remove("b:v1")
    assert not store.path_of(b).exists()
    assert_consistent(store)
    with pytest.raises(ModelNotFound):
        store.remove("b:v1")


def test_disk_full_during_copy(tiny_llama: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """ENOSPC mid-write: one clear error, no temp file, nothing registered, the old index intact."""
    store = Store()
    store.add_file(tiny_llama, "kept", source="x")
    before = store.index_path.read_bytes()
    monkeypatch.setattr(store_mod, "_try_link", lambda src, dst: False)
    real_copy = store_mod.shutil.copyfileobj

    def full_disk(src, dst, length=0):  # noqa: ANN001
        dst.write(src.read(4096))
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(store_mod.shutil, "copyfileobj", full_disk)
    with pytest.raises(StoreError, match="disk full"):
        store.add_file(tiny_llama, "new", source="x")
    monkeypatch.setattr(store_mod.shutil, "copyfileobj", real_copy)
    assert store.index_path.read_bytes() == before
    assert_consistent(store)


def test_not_enough_space_is_refused_before_writing(
    tiny_llama: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(store_mod, "_try_link", lambda src, dst: False)
    full = SimpleNamespace(total=1 << 30, used=(1 << 30) - 1000, free=1000)
    monkeypatch.setattr(store_mod.shutil, "disk_usage", lambda path: full)
    store = Store()
    with pytest.raises(StoreError, match=r"not enough disk space for tiny:latest .*, 1000 B free$"):
        store.add_file(tiny_llama, "tiny", source="x")
    assert store.list() == []
    assert_consistent(store)


def test_disk_full_while_writing_index(tiny_llama: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    store = Store()
    store.add_file(tiny_llama, "kept", source="x")
    before = store.index_path.read_bytes()
    real_fsync = os.fsync

    def failing_fsync(fd: int) -> None:
        if ".index.json.tmp-" in os.readlink(f"/proc/self/fd/{fd}"):
            raise OSError(errno.ENOSPC, "No space left on device")
        real_fsync(fd)

    monkeypatch.setattr(store_mod.os, "fsync", failing_fsync)
    with pytest.raises(StoreError, match="disk full"):
        store.add_file(tiny_llama, "other", source="x")
    monkeypatch.setattr(store_mod.os, "fsync", real_fsync)
    assert store.index_path.read_bytes() == before
    assert [r.name for r in store.list()] == ["kept:latest"]


def test_damaged_index_is_one_clear_error(localllm_home: Path) -> None:
    localllm_home.mkdir(parents=True)
    (localllm_home / "index.json").write_text("{not json")
    with pytest.raises(StoreError, match="damaged"):
        Store().list()


def test_gc_removes_dead_writers_and_orphans(tiny_llama: Path) -> None:
    store = Store()
    r = store.add_file(tiny_llama, "tiny", source="x")
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True).stdout.strip()  # fmt: skip
    stale = store.blobs / f".tmp-{dead}-abcdef"
    stale.write_bytes(b"partial")
    orphan = store.blobs / ("sha256-" + "1" * 64)
    orphan.write_bytes(b"orphan")
    live = store.blobs / f".tmp-{os.getpid()}-abcdef"
    live.write_bytes(b"in progress")
    removed = store.gc()
    assert set(removed) == {stale, orphan}
    assert live.exists() and store.path_of(r).exists()
    live.unlink()
    assert_consistent(store)


def test_gc_reads_the_temporary_names_the_writers_make(localllm_home: Path) -> None:
    """`temp_path` (blob writes, pulls' joins, the index) and `gc` agree on the name: a dead
    writer's file goes, a live one's stays, and nothing else is taken for one."""
    store = Store()
    store.blobs.mkdir(parents=True)
    dead = int(subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                              capture_output=True, text=True).stdout)  # fmt: skip
    index_tmp = store_mod.temp_path(store.home, ".index.json")
    for p in (store.temp_path(), index_tmp):
        assert p.parent in (store.blobs, store.home)
        assert store_mod.temp_writer(p.name) == os.getpid()
    assert index_tmp.name.startswith(".index.json.tmp-")
    assert store.temp_path() != store.temp_path()
    assert store_mod.temp_writer("sha256-" + "a" * 64) is None
    assert store_mod.temp_writer(".partial-" + "a" * 64 + "-12-ab") is None
    mine = store.temp_path()
    theirs = mine.with_name(mine.name.replace(f"-{os.getpid()}-", f"-{dead}-"))
    for p in (mine, theirs):
        p.write_bytes(b"x")
    assert store.gc() == [theirs] and mine.exists()
    assert store_mod.pid_alive(os.getpid()) and not store_mod.pid_alive(dead)


_IMPORTER = textwrap.dedent(
    """
    import sys
    from localllm.models_registry.store import Store
    Store().add_file(sys.argv[1], sys.argv[2], source="x", link=False)
    """
)


def test_concurrent_imports_do_not_corrupt(tiny_llama: Path, tmp_path: Path) -> None:
    """Processes importing at once (same bytes and different names): every one lands intact."""
    procs = [
        subprocess.Popen([sys.executable, "-c", _IMPORTER, str(tiny_llama), f"m{i}"])
        for i in range(4)
    ]
    assert [p.wait(timeout=120) for p in procs] == [0, 0, 0, 0]
    store = Store()
    assert [r.name for r in store.list()] == [f"m{i}:latest" for i in range(4)]
    assert_consistent(store)


_SLOW_COPY = textwrap.dedent(
    """
    import sys, time
    from localllm.models_registry import store as s
    real = s.shutil.copyfileobj
    def slow(src, dst, length=0):
        while chunk := src.read(65536):
            dst.write(chunk); dst.flush()
            print("progress", flush=True); time.sleep(0.05)
    s.shutil.copyfileobj = slow
    s.Store().add_file(sys.argv[1], "killed", source="x", link=False)
    """
)


def test_kill_mid_import_leaves_store_consistent(tiny_llama: Path) -> None:
    store = Store()
    store.add_file(tiny_llama, "kept", source="x")
    p = subprocess.Popen(
        [sys.executable, "-c", _SLOW_COPY, str(tiny_llama)], stdout=subprocess.PIPE
    )
    for _ in range(5):
        assert p.stdout.readline() == b"progress\n"
    p.send_signal(signal.SIGKILL)
    p.wait()
    time.sleep(0.05)
    assert [r.name for r in store.list()] == ["kept:latest"]
    assert any(".tmp-" in q.name for q in store.blobs.iterdir())  # the dead writer's partial file
    store.gc()
    assert_consistent(store)


def test_index_is_json_with_version(tiny_llama: Path) -> None:
    store = Store()
    store.add_file(tiny_llama, "tiny", source="file:/x")
    data = json.loads(store.index_path.read_text())
    assert data["version"] == 1
    entry = data["models"]["tiny:latest"]
    assert entry["source"] == "file:/x" and entry["info"]["architecture"] == "llama"


def test_missing_source_file(tmp_path: Path) -> None:
    with pytest.raises(LocalLLMError, match="no such file"):
        Store().add_file(tmp_path / "absent.gguf", "x", source="x")


@pytest.mark.parametrize(
    "content",
    [
        b"",
        b"GGU",
        b"GGML" + bytes(60),
        b"GGUF\x03\x00\x00\x00" + (1 << 63).to_bytes(8, "little") * 2,
    ],
    ids=["empty", "3 bytes", "wrong magic", "counts 2^63"],
)
def test_hostile_imports_leave_the_store_unchanged(
    content: bytes, tmp_path: Path, tiny_llama: Path
) -> None:
    store = Store()
    store.add_file(tiny_llama, "kept", source="x")
    index = store.index_path.read_bytes()
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(content)
    with pytest.raises(GGUFFormatError, match="bad.gguf"):
        store.add_file(bad, "bad", source="x")
    assert store.index_path.read_bytes() == index
    assert_consistent(store)


# -- references: records that point at another tool's file instead of a blob ------------------


def test_reference_registers_without_copying(tiny_llama: Path, tmp_path: Path) -> None:
    other = tmp_path / "tool" / "m.gguf"
    other.parent.mkdir()
    other.write_bytes(tiny_llama.read_bytes())
    link = tmp_path / "tool" / "link.gguf"
    link.symlink_to(other)
    store = Store()
    r = store.add_reference(link, "ref", source="ollama:x")
    assert r.ref == str(other) and r.digest == sha256(other) and r.size == other.stat().st_size
    assert r.ref_mtime_ns == os.stat(other).st_mtime_ns
    assert list(store.blobs.iterdir()) == []
    assert store.path_of(r) == other and store.get("ref") == r
    entry = json.loads(store.index_path.read_text())["models"]["ref:latest"]
    assert entry["ref"] == str(other) and entry["ref_mtime_ns"] == r.ref_mtime_ns


def test_reference_checks_file_and_digest(tiny_llama: Path, tmp_path: Path) -> None:
    store = Store()
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(tiny_llama.read_bytes()[:5000])
    with pytest.raises(GGUFFormatError, match="bad.gguf"):
        store.add_reference(bad, "bad", source="x")
    with pytest.raises(InvalidName):
        store.add_reference(tiny_llama, "m", source="x", digest="sha256:../../etc/passwd")
    with pytest.raises(LocalLLMError, match="not a regular file"):
        store.add_reference(tmp_path, "dir", source="x")
    with pytest.raises(LocalLLMError, match="no such file"):
        store.add_reference(tmp_path / "absent.gguf", "absent", source="x")
    blob = store.add_file(tiny_llama, "blob", source="x")
    with pytest.raises(StoreError, match="inside the store"):
        store.add_reference(store.path_of(blob), "loop", source="x")
    assert [r.name for r in store.list()] == ["blob:latest"]
    given = store.add_reference(tiny_llama, "given", source="x", digest="sha256:" + "ab" * 32)
    assert given.digest == "ab" * 32  # a digest the owning tool names the file by is trusted


def test_old_index_without_reference_fields_still_loads(tiny_llama: Path) -> None:
    store = Store()
    store.add_file(tiny_llama, "old", source="x")
    data = json.loads(store.index_path.read_text())
    assert "ref" not in data["models"]["old:latest"]  # blob records keep the old layout
    assert "ref_mtime_ns" not in data["models"]["old:latest"]
    (record,) = store.list()
    assert record.ref is None and record.ref_mtime_ns is None


def test_reference_and_blob_with_one_digest(tiny_llama: Path, tmp_path: Path) -> None:
    """A reference never keeps a blob alive, and removing either never touches the other tool's file."""
    other = tmp_path / "tool.gguf"
    other.write_bytes(tiny_llama.read_bytes())
    original = (other.read_bytes(), os.stat(other).st_mtime_ns)
    store = Store()
    blob = store.add_file(tiny_llama, "blob", source="x")
    ref = store.add_reference(other, "ref", source="x")
    assert ref.digest == blob.digest

    store.remove("ref")  # the blob record still needs its blob
    assert store.path_of(blob).is_file() and store.gc() == []
    ref = store.add_reference(other, "ref", source="x")
    store.remove("blob")  # the reference does not keep the blob alive
    assert not store.blob_path(blob.digest).exists()
    assert store.path_of(ref) == other
    assert (other.read_bytes(), os.stat(other).st_mtime_ns) == original

    orphan = store.blob_path(ref.digest)  # a blob with the reference's digest, no blob record
    orphan.write_bytes(b"left over")
    store.remove("ref")  # removing a reference only drops its name
    assert orphan.read_bytes() == b"left over"
    assert store.gc() == [orphan]
    assert store.list() == [] and other.read_bytes() == original[0]
    assert list(store.blobs.iterdir()) == []


# -- inconsistent models: well-formed GGUF, hyperparameters that disagree with the tensors --------


def zero_layers(src: Path, dst: Path) -> Path:
    """`src` with `llama.block_count` patched to 0: parses, but llama.cpp aborts on it."""
    data = bytearray(src.read_bytes())
    with GGUFFile(src) as gf:
        _start, end = gf.kv_spans["llama.block_count"]
    data[end - 4 : end] = bytes(4)  # the u32 value ends the entry
    dst.write_bytes(data)
    return dst


@pytest.mark.parametrize("how", ["link", "copy", "parts"])
def test_inconsistent_import_registers_nothing(how: str, tiny_llama: Path, tmp_path: Path) -> None:
    store = Store()
    kept = store.add_file(tiny_llama, "kept", source="x")
    index = store.index_path.read_bytes()
    bad = zero_layers(tiny_llama, tmp_path / "bad.gguf")
    if how == "parts":  # joined first, so the check runs on the joined bytes in the store
        data = bad.read_bytes()
        (tmp_path / "p1").write_bytes(data[:1000])
        (tmp_path / "p2").write_bytes(data[1000:])
        source: Path | list[Path] = [tmp_path / "p1", tmp_path / "p2"]
    else:
        source = bad
    with pytest.raises(GGUFFormatError, match="llama.block_count is 0") as exc:
        store.add_file(source, "bad", source="x", link=how == "link")
    assert "\n" not in str(exc.value)
    assert store.index_path.read_bytes() == index
    assert [p.name for p in store.blobs.iterdir()] == [f"sha256-{kept.digest}"]
    assert_consistent(store)


def test_inconsistent_adopt_registers_nothing(tiny_llama: Path) -> None:
    store = Store()
    store.add_file(tiny_llama, "kept", source="x")
    index = store.index_path.read_bytes()
    pulled = zero_layers(tiny_llama, store.blobs / f".tmp-{os.getpid()}-feed")
    with pytest.raises(GGUFFormatError, match="llama.block_count is 0"):
        store.adopt(pulled, "bad", source="hf:x", digest=sha256(pulled))
    assert store.index_path.read_bytes() == index
    assert pulled.is_file()  # left where it was, for the caller (pull) to remove
    assert not store.blob_path(sha256(pulled)).exists()
    pulled.unlink()
    assert_consistent(store)


def test_inconsistent_reference_registers_nothing(tiny_llama: Path, tmp_path: Path) -> None:
    store = Store()
    store.add_file(tiny_llama, "kept", source="x")
    index = store.index_path.read_bytes()
    bad = zero_layers(tiny_llama, tmp_path / "bad.gguf")
    with pytest.raises(GGUFFormatError, match="llama.block_count is 0"):
        store.add_reference(bad, "bad", source="x")
    assert store.index_path.read_bytes() == index
    assert [r.name for r in store.list()] == ["kept:latest"]
    assert_consistent(store)
