"""Beside RL: the trainers of supervised fine-tuning (SFT), DPO and a Bradley-Terry
reward model (RM): examples from :mod:`plainrl.data.offline` padded into micro-batches,
each algorithm's objective, and :class:`OfflineTrainer`, one optimiser step
(:class:`MasterAdamW`) on a batch of examples. The run around it is
:func:`plainrl.run.offline.train_offline`.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass
from typing import Callable

import torch

from plainrl.algorithms import aggregate_loss, bradley_terry_loss, dpo_loss
from plainrl.config import Config
from plainrl.data.offline import Example
from plainrl.frames import pack_by_length
from plainrl.models import (
    enable_gradient_checkpointing,
    reference_policy,
    sequence_logps,
    sequence_scores,
    trainable_parameters,
)
from plainrl.train.distributed import Parallel, connected_positions
from plainrl.train.optim import MasterAdamW

__all__ = ["OBJECTIVES", "Batch", "OfflineTrainer", "Totals", "collate", "micro_batches"]


# ----------------------------------------------------------------------------- batches


@dataclass
class Batch:
    """Padded sequences of some examples: all first sequences (sft: the chat; dpo/rm:
    chosen), then all second ones (rejected).

    input_ids, attention_mask: [B, T]; mask: [B, T-1] 1 where target t+1 is trained on /
    scored; last: [B] the position of each sequence's last masked token (the RM reads
    its score there).
    """

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    mask: torch.Tensor
    last: torch.Tensor


def collate(examples: list[Example], pad_id: int) -> Batch:
    """Pad the examples' sequences (first sequences, then second ones) into one :class:`Batch`."""
    seqs = [ex.seqs[j] for j in range(len(examples[0].seqs)) for ex in examples]
    width = max(len(s.ids) for s in seqs)
    ids = torch.full((len(seqs), width), pad_id, dtype=torch.long)
    attn = torch.zeros((len(seqs), width), dtype=torch.long)
    mask = torch.zeros((len(seqs), width))
    for r, s in enumerate(seqs):
        ids[r, : len(s.ids)] = torch.tensor(s.ids)
        attn[r, : len(s.ids)] = 1
        mask[r, : len(s.ids)] = torch.tensor(s.mask, dtype=torch.float32)
    positions = torch.arange(width)
    last = torch.where(mask > 0, positions, -1).amax(dim=1)  # [B]
    return Batch(ids, attn, mask[:, 1:], last)


def micro_batches(examples: list[Example], token_budget: int) -> list[list[Example]]:
    """Examples grouped, longest first, so a group's padded tokens stay within the budget."""
    groups = pack_by_length([e.width for e in examples], token_budget, [len(e.seqs) for e in examples])
    return [[examples[i] for i in g] for g in groups]


# ----------------------------------------------------------------------------- objectives


@dataclass
class Totals:
    """Normalisers over the whole optimiser batch (sums of micro-batch losses equal one
    call on the batch): trained tokens and sequences (sft), pairs (dpo, rm)."""

    tokens: int
    seqs: int
    pairs: int


Objective = Callable[["OfflineTrainer", Batch, Totals], tuple[torch.Tensor, dict[str, float]]]


def _sft(t: "OfflineTrainer", b: Batch, n: Totals) -> tuple[torch.Tensor, dict[str, float]]:
    logps = t.call(sequence_logps, b.input_ids, b.attention_mask,
                   positions=connected_positions(b.mask > 0, t.parallel))  # [B, T-1]
    loss = aggregate_loss(-logps, b.mask, t.cfg.algorithm.loss_agg, num_tokens=n.tokens, num_seqs=n.seqs,
                          normalizer=t.cfg.model.max_context)
    nll = float(-(logps.detach() * b.mask).sum())
    return loss, {"nll": nll / max(1, n.tokens)}


def _response_logps(t: "OfflineTrainer", call, b: Batch) -> torch.Tensor:
    logps = call(sequence_logps, b.input_ids, b.attention_mask,
                 positions=connected_positions(b.mask > 0, t.parallel))  # [2P, T-1]
    return (logps * b.mask).sum(dim=1)  # [2P] log pi(y | x)


def _pair_metrics(chosen: torch.Tensor, rejected: torch.Tensor, pairs: int) -> dict[str, float]:
    return {"accuracy": float((chosen > rejected).float().sum()) / pairs,
            "margin": float((chosen - rejected).sum()) / pairs}


def _dpo(t: "OfflineTrainer", b: Batch, n: Totals) -> tuple[torch.Tensor, dict[str, float]]:
    policy = _response_logps(t, t.call, b).chunk(2)
    with torch.no_grad(), t.reference() as ref_call:
        ref = _response_logps(t, ref_call, b).chunk(2)
    losses, chosen, rejected = dpo_loss(policy[0], policy[1], ref[0], ref[1], beta=t.cfg.algorithm.beta)
    return losses.sum() / n.pairs, {**_pair_metrics(chosen, rejected, n.pairs),
                                    "chosen_reward": float(chosen.sum()) / n.pairs,
                                    "rejected_reward": float(rejected.sum()) / n.pairs}


def _rm(t: "OfflineTrainer", b: Batch, n: Totals) -> tuple[torch.Tensor, dict[str, float]]:
    chosen, rejected = t.call(sequence_scores, b.input_ids, b.attention_mask, b.last).chunk(2)
    loss = bradley_terry_loss(chosen, rejected).sum() / n.pairs
    return loss, _pair_metrics(chosen.detach(), rejected.detach(), n.pairs)


# algorithm.name -> objective; the keys are exactly config.OFFLINE_ALGORITHMS
OBJECTIVES: dict[str, Objective] = {"sft": _sft, "dpo": _dpo, "rm": _rm}


class OfflineTrainer:
    """The model, its optimiser and (DPO) the reference; :meth:`step` is one optimiser
    step on a batch of examples, :meth:`evaluate` the same objective without updates.

    The reference policy of DPO is, under LoRA, the policy the run starts from
    (:func:`plainrl.models.reference_policy`: a frozen copy of ``model.adapter`` when the
    run starts from one, else the base model with adapters disabled), or a frozen copy
    of the initial weights for full fine-tuning.

    ``parallel``: under torchrun, every rank gets the whole batch and computes on its
    shard, normalised by the global totals (as :class:`~plainrl.train.Learner`).
    """

    def __init__(self, model: torch.nn.Module, cfg: Config, *, pad_id: int, parallel: Parallel | None = None):
        self.model, self.cfg, self.pad_id = model, cfg, pad_id
        self.parallel = parallel or Parallel()
        self.objective = OBJECTIVES[cfg.algorithm.name]
        self.ref_model = None
        if cfg.algorithm.name == "dpo" and not cfg.model.lora.enabled:
            self.ref_model = self.parallel.frozen_copy(model)
        if cfg.train.gradient_checkpointing:  # sft, dpo and rm all train the model under autograd
            enable_gradient_checkpointing(model)
        self.call = self.parallel.wrap(model)  # every forward runs through it (DDP / FSDP2 hooks)
        self.ref_call = None if self.ref_model is None else self.parallel.wrap(self.ref_model, trainable=False)
        self.opt = MasterAdamW(trainable_parameters(model), cfg.train)  # FSDP2: on the sharded parameters

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    @contextlib.contextmanager
    def reference(self):
        """Yields the reference policy's call (see the class docstring)."""
        if self.ref_call is not None:
            yield self.ref_call
        else:
            with reference_policy(self.model):
                yield self.call

    def _run(self, examples: list[Example]) -> tuple[float, dict[str, float]]:
        """Forward (and backward, under grad) every micro-batch of this rank's share of
        ``examples``; returns the loss and metric sums over all ranks.

        Under torchrun a rank short of micro-batches runs copies of its first example with
        the loss weighted 0 (every rank runs as many forwards and backwards)."""
        par = self.parallel
        rows = par.shard(len(examples))
        mine = examples[rows.start: rows.stop]
        groups = micro_batches(mine, self.cfg.train.micro_batch_tokens) if mine else []
        batches = [collate(g, self.pad_id) for g in groups]
        real = len(batches)
        if extra := par.even_out(real):
            empty = collate([examples[rows.start]], self.pad_id)
            batches += [Batch(empty.input_ids, empty.attention_mask, torch.zeros_like(empty.mask), empty.last)] * extra
        pairs = len(examples) if len(examples[0].seqs) == 2 else 0
        tokens, seqs = par.sum([float(sum(b.mask.sum() for b in batches[:real])),
                                float(sum(len(b.last) for b in batches[:real]))])
        totals = Totals(tokens=int(tokens), seqs=int(seqs), pairs=max(1, pairs))
        loss_sum, sums = 0.0, {}
        for i, b in enumerate(batches):
            dev = self.device
            b = Batch(b.input_ids.to(dev), b.attention_mask.to(dev), b.mask.to(dev), b.last.to(dev))
            weight = 1.0 if i < real else 0.0  # a padding micro-batch: in the graph, out of the loss
            with par.no_sync(self.call, last=i == len(batches) - 1):
                loss, metrics = self.objective(self, b, totals)
                loss = loss * weight if weight != 1.0 else loss
                if torch.is_grad_enabled():
                    loss.backward()
            loss_sum += loss.item()
            for k, v in metrics.items():
                sums[k] = sums.get(k, 0.0) + v * weight
        keys = sorted(sums)
        loss_sum, *values = par.sum([loss_sum, *(sums[k] for k in keys)])
        return loss_sum, {**dict(zip(keys, values)), "tokens": float(totals.tokens)}

    def step(self, examples: list[Example]) -> dict[str, float]:
        """One optimiser step on ``examples`` (the loss normalised over all of them)."""
        self.model.train()
        lr = self.opt.lr
        loss, metrics = self._run(examples)
        grad_norm, skipped = self.opt.step(loss_finite=math.isfinite(loss))
        self.opt.scheduler.step()
        return {"loss": loss, **metrics, "grad_norm": grad_norm, "lr": lr, "skipped_step": float(skipped)}

    @torch.no_grad()
    def evaluate(self, examples: list[Example]) -> dict[str, float]:
        """The objective's loss and metrics on held-out examples, under ``eval/`` keys."""
        self.model.eval()
        try:
            out: dict[str, float] = {}
            size = self.cfg.train.batch_size
            chunks = [examples[i : i + size] for i in range(0, len(examples), size)]
            for chunk in chunks:
                loss, metrics = self._run(chunk)
                for k, v in {"loss": loss, **metrics}.items():
                    out[k] = out.get(k, 0.0) + v * len(chunk) / len(examples)
            out.pop("tokens", None)
            return {f"eval/{k}": v for k, v in out.items()} | {"eval/n": len(examples)}
        finally:
            self.model.train()
