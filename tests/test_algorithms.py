"""Tests of plainrl.algorithms: hand-computed cases (derivations in comments), edge cases,
a loop reference for GAE, and gradient-accumulation invariance of every loss aggregation."""

from __future__ import annotations

import math
from typing import get_args

import pytest
import torch

from plainrl.algorithms import (
    KLEstimator,
    LossAgg,
    RatioLevel,
    aggregate_loss,
    entropy_from_logits,
    gae,
    grpo_advantages,
    kl_estimate,
    policy_loss,
    truncated_is_weights,
    reinforce_pp_advantages,
    whiten_advantages,
    rloo_advantages,
    value_loss,
)
from plainrl.algorithms.kl import _KL_ESTIMATORS
from plainrl.algorithms.losses import _AGGREGATORS, _RATIO_FNS

NAN = float("nan")


def t(*values: float) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float32)


def close(actual, expected, atol=1e-5):
    torch.testing.assert_close(actual, torch.as_tensor(expected, dtype=actual.dtype), atol=atol, rtol=1e-5)


def test_dispatch_tables_match_literals():
    assert set(_KL_ESTIMATORS) == set(get_args(KLEstimator))
    assert set(_AGGREGATORS) == set(get_args(LossAgg))
    assert set(_RATIO_FNS) == set(get_args(RatioLevel))


# ----------------------------------------------------------------------------- GRPO / Dr. GRPO


def test_grpo_hand_computed_groups_of_two():
    # rewards [1,0 | 0,1], group 2: each group mean 0.5; unbiased std =
    # sqrt((0.5^2 + 0.5^2) / (2-1)) = sqrt(0.5) = 0.70711; A = +-0.5 / (0.70711 + 1e-6) = +-0.70711.
    adv = grpo_advantages(t(1.0, 0.0, 0.0, 1.0), 2)
    close(adv, [0.70711, -0.70711, -0.70711, 0.70711])


def test_grpo_hand_computed_group_of_four_and_dr_grpo():
    # rewards [1,0,0,0]: mean 0.25; deviations [0.75, -0.25 x3]; sum of squares
    # 0.5625 + 3 * 0.0625 = 0.75; unbiased var 0.75 / 3 = 0.25; std 0.5.
    # GRPO: [0.75, -0.25, -0.25, -0.25] / 0.5 = [1.5, -0.5, -0.5, -0.5].
    # Dr. GRPO (no std): the deviations themselves.
    r = t(1.0, 0.0, 0.0, 0.0)
    close(grpo_advantages(r, 4, eps=0.0), [1.5, -0.5, -0.5, -0.5])
    close(grpo_advantages(r, 4, norm_std=False), [0.75, -0.25, -0.25, -0.25])


@pytest.mark.parametrize("norm_std", [True, False])
def test_grpo_equal_rewards_give_exact_zero(norm_std):
    # 0.1 and 0.7 are inexact in binary, so mean(r) need not equal r bit for bit; the
    # result must still be exactly 0 (not 1e-8, and not 0/0 = NaN after the std division).
    r = t(0.1, 0.1, 0.1, 0.7, 0.7, 0.7)
    assert torch.equal(grpo_advantages(r, 3, norm_std=norm_std), torch.zeros(6))
    assert torch.equal(grpo_advantages(r, 3, norm_std=norm_std, eps=0.0), torch.zeros(6))


def test_grpo_groups_of_one_give_zero():
    assert torch.equal(grpo_advantages(t(3.0, -1.0, 0.5), 1), torch.zeros(3))
    assert torch.equal(rloo_advantages(t(3.0, -1.0, 0.5), 1), torch.zeros(3))


def test_grpo_invalid_samples_are_excluded_and_zero():
    # valid rewards {1, 0, 1}: mean 2/3; unbiased var ((1/3)^2 + (2/3)^2 + (1/3)^2) / 2
    # = (6/9) / 2 = 1/3; std 0.57735. A = [(1/3)/0.57735, 0 (invalid), (-2/3)/0.57735, 0.57735]
    # = [0.57735, 0, -1.15470, 0.57735].
    r = t(1.0, NAN, 0.0, 1.0)
    valid = torch.tensor([True, False, True, True])
    adv = grpo_advantages(r, 4, valid=valid, eps=0.0)
    close(adv, [0.57735, 0.0, -1.15470, 0.57735])
    assert adv[1].item() == 0.0
    assert torch.isnan(r[1])  # input untouched


def test_grpo_groups_with_fewer_than_two_valid_give_zero():
    # group 1: one valid sample (no spread to compare against); group 2: none valid.
    r = t(5.0, NAN, NAN, NAN)
    valid = torch.tensor([True, False, False, False])
    for norm_std in (True, False):
        assert torch.equal(grpo_advantages(r, 2, valid=valid, norm_std=norm_std), torch.zeros(4))
    assert torch.equal(rloo_advantages(r, 2, valid=valid), torch.zeros(4))


def test_grpo_nan_free_with_tiny_spread():
    # 1 and 1 + 2^-23 differ by one float32 ulp (a naive float32 mean rounds to 1.0 and
    # gives [0, +0.107]). Exact: deviations +-2^-24 = +-5.96e-8; unbiased std
    # sqrt(2 * (5.96e-8)^2 / 1) = 8.43e-8; A = +-5.96e-8 / (8.43e-8 + 1e-6) = +-0.05497.
    r = t(1.0, 1.0 + 2**-23)
    adv = grpo_advantages(r, 2)
    close(adv, [-0.05497, 0.05497])
    assert torch.isfinite(grpo_advantages(r, 2, eps=0.0)).all()


def test_grpo_errors():
    with pytest.raises(ValueError, match="groups of group_size=3"):
        grpo_advantages(torch.zeros(4), 3)
    with pytest.raises(ValueError, match="positive int"):
        grpo_advantages(torch.zeros(4), 0)
    with pytest.raises(ValueError, match="marked valid"):
        grpo_advantages(t(1.0, NAN), 2)
    with pytest.raises(ValueError, match="bool"):
        grpo_advantages(t(1.0, 0.0), 2, valid=torch.ones(2))
    with pytest.raises(ValueError, match="1-D"):
        grpo_advantages(torch.zeros(2, 2), 2)
    with pytest.raises(ValueError, match="eps"):
        grpo_advantages(torch.zeros(2), 2, eps=-1.0)


# ----------------------------------------------------------------------------- RLOO


def test_rloo_hand_computed():
    # rewards [1,0,0,1], group 4: baseline of each = mean of the other three:
    # i0: (0+0+1)/3 = 1/3 -> A = 2/3; i1: (1+0+1)/3 = 2/3 -> A = -2/3; i2 likewise -2/3; i3 = 2/3.
    close(rloo_advantages(t(1.0, 0.0, 0.0, 1.0), 4), [2 / 3, -2 / 3, -2 / 3, 2 / 3])


def test_rloo_invalid_and_equal():
    # valid {1, 0, 1} (index 1 invalid): i0 baseline (0+1)/2 = 0.5 -> 0.5;
    # i2 baseline (1+1)/2 = 1 -> -1; i3 -> 0.5; invalid -> 0.
    valid = torch.tensor([True, False, True, True])
    close(rloo_advantages(t(1.0, NAN, 0.0, 1.0), 4, valid=valid), [0.5, 0.0, -1.0, 0.5])
    assert torch.equal(rloo_advantages(t(0.1, 0.1, 0.1, 0.3, 0.3, 0.3), 3), torch.zeros(6))


# ----------------------------------------------------------------------------- REINFORCE++


def test_reinforce_pp_hand_computed():
    # gamma 0.5. Row 0 rewards [0,0,1]: G = [0 + 0.5*(0 + 0.5*1), 0 + 0.5*1, 1] = [0.25, 0.5, 1].
    # Row 1 rewards [0,-0.5,(pad)]: G = [0 + 0.5*(-0.5), -0.5] = [-0.25, -0.5].
    # Batch of 5 loss tokens: mean 1.0/5 = 0.2; deviations [0.05, 0.3, 0.8, -0.45, -0.7];
    # squares sum 0.0025+0.09+0.64+0.2025+0.49 = 1.425; population var 0.285; std 0.53385.
    # A = deviations / 0.53385 = [0.09366, 0.56195, 1.49854, -0.84293, -1.31122].
    rewards = torch.tensor([[0.0, 0.0, 1.0], [0.0, -0.5, 7.0]])
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    adv = reinforce_pp_advantages(rewards, mask, gamma=0.5)
    close(adv, [[0.09366, 0.56195, 1.49854], [-0.84293, -1.31122, 0.0]])


def test_reinforce_pp_skips_interior_masked_tokens():
    # Middle token is tool output (mask 0): its reward 5 is ignored and it takes no
    # discount step, so G = [0 + 0.5*1, -, 1] = [0.5, -, 1]; mean 0.75, population
    # std 0.25 -> A = [-1, 0, 1].
    adv = reinforce_pp_advantages(torch.tensor([[0.0, 5.0, 1.0]]), torch.tensor([[1, 0, 1]]), gamma=0.5)
    close(adv, [[-1.0, 0.0, 1.0]])


def test_reinforce_pp_degenerate_batches():
    # All returns equal (gamma 1, one reward 0.1 on each length-1 row) -> exactly 0.
    mask = torch.tensor([[1, 0], [1, 0], [1, 0]])
    rewards = torch.tensor([[0.1, 0.0], [0.1, 0.0], [0.1, 0.0]])
    assert torch.equal(reinforce_pp_advantages(rewards, mask), torch.zeros(3, 2))
    # No loss tokens at all (all-masked rows), NaN rewards in the padding.
    out = reinforce_pp_advantages(torch.full((2, 3), NAN), torch.zeros(2, 3))
    assert torch.equal(out, torch.zeros(2, 3))


def test_whiten_advantages_hand_computed():
    # Loss tokens 1, 2, 3, 6 (the 9 and the NaN are masked): mean 12/4 = 3, deviations
    # [-2, -1, 0, 3], squares 4+1+0+9 = 14, population var 3.5, std 1.870829.
    adv = torch.tensor([[1.0, 2.0, 9.0], [3.0, 6.0, NAN]])
    mask = torch.tensor([[1, 1, 0], [1, 1, 0]])
    out = whiten_advantages(adv, mask)
    close(out, [[-2 / 1.870829, -1 / 1.870829, 0.0], [0.0, 3 / 1.870829, 0.0]])
    # whitened loss tokens have mean 0 and population std 1
    v = out[mask.bool()]
    close(v.mean(), 0.0)
    close(v.var(unbiased=False), 1.0)


def test_whiten_advantages_degenerate():
    # one distinct value (float residue must not become a signal), no loss tokens, a 1-D batch
    assert torch.equal(whiten_advantages(torch.full((2, 2), 0.1), torch.ones(2, 2)), torch.zeros(2, 2))
    assert torch.equal(whiten_advantages(torch.full((2, 2), NAN), torch.zeros(2, 2)), torch.zeros(2, 2))
    close(whiten_advantages(torch.tensor([1.0, 3.0]), torch.ones(2)), [-1.0, 1.0])
    with pytest.raises(ValueError, match="shape"):
        whiten_advantages(torch.ones(2, 3), torch.ones(3, 2))


# ----------------------------------------------------------------------------- GAE


def _gae_loop(r, v, mask, gamma, lam):
    """Plain double-loop reference: walk each row's loss tokens right to left."""
    B, T = r.shape
    adv = torch.zeros(B, T, dtype=torch.float64)
    ret = torch.zeros(B, T, dtype=torch.float64)
    for b in range(B):
        idx = [i for i in range(T) if mask[b, i]]
        running = 0.0
        for k in range(len(idx) - 1, -1, -1):
            i = idx[k]
            next_v = float(v[b, idx[k + 1]]) if k + 1 < len(idx) else 0.0
            delta = float(r[b, i]) + gamma * next_v - float(v[b, i])
            running = delta + gamma * lam * running
            adv[b, i] = running
            ret[b, i] = running + float(v[b, i])
    return adv, ret


def test_gae_hand_computed():
    # gamma 1, lam 0.5. Row 0, V = [0.5, 0.6, 0.7], r = [0, 0, 1], episode ends after t=2:
    #   delta2 = 1 + 0 - 0.7 = 0.3; delta1 = 0 + 0.7 - 0.6 = 0.1; delta0 = 0 + 0.6 - 0.5 = 0.1
    #   A2 = 0.3; A1 = 0.1 + 0.5*0.3 = 0.25; A0 = 0.1 + 0.5*0.25 = 0.225; returns = A + V
    #   = [0.725, 0.85, 1.0].
    # Row 1 right-padded (pad reward 9 and value 99 must be ignored), r = [0, 1]:
    #   delta1 = 1 - 0.6 = 0.4; delta0 = 0.6 - 0.5 = 0.1; A = [0.1 + 0.5*0.4, 0.4] = [0.3, 0.4].
    # Row 2 length 1: A0 = 2 - 0.5 = 1.5, return 2.
    r = torch.tensor([[0.0, 0.0, 1.0], [0.0, 1.0, 9.0], [2.0, NAN, NAN]])
    v = torch.tensor([[0.5, 0.6, 0.7], [0.5, 0.6, 99.0], [0.5, NAN, NAN]])
    mask = torch.tensor([[1, 1, 1], [1, 1, 0], [1, 0, 0]])
    adv, ret = gae(r, v, mask, gamma=1.0, lam=0.5)
    close(adv, [[0.225, 0.25, 0.3], [0.3, 0.4, 0.0], [1.5, 0.0, 0.0]])
    close(ret, [[0.725, 0.85, 1.0], [0.8, 1.0, 0.0], [2.0, 0.0, 0.0]])


@pytest.mark.parametrize("seed", range(5))
def test_gae_matches_loop_on_random_inputs(seed):
    g = torch.Generator().manual_seed(seed)
    B, T = 6, 9
    r = torch.randn(B, T, generator=g, dtype=torch.float64)
    v = torch.randn(B, T, generator=g, dtype=torch.float64)
    lengths = torch.randint(0, T + 1, (B,), generator=g)
    mask = (torch.arange(T) < lengths[:, None]) & (torch.rand(B, T, generator=g) > 0.2)  # padding + gaps
    mask[0] = False  # an all-masked row
    gamma, lam = [(1.0, 1.0), (0.99, 0.95), (0.9, 0.0), (0.5, 0.7), (1.0, 0.3)][seed]
    adv, ret = gae(r, v, mask, gamma=gamma, lam=lam)
    ref_adv, ref_ret = _gae_loop(r, v, mask, gamma, lam)
    torch.testing.assert_close(adv, ref_adv)
    torch.testing.assert_close(ret, ref_ret)
    assert torch.equal(adv[0], torch.zeros(T, dtype=torch.float64))


def test_gae_detached_and_errors():
    v = torch.zeros(1, 2, requires_grad=True)
    adv, ret = gae(torch.ones(1, 2), v, torch.ones(1, 2), gamma=1.0, lam=1.0)
    assert not adv.requires_grad and not ret.requires_grad
    with pytest.raises(ValueError, match="shape"):
        gae(torch.ones(1, 2), torch.ones(1, 3), torch.ones(1, 2), gamma=1.0, lam=1.0)
    with pytest.raises(ValueError, match="lam"):
        gae(torch.ones(1, 2), torch.ones(1, 2), torch.ones(1, 2), gamma=1.0, lam=1.5)


def test_value_loss_hand_computed():
    # clip 0.2. Token 0: V 1.0, V_old 0.5, R 2.0: unclipped (1-2)^2 = 1; V_clip = 0.5 + 0.2
    #   = 0.7, (0.7-2)^2 = 1.69 -> max 1.69, loss 0.845, clipped branch active (no gradient).
    # Token 1: V 2.0 = V_old, R 2.5: both 0.25 -> 0.125. token-mean (0.845+0.125)/2 = 0.485.
    # Unclipped: (0.5 + 0.125)/2 = 0.3125. Token 2 is padding with NaN everywhere.
    values = torch.tensor([[1.0, 2.0, NAN]], requires_grad=True)
    old = torch.tensor([[0.5, 2.0, NAN]])
    returns = torch.tensor([[2.0, 2.5, NAN]])
    mask = torch.tensor([[1, 1, 0]])
    loss, stats = value_loss(values, old, returns, mask, clip=0.2)
    close(loss, 0.485)
    close(stats["clip_frac"], 0.5)
    loss.backward()
    # d/dV of 0.5*(V-R)^2/2 at token 1 = (2 - 2.5)/2 = -0.25; token 0 clipped -> 0.
    close(values.grad, [[0.0, -0.25, 0.0]])
    close(value_loss(values, old, returns, mask)[0], 0.3125)
    with pytest.raises(ValueError, match="clip"):
        value_loss(values, old, returns, mask, clip=0.0)


# ----------------------------------------------------------------------------- KL


def test_kl_estimators_hand_computed():
    # pi = [0.5, 0.25], pi_ref = [0.25, 0.5]: log_ratio = log(ref/pi) = [-ln2, ln2] = [-0.69315, 0.69315].
    # k1 = -log_ratio = [0.69315, -0.69315]; k2 = 0.5 * 0.48045 = 0.24023 each;
    # k3 = exp(lr) - 1 - lr = [0.5 - 1 + 0.69315, 2 - 1 - 0.69315] = [0.19315, 0.30685].
    logps = torch.log(torch.tensor([0.5, 0.25]))
    ref = torch.log(torch.tensor([0.25, 0.5]))
    close(kl_estimate(logps, ref, "k1"), [0.69315, -0.69315])
    close(kl_estimate(logps, ref, "k2"), [0.24023, 0.24023])
    close(kl_estimate(logps, ref, "k3"), [0.19315, 0.30685])
    assert torch.equal(kl_estimate(logps, logps, "k3"), torch.zeros(2))


def test_kl_clamp_and_errors():
    # log_ratio 100 is clamped to 20: k1 = -20, k3 = e^20 - 21, finite.
    out1 = kl_estimate(torch.tensor([0.0]), torch.tensor([100.0]), "k1")
    out3 = kl_estimate(torch.tensor([0.0]), torch.tensor([100.0]), "k3")
    close(out1, [-20.0])
    assert torch.isfinite(out3).all()
    close(out3, [math.exp(20) - 21], atol=1e3)
    with pytest.raises(ValueError, match=r"\['k1', 'k2', 'k3'\]"):
        kl_estimate(torch.zeros(2), torch.zeros(2), "k4")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="shape"):
        kl_estimate(torch.zeros(2), torch.zeros(3), "k1")


# ----------------------------------------------------------------------------- aggregation


def test_aggregate_loss_hand_computed():
    # loss [[1,2,3],[4,x,x]], row lengths 3 and 1:
    # token-mean (1+2+3+4)/4 = 2.5; with num_tokens=8: 10/8 = 1.25.
    # seq-mean-token-mean (6/3 + 4/1)/2 = 3; with num_seqs=4: 6/4 = 1.5.
    # seq-mean-token-sum-norm, normalizer T=3: (6/3 + 4/3)/2 = 1.66667; normalizer 4: (1.5 + 1)/2 = 1.25.
    loss = torch.tensor([[1.0, 2.0, 3.0], [4.0, NAN, NAN]])
    mask = torch.tensor([[1, 1, 1], [1, 0, 0]])
    close(aggregate_loss(loss, mask, "token-mean"), 2.5)
    close(aggregate_loss(loss, mask, "token-mean", num_tokens=8), 1.25)
    close(aggregate_loss(loss, mask, "seq-mean-token-mean"), 3.0)
    close(aggregate_loss(loss, mask, "seq-mean-token-mean", num_seqs=4), 1.5)
    close(aggregate_loss(loss, mask, "seq-mean-token-sum-norm"), 10 / 6)
    close(aggregate_loss(loss, mask, "seq-mean-token-sum-norm", normalizer=4), 1.25)
    # Counts given as tensors (e.g. after an all-reduce) behave the same.
    close(aggregate_loss(loss, mask, "token-mean", num_tokens=torch.tensor(8)), 1.25)


@pytest.mark.parametrize("mode", get_args(LossAgg))
def test_aggregate_loss_all_masked_rows(mode):
    # Row 1 fully masked with NaN inside: token-mean 1/1 = 1; seq-mean-token-mean (1 + 0)/2 = 0.5;
    # sum-norm (1/2 + 0)/2 = 0.25. A fully masked batch gives 0 and a zero (not NaN) gradient.
    loss = torch.tensor([[1.0, NAN], [NAN, NAN]], requires_grad=True)
    mask = torch.tensor([[1, 0], [0, 0]])
    expected = {"token-mean": 1.0, "seq-mean-token-mean": 0.5, "seq-mean-token-sum-norm": 0.25}[mode]
    close(aggregate_loss(loss, mask, mode), expected)
    out = aggregate_loss(loss, torch.zeros(2, 2), mode)
    out.backward()
    assert out.item() == 0.0 and torch.equal(loss.grad, torch.zeros(2, 2))


def test_aggregate_loss_errors():
    loss, mask = torch.zeros(2, 3), torch.ones(2, 3)
    with pytest.raises(ValueError, match="token-mean"):
        aggregate_loss(loss, mask, "mean")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="normalizer"):
        aggregate_loss(loss, mask, "seq-mean-token-sum-norm", normalizer=0)
    with pytest.raises(ValueError, match="num_tokens"):
        aggregate_loss(loss, mask, "token-mean", num_tokens=-1)
    with pytest.raises(ValueError, match="shape"):
        aggregate_loss(loss, torch.ones(2, 2), "token-mean")


# ----------------------------------------------------------------------------- policy loss


def _ratios_to_logps(ratios):
    old = torch.full_like(ratios, math.log(0.5))
    return (old + ratios.log()).requires_grad_(), old


def test_policy_loss_hand_computed_asymmetric_clip():
    # ratios [1, 1.5, 0.5, 3], A [1, 1, -1, -1], clip range [0.8, 1.28]; loss = max(-A r, -A clip(r)):
    # t0: r 1 in range -> -1.
    # t1: A>0, r 1.5 > 1.28 -> max(-1.5, -1.28) = -1.28 (clipped, no gradient).
    # t2: A<0, r 0.5 < 0.8 -> max(0.5, 0.8) = 0.8 (clipped, no gradient).
    # t3: A<0, r 3 (high side is not clipped for A<0) -> max(3, 1.28) = 3.
    # token-mean: (-1 - 1.28 + 0.8 + 3)/4 = 0.38. Gradients d/dlogp = -A r / 4 where unclipped:
    # [-0.25, 0, 0, 0.75]. clip_frac 2/4; ratio_mean 6/4 = 1.5; ratio_max 3.
    # approx_kl (k3 of log r): r - 1 - ln r = [0, 0.09453, 0.19315, 0.90139], mean 0.29727.
    logps, old = _ratios_to_logps(torch.tensor([[1.0, 1.5, 0.5, 3.0]]))
    adv = torch.tensor([[1.0, 1.0, -1.0, -1.0]])
    loss, stats = policy_loss(logps, old, adv, torch.ones(1, 4), clip_low=0.2, clip_high=0.28)
    close(loss, 0.38)
    loss.backward()
    close(logps.grad, [[-0.25, 0.0, 0.0, 0.75]])
    close(stats["clip_frac"], 0.5)
    close(stats["clip_frac_high"], 0.25)
    close(stats["clip_frac_low"], 0.25)
    close(stats["dual_clip_frac"], 0.0)
    close(stats["ratio_mean"], 1.5)
    close(stats["ratio_max"], 3.0)
    close(stats["approx_kl"], 0.29727)
    for v in stats.values():
        assert isinstance(v, torch.Tensor) and v.dim() == 0 and not v.requires_grad


def test_policy_loss_dual_clip():
    # Same tokens, dual_clip c=2: t3 (A=-1, r=3) is capped at c|A| = 2 and loses its gradient.
    # token-mean (-1 - 1.28 + 0.8 + 2)/4 = 0.13; clip_frac 3/4; grads [-0.25, 0, 0, 0].
    logps, old = _ratios_to_logps(torch.tensor([[1.0, 1.5, 0.5, 3.0]]))
    adv = torch.tensor([[1.0, 1.0, -1.0, -1.0]])
    loss, stats = policy_loss(logps, old, adv, torch.ones(1, 4), clip_low=0.2, clip_high=0.28, dual_clip=2.0)
    close(loss, 0.13)
    loss.backward()
    close(logps.grad, [[-0.25, 0.0, 0.0, 0.0]])
    close(stats["clip_frac"], 0.75)
    close(stats["dual_clip_frac"], 0.25)


def test_policy_loss_sequence_advantages_broadcast():
    g = torch.Generator().manual_seed(0)
    logps = -torch.rand(3, 4, generator=g)
    old = -torch.rand(3, 4, generator=g)
    adv = torch.randn(3, generator=g)
    mask = torch.ones(3, 4)
    a, _ = policy_loss(logps, old, adv, mask)
    b, _ = policy_loss(logps, old, adv[:, None].expand(3, 4), mask)
    torch.testing.assert_close(a, b)


def test_policy_loss_gspo_sequence_ratio():
    # Token log-ratios [ln 2, 0] -> mean ln2/2 -> s = sqrt(2) = 1.41421 at both tokens; A = 1.
    # clip_high 0.5 (range [0.8, 1.5]) leaves s unclipped: per-token loss -1.41421,
    # seq-mean-token-mean -1.41421; gradient per token -A s / |y| = -0.70711, which is the
    # gradient of the sequence objective -A exp(mean_t(logp - old)).
    logps, old = _ratios_to_logps(torch.tensor([[2.0, 1.0]]))
    adv = torch.tensor([1.0])
    loss, stats = policy_loss(
        logps, old, adv, torch.ones(1, 2), clip_high=0.5, ratio_level="sequence", agg="seq-mean-token-mean"
    )
    close(loss, -math.sqrt(2))
    close(stats["ratio_mean"], math.sqrt(2))
    loss.backward()
    close(logps.grad, [[-math.sqrt(2) / 2, -math.sqrt(2) / 2]])
    # clip_high 0.2: s = 1.414 > 1.2, every token of the sequence is clipped together.
    logps.grad = None
    loss, stats = policy_loss(logps, old, adv, torch.ones(1, 2), ratio_level="sequence")
    loss.backward()
    close(logps.grad, [[0.0, 0.0]])
    close(stats["clip_frac"], 1.0)


def test_policy_loss_gspo_matches_sequence_objective_on_random_input():
    g = torch.Generator().manual_seed(1)
    logps = (-torch.rand(4, 5, generator=g)).requires_grad_()
    old = logps.detach() + 0.05 * torch.randn(4, 5, generator=g)
    mask = torch.arange(5) < torch.tensor([5, 3, 1, 4])[:, None]
    adv = torch.randn(4, generator=g)
    loss, _ = policy_loss(logps, old, adv, mask, clip_low=1.0, clip_high=10.0, ratio_level="sequence",
                          agg="seq-mean-token-mean")
    (grad,) = torch.autograd.grad(loss, logps)
    # Reference: GSPO without clipping, -mean_i A_i s_i, s_i = exp(mean over the row's tokens).
    diff = torch.where(mask, logps - old, 0.0)
    s = torch.exp(diff.sum(1) / mask.sum(1))
    ref = -(adv * s).mean()
    (ref_grad,) = torch.autograd.grad(ref, logps)
    torch.testing.assert_close(loss, ref)
    torch.testing.assert_close(grad, ref_grad)


@pytest.mark.parametrize("ratio_level", get_args(RatioLevel))
def test_policy_loss_padding_garbage_and_all_masked_rows(ratio_level):
    # -inf / NaN at padded positions and a fully masked row: loss, stats and gradient stay finite,
    # padding gets zero gradient. Row 1 has length 1.
    logps = torch.tensor([[-1.0, -0.5, -torch.inf], [-0.2, NAN, NAN], [NAN, -torch.inf, NAN]], requires_grad=True)
    old = torch.tensor([[-1.1, -0.4, NAN], [-0.3, -torch.inf, NAN], [NAN, NAN, NAN]])
    mask = torch.tensor([[1, 1, 0], [1, 0, 0], [0, 0, 0]])
    for agg in get_args(LossAgg):
        logps.grad = None
        loss, stats = policy_loss(logps, old, torch.tensor([1.0, -1.0, 2.0]), mask,
                                  ratio_level=ratio_level, agg=agg, dual_clip=3.0)
        loss.backward()
        assert torch.isfinite(loss)
        assert all(torch.isfinite(v) for v in stats.values())
        assert torch.isfinite(logps.grad).all()
        assert torch.equal(logps.grad[~mask.bool()], torch.zeros(int((~mask.bool()).sum())))
        assert (logps.grad[mask.bool()] != 0).all(), agg  # the real tokens do get a gradient
    # No loss tokens at all: every stat is 0.
    loss, stats = policy_loss(logps, old, torch.ones(3), torch.zeros(3, 3), ratio_level=ratio_level)
    assert loss.item() == 0.0 and all(v.item() == 0.0 for v in stats.values())


def test_policy_loss_errors():
    x, m = torch.zeros(2, 3), torch.ones(2, 3)
    with pytest.raises(ValueError, match=r"\['token', 'sequence'\]"):
        policy_loss(x, x, torch.zeros(2), m, ratio_level="seq")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="seq-mean-token-mean"):
        policy_loss(x, x, torch.zeros(2), m, agg="sum")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="dual_clip"):
        policy_loss(x, x, torch.zeros(2), m, dual_clip=1.0)
    with pytest.raises(ValueError, match="advantages"):
        policy_loss(x, x, torch.zeros(3), m)
    with pytest.raises(ValueError, match="clip_low"):
        policy_loss(x, x, torch.zeros(2), m, clip_low=1.5)


# ----------------------------------------------------------------------------- gradient accumulation


@pytest.mark.parametrize("ratio_level", get_args(RatioLevel))
@pytest.mark.parametrize("agg", get_args(LossAgg))
def test_gradient_accumulation_invariance(agg, ratio_level):
    """One call on 8 sequences == sum of 8 single-sequence calls given the batch's counts.

    Each single-sequence call sees its row trimmed to its own length (different padding
    than the full batch), so a fixed ``normalizer`` is passed, as documented.
    """
    g = torch.Generator().manual_seed(0)
    B, T = 8, 6
    lengths = torch.tensor([6, 1, 3, 0, 5, 2, 6, 4])  # a length-1 row and an all-masked row
    mask = torch.arange(T) < lengths[:, None]
    logps = (-2 * torch.rand(B, T, generator=g)).requires_grad_()
    old = logps.detach() + 0.3 * torch.randn(B, T, generator=g)  # some ratios fall outside the clip range
    adv = torch.randn(B, generator=g)
    kw = dict(clip_low=0.2, clip_high=0.28, dual_clip=2.0, ratio_level=ratio_level, agg=agg, normalizer=T)

    full, _ = policy_loss(logps, old, adv, mask, **kw)
    (grad_full,) = torch.autograd.grad(full, logps)

    num_tokens, num_seqs = int(mask.sum()), B
    total = torch.zeros(())
    for i in range(B):
        width = max(int(lengths[i]), 1)
        part, _ = policy_loss(logps[i : i + 1, :width], old[i : i + 1, :width], adv[i : i + 1],
                              mask[i : i + 1, :width], num_tokens=num_tokens, num_seqs=num_seqs, **kw)
        total = total + part
    (grad_micro,) = torch.autograd.grad(total, logps)

    torch.testing.assert_close(total, full)
    torch.testing.assert_close(grad_micro, grad_full)
    assert grad_full.abs().sum() > 0  # the comparison is not vacuous


# ----------------------------------------------------------------------------- entropy


def test_entropy_from_logits():
    # Uniform over 2 -> ln 2 = 0.69315; uniform over 4 -> ln 4 = 1.38629;
    # logits [0, -inf] -> one certain token -> 0, with a finite gradient.
    logits = torch.tensor([[0.0, 0.0, -torch.inf, -torch.inf], [1.0, 1.0, 1.0, 1.0]], requires_grad=True)
    h = entropy_from_logits(logits)
    close(h, [math.log(2), math.log(4)])
    h.sum().backward()
    assert torch.isfinite(logits.grad).all()
    certain = entropy_from_logits(torch.tensor([0.0, -torch.inf]))
    assert certain.item() == 0.0
    out = entropy_from_logits(torch.zeros(2, 3, 5, dtype=torch.bfloat16))
    assert out.dtype == torch.float32 and out.shape == (2, 3)


# ----------------------------------------------------------------------------- token rewards, groups, shaping


def test_token_rewards_hand_computed():
    # row 0: loss tokens 0,1 -> KL penalty -0.5*kl on both, reward 1 on the last (index 1):
    #        [-0.05, -0.1 + 1, 0]; row 1: loss tokens 1,2 -> [0, -0.25, -0.3 + 2];
    # row 2: invalid -> all 0 (its NaN reward never reaches a sum).
    from plainrl.algorithms import token_rewards

    mask = torch.tensor([[1, 1, 0], [0, 1, 1], [1, 1, 1]])
    kl = torch.tensor([[0.1, 0.2, 0.3], [0.4, 0.5, 0.6], [0.7, 0.8, 0.9]])
    valid = torch.tensor([True, True, False])
    out = token_rewards(t(1.0, 2.0, NAN), mask, kl=kl, kl_coef=0.5, valid=valid)
    close(out, [[-0.05, 0.9, 0.0], [0.0, -0.25, 1.7], [0.0, 0.0, 0.0]])
    close(token_rewards(t(1.0, 2.0, NAN), mask, valid=valid), [[0, 1, 0], [0, 0, 2], [0, 0, 0]])
    # a row without loss tokens gets nothing, not a reward at position -1
    assert torch.equal(token_rewards(t(5.0), torch.zeros(1, 3)), torch.zeros(1, 3))
    with pytest.raises(ValueError, match="marked valid"):
        token_rewards(t(NAN), torch.ones(1, 2))


def test_informative_groups():
    # groups of 2: [1, 1] all equal; [0, 1] informative; [NaN (invalid), 1] one valid sample
    from plainrl.algorithms import informative_groups

    valid = torch.tensor([True, True, True, True, False, True])
    out = informative_groups(t(1.0, 1.0, 0.0, 1.0, NAN, 1.0), 2, valid=valid)
    assert out.tolist() == [False, True, False]
    # exactly the groups whose GRPO advantages are not all zero
    adv = grpo_advantages(t(1.0, 1.0, 0.0, 1.0, NAN, 1.0), 2, valid=valid).view(-1, 2)
    assert (adv != 0).any(dim=1).tolist() == out.tolist()


def test_overlong_penalty_hand_computed():
    # L_max = 10, L_cache = 4: free up to 6 tokens, then (6 - |y|) / 4, -1 beyond 10.
    # |y| = 5, 6 -> 0; 7 -> -0.25; 8 -> -0.5; 10 -> -1; 11 -> -1.
    from plainrl.algorithms import overlong_penalty

    lengths = torch.tensor([5, 6, 7, 8, 10, 11])
    close(overlong_penalty(lengths, 10, 4), [0.0, 0.0, -0.25, -0.5, -1.0, -1.0])
    close(overlong_penalty(lengths, 10, 4, factor=2.0), [0.0, 0.0, -0.5, -1.0, -2.0, -2.0])
    # L_cache = L_max: the penalty starts at the first token, -|y| / 10
    close(overlong_penalty(lengths, 10, 10), [-0.5, -0.6, -0.7, -0.8, -1.0, -1.0])
    for bad, why in ((dict(max_len=0, cache_len=1), "max_len must be > 0, got 0"),
                     (dict(max_len=10, cache_len=0), r"cache_len must be in \(0, max_len=10\], got 0"),
                     (dict(max_len=10, cache_len=11), r"cache_len must be in \(0, max_len=10\], got 11")):
        with pytest.raises(ValueError, match=why):
            overlong_penalty(lengths, **bad)


# ----------------------------------------------------------------------------- preference losses


def test_dpo_loss_hand_computed():
    # pair 0: beta 0.5; chosen reward 0.5 * (-1 - -1.5) = 0.25, rejected 0.5 * (-2 - -1.5) = -0.25,
    #   margin 0.5, loss = -log sigmoid(0.5) = log(1 + e^-0.5) = 0.474077;
    #   d loss / d policy_chosen = -beta * sigmoid(-0.5) = -0.5 * 0.377541 = -0.188771, and +0.188771
    #   for policy_rejected.
    # pair 1: policy = reference, margin 0: loss = log 2 = 0.693147.
    from plainrl.algorithms import dpo_loss

    pc = torch.tensor([-1.0, -3.0], requires_grad=True)
    pr = torch.tensor([-2.0, -4.0], requires_grad=True)
    losses, chosen, rejected = dpo_loss(pc, pr, t(-1.5, -3.0), t(-1.5, -4.0), beta=0.5)
    close(losses, [0.474077, 0.693147])
    close(chosen, [0.25, 0.0])
    close(rejected, [-0.25, 0.0])
    losses[0].backward()
    close(pc.grad, [-0.188771, 0.0])
    close(pr.grad, [0.188771, 0.0])
    # a huge margin neither overflows nor gives NaN
    big, _, _ = dpo_loss(t(0.0), t(-1e6), t(0.0), t(0.0), beta=1.0)
    assert big.item() == 0.0
    huge, _, _ = dpo_loss(t(-1e6), t(0.0), t(0.0), t(0.0), beta=1.0)
    close(huge, [1e6])
    with pytest.raises(ValueError, match="beta"):
        dpo_loss(t(0.0), t(0.0), t(0.0), t(0.0), beta=0.0)
    with pytest.raises(ValueError, match="shape"):
        dpo_loss(t(0.0, 1.0), t(0.0), t(0.0), t(0.0))


def test_bradley_terry_loss_hand_computed():
    # r_w - r_l = 1: loss = log(1 + e^-1) = 0.313262, d/d r_w = -sigmoid(-1) = -0.268941;
    # equal scores: log 2.
    from plainrl.algorithms import bradley_terry_loss

    chosen = torch.tensor([2.0, 0.0], requires_grad=True)
    loss = bradley_terry_loss(chosen, t(1.0, 0.0))
    close(loss, [0.313262, 0.693147])
    loss.sum().backward()
    close(chosen.grad, [-0.268941, -0.5])


def test_truncated_is_weights_hand_computed():
    # learner pi_old = [0.5, 0.2, 0.9, 0.3], engine = [0.25, 0.4, 0.1, 0.3]; the last token is masked.
    # ratios pi_old / pi_engine = [2, 0.5, 9, 1]; with C = 3: [2, 0.5, 3, (masked) 0]; one of three truncated
    old = torch.log(torch.tensor([[0.5, 0.2, 0.9, 0.3]]))
    engine = torch.log(torch.tensor([[0.25, 0.4, 0.1, 0.3]]))
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0]])
    w, frac = truncated_is_weights(old, engine, mask, cap=3.0)
    torch.testing.assert_close(w, torch.tensor([[2.0, 0.5, 3.0, 0.0]]))
    assert float(frac) == pytest.approx(1 / 3)
    # on-policy (ratio 1), A = 1, token-mean: the loss is -mean_t(w_t) = -(2 + 0.5 + 3) / 3,
    # and the gradient of each token's logprob is -w_t / 3
    logps = old.clone().requires_grad_(True)
    loss, _ = policy_loss(logps, old, torch.tensor([1.0]), mask, is_weights=w)
    assert float(loss) == pytest.approx(-5.5 / 3)
    loss.backward()
    torch.testing.assert_close(logps.grad, torch.tensor([[-2 / 3, -0.5 / 3, -1.0, 0.0]]))
    with pytest.raises(ValueError, match="tis_cap"):
        truncated_is_weights(old, engine, mask, cap=0.0)
