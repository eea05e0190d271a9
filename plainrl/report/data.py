"""Reading a run directory for the report: ``config.yaml``, ``metrics.jsonl`` (train
rows and ``eval/`` rows), ``rollouts.jsonl`` and ``errors.jsonl``, as plain Python data."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

REQUIRED = ("config.yaml", "metrics.jsonl")  # what `plainrl train` writes before the first step


def read_jsonl_value(v: Any) -> Any:
    """A value as :class:`plainrl.metrics.MetricsLogger` wrote it, back: ``"nan"``/``"inf"``
    /``"-inf"`` -> float (JSON has none). Here rather than imported, so reading a run
    does not import torch."""
    if isinstance(v, str) and v in ("nan", "inf", "-inf"):
        return float(v)
    return v


class RunDirError(ValueError):
    """A path given as a run directory is not one; the message names the path and what is missing."""


@dataclass
class RunData:
    """One run directory's contents.

    train:    metrics rows of training steps (``step`` and the metrics), in step order.
    evals:    rows with ``eval/`` keys (``step``: training steps done when it ran).
    rollouts: ``rollouts.jsonl`` records (prompt, completion, ``segments``, reward parts, ...).
    errors:   ``errors.jsonl`` records (step, sample_id, source, error).
    notes:    what could not be read (a cut last line after a crash, ...).
    """

    path: Path
    name: str
    config: dict[str, Any]
    train: list[dict[str, Any]] = field(default_factory=list)
    evals: list[dict[str, Any]] = field(default_factory=list)
    rollouts: list[dict[str, Any]] = field(default_factory=list)
    errors: list[dict[str, Any]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def series(self, key: str) -> tuple[list[int], list[float]]:
        """``(steps, values)`` of a training metric, finite numbers only."""
        steps, values = [], []
        for row in self.train:
            v = row.get(key)
            if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v):
                steps.append(row["step"])
                values.append(float(v))
        return steps, values

    def metric_names(self) -> list[str]:
        """Numeric training metrics, in first-seen order."""
        seen: dict[str, None] = {}
        for row in self.train:
            for k, v in row.items():
                if k != "step" and isinstance(v, (int, float)) and not isinstance(v, bool):
                    seen.setdefault(k, None)
        return list(seen)

    @property
    def total_steps(self) -> int | None:
        return (self.config.get("train") or {}).get("steps")


def read_jsonl(path: Path, notes: list[str]) -> list[dict[str, Any]]:
    """Records of a JSON Lines file; unreadable lines (a line cut by a crash) are skipped and noted."""
    if not path.is_file():
        return []
    rows, bad = [], []
    for i, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            bad.append(i)
            continue
        if isinstance(row, dict):
            rows.append({k: read_jsonl_value(v) for k, v in row.items()})
        else:
            bad.append(i)
    if bad:
        notes.append(f"{path.name}: {len(bad)} unreadable line(s) skipped (line {', '.join(map(str, bad[:5]))})")
    return rows


def read_run(path: str | Path, name: str | None = None) -> RunData:
    """Read a run directory (what ``plainrl train`` wrote to ``run_dir``).

    Raises:
        RunDirError: ``path`` does not exist, is not a directory, or lacks ``config.yaml``
            or ``metrics.jsonl``; the message names the path and the missing files.
    """
    p = Path(path)
    if not p.exists():
        raise RunDirError(f"{str(p)!r} does not exist; pass a plainrl run directory (the run_dir of a run)")
    if not p.is_dir():
        raise RunDirError(f"{str(p)!r} is a file, not a plainrl run directory (the run_dir of a run)")
    missing = [f for f in REQUIRED if not (p / f).is_file()]
    if missing:
        raise RunDirError(f"{str(p)!r} is not a plainrl run directory: {' and '.join(missing)} "
                          f"{'is' if len(missing) == 1 else 'are'} missing (plainrl train writes "
                          f"{', '.join(REQUIRED)} to run_dir when a run starts)")
    try:
        config = yaml.safe_load((p / "config.yaml").read_text()) or {}
    except yaml.YAMLError as e:
        raise RunDirError(f"{str(p / 'config.yaml')!r} is not valid YAML: {e}") from None
    if not isinstance(config, dict):
        raise RunDirError(f"{str(p / 'config.yaml')!r} does not hold a mapping")
    run = RunData(p, name or p.resolve().name, config)
    for row in read_jsonl(p / "metrics.jsonl", run.notes):
        if "step" not in row:
            continue
        (run.evals if any(k.startswith("eval/") for k in row) else run.train).append(row)
    run.train.sort(key=lambda r: r["step"])
    run.rollouts = read_jsonl(p / "rollouts.jsonl", run.notes)
    run.errors = read_jsonl(p / "errors.jsonl", run.notes)
    return run


def read_runs(paths: list[str | Path]) -> list[RunData]:
    """Several run directories; runs whose directory names clash are named by their parent too."""
    if not paths:
        raise RunDirError("no run directory given")
    names = [Path(p).resolve().name for p in paths]
    out = []
    for p, n in zip(paths, names):
        if names.count(n) > 1:
            n = f"{Path(p).resolve().parent.name}/{n}"
        out.append(read_run(p, n))
    return out


def flatten(d: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """``{"train": {"lr": 1e-5}}`` -> ``{"train.lr": 1e-5}`` (lists stay values)."""
    out: dict[str, Any] = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict) and v:
            out.update(flatten(v, key + "."))
        else:
            out[key] = v
    return out


def config_diff(runs: list[RunData]) -> list[tuple[str, list[Any]]]:
    """The config keys whose values differ between runs (``run_dir`` left out), with each run's value."""
    flat = [flatten(r.config) for r in runs]
    keys = sorted(set().union(*flat) - {"run_dir"})
    missing = object()
    rows = []
    for k in keys:
        values = [f.get(k, missing) for f in flat]
        if any(v != values[0] for v in values[1:]):
            rows.append((k, [None if v is missing else v for v in values]))
    return rows
