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
from plainrl.rollout.event_loop import LoopBlocked, RunLoop, blocked_report
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
    caplog.set_level(logging.WARNING, logger="plainrl.rollout.event_loop")
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


@pytest.mark.e2e
def test_plainrl_train_reports_a_blocked_loop_and_sigterm_ends_it(tiny_model_dir, tmp_path):
    """A real run whose async agent blocks in time.sleep: the warning names the agent's line, and
    SIGTERM ends the run at once (exit status 143) with that reason."""
    import subprocess
    import sys

    from conftest import REPO, tiny_overrides

    agent = tmp_path / "blocking.py"
    agent.write_text("import time\n\n\nasync def agent(llm, row):\n    time.sleep(600)\n    return 1.0\n")
    log = tmp_path / "run.log"
    cmd = [sys.executable, "-m", "plainrl.cli", "train", str(REPO / "examples" / "agent_openai.yaml"),
           *tiny_overrides(tiny_model_dir, tmp_path / "run"), "eval.before=false", "eval.after=false",
           f"rollout.agent={agent}:agent", "rewards=[]"]
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    with open(log, "w") as out:
        job = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 120
        while "event loop is blocked" not in log.read_text() and time.monotonic() < deadline and job.poll() is None:
            time.sleep(0.2)
        text = log.read_text()
        assert f"{agent}:5 in agent ('time.sleep(600)')" in text, text
        job.send_signal(signal.SIGTERM)
        assert job.wait(timeout=30) == 143
    finally:
        if job.poll() is None:
            job.kill()
    assert "plainrl: stopped by SIGTERM while the episodes' event loop was blocked: episode" in log.read_text()
