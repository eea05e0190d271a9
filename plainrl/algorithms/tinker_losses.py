"""The token losses of Tinker's training API (``forward_backward(data, loss_fn)``), as pure
functions of one sequence's tensors.

Every function takes ``logprobs`` [N], log p_theta(target_i | prefix) of the N target tokens under
the model being trained (differentiable), and the datum's ``loss_fn_inputs`` as float32 tensors
[N], and returns the elementwise loss [N]; the datum's loss is its sum and a request's loss the
sum over its datums (Tinker sums, it does not average: the caller weights tokens through
``weights`` or ``advantages``). ``cross_entropy`` also takes K targets per position (``(N, K)``
``target_tokens`` and ``weights``, Tinker's top-K distillation): ``logprobs`` [N, K], loss [N].

Source: Tinker's loss documentation (https://tinker-docs.thinkingmachines.ai/losses and its
per-loss pages), which gives each loss as the PyTorch below; the policy-gradient losses follow
Schulman et al. 2017 (PPO, arXiv:1707.06347, eq. 7), MiniMax-M1 (CISPO, arXiv:2506.13585, eq. 4),
Zheng et al. 2025 (GSPO, arXiv:2507.18071, its GSPO-token variant) and Richemond et al. 2024
(DRO, arXiv:2405.19107). ``q`` is the sampling policy, whose logprobs the caller sends as
``loss_fn_inputs["logprobs"]``.

``stable_reinforce``: Tinker documents its contract (samples recorded with
``record_stability_info``, every trained token's sampled sequence named by provenance spans,
``loss_fn_config`` key ``kl_coeff``) but not its objective, which is in alpha. plainrl's is
:func:`stable_reinforce`: REINFORCE with a truncated importance weight on the logprobs the
service recorded when it sampled, plus an optional quadratic penalty toward the sampler.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Literal

import torch

TinkerLoss = Literal["cross_entropy", "importance_sampling", "ppo", "cispo", "gspo", "dro", "stable_reinforce"]

# Defaults of the ratio's clip bounds (loss_fn_config clip_low_threshold / clip_high_threshold):
# PPO's 1 -/+ 0.2 (Schulman et al. 2017); CISPO with no lower bound and an upper bound of 4 (Tinker's);
# GSPO's 1 - 3e-4 / 1 + 4e-4 (the clipping ranges of Zheng et al. 2025's experiments: a sequence ratio is
# a geometric mean, far closer to 1 than a token's; Tinker does not publish its default)
DEFAULT_CLIP: dict[str, tuple[float, float]] = {"ppo": (0.8, 1.2), "cispo": (0.0, 4.0), "gspo": (1 - 3e-4, 1 + 4e-4)}
# stable_reinforce's cap on the importance weight (Yao et al. 2025, "Your efficient RL framework secretly
# brings you off-policy RL training": truncated IS with C = 2)
STABLE_REINFORCE_CAP = 2.0


def cross_entropy(logprobs: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """Weighted negative log-likelihood: ``-weights * logprobs`` [N] (0 weight: a prompt token).

    With K targets per position (``logprobs`` and ``weights`` [N, K]) the loss of position n is
    ``-sum_k weights[n, k] * logprobs[n, k]`` [N]: with the teacher's top-K probabilities as the
    weights, the cross-entropy of the student against the teacher's (renormalised) top-K
    distribution, i.e. the forward KL up to the teacher's entropy (Tinker's top-K distillation,
    the cookbook's ``sdft``).

    The gradient of its sum with respect to ``logprobs`` is ``-weights``, which is how Tinker's SDK
    runs ``forward_backward_custom``: it sends ``weights = -dC/dlogprobs`` of the user's loss C.
    """
    loss = -weights * logprobs
    return loss.sum(-1) if loss.dim() == 2 else loss


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


def gspo(logprobs: torch.Tensor, sampling_logprobs: torch.Tensor, advantages: torch.Tensor,
         sequence_ratio_mask: torch.Tensor, *, clip_low: float = 1 - 3e-4, clip_high: float = 1 + 4e-4) -> torch.Tensor:
    """GSPO-token (Zheng et al. 2025; Tinker's ``gspo``) [N]: PPO's clipped surrogate with
    every token's ratio valued at the sequence ratio s = exp(mean over M of log p/q), M the tokens
    ``sequence_ratio_mask`` marks, and differentiated as the token's own ratio:

        s_t = sg(s) * p_t / sg(p_t),   loss_t = -min(s_t * A_t, clip(s_t, clip_low, clip_high) * A_t)

    so with one advantage per sequence its gradient is GSPO's (the whole sequence kept or
    clipped together). No marked token: s = 1.
    """
    marked = sequence_ratio_mask != 0
    diff = (logprobs.detach() - sampling_logprobs)[marked]
    log_s = diff.mean() if diff.numel() else logprobs.new_zeros(())
    ratio = torch.exp(log_s + logprobs - logprobs.detach())
    return -torch.minimum(ratio * advantages, ratio.clamp(clip_low, clip_high) * advantages)


def dro(logprobs: torch.Tensor, sampling_logprobs: torch.Tensor, advantages: torch.Tensor, *,
        beta: float) -> torch.Tensor:
    """DRO (Richemond et al. 2024; Kimi k1.5, arXiv:2501.12599; Tinker's ``dro``) [N]:
    ``-(logprobs * A - beta / 2 * (logprobs - q)^2)``: the policy gradient with a quadratic penalty on
    the log-ratio to the sampler, which keeps it off-policy stable without a ratio. The
    advantages are the client's (DRO's soft value baseline is computed there)."""
    return -(logprobs * advantages - 0.5 * beta * (logprobs - sampling_logprobs) ** 2)


def stable_reinforce(logprobs: torch.Tensor, sampling_logprobs: torch.Tensor, advantages: torch.Tensor,
                     sampled: torch.Tensor, *, kl_coeff: float = 0.0, cap: float = STABLE_REINFORCE_CAP) -> torch.Tensor:
    """plainrl's ``stable_reinforce`` [N] (Tinker has not published its objective; see the module
    docstring): REINFORCE with a truncated importance weight, plus an optional quadratic penalty
    toward the sampler,

        loss_t = m_t * (-sg(min(p_t / q_t, cap)) * A_t * log p_t + kl_coeff / 2 * (log p_t - log q_t)^2)

    The weight corrects for samples drawn by q (another step's weights or other numerics) and, being
    truncated and held constant, never zeroes a token's gradient (as PPO's clip does) nor lets one
    token's weight explode (IMPALA's truncated IS, Espeholt et al. 2018, arXiv:1802.01561, eq. 1;
    Yao et al. 2025's cap of 2). The penalty is DRO's (:func:`dro`). ``q`` is the sampler's own
    logprobs, recorded when the service sampled (``record_stability_info``), and m_t (``sampled`` [N])
    is 1 on the positions the datum's provenance names as sampled tokens, 0 elsewhere (prompt
    positions: no sampler logprob to weight by or to stay near).
    """
    weight = torch.exp(logprobs - sampling_logprobs).clamp(max=cap).detach()
    loss = -weight * advantages * logprobs + 0.5 * kl_coeff * (logprobs - sampling_logprobs) ** 2
    return torch.where(sampled != 0, loss, torch.zeros_like(loss))


# what each loss reads from loss_fn_inputs besides target_tokens
INPUTS: dict[str, tuple[str, ...]] = {
    "cross_entropy": ("weights",),
    "importance_sampling": ("logprobs", "advantages"),
    "ppo": ("logprobs", "advantages"),
    "cispo": ("logprobs", "advantages"),
    "gspo": ("logprobs", "advantages", "sequence_ratio_mask"),
    "dro": ("logprobs", "advantages"),
    "stable_reinforce": ("logprobs", "advantages"),
}
LOSSES: tuple[str, ...] = tuple(INPUTS)
_CLIP = ("clip_low_threshold", "clip_high_threshold")
CONFIG_KEYS: dict[str, tuple[str, ...]] = {
    "cross_entropy": (), "importance_sampling": (), "ppo": _CLIP, "cispo": _CLIP, "gspo": _CLIP,
    "dro": ("beta",), "stable_reinforce": ("kl_coeff",),
}
# config keys without a default: the request must give them
REQUIRED_CONFIG: dict[str, tuple[str, ...]] = {"dro": ("beta",)}
# the losses whose inputs may carry K values per position ((N, K) target_tokens and weights)
TOP_K_LOSSES: tuple[str, ...] = ("cross_entropy",)
# the losses that need each datum's provenance (which sampled sequence each token came from), and the
# inputs the service derives from it: ``sampled`` [N], 1 where a target is a recorded sampled token
NEEDS_PROVENANCE: tuple[str, ...] = ("stable_reinforce",)
DERIVED_INPUTS: dict[str, tuple[str, ...]] = {"stable_reinforce": ("sampled",)}


def check_config(name: str, config: Mapping[str, float]) -> None:
    """Raise ``ValueError`` naming the problem if ``config`` is not ``loss_fn_config`` of loss ``name``."""
    if name not in INPUTS:
        raise ValueError(f"loss_fn={name!r} is not one this service computes; use one of {list(LOSSES)}")
    unknown = sorted(set(config) - set(CONFIG_KEYS[name]))
    if unknown:
        raise ValueError(f"loss_fn_config keys {unknown} do not apply to loss_fn={name!r}; "
                         f"it takes {list(CONFIG_KEYS[name]) or 'none'}")
    missing = [k for k in REQUIRED_CONFIG.get(name, ()) if k not in config]
    if missing:
        raise ValueError(f"loss_fn={name!r} needs loss_fn_config {missing} (e.g. {{'beta': 0.05}}: the weight "
                         "of its quadratic penalty)")


def elementwise_loss(name: str, logprobs: torch.Tensor, inputs: Mapping[str, torch.Tensor],
                     config: Mapping[str, float] | None = None) -> torch.Tensor:
    """Dispatch ``name`` (one of :data:`LOSSES`) on one datum: [N] elementwise loss.

    Args:
        logprobs: [N] logprobs of the target tokens under the trained model ([N, K] for K targets
            per position, :data:`TOP_K_LOSSES`).
        inputs: the datum's ``loss_fn_inputs`` as [N] float tensors (see :data:`INPUTS`), and those
            the service derives (:data:`DERIVED_INPUTS`).
        config: ``loss_fn_config`` (:data:`CONFIG_KEYS`: the clip thresholds of ppo, cispo and gspo,
            dro's ``beta``, stable_reinforce's ``kl_coeff``).
    Raises:
        ValueError: an unknown loss or config key, or a required key missing (the message lists them).
    """
    config = dict(config or {})
    check_config(name, config)
    if name == "cross_entropy":
        return cross_entropy(logprobs, inputs["weights"])
    q, adv = inputs["logprobs"], inputs["advantages"]
    if name == "importance_sampling":
        return importance_sampling(logprobs, q, adv)
    if name == "dro":
        return dro(logprobs, q, adv, beta=float(config["beta"]))
    if name == "stable_reinforce":
        return stable_reinforce(logprobs, q, adv, inputs["sampled"], kl_coeff=float(config.get("kl_coeff", 0.0)))
    low, high = DEFAULT_CLIP[name]
    clip = dict(clip_low=float(config.get("clip_low_threshold", low)),
                clip_high=float(config.get("clip_high_threshold", high)))
    if name == "gspo":
        return gspo(logprobs, q, adv, inputs["sequence_ratio_mask"], **clip)
    fn: Callable[..., torch.Tensor] = ppo if name == "ppo" else cispo
    return fn(logprobs, q, adv, **clip)
