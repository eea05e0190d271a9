"""The documentation matches the code: links, config keys, commands, references, wording; the
generated configuration reference is current; the site builds with MkDocs in strict mode.

Each check of tools/docs_check.py is run on the real pages and, to show it can fail, on a bad
page written to tmp_path."""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))
import docs_check  # noqa: E402

PAGES = docs_check.user_pages(ROOT)


def _page(tmp_path: Path, text: str, name: str = "page.md") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


@pytest.mark.parametrize("check", ["check_config_keys", "check_yaml_blocks", "check_schema_documented", "check_cli",
                                   "check_references", "check_process_words"])
def test_user_pages_pass(check):
    """README.md and docs/ pass each check; the tests below show each one fails on a bad page."""
    assert getattr(docs_check, check)(PAGES) == []


def test_links_and_anchors_resolve():
    others = [ROOT / p for p in ("CHANGELOG.md", "CONTRIBUTING.md", "benchmarks/README.md", "benchmarks/NOTES.md")]
    assert docs_check.check_links(PAGES + [p for p in others if p.exists()]) == []


def test_links_fail_on_a_bad_page(tmp_path):
    _page(tmp_path, "# Other page\n\n## A heading: with `code`\n", "other.md")
    page = _page(tmp_path, "[ok](other.md#a-heading-with-code) [ok](#mine)\n\n## Mine\n\n"
                           "[gone](missing.md) [bad anchor](other.md#nope) ![img](pic.png)\n"
                           "```\n[in code](not-checked.md)\n```\n")
    problems = docs_check.check_links([page], docs_dir=tmp_path / "docs")
    assert len(problems) == 3, problems
    assert "missing.md does not exist" in problems[0] and "'nope'" in problems[1] and "pic.png" in problems[2]


def test_docs_pages_do_not_link_outside_docs(tmp_path):
    (tmp_path / "docs").mkdir()
    _page(tmp_path, "x\n", "outside.md")
    page = _page(tmp_path / "docs", "[out](../outside.md)\n")
    problems = docs_check.check_links([page], docs_dir=tmp_path / "docs")
    assert len(problems) == 1 and "leaves docs/" in problems[0]



def test_config_keys_fail_on_a_bad_page(tmp_path):
    page = _page(tmp_path, "Set `train.lr` and `data.task_args.num_train`, not `train.lrr=1` or "
                           "`rollout.remote.urlz`; `model.generate` is a method and `train.py` a file.\n"
                           "```bash\nplainrl train c.yaml algorithm.clip_hihg=0.3 rewards.0.weight=1\n```\n")
    problems = docs_check.check_config_keys([page])
    assert [p.split("'")[1] for p in problems] == ["train.lrr", "rollout.remote.urlz", "algorithm.clip_hihg"], problems



def test_schema_documented_fails_on_a_page_missing_keys(tmp_path):
    problems = docs_check.check_schema_documented([_page(tmp_path, "Only `train.lr` here.\n")])
    assert any("train.steps is documented on no page" in p for p in problems)
    assert not any(p.startswith("plainrl/config: train.lr ") for p in problems)



def test_cli_fails_on_a_bad_page(tmp_path):
    page = _page(tmp_path, "`plainrl report RUN --png x.png --metrics a` and `plainrl cache clear --legacy` "
                           "exist; `from plainrl import train` is Python.\n"
                           "```bash\nplainrl trian c.yaml\n"
                           "plainrl report RUN --pngg x  # a comment: plainrl keeps\n```\n")
    problems = docs_check.check_cli([page])
    assert len(problems) == 2, problems
    assert "`plainrl trian` is not a command" in problems[0] and "no flag --pngg" in problems[1]



def test_references_fail_on_a_bad_page(tmp_path):
    page = _page(tmp_path, "`plainrl.rewards.builtins:correctness`, plainrl.config.docgen and "
                           "`plainrl.rollout.engines.static_decoder` import; `plainrl.rewards.nope` and "
                           "`plainrl.rewards.builtins:nope` do not.\n")
    problems = docs_check.check_references([page])
    assert [p.split(": ")[1] for p in problems] == ["plainrl.rewards.nope does not import",
                                                   "plainrl.rewards.builtins:nope does not import"], problems



def test_process_words_fail_on_a_bad_page(tmp_path):
    page = _page(tmp_path, "Measured in session 3.\nThe rounding error is small; a POSIX session is killed.\n"
                           "```\n# goal: 3x\n```\n")
    problems = docs_check.check_process_words([page])
    assert [p.split(": ")[1] for p in problems] == ["'session'", "'goal'"], problems


def test_configuration_reference_is_generated_from_the_schema(tmp_path):
    from plainrl.config import docgen

    assert docgen.main(["--check"]) == 0, "run `python -m plainrl.config.docgen`"
    stale = docgen.PAGE.read_text().replace("`train.lr`", "`train.lr_old`", 1)
    page = _page(tmp_path, stale, "configuration.md")
    assert docgen.main(["--check", str(page)]) == 1
    assert docgen.main([str(page)]) == 0 and page.read_text() == docgen.PAGE.read_text()


def _quiet_env() -> dict[str, str]:
    return {**os.environ, "NO_MKDOCS_2_WARNING": "1"}  # mkdocs-material's banner about its successor


@pytest.mark.skipif(importlib.util.find_spec("mkdocs") is None or importlib.util.find_spec("material") is None,
                    reason="mkdocs and mkdocs-material not installed (pip install -e '.[docs]')")
def test_site_builds_strict(tmp_path):
    """`mkdocs build --strict`: any broken link or anchor, or a page left out of the navigation,
    fails the build (mkdocs.yml's validation settings)."""
    site = tmp_path / "site"
    proc = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(site)],
                          cwd=ROOT, capture_output=True, text=True, timeout=300, env=_quiet_env())
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert (site / "index.html").exists() and (site / "configuration" / "index.html").exists()


@pytest.mark.skipif(importlib.util.find_spec("mkdocs") is None or importlib.util.find_spec("material") is None,
                    reason="mkdocs and mkdocs-material not installed (pip install -e '.[docs]')")
def test_site_build_fails_on_a_broken_anchor(tmp_path):
    copy = tmp_path / "repo"
    shutil.copytree(ROOT / "docs", copy / "docs")
    shutil.copy(ROOT / "mkdocs.yml", copy / "mkdocs.yml")
    (copy / "docs" / "configuration.md").write_text((copy / "docs" / "configuration.md").read_text()
                                                    + "\n[broken](algorithms.md#no-such-heading)\n")
    proc = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "s")],
                          cwd=copy, capture_output=True, text=True, timeout=300, env=_quiet_env())
    assert proc.returncode != 0 and "no-such-heading" in proc.stdout + proc.stderr


def test_navigation_lists_each_page_once():
    import yaml

    def pages(node):
        if isinstance(node, str):
            yield node
        elif isinstance(node, list):
            for item in node:
                yield from pages(item)
        elif isinstance(node, dict):
            for value in node.values():
                yield from pages(value)

    # mkdocs.yml's material extensions use !!python tags; the nav is plain YAML
    text = (ROOT / "mkdocs.yml").read_text()
    nav = yaml.safe_load(text[text.index("\nnav:"):].split("\n\n", 1)[0])["nav"]
    listed = list(pages(nav))
    assert sorted({p for p in listed if listed.count(p) > 1}) == [], "a page is in mkdocs.yml's nav twice"


def test_benchmarks_readme_lists_every_script():
    listed = (ROOT / "benchmarks" / "README.md").read_text()
    missing = [p.name for p in sorted((ROOT / "benchmarks").glob("*.py")) if f"`{p.name}`" not in listed]
    assert missing == [], f"add these scripts to benchmarks/README.md's table: {missing}"



def test_yaml_snippets_fail_on_a_bad_page(tmp_path):
    page = _page(tmp_path, "```yaml\ntrain: {lr: 1e-5, steps: 3}\nrewards:\n  - {fn: correctness, wieght: 1}\n"
                           "data: {task: arithmetic, task_args: {anything: 1}}\n```\n\n"
                           "```yaml\nmodel: [unclosed\n```\n\n```bash\ntrain: {nope: 1}\n```\n")
    problems = docs_check.check_yaml_blocks([page])
    assert len(problems) == 2, problems
    assert "'rewards.wieght'" in problems[0] and "does not parse" in problems[1]


def test_readme_and_site_index_every_page():
    """README.md's documentation index and docs/index.md link every page of docs/."""
    pages = {p.name for p in (ROOT / "docs").glob("*.md")} - {"index.md"}
    readme = (ROOT / "README.md").read_text()
    index = (ROOT / "docs" / "index.md").read_text()
    assert [p for p in sorted(pages) if f"(docs/{p})" not in readme] == [], "add them to README.md's Documentation"
    assert [p for p in sorted(pages) if f"({p})" not in index] == [], "add them to docs/index.md's Pages table"


def test_code_points_to_sections_that_exist():
    assert docs_check.check_code_pointers(docs_check.code_files(ROOT)) == []


def test_code_pointers_fail_on_a_bad_file(tmp_path):
    bad = tmp_path / "mod.py"
    bad.write_text('"""See docs/outputs.md, "Outputs that travel", and docs/checkpointing.md,\n'
                   '"Portable outputs"; docs/' 'gone.md, "Anything".\n"""\n')  # split: this file is checked too
    problems = docs_check.check_code_pointers([bad])
    assert len(problems) == 2, problems
    assert '"Portable outputs": no such section' in problems[0] and "gone.md, which does not exist" in problems[1]


def test_readme_stays_a_front_page():
    """README.md is the front page (at most 250 lines); details belong on a page of docs/."""
    lines = (ROOT / "README.md").read_text().count("\n")
    assert lines <= 250, f"README.md has {lines} lines: move detail to docs/ and link it"
