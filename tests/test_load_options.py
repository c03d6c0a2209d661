"""Backends by spec, typed load options, refusing what a backend lacks, per-model defaults."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from localllm import backends
from localllm.chat import template_for
from localllm.engine import check_options, load, sampling_defaults
from localllm.errors import LocalLLMError, Unsupported
from localllm.types import LoadOptions


def test_load_options_validate_and_round_trip() -> None:
    o = LoadOptions(kv_cache="k=q8_0,v=q8_0", streaming="4:1020", ctx=2048, parallel=2)
    assert o.kv_cache == "q8_0" and o.context.sinks == 4 and o.context.window == 1020
    assert o.to_dict() == {"ctx": 2048, "kv_cache": "q8_0", "streaming": "4:1020", "parallel": 2}
    assert LoadOptions.from_dict(o.to_dict()) == o
    # forward compatible: a newer localllm's key is ignored (and can be named), not fatal
    saved = o.to_dict() | {"rope_scaling": "yarn"}
    assert LoadOptions.from_dict(saved) == o and LoadOptions.unknown(saved) == ["rope_scaling"]
    assert LoadOptions.from_dict({"ctx": None}) == LoadOptions()
    assert LoadOptions(streaming="off").streaming is None and LoadOptions(speculative="off").speculative is None
    for bad, said in [
        ({"backend": "vllm"}, "unknown backend 'vllm'"),
        ({"device": "tpu"}, "unknown device"),
        ({"ctx": 0}, "--ctx"),
        ({"kv_cache": "q3"}, "unknown KV cache type"),
        ({"streaming": "4"}, "SINKS:WINDOW"),
        ({"evict": "lru:10"}, "h2o:BUDGET"),
        ({"speculative": "draft"}, "draft:MODEL"),
        ({"parallel": 0}, "--parallel"),
        ({"threads": -1}, "--threads"),
    ]:
        with pytest.raises(LocalLLMError, match=said):
            LoadOptions(**bad)


def test_the_registry_names_describes_and_refuses() -> None:
    assert backends.names()[:2] == ("auto", "llama.cpp") and "torch" in backends.names()
    spec = backends.describe("auto")
    assert spec.name == "llama.cpp" and spec.capabilities.batching
    assert backends.get("torch").capabilities.batching  # described without importing torch
    with pytest.raises(LocalLLMError, match="unknown backend 'nope'"):
        backends.get("nope")


def test_describing_backends_imports_none() -> None:
    code = (
        "import sys\n"
        "from localllm import backends\n"
        "from localllm.types import LoadOptions\n"
        "caps = backends.describe(LoadOptions().backend).capabilities\n"
        "assert caps.kv_cache_types and 'llama.cpp' in backends.names()\n"
        "bad = [m for m in ('llama_cpp', 'localllm.backends.llamacpp', 'torch') if m in sys.modules]\n"
        "assert not bad, bad\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_options_a_backend_lacks_are_refused_in_its_words() -> None:
    caps = backends.describe("llama.cpp").capabilities
    check_options(LoadOptions(kv_cache="q8_0", streaming="4:60"), caps, "llama.cpp")
    for opts, said in [
        (LoadOptions(evict="h2o:512"), "no h2o eviction"),
        (LoadOptions(speculative="self"), "no speculative mode 'self' .it has: off, lookup, draft"),
        (LoadOptions(kv_cache="int8"), "no int8 KV cache"),
        (LoadOptions(dtype="bf16"), "no bf16 working dtype"),
    ]:
        with pytest.raises(Unsupported, match=said):
            check_options(opts, caps, "llama.cpp")


def test_load_goes_through_the_registry(default_model_path: Path) -> None:
    import fakebackend

    backends.register(fakebackend.spec(), auto=False)
    try:
        with load("smollm2", backend="fake", ctx=128, parallel=3) as m:
            assert isinstance(m.backend, fakebackend.FakeRunner)
            assert m.n_ctx == 128 and m.parallel == 3 and m.options.backend == "fake"
            assert m.sampling_defaults == {"temperature": 0.2, "top_p": 0.9}  # the catalog's
            assert m.complete("say:hi", max_tokens=5).text == "hi"
        with pytest.raises(Unsupported, match="the fake backend has no q8_0 KV cache"):
            load("smollm2", backend="fake", kv_cache="q8_0")
        with pytest.raises(Unsupported, match="context shift"):
            load("smollm2", backend="fake", streaming="4:64")
    finally:
        backends.unregister("fake")


def test_sampling_defaults_file_then_catalog_then_global(default_model_path: Path, tmp_path: Path) -> None:
    from ggufs import copy_gguf

    assert sampling_defaults(default_model_path) == ({}, "global")
    assert sampling_defaults(default_model_path, {"temperature": 0.2}) == ({"temperature": 0.2}, "catalog")
    marked = copy_gguf(default_model_path, tmp_path / "m.gguf", {
        "general.sampling.temp": 0.6, "general.sampling.top_k": 20, "general.sampling.top_p": 0.8})  # fmt: skip
    values, source = sampling_defaults(marked, {"temperature": 0.2})
    assert source == "model file" and values == {"temperature": pytest.approx(0.6), "top_k": 20,
                                                 "top_p": pytest.approx(0.8)}  # fmt: skip
    impossible = copy_gguf(default_model_path, tmp_path / "bad.gguf", {"general.sampling.top_p": 7.0})
    assert sampling_defaults(impossible, {"temperature": 0.2}) == ({"temperature": 0.2}, "catalog")


def test_user_sampling_wins_over_model_defaults() -> None:
    from fakebackend import FakeRunner

    from localllm.engine import Model

    with Model(FakeRunner(), "fake", sampling_defaults={"temperature": 0.2, "top_p": 0.9}) as m:
        s = m.sampling(temperature=0.7, top_p=None)
        assert (s.temperature, s.top_p, s.top_k) == (0.7, 0.9, 40)


def test_a_model_without_a_template_gets_its_family_or_plain_text() -> None:
    own = template_for({"tokenizer.chat_template": "{{ messages[0]['content'] }}"})
    assert own.origin == "model file" and not own.note
    gemma = template_for({"general.architecture": "gemma3"}, bos_token="<bos>")
    text = gemma.render([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}])
    assert text == "<bos><start_of_turn>user\nBe brief.\n\nHi<end_of_turn>\n<start_of_turn>model\n"
    assert "gemma" in gemma.note
    plain = template_for({"general.architecture": "llama"})
    assert plain.render([{"role": "user", "content": "Once upon a time"}]) == "Once upon a time"
    assert plain.origin == "plain text" and "plain text" in plain.note


def test_gemma_base_model_chats_in_its_own_format(gemma_model_path: Path) -> None:
    """The packaged Gemma 3 270M has no template: ChatML made it echo and emit `<|im_end`."""
    from localllm.models_registry.store import Store

    Store().add_file(gemma_model_path, "gemma3:270m-test", source="file:test")
    with load("gemma3:270m-test", ctx=256, parallel=1) as m:
        assert m.backend.chat_template.origin.startswith("gemma")
        prompt = m.tokenize(m.backend.chat_template.render([{"role": "user", "content": "Hi"}]),
                            add_special=False)  # fmt: skip
        (turn,) = m.tokenize("<start_of_turn>", add_special=False)  # one special token
        assert prompt.count(turn) == 2
        r = m.chat([{"role": "user", "content": "What is the capital of France?"}], max_tokens=24,
                   temperature=0)  # fmt: skip
        assert "<|im_end" not in r.text and "<|im_start" not in r.text
