"""Optimisation: micro-batches by token budget, fp32 logprobs in chunks, the policy
loss from :mod:`plainrl.algorithms`, AdamW with warm-up and gradient clipping."""

from __future__ import annotations

import contextlib
import copy
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from plainrl.algorithms import aggregate_loss, kl_estimate, policy_loss
from plainrl.config import Config
from plainrl.models import trainable_parameters
from plainrl.types import Episode, MicroBatch

# Largest [B, chunk, V] float32 block of logits held at once (elements): 2^26 = 256 MiB.
LOGIT_BLOCK_ELEMENTS = 1 << 26


def _unwrap(model: torch.nn.Module) -> torch.nn.Module:
    """The transformers model under a peft wrapper (LoRA layers stay injected)."""
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def _target_logps(hidden: torch.Tensor, lm_head: torch.nn.Module, targets: torch.Tensor, temperature: float) -> torch.Tensor:
    logits = lm_head(hidden).float()  # [c, V] float32, one chunk only
    if temperature != 1.0:
        logits = logits / temperature
    return torch.log_softmax(logits, dim=-1).gather(-1, targets[:, None]).squeeze(-1)  # [c]


def sequence_logps(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    *,
    temperature: float = 1.0,
    positions: torch.Tensor | None = None,
) -> torch.Tensor:
    """log pi_T(x_{t+1} | x_{<=t}) for every position, in float32, where
    pi_T = softmax(logits / temperature) is the policy the engine sampled from.

    The LM head and log-softmax run over chunks of positions so that no whole
    [B, T, V] float32 logits tensor exists; under autograd each chunk is
    checkpointed (recomputed in backward) so the chunks' logits are not kept either.

    Args:
        input_ids: [B, T] token ids (right-padded).
        attention_mask: [B, T] 1 on real tokens.
        temperature: the sampling temperature (1 = the model's own distribution).
        positions: optional [B, T-1] bool; the LM head runs only where it is True
            (the completion tokens: prompts are most of a sequence and need no logits).
    Returns:
        [B, T-1] float32 logprobs of ``input_ids[:, 1:]`` (0 where ``positions`` is False).
    """
    base = _unwrap(model)
    hidden = base.get_decoder()(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state  # [B, T, H]
    b, t = input_ids.shape
    # flatten to 2-D rows so every chunk is contiguous: a strided 3-D slice makes
    # F.linear fall back to a batched matmul that copies the whole LM head per row
    hidden = hidden[:, :-1].reshape(b * (t - 1), -1)  # [B*(T-1), H]
    targets = input_ids[:, 1:].reshape(-1)  # [B*(T-1)]
    index = None
    if positions is not None:
        index = positions.reshape(-1).nonzero().squeeze(-1)  # [K]
        hidden, targets = hidden[index], targets[index]
    lm_head = base.get_output_embeddings()
    chunk = max(1, LOGIT_BLOCK_ELEMENTS // lm_head.weight.shape[0])
    outs = []
    for s in range(0, hidden.shape[0], chunk):
        h, y = hidden[s : s + chunk], targets[s : s + chunk]
        if torch.is_grad_enabled():
            outs.append(checkpoint(_target_logps, h, lm_head, y, temperature, use_reentrant=False))
        else:
            outs.append(_target_logps(h, lm_head, y, temperature))
    flat = torch.cat(outs) if outs else hidden.new_zeros(0, dtype=torch.float32)
    if index is None:
        return flat.view(b, t - 1)
    return torch.zeros(b * (t - 1), dtype=flat.dtype, device=flat.device).index_put((index,), flat).view(b, t - 1)


def make_micro_batches(
    episodes: list[Episode], advantages: torch.Tensor, *, pad_id: int, token_budget: int
) -> list[MicroBatch]:
    """Group episodes into padded micro-batches of at most ``token_budget`` padded tokens.

    Episodes are sorted by length first so each micro-batch pads to a similar
    length (less wasted compute than padding everything to the longest).

    Args:
        episodes: N episodes.
        advantages: [N] one advantage per episode.
    Returns:
        micro-batches covering every episode exactly once.
    """
    order = sorted(range(len(episodes)), key=lambda i: -_len(episodes[i]))
    groups: list[list[int]] = []
    for i in order:
        # sorted descending, so the group's first member sets its padded width
        if groups and (len(groups[-1]) + 1) * _len(episodes[groups[-1][0]]) <= token_budget:
            groups[-1].append(i)
        else:
            groups.append([i])
    return [_collate([episodes[i] for i in g], advantages[g], pad_id) for g in groups]


def _len(ep: Episode) -> int:
    return len(ep.prompt_ids) + len(ep.completion_ids)


def _collate(eps: list[Episode], adv: torch.Tensor, pad_id: int) -> MicroBatch:
    width = max(_len(e) for e in eps)
    b = len(eps)
    ids = torch.full((b, width), pad_id, dtype=torch.long)
    attn = torch.zeros((b, width), dtype=torch.long)
    loss_mask = torch.zeros((b, width - 1))
    old = torch.zeros((b, width - 1))
    for r, e in enumerate(eps):
        p, n = len(e.prompt_ids), len(e.completion_ids)
        ids[r, : p + n] = torch.tensor(e.prompt_ids + e.completion_ids)
        attn[r, : p + n] = 1
        # target index t predicts token t+1: completion token k sits at target p-1+k
        loss_mask[r, p - 1 : p - 1 + n] = torch.tensor(e.loss_mask, dtype=torch.float32)
        old[r, p - 1 : p - 1 + n] = torch.tensor(e.logprobs)
    return MicroBatch(input_ids=ids, attention_mask=attn, loss_mask=loss_mask, old_logps=old, advantages=adv.float())


def lr_lambda(step: int, *, warmup: int, total: int, schedule: str) -> float:
    """Multiplier of the base LR at optimiser step ``step`` (0-based): linear warm-up
    over ``warmup`` steps, then constant or cosine decay to 0 at ``total``."""
    if step < warmup:
        return (step + 1) / warmup
    if schedule == "cosine":
        progress = (step - warmup) / max(1, total - warmup)
        return 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))
    return 1.0


@dataclass
class UpdateStats:
    loss: float
    grad_norm: float
    kl: float
    clip_frac: float
    lr: float
    num_tokens: int
    micro_batches: int
    skipped: bool


class Learner:
    """Holds the optimiser and scheduler; one :meth:`update` is one optimiser step.

    The reference policy for the KL term is the same model with adapters disabled
    under LoRA (no second copy), or a frozen copy for full fine-tuning.
    """

    def __init__(self, model: torch.nn.Module, cfg: Config, *, pad_id: int):
        self.model, self.cfg, self.pad_id = model, cfg, pad_id
        t = cfg.train
        self.params = trainable_parameters(model)
        # Mixed precision (Micikevicius et al. 2018): the optimiser updates fp32 master
        # copies; bf16 parameters would round away updates smaller than ~0.4% of a weight.
        self.master = [
            p if p.dtype == torch.float32 else p.detach().float().requires_grad_(True) for p in self.params
        ]
        self.optimizer = torch.optim.AdamW(self.master, lr=t.lr, betas=t.betas, weight_decay=t.weight_decay)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer,
            lambda s: lr_lambda(s, warmup=t.warmup_steps, total=t.steps, schedule=t.lr_schedule),
        )
        self.temperature = cfg.rollout.temperature or 1.0
        self.ref_model = None
        if cfg.algorithm.kl_coef > 0 and not cfg.model.lora.enabled:
            self.ref_model = copy.deepcopy(model).eval().requires_grad_(False)

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    def _ref_context(self):
        if self.ref_model is None and hasattr(self.model, "disable_adapter"):
            return self.model.disable_adapter()
        return contextlib.nullcontext()

    @torch.no_grad()
    def _ref_logps(self, ids: torch.Tensor, attn: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        with self._ref_context():
            return sequence_logps(self.ref_model or self.model, ids, attn, temperature=self.temperature, positions=mask > 0)

    def update(self, episodes: list[Episode], advantages: torch.Tensor) -> UpdateStats:
        """One optimiser step on a rollout batch (on-policy, one pass).

        Old logprobs are the current ones detached (ratio exactly 1 at the first and
        only pass), which saves a forward; clipping matters once several passes are made.

        Args:
            episodes: N episodes of this step.
            advantages: [N] per-episode advantages.
        """
        a, dev = self.cfg.algorithm, self.device
        mbs = make_micro_batches(episodes, advantages, pad_id=self.pad_id, token_budget=self.cfg.train.micro_batch_tokens)
        num_tokens = int(sum(mb.loss_mask.sum().item() for mb in mbs))
        num_seqs = len(episodes)
        normalizer = self.cfg.rollout.max_new_tokens
        loss_sum = kl_sum = clip_sum = 0.0
        self.model.train()
        for mb in mbs:
            ids, attn = mb.input_ids.to(dev), mb.attention_mask.to(dev)
            mask, adv = mb.loss_mask.to(dev), mb.advantages.to(dev)
            logps = sequence_logps(self.model, ids, attn, temperature=self.temperature, positions=mask > 0)  # [B, T-1]
            agg = dict(num_tokens=num_tokens, num_seqs=num_seqs, normalizer=normalizer)
            loss, stats = policy_loss(
                logps, logps.detach(), adv, mask, clip_low=a.clip_low, clip_high=a.clip_high,
                dual_clip=a.dual_clip, agg=a.loss_agg, **agg,
            )
            if a.kl_coef > 0:
                kl = kl_estimate(logps, self._ref_logps(ids, attn, mask), a.kl_estimator)  # [B, T-1]
                kl_loss = aggregate_loss(kl, mask, a.loss_agg, **agg)
                loss = loss + a.kl_coef * kl_loss
                kl_sum += kl_loss.item()
            loss.backward()
            loss_sum += loss.item()
            clip_sum += float(stats["clip_frac"]) * float(mask.sum())
        for m, p in zip(self.master, self.params):
            if m is not p:
                m.grad = None if p.grad is None else p.grad.float()
                p.grad = None
        grad_norm = torch.nn.utils.clip_grad_norm_(self.master, self.cfg.train.max_grad_norm or float("inf"))
        skipped = not torch.isfinite(grad_norm).item() or not math.isfinite(loss_sum)
        lr = self.scheduler.get_last_lr()[0]
        if not skipped:
            self.optimizer.step()
            with torch.no_grad():
                for m, p in zip(self.master, self.params):
                    if m is not p:
                        p.copy_(m)
        self.optimizer.zero_grad(set_to_none=True)
        self.scheduler.step()
        return UpdateStats(
            loss=loss_sum, grad_norm=float(grad_norm), kl=kl_sum, clip_frac=clip_sum / max(1, num_tokens),
            lr=lr, num_tokens=num_tokens, micro_batches=len(mbs), skipped=skipped,
        )
