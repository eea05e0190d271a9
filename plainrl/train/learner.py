"""The policy learner: one rollout batch -> ``algorithm.ppo_epochs`` passes of
``algorithm.mini_batches`` optimiser steps, each over micro-batches by token budget,
with the policy loss of :mod:`plainrl.algorithms` and the optimiser of
:mod:`plainrl.train.optim`."""

from __future__ import annotations

import contextlib
import dataclasses
import math
import warnings
from dataclasses import dataclass
from typing import Callable

import torch

from plainrl.algorithms import aggregate_loss, kl_estimate, policy_loss
from plainrl.algorithms.distill import topk_generalized_jsd
from plainrl.algorithms.is_correction import Bounds, Tally, correct
from plainrl.algorithms.kl import LOG_RATIO_CLAMP
from plainrl.algorithms.sampling_filter import filtering
from plainrl.config import AlgorithmConfig, TrainConfig
from plainrl.frames import completion_frame, make_micro_batches, to_completion_frame
from plainrl.models import (
    enable_gradient_checkpointing,
    reference_policy,
    sequence_logps,
    sequence_topk,
    trainable_parameters,
)
from plainrl.train.distributed import Parallel, connected_positions
from plainrl.train.optim import MasterAdamW
from plainrl.types import Episode, MicroBatch


def mini_batch_indices(n: int, epochs: int, mini_batches: int) -> list[torch.Tensor]:
    """Episode indices of each optimiser step: ``epochs`` passes, each split into
    ``mini_batches`` parts, reshuffled every pass by the global torch RNG (seeded, and
    restored on resume); with one part, the batch in order and no RNG drawn."""
    steps = []
    for _ in range(epochs):
        order = torch.randperm(n) if mini_batches > 1 else torch.arange(n)
        steps.extend(part for part in order.tensor_split(mini_batches) if len(part))
    return steps


@dataclass
class UpdateStats:
    """One :meth:`Learner.update`: means over its optimiser steps (``loss``, ``kl``,
    ``entropy``, ``grad_norm``), loss-token means (``clip_frac``, ``approx_kl``), and
    totals (``num_tokens``: loss tokens over all steps, ``micro_batches``).

    ``logprob_diff`` is the mean |learner logprob - engine logprob| of the sampled tokens
    before the update: 0 up to float rounding when engine and learner compute the same
    policy; larger values mean the rollouts are off-policy by numerics (precision, kernels)."""

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
    logprob_diff: float = 0.0

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
            logprob_diff=steps[0].logprob_diff,  # the first step's forward is the rollout policy's
        )


class Learner:
    """Holds the optimiser and scheduler; one :meth:`update` is one rollout batch:
    ``algorithm.ppo_epochs`` passes of ``algorithm.mini_batches`` optimiser steps each.

    The reference policy for the KL term is, under LoRA, the same model with adapters
    disabled (no second copy) or with the frozen copy of ``model.adapter`` switched in
    (:func:`plainrl.models.reference_policy`), or a frozen copy for full fine-tuning.

    Args:
        model: the policy (a peft model under LoRA).
        algorithm: the ``algorithm`` section (loss, clipping, KL, entropy, epochs).
        train: the ``train`` section (optimiser, ``micro_batch_tokens``, ``share_prompts``,
            ``gradient_checkpointing``: the model's decoder layers are then checkpointed, the
            reference copy's not, as it never runs under autograd; ``packing``: micro-batches
            by real tokens, each forward packed without padding, :mod:`plainrl.models.packing`).
        pad_id: padding token id.
        temperature: the sampling temperature (``rollout.temperature``; 0 = greedy counts as 1):
            logprobs are of softmax(logits / temperature), the distribution sampled from.
        top_k, top_p: the sampler's filter (``rollout.top_k``, ``rollout.top_p``; 0 and 1.0: off).
            The off-policy correction's ratio is then taken after the same filter, as the engine's
            logprobs are (:mod:`plainrl.algorithms.sampling_filter`); the loss's own ratio is not.
        completion_budget: the most completion tokens an episode can have
            (``rollout.completion_budget``: ``max_total_tokens`` for multi-turn), the
            constant of Dr. GRPO's ``seq-mean-token-sum-norm``.
        copy_reference: keep a frozen copy of the model as the KL reference (full
            fine-tuning with ``kl_coef > 0``); under LoRA the reference is the policy the
            run starts from (:func:`plainrl.models.reference_policy`: the frozen copy of
            ``model.adapter`` when there is one, else the base with adapters disabled).
        parallel: under torchrun, this rank's :class:`~plainrl.train.distributed.Parallel`:
            the model is wrapped for ``train.strategy`` here (before the optimiser is built),
            every rank gets the whole batch and computes on its shard, and the loss is
            normalised by the global counts, so the update is the one-process update.
            Default: one process.
    """

    def __init__(self, model: torch.nn.Module, algorithm: AlgorithmConfig, train: TrainConfig, *, pad_id: int,
                 temperature: float, completion_budget: int, copy_reference: bool, parallel: Parallel | None = None,
                 top_k: int = 0, top_p: float = 1.0):
        self.model, self.algorithm, self.train, self.pad_id = model, algorithm, train, pad_id
        self.parallel = parallel or Parallel()
        self.temperature = temperature or 1.0
        self.completion_budget = completion_budget
        self.ref_model = self.parallel.frozen_copy(model) if copy_reference else None
        if train.gradient_checkpointing:
            enable_gradient_checkpointing(model)
        # every forward runs through these (DDP / FSDP2 hooks; in one process a plain call)
        self.call = self.parallel.wrap(model)
        self.ref_call = None if self.ref_model is None else self.parallel.wrap(self.ref_model, trainable=False)
        self.opt = MasterAdamW(trainable_parameters(model), train)  # FSDP2: on the sharded parameters
        self.params, self.master = self.opt.params, self.opt.master
        self.optimizer, self.scheduler = self.opt.optimizer, self.opt.scheduler
        # algorithm.correction as run.correction resolved it (a list); is_tally: the is/* metrics, read by the loop
        self.is_methods = algorithm.correction.methods
        self.is_bounds = Bounds(**algorithm.correction.bounds())
        self.is_tally = Tally()
        # greedy decoding records unfiltered logprobs (vLLM's too), so a filter matters only when sampling
        self.sampling_filter = (top_k, top_p) if temperature and filtering(top_k, top_p) else None

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    def reference_context(self) -> contextlib.AbstractContextManager:
        """A context within which ``self.ref_call or self.call`` computes the reference policy."""
        return reference_policy(self.model) if self.ref_model is None else contextlib.nullcontext()

    def _prompt_lens(self, mb: MicroBatch) -> torch.Tensor | None:
        return mb.prompt_lens if self.train.share_prompts else None

    def _micro_batches(self, episodes: list[Episode], advantages: torch.Tensor, old_logps: torch.Tensor | None = None,
                       teacher_topk: tuple[torch.Tensor, torch.Tensor] | None = None,
                       behaviour: torch.Tensor | None = None) -> list[MicroBatch]:
        t = self.train
        return make_micro_batches(episodes, advantages, pad_id=self.pad_id, token_budget=t.micro_batch_tokens,
                                  old_logps=old_logps, packing=t.packing, share_prompts=t.share_prompts,
                                  teacher_topk=teacher_topk, behaviour_logps=behaviour)

    def _logps(self, call: torch.nn.Module, mb: MicroBatch, positions: torch.Tensor, with_entropy: bool = False,
               extra_targets: torch.Tensor | None = None, sampling_filter: tuple[int, float] | None = None):
        dev = self.device
        return call(sequence_logps, mb.input_ids.to(dev), mb.attention_mask.to(dev), temperature=self.temperature,
                    positions=connected_positions(positions.to(dev), self.parallel), with_entropy=with_entropy,
                    prompt_lens=self._prompt_lens(mb), packing=self.train.packing,
                    extra_targets=None if extra_targets is None else extra_targets.to(dev),
                    sampling_filter=sampling_filter)

    @torch.no_grad()
    def _ref_logps(self, mb: MicroBatch) -> torch.Tensor:
        with self.reference_context():
            return self._logps(self.ref_call or self.call, mb, mb.loss_mask > 0)

    def _padding(self, episodes: list[Episode], count: int, old_logps: torch.Tensor | None = None,
                 teacher_topk: tuple[torch.Tensor, torch.Tensor] | None = None,
                 behaviour: torch.Tensor | None = None) -> list[MicroBatch]:
        """``count`` micro-batches that add nothing (this rank's first episode with its loss
        mask zeroed), so every rank runs as many as the busiest (:meth:`Parallel.even_out`)."""
        if not count:
            return []
        first = self.parallel.shard(len(episodes)).start
        ep = dataclasses.replace(episodes[first], loss_mask=[0] * len(episodes[first].loss_mask))
        old = None if old_logps is None else old_logps[first: first + 1]
        topk = None if teacher_topk is None else tuple(t[first: first + 1] for t in teacher_topk)
        beh = None if behaviour is None else behaviour[first: first + 1]
        return self._micro_batches([ep], torch.zeros(1), old, topk, beh) * count

    @torch.no_grad()
    def old_logps(self, episodes: list[Episode]) -> tuple[torch.Tensor, torch.Tensor | None]:
        """pi_old recomputed before several passes, and (when the sampler filters) the same after
        the sampler's top-k/top-p filter, from one forward: the correction's ratio and
        ``rollout/logprob_diff`` compare it with the engine's logprobs, which are filtered too.

        Returns:
            ``(old [N, L], behaviour [N, L] or None)`` in the completion frame, 0 off the loss mask
            (behaviour: -1e4 where the filter drops the sampled token).
        """
        sf = self.sampling_filter
        logps, *rest = self._scored(episodes, self.call, contextlib.nullcontext, sampling_filter=sf)
        return logps, (rest[0] if sf else None)

    @torch.no_grad()
    def completion_logps(self, episodes: list[Episode], *, reference: bool = False) -> torch.Tensor:
        """Logprobs of the episodes' loss tokens under the current policy (or the
        reference), without gradient; under torchrun each rank computes its shard of the
        rows and the result is assembled on every rank.

        Returns:
            [N, L] float32 in the completion frame (:mod:`plainrl.frames`), 0 off the loss mask.
        """
        if reference:
            return self.scored_logps(episodes, self.ref_call or self.call, self.reference_context)[0]
        return self.scored_logps(episodes, self.call, contextlib.nullcontext)[0]

    @torch.no_grad()
    def scored_logps(self, episodes: list[Episode], call: torch.nn.Module,
                     context: Callable[[], contextlib.AbstractContextManager], *, topk: int = 0
                     ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """The episodes' loss tokens scored by ``call`` (this learner's model, its reference, or a
        distillation teacher: :mod:`plainrl.train.teacher`) within ``context``, without gradient,
        micro-batched and sharded as the update is (under torchrun each rank scores its share and
        every rank gets the whole result), at the sampling temperature.

        Args:
            call: a :class:`~plainrl.train.distributed.ModelCall` (wrapped for the strategy).
            context: entered around each forward (e.g. :func:`plainrl.models.reference_policy`).
            topk: also the ``topk`` most likely tokens at each loss position and their logprobs.
        Returns:
            ``(logps [N, L], topk_ids [N, L, k] or None, topk_logps [N, L, k] or None)``, float32
            (ids int64) in the completion frame, 0 off the loss mask.
        """
        logps, *top = self._scored(episodes, call, context, topk=topk)
        return (logps, *top) if topk else (logps, None, None)

    def _scored(self, episodes: list[Episode], call: torch.nn.Module,
                context: Callable[[], contextlib.AbstractContextManager], *, topk: int = 0,
                sampling_filter: tuple[int, float] | None = None) -> list[torch.Tensor]:
        """:meth:`scored_logps`'s frames: ``[logps]``, then ``topk_ids, topk_logps`` with ``topk``,
        or the filtered logps with ``sampling_filter``."""
        n, width = len(episodes), max((len(e.completion_ids) for e in episodes), default=0)
        out = [torch.zeros(n, width)] + ([torch.zeros(n, width, topk, dtype=torch.long), torch.zeros(n, width, topk)]
                                         if topk else []) + ([torch.zeros(n, width)] if sampling_filter else [])
        rows = self._share(episodes, torch.arange(n))
        mine = [episodes[i] for i in rows]
        mbs = self._micro_batches(mine, torch.zeros(len(mine))) if mine else []
        real = len(mbs)
        mbs += self._padding(episodes, self.parallel.even_out(real))
        local = [torch.zeros(len(mine), *o.shape[1:], dtype=o.dtype) for o in out]
        for i, mb in enumerate(mbs):
            with context():
                if topk:
                    dev = self.device
                    got = call(sequence_topk, mb.input_ids.to(dev), mb.attention_mask.to(dev), k=topk,
                               temperature=self.temperature, positions=(mb.loss_mask > 0).to(dev),
                               prompt_lens=self._prompt_lens(mb), packing=self.train.packing)
                else:
                    got = self._logps(call, mb, mb.loss_mask > 0, sampling_filter=sampling_filter)
                    got = got if isinstance(got, tuple) else (got,)
            if i < real:
                for x, frame in zip(got, local):
                    to_completion_frame(x, mb, frame)
        for o, frame in zip(out, local):
            o[rows] = frame
        if sampling_filter:  # -inf (a token the filter drops) would make the cross-rank sum nan; far below the clamp
            out[-1] = out[-1].clamp(min=-1e4)
        return [self.parallel.sum_tensor(o) for o in out]

    def _share(self, episodes: list[Episode], indices: torch.Tensor) -> torch.Tensor:
        return self.parallel.share(episodes, indices, share_prompts=self.train.share_prompts)

    def update(self, episodes: list[Episode], advantages: torch.Tensor,
               teacher_topk: tuple[torch.Tensor, torch.Tensor] | None = None) -> UpdateStats:
        """Optimise the policy on one rollout batch; steps the LR schedule once.

        One pass over one mini-batch (the default) is on-policy: old logprobs are the
        current ones detached (ratio exactly 1), which saves a forward. With several
        passes or mini-batches the old logprobs are recomputed by the learner, without
        gradient, before the first optimiser step, so the ratio measures how far the
        policy moved within this update and clipping takes effect.

        Args:
            episodes: N episodes of this step.
            advantages: [N] per-episode advantages, or [N, L] per completion token.
            teacher_topk: ``(ids, logps)`` [N, L, k] each, a teacher's top-k tokens at each
                completion token (:class:`plainrl.train.teacher.TeacherScores`): the loss gains
                ``algorithm.distill_coef`` times GKD's divergence (``distill_loss: gkd_topk``).
        """
        a = self.algorithm
        old, behaviour = self.old_logps(episodes) if a.multi_pass else (None, None)  # [N, L] each
        steps = []
        # one plan for all ranks (rank 0's draw), over the whole batch as in one process
        plan = self.parallel.broadcast(mini_batch_indices(len(episodes), a.ppo_epochs, a.mini_batches))
        for idx in plan:
            steps.append(self._step(episodes, idx, advantages, old, teacher_topk, behaviour))
        self.scheduler.step()
        stats = UpdateStats.merge(steps)
        if old is not None:
            frame = completion_frame(episodes)  # [N, L] the engine's logprobs
            diff = ((old if behaviour is None else behaviour) - frame.logprobs).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
            stats.logprob_diff = float((diff.abs() * frame.mask).sum() / frame.mask.sum().clamp(min=1))
        return stats

    def skip(self) -> UpdateStats:
        """Advance the LR schedule without touching the policy (PPO critic warm-up)."""
        lr = self.opt.lr
        with warnings.catch_warnings():  # "scheduler.step() before optimizer.step()": deliberate here
            warnings.simplefilter("ignore", UserWarning)
            self.scheduler.step()
        return UpdateStats(loss=0.0, grad_norm=0.0, kl=0.0, clip_frac=0.0, lr=lr, num_tokens=0, micro_batches=0,
                           skipped=False, optimizer_steps=0)

    def _step(self, episodes: list[Episode], idx: torch.Tensor, advantages: torch.Tensor,
              old_logps: torch.Tensor | None, teacher_topk: tuple[torch.Tensor, torch.Tensor] | None = None,
              behaviour: torch.Tensor | None = None) -> UpdateStats:
        """One optimiser step on the mini-batch ``idx`` (indices into the whole batch), its
        loss normalised over the whole mini-batch (all ranks' shares of it) less the tokens an
        off-policy rejection dropped."""
        a, dev, par = self.algorithm, self.device, self.parallel
        mine = self._share(episodes, idx)
        topk = None if teacher_topk is None else (teacher_topk[0][mine], teacher_topk[1][mine])
        mbs = self._micro_batches([episodes[i] for i in mine], advantages[mine],
                                  None if old_logps is None else old_logps[mine], topk,
                                  None if behaviour is None else behaviour[mine]) if len(mine) else []
        real = len(mbs)
        mbs += self._padding(episodes, par.even_out(real), old_logps, teacher_topk, behaviour)
        num_tokens = int(par.sum([sum(mb.loss_mask.sum().item() for mb in mbs)])[0])
        agg = dict(num_tokens=num_tokens, num_seqs=len(idx), normalizer=self.completion_budget)
        # loss, kl, entropy, clip, approx_kl, |logp diff|, tokens and sequences a rejection dropped
        sums = torch.zeros(8, dtype=torch.float64)
        self.model.train()
        for i, mb in enumerate(mbs):
            with par.no_sync(self.call, last=i == len(mbs) - 1):
                sums += torch.tensor(self._micro_step(mb, agg, on_policy=old_logps is None), dtype=torch.float64)
        loss_sum, kl_sum, ent_sum, clip_sum, approx_kl_sum, diff_sum, drop_tokens, drop_seqs = par.sum(sums.tolist())
        # Rejected tokens leave the normaliser too (as verl's rejection mask does): every term of the loss was
        # divided by the same count (token-mean: tokens; seq-mean-*: sequences), now known, so the gradient is
        # rescaled once, exactly, before clipping. Dr. GRPO's constant normaliser stays per sequence.
        total, dropped = (num_tokens, drop_tokens) if a.loss_agg == "token-mean" else (len(idx), drop_seqs)
        scale = 1.0 if not dropped else (total / (total - dropped) if total > dropped else 0.0)
        loss_sum, kl_sum, ent_sum = loss_sum * scale, kl_sum * scale, ent_sum * scale
        lr = self.opt.lr
        # the global loss: every rank takes the same decision to skip (and to skip a step that kept nothing)
        grad_norm, skipped = self.opt.step(loss_finite=math.isfinite(loss_sum), grad_scale=scale)
        kept = max(1, num_tokens - int(drop_tokens))
        return UpdateStats(
            loss=loss_sum, grad_norm=grad_norm, kl=kl_sum, clip_frac=clip_sum / kept,
            lr=lr, num_tokens=num_tokens, micro_batches=int(par.sum([real])[0]), skipped=skipped, entropy=ent_sum,
            approx_kl=approx_kl_sum / kept, logprob_diff=diff_sum / max(1, num_tokens),
        )

    def _micro_step(self, mb: MicroBatch, agg: dict, *, on_policy: bool) -> tuple[float, ...]:
        """Forward and backward of one micro-batch (gradients accumulate); returns its loss,
        KL and entropy terms, its loss-token sums of clip fraction, approx KL and |learner -
        engine logprob| (on-policy only), and the tokens and sequences a rejection dropped."""
        a, dev = self.algorithm, self.device
        mask, adv = mb.loss_mask.to(dev), mb.advantages.to(dev)
        # the filtered logprobs come from this forward only on one pass; several passes recomputed them
        sf = self.sampling_filter if on_policy else None
        out = self._logps(self.call, mb, mask > 0, with_entropy=a.entropy_coef > 0, extra_targets=mb.teacher_ids,
                          sampling_filter=sf)
        out = list(out) if isinstance(out, tuple) else [out]
        logps = out.pop(0)  # [B, T-1]
        entropy = out.pop(0) if a.entropy_coef > 0 else None
        student_topk = out.pop(0) if mb.teacher_ids is not None else None  # [B, T-1, k]
        filtered = out.pop(0) if sf is not None else None
        engine = mb.engine_logps.to(dev)
        # pi_old is always the learner's own (detached, or recomputed before several passes), never
        # the engine's: an engine computes the same policy with other kernels or precision
        old = logps.detach() if on_policy else mb.old_logps.to(dev)
        # the behaviour ratio's pi_old: after the sampler's filter, as the engine's logprobs are
        behaviour = filtered if filtered is not None else (
            old if on_policy or mb.behaviour_logps is None else mb.behaviour_logps.to(dev))
        diff = 0.0
        if on_policy:
            gap = (behaviour - engine).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
            diff = float((gap.abs() * mask).sum())
        is_weights, kept = None, mask
        if self.is_methods:  # algorithm.correction: the engine's policy is not the learner's pi_old
            corr = correct(behaviour, engine, mask, self.is_methods, self.is_bounds)
            is_weights, kept = corr.weights, corr.kept.to(mask.dtype)
            self.is_tally.add(corr)
        # rejected tokens leave every term (policy, KL, distillation, entropy); _step fixes the normaliser
        loss, stats = policy_loss(
            logps, old, adv, kept, clip_low=a.clip_low, clip_high=a.clip_high,
            dual_clip=a.dual_clip, ratio_level=a.ratio_level, agg=a.loss_agg, is_weights=is_weights, **agg,
        )
        kl_value = ent_value = 0.0
        if a.loss_kl_coef > 0:  # (a KL in the reward, algorithm.kl_reward_coef, is in the advantages already)
            kl = kl_estimate(logps, self._ref_logps(mb), a.kl_estimator)  # [B, T-1]
            kl_loss = aggregate_loss(kl, kept, a.loss_agg, **agg)
            loss = loss + a.loss_kl_coef * kl_loss
            kl_value = kl_loss.item()
        if student_topk is not None:  # GKD: the divergence to the teacher's top-k as a loss term
            jsd = topk_generalized_jsd(student_topk, mb.teacher_logps.to(dev), a.distill_beta)  # [B, T-1]
            loss = loss + a.distill_coef * aggregate_loss(jsd, kept, a.loss_agg, **agg)
        if entropy is not None:
            ent = aggregate_loss(entropy, kept, a.loss_agg, **agg)
            loss = loss - a.entropy_coef * ent  # a bonus: higher entropy lowers the loss
            ent_value = ent.item()
        if loss.requires_grad:  # no loss token in this micro-batch (e.g. all filtered): nothing to learn
            loss.backward()
        tokens = float(kept.sum())
        had = mask > 0
        dropped_seqs = float((had.any(1) & ~(kept > 0).any(1)).sum())
        return (loss.item(), kl_value, ent_value, float(stats["clip_frac"]) * tokens,
                float(stats["approx_kl"]) * tokens, diff, float(mask.sum()) - tokens, dropped_seqs)
