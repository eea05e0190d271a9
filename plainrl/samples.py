"""Episodes -> training samples: every segment of an agent episode is a sample of its own.

An agent (``rollout.agent``) whose call extends no segment's context (it edited or
summarised its history, a sub-agent, or it asked the model something on the side) starts a
new segment: its own prompt, its own completion (:mod:`plainrl.rollout.trajectory`). Each segment is trained as one sample, with
its episode's reward (or the agent's ``segment_rewards``), in its episode's group. Group
baselines count every episode once, whatever its number of segments
(:mod:`plainrl.algorithms.segments`). Every other episode is one sample: itself.
"""

from __future__ import annotations

import torch

from plainrl.types import Episode

__all__ = ["sample_rewards", "sample_groups", "training_samples"]


def sample_rewards(e: Episode) -> list[float | None]:
    """The reward of each of ``e``'s segments, in call order: the agent's ``segment_rewards``,
    or the episode's ``reward`` for each; all None when the episode is unscorable."""
    n = len(e.earlier) + 1
    if e.reward is None:
        return [None] * n
    return list(e.segment_rewards) if e.segment_rewards is not None else [e.reward] * n


def training_samples(episodes: list[Episode]) -> list[Episode]:
    """Every segment of every episode as a sample, in order (an episode's earlier segments,
    then the episode itself, which is its last segment).

    Sets, in place, each sample's ``group`` (its episode's), ``segment``, ``segments`` and
    ``reward`` (:func:`sample_rewards`); earlier segments also get the episode's
    ``reward_parts``. With one segment and no ``segment_rewards`` this changes nothing.
    Call it once per step, after the groups are final (gathering and dynamic sampling
    renumber them) and before anything changes the samples' rewards (overlong shaping).

    Returns:
        S >= N samples; each group's samples contiguous when its episodes are.
    """
    out: list[Episode] = []
    for e in episodes:
        segs = [*e.earlier, e]
        for k, (s, r) in enumerate(zip(segs, sample_rewards(e))):
            s.group, s.segment, s.segments, s.reward = e.group, k, len(segs), r
            if s is not e:
                s.reward_parts = e.reward_parts
        out.extend(segs)
    return out


def sample_groups(samples: list[Episode]) -> tuple[torch.Tensor, torch.Tensor] | None:
    """``(group [S], episode [S])`` ids of samples from :func:`training_samples`, for the
    group statistics that count each episode once; None when every episode is one sample
    (the estimators' plain contiguous groups then apply)."""
    if all(s.segments == 1 for s in samples):
        return None
    episode, current = [], -1
    for s in samples:
        current += s.segment == 0  # an episode's samples are contiguous, its first is segment 0
        episode.append(current)
    return torch.tensor([s.group for s in samples]), torch.tensor(episode)
