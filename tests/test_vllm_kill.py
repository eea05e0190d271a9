"""A run with vLLM in the trainer's process (rollout.engine=vllm): its first two steps sample the
learner's policy after each sync, and at its SIGKILL vLLM's engine core process (and any worker of
its own) is gone within ORPHAN_GRACE_S of the trainer's death. One run for both: starting vLLM is
most of its cost. Runs under `make test-vllm`; skipped where vLLM is not installed."""

from __future__ import annotations

import json
import subprocess
import sys

import psutil
import pytest

pytest.importorskip("vllm", reason="vLLM is not installed in this venv; `make test-vllm` runs these tests")

from conftest import REPO  # noqa: E402
from test_kill import DATA, _env, _kill_and_expect_gone, _wait_until  # noqa: E402

pytestmark = pytest.mark.vllm


LOGPROB_TOL = 2e-3  # mean |vLLM - learner| logprob, float32 (tests/test_vllm_engine.py)


def test_a_colocated_run_samples_its_policy_and_sigkill_leaves_no_engine_process(tmp_path):
    gate, run = tmp_path / "gated", tmp_path / "run"
    cmd = [sys.executable, "-m", "plainrl.cli", "train", str(REPO / "examples" / "arithmetic_grpo.yaml"),
           f"run_dir={run}", "rollout.engine=vllm", "rollout.vllm.enforce_eager=true",
           "model.dtype=float32", "model.max_context=512", "rollout.prompts_per_step=2", "rollout.group_size=2",
           "rollout.max_new_tokens=16", "eval.before=false", "eval.after=false", "log.progress=false",
           "log.report=false", "log.tensorboard=false", "algorithm.correction.methods=[token_tis]",
           # the 2 steps' 8 completions scored, then held in the third step's first reward call, in the
           # trainer's process: vLLM has sampled and waits
           f"rewards=[{{fn: '{DATA / 'held.py'}:held_reward'}}]", "rollout.reward_timeout_s=null"]
    log = tmp_path / "run.log"
    with open(log, "w") as out:
        job = subprocess.Popen(cmd, env=_env(PLAINRL_TEST_GATE=str(gate), PLAINRL_TEST_HOLD_AFTER="8"),
                               stdout=out, stderr=subprocess.STDOUT)
    try:
        _wait_until(gate.exists, job, log, "the third step's reward call", limit_s=1200)
        started = psutil.Process(job.pid).children(recursive=True)
        names = [" ".join(p.cmdline()) + " " + p.name() for p in started]
        assert any("EngineCore" in n for n in names), names  # vLLM's engine core runs in a process of its own
        _kill_and_expect_gone(job, started)
    finally:
        if job.poll() is None:
            job.kill()
    steps = [r for r in (json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()) if "time/sync" in r]
    assert len(steps) == 2, steps
    # after each sync (auto on CPU: the LoRA model merged, in full) vLLM samples the learner's
    # policy: logprobs agree, no weight is truncated
    assert all(r["rollout/logprob_diff"] < LOGPROB_TOL and r["is/truncated_fraction"] == 0.0 for r in steps), steps
