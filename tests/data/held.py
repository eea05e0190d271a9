"""An environment and an agent that hold a run at a known point with processes of their own
alive, for the tests that SIGKILL the trainer (tests/test_kill.py). Each started process
carries ``$PLAINRL_TEST_MARK`` in its command line, so the test finds it wherever it went
(after setsid(), into a PID namespace) and checks that it is gone after the trainer's death.
And a reward function that holds the run past its first rollout (tests/test_vllm_kill.py).
Nothing here waits for a number of seconds: a held process sleeps until it is killed."""

import asyncio
import dataclasses
import json
import os
import sys
import time

from plainrl.rollout.envs import PythonToolEnv

# the command line of a held process: "python -c <this> <mark>"
SLEEPER = "import time\nwhile True:\n    time.sleep(1)\n"


def _tool_code(mark: str) -> str:
    # runs inside the sandbox: a grandchild that calls setsid() (it leaves the run's process group),
    # then the tool process itself turns into a sleeper (both in the sandbox's PID namespace)
    return (f"import os, subprocess, sys\n"
            f"subprocess.Popen([sys.executable, '-c', 'import os\\nos.setsid()\\n' + {SLEEPER!r}, {mark!r}])\n"
            f"os.execv(sys.executable, [sys.executable, '-c', {SLEEPER!r}, {mark!r}])\n")


class HeldPythonTool(PythonToolEnv):
    """The Python tool (:class:`plainrl.rollout.envs.PythonToolEnv`) whose every step runs, through
    its own ``step`` and :func:`plainrl.rollout.sandbox.run_python`, a code block that never ends."""

    def step(self, turn_text, state):
        block = f"\n```python\n{_tool_code(os.environ['PLAINRL_TEST_MARK'])}```"
        return super().step(turn_text, dataclasses.replace(state, text=state.text + block, finish_reason="stop"))


def held_python_tool():
    """``rollout.env`` factory: the held tool with a sandbox time limit longer than any test."""
    return HeldPythonTool(timeout_s=3600)


# A harness run as a subprocess agent (docs/agents.md): one request through the run's gateway
# with the openai SDK, then a tool of its own started (a grandchild), then it waits on that tool.
HARNESS = f"""
import json, os, subprocess, sys
import openai
client = openai.OpenAI(max_retries=0)
reply = client.chat.completions.create(model="policy", messages=[{{"role": "user", "content": "hi"}}], max_tokens=2)
tool = subprocess.Popen([sys.executable, "-c", {SLEEPER!r}, sys.argv[1]])
port = int(os.environ["OPENAI_BASE_URL"].rsplit(":", 1)[1].split("/")[0])
gate = os.path.join(sys.argv[2], str(os.getpid()))
with open(gate + ".tmp", "w") as f:
    json.dump({{"port": port, "harness": os.getpid(), "tool": tool.pid}}, f)
os.rename(gate + ".tmp", gate + ".json")
tool.wait()
"""


async def held_agent(llm, row):
    """``rollout.agent``: the harness above as a subprocess on this episode's gateway key; once it
    holds, it writes ``<pid>.json`` (the gateway's port, its pid and its tool's) into the
    directory ``$PLAINRL_TEST_GATE``."""
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-c", HARNESS, os.environ["PLAINRL_TEST_MARK"], os.environ["PLAINRL_TEST_GATE"],
        env={**os.environ, **llm.openai_env()})
    await proc.wait()
    return {"reward": 0.0}


_reward_calls = 0


def held_reward(completion, **columns):
    """A reward function that scores its first ``$PLAINRL_TEST_HOLD_AFTER`` calls (0 by default)
    by the completion's length (rewards that differ within a group, so the policy moves), then
    touches ``$PLAINRL_TEST_GATE`` and never returns: the run is then past that many completions'
    scoring, with every engine process it started alive."""
    global _reward_calls
    _reward_calls += 1
    if _reward_calls <= int(os.environ.get("PLAINRL_TEST_HOLD_AFTER", "0")):
        return float(len(completion) % 3) / 2
    open(os.environ["PLAINRL_TEST_GATE"], "a").close()
    while True:
        time.sleep(1)


_episodes = 0


async def held_after_agent(llm, row):
    """``rollout.agent``: its first ``$PLAINRL_TEST_HOLD_AFTER`` episodes make one short model call
    and return a reward; every later one appends its prompt (decoded, as rollouts.jsonl writes
    it) as a JSON line to ``$PLAINRL_TEST_GATE`` and never returns until the run cancels it: a
    batch in flight until a stop abandons it (tests/test_async_stop.py)."""
    global _episodes
    _episodes += 1
    if _episodes <= int(os.environ["PLAINRL_TEST_HOLD_AFTER"]):
        reply = await llm.chat(llm.prompt_messages, max_tokens=4)
        return float(len(reply.text) % 3) / 2
    with open(os.environ["PLAINRL_TEST_GATE"], "a") as f:
        f.write(json.dumps(llm.tokenizer.decode(llm.prompt_ids)) + "\n")
    while True:
        await asyncio.sleep(1)
