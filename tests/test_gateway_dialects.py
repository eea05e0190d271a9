"""The gateway's other dialects with their real SDKs: OpenAI's Responses API
(``client.responses.create``, streamed and not, ``previous_response_id``) and Anthropic's
Messages (``client.messages.create`` / ``.stream``); the trained spans equal what each call
sampled, the same conversation trains on the same ids in every dialect, and each dialect's
errors come in its own schema."""

from __future__ import annotations

import json

import anthropic
import httpx
import openai
import pytest

from plainrl.rollout.gateway import Gateway
from test_gateway import ANSWER, CALC, ScriptedEngine, rollout, spans

QUESTION = "What is 6*7? (0)"
RESPONSES_TOOL = {"type": "function", "name": "calc", "description": CALC["function"]["description"],
                  "parameters": CALC["function"]["parameters"]}
ANTHROPIC_TOOL = {"name": "calc", "description": CALC["function"]["description"],
                  "input_schema": CALC["function"]["parameters"]}


def run(tokenizer, agent, n=1):
    engine, gateway = ScriptedEngine(tokenizer), Gateway("policy", 2048)
    try:
        eps = rollout(engine, tokenizer, agent, n, gateway=gateway)
    finally:
        gateway.close()
    return engine, eps


def sampled(engine) -> list[list[int]]:
    return [list(gen.token_ids) for _, gen, _ in engine.calls]


# ------------------------------------------------------------------ the Responses API


async def responses_agent(llm, row):
    """A tool loop on ``client.responses.create``: the output items sent back as input."""
    client = llm.openai_client()
    items = [{"role": "user", "content": QUESTION}]
    first = await client.responses.create(model="policy", input=items, tools=[RESPONSES_TOOL], max_output_tokens=48,
                                          extra_body={"return_token_ids": True})
    [call] = [o for o in first.output if o.type == "function_call"]
    items += [o.model_dump(exclude_none=True) for o in first.output]
    items.append({"type": "function_call_output", "call_id": call.call_id,
                  "output": str(eval(json.loads(call.arguments)["expression"]))})  # noqa: S307 (the test's input)
    second = await client.responses.create(model="policy", input=items, tools=[RESPONSES_TOOL],
                                           extra_body={"return_token_ids": True})
    llm.row["seen"] = (first, second)
    return 1.0 if "42" in second.output_text else 0.0


def test_responses_create_with_a_function_tool_is_recorded_token_exactly(tokenizer):
    engine, [ep] = run(tokenizer, responses_agent)
    assert ep.env.error is None and ep.env.reward == 1.0
    first, second = ep.row["seen"]
    assert first.status == "completed" and [o.type for o in first.output] == ["function_call"]
    call = first.output[0]
    assert call.name == "calc" and json.loads(call.arguments) == {"expression": "6*7"}
    assert second.output_text == ANSWER and [o.type for o in second.output] == ["message"]
    assert second.usage.output_tokens == len(second.token_ids)
    # one segment: the output items sent back continued it; the trained spans are the responses' ids
    assert ep.env.info["segments"] == 1
    assert [ids for ids, _ in spans(ep)] == [first.token_ids, second.token_ids] == sampled(engine)
    assert [c[0] for c in engine.calls] == [first.prompt_token_ids, second.prompt_token_ids]


async def responses_stream_agent(llm, row):
    """Streamed, with ``instructions`` and ``previous_response_id`` (only the tool's output sent)."""
    client = llm.openai_client()
    events = []
    stream = await client.responses.create(model="policy", input=QUESTION, instructions="Use the tool.",
                                           tools=[RESPONSES_TOOL], stream=True, store=False,
                                           reasoning={"effort": "low"})
    async for ev in stream:
        events.append(ev.type)
    first = ev.response
    call = first.output[0]
    stream = await client.responses.create(model="policy", previous_response_id=first.id, instructions="Use the tool.",
                                           input=[{"type": "function_call_output", "call_id": call.call_id,
                                                   "output": "42"}], tools=[RESPONSES_TOOL], stream=True)
    deltas = []
    async for ev in stream:
        if ev.type == "response.output_text.delta":
            deltas.append(ev.delta)
    second = ev.response  # the last event's: response.completed
    llm.row["seen"] = (events, first, second, deltas)
    return 1.0 if "42" in second.output_text else 0.0


def test_responses_stream_and_previous_response_id_continue_the_segment(tokenizer):
    engine, [ep] = run(tokenizer, responses_stream_agent)
    assert ep.env.error is None and ep.env.reward == 1.0
    events, first, second, deltas = ep.row["seen"]
    assert events == ["response.created", "response.in_progress", "response.output_item.added",
                      "response.function_call_arguments.delta", "response.function_call_arguments.done",
                      "response.output_item.done", "response.completed"]
    assert first.output[0].type == "function_call" and first.output[0].name == "calc"
    assert second.output_text == ANSWER and "".join(deltas) == ANSWER
    assert ep.env.info["segments"] == 1 and [ids for ids, _ in spans(ep)] == sampled(engine)


# ------------------------------------------------------------------ Anthropic Messages


async def anthropic_agent(llm, row):
    """A tool loop on ``client.messages.create``, then one streamed call."""
    client = llm.anthropic_client()
    messages = [{"role": "user", "content": QUESTION}]
    first = await client.messages.create(model="policy", max_tokens=48, system="Use the tool.", messages=messages,
                                         tools=[ANTHROPIC_TOOL])
    [use] = [b for b in first.content if b.type == "tool_use"]
    messages += [{"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in first.content]},
                 {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id,
                                               "content": str(eval(use.input["expression"]))}]}]  # noqa: S307
    async with client.messages.stream(model="policy", max_tokens=64, system="Use the tool.", messages=messages,
                                      tools=[ANTHROPIC_TOOL]) as stream:
        second = await stream.get_final_message()
    llm.row["seen"] = (first, second)
    return 1.0 if "42" in second.content[0].text else 0.0


def test_anthropic_messages_with_tool_use_streamed_and_not_are_recorded_token_exactly(tokenizer):
    engine, [ep] = run(tokenizer, anthropic_agent)
    assert ep.env.error is None and ep.env.reward == 1.0
    first, second = ep.row["seen"]
    assert first.stop_reason == "tool_use" and [b.type for b in first.content] == ["tool_use"]
    assert first.content[0].name == "calc" and first.content[0].input == {"expression": "6*7"}
    assert first.usage.output_tokens == len(engine.calls[0][1].token_ids)
    assert second.stop_reason == "end_turn" and second.content[0].text == ANSWER
    assert ep.env.info["segments"] == 1 and [ids for ids, _ in spans(ep)] == sampled(engine)
    assert engine.calls[0][2].max_new_tokens == 48


# ------------------------------------------------------------------ one conversation, three dialects


async def chat_agent(llm, row):
    client = llm.openai_client()
    messages = [{"role": "system", "content": "Use the tool."}, {"role": "user", "content": QUESTION}]
    first = await client.chat.completions.create(model="policy", messages=messages, tools=[CALC], max_tokens=48)
    call = first.choices[0].message.tool_calls[0]
    messages += [first.choices[0].message, {"role": "tool", "tool_call_id": call.id, "content": "42"}]
    await client.chat.completions.create(model="policy", messages=messages, tools=[CALC], max_tokens=64)
    return 1.0


async def responses_same_agent(llm, row):
    client = llm.openai_client()
    items = [{"role": "user", "content": QUESTION}]
    first = await client.responses.create(model="policy", instructions="Use the tool.", input=items,
                                          tools=[RESPONSES_TOOL], max_output_tokens=48)
    items += [o.model_dump(exclude_none=True) for o in first.output]
    items.append({"type": "function_call_output", "call_id": first.output[0].call_id, "output": "42"})
    await client.responses.create(model="policy", instructions="Use the tool.", input=items, tools=[RESPONSES_TOOL],
                                  max_output_tokens=64)
    return 1.0


async def anthropic_same_agent(llm, row):
    client = llm.anthropic_client()
    messages = [{"role": "user", "content": QUESTION}]
    first = await client.messages.create(model="policy", max_tokens=48, system="Use the tool.", messages=messages,
                                         tools=[ANTHROPIC_TOOL])
    messages += [{"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in first.content]},
                 {"role": "user", "content": [{"type": "tool_result", "tool_use_id": first.content[0].id,
                                               "content": "42"}]}]
    await client.messages.create(model="policy", max_tokens=64, system="Use the tool.", messages=messages,
                                 tools=[ANTHROPIC_TOOL])
    return 1.0


def test_the_same_conversation_trains_on_the_same_ids_in_every_dialect(tokenizer):
    got = []
    for agent in (chat_agent, responses_same_agent, anthropic_same_agent):
        engine, [ep] = run(tokenizer, agent)
        assert ep.env.error is None and ep.env.info["segments"] == 1, agent.__name__
        got.append((ep.prompt_ids, ep.completion_ids, ep.loss_mask, ep.logprobs))
        assert [ids for ids, _ in spans(ep)] == sampled(engine)
    assert got[0] == got[1] == got[2]


# ------------------------------------------------------------------ keys and errors, each in its schema


def test_every_route_asks_for_the_key_and_errors_come_in_each_dialects_schema(tokenizer):
    async def agent(llm, row):
        seen = {}
        base, root = llm.base_url, llm.base_url.removesuffix("/v1")
        wrong = openai.AsyncOpenAI(base_url=base, api_key="sk-wrong", max_retries=0)
        with pytest.raises(openai.AuthenticationError) as e:
            await wrong.responses.create(model="p", input="hi")
        seen["responses_401"] = e.value.body
        with pytest.raises(openai.AuthenticationError):
            await wrong.models.list()
        with pytest.raises(openai.BadRequestError) as e:
            await llm.openai_client().responses.create(model="p", input=5)
        seen["responses_400"] = e.value.body
        with pytest.raises(openai.BadRequestError) as e:
            await llm.openai_client().responses.create(model="p", input="hi", previous_response_id="resp_nope")
        seen["responses_missing"] = e.value.body
        bad = anthropic.AsyncAnthropic(base_url=root, api_key="sk-wrong", max_retries=0)
        with pytest.raises(anthropic.AuthenticationError) as e:
            await bad.messages.create(model="p", max_tokens=8, messages=[{"role": "user", "content": "hi"}])
        seen["messages_401"] = e.value.body
        with pytest.raises(anthropic.BadRequestError) as e:
            await llm.anthropic_client().messages.create(model="p", max_tokens=0,
                                                         messages=[{"role": "user", "content": "hi"}])
        seen["messages_400"] = e.value.body
        async with httpx.AsyncClient(timeout=30) as http:  # the key as a bearer token works too
            r = await http.get(f"{base}/models", headers={"Authorization": f"Bearer {llm.api_key}"})
            seen["models"] = r.json()
            r = await http.post(f"{root}/v1/messages", headers={"Authorization": f"Bearer {llm.api_key}"},
                                json={"model": "p", "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}]})
            seen["bearer"] = r.status_code
        llm.row["seen"] = seen
        return 1.0

    _, [ep] = run(tokenizer, agent)
    assert ep.env.error is None, ep.env.error
    seen = ep.row["seen"]
    assert seen["responses_401"]["code"] == "invalid_api_key"
    assert seen["responses_400"]["param"] == "input"
    assert seen["responses_missing"]["param"] == "previous_response_id"
    assert seen["responses_missing"]["code"] == "previous_response_not_found"
    assert seen["messages_401"] == {"type": "error", "error": {"type": "authentication_error", "message": (
        "unknown API key: use the episode's own (llm.api_key, llm.anthropic_client(), llm.anthropic_env())")}}
    assert seen["messages_400"]["type"] == "error" and seen["messages_400"]["error"]["type"] == "invalid_request_error"
    assert "max_tokens" in seen["messages_400"]["error"]["message"]
    assert seen["models"]["data"][0]["id"] == "policy" and seen["bearer"] == 200


def test_a_plain_function_agent_uses_a_blocking_anthropic_client(tokenizer):
    def agent(llm, row):  # runs in a thread of its own: the blocking SDK client is fine here
        m = llm.anthropic_client().messages.create(model="policy", max_tokens=48, tools=[ANTHROPIC_TOOL],
                                                   messages=[{"role": "user", "content": QUESTION}])
        return 1.0 if m.stop_reason == "tool_use" else 0.0

    engine, [ep] = run(tokenizer, agent)
    assert ep.env.error is None and ep.env.reward == 1.0
    assert [ids for ids, _ in spans(ep)] == sampled(engine)


class StoppingEngine(ScriptedEngine):
    """The scripted engine, honouring stop strings as an engine does: the sample ends with the
    first stop string (kept), finish reason ``stop``."""

    def generate(self, prompts, params, *, seeds=None):
        out = super().generate(prompts, params, seeds=seeds)
        for k, gen in enumerate(out):
            text = self.tok.decode(gen.token_ids, skip_special_tokens=True)
            hits = [(text.index(s) + len(s), s) for s in params.stop if s in text]
            if hits:
                ids = self.tok(text[: min(hits)[0]], add_special_tokens=False)["input_ids"]
                out[k] = type(gen)(ids, gen.logprobs[: len(ids)], "stop")
                self.calls[-len(out) + k] = (self.calls[-len(out) + k][0], out[k], params)
        return out


def test_anthropic_stop_sequences_end_the_turn_and_the_reply_sent_back_continues_it(tokenizer):
    async def agent(llm, row):
        client = llm.anthropic_client()
        messages = [{"role": "user", "content": QUESTION}]
        first = await client.messages.create(model="policy", max_tokens=48, messages=messages,
                                             stop_sequences=['"calc"'])
        messages += [{"role": "assistant", "content": first.content[0].text},
                     {"role": "user", "content": "Go on."}]
        second = await client.messages.create(model="policy", max_tokens=48, messages=messages)
        llm.row["seen"] = (first, second)
        return 1.0

    engine = StoppingEngine(tokenizer)
    gateway = Gateway("policy", 2048)
    try:
        [ep] = rollout(engine, tokenizer, agent, gateway=gateway)
    finally:
        gateway.close()
    assert ep.env.error is None, ep.env.error
    first, second = ep.row["seen"]
    assert first.stop_reason == "stop_sequence" and first.stop_sequence == '"calc"'
    assert first.content[0].text == '<tool_call>\n{"name": '  # the sequence left out, as Anthropic does
    assert '"calc"' in tokenizer.decode(engine.calls[0][1].token_ids)  # ... but sampled and trained
    assert second.stop_reason == "end_turn"
    assert ep.env.info["segments"] == 1 and [ids for ids, _ in spans(ep)] == sampled(engine)
