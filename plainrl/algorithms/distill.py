"""On-policy distillation: the student samples, a teacher scores the sampled tokens.

Two forms of the learning signal (``algorithm.distill_loss``):

``reverse_kl`` (Agarwal et al. 2024, "On-Policy Distillation of Language Models: Learning from
Self-Generated Mistakes" (GKD), arXiv:2306.13649, sec. 3 with the student's own samples; Thinking
Machines, "On-Policy Distillation", 2025; Qwen3 technical report, arXiv:2505.09388, sec. 4.5).
The objective is the reverse KL of the student pi_theta to the teacher pi_T on the student's
own completions,

    KL(pi_theta || pi_T) = E_{y ~ pi_theta} [ sum_t log pi_theta(y_t | x, y_<t) - log pi_T(y_t | x, y_<t) ].

Its policy gradient is REINFORCE with the per-token reward r_t = log pi_T(y_t) - log pi_theta(y_t)
(the one-sample estimate of -KL at token t). Thinking Machines and the Tinker cookbook use that
reward undiscounted and unsummed (each token is its own return, discount 0), which is the
advantage

    A_t = log pi_T(y_t | x, y_<t) - log pi_old(y_t | x, y_<t)                              (1)

with pi_old the policy that sampled (the engine's logprobs). It goes through the run's usual
importance-sampling/clip loss, so several passes or stale samples stay corrected.
:func:`reverse_kl_advantages` is (1); :func:`mix_advantages` adds the task reward's group
advantage, ``A_t = distill_coef * A^distill_t + reward_coef * A^reward``.

``gkd_topk``: a generalised Jensen-Shannon divergence between the teacher and the student
(Agarwal et al. 2024, eq. 3), with beta the direction knob the docs describe (0: forward KL,
1: reverse KL, continuous in between; see :func:`topk_generalized_jsd`) per sampled position,
computed over the teacher's top-k tokens plus one class for the rest of the vocabulary. The
coarsening keeps it a divergence between two proper distributions over k + 1 classes, so a
student that moves mass off the teacher's top-k is penalised (renormalising over the k tokens
would not see it); by the data-processing inequality it is at most the full-vocabulary value.
See :func:`topk_generalized_jsd`.
"""

from __future__ import annotations

import math

import torch

from plainrl.algorithms.advantages import _check_bt


def reverse_kl_advantages(teacher_logps: torch.Tensor, behaviour_logps: torch.Tensor,
                          mask: torch.Tensor) -> torch.Tensor:
    """Per-token advantages of on-policy distillation, eq. (1) of the module docstring:
    ``A_t = log pi_T(y_t) - log pi_old(y_t)`` on loss tokens, 0 elsewhere.

    Args:
        teacher_logps: [N, L] the teacher's logprobs of the sampled tokens (completion frame).
        behaviour_logps: [N, L] the sampling policy's logprobs of the same tokens.
        mask: [N, L] loss mask (nonzero: a token the student sampled).
    Returns:
        [N, L] float32 advantages; exactly 0 off the mask (even where an input is NaN or inf).
    Raises:
        ValueError: the shapes differ or are not [N, L].
    """
    _check_bt(teacher_logps=teacher_logps, behaviour_logps=behaviour_logps, mask=mask)
    adv = teacher_logps.float() - behaviour_logps.float()
    return torch.where(mask != 0, adv, torch.zeros_like(adv))


def mix_advantages(distill: torch.Tensor, reward: torch.Tensor, mask: torch.Tensor, *,
                   distill_coef: float, reward_coef: float) -> torch.Tensor:
    """``distill_coef * distill + reward_coef * reward`` per token, 0 off the mask.

    Args:
        distill: [N, L] distillation advantages (:func:`reverse_kl_advantages`).
        reward: [N] sequence advantages of the task reward (GRPO, RLOO), broadcast over each
            completion's tokens, or [N, L] token advantages.
        mask: [N, L] loss mask.
        distill_coef, reward_coef: the weights (``algorithm.distill_coef``, ``algorithm.reward_coef``), >= 0.
    Returns:
        [N, L] float32.
    Raises:
        ValueError: a negative weight or mismatched shapes.
    """
    if distill_coef < 0 or reward_coef < 0:
        raise ValueError(f"distill_coef and reward_coef must be >= 0, got {distill_coef}, {reward_coef}")
    _check_bt(distill=distill, mask=mask)
    if reward.dim() == 1:
        if reward.shape[0] != distill.shape[0]:
            raise ValueError(f"reward must be [N={distill.shape[0]}] or [N, L], got {tuple(reward.shape)}")
        reward = reward[:, None].expand_as(distill)
    _check_bt(distill=distill, reward=reward)
    # a zero weight contributes exactly nothing, even where the other term is not finite
    out = torch.zeros_like(distill, dtype=torch.float32)
    if distill_coef:
        out = out + distill_coef * distill.float()
    if reward_coef:
        out = out + reward_coef * reward.float()
    return torch.where(mask != 0, out, torch.zeros_like(out))


def _log1mexp(x: torch.Tensor) -> torch.Tensor:
    """log(1 - exp(x)) for x <= 0, accurate at both ends (Maechler 2012, "Accurately Computing
    log(1 - exp(-|a|))"); x is clamped just below 0 so a top-k holding all the mass gives a
    finite, very small log tail rather than -inf."""
    x = x.clamp(max=-1e-10)
    return torch.where(x > -math.log(2.0), torch.log(-torch.expm1(x)), torch.log1p(-torch.exp(x)))


def with_tail(topk_logps: torch.Tensor) -> torch.Tensor:
    """The k logprobs of the teacher's top-k tokens plus the log-mass of every other token.

    Args:
        topk_logps: [..., k] full-vocabulary logprobs of k distinct tokens.
    Returns:
        [..., k + 1] log-probabilities of a distribution over the k tokens and "the rest".
    """
    lp = topk_logps.float()
    return torch.cat([lp, _log1mexp(torch.logsumexp(lp, dim=-1, keepdim=True))], dim=-1)


def topk_generalized_jsd(student_logps: torch.Tensor, teacher_logps: torch.Tensor, beta: float) -> torch.Tensor:
    """The generalised JSD per position, over the teacher's top-k tokens and one class for the rest,
    interpolating from the forward KL (beta = 0) to the reverse KL (beta = 1).

    With S and T the student's and teacher's distributions over the k + 1 classes
    (:func:`with_tail`) and the mixture M = beta * T + (1 - beta) * S:

        beta = 0:       KL(T || S)                                  (forward KL, supervised KD)
        beta = 1:       KL(S || T)                                  (reverse KL)
        0 < beta < 1:   (1 - beta) * KL(T || M) + beta * KL(S || M)

    Why these weights: GKD's eq. 3 (Agarwal et al. 2024, arXiv:2306.13649) weights KL(T || M) by
    beta, the "coefficient-matched" form. Its limits are 0 at both ends (beta -> 1: M -> T, so
    KL(T || M) -> 0 and the other term carries a factor 1 - beta; symmetrically at beta -> 0), so
    between the ends beta scales the signal instead of choosing its direction (at beta = 0.9 about
    1/15 of beta = 1's). Attaching each weight to the other term gives the limits above: beta -> 0:
    M -> S and the value -> KL(T || S); beta -> 1: M -> T and the value -> KL(S || T), the same
    expressions as the endpoints, so the divergence is continuous in beta on [0, 1]; beta = 0.5 is
    the symmetric JSD either way. The same fix: ms-swift #10213 (issue #10078), verl-recipe #151.

    Args:
        student_logps: [..., k] the student's full-vocabulary logprobs of the teacher's top-k
            tokens at each position (differentiable).
        teacher_logps: [..., k] the teacher's logprobs of the same tokens.
        beta: in [0, 1] (``algorithm.distill_beta``).
    Returns:
        [...] float32 divergence per position, >= 0 up to rounding.
    Raises:
        ValueError: beta outside [0, 1] or shapes that differ.
    """
    if not 0.0 <= beta <= 1.0:
        raise ValueError(f"beta must be in [0, 1], got {beta}")
    if student_logps.shape != teacher_logps.shape:
        raise ValueError(f"student_logps {tuple(student_logps.shape)} and teacher_logps "
                         f"{tuple(teacher_logps.shape)} must have the same shape [..., k]")
    s, t = with_tail(student_logps), with_tail(teacher_logps.detach())

    def kl(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:  # KL(P || Q) from log-probabilities
        return (p.exp() * (p - q)).sum(-1)

    if beta == 0.0:
        return kl(t, s)
    if beta == 1.0:
        return kl(s, t)
    m = torch.logsumexp(torch.stack([t + math.log(beta), s + math.log(1.0 - beta)]), dim=0)
    return (1.0 - beta) * kl(t, m) + beta * kl(s, m)
