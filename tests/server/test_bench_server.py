"""`localllm bench --url`: the same measurements against a running server, through its OpenAI
and its Ollama API (the real default model behind our server)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
from servers import real_server
from test_cli import run

from localllm.server.runner import BackgroundServer


@pytest.fixture(scope="module")
def server(default_model_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[BackgroundServer]:
    with real_server(tmp_path_factory.mktemp("home"), parallel=2) as s:
        yield s


@pytest.mark.parametrize("api", ["openai", "ollama", "auto"])
def test_bench_a_server(api: str, server: BackgroundServer, capsys: pytest.CaptureFixture[str]) -> None:
    rc, out, err = run(["bench", "--url", server.url, "--api", api, "--prompt-tokens", "40",
                        "--gen-tokens", "6", "--concurrency", "1,2", "--requests", "2",
                        "--gpu-cost-per-hour", "1", "--json"], capsys)  # fmt: skip
    assert rc in (0, None), err
    r = json.loads(out)
    assert r["target"] == "server" and r["api"] == ("openai" if api == "auto" else api)
    assert r["model"].startswith("smollm2")  # the first the server lists
    for lv in r["levels"]:
        assert lv["requests"] == 2 and lv["prompt_tokens"] > 0
        if api != "ollama":  # ignore_eos reaches the engine through the OpenAI route
            assert lv["completion_tokens"] == 12
        assert 0 < lv["ttft_s"]["p50"] <= lv["e2e_s"]["p99"]
        assert lv["output_tokens_per_s"] > 0 and lv["usd_per_million_output"] > 0
        assert "ceiling_fraction" not in lv  # the server's weights are not known from here
