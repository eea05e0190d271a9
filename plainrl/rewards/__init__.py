"""Reward functions: loading user references, built-ins, and the scoring runner.

    from plainrl.rewards import build_reward_fns, score, reward_metrics
    fns = build_reward_fns(cfg.rewards)              # during config validation
    out = score(fns, completions, rows, sample_ids)  # each step
    logger.log(reward_metrics(out, [f.name for f in fns]))

Forms (docs/rewards.md): per-sample ``fn(completion, **columns)``; ``@batched``
``fn(completions, **columns_as_lists)``; the episode columns ``messages``/``prompt``/
``completion_tokens`` by naming them; ``reward_combine`` (:func:`load_reward_combine`).
"""

from plainrl.rewards.builtins import (
    code_tests,
    correctness,
    countdown,
    exact_match,
    extract_final_answer,
    format_reward,
    last_number_correct,
    length,
    numeric_closeness,
    think_format,
    tool_success,
)
from plainrl.rewards.forms import batched, is_batched
from plainrl.rewards.loading import BUILTIN_REWARDS, RewardFn, RewardLoadError, build_reward_fns, load_reward_fn
from plainrl.rewards.runner import RewardError, RewardWorkers, reward_metrics, score
from plainrl.rewards.episodes import score_episodes
from plainrl.rewards.combine import RewardCombine, load_reward_combine

__all__ = [
    "BUILTIN_REWARDS",
    "RewardCombine",
    "RewardError",
    "RewardWorkers",
    "RewardFn",
    "RewardLoadError",
    "batched",
    "build_reward_fns",
    "code_tests",
    "correctness",
    "countdown",
    "exact_match",
    "extract_final_answer",
    "format_reward",
    "is_batched",
    "last_number_correct",
    "length",
    "load_reward_combine",
    "load_reward_fn",
    "numeric_closeness",
    "reward_metrics",
    "score",
    "score_episodes",
    "think_format",
    "tool_success",
]
