"""The package as a user installs it: a wheel built from this tree holds every source folder and data file, and the
CLI installed from it (not editable, run from outside the checkout) validates a shipped recipe and runs `doctor`,
with every hpc_tools module it loads coming from the installed copy."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import venv
import zipfile
from pathlib import Path

import pytest

from tests.helpers import REPO, run_cli

PACKAGES = ("hpc_tools", "profiling")
BUILD_FILES = ("setup.cfg", "pyproject.toml", "README.md")  # what setup.cfg reads besides the packages


def source_files() -> list[str]:
    """Every file under the packages (posix paths relative to the repository), caches left out."""
    return sorted(p.relative_to(REPO).as_posix() for top in PACKAGES for p in (REPO / top).rglob("*")
                  if p.is_file() and "__pycache__" not in p.parts and p.suffix != ".pyc")


def test_every_source_folder_is_a_package():
    """`packages = find:` ships only folders with an ``__init__.py``: one without it is missing from every wheel
    (the editable install of a checkout hides that)."""
    folders = {str(Path(f).parent) for f in source_files() if f.endswith(".py")}
    assert "hpc_tools/recipe" in folders and "hpc_tools/train/megatron" in folders
    assert sorted(f for f in folders if not (REPO / f / "__init__.py").is_file()) == []


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    """A wheel of this tree (its packages copied out first: building in the checkout would leave build/ there, and a
    stale build/lib would put deleted modules into the wheel)."""
    work = tmp_path_factory.mktemp("wheel")
    src = work / "src"
    for top in PACKAGES:
        shutil.copytree(REPO / top, src / top, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    for name in BUILD_FILES:
        shutil.copy2(REPO / name, src / name)
    out = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index",
                          "--disable-pip-version-check", "-w", str(work / "dist"), str(src)],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    (built,) = (work / "dist").glob("hpc_tools-*.whl")
    return built


def test_the_wheel_holds_every_source_file_and_data_file(wheel):
    """Every .py file of every folder, and every other file under the packages (the sbatch template, ...), which the
    code reads at run time."""
    names = set(zipfile.ZipFile(wheel).namelist())
    expected = source_files()
    assert any(f.endswith(".j2") for f in expected)
    assert sorted(set(expected) - names) == []
    assert "hpc_tools/recipe/schema.py" in names and "hpc_tools/render/templates/job.sbatch.j2" in names
    entry_points = next(n for n in names if n.endswith(".dist-info/entry_points.txt"))
    assert "hpc-tools = hpc_tools.cli:main" in zipfile.ZipFile(wheel).read(entry_points).decode()


@pytest.fixture(scope="module")
def installed(wheel, tmp_path_factory) -> Path:
    """A fresh venv that sees this machine's packages (--system-site-packages: the dependencies) with the wheel
    installed into it, not editable. Returns the venv."""
    env_dir = tmp_path_factory.mktemp("venv") / "v"
    venv.create(env_dir, system_site_packages=True, with_pip=False, symlinks=True)
    python = env_dir / "bin" / "python"
    # pip comes from the system site-packages and installs into the venv that runs it; --ignore-installed: the
    # checkout's own (editable) hpc_tools is visible there too, and must not count as installed.
    out = subprocess.run([str(python), "-m", "pip", "install", "--no-deps", "--no-index", "--ignore-installed",
                          "--disable-pip-version-check", "--root-user-action=ignore", str(wheel)],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    return env_dir


def run_installed(env_dir: Path, *argv: str, cwd: Path) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    return subprocess.run([str(a) for a in argv], cwd=cwd, env=env, capture_output=True, text=True, timeout=300)


def test_the_installed_cli_validates_and_renders_a_shipped_recipe_from_outside_the_checkout(installed, tmp_path):
    recipe = REPO / "recipes" / "gpt_3d.yaml"
    out = run_installed(installed, installed / "bin" / "hpc-tools", "validate", "--offline", "--json", recipe,
                        cwd=tmp_path)
    assert out.returncode == 0, out.stdout + out.stderr
    data = json.loads(out.stdout)
    assert data["ok"] is True and [r["errors"] for r in data["results"]] == [[], []]
    # render reads the sbatch template, package data: the installed copy writes what the checkout writes.
    out = run_installed(installed, installed / "bin" / "hpc-tools", "render", recipe, "-o", tmp_path / "job.sbatch",
                        cwd=tmp_path)
    assert out.returncode == 0, out.stdout + out.stderr
    ref = run_cli("render", str(recipe), "-o", str(tmp_path / "ref.sbatch"), env={"HPC_TOOLS_SITE": "none"})
    assert ref.returncode == 0, ref.stderr
    assert (tmp_path / "job.sbatch").read_text() == (tmp_path / "ref.sbatch").read_text()
    assert "#SBATCH --job-name=gpt_3d" in (tmp_path / "job.sbatch").read_text()
    # The same commands in-process, then where every module they loaded came from: the venv, never the checkout
    # (whose editable install is visible through the system site-packages and would fill any hole in the wheel).
    probe = ("import json, sys\nfrom hpc_tools.cli import main\n"
             f"rc = [main(['validate', '--offline', {str(recipe)!r}]), main(['render', {str(recipe)!r}, '-o', '-'])]\n"
             "mods = {n: getattr(m, '__file__', None) for n, m in list(sys.modules.items())\n"
             "        if n.split('.')[0] in ('hpc_tools', 'profiling')}\n"
             "print(json.dumps({'rc': rc, 'modules': mods}))\n")
    out = run_installed(installed, installed / "bin" / "python", "-c", probe, cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["rc"] == [0, 0]
    modules = result["modules"]
    assert "hpc_tools.recipe.schema" in modules and "hpc_tools.render.sbatch" in modules
    site = str(installed.resolve())
    outside = {n: f for n, f in modules.items() if f is None or not str(Path(f).resolve()).startswith(site)}
    assert outside == {}


def test_the_installed_doctor_says_the_pins_are_not_here(installed, tmp_path):
    """environment/ (the pins) stays in the checkout: an installed doctor says so in a row of its own instead of
    comparing with nothing; its other rows still work."""
    out = run_installed(installed, installed / "bin" / "hpc-tools", "doctor", "--no-torch", "--json", "--runs-dir",
                        tmp_path / "runs", cwd=tmp_path)
    rows = {row["name"]: row for row in json.loads(out.stdout)["checks"]}
    assert rows["pins"]["status"] == "skip" and "environment/" in rows["pins"]["detail"], rows["pins"]
    assert rows["python"]["status"] == "pass" and "needs >= 3.10" in rows["python"]["detail"]
    assert rows["pydantic" if "pydantic" in rows else "pandas"]["status"] == "pass"
