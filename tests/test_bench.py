"""`localllm bench`: its statistics, cost and ceiling arithmetic on synthetic timings, the
bandwidth probe, and end-to-end runs on the default model (both engines, quick)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
from test_cli import assert_one_line_error, run

from localllm.bench import (
    Price,
    Sample,
    decode_ceiling,
    level_report,
    memory_bandwidth,
    percentile,
    prompts_for,
    summarize,
    weight_bytes_of_file,
)
from localllm.errors import LocalLLMError
from localllm.gguf_file import GGUFFile


def test_percentiles_are_numpys_linear_ones() -> None:
    rng = np.random.default_rng(0)
    for n in (1, 2, 3, 10, 101, 1000):
        xs = list(rng.exponential(0.2, n))
        for q in (0, 50, 95, 99, 100):
            assert percentile(xs, q) == pytest.approx(float(np.percentile(xs, q)), rel=1e-12)
    assert math.isnan(percentile([], 50))
    s = summarize([1.0, 2.0, 3.0, 4.0])
    assert s == {"p50": 2.5, "p95": pytest.approx(3.85), "p99": pytest.approx(3.97), "mean": 2.5}


def test_level_report_on_synthetic_timings() -> None:
    """Four requests of 11 tokens: TPOT is decode time over the 10 tokens after the first;
    throughput is tokens over the level's wall time; prompt rate is prompt tokens over TTFT."""
    samples = [Sample(ttft_s=0.1 * (i + 1), decode_s=1.0 + i, e2e_s=0.1 * (i + 1) + 1.0 + i,
                      prompt_tokens=100, completion_tokens=11) for i in range(4)]  # fmt: skip
    r = level_report(2, samples, wall_s=8.0, price=Price(3.6, "test"), ceiling=50.0)
    assert r["completion_tokens"] == 44 and r["prompt_tokens"] == 400
    assert r["tpot_s"]["p50"] == pytest.approx(0.25)  # (0.1, 0.2, 0.3, 0.4) s per token
    assert r["tpot_s"]["p99"] == pytest.approx(0.397)
    assert r["ttft_s"]["p50"] == pytest.approx(0.25)
    assert r["output_tokens_per_s"] == pytest.approx(44 / 8)
    assert r["input_tokens_per_s"] == pytest.approx(400 / 8)
    assert r["prompt_tokens_per_s"] == pytest.approx(np.median([1000, 500, 1000 / 3, 250]))
    assert r["decode_tokens_per_s"] == pytest.approx(2 / 0.25)  # two streams at the median TPOT
    # 3.6 USD an hour = 0.001 USD a second: 5.5 tokens/s → 0.001 / 5.5 × 1e6 USD per million
    assert r["usd_per_million_output"] == pytest.approx(1e3 / 5.5)
    assert r["ceiling_fraction"] == pytest.approx(8 / 50)
    # the engine says how long the prompt took once it had a slot: that, not the TTFT (queueing)
    queued = [Sample(ttft_s=2.0, decode_s=1.0, e2e_s=3.0, prompt_tokens=100, completion_tokens=11, prompt_s=0.5)]
    assert level_report(1, queued, 3.0)["prompt_tokens_per_s"] == pytest.approx(200)
    # input is priced at the machine's prefill rate: prompt tokens over the time any request was
    # in prefill (the union of sent + TTFT − prompt time … sent + TTFT), not one request's rate
    overlaid = [Sample(1.0, 1.0, 2.0, 100, 11, prompt_s=1.0, start_s=0.0),  # prefill 0 … 1
                Sample(1.5, 1.0, 2.5, 100, 11, prompt_s=1.0, start_s=0.0),  # 0.5 … 1.5 (waited 0.5)
                Sample(0.5, 1.0, 1.5, 100, 11, prompt_s=0.5, start_s=3.0)]  # 3 … 3.5, apart
    r = level_report(2, overlaid, 4.5, price=Price(3.6, "test"))
    assert r["prefill_tokens_per_s"] == pytest.approx(300 / 2.0)
    assert r["prompt_tokens_per_s"] == pytest.approx(100)  # each request's own: 100, 100, 200
    assert r["usd_per_million_input"] == pytest.approx(1e3 / 150)
    # without send times (a caller's samples), the per-request median stands in
    assert level_report(1, queued, 3.0)["prefill_tokens_per_s"] == pytest.approx(200)
    one = level_report(1, [Sample(0.5, 0.0, 0.5, 10, 1)], 0.5)
    assert math.isnan(one["tpot_s"]["p50"]) and one["decode_tokens_per_s"] == 0.0


def test_price_and_ceiling_arithmetic() -> None:
    assert Price.of() is None
    assert Price.of(gpu_cost_per_hour=2.5).usd_per_hour == 2.5
    p = Price.of(watts=350, kwh_price=0.2)
    assert p.usd_per_hour == pytest.approx(0.07) and "350 W" in p.basis
    assert p.per_million(0.0) is None
    assert p.per_million(1000.0) == pytest.approx(0.07 / 3.6e6 * 1e6)
    for bad in ({"watts": 100}, {"kwh_price": 0.1}, {"gpu_cost_per_hour": 1, "watts": 1, "kwh_price": 1},
                {"gpu_cost_per_hour": -1}, {"watts": float("nan"), "kwh_price": 1}):  # fmt: skip
        with pytest.raises(LocalLLMError):
            Price.of(**bad)
    # 20 GB/s over 100 MB of weights: 200 tokens/s alone; 8 streams with 1 MB of KV each
    # read 108 MB a step for 8 tokens
    assert decode_ceiling(20e9, 100e6, 0, 1) == pytest.approx(200)
    assert decode_ceiling(20e9, 100e6, 1e6, 8) == pytest.approx(8 * 20e9 / 108e6)
    assert decode_ceiling(20e9, 0, 0, 1) == math.inf


def test_bandwidth_probe_is_a_plausible_number() -> None:
    bw = memory_bandwidth(nbytes=32 << 20, repeats=2)
    assert 1e8 < bw < 1e13, bw  # between 0.1 GB/s and 10 TB/s: a number, not a unit mistake


def test_weight_bytes_read_per_token(tiny_llama: Path, default_model_path: Path) -> None:
    """Tied head (SmolLM2): every tensor, the embedding read as the head; untied: all but the
    embedding (a step reads one row of it)."""
    for path in (tiny_llama, default_model_path):
        with GGUFFile(path) as f:
            sizes = {n: t.nbytes for n, t in f.tensors.items()}
        want = sum(sizes.values()) - (sizes["token_embd.weight"] if "output.weight" in sizes else 0)
        assert weight_bytes_of_file(path) == want
    assert 90e6 < weight_bytes_of_file(default_model_path) < 100e6  # REFERENCE.md: ≈ 96 MB


def test_prompts_are_the_length_asked_and_differ() -> None:
    tok = lambda s: s.split()  # noqa: E731 - a word a token
    ps = prompts_for(tok, 50, 5, start=3)
    assert len(set(ps)) == 5 and all(p.startswith(f"Request {3 + i}: ") for i, p in enumerate(ps))
    assert all(40 <= len(tok(p)) <= 50 for p in ps)


@pytest.mark.parametrize("backend", ["llama.cpp", "torch"])
def test_bench_json_end_to_end(backend: str, capsys: pytest.CaptureFixture[str],
                               default_model_path: Path) -> None:  # fmt: skip
    rc, out, err = run(["bench", "smollm2", "--backend", backend, "--prompt-tokens", "48",
                        "--gen-tokens", "8", "--concurrency", "1,2", "--requests", "2",
                        "--gpu-cost-per-hour", "1.5", "--json"], capsys)  # fmt: skip
    assert rc in (0, None), err
    r = json.loads(out)
    assert (r["target"], r["backend"], r["model"]) == ("engine", backend, "smollm2:135m-instruct-q4_1")
    assert [lv["concurrency"] for lv in r["levels"]] == [1, 2]
    for lv in r["levels"]:
        assert lv["requests"] == 2 and lv["completion_tokens"] == 16  # ignore_eos: all 8 each
        assert 40 <= lv["prompt_tokens"] / 2 <= 60
        assert 0 < lv["ttft_s"]["p50"] <= lv["ttft_s"]["p99"] <= lv["e2e_s"]["p99"]
        assert lv["tpot_s"]["p50"] > 0 and lv["output_tokens_per_s"] > 0
        assert 0 < lv["ceiling_fraction"] < 1.5, lv  # measured against the probe's ceiling
        assert lv["usd_per_million_output"] == pytest.approx(1.5 / (lv["output_tokens_per_s"] * 3600) * 1e6)
    assert r["memory_bandwidth_bytes_per_s"] > 0 and r["kv_bytes_per_token"] == 23040
    assert r["weights_bytes_per_token"] > 50e6
    assert r["machine"]["cores"] >= 1


def test_bench_table(capsys: pytest.CaptureFixture[str], default_model_path: Path) -> None:
    rc, out, err = run(["bench", "smollm2", "--backend", "llama.cpp", "--prompt-tokens", "16",
                        "--gen-tokens", "4", "--requests", "1", "--watts", "65", "--kwh-price", "0.3"],
                       capsys)  # fmt: skip
    assert rc in (0, None), err
    assert "TTFT ms p50/95/99" in out and "% of ceiling" in out and "USD/M out" in out
    assert "price: 65 W at 0.3 USD per kWh" in out and "memory bandwidth" in out


@pytest.mark.parametrize(("args", "text"), [
    (["--concurrency", "1,x"], "--concurrency takes numbers"),
    (["--concurrency", "0"], "--concurrency levels must be between 1 and 256"),
    (["--gen-tokens", "1"], "--gen-tokens >= 2"),
    (["--watts", "10"], "--watts and --kwh-price go together"),
    (["--requests", "0"], "--requests must be >= 1"),
])  # fmt: skip
def test_bad_options_are_one_line(args: list[str], text: str, capsys: pytest.CaptureFixture[str]) -> None:
    rc, out, err = run(["bench", "smollm2", *args], capsys)
    assert_one_line_error(rc, out, err, text)


def test_unreachable_server_is_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    rc, out, err = run(["bench", "--url", "http://127.0.0.1:9", "--requests", "1"], capsys)
    assert_one_line_error(rc, out, err, "cannot reach http://127.0.0.1:9")


# -- recommend ------------------------------------------------------------------------------


def test_targets_say_what_they_miss() -> None:
    from localllm.recommend import Targets

    row = {"memory_bytes": 2e9, "ttft_p95_s": 0.8, "tokens_per_s": 12.0}
    assert Targets().misses(row) == []
    assert Targets(max_ttft_s=1, min_tokens_per_s=10, max_memory_bytes=3e9).misses(row) == []
    assert Targets(max_ttft_s=0.5, min_tokens_per_s=20, max_memory_bytes=1e9).misses(row) == [
        "memory 2.00 GB > 1 GB", "TTFT p95 0.80 s > 0.5 s", "12.0 tokens/s < 20"]


def test_recommend_end_to_end(capsys: pytest.CaptureFixture[str], tmp_path: Path,
                              default_model_path: Path, tiny_llama: Path) -> None:  # fmt: skip
    """The default model and a Q8_0 of it (one family: KL against the larger) on llama.cpp;
    a random-weight model (its own family) is ranked last for quality; a second run takes the
    kept numbers; a memory target leaves candidates unmeasured and says so."""
    from localllm.models_registry.store import Store
    from localllm.quant.writer import quantize_file

    store = Store()
    q8 = quantize_file(default_model_path, tmp_path / "smollm2-q8_0.gguf", "Q8_0", allow_requantize=True)
    store.import_file(q8.path, "smol-q8:latest")
    store.import_file(tiny_llama, "tiny:latest")
    args = ["recommend", "--backend", "llama.cpp", "--quality-chars", "600", "--min-tokens-per-s", "1",
            "--prompt-tokens", "32", "--gen-tokens", "8",
            "--model", "smollm2", "--model", "smol-q8", "--model", "tiny", "--gpu-cost-per-hour", "1", "--json"]
    rc, out, err = run(args, capsys)
    assert rc in (0, None), err
    r = json.loads(out)
    rows = r["rows"]
    assert {row["model"] for row in rows} == {"smollm2:135m-instruct-q4_1", "smol-q8:latest", "tiny:latest"}
    assert {(row["kv_cache"], row["speculative"]) for row in rows} == {("f16", "off"), ("q8_0", "off"),
                                                                        ("f16", "lookup")}
    by = {(row["model"], row["kv_cache"], row["speculative"]): row for row in rows}
    ref, q4 = by[("smol-q8:latest", "f16", "off")], by[("smollm2:135m-instruct-q4_1", "f16", "off")]
    assert ref["kl_mean"] == 0.0 and ref["reference"] == "smol-q8:latest"  # the family's largest file
    assert q4["reference"] == "smol-q8:latest" and 0 < q4["kl_mean"] < 0.5 and q4["top1_agreement"] < 1
    assert by[("smol-q8:latest", "q8_0", "off")]["kl_mean"] > 0  # its KV cache against f16
    tiny = by[("tiny:latest", "f16", "off")]
    assert tiny["kl_mean"] == 0.0 and tiny["bits_per_char"] > 3 * q4["bits_per_char"]  # random weights
    # llama.cpp's q8_0 cache needs heads of 32: the tiny model (16) cannot run it, and says so
    assert by[("tiny:latest", "q8_0", "off")]["misses"][0].startswith("cannot run: ")
    rows = [row for row in rows if "skipped" not in row]
    assert all(row["meets"] for row in rows) and rows[-1]["model"] == "tiny:latest"
    bpcs = [round(row["bits_per_char"], 2) for row in rows]
    assert bpcs == sorted(bpcs)  # ranked by quality first
    assert all(row["usd_per_million_output"] > 0 and not row["cached"] for row in rows)
    # the second run measures nothing: the same numbers, from the store
    rc, out, err = run(args, capsys)
    again = json.loads(out)["rows"]
    again = [row for row in again if "skipped" not in row]
    assert all(row["cached"] for row in again)
    assert [(x["model"], x["bits_per_char"]) for x in again] == [(x["model"], x["bits_per_char"]) for x in rows]
    # a memory target below every model: nothing measured, each says why
    rc, out, err = run(["recommend", "--backend", "llama.cpp", "--model", "tiny", "--max-memory", "0.001"], capsys)
    assert rc in (0, None), err
    assert "no local model and setting meets every target here" in out and "memory" in out


def test_recommend_with_nothing_local_is_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    rc, out, err = run(["recommend", "--model", "nothing-here"], capsys)
    assert_one_line_error(rc, out, err, "no local models to compare")
