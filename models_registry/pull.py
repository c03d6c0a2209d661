"""`localllm pull`: download a model from Hugging Face into the store, verified and resumable.

    pull("smollm2")                        the catalog; offline from an installed package when one ships it
    pull("hf.co/ORG/REPO")                 the repo's Q4_K_M GGUF (split parts joined into one model)
    pull("hf.co/ORG/REPO:Q8_0")            that quantization
    pull("hf.co/ORG/REPO/FILE.gguf")       that file

What can go wrong elsewhere, and what this module does instead (REFERENCE.md, "Downloads"):
- Right size, wrong bytes: every file is checked against the sha256 the hub's LFS metadata (or the
  catalog) names, by re-reading what is on disk, before anything is registered. Files kept in git
  rather than LFS are checked against their git blob id. A mismatch deletes the download and says so.
- Lost partial files: bytes go to `blobs/.partial-<sha256>-<pid>-<rand>`; a later pull (after Ctrl-C,
  a network drop or kill -9) claims a dead writer's partial file by renaming it (atomic, so two
  claimants can never share one) and asks the server for the rest with a `Range` request.
- Concurrent pulls: one flock per file makes a second puller wait, then reuse the finished blob; and
  because each writer owns its partial file by name, a filesystem where locks do nothing still cannot
  get two writers into one file.
- Credentials: redirects are followed here, not by the HTTP client, and the token goes only to the
  origin it was meant for (the hub), never to a CDN or any other host.
- Revisions are pinned: a branch is resolved to a commit once, and every file comes from that commit.
- Disk: free space is checked before the first byte and ENOSPC during a write stops cleanly.

No path is built from a remote string: partial files, locks and blobs are named by checked digests.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import fcntl
import hashlib
import http.client
import os
import re
import secrets
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urljoin, urlsplit

from localllm.errors import GGUFFormatError, InvalidName, LocalLLMError, ModelNotFound, StoreError
from localllm.model_info import human_bytes
from localllm.models_registry.catalog import (
    Catalog,
    CatalogEntry,
    default_catalog,
    find_local,
    packaged_files,
)
from localllm.models_registry.names import (
    DEFAULT_QUANT,
    HF_PREFIX,
    SPLIT_GGUF,
    check_digest,
    hf_store_name,
    parse_name,
    split_gguf_name,
)
from localllm.models_registry.store import ModelRecord, Store, ensure_free_space, pid_alive

CHUNK = 1 << 20
RETRY_DELAYS = (0.5, 1.0, 2.0, 4.0, 8.0)  # then give up; reset whenever bytes arrive again
MAX_REDIRECTS = 10
_GIT_OID = re.compile(r"[0-9a-f]{40}")
_QUANT = re.compile(
    r"(?<![A-Za-z0-9])((?:I|T)?Q[1-8](?:_[A-Za-z0-9]+)*|[BF]F16|F16|F32|FP16)(?![A-Za-z0-9])",
    re.IGNORECASE,
)
_PARTIAL = re.compile(r"^\.partial-(?P<key>[0-9a-f]{64})-(?P<pid>\d+)-[0-9a-f]+$")


class PullCancelled(LocalLLMError):
    """The pull was cancelled; the partial download is kept for the next pull to resume."""


@dataclass(frozen=True)
class PullEvent:
    """Progress of one pull, for a progress bar. `done`/`total` count bytes of the whole model."""

    name: str
    phase: str  # resolving | waiting | downloading | retrying | verifying | joining | registering | done
    file: str = ""
    done: int = 0
    total: int = 0
    message: str = ""


@dataclass(frozen=True)
class RemoteFile:
    """One file at a pinned commit, with what its bytes must hash to."""

    repo: str
    commit: str
    path: str  # the file's path in the repo (from the hub: never used as a local path)
    size: int
    sha256: str | None  # LFS files
    git_oid: str | None = None  # files kept in git: sha1 of "blob <size>\0" + bytes
    problem: str | None = None  # why this file cannot be fetched safely (a bad digest)

    @property
    def key(self) -> str:
        """A local name for this file's partial download and lock: its sha256, or a hash of where."""
        if self.sha256:
            return self.sha256
        return hashlib.sha256(f"{self.repo}@{self.commit}/{self.path}".encode()).hexdigest()


@dataclass
class PullPlan:
    """What a name means: the store name, and either package files or remote files."""

    name: str  # `name:tag` in the store
    source: str = ""
    files: list[RemoteFile] = field(default_factory=list)  # one, or split parts in order
    expected_sha256: str | None = None  # of the registered bytes (single file)
    package: tuple[list[Path], str] | None = None
    projector: RemoteFile | None = None  # the model's vision projector (an mmproj GGUF), if it has one

    @property
    def total(self) -> int:
        return sum(f.size for f in self.files) + (self.projector.size if self.projector else 0)


Progress = Callable[[PullEvent], None]


# -- resolving names ---------------------------------------------------------------------------


def _offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on")


def _endpoint() -> str:
    return (os.environ.get("HF_ENDPOINT") or "https://huggingface.co").rstrip("/")


def _repo_info(repo: str, revision: str | None) -> Any:
    """The hub's model info with file metadata (LFS sha256), as one line of error on failure."""
    from huggingface_hub import HfApi
    from huggingface_hub import errors as hf_errors

    endpoint = _endpoint()
    try:
        return HfApi(endpoint=endpoint).model_info(
            repo, revision=revision, files_metadata=True, timeout=30
        )
    except hf_errors.GatedRepoError:
        raise LocalLLMError(
            f"{repo} is gated: accept its license on the hub and set HF_TOKEN"
        ) from None
    except hf_errors.RevisionNotFoundError:
        raise ModelNotFound(f"{repo} has no revision {revision!r}") from None
    except hf_errors.RepositoryNotFoundError:
        raise ModelNotFound(
            f"no model repo {repo!r} on {endpoint} (a private repo needs HF_TOKEN)"
        ) from None
    except hf_errors.OfflineModeIsEnabled:
        raise LocalLLMError(f"HF_HUB_OFFLINE is set: cannot look up {repo}") from None
    except hf_errors.HfHubHTTPError as e:
        status = e.response.status_code if e.response is not None else "?"
        raise LocalLLMError(f"the hub answered HTTP {status} for {repo}") from None
    except (KeyError, TypeError, ValueError, AttributeError) as e:
        raise LocalLLMError(f"the hub's answer for {repo} is malformed ({e!r})") from None
    except Exception as e:  # httpx2 transport errors: refused, DNS, TLS, timeouts
        if type(e).__module__.startswith("httpx"):
            raise LocalLLMError(f"cannot reach {endpoint}: {e}") from None
        raise


def _remote_files(info: Any, repo: str, suffixes: tuple[str, ...] = (".gguf",)) -> dict[str, RemoteFile]:
    commit = str(info.sha or "")
    if not _GIT_OID.fullmatch(commit):
        raise LocalLLMError(f"the hub gave no commit for {repo} (got {commit!r})")
    files = {}
    for s in info.siblings or []:
        path = s.rfilename
        if not isinstance(path, str) or not path.endswith(suffixes) or not _safe_remote_path(path):
            continue  # a hostile listing cannot name `../x` or `/etc/x`: such entries do not exist
        lfs = s.lfs
        sha = lfs.sha256 if lfs is not None else None
        size = lfs.size if lfs is not None else s.size
        problem = None
        if sha is not None:
            try:
                sha = check_digest(str(sha))
            except InvalidName:
                sha, problem = None, f"the hub gave a bad sha256 for {path!r} in {repo}"
        oid = s.blob_id if sha is None and _GIT_OID.fullmatch(str(s.blob_id or "")) else None
        if not isinstance(size, int) or size <= 0:
            continue
        files[path] = RemoteFile(repo, commit, path, size, sha, oid, problem)
    return files


def _safe_remote_path(path: str) -> bool:
    segs = path.split("/")
    return (
        len(path) <= 1000
        and path.isascii()
        and path.isprintable()
        and "\\" not in path
        and all(s not in ("", ".", "..") for s in segs)
    )


def _quant_of(path: str) -> str | None:
    base = path.rsplit("/", 1)[-1]
    m = SPLIT_GGUF.fullmatch(base)
    stem = m.group("stem") if m else base[: -len(".gguf")]
    found = _QUANT.findall(stem)
    return found[-1].upper() if found else None


def _with_parts(files: dict[str, RemoteFile], first: str) -> list[RemoteFile]:
    """`first` alone, or all parts of the split GGUF it begins."""
    base = first.rsplit("/", 1)[-1]
    m = SPLIT_GGUF.fullmatch(base)
    if not m:
        return [files[first]]
    n = int(m.group("total"))
    prefix = first[: len(first) - len(base)] + m.group("stem")
    names = [split_gguf_name(prefix, i, n) for i in range(1, n + 1)]
    missing = [p for p in names if p not in files]
    if missing:
        raise LocalLLMError(f"split model {first} is missing part(s): {', '.join(missing)}")
    return [files[p] for p in names]


def _pick_quant(files: dict[str, RemoteFile], repo: str, quant: str) -> list[RemoteFile]:
    candidates = sorted(
        (p for p in files if "mmproj" not in p.lower() and _quant_of(p) == quant.upper()),
        key=lambda p: (p.count("/"), len(p), p),
    )
    firsts = [p for p in candidates if _is_first_part(p)]
    if not firsts:
        have = sorted({q for p in files if "mmproj" not in p.lower() and (q := _quant_of(p))})
        if not have:
            raise ModelNotFound(f"{repo} has no GGUF files")
        raise ModelNotFound(
            f"{repo} has no {quant.upper()} GGUF; available: {', '.join(have)} "
            f"(pull hf.co/{repo}:{have[0]})"
        )
    return _with_parts(files, firsts[0])


def _pick_projector(files: dict[str, RemoteFile], named: str = "") -> RemoteFile | None:
    """The repo's vision projector: the one the catalog names, else its mmproj file (F16 first,
    as the ggml-org and LM Studio repos ship it beside lighter ones); None when it has none."""
    if named:
        return files.get(named)
    found = sorted((p for p in files if "mmproj" in p.rsplit("/", 1)[-1].lower()),
                   key=lambda p: ("f16" not in p.lower(), p.count("/"), len(p), p))  # fmt: skip
    return files[found[0]] if found else None


def _is_first_part(path: str) -> bool:
    """A whole GGUF, or the first part of a split one."""
    m = SPLIT_GGUF.fullmatch(path.rsplit("/", 1)[-1])
    return m is None or int(m.group("part")) == 1


def plan(text: str, *, revision: str | None = None, catalog: Catalog | None = None) -> PullPlan:
    """Resolve a name to what must be fetched. Looks at the hub only when it has to."""
    catalog = catalog or default_catalog()
    name = parse_name(text)
    if name.is_hf:
        key = hf_store_name(name)
        parts = name.name[len(HF_PREFIX) :].split("/")
        repo = "/".join(parts[:2])
        if _offline():
            raise LocalLLMError(f"HF_HUB_OFFLINE is set: cannot download {text}")
        info = _repo_info(repo, revision)
        files = _remote_files(info, repo)
        if len(parts) == 3:
            wanted = parts[2]
            if wanted not in files:
                have = sorted(files)[:12]
                raise ModelNotFound(
                    f"{repo} has no file {wanted!r}"
                    + (f"; GGUF files: {', '.join(have)}" if have else "; it has no GGUF files")
                )
            chosen = _with_parts(files, wanted)
        else:
            chosen = _pick_quant(files, repo, name.tag or DEFAULT_QUANT)
        return _remote_plan(key, chosen, _pick_projector(files) if "mmproj" not in chosen[0].path.lower() else None)
    entry = catalog.resolve(name)
    if entry is None:
        catalog.refuse_unknown_tag(name)
        raise ModelNotFound(
            f"unknown model {text!r}: not in the catalog; name a Hugging Face repo as "
            f"hf.co/ORG/REPO[:QUANT]"
        )
    found = packaged_files(entry.known)
    if found is not None:
        return PullPlan(entry.name, source=found[1], package=found,
                        expected_sha256=entry.known.sha256)  # fmt: skip
    if _offline():
        raise LocalLLMError(
            f"HF_HUB_OFFLINE is set and no installed package ships {entry.name}: cannot download it"
        )
    return _catalog_plan(entry, revision)


def _catalog_plan(entry: CatalogEntry, revision: str | None) -> PullPlan:
    repo = entry.variant.repo
    files = _remote_files(_repo_info(repo, revision), repo)
    filename = entry.filename
    if entry.variant.split:
        stem = filename[: -len(".gguf")]
        firsts = [
            p
            for p in files
            if (m := SPLIT_GGUF.fullmatch(p)) and m["stem"] == stem and int(m["part"]) == 1
        ]
        if not firsts:
            raise ModelNotFound(f"{repo} no longer has {filename} (split)")
        chosen = _with_parts(files, firsts[0])
    else:
        if filename not in files:
            raise ModelNotFound(f"{repo} no longer has {filename}")
        chosen = [files[filename]]
    known = entry.known.sha256
    if known and len(chosen) == 1 and chosen[0].sha256 is None:  # a git file: the pin decides
        chosen = [dataclasses.replace(chosen[0], sha256=known, git_oid=None)]
    projector = None
    if entry.variant.mmproj:
        projector = _pick_projector(files, entry.variant.mmproj)
        if projector is None:
            raise ModelNotFound(f"{repo} no longer has {entry.variant.mmproj} (its vision projector)")
    p = _remote_plan(entry.name, chosen, projector)
    if known and len(chosen) == 1 and chosen[0].sha256 and chosen[0].sha256 != known:
        raise StoreError(
            f"{repo}/{filename} has sha256 {chosen[0].sha256} on the hub but the catalog pins "
            f"{known}: the file changed upstream; not downloading"
        )
    p.expected_sha256 = known or p.expected_sha256
    return p


def _remote_plan(key: str, chosen: list[RemoteFile], projector: RemoteFile | None = None) -> PullPlan:
    for f in [*chosen, *([projector] if projector else [])]:
        if f.problem:
            raise LocalLLMError(f"{f.problem}; not downloading")
    first = chosen[0]
    more = f" (+{len(chosen) - 1} parts)" if len(chosen) > 1 else ""
    return PullPlan(
        key,
        source=f"hf:{first.repo}@{first.commit}/{first.path}{more}",
        files=chosen,
        expected_sha256=first.sha256 if len(chosen) == 1 else None,
        projector=projector,
    )


def fetch_files(text: str, wanted: list[str], *, store: Store | None = None,
                revision: str | None = None, on_progress: Progress | None = None,
                cancel: Any = None) -> list[Path]:  # fmt: skip
    """Files of a Hugging Face repo beside its models (a published draft head's `config.json`
    and `model.safetensors`), fetched, resumed and verified as a model's are, in `wanted`'s
    order: partial files of the store's that the caller reads and then deletes (nothing is
    registered)."""
    store = store or Store()
    name = parse_name(text)
    if not name.is_hf or len(name.name[len(HF_PREFIX) :].split("/")) != 2:
        raise InvalidName(f"{text!r}: name a Hugging Face repo as hf.co/ORG/REPO")
    repo = name.name[len(HF_PREFIX) :]
    if _offline():
        raise LocalLLMError(f"HF_HUB_OFFLINE is set: cannot download {text}")
    files = _remote_files(_repo_info(repo, revision), repo, tuple(sorted({"." + w.rsplit(".", 1)[-1] for w in wanted})))
    missing = [w for w in wanted if w not in files]
    if missing:
        raise ModelNotFound(f"{repo} has no {', '.join(missing)}")
    p = _remote_plan(repo, [files[w] for w in wanted])
    return _Puller(store, p, on_progress or (lambda e: None), cancel).fetch_only()


# -- pulling -----------------------------------------------------------------------------------


def pull(
    text: str,
    *,
    store: Store | None = None,
    revision: str | None = None,
    on_progress: Progress | None = None,
    cancel: Any = None,
    catalog: Catalog | None = None,
) -> ModelRecord:
    """Fetch `text` into the store and return its record. `cancel` is an Event-like object
    (`is_set()`); Ctrl-C works too. Either way the partial download stays for the next pull."""
    store = store or Store()
    emit = on_progress or (lambda e: None)
    if _offline():
        have = find_local(text, store, catalog)
        if have is not None:
            emit(PullEvent(have.name, "done", done=have.size, total=have.size,
                           message="HF_HUB_OFFLINE is set: the local copy was not checked for updates"))  # fmt: skip
            return have
    emit(PullEvent(text, "resolving", message=f"resolving {text}"))
    p = plan(text, revision=revision, catalog=catalog)
    existing = store.get(p.name)
    if existing is not None and (p.projector is None or existing.projector) and (
        (p.expected_sha256 and existing.digest == p.expected_sha256)
        or (p.files and existing.source == p.source)
    ):
        emit(PullEvent(p.name, "done", done=existing.size, total=existing.size,
                       message="already up to date"))  # fmt: skip
        return existing
    if p.package is not None:
        paths, source = p.package
        size = sum(x.stat().st_size for x in paths)
        emit(PullEvent(p.name, "registering", total=size, message=f"from the installed {source}"))
        record = store.add_file(paths, p.name, source=source, expected_sha256=p.expected_sha256)
        emit(PullEvent(p.name, "done", done=size, total=size, message="installed package"))
        return record
    return _Puller(store, p, emit, cancel).run()


def _origin(url: str) -> tuple[str, str, int]:
    u = urlsplit(url)
    return (
        u.scheme,
        (u.hostname or "").lower(),
        u.port or {"http": 80, "https": 443}.get(u.scheme, 0),
    )


class _Puller:
    def __init__(self, store: Store, plan: PullPlan, emit: Progress, cancel: Any) -> None:
        self.store, self.plan, self.emit, self.cancel = store, plan, emit, cancel
        self.done = 0  # bytes of the model on disk so far (all files)
        self.last_emit = 0.0
        self.locks: list[int] = []

    # -- the whole model ---------------------------------------------------------------------

    def run(self) -> ModelRecord:
        p, store = self.plan, self.store
        store.blobs.mkdir(parents=True, exist_ok=True)
        (store.home / "locks").mkdir(parents=True, exist_ok=True)
        try:
            for f in p.files:  # always in the plan's order: two pullers cannot deadlock
                self._lock(f)
            reuse = self._reuse()
            if reuse is not None:
                return self._with_projector(reuse)
            self._check_space()
            fetched = [self._fetch(f) for f in p.files]
            paths = [path for path, _sha in fetched]
            try:
                self.emit(PullEvent(p.name, "registering", done=self.done, total=p.total))
                if len(paths) == 1:
                    record = store.adopt(paths[0], p.name, source=p.source, digest=fetched[0][1])
                else:
                    record = self._join(paths)
            except GGUFFormatError as e:  # the hub's bytes, verified, but not a model we can use
                for path in paths:
                    with contextlib.suppress(FileNotFoundError):
                        path.unlink()
                raise GGUFFormatError(f"{p.files[0].repo}/{p.files[0].path}", e.reason) from None
            for path in paths:
                with contextlib.suppress(FileNotFoundError):
                    path.unlink()
            record = self._with_projector(record)
            self.emit(PullEvent(p.name, "done", done=p.total, total=p.total,
                                message=f"sha256:{record.digest}"))  # fmt: skip
            return record
        finally:
            for fd in self.locks:
                os.close(fd)  # closing releases the flock

    def fetch_only(self) -> list[Path]:
        """The plan's files, fetched and verified, not registered (`fetch_files`)."""
        self.store.blobs.mkdir(parents=True, exist_ok=True)
        (self.store.home / "locks").mkdir(parents=True, exist_ok=True)
        try:
            for f in self.plan.files:
                self._lock(f)
            self._check_space(join=False)
            paths = [self._fetch(f)[0] for f in self.plan.files]
            self.emit(PullEvent(self.plan.name, "done", done=self.plan.total, total=self.plan.total))
            return paths
        finally:
            for fd in self.locks:
                os.close(fd)

    def _with_projector(self, record: ModelRecord) -> ModelRecord:
        """The model's vision projector, pulled with it (it then reads images)."""
        f = self.plan.projector
        if f is None or record.projector == f.sha256:
            return record
        path, _sha = self._fetch(f)
        try:
            return self.store.add_projector(record.name, path)
        finally:
            with contextlib.suppress(FileNotFoundError):
                path.unlink()

    def _reuse(self) -> ModelRecord | None:
        """After waiting for another puller: what it finished is ours to name."""
        p = self.plan
        existing = self.store.get(p.name)
        if existing is not None and existing.source == p.source:
            return existing
        f = p.files[0]
        if len(p.files) == 1 and f.sha256 and self.store.blob_path(f.sha256).is_file():
            self.emit(PullEvent(p.name, "registering", message="already in the store"))
            return self.store.add_file(self.store.blob_path(f.sha256), p.name, source=p.source,
                                       expected_sha256=f.sha256)  # fmt: skip
        return None

    def _lock(self, f: RemoteFile) -> None:
        fd = os.open(
            self.store.home / "locks" / f"pull-{f.key}.lock", os.O_RDWR | os.O_CREAT, 0o644
        )
        self.locks.append(fd)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return
        except BlockingIOError:
            pass
        self.emit(PullEvent(self.plan.name, "waiting", file=f.path,
                            message="another pull of this file is running; waiting for it"))  # fmt: skip
        while True:
            self._check_cancel()
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                return
            except BlockingIOError:
                time.sleep(0.2)

    def _check_space(self, join: bool = True) -> None:
        on_disk = sum(
            x.stat().st_size
            for f in self.plan.files
            for x in self.store.blobs.glob(f".partial-{f.key}-*")
        )
        need = self.plan.total - on_disk
        if join and len(self.plan.files) > 1:
            need += self.plan.total  # the joined file is written beside the parts
        ensure_free_space(self.store.blobs, need, self.plan.name)

    def _check_cancel(self) -> None:
        if self.cancel is not None and self.cancel.is_set():
            raise PullCancelled(
                f"pull of {self.plan.name} cancelled; {human_bytes(self.done)} of "
                f"{human_bytes(self.plan.total)} kept: pull again to resume"
            )

    # -- one file ------------------------------------------------------------------------------

    def _claim_partial(self, f: RemoteFile) -> Path:
        """A partial file of this key from a dead writer, renamed to be ours; else a new one.

        Ours are fair game too (an earlier, cancelled pull in this process): we hold the file's
        lock, so no thread of ours is writing it."""
        mine = self.store.blobs / f".partial-{f.key}-{os.getpid()}-{secrets.token_hex(6)}"
        candidates = []
        for p in self.store.blobs.glob(f".partial-{f.key}-*"):
            m = _PARTIAL.match(p.name)
            pid = int(m.group("pid")) if m else -1
            if m and (pid == os.getpid() or not pid_alive(pid)):
                with contextlib.suppress(OSError):
                    candidates.append((p.stat().st_size, p))
        for _size, p in sorted(candidates, reverse=True):
            try:
                os.rename(p, mine)  # atomic: exactly one claimant wins
            except FileNotFoundError:
                continue
            for _s, other in candidates:  # smaller leftovers of the same file are useless now
                if other != p:
                    with contextlib.suppress(FileNotFoundError):
                        other.unlink()
            return mine
        fd = os.open(mine, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        os.close(fd)
        return mine

    def _fetch(self, f: RemoteFile) -> tuple[Path, str]:
        """Download one file to a partial file we own, resume what is there, verify it.
        Returns the file and its sha256, computed by re-reading it from disk."""
        path = self._claim_partial(f)
        have = path.stat().st_size
        if have > f.size:
            path.unlink()
            path = self._claim_partial(f)
            have = 0
        self.done += have
        if have:
            self.emit(PullEvent(self.plan.name, "downloading", file=f.path, done=self.done,
                                total=self.plan.total, message=f"resuming at {human_bytes(have)}"))  # fmt: skip
        hasher = _TrailingHash(path, git_size=None if f.sha256 else f.size)
        try:
            hasher.advance(have)  # the bytes already there are re-read while the rest arrives
            if have < f.size:
                self._download(f, path, have, hasher)
            self.emit(PullEvent(self.plan.name, "verifying", file=f.path, done=self.done,
                                total=self.plan.total))  # fmt: skip
            size = path.stat().st_size
            sha256, git_oid = hasher.finish(size)
            self._check(f, path, size, sha256, git_oid)
        except OSError as e:
            if e.errno == errno.ENOSPC:
                with contextlib.suppress(FileNotFoundError):
                    path.unlink()
                raise StoreError(
                    f"disk full while pulling {self.plan.name} into {self.store.blobs}; the partial "
                    "download was deleted to give the space back; nothing registered"
                ) from None
            raise
        finally:
            hasher.close()
        return path, sha256

    def _check(self, f: RemoteFile, path: Path, size: int, sha256: str, git_oid: str) -> None:
        """Size and hash against what the hub promised; a wrong file is deleted."""
        want, got, what = (f.sha256, sha256, "sha256") if f.sha256 else (f.git_oid, git_oid,
                                                                           "git blob id")  # fmt: skip
        if size == f.size and (want is None or got == want):
            return
        path.unlink()
        detail = (
            f"size {size} instead of {f.size}"
            if size != f.size
            else f"{what} {got} instead of {want}"
        )
        raise StoreError(
            f"download of {f.path} from {f.repo} is corrupt ({detail}); it was deleted and "
            "nothing was registered: pull again to retry from scratch"
        )

    def _download(self, f: RemoteFile, path: Path, offset: int, hasher: _TrailingHash) -> None:
        from huggingface_hub import hf_hub_url
        from huggingface_hub.utils import build_hf_headers

        url = hf_hub_url(f.repo, f.path, revision=f.commit, endpoint=_endpoint())
        auth = build_hf_headers(library_name="localllm")
        attempt = 0
        with open(path, "r+b", buffering=0) as out:
            out.seek(offset)
            while offset < f.size:
                self._check_cancel()
                before = offset
                try:
                    offset = self._get(url, auth, f, out, offset, hasher)
                    error = None
                except _Retry as e:
                    error = str(e)
                    offset = out.tell()
                if offset >= f.size:
                    break
                if offset > before:
                    attempt = 0  # progress was made: the budget of retries starts again
                if attempt >= len(RETRY_DELAYS):
                    raise LocalLLMError(
                        f"download of {f.path} failed after {attempt + 1} tries ({error}); "
                        f"{human_bytes(self.done)} kept: pull again to resume"
                    )
                delay = RETRY_DELAYS[attempt]
                attempt += 1
                self.emit(PullEvent(self.plan.name, "retrying", file=f.path, done=self.done,
                                    total=self.plan.total,
                                    message=f"{error or 'connection closed early'}; "
                                            f"retrying in {delay:g} s"))  # fmt: skip
                self._sleep(delay)
            os.fsync(out.fileno())

    def _sleep(self, seconds: float) -> None:
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            self._check_cancel()
            time.sleep(min(0.1, max(0.0, end - time.monotonic())))

    def _get(self, url: str, auth: dict[str, str], f: RemoteFile, out: Any, offset: int,
             hasher: _TrailingHash) -> int:  # fmt: skip
        """One GET from `offset`, following redirects by hand; returns the new offset."""
        origin = _origin(url)
        headers = dict(auth)
        headers["Accept-Encoding"] = "identity"
        if offset:
            headers["Range"] = f"bytes={offset}-"
        for _ in range(MAX_REDIRECTS + 1):
            r = _open(url, headers)
            try:
                if r.status in (301, 302, 303, 307, 308) and r.headers.get("location"):
                    url = urljoin(url, r.headers["location"])
                    if _origin(url) != origin:
                        # the token is for the hub; a CDN's signed URL needs none
                        headers = {k: v for k, v in headers.items()
                                   if k.lower() not in ("authorization", "cookie")}  # fmt: skip
                    continue
                return self._body(r, f, out, offset, hasher)
            except _TRANSIENT as e:
                if isinstance(e, OSError) and e.errno in _DISK_ERRORS:
                    raise  # our disk, not the network: no retry
                raise _Retry(f"{type(e).__name__}: {e or 'connection lost'}") from None
            finally:
                r.close()
        raise LocalLLMError(f"too many redirects downloading {f.path}")

    def _restart(self, out: Any, offset: int, hasher: _TrailingHash) -> None:
        out.seek(0)
        out.truncate()
        hasher.reset()
        self.done -= offset

    def _body(self, r: _Response, f: RemoteFile, out: Any, offset: int,
              hasher: _TrailingHash) -> int:  # fmt: skip
        status = r.status
        if status == 416 and offset:
            # the server cannot serve from here: the partial file is wrong; start again
            self._restart(out, offset, hasher)
            raise _Retry("the server refused to resume (HTTP 416); starting over")
        if status in (401, 403):
            raise LocalLLMError(
                f"the hub refused {f.path} (HTTP {status}): set HF_TOKEN, or accept the repo's terms"
            )
        if status == 404:
            raise ModelNotFound(f"{f.path} is gone from {f.repo} at {f.commit[:12]}")
        if status == 429 or status >= 500:
            raise _Retry(f"HTTP {status}")
        if status == 200:
            if offset:  # the server ignored Range: take the whole file again
                self._restart(out, offset, hasher)
                offset = 0
        elif status == 206:
            m = re.match(r"bytes (\d+)-(\d+)/(\d+|\*)", r.headers.get("content-range", ""))
            if not m or int(m.group(1)) != offset:
                raise _Retry(f"bad Content-Range {r.headers.get('content-range')!r}")
        else:
            raise LocalLLMError(f"unexpected HTTP {status} downloading {f.path}")
        buf = memoryview(bytearray(CHUNK))
        while n := r.readinto(buf):
            if offset + n > f.size:
                self._restart(out, offset, hasher)
                raise StoreError(
                    f"the server sent more than the {f.size} bytes of {f.path}; nothing registered"
                )
            view = buf[:n]
            while view:
                view = view[out.write(view) :]
            offset += n
            self.done += n
            hasher.advance(offset)
            now = time.monotonic()
            if now - self.last_emit >= 0.1:
                self.last_emit = now
                self._check_cancel()
                self.emit(PullEvent(self.plan.name, "downloading", file=f.path, done=self.done,
                                    total=self.plan.total))  # fmt: skip
        return offset

    # -- split models --------------------------------------------------------------------------

    def _join(self, paths: list[Path]) -> ModelRecord:
        from localllm.gguf_merge import merge_split

        p = self.plan
        self.emit(PullEvent(p.name, "joining", done=self.done, total=p.total,
                            message=f"joining {len(paths)} parts"))  # fmt: skip
        tmp = self.store.temp_path()
        try:
            merge_split(paths, tmp)
            self.emit(PullEvent(p.name, "registering", done=self.done, total=p.total))
            return self.store.add_file(tmp, p.name, source=p.source)
        finally:
            with contextlib.suppress(FileNotFoundError):
                tmp.unlink()


class _Retry(Exception):
    """A failure worth another try from where the file stands."""


# -- HTTP --------------------------------------------------------------------------------------
# The body of a multi-GB file is read with the standard library straight into one buffer: on
# loopback that runs at curl's speed, where an httpx stream costs about twice the time in Python
# per 64 KiB. Behind a proxy (HTTP(S)_PROXY) huggingface_hub's httpx2 session is used instead.

_TRANSIENT = (OSError, http.client.HTTPException)
_DISK_ERRORS = {errno.ENOSPC, errno.EDQUOT, errno.EIO, errno.EROFS, errno.EFBIG, errno.EBADF}


class _Response:
    status: int
    headers: dict[str, str]  # lower-case names

    def readinto(self, buf: memoryview) -> int:
        raise NotImplementedError

    def close(self) -> None:
        raise NotImplementedError


class _StdResponse(_Response):
    def __init__(self, conn: http.client.HTTPConnection, resp: http.client.HTTPResponse) -> None:
        self.conn, self.resp = conn, resp
        self.status = resp.status
        self.headers = {k.lower(): v for k, v in resp.getheaders()}

    def readinto(self, buf: memoryview) -> int:
        return self.resp.readinto(buf)

    def close(self) -> None:
        self.conn.close()


class _HttpxResponse(_Response):
    def __init__(self, url: str, headers: dict[str, str]) -> None:
        import httpx2
        from huggingface_hub.utils import get_session

        self._cm = get_session().stream("GET", url, headers=headers, follow_redirects=False,
                                        timeout=httpx2.Timeout(30.0, connect=15.0))  # fmt: skip
        try:
            r = self._cm.__enter__()
        except httpx2.TransportError as e:
            raise ConnectionError(str(e)) from None
        self.status = r.status_code
        self.headers = {k.lower(): v for k, v in r.headers.items()}
        self._chunks = r.iter_raw()
        self._left = b""
        self._errors = httpx2.TransportError

    def readinto(self, buf: memoryview) -> int:
        try:
            while not self._left:
                self._left = next(self._chunks, b"")
                if not self._left:
                    return 0
        except self._errors as e:
            raise ConnectionError(str(e)) from None
        n = min(len(buf), len(self._left))
        buf[:n] = self._left[:n]
        self._left = self._left[n:]
        return n

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self._cm.__exit__(None, None, None)


def _ssl_context() -> Any:
    import ssl

    try:
        import certifi

        return ssl.create_default_context(cafile=certifi.where())
    except ImportError:
        return ssl.create_default_context()


def _open(url: str, headers: dict[str, str]) -> _Response:
    """GET `url` with exactly `headers`, no redirects followed; the body is left to read."""
    import urllib.request

    u = urlsplit(url)
    if u.scheme not in ("http", "https"):
        raise LocalLLMError(f"refusing to download from {u.scheme}:// URL")
    if urllib.request.getproxies().get(u.scheme) and not urllib.request.proxy_bypass(
        u.hostname or ""
    ):
        return _HttpxResponse(url, headers)
    if u.scheme == "https":
        conn: http.client.HTTPConnection = http.client.HTTPSConnection(
            u.hostname or "", u.port, timeout=30, context=_ssl_context()
        )
    else:
        conn = http.client.HTTPConnection(u.hostname or "", u.port, timeout=30)
    try:
        conn.request("GET", u.path + (f"?{u.query}" if u.query else ""),
                     headers={"User-Agent": "localllm", **headers})  # fmt: skip
        return _StdResponse(conn, conn.getresponse())
    except BaseException:
        conn.close()
        raise


# -- verification ------------------------------------------------------------------------------


class _TrailingHash:
    """Hashes a file by re-reading it from disk in a second thread, trailing the writer.

    The writer calls `advance(n)` once the first n bytes are written, `reset()` when it truncates
    the file, and `finish(size)` at the end. The digest is of the bytes on disk, not of the bytes
    the writer meant to write, and costs little extra time: hashing overlaps the download.
    """

    def __init__(self, path: Path, git_size: int | None = None) -> None:
        self.fd = os.open(path, os.O_RDONLY)
        self.git_size = git_size  # also compute the git blob id (sha1) for files kept in git
        self.cond = threading.Condition()
        self.limit = 0
        self.gen = 0
        self.closed = False  # the writer is done
        self.stop = False  # give up (an error, or after finish)
        self.result: tuple[int, int, str, str] | None = None  # (gen, size, sha256, git oid)
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, name="localllm-verify", daemon=True)
        self.thread.start()

    def advance(self, limit: int) -> None:
        with self.cond:
            self.limit = limit
            self.cond.notify()

    def reset(self) -> None:
        with self.cond:
            self.gen += 1
            self.limit = 0
            self.cond.notify()

    def finish(self, size: int) -> tuple[str, str]:
        """The digests of the first `size` bytes (the whole file, which the writer has synced)."""
        with self.cond:
            self.limit = size
            self.closed = True
            self.cond.notify()
        self.thread.join()
        if self.error is not None:
            raise self.error
        assert self.result is not None and self.result[:2] == (self.gen, size)
        return self.result[2], self.result[3]

    def close(self) -> None:
        with self.cond:
            self.stop = True
            self.cond.notify()
        self.thread.join()
        os.close(self.fd)

    def _run(self) -> None:
        try:
            gen, pos, sha, git = -1, 0, hashlib.sha256(), None
            while True:
                with self.cond:
                    while (not self.stop and not self.closed and self.gen == gen
                           and pos >= self.limit):  # fmt: skip
                        self.cond.wait()
                    if self.stop:
                        return
                    if self.gen != gen:  # first round, or the writer truncated the file
                        gen, pos, sha = self.gen, 0, hashlib.sha256()
                        git = hashlib.sha1(b"blob %d\0" % self.git_size) if self.git_size else None
                        continue
                    if pos >= self.limit:  # the writer is done and we caught up
                        self.result = (gen, pos, sha.hexdigest(), git.hexdigest() if git else "")
                        return
                    end = min(self.limit, pos + CHUNK)
                data = os.pread(self.fd, end - pos, pos)
                if not data:
                    raise StoreError("the file being verified shrank while it was read")
                sha.update(data)
                if git is not None:
                    git.update(data)
                pos += len(data)
        except BaseException as e:  # handed to the writer by finish()
            self.error = e
