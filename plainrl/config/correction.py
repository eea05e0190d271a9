"""``algorithm.is_correction`` and ``algorithm.is_bounds``: which off-policy correction the
policy loss applies between the engine's policy and the learner's, and its thresholds
(the math and sources: :mod:`plainrl.algorithms.is_correction`)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from plainrl.config.base import _Section

ISMethod = Literal["token_tis", "sequence_tis", "token_mis", "sequence_mis", "icepop", "geometric_mask"]
IS_WEIGHTINGS = ("token_tis", "sequence_tis", "token_mis", "sequence_mis", "icepop")


class ISBoundsConfig(_Section):
    """The thresholds of the corrections (token TIS's cap is `algorithm.tis_cap`)."""

    sequence_tis_cap: float = Field(2.0, gt=0.0)
    """`sequence_tis`: the cap C of the sequence's ratio prod_t rho_t (verl's `seq_is` default)."""
    token_mis: tuple[float, float] = (0.0, 2.0)
    """`token_mis`: [low, high]; a token whose ratio leaves it is dropped (the MIS estimator rho * 1[rho <= 2])."""
    sequence_mis: tuple[float, float] = (0.0, 2.0)
    """`sequence_mis`: [low, high] of the sequence's ratio prod_t rho_t; outside, the whole sequence is dropped
    (verl's `seq_mis`)."""
    icepop: tuple[float, float] = (0.5, 5.0)
    """`icepop`: [alpha, beta]; a token whose ratio leaves it is dropped (IcePop's 0.5 and 5)."""
    geometric_mask: tuple[float, float] = (0.99, 1.01)
    """`geometric_mask`: [low, high] of the sequence's geometric mean ratio exp(mean_t log rho_t); outside, the
    sequence is dropped (SkyRL's fully-async example)."""

    @model_validator(mode="after")
    def _ordered(self):
        for name in ("token_mis", "sequence_mis", "icepop", "geometric_mask"):
            low, high = getattr(self, name)
            if not 0.0 <= low <= high:
                raise ValueError(f"algorithm.is_bounds.{name} must be [low, high] with 0 <= low <= high, "
                                 f"got {[low, high]}")
        return self


def check_is_correction(methods: list[str] | str) -> list[str] | str:
    """``algorithm.is_correction`` with at most one weighting (the others are masks).

    Raises:
        ValueError: two weightings.
    """
    if methods != "auto" and sum(m in IS_WEIGHTINGS for m in methods) > 1:
        raise ValueError(f"algorithm.is_correction takes one weighting of {list(IS_WEIGHTINGS)} (plus "
                         f"geometric_mask), got {methods}: each corrects the same mismatch, so two would correct "
                         "it twice")
    return methods
