"""An agent written for the OpenAI API, trained unchanged (examples/agent_openai.yaml).

`solve` is ordinary `openai` SDK code: a chat loop with one function tool, as it would run
against any OpenAI-compatible server. plainrl's part is the two lines of `agent`: the client
comes from `llm.openai_client()` (an `openai.AsyncOpenAI` bound to this episode's key on the
run's loopback gateway), and the reward goes back as the return value. The gateway parses
the model's tool calls into OpenAI `tool_calls`, renders the tool results with the chat
template, and records every sampled token exactly; see docs/agents.md, "Agents written for
the OpenAI API".
"""

from __future__ import annotations

import json

import openai

from plainrl.rewards.builtins import correctness
from plainrl.rollout.envs import CalculatorError, format_number, safe_eval

TOOLS = [{
    "type": "function",
    "function": {
        "name": "calculate",
        "description": "Evaluate an arithmetic expression and return the result.",
        "parameters": {"type": "object",
                       "properties": {"expression": {"type": "string", "description": "for example 12 * 34"}},
                       "required": ["expression"]},
    },
}]
MAX_CALLS = 3


def calculate(arguments: str) -> str:
    try:
        return format_number(safe_eval(str(json.loads(arguments)["expression"])))
    except (ValueError, KeyError, TypeError, CalculatorError) as e:
        return f"Error: {e}"


async def solve(client: openai.AsyncOpenAI, messages: list, state: dict) -> str:
    """The agent's own loop: ask, run the tool calls, ask again; the last reply's text."""
    for _ in range(MAX_CALLS + 1):
        response = await client.chat.completions.create(model="policy", messages=messages, tools=TOOLS,
                                                        max_tokens=96)
        choice = response.choices[0]
        messages.append(choice.message)  # the SDK's message object, tool calls included
        state["text"] = choice.message.content or ""
        if choice.finish_reason != "tool_calls" or state["calls"] == MAX_CALLS:
            break
        for call in choice.message.tool_calls:
            result = calculate(call.function.arguments)
            state["calls"] += 1
            state["errors"] += result.startswith("Error")
            messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
    return state["text"]


async def agent(llm, row):
    state = {"calls": 0, "errors": 0, "text": ""}
    try:
        await solve(llm.openai_client(), llm.prompt_messages, state)
    except openai.BadRequestError as e:  # out of the episode's token budget: score what was written
        if e.code != "context_length_exceeded":
            raise
    return {"reward": correctness(state["text"], answer=row["answer"]), "tool_calls": state["calls"],
            "tool_errors": state["errors"]}
