"""What the engines over vLLM and servers share: prompts as requests (each with its seed,
or unseeded ones grouped with ``n`` samples), plainrl's :class:`SamplingParams` mapped onto
vLLM's, and vLLM's finish reasons mapped back."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from plainrl.types import FinishReason, SamplingParams

# vLLM's allowed --max-lora-rank values (vllm.config.lora.MaxLoRARanks)
VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)


class EngineError(RuntimeError):
    """A rollout engine failed (server unreachable or dead, wrong model, vLLM missing); the
    message names the engine or URL and what to do."""


@dataclass
class Request:
    """One engine request: a distinct prompt and the positions it fills in the output.

    prompt_ids: [P] token ids.
    rows:       indices into the caller's prompt list, one per sample (``n = len(rows)``).
    seed:       the request's seed (vLLM's per-request ``seed``), that of its one row; None
                for an unseeded request.
    """

    prompt_ids: list[int]
    rows: list[int]
    seed: int | None = None


def make_requests(prompts: list[list[int]], seeds: list[int] | None) -> list[Request]:
    """The requests for one ``generate`` call.

    Seeded (``seeds``: one per prompt, :mod:`plainrl.rollout.seeding`): one request per
    prompt with its own seed, so each sample's random stream is its own (vLLM gives the
    ``n`` samples of a seeded request the seeds ``seed + i``, which would tie a sample to
    its place in the batch); the engine's prefix cache still prefills a group's shared
    prompt once. Unseeded: identical prompts (a GRPO group) grouped into one request with
    ``n`` samples, so the engine prefills the prompt once.

    Raises:
        ValueError: ``seeds`` is not one per prompt.
    """
    if seeds is not None:
        if len(seeds) != len(prompts):
            raise ValueError(f"{len(seeds)} seeds for {len(prompts)} prompts; give one seed per prompt")
        return [Request(list(p), [row], int(s)) for row, (p, s) in enumerate(zip(prompts, seeds))]
    index: dict[tuple[int, ...], Request] = {}
    for row, p in enumerate(prompts):
        index.setdefault(tuple(p), Request(list(p), [])).rows.append(row)
    return list(index.values())


def sampling_kwargs(params: SamplingParams, *, n: int, seed: int | None) -> dict[str, Any]:
    """vLLM ``SamplingParams`` keyword arguments (also the JSON fields of its completions API).

    ``logprobs=0`` returns the sampled token's logprob alone; with the engine's
    ``logprobs_mode="processed_logprobs"`` that is log softmax(z / T) after vLLM's top-k/top-p
    filtering (the distribution it sampled from, the convention of every plainrl engine:
    :mod:`plainrl.algorithms.sampling_filter`). Greedy (T = 0) logprobs are of softmax(z), as
    the embedded engine's. The stop string's tokens stay in ``token_ids`` as in the embedded
    engine; ``include_stop_str_in_output`` keeps the text consistent with them. Stop token
    ids replace the EOS (``ignore_eos``), as the embedded engine's ``stop_token_ids``.
    ``params.structured_outputs`` becomes vLLM's ``structured_outputs`` (a dict: the JSON field
    of the completions API; :func:`vllm_structured` makes the engine's own object of it).
    """
    kwargs = dict(
        n=n, max_tokens=params.max_new_tokens, temperature=params.temperature, top_p=params.top_p,
        top_k=params.top_k if params.top_k > 0 else -1, seed=seed, stop=list(params.stop),
        include_stop_str_in_output=True, logprobs=0,
    )
    if params.stop_token_ids is not None:
        kwargs.update(stop_token_ids=list(params.stop_token_ids), ignore_eos=True)
    if params.structured_outputs is not None:
        kwargs["structured_outputs"] = json.loads(params.structured_outputs)
    return kwargs


def vllm_structured(kwargs: dict[str, Any]) -> dict[str, Any]:
    """:func:`sampling_kwargs` for ``vllm.SamplingParams`` in process: its ``structured_outputs``
    dict as vLLM's ``StructuredOutputsParams``."""
    if kwargs.get("structured_outputs") is not None:
        from vllm.sampling_params import StructuredOutputsParams

        kwargs = {**kwargs, "structured_outputs": StructuredOutputsParams(**kwargs["structured_outputs"])}
    return kwargs


def finish_reason(reason: str | None, stop_reason: int | str | None, url: str = "vllm") -> FinishReason:
    """vLLM's (finish_reason, stop_reason) as plainrl's: a stop string -> ``stop``, the
    EOS token -> ``eos``, the token budget -> ``length``.

    Raises:
        EngineError: the request was aborted or failed inside the engine.
    """
    if reason == "length":
        return "length"
    if reason == "stop":
        return "stop" if isinstance(stop_reason, str) else "eos"
    raise EngineError(f"{url}: a request ended with finish_reason={reason!r} (aborted or failed in the engine)")


def lora_rank_slots(r: int) -> int:
    """vLLM's ``max_lora_rank`` for an adapter of rank ``r``: the smallest allowed value >= r.

    Raises:
        EngineError: r above vLLM's largest rank.
    """
    for allowed in VLLM_LORA_RANKS:
        if allowed >= r:
            return allowed
    raise EngineError(f"model.lora.r={r} is above vLLM's largest LoRA rank {VLLM_LORA_RANKS[-1]}")
