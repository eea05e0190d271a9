"""The algorithm math as pure tensor functions (advantages, KL estimators, losses,
reward shaping, preference losses).

See docs/algorithms.md for the formulas, knobs and sources.
"""

from plainrl.algorithms.advantages import (
    gae,
    grpo_advantages,
    informative_groups,
    kl_penalized_rewards,
    reinforce_pp_advantages,
    rloo_advantages,
    token_rewards,
    whiten_advantages,
)
from plainrl.algorithms.kl import LOG_RATIO_CLAMP, KLEstimator, kl_estimate
from plainrl.algorithms.losses import (
    LossAgg,
    RatioLevel,
    aggregate_loss,
    entropy_from_logits,
    policy_loss,
    truncated_is_weights,
    value_loss,
)
from plainrl.algorithms.segments import episode_weighted_advantages, informative_episode_groups
from plainrl.algorithms.preference import bradley_terry_loss, dpo_loss
from plainrl.algorithms.shaping import overlong_penalty

__all__ = [
    "LOG_RATIO_CLAMP",
    "KLEstimator",
    "LossAgg",
    "RatioLevel",
    "aggregate_loss",
    "bradley_terry_loss",
    "dpo_loss",
    "entropy_from_logits",
    "episode_weighted_advantages",
    "gae",
    "grpo_advantages",
    "informative_episode_groups",
    "informative_groups",
    "kl_estimate",
    "kl_penalized_rewards",
    "overlong_penalty",
    "policy_loss",
    "reinforce_pp_advantages",
    "rloo_advantages",
    "token_rewards",
    "truncated_is_weights",
    "value_loss",
    "whiten_advantages",
]
