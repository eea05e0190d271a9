"""From scored episodes to advantages, per ``algorithm.advantage``: the glue between
one step's tensors and the pure functions of :mod:`plainrl.algorithms`.

Sequence-level estimators (grpo, rloo) give one advantage per episode, [N];
token-level ones (reinforce_pp, gae) one per completion token, [N, L] in the
completion frame of :mod:`plainrl.frames`. The learner takes both.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, NamedTuple

import torch

from plainrl.algorithms.advantages import (
    gae,
    grpo_advantages,
    kl_penalized_rewards,
    reinforce_pp_advantages,
    rloo_advantages,
    token_rewards,
    whiten_advantages,
)
from plainrl.algorithms.distill import mix_advantages, reverse_kl_advantages
from plainrl.algorithms.kl import KLEstimator, kl_estimate
from plainrl.algorithms.segments import episode_weighted_advantages
from plainrl.frames import CompletionFrame
from plainrl.samples import sample_groups
from plainrl.types import Episode


@dataclass(frozen=True)
class AdvantageParams:
    """The scalars the estimators read (from ``algorithm`` and ``rollout``, at setup).

    estimator:  ``algorithm.advantage`` (a key of :data:`ADVANTAGE_ESTIMATORS`).
    group_size: samples per prompt (``rollout.group_size``; grpo, rloo).
    norm_std:   divide GRPO's group-centred rewards by the group std (``Config.norm_std``).
    gamma, lam: discount and GAE lambda (reinforce_pp, gae).
    kl_coef:    the weight of the KL in the reward (``algorithm.kl_reward_coef``, or ``kl_coef``
                under ``kl_placement: reward``: ``AlgorithmConfig.reward_kl``).
    whiten:     ``algorithm.whiten_advantages`` (batch whitening, PPO).
    """

    estimator: str
    group_size: int
    norm_std: bool = True
    gamma: float = 1.0
    lam: float = 1.0
    kl_coef: float = 0.0
    whiten: bool = False


@dataclass
class EstimatorInputs:
    """What an advantage estimator may use (N episodes, L the longest completion).

    rewards: [N] sequence rewards, NaN where unscorable.
    valid:   [N] bool, False where unscorable.
    mask:    [N, L] loss mask.
    kl:      [N, L] per-token KL of the rollout policy to the reference, when it goes
             into the reward (``algorithm.kl_reward_coef`` or ``kl_placement: reward``); else None.
    values:  [N, L] critic values (gae); else None.
    groups:  ``(group [N], episode [N])`` ids when some episode gave several samples (agent
             segments, :func:`plainrl.samples.sample_groups`): grpo and rloo then count each
             episode once in its group; None: contiguous groups of ``group_size`` samples.
    """

    rewards: torch.Tensor
    valid: torch.Tensor
    mask: torch.Tensor
    kl: torch.Tensor | None = None
    values: torch.Tensor | None = None
    groups: tuple[torch.Tensor, torch.Tensor] | None = None


def _sequence_rewards(x: EstimatorInputs, p: AdvantageParams) -> torch.Tensor:
    # a sequence-level estimator takes the KL in the reward as its sum over the sequence
    return x.rewards if x.kl is None else kl_penalized_rewards(x.rewards, x.mask, x.kl, p.kl_coef)


def _token_rewards(x: EstimatorInputs, p: AdvantageParams) -> torch.Tensor:
    return token_rewards(x.rewards, x.mask, kl=x.kl, kl_coef=p.kl_coef, valid=x.valid)


def _grpo(x: EstimatorInputs, p: AdvantageParams) -> torch.Tensor:
    if x.groups is not None:
        return episode_weighted_advantages(_sequence_rewards(x, p), *x.groups, estimator="grpo",
                                           norm_std=p.norm_std, valid=x.valid)
    return grpo_advantages(_sequence_rewards(x, p), p.group_size, norm_std=p.norm_std, valid=x.valid)


def _rloo(x: EstimatorInputs, p: AdvantageParams) -> torch.Tensor:
    if x.groups is not None:
        return episode_weighted_advantages(_sequence_rewards(x, p), *x.groups, estimator="rloo", valid=x.valid)
    return rloo_advantages(_sequence_rewards(x, p), p.group_size, valid=x.valid)


def _reinforce_pp(x: EstimatorInputs, p: AdvantageParams) -> torch.Tensor:
    # unscorable rows leave the batch statistics (and get advantage 0)
    return reinforce_pp_advantages(_token_rewards(x, p), x.mask * x.valid[:, None], gamma=p.gamma)


def _gae(x: EstimatorInputs, p: AdvantageParams) -> torch.Tensor:
    if x.values is None:
        raise ValueError("algorithm.advantage=gae needs critic values")
    advantages, _returns = gae(_token_rewards(x, p), x.values, x.mask * x.valid[:, None], gamma=p.gamma, lam=p.lam)
    return advantages


# algorithm.advantage -> estimator; the keys are exactly config.AdvantageEstimator
ADVANTAGE_ESTIMATORS: dict[str, Callable[[EstimatorInputs, AdvantageParams], torch.Tensor]] = {
    "grpo": _grpo,
    "rloo": _rloo,
    "reinforce_pp": _reinforce_pp,
    "gae": _gae,
}


def reward_kl(frame: CompletionFrame, ref_logps: torch.Tensor, estimator: KLEstimator) -> torch.Tensor:
    """Per-token KL of the rollout policy (the engine's logprobs) to the reference.

    Args:
        frame: the step's loss mask and engine logprobs, [N, L] each.
        ref_logps: [N, L] reference logprobs of the loss tokens (completion frame).
        estimator: ``algorithm.kl_reward_estimator`` (or ``kl_estimator`` under ``kl_placement: reward``;
            k1, k2, k3: :func:`plainrl.algorithms.kl_estimate`).
    Returns:
        [N, L] float32, 0 off the loss mask.
    """
    kl = kl_estimate(frame.logprobs, ref_logps, estimator)
    return torch.where(frame.mask > 0, kl, torch.zeros_like(kl))


class Advantages(NamedTuple):
    """What :func:`compute_advantages` gives the learner and the critic.

    advantages: [N] (grpo, rloo) or [N, L] (reinforce_pp, gae), detached; whitened
                when ``algorithm.whiten_advantages``.
    returns:    [N, L] the critic's targets, GAE's lambda-returns ``A + V`` computed
                before any whitening; None without a critic.
    """

    advantages: torch.Tensor
    returns: torch.Tensor | None


def compute_advantages(
    episodes: list[Episode],
    mask: torch.Tensor,
    params: AdvantageParams,
    *,
    kl: torch.Tensor | None = None,
    values: torch.Tensor | None = None,
) -> Advantages:
    """Advantages by ``params.estimator`` (:data:`ADVANTAGE_ESTIMATORS`); unscorable
    episodes (reward None) get exactly 0. Sets each ``Episode.advantage`` (for logs:
    the mean over its loss tokens for token-level estimators).

    Samples cut from one agent episode (:func:`plainrl.samples.training_samples`) are
    grouped with their episode's group, each episode counting once in grpo's and rloo's
    group statistics (:func:`plainrl.algorithms.segments.episode_weighted_advantages`);
    reinforce_pp and gae treat every sample as a sequence of its own, its reward on its
    last loss token.

    Args:
        episodes: N scored episodes (or training samples), each prompt's group contiguous.
        mask: [N, L] their loss masks (:class:`plainrl.frames.CompletionFrame`).
        params: the estimator and its scalars.
        kl: [N, L] :func:`reward_kl`, when the KL goes into the reward.
        values: [N, L] critic values, for gae.
    Returns:
        :class:`Advantages`.
    Raises:
        ValueError: gae without ``values``.
    """
    valid = torch.tensor([e.reward is not None for e in episodes])
    rewards = torch.tensor([e.reward if e.reward is not None else float("nan") for e in episodes])
    x = EstimatorInputs(rewards, valid, mask, kl, values, groups=sample_groups(episodes))
    adv = ADVANTAGE_ESTIMATORS[params.estimator](x, params)
    returns = None
    if values is not None and adv.dim() == 2:
        returns = torch.where(x.mask.bool(), adv + values, torch.zeros_like(adv))
    if params.whiten:
        # unscorable rows stay out of the statistics and at exactly 0
        m = x.mask * valid[:, None] if adv.dim() == 2 else valid
        adv = whiten_advantages(adv, m)
    _record(episodes, adv, x.mask)
    return Advantages(adv, returns)


def with_teacher(adv: Advantages, episodes: list[Episode], frame: CompletionFrame, teacher_logps: torch.Tensor, *,
                 distill_loss: str, distill_coef: float, reward_coef: float) -> Advantages:
    """The step's advantages with a distillation teacher (:mod:`plainrl.algorithms.distill`):
    under ``reverse_kl``, ``distill_coef * (log pi_T - log pi_old) + reward_coef * A^reward``
    per token; under ``gkd_topk`` (the teacher enters the loss instead), ``reward_coef * A^reward``.
    Updates each ``Episode.advantage`` (the mean over its loss tokens).

    Args:
        adv: the task reward's advantages (:func:`compute_advantages`), [N] or [N, L].
        frame: the step's loss mask and engine (behaviour) logprobs, [N, L] each.
        teacher_logps: [N, L] the teacher's logprobs of the sampled tokens.
    Returns:
        :class:`Advantages` with [N, L] advantages (reverse_kl) or the scaled reward ones (gkd_topk).
    """
    if distill_loss == "gkd_topk":
        out = adv.advantages * reward_coef
    else:
        out = mix_advantages(reverse_kl_advantages(teacher_logps, frame.logprobs, frame.mask), adv.advantages,
                             frame.mask, distill_coef=distill_coef, reward_coef=reward_coef)
    _record(episodes, out, frame.mask)
    return Advantages(out, adv.returns)


def _record(episodes: list[Episode], adv: torch.Tensor, mask: torch.Tensor) -> None:
    """``Episode.advantage`` for the logs: the sequence advantage, or the mean over the loss tokens."""
    per_episode = adv if adv.dim() == 1 else (adv * mask).sum(1) / mask.sum(1).clamp(min=1)
    for e, value in zip(episodes, per_episode.tolist()):
        e.advantage = value
