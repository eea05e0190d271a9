"""rollout.async_steps: 2 with the embedded engine (a copy of the model sampling on the rollout
thread): the staleness bound over a run, an exact resume after kill -9 with batches in flight
(resumed with partial rollouts on), and the copy's weights between pushes."""

from __future__ import annotations

import json
import os
import pickle
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from plainrl.checkpoint import verify
from plainrl.config import load_config
from plainrl.rollout.engines.hf import HFEngine
from plainrl.rollout.engines.factory import sampling_copy
from plainrl.run.async_rollout import IN_FLIGHT
from plainrl.run.setup import make_learner
from plainrl.types import Episode, SamplingParams

REPO = Path(__file__).resolve().parents[1]
N = 2


def _cmd(model_dir: Path, run_dir: Path, *extra: str) -> list[str]:
    return [sys.executable, "-m", "plainrl.cli", "train", str(REPO / "examples" / "arithmetic_grpo.yaml"),
            f"model.name={model_dir}", "model.dtype=float32", f"run_dir={run_dir}", "train.epochs=null",
            "train.warmup_steps=0", "rollout.prompts_per_step=2", "rollout.group_size=2", "rollout.max_new_tokens=8",
            "data.eval_size=2", "eval.before=false", "eval.after=false", "log.progress=false", "log.report=false",
            "log.rollouts_per_step=8", "rollout.max_total_tokens=null", f"rollout.async_steps={N}", *extra]


def _rows(run_dir: Path, name: str) -> list[dict]:
    path = run_dir / name
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def _steps(run_dir: Path) -> list[dict]:
    return [r for r in _rows(run_dir, "metrics.jsonl") if "loss" in r]


@pytest.mark.e2e
def test_async_steps_2_on_the_embedded_engine_bounds_staleness_and_resumes_after_kill_9(tiny_model_dir, tmp_path):
    a = tmp_path / "a"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(_cmd(tiny_model_dir, a, "train.steps=40", "checkpoint.every=2"),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    ckpt = a / "checkpoints" / "step-000004"
    deadline = time.monotonic() + 600
    try:  # kill -9 as soon as the checkpoint of step 4 is complete (its manifest is written last)
        while not (ckpt / "manifest.json").exists():
            assert proc.poll() is None, proc.stderr.read()[-3000:]
            assert time.monotonic() < deadline, "no checkpoint of step 4 in 600 s"
            time.sleep(0.05)
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    log = (a / "log.txt").read_text() if (a / "log.txt").exists() else ""
    steps = _steps(a)
    assert len(steps) >= 4 and all(r["rollout/staleness_max"] <= N for r in steps)
    assert any(r["rollout/staleness_max"] > 0 for r in steps)  # sampled ahead, not in step
    assert all("time/idle_learner" in r and "time/idle_engine" in r for r in steps)
    assert all("is/masked_fraction" in r for r in steps), log[-2000:]  # auto: token TIS + the geometric mask

    assert IN_FLIGHT in verify(ckpt)["files"]
    saved = pickle.loads((ckpt / IN_FLIGHT).read_bytes())
    # the batch of step 4 (next to train) and up to N ahead of it: batch 4 + N may start once
    # the engine holds version 4, which the push after update 3 gives it before the checkpoint
    assert 1 <= len(saved) <= N + 1 and [b.step for b in saved] == list(range(4, 4 + len(saved)))
    assert all(4 - b.policy_step >= 0 and b.step - b.policy_step <= N for b in saved)
    b = tmp_path / "b"
    # resumed with partial rollouts on: the saved batches as they are, the next one in chunks of 3 tokens
    out = subprocess.run(_cmd(tiny_model_dir, b, f"train.steps={4 + len(saved) + 1}", f"checkpoint.resume={ckpt}",
                              "rollout.partial=true", "rollout.partial_chunk=3"),
                         capture_output=True, text=True, timeout=600, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "algorithm.correction.methods: ['token_tis', 'geometric_mask'] (auto:" in out.stdout + out.stderr
    resumed = {r["step"]: r for r in _steps(b)}
    rollouts = _rows(b, "rollouts.jsonl")
    for batch in saved:  # trained as saved: the same completions, sampled with the same weights
        logged = [r["completion"] for r in rollouts if r["step"] == batch.step]
        assert logged == [e.completion_text for e in batch.episodes]
        assert resumed[batch.step]["rollout/staleness"] == batch.step - batch.policy_step <= N
    assert all(r["rollout/staleness_max"] <= N for r in resumed.values())
    fresh = resumed[4 + len(saved)]  # sampled by the resumed run, every token with its version
    assert 0 <= fresh["rollout/partial_fraction"] <= 1 and fresh["rollout/policy_versions_per_sample"] >= 1


@pytest.mark.parametrize("decoder", ["static", "transformers"])
def test_the_copy_samples_with_the_pushed_version_until_the_next_push(tiny_model_dir, tokenizer, decoder):
    """The learner's update does not reach the engine's copy until a push, and after it the
    engine's logprobs of its samples are the learner's (each checked against the learner's
    weights at that version)."""
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    cfg = load_config(None, ["data.task=arithmetic", "rewards=[{fn: plainrl.rewards.builtins:correctness}]",
                             "model.lora.enabled=false", "rollout.temperature=1.0"])
    learner = make_learner(cfg, model, pad_id=0)
    engine = HFEngine(sampling_copy(model), tokenizer, batch_size=4, decoder=decoder)
    prompts = [tokenizer(t)["input_ids"] for t in ("What is 2 + 2?", "Name a colour.")]

    def gap() -> float:  # the largest |engine - learner| logprob of fresh samples
        gens = engine.generate(prompts, SamplingParams(max_new_tokens=6, temperature=1.0), seeds=[1, 2])
        eps = [Episode(sample_id=str(i), group=i, row={}, prompt_ids=p, completion_ids=g.token_ids,
                       logprobs=g.logprobs, loss_mask=[1] * len(g.token_ids), finish_reason=g.finish_reason)
               for i, (p, g) in enumerate(zip(prompts, gens))]
        lp = learner.completion_logps(eps)
        return max(float((lp[i, : len(e.logprobs)] - torch.tensor(e.logprobs)).abs().max()) for i, e in enumerate(eps))

    assert gap() < 1e-4  # version 0 on both sides
    with torch.no_grad():  # an update: every weight moves
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    assert gap() > 1e-2  # the engine still samples with version 0
    engine.load_weights(model)
    assert gap() < 1e-4  # version 1 on both sides
    assert all(not p.requires_grad for p in engine.model.parameters())
