"""The built-in catalog (`catalog.toml`) and name resolution.

`smollm2` → the family's default tag → `smollm2:135m-instruct-q4_1` → a repo, a file name and,
where known, the file's size, sha256 and an installed Python package that ships it; and the model's
shape, enough for `memory.estimate` to say whether a file fits before it is pulled.
"""

from __future__ import annotations

import importlib.util
import tomllib
from dataclasses import MISSING, dataclass, field, fields
from functools import cache
from pathlib import Path
from typing import Any

from localllm.errors import LocalLLMError, ModelNotFound
from localllm.model_info import ModelInfo
from localllm.models_registry.names import ModelName, check_digest, hf_store_name, parse_name
from localllm.models_registry.store import ModelRecord, Store

CATALOG_PATH = Path(__file__).with_name("catalog.toml")


@dataclass(frozen=True)
class KnownFile:
    """What is known for certain about one file of a variant."""

    size: int | None = None
    sha256: str | None = None
    package: str | None = None
    package_file: str | None = None
    package_parts: tuple[tuple[str, str], ...] = ()


@dataclass(frozen=True)
class Shape:
    """A variant's network shape, the same for every quant: what the KV cache and compute need."""

    architecture: str
    layers: int
    n_embd: int
    heads: int
    kv_heads: int  # per layer
    head_dim_k: int
    head_dim_v: int
    n_ff: int
    vocab_size: int
    sliding_window: int = 0  # 0 when every layer attends to the whole context
    sliding_window_pattern: int = 0  # every Nth layer is global (Gemma 3: 6); not in ModelInfo

    def model_info(
        self, *, weights_bytes: int, context_length: int, name: str = "", quant: str = ""
    ) -> ModelInfo:
        """A ModelInfo for a file of this shape whose tensors take `weights_bytes`.

        The parameter count is not known from the catalog and is left 0; the estimate never uses it.
        """
        return ModelInfo(
            architecture=self.architecture,
            name=name,
            parameters=0,
            quant=quant,
            context_length=context_length,
            n_layers=self.layers,
            n_embd=self.n_embd,
            n_heads=self.heads,
            kv_heads=(self.kv_heads,) * self.layers,
            head_dim_k=self.head_dim_k,
            head_dim_v=self.head_dim_v,
            n_ff=self.n_ff,
            vocab_size=self.vocab_size,
            weights_bytes=weights_bytes,
            file_size=weights_bytes,
            sliding_window=self.sliding_window,
        )


@dataclass(frozen=True)
class Variant:
    tag: str
    params: str
    context: int
    repo: str
    file: str  # with {QUANT} / {quant}
    quants: tuple[str, ...]
    default_quant: str
    approx_size: int = 0
    split: bool = False
    files: dict[str, KnownFile] = field(default_factory=dict)
    shape: Shape | None = None  # None for entries that do not carry one
    sampling: dict[str, Any] = field(default_factory=dict)  # the model card's suggested defaults
    mmproj: str = ""  # its vision projector's file in the same repo (pulled with it), if any

    def filename(self, quant: str) -> str:
        return self.file.replace("{QUANT}", quant.upper()).replace("{quant}", quant.lower())


@dataclass(frozen=True)
class Family:
    name: str
    description: str
    license: str
    default: str
    variants: dict[str, Variant]


@dataclass(frozen=True)
class CatalogEntry:
    """One resolved catalog file: `family:variant-quant`."""

    family: Family
    variant: Variant
    quant: str

    @property
    def name(self) -> str:
        return f"{self.family.name}:{self.variant.tag}-{self.quant.lower()}"

    @property
    def filename(self) -> str:
        return self.variant.filename(self.quant)

    @property
    def known(self) -> KnownFile:
        return self.variant.files.get(self.quant, KnownFile())

    @property
    def size(self) -> tuple[int, bool] | None:
        """(bytes, approximate) of the file: exact where known, else the catalog's rounded
        `approx_size` for the variant's default quant; None when neither is known."""
        if self.known.size:
            return self.known.size, False
        if self.quant == self.variant.default_quant and self.variant.approx_size:
            return self.variant.approx_size, True
        return None

    def model_info(self, size: int | None = None) -> ModelInfo | None:
        """What `memory.estimate` needs for this file, its weights counted as the whole file
        (`size`, else the catalog's size); None without a shape or a size, rather than a guess."""
        if size is None:
            known = self.size
            size = known[0] if known else None
        if self.variant.shape is None or size is None:
            return None
        return self.variant.shape.model_info(
            weights_bytes=size, context_length=self.variant.context, name=self.name,
            quant=self.quant,
        )  # fmt: skip


class Catalog:
    def __init__(self, families: dict[str, Family]) -> None:
        self.families = families

    @classmethod
    def load(cls, path: str | Path = CATALOG_PATH) -> Catalog:
        try:
            data = tomllib.loads(Path(path).read_text())
            return cls({name: _family(name, d) for name, d in data.items()})
        except (OSError, tomllib.TOMLDecodeError, KeyError, TypeError, ValueError) as e:
            raise LocalLLMError(f"the model catalog {path} is broken: {e}") from None

    def default_tag(self, family: str) -> str | None:
        f = self.families.get(family)
        return f.default if f else None

    def resolve(self, name: ModelName) -> CatalogEntry | None:
        """The catalog file for `name`, or None when the catalog does not know it."""
        fam = self.families.get(name.name)
        if fam is None:
            return None
        tag = (name.tag or fam.default).lower()
        for v in fam.variants.values():
            if tag == v.tag.lower():
                return CatalogEntry(fam, v, v.default_quant)
            if tag.startswith(v.tag.lower() + "-"):
                want = tag[len(v.tag) + 1 :]
                for q in v.quants:
                    if q.lower() == want:
                        return CatalogEntry(fam, v, q)
        return None

    def tags(self, family: str) -> list[str]:
        fam = self.families[family]
        return [f"{v.tag}-{q.lower()}" for v in fam.variants.values() for q in v.quants]

    def refuse_unknown_tag(self, name: ModelName) -> None:
        """When `resolve(name)` gave None for a family the catalog knows (so the tag is what is
        wrong): raise ModelNotFound naming some of the family's tags. Otherwise return."""
        if name.name not in self.families:
            return
        tags = self.tags(name.name)
        more = ", ..." if len(tags) > 8 else ""
        raise ModelNotFound(
            f"{name.name} has no tag {name.tag!r} (try: {', '.join(tags[:8])}{more})"
        )


def _family(name: str, d: dict[str, Any]) -> Family:
    parse_name(name)  # catalog names obey the same rules as user names
    variants = {}
    for tag, v in d["variants"].items():
        files = {
            q.upper(): KnownFile(
                size=f.get("size"),
                sha256=check_digest(f["sha256"]) if "sha256" in f else None,
                package=f.get("package"),
                package_file=f.get("package_file"),
                package_parts=tuple((m, p) for m, p in f.get("package_parts", ())),
            )
            for q, f in v.get("files", {}).items()
        }
        variants[tag] = Variant(
            tag=tag,
            params=v["params"],
            context=int(v["context"]),
            repo=v["repo"],
            file=v["file"],
            quants=tuple(q.upper() for q in v["quants"]),
            default_quant=v["default_quant"].upper(),
            approx_size=int(v.get("approx_size", 0)),
            split=bool(v.get("split", False)),
            files=files,
            shape=_shape(v["shape"]) if "shape" in v else None,
            sampling=_sampling(v.get("sampling", {})),
            mmproj=str(v.get("mmproj", "")),
        )
    return Family(name, d.get("description", ""), d.get("license", ""), d["default"], variants)


def _sampling(d: dict[str, Any]) -> dict[str, Any]:
    from localllm.types import SamplingParams

    SamplingParams.from_kwargs(**d)  # unknown keys or impossible values: the catalog is broken
    return dict(d)


def sampling_for(record: ModelRecord, catalog: Catalog | None = None) -> dict[str, Any]:
    """The catalog's suggested sampling for a stored model: by its name, else by its bytes."""
    catalog = catalog or default_catalog()
    try:
        entry = catalog.resolve(parse_name(record.name))
    except LocalLLMError:
        entry = None
    if entry is not None:
        return dict(entry.variant.sampling)
    for fam in catalog.families.values():
        for v in fam.variants.values():
            if any(f.sha256 == record.digest for f in v.files.values()):
                return dict(v.sampling)
    return {}


def _shape(d: dict[str, Any]) -> Shape:
    names = {f.name for f in fields(Shape)}
    if unknown := set(d) - names:
        raise ValueError(f"unknown shape keys {sorted(unknown)}")
    counts = {  # a missing required key is a KeyError, as elsewhere in the catalog
        f.name: int(d[f.name]) if f.name in d or f.default is MISSING else f.default
        for f in fields(Shape)
        if f.name != "architecture"
    }
    shape = Shape(architecture=str(d["architecture"]), **counts)
    if min(shape.layers, shape.heads, shape.kv_heads, shape.head_dim_k, shape.head_dim_v) <= 0:
        raise ValueError(f"shape {d} has an impossible value")
    return shape


@cache
def default_catalog() -> Catalog:
    return Catalog.load()


def _package_dir(module: str) -> Path | None:
    """Where an installed package lives, found without importing it."""
    try:
        spec = importlib.util.find_spec(module)
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(next(iter(spec.submodule_search_locations))).resolve()


def _inside(base: Path, rel: str) -> Path | None:
    p = (base / rel).resolve()
    return p if p.is_relative_to(base) and p.is_file() else None


def packaged_files(known: KnownFile) -> tuple[list[Path], str] | None:
    """The installed package files that hold this model (one file or parts), and their source."""
    if known.package and known.package_file:
        base = _package_dir(known.package)
        p = _inside(base, known.package_file) if base else None
        return ([p], f"package:{known.package}") if p else None
    if known.package_parts:
        parts = []
        for module, rel in known.package_parts:
            base = _package_dir(module)
            p = _inside(base, rel) if base else None
            if p is None:
                return None
            parts.append(p)
        return parts, f"package:{known.package_parts[0][0].rsplit('_part', 1)[0]}"
    return None


def find_local(text: str, store: Store, catalog: Catalog | None = None) -> ModelRecord | None:
    """The stored model a name means: exactly as given, else its catalog name."""
    name = parse_name(text)
    if name.is_hf:  # `hf.co/ORG/REPO` means its Q4_K_M, and quant tags are upper case
        return store.get(hf_store_name(name))
    record = store.get(str(name))
    if record is not None:
        return record
    entry = (catalog or default_catalog()).resolve(name)
    return store.get(entry.name) if entry else None


def ensure_local(text: str, store: Store, catalog: Catalog | None = None) -> ModelRecord:
    """The stored model for a name, registering it from an installed package when one ships it.

    Raises ModelNotFound with what to do when it is neither stored nor available offline.
    """
    catalog = catalog or default_catalog()
    record = find_local(text, store, catalog)
    if record is not None:
        return record
    name = parse_name(text)
    entry = catalog.resolve(name)
    if entry is None:
        catalog.refuse_unknown_tag(name)
        if name.is_hf:
            raise ModelNotFound(f"model {text!r} is not in the store; run `localllm pull {text}`")
        raise ModelNotFound(f"unknown model {text!r}: not in the store nor in the catalog")
    found = packaged_files(entry.known)
    if found is None:
        raise ModelNotFound(
            f"model {entry.name} is not in the store; run `localllm pull {entry.name}`"
        )
    paths, source = found
    return store.add_file(paths, entry.name, source=source, expected_sha256=entry.known.sha256)
