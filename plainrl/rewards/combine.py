"""``reward_combine: module:fn``: a user function that turns the per-function scores of a
batch into its rewards, replacing the weighted sum.

    def gated(scores, answer):                     # scores: {name: [N] float | None}
        return [f if c == 1.0 else 0.0 for c, f in zip(scores["correctness"], scores["format_reward"])]

    combine = load_reward_combine("my_rewards.py:gated")
    out = score(fns, completions, rows, ids, combine=combine)

Per-function values stay in ``RewardOutput.parts`` (so ``reward/<name>/mean`` is still
logged); weights are not applied to what ``combine`` sees.
"""

from __future__ import annotations

import inspect
import math
import numbers
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Callable

from plainrl.rewards.loading import RewardLoadError, load_reward_fn
from plainrl.rewards.runner import RewardError

__all__ = ["RewardCombine", "load_reward_combine"]


@dataclass(frozen=True)
class RewardCombine:
    """A loaded ``reward_combine`` function.

    name: the reference as written (named in errors).
    fn:   ``fn(scores: dict[str, list[float | None]], **columns: list) -> list[float | None]``;
          ``scores`` has one [N] list per reward function and reward model (None =
          unscorable), each column a list aligned with them. A None in its result marks
          that sample unscorable.
    params: the column names ``fn`` declares after ``scores``, or None (it takes ``**kwargs``:
          every column is passed).
    """

    name: str
    fn: Callable[..., Any]
    params: frozenset[str] | None = field(default=None)

    def __call__(self, parts: Mapping[str, list[float | None]], rows: Sequence[Mapping[str, Any]]
                 ) -> list[float | None]:
        """The [N] totals for ``parts`` ({name: [N]}) and the N ``rows``.

        Raises:
            RewardError: ``fn`` raised, or returned something other than N finite numbers
                or None (NaN, inf, a string, a wrong length); the message names ``fn``.
        """
        n = len(rows)
        names: dict[str, None] = {}
        for row in rows:
            names.update(dict.fromkeys(row))
        if self.params is not None:
            names = {k: None for k in names if k in self.params}
        columns = {k: [row.get(k) for row in rows] for k in names}
        scores = {k: list(v) for k, v in parts.items()}
        try:
            out = self.fn(scores, **columns)
        except Exception as e:
            raise RewardError(f"reward_combine {self.name!r} raised {type(e).__name__}: {e}") from e
        if isinstance(out, (str, bytes, Mapping)) or not hasattr(out, "__len__"):
            raise RewardError(f"reward_combine {self.name!r} returned {type(out).__name__}; "
                              f"expected a list of {n} floats (None = unscorable)")
        if len(out) != n:
            raise RewardError(f"reward_combine {self.name!r} returned {len(out)} values for {n} samples; "
                              "return one reward per sample, in order")
        total: list[float | None] = []
        for i, v in enumerate(out):
            if v is None:
                total.append(None)
                continue
            if not isinstance(v, numbers.Real) or not math.isfinite(float(v)):
                raise RewardError(f"reward_combine {self.name!r} returned {v!r} for sample {i}; "
                                  "expected a finite float (or None for unscorable)")
            total.append(float(v))
        return total


def load_reward_combine(ref: str) -> RewardCombine:
    """Load ``reward_combine`` (``package.module:fn`` or ``path/to/file.py:fn``) and check it can
    take the scores dict positionally; nothing is called.

    Raises:
        RewardLoadError: the reference does not resolve (see
            :func:`plainrl.rewards.load_reward_fn`) or the function takes no positional argument.
    """
    fn = load_reward_fn(ref, what="reward_combine")
    params: frozenset[str] | None = None
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        return RewardCombine(ref, fn, None)
    ps = list(sig.parameters.values())
    if not any(p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD, p.VAR_POSITIONAL) for p in ps):
        raise RewardLoadError(f"reward_combine {ref!r}: {sig} cannot take the scores dict as its first "
                              "positional argument; define it as fn(scores, **columns)")
    if not any(p.kind is p.VAR_KEYWORD for p in ps):
        first = next(p for p in ps if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD, p.VAR_POSITIONAL))
        params = frozenset(p.name for p in ps if p is not first
                           and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY))
    return RewardCombine(ref, fn, params)
