"""What a release is made of, built as a release builds it (`python -m build`: the sdist, then the
wheel from the sdist) and installed as a user installs it (a fresh venv, dependencies from the
index). The wheel holds every package folder and module on disk (setuptools drops unlisted
remapped subpackages silently; packaging/check_wheel.py checks); ruff refuses the bare folder names
`tui`, `quant`, `models_registry`; the CHANGELOG has the version being built; the Homebrew
template renders for the sdist."""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

import pytest

from conftest import need

ROOT = Path(__file__).resolve().parents[1]
CHECK = ROOT / "packaging" / "check_wheel.py"
RENDER = ROOT / "packaging" / "homebrew" / "render.py"
# what `git ls-files` would hand a release build (a copy: the build leaves build/ and egg-info behind);
# tests/ too, with the corpus, which neither the sdist nor the wheel may carry
SOURCES = ("pyproject.toml", "README.md", "CHANGELOG.md", "MANIFEST.in", "localllm", "tui", "quant",
           "models_registry", "packaging", "scripts", "tests")  # fmt: skip
CORPUS_TEXTS = ("tinyshakespeare.txt", "alice.txt", "moby_dick_part.txt")


def check(wheel: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(CHECK), str(wheel)], capture_output=True, text=True, timeout=60
    )


@pytest.fixture(scope="module")
def dist(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """{"sdist": ..., "wheel": ...} built by `python -m build` from a copy of the sources."""
    need("build", "pip install -e '.[dev]'")
    src = tmp_path_factory.mktemp("src")
    for name in SOURCES:
        p = ROOT / name
        if p.is_dir():
            shutil.copytree(p, src / name, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy(p, src / name)
    out = tmp_path_factory.mktemp("dist")
    p = subprocess.run([sys.executable, "-m", "build", "--no-isolation", "--outdir", str(out), str(src)],
                       capture_output=True, text=True, timeout=600)  # fmt: skip
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    [sdist] = out.glob("localllm-*.tar.gz")
    [whl] = out.glob("localllm-*.whl")
    return {"sdist": sdist, "wheel": whl}


@pytest.fixture(scope="module")
def wheel(dist: dict[str, Path]) -> Path:
    return dist["wheel"]


def test_every_package_folder_and_module_is_in_the_wheel(wheel: Path) -> None:
    p = check(wheel)
    assert p.returncode == 0, p.stdout + p.stderr
    with zipfile.ZipFile(wheel) as z:
        names = set(z.namelist())
    for package in ("localllm/tui", "localllm/quant", "localllm/models_registry"):
        assert f"{package}/__init__.py" in names
    assert "localllm/models_registry/catalog.toml" in names
    assert not any(n.startswith(("tui/", "quant/", "models_registry/", "tests/")) for n in names)
    assert not any(n.endswith(CORPUS_TEXTS) for n in names)


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


def test_the_sdist_carries_the_code_the_changelog_and_the_service_files(dist: dict[str, Path]) -> None:
    from localllm import __version__

    assert dist["sdist"].name == f"localllm-{__version__}.tar.gz"
    assert dist["wheel"].name == f"localllm-{__version__}-py3-none-any.whl"
    top = f"localllm-{__version__}"
    with tarfile.open(dist["sdist"]) as tar:
        names = set(tar.getnames())
    for rel in ("pyproject.toml", "README.md", "CHANGELOG.md", "tui/app.py", "quant/__init__.py",
                "models_registry/catalog.toml", "localllm/data/quality.txt",
                "packaging/systemd/localllm.service", "packaging/launchd/dev.localllm.serve.plist",
                "packaging/homebrew/localllm.rb.in", "packaging/pyinstaller/localllm.spec",
                "scripts/llamacpp-build"):  # fmt: skip
        assert f"{top}/{rel}" in names, rel
    assert not any("__pycache__" in n or n.startswith(f"{top}/tests/") for n in names)
    assert not any(n.endswith(CORPUS_TEXTS) for n in names)


def test_the_changelog_has_the_version_being_built() -> None:
    """The CHANGELOG is kept: the version pyproject builds (localllm.__version__) has a section."""
    from localllm import __version__

    text = (ROOT / "CHANGELOG.md").read_text(encoding="utf-8")
    headings = [ln for ln in text.splitlines() if ln.startswith("## [")]
    assert headings and headings[0].startswith(f"## [{__version__}]"), headings[:1]


# -- installed as a user installs it -------------------------------------------------------------


@pytest.fixture(scope="module")
def fresh_venv(wheel: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A new venv with only the wheel and its declared dependencies (no extras: no llama.cpp, no
    torch), as `pipx install localllm` would make one."""
    venv = tmp_path_factory.mktemp("fresh") / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
    p = subprocess.run([str(venv / "bin" / "python"), "-m", "pip", "install", "-q", "--disable-pip-version-check",
                        str(wheel)], capture_output=True, text=True, timeout=900)  # fmt: skip
    assert p.returncode == 0, "pip install of the wheel failed: " + p.stderr[-3000:]
    return venv


def in_venv(venv: Path, *args: str, home: Path) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env |= {"LOCALLLM_HOME": str(home), "PATH": f"{venv / 'bin'}{os.pathsep}{env.get('PATH', '')}"}
    return subprocess.run(list(args), capture_output=True, text=True, timeout=300, env=env, cwd=home.parent)


def test_the_wheel_installs_and_runs_in_a_fresh_venv(fresh_venv: Path, tmp_path: Path) -> None:
    from localllm import __version__

    home = tmp_path / "home"
    exe = str(fresh_venv / "bin" / "localllm")
    p = in_venv(fresh_venv, exe, "--version", home=home)
    assert p.returncode == 0, p.stderr
    lines = p.stdout.splitlines()
    assert lines[0].startswith(f"localllm {__version__} (Python ")
    assert "llama-cpp-python: not installed (pip install 'localllm[llamacpp]')" in lines
    assert "torch: not installed (pip install 'localllm[torch]')" in lines
    # python -m localllm is the same program
    assert in_venv(fresh_venv, str(fresh_venv / "bin" / "python"), "-m", "localllm", "--version",
                   home=home).stdout == p.stdout  # fmt: skip
    # the import is the installed copy, not this checkout
    where = in_venv(fresh_venv, str(fresh_venv / "bin" / "python"), "-c",
                    "import localllm.tui, localllm.quant; print(localllm.__file__)", home=home)  # fmt: skip
    assert where.returncode == 0 and str(fresh_venv) in where.stdout, where.stdout + where.stderr

    p = in_venv(fresh_venv, exe, "--help", home=home)
    assert p.returncode == 0 and "serve" in p.stdout and "--install-completion" in p.stdout, p.stderr

    p = in_venv(fresh_venv, exe, "list", home=home)
    assert (p.returncode, p.stderr) == (0, "") and "No local models" in p.stdout

    p = in_venv(fresh_venv, exe, "doctor", "--json", home=home)
    report = json.loads(p.stdout)
    checks = {c["name"]: c for c in report["checks"]}
    # neither engine is installed: llama.cpp (the default engine) fails with the install line,
    # torch is optional, and no backend runs
    assert checks["llama_cpp"]["ok"] is False and "pip install 'localllm[llamacpp]'" in checks["llama_cpp"]["fix"]
    assert checks["torch"]["ok"] is None and checks["backends"]["ok"] is False
    assert checks["store"]["ok"] is True and checks["python"]["ok"] is True
    assert p.returncode == (0 if report["ok"] else 1) == 1


# -- Homebrew ------------------------------------------------------------------------------------


def render_formula(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, str(RENDER), *args], capture_output=True, text=True, timeout=60)


def test_the_homebrew_formula_renders_for_the_sdist(dist: dict[str, Path], tmp_path: Path) -> None:
    from localllm import __version__

    sdist = dist["sdist"]
    url = f"https://files.example/localllm-{__version__}.tar.gz"
    out = tmp_path / "localllm.rb"
    p = render_formula(str(sdist), "--url", url, "-o", str(out))
    assert p.returncode == 0, p.stderr
    rb = out.read_text()
    assert not re.search(r"@[A-Z0-9]+@", rb), "a placeholder was left"
    assert f'url "{url}"' in rb
    assert f'sha256 "{hashlib.sha256(sdist.read_bytes()).hexdigest()}"' in rb
    # the service block runs the same server as the systemd unit and the launchd agent
    assert 'run [opt_bin/"localllm", "serve", "--host", "127.0.0.1", "--port", "11435",' in rb
    assert '"--api-key-file", etc/"localllm/api-key"]' in rb and "keep_alive crashed: true" in rb
    assert 'shell_parameter_format: :typer' in rb  # the completion Typer gives (test_completion.py)
    if shutil.which("ruby"):
        syntax = subprocess.run(["ruby", "-c", str(out)], capture_output=True, text=True, timeout=60)
        assert syntax.returncode == 0, syntax.stderr


def test_the_homebrew_renderer_refuses_bad_input(dist: dict[str, Path], tmp_path: Path) -> None:
    p = render_formula(str(dist["sdist"]), "--url", "https://files.example/localllm-9.9.9.tar.gz")
    assert p.returncode == 1 and p.stderr.startswith("error: the URL does not name version")
    junk = tmp_path / "junk.tar.gz"
    junk.write_bytes(b"not a tarball")
    p = render_formula(str(junk), "--url", "https://files.example/x")
    assert p.returncode == 1 and p.stderr.startswith("error: ") and len(p.stderr.splitlines()) == 1
