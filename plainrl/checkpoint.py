"""Resumable training checkpoints: atomic on disk, checksummed, loaded with safe loaders only.

    path = save_checkpoint(run_dir, step, model=..., optimizer=..., scheduler=...,
                           sampler_state=sampler.state_dict(), generator=generator,
                           config_yaml=dump_config(cfg), keep_last=3)
    ckpt = resolve_resume(run_dir, "auto")          # None: start from scratch
    if ckpt is not None:
        state = load_checkpoint(ckpt, model=..., optimizer=..., scheduler=..., generator=generator)
        sampler.load_state_dict(state.sampler_state)

Layout (see docs/checkpointing.md)::

    run_dir/checkpoints/
        latest                  # one line: "step-000123" (the commit point)
        step-000123/
            weights.safetensors # LoRA adapter only, or every parameter (tied ones once)
            master.safetensors  # fp32 master weights, when the optimizer updates copies (bf16)
            optimizer.pt        # optimizer.state_dict()
            scheduler.pt        # scheduler.state_dict()
            rng.pt              # python, numpy, torch CPU/CUDA, sampling generator
            state.json          # step, sampler state, extra, weights kind
            config.yaml         # the resolved config of the run that wrote it
            manifest.json       # sha256 + size of every file above; written last

A checkpoint directory is written under ``.tmp-*``, fsynced, renamed into place and
only then named by ``latest``; a process killed at any point leaves the previous
checkpoint loadable. ``.pt`` files are read with ``torch.load(weights_only=True)``, so
a checkpoint cannot run code when loaded.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import random
import re
import secrets
import shutil
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping

import numpy as np
import torch

log = logging.getLogger(__name__)

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
TMP_PREFIX = ".tmp-"
_STEP_DIR = re.compile(r"^step-(\d+)$")
_ALIASES_KEY = "plainrl.aliases"

# Points at which save_checkpoint calls the fault hook, in order. Each stage is
# reported right after the step it names is done ("rename": the directory has its
# final name but `latest` still names the previous one).
FAULT_STAGES = ("weights", "optimizer", "manifest", "rename", "pointer", "retention")

# Test hook: called with each stage name. Tests set it in a forked child to SIGKILL
# the process mid-save. PLAINRL_CHECKPOINT_FAULT=<stage> does the same from outside
# (for end-to-end tests of the CLI), without code changes.
_FAULT_HOOK: Callable[[str], None] | None = None

# Fields whose change between the checkpoint and this run breaks resume.
# FATAL: the saved weights/optimizer do not fit, or would silently sit on another base model.
FATAL_FIELDS = ("model.name", "model.lora.enabled", "model.lora.r", "model.lora.target_modules")
# WARN: loading works, but the run is no longer the experiment that was started
# (a different seed also makes PromptSampler.load_state_dict refuse the data position).
WARN_FIELDS = ("seed", "rollout.group_size", "rollout.prompts_per_step", "algorithm.name", "model.quantization")
RESUME_FIELDS = FATAL_FIELDS + WARN_FIELDS


class CheckpointError(RuntimeError):
    """A checkpoint cannot be written, found or loaded; the message names the file or field."""


@dataclass
class CheckpointState:
    """What :func:`load_checkpoint` returns besides what it restores in place.

    Attributes:
        path: the checkpoint directory.
        step: the ``step`` given to :func:`save_checkpoint`.
        sampler_state: the ``sampler_state`` given to :func:`save_checkpoint`.
        extra: the ``extra`` given to :func:`save_checkpoint` (``{}`` when None).
        config_yaml: the resolved config YAML of the run that saved it.
    """

    path: Path
    step: int
    sampler_state: dict[str, Any]
    extra: dict[str, Any] = field(default_factory=dict)
    config_yaml: str = ""

    @property
    def config(self) -> dict[str, Any]:
        """``config_yaml`` parsed (for :func:`check_compatible`)."""
        import yaml

        return yaml.safe_load(self.config_yaml) or {}


# ----------------------------------------------------------------------------- helpers


def _fault(stage: str) -> None:
    if _FAULT_HOOK is not None:
        _FAULT_HOOK(stage)
    if os.environ.get("PLAINRL_CHECKPOINT_FAULT") == stage:
        os.kill(os.getpid(), signal.SIGKILL)


def step_dir_name(step: int) -> str:
    """``step-000123``; wider numbers keep all their digits (sorting parses the number)."""
    return f"step-{step:06d}"


def _step_of(name: str) -> int | None:
    m = _STEP_DIR.match(name)
    return int(m.group(1)) if m else None


def _fsync_path(path: Path) -> None:
    # Opening read-only is enough for fsync on Linux, for files and directories alike.
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_bytes(path: Path, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def _torch_save(obj: Any, path: Path) -> None:
    with open(path, "wb") as f:
        torch.save(obj, f)
        f.flush()
        os.fsync(f.fileno())


def _torch_load(path: Path) -> Any:
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # the unpickler raises many types for unexpected content
        raise CheckpointError(f"{path}: cannot be read with torch.load(weights_only=True): {e}") from e


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _is_peft(model: torch.nn.Module) -> bool:
    try:
        from peft import PeftModel
    except ImportError:  # peft is a dependency, but a full fine-tune should not need it
        return False
    return isinstance(model, PeftModel)


def _weights_to_save(model: torch.nn.Module) -> tuple[str, dict[str, torch.Tensor], dict[str, str]]:
    """(kind, tensors, aliases): tensors safetensors can write, aliases name tied copies.

    safetensors refuses tensors that share memory; tied weights (embed_tokens /
    lm_head) are the same tensor under two names, so the second name is stored as
    an alias of the first and restored on load.
    """
    if _is_peft(model):
        from peft import get_peft_model_state_dict

        kind, sd = "lora", get_peft_model_state_dict(model)
    else:
        kind, sd = "full", model.state_dict()
    tensors: dict[str, torch.Tensor] = {}
    aliases: dict[str, str] = {}
    seen: dict[tuple, str] = {}
    storages: set[int] = set()
    for name, t in sd.items():
        t = t.detach()
        key = (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), t.stride(), t.dtype, t.device)
        if t.numel() and key in seen:
            aliases[name] = seen[key]
            continue
        ptr = t.untyped_storage().data_ptr()
        if t.numel() and ptr in storages:
            t = t.clone()  # overlaps another tensor without being the same view: store a copy
        storages.add(t.untyped_storage().data_ptr())
        seen[key] = name
        tensors[name] = t.to("cpu").contiguous()
    return kind, tensors, aliases


def _master_pairs(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> list[tuple[str, torch.nn.Parameter, torch.Tensor]]:
    """(name, model parameter, optimizer parameter) for every trainable parameter the
    optimizer updates through a separate master copy.

    Learner keeps fp32 master copies of bf16 parameters and gives those to AdamW,
    aligned with ``model.parameters()`` order. The masters are the precise weights:
    without them a resume would restart from bf16-rounded values, and a Learner built
    before loading would keep stale masters and overwrite the loaded weights at its
    next step.
    """
    opt_params = [p for g in optimizer.param_groups for p in g["params"]]
    own = {id(p) for p in model.parameters()}
    if all(id(m) in own for m in opt_params):
        return []
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    if len(opt_params) != len(named) or any(m.shape != p.shape for (_, p), m in zip(named, opt_params)):
        raise CheckpointError(
            "the optimizer's parameters are neither the model's own nor master copies of its trainable "
            "parameters in model.parameters() order; cannot tell which weights it updates"
        )
    return [(n, p, m) for (n, p), m in zip(named, opt_params) if m is not p]


def _check_finite(tensors: Mapping[str, torch.Tensor]) -> None:
    bad = [n for n, t in tensors.items() if t.is_floating_point() and not bool(torch.isfinite(t).all())]
    if bad:
        shown = ", ".join(bad[:5]) + (f" and {len(bad) - 5} more" if len(bad) > 5 else "")
        raise CheckpointError(
            f"refusing to save a checkpoint: non-finite (NaN/inf) values in {shown}; "
            "the previous checkpoint is kept as it was"
        )


def _rng_state(generator: torch.Generator | None) -> dict[str, Any]:
    version, internal, gauss = random.getstate()
    np_name, np_keys, np_pos, np_has_gauss, np_gauss = np.random.get_state()
    state: dict[str, Any] = {
        "python": {"version": version, "state": list(internal), "gauss_next": gauss},
        # int64: torch's safe unpickler takes tensors, not numpy arrays
        "numpy": {"name": np_name, "keys": torch.from_numpy(np_keys.astype(np.int64)), "pos": int(np_pos),
                  "has_gauss": int(np_has_gauss), "cached_gaussian": float(np_gauss)},
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
    }
    if generator is not None:
        state["generator"] = generator.get_state()
        state["generator_device"] = str(generator.device)
    return state


def _restore_rng(state: Mapping[str, Any], generator: torch.Generator | None, path: Path) -> None:
    try:
        py = state["python"]
        random.setstate((py["version"], tuple(py["state"]), py["gauss_next"]))
        npst = state["numpy"]
        np.random.set_state((npst["name"], npst["keys"].numpy().astype(np.uint32), npst["pos"],
                             npst["has_gauss"], npst["cached_gaussian"]))
        torch.set_rng_state(state["torch"])
    except (KeyError, TypeError, ValueError, RuntimeError) as e:
        raise CheckpointError(f"{path / RNG}: bad RNG state ({type(e).__name__}: {e})") from e
    cuda = state.get("cuda") or []
    if cuda and torch.cuda.is_available():
        n = min(len(cuda), torch.cuda.device_count())
        if n < len(cuda):
            log.warning("checkpoint has CUDA RNG states for %d devices, this machine has %d; restoring %d",
                        len(cuda), torch.cuda.device_count(), n)
        for i in range(n):
            torch.cuda.set_rng_state(cuda[i], i)
    elif cuda:
        log.warning("checkpoint %s holds CUDA RNG states but CUDA is not available; not restored", path)
    if generator is not None:
        if "generator" not in state:
            raise CheckpointError(f"{path / RNG}: no sampling generator state was saved")
        try:
            generator.set_state(state["generator"])
        except RuntimeError as e:
            raise CheckpointError(
                f"{path / RNG}: the sampling generator state (saved on {state.get('generator_device')}) "
                f"does not fit this generator on {generator.device}: {e}"
            ) from e


# ----------------------------------------------------------------------------- manifest


def _manifest_files(directory: Path, names: Iterable[str]) -> dict[str, dict[str, Any]]:
    return {n: {"size": (directory / n).stat().st_size, "sha256": _sha256(directory / n)} for n in names}


def _read_manifest(ckpt_dir: Path) -> dict[str, Any]:
    path = ckpt_dir / MANIFEST
    if not path.is_file():
        raise CheckpointError(f"{ckpt_dir}: {MANIFEST} is missing (an incomplete checkpoint)")
    try:
        manifest = json.loads(path.read_text())
        files = manifest["files"]
        if not isinstance(files, dict):
            raise TypeError("'files' is not a mapping")
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise CheckpointError(f"{path}: unreadable manifest ({type(e).__name__}: {e})") from e
    if manifest.get("format_version") != FORMAT_VERSION:
        raise CheckpointError(
            f"{path}: format_version {manifest.get('format_version')!r}, this plainrl reads {FORMAT_VERSION}"
        )
    return manifest


def verify(ckpt_dir: str | Path) -> dict[str, Any]:
    """Recompute the size and sha256 of every file the manifest lists.

    Args:
        ckpt_dir: a ``checkpoints/step-*`` directory.
    Returns:
        the parsed manifest.
    Raises:
        CheckpointError: the manifest is missing, unreadable or lacks a required file,
            or a file is missing, truncated/extended (size mismatch) or altered (sha256
            mismatch); the message names the file.
    """
    ckpt_dir = Path(ckpt_dir)
    manifest = _read_manifest(ckpt_dir)
    files = manifest["files"]
    unlisted = [n for n in REQUIRED_FILES if n not in files]
    if unlisted:
        raise CheckpointError(f"{ckpt_dir / MANIFEST}: does not list {', '.join(unlisted)}")
    for name, entry in files.items():
        if "/" in name or "\\" in name or name in ("", ".", ".."):
            raise CheckpointError(f"{ckpt_dir / MANIFEST}: file name {name!r} is not a plain name")
        path = ckpt_dir / name
        if not path.is_file():
            raise CheckpointError(f"{path}: missing (listed in {MANIFEST})")
        size = path.stat().st_size
        if size != entry.get("size"):
            what = "truncated" if size < entry.get("size", 0) else "size changed"
            raise CheckpointError(f"{path}: {what}: {size} bytes, manifest says {entry.get('size')}")
        if _sha256(path) != entry.get("sha256"):
            raise CheckpointError(f"{path}: altered: sha256 differs from {MANIFEST}")
    return manifest


# ----------------------------------------------------------------------------- save


def _remove_dir(path: Path) -> None:
    """Delete a directory so that it vanishes at once: rename to .tmp-* first (atomic),
    then delete; a kill midway leaves a .tmp-* that the next save removes."""
    trash = path.parent / f"{TMP_PREFIX}del-{path.name}-{os.getpid()}-{secrets.token_hex(4)}"
    try:
        os.rename(path, trash)
    except FileNotFoundError:
        return
    shutil.rmtree(trash, ignore_errors=True)


def _read_pointer(root: Path) -> str | None:
    try:
        name = (root / LATEST).read_text().strip()
    except (FileNotFoundError, UnicodeDecodeError):
        return None
    # only a bare step-N name: a pointer must never lead outside checkpoints/
    return name if _step_of(name) is not None else None


def _complete_checkpoints(root: Path) -> list[tuple[int, Path]]:
    """(step, dir) of every step-* directory with a manifest, newest first (not verified)."""
    out = []
    for p in root.iterdir():
        step = _step_of(p.name)
        if step is not None and p.is_dir() and (p / MANIFEST).is_file():
            out.append((step, p))
    return sorted(out, reverse=True)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


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
        if pid is not None and pid != os.getpid() and _pid_alive(pid):
            continue
        log.info("removing %s, left by an interrupted save", p)
        shutil.rmtree(p, ignore_errors=True)


def _apply_retention(root: Path, keep_last: int | None, newest: Path) -> None:
    if keep_last is None:
        return
    protected = {newest.name, _read_pointer(root)}
    complete = _complete_checkpoints(root)
    if complete:
        protected.add(complete[0][1].name)
    for _, p in complete[keep_last:]:
        if p.name not in protected:
            log.info("removing old checkpoint %s (keep_last=%d)", p, keep_last)
            _remove_dir(p)


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
    keep_last: int | None = 3,
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
        keep_last: complete checkpoints to keep (>= 1), None keeps all.
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
    kind, tensors, aliases = _weights_to_save(model)
    _check_finite(tensors)
    masters = {n: m.detach().to("cpu").contiguous() for n, _, m in _master_pairs(model, optimizer)}
    _check_finite(masters)
    files = REQUIRED_FILES + ((MASTER,) if masters else ())
    try:
        state_json = json.dumps({
            "format_version": FORMAT_VERSION, "step": step, "weights": kind,
            "sampler": sampler_state, "extra": extra or {},
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

        save_file(tensors, str(tmp / WEIGHTS), metadata={_ALIASES_KEY: json.dumps(aliases), "weights": kind})
        _fsync_path(tmp / WEIGHTS)
        del tensors
        if masters:
            save_file(masters, str(tmp / MASTER))
            _fsync_path(tmp / MASTER)
        _fault("weights")
        _torch_save(optimizer.state_dict(), tmp / OPTIMIZER)
        _fault("optimizer")
        _torch_save(scheduler.state_dict(), tmp / SCHEDULER)
        _torch_save(_rng_state(generator), tmp / RNG)
        _write_bytes(tmp / STATE, state_json.encode())
        _write_bytes(tmp / CONFIG, config_yaml.encode())
        manifest = {"format_version": FORMAT_VERSION, "step": step,
                    "files": _manifest_files(tmp, files)}
        # the manifest is written last: its presence marks the directory complete
        _write_bytes(tmp / MANIFEST, json.dumps(manifest, indent=1).encode())
        _fsync_path(tmp)
        _fault("manifest")
        if final.exists():
            # never committed (killed after rename) or saved twice at one step;
            # moved aside (atomic) so `final` is free for a plain rename
            log.warning("replacing existing checkpoint directory %s", final)
            _remove_dir(final)
        os.rename(tmp, final)
        _fsync_path(root)
    except BaseException as e:
        shutil.rmtree(tmp, ignore_errors=True)
        if isinstance(e, OSError):
            raise CheckpointError(f"could not write checkpoint {final}: {e}") from e
        raise
    _fault("rename")
    pointer_tmp = root / f"{LATEST}.tmp"
    _write_bytes(pointer_tmp, (name + "\n").encode())
    _fault("pointer")
    os.replace(pointer_tmp, root / LATEST)
    _fsync_path(root)
    _fault("retention")
    _apply_retention(root, keep_last, final)
    _clean_stale_tmp(root, started)
    return final


# ----------------------------------------------------------------------------- find


def find_latest(run_dir: str | Path) -> Path | None:
    """The checkpoint to resume from, verified.

    ``latest`` names it when that directory is complete and verifies; otherwise (with
    a warning) the newest complete checkpoint that verifies. Directories without a
    manifest and ``.tmp-*`` directories (interrupted saves) are ignored with a warning.

    Args:
        run_dir: the run directory (or its ``checkpoints/`` directory).
    Returns:
        the checkpoint directory, or None when there is no usable checkpoint.
    """
    run_dir = Path(run_dir)
    root = run_dir if run_dir.name == CHECKPOINTS_DIR and not (run_dir / CHECKPOINTS_DIR).is_dir() else run_dir / CHECKPOINTS_DIR
    if not root.is_dir():
        return None
    for p in sorted(root.iterdir()):
        if p.name.startswith(TMP_PREFIX) and p.is_dir():
            log.warning("ignoring %s: left by an interrupted save (removed at the next save)", p)
        elif _step_of(p.name) is not None and p.is_dir() and not (p / MANIFEST).is_file():
            log.warning("ignoring %s: no %s, an incomplete checkpoint", p, MANIFEST)
    complete = _complete_checkpoints(root)
    pointed = _read_pointer(root)
    if pointed is not None:
        target = root / pointed
        if (target / MANIFEST).is_file():
            try:
                verify(target)
            except CheckpointError as e:
                log.warning("checkpoint %s named by %s fails verification: %s", target, root / LATEST, e)
            else:
                newer = [p.name for s, p in complete if s > _step_of(pointed)]
                if newer:
                    log.warning("ignoring %s: written after %s but never committed to %s",
                                ", ".join(newer), pointed, root / LATEST)
                return target
        else:
            log.warning("%s names %s, which is missing or incomplete", root / LATEST, pointed)
    elif complete:
        log.warning("%s is missing or unreadable; looking for the newest complete checkpoint", root / LATEST)
    for _, p in complete:
        if p.name == pointed:
            continue
        try:
            verify(p)
        except CheckpointError as e:
            log.warning("ignoring checkpoint %s: %s", p, e)
            continue
        if pointed is not None:
            log.warning("falling back to checkpoint %s", p)
        return p
    return None


def resolve_resume(run_dir: str | Path, resume: str | Path) -> Path | None:
    """Which checkpoint a run should start from.

    Args:
        run_dir: this run's directory.
        resume: ``"auto"`` (the latest usable checkpoint of ``run_dir``, or None),
            ``"never"`` (None), or a path: a checkpoint directory, or a run directory
            whose latest usable checkpoint is taken.
    Returns:
        a verified checkpoint directory, or None to start from scratch.
    Raises:
        CheckpointError: ``"never"`` while ``run_dir`` already holds complete
            checkpoints (a fresh run would mix its checkpoints with the old ones;
            resume, pick another run_dir or delete ``checkpoints/``); a path that does
            not exist, holds no usable checkpoint or fails verification.
    """
    if isinstance(resume, str) and resume == "never":
        root = Path(run_dir) / CHECKPOINTS_DIR
        if root.is_dir():
            complete = _complete_checkpoints(root)
            if complete:
                raise CheckpointError(
                    f"resume=never but {root} already holds checkpoints (newest {complete[0][1].name}); "
                    "use resume=auto to continue that run, or another run_dir, or delete the directory"
                )
        return None
    if isinstance(resume, str) and resume == "auto":
        return find_latest(run_dir)
    path = Path(resume)
    if not path.exists():
        raise CheckpointError(f"resume={str(resume)!r}: no such file or directory (expected auto, never or a path)")
    if (path / MANIFEST).is_file():
        verify(path)
        return path
    found = find_latest(path)
    if found is None:
        raise CheckpointError(f"resume={str(resume)!r}: no complete, verified checkpoint there")
    return found


# ----------------------------------------------------------------------------- load


def read_config(ckpt_dir: str | Path) -> dict[str, Any]:
    """The config a checkpoint was saved with, as a dict, without loading anything else
    (to run :func:`check_compatible` before :func:`load_checkpoint`).

    Raises:
        CheckpointError: ``config.yaml`` is missing or not YAML.
    """
    import yaml

    path = Path(ckpt_dir) / CONFIG
    try:
        return yaml.safe_load(path.read_text()) or {}
    except (OSError, yaml.YAMLError) as e:
        raise CheckpointError(f"{path}: unreadable ({type(e).__name__}: {e})") from e


def _load_weights(model: torch.nn.Module, path: Path, kind: str) -> None:
    from safetensors import safe_open
    from safetensors.torch import load_file

    model_kind = "lora" if _is_peft(model) else "full"
    if kind != model_kind:
        raise CheckpointError(
            f"{path}: holds {kind} weights but the model is {'a LoRA (peft)' if model_kind == 'lora' else 'a full'} "
            "model; model.lora.enabled differs from the run that saved it"
        )
    with safe_open(str(path), framework="pt") as f:
        meta = f.metadata() or {}
    sd = load_file(str(path))
    for alias, kept in json.loads(meta.get(_ALIASES_KEY, "{}")).items():
        sd[alias] = sd[kept]
    if kind == "lora":
        from peft import get_peft_model_state_dict, set_peft_model_state_dict

        expected = set(get_peft_model_state_dict(model))
    else:
        expected = set(model.state_dict())
    missing, unexpected = sorted(expected - set(sd)), sorted(set(sd) - expected)
    if missing or unexpected:
        raise CheckpointError(
            f"{path}: weights do not match the model: missing {missing[:5]}{'...' if len(missing) > 5 else ''}, "
            f"unexpected {unexpected[:5]}{'...' if len(unexpected) > 5 else ''} "
            "(a different model or LoRA target_modules?)"
        )
    try:
        if kind == "lora":
            set_peft_model_state_dict(model, sd)
        else:
            model.load_state_dict(sd, strict=True)
    except RuntimeError as e:  # shape mismatch
        raise CheckpointError(f"{path}: weights do not fit the model (a different size or LoRA r?): {e}") from e


@torch.no_grad()
def _load_masters(model: torch.nn.Module, optimizer: torch.optim.Optimizer, path: Path | None) -> None:
    from safetensors.torch import load_file

    saved = load_file(str(path)) if path is not None else {}
    pairs = _master_pairs(model, optimizer)
    for name, p, m in pairs:
        if name in saved:
            if saved[name].shape != m.shape:
                raise CheckpointError(f"{path}: {name} has shape {tuple(saved[name].shape)}, the model {tuple(m.shape)}")
            m.copy_(saved[name])
        else:  # saved by a run without masters (fp32): start them from the loaded weights
            m.copy_(p)
    # saved with masters, resumed without (an fp32 model): the masters are the precise values
    paired, params = {n for n, _, _ in pairs}, dict(model.named_parameters())
    for name, t in saved.items():
        if name in paired:
            continue
        if name not in params or params[name].shape != t.shape:
            raise CheckpointError(f"{path}: master weight {name} does not fit the model")
        params[name].copy_(t)


def _load_optimizer(optimizer: torch.optim.Optimizer, path: Path) -> None:
    sd = _torch_load(path)
    saved_groups, groups = sd.get("param_groups", []), optimizer.param_groups
    if [len(g["params"]) for g in saved_groups] != [len(g["params"]) for g in groups]:
        raise CheckpointError(
            f"{path}: the optimizer was saved for parameter groups of sizes "
            f"{[len(g['params']) for g in saved_groups]}, this one has {[len(g['params']) for g in groups]}"
        )
    # load_state_dict maps state by position and does not check shapes: do it here,
    # so a mismatch fails now instead of at the next optimizer.step()
    params = [p for g in groups for p in g["params"]]
    ids = [i for g in saved_groups for i in g["params"]]
    for pos, pid in enumerate(ids):
        for k, v in sd.get("state", {}).get(pid, {}).items():
            if torch.is_tensor(v) and v.dim() > 0 and v.shape != params[pos].shape:
                raise CheckpointError(
                    f"{path}: optimizer state {k!r} of parameter {pos} has shape {tuple(v.shape)}, "
                    f"the parameter has {tuple(params[pos].shape)}"
                )
    try:
        optimizer.load_state_dict(sd)
    except (ValueError, KeyError, RuntimeError) as e:
        raise CheckpointError(f"{path}: optimizer state does not fit: {e}") from e


def load_checkpoint(
    ckpt_dir: str | Path,
    *,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    scheduler: Any = None,
    generator: torch.Generator | None = None,
    restore_rng: bool = True,
) -> CheckpointState:
    """Verify a checkpoint, then restore it into the given objects in place.

    Weights: the LoRA adapter (``set_peft_model_state_dict``) or every parameter with
    strict key checking. When the optimizer updates master copies (see
    :func:`save_checkpoint`), those are restored too, or re-derived from the loaded
    weights if the checkpoint has none. Then optimizer and scheduler state, the RNG states
    (python, numpy, torch CPU, CUDA where available, ``generator``). Build the model,
    optimizer and scheduler exactly as the saving run did before calling this.

    Args:
        ckpt_dir: a checkpoint directory (e.g. from :func:`resolve_resume`).
        model: the policy, same architecture and LoRA setup as when saved.
        optimizer, scheduler: restored when given (``learner.optimizer``,
            ``learner.scheduler``); without the optimizer, master weights are not touched.
        generator: the sampling generator, restored when given.
        restore_rng: False leaves the global RNGs (and ``generator``) alone.
    Returns:
        step, sampler state, extra and config YAML of the checkpoint.
    Raises:
        CheckpointError: verification fails (the message names the file), or a
            saved state does not fit the model/optimizer (different model, LoRA
            setting, parameter shapes) or the generator's device.
    """
    ckpt_dir = Path(ckpt_dir)
    manifest = verify(ckpt_dir)
    try:
        state = json.loads((ckpt_dir / STATE).read_text())
        step, kind = int(state["step"]), state["weights"]
    except (ValueError, KeyError, TypeError) as e:
        raise CheckpointError(f"{ckpt_dir / STATE}: unreadable ({type(e).__name__}: {e})") from e
    _load_weights(model, ckpt_dir / WEIGHTS, kind)
    if optimizer is not None:
        _load_masters(model, optimizer, ckpt_dir / MASTER if MASTER in manifest["files"] else None)
        _load_optimizer(optimizer, ckpt_dir / OPTIMIZER)
    if scheduler is not None:
        scheduler.load_state_dict(_torch_load(ckpt_dir / SCHEDULER))
    rng = _torch_load(ckpt_dir / RNG)
    if restore_rng:
        _restore_rng(rng, generator, ckpt_dir)
    return CheckpointState(
        path=ckpt_dir, step=step, sampler_state=state.get("sampler") or {}, extra=state.get("extra") or {},
        config_yaml=(ckpt_dir / CONFIG).read_text(),
    )


# ----------------------------------------------------------------------------- compatibility

_UNSET = object()


def _get(cfg: Mapping[str, Any], dotted: str) -> Any:
    node: Any = cfg
    for part in dotted.split("."):
        if not isinstance(node, Mapping) or part not in node:
            return _UNSET
        node = node[part]
    return node


def _norm(field_name: str, value: Any) -> Any:
    # peft treats target_modules as a set: order is not a change
    if field_name == "model.lora.target_modules" and isinstance(value, (list, tuple)):
        return sorted(value)
    if field_name == "model.quantization" and value is _UNSET:  # saved before the option existed
        return "none"
    return value


def check_compatible(
    saved_config: Mapping[str, Any], current_config: Mapping[str, Any], fields: Iterable[str] = RESUME_FIELDS
) -> list[str]:
    """Fields that differ between a checkpoint's config and this run's, where a change
    breaks resume.

    Suggested policy: fail on :data:`FATAL_FIELDS` (model.name, model.lora.enabled,
    model.lora.r, model.lora.target_modules: the weights would not fit, or would sit
    on another base model), warn on :data:`WARN_FIELDS` (seed, rollout.group_size,
    rollout.prompts_per_step, algorithm.name: it runs, but is another experiment).
    Call twice with ``fields=FATAL_FIELDS`` and ``fields=WARN_FIELDS`` to split them.

    Args:
        saved_config: the checkpoint's config as a dict (``CheckpointState.config``).
        current_config: this run's, e.g. ``cfg.model_dump(mode="json")``.
        fields: dotted fields to compare (default: all of :data:`RESUME_FIELDS`).
    Returns:
        one message per changed field, naming it and both values; empty when compatible.
    """
    out = []
    for f in fields:
        old, new = _get(saved_config, f), _get(current_config, f)
        if _norm(f, old) != _norm(f, new):
            show = lambda v: "<unset>" if v is _UNSET else repr(v)  # noqa: E731
            out.append(f"{f}: checkpoint has {show(old)}, this run has {show(new)}")
    return out
