"""A user's `git clone` has nothing beside it: the suite must collect there, and what the tests read
(the corpus) must come from inside the clone. The clone is of the working tree as it stands
(`git stash create` records uncommitted changes to tracked files; untracked files are not in it)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import CORPUS

ROOT = Path(__file__).resolve().parents[1]


def test_the_corpus_is_in_the_repository(corpus_dir: Path) -> None:
    """Without LOCALLLM_CORPUS the fixture is the repository's own folder, and the texts are whole."""
    if os.environ.get("LOCALLLM_CORPUS"):
        pytest.skip(
            "LOCALLLM_CORPUS names another folder for this run; the clone test below unsets it"
        )
    assert corpus_dir == CORPUS and corpus_dir.is_relative_to(ROOT)
    sizes = {p.name: p.stat().st_size for p in corpus_dir.glob("*.txt")}
    assert sizes.keys() == {"tinyshakespeare.txt", "alice.txt", "moby_dick_part.txt"}
    assert sizes["tinyshakespeare.txt"] > 1_000_000 and sizes["moby_dick_part.txt"] > 390_000
    assert (corpus_dir / "README.md").is_file()


def git(*args: str, cwd: Path) -> str:
    return subprocess.run(["git", *args], cwd=cwd, capture_output=True, text=True, check=True,
                          timeout=120).stdout.strip()  # fmt: skip


def working_tree_commit() -> str:
    """The working tree as a commit (`git stash create`; HEAD when nothing changed). Tried again:
    it fails without a word (exit 1) when another git process holds the index lock a moment."""
    for _ in range(10):
        p = subprocess.run(["git", "stash", "create"], cwd=ROOT, capture_output=True, text=True, timeout=120)
        if p.returncode == 0:
            return p.stdout.strip() or "HEAD"
        time.sleep(0.5)
    raise AssertionError(f"git stash create failed 10 times: {p.stderr.strip() or p.returncode}")


@pytest.fixture(scope="module")
def clone(tmp_path_factory: pytest.TempPathFactory) -> Path:
    if shutil.which("git") is None:
        pytest.fail("git is not installed: apt-get install git", pytrace=False)
    if not (ROOT / ".git").exists():
        pytest.fail(f"{ROOT} is not a git checkout: this test clones it", pytrace=False)
    rev = git("rev-parse", working_tree_commit(), cwd=ROOT)
    dest = tmp_path_factory.mktemp("fresh") / "localllm"
    git("clone", "-q", "--no-checkout", str(ROOT), str(dest), cwd=dest.parent)
    git("fetch", "-q", str(ROOT), rev, cwd=dest)  # a stash commit is on no branch the clone has
    git("checkout", "-q", rev, cwd=dest)
    assert sorted(p.name for p in dest.parent.iterdir()) == ["localllm"]  # nothing beside it
    return dest


def pytest_in(clone: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != "LOCALLLM_CORPUS"}
    return subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", *args], cwd=clone,
                          env=env, capture_output=True, text=True, timeout=600)  # fmt: skip


def test_a_fresh_clone_collects_the_whole_suite(clone: Path) -> None:
    p = pytest_in(clone, "--collect-only", "-q")
    out = p.stdout + p.stderr
    assert p.returncode == 0, out[-3000:]
    assert "tests/test_fresh_clone.py::test_the_corpus_is_in_the_repository" in out


def test_the_corpus_fixture_resolves_inside_the_clone(clone: Path) -> None:
    p = pytest_in(clone, "-q", "tests/test_fresh_clone.py::test_the_corpus_is_in_the_repository")
    out = p.stdout + p.stderr
    assert p.returncode == 0 and "1 passed" in out, out[-3000:]
    # the fixture the clone ran is the clone's: its conftest names its own folder
    assert (clone / "tests" / "data" / "corpus" / "tinyshakespeare.txt").is_file()
    assert not (clone.parent / "shared").exists()
