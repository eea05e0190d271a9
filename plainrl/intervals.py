"""What a held-out figure's interval is: every evaluation figure plainrl prints or writes (the
run's eval lines, ``plainrl eval``, the report, the model card) names the interval's method and
n beside it, e.g. ``pass@1 0.420 [0.330, 0.520] (Wilson 95%, n=100)``.

The intervals themselves are computed in :mod:`plainrl.metrics` (:func:`~plainrl.metrics.wilson_interval`,
:func:`~plainrl.metrics.mean_interval`); this module only names them, and imports nothing heavy
so the report can use it.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

__all__ = [
    "CONFIDENCE", "T_BELOW", "eval_figures", "eval_keys", "figure", "interval_method", "mean_interval_method",
    "method_label",
]

CONFIDENCE = 0.95  # every eval interval's level
T_BELOW = 30  # fewer values: Student's t; from here the normal quantile (1.960, t's is 2.045 at n = 30: 4% apart)
N_KEY = "eval/n"
_BOUNDS = ("_ci_low", "_ci_high")


def mean_interval_method(n: int) -> str:
    """How :func:`plainrl.metrics.mean_interval` computes the interval of ``n`` values: ``"student-t"``
    below :data:`T_BELOW` values, ``"normal"`` from there."""
    return "student-t" if n < T_BELOW else "normal"


def interval_method(metric: str, n: int) -> str:
    """How the interval of eval metric ``metric`` (``pass@1``, ``mean@4``, with or without ``eval/``)
    over ``n`` prompts is computed: ``"wilson"`` for pass@1 (a share of n pass/fail prompts),
    otherwise a mean over prompts: ``"student-t"`` below :data:`T_BELOW` prompts, ``"normal"`` from there."""
    return "wilson" if metric.removeprefix("eval/") == "pass@1" else mean_interval_method(n)


def method_label(method: str) -> str:
    """A method of :func:`interval_method` as printed: ``Wilson 95%``, ``Student's t 95% over prompts``,
    ``normal 95% over prompts``.

    Raises:
        ValueError: an unknown method.
    """
    level = f"{CONFIDENCE * 100:g}%"
    names = {"wilson": f"Wilson {level}", "student-t": f"Student's t {level} over prompts",
             "normal": f"normal {level} over prompts"}
    if method not in names:
        raise ValueError(f"unknown interval method {method!r}; one of {sorted(names)}")
    return names[method]


def _number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def figure(row: Mapping[str, Any], key: str, digits: int = 3) -> str:
    """``row[key]`` as printed, with its interval, the interval's method and n when the row has them:
    ``0.420 [0.330, 0.520] (Wilson 95%, n=100)``; a figure without an interval says so:
    ``1.234 (no interval, n=50)``; ``row`` without ``eval/n``: no n. Empty when the row lacks the key.

    Args:
        row: an evaluation row of ``metrics.jsonl`` (``eval/<metric>``, ``eval/<metric>_ci_low``/``_high``,
            ``eval/n``).
        key: the metric's key, e.g. ``eval/pass@1``.
    """
    v = row.get(key)
    if not _number(v):
        return "" if v is None else str(v)
    n = row.get(N_KEY)
    n_text = f"n={int(n)}" if _number(n) else ""
    text = f"{v:.{digits}f}" if math.isfinite(v) else str(v)
    low, high = (row.get(key + b) for b in _BOUNDS)
    if _number(low) and _number(high):
        method = method_label(interval_method(key, int(n) if _number(n) else 0))
        return f"{text} [{low:.{digits}f}, {high:.{digits}f}] ({', '.join(filter(None, (method, n_text)))})"
    return f"{text} ({', '.join(filter(None, ('no interval', n_text)))})"


def eval_keys(row: Mapping[str, Any]) -> list[str]:
    """The figures of an evaluation row: its ``eval/`` keys but the interval bounds and ``eval/n``."""
    return [k for k in row if k.startswith("eval/") and k != N_KEY and not k.endswith(_BOUNDS)]


def eval_figures(row: Mapping[str, Any], digits: int = 3) -> str:
    """An evaluation row on one line, each figure with its interval, method and n (:func:`figure`):
    ``eval/pass@1 0.420 [0.330, 0.520] (Wilson 95%, n=100)  eval/mean@4 ...``."""
    return "  ".join(f"{k} {figure(row, k, digits)}" for k in eval_keys(row))
