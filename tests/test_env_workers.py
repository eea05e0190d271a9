"""Environments in worker processes (rollout.env_timeout_s): same episodes as in process,
state kept across turns, hangs and crashes cut off without killing the run."""

from __future__ import annotations

import json
import time

import psutil
import pytest

import plainrl.run.loop as loop
import plainrl.run.setup as run_setup
from conftest import REPO, tiny_overrides
from plainrl.config import load_config
from plainrl.rollout import multi_turn_rollout
from plainrl.rollout.envs import EnvError, EnvWorkers, StepResult
from plainrl.rewards import RewardFn
from plainrl.rewards.loading import load_reward_fn
from plainrl.rewards import score_episodes
from plainrl.types import Generation, SamplingParams
from test_envs import ScriptedEnv, make_prompt, three_turn_setup

BAD_ENVS = REPO / "tests" / "data" / "bad_envs.py"


def _children() -> set[int]:
    return {p.pid for p in psutil.Process().children(recursive=True)}


def _gone(pids: set[int], within_s: float = 5.0) -> bool:
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        if not any(psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE for p in pids):
            return True
        time.sleep(0.05)
    return False


class EosEngine:
    """Every generate call returns the same two tokens, ended by EOS."""

    def __init__(self, eos: int):
        self.eos = eos

    def generate(self, prompts, params, *, seeds=None):
        return [Generation(token_ids=[42, self.eos], logprobs=[-0.5, -0.25], finish_reason="eos") for _ in prompts]

    def load_weights(self, model):
        pass


class CountingEnv:
    """Keeps a count on itself and in state.scratch: both must survive across turns in a worker."""

    stop = ()
    max_turns = None

    def __init__(self):
        self.steps = 0

    def reset(self, row):
        return None

    def step(self, turn_text, state):
        self.steps += 1
        state.scratch["n"] = state.scratch.get("n", 0) + 1
        seen = f"{self.steps}/{state.scratch['n']}/{state.turn}"
        if state.turn == 2:
            return StepResult(done=True, reward=1.0, info={"seen": seen})
        return StepResult(observation=" ok", info={"seen": seen})


class RowEnv:
    """Does what the row says: hang (with a grandchild), die, return garbage, or finish."""

    stop = ()
    max_turns = None

    def reset(self, row):
        return None

    def step(self, turn_text, state):
        how = state.row.get("how")
        if how == "hang":
            import subprocess

            subprocess.Popen(["sleep", "1000"])
            time.sleep(10_000)
        if how == "die":
            import os

            os._exit(3)
        if how == "not_a_result":
            return "done"
        if how == "unpicklable":
            return StepResult(observation="x", info={"f": lambda: 0})
        return StepResult(done=True, reward=1.0)


def _rollout(tokenizer, factory, hows, **kw):
    prompts = [make_prompt(tokenizer, f"Task {i}", i, how=h) for i, h in enumerate(hows)]
    return multi_turn_rollout(EosEngine(tokenizer.eos_token_id), prompts, factory, SamplingParams(max_new_tokens=8),
                              tokenizer, group_size=1, step=0, max_turns=None, max_total_tokens=64, **kw)


def test_worker_envs_give_the_same_episodes_as_in_process(tokenizer):
    pa, pb, *_, engine = three_turn_setup(tokenizer)
    local = multi_turn_rollout(engine, [pa, pb], ScriptedEnv, SamplingParams(max_new_tokens=32), tokenizer,
                               group_size=1, step=0, max_turns=None, max_total_tokens=200)
    pa, pb, *_, engine = three_turn_setup(tokenizer)
    with EnvWorkers(ScriptedEnv, timeout_s=30) as workers:
        remote = multi_turn_rollout(engine, [pa, pb], workers, SamplingParams(max_new_tokens=32), tokenizer,
                                    group_size=1, step=0, max_turns=None, max_total_tokens=200)
    assert [e.completion_ids for e in remote] == [e.completion_ids for e in local]
    assert [e.loss_mask for e in remote] == [e.loss_mask for e in local]
    assert [e.logprobs for e in remote] == [e.logprobs for e in local]
    assert [e.columns() for e in remote] == [e.columns() for e in local]
    assert local[0].env.info["turns"] == 3 and local[0].env.error is None


def test_environment_object_and_scratch_live_across_turns(tokenizer):
    with EnvWorkers(CountingEnv, timeout_s=30) as workers:
        eps = _rollout(tokenizer, workers, ["a", "b"])
    for e in eps:
        assert e.env.error is None and e.env.reward == 1.0
        assert e.env.info["seen"] == "3/3/2"  # one env object and one scratch per episode, 3 steps


def test_a_hanging_step_is_killed_with_its_grandchildren_and_the_others_go_on(tokenizer):
    before = _children()
    with EnvWorkers(RowEnv, timeout_s=1) as workers:
        workers.prestart(2)
        forked = _children() - before
        t = time.monotonic()
        hung, fine = _rollout(tokenizer, workers, ["hang", "ok"])
        assert time.monotonic() - t < 1 + 2
        assert "env.step did not return within 1 s" in hung.env.error
        assert hung.env.info["end_reason"] == "env_error" and hung.env.reward is None
        assert fine.env.error is None and fine.env.reward == 1.0
        leftover = {p.pid for p in psutil.process_iter(["cmdline"]) if p.info["cmdline"] == ["sleep", "1000"]}
        assert _gone(leftover), "the hung step's grandchild outlived the timeout"
    assert _gone(forked | (_children() - before)), "env workers outlived close()"


@pytest.mark.parametrize("how, message", [
    ("die", "env.step: the environment's worker process died (exit code 3)"),
    ("not_a_result", "TypeError: env.step must return a StepResult, got str"),
    ("unpicklable", "the result could not be sent back to the trainer"),
])
def test_crashes_and_bad_results_make_the_episode_unscorable(tokenizer, how, message):
    with EnvWorkers(RowEnv, timeout_s=10) as workers:
        bad, fine = _rollout(tokenizer, workers, [how, "ok"])
    assert message in bad.env.error
    assert fine.env.error is None and fine.env.reward == 1.0


@pytest.mark.parametrize("isolated", [False, True])
def test_an_env_that_fails_to_start_gives_an_empty_unscorable_episode(tokenizer, isolated):
    factory = load_reward_fn(f"{BAD_ENVS}:reset_raises")
    with EnvWorkers(factory, timeout_s=10) as workers:
        (e,) = _rollout(tokenizer, workers if isolated else factory, ["x"])
    assert e.completion_ids == [] and e.loss_mask == []
    assert e.env.error.startswith("ValueError: no such task (at ") and "bad_envs.py" in e.env.error
    assert e.env.info["end_reason"] == "env_error"


def test_workers_are_reused_between_episodes_and_replaced_after_a_kill(tokenizer):
    fds = psutil.Process().num_fds()
    with EnvWorkers(RowEnv, timeout_s=10) as workers:
        for _ in range(3):
            _rollout(tokenizer, workers, ["ok", "ok", "ok"])
        assert workers.started == 3
        _rollout(tokenizer, workers, ["die", "ok", "ok"])
        _rollout(tokenizer, workers, ["ok", "ok", "ok"])
        assert workers.started == 4  # only the dead one was replaced
    assert psutil.Process().num_fds() == fds


def test_env_errors_are_recorded_when_scoring_and_fail_fast_stops(tokenizer):
    with EnvWorkers(RowEnv, timeout_s=10) as workers:
        eps = _rollout(tokenizer, workers, ["die", "ok"])
    fns = [RewardFn("len", lambda completion: float(len(completion)))]
    out = score_episodes(eps, fns)
    assert [e.reward is None for e in eps] == [True, False]
    (err,) = out.errors
    assert err.sample_id == eps[0].sample_id and err.source == "environment" and "died" in err.message
    with pytest.raises(EnvError, match=f"environment on sample '{eps[0].sample_id}'.*died"):
        score_episodes(eps, fns, fail_fast=True)


def _train_cfg(tiny_model_dir, run_dir, env, *extra):
    return load_config(REPO / "examples" / "arithmetic_grpo.yaml", tiny_overrides(tiny_model_dir, run_dir) + [
        f"rollout.env={BAD_ENVS}:{env}", "rewards=[{fn: 'plainrl.rollout.envs:env_reward'}]",
        "eval.before=false", "eval.after=false", *extra])


@pytest.mark.parametrize("env, extra", [("raises", ["rollout.env_timeout_s=null"]), ("raises", []),
                                        ("hangs", ["rollout.env_timeout_s=1"])])
def test_failing_environments_in_a_real_training_step(tiny_model_dir, tmp_path, env, extra):
    before = _children()
    run = loop.train(_train_cfg(tiny_model_dir, tmp_path / "run", env, *extra))
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 2  # the run went on
    for r in rows:
        assert r["reward/unscorable"] == 4.0 and r["env/error_rate"] == 1.0
        assert r["loss"] == 0.0  # unscorable samples get advantage 0
    errors = [json.loads(x) for x in (run / "errors.jsonl").read_text().splitlines()]
    assert len(errors) == 8 and {e["source"] for e in errors} == {"environment"}
    assert {e["step"] for e in errors} == {0, 1} and all(e["sample_id"].startswith("s") for e in errors)
    expected = "did not return within 1 s" if env == "hangs" else "RuntimeError: tool backend down"
    assert all(expected in e["error"] for e in errors)
    assert _gone(_children() - before), "env workers outlived the run"


def test_fail_fast_stops_at_a_failing_environment(tiny_model_dir, tmp_path):
    with pytest.raises(EnvError, match="environment on sample 's0-.*tool backend down"):
        loop.train(_train_cfg(tiny_model_dir, tmp_path / "run", "raises", "rollout.fail_fast=true"))


def test_bad_env_references_are_config_errors_before_any_model_loads(tiny_model_dir, tmp_path):
    from plainrl.config import ConfigError
    from plainrl.rewards import RewardLoadError

    with pytest.raises(ConfigError, match="rollout.env='nope': use a built-in"):
        load_config(REPO / "examples" / "arithmetic_grpo.yaml", ["rollout.env=nope"])
    with pytest.raises(RewardLoadError, match=r"rollout.env 'nope.py:f': file .* not found"):
        run_setup.prepare(load_config(REPO / "examples" / "arithmetic_grpo.yaml",
                                 tiny_overrides(tiny_model_dir, tmp_path / "run") + ["rollout.env=nope.py:f"]))


class NanRewardEnv(RowEnv):
    def step(self, turn_text, state):
        return StepResult(done=True, reward=float("nan") if state.row.get("how") == "nan" else 1.0)


def test_a_nan_environment_reward_makes_the_sample_unscorable(tokenizer):
    from plainrl.rollout.envs import env_reward

    with EnvWorkers(NanRewardEnv, timeout_s=10) as workers:
        eps = _rollout(tokenizer, workers, ["nan", "ok"])
    out = score_episodes(eps, [RewardFn("env_reward", env_reward)], timeout_s=10)
    assert [e.reward for e in eps] == [None, 1.0]
    (err,) = out.errors
    assert err.sample_id == eps[0].sample_id and "returned nan, expected a finite float" in err.message


def test_max_live_runs_episodes_in_waves_with_a_bounded_number_of_workers(tokenizer):
    prompts = [make_prompt(tokenizer, f"Task {i}", i) for i in range(3)]

    class Counting(EosEngine):
        def __init__(self, eos):
            super().__init__(eos)
            self.batches = []

        def generate(self, prompts, params, *, seeds=None):
            self.batches.append(len(prompts))
            return super().generate(prompts, params, seeds=seeds)

    def run(factory, max_live):
        engine = Counting(tokenizer.eos_token_id)
        eps = multi_turn_rollout(engine, prompts, factory, SamplingParams(max_new_tokens=8), tokenizer, group_size=2,
                                 step=0, max_turns=None, max_total_tokens=64, max_live=max_live)
        return eps, engine.batches

    whole, batches = run(CountingEnv, None)
    assert max(batches) == 6
    with EnvWorkers(CountingEnv, timeout_s=30) as workers:
        waves, batches = run(workers, 4)
        # at most 4 episodes in flight (a batch is whatever of them waits for the engine: timing decides
        # whether that is 4 or fewer), and the other 2 reuse the same 4 workers
        assert workers.started == 4 and max(batches) <= 4
    key = lambda e: (e.sample_id, e.group, e.completion_ids, e.loss_mask, e.env.info)  # noqa: E731
    assert [key(e) for e in waves] == [key(e) for e in whole]
    assert [e.group for e in whole] == [0, 0, 1, 1, 2, 2]
    with pytest.raises(ValueError, match="max_live"):
        run(CountingEnv, 0)
