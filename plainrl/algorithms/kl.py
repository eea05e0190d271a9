"""Per-token estimators of the KL divergence between the policy and a reference.

All three estimators follow Schulman (2020), "Approximating KL Divergence",
http://joschu.net/blog/kl-approx.html. Tokens are sampled from the policy pi
(``logps``), so with ``log_ratio = ref_logps - logps = log(pi_ref / pi)``:

    k1 = -log_ratio                         unbiased, high variance, can be negative
    k2 = 0.5 * log_ratio ** 2               biased, low variance, >= 0
    k3 = exp(log_ratio) - 1 - log_ratio     unbiased, low variance, >= 0

each an estimate of KL(pi || pi_ref) whose expectation under pi is the true KL
(k2 only to second order). k3 is the estimator of DeepSeekMath's GRPO
(Shao et al. 2024, arXiv:2402.03300, eq. 4).
"""

from __future__ import annotations

from typing import Callable, Literal, get_args

import torch

KLEstimator = Literal["k1", "k2", "k3"]

# exp(20) ~ 4.9e8 is finite in float32/bfloat16, and a per-token probability ratio
# beyond e^20 is already meaningless, so the clamp only guards against inf/NaN.
LOG_RATIO_CLAMP = 20.0


def _k1(log_ratio: torch.Tensor) -> torch.Tensor:
    return -log_ratio


def _k2(log_ratio: torch.Tensor) -> torch.Tensor:
    return 0.5 * log_ratio.square()


def _k3(log_ratio: torch.Tensor) -> torch.Tensor:
    # expm1 instead of exp(x) - 1: near x = 0 (the usual case) the estimate is ~x^2/2
    # and exp(x) - 1 would lose most of its significant bits to cancellation.
    return torch.expm1(log_ratio) - log_ratio


_KL_ESTIMATORS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "k1": _k1,
    "k2": _k2,
    "k3": _k3,
}


def kl_estimate(logps: torch.Tensor, ref_logps: torch.Tensor, estimator: KLEstimator) -> torch.Tensor:
    """Per-token estimate of KL(pi || pi_ref) from log-probs of tokens sampled from pi.

    With ``log_ratio = clamp(ref_logps - logps, -20, 20)`` (:data:`LOG_RATIO_CLAMP`):
    ``k1 = -log_ratio``, ``k2 = 0.5 * log_ratio**2``, ``k3 = exp(log_ratio) - 1 - log_ratio``.
    The clamp is for numerical safety only; past it the gradient is zero.

    Args:
        logps:      [B, T] (any shape) log pi(token) of the sampled tokens; differentiable.
        ref_logps:  same shape, log pi_ref(token) of the same tokens.
        estimator:  ``"k1"``, ``"k2"`` or ``"k3"``.

    Returns:
        Same shape as ``logps``, float32 (computed in float32 whatever the input dtype).
        Masking and averaging are the caller's (e.g. :func:`aggregate_loss`).

    Raises:
        ValueError: unknown ``estimator`` (the message lists the valid ones), or
            ``logps`` and ``ref_logps`` differ in shape.

    Source: Schulman 2020, "Approximating KL Divergence" (k1, k2, k3);
    k3 as in Shao et al. 2024 (DeepSeekMath, arXiv:2402.03300) eq. 4.
    """
    fn = _KL_ESTIMATORS.get(estimator)
    if fn is None:
        raise ValueError(f"unknown KL estimator {estimator!r}; expected one of {list(get_args(KLEstimator))}")
    if logps.shape != ref_logps.shape:
        raise ValueError(
            f"logps and ref_logps must have the same shape, got {tuple(logps.shape)} and {tuple(ref_logps.shape)}"
        )
    log_ratio = (ref_logps.float() - logps.float()).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    return fn(log_ratio)
