"""Checkpoints of a run under ``torchrun``: every rank calls :func:`save_ranked` /
:func:`load_ranked`; the layout, manifest and ``latest`` commit point are those of one
process (:mod:`plainrl.checkpoint.save`).

- DDP: every rank holds the same weights, so rank 0 writes the usual checkpoint
  (``weights.safetensors``, ``optimizer.pt``, ...) with every rank's RNG states beside its
  own (``rng-rank<r>.pt``); every rank loads it.
- FSDP2: the model's and optimizer's shards are written by ``torch.distributed.checkpoint``
  (DCP: ``.metadata`` and one ``__<rank>_0.distcp`` per rank, written in parallel; under
  LoRA the trainable adapter only), then rank 0 adds the scheduler, RNG, state and config
  files and the manifest and commits. DCP reshards on load, so a run may resume on another
  number of ranks.

Resuming at the same world size is exact (each rank gets its RNG states back). At another
world size the data position is still exact (the sampler's state is global) but the
per-rank sampling streams are not: every rank takes rank 0's global RNG states and a fresh
sampling generator, and a warning says so.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from plainrl.checkpoint.files import manifest_files, torch_bytes, torch_load, torch_save, verify, write_bytes
from plainrl.checkpoint.layout import (
    CHECKPOINTS_DIR, CONFIG, FORMAT_VERSION, MANIFEST, RNG, SCHEDULER, STATE, TMP_PREFIX, CheckpointError,
    rank_rng_file, step_dir_name,
)
from plainrl.checkpoint.load import CheckpointState, load_checkpoint, optimizer_restarts
from plainrl.checkpoint.rng import get_rng_state, set_rng_state
from plainrl.checkpoint.save import commit, save_checkpoint

DCP_KIND = "dcp"  # state.json "weights" of a sharded checkpoint


def _from_rank0(value: Any) -> Any:
    """Rank 0's ``value`` on every rank; an exception there is raised on every rank."""
    box = [value]
    dist.broadcast_object_list(box, src=0)
    if isinstance(box[0], BaseException):
        raise box[0]
    return box[0]


def _dcp_options(*, strict: bool = True):
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    # LoRA: the adapter only, as one process saves; loading it leaves the frozen base as loaded
    # (DCP itself fails on a trainable key the checkpoint lacks)
    return StateDictOptions(ignore_frozen_params=True, strict=strict)


def save_ranked(run_dir: str | Path, step: int, *, strategy: str, model: torch.nn.Module,
                optimizer: torch.optim.Optimizer, scheduler: Any, sampler_state: dict[str, Any],
                generator: torch.Generator | None, config_yaml: str, keep_last: int | None = 3,
                extra: dict[str, Any] | None = None, save_optimizer: bool = True) -> Path:
    """:func:`~plainrl.checkpoint.save_checkpoint` for a run under torchrun; every rank calls it
    at the same step and gets the committed directory back (after the commit).

    Args:
        strategy: ``ddp`` or ``fsdp2`` (``train.strategy``).
        model: the policy (the unwrapped model: its parameters are DTensors under FSDP2).
        others: as :func:`~plainrl.checkpoint.save_checkpoint`.
    Raises:
        CheckpointError: as :func:`~plainrl.checkpoint.save_checkpoint`, on every rank.
    """
    world = dist.get_world_size()
    rngs: list[Any] = [None] * world
    dist.all_gather_object(rngs, get_rng_state(generator))
    extra = {**(extra or {}), "world_size": world, "strategy": strategy}
    others = {rank_rng_file(r): torch_bytes(rngs[r]) for r in range(1, world)}
    if strategy == "ddp":
        out: Any = None
        if dist.get_rank() == 0:
            try:
                out = str(save_checkpoint(run_dir, step, model=model, optimizer=optimizer, scheduler=scheduler,
                                          sampler_state=sampler_state, generator=generator, config_yaml=config_yaml,
                                          extra=extra, keep_last=keep_last, blobs=others,
                                          save_optimizer=save_optimizer))
            except Exception as e:  # noqa: BLE001 - every rank raises it
                out = e
        return Path(_from_rank0(out))
    return _save_dcp(Path(run_dir), step, model=model, optimizer=optimizer, scheduler=scheduler, rngs=rngs,
                     state={"sampler": sampler_state, "extra": extra}, config_yaml=config_yaml, keep_last=keep_last,
                     save_optimizer=save_optimizer)


def _save_dcp(run_dir: Path, step: int, *, model, optimizer, scheduler, rngs: list[Any], state: dict[str, Any],
              config_yaml: str, keep_last: int | None, save_optimizer: bool) -> Path:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    started = time.time()
    root = run_dir / CHECKPOINTS_DIR
    tmp: Any = None
    if dist.get_rank() == 0:
        root.mkdir(parents=True, exist_ok=True)
        tmp = root / f"{TMP_PREFIX}{step_dir_name(step)}-{os.getpid()}-{secrets.token_hex(4)}"
        tmp.mkdir()
    tmp = Path(_from_rank0(tmp))
    model_sd, optim_sd = get_state_dict(model, optimizer, options=_dcp_options())
    local = [v.to_local() if hasattr(v, "to_local") else v for v in model_sd.values()]
    on = "cuda" if dist.get_backend() == "nccl" else "cpu"  # NCCL reduces CUDA tensors only
    bad = torch.tensor([float(any(t.is_floating_point() and not bool(torch.isfinite(t).all()) for t in local))],
                       device=on)
    dist.all_reduce(bad, op=dist.ReduceOp.MAX)
    if bad.item():
        if dist.get_rank() == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        raise CheckpointError("refusing to save a checkpoint: non-finite (NaN/inf) weights; "
                              "the previous checkpoint is kept as it was")
    dcp.save({"model": model_sd, "optimizer": optim_sd} if save_optimizer else {"model": model_sd},
             checkpoint_id=str(tmp))
    out: Any = None
    if dist.get_rank() == 0:
        try:
            torch_save(scheduler.state_dict(), tmp / SCHEDULER)
            for r, rng in enumerate(rngs):
                torch_save(rng, tmp / rank_rng_file(r))
            write_bytes(tmp / STATE, json.dumps({
                "format_version": FORMAT_VERSION, "step": step, "weights": DCP_KIND, **state,
                "torch_version": torch.__version__, "saved_unix": started}, indent=1).encode())
            write_bytes(tmp / CONFIG, config_yaml.encode())
            names = sorted(p.name for p in tmp.iterdir())
            manifest = {"format_version": FORMAT_VERSION, "step": step, "layout": DCP_KIND,
                        "optimizer": save_optimizer, "files": manifest_files(tmp, names)}
            write_bytes(tmp / MANIFEST, json.dumps(manifest, indent=1).encode())  # last: marks it complete
            out = str(commit(tmp, step, keep_last=keep_last, started=started))
        except Exception as e:  # noqa: BLE001 - every rank raises it
            shutil.rmtree(tmp, ignore_errors=True)
            out = e if isinstance(e, CheckpointError) else CheckpointError(f"could not write checkpoint: {e}")
    return Path(_from_rank0(out))


def load_ranked(ckpt_dir: str | Path, *, strategy: str, model: torch.nn.Module,
                optimizer: torch.optim.Optimizer | None, scheduler: Any, generator: torch.Generator | None,
                generator_seed: int, restore_rng: bool = True) -> tuple[CheckpointState, list[str]]:
    """Restore a checkpoint on every rank (rank 0 verifies the manifest for all).

    Args:
        strategy: ``train.strategy`` of this run; a checkpoint from the other layout is refused.
        generator_seed: seeds this rank's sampling generator when the checkpoint holds no
            state for it (another world size).
        others: as :func:`~plainrl.checkpoint.load_checkpoint`.
    Returns:
        ``(state, warnings)``: warnings name what a different world size changes.
    Raises:
        CheckpointError: verification failed, or the checkpoint was written under the
            other strategy (the message says which to use).
    """
    ckpt_dir = Path(ckpt_dir)
    rank, world = dist.get_rank(), dist.get_world_size()
    checked: Any = None
    if rank == 0:
        try:
            verify(ckpt_dir)
        except CheckpointError as e:
            checked = e
    _from_rank0(checked)
    state = json.loads((ckpt_dir / STATE).read_text())
    kind, saved_world = state.get("weights"), int((state.get("extra") or {}).get("world_size", 1))
    if (kind == DCP_KIND) != (strategy == "fsdp2"):
        wanted = "fsdp2" if kind == DCP_KIND else "ddp"
        raise CheckpointError(f"{ckpt_dir} was written {'sharded by FSDP2' if kind == DCP_KIND else 'whole'}; "
                              f"resume it with train.strategy={wanted}")
    if kind == DCP_KIND:
        result = _load_dcp(ckpt_dir, state, model=model, optimizer=optimizer, scheduler=scheduler)
    else:
        result = load_checkpoint(ckpt_dir, model=model, optimizer=optimizer, scheduler=scheduler, restore_rng=False,
                                 verified=True)
    warnings = list(result.warnings)
    if restore_rng:
        own = ckpt_dir / rank_rng_file(rank)
        if saved_world == world and own.is_file():
            set_rng_state(torch_load(own), generator, ckpt_dir)
        else:
            set_rng_state(torch_load(ckpt_dir / RNG), None, ckpt_dir)
            if generator is not None:
                generator.manual_seed(generator_seed)
            warnings.append(f"{ckpt_dir} was saved by {saved_world} rank(s), this run has {world}: the data "
                            "position is global and continues exactly; each rank's sampling generator starts afresh")
    return result, warnings


def _load_dcp(ckpt_dir: Path, state: dict[str, Any], *, model, optimizer, scheduler) -> CheckpointState:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_model_state_dict, set_state_dict

    saved_optimizer = json.loads((ckpt_dir / MANIFEST).read_text()).get("optimizer", True)
    model_sd, optim_sd = get_state_dict(model, optimizer, options=_dcp_options())
    with_optimizer = optimizer is not None and saved_optimizer
    target = {"model": model_sd, "optimizer": optim_sd} if with_optimizer else {"model": model_sd}
    try:
        dcp.load(target, checkpoint_id=str(ckpt_dir))
    except Exception as e:  # DCP raises CheckpointException naming the missing or mismatched keys
        raise CheckpointError(f"{ckpt_dir}: the sharded state does not fit this model/optimizer "
                              f"(a different model or LoRA setting?): {e}") from e
    if with_optimizer:
        set_state_dict(model, optimizer, model_state_dict=model_sd, optim_state_dict=optim_sd,
                       options=_dcp_options(strict=False))
    else:
        set_model_state_dict(model, model_sd, options=_dcp_options(strict=False))
    if scheduler is not None:
        scheduler.load_state_dict(torch_load(ckpt_dir / SCHEDULER))
    step = int(state["step"])
    return CheckpointState(path=ckpt_dir, step=step, sampler_state=state.get("sampler") or {},
                           extra=state.get("extra") or {}, config_yaml=(ckpt_dir / CONFIG).read_text(),
                           warnings=[optimizer_restarts(ckpt_dir, step)] if optimizer is not None and not saved_optimizer
                           else [])
