"""Tinker's training primitives on one adapter: ``forward_backward`` / ``forward`` (the built-in
losses of :mod:`plainrl.algorithms.tinker_losses` on exact token ids) and ``optim_step`` (AdamW
with the step's ``AdamParams``), with the checks that turn bad input into a 400 naming the field.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from plainrl.algorithms.tinker_losses import (DERIVED_INPUTS, INPUTS, NEEDS_PROVENANCE, TOP_K_LOSSES,
                                              check_config, elementwise_loss)
from plainrl.config import TrainConfig
from plainrl.frames import pack_by_length
from plainrl.models.forward import target_logps
from plainrl.tinker.adapters import Adapters
from plainrl.tinker.errors import UserError
from plainrl.tinker.stability import StabilityRecords, session_of
from plainrl.tinker.wire import ForwardBackwardCall, encode_forward_backward_output
from plainrl.train.optim import MasterAdamW


@dataclass
class TrainingModel:
    """One training client: its adapter on the shared base and its own optimizer state.

    ``optimizer`` is plainrl's :class:`MasterAdamW` (fp32 masters of 16-bit adapters); each
    ``optim_step`` sets its hyperparameters from the request's ``AdamParams``.
    """

    model_id: str
    adapter: str
    base_model: str
    rank: int
    targets: list[str]
    optimizer: MasterAdamW
    steps: int = 0


def make_optimizer(params: list[torch.nn.Parameter]) -> MasterAdamW:
    """An AdamW for ``params`` whose settings every ``optim_step`` replaces (no schedule, no clipping
    until asked)."""
    return MasterAdamW(params, TrainConfig(lr=1e-4, max_grad_norm=None, warmup_steps=0))


def check_call(call: ForwardBackwardCall, *, vocab_size: int, context: int,
               stability: StabilityRecords | None = None) -> None:
    """Reject a ``forward_backward`` / ``forward`` request the model cannot run, before it is queued.
    For a loss that trains on recorded samples (``stable_reinforce``) every datum's ``logprobs``
    input is replaced, on the positions its provenance names as sampled, by the sampler's recorded
    logprobs (:meth:`StabilityRecords.sampling_logprobs`).

    Raises:
        UserError: an unknown loss or config key (or a required one missing), no data, an empty or
            over-long sequence, a token id outside the vocabulary, a missing input, an input whose
            shape is not the sequence's [N] (or [N, K] for top-K targets), or missing or false provenance.
    """
    try:
        check_config(call.loss_fn, call.loss_fn_config)
    except ValueError as e:
        raise UserError(str(e)) from e
    if not call.data:
        raise UserError("data: no Datum given")
    widths = {d.inputs["target_tokens"].shape[1:] for d in call.data if "target_tokens" in d.inputs}
    if len(widths) > 1:
        raise UserError(f"data: target_tokens of shapes (N,) and (N, K) with several K {sorted(widths)} in one "
                        "request; send datums with one K together")
    for i, d in enumerate(call.data):
        n = len(d.tokens)
        if n == 0:
            raise UserError(f"data[{i}].model_input: no tokens")
        if n > context:
            raise UserError(f"data[{i}].model_input: {n} tokens, over the model's context of {context}")
        _check_ids(d.tokens, vocab_size, f"data[{i}].model_input")
        for key in ("target_tokens", *INPUTS[call.loss_fn]):
            if key not in d.inputs:
                raise UserError(f"data[{i}].loss_fn_inputs: {key!r} is missing; loss_fn={call.loss_fn!r} needs "
                                f"{['target_tokens', *INPUTS[call.loss_fn]]}")
            shape = tuple(d.inputs[key].shape)
            top_k = call.loss_fn in TOP_K_LOSSES and len(shape) == 2 and key in ("target_tokens", "weights")
            if shape != (n,) and not (top_k and shape[0] == n and shape == d.inputs["target_tokens"].shape):
                raise UserError(f"data[{i}].loss_fn_inputs[{key!r}]: shape {shape}, but model_input has {n} "
                                f"tokens; every loss input is one value per input position, shape ({n},)"
                                + (f", or ({n}, K) for target_tokens and weights alike" if call.loss_fn in TOP_K_LOSSES
                                   else ""))
        _check_ids(d.inputs["target_tokens"], vocab_size, f"data[{i}].loss_fn_inputs['target_tokens']")
        if call.loss_fn in NEEDS_PROVENANCE:
            if d.spans is None:
                raise UserError(f"data[{i}]: loss_fn={call.loss_fn!r} needs provenance on every datum "
                                "(Datum.with_provenance naming the sampled sequences by their sequence_id)")
            if stability is None:
                raise UserError(f"loss_fn={call.loss_fn!r}: this service records no stability information")
            d.inputs["logprobs"], d.inputs["sampled"] = stability.sampling_logprobs(
                d.spans, d.inputs["target_tokens"], d.inputs["logprobs"], session_of(call.model_id), f"data[{i}]")


def _check_ids(ids: np.ndarray, vocab_size: int, where: str) -> None:
    bad = (ids < 0) | (ids >= vocab_size)
    if bad.any():
        raise UserError(f"{where}: token id {int(ids[bad][0])} at position {int(np.argmax(bad))} is outside "
                        f"the vocabulary [0, {vocab_size})")


def _collate(batch: list, pad_id: int, device: torch.device) -> tuple[torch.Tensor, ...]:
    """Datums right-padded into one forward: input ids and attention mask [B, T], target ids
    [B, T] (or [B, T, K])."""
    width = max(len(d.tokens) for d in batch)
    ids = torch.full((len(batch), width), pad_id, dtype=torch.long)
    targets = torch.zeros((len(batch), width, *batch[0].inputs["target_tokens"].shape[1:]), dtype=torch.long)
    mask = torch.zeros((len(batch), width), dtype=torch.long)
    for r, d in enumerate(batch):
        n = len(d.tokens)
        ids[r, :n] = torch.from_numpy(np.asarray(d.tokens, dtype=np.int64))
        targets[r, :n] = torch.from_numpy(d.inputs["target_tokens"].astype(np.int64))
        mask[r, :n] = 1
    return ids.to(device), mask.to(device), targets.to(device)


def forward_backward(adapters: Adapters, tm: TrainingModel, call: ForwardBackwardCall, *,
                     micro_batch_tokens: int) -> bytes:
    """Run ``call`` on ``tm``'s adapter: per datum the target logprobs
    (:func:`~plainrl.models.forward.target_logps`, the learner's chunked forward) and the
    elementwise loss; unless ``call.forward_only``, the gradient of the summed loss added to the
    adapter's ``.grad``, micro-batched as the learner's are (:func:`~plainrl.frames.pack_by_length`:
    at most ``micro_batch_tokens`` padded tokens each, longest first), each backpropagated at once.

    Returns:
        the protobuf ``ForwardBackwardOutput``: per datum ``logprobs`` and ``elementwise_loss`` [N],
        metric ``loss:sum``.
    """
    outputs: list[dict[str, np.ndarray]] = [{} for _ in call.data]
    total = 0.0
    pad = adapters.tokenizer.pad_token_id or 0
    names = INPUTS[call.loss_fn] + DERIVED_INPUTS.get(call.loss_fn, ())
    with adapters.use(tm.adapter) as model, torch.set_grad_enabled(not call.forward_only):
        device = next(model.parameters()).device
        for group in pack_by_length([len(d.tokens) for d in call.data], micro_batch_tokens):
            batch = [call.data[i] for i in group]
            ids, mask, targets = _collate(batch, pad, device)
            logps = target_logps(model, ids, mask, targets, positions=mask > 0)  # [B, T] or [B, T, K]
            losses = []
            for r, d in enumerate(batch):
                inputs = {k: torch.from_numpy(np.array(d.inputs[k], dtype=np.float32)).to(device) for k in names}
                losses.append(elementwise_loss(call.loss_fn, logps[r, : len(d.tokens)], inputs, call.loss_fn_config))
            loss = torch.stack([x.sum() for x in losses]).sum()
            if not call.forward_only:
                loss.backward()
            total += float(loss.detach())
            for r, (i, x) in enumerate(zip(group, losses)):
                outputs[i] = {"logprobs": logps[r, : len(call.data[i].tokens)].detach().float().cpu().numpy(),
                              "elementwise_loss": x.detach().float().cpu().numpy()}
    return encode_forward_backward_output(outputs, {"loss:sum": total})


def optim_step(tm: TrainingModel, *, learning_rate: float, beta1: float, beta2: float, eps: float,
               weight_decay: float, grad_clip_norm: float) -> dict[str, float]:
    """One AdamW step (decoupled weight decay; Loshchilov & Hutter 2019) on the gradients that
    ``forward_backward`` accumulated, clipped to a global norm of ``grad_clip_norm`` when it is
    positive; the gradients are then cleared. A non-finite gradient norm skips the update.

    Returns:
        metrics ``grad_norm`` (before clipping), ``learning_rate``, ``skipped`` (1.0 or 0.0).
    """
    tm.optimizer.set_hyperparameters(lr=learning_rate, betas=(beta1, beta2), eps=eps, weight_decay=weight_decay,
                                     max_grad_norm=grad_clip_norm if grad_clip_norm > 0 else None)
    grad_norm, skipped = tm.optimizer.step()
    tm.steps += 0 if skipped else 1
    return {"grad_norm": grad_norm, "learning_rate": learning_rate, "skipped": float(skipped)}
