"""``data.curriculum``: draw training prompts by their running pass rate instead of uniformly
(:class:`plainrl.data.curriculum.CurriculumSampler`, the math in
:mod:`plainrl.algorithms.curriculum`)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from plainrl.config.base import _Section

Weighting = Literal["learnability", "pools"]


class PoolWeights(_Section):
    """The share of each step's draws that goes to each pass-rate pool (`data.curriculum.weighting: pools`);
    normalised over the pools that hold prompts."""

    hard: float = Field(0.1, ge=0.0)
    """Prompts whose pass rate is at most `data.curriculum.hard_below` (rarely or never solved)."""
    medium: float = Field(0.8, ge=0.0)
    """Prompts between the two thresholds, and unseen prompts (their pass rate is `data.curriculum.prior`)."""
    easy: float = Field(0.1, ge=0.0)
    """Prompts whose pass rate is at least `data.curriculum.easy_above` (mostly or always solved)."""

    @model_validator(mode="after")
    def _some_weight(self) -> "PoolWeights":
        if self.hard + self.medium + self.easy <= 0:
            raise ValueError("data.curriculum.pool_weights are all 0, so no pool would be drawn from; give at "
                             "least one pool a positive weight, e.g. {medium: 1}")
        return self


class CurriculumConfig(_Section):
    """A prompt sampler that keeps each training prompt's running pass rate and draws prompts where the
    signal is: a group whose samples all pass or all fail has zero group-relative advantage. A sample
    passes when its reward (`pass_reward`: the total, or one reward function's) is at least
    `pass_threshold`."""

    weighting: Weighting = "learnability"
    """`learnability`: draw each prompt in proportion to p(1-p) of its pass rate p (0 for prompts always or
    never solved, largest at p = 0.5); `pools`: split the draws between the hard, medium and easy pools by
    `pool_weights`, uniformly within a pool."""
    pass_reward: str | None = None
    """The reward whose value decides a pass: null: the weighted total of `rewards` (what the advantages see);
    a reward's name (its `name`, or its function's name): that function's raw value."""
    pass_threshold: float = 1.0
    """A sample passes when its reward (`pass_reward`) is >= this; with `correctness` (1 or 0) plus shaping
    terms worth less than 1, 1.0 counts correct answers only."""
    ema: float = Field(0.5, gt=0.0, le=1.0)
    """Weight of the newest group in a prompt's running pass rate: p <- (1 - ema) p + ema x (the group's share
    of passes); a prompt's first group sets p; 1: the last group alone."""
    prior: float = Field(0.5, ge=0.0, le=1.0)
    """The pass rate of a prompt not drawn yet (0.5: the largest learnability, so unseen prompts are tried
    before known ones)."""
    explore: float = Field(0.05, ge=0.0, le=1.0)
    """Share of the draw probability spread uniformly over all prompts, so no prompt's chance is 0 (a solved
    prompt is seen again and can be forgotten or relearned); 1: uniform draws."""
    hard_below: float = Field(0.1, ge=0.0, le=1.0)
    """A pass rate at most this puts a prompt in the hard pool (pools and the `data/curriculum_pool/*` metrics)."""
    easy_above: float = Field(0.9, ge=0.0, le=1.0)
    """A pass rate at least this puts a prompt in the easy pool."""
    pool_weights: PoolWeights = Field(default_factory=PoolWeights)
    """`weighting: pools`: the share of draws per pool."""
    redraws: int = Field(0, ge=0)
    """Zero-signal gate: a step's groups whose rewards are all equal (zero advantage) are replaced by newly drawn
    prompts, at most this many times a step, each time drawing only as many prompts as groups were dropped
    (`sampling/*` metrics); 0: off. Not with `algorithm.dynamic_sampling`, which re-draws whole batches."""

    @model_validator(mode="after")
    def _thresholds(self) -> "CurriculumConfig":
        if self.hard_below >= self.easy_above:
            raise ValueError(f"data.curriculum.hard_below={self.hard_below} must be below data.curriculum.easy_above="
                             f"{self.easy_above} (the hard and easy pools would overlap); lower hard_below or raise "
                             "easy_above")
        return self
