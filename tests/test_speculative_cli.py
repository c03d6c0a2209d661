"""`--speculative` at the front doors (issue 13; issue 32: the engine drafts and verifies, the torch
runner evaluates): `run --stats`, `eval --speculative` (lookup, a draft model, `self` tuned to pay
or not), `localllm tune` and the stored choice `self` reads back, the Python API's per-call mode,
the off-switch through the engine, and one line for each combination that cannot run."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from test_cli import assert_one_line_error, run

from localllm.models_registry.store import Store

from conftest import need

COPY = "red green blue, " * 5 + "red"  # the model goes on with the pattern


def test_run_stats_show_acceptance_and_the_text_is_plain_greedy(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """fp32 on the torch engine: `--speculative lookup` prints what plain greedy prints, and
    `--stats` says how many drafts were accepted in how many passes."""
    need("torch", "pip install -e '.[dev]'")
    args = ["run", "smollm2", COPY, "--raw", "--backend", "torch", "--dtype", "f32",
            "--temperature", "0", "--max-tokens", "40", "--stats"]  # fmt: skip
    rc, plain, err = run(args, capsys)
    assert rc == 0, err and "speculative" not in err
    rc, out, err = run([*args, "--speculative", "lookup"], capsys)
    assert rc == 0, err
    assert out == plain
    line = next(ln for ln in err.splitlines() if ln.startswith("speculative lookup:"))
    assert "drafted tokens accepted" in line and "tokens per pass" in line


def test_run_json_carries_the_speculative_stats(capsys: pytest.CaptureFixture[str]) -> None:
    need("torch", "pip install -e '.[dev]'")
    rc, out, err = run(["run", "smollm2", COPY, "--raw", "--backend", "torch", "--temperature", "0",
                        "--max-tokens", "30", "--speculative", "lookup", "--json"], capsys)  # fmt: skip
    assert rc == 0, err
    sp = json.loads(out)["speculative"]
    assert sp["mode"] == "lookup" and sp["passes"] >= 1 and sp["accepted"] <= sp["drafted"]
    assert sp["tokens_per_pass"] >= 1 and 0 <= sp["acceptance"] <= 1
    assert sp["rounds"] >= 1 and sp["accepted"] > 0  # a repeated sentence is easy to look up


def test_eval_measures_a_drafters_acceptance(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    need("torch", "pip install -e '.[dev]'")
    text = tmp_path / "t.txt"
    text.write_text(COPY)
    rc, out, err = run(["eval", "smollm2", "--text", str(text), "--backend", "torch",
                        "--speculative", "lookup", "--json"], capsys)  # fmt: skip
    assert rc == 0, err
    sp = json.loads(out)["speculative"]
    assert sp["mode"] == "lookup" and sp["proposed"] > 10 and 0.3 < sp["coverage"] <= 1
    assert sp["acceptance"] > 0.5 and sp["tokens_per_pass"] > 1.5  # the sentence repeats
    rc, out, err = run(["eval", "smollm2", "--text", str(text), "--backend", "torch",
                        "--speculative", "lookup"], capsys)  # fmt: skip
    assert rc == 0 and "speculative lookup: a draft at" in out


def test_eval_measures_a_draft_models_acceptance(tmp_path: Path,
                                                 capsys: pytest.CaptureFixture[str]) -> None:  # fmt: skip
    """The model as its own draft (a second runner of the same file and options): its teacher-
    forced choice is the model's at every position, so α is 1 and a pass yields k + 1 tokens."""
    need("torch", "pip install -e '.[dev]'")
    from localllm.engine.speculative import DRAFT_K

    text = tmp_path / "t.txt"
    text.write_text("Once upon a time, a little fox lived in the woods. " + COPY)
    rc, out, err = run(["eval", "smollm2", "--text", str(text), "--backend", "torch",
                        "--speculative", "draft:smollm2", "--json"], capsys)  # fmt: skip
    assert rc == 0, err
    r = json.loads(out)
    sp = r["speculative"]
    assert sp["mode"] == "draft" and sp["proposed"] == r["tokens"] and sp["coverage"] == 1.0
    assert sp["acceptance"] == 1.0 and sp["k"] == DRAFT_K and sp["tokens_per_pass"] == DRAFT_K + 1


def test_tune_prints_the_table_and_keeps_the_choice(tiny_llama: Path, capsys: pytest.CaptureFixture[str],
                                                   monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    """`localllm tune` on a 2-layer model: the JSON lists every measured row; the choice is kept
    in the store, and the `self` mode reads it back instead of searching again."""
    need("torch", "pip install -e '.[dev]'")
    Store().add_file(tiny_llama, "tiny", source="file:x")
    rc, out, err = run(["tune", "tiny", "--json"], capsys)
    assert rc == 0, err
    r = json.loads(out)
    assert r["table"] and all({"skip", "k", "agreement", "tokens_per_s", "speedup"} <= set(row)
                              for row in r["table"])  # fmt: skip
    stored = list((Store().home / "tuned").glob("*.json"))
    assert len(stored) == 1
    kept = json.loads(stored[0].read_text())
    assert list(kept) == [r["device"]] and kept[r["device"]]["table"] == r["table"]
    mine = kept[r["device"]]
    assert tuple(mine["skip"]) == tuple(r["skip"]) and mine["pays"] == r["pays"]
    from localllm.engine import tune

    calls = []
    monkeypatch.setattr(tune, "tune", lambda *a, **k: calls.append(1))
    rc, out, err = run(["run", "tiny", "hello", "--raw", "--backend", "torch", "--max-tokens", "5",
                        "--speculative", "self", "--json"], capsys)  # fmt: skip
    assert rc == 0, err
    assert not calls
    assert json.loads(out)["speculative"]["mode"] == "self"


def _store_self(key_file: Path, device: str, config: object) -> None:
    """Replace the stored `self` choice for `device` (as `localllm tune` writes it)."""
    from localllm.engine import tune

    key_file.unlink()
    tune.save(key_file, device, config)  # type: ignore[arg-type]


def test_self_decodes_plainly_where_it_does_not_pay(tiny_llama: Path,
                                                    capsys: pytest.CaptureFixture[str]) -> None:  # fmt: skip
    """Where tuning found that no skip set pays, `--speculative self` drafts nothing: the text is
    plain greedy's, no round ran, and eval says it decodes plainly. Where it pays, the stored
    skip set drafts (eval measures it at every position, at the stored draft length)."""
    need("torch", "pip install -e '.[dev]'")
    from localllm.engine import tune

    Store().add_file(tiny_llama, "tiny", source="file:x")
    rc, out, err = run(["tune", "tiny", "--json"], capsys)
    assert rc == 0, err
    device = json.loads(out)["device"]
    (key_file,) = (Store().home / "tuned").glob("*.json")
    _store_self(key_file, device, tune.SelfConfig(pays=False, speedup=1.0))
    args = ["run", "tiny", "hello", "--raw", "--backend", "torch", "--max-tokens", "12",
            "--temperature", "0", "--json"]  # fmt: skip
    rc, out, err = run(args, capsys)
    assert rc == 0, err
    plain = json.loads(out)
    rc, out, err = run([*args, "--speculative", "self"], capsys)
    assert rc == 0, err
    spec = json.loads(out)
    assert spec["text"] == plain["text"]
    assert spec["usage"]["completion_tokens"] == plain["usage"]["completion_tokens"] == 12
    sp = spec["speculative"]
    assert sp["mode"] == "self" and sp["rounds"] == sp["drafted"] == 0 and sp["passes"] == 11
    text = key_file.parent / "t.txt"
    text.write_text(COPY)
    rc, out, err = run(["eval", "tiny", "--text", str(text), "--backend", "torch",
                        "--speculative", "self", "--json"], capsys)  # fmt: skip
    assert rc == 0, err
    sp = json.loads(out)["speculative"]
    assert sp["proposed"] == 0 and sp["k"] == 0 and "decodes plainly" in sp["note"]
    _store_self(key_file, device, tune.SelfConfig(skip=(1,), k=2, pays=True, speedup=1.2))
    rc, out, err = run(["eval", "tiny", "--text", str(text), "--backend", "torch",
                        "--speculative", "self", "--json"], capsys)  # fmt: skip
    assert rc == 0, err
    r = json.loads(out)
    sp = r["speculative"]
    assert "note" not in sp and sp["proposed"] == r["tokens"] and sp["coverage"] == 1.0
    assert sp["k"] == 2 and 0 <= sp["acceptance"] <= 1
    rc, out, err = run([*args, "--speculative", "self"], capsys)
    assert rc == 0, err
    spec = json.loads(out)
    assert spec["text"] == plain["text"] and spec["speculative"]["rounds"] >= 1


@pytest.mark.parametrize(
    ("args", "text"),
    [
        (["--backend", "llama.cpp", "--speculative", "self"], "the torch backend has it"),
        (
            ["--backend", "torch", "--speculative", "lookup", "--streaming", "4:64"],
            "cannot run with --streaming",
        ),
        (
            ["--backend", "torch", "--speculative", "lookup", "--evict", "h2o:64"],
            "cannot run with H2O eviction",
        ),
        (["--backend", "torch", "--speculative", "draft:nosuchmodel"], "nosuchmodel"),
    ],
)
def test_what_cannot_compose_is_one_line(args: list[str], text: str,
                                         capsys: pytest.CaptureFixture[str]) -> None:  # fmt: skip
    need("torch", "pip install -e '.[dev]'")
    rc, out, err = run(["run", "smollm2", "hi", "--max-tokens", "2", *args], capsys)
    assert_one_line_error(rc, out, err, text)


def test_a_draft_with_another_vocabulary_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    need("torch", "pip install -e '.[dev]'")
    need("transformers", "pip install -e '.[dev]'")
    import sys

    sys.path.insert(0, str(Path(__file__).parent / "backends" / "torch"))
    from test_models import hf_model, write_gguf

    other = write_gguf(hf_model("llama"), tmp_path / "other.gguf")  # a vocabulary of its own
    Store().add_file(other, "other", source="file:x")
    rc, out, err = run(["run", "smollm2", "hi", "--backend", "torch", "--max-tokens", "2",
                        "--speculative", "draft:other"], capsys)  # fmt: skip
    assert_one_line_error(rc, out, err, "another vocabulary")


def test_the_off_switch_through_the_engine() -> None:
    """A drafter that is always wrong: speculation switches itself off within a few rounds, the
    result says why, and the text is plain greedy's."""
    need("torch", "pip install -e '.[dev]'")
    from localllm.engine import load
    from localllm.engine.speculative import Draft, Pace

    class Wrong:
        def propose(self, seq, k):  # noqa: ANN001, ANN202
            return Draft([7] * k)  # a byte token the model never says here

    # enough tokens for WINDOW rounds even where each failed round pauses it (1 + 2 + ... + 32)
    n = 110
    with load("smollm2", backend="torch", ctx=256, dtype="f32", threads=2, parallel=1) as llm:
        engines = llm._drafter

        def wrong(spec, policy):  # noqa: ANN001, ANN202
            drafter, pace = engines(spec, policy)
            if pace is None:
                return None, None
            pace = Pace(4, 4)
            pace.plain(1.0)  # speculate from the first pass
            return Wrong(), pace

        llm._drafter = wrong  # type: ignore[method-assign]
        plain = llm.complete("Once upon a time", max_tokens=n, temperature=0)
        spec = llm.complete("Once upon a time", max_tokens=n, temperature=0, speculative="lookup")
    assert spec.token_ids == plain.token_ids and plain.speculative is None
    assert spec.usage.completion_tokens == n
    sp = spec.speculative
    assert sp.switched_off and "rejected" in sp.switched_off and sp.accepted == 0
    assert sp.rounds == sp.rejections == Pace.WINDOW and sp.drafted >= Pace.WINDOW
    assert sp.passes == n - 1  # then plain to the end


def test_the_python_api_takes_a_default_and_a_per_call_mode() -> None:
    need("torch", "pip install -e '.[dev]'")
    import localllm

    with localllm.load("smollm2", backend="torch", speculative="lookup", ctx=256) as llm:
        default = llm.complete(COPY, max_tokens=12, temperature=0)
        off = llm.complete(COPY, max_tokens=12, temperature=0, speculative="off")
        chunks = list(llm.stream(COPY, max_tokens=12, temperature=0))
    assert default.speculative is not None and default.speculative.mode == "lookup"
    assert off.speculative is None and off.text == default.text
    assert chunks[-1].result.speculative.mode == "lookup"
    assert "".join(c.text for c in chunks) == default.text


def test_tune_measures_whether_a_head_drafts_trees(tiny_llama: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Where the model has a draft head, `localllm tune` also measures a chain against a tree of
    drafts beside plain decoding, keeps the choice under the device's key, and `head` drafts
    that way from then on."""
    need("torch", "pip install -e '.[dev]'")
    import torch

    from localllm.backends.torch.draft_head import DraftHead
    from localllm.backends.torch.train_draft import save_head
    from localllm.engine import load
    from localllm.engine.core import head_path
    from localllm.engine.speculative import TREE_WIDTH
    from localllm.types import ContextPolicy

    store = Store()
    record = store.add_file(tiny_llama, "tiny", source="file:x")
    torch.manual_seed(0)
    save_head(DraftHead(64, 4, 2, 128, torch.arange(0, 384, 2)), head_path(store.home, record.digest),
              record.digest)  # fmt: skip
    rc, out, err = run(["tune", "tiny", "--json"], capsys)
    assert rc == 0, err
    r = json.loads(out)
    head = r["head"]
    assert isinstance(head["tree"], bool) and head["tree"] == (head["tree_speedup"] > head["chain_speedup"])
    assert len(head["runs"]["chain"]) == len(head["runs"]["tree"]) == 3
    (key_file,) = (store.home / "tuned").glob("*.json")
    kept = json.loads(key_file.read_text())
    assert kept[r["device"] + "/head"] == head
    for tree in (True, False):
        kept[r["device"] + "/head"]["tree"] = tree
        key_file.write_text(json.dumps(kept))
        with load("tiny", backend="torch", ctx=128) as m:
            drafter, _pace = m._drafter("head", ContextPolicy())
        assert drafter.width == (TREE_WIDTH if tree else 1) and drafter.tree_cost is None
