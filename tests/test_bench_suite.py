"""The benchmark suite cannot rot: `bench/run_all.py --quick` runs every script's smoke mode
(into a temporary results folder) and renders BENCHMARKS.md from what they wrote."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from conftest import need

BENCH = Path(__file__).resolve().parents[1] / "bench"


def test_every_bench_script_runs_quick_and_the_report_has_each(tmp_path: Path, default_model_path: Path,
                                                               corpus_dir: Path) -> None:  # fmt: skip
    need("matplotlib", "pip install -e '.[dev]' (bench/report.py draws the plots)")
    sys.path.insert(0, str(BENCH))
    try:
        from report import SECTIONS
        from run_all import SCRIPTS
    finally:
        sys.path.remove(str(BENCH))
    on_disk = {p.stem for p in BENCH.glob("*.py")} - {"common", "report", "run_all"}
    assert on_disk == set(SCRIPTS), "every bench script is in run_all's list (and only those)"
    assert {name.split("#")[0] for name, *_ in SECTIONS} == set(SCRIPTS), "and has a report section"
    env = os.environ | {"LOCALLLM_BENCH_RESULTS": str(tmp_path / "results"), "LOCALLLM_HOME": str(tmp_path / "home"),
                        "LOCALLLM_CORPUS": str(corpus_dir)}  # fmt: skip
    p = subprocess.run([sys.executable, str(BENCH / "run_all.py"), "--quick"], env=env, capture_output=True,
                       text=True, timeout=1500)  # fmt: skip
    assert p.returncode == 0, p.stderr[-4000:]
    quick = tmp_path / "results" / "quick"
    for name in SCRIPTS:
        data = json.loads((quick / f"{name}.json").read_text())
        assert data["quick"] is True and data["machine"], name
    report = (quick / "BENCHMARKS.md").read_text()
    assert "No result yet" not in report and "was not understood" not in report and "No plot" not in report
    for _, title, *_ in SECTIONS:
        assert f"## {title}" in report
    assert report.count("| figure | value | anchor | anchor value | ratio | target |") >= len(SECTIONS) - 3  # torch_cuda, llamacpp_build: skipped
    for png in (quick / "plots").glob("*.png"):
        assert png.stat().st_size > 5000, png
        assert f"plots/{png.name}" in report
