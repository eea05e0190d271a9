"""LLM-as-judge: a reward read off another model's (or the policy's base model's) reply.

    rewards:
      - fn: judge
        weight: 1.0
        kwargs: {model: policy_base, template: "...{prompt}...{completion}...{answer}...", pattern: "(\\d+)"}

The judge sees ``template`` filled with the episode's ``{prompt}``, ``{completion}`` and
``{answer}`` as one user message, replies greedily, and the first match of ``pattern`` in
the reply (its first group, if it has one) is the score, mapped linearly from
``[min_score, max_score]`` onto [0, 1] and clipped. A reply with no score is unscorable
(None: the sample leaves its group's statistics), never 0.

``model``: ``policy_base`` (the policy's base model, as ``model.name`` loads it, in this
process, on the embedded engine), a local model directory or name plainrl can load, or the
URL of an OpenAI-compatible server (``http://host:port``; ``/v1/chat/completions``, the
served model from ``/v1/models`` unless ``served_model`` names it; an API key from the
environment variable ``api_key_env``). The policy's base is the judge of choice on a
laptop; a small model judges badly (the docs give its agreement with ``correctness``).

Source: Zheng et al. 2023, "Judging LLM-as-a-Judge with MT-Bench and Chatbot Arena"
(arXiv:2306.05685), single-answer grading with a reference answer.
"""

from __future__ import annotations

import functools
import multiprocessing
import os
import re
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from typing import Any

from plainrl.rewards.forms import batched
from plainrl.rewards.loading import RewardFn, RewardLoadError

DEFAULT_TEMPLATE = (
    "Grade the answer to the question below. Compare it with the reference answer.\n\n"
    "Question: {prompt}\nReference answer: {answer}\nAnswer to grade: {completion}\n\n"
    "Reply with only a score from 0 (wrong) to 10 (fully correct)."
)
POLICY_BASE = "policy_base"


def parse_score(reply: str, pattern: str, min_score: float, max_score: float) -> float | None:
    """The first match of ``pattern`` in ``reply`` mapped from [min_score, max_score] onto [0, 1]
    (clipped); None when nothing matches or the match is not a number."""
    m = re.search(pattern, reply)
    if m is None:
        return None
    try:
        x = float(m.group(1) if m.groups() else m.group(0))
    except (TypeError, ValueError):
        return None
    return min(1.0, max(0.0, (x - min_score) / (max_score - min_score)))


def _is_url(model: str) -> bool:
    return model.startswith(("http://", "https://"))


@functools.lru_cache(maxsize=2)
def _local_judge(model: str):
    """The judge model loaded once per process (reward workers each load their own)."""
    import torch

    from plainrl.config import ModelConfig
    from plainrl.models import load_policy, load_tokenizer
    from plainrl.rollout.engines.hf import HFEngine

    if multiprocessing.parent_process() is not None:
        # a forked reward worker: the parent's OpenMP pool does not survive fork (torch ops on several
        # threads can crash here), and the worker is one of several processes sharing the cores anyway
        torch.set_num_threads(1)
    tokenizer = load_tokenizer(model)
    policy = load_policy(ModelConfig(name=model, lora={"enabled": False}), torch.device("cpu"))
    return tokenizer, HFEngine(policy, tokenizer)


def _ask_local(model: str, questions: list[str], max_new_tokens: int) -> list[str]:
    from plainrl.types import SamplingParams

    tokenizer, engine = _local_judge(model)
    prompts = [tokenizer(tokenizer.apply_chat_template([{"role": "user", "content": q}], tokenize=False,
                                                       add_generation_prompt=True), add_special_tokens=False)["input_ids"]
               for q in questions]
    out = engine.generate(prompts, SamplingParams(max_new_tokens=max_new_tokens, temperature=0.0))
    return [tokenizer.decode(g.token_ids, skip_special_tokens=True) for g in out]


def _endpoint(url: str, api_key_env: str | None) -> tuple[str, dict[str, str]]:
    """The server's base URL (without ``/v1``) and the request headers (the key from ``api_key_env``)."""
    headers = {"Authorization": f"Bearer {os.environ[api_key_env]}"} if api_key_env else {}
    return url.rstrip("/").removesuffix("/v1"), headers


def _ask_server(url: str, questions: list[str], *, max_new_tokens: int, timeout_s: float, max_retries: int,
                served_model: str | None, api_key_env: str | None) -> list[str]:
    """The judge server's replies, through the ``openai`` client: a 408/409/429/5xx answer or a
    connection error is retried up to ``max_retries`` times with exponential backoff and jitter,
    waiting what the server's ``Retry-After`` asks (the client's own rule, up to 60 s), each request
    limited to ``timeout_s``; a hosted judge's rate limit then slows a chunk down instead of
    making it unscorable."""
    import openai

    base, _ = _endpoint(url, None)
    # a server without keys ignores the header; the client refuses to start without one
    key = os.environ[api_key_env] if api_key_env else "none"
    with openai.OpenAI(base_url=base + "/v1", api_key=key, timeout=timeout_s, max_retries=max_retries) as client:
        if served_model is None:
            served_model = client.models.list().data[0].id

        def ask(q: str) -> str:
            r = client.chat.completions.create(model=served_model, messages=[{"role": "user", "content": q}],
                                               temperature=0.0, max_tokens=max_new_tokens)
            return r.choices[0].message.content or ""

        with ThreadPoolExecutor(max_workers=min(16, len(questions))) as pool:
            return list(pool.map(ask, questions))


@batched
def judge(completions: list[str], prompt: list[str | None], answer: list[Any] | None = None, *,
          model: str = POLICY_BASE, template: str = DEFAULT_TEMPLATE, pattern: str = r"(\d+(?:\.\d+)?)",
          min_score: float = 0.0, max_score: float = 10.0, max_new_tokens: int = 16, timeout_s: float = 60.0,
          max_retries: int = 4, served_model: str | None = None,
          api_key_env: str | None = None) -> list[float | None]:
    """LLM-as-judge scores in [0, 1], one per completion (None: the reply had no score).

    Args:
        completions: [N] the policy's completions.
        prompt: [N] each episode's prompt (the row's ``prompt`` or last user message).
        answer: [N] reference answers (``{answer}`` renders as "none" where missing).
        model: ``policy_base`` (bound to ``model.name`` by the run), a local model, or a URL.
        template: the judge's user message, with ``{prompt}``, ``{completion}``, ``{answer}``.
        pattern: a regular expression whose first match (first group) is the score.
        min_score, max_score: the scale the template asks for, mapped onto [0, 1].
        timeout_s: per request to a judge server (seconds).
        max_retries: retries of a judge server's request after a 408/409/429/5xx or a connection
            error, with the ``openai`` client's jittered exponential backoff, honouring ``Retry-After``.
    Raises:
        openai.APIError: a judge server still failed after its retries (the runner records every
            sample of the chunk as unscorable, naming the error; ``fail_fast`` stops the run).
    """
    answers = answer if answer is not None else [None] * len(completions)
    questions = [template.format(prompt=p or "", completion=c, answer="none" if a is None else a)
                 for c, p, a in zip(completions, prompt, answers)]
    if _is_url(model):
        replies = _ask_server(model, questions, max_new_tokens=max_new_tokens, timeout_s=timeout_s,
                              max_retries=max_retries, served_model=served_model, api_key_env=api_key_env)
    else:
        replies = _ask_local(model, questions, max_new_tokens)
    return [parse_score(r, pattern, min_score, max_score) for r in replies]


def bind_judges(fns: list[RewardFn], policy_model: str) -> list[RewardFn]:
    """Each :func:`judge` reward with ``model: policy_base`` bound to the policy's
    ``model.name``; judge servers checked now, before any model loads.

    Raises:
        RewardLoadError: a judge URL does not answer ``/v1/models`` (named), its
            ``api_key_env`` is not set, or ``min_score >= max_score``.
    """
    out = []
    for f in fns:
        if f.fn is not judge:
            out.append(f)
            continue
        kwargs = dict(f.kwargs)
        model = kwargs.setdefault("model", POLICY_BASE)
        if kwargs.get("min_score", 0.0) >= kwargs.get("max_score", 10.0):
            raise RewardLoadError(f"reward {f.name!r}: min_score must be below max_score, got "
                                  f"{kwargs.get('min_score', 0.0)} and {kwargs.get('max_score', 10.0)}")
        if model == POLICY_BASE:
            kwargs["model"] = policy_model
        elif _is_url(model):
            _check_server(f.name, model, kwargs.get("api_key_env"), kwargs.get("timeout_s", 60.0))
        out.append(replace(f, kwargs=kwargs))
    return out


def _check_server(name: str, url: str, api_key_env: str | None, timeout_s: float) -> None:
    import httpx

    if api_key_env and api_key_env not in os.environ:
        raise RewardLoadError(f"reward {name!r}: api_key_env={api_key_env!r} is not set in the environment")
    base, headers = _endpoint(url, api_key_env)
    try:
        httpx.get(base + "/v1/models", headers=headers,
                  timeout=min(timeout_s, 10.0)).raise_for_status()
    except httpx.HTTPError as e:
        raise RewardLoadError(f"reward {name!r}: the judge server {url} does not answer GET /v1/models "
                              f"({type(e).__name__}: {e}); start it or fix kwargs.model") from e
