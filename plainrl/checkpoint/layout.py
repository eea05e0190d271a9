"""What a checkpoint directory holds and how it is named, and the error every checkpoint
function raises."""

from __future__ import annotations

import re
from pathlib import Path

FORMAT_VERSION = 1
CHECKPOINTS_DIR = "checkpoints"
LATEST = "latest"
MANIFEST = "manifest.json"
WEIGHTS = "weights.safetensors"
MASTER = "master.safetensors"  # only when the optimizer updates fp32 copies of the weights
OPTIMIZER = "optimizer.pt"
SCHEDULER = "scheduler.pt"
RNG = "rng.pt"
STATE = "state.json"
CONFIG = "config.yaml"
REQUIRED_FILES = (WEIGHTS, OPTIMIZER, SCHEDULER, RNG, STATE, CONFIG)
# FSDP2 under torchrun: model and optimizer shards written by torch.distributed.checkpoint
# (its ``.metadata`` and one ``__<rank>_0.distcp`` per rank) in place of weights and optimizer
DCP_METADATA = ".metadata"
DCP_REQUIRED_FILES = (DCP_METADATA, SCHEDULER, RNG, STATE, CONFIG)
TMP_PREFIX = ".tmp-"
ALIASES_KEY = "plainrl.aliases"  # safetensors metadata: tied weight names -> the name stored
_STEP_DIR = re.compile(r"^step-(\d+)$")


class CheckpointError(RuntimeError):
    """A checkpoint cannot be written, found or loaded; the message names the file or field."""


def rank_rng_file(rank: int) -> str:
    """The RNG-state file of ``rank`` under torchrun: rank 0's is ``rng.pt``, as in one process."""
    return RNG if rank == 0 else f"rng-rank{rank}.pt"


def step_dir_name(step: int) -> str:
    """``step-000123``; wider numbers keep all their digits (sorting parses the number)."""
    return f"step-{step:06d}"


def step_of(name: str) -> int | None:
    """The step of a ``step-N`` directory name, None for any other name."""
    m = _STEP_DIR.match(name)
    return int(m.group(1)) if m else None


def read_pointer(root: Path) -> str | None:
    """The directory name in ``root/latest``, None when missing or not a step name."""
    try:
        name = (root / LATEST).read_text().strip()
    except (FileNotFoundError, UnicodeDecodeError):
        return None
    # only a bare step-N name: a pointer must never lead outside checkpoints/
    return name if step_of(name) is not None else None


def complete_checkpoints(root: Path) -> list[tuple[int, Path]]:
    """(step, dir) of every step-* directory with a manifest, newest first (not verified)."""
    out = []
    for p in root.iterdir():
        step = step_of(p.name)
        if step is not None and p.is_dir() and (p / MANIFEST).is_file():
            out.append((step, p))
    return sorted(out, reverse=True)
