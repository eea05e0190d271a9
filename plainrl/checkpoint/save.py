"""save_checkpoint: write a checkpoint atomically, commit it through ``latest``, then
apply retention and remove what interrupted saves left."""

from __future__ import annotations

import json
import logging
import os
import re
import secrets
import shutil
import time
from pathlib import Path
from typing import Any

import psutil
import torch

from plainrl.checkpoint.files import fsync_path, manifest_files, remove_dir, torch_save, write_bytes
from plainrl.checkpoint.layout import (
    ALIASES_KEY, CHECKPOINTS_DIR, CONFIG, FORMAT_VERSION, LATEST, MANIFEST, MASTER, OPTIMIZER, REQUIRED_FILES, RNG,
    SCHEDULER, STATE, TMP_PREFIX, WEIGHTS, CheckpointError, complete_checkpoints, read_pointer, step_dir_name,
)
from plainrl.checkpoint.rng import get_rng_state
from plainrl.checkpoint.weights import check_finite, master_pairs, weights_to_save
from plainrl.durable import remove_stale_siblings, replace_dir, write_atomic

log = logging.getLogger(__name__)


def _clean_stale_tmp(root: Path, started: float) -> None:
    for p in root.iterdir():
        if not p.name.startswith(TMP_PREFIX) or not p.is_dir():
            continue
        try:
            if p.stat().st_mtime >= started:
                continue  # newer than this save: maybe another live writer
        except FileNotFoundError:
            continue
        m = re.search(r"-(\d+)-[0-9a-f]+$", p.name)
        pid = int(m.group(1)) if m else None
        if pid is not None and pid != os.getpid() and psutil.pid_exists(pid):
            continue
        log.info("removing %s, left by an interrupted save", p)
        shutil.rmtree(p, ignore_errors=True)


def _apply_retention(root: Path, keep_last: int | None, newest: Path) -> None:
    if keep_last is None:
        return
    protected = {newest.name, read_pointer(root)}
    complete = complete_checkpoints(root)
    if complete:
        protected.add(complete[0][1].name)
    for _, p in complete[keep_last:]:
        if p.name not in protected:
            log.info("removing old checkpoint %s (keep_last=%d)", p, keep_last)
            remove_dir(p)


def save_checkpoint(
    run_dir: str | Path,
    step: int,
    *,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: Any,
    sampler_state: dict[str, Any],
    generator: torch.Generator | None,
    config_yaml: str,
    extra: dict[str, Any] | None = None,
    blobs: dict[str, bytes] | None = None,
    keep_last: int | None = 3,
    save_optimizer: bool = True,
    rng_state: dict[str, Any] | None = None,
) -> Path:
    """Write ``run_dir/checkpoints/step-<step>/`` atomically and point ``latest`` at it.

    Saved: the trainable weights (the LoRA adapter under peft, else every parameter
    and persistent buffer, tied tensors once), the fp32 master weights when the
    optimizer updates copies of the parameters (Learner on a bf16 model), optimizer
    and scheduler state, the RNG states (python, numpy, torch CPU, every CUDA device,
    ``generator``), the sampler state, ``step``, ``extra``, the config YAML, and a
    manifest with the sha256 and size of every file. Then checkpoints beyond the newest ``keep_last`` complete ones
    are deleted (never the one just written), as are ``.tmp-*`` directories that
    interrupted saves left behind.

    A directory already named ``step-<step>`` (written but never committed by a
    process killed after the rename, or a second save at the same step) is replaced.

    Args:
        run_dir: the run directory (``checkpoints/`` is created inside).
        step: optimiser steps completed; resuming continues at this step.
        model: the policy (a peft model under LoRA).
        optimizer: ``learner.optimizer``; its parameters must be the model's own or
            master copies of its trainable parameters in ``model.parameters()`` order.
        scheduler: its ``state_dict()`` is saved.
        sampler_state: ``PromptSampler.state_dict()`` (JSON-serialisable).
        generator: the sampling generator, or None.
        config_yaml: ``dump_config(cfg)``.
        extra: anything else JSON-serialisable to get back on resume.
        blobs: file name -> bytes, files of the run's own to get back on resume
            (``CheckpointState.blobs``), e.g. the next step's batch under ``rollout.async_steps``
            or the RNG states of the other ranks under torchrun (``rng-rank1.pt``).
        keep_last: complete checkpoints to keep (>= 1), None keeps all.
        save_optimizer: False (``checkpoint.save_optimizer``) leaves ``optimizer.pt`` out and
            records that in the manifest (``"optimizer": false``), which :func:`verify` then does
            not require; resuming restarts the optimizer state (:func:`load_checkpoint` warns).
            The fp32 master weights are still saved: they are the weights, not optimizer state.
        rng_state: :func:`~plainrl.checkpoint.rng.get_rng_state`'s value taken earlier, saved instead
            of the live RNG states (``rollout.async_steps``: those from when an abandoned batch
            started); None: the states now.
    Returns:
        the checkpoint directory.
    Raises:
        CheckpointError: a saved weight is NaN/inf (nothing is written), the
            optimizer's parameters cannot be matched to the model's, ``extra`` or
            ``sampler_state`` is not JSON-serialisable, or writing failed (the temporary
            directory is removed; the previous checkpoint is untouched).
        ValueError: ``step < 0`` or ``keep_last < 1``.
    """
    if step < 0:
        raise ValueError(f"step must be >= 0, got {step}")
    if keep_last is not None and keep_last < 1:
        raise ValueError(f"keep_last must be >= 1 (or None to keep all), got {keep_last}")
    started = time.time()
    kind, tensors, aliases = weights_to_save(model)
    check_finite(tensors)
    masters = {n: m.detach().to("cpu").contiguous() for n, _, m in master_pairs(model, optimizer)}
    check_finite(masters)
    blobs = blobs or {}
    reserved = set(REQUIRED_FILES) | {MASTER, MANIFEST}
    bad = [n for n in blobs if n in reserved or "/" in n or n.startswith(".")]
    if bad:
        raise ValueError(f"blob names {bad} clash with the checkpoint's own files or are not plain names")
    required = REQUIRED_FILES if save_optimizer else tuple(n for n in REQUIRED_FILES if n != OPTIMIZER)
    files = required + ((MASTER,) if masters else ()) + tuple(blobs)
    try:
        state_json = json.dumps({
            "format_version": FORMAT_VERSION, "step": step, "weights": kind,
            "sampler": sampler_state, "extra": extra or {}, "blobs": sorted(blobs),
            "torch_version": torch.__version__, "saved_unix": started,
        }, indent=1)
    except (TypeError, ValueError) as e:
        raise CheckpointError(f"sampler_state and extra must be JSON-serialisable: {e}") from e

    root = Path(run_dir) / CHECKPOINTS_DIR
    root.mkdir(parents=True, exist_ok=True)
    name = step_dir_name(step)
    final = root / name
    tmp = root / f"{TMP_PREFIX}{name}-{os.getpid()}-{secrets.token_hex(4)}"
    tmp.mkdir()
    try:
        from safetensors.torch import save_file

        save_file(tensors, str(tmp / WEIGHTS), metadata={ALIASES_KEY: json.dumps(aliases), "weights": kind})
        fsync_path(tmp / WEIGHTS)
        del tensors
        if masters:
            save_file(masters, str(tmp / MASTER))
            fsync_path(tmp / MASTER)
        if save_optimizer:
            torch_save(optimizer.state_dict(), tmp / OPTIMIZER)
        torch_save(scheduler.state_dict(), tmp / SCHEDULER)
        torch_save(rng_state if rng_state is not None else get_rng_state(generator), tmp / RNG)
        for blob_name, data in blobs.items():
            write_bytes(tmp / blob_name, data)
        write_bytes(tmp / STATE, state_json.encode())
        write_bytes(tmp / CONFIG, config_yaml.encode())
        manifest = {"format_version": FORMAT_VERSION, "step": step, "optimizer": save_optimizer,
                    "files": manifest_files(tmp, files)}
        # the manifest is written last: its presence marks the directory complete
        write_bytes(tmp / MANIFEST, json.dumps(manifest, indent=1).encode())
    except BaseException as e:
        shutil.rmtree(tmp, ignore_errors=True)
        if isinstance(e, OSError):
            raise CheckpointError(f"could not write checkpoint {final}: {e}") from e
        raise
    commit(tmp, step, keep_last=keep_last, started=started)
    return final


def commit(tmp: Path, step: int, *, keep_last: int | None, started: float) -> Path:
    """Make the complete checkpoint directory ``tmp`` (its manifest written last) the
    checkpoint of ``step``: rename it to ``step-<step>`` and point ``latest`` at it (the
    commit point), then apply ``keep_last`` and remove what interrupted saves left.

    Raises:
        CheckpointError: the rename failed (``tmp`` is removed; the previous checkpoint is untouched).
    """
    root = tmp.parent
    name = step_dir_name(step)
    final = root / name
    try:
        if final.exists():  # never committed (killed after the rename) or saved twice at one step
            log.warning("replacing existing checkpoint directory %s", final)
        replace_dir(tmp, final)  # fsynced, renamed (swapped in whole over an existing one), directory fsynced
    except BaseException as e:
        shutil.rmtree(tmp, ignore_errors=True)
        if isinstance(e, OSError):
            raise CheckpointError(f"could not write checkpoint {final}: {e}") from e
        raise
    remove_stale_siblings(root / LATEST)  # a pointer's temporary that a killed commit left
    write_atomic(root / LATEST, name + "\n")  # the commit point
    _apply_retention(root, keep_last, final)
    _clean_stale_tmp(root, started)
    return final
