"""The ``train`` section: optimisation, micro-batching, and how several processes share
the work when the run is launched by ``torchrun`` (``strategy``; see docs/distributed.md)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from plainrl.config.base import _Section

# ddp: every rank holds the whole model, gradients are all-reduced (DistributedDataParallel);
# fsdp2: parameters, gradients and optimizer state are sharded over the ranks, each decoder
# layer gathered for its forward and backward (torch.distributed.fsdp.fully_shard)
Strategy = Literal["ddp", "fsdp2"]


class TrainConfig(_Section):
    """Optimisation (AdamW, linear warm-up then constant or cosine), micro-batches, and the
    distributed strategy under torchrun."""

    steps: int = Field(50, gt=0)
    lr: float = Field(1e-5, gt=0.0)
    lr_schedule: Literal["constant", "cosine"] = "constant"
    warmup_steps: int = Field(0, ge=0)
    weight_decay: float = Field(0.0, ge=0.0)
    betas: tuple[float, float] = (0.9, 0.999)
    max_grad_norm: float | None = Field(1.0, gt=0.0)
    micro_batch_tokens: int = Field(4096, gt=0)  # token budget of one forward/backward
    # RL: samples of one prompt in a micro-batch run the prompt once (plainrl.models.shared_prompt_hidden)
    share_prompts: bool = True
    # recompute each decoder layer's activations in backward instead of keeping them
    # (plainrl.models.enable_gradient_checkpointing): less memory, about one more forward
    gradient_checkpointing: bool = False
    # RL: pack a micro-batch's episodes end to end (position ids restart, attention kept within
    # each episode) so no compute is spent on padding (plainrl.models.packing); on by default:
    # faster on the demo batch (benchmarks/packing.py; figures in docs/benchmarks.md)
    packing: bool = True
    batch_size: int = Field(8, gt=0)  # sft/dpo/rm: rows (pairs) per optimiser step; RL uses the rollout's
    max_bad_steps: int = Field(3, gt=0)  # stop after this many non-finite steps in a row
    # the device's peak FLOP/s for perf/mfu (plainrl.perf); default: a table of CUDA devices in 16-bit
    peak_flops: float | None = Field(None, gt=0)
    # under torchrun (ignored in one process): how the ranks share the model
    strategy: Strategy = "ddp"
    # under torchrun: the longest wait of a collective (a dead or stuck rank ends the run after it)
    collective_timeout_s: float = Field(600.0, gt=0)


def strategy_problem(train: TrainConfig, quantization: str, *, rl: bool) -> str | None:
    """Why ``train.strategy`` cannot run this config (None when it can); checked at load,
    before torchrun's processes load a model. ``quantization``: ``model.quantization``;
    ``rl``: an RL run (its packed or shared-prompt forward), not sft/dpo/rm."""
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
