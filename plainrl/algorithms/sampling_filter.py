"""The sampler's top-k / top-p (nucleus) filter, and the logprobs of the distribution it leaves.

An engine that samples with ``top_k`` or ``top_p`` draws from the filtered, renormalised
distribution

    mu(y) = pi_T(y) / Z   for y in the kept set K,   0 elsewhere,   Z = sum_{v in K} pi_T(v)

(pi_T = softmax(z / T)), and vLLM (``logprobs_mode=processed_logprobs``) returns log mu(y), as
the embedded engine does too. The learner's pi_old is unfiltered, so the ratio
pi_old(y) / mu(y) = Z * pi_old(y) / pi_T(y) is biased by the nucleus mass Z < 1 at every token,
the same way: a geometric sequence band like [0.99, 1.01] then drops every sequence. The
behaviour ratio is therefore taken between like and like: the learner's logits go through the
same filter, mu_old(y) = pi_old(y) / Z_old on K_old, and rho = mu_old(y) / mu(y), which is 1
when learner and engine compute the same policy. A token outside the learner's own kept set
has mu_old = 0 (log -inf; the corrections clamp log rho at -20, so it weighs ~0 or is dropped).

The filter is vLLM's and Hugging Face's: top-k first (ties with the k-th logit kept), then top-p
over what top-k left: a token is dropped when the probability of the tokens ranked before it
already reaches ``top_p``, so the most likely token is always kept (Holtzman et al. 2020, "The
Curious Case of Neural Text Degeneration", sec. 3.1; vLLM ``apply_top_k_top_p``). NeMo-RL applies
the same filter to the training logits (``nemo_rl/algorithms/logits_sampling_utils.py``,
``apply_top_k_top_p``, used when generation sets top_k/top_p).
"""

from __future__ import annotations

import torch


def filtering(top_k: int, top_p: float) -> bool:
    """Whether ``top_k`` (0: off) or ``top_p`` (1.0: off) filter anything."""
    return top_k > 0 or top_p < 1.0


# top-p's candidates: the nucleus of a trained model's next token is rarely more than a few hundred
# tokens, so the most likely NUCLEUS_CANDIDATES are taken by topk (cheap) and the whole vocabulary
# is sorted only when their mass falls short of top_p (a flat distribution: a random model's)
NUCLEUS_CANDIDATES = 1024


def keep_mask(logits: torch.Tensor, top_k: int, top_p: float, *, candidates: int = NUCLEUS_CANDIDATES
              ) -> torch.Tensor:
    """Which tokens the top-k, then top-p, filter keeps.

    Args:
        logits: [..., V] float logits (already divided by the temperature: top-p reads
            softmax(logits)).
        top_k: keep the k largest (0: off; k >= V keeps all).
        top_p: keep the smallest prefix, by descending probability, whose mass reaches top_p
            (1.0: off), the most likely token always.
        candidates: top-p looks for its nucleus among this many most likely tokens first, and
            sorts the whole vocabulary only when their mass is below top_p (the same set either way,
            up to the order of tied logits).
    Returns:
        [..., V] bool, True where the token stays.
    Raises:
        ValueError: ``top_k < 0`` or ``top_p`` outside (0, 1].
    """
    if top_k < 0 or not 0.0 < top_p <= 1.0:
        raise ValueError(f"top_k must be >= 0 and top_p in (0, 1], got top_k={top_k}, top_p={top_p}")
    keep = torch.ones_like(logits, dtype=torch.bool)
    top = None
    if 0 < top_k < logits.shape[-1]:
        top = torch.topk(logits, top_k, dim=-1)  # sorted, descending
        keep = logits >= top.values[..., -1:]  # ties with the k-th stay
        if top_p < 1.0 and bool((keep.sum(-1) > top_k).any()):
            top = None  # a tie at the k-th: the nucleus is taken over the whole vocabulary below
    if top_p < 1.0:
        masked = logits.masked_fill(~keep, float("-inf")) if 0 < top_k < logits.shape[-1] else logits
        probs = None
        if top is not None:  # the nucleus lies within the top k, already sorted: no sort of the vocabulary
            sorted_logits, order = top.values, top.indices
        elif candidates < logits.shape[-1]:
            sorted_logits, order = torch.topk(masked, candidates, dim=-1)
            probs = torch.exp(sorted_logits - torch.logsumexp(masked, dim=-1, keepdim=True))  # of the whole row
            if not bool((probs.sum(-1) >= top_p).all()):  # some row's nucleus reaches past the candidates
                probs = None
                sorted_logits, order = torch.sort(masked, dim=-1, descending=True)
        else:
            sorted_logits, order = torch.sort(masked, dim=-1, descending=True)
        probs = sorted_logits.softmax(-1) if probs is None else probs
        before = probs.cumsum(-1) - probs  # mass of the tokens ranked before each one
        # a token outside the candidates ranks after all of them, whose mass reaches top_p: dropped
        keep = keep & torch.zeros_like(keep).scatter(-1, order, before < top_p)
    return keep


def filter_logits(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """``logits`` with every token the filter drops set to -inf ([..., V], same dtype)."""
    if not filtering(top_k, top_p):
        return logits
    return logits.masked_fill(~keep_mask(logits, top_k, top_p), float("-inf"))


def filtered_logprobs(logits: torch.Tensor, targets: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """log mu(target): the targets' logprobs under the filtered, renormalised distribution.

    Args:
        logits: [..., V] tempered logits (z / T).
        targets: [...] int64 token ids.
        top_k, top_p: as :func:`keep_mask` (both off: log softmax(logits) at the targets).
    Returns:
        [...] float32; -inf for a target the filter drops.
    """
    logp = torch.log_softmax(filter_logits(logits.float(), top_k, top_p), dim=-1)
    return logp.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
