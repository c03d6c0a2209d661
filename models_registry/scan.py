"""Find GGUF models other tools already keep on this machine, and register them by reference.

    Hugging Face hub cache   $HF_HUB_CACHE, else $HF_HOME/hub, else ~/.cache/huggingface/hub
        models--ORG--REPO/refs/main                  the commit `main` points at
        models--ORG--REPO/snapshots/<commit>/F.gguf   symlink → ../../blobs/<sha256> (LFS files)
    Ollama                   $OLLAMA_MODELS, else ~/.ollama/models; and /usr/share/ollama/.ollama/models
        manifests/<host>/<namespace>/<model>/<tag>    JSON; the layer with mediaType
                                                      application/vnd.ollama.image.model is the GGUF
        blobs/sha256-<hex>
    LM Studio                ~/.lmstudio/models and ~/.cache/lm-studio/models
        <publisher>/<repo>/<file>.gguf

`scan()` only reads: folder listings, Ollama manifests and each candidate's GGUF header (every
candidate is parsed through `gguf_file.py`, checked by `model_check.py`, and reported as skipped,
with the reason, if it is not a readable GGUF or its hyperparameters disagree with its tensors).
It hashes nothing. `register_found()` registers each model with `Store.add_reference` (which
checks the file again), so nothing is copied; Hugging Face LFS blobs and Ollama blobs are already
named by their sha256, LM Studio files (and non-LFS Hugging Face files) are hashed at registration,
which reads the whole file once.

Ollama manifests are treated as hostile (CVE-2024-37032): a layer digest must be `sha256:` and 64
hex digits before a path is built from it, and the blob must resolve inside `blobs/`. Oversized,
non-JSON or malformed manifests are reported as skipped, never fatal.

Names: Hugging Face files become `hf.co/ORG/REPO/FILE.gguf` (tagged with the short commit for a
second version of a file from an older snapshot); Ollama models keep their Ollama name
(`llama3.2:3b`, `ns/model:tag`, `hf.co/ORG/REPO:TAG`); LM Studio files become
`publisher/repo:quant`, lowercased. When a name is already taken by a different model,
`register_found` tries `name:tag-2`, `name:tag-3`, …; when it already names the same file (or the
same sha256), the item is reported as already registered, so scanning twice registers nothing new.
Split GGUFs (`-00001-of-0000N.gguf`) and multimodal projectors (`mmproj*`) are skipped.
"""

from __future__ import annotations

import json
import os
import re
import stat
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from localllm.errors import GGUFFormatError, InvalidName, LocalLLMError
from localllm.model_check import read_checked_info
from localllm.model_info import ModelInfo
from localllm.models_registry.names import (
    DEFAULT_TAG,
    SPLIT_GGUF,
    check_digest,
    parse_name,
    slug,
)
from localllm.models_registry.store import ModelRecord, Store, full_name

HUGGINGFACE, OLLAMA, LMSTUDIO = "huggingface", "ollama", "lmstudio"
OLLAMA_MODEL_LAYER = "application/vnd.ollama.image.model"
SYSTEM_OLLAMA = Path("/usr/share/ollama/.ollama/models")  # the Linux service's store
MAX_MANIFEST_BYTES = 1 << 20
MAX_NAME_TRIES = 99

_HEX64 = re.compile(r"[0-9a-f]{64}")
_COMMIT = re.compile(r"[0-9a-f]{40}")


# -- where to look -----------------------------------------------------------------------------


def _env_roots(kind: str, environ: Mapping[str, str] | None = None) -> tuple[Path, ...]:
    env = os.environ if environ is None else environ
    home = Path(env.get("HOME") or Path.home())

    def expand(p: str) -> Path:
        return Path(os.path.expandvars(p)).expanduser()

    if kind == HUGGINGFACE:  # the precedence huggingface_hub.constants uses
        if env.get("HF_HUB_CACHE"):
            return (expand(env["HF_HUB_CACHE"]),)
        if env.get("HUGGINGFACE_HUB_CACHE"):
            return (expand(env["HUGGINGFACE_HUB_CACHE"]),)
        if env.get("HF_HOME"):
            return (expand(env["HF_HOME"]) / "hub",)
        cache = expand(env["XDG_CACHE_HOME"]) if env.get("XDG_CACHE_HOME") else home / ".cache"
        return (cache / "huggingface" / "hub",)
    if kind == OLLAMA:
        user = expand(env["OLLAMA_MODELS"]) if env.get("OLLAMA_MODELS") else home / ".ollama/models"
        system = (SYSTEM_OLLAMA,) if os.access(SYSTEM_OLLAMA, os.R_OK | os.X_OK) else ()
        return (user, *system)
    return (home / ".lmstudio" / "models", home / ".cache" / "lm-studio" / "models")


@dataclass(frozen=True)
class ScanRoots:
    """The folders to scan, per tool. Each field defaults to that tool's usual place(s), read from
    the environment; pass `()` to skip a tool, or other folders to look elsewhere."""

    huggingface: tuple[Path, ...] = field(default_factory=lambda: _env_roots(HUGGINGFACE))
    ollama: tuple[Path, ...] = field(default_factory=lambda: _env_roots(OLLAMA))
    lmstudio: tuple[Path, ...] = field(default_factory=lambda: _env_roots(LMSTUDIO))

    def __post_init__(self) -> None:
        for name in (HUGGINGFACE, OLLAMA, LMSTUDIO):
            value = getattr(self, name)
            paths = (value,) if isinstance(value, (str, os.PathLike)) else value
            object.__setattr__(self, name, tuple(Path(p).expanduser() for p in paths))

    @classmethod
    def from_env(cls, environ: Mapping[str, str]) -> ScanRoots:
        """The default roots as `environ` (instead of `os.environ`) would give them."""
        return cls(*(_env_roots(k, environ) for k in (HUGGINGFACE, OLLAMA, LMSTUDIO)))


# -- what was found ----------------------------------------------------------------------------


@dataclass(frozen=True)
class Found:
    """One candidate. `skipped` holds the one-line reason when it must not be registered."""

    path: Path  # the file as the tool keeps it (for HF, the snapshot path, often a symlink)
    origin: str  # "huggingface" | "ollama" | "lmstudio"
    suggested_name: str  # a valid store name, or "" when none could be made
    digest: str | None = None  # sha256 hex when the tool names the file by it; else hashed later
    info: ModelInfo | None = None
    skipped: str | None = None

    @property
    def ok(self) -> bool:
        return self.skipped is None


@dataclass(frozen=True)
class ScanResult:
    """What `register_found` did with one `Found`."""

    status: str  # "registered" | "already" | "skipped"
    name: str
    path: Path
    origin: str
    reason: str = ""

    def to_dict(self) -> dict[str, Any]:
        return {
            "status": self.status,
            "name": self.name,
            "path": str(self.path),
            "origin": self.origin,
            "reason": self.reason,
        }


def scan(roots: ScanRoots | None = None) -> list[Found]:
    """Every GGUF model found under `roots` (default: each tool's usual folders).

    Folders that do not exist or cannot be read yield nothing; nothing here raises for what
    is on disk. Candidates that are not readable GGUFs come back with `skipped` set.
    """
    roots = roots if roots is not None else ScanRoots()
    found: list[Found] = []
    for root in _unique(roots.huggingface):
        found += _scan_huggingface(root)
    for root in _unique(roots.ollama):
        found += _scan_ollama(root)
    for root in _unique(roots.lmstudio):
        found += _scan_lmstudio(root)
    return found


def register_found(store: Store, found: Iterable[Found]) -> list[ScanResult]:
    """Register each usable `Found` by reference; one result per item, in order.

    A name already used by the same file (or the same sha256) is "already"; a name taken by
    another model moves on to `name:tag-2`, `-3`, … A failure on one item (bad file, a file that
    changed, a full disk) is reported as "skipped" with its reason, and the rest go on.
    """
    records: dict[str, ModelRecord] = {r.name: r for r in store.list()}
    results: list[ScanResult] = []
    for f in found:
        if f.skipped is not None or not f.suggested_name:
            reason = f.skipped or "no usable name"
            results.append(ScanResult("skipped", f.suggested_name, f.path, f.origin, reason))
            continue
        try:
            results.append(_register_one(store, records, f))
        except (LocalLLMError, OSError) as e:
            reason = _one_line(str(e) if isinstance(e, LocalLLMError) else _os_reason(e))
            results.append(ScanResult("skipped", f.suggested_name, f.path, f.origin, reason))
    return results


def _register_one(store: Store, records: dict[str, ModelRecord], f: Found) -> ScanResult:
    real = str(Path(os.path.realpath(f.path)))
    for i in range(1, MAX_NAME_TRIES + 1):
        name = full_name(f.suggested_name if i == 1 else _variant(f.suggested_name, i))
        existing = records.get(name)
        if existing is not None and existing.ref != real:
            if f.digest is not None and existing.digest == f.digest:
                return ScanResult("already", name, f.path, f.origin)
            continue  # taken by a different model
        if existing is not None:  # this very file: unchanged, or changed since the last scan
            try:
                store.path_of(existing)
                return ScanResult("already", name, f.path, f.origin)
            except LocalLLMError:
                pass
        record = store.add_reference(f.path, name, source=f"{f.origin}:{f.path}", digest=f.digest)
        records[name] = record
        reason = "" if existing is None else "updated: the file changed since it was registered"
        return ScanResult("registered", name, f.path, f.origin, reason)
    return ScanResult(
        "skipped", f.suggested_name, f.path, f.origin, "every variant of this name is taken"
    )


def _variant(name: str, i: int) -> str:
    n = parse_name(name)
    return str(n.with_tag(f"{n.tag or DEFAULT_TAG}-{i}"))


# -- Hugging Face hub cache --------------------------------------------------------------------


def _scan_huggingface(root: Path) -> list[Found]:
    found: list[Found] = []
    for repo_dir in _subdirs(root):
        if not repo_dir.name.startswith("models--"):
            continue
        parts = repo_dir.name[len("models--") :].split("--")
        blobs = (repo_dir / "blobs").resolve()
        seen: set[str] = set()  # real paths: one registration per blob
        used_names: set[str] = set()
        for commit in _snapshots_in_order(repo_dir):
            snapshot = repo_dir / "snapshots" / commit
            tag = None if not used_names else commit[:12]
            for path in _gguf_candidates(snapshot, max_depth=6, found=found, origin=HUGGINGFACE):
                real = Path(os.path.realpath(path))
                name = _hf_name(parts, path.relative_to(snapshot))
                if str(real) in seen:
                    used_names.add(name)  # this name is the preferred snapshot's, even when deduped
                    continue
                seen.add(str(real))
                if name in used_names and tag is not None:
                    name = _with_tag(name, tag)
                used_names.add(name)
                digest = real.name if real.parent == blobs and _HEX64.fullmatch(real.name) else None
                found.append(_checked(path, HUGGINGFACE, name, digest))
    return found


def _snapshots_in_order(repo_dir: Path) -> list[str]:
    """Snapshot commits: the one `refs/main` names first, then the newest first."""
    snapshots = _subdirs(repo_dir / "snapshots")
    main = _read_small(repo_dir / "refs" / "main", 256).strip()

    def order(p: Path) -> tuple[int, float, str]:
        try:
            mtime = p.stat().st_mtime
        except OSError:
            mtime = 0.0
        return (0 if p.name == main and _COMMIT.fullmatch(main) else 1, -mtime, p.name)

    return [p.name for p in sorted(snapshots, key=order)]


def _hf_name(parts: list[str], rel: Path) -> str:
    if len(parts) == 2:
        candidate = f"hf.co/{parts[0]}/{parts[1]}/{rel.name}"
        if _valid(candidate):
            return candidate
    return _safe_name(parts[-2:], _stem(rel.name))


# -- Ollama ------------------------------------------------------------------------------------


def _scan_ollama(root: Path) -> list[Found]:
    manifests, blobs_dir = root / "manifests", root / "blobs"
    if not manifests.is_dir():
        return []
    blobs = blobs_dir.resolve()
    found: list[Found] = []
    for path in _walk_files(manifests, max_depth=3):
        rel = path.relative_to(manifests).parts
        if len(rel) != 4 or any(p.startswith(".") for p in rel):
            continue
        host, namespace, model, tag = rel
        name = _ollama_name(host, namespace, model, tag)

        def skip(reason: str, name: str = name, path: Path = path) -> None:
            found.append(Found(path, OLLAMA, name, skipped=reason))

        manifest, why = _read_manifest(path)
        if manifest is None:
            skip(why)
            continue
        layers = [
            layer
            for layer in manifest["layers"]
            if isinstance(layer, dict) and layer.get("mediaType") == OLLAMA_MODEL_LAYER
        ]
        if len(layers) != 1:
            skip("manifest has no model layer" if not layers else "several model layers")
            continue
        layer = layers[0]
        raw = layer.get("digest")
        try:
            if not isinstance(raw, str) or not raw.startswith("sha256:"):
                raise InvalidName(f"bad digest {raw!r}")
            digest = check_digest(raw)
        except InvalidName:
            skip(_one_line(f"manifest has a bad model digest {str(raw)[:80]!r}"))
            continue
        blob = (blobs_dir / f"sha256-{digest}").resolve()
        if blob.parent != blobs:
            skip("model blob resolves outside the blobs folder")
            continue
        try:
            st = os.stat(blob)
        except OSError:
            skip(f"model blob sha256-{digest[:12]}… is missing")
            continue
        size = layer.get("size")
        if isinstance(size, int) and not isinstance(size, bool) and size != st.st_size:
            skip(f"model blob is {st.st_size} bytes, the manifest says {size}")
            continue
        found.append(_checked(blob, OLLAMA, name, digest))
    return found


def _read_manifest(path: Path) -> tuple[dict[str, Any] | None, str]:
    try:
        st = os.stat(path)
        if not stat.S_ISREG(st.st_mode):
            return None, "manifest is not a regular file"
        if st.st_size > MAX_MANIFEST_BYTES:
            return None, f"manifest is too large ({st.st_size} bytes)"
        with open(path, "rb") as f:
            raw = f.read(MAX_MANIFEST_BYTES + 1)
    except OSError as e:
        return None, f"cannot read manifest: {_os_reason(e)}"
    if len(raw) > MAX_MANIFEST_BYTES:
        return None, "manifest is too large"
    try:
        data = json.loads(raw)
    except (ValueError, RecursionError):
        return None, "manifest is not JSON"
    if not isinstance(data, dict) or not isinstance(data.get("layers"), list):
        return None, "manifest is malformed (no list of layers)"
    return data, ""


def _ollama_name(host: str, namespace: str, model: str, tag: str) -> str:
    if host in ("hf.co", "huggingface.co"):  # quant tags in upper case, as `pull` names them
        candidate = f"hf.co/{namespace}/{model}:{tag if tag == DEFAULT_TAG else tag.upper()}"
        if _valid(candidate):
            return candidate
        return _safe_name([namespace, model], tag)
    if host == "registry.ollama.ai" and namespace != "library":
        return _safe_name([namespace, model], tag)
    return _safe_name([model], tag)


# -- LM Studio ---------------------------------------------------------------------------------


def _scan_lmstudio(root: Path) -> list[Found]:
    found: list[Found] = []
    for path in _gguf_candidates(root, max_depth=4, found=found, origin=LMSTUDIO):
        rel = path.relative_to(root).parts
        found.append(_checked(path, LMSTUDIO, _lmstudio_name(rel, None), None, lm_parts=rel))
    return found


def _lmstudio_name(rel: tuple[str, ...], quant: str | None) -> str:
    """`publisher/repo:quant` (a trailing `-GGUF` dropped from the repo), lowercased."""
    stem = _stem(rel[-1])
    tag = quant if quant and quant != "unknown" else stem
    if len(rel) >= 3:
        repo = re.sub(r"[-_.]gguf$", "", rel[-2], flags=re.IGNORECASE) or rel[-2]
        return _safe_name([rel[-3], repo], tag)
    return _safe_name([stem], tag)


# -- shared helpers ----------------------------------------------------------------------------


def _checked(
    path: Path,
    origin: str,
    name: str,
    digest: str | None,
    *,
    lm_parts: tuple[str, ...] | None = None,
) -> Found:
    """A Found for `path` after reading its GGUF header; skipped with the reason if it fails."""
    try:
        st = os.stat(path)
        if not stat.S_ISREG(st.st_mode):
            return Found(path, origin, name, digest, skipped="not a regular file")
        info = read_checked_info(str(path))
    except GGUFFormatError as e:
        return Found(path, origin, name, digest, skipped=_one_line(f"{e.what}: {e.reason}"))
    except LocalLLMError as e:
        return Found(path, origin, name, digest, skipped=_one_line(str(e)))
    except OSError as e:
        return Found(path, origin, name, digest, skipped=f"cannot read: {_os_reason(e)}")
    if lm_parts is not None:
        name = _lmstudio_name(lm_parts, info.quant)
    return Found(path, origin, name, digest, info=info)


def _gguf_candidates(
    root: Path, *, max_depth: int, found: list[Found], origin: str
) -> Iterator[Path]:
    """`*.gguf` files under `root`, less projectors and split parts (those go to `found` as
    skipped, one entry per split set)."""
    splits: dict[tuple[Path, str, str], Path] = {}
    for path in _walk_files(root, max_depth=max_depth):
        lower = path.name.lower()
        if not lower.endswith(".gguf") or lower.startswith("."):
            continue
        if "mmproj" in lower:
            continue  # a vision projector is not a model on its own
        m = SPLIT_GGUF.fullmatch(path.name)
        if m:
            key = (path.parent, m["stem"], m["total"])
            splits[key] = min(splits.get(key, path), path)
            continue
        yield path
    for (_, _, total), path in sorted(splits.items(), key=lambda kv: str(kv[1])):
        found.append(
            Found(
                path,
                origin,
                "",
                skipped=f"split GGUF ({int(total)} parts): not supported by scan yet",
            )
        )


def _walk_files(root: Path, *, max_depth: int) -> list[Path]:
    """Files (or symlinks to files) under `root`, sorted; symlinked folders are not entered."""
    out: list[Path] = []
    stack = [(root, 0)]
    while stack:
        folder, depth = stack.pop()
        try:
            with os.scandir(folder) as it:
                entries = list(it)
        except OSError:
            continue
        for e in entries:
            try:
                if e.is_dir(follow_symlinks=False):
                    if depth < max_depth:
                        stack.append((Path(e.path), depth + 1))
                elif e.is_file():
                    out.append(Path(e.path))
            except OSError:
                continue
    return sorted(out)


def _subdirs(folder: Path) -> list[Path]:
    try:
        with os.scandir(folder) as it:
            return sorted(Path(e.path) for e in it if e.is_dir(follow_symlinks=False))
    except OSError:
        return []


def _unique(paths: Iterable[Path]) -> list[Path]:
    seen: set[str] = set()
    out = []
    for p in paths:
        key = os.path.realpath(p)
        if key not in seen:
            seen.add(key)
            out.append(p)
    return out


def _read_small(path: Path, limit: int) -> str:
    try:
        with open(path, "rb") as f:
            return f.read(limit).decode("ascii", "replace")
    except OSError:
        return ""


def _stem(filename: str) -> str:
    return filename[:-5] if filename.lower().endswith(".gguf") else filename


def _safe_name(parts: list[str], tag: str | None) -> str:
    """A valid store name from arbitrary folder and file names: lowercase, [a-z0-9._-], at most
    one '/'; "" when nothing usable is left."""
    segments = [s for s in (slug(p, 96) for p in parts[-2:]) if s]
    if not segments:
        return ""
    tag_slug = slug(tag, 128) if tag else ""
    name = "/".join(segments) + (f":{tag_slug}" if tag_slug else "")
    if _valid(name):
        return name
    return segments[-1] if _valid(segments[-1]) else ""


def _with_tag(name: str, tag: str) -> str:
    n = parse_name(name)
    return str(n.with_tag(tag))


def _valid(name: str) -> bool:
    try:
        parse_name(name)
    except InvalidName:
        return False
    return True


def _one_line(text: str) -> str:
    return " ".join(text.split())


def _os_reason(e: OSError) -> str:
    return e.strerror or str(e)
