"""One event loop for the run: clients that libraries cache across calls keep working from
step to step (LangChain's ChatOpenAI, unmodified), a blocked loop is reported naming the
episode, and a stop signal while it is blocked ends the run at once."""

from __future__ import annotations

import logging
import os
import signal
import threading
import time

import pytest

from plainrl.rollout.gateway import Gateway
from plainrl.rollout.run_loop import LoopBlocked, RunLoop, blocked_report
from plainrl.run.lifecycle import GracefulStop
from test_gateway import CALC, ScriptedEngine, rollout


async def langchain_agent(llm, row):
    """LangChain as a user writes it: a ChatOpenAI with bound tools, a tool call, its result."""
    from langchain_core.messages import HumanMessage, ToolMessage
    from langchain_openai import ChatOpenAI

    model = ChatOpenAI(model="policy", base_url=llm.base_url, api_key=llm.api_key, max_retries=0,
                       max_tokens=48).bind_tools([CALC])
    messages = [HumanMessage(f"What is 6*7? ({row['i']})")]
    first = await model.ainvoke(messages)
    call = first.tool_calls[0]
    messages += [first, ToolMessage("42", tool_call_id=call["id"])]
    second = await model.ainvoke(messages)
    return 1.0 if "42" in second.content else 0.0


def test_langchain_chat_openai_trains_over_three_steps_on_one_loop(tokenizer):
    # langchain-openai caches its httpx.AsyncClient process-wide: on a new loop per step, its
    # second step failed with "Event loop is closed"
    engine, gateway, loop = ScriptedEngine(tokenizer), Gateway("policy", 2048), RunLoop()
    try:
        for step in range(3):
            eps = rollout(engine, tokenizer, langchain_agent, 2, gateway=gateway, loop=loop)
            assert [e.env.error for e in eps] == [None, None], step
            assert [e.env.reward for e in eps] == [1.0, 1.0]
            # one segment each: LangChain's message history extended what the gateway handed back
            assert [e.env.info["segments"] for e in eps] == [1, 1]
    finally:
        gateway.close()
        loop.close()


def blocking(seconds: float):
    async def agent(llm, row):
        await llm.chat(llm.prompt_messages, max_new_tokens=4)
        time.sleep(seconds)  # the mistake: a blocking call inside an async agent
        return 1.0
    return agent


def test_a_blocked_loop_is_reported_naming_the_episode_and_the_line(tokenizer, caplog):
    loop = RunLoop(blocked_after_s=0.3, check_every_s=0.05)
    caplog.set_level(logging.WARNING, logger="plainrl.rollout.run_loop")
    try:
        [ep] = rollout(ScriptedEngine(tokenizer), tokenizer, blocking(1.0), 1, loop=loop)
    finally:
        loop.close()
    assert ep.env.error is None and ep.env.reward == 1.0  # it ends well once the call returns
    text = "\n".join(r.getMessage() for r in caplog.records)
    assert "the episodes' event loop is blocked: episode 0 has held it" in text, text
    assert f"{__file__}:" in text and "time.sleep(seconds)" in text and "asyncio.to_thread" in text
    assert "runs again after" in text
    assert blocked_report() is None


def test_a_stop_signal_while_the_loop_is_blocked_ends_the_run_at_once(tokenizer):
    loop = RunLoop(blocked_after_s=0.3, check_every_s=0.05)
    signaller = threading.Thread(target=_signal_when_blocked, args=(loop,), daemon=True)
    start = time.monotonic()
    with GracefulStop() as stop:
        signaller.start()
        # 30 s: far past the test's patience, only the signal can end it
        with pytest.raises(LoopBlocked, match=r"stopped by SIGTERM while the episodes' event loop was blocked: "
                                              r"episode \d has held it .*time.sleep"):
            rollout(ScriptedEngine(tokenizer), tokenizer, blocking(30.0), 2, loop=loop)
    assert stop.signum == signal.SIGTERM
    assert time.monotonic() - start < 10
    loop.close()  # a blocked loop is left to its daemon thread: closing does not wait for it


def _signal_when_blocked(loop: RunLoop) -> None:
    deadline = time.monotonic() + 20
    while loop.blocked is None and time.monotonic() < deadline:
        time.sleep(0.05)
    os.kill(os.getpid(), signal.SIGTERM)
