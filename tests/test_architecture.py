"""docs/architecture.md's import rules, read from the source by tools/import_graph.py: no module
imports what its folder's row says it must not, the top-level units form no import circle, and no
module is over 500 lines."""

from __future__ import annotations

import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tools"))

import import_graph  # noqa: E402


def test_no_module_imports_what_its_folder_must_not():
    assert import_graph.analyse()["broken"] == []


def test_the_top_level_units_form_no_import_circle():
    assert import_graph.analyse()["circles"] == []


def test_no_module_is_over_500_lines():
    """CONTRIBUTING.md's code shape: one module per concept, none over 500 lines."""
    assert import_graph.analyse(long_lines=500)["long_modules"] == []


def test_the_checks_see_a_broken_rule_and_a_circle(tmp_path):
    """The two checks above on a made-up package: config/ importing train/ (config must import
    nothing of plainrl), and rollout/ and rewards/ importing each other (one inside a function)."""
    pkg = tmp_path / "plainrl"
    for unit, source in {"config": "from plainrl.train import x\n",
                         "rollout": "def f():\n    from plainrl.rewards.loading import y\n",
                         "rewards": "from ..rollout import z\n", "train": ""}.items():
        (pkg / unit).mkdir(parents=True)
        (pkg / unit / "__init__.py").write_text(source)
    found = import_graph.analyse(pkg=pkg)
    assert found["broken"] == ["plainrl.config -> plainrl.train"]
    assert found["circles"] == [{"rewards", "rollout"}]
