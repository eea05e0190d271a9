"""PPO's critic: a per-token value model (:func:`plainrl.models.load_value_model`) with
its own optimiser, fitted to GAE's lambda-returns.

    critic = Critic(load_value_model(cfg.model, device, per_token=True), cfg.algorithm, cfg.train,
                    lr=cfg.critic.lr, pad_id=pad)
    values = critic.values(episodes)                          # [N, L], before the update
    advantages = gae(token_rewards, values, mask, ...)         # (plainrl.algorithms.estimators)
    metrics = critic.update(episodes, returns, values, mask)  # value loss, own optimiser
"""

from __future__ import annotations

import dataclasses
import math

import torch

from plainrl.algorithms import value_loss
from plainrl.config import AlgorithmConfig, TrainConfig
from plainrl.frames import make_micro_batches, to_completion_frame
from plainrl.models import enable_gradient_checkpointing, token_values, trainable_parameters
from plainrl.train.learner import mini_batch_indices
from plainrl.train.distributed import Parallel
from plainrl.train.optim import MasterAdamW
from plainrl.types import Episode, MicroBatch


class Critic:
    """A per-token value model with its own optimiser (:class:`plainrl.train.optim.MasterAdamW`,
    learning rate ``critic.lr`` or ``train.lr``, the same schedule as the policy).

    Args:
        model: from ``load_value_model(..., per_token=True)``.
        algorithm: the ``algorithm`` section (``value_clip``, ``ppo_epochs``, ``mini_batches``).
        train: the ``train`` section (optimiser, ``micro_batch_tokens``, ``share_prompts``,
            ``gradient_checkpointing``, ``packing``).
        lr: ``critic.lr`` (None: ``train.lr``).
        pad_id: padding token id.
        parallel: under torchrun, as :class:`~plainrl.train.Learner`'s: the whole batch on
            every rank, each computing on its shard, the loss normalised globally.
    """

    def __init__(self, model: torch.nn.Module, algorithm: AlgorithmConfig, train: TrainConfig, *,
                 lr: float | None, pad_id: int, parallel: Parallel | None = None):
        self.model, self.algorithm, self.train, self.pad_id = model, algorithm, train, pad_id
        self.parallel = parallel or Parallel()
        if train.gradient_checkpointing:
            enable_gradient_checkpointing(model)
        self.call = self.parallel.wrap(model)  # every forward runs through it (DDP / FSDP2 hooks)
        self.opt = MasterAdamW(trainable_parameters(model), train, lr=lr)
        self.optimizer, self.scheduler = self.opt.optimizer, self.opt.scheduler

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    def _batches(self, episodes: list[Episode], **frames: torch.Tensor):
        return make_micro_batches(episodes, torch.zeros(len(episodes)), pad_id=self.pad_id,
                                  token_budget=self.train.micro_batch_tokens, packing=self.train.packing,
                                  share_prompts=self.train.share_prompts, **frames)

    @torch.no_grad()
    def values(self, episodes: list[Episode]) -> torch.Tensor:
        """Values of every completion position, without gradient.

        Returns:
            [N, L] float32 in the completion frame (:mod:`plainrl.frames`).
        """
        out = torch.zeros(len(episodes), max((len(e.completion_ids) for e in episodes), default=0))
        rows = self._share(episodes, torch.arange(len(episodes)))
        mine = [episodes[i] for i in rows]
        mbs = self._batches(mine) if mine else []
        real = len(mbs)
        mbs += self._padding(episodes, self.parallel.even_out(real))
        local = torch.zeros(len(mine), out.shape[1])
        for i, mb in enumerate(mbs):
            v = self._values(mb)
            if i < real:
                to_completion_frame(v, mb, local)
        out[rows] = local
        return self.parallel.sum_tensor(out)

    def _share(self, episodes: list[Episode], indices: torch.Tensor) -> torch.Tensor:
        return self.parallel.share(episodes, indices, share_prompts=self.train.share_prompts)

    def _padding(self, episodes: list[Episode], count: int) -> list[MicroBatch]:
        """Micro-batches that add nothing (this rank's first episode, loss mask zeroed), so
        every rank runs as many as the busiest (see :class:`~plainrl.train.distributed.Parallel`)."""
        if not count:
            return []
        first = episodes[self.parallel.shard(len(episodes)).start]
        ep = dataclasses.replace(first, loss_mask=[0] * len(first.loss_mask))
        zeros = torch.zeros(1, len(first.completion_ids))
        return self._batches([ep], old_values=zeros, returns=zeros) * count

    def _values(self, mb: MicroBatch) -> torch.Tensor:
        dev = self.device
        lens = mb.prompt_lens.to(dev) if self.train.share_prompts and mb.prompt_lens is not None else None
        return self.call(token_values, mb.input_ids.to(dev), mb.attention_mask.to(dev), lens,
                         packing=self.train.packing)  # [B, T-1]

    def update(self, episodes: list[Episode], returns: torch.Tensor, old_values: torch.Tensor,
               mask: torch.Tensor) -> dict[str, float]:
        """Fit the values to the lambda-returns (GAE's ``A + V``, before whitening) with the
        (clipped) value loss, over the same epochs and mini-batches as the policy;
        steps the LR schedule once. Unscorable episodes (reward None) are left out.

        Args:
            episodes: N episodes.
            returns: [N, L] lambda-returns (completion frame), :class:`plainrl.algorithms.estimators.Advantages`.
            old_values: [N, L] :meth:`values` from before this update.
            mask: [N, L] the loss mask (:class:`plainrl.frames.CompletionFrame`).
        Returns:
            ``critic/loss``, ``critic/clip_frac``, ``critic/grad_norm`` (means over optimiser
            steps), ``critic/value_mean``, ``critic/return_mean`` (over loss tokens).
        """
        a, dev, par = self.algorithm, self.device, self.parallel
        valid = torch.tensor([e.reward is not None for e in episodes], dtype=torch.float32)
        losses, clips, norms = [], [], []
        self.model.train()
        for idx in par.broadcast(mini_batch_indices(len(episodes), a.ppo_epochs, a.mini_batches)):
            mine = self._share(episodes, idx)
            eps = [episodes[i] for i in mine]
            mbs = self._batches(eps, old_values=old_values[mine], returns=returns[mine]) if eps else []
            masks = [mb.loss_mask * valid[mine][mb.index][:, None] for mb in mbs]  # [B, T-1] each
            pad = self._padding(episodes, par.even_out(len(mbs)))
            mbs, masks = mbs + pad, masks + [mb.loss_mask for mb in pad]
            num_tokens = int(par.sum([sum(m.sum().item() for m in masks)])[0])
            loss_sum = clip_sum = 0.0
            for i, (mb, mb_mask) in enumerate(zip(mbs, masks)):
                with par.no_sync(self.call, last=i == len(mbs) - 1):
                    v = self._values(mb)  # [B, T-1]
                    loss, stats = value_loss(v, mb.old_values.to(dev), mb.returns.to(dev), mb_mask.to(dev),
                                             clip=a.value_clip, agg="token-mean", num_tokens=num_tokens)
                    loss.backward()
                loss_sum += loss.item()
                clip_sum += float(stats["clip_frac"]) * float(mb_mask.sum())
            loss_sum, clip_sum = par.sum([loss_sum, clip_sum])
            grad_norm, _ = self.opt.step(loss_finite=math.isfinite(loss_sum))
            losses.append(loss_sum)
            clips.append(clip_sum / max(1, num_tokens))
            norms.append(grad_norm)
        self.scheduler.step()
        m = mask.bool() & valid.bool()[:, None]  # [N, L]
        mean = lambda x: float(x[m].mean()) if m.any() else 0.0  # noqa: E731
        return {
            "critic/loss": sum(losses) / len(losses), "critic/clip_frac": sum(clips) / len(clips),
            "critic/grad_norm": sum(norms) / len(norms), "critic/value_mean": mean(old_values),
            "critic/return_mean": mean(returns),
        }
