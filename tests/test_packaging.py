"""pyproject.toml builds a wheel that holds every package (accumulation.rl and the checker included) and installs
without the source tree: `pip wheel` on a copy of the project (so no build/ or egg-info lands in the checkout),
no network and no build isolation (setuptools comes from the venv), then the wheel installed into a target
folder and the checker and GRPO imported from there alone."""

import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


@pytest.mark.integration
def test_the_wheel_holds_every_package_and_imports_without_the_source_tree(tmp_path):
    source = tmp_path / "source"
    source.mkdir()
    shutil.copy(REPO / "pyproject.toml", source)
    for package in ("accumulation", "forks", "testkit"):
        shutil.copytree(REPO / package, source / package, ignore=shutil.ignore_patterns("__pycache__"))
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "--no-input"]
    wheels = tmp_path / "wheels"
    build = [*pip, "wheel", "--no-deps", "--no-build-isolation", "--no-index", "-w", str(wheels), str(source)]
    subprocess.run(build, check=True, capture_output=True, text=True, timeout=300)
    [wheel] = wheels.glob("accumulation-*.whl")
    with zipfile.ZipFile(wheel) as archive:
        names = set(archive.namelist())
        metadata = archive.read(next(name for name in names if name.endswith(".dist-info/METADATA"))).decode()
    packaged = {
        str(path.relative_to(REPO))
        for package in ("accumulation", "forks", "testkit")
        for path in (REPO / package).rglob("*.py")
    }
    assert packaged <= names, sorted(packaged - names)  # every module, accumulation/rl/ among them
    assert "accumulation/rl/on_policy.py" in names
    for requirement in ("torch>=2.13", "numpy>=2.4", "tensorboard>=2.21", "tomli-w>=1.2"):
        assert f"Requires-Dist: {requirement}" in metadata, metadata
    target = tmp_path / "installed"
    install = [*pip, "install", "--no-deps", "--no-index", "--target", str(target), str(wheel)]
    subprocess.run(install, check=True, capture_output=True, text=True, timeout=300)
    program = "import accumulation, accumulation.checker, accumulation.rl.on_policy\nprint(accumulation.__file__)\n"
    environment = {**os.environ, "PYTHONPATH": str(target)}  # the installed copy only, not this checkout
    completed = subprocess.run(
        [sys.executable, "-c", program], cwd=tmp_path, env=environment, capture_output=True, text=True, timeout=300
    )
    assert completed.returncode == 0, completed.stderr
    assert completed.stdout.strip().startswith(str(target)), completed.stdout
