"""Scoring a step's episodes: reward functions (through the runner) and reward models,
combined into each episode's ``reward`` and ``reward_parts``."""

from __future__ import annotations

from typing import Any, Sequence

from plainrl.rewards.forms import EPISODE_COLUMNS, episode_columns
from plainrl.rewards.loading import RewardFn
from plainrl.rewards.model import RewardModel
from plainrl.rewards.runner import RewardError, score, weighted_total
from plainrl.rollout.envs.base import EnvError
from plainrl.types import Episode, RewardOutput, SampleError


def score_episodes(episodes: list[Episode], fns: list[RewardFn], *, models: Sequence[RewardModel] = (),
                   fail_fast: bool = False, combine: Any = None, **runner_kwargs) -> RewardOutput:
    """Score episodes with the reward functions and reward models; store the totals and
    parts on them.

    An episode whose environment failed (``Episode.env.error``) is unscorable: nothing
    scores it (its parts are None) and its error joins the output's ``errors``. Reward
    functions get :meth:`Episode.columns` as keyword arguments, plus the episode columns
    they name as parameters (:data:`plainrl.rewards.forms.EPISODE_COLUMNS`: ``messages``,
    the episode as chat messages; ``prompt``; ``completion_tokens``, the policy's tokens).

    Args:
        models: reward models (``rewards: [{model: ...}]``), run in this process on
            ``prompt_ids + completion_ids``; a non-finite score makes the sample unscorable.
        fail_fast: raise at the first failed environment, reward call or reward model score.
        combine: a :class:`plainrl.rewards.RewardCombine` (``reward_combine``) computing the
            totals from every part (functions and models) instead of the weighted sum;
            episodes whose environment failed stay None.
        runner_kwargs: passed to :func:`plainrl.rewards.runner.score` (``timeout_s``, ``workers``, ``pool``).
    Raises:
        EnvError: ``fail_fast`` and an episode's environment failed (checked first).
        RewardError: ``fail_fast`` and a reward call or a reward model score failed; a
            batched function or ``combine`` broke its contract (wrong length, NaN).
    """
    failed = [e for e in episodes if e.env is not None and e.env.error is not None]
    errors = [SampleError(e.sample_id, "environment", e.env.error) for e in failed]
    if fail_fast and errors:
        raise EnvError(str(errors[0]))
    ok = [e for e in episodes if e.env is None or e.env.error is None]
    wanted = {c for f in [*fns, combine] if f is not None and f.params is not None
              for c in f.params if c in EPISODE_COLUMNS}
    rows = [episode_columns(e.columns(), e.completion_text, wanted=wanted, transcript=e.messages,
                            completion_tokens=sum(e.loss_mask) if e.loss_mask else len(e.completion_ids))
            if wanted else e.columns() for e in ok]
    scored = score(fns, [e.completion_text for e in ok], rows, [e.sample_id for e in ok],
                   fail_fast=fail_fast, **runner_kwargs)
    parts, weights = dict(scored.parts), {f.name: f.weight for f in fns}
    for m in models:
        parts[m.name] = m.score(ok)
        weights[m.name] = m.weight
        for e, v in zip(ok, parts[m.name]):
            if v is None:
                err = SampleError(e.sample_id, f"reward model {m.name!r}", "the score is not finite")
                if fail_fast:
                    raise RewardError(str(err))
                errors.append(err)
    where = {id(e): i for i, e in enumerate(ok)}
    full = {name: [vals[where[id(e)]] if id(e) in where else None for e in episodes] for name, vals in parts.items()}
    if combine is not None:
        ok_total = combine({name: list(vals) for name, vals in parts.items()}, rows) if ok else []
        total = [ok_total[where[id(e)]] if id(e) in where else None for e in episodes]
    else:
        total = [t if id(e) in where else None
                 for t, e in zip(weighted_total(full, weights, len(episodes)), episodes)]
    out = RewardOutput(total=total, parts=full, errors=scored.errors + errors)
    for i, e in enumerate(episodes):
        e.reward = out.total[i]
        e.reward_parts = {name: vals[i] for name, vals in full.items()}
    return out
