"""An agent written for OpenAI's Responses API, trained unchanged (examples/agent_responses.yaml).

`solve` is ordinary `openai` SDK code on `client.responses.create`: a tool loop with one
function tool that sends the response's output items back as input, as it would against
OpenAI's API (the OpenAI Agents SDK's default model speaks the same dialect). plainrl's part
is `agent`: the client comes from `llm.openai_client()`, the reward goes back as the return
value. The gateway parses the model's tool calls into `function_call` items, renders the
`function_call_output` items with the chat template and records every sampled token exactly;
see docs/agents.md, "Three dialects".
"""

from __future__ import annotations

import json

import openai

from plainrl.rewards.builtins import correctness
from plainrl.rollout.envs import CalculatorError, format_number, safe_eval

TOOLS = [{
    "type": "function",
    "name": "calculate",
    "description": "Evaluate an arithmetic expression and return the result.",
    "parameters": {"type": "object",
                   "properties": {"expression": {"type": "string", "description": "for example 12 * 34"}},
                   "required": ["expression"]},
}]
MAX_CALLS = 3


def calculate(arguments: str) -> str:
    try:
        return format_number(safe_eval(str(json.loads(arguments)["expression"])))
    except (ValueError, KeyError, TypeError, CalculatorError) as e:
        return f"Error: {e}"


async def solve(client: openai.AsyncOpenAI, instructions: str | None, question: str, state: dict) -> str:
    """The agent's own loop: ask, run the function calls, send their outputs; the last text."""
    items: list = [{"role": "user", "content": question}]
    for _ in range(MAX_CALLS + 1):
        response = await client.responses.create(model="policy", instructions=instructions, input=items,
                                                 tools=TOOLS, max_output_tokens=96)
        items += [o.model_dump(exclude_none=True) for o in response.output]  # the output items, sent back
        state["text"] = response.output_text
        calls = [o for o in response.output if o.type == "function_call"]
        if not calls or state["calls"] == MAX_CALLS:
            break
        for call in calls:
            result = calculate(call.arguments)
            state["calls"] += 1
            state["errors"] += result.startswith("Error")
            items.append({"type": "function_call_output", "call_id": call.call_id, "output": result})
    return state["text"]


async def agent(llm, row):
    state = {"calls": 0, "errors": 0, "text": ""}
    messages = llm.prompt_messages
    system = next((m["content"] for m in messages if m["role"] == "system"), None)
    try:
        await solve(llm.openai_client(), system, messages[-1]["content"], state)
    except openai.BadRequestError as e:  # out of the episode's token budget: score what was written
        if e.code != "context_length_exceeded":
            raise
    return {"reward": correctness(state["text"], answer=row["answer"]), "tool_calls": state["calls"],
            "tool_errors": state["errors"]}
