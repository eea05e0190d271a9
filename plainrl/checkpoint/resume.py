"""Which checkpoint a run resumes from (find_latest, resolve_resume), and whether its
config still fits this run (read_config, check_compatible, FATAL_FIELDS, WARN_FIELDS)."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, Iterable, Mapping

from plainrl.checkpoint.files import verify
from plainrl.checkpoint.layout import (
    CHECKPOINTS_DIR, CONFIG, LATEST, MANIFEST, TMP_PREFIX, CheckpointError, complete_checkpoints, read_pointer,
    step_of,
)

log = logging.getLogger(__name__)

# Fields whose change between the checkpoint and this run breaks resume.
# FATAL: the saved weights/optimizer do not fit, or would silently sit on another base model.
FATAL_FIELDS = ("model.name", "model.lora.enabled", "model.lora.r", "model.lora.target_modules")
# WARN: loading works, but the run is no longer the experiment that was started
# (a different seed also makes PromptSampler.load_state_dict refuse the data position).
WARN_FIELDS = ("seed", "rollout.group_size", "rollout.prompts_per_step", "algorithm.name", "model.quantization")
RESUME_FIELDS = FATAL_FIELDS + WARN_FIELDS


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
        elif step_of(p.name) is not None and p.is_dir() and not (p / MANIFEST).is_file():
            log.warning("ignoring %s: no %s, an incomplete checkpoint", p, MANIFEST)
    complete = complete_checkpoints(root)
    pointed = read_pointer(root)
    if pointed is not None:
        target = root / pointed
        if (target / MANIFEST).is_file():
            try:
                verify(target)
            except CheckpointError as e:
                log.warning("checkpoint %s named by %s fails verification: %s", target, root / LATEST, e)
            else:
                newer = [p.name for s, p in complete if s > step_of(pointed)]
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
            complete = complete_checkpoints(root)
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
