"""Structured outputs through the gateway, honoured or refused, never ignored: the OpenAI Agents
SDK's ``output_type`` (Responses ``text.format``) and LangChain's ``with_structured_output`` (Chat
``response_format``), unmodified, against an engine that constrains decoding (the schema reaches
its sampling settings, as vLLM's ``structured_outputs``) and one that cannot (a 400 naming the
option, as on the embedded engine)."""

from __future__ import annotations

import json

import openai
import pytest
from pydantic import BaseModel

from plainrl.rollout.engines.hf import HFEngine
from plainrl.rollout.engines.partial import PartialEngine
from plainrl.rollout.engines.remote import RemoteEngine
from plainrl.rollout.engines.requests import sampling_kwargs
from plainrl.types import Generation, SamplingParams
from test_gateway import ScriptedEngine, rollout, spans

pytest.importorskip("agents")  # openai-agents (the dev extra)

VERDICT = '{"answer": 42, "confident": true}'


class Verdict(BaseModel):
    answer: int
    confident: bool


class ConstrainingEngine(ScriptedEngine):
    """A scripted engine that says it constrains decoding (as vLLM's engines do): it answers JSON."""

    structured_outputs = True

    def reply(self, context: str) -> str:
        return VERDICT


async def refused(llm, error) -> float:
    """Keep the refusal, and answer in free text instead (an episode must call the model)."""
    llm.row["error"] = error
    await llm.chat(llm.prompt_messages, max_new_tokens=4)
    return 0.0


async def agents_sdk_agent(llm, row):
    from agents import Agent, OpenAIResponsesModel, Runner, set_tracing_disabled

    set_tracing_disabled(True)
    agent = Agent(name="judge", instructions="Answer as JSON.", output_type=Verdict,
                  model=OpenAIResponsesModel(model="policy", openai_client=llm.openai_client()))
    try:
        result = await Runner.run(agent, "What is 6*7?", max_turns=2)
    except openai.BadRequestError as e:
        return await refused(llm, e)
    llm.row["out"] = result.final_output
    return 1.0


async def langchain_agent(llm, row):
    from langchain_openai import ChatOpenAI

    model = ChatOpenAI(model="policy", base_url=llm.base_url, api_key=llm.api_key, max_retries=0, max_tokens=48)
    try:
        llm.row["out"] = await model.with_structured_output(Verdict).ainvoke("What is 6*7?")
    except openai.BadRequestError as e:
        return await refused(llm, e)
    return 1.0


@pytest.mark.parametrize("agent, param", [(agents_sdk_agent, "text.format"), (langchain_agent, "response_format")])
def test_a_schema_reaches_an_engine_that_constrains_decoding(tokenizer, agent, param):
    engine = ConstrainingEngine(tokenizer)
    [ep] = rollout(engine, tokenizer, agent)
    assert ep.env.error is None and ep.row.get("error") is None, ep.row.get("error")
    assert ep.row["out"] == Verdict(answer=42, confident=True)
    [(_, gen, params)] = engine.calls
    spec = json.loads(params.structured_outputs)
    assert set(spec) == {"json"} and spec["json"]["properties"].keys() == {"answer", "confident"}
    assert [ids for ids, _ in spans(ep)] == [list(gen.token_ids)]  # trained as sampled


@pytest.mark.parametrize("agent, param", [(agents_sdk_agent, "text.format"), (langchain_agent, "response_format")])
def test_an_engine_without_a_grammar_refuses_a_schema_naming_the_option(tokenizer, agent, param):
    engine = ScriptedEngine(tokenizer)  # as the embedded engine: no structured_outputs
    [ep] = rollout(engine, tokenizer, agent)
    err = ep.row["error"]
    assert err.status_code == 400 and err.body["param"] == param
    assert err.body["message"].startswith(f"{param}: structured outputs need an engine that constrains decoding")
    # nothing sampled for the refused request: the one call is the agent's free-text fallback
    assert [c[2].structured_outputs for c in engine.calls] == [None]


def test_anthropic_output_format_is_honoured_or_refused(tokenizer):
    import anthropic

    async def agent(llm, row):
        fmt = {"type": "json_schema", "schema": Verdict.model_json_schema()}
        try:
            m = await llm.anthropic_client().messages.create(
                model="policy", max_tokens=48, messages=[{"role": "user", "content": "6*7?"}],
                extra_body={"output_format": fmt})
        except anthropic.BadRequestError as e:
            return await refused(llm, e)
        llm.row["out"] = Verdict.model_validate_json(m.content[0].text)
        return 1.0

    constraining, plain = ConstrainingEngine(tokenizer), ScriptedEngine(tokenizer)
    [ok], [no] = rollout(constraining, tokenizer, agent), rollout(plain, tokenizer, agent)
    assert ok.row["out"] == Verdict(answer=42, confident=True)
    assert set(json.loads(constraining.calls[0][2].structured_outputs)) == {"json"}
    assert no.row["error"].status_code == 400 and "output_format: structured outputs need" in str(no.row["error"])


def test_chat_json_object_and_vllm_extension_and_conflicts(tokenizer):
    async def agent(llm, row):
        client = llm.openai_client()
        msgs = [{"role": "user", "content": "hi"}]
        await client.chat.completions.create(model="m", messages=msgs, response_format={"type": "json_object"})
        await client.chat.completions.create(model="m", messages=msgs, response_format={"type": "text"})
        await client.chat.completions.create(model="m", messages=msgs,
                                             extra_body={"structured_outputs": {"regex": "[0-9]+"}})
        errors = []
        for kw in ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
                   {"response_format": {"type": "yaml"}},
                   {"response_format": {"type": "json_object"}, "tool_choice": "required",
                    "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]}):
            with pytest.raises(openai.BadRequestError) as e:
                await client.chat.completions.create(model="m", messages=msgs, **kw)
            errors.append(e.value.body["param"])
        llm.row["errors"] = errors
        return 1.0

    engine = ConstrainingEngine(tokenizer)
    [ep] = rollout(engine, tokenizer, agent)
    assert ep.env.error is None, ep.env.error
    assert [c[2].structured_outputs for c in engine.calls] == ['{"json_object": true}', None, '{"regex": "[0-9]+"}']
    assert ep.row["errors"] == ["response_format.json_schema.schema", "response_format", "tool_choice"]


def test_vllm_engines_take_the_constraint_the_embedded_one_does_not():
    params = SamplingParams(structured_outputs='{"json": {"type": "object"}}')
    # the JSON field of vLLM's completions API (CompletionRequest.structured_outputs)
    assert sampling_kwargs(params, n=1, seed=None)["structured_outputs"] == {"json": {"type": "object"}}
    assert "structured_outputs" not in sampling_kwargs(SamplingParams(), n=1, seed=None)
    assert RemoteEngine.structured_outputs and not getattr(HFEngine, "structured_outputs", False)


def test_partial_rollouts_sample_a_structured_request_whole(tokenizer):
    class Inner:
        def __init__(self):
            self.asked = []

        def generate(self, prompts, params, *, seeds=None):
            self.asked.append(params.max_new_tokens)
            return [Generation([5] * params.max_new_tokens, [-0.1] * params.max_new_tokens, "length") for _ in prompts]

    inner = Inner()
    engine = PartialEngine(inner, tokenizer, chunk=4, by="chunks")
    [free] = engine.generate([[1, 2]], SamplingParams(max_new_tokens=10))
    [whole] = engine.generate([[1, 2]], SamplingParams(max_new_tokens=10, structured_outputs='{"json_object": true}'))
    # free text in chunks of 4 (a push may land between them); the grammar's sample in one piece
    assert inner.asked == [4, 4, 2, 10]
    assert len(free.token_ids) == len(whole.token_ids) == 10 and whole.versions == [0] * 10
