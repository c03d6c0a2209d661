"""The wheel holds every package folder and module on disk (setuptools drops unlisted remapped
subpackages silently; packaging/check_wheel.py checks), and ruff refuses the bare folder names
`tui`, `quant`, `models_registry`."""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from conftest import need

ROOT = Path(__file__).resolve().parents[1]
CHECK = ROOT / "packaging" / "check_wheel.py"
SOURCES = ("pyproject.toml", "README.md", "localllm", "tui", "quant", "models_registry")


def check(wheel: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(CHECK), str(wheel)], capture_output=True, text=True, timeout=60
    )


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    need("setuptools", "pip install -e '.[dev]'")
    src = tmp_path_factory.mktemp("src")
    for name in SOURCES:
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
    return whl


def test_every_package_folder_and_module_is_in_the_wheel(wheel: Path) -> None:
    p = check(wheel)
    assert p.returncode == 0, p.stdout + p.stderr
    with zipfile.ZipFile(wheel) as z:
        names = set(z.namelist())
    for package in ("localllm/tui", "localllm/quant", "localllm/models_registry"):
        assert f"{package}/__init__.py" in names
    assert "localllm/models_registry/catalog.toml" in names
    assert not any(n.startswith(("tui/", "quant/", "models_registry/", "tests/")) for n in names)


def test_check_wheel_catches_a_dropped_subpackage(wheel: Path, tmp_path: Path) -> None:
    """The checker itself can fail: a wheel without localllm/quant/ is refused."""
    broken = tmp_path / wheel.name
    with zipfile.ZipFile(wheel) as src, zipfile.ZipFile(broken, "w") as dst:
        for item in src.infolist():
            if not item.filename.startswith("localllm/quant/"):
                dst.writestr(item, src.read(item))
    p = check(broken)
    assert p.returncode == 1 and "localllm/quant/__init__.py" in p.stdout


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
