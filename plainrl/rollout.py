"""Rollout: prompts -> engine -> :class:`Episode` records (token-exact) -> rewards."""

from __future__ import annotations

import torch

from plainrl.config import RolloutConfig
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


def rollout(
    engine: Engine,
    prompts: list[PromptRow],
    params: SamplingParams,
    tokenizer,
    *,
    group_size: int,
    step: int,
    generator: torch.Generator | None = None,
) -> list[Episode]:
    """Sample ``group_size`` completions for each prompt.

    Returns:
        len(prompts) * group_size episodes, the samples of one prompt contiguous.
        ``completion_text`` is decoded for reward functions and logs only; training
        uses ``completion_ids`` exactly as sampled.
    """
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
        e.reward = out.total[i]
        e.reward_parts = {name: vals[i] for name, vals in out.parts.items()}
    return out
