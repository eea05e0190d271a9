"""Config: YAML + dotted overrides; every mistake fails before a model loads, naming path, value and fix."""

from pathlib import Path

import pytest

from plainrl.config import ConfigError, dump_config, load_config, parse_overrides

EXAMPLES = sorted((Path(__file__).resolve().parents[1] / "examples").glob("*.yaml"))
BASE = ["data.task=arithmetic", "rewards=[{fn: plainrl.rewards.builtins:correctness}]"]


def test_overrides_parse_types():
    o = parse_overrides(["train.lr=1e-5", "model.lora.enabled=false", "rollout.stop=[a, b]", "seed=3", "run_dir=x"])
    assert o == {"train": {"lr": 1e-5}, "model": {"lora": {"enabled": False}}, "rollout": {"stop": ["a", "b"]},
                 "seed": 3, "run_dir": "x"}


def test_override_applies_and_dump_round_trips(tmp_path):
    cfg = load_config(None, BASE + ["train.lr=3e-4", "rollout.group_size=4"])
    assert cfg.train.lr == 3e-4 and cfg.rollout.group_size == 4
    f = tmp_path / "c.yaml"
    f.write_text(dump_config(cfg))
    assert load_config(f) == cfg


@pytest.mark.parametrize("override, needles", [
    (["train.lrr=1"], ["train.lrr", "unknown key", "did you mean train.lr"]),
    (["train.lr=fast"], ["train.lr", "'fast'"]),
    (["rollout.group_size=0"], ["rollout.group_size", "greater than 0"]),
    (["algorithm.kl_estimator=k9"], ["algorithm.kl_estimator", "'k9'", "k1", "k3"]),
    (["rollout.max_new_tokens=2048"], ["rollout.max_new_tokens=2048", "model.max_context"]),
    (["rollout.group_size=1"], ["rollout.group_size=1", "at least 2"]),
    (["rollout.temperature=0"], ["temperature=0", "advantage is 0"]),
    (["data.path=x.jsonl"], ["data.task", "data.path", "exactly one"]),
    (["modle.name=x"], ["modle", "did you mean model"]),
])
def test_bad_config_messages(override, needles):
    with pytest.raises(ConfigError) as e:
        load_config(None, BASE + override)
    for n in needles:
        assert n in str(e.value), (n, str(e.value))


def test_no_reward_function():
    with pytest.raises(ConfigError, match="no reward function"):
        load_config(None, ["data.task=arithmetic"])


def test_bad_override_syntax_and_missing_file(tmp_path):
    with pytest.raises(ConfigError, match="dotted.key=value"):
        parse_overrides(["train.lr"])
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "nope.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("train: [1, 2\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(bad)


def test_dr_grpo_preset_turns_off_std():
    assert load_config(None, BASE).norm_std is True
    assert load_config(None, BASE + ["algorithm.name=dr_grpo"]).norm_std is False
    assert load_config(None, BASE + ["algorithm.name=dr_grpo", "algorithm.norm_std=true"]).norm_std is True


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_examples_validate(path, tmp_path):
    """Every example loads, names importable reward functions, and survives the round trip
    through the ``config.yaml`` a run writes (which is what ``plainrl eval RUN_DIR`` reads)."""
    from plainrl.rewards import build_reward_fns

    cfg = load_config(path)
    assert len(build_reward_fns(cfg.rewards)) == sum(s.fn is not None for s in cfg.rewards)
    saved = tmp_path / "config.yaml"
    saved.write_text(dump_config(cfg))
    assert load_config(saved) == cfg
