"""``data.curriculum``: the prompt sampler that draws training prompts by their running pass rate
(the math in :mod:`plainrl.algorithms.curriculum`), resumable exactly."""

from __future__ import annotations

import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from plainrl.algorithms.curriculum import (
    EASY, HARD, draw_probabilities, draw_without_replacement, learnability_weights, pass_fraction, pool_draw_weights,
    pool_index, update_pass_rate,
)
from plainrl.config.base import ConfigError
from plainrl.config.curriculum import CurriculumConfig
from plainrl.data.sampler import PromptSampler, Sampler
from plainrl.types import Episode

__all__ = ["CurriculumSampler", "PASS_RATE_BINS", "check_pass_reward", "make_prompt_sampler"]

# the pass-rate histogram logged each step (data/curriculum_pass_rate/<bin>), drawn by the report
PASS_RATE_BINS = ("0.0-0.2", "0.2-0.4", "0.4-0.6", "0.6-0.8", "0.8-1.0")


@dataclass
class _Tally:
    """What the groups observed since the last :meth:`CurriculumSampler.take_metrics` showed."""

    groups: int = 0
    zero_signal: int = 0
    pass_sum: float = 0.0  # sum over scored groups of their pass fraction
    scored: int = 0  # groups with a pass fraction


class CurriculumSampler:
    """Batches of training prompts drawn by their running pass rate, resumable exactly.

    Each prompt's pass rate is the moving average of its groups' pass fractions (a sample passes
    when its reward, the total or ``settings.pass_reward``'s, is >= ``settings.pass_threshold``);
    a prompt not drawn yet counts as ``settings.prior``. A batch is ``prompts_per_step`` distinct
    prompts (while the data has that many) drawn with probability (1 - explore) * w / sum(w) +
    explore / N, w the learnability p(1-p) or the pool weights of ``settings.weighting``. The
    randomness of batch b is a generator seeded from ``(seed, b)``, so the state is the pass-rate
    table and the number of batches drawn: :meth:`state_dict` captures both and a sampler built on
    the same rows and seed continues with the same batches after :meth:`load_state_dict`.

    Pass rates change when :meth:`observe` is given a scored batch; under
    ``rollout.async_steps`` the batches sampled ahead were drawn before the steps before them were
    observed, so a batch sees the pass rates of the batches scored up to its draw.

    Args:
        rows: the training prompts (non-empty; ``PromptRow`` objects: a batch's rows are matched
            to the table by identity).
        prompts_per_step: rows per batch (``rollout.prompts_per_step``).
        seed: the run's seed.
        settings: the ``data.curriculum`` section.

    Raises:
        ValueError: no rows, or ``prompts_per_step < 1``.
    """

    def __init__(self, rows: Sequence[Any], prompts_per_step: int, *, seed: int, settings: CurriculumConfig):
        if not rows:
            raise ValueError("CurriculumSampler needs at least one row")
        if prompts_per_step < 1:
            raise ValueError(f"prompts_per_step must be >= 1, got {prompts_per_step}")
        self.rows, self.prompts_per_step, self.seed, self.settings = rows, prompts_per_step, seed, settings
        self.rates: list[float | None] = [None] * len(rows)  # [N] running pass rates; None: not seen
        self.batches = 0  # batches drawn
        self._index = {id(r): i for i, r in enumerate(rows)}
        self._tally = _Tally()

    # ------------------------------------------------------------------ drawing

    def _rates_tensor(self) -> torch.Tensor:
        """[N] float64 pass rates, the prior for unseen prompts."""
        prior = self.settings.prior
        return torch.tensor([prior if r is None else r for r in self.rates], dtype=torch.float64)

    def probabilities(self) -> torch.Tensor:
        """[N] float64: each prompt's probability of being drawn first in the next batch."""
        s, rates = self.settings, self._rates_tensor()
        if s.weighting == "learnability":
            weights = learnability_weights(rates)
        else:
            shares = (s.pool_weights.hard, s.pool_weights.medium, s.pool_weights.easy)
            weights = pool_draw_weights(rates, s.hard_below, s.easy_above, shares)
        return draw_probabilities(weights, s.explore)

    def _generator(self) -> torch.Generator:
        # a string seed goes through SHA-512 in random.Random: the same in every process
        return torch.Generator().manual_seed(random.Random(f"curriculum:{self.seed}:{self.batches}").getrandbits(63))

    def next_batch(self, n: int | None = None) -> list[Any]:
        """The next ``n`` rows (default ``prompts_per_step``), distinct while the data has that many."""
        picked = draw_without_replacement(self.probabilities(), self.prompts_per_step if n is None else n,
                                          self._generator())
        self.batches += 1
        return [self.rows[i] for i in picked]

    # ------------------------------------------------------------------ learning the pass rates

    def _passes(self, e: Episode) -> float | None:
        name = self.settings.pass_reward
        return e.reward if name is None else e.reward_parts.get(name)

    def observe(self, rows: Sequence[Any], episodes: list[Episode], informative: Sequence[bool]) -> None:
        """Update the pass rates of a scored batch: ``rows`` as :meth:`next_batch` gave them,
        ``episodes`` their groups (``Episode.group`` indexes ``rows``), ``informative`` per group
        whether any advantage can be non-zero (for ``data/curriculum_zero_signal``)."""
        groups: dict[int, list[float | None]] = {}
        for e in episodes:
            groups.setdefault(e.group, []).append(self._passes(e))
        t = self._tally
        for g, rewards in sorted(groups.items()):
            t.groups += 1
            t.zero_signal += not informative[g]
            observed = pass_fraction(rewards, self.settings.pass_threshold)
            if observed is None:
                continue
            t.pass_sum, t.scored = t.pass_sum + observed, t.scored + 1
            i = self._index[id(rows[g])]
            self.rates[i] = update_pass_rate(self.rates[i], observed, self.settings.ema)

    def take_metrics(self) -> dict[str, float]:
        """The ``data/curriculum_*`` metrics since the last call: ``pass_rate`` (mean pass fraction of
        the groups drawn), ``zero_signal`` (share of them whose rewards were all equal), ``groups``
        (groups drawn), ``seen`` (prompts with a pass rate), ``pool/{unseen,hard,medium,easy}``
        (prompts per pool, the seen ones by their pass rate) and ``pass_rate/<bin>`` (share of all
        training prompts whose pass rate falls in each bin of :data:`PASS_RATE_BINS`, and
        ``pass_rate/unseen``, the share not drawn yet: together 1)."""
        t, self._tally = self._tally, _Tally()
        seen = torch.tensor([r for r in self.rates if r is not None], dtype=torch.float64)
        n = len(self.rates)
        out = {"data/curriculum_groups": float(t.groups),
               "data/curriculum_zero_signal": t.zero_signal / t.groups if t.groups else 0.0,
               "data/curriculum_seen": float(seen.numel()),
               "data/curriculum_pool/unseen": float(n - seen.numel())}
        if t.scored:
            out["data/curriculum_pass_rate"] = t.pass_sum / t.scored
        pools = torch.bincount(pool_index(seen, self.settings.hard_below, self.settings.easy_above), minlength=3)
        for name, k in (("hard", HARD), ("medium", 1), ("easy", EASY)):
            out[f"data/curriculum_pool/{name}"] = float(pools[k])
        bins = torch.bincount((seen * len(PASS_RATE_BINS)).long().clamp(max=len(PASS_RATE_BINS) - 1),
                              minlength=len(PASS_RATE_BINS))
        for label, count in zip(PASS_RATE_BINS, bins.tolist()):
            out[f"data/curriculum_pass_rate/{label}"] = count / n
        out["data/curriculum_pass_rate/unseen"] = (n - seen.numel()) / n
        return out

    # ------------------------------------------------------------------ resume

    def state_dict(self) -> dict[str, Any]:
        """``{"curriculum": True, "batches", "pass_rates", "num_rows", "seed"}`` (JSON-serialisable;
        an unseen prompt's pass rate is null)."""
        return {"curriculum": True, "batches": self.batches, "pass_rates": list(self.rates),
                "num_rows": len(self.rows), "seed": self.seed}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Continue from a :meth:`state_dict`.

        Raises:
            ValueError: the state is a uniform sampler's (the checkpoint was written with
                ``data.curriculum`` off), or was saved for another number of rows or seed.
        """
        if not state.get("curriculum"):
            raise ValueError("the checkpoint was written without data.curriculum, so it holds no pass rates to "
                             "resume; resume with data.curriculum unset, or start a new run_dir")
        for key, mine in (("num_rows", len(self.rows)), ("seed", self.seed)):
            if state[key] != mine:
                raise ValueError(
                    f"sampler state was saved with {key}={state[key]!r} but this run has {key}={mine!r}; the "
                    "training data or seed changed since the checkpoint, so the pass rates cannot be resumed")
        rates = state["pass_rates"]
        if len(rates) != len(self.rows) or any(r is not None and not 0.0 <= r <= 1.0 for r in rates):
            raise ValueError("sampler state holds pass rates that do not fit this run's rows (a damaged checkpoint)")
        self.rates, self.batches = [None if r is None else float(r) for r in rates], int(state["batches"])


def make_prompt_sampler(rows: Sequence[Any], prompts_per_step: int, *, seed: int, shuffle: bool,
                        curriculum: CurriculumConfig | None) -> Sampler:
    """The RL run's prompt sampler: by pass rate under ``data.curriculum``, else epoch by epoch
    (``data.shuffle``)."""
    if curriculum is None:
        return PromptSampler(rows, prompts_per_step, seed=seed, shuffle=shuffle)
    return CurriculumSampler(rows, prompts_per_step, seed=seed, settings=curriculum)


def check_pass_reward(curriculum: CurriculumConfig | None, reward_names: Sequence[str]) -> None:
    """``data.curriculum.pass_reward`` names one of the run's rewards (checked before any model loads).

    Raises:
        ConfigError: it names none of ``reward_names``.
    """
    name = curriculum.pass_reward if curriculum is not None else None
    if name is not None and name not in reward_names:
        raise ConfigError(f"data.curriculum.pass_reward={name!r} is not one of the run's rewards "
                          f"{list(reward_names)}; name one of them, or null for the total reward")
