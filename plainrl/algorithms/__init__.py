"""The algorithm math as pure tensor functions (advantages, KL estimators, losses).

See docs/algorithms.md for the formulas, knobs and sources.
"""

from plainrl.algorithms.advantages import gae, grpo_advantages, reinforce_pp_advantages, rloo_advantages
from plainrl.algorithms.kl import LOG_RATIO_CLAMP, KLEstimator, kl_estimate
from plainrl.algorithms.losses import (
    LossAgg,
    RatioLevel,
    aggregate_loss,
    entropy_from_logits,
    policy_loss,
    value_loss,
)

__all__ = [
    "LOG_RATIO_CLAMP",
    "KLEstimator",
    "LossAgg",
    "RatioLevel",
    "aggregate_loss",
    "entropy_from_logits",
    "gae",
    "grpo_advantages",
    "kl_estimate",
    "policy_loss",
    "reinforce_pp_advantages",
    "rloo_advantages",
    "value_loss",
]
