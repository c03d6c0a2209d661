"""`--speculative` at the front doors (issue 13): `run --stats`, `eval --speculative`, `localllm
tune`, the Python API's per-call mode, the off-switch through the engine, and one line for each
combination that cannot run."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from test_cli import assert_one_line_error, run

from localllm.models_registry.store import Store

from conftest import need

COPY = "red green blue, " * 5 + "red"  # the model goes on with the pattern


def test_run_stats_show_acceptance_and_the_text_is_plain_greedy(capsys: pytest.CaptureFixture[str]) -> None:
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


def test_eval_measures_a_drafters_acceptance(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
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


def test_tune_prints_the_table_and_keeps_the_choice(tiny_llama: Path,
                                                   capsys: pytest.CaptureFixture[str]) -> None:  # fmt: skip
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
    assert len(stored) == 1 and r["device"] in json.loads(stored[0].read_text())
    from localllm.backends.torch import tune

    calls = []
    original = tune.tune
    tune.tune = lambda *a, **k: calls.append(1) or original(*a, **k)  # type: ignore[assignment]
    try:
        rc, out, err = run(["run", "tiny", "hello", "--raw", "--backend", "torch", "--max-tokens", "5",
                            "--speculative", "self", "--json"], capsys)  # fmt: skip
    finally:
        tune.tune = original  # type: ignore[assignment]
    assert rc == 0, err and not calls
    assert json.loads(out)["speculative"]["mode"] == "self"


@pytest.mark.parametrize(
    ("args", "text"),
    [
        (["--backend", "llama.cpp", "--speculative", "self"], "the torch backend has it"),
        (["--backend", "torch", "--speculative", "lookup", "--streaming", "4:64"],
         "cannot run with --streaming"),
        (["--backend", "torch", "--speculative", "lookup", "--evict", "h2o:64"],
         "cannot run with H2O eviction"),
        (["--backend", "torch", "--speculative", "draft:nosuchmodel"], "nosuchmodel"),
    ],
)
def test_what_cannot_compose_is_one_line(args: list[str], text: str,
                                         capsys: pytest.CaptureFixture[str]) -> None:  # fmt: skip
    need("torch", "pip install -e '.[dev]'")
    rc, out, err = run(["run", "smollm2", "hi", "--max-tokens", "2", *args], capsys)
    assert_one_line_error(rc, out, err, text)


def test_a_draft_with_another_vocabulary_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
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


def test_the_off_switch_through_the_engine(default_model_path: Path) -> None:
    """A drafter that is always wrong: speculation switches itself off within a few rounds, the
    result says why, and the text is plain greedy's."""
    need("torch", "pip install -e '.[dev]'")
    from localllm.backends.torch.backend import TorchBackend
    from localllm.backends.torch.speculative import Draft, Pace
    from localllm.engine import Model

    class Wrong:
        def propose(self, slot, k):  # noqa: ANN001, ANN202
            return Draft([7] * k)  # a byte token the model never says here

    b = TorchBackend(default_model_path, n_ctx=256, dtype="f32", threads=2)
    plain_drafter = b._drafter

    def wrong(seq):  # noqa: ANN001, ANN202
        drafter, pace = plain_drafter(seq)
        if pace is None:
            return None, None
        pace = Pace(4, 4)
        pace.plain(1.0)  # speculate from the first pass
        return Wrong(), pace

    b._drafter = wrong  # type: ignore[method-assign]
    # enough tokens for WINDOW rounds even where each failed round pauses it (1 + 2 + ... + 32)
    n = 110
    with Model(b, "smollm2") as llm:
        plain = llm.complete("Once upon a time", max_tokens=n, temperature=0)
        spec = llm.complete("Once upon a time", max_tokens=n, temperature=0, speculative="lookup")
    assert spec.token_ids == plain.token_ids and plain.speculative is None
    assert spec.usage.completion_tokens == n
    sp = spec.speculative
    assert sp.switched_off and "rejected" in sp.switched_off and sp.accepted == 0
    assert sp.rounds == Pace.WINDOW and sp.passes == n - 1  # then plain to the end


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
