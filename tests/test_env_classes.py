"""rollout.env naming a class written for another trainer: TRL environment_factory classes (one copied from
TRL's documentation, unchanged) and OpenEnv environments (OpenEnv's own echo template, an MCP-tool
environment on OpenEnv's base classes), their tool errors and hangs, and the configuration errors."""

from __future__ import annotations

import importlib.util
import json
import random
import sys
import time
from pathlib import Path

import pytest

import plainrl.run.setup as run_setup
from conftest import REPO, tiny_overrides
from plainrl.cli import main
from plainrl.config import load_config
from plainrl.data import PromptRow, build_prompt_ids
from plainrl.rollout.envs import EnvWorkers
from plainrl.rollout.envs.classes import EnvClassError, env_class_kind
from plainrl.rollout.episodes import env_constructor
from plainrl.rollout.multiturn import multi_turn_rollout
from plainrl.types import Generation, SamplingParams

EXAMPLE = REPO / "examples" / "trl_env_grpo.yaml"
TRL_ENV = REPO / "examples" / "trl_increment_env.py"


class TextEngine:
    """Plays scripted model turns (text, ended by EOS or paused at a stop string) and keeps every context."""

    def __init__(self, tokenizer, turns: list[tuple[str, bool]]):
        self.tok, self.turns, self.contexts = tokenizer, list(turns), []

    def generate(self, prompts, params, *, seeds=None):
        out = []
        for ctx in prompts:
            self.contexts.append(list(ctx))
            text, eos = self.turns.pop(0)
            ids = list(self.tok(text, add_special_tokens=False)["input_ids"]) + ([self.tok.eos_token_id] if eos else [])
            out.append(Generation(token_ids=ids, logprobs=[-0.5] * len(ids), finish_reason="eos" if eos else "stop"))
        return out

    def load_weights(self, model):
        pass


def call(name: str, **arguments) -> str:
    return f'<tool_call>\n{json.dumps({"name": name, "arguments": arguments})}\n</tool_call>'


def prompt_row(tokenizer, text: str, **extra) -> PromptRow:
    row = {"prompt": text, **extra}
    return PromptRow(row=row, prompt_ids=build_prompt_ids(row, tokenizer), source_index=0)


def rollout_cfg(ref: str, **over):
    return load_config(None, ["rewards=[{fn: correctness}]", "data.task=arithmetic", f"rollout.env={ref}",
                              *[f"rollout.{k}={v}" for k, v in over.items()]]).rollout


def one_episode(tokenizer, factory, turns, text="Task: ", **row):
    engine = TextEngine(tokenizer, turns)
    (e,) = multi_turn_rollout(engine, [prompt_row(tokenizer, text, **row)], factory, SamplingParams(max_new_tokens=64),
                              tokenizer, group_size=1, step=0, max_turns=4, max_total_tokens=400)
    return e, engine


# ------------------------------------------------------------------------------------------------ TRL


def test_trl_class_from_trls_documentation_runs_unchanged(tokenizer):
    factory = env_constructor(rollout_cfg(f"{TRL_ENV}:IncrementEnv"))
    random.seed(3)
    target = random.Random(3).randint(1, 6)  # what IncrementEnv.reset draws from the global RNG below
    random.seed(3)
    e, engine = one_episode(tokenizer, factory, [(call("increment", step=target), False), ("Done.", True)])
    assert e.env.error is None and e.env.info["end_reason"] == "eos"
    assert e.env.reward == 1.0  # get_reward(): counter == target
    assert e.env.info["tool_calls"] == 1 and e.env.info["tool_errors"] == 0
    # reset's text appended to the prompt, the tool described from its hints and docstring
    user = [m for m in e.messages if m["role"] == "user"][0]["content"]
    assert user == f"Task: Increment the counter by {target}."
    system = e.messages[0]["content"]
    assert '"name": "increment"' in system and "Value to add to the counter." in system
    assert [m for m in e.messages if m["role"] == "tool"] == [{"role": "tool", "name": "increment",
                                                                "content": str(target)}]
    # token-exact: the second call saw the first turn's ids and the tool message's, masked out
    assert engine.contexts[1][: len(e.prompt_ids)] == e.prompt_ids
    assert e.completion_ids[: len(engine.contexts[1]) - len(e.prompt_ids)] == engine.contexts[1][len(e.prompt_ids):]
    assert 0 in e.loss_mask and e.loss_mask[-1] == 1


def test_wrong_step_scores_zero_and_a_raising_tool_answers_the_model(tokenizer, tmp_path):
    env_file = tmp_path / "envs.py"
    env_file.write_text('''
class Counter:
    def reset(self, start=0, **kwargs):
        self.n = start

    def get_reward(self) -> float:
        return float(self.n)

    def add(self, k: int) -> int:
        """Add to the counter.

        Args:
            k: how much
        """
        if k < 0:
            raise ValueError("k must be >= 0")
        self.n += k
        return self.n

    async def double(self) -> int:
        """Double the counter."""
        self.n *= 2
        return self.n
''')
    factory = env_constructor(rollout_cfg(f"{env_file}:Counter"))
    turns = [(call("add", k=-1), False), (call("add", k=2) + call("double"), False), ("ok", True)]
    e, _ = one_episode(tokenizer, factory, turns, start=1)  # the row's column reaches reset(start=1)
    assert e.env.error is None
    tools = [m["content"] for m in e.messages if m["role"] == "tool"]
    assert tools == ["Error: ValueError: k must be >= 0", "3", "6"]
    assert e.env.info["tool_errors"] == 1 and e.env.info["tool_calls"] == 3
    assert e.env.reward == 6.0  # async method run, get_reward read at the end


HANGS = '''
import time

class Slow:
    def reset(self, **kwargs):
        return None

    def get_reward(self) -> float:
        return 1.0

    def wait(self, seconds: float) -> str:
        """Wait.

        Args:
            seconds: how long
        """
        time.sleep(seconds)
        return "done"
'''


@pytest.mark.parametrize("workers", [False, True], ids=["in_process", "env_workers"])
def test_a_tool_that_hangs_fails_its_own_episode(tokenizer, tmp_path, workers):
    env_file = tmp_path / "slow.py"
    env_file.write_text(HANGS)
    factory = env_constructor(rollout_cfg(f"{env_file}:Slow", tool_timeout_s=0.3))
    if workers:
        factory = EnvWorkers(factory, timeout_s=20)
    try:
        rows = [prompt_row(tokenizer, "a"), prompt_row(tokenizer, "b")]
        engine = TextEngine(tokenizer, [(call("wait", seconds=30), False), (call("wait", seconds=0), False),
                                        ("fine", True)])
        start = time.monotonic()
        e1, e2 = multi_turn_rollout(engine, rows, factory, SamplingParams(), tokenizer, group_size=1, step=0,
                                    max_turns=4, max_total_tokens=400)
    finally:
        if workers:
            factory.close()
    assert time.monotonic() - start < 15
    hung, ok = (e1, e2) if e1.env.error else (e2, e1)
    assert "wait did not return within 0.3 s" in hung.env.error and hung.env.info["end_reason"] == "env_error"
    assert hung.env.reward is None  # get_reward is not read on a failed episode
    assert ok.env.error is None and ok.env.reward == 1.0


def test_get_reward_that_raises_fails_the_episode(tokenizer, tmp_path):
    env_file = tmp_path / "bad.py"
    env_file.write_text("class Bad:\n    def reset(self, **kw):\n        pass\n"
                        "    def get_reward(self):\n        raise KeyError('score')\n")
    e, _ = one_episode(tokenizer, env_constructor(rollout_cfg(f"{env_file}:Bad")), [("hi", True)])
    assert e.env.error.startswith("env.final_reward: KeyError") and e.env.info["end_reason"] == "env_error"


# ------------------------------------------------------------------------------------------- errors


@pytest.mark.parametrize("body, match", [
    ("class Nothing:\n    def _hidden(self):\n        pass\n", "has no public method and no reset"),
    ("class Undocumented:\n    def reset(self, **kw):\n        pass\n    def go(self, x: int) -> int:\n"
     "        return x\n", r"Undocumented\.go is a tool.*docstring"),
])
def test_a_class_that_is_no_environment_is_a_config_error(tmp_path, body, match):
    env_file = tmp_path / "envs.py"
    env_file.write_text(body)
    name = body.split()[1].rstrip(":")
    with pytest.raises(EnvClassError, match=match):
        env_constructor(rollout_cfg(f"{env_file}:{name}"))


def test_config_error_stops_the_run_before_the_model_loads(tiny_model_dir, tmp_path, monkeypatch, capsys):
    env_file = tmp_path / "envs.py"
    env_file.write_text("class Nothing:\n    pass\n")

    def no_model(*a, **kw):
        raise AssertionError("the model loaded before the bad rollout.env was reported")

    monkeypatch.setattr(run_setup, "load_policy", no_model)
    code = main(["train", str(EXAMPLE), *tiny_overrides(tiny_model_dir, tmp_path / "run"),
                 f"rollout.env={env_file}:Nothing"])
    err = capsys.readouterr().err
    assert code == 2, err
    assert "rollout.env" in err and "no public method and no reset" in err and "TRL environment_factory" in err


def test_kinds():
    from plainrl.rollout.envs import CalculatorEnv, ToolEnv

    assert env_class_kind(CalculatorEnv) == "plainrl" and env_class_kind(ToolEnv) == "plainrl"
    assert env_constructor(rollout_cfg("calculator")) is CalculatorEnv

    class Game:
        def step(self, action: str) -> str:  # a tool called step: one argument, so TRL-style
            """Act.

            Args:
                action: what to do
            """
            return action

    assert env_class_kind(Game) == "trl"


# ------------------------------------------------------------------------------------------ OpenEnv


def openenv_echo(tmp_path: Path) -> Path:
    """OpenEnv's own example environment: the echo template `openenv init` renders, rendered the same way."""
    pytest.importorskip("openenv.core.env_server", reason="openenv (with fastmcp) is not installed")
    tpl = Path(importlib.util.find_spec("openenv.cli").submodule_search_locations[0]) / "templates" / "openenv_env"
    sub = {"__ENV_CLASS_NAME__": "Echo", "__ENV_TITLE_NAME__": "Echo", "__ENV_NAME__": "echo"}

    def render(text: str) -> str:
        for k, v in sub.items():
            text = text.replace(k, v)
        return text

    pkg = tmp_path / "echo_env"
    (pkg / "server").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "server" / "__init__.py").write_text("")
    (pkg / "models.py").write_text(render((tpl / "models.py").read_text()))
    (pkg / "server" / "echo_environment.py").write_text(render((tpl / "server" / "__ENV_NAME___environment.py").read_text()))
    return pkg


def test_openenv_echo_template_runs_in_process(tokenizer, tmp_path, monkeypatch):
    openenv_echo(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    factory = env_constructor(rollout_cfg("echo_env.server.echo_environment:EchoEnvironment"))
    e, _ = one_episode(tokenizer, factory, [(call("step", message="hello"), False), ("bye", True)])
    assert e.env.error is None
    user = [m for m in e.messages if m["role"] == "user"][0]["content"]
    assert user.endswith('{"echoed_message": "Echo environment ready!", "message_length": 0}')
    assert '"name": "step"' in e.messages[0]["content"] and "Message to echo back" in e.messages[0]["content"]
    (tool,) = [m["content"] for m in e.messages if m["role"] == "tool"]
    assert json.loads(tool) == {"echoed_message": "hello", "message_length": 5}
    assert e.env.reward == pytest.approx(0.5)  # the template's reward: 0.1 per character
    # a bad action (a field the Action does not have) is the tool's error; the episode goes on
    e, _ = one_episode(tokenizer, factory, [(call("step", text="x"), False), ("bye", True)])
    assert e.env.error is None and e.env.info["malformed_calls"] == 1


MCP_ENV = '''
from openenv.core.env_server import CallToolAction, CallToolObservation, Environment, ListToolsAction
from openenv.core.env_server import ListToolsObservation, Observation, State, Tool, ToolError, ToolErrorType


class Lights(Environment):
    """Two MCP tools on OpenEnv's base classes, answering step() as an MCPEnvironment does."""

    def __init__(self):
        super().__init__()
        self.on = 0
        self.closed = False

    def reset(self, seed=None, episode_id=None, **kwargs) -> Observation:
        self.on = kwargs.get("start", 0)
        return Observation()

    def step(self, action: ListToolsAction | CallToolAction, timeout_s=None, **kwargs) -> Observation:
        if isinstance(action, ListToolsAction):
            schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
            return ListToolsObservation(tools=[Tool(name="switch_on", description="Switch n lights on.",
                                                    input_schema=schema)])
        if action.arguments.get("n", 0) < 0:
            return CallToolObservation(tool_name=action.tool_name, error=ToolError(
                error_type=ToolErrorType.INVALID_ARGS, message="n must be >= 0"))
        self.on += action.arguments["n"]
        return CallToolObservation(tool_name=action.tool_name, result=f"{self.on} on", reward=float(self.on),
                                   done=self.on >= 3)

    @property
    def state(self) -> State:
        return State(step_count=self.on)

    def close(self):
        self.closed = True
'''


def test_openenv_mcp_tools_run_in_process(tokenizer, tmp_path):
    pytest.importorskip("openenv.core.env_server", reason="openenv (with fastmcp) is not installed")
    env_file = tmp_path / "lights.py"
    env_file.write_text(MCP_ENV)
    factory = env_constructor(rollout_cfg(f"{env_file}:Lights"))
    built = []
    e, _ = one_episode(tokenizer, lambda **kw: built.append(factory(**kw)) or built[-1],
                       [(call("switch_on", n=-1), False), (call("switch_on", n=1), False),
                        (call("switch_on", n=1), False)], start=1)
    assert e.env.error is None
    tools = [m["content"] for m in e.messages if m["role"] == "tool"]
    assert tools == ["Error: RuntimeError: invalid_args: n must be >= 0", "2 on"]  # the last answer: done
    assert e.env.reward == 2.0 + 3.0 and e.env.info["end_reason"] == "env_done"  # done at 3 lights
    assert built[0].env.closed


def test_openenv_class_without_action_type_is_a_config_error(tmp_path):
    pytest.importorskip("openenv.core.env_server", reason="openenv (with fastmcp) is not installed")
    env_file = tmp_path / "untyped.py"
    env_file.write_text("from openenv.core.env_server import Environment, Observation, State\n"
                        "class Untyped(Environment):\n"
                        "    def reset(self, **kw): return Observation()\n"
                        "    def step(self, action): return Observation()\n"
                        "    @property\n    def state(self): return State()\n")
    with pytest.raises(EnvClassError, match="cannot tell the Action type of Untyped.step"):
        env_constructor(rollout_cfg(f"{env_file}:Untyped"))


# ---------------------------------------------------------------------------------------- 2 tiny steps


@pytest.mark.parametrize("which", ["trl", "openenv"])
def test_two_tiny_steps(which, tiny_model_dir, tmp_path, monkeypatch):
    over = []
    if which == "openenv":
        openenv_echo(tmp_path)
        monkeypatch.syspath_prepend(str(tmp_path))
        monkeypatch.setenv("PYTHONPATH", f"{tmp_path}:{REPO}")
        over = ["rollout.env=echo_env.server.echo_environment:EchoEnvironment"]
    run = tmp_path / "run"
    assert main(["train", str(EXAMPLE), *tiny_overrides(tiny_model_dir, run), *over]) == 0
    steps = [r for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines()) if "reward/mean" in r]
    assert [r["step"] for r in steps] == [0, 1]
    assert all(r["env/error_rate"] == 0.0 for r in steps)
    rollouts = [json.loads(line) for line in (run / "rollouts.jsonl").read_text().splitlines()]
    assert rollouts and not (run / "errors.jsonl").exists()
    if which == "trl":  # every prompt carries the task reset() drew
        assert all("Increment the counter by" in json.dumps(r) for r in rollouts)


FASTMCP_ENV = '''
from fastmcp import FastMCP
from openenv.core.env_server import MCPEnvironment, Observation, State


class Notes(MCPEnvironment):
    """An MCPEnvironment with one FastMCP tool, as OpenEnv's MCP environments are written."""

    def __init__(self):
        mcp = FastMCP("notes")
        self.notes = []

        @mcp.tool()
        def write(text: str) -> str:
            """Write a note."""
            if not text:
                raise ValueError("empty note")
            self.notes.append(text)
            return f"{len(self.notes)} notes"

        super().__init__(mcp)

    def reset(self, seed=None, episode_id=None, **kwargs) -> Observation:
        self.notes = []
        return Observation(reward=0.0)

    def _step_impl(self, action, timeout_s=None, **kwargs) -> Observation:
        return Observation()

    @property
    def state(self) -> State:
        return State(step_count=len(self.notes))
'''


def test_openenv_mcp_environment_with_fastmcp(tokenizer, tmp_path):
    pytest.importorskip("fastmcp", reason="fastmcp (openenv's MCP) is not installed")
    pytest.importorskip("openenv.core.env_server", reason="openenv is not installed")
    env_file = tmp_path / "notes.py"
    env_file.write_text(FASTMCP_ENV)
    factory = env_constructor(rollout_cfg(f"{env_file}:Notes"))
    e, _ = one_episode(tokenizer, factory, [(call("write", text="hi") + call("write", text=""), False), ("ok", True)])
    assert e.env.error is None and e.env.reward == 0.0
    assert '"name": "write"' in e.messages[0]["content"]
    (first, second) = [m["content"] for m in e.messages if m["role"] == "tool"]
    assert first == "1 notes" and second.startswith("Error: RuntimeError:") and "empty note" in second
