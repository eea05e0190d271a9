"""Exact resume of the whole loop: k steps + resume to N equals N uninterrupted steps."""

import json

import pytest
import torch
from safetensors.torch import load_file

import plainrl.run.loop as loop
import plainrl.run.setup as run_setup
from conftest import REPO, Preempted, preempt_after_checkpoint, tiny_overrides
from plainrl.checkpoint import CheckpointError
from plainrl.config import load_config

DATA = REPO / "tests" / "data"


def _cfg(tiny_model_dir, run_dir, *extra):
    over = tiny_overrides(tiny_model_dir, run_dir) + [
        "train.steps=4", "checkpoint.every=2", "train.lr=1e-2", "eval.before=true", "log.tensorboard=false",
        "log.rollouts_per_step=4",
        f"rewards=[{{fn: '{DATA / 'my_reward.py'}:length_bonus'}}]", *extra,
    ]
    return load_config(REPO / "examples" / "arithmetic_grpo.yaml", over)


def _metrics(run_dir):
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in r.items() if not k.startswith(("time/", "system/", "perf/"))} for r in rows]


@pytest.mark.parametrize("lora", [True, False])
def test_resume_is_exact(tiny_model_dir, tmp_path, monkeypatch, lora):
    extra = [] if lora else ["model.lora.enabled=false"]
    full = loop.train(_cfg(tiny_model_dir, tmp_path / "full", *extra))

    real_save = preempt_after_checkpoint(monkeypatch, run_setup, step=2)
    cut = tmp_path / "cut"
    with pytest.raises(Preempted):
        loop.train(_cfg(tiny_model_dir, cut, *extra))
    monkeypatch.setattr(run_setup, "save_checkpoint", real_save)
    loop.train(_cfg(tiny_model_dir, cut, *extra))  # the same command again resumes

    assert _metrics(cut) == _metrics(full)
    # the sampled completions (logged per step) are identical too
    assert (cut / "rollouts.jsonl").read_text() == (full / "rollouts.jsonl").read_text()
    assert [r["step"] for r in _metrics(cut) if "reward/mean" in r] == [0, 1, 2, 3]
    name = "checkpoints/step-000004/weights.safetensors"
    a, b = load_file(full / name), load_file(cut / name)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    oa = torch.load(full / "checkpoints/step-000004/optimizer.pt", weights_only=True)
    ob = torch.load(cut / "checkpoints/step-000004/optimizer.pt", weights_only=True)
    for k, st in oa["state"].items():
        assert all(torch.equal(st[n], ob["state"][k][n]) for n in st)


def test_resume_with_changed_lora_rank_fails(tiny_model_dir, tmp_path):
    loop.train(_cfg(tiny_model_dir, tmp_path / "r", "train.steps=2"))
    with pytest.raises(CheckpointError, match="model.lora.r"):
        loop.train(_cfg(tiny_model_dir, tmp_path / "r", "train.steps=3", "model.lora.r=4"))
