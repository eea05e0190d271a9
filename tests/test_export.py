"""`plainrl export RUN_DIR --merge OUT` on tiny runs: a LoRA policy, a full fine-tune and a
reward model each become one transformers directory with the trained behaviour; bad input
fails with a clear message. (The real-model export and its greedy decoding: test_portable.py;
in vLLM: test_vllm_export.py.)"""

from __future__ import annotations

import json

import pytest
import torch

import plainrl.run.offline as offline
from conftest import REPO, tiny_overrides
from plainrl.cli import main
from plainrl.config import load_config

DATA = REPO / "tests" / "data"
IDS = torch.tensor([[5, 17, 300, 42, 9, 1000, 77]])


def _rl_run(tiny_model_dir, run_dir, *extra):
    over = tiny_overrides(tiny_model_dir, run_dir) + ["train.lr=1e-2", "log.tensorboard=false", *extra,
                                                      f"rewards=[{{fn: '{DATA / 'my_reward.py'}:length_bonus'}}]"]
    assert main(["train", str(REPO / "examples" / "arithmetic_grpo.yaml"), *over]) == 0
    return run_dir


def test_export_of_a_lora_run_is_the_adapter_on_its_base(tiny_model_dir, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    run = _rl_run(tiny_model_dir, tmp_path / "run")
    out = tmp_path / "merged"
    assert main(["export", str(run), "--merge", str(out)]) == 0
    merged = AutoModelForCausalLM.from_pretrained(out).eval()
    adapter = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_model_dir), run / "final").eval()
    with torch.no_grad():
        torch.testing.assert_close(merged(IDS).logits, adapter(IDS).logits, atol=1e-5, rtol=1e-5)
        plain = AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()(IDS).logits
    assert not torch.allclose(merged(IDS).logits, plain)  # it trained, and the merge carries it
    assert json.loads((out / "config.json").read_text())["use_cache"] is True
    # a directory base has no hub id: the card says so and names it as configured
    assert "no hub id known" in (out / "README.md").read_text()


def test_export_of_a_full_fine_tune_in_bfloat16(tiny_model_dir, tmp_path):
    from transformers import AutoModelForCausalLM

    run = _rl_run(tiny_model_dir, tmp_path / "run", "model.lora.enabled=false")
    out = tmp_path / "bf16"
    assert main(["export", str(run), "--merge", str(out), "--dtype", "bfloat16"]) == 0
    exported = AutoModelForCausalLM.from_pretrained(out, dtype="auto")
    trained = AutoModelForCausalLM.from_pretrained(run / "final")
    assert exported.dtype == torch.bfloat16
    for (n, a), (_, b) in zip(exported.named_parameters(), trained.named_parameters()):
        assert torch.equal(a, b.to(torch.bfloat16)), n


def test_export_of_a_reward_model_keeps_its_score_head(tiny_model_dir, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForSequenceClassification

    over = tiny_overrides(tiny_model_dir, tmp_path / "rm") + [
        "algorithm.name=rm", f"data.path={DATA / 'preferences_mini.jsonl'}", "data.task=null", "rewards=[]",
        "train.batch_size=5", "train.steps=2", "train.lr=1e-2", "log.tensorboard=false",
        "eval.before=false", "eval.after=false"]
    run = offline.train_offline(load_config(REPO / "examples" / "arithmetic_grpo.yaml", over))
    out = tmp_path / "rm-merged"
    assert main(["export", str(run), "--merge", str(out)]) == 0
    merged = AutoModelForSequenceClassification.from_pretrained(out).eval()
    base = AutoModelForSequenceClassification.from_pretrained(tiny_model_dir, num_labels=1)
    adapter = PeftModel.from_pretrained(base, run / "final").eval()
    with torch.no_grad():
        torch.testing.assert_close(merged(IDS).logits, adapter(IDS).logits, atol=1e-5, rtol=1e-5)
    assert "pipeline_tag: text-classification" in (out / "README.md").read_text()


def test_export_refuses_what_it_cannot_export(tmp_path, capsys):
    assert main(["export", str(tmp_path), "--merge", str(tmp_path / "out")]) == 2
    assert "not a plainrl run directory" in capsys.readouterr().err
    (tmp_path / "config.yaml").write_text("{}")
    assert main(["export", str(tmp_path), "--merge", str(tmp_path / "out")]) == 2
    assert "has not finished" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:  # --merge is required: argparse's usage error
        main(["export", str(tmp_path)])
    assert e.value.code == 2 and "--merge" in capsys.readouterr().err
