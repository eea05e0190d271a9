"""End-to-end runs with the real embedded model (SmolLM2-135M-Instruct), kept short."""

import json
import math

import pytest
import torch
from safetensors.torch import load_file

from conftest import GSM8K_TRAIN, REPO
from plainrl.cli import main

pytestmark = pytest.mark.e2e


def test_arithmetic_demo_config_two_steps_real_model(tmp_path, capsys):
    """Greedy pass@1 is deterministic, so ``plainrl eval`` must reproduce the loop's own
    evaluations: on the config (the base model) the eval-before figure, on the run
    directory (the saved ``final/`` adapter) the eval-after one. A high learning rate
    makes two steps move the policy off its initial adapter (LoRA's B starts at zero)."""
    run = tmp_path / "run"
    over = [f"run_dir={run}", "train.steps=2", "train.warmup_steps=0", "rollout.prompts_per_step=2",
            "rollout.max_new_tokens=24", "data.eval_size=16", "log.progress=false", "train.lr=3e-2"]
    config = str(REPO / "examples" / "arithmetic_grpo.yaml")
    assert main(["train", config, *over]) == 0
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "reward/mean" in r]
    assert len(steps) == 2 and all(r["tokens/completion"] > 0 and math.isfinite(r["loss"]) for r in steps)
    before, after = [r for r in rows if "eval/n" in r]
    assert before["eval/n"] == after["eval/n"] == 16
    capsys.readouterr()
    assert main(["eval", config, *over]) == 0
    assert json.loads(capsys.readouterr().out)["eval/pass@1"] == before["eval/pass@1"]
    assert main(["eval", str(run)]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["model"].endswith("final") and out["eval/pass@1"] == after["eval/pass@1"]
    lora_b = load_file(run / "final" / "adapter_model.safetensors")
    assert any(t.abs().max() > 0 for n, t in lora_b.items() if "lora_B" in n)  # initialised to 0, so it trained


@pytest.mark.timeout(1800)  # 20 steps of the real 135M model
def test_demo_config_learns_in_twenty_steps(tmp_path):
    """The demo's recipe raises its training reward within 20 of its 30 steps (the model
    first learns to state 'Answer: N'); a broken gradient, advantage or sync shows here.

    The reward of steps 11-20 against steps 1-5, not one greedy evaluation at step 20: the
    policy swings step to step while it learns the format (float32, seed 0, on a Zen 4 CPU:
    `correctness` 0.94 at step 16, 0.0 at steps 19-20), so a 32-problem evaluation there
    passed on one CPU and read 0.03 -> 0.0 in bfloat16 on another. Measured gains of this
    figure: +0.37 to +0.62 in the demo's runs (seeds 0-2, bfloat16 and float32, Zen 4), +0.18
    in this test in bfloat16 there (whose `correctness` was still ~0 at step 20: the
    trajectory depends on the CPU's rounding). The bar, +0.1, sits below the smallest gain
    seen; a run whose update or sync is broken has nothing to raise its reward."""
    run = tmp_path / "run"
    over = [f"run_dir={run}", "train.steps=20", "eval.before=false", "eval.after=false", "log.progress=false",
            "log.tensorboard=false"]
    assert main(["train", str(REPO / "examples" / "arithmetic_grpo.yaml"), *over]) == 0
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    rewards = [r["reward/mean"] for r in rows if "reward/mean" in r]
    assert len(rewards) == 20
    first, late = sum(rewards[:5]) / 5, sum(rewards[10:]) / 10
    assert late >= first + 0.1, (first, late, rewards)


@pytest.mark.skipif(not GSM8K_TRAIN.is_file(), reason="GSM8K train split not beside the repo")
def test_gsm8k_config_one_step_on_the_real_file(tiny_model_dir, tmp_path, capsys):
    """The GSM8K config on GSM8K's real train file (7,473 rows: the loader, the held-out split,
    the prompt template) for one step, then `plainrl eval` of the run on the same held-out rows.
    The tiny random model: the file and the config are under test, not the model."""
    run = tmp_path / "run"
    over = [f"run_dir={run}", f"model.name={tiny_model_dir}", "model.dtype=float32", f"data.path={GSM8K_TRAIN}", "data.subset=null", "train.steps=1", "train.warmup_steps=0",
            "rollout.prompts_per_step=1", "rollout.group_size=2", "rollout.max_new_tokens=32", "data.eval_holdout=4",
            "data.eval_size=4", "eval.before=false", "log.progress=false"]
    assert main(["train", str(REPO / "examples" / "gsm8k_grpo.yaml"), *over]) == 0
    after = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()][-1]
    capsys.readouterr()
    assert main(["eval", str(run)]) == 0  # the run's 4 held-out rows, greedy: the loop's last figure again
    out = json.loads(capsys.readouterr().out)
    assert out["eval/n"] == after["eval/n"] == 4 and out["eval/pass@1"] == after["eval/pass@1"]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.gpu
def test_two_steps_on_gpu_bf16(tmp_path):
    run = tmp_path / "run"
    over = [f"run_dir={run}", "device=cuda", "train.steps=2", "train.warmup_steps=0", "data.eval_size=8",
            "log.progress=false"]
    assert main(["train", str(REPO / "examples" / "arithmetic_grpo.yaml"), *over]) == 0
