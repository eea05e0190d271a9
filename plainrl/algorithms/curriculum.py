"""Curriculum math (``data.curriculum``): a prompt's running pass rate and the probabilities with
which prompts are drawn from their pass rates.

A GRPO-style group of G samples of one prompt has zero group-relative advantage when all its
samples pass or all fail; with pass probability p that happens with probability p^G + (1-p)^G,
and the expected squared advantage signal of a binary reward is proportional to the reward's
variance p(1-p). Drawing prompts in proportion to p(1-p), "learnability", spends rollouts where
the gradient is (Tzannetos et al. 2023, "Proximal Curriculum for Reinforcement Learning Agents",
TMLR, which draws tasks by p(1-p) as the zone of proximal development; Foster & Foerster 2025, "Learning to
Reason at the Frontier of Learnability", arXiv:2502.12272, Sec. 3, which samples LLM RL prompts by
p(1-p)). The pool form splits draws between pass-rate pools (hard / medium / easy) by fixed
shares, as prime-rl's difficulty pools do.

Every function here is pure: pass rates in, probabilities (or indices, given a generator) out.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

__all__ = [
    "draw_probabilities", "draw_without_replacement", "learnability_weights", "pass_fraction", "pool_draw_weights",
    "pool_index", "update_pass_rate",
]

HARD, MEDIUM, EASY = 0, 1, 2  # pool_index's values


def pass_fraction(rewards: Sequence[float | None], threshold: float) -> float | None:
    """The share of a group's samples that pass: reward >= ``threshold``; unscorable samples (None)
    are left out. None when no sample was scorable (the group says nothing about the prompt)."""
    scored = [r for r in rewards if r is not None]
    if not scored:
        return None
    return sum(r >= threshold for r in scored) / len(scored)


def update_pass_rate(rate: float | None, observed: float, ema: float) -> float:
    """A prompt's running pass rate after one more group: the exponential moving average
    ``(1 - ema) * rate + ema * observed``; a prompt's first group (``rate`` None) sets it to
    ``observed``, so the prior of an unseen prompt leaves no trace once the prompt was seen.

    Args:
        rate: the running pass rate in [0, 1], or None for a prompt not seen before.
        observed: the new group's pass fraction (:func:`pass_fraction`) in [0, 1].
        ema: the new group's weight in (0, 1].
    """
    return observed if rate is None else (1.0 - ema) * rate + ema * observed


def learnability_weights(rates: torch.Tensor) -> torch.Tensor:
    """p(1 - p) per prompt: [N] pass rates in [0, 1] -> [N] weights in [0, 0.25] (0 for a prompt
    always or never solved, 0.25 at p = 0.5). Source: module docstring."""
    return rates * (1.0 - rates)


def pool_index(rates: torch.Tensor, hard_below: float, easy_above: float) -> torch.Tensor:
    """[N] pass rates -> [N] pools (long): :data:`HARD` where p <= ``hard_below``, :data:`EASY`
    where p >= ``easy_above``, :data:`MEDIUM` between (``hard_below < easy_above``)."""
    pools = torch.full(rates.shape, MEDIUM, dtype=torch.long)
    pools[rates <= hard_below] = HARD
    pools[rates >= easy_above] = EASY
    return pools


def pool_draw_weights(rates: torch.Tensor, hard_below: float, easy_above: float,
                      shares: tuple[float, float, float]) -> torch.Tensor:
    """Per-prompt weights that give each pool its share of the draws, uniformly within the pool:
    w_i = s_k / (n_k * S) for prompt i in pool k of n_k prompts, S the sum of the shares s_k of the
    pools that hold prompts (an empty pool's share goes to the others in proportion).

    Args:
        rates: [N] pass rates in [0, 1].
        shares: (hard, medium, easy) shares, >= 0.
    Returns:
        [N] float64 weights summing to 1, or all 0 when every non-empty pool's share is 0.
    """
    pools = pool_index(rates, hard_below, easy_above)
    counts = torch.bincount(pools, minlength=3).to(torch.float64)  # [3]
    s = torch.tensor(shares, dtype=torch.float64) * (counts > 0)
    if float(s.sum()) <= 0:
        return torch.zeros(rates.shape, dtype=torch.float64)
    per_prompt = s / s.sum() / counts.clamp(min=1)  # [3]
    return per_prompt[pools]


def draw_probabilities(weights: torch.Tensor, explore: float) -> torch.Tensor:
    """The draw distribution: pi_i = (1 - explore) * w_i / sum(w) + explore / N, a mixture of the
    weights and the uniform distribution (an epsilon-greedy share of uniform draws); uniform when
    every weight is 0.

    Args:
        weights: [N] non-negative weights (N >= 1).
        explore: the uniform share in [0, 1].
    Returns:
        [N] float64 probabilities summing to 1.
    """
    w = weights.to(torch.float64)
    n = w.numel()
    uniform = torch.full_like(w, 1.0 / n)
    total = float(w.sum())
    if total <= 0:
        return uniform
    return (1.0 - explore) * w / total + explore * uniform


def draw_without_replacement(probs: torch.Tensor, k: int, generator: torch.Generator) -> list[int]:
    """``k`` indices drawn one after another in proportion to ``probs``, each index at most once
    until all N were drawn (``k > N``: rounds of at most N). Indices of probability 0 come only
    after every positive one was drawn in the round, uniformly among themselves.

    Args:
        probs: [N] non-negative probabilities (not all 0).
        k: how many indices (>= 0).
        generator: the source of randomness (a CPU ``torch.Generator``); same state, same draw.
    Returns:
        ``k`` indices into ``probs``.
    """
    out: list[int] = []
    n = probs.numel()
    positive = torch.nonzero(probs > 0).flatten()
    zero = torch.nonzero(probs <= 0).flatten()
    while len(out) < k:
        take = min(k - len(out), n)
        first = min(take, positive.numel())
        if first:
            chosen = torch.multinomial(probs[positive], first, replacement=False, generator=generator)
            out.extend(positive[chosen].tolist())
        if take > first:
            out.extend(zero[torch.randperm(zero.numel(), generator=generator)[: take - first]].tolist())
    return out
