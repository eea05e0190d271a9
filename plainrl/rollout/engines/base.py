"""The rollout-engine protocol every backend implements."""

from __future__ import annotations

from typing import Protocol

import torch

from plainrl.types import Generation, SamplingParams


class Engine(Protocol):
    """Token-in, token-out generation.

    ``generate`` receives prompt token ids and returns, for each, the exact ids
    sampled and their logprobs under the current policy weights. ``seeds`` gives each
    prompt its own random stream (:mod:`plainrl.rollout.seeding`): a completion depends on
    its prompt and seed, not on the other prompts of the call (None: unseeded). ``load_weights``
    makes the engine sample from the learner's latest weights (a no-op for
    engines that share the learner's model). ``offload`` frees the engine's
    accelerator memory while the learner trains (vLLM's sleep mode; a no-op
    elsewhere). ``take_metrics`` returns the engine's counters since the last call
(``rollout/server_failures`` for servers; ``{}`` where there are none). ``close``
releases processes and connections.

    Implementations: :class:`~plainrl.rollout.engines.hf.HFEngine` (embedded),
    :class:`~plainrl.rollout.engines.vllm_local.VLLMEngine` (vLLM in process),
    :class:`~plainrl.rollout.engines.remote.RemoteEngine` (``plainrl serve`` servers),
    :class:`~plainrl.rollout.engines.sglang.SGLangEngine` (SGLang servers) and the read-only
    :class:`~plainrl.rollout.engines.openai_compat.OpenAICompatEngine` (OpenAI-compatible servers).
    """

    def generate(
        self,
        prompts: list[list[int]],
        params: SamplingParams,
        *,
        seeds: list[int] | None = None,
    ) -> list[Generation]: ...

    def load_weights(self, model: torch.nn.Module) -> None: ...

    def offload(self) -> None: ...

    def take_metrics(self) -> dict[str, float]: ...

    def close(self) -> None: ...
