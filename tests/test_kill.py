"""A training process killed for real: SIGKILL of ``plainrl train`` at a known point (between
two checkpoints, one step past the last one logged; tests/data/gate_reward.py holds the run
there), then the same command resumes it. The result equals an uninterrupted run's, and
nothing the trainer started (reward and environment worker processes) outlives it by more
than 10 s."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import psutil
import pytest
import torch
from safetensors.torch import load_file

from conftest import REPO, tiny_overrides

DATA = REPO / "tests" / "data"
ORPHAN_GRACE_S = 10  # the promise: the trainer's processes are gone this long after it is killed


def _cmd(tiny_model_dir, run_dir) -> list[str]:
    return [sys.executable, "-m", "plainrl.cli", "train", str(REPO / "examples" / "arithmetic_grpo.yaml"),
            *tiny_overrides(tiny_model_dir, run_dir), "train.steps=4", "checkpoint.every=2", "train.lr=1e-2",
            "eval.before=false", "eval.after=false", "log.tensorboard=false", "log.rollouts_per_step=4",
            # rewards in worker processes, the environment in worker processes: children to leave behind
            f"rewards=[{{fn: '{DATA / 'gate_reward.py'}:length_bonus'}}]", "rollout.reward_timeout_s=600",
            "rollout.reward_workers=2", f"rollout.env={DATA / 'bad_envs.py'}:fine", "rollout.env_timeout_s=600",
            # one episode at a time: model calls are not batched by timing (same samples for a seed)
            "rollout.max_concurrent_episodes=1"]


def _env(**extra) -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", **extra}


def _rows(run_dir) -> list[dict]:
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in r.items() if not k.startswith(("time/", "system/", "perf/"))} for r in rows]


@pytest.mark.e2e
@pytest.mark.timeout(1800)  # three runs of the tiny model: 680 s measured on 2 cores at load average 20
def test_sigkill_then_resume_equals_the_uninterrupted_run_and_leaves_no_process(tiny_model_dir, tmp_path):
    full, cut = tmp_path / "full", tmp_path / "cut"
    done = subprocess.run(_cmd(tiny_model_dir, full), env=_env(), capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]

    gated = tmp_path / "gated"
    log = open(tmp_path / "cut.log", "w")
    job = subprocess.Popen(_cmd(tiny_model_dir, cut), env=_env(PLAINRL_TEST_GATE=str(cut)), stdout=log,
                           stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 600
        while not gated.exists():  # inside step 3's reward call: step 2 logged, checkpoint 2 committed
            assert job.poll() is None, (tmp_path / "cut.log").read_text()[-4000:]
            assert time.monotonic() < deadline, "the run never reached the gate"
            time.sleep(0.05)
        trainer = psutil.Process(job.pid)
        started = trainer.children(recursive=True)
        names = sorted(p.name() for p in started)
        assert len(started) >= 3, names  # 2 reward workers and at least one environment worker
        job.send_signal(signal.SIGKILL)
        assert job.wait(timeout=30) == -signal.SIGKILL
        killed = time.monotonic()
        _, alive = psutil.wait_procs(started, timeout=ORPHAN_GRACE_S)
        assert not alive, f"still running {time.monotonic() - killed:.1f} s after the trainer's SIGKILL: {alive}"
    finally:
        if job.poll() is None:
            job.kill()
        log.close()
    assert (cut / "checkpoints" / "latest").read_text().strip() == "step-000002"
    assert not (cut / "checkpoints" / "step-000004").exists()
    killed_rows = _rows(cut)
    assert [r["step"] for r in killed_rows] == [0, 1, 2]  # one step past the checkpoint, then the kill

    resumed = subprocess.run(_cmd(tiny_model_dir, cut), env=_env(), capture_output=True, text=True, timeout=600)
    assert resumed.returncode == 0, resumed.stderr[-4000:]
    assert "resumed from" in resumed.stderr
    assert _rows(cut) == _rows(full)  # each step once, equal to the uninterrupted run's
    assert killed_rows == _rows(full)[:3]  # the step the killed run logged past its checkpoint, redone the same
    assert (cut / "rollouts.jsonl").read_text() == (full / "rollouts.jsonl").read_text()
    a = load_file(full / "final" / "adapter_model.safetensors")
    b = load_file(cut / "final" / "adapter_model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert any(t.abs().max() > 0 for n, t in a.items() if "lora_B" in n)  # B starts at 0: it trained
