"""The ``train`` section: optimisation, micro-batching, and how several processes share
the work when the run is launched by ``torchrun`` (``strategy``; see docs/distributed.md)."""

from __future__ import annotations

import math
from typing import Any, Literal

from pydantic import Field, PrivateAttr, model_validator

from plainrl.config.base import ConfigError, _Section

# ddp: every rank holds the whole model, gradients are all-reduced (DistributedDataParallel);
# fsdp2: parameters, gradients and optimizer state are sharded over the ranks, each decoder
# layer gathered for its forward and backward (torch.distributed.fsdp.fully_shard)
Strategy = Literal["ddp", "fsdp2"]

DEFAULT_STEPS = 50  # train.steps unless train.epochs is given


def epoch_steps(epochs: int, rows: int, rows_per_step: int) -> int:
    """Optimiser steps of ``epochs`` passes over ``rows`` usable training rows, ``rows_per_step``
    rows a step (RL: ``rollout.prompts_per_step`` prompts, each sampled ``rollout.group_size``
    times; sft/dpo/rm: ``train.batch_size`` rows): ``ceil(epochs * rows / rows_per_step)``, the
    last step reaching into the next epoch when the rows do not divide evenly."""
    return math.ceil(epochs * rows / rows_per_step)


class TrainConfig(_Section):
    """Optimisation (AdamW, linear warm-up then constant or cosine), micro-batches, and the
    distributed strategy under torchrun."""

    steps: int | None = Field(DEFAULT_STEPS, gt=0)
    """Optimiser steps; or give `train.epochs` instead (then this default does not apply)."""
    epochs: int | None = Field(None, gt=0)
    """Passes over the training rows instead of `train.steps`: `ceil(epochs x rows / rows_per_step)` steps."""
    lr: float = Field(1e-5, gt=0.0)
    """Learning rate (AdamW)."""
    lr_schedule: Literal["constant", "cosine"] = "constant"
    """After warm-up: `constant` or `cosine` (to 0)."""
    warmup_steps: int | None = Field(0, ge=0)
    """Linear warm-up steps; or give `train.warmup_ratio` instead (then this default does not apply). An override of
    `train.steps` or `train.epochs` giving fewer steps than a warm-up from the config file shortens the warm-up to
    the run (with a printed note)."""
    warmup_ratio: float | None = Field(None, ge=0.0, le=1.0)
    """Warm-up as a fraction of the run's steps (`ceil(ratio x steps)`, as transformers)."""
    weight_decay: float = Field(0.0, ge=0.0)
    """AdamW's weight decay."""
    betas: tuple[float, float] = (0.9, 0.999)
    """AdamW's betas."""
    max_grad_norm: float | None = Field(1.0, gt=0.0)
    """Gradient clipping norm (null: off)."""
    micro_batch_tokens: int = Field(4096, gt=0)
    """Token budget of one forward/backward: as few micro-batches as it allows, their tokens balanced."""
    share_prompts: bool = True
    """RL: the samples of one prompt in a micro-batch run the prompt once."""
    gradient_checkpointing: bool = False
    """Recompute each decoder layer's activations in backward instead of keeping them: less memory, about one more
    forward per update."""
    packing: bool = True
    """RL: pack a micro-batch's episodes end to end (position ids restart, attention kept within each) so no compute
    goes to padding."""
    batch_size: int = Field(8, gt=0)
    """sft/dpo/rm: rows (pairs) per optimiser step; RL steps take `rollout.prompts_per_step` prompts instead."""
    max_bad_steps: int = Field(3, gt=0)
    """Stop after this many steps in a row with a non-finite loss or gradient norm (each skipped)."""
    peak_flops: float | None = Field(None, gt=0)
    """The device's peak FLOP/s for `perf/mfu`; null: a table of CUDA GPUs in 16-bit."""
    strategy: Strategy = "ddp"
    """Under torchrun: `ddp` replicates the model, `fsdp2` shards each decoder layer (ignored in one process)."""
    fsdp_size: int | None = Field(None, gt=0)
    """Under torchrun with `strategy: fsdp2`: shard within groups of this many ranks and replicate across the groups
    (HSDP on a 2-D device mesh, replicate x shard; e.g. the GPUs of one node, so a layer's all-gather stays inside a
    node); it must divide the world size. null: shard over every rank."""
    offload: Literal["none", "optimizer", "params"] = "none"
    """Move training state from the GPU to host memory, for a slower step. `optimizer` (one process or `ddp`): the
    fp32 master weights and AdamW's two moments stay in pinned host memory and AdamW steps on the CPU; each step
    copies the gradients to the host and the updated weights back (ZeRO-Offload), freeing 8 bytes per trained
    parameter of GPU memory, 12 where the weights are 16-bit. `params` (torchrun with `strategy: fsdp2` on CUDA): the
    sharded parameters, their gradients and the optimizer state stay in host memory (FSDP2's `CPUOffloadPolicy`: each
    layer is copied to the GPU for its forward and backward, the optimizer steps on the CPU), freeing about 16 bytes
    per trained parameter (fp32 weight, gradient and two Adam moments) divided by the ranks."""
    collective_timeout_s: float = Field(600.0, gt=0)
    """Under torchrun: the longest wait of a collective; a dead or stuck rank ends the run after it."""
    _epoch_steps: int | None = PrivateAttr(None)  # train.epochs in steps, set by resolve_epochs
    # warmup_steps came from the config file and train.epochs from an override: fitted to the run, not refused
    _fit_warmup: bool = PrivateAttr(False)
    _warmup_note: str | None = PrivateAttr(None)

    @model_validator(mode="before")
    @classmethod
    def _defaults(cls, data: Any) -> Any:
        # `steps` (and `warmup_steps`) keep their defaults unless the other of the pair is given:
        # `train.epochs: 2` alone means an epoch-counted run, not 50 steps and 2 epochs at once
        if isinstance(data, dict):
            data = dict(data)
            for default, other in (("steps", "epochs"), ("warmup_steps", "warmup_ratio")):
                if data.get(other) is not None and default not in data:
                    data[default] = None
        return data

    @model_validator(mode="after")
    def _one_of_each(self) -> "TrainConfig":
        for a, b in (("steps", "epochs"), ("warmup_steps", "warmup_ratio")):
            if getattr(self, a) is not None and getattr(self, b) is not None:
                raise ValueError(f"train.{a}={getattr(self, a)!r} and train.{b}={getattr(self, b)!r}: set exactly "
                                 f"one of them (remove the other, or set it to null)")
            if getattr(self, a) is None and getattr(self, b) is None:
                raise ValueError(f"train.{a} and train.{b} are both null: set one of them")
        return self

    def resolve_epochs(self, rows: int, rows_per_step: int) -> int:
        """Fix the number of steps of ``train.epochs`` once the training rows are known
        (:func:`epoch_steps`); with ``train.steps`` this returns it unchanged.

        Raises:
            ConfigError: no rows, or ``train.warmup_steps`` beyond the derived steps (unless the
                steps came from an override and the warm-up from the file: then it is shortened).
        """
        if self.epochs is None:
            return self.total_steps
        if rows < 1 or rows_per_step < 1:
            raise ConfigError(f"train.epochs={self.epochs}: {rows} training rows at {rows_per_step} a step")
        self._epoch_steps = epoch_steps(self.epochs, rows, rows_per_step)
        if self._fit_warmup and self.warmup_steps is not None and self.warmup_steps > self._epoch_steps:
            self._warmup_note = (f"train.warmup_steps: {self.warmup_steps} from the config is longer than the "
                                 f"{self._epoch_steps} steps of train.epochs={self.epochs} from the overrides, so "
                                 "warm-up lasts the whole run (set both to keep your own)")
            self.warmup_steps = self._epoch_steps
        if self.warmup_steps is not None and self.warmup_steps > self._epoch_steps:
            raise ConfigError(f"train.warmup_steps={self.warmup_steps} exceeds the {self._epoch_steps} steps of "
                              f"train.epochs={self.epochs} ({rows} rows, {rows_per_step} a step); lower it")
        return self._epoch_steps

    @property
    def total_steps(self) -> int:
        """Optimiser steps of the run: ``train.steps``, or ``train.epochs`` in steps.

        Raises:
            RuntimeError: ``train.epochs`` before :meth:`resolve_epochs` (the data is not loaded yet).
        """
        if self.steps is not None:
            return self.steps
        if self._epoch_steps is None:
            raise RuntimeError("train.epochs: the number of steps is known once the training data is loaded "
                               "(TrainConfig.resolve_epochs)")
        return self._epoch_steps

    @property
    def warmup(self) -> int:
        """Warm-up steps: ``train.warmup_steps``, or ``ceil(train.warmup_ratio * total_steps)``."""
        if self.warmup_steps is not None:
            return self.warmup_steps
        return math.ceil(self.warmup_ratio * self.total_steps - 1e-9)  # 0.1 * 30 is 3.0000000000000004


def strategy_problem(train: TrainConfig, quantization: str, *, rl: bool) -> str | None:
    """Why ``train.strategy`` cannot run this config (None when it can); checked at load,
    before torchrun's processes load a model. ``quantization``: ``model.quantization``;
    ``rl``: an RL run (its packed or shared-prompt forward), not sft/dpo/rm."""
    if train.strategy != "fsdp2" and (train.fsdp_size is not None or train.offload == "params"):
        return (f"train.fsdp_size / train.offload=params shape FSDP2's sharding (train.strategy=fsdp2), not "
                f"train.strategy={train.strategy}; set train.strategy=fsdp2 or leave them unset "
                f"(train.offload=optimizer moves the optimizer state to the host without FSDP2)")
    if train.strategy == "fsdp2" and train.offload == "optimizer":
        return ("train.offload=optimizer keeps whole tensors in host memory and does not take FSDP2's sharded "
                "parameters; under train.strategy=fsdp2 use train.offload=params (FSDP2's CPUOffloadPolicy moves the "
                "optimizer state to the host with the shards), or train.strategy=ddp with train.offload=optimizer")
    if train.strategy != "fsdp2":
        return None
    if quantization != "none":
        return (f"train.strategy=fsdp2 shards float parameters and cannot shard a {quantization}-quantized base "
                f"(model.quantization={quantization!r}); use train.strategy=ddp, or model.quantization=none")
    if rl and not train.packing and train.share_prompts:
        # every rank must run the same sequence of layer calls (each is a collective); the unpacked
        # shared-prompt forward runs the decoder once or twice depending on the batch
        return ("train.strategy=fsdp2 needs the same layer calls on every rank, which the unpacked "
                "shared-prompt forward does not give; set train.packing=true (the default) or train.share_prompts=false")
    return None
