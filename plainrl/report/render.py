"""The report as one self-contained HTML file: the jinja2 template ``report.html.j2``
(package data) filled with the runs' charts, evaluation table, configs, rollouts and
errors. No network: the charts are inline SVG, the CSS and the script are in the page."""

from __future__ import annotations

import datetime
import math
from pathlib import Path
from typing import Any

import yaml
from jinja2 import Environment, PackageLoader, StrictUndefined, select_autoescape

from plainrl.durable import write_atomic
from plainrl.intervals import figure
from plainrl.report.data import RunData, config_diff, read_runs
from plainrl.report.plots import eval_chart, eval_metric_names, training_charts

MAX_ROLLOUTS = 2000  # per run: more are thinned evenly over the steps
MAX_ERRORS = 500  # per run: the first ones


def _fmt(v: Any, digits: int = 3) -> str:
    if v is None:
        return "–"
    if isinstance(v, bool):
        return str(v).lower()
    if isinstance(v, float):
        return str(v) if not math.isfinite(v) else f"{v:.{digits}g}" if abs(v) < 1e-3 and v else f"{v:.{digits}f}"
    return str(v)


def _thin(items: list[dict[str, Any]], limit: int) -> list[dict[str, Any]]:
    if len(items) <= limit:
        return items
    stride = len(items) / limit
    return [items[int(i * stride)] for i in range(limit)]


def _episode(run_idx: int, rec: dict[str, Any]) -> dict[str, Any]:
    """A ``rollouts.jsonl`` record as the template shows it (older records without
    ``segments`` show their completion as one policy segment)."""
    env = rec.get("env") or {}
    info = env.get("info") or {}
    segments = rec.get("segments") or [{"text": rec.get("completion") or "", "policy": True}]
    reward = rec.get("reward")
    return {
        "run": run_idx, "step": int(rec.get("step", -1)) + 1, "sample_id": rec.get("sample_id", ""),
        "reward": reward if isinstance(reward, (int, float)) else None,
        "advantage": rec.get("advantage"), "finish": rec.get("finish_reason") or "", "tokens": rec.get("tokens"),
        "tool_calls": int(info.get("tool_calls", 0) or 0), "env_turns": info.get("turns"),
        "env_error": env.get("error"), "env_reward": env.get("reward"),
        "env_info": {k: v for k, v in info.items() if k not in ("tool_calls",)},
        "prompt": rec.get("prompt") or "", "segments": segments, "answer": rec.get("answer"),
        "parts": rec.get("reward_parts") or {}, "trained": rec.get("trained", True),
    }


def _summary(run: RunData, metric: str) -> dict[str, Any]:
    """Mean of the first and of the last ``n`` steps' values (n = 5, or half the steps when fewer than 10)."""
    values = run.series(metric)[1]
    n = min(5, len(values) // 2)
    if n == 0:
        return {"first": None, "last": None, "n": 0}
    return {"first": sum(values[:n]) / n, "last": sum(values[-n:]) / n, "n": n}


def _eval_point(row: dict[str, Any]) -> dict[str, Any]:
    """An evaluation's pass@1 for the overview: the figure with its interval, method and n."""
    return {"step": row["step"], "pass1": figure(row, "eval/pass@1")}


def _overview(idx: int, run: RunData) -> dict[str, Any]:
    cfg = run.config
    evals = [r for r in run.evals if isinstance(r.get("eval/pass@1"), (int, float))]
    step_time = run.series("time/step")[1]
    return {
        "idx": idx, "name": run.name, "path": str(run.path), "algorithm": (cfg.get("algorithm") or {}).get("name"),
        "model": (cfg.get("model") or {}).get("name"), "steps_done": len(run.train), "steps": run.total_steps,
        "reward": _summary(run, "reward/mean"), "rollouts": len(run.rollouts), "errors": len(run.errors),
        "eval_first": _eval_point(evals[0]) if evals else None,
        "eval_last": _eval_point(evals[-1]) if len(evals) > 1 else None,
        "median_step_s": sorted(step_time)[len(step_time) // 2] if step_time else None,
        "train_s": sum(step_time) if step_time else None, "notes": run.notes,
    }


def _eval_table(runs: list[RunData], keys: list[str]) -> list[dict[str, Any]]:
    """One row per (run, eval): each metric as ``value [low, high] (method, n=...)`` when it has an
    interval, ``value (no interval, n=...)`` otherwise (:func:`plainrl.intervals.figure`)."""
    rows = []
    for idx, run in enumerate(runs):
        for r in run.evals:
            cells = []
            for k in keys:
                v = r.get(k)
                if not isinstance(v, (int, float)):
                    cells.append("")
                else:  # with its interval, the interval's method and n
                    cells.append(figure(r, k))
            rows.append({"run": run.name, "idx": idx, "step": r["step"], "n": r.get("eval/n"), "cells": cells})
    return rows


def build_context(runs: list[RunData]) -> dict[str, Any]:
    """Everything the template shows, computed from the runs."""
    headline, more = training_charts(runs)
    eval_keys = eval_metric_names(runs)
    evals = [c for i, k in enumerate(eval_keys) if (c := eval_chart(f"eval-{i}", runs, k))]
    main_evals = [c for c in evals if not c.keys[0].startswith("eval/env/")]  # environment counts go below
    episodes, errors = [], []
    for idx, run in enumerate(runs):
        episodes += [_episode(idx, rec) for rec in _thin(run.rollouts, MAX_ROLLOUTS)]
        errors += [{"run": run.name, "idx": idx, **e} for e in run.errors[:MAX_ERRORS]]
    steps = sorted({e["step"] for e in episodes})
    return {
        "title": "plainrl report: " + ", ".join(r.name for r in runs),
        "generated": datetime.datetime.now().strftime("%Y-%m-%d %H:%M"),
        "runs": [_overview(i, r) for i, r in enumerate(runs)],
        "headline": headline, "more": more, "eval_charts": main_evals, "eval_more": [c for c in evals if c not in main_evals], "eval_keys": eval_keys,
        "eval_rows": _eval_table(runs, eval_keys),
        "configs": [{"name": r.name, "yaml": yaml.safe_dump(r.config, sort_keys=False)} for r in runs],
        "diff": config_diff(runs) if len(runs) > 1 else [],
        "episodes": episodes, "rollouts_total": sum(len(r.rollouts) for r in runs),
        "step_min": steps[0] if steps else 0, "step_max": steps[-1] if steps else 0,
        "finish_reasons": sorted({e["finish"] for e in episodes if e["finish"]}),
        "any_tools": any(e["tool_calls"] or e["env_turns"] is not None for e in episodes),
        "errors": errors, "errors_total": sum(len(r.errors) for r in runs),
        "smoothing": 0.6,
    }


def _environment() -> Environment:
    env = Environment(loader=PackageLoader("plainrl.report", "."), autoescape=select_autoescape(["j2", "html"]),
                      undefined=StrictUndefined, trim_blocks=True, lstrip_blocks=True)
    env.filters["fmt"] = _fmt
    return env


def render_report(runs: list[RunData]) -> str:
    """The report page of ``runs`` (read with :func:`plainrl.report.data.read_run`)."""
    return _environment().get_template("report.html.j2").render(**build_context(runs))


def write_report(run_dirs: list[str | Path], out: str | Path | None = None) -> Path:
    """Read ``run_dirs`` and write their report to ``out`` (default: ``RUN_DIR/report.html``
    for one run, ``./report.html`` for several).

    Returns:
        the report's path.
    Raises:
        RunDirError: a path is not a run directory (named, with what is missing).
    """
    runs = read_runs(list(run_dirs))
    path = Path(out) if out is not None else (runs[0].path / "report.html" if len(runs) == 1 else Path("report.html"))
    text = render_report(runs)
    path.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(path, text)
    return path
