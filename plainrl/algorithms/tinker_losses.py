"""The token losses of Tinker's training API (``forward_backward(data, loss_fn)``), as pure
functions of one sequence's tensors.

Every function takes ``logprobs`` [N], log p_theta(target_i | prefix) of the N target tokens under
the model being trained (differentiable), and the datum's ``loss_fn_inputs`` as float32 tensors
[N], and returns the elementwise loss [N]; the datum's loss is its sum and a request's loss the
sum over its datums (Tinker sums, it does not average: the caller weights tokens through
``weights`` or ``advantages``).

Source: Tinker's loss documentation (https://tinker-docs.thinkingmachines.ai/losses), which gives
each loss as the PyTorch below; the policy-gradient losses follow Schulman et al. 2017 (PPO,
arXiv:1707.06347, eq. 7) and MiniMax-M1 (CISPO, arXiv:2506.13585, eq. 4). ``q`` is the sampling
policy, whose logprobs the caller sends as ``loss_fn_inputs["logprobs"]``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Literal

import torch

TinkerLoss = Literal["cross_entropy", "importance_sampling", "ppo", "cispo"]

# Tinker's defaults for the ratio's clip bounds (loss_fn_config clip_low_threshold / clip_high_threshold):
# PPO's 1 -/+ 0.2 (Schulman et al. 2017); CISPO with no lower bound and an upper bound of 4
DEFAULT_CLIP: dict[str, tuple[float, float]] = {"ppo": (0.8, 1.2), "cispo": (0.0, 4.0)}


def cross_entropy(logprobs: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """Weighted negative log-likelihood: ``-weights * logprobs`` [N] (0 weight: a prompt token).

    The gradient of its sum with respect to ``logprobs`` is ``-weights``, which is how Tinker's SDK
    runs ``forward_backward_custom``: it sends ``weights = -dC/dlogprobs`` of the user's loss C.
    """
    return -weights * logprobs


def importance_sampling(logprobs: torch.Tensor, sampling_logprobs: torch.Tensor,
                        advantages: torch.Tensor) -> torch.Tensor:
    """REINFORCE corrected for off-policy samples: ``-(p/q) * A`` [N], with p/q = exp(logprobs -
    sampling_logprobs) per token (its gradient is ``-(p/q) * A * d log p``: the policy gradient of
    samples drawn from q)."""
    return -torch.exp(logprobs - sampling_logprobs) * advantages


def ppo(logprobs: torch.Tensor, sampling_logprobs: torch.Tensor, advantages: torch.Tensor, *,
        clip_low: float = 0.8, clip_high: float = 1.2) -> torch.Tensor:
    """PPO's clipped surrogate per token: ``-min(r * A, clip(r, clip_low, clip_high) * A)`` [N] with
    r = p/q (Schulman et al. 2017, eq. 7; the bounds are ratios, 1 -/+ epsilon)."""
    ratio = torch.exp(logprobs - sampling_logprobs)
    return -torch.minimum(ratio * advantages, ratio.clamp(clip_low, clip_high) * advantages)


def cispo(logprobs: torch.Tensor, sampling_logprobs: torch.Tensor, advantages: torch.Tensor, *,
          clip_low: float = 0.0, clip_high: float = 4.0) -> torch.Tensor:
    """CISPO: ``-sg(clip(r, clip_low, clip_high)) * A * logprobs`` [N] (MiniMax-M1, eq. 4): the clipped
    ratio is a constant weight of the policy gradient, so no token's gradient is ever zeroed."""
    ratio = torch.exp(logprobs - sampling_logprobs).clamp(clip_low, clip_high).detach()
    return -ratio * advantages * logprobs


# what each loss reads from loss_fn_inputs besides target_tokens
INPUTS: dict[str, tuple[str, ...]] = {
    "cross_entropy": ("weights",),
    "importance_sampling": ("logprobs", "advantages"),
    "ppo": ("logprobs", "advantages"),
    "cispo": ("logprobs", "advantages"),
}
LOSSES: tuple[str, ...] = tuple(INPUTS)
CONFIG_KEYS: dict[str, tuple[str, ...]] = {
    "cross_entropy": (), "importance_sampling": (),
    "ppo": ("clip_low_threshold", "clip_high_threshold"), "cispo": ("clip_low_threshold", "clip_high_threshold"),
}


def elementwise_loss(name: str, logprobs: torch.Tensor, inputs: Mapping[str, torch.Tensor],
                     config: Mapping[str, float] | None = None) -> torch.Tensor:
    """Dispatch ``name`` (one of :data:`LOSSES`) on one datum: [N] elementwise loss.

    Args:
        logprobs: [N] logprobs of the target tokens under the trained model.
        inputs: the datum's ``loss_fn_inputs`` as [N] float tensors (see :data:`INPUTS`).
        config: ``loss_fn_config`` (``clip_low_threshold``, ``clip_high_threshold`` for ppo and cispo).
    Raises:
        ValueError: an unknown loss or config key (the message lists the known ones).
    """
    if name not in INPUTS:
        raise ValueError(f"loss_fn={name!r} is not one this service computes; use one of {list(LOSSES)}")
    config = dict(config or {})
    unknown = sorted(set(config) - set(CONFIG_KEYS[name]))
    if unknown:
        raise ValueError(f"loss_fn_config keys {unknown} do not apply to loss_fn={name!r}; "
                         f"it takes {list(CONFIG_KEYS[name]) or 'none'}")
    if name == "cross_entropy":
        return cross_entropy(logprobs, inputs["weights"])
    q, adv = inputs["logprobs"], inputs["advantages"]
    if name == "importance_sampling":
        return importance_sampling(logprobs, q, adv)
    low, high = DEFAULT_CLIP[name]
    fn: Callable[..., torch.Tensor] = ppo if name == "ppo" else cispo
    return fn(logprobs, q, adv, clip_low=float(config.get("clip_low_threshold", low)),
              clip_high=float(config.get("clip_high_threshold", high)))
