"""The gateway in front of vLLM: in process (rollout.engine=vllm) and a `plainrl serve` server
(rollout.engine=remote). An unmodified openai.AsyncOpenAI agent's trained spans equal each
response's token_ids and logprobs, through Chat Completions and the Responses API; a JSON schema
(`response_format`, `text.format`) constrains vLLM's sample. Runs under `make test-vllm`; skipped without vLLM."""

from __future__ import annotations

import json

import pytest
import torch

vllm = pytest.importorskip("vllm", reason="vLLM is not installed in this venv; `make test-vllm` runs these tests")

from test_gateway import CALC, prompts, spans  # noqa: E402

from plainrl.models import load_tokenizer  # noqa: E402
from plainrl.rollout import agent_rollout  # noqa: E402
from plainrl.rollout.episode_loop import LoopSettings  # noqa: E402
from plainrl.types import SamplingParams  # noqa: E402

pytestmark = pytest.mark.vllm
MODEL = "smollm2-135m-instruct"


async def agent(llm, row):
    """Two chat calls, a tool result between them, the second streamed; what came back is kept."""
    client = llm.openai_client()
    messages = [{"role": "user", "content": "What is 6*7? Use the calculate tool."}]
    first = await client.chat.completions.create(model="policy", messages=messages, tools=[CALC], max_tokens=24,
                                                 logprobs=True, extra_body={"return_token_ids": True})
    messages += [first.choices[0].message, {"role": "tool", "tool_call_id": "call_0", "content": "42"}]
    stream = await client.chat.completions.create(model="policy", messages=messages, tools=[CALC], max_tokens=24,
                                                  logprobs=True, stream=True, extra_body={"return_token_ids": True})
    chunks = [c async for c in stream]
    second_ids = [t for c in chunks if c.choices for t in (getattr(c.choices[0], "token_ids", None) or [])]
    second_lps = [t.logprob for c in chunks if c.choices and c.choices[0].logprobs
                  for t in c.choices[0].logprobs.content]
    llm.row["got"] = (first, second_ids, second_lps)
    return 1.0


async def responses_agent(llm, row):
    """The Responses API: two calls, the first's output items sent back, then a function output or a user turn."""
    client = llm.openai_client()
    tool = {"type": "function", **CALC["function"]}
    items = [{"role": "user", "content": "What is 6*7? Use the calculate tool."}]
    first = await client.responses.create(model="policy", input=items, tools=[tool], max_output_tokens=24,
                                          extra_body={"return_token_ids": True})
    items += [o.model_dump(exclude_none=True) for o in first.output]
    calls = [o for o in first.output if o.type == "function_call"]
    items += [{"type": "function_call_output", "call_id": c.call_id, "output": "42"} for c in calls] or \
        [{"role": "user", "content": "And 6*8?"}]
    second = await client.responses.create(model="policy", input=items, tools=[tool], max_output_tokens=24,
                                           extra_body={"return_token_ids": True})
    llm.row["got"] = (first, second)
    return 1.0


ANSWER_SCHEMA = {"type": "object", "properties": {"answer": {"type": "integer"}}, "required": ["answer"],
                 "additionalProperties": False}


async def structured_agent(llm, row):
    """A JSON schema through Chat Completions' response_format and the Responses API's text.format."""
    client = llm.openai_client()
    ask = [{"role": "user", "content": "What is 6*7? Answer in JSON."}]
    chat = await client.chat.completions.create(
        model="policy", messages=ask, max_tokens=24, extra_body={"return_token_ids": True},
        response_format={"type": "json_schema", "json_schema": {"name": "answer", "schema": ANSWER_SCHEMA}})
    follow = ask + [{"role": "assistant", "content": chat.choices[0].message.content},
                    {"role": "user", "content": "And 6*8?"}]  # the same conversation, continued in the other dialect
    resp = await client.responses.create(model="policy", input=follow, max_output_tokens=24,
                                         text={"format": {"type": "json_schema", "name": "answer",
                                                          "schema": ANSWER_SCHEMA}},
                                         extra_body={"return_token_ids": True})
    llm.row["got"] = (chat, resp)
    return 1.0


def _check_structured(eps):
    for ep in eps:
        assert ep.env.error is None, ep.env.error
        chat, resp = ep.row["got"]
        # constrained: each reply is the schema's JSON (unless the token limit cut it)
        for text, cut in ((chat.choices[0].message.content, chat.choices[0].finish_reason == "length"),
                          (resp.output_text, resp.status == "incomplete")):
            if not cut:
                assert set(json.loads(text)) == {"answer"} and isinstance(json.loads(text)["answer"], int), text
        assert [ids for ids, _ in spans(ep)] == [chat.choices[0].token_ids, resp.token_ids]


def _check_responses(eps):
    for ep in eps:
        assert ep.env.error is None, ep.env.error
        assert ep.env.info["segments"] == 1 and ep.env.info["generate_calls"] == 2
        first, second = ep.row["got"]
        assert [ids for ids, _ in spans(ep)] == [first.token_ids, second.token_ids]


def _check(eps):
    for ep in eps:
        assert ep.env.error is None, ep.env.error
        assert ep.env.info["segments"] == 1 and ep.env.info["generate_calls"] == 2
        first, second_ids, second_lps = ep.row["got"]
        got = spans(ep)
        assert got[0][0] == first.choices[0].token_ids
        assert got[0][1] == pytest.approx([t.logprob for t in first.choices[0].logprobs.content])
        assert ep.completion_ids[-len(second_ids):] == second_ids and ep.loss_mask[-len(second_ids):] == [1] * len(second_ids)
        if second_lps:  # (a reply that is only tool calls streams no content chunk)
            assert ep.logprobs[-len(second_ids):] == pytest.approx(second_lps)


def _run(engine, tok, max_in_flight, fn=agent):
    return agent_rollout(engine, prompts(tok, 3), fn, SamplingParams(max_new_tokens=24), tok,
                         LoopSettings(200, max_context=512, max_in_flight=max_in_flight), group_size=1, step=0,
                         generator=torch.Generator().manual_seed(0))


def test_the_gateway_in_front_of_vllm_in_process(vllm_full_engine):
    tok = load_tokenizer(MODEL)
    _check(_run(vllm_full_engine, tok, 1))
    _check_responses(_run(vllm_full_engine, tok, 1, responses_agent))
    _check_structured(_run(vllm_full_engine, tok, 1, structured_agent))


def test_the_gateway_in_front_of_a_remote_server(serve_pool):
    from plainrl.rollout.engines.remote import RemoteEngine

    tok = load_tokenizer(MODEL)
    [(_, url)] = serve_pool.get()
    engine = RemoteEngine([url], tok, sync="full", weights_via="http", max_model_len=512)
    try:
        _check(_run(engine, tok, 3))
        _check_responses(_run(engine, tok, 3, responses_agent))
        _check_structured(_run(engine, tok, 3, structured_agent))
    finally:
        engine.close()
