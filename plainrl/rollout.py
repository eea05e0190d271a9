"""Rollout: prompts -> engine -> :class:`Episode` records (token-exact) -> rewards;
DAPO's dynamic sampling and overlong reward shaping."""

from __future__ import annotations

from typing import Callable, Sequence

import torch

from plainrl.algorithms import informative_groups, overlong_penalty
from plainrl.config import AlgorithmConfig, Config, RolloutConfig
from plainrl.data import PromptRow
from plainrl.engines.base import Engine
from plainrl.envs.base import EnvError
from plainrl.rewards import RewardError, RewardFn, score
from plainrl.rewards.model import RewardModel
from plainrl.rewards.runner import weighted_total
from plainrl.types import Episode, RewardOutput, SampleError, SamplingParams


def sampling_params(cfg: RolloutConfig, **overrides) -> SamplingParams:
    """The engine's sampling settings from the ``rollout`` config section."""
    base = dict(
        max_new_tokens=cfg.max_new_tokens, temperature=cfg.temperature,
        top_p=cfg.top_p, top_k=cfg.top_k, stop=tuple(cfg.stop),
    )
    return SamplingParams(**{**base, **overrides})


def make_env_factory(cfg: RolloutConfig):
    """``rollout.env`` -> a zero-argument factory of environments, or None (single turn).

    With ``rollout.env_timeout_s`` set (the default) the factory is an
    :class:`~plainrl.envs.EnvWorkers` (each episode's environment in a worker process,
    every call time-limited; call its ``close()`` when done); no worker starts here.

    Raises:
        RewardLoadError: a ``module:fn`` reference that cannot be loaded (before any model
            loads; the config already refused names that are neither built-in nor references).
    """
    if cfg.env is None:
        return None
    from plainrl.envs import CalculatorEnv, EnvWorkers, PythonToolEnv

    builtins = {"calculator": CalculatorEnv, "python": lambda: PythonToolEnv(timeout_s=cfg.tool_timeout_s)}
    if cfg.env in builtins:
        factory = builtins[cfg.env]
    else:
        from plainrl.rewards.loading import load_reward_fn

        factory = load_reward_fn(cfg.env, what="rollout.env")
    return factory if cfg.env_timeout_s is None else EnvWorkers(factory, timeout_s=cfg.env_timeout_s)


def max_live_episodes(cfg: Config) -> int | None:
    """Multi-turn episodes in flight at once: a step's worth, at most ``rollout.env_workers``
    when environments run in worker processes (one each); None (all) otherwise."""
    if cfg.rollout.env_timeout_s is None:
        return None
    return min(cfg.rollout.prompts_per_step * cfg.rollout.group_size, cfg.rollout.env_workers)


def rollout(
    engine: Engine,
    prompts: list[PromptRow],
    params: SamplingParams,
    tokenizer,
    *,
    cfg: Config,
    step: int,
    env_factory=None,
    generator: torch.Generator | None = None,
) -> list[Episode]:
    """Sample ``rollout.group_size`` completions for each prompt, single-turn or, with an
    environment factory, multi-turn (:func:`plainrl.envs.multi_turn_rollout`).

    Returns:
        len(prompts) * group_size episodes, the samples of one prompt contiguous.
        ``completion_text`` is decoded for reward functions and logs only; training
        uses ``completion_ids`` exactly as sampled. An episode whose environment raised
        is unscorable (``reward`` stays None after scoring).
    """
    group_size = cfg.rollout.group_size
    if env_factory is not None:
        from plainrl.envs import multi_turn_rollout

        return multi_turn_rollout(
            engine, prompts, env_factory, params, tokenizer, group_size=group_size, step=step,
            max_turns=cfg.rollout.max_turns, max_total_tokens=cfg.rollout.completion_budget, generator=generator,
            system_prompt=cfg.data.system_prompt, prompt_template=cfg.data.prompt_template,
            max_live=max_live_episodes(cfg),
        )
    flat = [p for p in prompts for _ in range(group_size)]
    gens = engine.generate([p.prompt_ids for p in flat], params, generator=generator)
    episodes = []
    for i, (p, g) in enumerate(zip(flat, gens)):
        episodes.append(
            Episode(
                sample_id=f"s{step}-r{p.source_index}-{i % group_size}",
                group=i // group_size,
                row=p.row,
                prompt_ids=p.prompt_ids,
                completion_ids=g.token_ids,
                logprobs=g.logprobs,
                loss_mask=[1] * len(g.token_ids),
                finish_reason=g.finish_reason,
                completion_text=tokenizer.decode(g.token_ids, skip_special_tokens=True),
            )
        )
    return episodes


def score_episodes(episodes: list[Episode], fns: list[RewardFn], *, models: Sequence[RewardModel] = (),
                   fail_fast: bool = False, **runner_kwargs) -> RewardOutput:
    """Score episodes with the reward functions and reward models; store the totals and
    parts on them.

    An episode whose environment failed (``row["env_error"]``) is unscorable: nothing
    scores it (its parts are None) and its error joins the output's ``errors``.

    Args:
        models: reward models (``rewards: [{model: ...}]``), run in this process on
            ``prompt_ids + completion_ids``; a non-finite score makes the sample unscorable.
        fail_fast: raise at the first failed environment, reward call or reward model score.
        runner_kwargs: passed to :func:`plainrl.rewards.score` (``timeout_s``, ``workers``, ``pool``).
    Raises:
        EnvError: ``fail_fast`` and an episode's environment failed (checked first).
        RewardError: ``fail_fast`` and a reward call or a reward model score failed.
    """
    errors = [SampleError(e.sample_id, "environment", e.row["env_error"])
              for e in episodes if e.row.get("env_error") is not None]
    if fail_fast and errors:
        raise EnvError(str(errors[0]))
    ok = [e for e in episodes if e.row.get("env_error") is None]
    scored = score(fns, [e.completion_text for e in ok], [e.row for e in ok], [e.sample_id for e in ok],
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
    total = [t if id(e) in where else None for t, e in zip(weighted_total(full, weights, len(episodes)), episodes)]
    out = RewardOutput(total=total, parts=full, errors=scored.errors + errors)
    for i, e in enumerate(episodes):
        e.reward = out.total[i]
        e.reward_parts = {name: vals[i] for name, vals in full.items()}
    return out


def dynamic_sampling(
    draw: Callable[[], list[Episode]],
    fns: list[RewardFn],
    *,
    group_size: int,
    num_groups: int,
    max_tries: int,
    **runner_kwargs,
) -> tuple[list[Episode], RewardOutput, dict[str, float]]:
    """DAPO's dynamic sampling: keep only groups whose rewards are not all equal
    (they alone have non-zero group-relative advantages), drawing and scoring more
    rollout batches until ``num_groups`` are kept or ``max_tries`` batches were drawn.

    Groups are kept whole and in the order drawn, renumbered from 0; extra kept groups
    beyond ``num_groups`` are dropped. When every group of every try was filtered, the
    last batch is returned as it is (all its advantages are 0, so the step trains on
    nothing rather than failing); with fewer than ``num_groups`` kept, the step trains
    on what was kept.

    Args:
        draw: () -> the next batch of episodes (``group_size`` per prompt, contiguous).
        fns: the reward functions.
        group_size, num_groups: the batch the step wants (``rollout.group_size``,
            ``rollout.prompts_per_step``).
        max_tries: the most batches to draw (``algorithm.dynamic_sampling_tries``).
        runner_kwargs: passed to :func:`score_episodes` (``timeout_s``, ``fail_fast``).
    Returns:
        ``(episodes, rewards of every episode drawn, metrics)``; metrics:
        ``sampling/tries``, ``sampling/filtered_frac`` (groups dropped / groups drawn),
        ``sampling/kept_groups``.

    Source: Yu et al. 2025 (DAPO, arXiv:2503.14476) Sec. 3.2, eq. 11 and Algorithm 1.
    """
    kept: list[list[Episode]] = []
    outs: list[RewardOutput] = []
    drawn = tries = 0
    batch: list[Episode] = []
    while len(kept) < num_groups and tries < max_tries:
        batch = draw()
        tries += 1
        outs.append(score_episodes(batch, fns, **runner_kwargs))
        valid = torch.tensor([e.reward is not None for e in batch])
        rewards = torch.tensor([e.reward if e.reward is not None else float("nan") for e in batch])
        groups = [batch[i : i + group_size] for i in range(0, len(batch), group_size)]
        drawn += len(groups)
        kept.extend(g for g, ok in zip(groups, informative_groups(rewards, group_size, valid=valid).tolist()) if ok)
    metrics = {"sampling/tries": float(tries), "sampling/filtered_frac": 1.0 - len(kept) / max(1, drawn),
               "sampling/kept_groups": float(min(len(kept), num_groups))}
    episodes = [e for g in kept[:num_groups] for e in g] or batch
    for i, e in enumerate(episodes):
        e.group = i // group_size
    every = RewardOutput(total=[t for o in outs for t in o.total],
                         parts={k: [v for o in outs for v in o.parts[k]] for k in outs[0].parts},
                         errors=[m for o in outs for m in o.errors])
    return episodes, every, metrics


def shape_overlong(episodes: list[Episode], cfg: AlgorithmConfig, budget: int) -> dict[str, float]:
    """DAPO's overlong reward shaping, in place: add the soft overlong punishment
    (:func:`plainrl.algorithms.overlong_penalty`, L_max = ``budget``, L_cache =
    ``algorithm.overlong_buffer`` x budget) to each scorable episode's reward and record
    it as ``reward_parts["overlong"]``; with ``algorithm.overlong_filter``, give
    truncated episodes (finish reason ``length``) an all-zero loss mask, so they stay
    in their group's statistics but out of the loss.

    Args:
        budget: the completion budget in tokens (``rollout.completion_budget``).
    Returns:
        ``reward/overlong_penalty`` (mean over scorable episodes) and/or
        ``response_length/filtered_frac``; {} when both are off.

    Source: Yu et al. 2025 (DAPO, arXiv:2503.14476) Sec. 3.4 (overlong filtering; soft
    overlong punishment, eq. 13).
    """
    metrics: dict[str, float] = {}
    if cfg.overlong_buffer is not None:
        cache = max(1, round(cfg.overlong_buffer * budget))
        lengths = torch.tensor([len(e.completion_ids) for e in episodes])
        penalties = overlong_penalty(lengths, budget, cache, factor=cfg.overlong_penalty).tolist()
        scored = [(e, p) for e, p in zip(episodes, penalties) if e.reward is not None]
        for e, p in scored:
            e.reward += p
            e.reward_parts["overlong"] = p
        metrics["reward/overlong_penalty"] = sum(p for _, p in scored) / max(1, len(scored))
    if cfg.overlong_filter:
        truncated = [e for e in episodes if e.finish_reason == "length"]
        for e in truncated:
            e.loss_mask = [0] * len(e.loss_mask)
        metrics["response_length/filtered_frac"] = len(truncated) / max(1, len(episodes))
    return metrics
