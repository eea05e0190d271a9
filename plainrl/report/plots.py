"""The report's charts as inline SVG (matplotlib): training curves of one or several runs
overlaid, each line drawn raw and smoothed, and evaluation results with their
confidence intervals.

Each line of a curve chart is two SVG groups, ``<chart>-<i>-raw`` and
``<chart>-<i>-smooth``; the page's smoothing toggle shows or fades them with CSS
(no re-plotting in the browser). Smoothing is TensorBoard's debiased exponential
moving average: s_t = w s_{t-1} + (1 - w) x_t, divided by 1 - w^t.
"""

from __future__ import annotations

import io
import re
from dataclasses import dataclass

import matplotlib
from matplotlib.axes import Axes
from matplotlib.figure import Figure
from matplotlib.lines import Line2D
from matplotlib.ticker import MaxNLocator

from plainrl.intervals import interval_method, method_label
from plainrl.report.data import RunData

SMOOTHING = 0.6  # the EMA weight w
_COLORS = ("#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b", "#e377c2", "#17becf", "#7f7f7f",
           "#bcbd22")
_STYLES = ("-", "--", ":", "-.")
_SIZE = (4.6, 2.7)  # inches
_GENERIC_ID = re.compile(r' id="(?:figure|axes|patch|matplotlib\.axis|xtick|ytick|line2d|text|legend|PolyCollection|'
                         r'LineCollection|errorbar)_\d+"')
_METADATA = re.compile(r"<metadata>.*?</metadata>\s*", re.S)


@dataclass
class Chart:
    """One chart: ``id`` (HTML id and SVG group prefix), a title, the SVG, and the metric keys drawn."""

    id: str
    title: str
    svg: str
    keys: list[str]


def smooth(values: list[float], weight: float = SMOOTHING) -> list[float]:
    """Debiased EMA (TensorBoard's smoothing): the first value is kept, later ones pulled
    towards the running mean; ``weight`` 0 returns the values."""
    out, s = [], 0.0
    for t, v in enumerate(values, 1):
        s = weight * s + (1 - weight) * v
        out.append(s / (1 - weight ** t))
    return out


def _svg(fig: Figure, chart_id: str) -> str:
    """The figure as an ``<svg>`` element to inline: no XML prolog, ids unique to the chart."""
    buf = io.StringIO()
    with matplotlib.rc_context({"svg.fonttype": "none", "svg.hashsalt": chart_id}):
        fig.savefig(buf, format="svg", metadata={"Date": None})  # fixed margins: a tight bbox draws twice
    text = buf.getvalue()
    text = text[text.index("<svg"):]
    # matplotlib names every group figure_1, axes_1, xtick_1, ... in every figure: drop those
    # (unreferenced) ids so the page's ids stay unique; clip paths and markers keep theirs
    return _GENERIC_ID.sub("", _METADATA.sub("", text))


def _figure(title: str, xlabel: str) -> tuple[Figure, Axes]:
    fig = Figure(figsize=_SIZE)
    fig.subplots_adjust(left=0.13, right=0.97, bottom=0.16, top=0.88)
    return fig, _styled(fig.add_subplot(), title, xlabel)


def _styled(ax: Axes, title: str, xlabel: str) -> Axes:
    ax.set_title(title, fontsize=10)
    ax.set_xlabel(xlabel, fontsize=8)
    ax.tick_params(labelsize=7)
    ax.grid(True, alpha=0.3, linewidth=0.5)
    ax.xaxis.set_major_locator(MaxNLocator(nbins=6, integer=True))  # steps
    ax.yaxis.set_major_locator(MaxNLocator(nbins=5))
    ax.spines[["top", "right"]].set_visible(False)
    return ax


def _safe(s: str) -> str:
    return re.sub(r"[^A-Za-z0-9_-]", "_", s)


def short_labels(keys: list[str]) -> dict[str, str]:
    """Legend labels: the path parts the keys do not share (``reward/correctness/mean``,
    ``reward/format/mean`` -> ``correctness``, ``format``)."""
    parts = [k.split("/") for k in keys]
    if len(keys) < 2 or len({len(p) for p in parts}) != 1:
        return {k: k for k in keys}
    keep = [i for i in range(len(parts[0])) if len({p[i] for p in parts}) > 1]
    return {k: "/".join(p[i] for i in keep) for k, p in zip(keys, parts)}


def curve_chart(chart_id: str, title: str, runs: list[RunData], keys: list[str]) -> Chart | None:
    """Training curves of ``keys`` for every run, against steps done (a row's ``step`` + 1);
    None when no run has any of them. One key: a colour per run. Several keys: a colour per
    key and a line style per run."""
    keys = [k for k in keys if any(run.series(k)[1] for run in runs)]  # legends name only what is drawn
    if not keys:
        return None
    fig, ax = _figure(title, "step")
    drawn = _draw_curves(ax, chart_id, runs, keys)
    if not drawn:
        return None
    return Chart(chart_id, title, _svg(fig, chart_id), sorted(set(drawn)))


def _draw_curves(ax: Axes, chart_id: str, runs: list[RunData], keys: list[str]) -> list[str]:
    """Draw ``keys`` of every run (raw and smoothed) on ``ax``; returns the keys drawn."""
    drawn, i = [], 0
    short = short_labels(keys)
    for r_idx, run in enumerate(runs):
        for k_idx, key in enumerate(keys):
            steps, values = run.series(key)
            if not values:
                continue
            x = [s + 1 for s in steps]
            color = _COLORS[(k_idx if len(keys) > 1 else r_idx) % len(_COLORS)]
            style = _STYLES[r_idx % len(_STYLES)] if len(keys) > 1 else "-"
            # several runs and keys: the legend names keys by colour and runs by line style (below)
            label = (None if len(runs) > 1 and len(keys) > 1 else
                     run.name if len(runs) > 1 else short[key] if len(keys) > 1 else None)
            marker = "o" if len(x) < 12 else None  # a few steps: dots, so a single step shows
            raw, = ax.plot(x, values, color=color, linestyle=style, linewidth=1.0, marker=marker, markersize=3,
                           label=label)
            raw.set_gid(f"{chart_id}-{i}-raw")
            sm, = ax.plot(x, smooth(values), color=color, linestyle=style, linewidth=1.8)
            sm.set_gid(f"{chart_id}-{i}-smooth")
            drawn.append(key)
            i += 1
    if len(runs) > 1 and len(keys) > 1:
        handles = [Line2D([], [], color=_COLORS[k % len(_COLORS)], label=short[key]) for k, key in enumerate(keys)]
        handles += [Line2D([], [], color="#555", linestyle=_STYLES[r % len(_STYLES)], label=run.name)
                    for r, run in enumerate(runs)]
        ax.legend(handles=handles, fontsize=6.5, frameon=False, ncol=2)
    elif drawn and (len(runs) > 1 or len(keys) > 1):
        ax.legend(fontsize=7, frameon=False)
    return drawn


def eval_metric_names(runs: list[RunData]) -> list[str]:
    """The evaluation metrics (``eval/pass@1``, ``eval/mean@4``, ``eval/env/...``) without
    their interval bounds and ``eval/n``, in first-seen order."""
    seen: dict[str, None] = {}
    for run in runs:
        for row in run.evals:
            for k, v in row.items():
                if (k.startswith("eval/") and k != "eval/n" and not k.endswith(("_ci_low", "_ci_high"))
                        and isinstance(v, (int, float))):
                    seen.setdefault(k, None)
    return list(seen)


def eval_chart(chart_id: str, runs: list[RunData], key: str) -> Chart | None:
    """An evaluation metric against training steps done, with its 95% interval
    (``<key>_ci_low``/``_ci_high``) as error bars when logged; None without values."""
    title = eval_title(runs, key)
    fig, ax = _figure(title, "steps trained")
    if len(title) > 40:  # the method and n beside a mean@k: smaller, so the title fits the chart
        ax.title.set_fontsize(8)
    if not _draw_eval(ax, runs, key):
        return None
    return Chart(chart_id, title, _svg(fig, chart_id), [key])


def eval_title(runs: list[RunData], key: str) -> str:
    """``key`` with what its error bars are and over how many prompts: ``eval/pass@1 (Wilson 95%,
    n=100)``; several n (runs or evaluations over other held-out sets) are listed, ``n=50/100``."""
    rows = [r for run in runs for r in run.evals if isinstance(r.get(key), (int, float))]
    ns = sorted({int(r["eval/n"]) for r in rows if isinstance(r.get("eval/n"), (int, float))})
    n_text = "n=" + "/".join(map(str, ns)) if ns else ""
    if rows and all(isinstance(r.get(f"{key}_ci_low"), (int, float)) for r in rows):
        methods = sorted({method_label(interval_method(key, int(r.get("eval/n") or 0))) for r in rows})
        return f"{key} ({', '.join([*methods, n_text] if n_text else methods)})"
    return f"{key} ({', '.join(filter(None, ('no interval', n_text)))})"


def _draw_eval(ax: Axes, runs: list[RunData], key: str) -> bool:
    """Draw ``key`` of every run's evaluations on ``ax``; whether any run had it."""
    drawn = False
    for r_idx, run in enumerate(runs):
        rows = [r for r in run.evals if isinstance(r.get(key), (int, float))]
        if not rows:
            continue
        x = [r["step"] for r in rows]
        y = [float(r[key]) for r in rows]
        color = _COLORS[r_idx % len(_COLORS)]
        label = run.name if len(runs) > 1 else None
        if all(isinstance(r.get(f"{key}_ci_low"), (int, float)) for r in rows):
            low = [max(0.0, v - r[f"{key}_ci_low"]) for v, r in zip(y, rows)]
            high = [max(0.0, r[f"{key}_ci_high"] - v) for v, r in zip(y, rows)]
            ax.errorbar(x, y, yerr=[low, high], color=color, marker="o", markersize=4, capsize=3, linewidth=1.2,
                        label=label)
        else:
            ax.plot(x, y, color=color, marker="o", markersize=4, linewidth=1.2, label=label)
        drawn = True
    if drawn and len(runs) > 1:
        ax.legend(fontsize=7, frameon=False)
    return drawn


def curves_png(runs: list[RunData], out, keys: list[str], eval_key: str = "eval/pass@1") -> list[str]:
    """One PNG of the runs side by side with ``keys`` (a panel each, training curves raw and
    smoothed) and ``eval_key`` with its 95% intervals (a last panel): the recipes' curves
    for a page that cannot inline the report's SVG.

    Returns:
        the panels drawn (metric names); a key no run logged is left out.
    Raises:
        ValueError: none of ``keys`` nor ``eval_key`` was logged by any run.
    """
    panels = [k for k in keys if any(run.series(k)[1] for run in runs)]
    has_eval = any(isinstance(r.get(eval_key), (int, float)) for run in runs for r in run.evals)
    if not panels and not has_eval:
        raise ValueError(f"no run logged any of {[*keys, eval_key]}")
    n = len(panels) + has_eval
    fig = Figure(figsize=(_SIZE[0] * n, _SIZE[1] + 0.3))
    fig.subplots_adjust(left=0.13 / n, right=1 - 0.03 / n, bottom=0.17, top=0.86, wspace=0.25)
    for i, key in enumerate(panels):
        ax = _styled(fig.add_subplot(1, n, i + 1), key, "step")
        _draw_curves(ax, f"png-{i}", runs, [key])
    if has_eval:
        _draw_eval(_styled(fig.add_subplot(1, n, n), eval_title(runs, eval_key), "steps trained"), runs, eval_key)
    fig.savefig(out, format="png", dpi=150)
    return panels + ([eval_key] if has_eval else [])


def _reward_function_keys(runs: list[RunData]) -> list[str]:
    keys: dict[str, None] = {}
    for run in runs:
        for k in run.metric_names():
            if k.startswith("reward/") and k.endswith("/mean") and k != "reward/mean":
                keys.setdefault(k, None)
    return list(keys)


def _time_keys(runs: list[RunData]) -> list[str]:
    keys: dict[str, None] = {}
    for run in runs:
        for k in run.metric_names():
            if k.startswith("time/"):
                keys.setdefault(k, None)
    return sorted(keys, key=lambda k: (k == "time/step", k))


# (id, title, keys): the headline curves, in this order; every other metric follows under "more"
_HEADLINE = (
    ("reward", "Reward (mean)", ["reward/mean"]),
    ("reward_fns", "Reward per function (mean)", None),  # reward/<fn>/mean, found per run
    ("length", "Response length (tokens)", ["response_length/mean", "response_length/max"]),
    ("kl", "KL to the reference", ["kl", "kl_reward", "approx_kl"]),
    ("entropy", "Entropy", ["entropy"]),
    ("clip", "Clip fraction", ["clip_frac"]),
    # mean |engine - learner| logprob of the sampled tokens: ~1e-5 in float32, above 0.05 the rollouts are
    # off-policy by more than numerics (docs/engines.md, "Engine/learner mismatch")
    ("mismatch", "Engine/learner logprob difference (nats)", ["rollout/logprob_diff"]),
    ("times", "Phase times (s)", None),  # time/*
    ("loss", "Loss", ["loss"]),
    ("accuracy", "Accuracy", ["accuracy"]),
)


PASS_RATE_PREFIX = "data/curriculum_pass_rate/"  # data.curriculum: share of prompts per pass-rate bin
_BIN_COLORS = ("#d62728", "#ff7f0e", "#bcbd22", "#2ca02c", "#1f77b4")  # never solved ... always solved


def pass_rate_chart(chart_id: str, run: RunData, named: bool = False) -> Chart | None:
    """``data.curriculum``: how the training prompts' pass rates are distributed over the steps, as
    stacked shares (prompts not drawn yet, then each pass-rate bin, ``data/curriculum_pass_rate/<bin>``);
    None when the run logged none. ``named``: the title names the run (a report of several)."""
    unseen = PASS_RATE_PREFIX + "unseen"
    bins = sorted(k for k in run.metric_names() if k.startswith(PASS_RATE_PREFIX) and k != unseen)
    if not bins:
        return None
    keys = [unseen, *bins]
    steps = [row["step"] + 1 for row in run.train if isinstance(row.get(bins[0]), (int, float))]
    shares = []
    for key in keys:
        values = {s + 1: v for s, v in zip(*run.series(key))}
        shares.append([values.get(s, 0.0) for s in steps])
    title = "Pass rates of the training prompts" + (f" ({run.name})" if named else "")
    fig, ax = _figure(title, "step")
    ax.stackplot(steps, shares, labels=["not drawn yet", *(k[len(PASS_RATE_PREFIX):] for k in bins)],
                 colors=["#dddddd", *(_BIN_COLORS[i % len(_BIN_COLORS)] for i in range(len(bins)))])
    ax.set_ylim(0, 1)
    ax.set_ylabel("share of prompts", fontsize=8)
    ax.legend(fontsize=6.5, frameon=False, loc="upper left", bbox_to_anchor=(1.0, 1.0), title="pass rate",
              title_fontsize=6.5)
    fig.subplots_adjust(right=0.76)
    return Chart(chart_id, title, _svg(fig, chart_id), keys)


def training_charts(runs: list[RunData]) -> tuple[list[Chart], list[Chart]]:
    """``(headline charts, one chart per other numeric metric)`` for the runs; with
    ``data.curriculum``, each run's pass-rate distribution follows the reward curves."""
    headline, used = [], set()
    for chart_id, title, keys in _HEADLINE:
        if keys is None:
            keys = _reward_function_keys(runs) if chart_id == "reward_fns" else _time_keys(runs)
        if keys and (chart := curve_chart(chart_id, title, runs, keys)):
            headline.append(chart)
            used.update(chart.keys)
        if chart_id == "reward_fns":
            for i, run in enumerate(runs):
                if chart := pass_rate_chart(f"curriculum-{i}", run, named=len(runs) > 1):
                    headline.append(chart)
                    used.update(chart.keys)
    other_keys: dict[str, None] = {}
    for run in runs:
        for k in run.metric_names():
            if k not in used:
                other_keys.setdefault(k, None)
    more = [c for k in other_keys if (c := curve_chart(f"m-{_safe(k)}", k, runs, [k]))]
    return headline, more
