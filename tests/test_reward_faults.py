"""Reward functions that raise, hang or return NaN, inside a real training step."""

import json

import pytest

import plainrl.run.loop as loop
from conftest import REPO, tiny_overrides
from plainrl.config import load_config
from plainrl.rewards import RewardError

FNS = REPO / "tests" / "data" / "my_reward.py"
BAD = REPO / "tests" / "data" / "bad_rewards.py"
WHY = {"raises": "RuntimeError: reward backend down", "nan": "returned nan, expected a finite float",
       "hangs": "timed out after 1s"}


def _cfg(tiny_model_dir, run_dir, bad, *extra):
    rewards = f"[{{fn: '{FNS}:length_bonus'}}, {{fn: '{BAD}:{bad}', weight: 0.5}}]"
    return load_config(REPO / "examples" / "arithmetic_grpo.yaml", tiny_overrides(tiny_model_dir, run_dir) + [
        f"rewards={rewards}", "eval.before=false", "eval.after=false", *extra])


@pytest.mark.parametrize("bad, extra", [("raises", []), ("raises", ["rollout.reward_timeout_s=null"]),
                                        ("nan", []), ("hangs", ["rollout.reward_timeout_s=1", "rollout.reward_workers=2"])])
def test_unscorable_samples_are_counted_and_the_run_continues(tiny_model_dir, tmp_path, bad, extra):
    run = loop.train(_cfg(tiny_model_dir, tmp_path / "run", bad, *extra))
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 2
    for r in rows:
        assert r["reward/unscorable"] == 4.0  # every sample: the bad function has a non-zero weight
        assert r["loss"] == 0.0  # unscorable samples get advantage 0
    lines = [json.loads(x) for x in (run / "rollouts.jsonl").read_text().splitlines()]
    assert lines and all(x["reward"] is None and x["reward_parts"][bad] is None for x in lines)
    # why, per sample, in errors.jsonl: each step's 4 samples, the function named, the cause
    errors = [json.loads(x) for x in (run / "errors.jsonl").read_text().splitlines()]
    assert [e["step"] for e in errors] == [0] * 4 + [1] * 4
    assert len({(e["step"], e["sample_id"]) for e in errors}) == 8
    assert all(e["source"] == f"reward '{bad}'" and WHY[bad] in e["error"] for e in errors), errors


def test_fail_fast_stops_with_the_function_and_sample(tiny_model_dir, tmp_path):
    with pytest.raises(RewardError, match="raises"):
        loop.train(_cfg(tiny_model_dir, tmp_path / "run", "raises", "rollout.fail_fast=true"))
