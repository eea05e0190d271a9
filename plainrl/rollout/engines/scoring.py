"""Scoring token ids with inference servers: each sequence's tokens from a start position on,
by the served model's logprob of each token given all before it (its *prompt logprobs*), and
its ``k`` most likely tokens there. A remote distillation teacher
(``algorithm.teacher.remote``, :class:`~plainrl.train.teacher.RemoteTeacher`) scores the
student's sampled tokens this way; token ids go in, never text.

- ``vllm`` (any vLLM server: ``plainrl serve`` is one, ``vllm serve`` another):
  ``POST /v1/completions`` with ``prompt`` as a batch of token-id lists, ``max_tokens: 1``
  (vLLM takes no 0, so a server needs one token of context more than the longest sequence:
  it refuses a prompt that fills its context) and ``prompt_logprobs: k``. Each choice's ``prompt_logprobs`` holds one
  entry per prompt position (None at 0): a dict from token id (a JSON string) to
  ``{logprob, rank, decoded_token}`` holding the actual token and the top ``k`` (``k`` or
  ``k + 1`` entries). The server's ``--max-logprobs`` (20 by default) caps ``k``.
- ``sglang``: ``POST /generate`` with ``input_ids`` (a batch), ``return_logprob``,
  ``logprob_start_len`` and ``top_logprobs_num`` per sequence, ``max_new_tokens: 0``;
  ``meta_info.input_token_logprobs`` is ``[logprob, token_id, text]`` per position from
  ``logprob_start_len`` on, ``meta_info.input_top_logprobs`` a list of those per position.
  Written from SGLang's ``managers/io_struct.py`` (``GenerateReqInput``) and
  ``managers/tokenizer_manager.py`` at 0.5.23; not run against an SGLang server here.

A vLLM teacher server runs without LoRA (:meth:`ServedScorer._check_no_lora` says why).
Both score prompt tokens with the model's raw distribution, log softmax(z): sampling
settings (temperature included) do not apply to prompt positions (vLLM's
``gpu_model_runner._get_prompt_logprobs_dict``, SGLang's ``logprob_processor.py``).
Servers, timeouts, retries, failover and the tokenizer check are
:class:`~plainrl.rollout.engines.served.ServedEngine`'s.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import httpx

from plainrl.rollout.engines.requests import EngineError
from plainrl.rollout.engines.served import TOKENIZER_PROBE, ServedEngine
from plainrl.types import Generation, SamplingParams

REQUEST_TOKENS = 8192  # sequences are batched into requests of about this many tokens (one at least)
REQUEST_SEQUENCES = 64  # and at most this many sequences


@dataclass
class ScoredTokens:
    """One sequence's tokens from ``start`` on, scored (L = ``len(sequence) - start``).

    logprobs: [L] log p(sequence[start + i] | sequence[:start + i]), natural log.
    top_ids:  [L][k] the k most likely tokens at each of those positions, most likely first
              (empty lists when k = 0).
    top_logps: [L][k] their logprobs.
    """

    logprobs: list[float]
    top_ids: list[list[int]]
    top_logps: list[list[float]]


def vllm_score_body(sequences: list[list[int]], *, model: str, topk: int) -> dict[str, Any]:
    """The ``/v1/completions`` request scoring ``sequences`` (token ids) with ``topk`` tokens per position."""
    return dict(model=model, prompt=[list(s) for s in sequences], max_tokens=1, temperature=0.0,
                prompt_logprobs=topk, skip_special_tokens=False)


def parse_vllm_scores(choice: dict[str, Any], sequence: list[int], start: int, topk: int, url: str) -> ScoredTokens:
    """One ``/v1/completions`` choice's ``prompt_logprobs`` as :class:`ScoredTokens` of
    ``sequence[start:]`` (the module docstring gives the form); the top ``topk`` by rank.

    Raises:
        EngineError: no ``prompt_logprobs`` (the server is not vLLM, or too old), another length
            than ``sequence``, or a position without its own token.
    """
    entries = choice.get("prompt_logprobs")
    if entries is None:
        raise EngineError(f"inference server {url} returned no prompt_logprobs: a remote teacher needs a vLLM server "
                          "(`plainrl serve` or `vllm serve`) that scores prompt tokens; use "
                          "algorithm.teacher.remote.backend=sglang for SGLang")
    if len(entries) != len(sequence):
        raise EngineError(f"inference server {url} returned {len(entries)} prompt logprobs for a sequence of "
                          f"{len(sequence)} tokens")
    out = ScoredTokens([], [], [])
    for pos in range(start, len(sequence)):
        found = entries[pos] or {}
        own = found.get(str(sequence[pos]))
        if own is None:
            raise EngineError(f"inference server {url} returned no logprob of the token at position {pos} (id "
                              f"{sequence[pos]}); it got {len(found)} entries there")
        out.logprobs.append(float(own["logprob"]))
        if topk:
            ranked = sorted(found.items(), key=lambda kv: (kv[1].get("rank") or 0, -kv[1]["logprob"]))[:topk]
            out.top_ids.append([int(k) for k, _ in ranked])
            out.top_logps.append([float(v["logprob"]) for _, v in ranked])
        else:
            out.top_ids.append([])
            out.top_logps.append([])
    return out


def sglang_score_body(sequences: list[list[int]], starts: list[int], *, topk: int) -> dict[str, Any]:
    """SGLang's ``/generate`` request scoring ``sequences`` from ``starts`` on; one position earlier
    is asked for so that :func:`parse_sglang_scores` can align by token id."""
    return {"input_ids": [list(s) for s in sequences], "return_logprob": True,
            "logprob_start_len": [max(0, s - 1) for s in starts], "top_logprobs_num": [topk] * len(sequences),
            "return_text_in_logprobs": False, "sampling_params": {"max_new_tokens": 0, "temperature": 0.0}}


def parse_sglang_scores(output: dict[str, Any], sequence: list[int], start: int, topk: int, url: str) -> ScoredTokens:
    """One ``/generate`` output's input logprobs as :class:`ScoredTokens` of ``sequence[start:]``: the
    last ``L`` positions of ``meta_info.input_token_logprobs`` (``[logprob, token_id, ...]``), their
    ids checked against the sequence's.

    Raises:
        EngineError: no input logprobs, too few, or ids that are not the sequence's.
    """
    meta = output.get("meta_info") or {}
    entries = meta.get("input_token_logprobs")
    n = len(sequence) - start
    if entries is None or len(entries) < n:
        raise EngineError(f"SGLang server {url} returned {0 if entries is None else len(entries)} input token "
                          f"logprobs for the last {n} tokens of a sequence; it needs an SGLang version whose "
                          "/generate takes return_logprob with logprob_start_len")
    entries = entries[len(entries) - n:]
    ids = [int(e[1]) for e in entries]
    if ids != list(sequence[start:]):
        raise EngineError(f"SGLang server {url} scored the token ids {ids[:8]}..., not the sequence's "
                          f"{list(sequence[start:start + 8])}...")
    tops = (meta.get("input_top_logprobs") or [])[-n:] if topk else []
    if topk and len(tops) != n:
        raise EngineError(f"SGLang server {url} returned {len(tops)} positions of input_top_logprobs for {n} tokens")
    return ScoredTokens([float(e[0]) for e in entries],
                        [[int(t[1]) for t in top[:topk]] for top in tops] if topk else [[] for _ in ids],
                        [[float(t[0]) for t in top[:topk]] for top in tops] if topk else [[] for _ in ids])


def request_batches(sequences: list[list[int]], *, tokens: int | None = None,
                    size: int | None = None) -> list[list[int]]:
    """Indices of ``sequences`` in consecutive requests of at most ``tokens`` tokens (a longer
    sequence alone; default :data:`REQUEST_TOKENS`) and ``size`` sequences (:data:`REQUEST_SEQUENCES`)."""
    tokens, size = tokens or REQUEST_TOKENS, size or REQUEST_SEQUENCES
    out: list[list[int]] = []
    used = 0
    for i, s in enumerate(sequences):
        if not out or used + len(s) > tokens or len(out[-1]) >= size:
            out.append([])
            used = 0
        out[-1].append(i)
        used += len(s)
    return out


class ServedScorer(ServedEngine):
    """Token ids scored by inference servers (the module docstring): the servers checked at
    start (healthy, the trainer's tokenizer by a probe text, the context, the scoring itself
    answering), requests batched, spread over the live servers, each with the client's timeouts.

    Args:
        urls, tokenizer, timeout_s, connect_timeout_s, model, api_key: as
            :class:`~plainrl.rollout.engines.served.ServedEngine`'s.
        max_model_len: the longest sequence to score (``model.max_context``); a server must
            serve one token more (the module docstring).
        backend: ``vllm`` or ``sglang``.
        section: the config section quoted in errors.

    Raises:
        EngineError: a server is unreachable or slower than ``connect_timeout_s`` to answer its
            checks, serves another tokenizer or a shorter context, or does not score prompt tokens.
    """

    def __init__(self, urls: list[str], tokenizer, *, backend: str = "vllm", max_model_len: int = 1024,
                 section: str = "algorithm.teacher.remote", **kwargs):
        if backend not in ("vllm", "sglang"):
            raise ValueError(f"backend must be vllm or sglang, got {backend!r}")
        self.backend, self.section = backend, section
        self.start_hint = ("start one with `plainrl serve TEACHER.yaml model.lora.enabled=false --port PORT` (a config "
                           "whose model.name is the teacher) or `vllm serve MODEL`" if backend == "vllm" else
                           "start one with `python -m sglang.launch_server --model-path MODEL --port PORT`")
        super().__init__(urls, tokenizer, sync=None, max_model_len=max_model_len + 1, **kwargs)

    def _context_need(self) -> str:
        n = self._max_model_len - 1
        return (f"model.max_context={n} plus the one token a server must be asked to generate: serve the teacher "
                f"with a context of at least {n + 1} (`plainrl serve` with model.max_context={n + 1}, vLLM's "
                f"--max-model-len {n + 1})")

    def _check_backend(self, url: str) -> None:
        model = None
        if self.backend == "vllm":
            entry = self._served_model(url)
            model = entry["id"]
            self._check_no_lora(url, entry)
        probe = self._tokenizer(TOKENIZER_PROBE, add_special_tokens=False)["input_ids"][:8]
        self._score(url, model, [probe], [1], topk=0, timeout=self._probe_timeout)

    def _check_no_lora(self, url: str, entry: dict) -> None:
        """vLLM (0.32) scores prompt tokens through the sampler's LoRA mapping: on a server started
        with LoRA enabled a batch of several sequences crashes it (vllm-project/vllm#16668), and an
        adapter's ``lm_head`` delta is left out of prompt logprobs (#51594). So the served model
        must not be an adapter, and a server that shows its config (``/server_info``: ``plainrl
        serve``, or vLLM with ``VLLM_SERVER_DEV_MODE=1``) must run without LoRA. Checked before
        the first scoring request, which could crash such a server."""
        hint = ("serve the teacher without LoRA: `plainrl serve` of a config with model.lora.enabled=false, or vLLM "
                "without --enable-lora, an adapter merged into the weights (`plainrl export --merge`)")
        if entry.get("parent"):
            raise EngineError(f"inference server {url}: {self.section}.model={entry['id']!r} is a LoRA adapter on "
                              f"{entry['parent']!r}; vLLM leaves an adapter's lm_head out of prompt logprobs and can "
                              f"crash scoring batches on a LoRA server (vllm-project/vllm#51594, #16668); {hint}")
        try:
            info = self.client.get(url + "/server_info", params={"config_format": "json"}, timeout=self._probe_timeout)
        except httpx.HTTPError:
            return  # no config shown: nothing more to check here (docs/algorithms.md, "A remote teacher")
        config = info.json().get("vllm_config") if info.status_code == 200 else None
        if isinstance(config, dict) and config.get("lora_config"):
            raise EngineError(f"inference server {url} runs with LoRA enabled, and vLLM scores prompt tokens through "
                              "the sampler's LoRA mapping, which crashes the server once several sequences share a "
                              f"batch (vllm-project/vllm#16668); {hint}")

    def score(self, sequences: list[list[int]], starts: list[int], *, topk: int = 0) -> list[ScoredTokens]:
        """Each sequence's tokens from its start on, scored by the served model.

        Args:
            sequences: N token-id lists (prompt then completion).
            starts: N positions, each at least 1 (the first scored token has a prefix).
            topk: also each position's ``topk`` most likely tokens (0: none).
        Returns:
            N :class:`ScoredTokens`, in order.
        Raises:
            EngineError: every server failed, or one refused a request (a 4xx names why, e.g. a
                ``topk`` above vLLM's ``--max-logprobs``).
        """
        if len(sequences) != len(starts):
            raise ValueError(f"{len(sequences)} sequences but {len(starts)} starts")
        if any(s < 1 or s > len(q) for q, s in zip(sequences, starts)):
            raise ValueError("every start must be in [1, len(sequence)]: the first token has no prefix to score it")
        if not sequences:
            return []
        batches = request_batches(sequences)
        out: list[ScoredTokens | None] = [None] * len(sequences)
        with ThreadPoolExecutor(max_workers=min(16, len(batches))) as pool:
            futures = [pool.submit(self.pool.run, lambda server, b=b: self._score(
                self.urls[server], self.models[server], [sequences[i] for i in b], [starts[i] for i in b], topk=topk))
                for b in batches]
            for b, fut in zip(batches, futures):
                for i, scored in zip(b, fut.result()):
                    out[i] = scored
        return out  # type: ignore[return-value]

    def _score(self, url: str, model: str | None, sequences: list[list[int]], starts: list[int], *, topk: int,
               timeout: float | None = None) -> list[ScoredTokens]:
        """One request scoring ``sequences`` on ``url`` (``model``: the served name, vLLM's)."""
        extra = {} if timeout is None else {"timeout": timeout}
        if self.backend == "vllm":
            body = vllm_score_body(sequences, model=model, topk=topk)
            choices = sorted(self._call("POST", url, "/v1/completions", json=body, **extra).json()["choices"],
                             key=lambda c: c["index"])
            if len(choices) != len(sequences):
                raise EngineError(f"inference server {url} returned {len(choices)} choices for {len(sequences)} prompts")
            return [parse_vllm_scores(c, q, s, topk, url) for c, q, s in zip(choices, sequences, starts)]
        outputs = self._call("POST", url, "/generate", json=sglang_score_body(sequences, starts, topk=topk),
                             **extra).json()
        outputs = outputs if isinstance(outputs, list) else [outputs]
        if len(outputs) != len(sequences):
            raise EngineError(f"SGLang server {url} returned {len(outputs)} outputs for {len(sequences)} inputs")
        return [parse_sglang_scores(o, q, s, topk, url) for o, q, s in zip(outputs, sequences, starts)]

    def generate(self, prompts: list[list[int]], params: SamplingParams, *,
                 seeds: list[int] | None = None) -> list[Generation]:
        """Not offered: a scorer's servers score, they do not sample for the run.

        Raises:
            EngineError: always.
        """
        raise EngineError(f"{self.section}: these servers score a teacher's logprobs; sampling goes to rollout.engine")
