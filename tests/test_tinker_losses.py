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


def test_cross_entropy_over_k_targets_per_position():
    # Tinker's top-K distillation: position 0 against a teacher's (0.6, 0.4) over two tokens the
    # student gives 0.5 and 0.25; position 1 has no targets (weights 0)
    lp = torch.log(torch.tensor([[0.5, 0.25], [0.1, 0.2]], dtype=torch.float64)).requires_grad_(True)
    w = torch.tensor([[0.6, 0.4], [0.0, 0.0]], dtype=torch.float64)
    loss = elementwise_loss("cross_entropy", lp, {"weights": w})
    assert loss.tolist() == pytest.approx([-(0.6 * LN(0.5) + 0.4 * LN(0.25)), 0.0])
    loss.sum().backward()
    assert torch.allclose(lp.grad, -w)


def test_gspo_values_every_token_at_the_sequence_ratio():
    # marked tokens 1, 2 with p/q = 0.2/0.4 and 0.4/0.4: s = exp((ln 0.5 + 0) / 2) = 0.5 ** 0.5;
    # token 0 (a prompt token, unmarked, A = 0) takes s's value too but adds nothing
    lp = _lp(0.5, 0.2, 0.4)
    q = torch.log(torch.tensor([0.25, 0.4, 0.4], dtype=torch.float64))
    mask = torch.tensor([0.0, 1.0, 1.0], dtype=torch.float64)
    s = 0.5 ** 0.5
    inputs = {"logprobs": q, "advantages": torch.tensor([0.0, 1.0, 1.0], dtype=torch.float64),
              "sequence_ratio_mask": mask}
    loss = elementwise_loss("gspo", lp, inputs)
    # A > 0 and s below the bound: min(s * A, clip(s) * A) = s
    assert loss.tolist() == pytest.approx([0.0, -s, -s])
    loss.sum().backward()
    # d s_t / d logp_t = s_t: each token's own gradient, scaled by the sequence's ratio (token 2's own ratio is 1)
    assert lp.grad.tolist() == pytest.approx([0.0, -s, -s])
    # A < 0: min(-s, -clip(s)) = -(1 - 3e-4), the clipped branch: no gradient (the default bounds)
    lp.grad = None
    neg = elementwise_loss("gspo", lp, {**inputs, "advantages": torch.tensor([0.0, -1.0, -1.0], dtype=torch.float64)})
    assert neg.tolist() == pytest.approx([0.0, 1 - 3e-4, 1 - 3e-4])
    neg.sum().backward()
    assert lp.grad.tolist() == pytest.approx([0.0, 0.0, 0.0])
    wide = elementwise_loss("gspo", lp, {**inputs, "advantages": torch.tensor([0.0, -1.0, -1.0], dtype=torch.float64)},
                            {"clip_low_threshold": 0.5, "clip_high_threshold": 2.0})
    assert wide.tolist() == pytest.approx([0.0, s, s])
    # no marked token: s = 1
    none = elementwise_loss("gspo", lp.detach(), {**inputs, "sequence_ratio_mask": torch.zeros(3, dtype=torch.float64)})
    assert none.tolist() == pytest.approx([0.0, -1.0, -1.0])


def test_dro_penalises_the_squared_log_ratio():
    # p = 0.5, q = 0.25, A = 2, beta = 0.1: -(ln 0.5 * 2 - 0.05 * ln(2)^2); gradient -(A - beta * ln 2)
    lp = _lp(0.5)
    inputs = {"logprobs": torch.log(torch.tensor([0.25], dtype=torch.float64)),
              "advantages": torch.tensor([2.0], dtype=torch.float64)}
    loss = elementwise_loss("dro", lp, inputs, {"beta": 0.1})
    assert loss.item() == pytest.approx(-(2 * LN(0.5) - 0.05 * LN(2) ** 2))
    loss.sum().backward()
    assert lp.grad.item() == pytest.approx(-(2.0 - 0.1 * LN(2)))
    with pytest.raises(ValueError, match=r"loss_fn='dro' needs loss_fn_config \['beta'\]"):
        elementwise_loss("dro", lp, inputs)


def test_stable_reinforce_truncates_the_importance_weight():
    # p/q = 0.5/0.1 = 5 -> capped at 2; 0.2/0.4 = 0.5; A = 1, -2: loss = -w * A * ln p
    lp = _lp(0.5, 0.2)
    q = torch.log(torch.tensor([0.1, 0.4], dtype=torch.float64))
    inputs = {"logprobs": q, "advantages": torch.tensor([1.0, -2.0], dtype=torch.float64),
              "sampled": torch.ones(2, dtype=torch.float64)}
    loss = elementwise_loss("stable_reinforce", lp, inputs)
    assert loss.tolist() == pytest.approx([-2.0 * LN(0.5), 1.0 * LN(0.2)])
    loss.sum().backward()
    assert lp.grad.tolist() == pytest.approx([-2.0, 1.0])  # -sg(w) * A: the capped token keeps a gradient
    lp.grad = None
    kl = elementwise_loss("stable_reinforce", lp, inputs, {"kl_coeff": 0.2})
    assert kl.tolist() == pytest.approx([-2.0 * LN(0.5) + 0.1 * LN(5) ** 2, LN(0.2) + 0.1 * LN(0.5) ** 2])
    kl.sum().backward()
    assert lp.grad.tolist() == pytest.approx([-2.0 + 0.2 * LN(5), 1.0 + 0.2 * LN(0.5)])
    # a position the provenance does not name as sampled (a prompt token) adds nothing, penalty included
    off = elementwise_loss("stable_reinforce", lp, {**inputs, "sampled": torch.tensor([0.0, 1.0], dtype=torch.float64)},
                           {"kl_coeff": 0.2})
    assert off.tolist() == pytest.approx([0.0, LN(0.2) + 0.1 * LN(0.5) ** 2])
