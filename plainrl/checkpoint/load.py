"""load_checkpoint: verify a checkpoint, then restore weights, fp32 masters, optimizer,
scheduler and RNG states in place."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from plainrl.checkpoint.files import torch_load, verify
from plainrl.checkpoint.layout import (
    ALIASES_KEY, CONFIG, MANIFEST, MASTER, OPTIMIZER, RNG, SCHEDULER, STATE, WEIGHTS, CheckpointError,
)
from plainrl.checkpoint.rng import set_rng_state
from plainrl.checkpoint.weights import is_peft, master_pairs


@dataclass
class CheckpointState:
    """What :func:`load_checkpoint` returns besides what it restores in place.

    Attributes:
        path: the checkpoint directory.
        step: the ``step`` given to :func:`save_checkpoint`.
        sampler_state: the ``sampler_state`` given to :func:`save_checkpoint`.
        extra: the ``extra`` given to :func:`save_checkpoint` (``{}`` when None).
        config_yaml: the resolved config YAML of the run that saved it.
        warnings: what was not restored (the optimizer state of a checkpoint saved with
            ``checkpoint.save_optimizer: false``), for the run's log.
    """

    path: Path
    step: int
    sampler_state: dict[str, Any]
    extra: dict[str, Any] = field(default_factory=dict)
    blobs: dict[str, bytes] = field(default_factory=dict)  # save_checkpoint's ``blobs``
    config_yaml: str = ""
    warnings: list[str] = field(default_factory=list)

    @property
    def config(self) -> dict[str, Any]:
        """``config_yaml`` parsed (for :func:`check_compatible`)."""
        import yaml

        return yaml.safe_load(self.config_yaml) or {}


def _load_weights(model: torch.nn.Module, path: Path, kind: str) -> None:
    from safetensors import safe_open
    from safetensors.torch import load_file

    model_kind = "lora" if is_peft(model) else "full"
    if kind != model_kind:
        raise CheckpointError(
            f"{path}: holds {kind} weights but the model is {'a LoRA (peft)' if model_kind == 'lora' else 'a full'} "
            "model; model.lora.enabled differs from the run that saved it"
        )
    with safe_open(str(path), framework="pt") as f:
        meta = f.metadata() or {}
    sd = load_file(str(path))
    for alias, kept in json.loads(meta.get(ALIASES_KEY, "{}")).items():
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
    pairs = master_pairs(model, optimizer)
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
    sd = torch_load(path)
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
    verified: bool = False,
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
        verified: the manifest was checked already (under torchrun rank 0 checks for all).
    Returns:
        step, sampler state, extra and config YAML of the checkpoint, and ``warnings``: a checkpoint
        saved without optimizer state (``checkpoint.save_optimizer: false``) leaves the optimizer as
        built (its state restarts), and says so there.
    Raises:
        CheckpointError: verification fails (the message names the file), or a
            saved state does not fit the model/optimizer (different model, LoRA
            setting, parameter shapes) or the generator's device.
    """
    ckpt_dir = Path(ckpt_dir)
    manifest = json.loads((ckpt_dir / MANIFEST).read_text()) if verified else verify(ckpt_dir)
    try:
        state = json.loads((ckpt_dir / STATE).read_text())
        step, kind = int(state["step"]), state["weights"]
    except (ValueError, KeyError, TypeError) as e:
        raise CheckpointError(f"{ckpt_dir / STATE}: unreadable ({type(e).__name__}: {e})") from e
    _load_weights(model, ckpt_dir / WEIGHTS, kind)
    warnings = []
    if optimizer is not None:
        _load_masters(model, optimizer, ckpt_dir / MASTER if MASTER in manifest["files"] else None)
        if manifest.get("optimizer") is False:
            warnings.append(optimizer_restarts(ckpt_dir, step))
        else:
            _load_optimizer(optimizer, ckpt_dir / OPTIMIZER)
    if scheduler is not None:
        scheduler.load_state_dict(torch_load(ckpt_dir / SCHEDULER))
    rng = torch_load(ckpt_dir / RNG)
    if restore_rng:
        set_rng_state(rng, generator, ckpt_dir)
    return CheckpointState(
        path=ckpt_dir, step=step, sampler_state=state.get("sampler") or {}, extra=state.get("extra") or {},
        config_yaml=(ckpt_dir / CONFIG).read_text(),
        blobs={n: (ckpt_dir / n).read_bytes() for n in state.get("blobs", ()) if n in manifest["files"]},
        warnings=warnings,
    )


def optimizer_restarts(ckpt_dir: Path, step: int) -> str:
    """The warning of a resume from a checkpoint without optimizer state."""
    return (f"{ckpt_dir} was saved with checkpoint.save_optimizer=false: the optimizer state (AdamW's moment "
            f"estimates) restarts from zero at step {step}, so the next updates differ from an uninterrupted run's; "
            "weights, learning-rate schedule, RNG states and data position are restored")
