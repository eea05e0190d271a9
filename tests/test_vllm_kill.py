"""SIGKILL of a run with vLLM in the trainer's process (rollout.engine=vllm): vLLM's engine
core process (and any worker of its own) is gone within ORPHAN_GRACE_S of the trainer's death.
Runs under `make test-vllm`; skipped where vLLM is not installed."""

from __future__ import annotations

import subprocess
import sys

import psutil
import pytest

pytest.importorskip("vllm", reason="vLLM is not installed in this venv; `make test-vllm` runs these tests")

from conftest import REPO  # noqa: E402
from test_kill import DATA, _env, _kill_and_expect_gone, _wait_until  # noqa: E402

pytestmark = pytest.mark.vllm


def test_sigkill_of_a_run_with_vllm_in_process_leaves_no_engine_process(tmp_path):
    gate = tmp_path / "gated"
    cmd = [sys.executable, "-m", "plainrl.cli", "train", str(REPO / "examples" / "arithmetic_grpo.yaml"),
           f"run_dir={tmp_path / 'run'}", "rollout.engine=vllm", "rollout.vllm.enforce_eager=true",
           "model.dtype=float32", "model.max_context=512", "rollout.prompts_per_step=2", "rollout.group_size=2",
           "rollout.max_new_tokens=8", "eval.before=false", "eval.after=false", "log.progress=false",
           "log.report=false", "log.tensorboard=false",
           # held in the first reward call, in the trainer's process: vLLM has sampled and waits
           f"rewards=[{{fn: '{DATA / 'held.py'}:held_reward'}}]", "rollout.reward_timeout_s=null"]
    log = tmp_path / "run.log"
    with open(log, "w") as out:
        job = subprocess.Popen(cmd, env=_env(PLAINRL_TEST_GATE=str(gate)), stdout=out, stderr=subprocess.STDOUT)
    try:
        _wait_until(gate.exists, job, log, "the first reward call", limit_s=1200)
        started = psutil.Process(job.pid).children(recursive=True)
        names = [" ".join(p.cmdline()) + " " + p.name() for p in started]
        assert any("EngineCore" in n for n in names), names  # vLLM's engine core runs in a process of its own
        _kill_and_expect_gone(job, started)
    finally:
        if job.poll() is None:
            job.kill()
