"""plainrl.integrations.verifiers: a verifiers (0.4.0) taskset that runs offline, with its own two-turn Env,
trained 2 tiny steps: each task a verifiers episode (null harness, subprocess runtime) whose model calls
reach the run's gateway through verifiers' TrainClientConfig (POST /inference/v1/generate); rewards as
the traces record them, every trace branch a recorded segment; a failing verifiers episode fails its
plainrl episode."""

from __future__ import annotations

import json

import pytest

from conftest import REPO, tiny_overrides
from plainrl.cli import main

pytest.importorskip("verifiers.v1", reason="verifiers is not installed (pip install 'plainrl[verifiers]')")

EXAMPLE = REPO / "examples" / "verifiers_grpo.yaml"
TASKSET = '''
import verifiers.v1 as vf


class CountTask(vf.Task[vf.TaskData, vf.State, vf.TaskConfig]):
    @vf.reward(weight=0.5)
    async def answered(self, trace) -> float:
        return 1.0

    @vf.reward
    async def fixed(self, task) -> float:
        if task.name == "boom":
            raise RuntimeError("scorer broke")
        return 0.25


class CountTaskset(vf.Taskset[CountTask, vf.TasksetConfig]):
    def load(self):
        for name in ["a", "b", "c", "d", "boom"]:
            yield CountTask(vf.TaskData(name=name, prompt=f"Say {name}."), self.config.task)


class TwoTurnConfig(vf.EnvConfig):
    player: vf.AgentConfig = vf.AgentConfig()


class TwoTurnEnv(vf.Env[TwoTurnConfig]):
    """The taskset's own Env (verifiers pairs it through __all__): a second user turn, a reward of its own."""

    async def run(self, task, agents):
        async with agents.player.interaction(task) as interaction:
            segment = await interaction.turn()
            if not segment.terminated:
                await interaction.turn("Again, shorter.")
        interaction.trace.record_reward("env_turns", 2.0, 0.5)


__all__ = ["CountTaskset", "TwoTurnEnv"]
'''


def records(run, name):
    path = run / name
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def test_rows_carry_each_task(tmp_path):
    from plainrl.integrations.verifiers import rows

    (tmp_path / "count.py").write_text(TASKSET)
    got = rows(str(tmp_path / "count.py"), size=2, skip=1)
    assert [r["vf_task"]["name"] for r in got] == ["b", "c"] and got[0]["prompt"] == "Say b."
    with pytest.raises(ValueError, match="verifiers taskset 'no-such-taskset'"):
        rows("no-such-taskset")


def test_two_tiny_steps_rewards_as_the_trace_records_them(tiny_model_dir, tmp_path):
    (tmp_path / "count.py").write_text(TASKSET)
    run = tmp_path / "run"
    # each task a verifiers episode in a process of its own: one prompt a step, its group of two
    over = [f"data.source_args={{taskset: {tmp_path / 'count.py'}, size: 4}}", "data.eval_source_args=null",
            "eval.before=false", "eval.after=false", "rollout.prompts_per_step=1"]
    assert main(["train", str(EXAMPLE), *tiny_overrides(tiny_model_dir, run), *over]) == 0
    steps = [r for r in records(run, "metrics.jsonl") if "reward/mean" in r]
    assert [r["step"] for r in steps] == [0, 1]
    rollouts = records(run, "rollouts.jsonl")
    assert rollouts
    for r in rollouts:
        info = r["env"]["info"]
        # the task's two rewards (one weighted) and the Env's own, as the trace records them
        assert r["env"]["error"] is None and r["reward"] == pytest.approx(0.5 * 1.0 + 0.25 + 0.5 * 2.0)
        # every branch of the trace is a segment the gateway recorded, with the trace's reward
        # (each matched segment gets its trace's reward; the rollout consumes segment_rewards itself)
        assert info["segments"] == info["vf_branches"] and info["vf_unmatched_segments"] == 0
        assert info["model_tokens"] > 0
    assert not records(run, "errors.jsonl")


def test_a_failed_verifiers_episode_fails_its_own_episode(tiny_model_dir, tmp_path):
    (tmp_path / "count.py").write_text(TASKSET)
    run = tmp_path / "run"
    # the last two tasks ("d", "boom") in one step: "boom"'s scorer raises, "d"'s does not
    over = [f"data.source_args={{taskset: {tmp_path / 'count.py'}, size: 2, skip: 3}}", "data.eval_source_args=null",
            "eval.before=false", "eval.after=false", "train.steps=1", "rollout.prompts_per_step=2",
            "rollout.group_size=1", "algorithm.name=reinforce_pp"]
    assert main(["train", str(EXAMPLE), *tiny_overrides(tiny_model_dir, run), *over]) == 0
    errors = records(run, "errors.jsonl")
    assert errors and all("VerifiersError" in e["error"] and "scorer broke" in e["error"] for e in errors)
    assert len(errors) == 1  # the other task scored
    assert sorted(r["env"]["error"] is None for r in records(run, "rollouts.jsonl")) == [False, True]


def test_segments_get_the_reward_of_the_trace_whose_branch_they_begin():
    from types import SimpleNamespace as NS

    from plainrl.integrations.verifiers import _segment_rewards

    def seg(prompt, completion):
        return NS(prompt_ids=prompt, completion_ids=completion)

    traces = [NS(reward=1.0, branches=[NS(token_ids=[1, 2, 3, 4, 5])]),  # a branch may go on past the call
              NS(reward=0.25, branches=[NS(token_ids=[1, 2, 9]), NS(token_ids=[7, 8])])]
    llm = NS(trajectory=NS(segments=[seg([1, 2], [3]), seg([1, 2], [9]), seg([7], [8]), seg([6], [6])]))
    assert _segment_rewards(llm, traces, default=-1.0) == ([1.0, 0.25, 0.25, -1.0], 1)
