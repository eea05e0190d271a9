"""An agent written for Anthropic's Messages API, trained unchanged (examples/agent_anthropic.yaml).

`solve` is ordinary `anthropic` SDK code on `client.messages.create`: a tool loop with one
tool that sends the assistant's content blocks back and answers each `tool_use` block with
a `tool_result`, as it would against Anthropic's API. plainrl's part is `agent`: the client
comes from `llm.anthropic_client()`, the reward goes back as the return value. The gateway
parses the model's tool calls into `tool_use` blocks, renders the `tool_result` blocks with
the chat template and records every sampled token exactly; see docs/agents.md,
"Three dialects".
"""

from __future__ import annotations

import anthropic

from plainrl.rewards.builtins import correctness
from plainrl.rollout.envs import CalculatorError, format_number, safe_eval

TOOLS = [{
    "name": "calculate",
    "description": "Evaluate an arithmetic expression and return the result.",
    "input_schema": {"type": "object",
                     "properties": {"expression": {"type": "string", "description": "for example 12 * 34"}},
                     "required": ["expression"]},
}]
MAX_CALLS = 3


def calculate(arguments: dict) -> str:
    try:
        return format_number(safe_eval(str(arguments["expression"])))
    except (ValueError, KeyError, TypeError, CalculatorError) as e:
        return f"Error: {e}"


async def solve(client: anthropic.AsyncAnthropic, system: str | None, question: str, state: dict) -> str:
    """The agent's own loop: ask, run the tool uses, send their results; the last text."""
    messages: list = [{"role": "user", "content": question}]
    for _ in range(MAX_CALLS + 1):
        kw = {"system": system} if system else {}
        message = await client.messages.create(model="policy", max_tokens=96, messages=messages, tools=TOOLS, **kw)
        messages.append({"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in message.content]})
        state["text"] = "".join(b.text for b in message.content if b.type == "text")
        uses = [b for b in message.content if b.type == "tool_use"]
        if message.stop_reason != "tool_use" or state["calls"] == MAX_CALLS:
            break
        results = []
        for use in uses:
            result = calculate(use.input)
            state["calls"] += 1
            state["errors"] += result.startswith("Error")
            results.append({"type": "tool_result", "tool_use_id": use.id, "content": result})
        messages.append({"role": "user", "content": results})
    return state["text"]


async def agent(llm, row):
    state = {"calls": 0, "errors": 0, "text": ""}
    messages = llm.prompt_messages
    system = next((m["content"] for m in messages if m["role"] == "system"), None)
    try:
        await solve(llm.anthropic_client(), system, messages[-1]["content"], state)
    except anthropic.BadRequestError as e:  # out of the episode's token budget: score what was written
        if "no room for another model call" not in str(e):
            raise
    return {"reward": correctness(state["text"], answer=row["answer"]), "tool_calls": state["calls"],
            "tool_errors": state["errors"]}
