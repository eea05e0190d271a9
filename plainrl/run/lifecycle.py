"""A run's lifecycle around the loop, shared by the RL and offline trainers: the run
directory, resume checks, seeding, and stopping (at a step boundary on SIGTERM/SIGINT,
or after too many non-finite steps)."""

from __future__ import annotations

import random
import signal
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np
import torch

from plainrl.checkpoint import (
    FATAL_FIELDS, WARN_FIELDS, CheckpointError, check_compatible, find_latest, read_config, resolve_resume,
)
from plainrl.config import Config, dump_config
from plainrl.durable import write_atomic
from plainrl.metrics import MetricsLogger
from plainrl.rollout.event_loop import LoopBlocked, blocked_report


def seed_everything(seed: int) -> None:
    """Seed Python's, NumPy's and torch's global RNGs."""
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def check_resume(cfg: Config, run_dir: Path) -> tuple[Path | None, list[str]]:
    """The checkpoint to resume from (per ``checkpoint.resume``) and warnings about changed fields.

    Raises:
        CheckpointError: the checkpoint's model or LoRA shape differs from this config.
    """
    resume_from = resolve_resume(run_dir, cfg.checkpoint.resume)
    if resume_from is None:
        return None, []
    saved, current = read_config(resume_from), cfg.model_dump(mode="json")
    if fatal := check_compatible(saved, current, fields=FATAL_FIELDS):
        raise CheckpointError(f"cannot resume from {resume_from}:\n  " + "\n  ".join(fatal))
    return resume_from, check_compatible(saved, current, fields=WARN_FIELDS)


class Preempted(Exception):
    """SIGTERM/SIGINT arrived; the run stopped at a step boundary after writing a checkpoint."""

    exit_code = 75  # EX_TEMPFAIL: a scheduler may simply start the same command again

    def __init__(self, step: int, signum: int, checkpoint: Path):
        super().__init__(f"stopped by {signal.Signals(signum).name} after step {step}; checkpoint {checkpoint}")


class Diverged(RuntimeError):
    """``train.max_bad_steps`` optimiser steps in a row had a non-finite loss or gradient norm."""


class GracefulStop:
    """The first SIGTERM/SIGINT asks the loop to stop at the next step boundary; a second
    SIGINT interrupts at once (KeyboardInterrupt), and so does any stop while the episodes'
    event loop is blocked (:class:`~plainrl.rollout.event_loop.LoopBlocked`: the boundary would
    never come). Handlers are restored on exit.

    ``agree``: under torchrun, the largest value over the ranks (``Parallel.max``): a signal
    that reached one rank stops them all at the same boundary (:meth:`requested`). Leaving
    with :class:`Preempted` there, SIGTERM stays ignored: torchrun sends it to the ranks still
    running as soon as one rank exits, and it would kill a rank finishing its own exit (status
    -15 instead of 75, its clean-up cut short) after the checkpoint every rank agreed on."""

    def __init__(self, agree: Callable[[int], int] | None = None):
        self._agree = agree

    def requested(self) -> int | None:
        """The signal asking to stop, or None; under torchrun agreed by all ranks (a
        collective: every rank calls it at every step boundary)."""
        if self._agree is None:
            return self.signum
        return self._agree(self.signum or 0) or None

    def __enter__(self) -> "GracefulStop":
        self.signum: int | None = None
        self._old = {}
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGTERM, signal.SIGINT):
                self._old[sig] = signal.signal(sig, self._handle)
        return self

    def _handle(self, signum, frame) -> None:
        if self.signum is not None and signum == signal.SIGINT:
            raise KeyboardInterrupt
        self.signum = signum
        blocked = blocked_report()
        if blocked is not None:  # the step cannot reach its end: stop now, saying why
            raise LoopBlocked(signum, blocked)

    def __exit__(self, exc_type, *exc) -> None:
        for sig, handler in self._old.items():
            stopping = sig == signal.SIGTERM and self._agree is not None and exc_type is Preempted
            signal.signal(sig, signal.SIG_IGN if stopping else handler)


def open_run(cfg: Config, *, write: bool = True) -> tuple[Path, Path | None, list[str]]:
    """Create ``run_dir``, find the checkpoint to resume from (before anything is
    written over), save the resolved config (``write``: False on ranks other than 0),
    set threads and seeds.

    Returns:
        (run_dir, checkpoint to resume from or None, warnings about changed settings).
    """
    run_dir = Path(cfg.run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    resume_from, resume_warnings = check_resume(cfg, run_dir)
    if write:
        write_atomic(run_dir / "config.yaml", dump_config(cfg))
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    seed_everything(cfg.seed)
    return run_dir, resume_from, resume_warnings


@dataclass
class StepBoundary:
    """What happens between two steps of any training run (RL or offline): stop after
    ``max_bad_steps`` skipped (non-finite) steps in a row, evaluate every ``eval_every``
    steps, checkpoint every ``checkpoint_every`` steps and after the last, and on
    SIGTERM/SIGINT checkpoint and stop."""

    run_dir: Path
    total_steps: int
    max_bad_steps: int
    eval_every: int  # 0: only eval.before/after
    checkpoint_every: int  # 0: never
    bad_steps: int = 0

    @classmethod
    def for_run(cls, cfg: Config, run_dir: Path) -> "StepBoundary":
        return cls(run_dir, cfg.train.total_steps, cfg.train.max_bad_steps, cfg.eval.every, cfg.checkpoint.every)

    def __call__(self, step: int, *, skipped: bool, stop: GracefulStop, logger: MetricsLogger,
                 evaluate: Callable[[], dict[str, float] | None] | None, save: Callable[[int], Path]) -> None:
        """After step ``step`` (0-based) finished; ``evaluate`` is None without held-out rows, and
        returns None when a stop cut it short (nothing is logged).

        Raises:
            Diverged: the run is to stop, its last checkpoint named.
            Preempted: a signal arrived; the checkpoint of this step was written.
        """
        self.bad_steps = self.bad_steps + 1 if skipped else 0
        if self.bad_steps >= self.max_bad_steps:
            raise Diverged(f"step {step}: {self.bad_steps} steps in a row with a non-finite loss or gradient norm "
                           f"(skipped); last good checkpoint: {find_latest(self.run_dir) or 'none'}")
        done = step + 1
        if evaluate is not None and self.eval_every and done % self.eval_every == 0 and done < self.total_steps:
            if (result := evaluate()) is not None:
                logger.log_eval(done, result)
        every = self.checkpoint_every
        signum = stop.requested()
        if signum is not None:
            self.preempt(done, signum=signum, logger=logger, save=save)
        if every and (done % every == 0 or done == self.total_steps):
            with logger.phase(f"checkpoint after step {done}"):
                save(done)

    def preempt(self, done: int, *, signum: int, logger: MetricsLogger, save: Callable[[int], Path]) -> None:
        """A stop arrived after ``done`` steps (at a step boundary, or while step ``done`` waited
        for its batch): checkpoint after ``done`` steps and stop.

        Raises:
            Preempted: always, the checkpoint written.
        """
        with logger.phase(f"checkpoint after step {done}"):
            path = save(done)
        logger.close()
        raise Preempted(done, signum, path)


def attach_trackers(cfg: Config, run_dir: Path, logger: MetricsLogger) -> None:
    """Send the run's metrics and rollouts to the trackers of ``log`` too (``log.wandb``);
    rows already in ``metrics.jsonl`` (eval-before, earlier sessions) are replayed to them.

    Raises:
        ConfigError: a tracker's library is not installed.
    """
    if cfg.log.wandb is not None:
        from plainrl.tracking import WandbSink

        logger.add_sink(WandbSink(cfg.log.wandb, cfg.model_dump(mode="json"), run_dir))


def finish_run(cfg: Config, run_dir: Path, logger: MetricsLogger) -> None:
    """After the final save: close the logger and trackers (which may upload ``final/``),
    then with ``log.report`` write ``run_dir/report.html`` and print its path."""
    logger.close(final_dir=run_dir / "final")
    if cfg.log.report:
        from plainrl.report import write_report

        with logger.phase("writing the report"):
            path = write_report([run_dir], run_dir / "report.html")
        logger.print(f"report: {path}")
