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
    assert head_info(tmp_path / "h.safetensors", "a" * 64) == {"step": 1, "tokens": 8, "seconds": 1.0, "agree": 0.5}
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
