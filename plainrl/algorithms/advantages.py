"""Advantage estimators: group-relative (GRPO, Dr. GRPO, RLOO), REINFORCE++ and GAE.

Shapes: N = number of episodes (groups x group_size, each group contiguous),
B = sequences, T = padded length. ``mask`` is 1 (or True) on loss tokens; any
nonzero value counts as a loss token.

Every function here returns detached tensors: advantages and returns are targets,
and a gradient leaking through them (e.g. through critic values) would be a bug.
"""

from __future__ import annotations

import torch


def _check_bt(**tensors: torch.Tensor) -> None:
    """Raise ValueError unless every tensor is 2-D and all share the first one's shape."""
    (first_name, first), *rest = tensors.items()
    if first.dim() != 2:
        raise ValueError(f"{first_name} must be [B, T], got shape {tuple(first.shape)}")
    for name, t in rest:
        if t.shape != first.shape:
            raise ValueError(
                f"{name} must have the shape of {first_name} {tuple(first.shape)}, got {tuple(t.shape)}"
            )


def _grouped(
    rewards: torch.Tensor, group_size: int, valid: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Validate and reshape to ([G, group_size] rewards with invalid ones zeroed, [G, group_size] valid)."""
    if rewards.dim() != 1:
        raise ValueError(f"rewards must be 1-D [N], got shape {tuple(rewards.shape)}")
    if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size < 1:
        raise ValueError(f"group_size must be a positive int, got {group_size!r}")
    n = rewards.shape[0]
    if n % group_size:
        raise ValueError(f"{n} rewards do not split into groups of group_size={group_size}")
    if valid is None:
        valid = torch.ones(n, dtype=torch.bool, device=rewards.device)
    elif valid.dtype != torch.bool or valid.shape != rewards.shape:
        raise ValueError(
            f"valid must be a bool tensor of shape {tuple(rewards.shape)}, "
            f"got dtype {valid.dtype} and shape {tuple(valid.shape)}"
        )
    r = rewards.detach()
    if not r.is_floating_point():
        r = r.float()
    if not torch.isfinite(r[valid]).all():
        raise ValueError("a reward marked valid is NaN or infinite; mark that sample invalid (valid=False)")
    # Invalid rewards may be NaN; zero them so they cannot reach any sum.
    r = torch.where(valid, r, torch.zeros_like(r))
    return r.view(-1, group_size), valid.view(-1, group_size)


def _group_stats(
    r: torch.Tensor, v: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-group statistics over valid entries of [G, group_size] rewards.

    Returns (count [G, 1], shifted [G, gs], centred [G, gs], informative [G, 1]):
    ``shifted = r - min(valid r)`` and ``centred = r - mean(valid r)``, both 0 at
    invalid entries. Shifting by the group minimum first makes differences of nearly
    equal rewards exact (Sterbenz), so the mean's rounding cannot flip a sign; this
    avoids float64, which some backends lack.

    ``informative`` is False where a group has < 2 valid samples or all its valid
    rewards are equal: those groups carry no learning signal, and forcing their
    advantage to exactly 0 avoids both 0/0 and float residue from an inexact mean.
    """
    count = v.to(r.dtype).sum(dim=1, keepdim=True)
    hi = torch.where(v, r, torch.full_like(r, -torch.inf)).amax(dim=1, keepdim=True)
    lo = torch.where(v, r, torch.full_like(r, torch.inf)).amin(dim=1, keepdim=True)
    informative = (count >= 2) & (hi > lo)
    lo = torch.where(count > 0, lo, torch.zeros_like(lo))
    zeros = torch.zeros_like(r)
    shifted = torch.where(v, r - lo, zeros)
    mean = shifted.sum(dim=1, keepdim=True) / count.clamp(min=1)
    centred = torch.where(v, shifted - mean, zeros)
    return count, shifted, centred, informative


def grpo_advantages(
    rewards: torch.Tensor,
    group_size: int,
    *,
    norm_std: bool = True,
    eps: float = 1e-6,
    valid: torch.Tensor | None = None,
) -> torch.Tensor:
    """Group-relative advantages of GRPO, or of Dr. GRPO with ``norm_std=False``.

    For sample i of a group with valid rewards r_1..r_n:
    ``A_i = (r_i - mean(r)) / (std(r) + eps)`` (GRPO) or ``A_i = r_i - mean(r)`` (Dr. GRPO).
    ``std`` is the unbiased sample std (divides by n - 1), as ``torch.std`` in TRL's
    GRPOTrainer. Mean and std use only valid samples.

    Exactly 0 for: invalid samples; groups with fewer than 2 valid samples (incl.
    ``group_size=1``); groups whose valid rewards are all equal. Never NaN.

    Args:
        rewards:    [N] scalar reward per episode, N = groups x group_size, groups contiguous.
                    Entries with ``valid=False`` may hold anything, NaN included.
        group_size: episodes per prompt group (>= 1).
        norm_std:   divide by the group std (GRPO) or not (Dr. GRPO).
        eps:        added to the std before dividing (>= 0).
        valid:      [N] bool, False for episodes that could not be scored; None: all valid.

    Returns:
        [N] advantages (detached), float dtype of ``rewards`` (float32 for integer rewards).

    Raises:
        ValueError: ``rewards`` not 1-D, ``group_size`` not a positive int or not dividing N,
            ``valid`` not a bool tensor of shape [N], a valid reward that is NaN/inf, ``eps < 0``.

    Source: Shao et al. 2024 (DeepSeekMath, arXiv:2402.03300) Sec. 4.1.2, outcome
    supervision: A_i = (r_i - mean(r)) / std(r); Dr. GRPO: Liu et al. 2025
    (arXiv:2503.20783) Sec. 3.1 / Fig. 1, which drops the std division.
    """
    if eps < 0:
        raise ValueError(f"eps must be >= 0, got {eps}")
    r, v = _grouped(rewards, group_size, valid)
    count, _, adv, informative = _group_stats(r, v)
    if norm_std:
        var = adv.square().sum(dim=1, keepdim=True) / (count - 1).clamp(min=1)
        adv = adv / (var.sqrt() + eps)
    adv = torch.where(v & informative, adv, torch.zeros_like(adv))
    return adv.reshape(-1)


def rloo_advantages(
    rewards: torch.Tensor,
    group_size: int,
    *,
    valid: torch.Tensor | None = None,
) -> torch.Tensor:
    """REINFORCE leave-one-out advantages: each sample's baseline is the mean of the others.

    For sample i of a group with n valid rewards: ``A_i = r_i - (sum_j r_j - r_i) / (n - 1)``,
    which equals ``n / (n - 1) * (r_i - mean(r))``. Sums run over valid samples only.

    Exactly 0 for: invalid samples; groups with fewer than 2 valid samples (no
    "other" samples to form a baseline; incl. ``group_size=1``); groups whose valid
    rewards are all equal. Never NaN.

    Args:
        rewards:    [N] scalar reward per episode, groups contiguous; invalid entries may be NaN.
        group_size: episodes per prompt group (>= 1).
        valid:      [N] bool, False for unscorable episodes; None: all valid.

    Returns:
        [N] advantages (detached).

    Raises:
        ValueError: as :func:`grpo_advantages` (shape, group_size, valid, non-finite valid reward).

    Source: Kool et al. 2019, "Buy 4 REINFORCE Samples, Get a Baseline for Free!"
    (ICLR DeepRLStructPred workshop), the leave-one-out baseline; Ahmadian et al. 2024,
    "Back to Basics" (arXiv:2402.14740), section "REINFORCE Leave-One-Out (RLOO)":
    (1/k) sum_i [R(y_i) - 1/(k-1) sum_{j != i} R(y_j)] grad log pi(y_i | x).
    """
    r, v = _grouped(rewards, group_size, valid)
    count, shifted, _, informative = _group_stats(r, v)
    # The leave-one-out difference is shift-invariant, so the exact shifted rewards serve.
    total = shifted.sum(dim=1, keepdim=True)
    adv = shifted - (total - shifted) / (count - 1).clamp(min=1)
    adv = torch.where(v & informative, adv, torch.zeros_like(adv))
    return adv.reshape(-1)


def _masked_reverse_scan(x: torch.Tensor, m: torch.Tensor, gamma: float) -> torch.Tensor:
    """``y_t = x_t + gamma * y_next`` over loss tokens only, right to left.

    ``y_next`` is the value at the next loss token of the same row (0 after the
    last one): positions with mask 0 (padding, tool output) are not actions, so
    they neither add reward nor consume a discount step. Output is 0 there.
    """
    if x.shape[1] == 0:
        return torch.zeros_like(x)
    carry = torch.zeros_like(x[:, 0])
    out = []
    for t in range(x.shape[1] - 1, -1, -1):
        carry = torch.where(m[:, t], x[:, t] + gamma * carry, carry)
        out.append(torch.where(m[:, t], carry, torch.zeros_like(carry)))
    out.reverse()
    return torch.stack(out, dim=1)


def reinforce_pp_advantages(
    token_rewards: torch.Tensor,
    mask: torch.Tensor,
    *,
    gamma: float = 1.0,
    eps: float = 1e-8,
) -> torch.Tensor:
    """REINFORCE++ advantages: discounted return-to-go, normalised over the whole batch.

    ``G_t = r_t + gamma * G_next`` over loss tokens (``G_next``: the next loss token of
    the row; mask-0 positions are skipped, their rewards ignored), then
    ``A_t = (G_t - mean(G)) / sqrt(max(var(G), eps))`` with mean and population
    variance over every loss token of the batch (as OpenRLHF, the paper's reference
    implementation). The caller folds the KL penalty into the token rewards
    (``r_t = -beta * KL_t``, plus the sequence reward on the row's last loss token).

    Exactly 0 at mask-0 positions, and everywhere when all returns in the batch are
    equal (incl. no loss tokens at all). Never NaN.

    Args:
        token_rewards: [B, T] per-token rewards.
        mask:          [B, T] 1 on loss tokens.
        gamma:         discount per loss token, in [0, 1].
        eps:           lower bound on the variance before the square root (> 0).

    Returns:
        [B, T] advantages (detached), float dtype of ``token_rewards``.

    Raises:
        ValueError: shapes differ or are not 2-D; ``gamma`` outside [0, 1]; ``eps <= 0``.

    Source: Hu 2025, "REINFORCE++" (arXiv:2501.03262): token-level KL folded into the
    reward, return-to-go, and global (batch) advantage normalisation.
    """
    _check_bt(token_rewards=token_rewards, mask=mask)
    if not 0.0 <= gamma <= 1.0:
        raise ValueError(f"gamma must be in [0, 1], got {gamma}")
    if eps <= 0:
        raise ValueError(f"eps must be > 0, got {eps}")
    m = mask.bool()
    x = token_rewards.detach()
    if not x.is_floating_point():
        x = x.float()
    returns = _masked_reverse_scan(torch.where(m, x, torch.zeros_like(x)), m, gamma)
    return whiten_advantages(returns, m, eps=eps)


def whiten_advantages(advantages: torch.Tensor, mask: torch.Tensor, *, eps: float = 1e-8) -> torch.Tensor:
    """Batch whitening of token advantages: ``(A - mean) / sqrt(max(var, eps))``, with
    the mean and population variance over every loss token of the batch.

    Derivation of the edge cases: with one distinct value over the loss tokens the
    centred advantages are 0 up to float residue of the mean, which the division by
    a tiny std would blow up into a fake signal, so the result is exactly 0 then
    (also with no loss tokens at all). Mask-0 positions are 0 on output.

    Args:
        advantages: [B, T] (or [N]) advantages; values at mask-0 positions may be anything
                    finite or not, they are ignored.
        mask:       same shape, 1 on loss tokens.
        eps:        lower bound on the variance before the square root (> 0).

    Returns:
        same shape, detached, float dtype of ``advantages``.

    Raises:
        ValueError: shapes differ; ``eps <= 0``.

    Source: the advantage normalisation of PPO implementations for language models
    (Ziegler et al. 2019, arXiv:1909.08593, the ``whiten`` of its lm-human-preferences
    code; Zheng et al. 2023, "Secrets of RLHF in Large Language Models Part I: PPO",
    arXiv:2307.04964, Sec. 5.3.1, "advantage normalization"); REINFORCE++'s global
    normalisation (Hu 2025, arXiv:2501.03262, Sec. 3) is the same operation on returns.
    """
    if advantages.shape != mask.shape:
        raise ValueError(f"mask must have the shape of advantages {tuple(advantages.shape)}, got {tuple(mask.shape)}")
    if eps <= 0:
        raise ValueError(f"eps must be > 0, got {eps}")
    m = mask.bool()
    x = advantages.detach()
    if not x.is_floating_point():
        x = x.float()
    x = torch.where(m, x, torch.zeros_like(x))
    if x.numel() == 0:
        return x
    n = m.sum().clamp(min=1)
    mean = x.sum() / n
    centred = torch.where(m, x - mean, torch.zeros_like(x))
    var = centred.square().sum() / n
    adv = centred * var.clamp(min=eps).rsqrt()
    hi = torch.where(m, x, torch.full_like(x, -torch.inf)).amax()
    lo = torch.where(m, x, torch.full_like(x, torch.inf)).amin()
    return torch.where(hi > lo, adv, torch.zeros_like(adv))


def gae(
    token_rewards: torch.Tensor,
    values: torch.Tensor,
    mask: torch.Tensor,
    *,
    gamma: float,
    lam: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalized Advantage Estimation over the loss tokens of each row.

    ``delta_t = r_t + gamma * V_next - V_t`` and ``A_t = delta_t + gamma * lam * A_next``,
    where "next" is the next loss token of the same row (V_next = A_next = 0 after the
    last one, i.e. the episode terminates there). Mask-0 positions (right padding,
    tool output) are skipped: their rewards and values are ignored and they do not
    consume a discount step. ``returns = A + V`` (the lambda-return, the critic's target).

    Computed by one reverse scan over T, vectorised over B.

    Args:
        token_rewards: [B, T] per-token rewards (sequence reward on the last loss token).
        values:        [B, T] critic values V(s_t) at each token; values at mask-0
                       positions may be anything (NaN included).
        mask:          [B, T] 1 on loss tokens.
        gamma:         discount, in [0, 1].
        lam:           GAE lambda, in [0, 1] (0: one-step TD, 1: Monte-Carlo return - V).

    Returns:
        (advantages [B, T], returns [B, T]), both detached, 0 at mask-0 positions.

    Raises:
        ValueError: shapes differ or are not 2-D; ``gamma`` or ``lam`` outside [0, 1].

    Source: Schulman et al. 2016, "High-Dimensional Continuous Control Using Generalized
    Advantage Estimation" (arXiv:1506.02438) Sec. 3, eq. 11-16 (eq. 16: A = sum_l
    (gamma lam)^l delta_{t+l}).
    """
    _check_bt(token_rewards=token_rewards, values=values, mask=mask)
    if not 0.0 <= gamma <= 1.0:
        raise ValueError(f"gamma must be in [0, 1], got {gamma}")
    if not 0.0 <= lam <= 1.0:
        raise ValueError(f"lam must be in [0, 1], got {lam}")
    m = mask.bool()
    r = token_rewards.detach()
    v = values.detach()
    dtype = torch.promote_types(r.dtype, v.dtype)
    if not dtype.is_floating_point:
        dtype = torch.get_default_dtype()
    r, v = r.to(dtype), v.to(dtype)
    if v.shape[1] == 0:
        return torch.zeros_like(v), torch.zeros_like(v)
    zeros = torch.zeros_like(v[:, 0])
    next_value, next_adv = zeros, zeros
    advs = []
    for t in range(v.shape[1] - 1, -1, -1):
        mt = m[:, t]
        adv_t = r[:, t] + gamma * next_value - v[:, t] + gamma * lam * next_adv
        next_adv = torch.where(mt, adv_t, next_adv)
        next_value = torch.where(mt, v[:, t], next_value)
        advs.append(torch.where(mt, adv_t, zeros))
    advs.reverse()
    adv = torch.stack(advs, dim=1)
    returns = torch.where(m, adv + v, torch.zeros_like(adv))
    return adv, returns


def informative_groups(
    rewards: torch.Tensor,
    group_size: int,
    *,
    valid: torch.Tensor | None = None,
) -> torch.Tensor:
    """Which groups carry a learning signal: at least two valid rewards, not all equal.

    The groups for which :func:`grpo_advantages` and :func:`rloo_advantages` are not
    identically 0; DAPO's dynamic sampling keeps only these (for a 0/1 accuracy
    reward, exactly the constraint ``0 < |{o_i correct}| < G``).

    Args:
        rewards:    [N] scalar reward per episode, groups contiguous; invalid entries may be NaN.
        group_size: episodes per prompt group (>= 1).
        valid:      [N] bool, False for unscorable episodes; None: all valid.

    Returns:
        [N / group_size] bool.

    Raises:
        ValueError: as :func:`grpo_advantages`.

    Source: Yu et al. 2025 (DAPO, arXiv:2503.14476) Sec. 3.2, eq. 11 (dynamic sampling).
    """
    r, v = _grouped(rewards, group_size, valid)
    return _group_stats(r, v)[3].squeeze(1)


def token_rewards(
    rewards: torch.Tensor,
    mask: torch.Tensor,
    *,
    kl: torch.Tensor | None = None,
    kl_coef: float = 0.0,
    valid: torch.Tensor | None = None,
) -> torch.Tensor:
    """Per-token rewards from sequence rewards, with an optional KL penalty folded in.

    ``r_t = -kl_coef * kl_t`` on every loss token, plus the sequence reward on the
    row's last loss token (the action that ended the episode). Invalid rows
    (``valid=False``) get 0 everywhere: their reward is unknown, and a KL-only
    reward would give them a one-sided signal.

    Args:
        rewards: [B] sequence rewards; entries with ``valid=False`` may be NaN.
        mask:    [B, T] 1 on loss tokens.
        kl:      [B, T] per-token KL estimate (e.g. :func:`plainrl.algorithms.kl_estimate`); None: no penalty.
        kl_coef: beta >= 0.
        valid:   [B] bool; None: all valid.

    Returns:
        [B, T] float32 (detached), 0 off the mask; the input of
        :func:`reinforce_pp_advantages` and :func:`gae`.

    Raises:
        ValueError: shapes that do not fit, ``kl_coef < 0``, a valid reward that is NaN/inf.

    Source: the KL-shaped reward of RLHF, Ouyang et al. 2022 (InstructGPT,
    arXiv:2203.02155) eq. 2, per token as in Hu 2025 (REINFORCE++, arXiv:2501.03262).
    """
    if rewards.dim() != 1 or mask.dim() != 2 or mask.shape[0] != rewards.shape[0]:
        raise ValueError(f"rewards must be [B] and mask [B, T]; got {tuple(rewards.shape)} and {tuple(mask.shape)}")
    if kl_coef < 0:
        raise ValueError(f"kl_coef must be >= 0, got {kl_coef}")
    if valid is None:
        valid = torch.ones_like(rewards, dtype=torch.bool)
    r = torch.where(valid, rewards.detach().float(), torch.zeros_like(rewards, dtype=torch.float32))
    if not torch.isfinite(r).all():
        raise ValueError("a reward marked valid is NaN or infinite; mark that sample invalid (valid=False)")
    m = mask.bool() & valid[:, None]
    out = torch.zeros(mask.shape, dtype=torch.float32, device=mask.device)
    if kl is not None and kl_coef > 0:
        _check_bt(mask=mask, kl=kl)
        out = torch.where(m, -kl_coef * kl.detach().float(), out)
    if mask.shape[1]:
        positions = torch.arange(mask.shape[1], device=mask.device)
        last = torch.where(m, positions, -1).amax(dim=1)  # [B], -1 when a row has no loss token
        rows = (last >= 0).nonzero().squeeze(1)
        out[rows, last[rows]] += r[rows]
    return out


def kl_penalized_rewards(
    rewards: torch.Tensor, mask: torch.Tensor, kl: torch.Tensor, kl_coef: float
) -> torch.Tensor:
    """Sequence rewards with the per-token KL penalty of the reward summed in, for the
    outcome-reward estimators (GRPO, RLOO):

        R'_i = R_i − β · Σ_t mask_it · KL_it

    The same total a token-level estimator sees: with γ = 1 the return from the first token of
    :func:`token_rewards` is this R'. Summed, not averaged, over tokens, as in PPO-RLHF's reward
    (every sampled token pays its KL) and verl's ``use_kl_in_reward``; a long completion that
    drifts from the reference pays more than a short one. GRPO then centres (and scales) R'
    within the group, so what counts is a sample's KL relative to its group's.

    Args:
        rewards: [N] sequence rewards (NaN allowed where unscorable: it stays NaN).
        mask:    [N, L] 1 on loss tokens.
        kl:      [N, L] per-token KL estimate (:func:`plainrl.algorithms.kl_estimate`).
        kl_coef: β >= 0.
    Returns:
        [N] float32 (detached).
    Raises:
        ValueError: shapes that do not fit, or ``kl_coef < 0``.

    Source: Ouyang et al. 2022 (InstructGPT, arXiv:2203.02155) eq. 2, the KL-penalised reward
    R(x, y) − β log(π(y|x) / π_ref(y|x)), whose log-ratio is the sum of the per-token ones (k1).
    """
    if rewards.dim() != 1 or mask.shape[0] != rewards.shape[0]:
        raise ValueError(f"rewards must be [N] and mask [N, L]; got {tuple(rewards.shape)} and {tuple(mask.shape)}")
    _check_bt(mask=mask, kl=kl)
    if kl_coef < 0:
        raise ValueError(f"kl_coef must be >= 0, got {kl_coef}")
    return rewards.detach().float() - kl_coef * (kl.detach().float() * (mask != 0)).sum(dim=1)
