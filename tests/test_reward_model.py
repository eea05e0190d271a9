"""A trained reward model as an RL reward: the score of a sampled response equals its score
in RM training, the run shares the policy's frozen weights with it (checked on the objects the
run built), and bad paths fail early and clearly."""

from __future__ import annotations

import json
import math

import pytest
import torch

import plainrl.run.loop as loop
import plainrl.run.setup as run_setup
import plainrl.run.offline as offline
from conftest import REPO, tiny_overrides
from plainrl.config import ConfigError, load_config
from plainrl.models import ModelLoadError, sequence_scores
from plainrl.data.offline import load_offline_data
from plainrl.train.offline import collate
from plainrl.rewards import RewardLoadError
from plainrl.rewards.model import RewardModel
from plainrl.types import Episode

DATA = REPO / "tests" / "data"


def _episodes(prompts, completions):
    return [Episode(sample_id=str(i), group=i, row={}, prompt_ids=p, completion_ids=c, logprobs=[0.0] * len(c),
                    loss_mask=[1] * len(c), finish_reason="eos") for i, (p, c) in enumerate(zip(prompts, completions))]


@pytest.fixture(scope="module")
def rm_run(tiny_model_dir, tmp_path_factory):
    over = tiny_overrides(tiny_model_dir, tmp_path_factory.mktemp("rm") / "run") + [
        "algorithm.name=rm", f"data.path={DATA / 'preferences_mini.jsonl'}", "data.task=null", "rewards=[]",
        "train.batch_size=5", "train.steps=8", "train.lr=1e-2", "log.tensorboard=false",
        "eval.before=false", "eval.after=false",
    ]
    return offline.train_offline(load_config(REPO / "examples" / "arithmetic_grpo.yaml", over))


def _rl_cfg(tiny_model_dir, run_dir, rewards, *extra):
    return load_config(REPO / "examples" / "arithmetic_grpo.yaml", tiny_overrides(tiny_model_dir, run_dir) + [
        f"rewards={rewards}", "eval.before=false", "eval.after=false", *extra])


def test_rl_time_scores_equal_rm_training_scores(rm_run, tiny_model_dir, tokenizer, tmp_path):
    cfg = _rl_cfg(tiny_model_dir, tmp_path, f"[{{model: '{rm_run / 'final'}'}}]")
    rm = RewardModel.load(cfg.rewards[0], cfg.model, tokenizer, torch.device("cpu"))
    assert rm.name == "reward_model" and not rm.model.training
    batch = collate(load_offline_data(load_config(rm_run / "config.yaml"), tokenizer).train, tokenizer.pad_token_id)
    with torch.no_grad():
        trained = sequence_scores(rm.model, batch.input_ids, batch.attention_mask, batch.last)  # [2 x pairs]
    prompts, completions = [], []
    for ids, mask in zip(batch.input_ids.tolist(), batch.mask.tolist()):
        start = mask.index(1.0) + 1  # mask is over targets: target t is token t+1
        end = len(mask) - mask[::-1].index(1.0) + 1
        prompts.append(ids[:start])
        completions.append(ids[start:end])
    assert all(c[-1] == tokenizer.eos_token_id for c in completions)
    torch.testing.assert_close(torch.tensor(rm.score(_episodes(prompts, completions))), trained, rtol=1e-4, atol=1e-4)
    # a completion cut before its EOS is scored as if it had ended there
    cut = rm.score(_episodes(prompts[:1], [completions[0][:-1]]))
    assert cut[0] == pytest.approx(float(trained[0]), abs=1e-4)
    assert trained[: len(trained) // 2].gt(trained[len(trained) // 2:]).all()  # chosen > rejected: it learned


def _frozen_base(model: torch.nn.Module) -> dict[str, torch.nn.Parameter]:
    """The frozen parameters of the transformer body (not the LoRA factors, not the LM or score head),
    by their name without peft's wrapping."""
    named = ((n.removeprefix("base_model.model.").replace(".base_layer", ""), p) for n, p in model.named_parameters())
    return {n: p for n, p in named if n.startswith("model.") and "lora_" not in n and not p.requires_grad}


def test_rl_with_a_reward_model_shares_the_policy_weights(rm_run, tiny_model_dir, tmp_path, monkeypatch):
    rewards = f"[{{model: '{rm_run / 'final'}', weight: 1.0, name: rm}}, {{fn: plainrl.rewards.builtins:correctness}}]"
    cfg = _rl_cfg(tiny_model_dir, tmp_path / "run", rewards)
    built = []  # the Run that loop.train builds (plainrl.run.setup.setup, as the run calls it)
    real_setup = loop.setup
    monkeypatch.setattr(loop, "setup", lambda *a, **kw: built.append(real_setup(*a, **kw)) or built[-1])

    run = loop.train(cfg)
    assert len(built) == 1
    [rm] = built[0].reward_models
    policy, rm_base = _frozen_base(built[0].model), _frozen_base(rm.model)
    # the reward model's whole body (2 layers x 9 tensors, the final norm, the embedding) is the policy's tensors
    assert len(rm_base) == 2 * 9 + 2 and rm_base.keys() == policy.keys()
    assert all(rm_base[n].data_ptr() == policy[n].data_ptr() for n in rm_base), "the reward model holds a copy"
    assert not any(p.requires_grad for p in rm.model.parameters())
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 2 and all(math.isfinite(r["reward/rm/mean"]) for r in rows)
    assert all(r["reward/unscorable"] == 0 for r in rows)
    lines = [json.loads(x) for x in (run / "rollouts.jsonl").read_text().splitlines()]
    for x in lines:  # the total is the weighted sum of the parts (plus the demo recipe's overlong penalty)
        parts = x["reward_parts"]
        assert set(parts) <= {"rm", "correctness", "overlong"}
        assert x["reward"] == pytest.approx(parts["rm"] + parts["correctness"] + parts.get("overlong", 0.0), abs=1e-6)


def test_reward_model_errors(rm_run, tiny_model_dir, tmp_path, tokenizer):
    with pytest.raises(ConfigError, match="exactly one of fn .* or model"):
        _rl_cfg(tiny_model_dir, tmp_path, f"[{{fn: plainrl.rewards:correctness, model: '{rm_run / 'final'}'}}]")
    cpu = torch.device("cpu")
    lm = _rl_cfg(tiny_model_dir, tmp_path, f"[{{model: '{tiny_model_dir}'}}]")
    with pytest.raises(ModelLoadError, match="not a sequence-classification reward model"):
        RewardModel.load(lm.rewards[0], lm.model, tokenizer, cpu)
    missing = _rl_cfg(tiny_model_dir, tmp_path / "run", f"[{{model: '{tmp_path / 'nope' / 'final'}'}}]")
    with pytest.raises(ModelLoadError, match="no such directory"):
        run_setup.prepare(missing)  # before any model loads
    empty = _rl_cfg(tiny_model_dir, tmp_path / "run", f"[{{model: '{tmp_path}'}}]")
    with pytest.raises(ModelLoadError, match="no adapter_config.json or config.json"):
        run_setup.prepare(empty)
    dup = f"[{{model: '{rm_run / 'final'}'}}, {{fn: plainrl.rewards:correctness, name: reward_model}}]"
    with pytest.raises(RewardLoadError, match="reward name 'reward_model' is used twice: rewards\\[0\\] .*give one of them a distinct"):
        run_setup.prepare(_rl_cfg(tiny_model_dir, tmp_path / "run", dup))
