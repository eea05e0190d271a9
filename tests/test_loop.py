"""The whole loop on a tiny random Llama: every example config, the CLI, saving and eval."""

import json
import math
import re
from pathlib import Path

import pytest
import torch

from conftest import GSM8K_TRAIN, REPO, tiny_overrides
from plainrl.cli import main
from plainrl.config import load_config

EXAMPLES = sorted((REPO / "examples").glob("*.yaml"))
# sft/dpo/rm examples train on data rows, not rollouts: tests/test_offline.py runs them
RL_EXAMPLES = [e for e in EXAMPLES if not load_config(e).algorithm.offline]
DATA = REPO / "tests" / "data"


def _data_overrides(example: Path) -> list[str]:
    cfg = load_config(example)
    out = []
    if cfg.data.path is not None:  # hub datasets are not reachable in tests; use the fixture file
        out += [f"data.path={DATA / 'gsm_format_mini.jsonl'}", "data.subset=null", "data.eval_holdout=1"]
    if cfg.device == "cuda" or cfg.rollout.engine == "vllm":
        # a GPU example (qwen2.5_1.5b_gpu_grpo): its data, rewards and algorithm run here on the CPU
        # with the embedded engine (vLLM on CPU is make test-vllm's); what runs on CUDA: docs/gpu.md
        out += ["device=auto", "rollout.engine=hf"]
    if cfg.rollout.agent == "plainrl.integrations.verifiers:agent":
        # each episode a verifiers episode, its model turns each a process of its own: one prompt (a
        # group of two) a step, one held-out prompt
        out += ["rollout.prompts_per_step=1", "data.eval_size=1"]
    return out


def test_every_preset_has_an_example():
    from plainrl.config import PRESETS

    names = {load_config(e).algorithm.name for e in EXAMPLES}
    assert names == set(PRESETS), set(PRESETS) - names


@pytest.mark.parametrize("example", RL_EXAMPLES, ids=lambda p: p.name)
def test_every_example_runs_tiny(example, tiny_model_dir, tmp_path):
    run = tmp_path / "run"
    assert main(["train", str(example), *tiny_overrides(tiny_model_dir, run), *_data_overrides(example)]) == 0
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "reward/mean" in r]
    assert [r["step"] for r in steps] == [0, 1]
    for r in steps:
        assert isinstance(r["loss"], float) and math.isfinite(r["loss"])  # JSON writes NaN/inf as strings
        for spec in load_config(example).rewards:
            assert f"reward/{spec.fn.split(':')[1]}/mean" in r
    evals = [r for r in rows if "eval/pass@1" in r]
    assert [r["step"] for r in evals] == [0, 2]
    if load_config(example).rollout.env is not None:  # a tool-using policy is evaluated with its tools
        assert all("eval/env/turns" in r for r in evals)
    assert (run / "config.yaml").is_file() and (run / "final").is_dir()
    assert (run / "rollouts.jsonl").read_text().strip()
    assert list((run / "tb").iterdir())


def test_trainable_parameters_change_and_final_adapter_loads_without_plainrl(tiny_model_dir, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    import plainrl.run.loop as loop
    import plainrl.run.setup as run_setup

    captured = {}
    real = run_setup.Learner

    class Spy(real):
        def __init__(self, *args, **kw):
            super().__init__(*args, **kw)
            captured["before"] = [p.detach().clone() for p in self.params]
            captured["learner"] = self

    run_setup.Learner = Spy
    try:
        cfg = load_config(REPO / "examples" / "arithmetic_grpo.yaml",
                          tiny_overrides(tiny_model_dir, tmp_path / "run")
                          # a random model never answers right; text length varies, so advantages are non-zero
                          + ["train.lr=1e-2", f"rewards=[{{fn: '{DATA / 'my_reward.py'}:length_bonus'}}]"])
        run = loop.train(cfg)
    finally:
        run_setup.Learner = real
    after = captured["learner"].params
    assert any(not torch.equal(a, b) for a, b in zip(captured["before"], after))
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    model = PeftModel.from_pretrained(base, run / "final")
    trained = {n: p for n, p in captured["learner"].model.named_parameters() if "lora" in n}
    loaded = {n: p for n, p in model.named_parameters() if "lora" in n}
    assert trained.keys() == loaded.keys()
    for n in trained:
        torch.testing.assert_close(loaded[n].float(), trained[n].float())


def test_cli_eval_on_config_and_run_dir(tiny_model_dir, tmp_path, capsys):
    over = tiny_overrides(tiny_model_dir, tmp_path / "run")
    assert main(["eval", str(REPO / "examples" / "arithmetic_grpo.yaml"), *over, "eval.k=2"]) == 0
    captured = capsys.readouterr()
    out = json.loads(captured.out)
    assert out["eval/n"] == 4 and 0.0 <= out["eval/pass@1"] <= 1.0 and "eval/mean@2" in out
    assert out["figures"]["pass@1"].endswith("(Wilson 95%, n=4)")
    assert out["figures"]["mean@2"].endswith("(Student's t 95% over prompts, n=4)")
    # off a terminal the progress is a line per chunk of prompts (rich's live bar draws nothing there)
    assert re.search(r"eval pass@1: 4/4 rows, \d+s, ~0s left", captured.err), captured.err
    assert "eval mean@2: 4/4 rows" in captured.err
    assert main(["train", str(REPO / "examples" / "arithmetic_grpo.yaml"), *over]) == 0
    capsys.readouterr()
    assert main(["eval", str(tmp_path / "run"), f"data.path={DATA / 'gsm_format_mini.jsonl'}", "data.task=null",
                 "data.format=gsm8k"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["model"].endswith("final") and out["eval/n"] == 3


def test_config_errors_exit_2_before_loading(tmp_path, capsys):
    assert main(["train", str(REPO / "examples" / "arithmetic_grpo.yaml"), "train.lrr=1"]) == 2
    assert "did you mean train.lr" in capsys.readouterr().err


@pytest.mark.skipif(not GSM8K_TRAIN.is_file(), reason="GSM8K train split not beside the repo")
def test_gsm8k_real_file_loads_for_training(tokenizer):
    from plainrl.data import load_prompt_data

    cfg = load_config(REPO / "examples" / "gsm8k_grpo.yaml", [f"data.path={GSM8K_TRAIN}", "data.subset=null"])
    data = load_prompt_data(cfg.data, tokenizer, max_prompt_tokens=cfg.model.max_context - cfg.rollout.max_new_tokens,
                            seed=0)
    assert len(data.train) + len(data.eval) == 7473 and len(data.eval) == cfg.data.eval_holdout == 500
