"""Configs that should run do: a run shortened from the command line shortens its warm-up too, and an
environment's own reward scores its episodes when no `rewards:` is named (as TRL does). Each choice
is a note printed with the config."""

from __future__ import annotations

import pytest

from plainrl.config import ConfigError, dump_config, load_config
from plainrl.config.schema import ENV_REWARD


@pytest.mark.parametrize("overrides", [["train.steps=1"], {"train.steps": 1}])
def test_a_shortened_run_shortens_its_warmup(overrides):
    """Old code: "train.warmup_steps=2 exceeds train.steps=1" for ``plainrl train arithmetic_grpo train.steps=1``."""
    cfg = load_config("arithmetic_grpo", overrides)
    assert (cfg.train.steps, cfg.train.warmup_steps) == (1, 1)
    assert cfg.notes == ["train.warmup_steps: 2 from the config is longer than train.steps=1 from the overrides, "
                         "so warm-up lasts the whole run of 1 step (set both to keep your own)"]
    assert "warmup_steps: 1" in dump_config(cfg)


def test_warmup_set_with_the_steps_is_still_refused(tmp_path):
    with pytest.raises(ConfigError, match="train.warmup_steps=2 exceeds train.steps=1"):
        load_config("arithmetic_grpo", ["train.steps=1", "train.warmup_steps=2"])
    own = tmp_path / "own.yaml"  # both in the user's own file
    own.write_text("data: {task: arithmetic}\nrewards: [{fn: 'plainrl.rewards.builtins:correctness'}]\n"
                   "train: {steps: 1, warmup_steps: 2}\n")
    with pytest.raises(ConfigError, match="train.warmup_steps=2 exceeds train.steps=1"):
        load_config(own)
    assert load_config("arithmetic_grpo", ["train.steps=5"]).notes == []  # warm-up 2 fits: nothing changed


def test_an_environment_without_rewards_is_scored_by_its_own_reward():
    """Old code: "rewards: no reward function given" for a TRL-style environment with ``get_reward``."""
    cfg = load_config("trl_env_grpo", ["rewards=[]"])
    assert [(r.fn, r.weight) for r in cfg.rewards] == [(ENV_REWARD, 1.0)]
    assert any(ENV_REWARD in n and "environment's reward" in n for n in cfg.notes), cfg.notes
    assert ENV_REWARD in dump_config(cfg)


def test_a_builtin_tool_environment_still_needs_a_reward():
    with pytest.raises(ConfigError, match="no reward function given"):
        load_config("trl_env_grpo", ["rewards=[]", "rollout.env=calculator"])


def test_an_epoch_counted_run_from_an_override_shortens_its_warmup_once_its_steps_are_known():
    cfg = load_config("arithmetic_grpo", ["train.epochs=1", "train.steps=null"])
    assert cfg.resolve_steps(cfg.rollout.prompts_per_step) == 1  # one step's worth of rows
    assert cfg.train.warmup_steps == 1 and any("train.epochs=1" in n for n in cfg.notes), cfg.notes
    both = load_config("arithmetic_grpo", ["train.epochs=1", "train.steps=null", "train.warmup_steps=2"])
    with pytest.raises(ConfigError, match="exceeds the 1 steps of train.epochs=1"):
        both.resolve_steps(both.rollout.prompts_per_step)
