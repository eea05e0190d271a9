"""Which tensors a checkpoint stores: the model's weights (tied ones once), the optimizer's
fp32 master copies, and the refusal to store NaN/inf."""

from __future__ import annotations

from typing import Mapping

import torch

from plainrl.checkpoint.layout import CheckpointError


def is_peft(model: torch.nn.Module) -> bool:
    """Whether ``model`` is a peft model (its checkpoint holds the LoRA adapter only)."""
    try:
        from peft import PeftModel
    except ImportError:  # peft is a dependency, but a full fine-tune should not need it
        return False
    return isinstance(model, PeftModel)


def weights_to_save(model: torch.nn.Module) -> tuple[str, dict[str, torch.Tensor], dict[str, str]]:
    """(kind, tensors, aliases): tensors safetensors can write, aliases name tied copies.

    safetensors refuses tensors that share memory; tied weights (embed_tokens /
    lm_head) are the same tensor under two names, so the second name is stored as
    an alias of the first and restored on load.
    """
    if is_peft(model):
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


def master_pairs(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> list[tuple[str, torch.nn.Parameter, torch.Tensor]]:
    """(name, model parameter, optimizer parameter) for every trainable parameter the
    optimizer updates through a separate master copy.

    Learner keeps fp32 master copies of bf16 parameters and gives those to AdamW,
    aligned with ``model.parameters()`` order. The masters are the precise weights:
    without them a resume would restart from bf16-rounded values, and a Learner built
    before loading would keep stale masters and overwrite the loaded weights at its
    next step.

    Raises:
        CheckpointError: the optimizer's parameters are neither the model's own nor
            copies of its trainable parameters in order.
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


def check_finite(tensors: Mapping[str, torch.Tensor]) -> None:
    """Raises CheckpointError naming the (first five) tensors with NaN or ±inf values."""
    bad = [n for n, t in tensors.items() if t.is_floating_point() and not bool(torch.isfinite(t).all())]
    if bad:
        shown = ", ".join(bad[:5]) + (f" and {len(bad) - 5} more" if len(bad) > 5 else "")
        raise CheckpointError(
            f"refusing to save a checkpoint: non-finite (NaN/inf) values in {shown}; "
            "the previous checkpoint is kept as it was"
        )
