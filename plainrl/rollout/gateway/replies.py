"""Responses built from one recorded model call, with the ``openai`` package's own types:
``ChatCompletion``, ``ChatCompletionChunk`` (a stream replayed from the finished completion),
``Completion``; and vLLM's token-in/token-out ``/inference/v1/generate`` response.

vLLM's ``return_token_ids`` extension adds ``prompt_token_ids`` (the whole context the engine
continued) and the choice's ``token_ids`` (what it sampled, exactly the ids the episode trains
on), as vLLM returns them; the ``openai`` types keep extra fields.
"""

from __future__ import annotations

import json
import secrets
import time
from typing import Any, Iterator

from openai.types import Completion, CompletionChoice, CompletionUsage
from openai.types.chat import ChatCompletion, ChatCompletionChunk, ChatCompletionTokenLogprob
from openai.types.chat.chat_completion import Choice, ChoiceLogprobs
from openai.types.chat.chat_completion_token_logprob import TopLogprob
from openai.types.completion_choice import Logprobs

from plainrl.rollout.gateway.messages import Reply
from plainrl.rollout.llm import Turn

__all__ = ["chat_chunks", "chat_completion", "completion", "finish_reason", "generate_response"]


def finish_reason(turn: Turn, reply: Reply | None = None) -> str:
    """OpenAI's finish reason: ``tool_calls`` when the turn ended (EOS or a stop) with tool
    calls, ``length`` when it ran out of tokens, else ``stop``."""
    reason = turn.completion.finish_reason
    if reason == "length":
        return "length"
    return "tool_calls" if reply is not None and reply.calls else "stop"


def _usage(turn: Turn) -> CompletionUsage:
    n, p = len(turn.completion.token_ids), len(turn.context)
    return CompletionUsage(prompt_tokens=p, completion_tokens=n, total_tokens=p + n)


def _pieces(tokenizer, ids: list[int]) -> list[str]:
    return tokenizer.batch_decode([[t] for t in ids], skip_special_tokens=False)


def _chat_logprobs(tokenizer, turn: Turn, top: int | None) -> ChoiceLogprobs:
    # the engines return each sampled token's logprob, not the alternatives: top_logprobs
    # (when asked for) lists the sampled token alone
    out = []
    for piece, lp in zip(_pieces(tokenizer, turn.completion.token_ids), turn.completion.logprobs):
        raw = list(piece.encode("utf-8"))
        alts = [TopLogprob(token=piece, bytes=raw, logprob=lp)] if top else []
        out.append(ChatCompletionTokenLogprob(token=piece, bytes=raw, logprob=lp, top_logprobs=alts))
    return ChoiceLogprobs(content=out)


def _ids(prefix: str) -> str:
    return f"{prefix}-{secrets.token_hex(12)}"


def chat_completion(model: str, tokenizer, turn: Turn, reply: Reply, *, logprobs: bool, top_logprobs: int | None,
                    token_ids: bool) -> dict[str, Any]:
    """The ``chat.completion`` object for a recorded turn."""
    choice = Choice(index=0, message=reply.openai_message(), finish_reason=finish_reason(turn, reply),
                    logprobs=_chat_logprobs(tokenizer, turn, top_logprobs) if logprobs else None)
    if token_ids:
        choice.token_ids = list(turn.completion.token_ids)  # type: ignore[attr-defined]
    out = ChatCompletion(id=_ids("chatcmpl"), object="chat.completion", created=int(time.time()), model=model,
                         choices=[choice], usage=_usage(turn))
    if token_ids:
        out.prompt_token_ids = list(turn.context)  # type: ignore[attr-defined]
    return out.model_dump(mode="json", exclude_unset=True)


def chat_chunks(model: str, tokenizer, turn: Turn, reply: Reply, *, logprobs: bool, top_logprobs: int | None,
                token_ids: bool, usage: bool) -> Iterator[str]:
    """The server-sent events of a streamed chat completion, replayed from the finished one:
    the role, the reasoning (``reasoning_content``), the content (with its logprobs), the tool
    calls, the finish reason (with ``token_ids``), the usage when ``stream_options.include_usage``,
    then ``[DONE]``."""
    head = dict(id=_ids("chatcmpl"), object="chat.completion.chunk", created=int(time.time()), model=model)

    def event(choices: list[dict[str, Any]], **extra: Any) -> str:
        chunk = ChatCompletionChunk.model_validate({**head, "choices": choices, **extra})
        return f"data: {json.dumps(chunk.model_dump(mode='json', exclude_unset=True))}\n\n"

    first = {"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}
    yield event([first], **({"prompt_token_ids": list(turn.context)} if token_ids else {}))
    if reply.reasoning is not None:  # vLLM's field for a reasoning model's <think> text
        yield event([{"index": 0, "delta": {"reasoning_content": reply.reasoning}, "finish_reason": None}])
    if reply.content:
        lp = _chat_logprobs(tokenizer, turn, top_logprobs).model_dump(mode="json") if logprobs else None
        yield event([{"index": 0, "delta": {"content": reply.content}, "finish_reason": None, "logprobs": lp}])
    if reply.calls:
        calls = reply.openai_message()["tool_calls"]
        yield event([{"index": 0, "delta": {"tool_calls": [{"index": i, **c} for i, c in enumerate(calls)]},
                      "finish_reason": None}])
    last: dict[str, Any] = {"index": 0, "delta": {}, "finish_reason": finish_reason(turn, reply)}
    if token_ids:
        last["token_ids"] = list(turn.completion.token_ids)
    yield event([last])
    if usage:
        yield event([], usage=_usage(turn).model_dump())
    yield "data: [DONE]\n\n"


def completion(model: str, tokenizer, turn: Turn, *, logprobs: int | None, token_ids: bool) -> dict[str, Any]:
    """The ``text_completion`` object for a recorded ``/v1/completions`` turn."""
    c = turn.completion
    lp = None
    if logprobs is not None:
        pieces = _pieces(tokenizer, c.token_ids)
        offsets, at = [], 0
        for p in pieces:
            offsets.append(at)
            at += len(p)
        lp = Logprobs(tokens=pieces, token_logprobs=list(c.logprobs), text_offset=offsets,
                      top_logprobs=[{p: x} for p, x in zip(pieces, c.logprobs)] if logprobs else None)
    choice = CompletionChoice(index=0, text=c.text, finish_reason="length" if c.finish_reason == "length" else "stop",
                              logprobs=lp)
    if token_ids:
        choice.prompt_token_ids = list(turn.context)  # type: ignore[attr-defined]
        choice.token_ids = list(c.token_ids)  # type: ignore[attr-defined]
    out = Completion(id=_ids("cmpl"), object="text_completion", created=int(time.time()), model=model,
                     choices=[choice], usage=_usage(turn))
    return out.model_dump(mode="json", exclude_unset=True)


def generate_response(model: str | None, turn: Turn, request_id: str | None, *, logprobs: bool) -> dict[str, Any]:
    """vLLM's ``/inference/v1/generate`` response (``output_mode: tokens``): the sampled ids, each
    logprob (``token_id`` and, as clients of vLLM's earlier releases read it, ``token``
    ``"token_id:<id>"``), the finish reason and ``prompt_token_ids``."""
    c = turn.completion
    content = [{"token_id": t, "token": f"token_id:{t}", "logprob": x, "top_logprobs": []}
               for t, x in zip(c.token_ids, c.logprobs)]
    n, p = len(c.token_ids), len(turn.context)
    return {
        "request_id": request_id or _ids("gen"), "model": model, "created": int(time.time()), "output_mode": "tokens",
        "prompt_token_ids": list(turn.context),
        "usage": {"prompt_tokens": p, "completion_tokens": n, "total_tokens": p + n},
        "choices": [{"index": 0, "finish_reason": "length" if c.finish_reason == "length" else "stop",
                     "stop_reason": None, "token_ids": list(c.token_ids),
                     "logprobs": {"content": content} if logprobs else None}],
    }
