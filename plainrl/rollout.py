"""Rollout: prompts -> engine -> :class:`Episode` records (token-exact) -> rewards."""

from __future__ import annotations

import torch

from plainrl.config import Config, RolloutConfig
from plainrl.data import PromptRow
from plainrl.engines.base import Engine
from plainrl.rewards import RewardFn, score
from plainrl.types import Episode, RewardOutput, SamplingParams


def sampling_params(cfg: RolloutConfig, **overrides) -> SamplingParams:
    """The engine's sampling settings from the ``rollout`` config section."""
    base = dict(
        max_new_tokens=cfg.max_new_tokens, temperature=cfg.temperature,
        top_p=cfg.top_p, top_k=cfg.top_k, stop=tuple(cfg.stop),
    )
    return SamplingParams(**{**base, **overrides})


def make_env_factory(cfg: RolloutConfig):
    """``rollout.env`` -> a zero-argument factory of environments, or None (single turn).

    Raises:
        ValueError: an unknown name or a reference that cannot be loaded (before any model loads).
    """
    if cfg.env is None:
        return None
    from plainrl.envs import CalculatorEnv, PythonToolEnv

    builtins = {"calculator": CalculatorEnv, "python": lambda: PythonToolEnv(timeout_s=cfg.tool_timeout_s)}
    if cfg.env in builtins:
        return builtins[cfg.env]
    if ":" not in cfg.env:
        raise ValueError(
            f"rollout.env={cfg.env!r}: use a built-in ({', '.join(builtins)}) or a factory 'module:fn' / 'file.py:fn'"
        )
    from plainrl.rewards.loading import load_reward_fn

    return load_reward_fn(cfg.env)


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


def score_episodes(episodes: list[Episode], fns: list[RewardFn], **runner_kwargs) -> RewardOutput:
    """Score episodes with the reward functions and store the totals and parts on them."""
    out = score(
        fns, [e.completion_text for e in episodes], [e.row for e in episodes],
        [e.sample_id for e in episodes], **runner_kwargs,
    )
    for i, e in enumerate(episodes):
        # an environment that raised leaves the episode unscorable whatever the functions say
        e.reward = None if e.row.get("env_error") is not None else out.total[i]
        e.reward_parts = {name: vals[i] for name, vals in out.parts.items()}
    return out
