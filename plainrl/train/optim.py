"""The optimiser shared by every trainer: AdamW on fp32 master weights with warm-up,
a constant or cosine schedule and gradient clipping."""

from __future__ import annotations

import math

import torch

from plainrl.config import TrainConfig


def lr_lambda(step: int, *, warmup: int, total: int, schedule: str) -> float:
    """Multiplier of the base LR at optimiser step ``step`` (0-based): linear warm-up
    over ``warmup`` steps, then constant or cosine decay to 0 at ``total``."""
    if step < warmup:
        return (step + 1) / warmup
    if schedule == "cosine":
        progress = (step - warmup) / max(1, total - warmup)
        return 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))
    return 1.0


class MasterAdamW:
    """AdamW on fp32 master copies of the trainable parameters, with the LR schedule
    of :func:`lr_lambda` and gradient clipping; shared by the policy learner, the
    critic and the offline trainers.

    Mixed precision (Micikevicius et al. 2018): the optimiser updates fp32 master
    copies; bf16 parameters would round away updates smaller than ~0.4% of a weight.
    fp32 parameters are their own masters.

    Args:
        params: the trainable parameters (their order is the checkpoint's order).
        train: the ``train`` config section (lr, betas, weight decay, schedule, clipping).
        lr: overrides ``train.lr`` (e.g. ``critic.lr``).
    """

    def __init__(self, params: list[torch.nn.Parameter], train: TrainConfig, *, lr: float | None = None):
        self.params = params
        self.master = [p if p.dtype == torch.float32 else p.detach().float().requires_grad_(True) for p in params]
        self.max_grad_norm = train.max_grad_norm
        # fused AdamW on CUDA: one kernel for every parameter instead of a handful per tensor
        # (what torchtitan and TRL default to); on CPU the foreach path torch picks is kept
        self.fused = bool(self.master) and all(m.device.type == "cuda" for m in self.master)
        self.optimizer = torch.optim.AdamW(
            self.master, lr=lr or train.lr, betas=train.betas, weight_decay=train.weight_decay,
            fused=self.fused or None,
        )
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer,
            lambda s: lr_lambda(s, warmup=train.warmup, total=train.total_steps, schedule=train.lr_schedule),
        )

    @property
    def lr(self) -> float:
        return self.scheduler.get_last_lr()[0]

    def step(self, loss_finite: bool = True) -> tuple[float, bool]:
        """Apply the accumulated gradients (clipped) and clear them.

        A non-finite loss or gradient norm skips the update (the weights stay as they were).

        Returns:
            ``(grad_norm, skipped)``.
        """
        for m, p in zip(self.master, self.params):
            if m is not p:
                m.grad = None if p.grad is None else p.grad.float()
                p.grad = None
        grad_norm = torch.nn.utils.clip_grad_norm_(self.master, self.max_grad_norm or float("inf"))
        if hasattr(grad_norm, "full_tensor"):  # FSDP2: the norm over every rank's shards, replicated
            grad_norm = grad_norm.full_tensor()
        skipped = not torch.isfinite(grad_norm).item() or not loss_finite
        if not skipped:
            self.optimizer.step()
            with torch.no_grad():
                for m, p in zip(self.master, self.params):
                    if m is not p:
                        p.copy_(m)
        self.optimizer.zero_grad(set_to_none=True)
        return float(grad_norm), skipped
