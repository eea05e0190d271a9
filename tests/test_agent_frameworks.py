"""Agent frameworks no one here wrote, unchanged, against the gateway: the OpenAI Agents SDK
with its default model (``OpenAIResponsesModel``, the Responses API) and a function tool;
pydantic-ai through its Chat Completions and Responses models."""

from __future__ import annotations

import pytest

from test_gateway import ScriptedEngine, rollout, spans

agents = pytest.importorskip("agents")  # openai-agents (the dev extra)


async def agents_sdk_agent(llm, row):
    from agents import Agent, OpenAIResponsesModel, Runner, function_tool, set_tracing_disabled

    set_tracing_disabled(True)  # the SDK's traces go to OpenAI's servers; none are reachable here

    @function_tool
    def calc(expression: str) -> str:
        """Evaluate arithmetic."""
        return str(eval(expression))  # noqa: S307 (the scripted model's own call)

    agent = Agent(name="calculator", instructions="Use the calc tool.", tools=[calc],
                  model=OpenAIResponsesModel(model="policy", openai_client=llm.openai_client()))
    result = await Runner.run(agent, f"What is 6*7? ({row['i']})", max_turns=4)
    return 1.0 if "42" in result.final_output else 0.0


def test_openai_agents_sdk_with_its_responses_model_trains(tokenizer):
    engine = ScriptedEngine(tokenizer)
    eps = rollout(engine, tokenizer, agents_sdk_agent, 2)
    assert [e.env.error for e in eps] == [None, None]
    assert [e.env.reward for e in eps] == [1.0, 1.0]
    # the tool call, its result and the answer: one segment, both samples trained as sampled
    assert [e.env.info["segments"] for e in eps] == [1, 1]
    assert [e.env.info["generate_calls"] for e in eps] == [2, 2]
    assert sorted(ids for e in eps for ids, _ in spans(e)) == sorted(list(g.token_ids) for _, g, _ in engine.calls)


@pytest.mark.parametrize("dialect", ["chat", "responses"])
def test_pydantic_ai_trains_through_chat_completions_and_responses(tokenizer, dialect):
    pytest.importorskip("pydantic_ai")

    async def agent(llm, row):
        from pydantic_ai import Agent
        from pydantic_ai.models.openai import OpenAIChatModel, OpenAIResponsesModel
        from pydantic_ai.providers.openai import OpenAIProvider

        model_cls = OpenAIChatModel if dialect == "chat" else OpenAIResponsesModel
        model = model_cls("policy", provider=OpenAIProvider(openai_client=llm.openai_client()))
        bot = Agent(model, instructions="Use the calc tool.")

        @bot.tool_plain
        def calc(expression: str) -> str:
            """Evaluate arithmetic."""
            return str(eval(expression))  # noqa: S307 (the scripted model's own call)

        result = await bot.run(f"What is 6*7? ({row['i']})")
        return 1.0 if "42" in result.output else 0.0

    engine = ScriptedEngine(tokenizer)
    [ep] = rollout(engine, tokenizer, agent, 1)
    assert ep.env.error is None and ep.env.reward == 1.0
    assert ep.env.info["segments"] == 1 and ep.env.info["generate_calls"] == 2
    assert [ids for ids, _ in spans(ep)] == [list(g.token_ids) for _, g, _ in engine.calls]
