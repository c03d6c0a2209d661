"""`localllm train-draft` (issue 36, first part): the default model's head trained from its own
answers (and a --text file) for a token budget, kept beside the model under its digest, listed
by `show`; bad text files and broken head files are one line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from test_cli import assert_one_line_error, run

from localllm.engine.core import head_path
from localllm.engine.drafts import head_info
from localllm.models_registry.store import Store

from conftest import need


def test_train_draft_keeps_a_head_that_show_lists(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    need("torch", "pip install -e '.[dev]'")
    text = tmp_path / "notes.txt"
    text.write_text("The quick brown fox jumps over the lazy dog. " * 40)
    rc, out, err = run(["train-draft", "smollm2", "--tokens", "2048", "--text", str(text), "--json"], capsys)
    assert rc == 0, err
    got = json.loads(out)
    assert got["tokens"] == 2048 and got["steps"] == 2 and 0 <= got["agreement"] <= 1
    store = Store()
    path = Path(got["path"])
    digest = next(r.digest for r in store.list() if r.digest.startswith(path.stem))
    assert path.exists() and path == head_path(store.home, digest)
    info = head_info(path, digest)
    assert info is not None and info["tokens"] == 2048
    rc, out, err = run(["show", "smollm2"], capsys)
    assert rc == 0, err
    assert "draft head      trained on 2,048 tokens" in out
    rc, out, _ = run(["show", "smollm2", "--json"], capsys)
    assert json.loads(out)["draft_head"]["tokens"] == 2048
    path.write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json at all}")  # broken
    rc, out, err = run(["show", "smollm2"], capsys)
    assert rc == 0 and "not a draft head" in out, err


def test_a_text_file_that_cannot_be_read_is_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    need("torch", "pip install -e '.[dev]'")
    rc, out, err = run(["train-draft", "smollm2", "--tokens", "4096", "--text", str(tmp_path / "missing.txt")],
                       capsys)  # fmt: skip
    assert_one_line_error(rc, out, err, "missing.txt: cannot read it")
    rc, out, err = run(["train-draft", "smollm2", "--tokens", "0"], capsys)
    assert_one_line_error(rc, out, err, "--tokens and --minutes must be above 0")


def test_head_info_refuses_another_models_head(tmp_path: Path) -> None:
    need("torch", "pip install -e '.[dev]'")
    import torch

    from localllm.backends.torch.draft_head import DraftHead
    from localllm.backends.torch.train_draft import _save, _state

    _save(tmp_path / "h.safetensors", *_state(DraftHead(64, 4, 2, 128, torch.arange(3)), "a" * 64,
                                              step=1, tokens=8, seconds=1.0, agree=0.5))  # fmt: skip
    assert head_info(tmp_path / "h.safetensors", "a" * 64) == {"step": 1, "tokens": 8, "seconds": 1.0, "agree": 0.5,
                                                             "source": None}
    assert "not a draft head of this model" in head_info(tmp_path / "h.safetensors", "b" * 64)["error"]
    assert head_info(tmp_path / "none.safetensors", "a" * 64) is None


def test_a_runs_text_is_kept_for_its_resumption(tmp_path: Path) -> None:
    from localllm.engine.drafts import keep_text, kept_text

    path = tmp_path / "drafts" / "x.text.json"
    assert kept_text(path, "a" * 64) is None  # nothing kept
    keep_text(path, "a" * 64, [1, 2, 3], 12.5)
    assert kept_text(path, "a" * 64) == ([1, 2, 3], 12.5)
    assert kept_text(path, "b" * 64) is None  # another model's text is not this run's
    assert not list(path.parent.glob(".*.tmp"))  # written whole, then renamed
    path.write_text('{"digest": "' + "a" * 64 + '", "seconds": 1, "ids": [1, "x"]}')
    assert kept_text(path, "a" * 64) is None  # a damaged file: the text is written again
    path.write_text("{cut off")
    assert kept_text(path, "a" * 64) is None


def eagle_files(folder: Path, dim: int = 576, heads: int = 9, kv: int = 3, ffn: int = 256,
                vocab: int = 49152) -> Path:  # fmt: skip
    """A random EAGLE-1 head as its authors publish one (names and config of SafeAILab/EAGLE:
    `fc` and one Llama decoder layer without its input norm), for a model of width `dim`."""
    import torch
    from safetensors.torch import save_file

    torch.manual_seed(0)
    hd = dim // heads
    shapes = {
        "fc.weight": (dim, 2 * dim), "fc.bias": (dim,),
        "layers.0.self_attn.q_proj.weight": (heads * hd, dim),
        "layers.0.self_attn.k_proj.weight": (kv * hd, dim),
        "layers.0.self_attn.v_proj.weight": (kv * hd, dim),
        "layers.0.self_attn.o_proj.weight": (dim, heads * hd),
        "layers.0.mlp.gate_proj.weight": (ffn, dim), "layers.0.mlp.up_proj.weight": (ffn, dim),
        "layers.0.mlp.down_proj.weight": (dim, ffn),
        "layers.0.post_attention_layernorm.weight": (dim,),
    }  # fmt: skip
    folder.mkdir(parents=True)
    save_file({k: torch.randn(s) / s[-1] ** 0.5 for k, s in shapes.items()}, str(folder / "model.safetensors"))
    (folder / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "hidden_size": dim, "num_attention_heads": heads,
        "num_key_value_heads": kv, "intermediate_size": ffn, "num_hidden_layers": 1,
        "vocab_size": vocab, "rope_theta": 100000.0, "rms_norm_eps": 1e-5}))  # fmt: skip
    return folder


def test_a_published_head_is_taken_from_the_hub(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                               monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    """`train-draft MODEL --from hf.co/ORG/REPO`: the head's two files fetched and verified as a
    pull's, checked against the model, kept as its head (`show` says where it came from), and
    `--speculative head` drafts with it (greedy output unchanged); a head for another width and
    a repo without the files are one line; nothing is left in the store's blobs."""
    need("torch", "pip install -e '.[dev]'")
    from localllm.engine import load

    from fakehub import FakeHub

    good = eagle_files(tmp_path / "good")
    narrow = eagle_files(tmp_path / "narrow", dim=64, heads=4, kv=2)
    with FakeHub() as hub:
        for name in ("config.json", "model.safetensors"):
            hub.add("org/eagle-smollm2", name, good / name, lfs=name.endswith(".safetensors"))
            hub.add("org/eagle-narrow", name, narrow / name, lfs=name.endswith(".safetensors"))
        hub.add("org/empty", "config.json", good / "config.json", lfs=False)
        monkeypatch.setenv("HF_ENDPOINT", hub.url)
        monkeypatch.setenv("HF_HOME", str(tmp_path / "hf-home"))
        monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
        rc, out, err = run(["train-draft", "smollm2", "--from", "hf.co/org/eagle-smollm2", "--json"], capsys)
        assert rc == 0, err
        got = json.loads(out)
        assert got["from"] == "hf.co/org/eagle-smollm2" and Path(got["path"]).is_file()
        assert len(hub.downloads("model.safetensors")) == 1
        rc, out, err = run(["train-draft", "smollm2", "--from", "hf.co/org/eagle-narrow", "--json"], capsys)
        assert_one_line_error(rc, out, err, "a head for a model of width 64, but smollm2:135m-instruct-q4_1's is 576")
        assert len(hub.downloads("model.safetensors")) == 1  # refused on its config alone
        rc, out, err = run(["train-draft", "smollm2", "--from", "hf.co/org/empty", "--json"], capsys)
        assert_one_line_error(rc, out, err, "org/empty has no model.safetensors")
    assert not list(Store().blobs.glob(".partial-*")) and not list(Store().blobs.glob("*.tmp*"))
    rc, out, err = run(["show", "smollm2"], capsys)
    assert rc == 0 and "published, from hf.co/org/eagle-smollm2" in out, err
    with load("smollm2", backend="torch", ctx=256, threads=2, dtype="f32", kv_cache="f32") as m:
        plain = m.complete("The sea is", max_tokens=12, temperature=0, speculative="off")
        drafted = m.complete("The sea is", max_tokens=12, temperature=0, speculative="head")
    assert drafted.token_ids == plain.token_ids and drafted.speculative.mode == "head"
    assert drafted.speculative.drafted > 0  # it drafted with the published head


def test_a_published_head_is_taken_from_a_folder(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    need("torch", "pip install -e '.[dev]'")
    folder = eagle_files(tmp_path / "eagle")
    rc, out, err = run(["train-draft", "smollm2", "--from", str(folder)], capsys)
    assert rc == 0 and f"draft head from {folder} kept at" in out, err
    (folder / "model.safetensors").write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{broken}")
    rc, out, err = run(["train-draft", "smollm2", "--from", str(folder)], capsys)
    assert_one_line_error(rc, out, err, "model.safetensors cannot be read")
