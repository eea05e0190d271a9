"""A `rollout.agent` for examples/agent_calculator.yaml: the model may ask a calculator
for help by writing <calc>expression</calc>; the agent answers with a tool message and
lets the model go on, then scores the final answer itself.

plainrl records every token the model sampled and masks out what the agent added (the
tool messages, rendered by the chat template); see docs/agents.md.
"""

from __future__ import annotations

import asyncio
import re

from plainrl.rewards.builtins import correctness
from plainrl.rollout import ContextLengthError
from plainrl.rollout.envs import CalculatorError, format_number, safe_eval

CALL = re.compile(r"<calc>(.*?)</calc>", re.S)
MAX_CALLS = 3


async def calculate(expression: str) -> str:
    """The tool. A real one may be slow (a web search, a sandbox): awaiting it lets the
    other episodes of the step go on meanwhile; blocking code goes through a thread."""
    try:
        return format_number(await asyncio.to_thread(safe_eval, expression.strip()))
    except CalculatorError as e:
        return f"Error: {e}"


async def agent(llm, row):
    """One episode: chat until the model answers without calling the calculator."""
    messages = llm.prompt_messages
    calls = errors = 0
    reply = None
    try:
        for _ in range(MAX_CALLS + 1):
            reply = await llm.chat(messages, stop=["</calc>"])
            messages.append(reply.message)
            call = CALL.search(reply.text) if reply.finish_reason == "stop" else None
            if call is None or calls == MAX_CALLS:
                break
            result = await calculate(call.group(1))
            calls += 1
            errors += result.startswith("Error")
            messages.append({"role": "tool", "content": result})
    except ContextLengthError:  # out of budget: score what was written
        pass
    answer = reply.text if reply is not None else ""
    return {"reward": correctness(answer, answer=row["answer"]), "tool_calls": calls, "tool_errors": errors}
