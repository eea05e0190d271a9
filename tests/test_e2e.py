"""End-to-end runs with the real embedded model (SmolLM2-135M-Instruct), kept short."""

import json
import math

import pytest
import torch
from safetensors.torch import load_file

from conftest import GSM8K_TRAIN, REPO
from plainrl.cli import main

pytestmark = pytest.mark.e2e


def test_the_real_model_learns_the_answer_format_and_eval_reproduces_the_loop(tmp_path, capsys):
    """The demo's config on the real SmolLM2-135M-Instruct, shrunk to seconds, learns: 3 GRPO steps
    of 2 prompts x 8 samples rewarded by ``format_reward`` (the 'Answer: N' line the demo's model
    learns first) raise the reward from what the base model writes (float32, 2 AVX2 cores, seed 0:
    0.19, then 0.88 and 1.0 after the first and second update). A broken gradient, advantage sign,
    optimizer step or weight sync leaves the sampled policy where it started. (Whether the demo
    itself learns its task over seeds is benchmarks/demo_seeds.py's to show: minutes a seed.)

    Greedy pass@1 is deterministic, so ``plainrl eval`` then reproduces the loop's own
    evaluations: on the config (the base model) the eval-before figure, on the run directory
    (the saved ``final/`` adapter) the eval-after one."""
    run = tmp_path / "run"
    over = [f"run_dir={run}", "model.dtype=float32", "train.steps=3", "train.warmup_steps=0", "train.lr=2e-3",
            "rollout.prompts_per_step=2", "rollout.group_size=8", "rollout.max_new_tokens=32",
            "rewards=[{fn: plainrl.rewards.builtins:format_reward}]", "algorithm.overlong_buffer=null",
            "data.eval_size=8", "log.progress=false", "log.tensorboard=false", "log.report=false"]
    config = str(REPO / "examples" / "arithmetic_grpo.yaml")
    assert main(["train", config, *over]) == 0
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "reward/mean" in r]
    assert len(steps) == 3 and all(r["tokens/completion"] > 0 and math.isfinite(r["loss"]) for r in steps)
    rewards = [r["reward/mean"] for r in steps]
    assert sum(rewards[1:]) / 2 >= rewards[0] + 0.3, rewards
    before, after = [r for r in rows if "eval/n" in r]
    assert before["eval/n"] == after["eval/n"] == 8
    capsys.readouterr()
    assert main(["eval", config, *over]) == 0
    assert json.loads(capsys.readouterr().out)["eval/pass@1"] == before["eval/pass@1"]
    assert main(["eval", str(run)]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["model"].endswith("final") and out["eval/pass@1"] == after["eval/pass@1"]
    lora_b = load_file(run / "final" / "adapter_model.safetensors")
    assert any(t.abs().max() > 0 for n, t in lora_b.items() if "lora_B" in n)  # initialised to 0, so it trained


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
