"""The packaged examples: `plainrl examples` (list, copy) and `plainrl train NAME` from any directory."""

import json
import re
from pathlib import Path

import pytest
import yaml

from conftest import REPO, tiny_overrides
from plainrl.cli import main
from plainrl.config import ConfigError, load_config
from plainrl.config.examples import _describe, copy_example, examples_dir, find_example, list_examples


def test_examples_dir_is_the_checkout_or_the_package():
    # from a checkout (PYTHONPATH or an editable install) the examples are the repository's
    assert examples_dir().resolve() == (REPO / "examples").resolve()


def test_list_prints_every_config_on_one_line(capsys):
    assert main(["examples"]) == 0
    lines = capsys.readouterr().out.splitlines()
    names = sorted(p.stem for p in (REPO / "examples").glob("*.yaml"))
    listed = [line.split()[0] for line in lines[:-1]]
    assert listed == names
    for e in list_examples():
        assert e.description and "\n" not in e.description and not e.description.startswith("#"), e
        assert len(e.description) <= 120, f"{e.name}: its header comment's first sentence is too long for one line"
    assert "plainrl train NAME" in lines[-1]
    assert main(["examples", "list"]) == 0 and capsys.readouterr().out.splitlines() == lines


def test_description_is_the_first_sentence():
    assert _describe("# Dr. GRPO on x, two-number: more\n# text\nrun_dir: r\n# later") == "Dr. GRPO on x, two-number"
    assert _describe('# Answer ("a: b", (c: d)). Next\nx: 1') == 'Answer ("a: b", (c: d))'
    assert _describe("# One line\n# continues here\nx: 1") == "One line continues here"


def test_copy_writes_the_config_and_the_files_it_names(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert main(["examples", "copy", "agent_calculator", "mine"]) == 0
    assert capsys.readouterr().out.splitlines()[-1] == "run it: plainrl train mine/agent_calculator.yaml"
    copied = tmp_path / "mine" / "agent_calculator.yaml"
    assert (tmp_path / "mine" / "agent_calculator.py").read_text() == (REPO / "examples" / "agent_calculator.py").read_text()
    assert yaml.safe_load(copied.read_text())["rollout"]["agent"] == "mine/agent_calculator.py:agent"
    # the copy is a config that runs from here: its agent imports
    from plainrl.rollout.agents import load_agent

    assert callable(load_agent(load_config("mine/agent_calculator.yaml").rollout.agent))
    # into the current directory by default; a config naming no file copies alone
    assert [p.name for p in copy_example("arithmetic_grpo")] == ["arithmetic_grpo.yaml"]
    assert load_config("arithmetic_grpo.yaml") == load_config(REPO / "examples" / "arithmetic_grpo.yaml")


def test_copy_refuses_to_overwrite_and_unknown_names(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "agent_calculator.py").write_text("# mine\n")
    assert main(["examples", "copy", "agent_calculator"]) == 2
    assert "agent_calculator.py already exist" in capsys.readouterr().err
    assert not (tmp_path / "agent_calculator.yaml").exists()  # nothing written
    with pytest.raises(ConfigError, match="no packaged example 'nope'.*arithmetic_grpo"):
        copy_example("nope", tmp_path)


def test_a_name_that_is_not_a_file_loads_the_packaged_example(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # no examples/ here
    cfg = load_config("agent_calculator", ["seed=3"])
    assert cfg.seed == 3
    agent_file = Path(cfg.rollout.agent.rsplit(":", 1)[0])
    assert agent_file.is_absolute() and agent_file == (examples_dir() / "agent_calculator.py").resolve()
    assert load_config("agent_calculator.yaml") == load_config("agent_calculator")
    assert find_example("examples/agent_calculator") is None  # a path is never taken for a name
    with pytest.raises(ConfigError, match="does not exist, nor is it the name of a packaged example"):
        load_config("agent_calculatr")
    # a file of that name wins over the packaged example
    (tmp_path / "arithmetic_grpo.yaml").write_text("seed: 11\ndata: {task: arithmetic}\nrewards: [{fn: correctness}]\n")
    assert load_config("arithmetic_grpo.yaml").seed == 11


def test_train_runs_a_packaged_example_by_name_from_another_directory(tiny_model_dir, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    run = tmp_path / "run"
    assert main(["train", "agent_calculator", *tiny_overrides(tiny_model_dir, run), "train.steps=1"]) == 0
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "reward/mean" in r] == [0]
    assert yaml.safe_load((run / "config.yaml").read_text())["rollout"]["agent"].startswith(str(examples_dir().resolve()))


@pytest.mark.parametrize("name", [e.name for e in list_examples()])
def test_every_example_loads_by_name_and_copies(name, tmp_path, monkeypatch):
    """From a directory without examples/, each example loads by name with every file it names
    resolved, and its copy loads with the copied files."""
    monkeypatch.chdir(tmp_path)
    text = yaml.safe_dump(load_config(name).model_dump(mode="json"))
    assert "examples/" not in text.replace(str(examples_dir().resolve()), ""), f"{name}: a reference left unresolved"
    written = copy_example(name, "copy")
    copied = yaml.safe_dump(load_config(written[0]).model_dump(mode="json"))
    assert "examples/" not in copied
    named = set(re.findall(r"copy/[\w./-]+\.\w+", copied))
    assert named == {str(p) for p in written[1:]}, (named, written)
