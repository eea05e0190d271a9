"""Tinker's ``sample`` and ``compute_logprobs``: a request checked into a :class:`SampleCall`, its
engine settings, and sampling on plainrl's embedded engine
(:class:`plainrl.rollout.engines.hf.HFEngine`) on the sampler's weights (the servers' path is
:mod:`plainrl.tinker.served`): token ids in, token ids and their logprobs out. Prompt logprobs
are always the service's own forward.

Stop conditions (``SamplingParams.stop``): None stops at the model's EOS; stop strings stop at
EOS or the string; a list of token ids stops at those ids only (``[]``: at none, so at
``max_tokens``), as Tinker documents it.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import numpy as np
import torch

from plainrl.models import sequence_logps, sequence_topk
from plainrl.rollout.engines.hf import HFEngine
from plainrl.tinker.errors import UserError
from plainrl.types import Generation, SamplingParams


@dataclass
class SampleCall:
    """A ``SampleRequest`` checked: prompt ids, sampling settings, and what to return."""

    prompt: list[int]
    num_samples: int
    max_tokens: int
    temperature: float
    top_p: float
    top_k: int
    stop_strings: tuple[str, ...]
    stop_ids: list[int] | None  # None: the model's EOS ids
    seed: int | None
    prompt_logprobs: bool
    last_n: int | None
    topk: int = 0  # topk_prompt_logprobs: the prompt's k most likely tokens per position


def check_sample(request, *, vocab_size: int, context: int) -> SampleCall:
    """Turn a ``tinker.types.SampleRequest`` into a :class:`SampleCall`.

    Raises:
        UserError: a prompt chunk that is not tokens, an empty prompt, a token id outside the
            vocabulary, a prompt plus ``max_tokens`` over the context, or an out-of-range setting.
    """
    ids: list[int] = []
    for chunk in request.prompt.chunks:
        if getattr(chunk, "type", None) != "encoded_text":
            raise UserError(f"prompt: a {getattr(chunk, 'type', type(chunk).__name__)} chunk; this service "
                            "takes token chunks only (text models)")
        ids.extend(int(t) for t in chunk.tokens)
    if not ids:
        raise UserError("prompt: no tokens")
    bad = [t for t in ids if not 0 <= t < vocab_size]
    if bad:
        raise UserError(f"prompt: token id {bad[0]} is outside the vocabulary [0, {vocab_size})")
    p = request.sampling_params
    max_tokens = p.max_tokens if p.max_tokens is not None else context - len(ids)
    if max_tokens < 1:
        raise UserError(f"sampling_params.max_tokens={p.max_tokens}: the prompt's {len(ids)} tokens leave no room "
                        f"in the model's context of {context}" if p.max_tokens is None else
                        f"sampling_params.max_tokens={p.max_tokens} must be at least 1")
    if len(ids) + max_tokens > context:
        raise UserError(f"prompt ({len(ids)} tokens) + sampling_params.max_tokens ({max_tokens}) is over the "
                        f"model's context of {context}")
    if not 1 <= request.num_samples <= 1024:
        raise UserError(f"num_samples={request.num_samples} must be between 1 and 1024")
    if p.temperature < 0 or not 0 < p.top_p <= 1:
        raise UserError(f"sampling_params: temperature={p.temperature} must be >= 0 and top_p={p.top_p} in (0, 1]")
    stop = p.stop
    strings: tuple[str, ...] = ()
    stop_ids = None
    if isinstance(stop, str):
        strings = (stop,)
    elif stop is not None:
        items = list(stop)
        if all(isinstance(s, str) for s in items) and items:
            strings = tuple(items)
        elif all(isinstance(s, int) for s in items):
            stop_ids = items
        else:
            raise UserError("sampling_params.stop: give strings or token ids, not both")
    last_n = request.prompt_logprobs_last_n
    if last_n is not None and not 1 <= last_n <= len(ids) - 1:
        raise UserError(f"prompt_logprobs_last_n={last_n} must be between 1 and len(prompt) - 1 = {len(ids) - 1}")
    topk = request.topk_prompt_logprobs or 0
    if not 0 <= topk <= min(vocab_size, 1024):
        raise UserError(f"topk_prompt_logprobs={topk} must be between 0 and {min(vocab_size, 1024)}")
    return SampleCall(ids, request.num_samples, max_tokens, p.temperature, p.top_p,
                      p.top_k if p.top_k and p.top_k > 0 else 0, strings, stop_ids, p.seed,
                      bool(request.prompt_logprobs), last_n, topk)


def engine_params(call: SampleCall) -> tuple[SamplingParams, list[int]]:
    """The engine's sampling settings for ``call`` and one seed per sample (``call.seed + i``, or a
    random base without one), the same for every engine."""
    params = SamplingParams(max_new_tokens=call.max_tokens, temperature=call.temperature, top_p=call.top_p,
                            top_k=call.top_k, stop=call.stop_strings,
                            stop_token_ids=None if call.stop_ids is None else tuple(call.stop_ids))
    base_seed = call.seed if call.seed is not None else random.SystemRandom().randrange(2**31)
    return params, [base_seed + i for i in range(call.num_samples)]


def sequences(gens: list[Generation]) -> list[tuple[list[int], list[float], str]]:
    """Engine generations as Tinker's sequences: (token ids, logprobs, ``stop`` | ``length``)."""
    return [(g.token_ids, g.logprobs, "length" if g.finish_reason == "length" else "stop") for g in gens]


def sample(model: torch.nn.Module, tokenizer, call: SampleCall) -> list[tuple[list[int], list[float], str]]:
    """Sample ``call.num_samples`` completions of ``call.prompt`` with ``model`` as it is (the caller
    has made the sampler's adapter active), on the embedded engine.

    Returns:
        per sample (token ids, logprobs of the tempered policy, ``stop`` | ``length``).
    """
    engine = HFEngine(model, tokenizer, batch_size=min(64, call.num_samples), decoder="transformers",
                      merge_lora=False)
    params, seeds = engine_params(call)
    return sequences(engine.generate([call.prompt] * call.num_samples, params, seeds=seeds))


def prompt_logprobs(model: torch.nn.Module, call: SampleCall) -> np.ndarray:
    """The prompt's logprobs [P] under ``model`` as it is: NaN at position 0 and before ``call.last_n``."""
    out = np.full(len(call.prompt), np.nan, dtype=np.float32)
    if len(call.prompt) > 1:
        device = next(model.parameters()).device
        ids = torch.tensor([call.prompt], device=device)
        with torch.no_grad():
            out[1:] = sequence_logps(model, ids, torch.ones_like(ids))[0].float().cpu().numpy()  # [P-1]
        if call.last_n is not None:
            out[: len(call.prompt) - call.last_n] = np.nan
    return out


# what the SDK reads as "no entry" in a top-k row (tinker.types.topk_logprobs.MASK_LOGPROB, token id 0)
MASK_LOGPROB = -99999.0


def topk_prompt_logprobs(model: torch.nn.Module, call: SampleCall) -> tuple[np.ndarray, np.ndarray]:
    """The prompt's ``call.topk`` most likely tokens at each position under ``model`` as it is, from
    the same forward as :func:`prompt_logprobs` (temperature 1): ``(ids [P, k] int32, logprobs
    [P, k] float32)``, row i the distribution of prompt token i given the tokens before it; rows
    without one (position 0, and those before ``call.last_n``) hold the SDK's empty entry
    (id 0, :data:`MASK_LOGPROB`)."""
    p, k = len(call.prompt), call.topk
    ids = np.zeros((p, k), dtype=np.int32)
    lps = np.full((p, k), MASK_LOGPROB, dtype=np.float32)
    if p > 1:
        device = next(model.parameters()).device
        x = torch.tensor([call.prompt], device=device)
        with torch.no_grad():
            _, top_i, top_v = sequence_topk(model, x, torch.ones_like(x), k=k)  # [1, P-1, k] each
        ids[1:], lps[1:] = top_i[0].cpu().numpy(), top_v[0].float().cpu().numpy()
        if call.last_n is not None:
            ids[: p - call.last_n], lps[: p - call.last_n] = 0, MASK_LOGPROB
    return ids, lps
