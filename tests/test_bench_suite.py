"""The benchmark suite cannot rot: `bench/run_all.py --quick` runs the scripts' smoke modes (into a
temporary results folder) and renders BENCHMARKS.md from what they wrote.

Every suite runs the scripts whose smoke run takes seconds; the heavy ones (HEAVY: loading
transformers, tuning self-speculation, two servers, quantizing beside llama.cpp, the GEMV and
agreement measurements) run with the rest under `-m slow` (about 9 minutes on 2 cores). Every script is in
run_all's list and has a report section either way."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import need

BENCH = Path(__file__).resolve().parents[1] / "bench"
# smoke runs of 50-85 s each on the 2-core machines, and the two measurements of 20-35 s whose
# every number the tests hold elsewhere (torch_gemv: tests/backends/torch/test_quantized.py;
# llamacpp_agreement: tests/backends/torch/test_vs_llamacpp.py; kv_pool: test_rows.py, after
# loading both models; torch_compile: test_compiled.py, after compiling three times); the rest take 2-20 s
HEAVY = ("torch_engine", "kv_cache", "speculative", "server", "quantize", "torch_gemv", "llamacpp_agreement",
         "streaming_eval", "kv_pool", "torch_compile")


def bench_lists() -> tuple[list[str], list[tuple]]:
    sys.path.insert(0, str(BENCH))
    try:
        from report import SECTIONS
        from run_all import SCRIPTS
    finally:
        sys.path.remove(str(BENCH))
    return SCRIPTS, SECTIONS


def test_every_bench_script_is_listed_and_has_a_report_section() -> None:
    need("matplotlib", "pip install -e '.[dev]' (bench/report.py draws the plots)")
    scripts, sections = bench_lists()
    on_disk = {p.stem for p in BENCH.glob("*.py")} - {"common", "report", "run_all", "before_after"}  # before_after: a tool
    assert on_disk == set(scripts), "every bench script is in run_all's list (and only those)"
    assert {name.split("#")[0] for name, *_ in sections} == set(scripts), "and has a report section"
    assert set(HEAVY) <= set(scripts)


def run_quick(tmp_path: Path, corpus_dir: Path, names: list[str]) -> str:
    """run_all.py --quick for `names`; checks each result; returns the rendered report."""
    need("matplotlib", "pip install -e '.[dev]' (bench/report.py draws the plots)")
    env = os.environ | {"LOCALLLM_BENCH_RESULTS": str(tmp_path / "results"), "LOCALLLM_HOME": str(tmp_path / "home"),
                        "LOCALLLM_CORPUS": str(corpus_dir)}  # fmt: skip
    p = subprocess.run([sys.executable, str(BENCH / "run_all.py"), "--quick", "--only", ",".join(names)], env=env,
                       capture_output=True, text=True, timeout=1500)  # fmt: skip
    assert p.returncode == 0, p.stderr[-4000:]
    quick = tmp_path / "results" / "quick"
    for name in names:
        data = json.loads((quick / f"{name}.json").read_text())
        assert data["quick"] is True and data["machine"], name
    report = (quick / "BENCHMARKS.md").read_text()
    assert "was not understood" not in report
    for png in (quick / "plots").glob("*.png"):
        assert png.stat().st_size > 5000, png
        assert f"plots/{png.name}" in report
    return report


def test_the_fast_bench_scripts_run_quick_and_the_report_has_them(tmp_path: Path, default_model_path: Path,
                                                                   corpus_dir: Path) -> None:  # fmt: skip
    scripts, sections = bench_lists()
    report = run_quick(tmp_path, corpus_dir, [n for n in scripts if n not in HEAVY])
    for name, title, *_ in sections:
        assert f"## {title}" in report
        if name.split("#")[0] in HEAVY:
            continue
        body = report.split(f"## {title}", 1)[1].split("\n## ", 1)[0]
        assert "No result yet" not in body and "No plot" not in body, title


@pytest.mark.slow
def test_every_bench_script_runs_quick_and_the_report_has_each(tmp_path: Path, default_model_path: Path,
                                                               corpus_dir: Path) -> None:  # fmt: skip
    scripts, sections = bench_lists()
    report = run_quick(tmp_path, corpus_dir, scripts)
    assert "No result yet" not in report and "No plot" not in report
    for _, title, *_ in sections:
        assert f"## {title}" in report
    assert report.count("| figure | value | anchor | anchor value | ratio | target |") >= len(sections) - 4  # torch_cuda, llamacpp_build, llamacpp_gpu: skipped
