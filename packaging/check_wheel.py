"""Check a built wheel before it is published: every package folder and module on disk is in it.

    python packaging/check_wheel.py dist/localllm-*.whl

setuptools silently drops subpackages of remapped folders (`tui/` → `localllm.tui`) unless
pyproject.toml lists them; this catches that, and any missing data file. Exit 1 with the list of
what is missing. tests/test_packaging.py runs it on a freshly built wheel.
"""

from __future__ import annotations

import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# folder on disk → the package it installs as
FOLDERS = {"localllm": "localllm", "tui": "localllm.tui", "quant": "localllm.quant",
           "models_registry": "localllm.models_registry"}  # fmt: skip
DATA_SUFFIXES = (".py", ".toml", ".tcss", ".json", ".txt", ".c")


def expected_files(root: Path = ROOT) -> set[str]:
    """Paths inside the wheel that the source tree says must be there."""
    out = set()
    for folder, package in FOLDERS.items():
        for f in (root / folder).rglob("*"):
            if f.is_file() and f.suffix in DATA_SUFFIXES and "__pycache__" not in f.parts:
                rel = f.relative_to(root / folder).as_posix()
                out.add(f"{package.replace('.', '/')}/{rel}")
    return out


def missing_from(wheel: Path, root: Path = ROOT) -> list[str]:
    with zipfile.ZipFile(wheel) as z:
        names = set(z.namelist())
    return sorted(expected_files(root) - names)


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: check_wheel.py WHEEL", file=sys.stderr)
        return 2
    missing = missing_from(Path(argv[0]))
    if missing:
        print("missing from the wheel (list the packages in pyproject.toml [tool.setuptools]):")
        print("\n".join(f"  {m}" for m in missing))
        return 1
    print(f"ok: {len(expected_files())} files present")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
