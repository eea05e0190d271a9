"""Value models: the critic of PPO (one value per token) and the reward model (one
score per sequence), each a transformers backbone with a linear head ``score``
(:func:`plainrl.models.load_value_model`).

    critic = Critic(load_value_model(cfg.model, device, per_token=True), cfg, pad_id=pad)
    values = critic.values(episodes)                      # [N, L], before the update
    advantages = gae(token_rewards, values, mask, ...)     # (plainrl.estimators)
    metrics = critic.update(episodes, returns, values)  # value loss, own optimiser
"""

from __future__ import annotations

import math

import torch

from plainrl.algorithms import value_loss
from plainrl.config import Config
from plainrl.learner import (
    MasterAdamW, completion_tensor, make_micro_batches, mini_batch_indices, shared_prompt_hidden, to_completion_frame,
)
from plainrl.models import trainable_parameters, unwrap
from plainrl.types import Episode, MicroBatch


def _hidden(model: torch.nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor,
            prompt_lens: torch.Tensor | None = None) -> torch.Tensor:
    base = unwrap(model)
    if prompt_lens is not None:
        hidden = shared_prompt_hidden(base, input_ids, attention_mask, prompt_lens)
        if hidden is not None:
            return hidden
    return base.get_decoder()(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state


def token_values(model: torch.nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                 prompt_lens: torch.Tensor | None = None) -> torch.Tensor:
    """V(s_t) for every target position of a value model (``per_token=True``).

    The state before token t+1 is the prefix through token t, so the value at
    target index t is the head applied to hidden state t: the same frame as
    :func:`plainrl.learner.sequence_logps`.

    Args:
        input_ids: [B, T] token ids (right-padded).
        attention_mask: [B, T] 1 on real tokens.
        prompt_lens: [B] prompt tokens per row; rows with the same prompt then run it
            once (:func:`plainrl.learner.shared_prompt_hidden`).
    Returns:
        [B, T-1] float32 values (differentiable when grad is enabled).
    """
    hidden = _hidden(model, input_ids, attention_mask, prompt_lens)[:, :-1]  # [B, T-1, H]
    return unwrap(model).score(hidden.float()).squeeze(-1)


def sequence_scores(
    model: torch.nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor, last: torch.Tensor,
    prompt_lens: torch.Tensor | None = None,
) -> torch.Tensor:
    """A reward model's score of each sequence, read at the position ``last``.

    Args:
        input_ids: [B, T] token ids (right-padded).
        attention_mask: [B, T] 1 on real tokens.
        last: [B] the position whose hidden state is scored (plainrl's reward models
            use the last token of the response: the EOS that closes the final assistant turn).
        prompt_lens: [B] prompt tokens per row; rows with the same prompt then run it
            once (:func:`plainrl.learner.shared_prompt_hidden`).
    Returns:
        [B] float32 scores (differentiable when grad is enabled).
    """
    hidden = _hidden(model, input_ids, attention_mask, prompt_lens)  # [B, T, H]
    picked = hidden[torch.arange(hidden.shape[0], device=hidden.device), last.to(hidden.device)]  # [B, H]
    return unwrap(model).score(picked.float()).squeeze(-1)


class Critic:
    """A per-token value model with its own optimiser (:class:`plainrl.learner.MasterAdamW`,
    learning rate ``critic.lr`` or ``train.lr``, the same schedule as the policy).

    Args:
        model: from ``load_value_model(..., per_token=True)``.
        cfg: the run config (``algorithm.value_clip``, ``ppo_epochs``, ``mini_batches``, ``train``).
        pad_id: padding token id.
    """

    def __init__(self, model: torch.nn.Module, cfg: Config, *, pad_id: int):
        self.model, self.cfg, self.pad_id = model, cfg, pad_id
        self.opt = MasterAdamW(trainable_parameters(model), cfg.train, lr=cfg.critic.lr)
        self.optimizer, self.scheduler = self.opt.optimizer, self.opt.scheduler

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    def _batches(self, episodes: list[Episode], **frames: torch.Tensor):
        return make_micro_batches(episodes, torch.zeros(len(episodes)), pad_id=self.pad_id,
                                  token_budget=self.cfg.train.micro_batch_tokens, **frames)

    @torch.no_grad()
    def values(self, episodes: list[Episode]) -> torch.Tensor:
        """Values of every completion position, without gradient.

        Returns:
            [N, L] float32 in the completion frame (:func:`plainrl.learner.completion_tensor`).
        """
        out = torch.zeros(len(episodes), max((len(e.completion_ids) for e in episodes), default=0))
        for mb in self._batches(episodes):
            to_completion_frame(self._values(mb), mb, out)
        return out

    def _values(self, mb: MicroBatch) -> torch.Tensor:
        dev = self.device
        lens = mb.prompt_lens.to(dev) if self.cfg.train.share_prompts and mb.prompt_lens is not None else None
        return token_values(self.model, mb.input_ids.to(dev), mb.attention_mask.to(dev), lens)  # [B, T-1]

    def update(self, episodes: list[Episode], returns: torch.Tensor, old_values: torch.Tensor) -> dict[str, float]:
        """Fit the values to the lambda-returns (GAE's ``A + V``, before whitening) with the
        (clipped) value loss, over the same epochs and mini-batches as the policy;
        steps the LR schedule once. Unscorable episodes (reward None) are left out.

        Args:
            episodes: N episodes.
            returns: [N, L] lambda-returns (completion frame), :class:`plainrl.estimators.Advantages`.
            old_values: [N, L] :meth:`values` from before this update.
        Returns:
            ``critic/loss``, ``critic/clip_frac``, ``critic/grad_norm`` (means over optimiser
            steps), ``critic/value_mean``, ``critic/return_mean`` (over loss tokens).
        """
        a, dev = self.cfg.algorithm, self.device
        valid = torch.tensor([e.reward is not None for e in episodes], dtype=torch.float32)
        losses, clips, norms = [], [], []
        self.model.train()
        for idx in mini_batch_indices(len(episodes), a.ppo_epochs, a.mini_batches):
            eps = [episodes[i] for i in idx]
            mbs = self._batches(eps, old_values=old_values[idx], returns=returns[idx])
            masks = [mb.loss_mask * valid[idx][mb.index][:, None] for mb in mbs]  # [B, T-1] each
            num_tokens = int(sum(m.sum().item() for m in masks))
            loss_sum = clip_sum = 0.0
            for mb, mask in zip(mbs, masks):
                v = self._values(mb)  # [B, T-1]
                loss, stats = value_loss(v, mb.old_values.to(dev), mb.returns.to(dev), mask.to(dev),
                                         clip=a.value_clip, agg="token-mean", num_tokens=num_tokens)
                loss.backward()
                loss_sum += loss.item()
                clip_sum += float(stats["clip_frac"]) * float(mask.sum())
            grad_norm, _ = self.opt.step(loss_finite=math.isfinite(loss_sum))
            losses.append(loss_sum)
            clips.append(clip_sum / max(1, num_tokens))
            norms.append(grad_norm)
        self.scheduler.step()
        m = completion_tensor(episodes).bool() & valid.bool()[:, None]  # [N, L]
        mean = lambda x: float(x[m].mean()) if m.any() else 0.0  # noqa: E731
        return {
            "critic/loss": sum(losses) / len(losses), "critic/clip_frac": sum(clips) / len(clips),
            "critic/grad_norm": sum(norms) / len(norms), "critic/value_mean": mean(old_values),
            "critic/return_mean": mean(returns),
        }
