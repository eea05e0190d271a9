"""Collecting one step's scored episodes: a rollout batch, or DAPO's dynamic sampling
(batches drawn until enough groups are informative; ``data.curriculum.redraws``: only the
missing groups re-drawn), the curriculum's pass rates learnt from each scored batch; DAPO's
overlong shaping of the step's training samples."""

from __future__ import annotations

from typing import Any, Callable, Sequence

import torch

from plainrl.algorithms import informative_episode_groups, overlong_penalty
from plainrl.config import AlgorithmConfig
from plainrl.data import Sampler
from plainrl.samples import sample_rewards
from plainrl.types import Episode, RewardOutput


def dynamic_sampling(
    draw: Callable[[], list[Episode]],
    score: Callable[[list[Episode]], RewardOutput],
    *,
    group_size: int,
    num_groups: int,
    max_tries: int,
    redraw: Callable[[int], list[Episode]] | None = None,
) -> tuple[list[Episode], RewardOutput, dict[str, float]]:
    """DAPO's dynamic sampling: keep only groups whose rewards are not all equal
    (they alone have non-zero group-relative advantages), drawing and scoring more
    rollout batches until ``num_groups`` are kept or ``max_tries`` batches were drawn.
    With ``redraw`` (the curriculum's zero-signal gate, ``data.curriculum.redraws``), every
    batch after the first holds only as many prompts as groups are still missing.

    Groups are kept whole and in the order drawn, renumbered from 0; extra kept groups
    beyond ``num_groups`` are dropped. When every group of every try was filtered, the
    last batch is returned as it is (all its advantages are 0, so the step trains on
    nothing rather than failing); with fewer than ``num_groups`` kept, the step trains
    on what was kept.

    Args:
        draw: () -> the next batch of episodes (``group_size`` per prompt, contiguous).
        score: scores a batch in place (:func:`plainrl.rewards.score_episodes` with the
            run's reward functions and models).
        group_size, num_groups: the batch the step wants (``rollout.group_size``,
            ``rollout.prompts_per_step``).
        max_tries: the most batches to draw (``algorithm.dynamic_sampling_tries``).
        redraw: (groups wanted) -> a batch of that many prompts' groups; None: ``draw`` each time.
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
        batch = draw() if redraw is None or not tries else redraw(num_groups - len(kept))
        tries += 1
        outs.append(score(batch))
        groups = [batch[i : i + group_size] for i in range(0, len(batch), group_size)]
        drawn += len(groups)
        kept.extend(g for g, ok in zip(groups, _informative(batch, group_size)) if ok)
    metrics = {"sampling/tries": float(tries), "sampling/filtered_frac": 1.0 - len(kept) / max(1, drawn),
               "sampling/kept_groups": float(min(len(kept), num_groups))}
    episodes = [e for g in kept[:num_groups] for e in g] or batch
    for i, e in enumerate(episodes):
        e.group = i // group_size
    every = RewardOutput(total=[t for o in outs for t in o.total],
                         parts={k: [v for o in outs for v in o.parts[k]] for k in outs[0].parts},
                         errors=[m for o in outs for m in o.errors])
    return episodes, every, metrics


def _informative(batch: list[Episode], group_size: int) -> list[bool]:
    """Whether each group of ``group_size`` contiguous episodes has a non-zero advantage
    somewhere: judged on the rewards its training samples get (an agent's segments, each
    episode counting once: :func:`plainrl.algorithms.informative_episode_groups`)."""
    rewards, group, episode = [], [], []
    for i, e in enumerate(batch):
        for r in sample_rewards(e):
            rewards.append(float("nan") if r is None else r)
            group.append(i // group_size)
            episode.append(i)
    r = torch.tensor(rewards)
    return informative_episode_groups(r, torch.tensor(group), torch.tensor(episode), valid=~r.isnan()).tolist()


def observe_batch(sampler: Sampler, rows: Sequence[Any], episodes: list[Episode], group_size: int) -> None:
    """The prompt sampler sees a scored batch (``rows`` as it drew them, every rank's episodes), with
    each group's zero-signal flag judged as dynamic sampling judges it (the curriculum's pass rates
    learn from it; the epoch sampler ignores it)."""
    sampler.observe(rows, episodes, _informative(episodes, group_size))


def shape_overlong(episodes: list[Episode], cfg: AlgorithmConfig, budget: int) -> dict[str, float]:
    """DAPO's overlong reward shaping, in place, on a step's training samples (each agent
    segment is one, :func:`plainrl.samples.training_samples`): add the soft overlong punishment
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
