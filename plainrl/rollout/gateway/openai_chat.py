"""OpenAI's Chat Completions dialect and its neighbours, over the shared recorder.

- ``POST /v1/chat/completions``: a chat call of the episode whose key the request carries
  (:func:`~plainrl.rollout.gateway.recorder.chat_call`); ``stream`` replays the finished
  completion as events.
- ``POST /v1/completions``: a text or token-id prompt (:meth:`~plainrl.rollout.llm.LLM.generate_turn`).
- ``POST /inference/v1/generate``: vLLM's token-in, token-out route.
- ``GET /v1/models``: the model id and ``max_model_len``.

Errors are OpenAI's (:mod:`plainrl.rollout.gateway.errors`).
"""

from __future__ import annotations

import json
import time

from openai.types.chat import ChatCompletionFunctionTool
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from plainrl.rollout.gateway.errors import GatewayError, parse_body
from plainrl.rollout.gateway.keys import Episodes
from plainrl.rollout.gateway.messages import template_message
from plainrl.rollout.gateway.recorder import (
    ToolChoice, ToolSet, bearer_key, chat_call, episode, function_tool, model_call, template_format, trains,
)
from plainrl.rollout.gateway.replies import chat_chunks, chat_completion, completion, generate_response
from plainrl.rollout.gateway.sampling import request_sampling
from plainrl.rollout.gateway.schema import ChatRequest, CompletionRequest, GenerateRequest
from plainrl.rollout.gateway.structured import structured_outputs
from plainrl.rollout.offload import render_off_loop

__all__ = ["chat", "completions", "generate", "models"]


async def chat(episodes: Episodes, request: Request) -> Response:
    """``POST /v1/chat/completions``."""
    llm = episode(episodes, bearer_key(request))
    req = await parse_body(request, ChatRequest)
    fmt, renders = template_format(llm, episodes.tool_parser)
    c = req.tool_choice
    choice = ToolChoice(c) if isinstance(c, str) else ToolChoice("required", c.function.name) if c else ToolChoice()
    structured = structured_outputs(llm, req.response_format, "response_format", vllm=req.structured_outputs)
    sampling = request_sampling(req, llm.params, req.max_completion_tokens, structured)
    messages = [template_message(m, fmt, renders) for m in req.messages]
    functions = [function_tool(t.function.name, t.function.description, t.function.parameters, t.function.strict)
                 for t in req.tools or [] if isinstance(t, ChatCompletionFunctionTool)]
    tools = ToolSet(tuple(functions), dropped=len(req.tools or []) - len(functions))  # custom, or unknown: dropped
    done = await chat_call(episodes, request, llm, messages, tools, choice, sampling, train=trains(request, req.model),
                           continue_final=bool(req.continue_final_message))
    kw = dict(logprobs=bool(req.logprobs), top_logprobs=req.top_logprobs, token_ids=bool(req.return_token_ids))
    if req.stream:
        usage = bool(req.stream_options and req.stream_options.include_usage)
        return StreamingResponse(chat_chunks(episodes.model, llm.tokenizer, done.turn, done.reply, usage=usage, **kw),
                                 media_type="text/event-stream")
    return JSONResponse(chat_completion(episodes.model, llm.tokenizer, done.turn, done.reply, **kw))


async def completions(episodes: Episodes, request: Request) -> Response:
    """``POST /v1/completions``: one prompt, text or token ids."""
    llm = episode(episodes, bearer_key(request))
    req = await parse_body(request, CompletionRequest)
    if req.echo:
        raise GatewayError(400, "echo is not supported: the prompt is the episode's context", param="echo")
    prompt = req.prompt
    if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
        if len(prompt) != 1:
            raise GatewayError(400, f"prompt: one prompt per request, got {len(prompt)}", param="prompt")
        prompt = prompt[0]
    ids = await render_off_loop(lambda: list(llm.tokenizer(prompt)["input_ids"]), len(prompt)) \
        if isinstance(prompt, str) else list(prompt)  # a long prompt tokenized in a thread (rollout/offload.py)
    structured = structured_outputs(llm, req.response_format, "response_format", vllm=req.structured_outputs)
    sampling = request_sampling(req, llm.params, None, structured)
    turn = await model_call(episodes, request, llm, sampling,
                            llm.generate_turn(ids, sampling.params, stop_token_ids=sampling.stop_token_ids,
                                              train=trains(request, req.model)),
                            param="prompt")
    body = completion(episodes.model, llm.tokenizer, turn, logprobs=req.logprobs, token_ids=bool(req.return_token_ids))
    if req.stream:
        return StreamingResponse(iter([f"data: {json.dumps({**body, 'object': 'text_completion'})}\n\n",
                                       "data: [DONE]\n\n"]), media_type="text/event-stream")
    return JSONResponse(body)


async def generate(episodes: Episodes, request: Request) -> Response:
    """``POST /inference/v1/generate``: vLLM's token-in, token-out route."""
    llm = episode(episodes, bearer_key(request))
    req = await parse_body(request, GenerateRequest)
    if req.stream:
        raise GatewayError(400, "stream is not supported on /inference/v1/generate", param="stream")
    sp = req.sampling_params
    sampling = request_sampling(sp, llm.params, None, structured_outputs(llm, None, "", vllm=sp.structured_outputs))
    turn = await model_call(episodes, request, llm, sampling,
                            llm.generate_turn(list(req.token_ids), sampling.params,
                                              stop_token_ids=sampling.stop_token_ids,
                                              train=trains(request, req.model)), param="token_ids")
    return JSONResponse(generate_response(req.model or episodes.model, turn, req.request_id,
                                          logprobs=sp.logprobs is not None))


async def models(episodes: Episodes, request: Request) -> Response:
    """``GET /v1/models``: the model card, to a live episode's key (as every route)."""
    episode(episodes, bearer_key(request) or request.headers.get("x-api-key", ""))
    card = {"id": episodes.model, "object": "model", "created": int(time.time()), "owned_by": "plainrl",
            "max_model_len": episodes.max_model_len}
    return JSONResponse({"object": "list", "data": [card]})
