"""A run's lifecycle around the loop, shared by the RL and offline trainers: the run
directory, resume checks, seeding, and stopping (at a step boundary on SIGTERM/SIGINT,
or after too many non-finite steps)."""

from __future__ import annotations

import random
import signal
import threading
from pathlib import Path

import numpy as np
import torch

from plainrl.checkpoint import (
    FATAL_FIELDS, WARN_FIELDS, CheckpointError, check_compatible, read_config, resolve_resume,
)
from plainrl.config import Config, dump_config


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
    SIGINT interrupts at once (KeyboardInterrupt). Handlers are restored on exit."""

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

    def __exit__(self, *exc) -> None:
        for sig, handler in self._old.items():
            signal.signal(sig, handler)


def open_run(cfg: Config) -> tuple[Path, Path | None, list[str]]:
    """Create ``run_dir``, find the checkpoint to resume from (before anything is
    written over), save the resolved config, set threads and seeds.

    Returns:
        (run_dir, checkpoint to resume from or None, warnings about changed settings).
    """
    run_dir = Path(cfg.run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    resume_from, resume_warnings = check_resume(cfg, run_dir)
    (run_dir / "config.yaml").write_text(dump_config(cfg))
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    seed_everything(cfg.seed)
    return run_dir, resume_from, resume_warnings
