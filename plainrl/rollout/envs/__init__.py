"""Environments for multi-turn rollouts (tools, calculators, interaction), token-exact.

    from plainrl.rollout import multi_turn_rollout
    from plainrl.rollout.envs import CalculatorEnv
    episodes = multi_turn_rollout(engine, batch, lambda: CalculatorEnv(), params, tokenizer,
                                  group_size=8, step=step, max_turns=8, max_total_tokens=512)

See docs/environments.md for the protocol, the simple forms and the bookkeeping contract.
"""

from plainrl.rollout.envs.base import EnvError, EnvState, EnvTimeoutError, Environment, StepResult, call_with_timeout, env_reward
from plainrl.rollout.envs.calculator import CalculatorEnv, CalculatorError, format_number, safe_eval
from plainrl.rollout.envs.isolated import EnvWorkerError, EnvWorkers, EnvWorkerTimeout, RemoteEnv
from plainrl.rollout.envs.search import BM25Index, format_results, world_index
from plainrl.rollout.envs.python_tool import PythonToolEnv, find_closed_code_block
from plainrl.rollout.envs.tools import (
    InteractEnv,
    ToolCall,
    ToolCallError,
    ToolEnv,
    TriggerEnv,
    function_schema,
    hermes_tools_prompt,
    parse_tool_calls,
)

__all__ = [
    "BM25Index",
    "EnvError",
    "CalculatorEnv",
    "CalculatorError",
    "EnvState",
    "EnvTimeoutError",
    "EnvWorkerError",
    "EnvWorkerTimeout",
    "EnvWorkers",
    "Environment",
    "InteractEnv",
    "PythonToolEnv",
    "RemoteEnv",
    "StepResult",
    "ToolCall",
    "ToolCallError",
    "ToolEnv",
    "TriggerEnv",
    "call_with_timeout",
    "env_reward",
    "find_closed_code_block",
    "format_number",
    "format_results",
    "function_schema",
    "hermes_tools_prompt",
    "parse_tool_calls",
    "safe_eval",
    "world_index",
]
