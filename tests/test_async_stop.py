"""A stop under ``rollout.async_steps`` does not wait for the batch in flight (an agent episode
may take up to ``rollout.agent_timeout_s``): SIGTERM while the rollout thread samples a batch
that never ends exits 75 with a checkpoint within seconds, and the abandoned batch is sampled
again after resume from the sampler position it started at (plainrl/run/async_rollout.py; the
schedule's side in tests/test_async_rollout.py)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from conftest import REPO, tiny_overrides
from plainrl.cli import main
from plainrl.run.async_rollout import IN_FLIGHT

DATA = REPO / "tests" / "data"
STOP_BOUND_S = 30  # what a scheduler's grace allows (issue: exit 75 with a checkpoint within 30 s)


def _cmd(tiny_model_dir, run_dir, steps: int) -> list[str]:
    return [sys.executable, "-m", "plainrl.cli", "train", str(REPO / "examples" / "arithmetic_grpo.yaml"),
            *tiny_overrides(tiny_model_dir, run_dir), f"train.steps={steps}", "rollout.async_steps=2",
            f"rollout.agent={DATA / 'held.py'}:held_after_agent", "rewards=[{fn: 'plainrl.rollout.envs:env_reward'}]",
            "eval.before=false", "eval.after=false", "log.tensorboard=false", "log.rollouts_per_step=4",
            "algorithm.overlong_buffer=null",
            "rollout.reward_timeout_s=null"]  # (the agent's reward: no worker processes to fork)


def _rows(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


@pytest.mark.e2e
def test_sigterm_abandons_the_batch_in_flight_exits_75_and_resume_samples_it_again(tiny_model_dir, tmp_path,
                                                                                   monkeypatch, capsys):
    run, gate = tmp_path / "run", tmp_path / "held.jsonl"
    # 4 episodes a batch: batch 0 finishes, batch 1's episodes never end (sampled ahead during step 0)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO),
           "PLAINRL_TEST_HOLD_AFTER": "4", "PLAINRL_TEST_GATE": str(gate)}
    proc = subprocess.Popen(_cmd(tiny_model_dir, run, 4), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=env)
    try:
        deadline = time.monotonic() + 300  # only ends a run that never gets there (a failure)
        while len(_rows(gate)) < 4:  # every episode of batch 1 holds
            assert proc.poll() is None and time.monotonic() < deadline, proc.stderr.read()[-3000:]
            time.sleep(0.1)
        sent = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=STOP_BOUND_S)
        stopped_s = time.monotonic() - sent
    finally:
        if proc.poll() is None:
            proc.kill()  # never leave a training process behind a failed test
    assert proc.returncode == 75, err[-3000:]
    assert stopped_s < STOP_BOUND_S
    held = sorted(json.loads(line) for line in gate.read_text().splitlines())
    # whether the stop came during step 0's update or while the learner waited for batch 1, the
    # checkpoint is after step 0 and holds no batch (batch 1 was abandoned)
    assert [r["step"] for r in _rows(run / "metrics.jsonl") if "loss" in r] == [0]
    ckpt = run / "checkpoints" / "step-000001"
    assert (ckpt / "manifest.json").is_file() and not (ckpt / IN_FLIGHT).exists()

    # resumed (no episode holds now): batch 1 sampled again from the sampler position it started at
    # (in this process: the resume is not about a process)
    monkeypatch.setenv("PLAINRL_TEST_HOLD_AFTER", "1000")
    assert main(_cmd(tiny_model_dir, run, 2)[3:]) == 0
    assert "resumed from" in capsys.readouterr().err
    assert [r["step"] for r in _rows(run / "metrics.jsonl") if "loss" in r] == [0, 1]
    assert sorted(r["prompt"] for r in _rows(run / "rollouts.jsonl") if r["step"] == 1) == held
