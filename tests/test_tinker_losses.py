"""Tinker's built-in losses (plainrl/algorithms/tinker_losses.py) on hand-computed values."""

import math

import pytest
import torch

from plainrl.algorithms.tinker_losses import elementwise_loss

LN = math.log


def _lp(*probs):
    return torch.tensor([LN(p) for p in probs], dtype=torch.float64, requires_grad=True)


def test_cross_entropy_weights_tokens():
    lp = _lp(0.5, 0.25)
    loss = elementwise_loss("cross_entropy", lp, {"weights": torch.tensor([1.0, 0.0], dtype=torch.float64)})
    assert loss.tolist() == pytest.approx([LN(2), 0.0])
    loss.sum().backward()
    assert lp.grad.tolist() == pytest.approx([-1.0, 0.0])  # d(-w * logp)/dlogp = -w


def test_importance_sampling_ratio_times_advantage():
    # p/q = 0.5/0.25 = 2 and 0.2/0.4 = 0.5; A = 1, -2: loss = -(2 * 1), -(0.5 * -2)
    lp = _lp(0.5, 0.2)
    inputs = {"logprobs": torch.log(torch.tensor([0.25, 0.4], dtype=torch.float64)),
              "advantages": torch.tensor([1.0, -2.0], dtype=torch.float64)}
    loss = elementwise_loss("importance_sampling", lp, inputs)
    assert loss.tolist() == pytest.approx([-2.0, 1.0])
    loss.sum().backward()
    assert lp.grad.tolist() == pytest.approx([-2.0, 1.0])  # -r * A


def test_ppo_clips_the_ratio_both_ways():
    # r = 2, 0.5, 1 with A = 1, -2, 3 and bounds [0.8, 1.2]:
    # min(2, 1.2) = 1.2 -> -1.2; min(-1, -1.6) = -1.6 -> 1.6; min(3, 3) -> -3
    lp = _lp(0.5, 0.2, 0.3)
    inputs = {"logprobs": torch.log(torch.tensor([0.25, 0.4, 0.3], dtype=torch.float64)),
              "advantages": torch.tensor([1.0, -2.0, 3.0], dtype=torch.float64)}
    loss = elementwise_loss("ppo", lp, inputs)
    assert loss.tolist() == pytest.approx([-1.2, 1.6, -3.0])
    loss.sum().backward()
    # clipped tokens get no gradient; the unclipped one -r * A = -3
    assert lp.grad.tolist() == pytest.approx([0.0, 0.0, -3.0])
    wide = elementwise_loss("ppo", lp, inputs, {"clip_low_threshold": 0.1, "clip_high_threshold": 10.0})
    assert wide.tolist() == pytest.approx([-2.0, 1.0, -3.0])


def test_cispo_weights_the_log_likelihood_by_the_clipped_ratio():
    # r = 2, 0.5 (inside the default [0, 4]); loss = -r * A * logp
    lp = _lp(0.5, 0.2)
    inputs = {"logprobs": torch.log(torch.tensor([0.25, 0.4], dtype=torch.float64)),
              "advantages": torch.tensor([1.0, -2.0], dtype=torch.float64)}
    loss = elementwise_loss("cispo", lp, inputs)
    assert loss.tolist() == pytest.approx([-2 * LN(0.5), -(0.5 * -2.0) * LN(0.2)])
    loss.sum().backward()
    assert lp.grad.tolist() == pytest.approx([-2.0, 1.0])  # the ratio is a constant: -sg(r) * A
    lp.grad = None
    capped = elementwise_loss("cispo", lp, inputs, {"clip_high_threshold": 1.5})
    capped.sum().backward()
    assert capped[0].item() == pytest.approx(-1.5 * LN(0.5))
    assert lp.grad[0].item() == pytest.approx(-1.5)  # clipped, yet still a gradient (unlike PPO)


def test_unknown_loss_and_config_are_named():
    lp = _lp(0.5)
    with pytest.raises(ValueError, match="loss_fn='dpo'.*cross_entropy"):
        elementwise_loss("dpo", lp, {})
    with pytest.raises(ValueError, match=r"\['clip'\].*ppo"):
        elementwise_loss("ppo", lp, {"logprobs": lp.detach(), "advantages": lp.detach()}, {"clip": 1.0})
