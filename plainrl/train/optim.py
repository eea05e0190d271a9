"""The optimiser shared by every trainer: AdamW on fp32 master weights with warm-up,
a constant or cosine schedule and gradient clipping; with ``train.offload: optimizer`` the
masters and AdamW's moments live in host memory and the step runs on the CPU (ZeRO-Offload)."""

from __future__ import annotations

import math
from typing import Any

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


def _host_copy(t: torch.Tensor, pin: bool) -> torch.Tensor:
    """An fp32 copy of ``t`` in host memory (page-locked when ``pin``, so copies to and from
    the GPU can run asynchronously)."""
    return torch.empty(t.shape, dtype=torch.float32, device="cpu", pin_memory=pin).copy_(t.detach())


class MasterAdamW:
    """AdamW on fp32 master copies of the trainable parameters, with the LR schedule
    of :func:`lr_lambda` and gradient clipping; shared by the policy learner, the
    critic and the offline trainers.

    Mixed precision (Micikevicius et al. 2018): the optimiser updates fp32 master
    copies; bf16 parameters would round away updates smaller than ~0.4% of a weight.
    fp32 parameters are their own masters.

    Optimizer offload (``train.offload: optimizer``; ZeRO-Offload, Ren et al. 2021): the
    masters (fp32 for every parameter, whatever its dtype), AdamW's two moments and an fp32
    gradient buffer per parameter live in host memory, page-locked when the parameters are on
    CUDA. :meth:`step` copies each gradient to its host buffer (all queued, then one wait),
    clips and steps there (torch's fused CPU AdamW) and queues the copies of the updated
    weights back without waiting (the next forward on the same stream waits for them). The
    device keeps only the parameters and, during backward, their gradients: 8 bytes of AdamW
    state per trainable parameter less, and 4 more where the weights are 16-bit. With
    parameters on the CPU it computes the same update with extra copies.

    Args:
        params: the trainable parameters (their order is the checkpoint's order).
        train: the ``train`` config section (lr, betas, weight decay, schedule, clipping, offload).
        lr: overrides ``train.lr`` (e.g. ``critic.lr``).
    Raises:
        ValueError: ``train.offload: optimizer`` with FSDP2's sharded (DTensor) parameters.
    """

    def __init__(self, params: list[torch.nn.Parameter], train: TrainConfig, *, lr: float | None = None):
        self.params = params
        self.offload = train.offload == "optimizer"
        if self.offload:
            if any(hasattr(p, "full_tensor") for p in params):
                raise ValueError("train.offload=optimizer does not take FSDP2's sharded parameters: "
                                 "use train.offload=params under train.strategy=fsdp2")
            pin = any(p.device.type == "cuda" for p in params)
            self.master = [_host_copy(p, pin).requires_grad_(True) for p in params]
            self.host_grads = [torch.empty(p.shape, dtype=torch.float32, pin_memory=pin) for p in params]
        else:
            self.master = [p if p.dtype == torch.float32 else p.detach().float().requires_grad_(True) for p in params]
        self.max_grad_norm = train.max_grad_norm
        # fused AdamW on CUDA: one kernel for every parameter instead of a handful per tensor
        # (what torchtitan and TRL default to); on the CPU the offloaded step is fused too (the
        # step is the offload's bottleneck; torchao's CPUOffloadOptimizer does the same), while
        # a plain CPU run keeps the foreach path torch picks
        self.fused = bool(self.master) and (self.offload or all(m.device.type == "cuda" for m in self.master))
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

    def step(self, loss_finite: bool = True, grad_scale: float = 1.0) -> tuple[float, bool]:
        """Apply the accumulated gradients (clipped) and clear them.

        A non-finite loss or gradient norm skips the update (the weights stay as they were).

        Args:
            loss_finite: the step's loss was finite.
            grad_scale: multiplies the gradients before clipping: the learner's loss normaliser
                corrected once it knows how many tokens an off-policy rejection kept; 0: nothing
                was kept, the update is skipped (AdamW would still move the weights on zero gradients).
        Returns:
            ``(grad_norm, skipped)``.
        """
        if self.offload:
            self._grads_to_host()
        else:
            for m, p in zip(self.master, self.params):
                if m is not p:
                    m.grad = None if p.grad is None else p.grad.float()
                    p.grad = None
        if grad_scale != 1.0:
            with torch.no_grad():
                for m in self.master:
                    if m.grad is not None:
                        m.grad.mul_(grad_scale)
        grad_norm = torch.nn.utils.clip_grad_norm_(self.master, self.max_grad_norm or float("inf"))
        if hasattr(grad_norm, "full_tensor"):  # FSDP2: the norm over every rank's shards, replicated
            grad_norm = grad_norm.full_tensor()
        skipped = not torch.isfinite(grad_norm).item() or not loss_finite or grad_scale == 0
        if not skipped:
            self.optimizer.step()
            with torch.no_grad():
                for m, p in zip(self.master, self.params):
                    if m is not p:
                        # from page-locked memory: queued on the stream, the host goes on
                        p.copy_(m, non_blocking=self.offload)
        self.optimizer.zero_grad(set_to_none=True)
        return float(grad_norm), skipped

    def set_hyperparameters(self, *, lr: float, betas: tuple[float, float], eps: float, weight_decay: float,
                            max_grad_norm: float | None) -> None:
        """Replace AdamW's settings for the next :meth:`step` (``plainrl tinker``: each ``optim_step``
        brings its own); ``max_grad_norm`` None: no clipping."""
        for group in self.optimizer.param_groups:
            group.update(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)
        self.max_grad_norm = max_grad_norm

    def state_dict(self) -> dict[str, Any]:
        """AdamW's state (``optimizer``: ``torch.optim.AdamW.state_dict()``) and the fp32 masters
        that differ from their parameters (``masters``: detached tensors in ``params`` order; empty
        for fp32 parameters without offload, which are their own masters). Its tensors are this
        optimizer's own, as torch's ``state_dict`` returns them: write them out or copy them."""
        return {"optimizer": self.optimizer.state_dict(),
                "masters": [m.detach() for m, p in zip(self.master, self.params) if m is not p]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned, for the same parameters in the same order.

        Raises:
            ValueError: the state is of other parameters (another count or shape of masters, or an
                optimizer state torch refuses).
        """
        masters = [m for m, p in zip(self.master, self.params) if m is not p]
        saved = list(state["masters"])
        if len(saved) != len(masters) or any(s.shape != m.shape for s, m in zip(saved, masters)):
            raise ValueError(f"optimizer state of other parameters: {len(saved)} saved master weights "
                             f"{[tuple(s.shape) for s in saved[:3]]}..., {len(masters)} here "
                             f"{[tuple(m.shape) for m in masters[:3]]}...; load it into the model it was saved from")
        self.optimizer.load_state_dict(state["optimizer"])
        with torch.no_grad():
            for m, s in zip(masters, saved):
                m.copy_(s)

    def masters_from_params(self) -> None:
        """Set the fp32 masters to the parameters' values, after the parameters were overwritten
        (weights loaded from elsewhere): the next step then starts from them."""
        with torch.no_grad():
            for m, p in zip(self.master, self.params):
                if m is not p:
                    m.copy_(p.detach().float())

    def _grads_to_host(self) -> None:
        """Every gradient into its fp32 host buffer (the device's freed), then one wait."""
        devices = set()
        for m, p, buf in zip(self.master, self.params, self.host_grads):
            m.grad = None
            if p.grad is not None:
                # non_blocking into pinned memory: the copies queue behind one another and the
                # backward; the device gradient's memory is reused only after its copy (same stream)
                m.grad = buf.copy_(p.grad, non_blocking=True)
                devices.add(p.device)
                p.grad = None
        for device in devices:
            if device.type == "cuda":
                torch.cuda.current_stream(device).synchronize()  # the CPU reads the buffers next
