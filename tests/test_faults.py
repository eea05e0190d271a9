"""Faults: SIGTERM/SIGINT stop at a step boundary with a checkpoint; non-finite steps are skipped."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch

import plainrl.train.learner as learner_mod
import plainrl.run.loop as loop
from conftest import REPO, tiny_overrides
from plainrl.config import load_config
from plainrl.run.lifecycle import Diverged

DATA = REPO / "tests" / "data"


def _over(tiny_model_dir, run_dir, steps):
    return tiny_overrides(tiny_model_dir, run_dir) + [
        f"train.steps={steps}", "eval.before=false", "eval.after=false", "log.tensorboard=false",
        f"rewards=[{{fn: '{DATA / 'my_reward.py'}:length_bonus'}}]",
    ]


def _steps_logged(run_dir):
    f = run_dir / "metrics.jsonl"
    return [json.loads(x)["step"] for x in f.read_text().splitlines()] if f.exists() else []


def _survivors(run_dir):
    """Processes still alive that belong to the run (forked workers share its command line)."""
    import psutil

    found = []
    for p in psutil.process_iter(["cmdline"]):
        try:
            if str(run_dir) in " ".join(p.info["cmdline"] or []):
                found.append(p)
        except psutil.Error:
            pass
    return found


def test_signal_checkpoints_and_exits_75_then_resumes(tiny_model_dir, tmp_path):
    """SIGTERM, then SIGINT to the run that resumed from SIGTERM's checkpoint (one chain of runs
    instead of a fresh run per signal): each stops at a step boundary with a checkpoint, exits
    75 and leaves no process; the same command resumes from there, and a short last run ends it."""
    run = tmp_path / "run"
    # reward calls in worker processes, so there are children to leave behind
    cmd = [sys.executable, "-m", "plainrl.cli", "train", str(REPO / "examples" / "arithmetic_grpo.yaml"),
           *_over(tiny_model_dir, run, 500), "rollout.reward_timeout_s=30"]
    done = 0  # steps checkpointed so far
    for sig in (signal.SIGTERM, signal.SIGINT):
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        deadline = time.monotonic() + 600  # only ends a run that never gets there (a failure)
        try:  # a step past the last checkpoint logged (the resumed run's first one, after SIGTERM)
            while len(_steps_logged(run)) <= done:
                assert proc.poll() is None and time.monotonic() < deadline, f"no step past {done} logged"
                time.sleep(0.2)
            proc.send_signal(sig)
            _, err = proc.communicate(timeout=120)
        finally:
            if proc.poll() is None:
                proc.kill()  # never leave a training process behind a failed test
        assert proc.returncode == 75, (sig, err)
        assert "resume" in err.replace("resumed from", "")  # the hint, not the resumed run's own line
        assert ("resumed from" in err) == (done > 0)  # the SIGINT run is the resumed one
        assert not _survivors(run)
        assert _steps_logged(run) == list(range(len(_steps_logged(run))))  # each step once
        assert len(_steps_logged(run)) > done
        done = max(_steps_logged(run)) + 1
        assert (run / "checkpoints" / f"step-{done:06d}" / "manifest.json").is_file()
    # the same command resumes from there (a short run this time)
    cmd_resume = [*cmd[:-len(_over(tiny_model_dir, run, 500)) - 1], *_over(tiny_model_dir, run, done + 1)]
    out = subprocess.run(cmd_resume, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert "resumed from" in out.stderr
    assert _steps_logged(run) == list(range(done + 1))


def test_second_sigint_exits_at_once(tiny_model_dir, tmp_path):
    run = tmp_path / "run"
    # a reward that sleeps keeps the step busy, so only the second SIGINT can end it quickly
    slow = f"rewards=[{{fn: '{DATA / 'bad_rewards.py'}:hangs'}}]"
    cmd = [sys.executable, "-m", "plainrl.cli", "train", str(REPO / "examples" / "arithmetic_grpo.yaml"),
           *_over(tiny_model_dir, run, 500), slow]
    marker = tmp_path / "in_reward"
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "PLAINRL_TEST_MARKER": str(marker)})
    deadline = time.monotonic() + 180
    while not marker.exists() and time.monotonic() < deadline:  # inside the first step's reward call
        time.sleep(0.2)
    try:
        assert marker.exists(), "the run never reached its reward call"
        proc.send_signal(signal.SIGINT)
        time.sleep(0.5)
        start = time.monotonic()
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=60)
    finally:
        proc.kill()  # never leave a training process behind a failed test
    assert proc.returncode == 130, err
    assert time.monotonic() - start < 10
    assert not _steps_logged(run)


def test_non_finite_steps_are_skipped_then_the_run_stops(tiny_model_dir, tmp_path, monkeypatch):
    real = learner_mod.policy_loss

    def nan_loss(*a, **k):
        loss, stats = real(*a, **k)
        return loss * float("nan"), stats

    monkeypatch.setattr(learner_mod, "policy_loss", nan_loss)
    seen = {}
    real_setup = loop.setup

    def spy_setup(cfg, *rest):
        run = real_setup(cfg, *rest)
        seen["run"] = run
        seen["before"] = [p.detach().clone() for p in run.learner.params]
        return run

    monkeypatch.setattr(loop, "setup", spy_setup)
    cfg = load_config(REPO / "examples" / "arithmetic_grpo.yaml",
                      _over(tiny_model_dir, tmp_path / "run", 10) + ["train.max_bad_steps=3"])
    with pytest.raises(Diverged, match="step 2: 3 steps in a row"):
        loop.train(cfg)
    assert all(torch.equal(a, b) for a, b in zip(seen["before"], seen["run"].learner.params))
    rows = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["skipped_step"] for r in rows] == [1.0, 1.0, 1.0]
    assert all(r["loss"] == "nan" for r in rows)  # logged as it is, not smoothed


def test_a_stop_agreed_under_torchrun_leaves_sigterm_ignored():
    """torchrun sends SIGTERM to the ranks still running once one exits: after a stop agreed
    by all ranks (Preempted), a rank finishing its exit must not die of it (status -15, not 75).
    In one process, and on any other way out, the handlers are restored."""
    from plainrl.run.lifecycle import GracefulStop, Preempted

    before = signal.getsignal(signal.SIGTERM)
    try:
        for agree, raised, after in ((lambda v: v, Preempted(1, signal.SIGTERM, REPO), signal.SIG_IGN),
                                     (None, Preempted(1, signal.SIGTERM, REPO), before),
                                     (lambda v: v, RuntimeError("boom"), before)):
            with pytest.raises(type(raised)):
                with GracefulStop(agree=agree):
                    assert signal.getsignal(signal.SIGTERM) not in (before, signal.SIG_IGN)
                    raise raised
            assert signal.getsignal(signal.SIGTERM) == after
            assert signal.getsignal(signal.SIGINT) == signal.default_int_handler
            signal.signal(signal.SIGTERM, before)
    finally:
        signal.signal(signal.SIGTERM, before)
