"""End-to-end runs with the real embedded model (SmolLM2-135M-Instruct), kept short."""

import json

import pytest
import torch

from conftest import GSM8K_TRAIN, REPO
from plainrl.cli import main

pytestmark = pytest.mark.e2e


def test_arithmetic_demo_config_two_steps_real_model(tmp_path):
    run = tmp_path / "run"
    over = [f"run_dir={run}", "train.steps=2", "train.warmup_steps=0", "rollout.prompts_per_step=2",
            "rollout.max_new_tokens=24", "data.eval_size=8", "log.progress=false"]
    assert main(["train", str(REPO / "examples" / "arithmetic_grpo.yaml"), *over]) == 0
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "reward/mean" in r]
    assert len(steps) == 2 and all(r["tokens/completion"] > 0 for r in steps)
    assert [r["eval/n"] for r in rows if "eval/n" in r] == [8, 8]
    assert (run / "final" / "adapter_config.json").is_file()


@pytest.mark.skipif(not GSM8K_TRAIN.is_file(), reason="GSM8K train split not beside the repo")
def test_gsm8k_config_one_step_on_the_real_file(tmp_path, capsys):
    run = tmp_path / "run"
    over = [f"run_dir={run}", f"data.path={GSM8K_TRAIN}", "data.subset=null", "train.steps=1", "train.warmup_steps=0",
            "rollout.prompts_per_step=1", "rollout.group_size=2", "rollout.max_new_tokens=32", "data.eval_holdout=4",
            "data.eval_size=4", "eval.before=false", "log.progress=false"]
    assert main(["train", str(REPO / "examples" / "gsm8k_grpo.yaml"), *over]) == 0
    capsys.readouterr()
    assert main(["eval", str(run), "eval.max_new_tokens=16"]) == 0  # the run's 4 held-out rows
    out = json.loads(capsys.readouterr().out)
    assert out["eval/n"] == 4 and 0.0 <= out["eval/pass@1"] <= 1.0


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.gpu
def test_two_steps_on_gpu_bf16(tmp_path):
    run = tmp_path / "run"
    over = [f"run_dir={run}", "device=cuda", "train.steps=2", "train.warmup_steps=0", "data.eval_size=8",
            "log.progress=false"]
    assert main(["train", str(REPO / "examples" / "arithmetic_grpo.yaml"), *over]) == 0
