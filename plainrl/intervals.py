"""A held-out figure's interval, computed and named: :func:`wilson_interval` for a pass rate,
:func:`mean_interval` for the mean of per-prompt scores, and every evaluation figure plainrl prints
or writes (the run's eval lines, ``plainrl eval``, the report, the model card) with the interval's
method and n beside it, e.g. ``pass@1 0.420 [0.330, 0.520] (Wilson 95%, n=100)``. Imports nothing
heavy, so the report can use it.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from statistics import NormalDist
from typing import Any

__all__ = [
    "CONFIDENCE", "T_BELOW", "eval_figures", "eval_keys", "figure", "interval_method", "mean_interval",
    "mean_interval_method", "method_label", "student_t_quantile", "student_t_two_sided", "wilson_interval",
]

CONFIDENCE = 0.95  # every eval interval's level
T_BELOW = 30  # fewer values: Student's t; from here the normal quantile (1.960, t's is 2.045 at n = 30: 4% apart)
N_KEY = "eval/n"
_BOUNDS = ("_ci_low", "_ci_high")


def mean_interval_method(n: int) -> str:
    """How :func:`mean_interval` computes the interval of ``n`` values: ``"student-t"``
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


def wilson_interval(successes: int, n: int, z: float = 1.96) -> tuple[float, float]:
    """Confidence interval of a success rate from ``n`` pass/fail trials (z = 1.96: 95%).

    The Wilson score interval (Wilson 1927, JASA 22:209; recommended over the normal
    approximation by Brown, Cai & DasGupta 2001, Stat. Sci. 16:101): with p = s/n,

        centre = (p + z^2/(2n)) / (1 + z^2/n)
        half   = z / (1 + z^2/n) * sqrt(p(1-p)/n + z^2/(4n^2))

    It stays inside [0, 1] and is not degenerate at p = 0 or 1, where evals of small
    models often sit.

    Raises:
        ValueError: ``n < 1`` or ``successes`` outside ``[0, n]``.
    """
    if n < 1 or not 0 <= successes <= n:
        raise ValueError(f"wilson_interval needs 0 <= successes <= n and n >= 1; got {successes}/{n}")
    p, z2 = successes / n, z * z
    centre = (p + z2 / (2 * n)) / (1 + z2 / n)
    half = z / (1 + z2 / n) * math.sqrt(p * (1 - p) / n + z2 / (4 * n * n))
    return max(0.0, centre - half), min(1.0, centre + half)


def student_t_two_sided(t: float, df: int) -> float:
    """P(|T| <= t) for Student's t with ``df`` (>= 1) degrees of freedom, ``t >= 0``.

    The closed forms of Abramowitz & Stegun (1964), 26.7.3 (odd df) and 26.7.4 (even df),
    with theta = atan(t / sqrt(df)):

        odd:  A = (2/pi) * (theta + sin(theta) * sum_{j=0}^{(df-3)/2} a_j cos(theta)^(2j+1)),
              a_0 = 1, a_j = a_{j-1} * 2j / (2j + 1)             (no sum for df = 1)
        even: A = sin(theta) * sum_{j=0}^{(df-2)/2} b_j cos(theta)^(2j),
              b_0 = 1, b_j = b_{j-1} * (2j - 1) / (2j)

    Raises:
        ValueError: ``df < 1`` or ``t < 0``.
    """
    if df < 1 or t < 0:
        raise ValueError(f"student_t_two_sided needs df >= 1 and t >= 0, got df={df}, t={t}")
    theta = math.atan(t / math.sqrt(df))
    s, c = math.sin(theta), math.cos(theta)
    if df % 2 == 1:
        total, term = 0.0, c
        for j in range((df - 1) // 2):
            total += term
            term *= c * c * (2 * j + 2) / (2 * j + 3)
        return min(1.0, 2 / math.pi * (theta + s * total))
    total, term = 0.0, 1.0
    for j in range(df // 2):
        total += term
        term *= c * c * (2 * j + 1) / (2 * j + 2)
    return min(1.0, s * total)


def student_t_quantile(confidence: float, df: int) -> float:
    """The t with P(|T| <= t) = ``confidence`` for Student's t with ``df`` degrees of freedom
    (t_{(1+confidence)/2, df}: 12.706 for df = 1 at 0.95, 2.262 for df = 9), by bisection of
    :func:`student_t_two_sided` to 1e-12 relative.

    Raises:
        ValueError: ``confidence`` outside (0, 1) or ``df < 1``.
    """
    if not 0 < confidence < 1 or df < 1:
        raise ValueError(f"student_t_quantile needs 0 < confidence < 1 and df >= 1, got {confidence}, {df}")
    lo, hi = 0.0, 1.0
    while student_t_two_sided(hi, df) < confidence:
        hi *= 2
    while hi - lo > 1e-12 * hi:
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if student_t_two_sided(mid, df) < confidence else (lo, mid)
    return (lo + hi) / 2


def mean_interval(values: list[float], confidence: float = 0.95) -> tuple[float, float]:
    """Confidence interval of the mean of i.i.d. per-item scores (e.g. each prompt's mean
    accuracy over k samples): mean -/+ q * s / sqrt(n), with the sample standard deviation s.
    q is Student's t quantile with n - 1 degrees of freedom below :data:`T_BELOW` values
    (the normal one understates the interval there: 1.96 against t's 2.26 at n = 10), the
    normal quantile from there (:func:`mean_interval_method` names which). Treating the
    prompt, not the sample, as the unit keeps the k correlated samples of a prompt from
    narrowing the interval (Miller 2024, "Adding Error Bars to Evals", arXiv:2411.00640,
    Sec. 2.2, which gives the t interval for small n).

    Raises:
        ValueError: no values, or ``confidence`` outside (0, 1).
    """
    if not values:
        raise ValueError("mean_interval needs at least one value")
    if not 0 < confidence < 1:
        raise ValueError(f"mean_interval needs 0 < confidence < 1, got {confidence}")
    n = len(values)
    mean = sum(values) / n
    if n < 2:
        return mean, mean
    var = sum((v - mean) ** 2 for v in values) / (n - 1)
    if mean_interval_method(n) == "student-t":
        q = student_t_quantile(confidence, n - 1)
    else:
        q = NormalDist().inv_cdf((1 + confidence) / 2)
    half = q * math.sqrt(var / n)
    return mean - half, mean + half
