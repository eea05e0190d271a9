"""A reasoning model's ``<think>`` text through the gateway: handed back as ``reasoning_content``
(Chat Completions, streamed too), a ``reasoning`` item (Responses, through the OpenAI Agents SDK) and a
``thinking`` block (the ``anthropic`` SDK), while the episode trains on every sampled token, the
think tokens included, in one segment whether or not the client sends its reasoning back. Tool
calls in a format named by ``rollout.tool_parser``, and malformed ones counted."""

from __future__ import annotations

import copy
import json

import pytest

from plainrl.rollout.gateway import Gateway
from test_gateway import ANSWER, CALC, TOOL_CALL, ScriptedEngine, rollout, spans

# a Qwen3-style ChatML template: tools in the system message, an assistant's reasoning_content written
# as <think> before its content, tool calls as hermes blocks, tool results as <tool_response> user turns
QWEN3_STYLE = (
    "{% if tools %}<|im_start|>system\n# Tools\n<tools>{% for t in tools %}\n{{ t | tojson }}{% endfor %}\n</tools>"
    "<|im_end|>\n{% endif %}"
    "{% for m in messages %}"
    "{% if m.role == 'assistant' %}<|im_start|>assistant\n"
    "{% if m.reasoning_content %}<think>\n{{ m.reasoning_content }}\n</think>\n\n{% endif %}{{ m.content or '' }}"
    "{% for c in m.tool_calls or [] %}\n<tool_call>\n{\"name\": \"{{ c.function.name }}\", \"arguments\": "
    "{{ c.function.arguments | tojson }}}\n</tool_call>{% endfor %}<|im_end|>\n"
    "{% elif m.role == 'tool' %}<|im_start|>user\n<tool_response>\n{{ m.content }}\n</tool_response><|im_end|>\n"
    "{% else %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
THOUGHT, THOUGHT2 = "I should use calc.", "It returned 42."


@pytest.fixture
def qwen3_tokenizer(tokenizer):
    tok = copy.deepcopy(tokenizer)
    tok.chat_template = QWEN3_STYLE
    return tok


class ThinkingEngine(ScriptedEngine):
    """Thinks, then calls the tool; thinks, then answers."""

    def reply(self, context: str) -> str:
        if "<tool_response>" in context:
            return f"<think>\n{THOUGHT2}\n</think>\n\n{ANSWER}"
        return f"<think>\n{THOUGHT}\n</think>\n\n{TOOL_CALL}"


def trained_as_sampled(ep, engine, tok) -> None:
    """One segment, and its trained spans are exactly what the engine sampled, think tokens included."""
    assert ep.env.info["segments"] == 1
    got = [ids for ids, _ in spans(ep)]
    assert got == [list(g.token_ids) for _, g, _ in engine.calls]
    assert all("<think>" in tok.decode(ids) for ids in got)


@pytest.mark.parametrize("send_back", [True, False])
def test_chat_completions_hand_back_reasoning_content_and_train_the_think_tokens(qwen3_tokenizer, send_back):
    async def agent(llm, row):
        client = llm.openai_client()
        messages = [{"role": "user", "content": "What is 6*7?"}]
        first = await client.chat.completions.create(model="m", messages=messages, tools=[CALC], max_tokens=64)
        msg = first.choices[0].message
        call = msg.tool_calls[0]
        back = msg.model_dump(exclude_none=True)
        if not send_back:  # many clients drop the reasoning
            back.pop("reasoning_content")
        messages += [back, {"role": "tool", "tool_call_id": call.id, "content": "42"}]
        stream = await client.chat.completions.create(model="m", messages=messages, tools=[CALC], stream=True)
        chunks = [c async for c in stream]
        llm.row["seen"] = (msg, [c.choices[0].delta for c in chunks if c.choices])
        return 1.0

    engine = ThinkingEngine(qwen3_tokenizer)
    [ep] = rollout(engine, qwen3_tokenizer, agent)
    assert ep.env.error is None, ep.env.error
    msg, deltas = ep.row["seen"]
    assert msg.reasoning_content == THOUGHT and msg.content is None
    assert json.loads(msg.tool_calls[0].function.arguments) == {"expression": "6*7"}
    assert "".join(getattr(d, "reasoning_content", None) or "" for d in deltas) == THOUGHT2
    assert "".join(d.content or "" for d in deltas) == ANSWER
    trained_as_sampled(ep, engine, qwen3_tokenizer)


def test_the_agents_sdk_gets_reasoning_items_and_sends_them_back(qwen3_tokenizer):
    pytest.importorskip("agents")

    async def agent(llm, row):
        from agents import Agent, OpenAIResponsesModel, Runner, function_tool, set_tracing_disabled

        set_tracing_disabled(True)

        @function_tool
        def calc(expression: str) -> str:
            """Evaluate arithmetic."""
            return str(eval(expression))  # noqa: S307 (the scripted model's own call)

        bot = Agent(name="calculator", instructions="Use the calc tool.", tools=[calc],
                    model=OpenAIResponsesModel(model="policy", openai_client=llm.openai_client()))
        result = await Runner.run(bot, "What is 6*7?", max_turns=4)
        llm.row["reasoning"] = [i.raw_item.content[0].text for i in result.new_items if i.type == "reasoning_item"]
        return 1.0 if "42" in result.final_output else 0.0

    engine = ThinkingEngine(qwen3_tokenizer)
    [ep] = rollout(engine, qwen3_tokenizer, agent)
    assert ep.env.error is None and ep.env.reward == 1.0
    assert ep.row["reasoning"] == [THOUGHT, THOUGHT2]
    trained_as_sampled(ep, engine, qwen3_tokenizer)


def test_a_streamed_response_carries_its_reasoning_item(qwen3_tokenizer):
    async def agent(llm, row):
        stream = await llm.openai_client().responses.create(model="policy", input="What is 6*7?", stream=True,
                                                            tools=[{"type": "function", **CALC["function"]}])
        llm.row["events"] = [e async for e in stream]
        return 1.0

    [ep] = rollout(ThinkingEngine(qwen3_tokenizer), qwen3_tokenizer, agent)
    assert ep.env.error is None, ep.env.error
    events = ep.row["events"]
    assert "".join(e.delta for e in events if e.type == "response.reasoning_text.delta") == THOUGHT
    done = events[-1].response
    assert [o.type for o in done.output] == ["reasoning", "function_call"]
    assert done.output[0].content[0].text == THOUGHT


def test_anthropic_messages_hand_back_thinking_blocks(qwen3_tokenizer):
    tool = {"name": "calc", "description": "Evaluate arithmetic.", "input_schema": CALC["function"]["parameters"]}

    async def agent(llm, row):
        client = llm.anthropic_client()
        messages = [{"role": "user", "content": "What is 6*7?"}]
        first = await client.messages.create(model="policy", max_tokens=64, messages=messages, tools=[tool])
        [use] = [b for b in first.content if b.type == "tool_use"]
        messages += [{"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in first.content]},
                     {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "42"}]}]
        async with client.messages.stream(model="policy", max_tokens=64, messages=messages, tools=[tool]) as s:
            second = await s.get_final_message()
        llm.row["seen"] = (first, second)
        return 1.0

    engine = ThinkingEngine(qwen3_tokenizer)
    [ep] = rollout(engine, qwen3_tokenizer, agent)
    assert ep.env.error is None, ep.env.error
    first, second = ep.row["seen"]
    assert [b.type for b in first.content] == ["thinking", "tool_use"] and first.content[0].thinking == THOUGHT
    assert [b.type for b in second.content] == ["thinking", "text"] and second.content[0].thinking == THOUGHT2
    assert second.content[1].text == ANSWER
    trained_as_sampled(ep, engine, qwen3_tokenizer)


class XMLEngine(ScriptedEngine):
    """Calls the tool in Qwen3-Coder's XML, then answers; or writes a call cut off mid-block."""

    broken = False

    def reply(self, context: str) -> str:
        if self.broken:
            return "<tool_call>\n<function=calc>\n<parameter=expression>\n6*7"
        if "<tool_response>" in context or "<|im_start|>tool" in context:
            return ANSWER
        return "<tool_call>\n<function=calc>\n<parameter=expression>\n6*7\n</parameter>\n</function>\n</tool_call>"


@pytest.mark.parametrize("broken", [False, True])
def test_a_named_tool_parser_reads_its_format_and_an_unparsed_call_is_counted(tokenizer, broken):
    async def agent(llm, row):
        client = llm.openai_client()
        r = await client.chat.completions.create(model="m", messages=[{"role": "user", "content": "6*7?"}],
                                                 tools=[CALC], max_tokens=64)
        llm.row["msg"] = r.choices[0].message
        return 1.0

    engine, gateway = XMLEngine(tokenizer), Gateway("policy", 2048)
    engine.broken = broken
    gateway.episodes.tool_parser = "qwen3_coder"  # rollout.tool_parser
    try:
        [ep] = rollout(engine, tokenizer, agent, gateway=gateway)
        metrics = gateway.take_metrics()
    finally:
        gateway.close()
    msg = ep.row["msg"]
    if broken:
        assert msg.tool_calls is None and msg.content.startswith("<tool_call>")
        assert metrics["gateway/unparsed_tool_calls"] == 1.0
    else:
        assert json.loads(msg.tool_calls[0].function.arguments) == {"expression": "6*7"}
        assert metrics["gateway/unparsed_tool_calls"] == 0.0
