"""The wheel adds one import namespace, `interleaf`, and works installed: built from a copy
of the sources (so no build output lands in the checkout), installed into a fresh virtual
environment (its dependencies, torch and the rest, seen from the packages of the Python
running the tests, whether that is the system's or a virtual environment's) and run from
outside the checkout."""

from __future__ import annotations

import pathlib
import shutil
import site as site_module
import subprocess
import sys
import sysconfig
import tomllib
import zipfile

from tests.source_tree import LINKED, PACKAGE_FOLDERS

ROOT = pathlib.Path(__file__).resolve().parent.parent


def _build(tmp: pathlib.Path) -> pathlib.Path:
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    source = tmp / "src"
    source.mkdir()
    for name in ("pyproject.toml", pyproject["project"]["readme"]):
        shutil.copy(ROOT / name, source / name)
    for folder in PACKAGE_FOLDERS:  # interleaf/'s links are copied as links
        shutil.copytree(ROOT / folder, source / folder, symlinks=True,
                        ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    built = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--wheel-dir", str(tmp / "dist"),
                            str(source)], capture_output=True, text=True, timeout=600)
    assert built.returncode == 0, built.stdout + built.stderr
    (wheel,) = (tmp / "dist").glob("interleaf-*.whl")
    return wheel


def test_wheel_installs_one_namespace_that_works(tmp_path):
    wheel = _build(tmp_path)
    names = zipfile.ZipFile(wheel).namelist()
    tops = {name.split("/")[0] for name in names}
    dist_info = [t for t in tops if t.endswith(".dist-info")]
    assert tops == {"interleaf", *dist_info} and len(dist_info) == 1, tops
    # Every module of the source folders is in it, under the namespace (a subpackage
    # missing from pyproject.toml's list would be left out).
    for folder in LINKED:
        for module in (ROOT / folder).rglob("*.py"):
            assert f"interleaf/{module.relative_to(ROOT).as_posix()}" in names, module
    entry_points = zipfile.ZipFile(wheel).read(f"{dist_info[0]}/entry_points.txt").decode()
    assert "interleaf = interleaf.clients.cli:main" in entry_points

    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=300)
    # Its dependencies come from the running Python's own site-packages (a .pth file adds
    # them), not the system's: the suite may itself run from a virtual environment.
    site = subprocess.run([venv / "bin" / "python", "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          capture_output=True, text=True, check=True).stdout.strip()
    running = {sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"], *site_module.getsitepackages()}
    (pathlib.Path(site) / "_running_python.pth").write_text("\n".join(sorted(running)) + "\n")
    installed = subprocess.run([venv / "bin" / "python", "-m", "pip", "install", "--no-deps", "--quiet", str(wheel)],
                               capture_output=True, text=True, timeout=300)
    assert installed.returncode == 0, installed.stderr
    # From a folder outside the checkout, so neither the checkout nor an editable install of it answers.
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    added = sorted(p.name for p in pathlib.Path(site).iterdir())
    assert [p for p in added if not p.startswith(("interleaf", "_distutils_hack", "distutils-precedence",
                                                  "pip", "setuptools", "pkg_resources",
                                                  "_running_python.pth"))] == [], added
    assert [p for p in added if p.startswith("interleaf")] == ["interleaf", dist_info[0]]

    helped = subprocess.run([venv / "bin" / "interleaf", "--help"], capture_output=True, text=True, cwd=elsewhere,
                            timeout=120)
    assert helped.returncode == 0 and "coordinator" in helped.stdout and "stage-server" in helped.stdout, helped.stderr
    imported = subprocess.run(
        [venv / "bin" / "python", "-c",
         "import interleaf, interleaf.coordinator, interleaf.coordinator.main, interleaf.stageserver.main; "
         "print(interleaf.__file__); print(interleaf.coordinator.__file__)"],
        capture_output=True, text=True, cwd=elsewhere, timeout=120)
    assert imported.returncode == 0, imported.stderr
    for path in imported.stdout.split():
        assert pathlib.Path(path).is_relative_to(site), path
