"""A request's sampling fields -> the engine's :class:`~plainrl.types.SamplingParams`.

The samples must come from the policy being trained, at the distribution the learner's
logprobs assume: the run's ``temperature``, ``top_p`` and ``top_k`` win over a request's, and
settings that would reshape the distribution (penalties, ``logit_bias``, ``min_p``) are not
applied; each request that asked for something else counts once in
``rollout/sampling_overrides``. What does not change the distribution is honoured:
``max_tokens`` (up to the run's ``rollout.max_new_tokens``, a request asking for more counted
as an override too, and the episode's room), ``stop`` strings (added to the run's) and
``stop_token_ids``; structured outputs where the engine constrains decoding
(:mod:`~plainrl.rollout.gateway.structured`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from plainrl.rollout.gateway.errors import GatewayError
from plainrl.rollout.gateway.schema import SamplingFields
from plainrl.types import SamplingParams

__all__ = ["RequestSampling", "request_sampling"]

# (field, the value that leaves the distribution as it is): asked otherwise, the run's setting wins
_NEUTRAL = {"min_p": 0.0, "frequency_penalty": 0.0, "presence_penalty": 0.0, "repetition_penalty": 1.0}


@dataclass(frozen=True)
class RequestSampling:
    """params: what the engine samples with; stop_token_ids: ids that end the completion;
    overridden: the request asked for sampling settings the run replaced; capped: the request's
    ``max_tokens`` (or its other name) that ``rollout.max_new_tokens`` cut, else None."""

    params: SamplingParams
    stop_token_ids: tuple[int, ...]
    overridden: bool
    capped: int | None = None


def request_sampling(req: SamplingFields, run: SamplingParams, max_tokens: int | None = None,
                     structured: str | None = None) -> RequestSampling:
    """Map a request's fields onto the run's sampling settings.

    Args:
        req: the validated request (or a ``/inference/v1/generate`` request's ``sampling_params``).
        run: the run's settings (``rollout.*``; greedy in evaluation).
        max_tokens: the request's completion limit when it has another name than ``max_tokens``
            (``max_completion_tokens``).
        structured: the request's structured outputs (:func:`~plainrl.rollout.gateway.structured.structured_outputs`).
    Raises:
        GatewayError: 400 for ``n`` > 1 or an empty stop string.
    """
    if req.n is not None and req.n != 1:
        raise GatewayError(400, f"n={req.n}: the gateway samples one completion per request; send n requests "
                                "(each is a sample of the episode)", param="n")
    limit = max_tokens or req.max_tokens
    stop = (req.stop,) if isinstance(req.stop, str) else tuple(req.stop or ())
    if not all(stop):
        raise GatewayError(400, "stop strings must be non-empty", param="stop")
    overridden = (
        (req.temperature is not None and req.temperature != run.temperature)
        or (req.top_p is not None and req.top_p != run.top_p)
        or (req.top_k is not None and req.top_k not in (run.top_k, -1 if run.top_k == 0 else run.top_k))
        or any(getattr(req, k, None) is not None and getattr(req, k) != v for k, v in _NEUTRAL.items())
        or bool(req.logit_bias)
    )
    capped = limit if limit is not None and limit > run.max_new_tokens else None
    params = dataclasses.replace(
        run, max_new_tokens=min(limit, run.max_new_tokens) if limit else run.max_new_tokens,
        stop=tuple(dict.fromkeys(run.stop + stop)), structured_outputs=structured)
    return RequestSampling(params, tuple(req.stop_token_ids or ()), bool(overridden) or capped is not None, capped)
