"""Conformance details of the gateway's dialects, with the real ``openai`` and ``anthropic`` SDKs:
text parts joined with a newline (as vLLM does), a trailing assistant message continued (Anthropic's
prefill, ``continue_final_message``, a Responses message ``incomplete``), a chat template's refusal
as a 400 naming its message, ``max_tokens`` above ``rollout.max_new_tokens`` counted and printed
once, ``/v1/messages/count_tokens``, ``previous_response_not_found``, ``is_error`` kept, and
Anthropic's overload status."""

from __future__ import annotations

import copy
import json
import logging

import anthropic
import openai
import pytest

from plainrl.rollout.gateway import Gateway
from plainrl.rollout.gateway.anthropic_messages import error_response
from test_gateway_tools import ToolScript, call
from test_gateway import rollout

REPLY = " 42, as the tool said."


def run(tokenizer, agent, replies=(REPLY,)):
    engine, gateway = ToolScript(tokenizer, list(replies)), Gateway("policy", 4096)
    try:
        [ep] = rollout(engine, tokenizer, agent, 1, budget=3000, gateway=gateway)
        metrics = gateway.take_metrics()
    finally:
        gateway.close()
    return engine, ep, metrics


async def parts_agent(llm, row):
    oa, an = llm.openai_client(), llm.anthropic_client()
    await oa.chat.completions.create(model="p", messages=[{"role": "user", "content": [
        {"type": "text", "text": "chat one"}, {"type": "text", "text": "chat two"}]}])
    await oa.responses.create(model="p", input=[{"role": "user", "content": [
        {"type": "input_text", "text": "resp one"}, {"type": "input_text", "text": "resp two"}]}])
    await an.messages.create(model="p", max_tokens=8, messages=[{"role": "user", "content": [
        {"type": "text", "text": "anth one"}, {"type": "text", "text": "anth two"}]}])
    return 1.0


def test_text_parts_are_joined_with_a_newline_in_every_dialect(tokenizer):
    engine, ep, _ = run(tokenizer, parts_agent)
    assert ep.env.error is None
    for ctx, name in zip(engine.contexts, ("chat", "resp", "anth")):
        assert f"{name} one\n{name} two" in ctx


async def prefill_agent(llm, row):
    oa, an = llm.openai_client(), llm.anthropic_client()
    question = {"role": "user", "content": "What is 6*7?"}
    m = await an.messages.create(model="p", max_tokens=16, messages=[
        question, {"role": "assistant", "content": "The answer is"}])
    c = await oa.chat.completions.create(model="p", messages=[question, {"role": "assistant", "content": "It is"}],
                                         extra_body={"continue_final_message": True, "add_generation_prompt": False})
    r = await oa.responses.create(model="p", input=[question, {"type": "message", "role": "assistant", "status": "incomplete",
                                                               "content": [{"type": "output_text", "text": "So"}]}])
    llm.row["seen"] = (m.content[0].text, c.choices[0].message.content, r.output_text)
    return 1.0


def test_a_trailing_assistant_message_is_continued_not_closed(tokenizer):
    engine, ep, _ = run(tokenizer, prefill_agent)
    assert ep.env.error is None
    # the prefill follows the assistant header, unclosed, and the model goes on from it
    for ctx, prefill in zip(engine.contexts, ("The answer is", "It is", "So")):
        assert ctx.endswith(f"<|im_start|>assistant\n{prefill}")
    # each dialect hands back what follows the prefill
    assert ep.row["seen"] == (REPLY, REPLY, REPLY)


def test_a_chat_template_refusal_is_a_400_naming_its_message(tokenizer):
    strict = copy.deepcopy(tokenizer)
    strict.chat_template = ("{% for m in messages %}{% if loop.index0 > 0 and m['role'] == messages[loop.index0 - 1]"
                            "['role'] %}{{ raise_exception('Conversation roles must alternate user/assistant') }}"
                            "{% endif %}{% endfor %}" + tokenizer.chat_template)

    async def agent(llm, row):
        with pytest.raises(openai.BadRequestError) as e:
            await llm.openai_client().chat.completions.create(model="p", messages=[
                {"role": "user", "content": "a"}, {"role": "user", "content": "b"}])
        llm.row["error"] = e.value
        await llm.openai_client().chat.completions.create(model="p", messages=[{"role": "user", "content": "a"}])
        return 1.0

    _, ep, _ = run(strict, agent)
    err = ep.row["error"]
    assert err.code == "chat_template_error" and "Conversation roles must alternate user/assistant" in err.message


async def capped_agent(llm, row):
    an = llm.anthropic_client()
    for _ in range(2):  # Anthropic's max_tokens is required: harnesses send their model's whole budget
        await an.messages.create(model="p", max_tokens=4000, messages=[{"role": "user", "content": "hi"}])
    await an.messages.create(model="p", max_tokens=8, messages=[{"role": "user", "content": "hi"}])
    return 1.0


def test_max_tokens_above_the_runs_limit_is_counted_and_printed_once(tokenizer, caplog):
    with caplog.at_level(logging.WARNING, logger="plainrl.rollout.gateway"):
        _, ep, metrics = run(tokenizer, capped_agent)
    assert ep.env.error is None
    assert metrics["rollout/sampling_overrides"] == 2.0
    notes = [r.getMessage() for r in caplog.records if "rollout.max_new_tokens" in r.getMessage()]
    assert len(notes) == 1 and "4000" in notes[0] and "rollout.max_new_tokens=64" in notes[0]


async def count_agent(llm, row):
    an = llm.anthropic_client()
    tool = {"name": "calc", "description": "Evaluate.", "input_schema": {"type": "object", "properties": {}}}
    messages = [{"role": "user", "content": "What is 6*7?"}]
    counted = await an.messages.count_tokens(model="p", messages=messages, tools=[tool], system="Be brief.")
    made = await an.messages.create(model="p", max_tokens=8, messages=messages, tools=[tool], system="Be brief.")
    use = await an.messages.create(model="p", max_tokens=8, system="Be brief.", tools=[tool], messages=messages + [
        {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "calc", "input": {}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": "boom",
                                      "is_error": True}]}])
    llm.row["seen"] = (counted.input_tokens, made.usage.input_tokens, use)
    return 1.0


def test_count_tokens_counts_the_prompt_a_call_would_continue_and_is_error_is_kept(tokenizer):
    engine, ep, _ = run(tokenizer, count_agent, [REPLY, "Sorry."])
    assert ep.env.error is None
    counted, used, _ = ep.row["seen"]
    assert counted == used == len(tokenizer(engine.contexts[0], add_special_tokens=False)["input_ids"])
    assert len(engine.contexts) == 2  # counting sampled nothing
    [tool_message] = [m for m in ep.messages if m["role"] == "tool"]
    assert tool_message["is_error"] is True and tool_message["content"] == "boom"


async def missing_response_agent(llm, row):
    with pytest.raises(openai.BadRequestError) as e:
        await llm.openai_client().responses.create(model="p", input="hi", previous_response_id="resp_nope")
    llm.row["error"] = e.value
    await llm.openai_client().responses.create(model="p", input="hi")
    return 1.0


def test_a_previous_response_id_miss_is_previous_response_not_found(tokenizer):
    _, ep, _ = run(tokenizer, missing_response_agent)
    err = ep.row["error"]
    assert err.status_code == 400 and err.code == "previous_response_not_found"
    assert err.body["param"] == "previous_response_id"


def test_an_engine_that_cannot_answer_is_anthropics_overload():
    r = error_response(503, "the engine failed: RuntimeError: boom")
    assert r.status_code == 529 and json.loads(r.body)["error"]["type"] == "overloaded_error"
