"""Knobs of issue 19 (run end to end in tests/test_data_source.py): train.epochs and
train.warmup_ratio (exactly one of each pair), the KL in the reward beside the KL in the loss
(the pure function, hand-computed; the config's choice of which KL goes where), and
token-bounded micro-batches balanced across micro-batches, with the gradient of fixed-size ones."""

import math

import pytest
import torch
from transformers import AutoModelForCausalLM

from conftest import REPO, grouped_episodes
from plainrl.algorithms import kl_penalized_rewards
from plainrl.config import ConfigError, TrainConfig, load_config
from plainrl.config.train import epoch_steps
from plainrl.frames import make_micro_batches, pack_by_length, pack_by_tokens
from plainrl.run.setup import make_learner

RL = ["data.task=arithmetic", "rewards=[{fn: correctness}]"]


# ----------------------------------------------------------------------------- epochs, warm-up


def test_epochs_become_steps_and_warmup_ratio_rounds_up():
    assert epoch_steps(1, 4, 2) == 2 and epoch_steps(2, 301, 4) == 151  # 150.5: the last step reaches on
    t = TrainConfig(epochs=3, warmup_ratio=0.1)
    with pytest.raises(RuntimeError, match="known once the training data is loaded"):
        t.total_steps
    assert t.resolve_epochs(100, 10) == 30 and t.total_steps == 30
    assert t.warmup == 3  # ceil(0.1 * 30), though 0.1 * 30 is 3.0000000000000004 in floats
    assert TrainConfig(steps=7, warmup_ratio=0.5).warmup == 4
    assert (TrainConfig().steps, TrainConfig().warmup) == (50, 0)  # neither given: the fields' defaults
    assert TrainConfig.model_fields["steps"].default == 50  # the default the docs' key table shows
    assert TrainConfig(epochs=2).steps is None and TrainConfig(warmup_ratio=0.1).warmup_steps is None
    cfg = load_config(None, RL + ["train.steps=null", "train.epochs=2", "rollout.prompts_per_step=4"])
    assert cfg.resolve_steps(10) == 5 and cfg.train.total_steps == 5  # RL: prompts per step
    off = load_config(REPO / "examples" / "dpo_ultrafeedback.yaml", ["train.steps=null", "train.epochs=2",
                                                                     "train.batch_size=3"])
    assert off.resolve_steps(10) == 7  # sft/dpo/rm: rows (pairs) per step


@pytest.mark.parametrize("override, needles", [
    (["train.steps=10", "train.epochs=2"], ["train.steps=10 and train.epochs=2", "exactly one"]),
    (["train.warmup_ratio=0.1", "train.warmup_steps=3"], ["train.warmup_steps=3 and train.warmup_ratio=0.1"]),
    (["train.warmup_ratio=1.5"], ["train.warmup_ratio"]),
    (["train.steps=null"], ["train.steps and train.epochs are both null: set one of them"]),
    (["train.warmup_steps=null", "train.warmup_ratio=null"], ["train.warmup_steps and train.warmup_ratio are both null"]),
])
def test_one_of_each_pair(override, needles):
    with pytest.raises(ConfigError) as e:
        load_config(None, RL + override)
    for n in needles:
        assert n in str(e.value), str(e.value)


def test_derived_steps_are_checked_once_known():
    cfg = load_config(None, RL + ["train.steps=null", "train.epochs=1", "train.warmup_steps=5",
                                  "rollout.prompts_per_step=4"])
    with pytest.raises(ConfigError, match=r"warmup_steps=5 exceeds the 3 steps of train.epochs=1 \(10 rows, 4 a step\)"):
        cfg.resolve_steps(10)
    ppo = load_config(None, RL + ["algorithm.name=ppo", "train.steps=null", "train.epochs=1", "critic.warmup_steps=3",
                                  "rollout.prompts_per_step=4"])
    with pytest.raises(ConfigError, match="critic.warmup_steps=3 leaves no policy step out of the 3 steps"):
        ppo.resolve_steps(10)


# ----------------------------------------------------------------------------- KL in the reward


def test_kl_penalized_rewards_hand_computed():
    rewards = torch.tensor([1.0, 0.0, float("nan")])
    mask = torch.tensor([[1, 1, 0], [1, 1, 1], [1, 0, 0]])
    kl = torch.tensor([[0.2, 0.4, 9.0], [0.1, -0.1, 0.3], [1.0, 1.0, 1.0]])
    out = kl_penalized_rewards(rewards, mask, kl, 0.5)
    # 1 - 0.5 * (0.2 + 0.4) = 0.7 (the 9 is past the completion); 0 - 0.5 * 0.3 = -0.15; unscorable stays NaN
    torch.testing.assert_close(out[:2], torch.tensor([0.7, -0.15]))
    assert math.isnan(out[2])
    assert torch.equal(kl_penalized_rewards(rewards[:2], mask[:2], kl[:2], 0.0), rewards[:2])
    with pytest.raises(ValueError, match="kl_coef must be >= 0"):
        kl_penalized_rewards(rewards, mask, kl, -1.0)


def test_which_kl_goes_where():
    both = load_config(None, RL + ["algorithm.kl_coef=0.05", "algorithm.kl_estimator=k3",
                                   "algorithm.kl_reward_coef=0.1", "algorithm.kl_reward_estimator=k2"]).algorithm
    assert (both.loss_kl_coef, both.kl_estimator, both.reward_kl) == (0.05, "k3", (0.1, "k2"))
    reward_only = load_config(None, RL + ["algorithm.kl_reward_coef=0.1"]).algorithm
    assert (reward_only.loss_kl_coef, reward_only.reward_kl, reward_only.uses_reference) == (0.0, (0.1, "k1"), True)
    legacy = load_config(None, RL + ["algorithm.name=reinforce_pp"]).algorithm  # kl_placement: reward, kl_coef 0.01
    assert (legacy.loss_kl_coef, legacy.reward_kl) == (0.0, (0.01, "k1"))
    with pytest.raises(ConfigError, match="kl_placement=reward puts algorithm.kl_coef=0.01 there too.*'ppo'"):
        load_config(None, RL + ["algorithm.name=ppo", "algorithm.kl_reward_coef=0.1"])
    ppo = load_config(None, RL + ["algorithm.name=ppo", "algorithm.kl_placement=loss", "algorithm.kl_reward_coef=0.1"])
    assert (ppo.algorithm.loss_kl_coef, ppo.algorithm.reward_kl) == (0.01, (0.1, "k1"))
    with pytest.raises(ConfigError, match="kl_reward_coef: algorithm.name='dpo' learns from data rows"):
        load_config(REPO / "examples" / "dpo_ultrafeedback.yaml", ["algorithm.kl_reward_coef=0.1"])


def test_a_reward_kl_alone_keeps_a_frozen_reference_for_full_fine_tuning(tiny_model_dir):
    cfg = load_config(None, RL + [f"model.name={tiny_model_dir}", "model.lora.enabled=false",
                                  "algorithm.kl_reward_coef=0.1"])
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    assert make_learner(cfg, model, pad_id=0).ref_model is not None


# ----------------------------------------------------------------------------- micro-batches


def test_micro_batches_are_as_few_as_the_budget_allows_and_balanced_hand_computed():
    # packed (real tokens): 1-token prompts, episode 0 has 10 tokens, the others 2; budget 16.
    # Next-fit would give 10+2+2 = 14 and 2*5 = 10; balanced: 12 and 12
    prompts, lens = [(i,) for i in range(8)], [9, 1, 1, 1, 1, 1, 1, 1]
    assert pack_by_tokens(prompts, lens, 16, share_prompts=True) == [[0, 1], [2, 3, 4, 5, 6, 7]]
    # padded (members x the longest): widths 8 8 4 4 4 4 2 2, budget 32. Next-fit: 4 x 8 = 32 and 4 x 4 = 16;
    # balanced: 3 x 8 = 24 and 5 x 4 = 20 (a cap of 20 would need 3 micro-batches)
    assert pack_by_length([8, 8, 4, 4, 4, 4, 2, 2], 32) == [[0, 1, 2], [3, 4, 5, 6, 7]]
    # one micro-batch when everything fits; a sequence over the budget alone
    assert pack_by_tokens(prompts, lens, 1000, share_prompts=True) == [list(range(8))]
    assert pack_by_length([50, 3, 3], 20) == [[0], [1, 2]]


@pytest.mark.parametrize("packing", [True, False])
def test_balanced_micro_batches_give_the_gradient_of_fixed_size_ones(tiny_model_dir, packing):
    """train.micro_batch_tokens=24 on the grouped episodes: packed, real tokens 19 and 17 (next-fit:
    24 and 9); padded, 18, 16 and 21 padded tokens (next-fit: 18, 24, 12). The gradient equals
    the one of one episode per micro-batch, and of the whole batch at once, to float tolerance."""
    eps = grouped_episodes()
    adv = torch.tensor([1.0, -1.0, 0.5, -0.5, 2.0, -2.0, 0.7])
    mbs = make_micro_batches(eps, adv, pad_id=0, token_budget=24, packing=packing, share_prompts=True)
    if packing:  # real tokens, a shared prompt once per micro-batch
        idx = [mb.index.tolist() for mb in mbs]
        assert [sum(len(eps[i].completion_ids) for i in g) + sum(map(len, {tuple(eps[i].prompt_ids) for i in g}))
                for g in idx] == [19, 17]
    else:
        assert [mb.input_ids.numel() for mb in mbs] == [18, 16, 21]
    grads = []
    for budget in (24, 1, 100_000):  # balanced; one episode each (fixed size 1); all at once
        torch.manual_seed(0)
        m = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
        cfg = load_config(None, RL + [f"train.micro_batch_tokens={budget}", f"train.packing={packing}",
                                      "model.lora.enabled=false", "train.max_grad_norm=null",
                                      "algorithm.loss_agg=seq-mean-token-mean", "algorithm.kl_coef=0.1"])
        learner = make_learner(cfg, m, pad_id=0)
        learner.optimizer.step = lambda: None  # keep the gradient for inspection
        learner.optimizer.zero_grad = lambda set_to_none=True: None
        stats = learner.update(eps, adv)
        assert stats.micro_batches == {24: len(mbs), 1: 7, 100_000: 1}[budget]
        grads.append(torch.cat([p.grad.flatten() for p in learner.master]))
    assert grads[0].abs().sum() > 0
    torch.testing.assert_close(grads[0], grads[1], atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(grads[0], grads[2], atol=1e-5, rtol=1e-4)
