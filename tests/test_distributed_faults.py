"""Faults under real ``torchrun`` (2 gloo ranks on CPU, the tiny model): a SIGTERM that
reaches one rank stops both at the same step boundary with a DDP checkpoint (exit status 75
on every rank), which resumes in one process (another world size) and is refused under FSDP2;
a rank that hangs ends the job through ``train.collective_timeout_s`` instead of holding it
for ever. The SIGKILL of a rank and the exact resume after it: tests/test_distributed.py."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time

import psutil
import pytest

from conftest import REPO, tiny_overrides

pytestmark = pytest.mark.e2e
GATE = REPO / "tests" / "data" / "gate_reward.py"


def _cmd(tiny_model_dir, run, *extra, nproc: int | None = 2) -> list[str]:
    launcher = ["-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}"] if nproc else []
    return [sys.executable, *launcher, "-m", "plainrl", "train", str(REPO / "examples" / "arithmetic_grpo.yaml"),
            *tiny_overrides(tiny_model_dir, run), "data.eval_size=2", "eval.before=false", "eval.after=false",
            "log.tensorboard=false", "train.strategy=ddp", f"rewards=[{{fn: {GATE}:length_bonus}}]", *extra]


def _env(**extra) -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", **extra}


# torchrun's grace for its workers after one failed, before it SIGKILLs the rest (30 s by default): a
# worker held where plainrl's SIGTERM handler cannot end it (a hung reward call) waits it out whole. The
# variable is torchrun's documented twin of --shutdown-timeout (ignored by a torch without it: slower only)
SHORT_GRACE = {"TORCH_ELASTIC_SHUTDOWN_TIMEOUT": "2"}


def _steps(run) -> list[int]:
    f = run / "metrics.jsonl"
    return [json.loads(x)["step"] for x in f.read_text().splitlines()] if f.is_file() else []


def _ranks(job: subprocess.Popen) -> dict[int, psutil.Process]:
    """torchrun's workers by RANK (their forked reward workers inherit RANK too: not direct children)."""
    return {int(p.environ()["RANK"]): p for p in psutil.Process(job.pid).children() if "RANK" in p.environ()}


@pytest.mark.timeout(1200)
def test_sigterm_to_one_rank_checkpoints_all_then_resumes_at_another_world_size(tiny_model_dir, tmp_path, capfd):
    run = tmp_path / "run"
    log = open(tmp_path / "job.log", "w")
    job = subprocess.Popen(_cmd(tiny_model_dir, run, "train.steps=200", "checkpoint.every=0"), cwd=REPO, env=_env(),
                           stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 600
        while not _steps(run):
            assert job.poll() is None, (tmp_path / "job.log").read_text()[-4000:]
            assert time.monotonic() < deadline, "no step logged in 600 s"
            time.sleep(0.1)
        _ranks(job)[1].send_signal(signal.SIGTERM)  # rank 1 alone: the stop is agreed at the step boundary
        job.wait(timeout=300)
    finally:
        if job.poll() is None:
            job.kill()
        log.close()
    out = (tmp_path / "job.log").read_text()
    # both ranks ended with 75 (torchrun itself reports the failed workers and exits 1)
    assert sorted(re.findall(r"^\s*exitcode\s*:\s*(-?\d+) \(pid", out, re.M)) == ["75", "75"], out[-4000:]
    done = max(_steps(run)) + 1
    ckpt = run / "checkpoints" / f"step-{done:06d}"
    assert (run / "checkpoints" / "latest").read_text().strip() == ckpt.name  # the boundary after the last step
    assert {"weights.safetensors", "optimizer.pt", "rng-rank1.pt"} <= {p.name for p in ckpt.iterdir()}  # DDP: whole
    state = json.loads((ckpt / "state.json").read_text())
    assert state["extra"]["world_size"] == 2 and state["extra"]["strategy"] == "ddp"

    # refused under FSDP2, naming the strategy to use: the check a resuming rank makes first (in a
    # one-rank gloo group here, not another torchrun job: the same function, minutes less)
    import torch.distributed as dist

    from plainrl.checkpoint import CheckpointError
    from plainrl.checkpoint.ranked import load_ranked

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        with pytest.raises(CheckpointError, match=f"{ckpt} was written whole; resume it with train.strategy=ddp"):
            load_ranked(ckpt, strategy="fsdp2", model=None, optimizer=None, scheduler=None, generator=None,
                        generator_seed=0)
    finally:
        dist.destroy_process_group()

    # one process resumes the 2-rank checkpoint: the data position continues, each step logged once (this
    # process, with no torchrun variable set, is a plain one-process run: no interpreter start to pay)
    from plainrl.cli import main

    capfd.readouterr()
    argv = _cmd(tiny_model_dir, run, f"train.steps={done + 1}", nproc=None)
    assert argv[:4] == [sys.executable, "-m", "plainrl", "train"]
    assert main(argv[3:]) == 0
    out, err = capfd.readouterr()
    assert f"resumed from {ckpt} at step {done}" in err + out
    assert _steps(run) == list(range(done + 1))


@pytest.mark.timeout(900)
def test_a_hung_rank_ends_the_job_through_the_collective_timeout(tiny_model_dir, tmp_path):
    run = tmp_path / "run"
    # short, yet well above how long a rank waits for the other in the set-up before the hang (rank 1 waits
    # for rank 0's model load in a barrier: 10 s timed out there on a 2-core machine at load 13)
    timeout_s = 20
    log = open(tmp_path / "job.log", "w")
    # rank 1 blocks in its first reward call (in its own process: reward_timeout_s=null); rank 0 goes on to
    # gather the step's episodes and waits there
    job = subprocess.Popen(_cmd(tiny_model_dir, run, "rollout.reward_timeout_s=null",
                                f"train.collective_timeout_s={timeout_s}"),
                           cwd=REPO, env=_env(PLAINRL_TEST_GATE=str(run), PLAINRL_TEST_HANG_RANK="1", **SHORT_GRACE),
                           stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 600
        while not (tmp_path / "gated").exists():
            assert job.poll() is None, (tmp_path / "job.log").read_text()[-4000:]
            assert time.monotonic() < deadline, "rank 1 never reached its reward call"
            time.sleep(0.1)
        hung = time.monotonic()
        # the timeout, then torchrun's grace for the hung rank (SHORT_GRACE, then SIGKILL), then a margin
        code = job.wait(timeout=timeout_s + 30 + 120)
        took = time.monotonic() - hung
    finally:
        if job.poll() is None:
            job.kill()
        log.close()
    out = (tmp_path / "job.log").read_text()
    assert code != 0, out[-4000:]
    assert took >= timeout_s * 0.9, f"ended after {took:.0f} s, before the collective timeout: {out[-4000:]}"
    assert re.search(r"[Tt]imed out|timeout", out), out[-4000:]
    assert not _steps(run)  # the step never finished
