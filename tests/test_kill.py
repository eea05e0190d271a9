"""A training process killed for real: SIGKILL of ``plainrl train`` at a known point (between
two checkpoints, one step past the last one logged; tests/data/gate_reward.py holds the run
there), then the same command resumes it. The result equals an uninterrupted run's, and
nothing the trainer started outlives it by more than 10 s: reward and environment worker
processes, the Python tool's sandboxed processes (under setsid and in a PID namespace of
their own), the gateway's socket and an agent's subprocesses (tests/data/held.py holds those
alive); vLLM's engine processes: tests/test_vllm_kill.py."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import uuid

import psutil
import pytest
import torch
from safetensors.torch import load_file

from conftest import REPO, tiny_overrides

DATA = REPO / "tests" / "data"
ORPHAN_GRACE_S = 10  # the promise: the trainer's processes are gone this long after it is killed


def _cmd(tiny_model_dir, run_dir) -> list[str]:
    return [sys.executable, "-m", "plainrl.cli", *_args(tiny_model_dir, run_dir)]


def _args(tiny_model_dir, run_dir) -> list[str]:
    """``plainrl train``'s arguments; one torch thread (``threads=1``), in this process as in a child."""
    return ["train", str(REPO / "examples" / "arithmetic_grpo.yaml"), "threads=1",
            *tiny_overrides(tiny_model_dir, run_dir), "train.steps=4", "checkpoint.every=2", "train.lr=1e-2",
            "eval.before=false", "eval.after=false", "log.tensorboard=false", "log.rollouts_per_step=4",
            # rewards in worker processes, the environment in worker processes: children to leave behind
            f"rewards=[{{fn: '{DATA / 'gate_reward.py'}:length_bonus'}}]", "rollout.reward_timeout_s=600",
            "rollout.reward_workers=2", f"rollout.env={DATA / 'bad_envs.py'}:fine", "rollout.env_timeout_s=600",
            # one episode at a time: model calls are not batched by timing (same samples for a seed)
            "rollout.max_concurrent_episodes=1"]


def _env(**extra) -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", **extra}


def _marked(mark: str) -> list[psutil.Process]:
    """Every process whose command line carries ``mark`` (tests/data/held.py), wherever it went."""
    return [p for p in psutil.process_iter(["cmdline"]) if mark in (p.info["cmdline"] or [])]


def _session(p: psutil.Process) -> int | None:
    try:
        return os.getsid(p.pid)
    except ProcessLookupError:
        return None


def _wait_until(held, job: subprocess.Popen, log, what: str, limit_s: float = 600):
    """Wait for ``held()`` to return something true while ``job`` runs; returns it. ``limit_s``
    only ends a run that never gets there (a failure), it is not what the test waits for."""
    deadline = time.monotonic() + limit_s
    while not (got := held()):
        assert job.poll() is None, f"the run ended before {what}:\n" + log.read_text()[-4000:]
        assert time.monotonic() < deadline, f"the run never reached {what}"
        time.sleep(0.05)
    return got


def _kill_and_expect_gone(job: subprocess.Popen, started: list[psutil.Process], mark: str | None = None) -> None:
    """SIGKILL ``job`` (the trainer); every process of ``started``, and every one carrying ``mark``
    when the trainer is dead (started after the list was made), must be gone ORPHAN_GRACE_S later."""
    job.send_signal(signal.SIGKILL)
    assert job.wait(timeout=30) == -signal.SIGKILL
    killed = time.monotonic()
    late = [p for p in _marked(mark) if p not in started] if mark else []
    _, alive = psutil.wait_procs(started + late, timeout=ORPHAN_GRACE_S)
    assert not alive, f"still running {time.monotonic() - killed:.1f} s after the trainer's SIGKILL: {alive}"


def _rows(run_dir) -> list[dict]:
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in r.items() if not k.startswith(("time/", "system/", "perf/"))} for r in rows]


def _train_here(args: list[str], capfd) -> str:
    """``plainrl train`` with ``args`` in this process (no interpreter to start, torch already
    imported); returns what it wrote to stderr. The torch thread count is set back after."""
    from plainrl.cli import main

    threads = torch.get_num_threads()
    capfd.readouterr()
    try:
        code = main(args)
    finally:
        torch.set_num_threads(threads)
    err = capfd.readouterr().err
    assert code == 0, err[-4000:]
    return err


@pytest.mark.e2e
@pytest.mark.timeout(1800)  # three runs of the tiny model: 680 s measured on 2 cores at load average 20
def test_sigkill_then_resume_equals_the_uninterrupted_run_and_leaves_no_process(tiny_model_dir, tmp_path, capfd):
    """The uninterrupted run and the resume run in this process (the same command line as the
    killed child's, ``plainrl.cli.main``); only the run that is killed needs a process of its own."""
    full, cut = tmp_path / "full", tmp_path / "cut"
    _train_here(_args(tiny_model_dir, full), capfd)

    gated = tmp_path / "gated"
    log = open(tmp_path / "cut.log", "w")
    job = subprocess.Popen(_cmd(tiny_model_dir, cut), env=_env(PLAINRL_TEST_GATE=str(cut)), stdout=log,
                           stderr=subprocess.STDOUT)
    try:
        _wait_until(gated.exists, job, tmp_path / "cut.log", "the gate")  # inside step 3's reward call
        started = psutil.Process(job.pid).children(recursive=True)
        names = sorted(p.name() for p in started)
        assert len(started) >= 3, names  # 2 reward workers and at least one environment worker
        _kill_and_expect_gone(job, started)
    finally:
        if job.poll() is None:
            job.kill()
        log.close()
    assert (cut / "checkpoints" / "latest").read_text().strip() == "step-000002"
    assert not (cut / "checkpoints" / "step-000004").exists()
    killed_rows = _rows(cut)
    assert [r["step"] for r in killed_rows] == [0, 1, 2]  # one step past the checkpoint, then the kill

    assert "resumed from" in _train_here(_args(tiny_model_dir, cut), capfd)  # the same command again
    assert _rows(cut) == _rows(full)  # each step once, equal to the uninterrupted run's
    assert killed_rows == _rows(full)[:3]  # the step the killed run logged past its checkpoint, redone the same
    assert (cut / "rollouts.jsonl").read_text() == (full / "rollouts.jsonl").read_text()
    a = load_file(full / "final" / "adapter_model.safetensors")
    b = load_file(cut / "final" / "adapter_model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert any(t.abs().max() > 0 for n, t in a.items() if "lora_B" in n)  # B starts at 0: it trained


def _end(job: subprocess.Popen, mark: str) -> None:
    """After a failed test too: nothing of it left running."""
    if job.poll() is None:
        job.kill()
    for p in _marked(mark):
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass


def _held_run(tiny_model_dir, tmp_path, example: str, *overrides: str, **env: str):
    """``plainrl train`` of ``example`` (tiny model, no evaluation) with tests/data/held.py's mark
    in its environment; returns ``(process, log path, mark)``."""
    mark = f"plainrl-test-held-{uuid.uuid4().hex}"
    cmd = [sys.executable, "-m", "plainrl.cli", "train", str(REPO / "examples" / example),
           *tiny_overrides(tiny_model_dir, tmp_path / "run"), "eval.before=false", "eval.after=false",
           "log.tensorboard=false", *overrides]
    log = tmp_path / "run.log"
    with open(log, "w") as out:
        job = subprocess.Popen(cmd, env=_env(PLAINRL_TEST_MARK=mark, **env), stdout=out, stderr=subprocess.STDOUT)
    return job, log, mark


@pytest.mark.e2e
@pytest.mark.parametrize("env_timeout_s", ["600", "null"], ids=["env-worker", "in-trainer"])
def test_sigkill_leaves_no_sandboxed_tool_process(tiny_model_dir, tmp_path, env_timeout_s):
    """The Python tool's sandbox (a keeper started under setsid, the code in a PID namespace),
    with the environment in a worker process and in the trainer's own: a tool process and a
    grandchild that called setsid() again are running when the trainer is killed."""
    job, log, mark = _held_run(tiny_model_dir, tmp_path, "arithmetic_python_tool.yaml",
                               f"rollout.env={DATA / 'held.py'}:held_python_tool",
                               f"rollout.env_timeout_s={env_timeout_s}", "rollout.max_concurrent_episodes=1")
    try:
        def held():  # the tool process (under the keeper's setsid) and its grandchild, after its own setsid()
            procs = _marked(mark)
            sessions = {_session(p) for p in procs} - {None, os.getsid(job.pid)}
            return procs if len(sessions) == 2 else None

        tool = _wait_until(held, job, log, "the held tool call")
        started = psutil.Process(job.pid).children(recursive=True)
        assert set(tool) <= set(started)  # found through the process tree, setsid() notwithstanding
        _kill_and_expect_gone(job, started, mark)
    finally:
        _end(job, mark)


@pytest.mark.e2e
def test_sigkill_closes_the_gateway_and_ends_the_agents_subprocesses(tiny_model_dir, tmp_path):
    """An agent that runs a harness as a subprocess on the run's gateway (llm.openai_env()); the
    harness has made a request and waits on a tool of its own when the trainer is killed."""
    gate = tmp_path / "gate"
    gate.mkdir()
    job, log, mark = _held_run(tiny_model_dir, tmp_path, "agent_openai.yaml",
                               f"rollout.agent={DATA / 'held.py'}:held_agent",
                               "rewards=[{fn: 'plainrl.rollout.envs:env_reward'}]", PLAINRL_TEST_GATE=str(gate))
    try:
        [first, *_] = _wait_until(lambda: sorted(gate.glob("*.json")), job, log, "a harness holding")
        held = json.loads(first.read_text())
        started = psutil.Process(job.pid).children(recursive=True)
        assert {held["harness"], held["tool"]} <= {p.pid for p in started} and len(_marked(mark)) >= 2
        socket.create_connection(("127.0.0.1", held["port"]), timeout=10).close()  # the gateway listens
        _kill_and_expect_gone(job, started, mark)
    finally:
        _end(job, mark)
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection(("127.0.0.1", held["port"]), timeout=10)
