"""The distributions built from this checkout: the wheel holds the two packages' files (the
packaged tuning files included) and nothing else, the sdist builds the same wheel, and the
metadata declares its license without a deprecated field (the LICENSE file shipped in
both), the version that ``kvtier.__version__`` says, the Python it needs, the ``kvtier``
command and the vLLM versions the ``[vllm]`` extra accepts.
"""

from __future__ import annotations

import email
import shutil
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

import pytest

import kvtier

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("kvtier", "kvtier_kernels")
SOURCES = ("pyproject.toml", "README.md", "LICENSE", *PACKAGES)

pytestmark = pytest.mark.slow


def _setuptools_major() -> int:
    try:
        import setuptools
    except ImportError:
        return 0
    return int(setuptools.__version__.split(".")[0])


if _setuptools_major() < 77:  # what pyproject.toml's build-system requires
    pytest.skip("building without isolation needs setuptools >= 77", allow_module_level=True)


def _package_files(tree: Path) -> set[str]:
    return {
        path.relative_to(tree).as_posix()
        for package in PACKAGES
        for path in (tree / package).rglob("*")
        if path.is_file() and "__pycache__" not in path.parts
    }


def _wheel(source: Path, out: Path) -> zipfile.ZipFile:
    pip_wheel = [sys.executable, "-m", "pip", "wheel", "-v", "--no-deps", "--no-build-isolation"]
    build = subprocess.run(
        [*pip_wheel, str(source), "-w", str(out)], capture_output=True, text=True, timeout=300
    )
    assert build.returncode == 0, build.stdout[-3000:] + build.stderr[-3000:]
    assert "DeprecationWarning" not in build.stdout + build.stderr, build.stdout[-3000:]
    (wheel,) = out.glob("kvtier-*.whl")
    return zipfile.ZipFile(wheel)


@pytest.fixture(scope="module")
def checkout(tmp_path_factory) -> Path:
    """A copy of the checkout's sources, without any earlier build's files."""
    tree = tmp_path_factory.mktemp("checkout")
    for name in SOURCES:
        source = ROOT / name
        if source.is_dir():
            shutil.copytree(source, tree / name, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy2(source, tree / name)
    return tree


@pytest.fixture(scope="module")
def wheel(checkout, tmp_path_factory) -> zipfile.ZipFile:
    return _wheel(checkout, tmp_path_factory.mktemp("wheel"))


def test_the_wheel_holds_the_package_files_and_nothing_else(checkout, wheel):
    files = {name for name in wheel.namelist() if ".dist-info/" not in name}
    assert files == _package_files(checkout)
    assert any(name.startswith("kvtier_kernels/tuning/tuned/") for name in files)


def test_the_metadata_names_the_license_the_version_the_python_and_the_command(wheel):
    dist_info = next(n for n in wheel.namelist() if n.endswith(".dist-info/METADATA"))
    metadata = email.message_from_bytes(wheel.read(dist_info))
    assert metadata["License-Expression"] == "Apache-2.0"
    assert metadata["Requires-Python"] == ">=3.10"
    assert kvtier.__version__ == metadata["Version"]
    entry_points = wheel.read(dist_info.replace("METADATA", "entry_points.txt")).decode()
    assert "kvtier = kvtier.cli:main" in entry_points


def test_the_license_file_is_apache_2_and_ships_in_both_distributions(wheel):
    text = (ROOT / "LICENSE").read_text()
    assert text.split()[:3] == ["Apache", "License", "Version"] and "Version 2.0" in text
    assert "END OF TERMS AND CONDITIONS" in text, "the whole license, not a notice"
    dist_info = next(n for n in wheel.namelist() if n.endswith(".dist-info/METADATA"))
    metadata = email.message_from_bytes(wheel.read(dist_info))
    assert metadata.get_all("License-File") == ["LICENSE"]
    shipped = dist_info.replace("METADATA", "licenses/LICENSE")
    assert wheel.read(shipped).decode() == text


def test_the_vllm_extra_is_bounded_to_the_checked_versions(wheel):
    dist_info = next(n for n in wheel.namelist() if n.endswith(".dist-info/METADATA"))
    metadata = email.message_from_bytes(wheel.read(dist_info))
    [vllm] = [r for r in metadata.get_all("Requires-Dist") if r.startswith(("vllm>", "vllm<"))]
    specifier, marker = (part.strip() for part in vllm.removeprefix("vllm").split(";"))
    assert marker == 'extra == "vllm"'
    bounds = {bound.strip() for bound in specifier.split(",")}
    assert bounds == {">=0.32", "<0.34"}, "the lower bound tested, the upper one checked"
    portability = (ROOT / "docs" / "portability.md").read_text()
    assert "`vllm>=0.32,<0.34`" in portability


def test_the_sdist_builds_the_same_wheel(checkout, wheel, tmp_path):
    program = "import sys; from setuptools import build_meta; build_meta.build_sdist(sys.argv[1])"
    sdist = subprocess.run(
        [sys.executable, "-c", program, str(tmp_path)],
        capture_output=True,
        text=True,
        cwd=checkout,
        timeout=300,
    )
    assert sdist.returncode == 0, sdist.stdout[-3000:] + sdist.stderr[-3000:]
    (archive,) = tmp_path.glob("kvtier-*.tar.gz")
    with tarfile.open(archive) as tar:
        tar.extractall(tmp_path / "sdist", filter="data")
    (unpacked,) = (tmp_path / "sdist").iterdir()
    assert (unpacked / "LICENSE").read_text() == (ROOT / "LICENSE").read_text()
    again = _wheel(unpacked, tmp_path / "wheel")
    assert set(again.namelist()) == set(wheel.namelist())
