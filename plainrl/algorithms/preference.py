"""Losses on preference pairs: DPO and the Bradley-Terry reward model.

Shapes: B = preference pairs. Log-probabilities are sums over the response tokens
of a sequence (``log pi(y | x)``); rewards are one scalar per sequence.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def _check_pairs(**tensors: torch.Tensor) -> None:
    (first_name, first), *rest = tensors.items()
    if first.dim() != 1:
        raise ValueError(f"{first_name} must be 1-D [B], got shape {tuple(first.shape)}")
    for name, t in rest:
        if t.shape != first.shape:
            raise ValueError(f"{name} must have the shape of {first_name} {tuple(first.shape)}, got {tuple(t.shape)}")


def dpo_loss(
    policy_chosen: torch.Tensor,
    policy_rejected: torch.Tensor,
    ref_chosen: torch.Tensor,
    ref_rejected: torch.Tensor,
    *,
    beta: float = 0.1,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Direct Preference Optimization loss per pair.

    With implicit rewards ``r_w = beta * (log pi(y_w|x) - log pi_ref(y_w|x))`` and
    ``r_l`` likewise for the rejected response::

        loss = -log sigmoid(r_w - r_l)

    computed as ``softplus(-(r_w - r_l))`` (no overflow for large margins).

    Args:
        policy_chosen, policy_rejected: [B] log pi_theta of the chosen / rejected
            responses (sums over response tokens; differentiable).
        ref_chosen, ref_rejected: [B] the same under the reference policy (detached).
        beta: > 0, the strength of the implicit KL constraint.

    Returns:
        ``(losses [B], chosen_rewards [B], rejected_rewards [B])``, float32; the rewards
        are detached (for logging: accuracy = mean(chosen > rejected), margin).
        Reduce the losses with a sum divided by the optimiser batch's pair count.

    Raises:
        ValueError: shapes differ or are not 1-D; ``beta <= 0``.

    Source: Rafailov et al. 2023 (DPO, arXiv:2305.18290) eq. 7.
    """
    _check_pairs(policy_chosen=policy_chosen, policy_rejected=policy_rejected,
                 ref_chosen=ref_chosen, ref_rejected=ref_rejected)
    if beta <= 0:
        raise ValueError(f"beta must be > 0, got {beta}")
    chosen = beta * (policy_chosen.float() - ref_chosen.detach().float())
    rejected = beta * (policy_rejected.float() - ref_rejected.detach().float())
    losses = F.softplus(-(chosen - rejected))
    return losses, chosen.detach(), rejected.detach()


def bradley_terry_loss(chosen_scores: torch.Tensor, rejected_scores: torch.Tensor) -> torch.Tensor:
    """Reward-model loss per pair under the Bradley-Terry preference model.

    ``P(y_w > y_l | x) = sigmoid(r(x, y_w) - r(x, y_l))``, trained by its negative
    log-likelihood ``loss = -log sigmoid(r_w - r_l)`` = ``softplus(r_l - r_w)``.

    Args:
        chosen_scores, rejected_scores: [B] scalar rewards r(x, y) (differentiable).

    Returns:
        [B] float32 losses; reduce with a sum divided by the optimiser batch's pair count.

    Raises:
        ValueError: shapes differ or are not 1-D.

    Source: Bradley & Terry 1952; as a reward-model loss Ouyang et al. 2022
    (InstructGPT, arXiv:2203.02155) eq. 1 and Rafailov et al. 2023 (DPO,
    arXiv:2305.18290) eq. 2.
    """
    _check_pairs(chosen_scores=chosen_scores, rejected_scores=rejected_scores)
    return F.softplus(rejected_scores.float() - chosen_scores.float())
