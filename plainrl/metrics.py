"""Metric sinks: ``metrics.jsonl`` (one object per step), TensorBoard scalars, sampled
rollouts and unscorable samples' errors as JSON Lines, further sinks such as Weights &
Biases (:class:`MetricsSink`, :mod:`plainrl.tracking`), and a live progress line on the
terminal (rich): each step's headline metrics, its phase split and the ETA, and a
spinner with the elapsed time for long phases between steps (:meth:`MetricsLogger.phase`)."""

from __future__ import annotations

import json
import math
import time
from collections import defaultdict
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator, Protocol

from rich.console import Console

from plainrl.durable import write_atomic
from plainrl.intervals import eval_figures
from plainrl.types import Episode, SampleError


# (metric, label, format) of the per-step progress line; absent metrics are left out
_PROGRESS = (
    ("reward/mean", "reward", ".3f"), ("kl", "kl", ".4f"), ("response_length/mean", "len", ".1f"),
    ("accuracy", "acc", ".3f"), ("loss", "loss", "+.4f"),
)
# short names of StepTimer phases on the progress line; others are shown as named
_PHASES = {"generate": "gen", "reward": "rew", "update": "upd"}


def format_duration(seconds: float) -> str:
    """``42s``, ``5m07s``, ``2h05m``."""
    s = int(round(seconds))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{s % 3600 // 60:02d}m"


def progress_line(step: int, total_steps: int, metrics: dict[str, Any], eta_s: float | None) -> str:
    """One step's status line: headline metrics, the step time split by phase, the ETA.

        step 3/40 reward 0.125 kl 0.0012 len 31.2 | 9.1s: gen 5.2 rew 0.3 upd 3.6 | eta 5m33s
    """
    parts = [f"step {step + 1}/{total_steps}"]
    parts += [f"{label} {metrics[k]:{fmt}}" for k, label, fmt in _PROGRESS if isinstance(metrics.get(k), (int, float))]
    line = " ".join(parts)
    if isinstance(metrics.get("time/step"), (int, float)):
        phases = [f"{_PHASES.get(k[5:], k[5:])} {v:.1f}" for k, v in metrics.items()
                  if k.startswith("time/") and k != "time/step" and isinstance(v, (int, float))]
        line += f" | {metrics['time/step']:.1f}s" + (": " + " ".join(phases) if phases else "")
    if eta_s is not None:
        line += f" | eta {format_duration(eta_s)}"
    return line


class MetricsSink(Protocol):
    """Another destination for what :class:`MetricsLogger` logs (e.g.
    :class:`plainrl.tracking.WandbSink`). Rows are ``metrics.jsonl``'s: train steps and
    ``eval/`` rows, in order, non-finite values as floats."""

    def log(self, step: int, metrics: dict[str, Any]) -> None: ...

    def log_rollouts(self, step: int, records: list[dict[str, Any]]) -> None: ...

    def close(self, final_dir: Path | None = None) -> None:
        """The run ended; ``final_dir``: the saved policy when it finished (None when it stopped early)."""


class StepTimer:
    """Wall-clock seconds of one step's phases, as ``time/<phase>`` metrics; ``time/step``
    runs from construction. A phase entered several times adds up.

        timer = StepTimer()
        with timer("generate"):
            ...
        timer.metrics()  # {"time/generate": 2.5, "time/step": 2.6}
    """

    def __init__(self) -> None:
        self._start = time.perf_counter()
        self.seconds: defaultdict[str, float] = defaultdict(float)

    @contextmanager
    def __call__(self, phase: str) -> Iterator[None]:
        t = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[phase] += time.perf_counter() - t

    def metrics(self) -> dict[str, float]:
        return {**{f"time/{k}": v for k, v in self.seconds.items()}, "time/step": time.perf_counter() - self._start}


def _clean(v: Any) -> Any:
    # JSON has no NaN/inf; write them as strings so a bad step is logged as it is.
    if isinstance(v, float) and not math.isfinite(v):
        return str(v)
    return v


def completion_segments(ep: Episode, tokenizer) -> list[dict[str, Any]]:
    """The completion as runs of policy and environment tokens, for the rollout browser:
    ``[{"text": ..., "policy": True}, {"text": <tool output>, "policy": False}, ...]``
    (``policy``: the loss mask was 1 there). Single-turn episodes, and episodes whose whole
    mask is 0 (``algorithm.overlong_filter``), are one policy segment: nothing there came
    from an environment."""
    if ep.env is None or not any(ep.loss_mask):
        return [{"text": ep.completion_text or tokenizer.decode(ep.completion_ids), "policy": True}]
    segments: list[dict[str, Any]] = []
    start = 0
    for i in range(1, len(ep.completion_ids) + 1):
        if i == len(ep.completion_ids) or ep.loss_mask[i] != ep.loss_mask[start]:
            segments.append({"text": tokenizer.decode(ep.completion_ids[start:i]), "policy": bool(ep.loss_mask[start])})
            start = i
    return segments


def rollout_record(step: int, ep: Episode, tokenizer) -> dict[str, Any]:
    """One line of ``rollouts.jsonl``: prompt, completion and its policy/environment segments,
    the reward and its parts, the advantage (the mean over loss tokens for token-level
    estimators), finish reason, answer, completion tokens, whether any token was trained,
    and the environment's outcome (``env``: reward, error, info such as ``tool_calls``).
    An agent episode of several segments describes its last one (the reward and advantage
    it trained with) and lists the others as ``earlier_segments`` (prompt, completion,
    reward, advantage, finish reason, tokens; each trained as a sample of its own)."""
    env = None if ep.env is None else {"reward": ep.env.reward, "error": ep.env.error, "info": ep.env.info}
    rec = {
        "step": step, "sample_id": ep.sample_id, "group": ep.group, "prompt": tokenizer.decode(ep.prompt_ids),
        "completion": ep.completion_text, "segments": completion_segments(ep, tokenizer),
        "reward": ep.reward, "reward_parts": ep.reward_parts, "advantage": ep.advantage,
        "finish_reason": ep.finish_reason, "answer": ep.row.get("answer"), "tokens": len(ep.completion_ids),
        "trained": any(ep.loss_mask), "env": env,
    }
    if ep.teacher_logprob is not None:  # on-policy distillation: the teacher's summed logprob of the completion
        rec["teacher_logprob"] = ep.teacher_logprob
    if ep.earlier:
        rec["earlier_segments"] = [
            {"prompt": tokenizer.decode(s.prompt_ids), "completion": s.completion_text, "reward": s.reward,
             "advantage": s.advantage, "finish_reason": s.finish_reason, "tokens": len(s.completion_ids)}
            for s in ep.earlier]
    return rec


class MetricsLogger:
    """Writes every step's metrics to all sinks.

    Args:
        run_dir: directory receiving ``metrics.jsonl``, ``rollouts.jsonl``, ``errors.jsonl`` and ``tb/``.
        total_steps: for the ETA.
        tensorboard: also write TensorBoard event files.
        progress: print one status line per step (and eval results).
        ranks: the world size under torchrun, shown on the progress line when > 1.
    """

    def __init__(self, run_dir: str | Path, *, total_steps: int, tensorboard: bool = True, progress: bool = True,
                 ranks: int = 1):
        self.run_dir = Path(run_dir)
        self.ranks = ranks
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.metrics_f = open(self.run_dir / "metrics.jsonl", "a")
        self.rollouts_f = open(self.run_dir / "rollouts.jsonl", "a")
        self.total_steps = total_steps
        # soft_wrap: a line stays one line, however narrow the terminal (rich wraps at 80 columns off one)
        self.console = Console(stderr=True, soft_wrap=True)
        self.progress = progress
        self.tb = None
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self.tb = SummaryWriter(str(self.run_dir / "tb"))
        self.started = time.monotonic()
        self.steps_done = 0
        self.step_times: list[float] = []  # time/step of this session's steps, for the ETA
        self.sinks: list[MetricsSink] = []
        self.closed = False

    def add_sink(self, sink: MetricsSink) -> None:
        """Send everything logged from now on to ``sink`` too, after replaying the rows
        ``metrics.jsonl`` already holds (earlier sessions of a resumed run, eval-before)."""
        self.metrics_f.flush()
        for line in (self.run_dir / "metrics.jsonl").read_text().splitlines():
            row = {k: float(v) if v in ("nan", "inf", "-inf") else v for k, v in json.loads(line).items()}
            sink.log(row.pop("step"), row)
        self.sinks.append(sink)

    @contextmanager
    def phase(self, what: str) -> Iterator[None]:
        """A long phase between steps (a checkpoint save, the report): a spinner with the
        elapsed time on a terminal while it runs, then ``<what>: 2.3s``."""
        t = time.perf_counter()
        if self.progress and self.console.is_terminal:
            with self.console.status(f"{what} ..."):
                yield
        else:
            yield
        if self.progress:
            self.console.print(f"{what}: {time.perf_counter() - t:.1f}s", highlight=False, markup=False)

    def eta_s(self, step: int) -> float | None:
        """Seconds left after step ``step`` (0-based): the mean of the last 10 steps' times
        (this session) times the steps to go; None before a step was timed."""
        if not self.step_times:
            return None
        recent = self.step_times[-10:]
        return sum(recent) / len(recent) * max(0, self.total_steps - step - 1)

    def resume_at(self, step: int) -> None:
        """Drop rows of steps >= ``step`` (logged after the checkpoint, before a crash),
        so a resumed run's files hold each step once. A last line without its newline (the
        crashed process was killed while appending it) is dropped too: it was logged after
        the checkpoint. Each file is replaced whole (:func:`plainrl.durable.write_atomic`)."""
        self.metrics_f.close()
        self.rollouts_f.close()
        for name in ("metrics.jsonl", "rollouts.jsonl", "errors.jsonl"):
            path = self.run_dir / name
            if not path.exists():
                continue
            keep = []
            lines = path.read_text().split("\n")
            for line in lines[:-1]:  # the last piece: "" after a final newline, else a torn row
                if not line.strip():
                    continue
                row = json.loads(line)
                # an eval logged at the checkpoint's own step ran before the save
                if row["step"] < step or (row["step"] == step and any(k.startswith("eval/") for k in row)):
                    keep.append(line)
            # replaced whole: rewritten in place, a kill mid-write would lose the run's history
            write_atomic(path, "".join(r + "\n" for r in keep))
        self.metrics_f = open(self.run_dir / "metrics.jsonl", "a")
        self.rollouts_f = open(self.run_dir / "rollouts.jsonl", "a")

    def log(self, step: int, metrics: dict[str, float]) -> None:
        """Append one step's metrics (``step`` is added) and show the progress line."""
        row = {"step": step, **{k: _clean(v) for k, v in metrics.items()}}
        self.metrics_f.write(json.dumps(row) + "\n")
        self.metrics_f.flush()
        if self.tb is not None:
            for k, v in metrics.items():
                if isinstance(v, (int, float)):
                    self.tb.add_scalar(k, v, step)
            self.tb.flush()
        for sink in self.sinks:
            sink.log(step, metrics)
        self.steps_done += 1
        if isinstance(metrics.get("time/step"), (int, float)):
            self.step_times.append(float(metrics["time/step"]))
        if self.progress:
            line = progress_line(step, self.total_steps, metrics, self.eta_s(step))
            self.console.print(line + (f" | {self.ranks} ranks" if self.ranks > 1 else ""),
                               highlight=False, markup=False, soft_wrap=True)

    def log_eval(self, step: int, metrics: dict[str, float]) -> None:
        """Eval results go to the same files, under ``eval/`` keys."""
        row = {"step": step, **metrics}
        self.metrics_f.write(json.dumps(row) + "\n")
        self.metrics_f.flush()
        if self.tb is not None:
            for k, v in metrics.items():
                self.tb.add_scalar(k, v, step)
        for sink in self.sinks:
            sink.log(step, metrics)
        if self.progress:
            # each figure with its interval, the interval's method and n (plainrl.intervals)
            self.console.print(eval_figures(metrics), highlight=False, markup=False)

    def log_rollouts(self, step: int, episodes: list[Episode], count: int, tokenizer) -> None:
        """Write ``count`` episodes spread over the step's groups (:func:`rollout_record`)."""
        if count <= 0:
            return
        records = [rollout_record(step, ep, tokenizer) for ep in episodes[:: max(1, len(episodes) // count)][:count]]
        for rec in records:
            self.rollouts_f.write(json.dumps(rec, default=str) + "\n")
        self.rollouts_f.flush()
        for sink in self.sinks:
            sink.log_rollouts(step, records)

    def log_errors(self, step: int, errors: list[SampleError]) -> None:
        """Append why samples were unscorable to ``errors.jsonl`` (``step``, ``sample_id``,
        ``source``, ``error``) and print one line naming the first of them."""
        if not errors:
            return
        with open(self.run_dir / "errors.jsonl", "a") as f:
            for e in errors:
                f.write(json.dumps({"step": step, "sample_id": e.sample_id, "source": e.source,
                                    "error": e.message}) + "\n")
        more = f" (+{len(errors) - 1} more)" if len(errors) > 1 else ""
        self.console.print(f"step {step + 1}: {errors[0]}{more}; see {self.run_dir / 'errors.jsonl'}",
                           highlight=False, markup=False)

    def print(self, msg: str) -> None:
        """Notes and warnings: always shown (``progress`` only silences the per-step lines)."""
        self.console.print(msg, highlight=False)

    def close(self, final_dir: Path | None = None) -> None:
        """Close the files and every sink (once; later calls do nothing). ``final_dir``:
        the saved policy, when the run finished (sinks may upload it)."""
        if self.closed:
            return
        self.closed = True
        self.metrics_f.close()
        self.rollouts_f.close()
        if self.tb is not None:
            self.tb.close()
        for sink in self.sinks:
            sink.close(final_dir)
