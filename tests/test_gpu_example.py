"""examples/qwen2.5_1.5b_gpu_grpo.yaml on a CUDA machine with vLLM (`make test-gpu`): one step of the
packaged example by name, with vLLM colocated, on a tiny random model in place of the hub's Qwen
(the hub is not reached in tests) and the GSM8K-format fixture. Skipped, saying why, without CUDA or
vLLM; `make test` validates the same config and runs it tiny on the CPU (tests/test_config.py,
tests/test_loop.py)."""

from __future__ import annotations

import importlib.util
import json
import math

import pytest
import torch

from conftest import REPO, tiny_overrides
from plainrl.cli import main

pytestmark = [
    pytest.mark.gpu, pytest.mark.vllm,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="needs vLLM (pip install 'plainrl[vllm]')"),
]


def test_qwen_gpu_example_steps_with_vllm_on_cuda(tiny_model_dir, tmp_path):
    run = tmp_path / "run"
    over = [*tiny_overrides(tiny_model_dir, run), "model.dtype=bfloat16", "train.steps=1",
            f"data.path={REPO / 'tests' / 'data' / 'gsm_format_mini.jsonl'}", "data.subset=null",
            "data.eval_holdout=1", "rollout.prompts_per_step=2"]
    assert main(["train", "qwen2.5_1.5b_gpu_grpo", *over]) == 0
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "reward/mean" in r]
    assert [r["step"] for r in steps] == [0]
    assert math.isfinite(steps[0]["loss"]) and math.isfinite(steps[0]["rollout/logprob_diff"])
    assert (run / "final" / "adapter_config.json").is_file()
