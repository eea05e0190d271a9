"""Reward functions: loading user references, built-ins, and the scoring runner.

    from plainrl.rewards import build_reward_fns, score, reward_metrics
    fns = build_reward_fns(cfg.rewards)              # during config validation
    out = score(fns, completions, rows, sample_ids)  # each step
    logger.log(reward_metrics(out, [f.name for f in fns]))
"""

from plainrl.rewards.builtins import (
    correctness,
    extract_final_answer,
    format_reward,
    last_number_correct,
    numeric_closeness,
    tool_success,
)
from plainrl.rewards.loading import RewardFn, RewardLoadError, build_reward_fns, load_reward_fn
from plainrl.rewards.runner import RewardError, RewardWorkers, reward_metrics, score
from plainrl.rewards.episodes import score_episodes

__all__ = [
    "RewardError",
    "RewardWorkers",
    "RewardFn",
    "RewardLoadError",
    "build_reward_fns",
    "correctness",
    "extract_final_answer",
    "format_reward",
    "last_number_correct",
    "load_reward_fn",
    "numeric_closeness",
    "reward_metrics",
    "score",
    "score_episodes",
    "tool_success",
]
