"""One bench script on two versions of the code, side by side in one run.

    .venv/bin/python bench/before_after.py [--name NAME] [--rounds N] REF SCRIPT -- [script args]

REF is a git revision (a commit before a change); its tree is checked out into a temporary
worktree and SCRIPT (a path under bench/) runs there with that tree first on PYTHONPATH, then
here, alternating for `--rounds` rounds, each writing its JSON into a folder of its own. The runs
share the machine's state within a round, so drift between rounds shows in both. Writes
bench/results/NAME.json: {"before": {"ref": ..., "runs": [...]}, "after": {"runs": [...]}}, every
run's whole JSON kept. The script must honour LOCALLLM_BENCH_RESULTS (bench/common.save does).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from common import BENCH, log, save

ROOT = BENCH.parent


def _run(tree: Path, script: str, args: list[str], out: Path) -> dict:
    env = dict(os.environ, PYTHONPATH=str(tree), LOCALLLM_BENCH_RESULTS=str(out))
    out.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, str(tree / "bench" / script), *args]
    log(f"$ PYTHONPATH={tree} {' '.join(cmd)}")
    subprocess.run(cmd, env=env, check=True, cwd=tree)
    found = sorted(out.rglob("*.json"), key=lambda p: p.stat().st_mtime)
    if not found:
        raise SystemExit(f"{script} wrote no JSON under {out}")
    return json.loads(found[-1].read_text())


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("ref")
    ap.add_argument("script")
    ap.add_argument("--name")
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("rest", nargs=argparse.REMAINDER)
    a = ap.parse_args()
    rest = a.rest[1:] if a.rest[:1] == ["--"] else a.rest
    script = Path(a.script).name
    sha = subprocess.run(["git", "rev-parse", a.ref], cwd=ROOT, check=True, capture_output=True,
                         text=True).stdout.strip()  # fmt: skip
    work = Path(tempfile.mkdtemp(prefix="localllm-before-"))
    before_tree = work / "tree"
    subprocess.run(["git", "worktree", "add", "--detach", str(before_tree), sha], cwd=ROOT,
                   check=True, capture_output=True)  # fmt: skip
    result: dict = {"script": script, "args": rest,
                    "before": {"ref": sha, "runs": []}, "after": {"runs": []}}  # fmt: skip
    try:
        for i in range(a.rounds):
            result["before"]["runs"].append(_run(before_tree, script, rest, work / f"before{i}"))
            result["after"]["runs"].append(_run(ROOT, script, rest, work / f"after{i}"))
    finally:
        subprocess.run(["git", "worktree", "remove", "--force", str(before_tree)], cwd=ROOT,
                       capture_output=True)  # fmt: skip
    save(a.name or f"before_after_{Path(script).stem}", result, quick="--quick" in rest)


if __name__ == "__main__":
    main()
