"""Optimisation: micro-batches by token budget, fp32 logprobs in chunks, the policy
loss from :mod:`plainrl.algorithms`, AdamW with warm-up and gradient clipping;
several passes (``algorithm.ppo_epochs``) over mini-batches (``algorithm.mini_batches``)
of one rollout batch."""

from __future__ import annotations

import contextlib
import copy
import math
import warnings
from dataclasses import dataclass

import torch
from torch.utils.checkpoint import checkpoint

from plainrl.algorithms import aggregate_loss, entropy_from_logits, kl_estimate, policy_loss
from plainrl.config import Config, TrainConfig
from plainrl.models import trainable_parameters, unwrap
from plainrl.types import Episode, MicroBatch

# Largest [B, chunk, V] float32 block of logits held at once (elements): 2^26 = 256 MiB.
LOGIT_BLOCK_ELEMENTS = 1 << 26


def _target_logps(
    hidden: torch.Tensor, lm_head: torch.nn.Module, targets: torch.Tensor, temperature: float, with_entropy: bool
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    logits = lm_head(hidden).float()  # [c, V] float32, one chunk only
    if temperature != 1.0:
        logits = logits / temperature
    logps = torch.log_softmax(logits, dim=-1).gather(-1, targets[:, None]).squeeze(-1)  # [c]
    return (logps, entropy_from_logits(logits)) if with_entropy else logps


def shared_prompt_hidden(
    base: torch.nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor, prompt_lens: torch.Tensor
) -> torch.Tensor | None:
    """The decoder's last hidden states [B, T, H] with each distinct prompt run once.

    A GRPO group's samples share their prompt, and a prompt is often longer than the
    completions; recomputing it for every sample is most of the training forward and
    backward. Here the distinct prompts run first (left-padded so they all end at
    column P, with use_cache), their keys and values are repeated to the rows that
    share them (an index, so gradients from every row sum into the one prompt
    computation), and the completions run on top with the cache. The result is laid out
    as the plain forward's: row b's position i is prompt column P - p_b + i for i < p_b,
    else completion column i - p_b. The mathematics is that of one causal forward per
    row; only float rounding differs.

    Args:
        base: the unwrapped transformers causal LM.
        input_ids: [B, T] prompt + completion, right-padded.
        attention_mask: [B, T] 1 on real tokens.
        prompt_lens: [B] prompt tokens per row.
    Returns:
        [B, T, H] hidden states (padding positions hold finite values of no meaning),
        or None when no two rows share a prompt (nothing to save).
    """
    from transformers import DynamicCache

    b, t = input_ids.shape
    lens = attention_mask.sum(1).tolist()
    p_lens = prompt_lens.tolist()
    first: dict[tuple[int, ...], int] = {}
    owner = [first.setdefault(tuple(input_ids[r, : p_lens[r]].tolist()), len(first)) for r in range(b)]
    if len(first) == b or min(p_lens) < 1:
        return None
    dev = input_ids.device
    width = max(p_lens)  # P: prompts end at column P
    suffix = max(n - p for n, p in zip(lens, p_lens))  # longest completion
    prompt_ids = torch.zeros(len(first), width, dtype=torch.long, device=dev)
    prompt_mask = torch.zeros(len(first), width, dtype=torch.long, device=dev)
    for key, g in first.items():
        prompt_ids[g, width - len(key):] = torch.tensor(key, device=dev)
        prompt_mask[g, width - len(key):] = 1
    comp_ids = torch.zeros(b, suffix, dtype=torch.long, device=dev)
    comp_mask = torch.zeros(b, suffix, dtype=torch.long, device=dev)
    for r in range(b):
        comp_ids[r, : lens[r] - p_lens[r]] = input_ids[r, p_lens[r] : lens[r]]
        comp_mask[r, : lens[r] - p_lens[r]] = 1
    owner_t = torch.tensor(owner, device=dev)
    p_t = prompt_lens.to(dev)
    decoder = base.get_decoder()
    cache = DynamicCache()
    prompt_pos = (prompt_mask.cumsum(-1) - 1).clamp(min=0)
    prompt_hidden = decoder(input_ids=prompt_ids, attention_mask=prompt_mask, position_ids=prompt_pos,
                            past_key_values=cache, use_cache=True).last_hidden_state  # [G, P, H]
    cache.batch_select_indices(owner_t)  # [G, ...] -> [B, ...], differentiable
    comp_pos = p_t[:, None] + torch.arange(suffix, device=dev)[None]  # [B, C]
    comp_hidden = decoder(input_ids=comp_ids, attention_mask=torch.cat([prompt_mask[owner_t], comp_mask], dim=1),
                          position_ids=comp_pos, past_key_values=cache, use_cache=True).last_hidden_state  # [B, C, H]
    joined = torch.cat([prompt_hidden[owner_t], comp_hidden], dim=1)  # [B, P + C, H]
    column = (width - p_t[:, None] + torch.arange(t, device=dev)[None]).clamp(max=width + suffix - 1)  # [B, T]
    return joined.gather(1, column[..., None].expand(-1, -1, joined.shape[-1]))


def sequence_logps(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    *,
    temperature: float = 1.0,
    positions: torch.Tensor | None = None,
    with_entropy: bool = False,
    prompt_lens: torch.Tensor | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """log pi_T(x_{t+1} | x_{<=t}) for every position, in float32, where
    pi_T = softmax(logits / temperature) is the policy the engine sampled from;
    optionally also the entropy of pi_T at each position.

    The LM head and log-softmax run over chunks of positions so that no whole
    [B, T, V] float32 logits tensor exists; under autograd each chunk is
    checkpointed (recomputed in backward) so the chunks' logits are not kept either.

    Args:
        input_ids: [B, T] token ids (right-padded).
        attention_mask: [B, T] 1 on real tokens.
        temperature: the sampling temperature (1 = the model's own distribution).
        positions: optional [B, T-1] bool; the LM head runs only where it is True
            (the completion tokens: prompts are most of a sequence and need no logits).
        with_entropy: also return the entropy of pi_T (:func:`entropy_from_logits`).
        prompt_lens: optional [B] prompt lengths; rows with identical prompts then run
            their prompt once (:func:`shared_prompt_hidden`).
    Returns:
        [B, T-1] float32 logprobs of ``input_ids[:, 1:]`` (0 where ``positions`` is False);
        with ``with_entropy``, ``(logps, entropy)``, both [B, T-1].
    """
    base = unwrap(model)
    hidden = None
    if prompt_lens is not None:
        hidden = shared_prompt_hidden(base, input_ids, attention_mask, prompt_lens)
    if hidden is None:
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
            out = checkpoint(_target_logps, h, lm_head, y, temperature, with_entropy, use_reentrant=False)
        else:
            out = _target_logps(h, lm_head, y, temperature, with_entropy)
        outs.append(out if with_entropy else (out,))
    columns = [torch.cat(c) for c in zip(*outs)] or [hidden.new_zeros(0, dtype=torch.float32)] * (1 + with_entropy)

    def unflatten(flat: torch.Tensor) -> torch.Tensor:
        if index is None:
            return flat.view(b, t - 1)
        return torch.zeros(b * (t - 1), dtype=flat.dtype, device=flat.device).index_put((index,), flat).view(b, t - 1)

    results = [unflatten(c) for c in columns]
    return tuple(results) if with_entropy else results[0]


def completion_tensor(episodes: list[Episode], values: list[list[float]] | None = None) -> torch.Tensor:
    """Per-token lists of N episodes as one right-padded [N, L] float32 tensor, L the
    longest completion: the *completion frame* (position k = completion token k).
    ``values`` default to the episodes' loss masks."""
    rows = values if values is not None else [e.loss_mask for e in episodes]
    out = torch.zeros(len(episodes), max((len(e.completion_ids) for e in episodes), default=0))
    for i, r in enumerate(rows):
        out[i, : len(r)] = torch.tensor(r, dtype=torch.float32)
    return out


def pack_by_length(widths: list[int], token_budget: int, rows: list[int] | None = None) -> list[list[int]]:
    """Indices grouped longest first so each group's padded size, members x rows each x
    the group's longest width, stays within ``token_budget`` (a single item may exceed it).

    Args:
        widths: [N] padded length of each item.
        rows: [N] sequences per item (2 for a chosen/rejected pair); default 1.
    Returns:
        groups of indices covering 0..N-1 exactly once.
    """
    rows = rows or [1] * len(widths)
    groups: list[list[int]] = []
    for i in sorted(range(len(widths)), key=lambda i: -widths[i]):
        # sorted descending, so the group's first member sets its padded width
        if groups and (len(groups[-1]) + 1) * rows[i] * widths[groups[-1][0]] <= token_budget:
            groups[-1].append(i)
        else:
            groups.append([i])
    return groups


def make_micro_batches(
    episodes: list[Episode],
    advantages: torch.Tensor,
    *,
    pad_id: int,
    token_budget: int,
    old_logps: torch.Tensor | None = None,
    old_values: torch.Tensor | None = None,
    returns: torch.Tensor | None = None,
) -> list[MicroBatch]:
    """Group episodes into padded micro-batches of at most ``token_budget`` padded tokens.

    Episodes are sorted by length first so each micro-batch pads to a similar
    length (less wasted compute than padding everything to the longest).

    Args:
        episodes: N episodes.
        advantages: [N] one advantage per episode, or [N, L] per completion token.
        old_logps: [N, L] logprobs to use as pi_old instead of the engine's.
        old_values, returns: [N, L] critic values at rollout time and critic targets (GAE).
            (All [N, L] tensors are in the completion frame of :func:`completion_tensor`.)
    Returns:
        micro-batches covering every episode exactly once.
    """
    groups = pack_by_length([_len(e) for e in episodes], token_budget)
    frames = {"advantages": advantages, "old_logps": old_logps, "old_values": old_values, "returns": returns}
    return [_collate(episodes, g, pad_id, {k: v for k, v in frames.items() if v is not None}) for g in groups]


def _len(ep: Episode) -> int:
    return len(ep.prompt_ids) + len(ep.completion_ids)


def _collate(episodes: list[Episode], index: list[int], pad_id: int, frames: dict[str, torch.Tensor]) -> MicroBatch:
    eps = [episodes[i] for i in index]
    width = max(_len(e) for e in eps)
    b = len(eps)
    ids = torch.full((b, width), pad_id, dtype=torch.long)
    attn = torch.zeros((b, width), dtype=torch.long)
    loss_mask = torch.zeros((b, width - 1))
    old = torch.zeros((b, width - 1))
    pos = torch.full((b, width - 1), -1, dtype=torch.long)
    for r, e in enumerate(eps):
        p, n = len(e.prompt_ids), len(e.completion_ids)
        ids[r, : p + n] = torch.tensor(e.prompt_ids + e.completion_ids)
        attn[r, : p + n] = 1
        # target index t predicts token t+1: completion token k sits at target p-1+k
        loss_mask[r, p - 1 : p - 1 + n] = torch.tensor(e.loss_mask, dtype=torch.float32)
        old[r, p - 1 : p - 1 + n] = torch.tensor(e.logprobs)
        pos[r, p - 1 : p - 1 + n] = torch.arange(n)
    idx = torch.tensor(index)
    fields = {}
    for name, frame in frames.items():
        if name == "advantages" and frame.dim() == 1:
            fields[name] = frame[idx].float()  # [B], broadcast over tokens by the loss
            continue
        rows = frame[idx].float()  # [B, L]
        if rows.shape[1] == 0:  # every completion empty
            fields[name] = torch.zeros(pos.shape)
            continue
        fields[name] = torch.where(pos >= 0, rows.gather(1, pos.clamp(0, rows.shape[1] - 1)), 0.0)
    fields.setdefault("old_logps", old)
    prompt_lens = torch.tensor([len(e.prompt_ids) for e in eps])
    return MicroBatch(input_ids=ids, attention_mask=attn, loss_mask=loss_mask, index=idx, completion_pos=pos,
                      prompt_lens=prompt_lens, **fields)


def to_completion_frame(x: torch.Tensor, mb: MicroBatch, out: torch.Tensor) -> None:
    """Write a micro-batch's [B, T-1] per-target values into ``out`` [N, L] (the
    completion frame), at each row's episode index."""
    sel = mb.completion_pos >= 0  # [B, T-1]
    rows = mb.index.to(x.device)[:, None].expand_as(sel)[sel]
    out[rows.cpu(), mb.completion_pos[sel].cpu()] = x[sel.to(x.device)].detach().float().cpu()


def mini_batch_indices(n: int, epochs: int, mini_batches: int) -> list[torch.Tensor]:
    """Episode indices of each optimiser step: ``epochs`` passes, each split into
    ``mini_batches`` parts, reshuffled every pass by the global torch RNG (seeded, and
    restored on resume); with one part, the batch in order and no RNG drawn."""
    steps = []
    for _ in range(epochs):
        order = torch.randperm(n) if mini_batches > 1 else torch.arange(n)
        steps.extend(part for part in order.tensor_split(mini_batches) if len(part))
    return steps


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
        self.optimizer = torch.optim.AdamW(
            self.master, lr=lr or train.lr, betas=train.betas, weight_decay=train.weight_decay
        )
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer,
            lambda s: lr_lambda(s, warmup=train.warmup_steps, total=train.steps, schedule=train.lr_schedule),
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
        skipped = not torch.isfinite(grad_norm).item() or not loss_finite
        if not skipped:
            self.optimizer.step()
            with torch.no_grad():
                for m, p in zip(self.master, self.params):
                    if m is not p:
                        p.copy_(m)
        self.optimizer.zero_grad(set_to_none=True)
        return float(grad_norm), skipped


@dataclass
class UpdateStats:
    """One :meth:`Learner.update`: means over its optimiser steps (``loss``, ``kl``,
    ``entropy``, ``grad_norm``), loss-token means (``clip_frac``, ``approx_kl``), and
    totals (``num_tokens``: loss tokens over all steps, ``micro_batches``)."""

    loss: float
    grad_norm: float
    kl: float
    clip_frac: float
    lr: float
    num_tokens: int
    micro_batches: int
    skipped: bool
    entropy: float = 0.0
    approx_kl: float = 0.0
    optimizer_steps: int = 1

    @staticmethod
    def merge(steps: list["UpdateStats"]) -> "UpdateStats":
        """Several optimiser steps of one update as one record."""
        mean = lambda k: sum(getattr(s, k) for s in steps) / len(steps)  # noqa: E731
        tokens = sum(s.num_tokens for s in steps)
        per_token = lambda k: sum(getattr(s, k) * s.num_tokens for s in steps) / max(1, tokens)  # noqa: E731
        return UpdateStats(
            loss=mean("loss"), grad_norm=mean("grad_norm"), kl=mean("kl"), clip_frac=per_token("clip_frac"),
            lr=steps[0].lr, num_tokens=tokens,
            micro_batches=sum(s.micro_batches for s in steps), skipped=any(s.skipped for s in steps),
            entropy=mean("entropy"), approx_kl=per_token("approx_kl"), optimizer_steps=len(steps),
        )


class Learner:
    """Holds the optimiser and scheduler; one :meth:`update` is one rollout batch:
    ``algorithm.ppo_epochs`` passes of ``algorithm.mini_batches`` optimiser steps each.

    The reference policy for the KL term is the same model with adapters disabled
    under LoRA (no second copy), or a frozen copy for full fine-tuning.
    """

    def __init__(self, model: torch.nn.Module, cfg: Config, *, pad_id: int):
        self.model, self.cfg, self.pad_id = model, cfg, pad_id
        self.opt = MasterAdamW(trainable_parameters(model), cfg.train)
        self.params, self.master = self.opt.params, self.opt.master
        self.optimizer, self.scheduler = self.opt.optimizer, self.opt.scheduler
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

    def _prompt_lens(self, mb: MicroBatch) -> torch.Tensor | None:
        return mb.prompt_lens if self.cfg.train.share_prompts else None

    @torch.no_grad()
    def _ref_logps(self, mb: MicroBatch) -> torch.Tensor:
        dev = self.device
        with self._ref_context():
            return sequence_logps(self.ref_model or self.model, mb.input_ids.to(dev), mb.attention_mask.to(dev),
                                  temperature=self.temperature, positions=mb.loss_mask.to(dev) > 0,
                                  prompt_lens=self._prompt_lens(mb))

    @torch.no_grad()
    def completion_logps(self, episodes: list[Episode], *, reference: bool = False) -> torch.Tensor:
        """Logprobs of the episodes' loss tokens under the current policy (or the
        reference), without gradient.

        Returns:
            [N, L] float32 in the completion frame (:func:`completion_tensor`), 0 off the loss mask.
        """
        out = torch.zeros(len(episodes), max((len(e.completion_ids) for e in episodes), default=0))
        mbs = make_micro_batches(episodes, torch.zeros(len(episodes)), pad_id=self.pad_id,
                                 token_budget=self.cfg.train.micro_batch_tokens)
        dev = self.device
        for mb in mbs:
            if reference:
                lp = self._ref_logps(mb)
            else:
                lp = sequence_logps(self.model, mb.input_ids.to(dev), mb.attention_mask.to(dev),
                                    temperature=self.temperature, positions=mb.loss_mask.to(dev) > 0,
                                    prompt_lens=self._prompt_lens(mb))
            to_completion_frame(lp, mb, out)
        return out

    def update(self, episodes: list[Episode], advantages: torch.Tensor) -> UpdateStats:
        """Optimise the policy on one rollout batch; steps the LR schedule once.

        One pass over one mini-batch (the default) is on-policy: old logprobs are the
        current ones detached (ratio exactly 1), which saves a forward. With several
        passes or mini-batches the old logprobs are recomputed by the learner, without
        gradient, before the first optimiser step, so the ratio measures how far the
        policy moved within this update and clipping takes effect.

        Args:
            episodes: N episodes of this step.
            advantages: [N] per-episode advantages, or [N, L] per completion token.
        """
        a = self.cfg.algorithm
        old = self.completion_logps(episodes) if a.multi_pass else None  # [N, L]
        steps = []
        for idx in mini_batch_indices(len(episodes), a.ppo_epochs, a.mini_batches):
            steps.append(self._step([episodes[i] for i in idx], advantages[idx], None if old is None else old[idx]))
        self.scheduler.step()
        return UpdateStats.merge(steps)

    def skip(self) -> UpdateStats:
        """Advance the LR schedule without touching the policy (PPO critic warm-up)."""
        lr = self.opt.lr
        with warnings.catch_warnings():  # "scheduler.step() before optimizer.step()": deliberate here
            warnings.simplefilter("ignore", UserWarning)
            self.scheduler.step()
        return UpdateStats(loss=0.0, grad_norm=0.0, kl=0.0, clip_frac=0.0, lr=lr, num_tokens=0, micro_batches=0,
                           skipped=False, optimizer_steps=0)

    def _step(self, episodes: list[Episode], advantages: torch.Tensor, old_logps: torch.Tensor | None) -> UpdateStats:
        """One optimiser step on a mini-batch, its loss normalised over the whole mini-batch."""
        a, dev = self.cfg.algorithm, self.device
        mbs = make_micro_batches(episodes, advantages, pad_id=self.pad_id,
                                 token_budget=self.cfg.train.micro_batch_tokens, old_logps=old_logps)
        num_tokens = int(sum(mb.loss_mask.sum().item() for mb in mbs))
        agg = dict(num_tokens=num_tokens, num_seqs=len(episodes), normalizer=self.cfg.rollout.max_new_tokens)
        loss_sum = kl_sum = ent_sum = clip_sum = approx_kl_sum = 0.0
        self.model.train()
        for mb in mbs:
            ids, attn = mb.input_ids.to(dev), mb.attention_mask.to(dev)
            mask, adv = mb.loss_mask.to(dev), mb.advantages.to(dev)
            out = sequence_logps(self.model, ids, attn, temperature=self.temperature, positions=mask > 0,
                                 with_entropy=a.entropy_coef > 0, prompt_lens=self._prompt_lens(mb))
            logps, entropy = out if a.entropy_coef > 0 else (out, None)  # [B, T-1]
            old = logps.detach() if old_logps is None else mb.old_logps.to(dev)
            loss, stats = policy_loss(
                logps, old, adv, mask, clip_low=a.clip_low, clip_high=a.clip_high,
                dual_clip=a.dual_clip, ratio_level=a.ratio_level, agg=a.loss_agg, **agg,
            )
            if a.kl_coef > 0 and a.kl_placement == "loss":
                kl = kl_estimate(logps, self._ref_logps(mb), a.kl_estimator)  # [B, T-1]
                kl_loss = aggregate_loss(kl, mask, a.loss_agg, **agg)
                loss = loss + a.kl_coef * kl_loss
                kl_sum += kl_loss.item()
            if entropy is not None:
                ent = aggregate_loss(entropy, mask, a.loss_agg, **agg)
                loss = loss - a.entropy_coef * ent  # a bonus: higher entropy lowers the loss
                ent_sum += ent.item()
            if loss.requires_grad:  # no loss token in this micro-batch (e.g. all filtered): nothing to learn
                loss.backward()
            loss_sum += loss.item()
            tokens = float(mask.sum())
            clip_sum += float(stats["clip_frac"]) * tokens
            approx_kl_sum += float(stats["approx_kl"]) * tokens
        lr = self.opt.lr
        grad_norm, skipped = self.opt.step(loss_finite=math.isfinite(loss_sum))
        return UpdateStats(
            loss=loss_sum, grad_norm=grad_norm, kl=kl_sum, clip_frac=clip_sum / max(1, num_tokens),
            lr=lr, num_tokens=num_tokens, micro_batches=len(mbs), skipped=skipped, entropy=ent_sum,
            approx_kl=approx_kl_sum / max(1, num_tokens),
        )
