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
