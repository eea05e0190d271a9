"""From scored episodes to advantages, per ``algorithm.advantage``: the glue between
the config and the pure functions of :mod:`plainrl.algorithms`.

Sequence-level estimators (grpo, rloo) give one advantage per episode, [N];
token-level ones (reinforce_pp, gae) one per completion token, [N, L] in the
completion frame of :func:`plainrl.learner.completion_tensor`. The learner takes both.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, NamedTuple

import torch

from plainrl.algorithms import (
    gae,
    grpo_advantages,
    kl_estimate,
    reinforce_pp_advantages,
    rloo_advantages,
    token_rewards,
    whiten_advantages,
)
from plainrl.config import AlgorithmConfig, Config
from plainrl.learner import completion_tensor
from plainrl.types import Episode


@dataclass
class EstimatorInputs:
    """What an advantage estimator may use (N episodes, L the longest completion).

    rewards: [N] sequence rewards, NaN where unscorable.
    valid:   [N] bool, False where unscorable.
    mask:    [N, L] loss mask.
    kl:      [N, L] per-token KL of the rollout policy to the reference, when it goes
             into the reward (``algorithm.kl_placement: reward``); else None.
    values:  [N, L] critic values (gae); else None.
    """

    rewards: torch.Tensor
    valid: torch.Tensor
    mask: torch.Tensor
    kl: torch.Tensor | None = None
    values: torch.Tensor | None = None


def _sequence_rewards(x: EstimatorInputs, a: AlgorithmConfig) -> torch.Tensor:
    # a sequence-level estimator takes the KL in the reward as its sum over the sequence
    if x.kl is None:
        return x.rewards
    return x.rewards - a.kl_coef * (x.kl * x.mask).sum(dim=1)


def _token_rewards(x: EstimatorInputs, a: AlgorithmConfig) -> torch.Tensor:
    return token_rewards(x.rewards, x.mask, kl=x.kl, kl_coef=a.kl_coef, valid=x.valid)


def _grpo(x: EstimatorInputs, cfg: Config) -> torch.Tensor:
    a = cfg.algorithm
    return grpo_advantages(_sequence_rewards(x, a), cfg.rollout.group_size, norm_std=a.norm_std, valid=x.valid)


def _rloo(x: EstimatorInputs, cfg: Config) -> torch.Tensor:
    return rloo_advantages(_sequence_rewards(x, cfg.algorithm), cfg.rollout.group_size, valid=x.valid)


def _reinforce_pp(x: EstimatorInputs, cfg: Config) -> torch.Tensor:
    a = cfg.algorithm
    # unscorable rows leave the batch statistics (and get advantage 0)
    return reinforce_pp_advantages(_token_rewards(x, a), x.mask * x.valid[:, None], gamma=a.gamma)


def _gae(x: EstimatorInputs, cfg: Config) -> torch.Tensor:
    a = cfg.algorithm
    if x.values is None:
        raise ValueError("algorithm.advantage=gae needs critic values")
    advantages, _returns = gae(_token_rewards(x, a), x.values, x.mask * x.valid[:, None], gamma=a.gamma, lam=a.lam)
    return advantages


# algorithm.advantage -> estimator; the keys are exactly config.AdvantageEstimator
ADVANTAGE_ESTIMATORS: dict[str, Callable[[EstimatorInputs, Config], torch.Tensor]] = {
    "grpo": _grpo,
    "rloo": _rloo,
    "reinforce_pp": _reinforce_pp,
    "gae": _gae,
}


def reward_kl(episodes: list[Episode], ref_logps: torch.Tensor, cfg: Config) -> torch.Tensor:
    """Per-token KL of the rollout policy (the engine's logprobs) to the reference,
    with ``algorithm.kl_estimator``.

    Args:
        ref_logps: [N, L] reference logprobs of the loss tokens (completion frame).
    Returns:
        [N, L] float32, 0 off the loss mask.
    """
    mask = completion_tensor(episodes) > 0
    old = completion_tensor(episodes, [e.logprobs for e in episodes])
    kl = kl_estimate(old, ref_logps, cfg.algorithm.kl_estimator)
    return torch.where(mask, kl, torch.zeros_like(kl))


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
    cfg: Config,
    *,
    kl: torch.Tensor | None = None,
    values: torch.Tensor | None = None,
) -> Advantages:
    """Advantages by ``algorithm.advantage`` (:data:`ADVANTAGE_ESTIMATORS`); unscorable
    episodes (reward None) get exactly 0. Sets each ``Episode.advantage`` (for logs:
    the mean over its loss tokens for token-level estimators).

    Args:
        episodes: N scored episodes, each prompt's group contiguous.
        kl: [N, L] :func:`reward_kl`, when the KL goes into the reward.
        values: [N, L] critic values, for gae.
    Returns:
        :class:`Advantages`.
    Raises:
        ValueError: gae without ``values``.
    """
    valid = torch.tensor([e.reward is not None for e in episodes])
    rewards = torch.tensor([e.reward if e.reward is not None else float("nan") for e in episodes])
    x = EstimatorInputs(rewards, valid, completion_tensor(episodes), kl, values)
    adv = ADVANTAGE_ESTIMATORS[cfg.algorithm.advantage](x, cfg)
    returns = None
    if values is not None and adv.dim() == 2:
        returns = torch.where(x.mask.bool(), adv + values, torch.zeros_like(adv))
    if cfg.algorithm.whiten_advantages:
        # unscorable rows stay out of the statistics and at exactly 0
        m = x.mask * valid[:, None] if adv.dim() == 2 else valid
        adv = whiten_advantages(adv, m)
    per_episode = adv if adv.dim() == 1 else (adv * x.mask).sum(1) / x.mask.sum(1).clamp(min=1)
    for e, value in zip(episodes, per_episode.tolist()):
        e.advantage = value
    return Advantages(adv, returns)
