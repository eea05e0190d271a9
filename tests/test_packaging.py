"""Package metadata: one version, the license files, the changelog's and citation's versions."""

import re
import tomllib
from pathlib import Path

import yaml

import plainrl

ROOT = Path(__file__).resolve().parent.parent


def test_version_has_one_source():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert "version" not in project["project"] and "version" in project["project"]["dynamic"]
    assert project["tool"]["setuptools"]["dynamic"]["version"] == {"attr": "plainrl.__version__"}
    assert re.fullmatch(r"\d+\.\d+\.\d+(\.dev\d+|rc\d+)?", plainrl.__version__)


def test_license_metadata_is_pep639():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert project["license"] == "Apache-2.0"
    for name in project["license-files"]:
        assert "Apache License" in (ROOT / name).read_text()[:200]
    assert not any(c.startswith("License ::") for c in project["classifiers"])  # PEP 639: the expression replaces them


def test_changelog_and_citation_name_the_version():
    changelog = (ROOT / "CHANGELOG.md").read_text()
    assert "## [Unreleased]" in changelog
    assert re.search(rf"^## \[{re.escape(plainrl.__version__)}\] - \d{{4}}-\d{{2}}-\d{{2}}$", changelog, re.M), \
        f"CHANGELOG.md has no section for version {plainrl.__version__}"
    citation = yaml.safe_load((ROOT / "CITATION.cff").read_text())
    assert citation["version"] == plainrl.__version__ and citation["cff-version"] == "1.2.0"


def test_wheel_carries_the_examples_license_and_metadata(tmp_path):
    """The built wheel (as `pip wheel .` makes it) holds every example config and the files they
    name under plainrl/examples, the license, and the metadata read from one version."""
    import subprocess
    import sys
    import zipfile
    from email.parser import Parser

    from importlib.metadata import version

    # without build isolation when this venv's setuptools reads PEP 639 metadata (faster, no index needed)
    isolation = [] if int(version("setuptools").split(".")[0]) >= 77 else ["--use-pep517"]
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps",
                    *(isolation or ["--no-build-isolation"]), "--wheel-dir", str(tmp_path), str(ROOT)],
                   check=True, timeout=300, cwd=tmp_path)
    (wheel,) = tmp_path.glob("plainrl-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    for path in (ROOT / "examples").iterdir():
        if path.is_file() and path.suffix in (".yaml", ".py", ".ipynb"):
            assert f"plainrl/examples/{path.name}" in names, path.name
    assert "plainrl/report/report.html.j2" in names
    info = f"plainrl-{plainrl.__version__}.dist-info"
    meta = Parser().parsestr(zipfile.ZipFile(wheel).read(f"{info}/METADATA").decode())
    assert meta["Version"] == plainrl.__version__ and meta["License-Expression"] == "Apache-2.0"
    assert f"{info}/licenses/LICENSE" in names and meta["Requires-Python"] == ">=3.11"
    assert any(u.startswith("Changelog, ") for u in meta.get_all("Project-URL"))
