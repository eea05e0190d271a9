"""``rollout.remote.backend: openai``: any OpenAI-compatible completions server (a hosted
API, vLLM, SGLang, llama.cpp's server, ...) as a read-only engine: it samples, the trainer
never pushes weights to it, so it serves ``plainrl eval`` of the served model as it is.

**Not token-exact.** The API takes text and returns text: the prompt ids are decoded with
the trainer's tokenizer (special tokens kept, so a chat template survives) and the server
tokenizes that text again; the completion's text is tokenized again here
(``add_special_tokens=False``). Where the server's tokenizer is not the trainer's, or
re-tokenising a text does not give back the ids that produced it (it need not), the ids
are not the ones sampled; the EOS token is not in them (the API returns text without it),
and a stop string is cut from the text by the OpenAI API (vLLM keeps it when asked).
Logprobs are the server's per-token ``logprobs.token_logprobs`` when its tokens spell the
completion's text and are as many as the re-tokenised ids; otherwise they are unknown
(NaN) and anything that needs them must recompute them with the policy. That is why this
backend cannot train: use ``vllm`` (``plainrl serve``) or ``sglang`` for rollouts.

Requests: ``POST /v1/completions`` with ``model``, ``prompt`` (text), ``n`` (a group's
samples), ``max_tokens``, ``temperature``, ``top_p``, ``seed``, ``stop``, ``logprobs: 0``;
``top_k`` (not in OpenAI's API; vLLM and SGLang take it) only when set. A seeded call sends one
request per sample with its seed (``seed`` only when there is one); whether the server
honours it is the server's (OpenAI's API calls it best effort). The API key
comes from the environment variable ``rollout.remote.api_key_env`` names.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from plainrl.rollout.engines.requests import EngineError, Request, finish_reason
from plainrl.rollout.engines.served import ServedEngine
from plainrl.types import Generation, SamplingParams

START_HINT = "point rollout.remote.urls at an OpenAI-compatible server's base URL (the part before /v1)"


def completion_body(prompt: str, params: SamplingParams, *, model: str, n: int, seed: int | None) -> dict[str, Any]:
    """The ``/v1/completions`` request for ``n`` samples of ``prompt`` (text); ``seed`` None: unseeded."""
    body: dict[str, Any] = dict(model=model, prompt=prompt, n=n, max_tokens=params.max_new_tokens,
                                temperature=params.temperature, top_p=params.top_p, logprobs=0)
    if seed is not None:
        body["seed"] = seed
    if params.stop:
        body["stop"] = list(params.stop)
    if params.top_k > 0:
        body["top_k"] = params.top_k
    return body


def parse_choice(choice: dict[str, Any], tokenizer, url: str) -> Generation:
    """One ``/v1/completions`` choice as a :class:`Generation`: the text re-tokenised with the
    trainer's tokenizer, and the server's logprobs where they line up with those ids (else NaN).

    Raises:
        EngineError: the server reports a finish reason other than stop/length.
    """
    text = choice.get("text") or ""
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    served = choice.get("logprobs") or {}
    tokens, values = served.get("tokens") or [], served.get("token_logprobs") or []
    aligned = len(values) == len(ids) and "".join(tokens) == text and None not in values
    logprobs = [float(v) for v in values] if aligned else [math.nan] * len(ids)
    return Generation(token_ids=ids, logprobs=logprobs,
                      finish_reason=finish_reason(choice.get("finish_reason"), choice.get("stop_reason"), url))


class OpenAICompatEngine(ServedEngine):
    """A read-only :class:`~plainrl.rollout.engines.base.Engine` over OpenAI-compatible servers
    (see the module docstring for what is not exact). Arguments as
    :class:`~plainrl.rollout.engines.served.ServedEngine`'s, without ``sync``: ``model`` names
    the served model (required when a server lists several).

    Raises:
        EngineError: a server does not answer ``/v1/models`` (unreachable, or the key is
            refused), does not serve ``model``, or serves a shorter context;
            :meth:`load_weights` always.
    """

    backend = "openai"
    start_hint = START_HINT

    def __init__(self, urls: list[str], tokenizer, **kwargs):
        super().__init__(urls, tokenizer, sync=None, **kwargs)

    def _check(self, url: str) -> str:
        # no /health or /tokenize in OpenAI's API: a model list is what every such server answers
        return self._served_model(url, retries=0, unique=True)["id"]

    def _complete(self, server: int, req: Request, params: SamplingParams) -> list[Generation]:
        url = self.urls[server]
        prompt = self._tokenizer.decode(req.prompt_ids, skip_special_tokens=False)
        body = completion_body(prompt, params, model=self.models[server], n=len(req.rows), seed=req.seed)
        choices = sorted(self._call("POST", url, "/v1/completions", json=body).json()["choices"],
                         key=lambda c: c["index"])
        return [parse_choice(c, self._tokenizer, url) for c in choices]

    def load_weights(self, model: torch.nn.Module) -> None:
        """Refused: the trainer cannot push weights to an OpenAI-compatible server.

        Raises:
            EngineError: always.
        """
        raise EngineError("rollout.remote.backend=openai is read-only: the trainer cannot push weights to an "
                          "OpenAI-compatible server; train with backend vllm (`plainrl serve`) or sglang")
