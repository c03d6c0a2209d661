"""The wheel holds every package folder on disk (setuptools drops unlisted remapped subpackages
silently), and ruff refuses the bare folder names `tui`, `quant`, `models_registry`."""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from conftest import need

ROOT = Path(__file__).resolve().parents[1]
# folder on disk → the package name it installs as
FOLDERS = {"localllm": "localllm", "tui": "localllm.tui", "quant": "localllm.quant",
           "models_registry": "localllm.models_registry"}  # fmt: skip


def packages_on_disk() -> set[str]:
    found = set()
    for folder, package in FOLDERS.items():
        for init in (ROOT / folder).rglob("__init__.py"):
            rel = init.parent.relative_to(ROOT / folder).parts
            found.add(".".join((package, *rel)))
    return found


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> zipfile.ZipFile:
    need("setuptools", "pip install -e '.[dev]'")
    src = tmp_path_factory.mktemp("src")
    for name in ("pyproject.toml", "README.md", *FOLDERS):
        p = ROOT / name
        if p.is_dir():
            shutil.copytree(p, src / name, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy(p, src / name)
    out = tmp_path_factory.mktemp("wheel")
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(out), str(src)],
        check=True, capture_output=True, timeout=300,
    )  # fmt: skip
    [whl] = out.glob("localllm-*.whl")
    return zipfile.ZipFile(whl)


def test_every_package_folder_is_in_the_wheel(wheel: zipfile.ZipFile) -> None:
    in_wheel = {
        n.rsplit("/", 1)[0].replace("/", ".")
        for n in wheel.namelist()
        if n.endswith("/__init__.py")
    }
    missing = packages_on_disk() - in_wheel
    assert not missing, (
        f"add these to [tool.setuptools] packages in pyproject.toml: {sorted(missing)}"
    )
    assert {"localllm.tui", "localllm.quant", "localllm.models_registry"} <= in_wheel


def test_data_files_are_in_the_wheel(wheel: zipfile.ZipFile) -> None:
    names = set(wheel.namelist())
    assert "localllm/models_registry/catalog.toml" in names
    assert not any(n.startswith(("tui/", "quant/", "models_registry/", "tests/")) for n in names)


def test_every_module_is_in_the_wheel(wheel: zipfile.ZipFile) -> None:
    names = set(wheel.namelist())
    for folder, package in FOLDERS.items():
        for py in (ROOT / folder).rglob("*.py"):
            rel = py.relative_to(ROOT / folder).as_posix()
            assert f"{package.replace('.', '/')}/{rel}" in names, rel


@pytest.mark.parametrize(
    "line", ["import tui", "from quant import x", "import models_registry.store"]
)
def test_ruff_bans_bare_folder_names(line: str) -> None:
    need("ruff", "pip install -e '.[dev]'")
    p = subprocess.run(
        [sys.executable, "-m", "ruff", "check", "--config", str(ROOT / "pyproject.toml"),
         "--stdin-filename", "probe.py", "--select", "TID251", "-"],
        input=line + "\n", capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert p.returncode == 1 and "TID251" in p.stdout, p.stdout + p.stderr


def test_installed_names_import() -> None:
    import localllm.models_registry.store
    import localllm.quant
    import localllm.tui  # noqa: F401
