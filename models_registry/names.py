"""Model names: `name[:tag]`, `hf.co/ORG/REPO[:QUANT]`, `hf.co/ORG/REPO/FILE.gguf`.

Names come from users and from remote metadata, so they are checked before anything is built
from them: no `..`, no absolute paths, no backslashes, no control or non-ASCII characters. The
store never builds a path from a name anyway (blobs are named by digest), but a name that could
become one is refused here, with one line saying why.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path

from localllm.errors import InvalidName

HF_PREFIX = "hf.co/"
DEFAULT_TAG = "latest"
DEFAULT_QUANT = "Q4_K_M"  # what `hf.co/ORG/REPO` without a tag means
_SEGMENT = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,95}")
_TAG = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
_DIGEST = re.compile(r"[0-9a-f]{64}")


@dataclass(frozen=True)
class ModelName:
    """A parsed name. `tag` is None when the user gave none (the catalog picks its default)."""

    name: str  # `smollm2`, `library/foo`, or `hf.co/ORG/REPO[/FILE.gguf]`
    tag: str | None = None

    @property
    def is_hf(self) -> bool:
        return self.name.startswith(HF_PREFIX)

    def with_tag(self, tag: str) -> ModelName:
        return ModelName(self.name, tag)

    def __str__(self) -> str:
        return f"{self.name}:{self.tag}" if self.tag else self.name


def parse_name(text: str) -> ModelName:
    """Parse and validate a model name; raise InvalidName with the reason."""
    if not isinstance(text, str) or not text.strip():
        raise InvalidName("empty model name")
    raw = text.strip()
    if len(raw) > 300:
        raise InvalidName("model name is too long")
    if not raw.isascii() or not raw.isprintable():
        raise InvalidName(f"model name {raw!r} contains characters that are not allowed")
    if raw.startswith(("/", "\\", "~")) or "\\" in raw or "//" in raw or ":/" in raw:
        raise InvalidName(f"model name {raw!r} looks like a path; use `localllm import PATH`")
    body, tag = raw, None
    if ":" in raw:
        body, tag = raw.rsplit(":", 1)
        if not _TAG.fullmatch(tag):
            raise InvalidName(f"bad tag {tag!r} in {raw!r} (letters, digits, '.', '_', '-')")
    segments = body.split("/")
    if any(s in ("", ".", "..") for s in segments):
        raise InvalidName(f"model name {raw!r} has an empty or '..' part")
    if body.startswith(HF_PREFIX):
        parts = segments[1:]
        if len(parts) not in (2, 3) or (len(parts) == 3 and not parts[2].endswith(".gguf")):
            raise InvalidName(
                f"bad name {raw!r}: use hf.co/ORG/REPO[:QUANT] or hf.co/ORG/REPO/FILE.gguf"
            )
    elif len(segments) > 2:
        raise InvalidName(f"model name {raw!r} has too many '/' parts")
    else:
        parts = segments
    for s in parts:
        if not _SEGMENT.fullmatch(s):
            raise InvalidName(f"bad part {s!r} in model name {raw!r}")
    return ModelName(body, tag)


def check_digest(digest: str) -> str:
    """A sha256 hex digest (optionally `sha256:`-prefixed) → the bare 64 lowercase hex chars."""
    d = digest[7:] if digest.startswith("sha256:") else digest
    if not _DIGEST.fullmatch(d):
        raise InvalidName(f"bad sha256 digest {digest!r}")
    return d


def hf_store_name(name: ModelName) -> str:
    """The store name of a Hugging Face name: a repo takes its quant as the tag, in upper case."""
    if name.name.count("/") == 2:  # hf.co/ORG/REPO
        return f"{name.name}:{(name.tag or DEFAULT_QUANT).upper()}"
    return f"{name.name}:{name.tag or DEFAULT_TAG}"


# A part of a split GGUF as llama.cpp's gguf-split names it: `STEM-00001-of-00003.gguf`. The
# numbering is matched exactly as llama.cpp writes it (ASCII digits, lower-case `-of-`); only the
# extension may be in any case, since other tools' folders (scan) hold `.GGUF` files too. Pulls see
# lower-case `.gguf` only (the hub listing is filtered on it) and build part names with
# `split_gguf_name`, which this pattern parses back. Use it with `fullmatch` (it has no anchors).
SPLIT_GGUF = re.compile(r"(?P<stem>.+)-(?P<part>[0-9]{5})-of-(?P<total>[0-9]{5})(?i:\.gguf)")
_UNSAFE = re.compile(r"[^a-z0-9._-]+")


def split_gguf_name(stem: str, part: int, total: int) -> str:
    """The file name of part `part` (from 1) of `total` of a split GGUF; `SPLIT_GGUF` matches it."""
    return f"{stem}-{part:05d}-of-{total:05d}.gguf"


def slug(text: str, limit: int) -> str:
    """`text` lower-cased, each run of characters outside [a-z0-9._-] made one '-', trimmed of
    '-', '.', '_' at both ends, at most `limit` characters; "" when nothing is left."""
    return _UNSAFE.sub("-", text.lower()).strip("-._")[:limit].rstrip("-._")


def name_from_file(path: str | os.PathLike[str]) -> str:
    """A model name for an imported file: its stem, lower case, safe characters only."""
    return slug(Path(path).stem, 96) or "model"
