"""Rollout: prompts -> engine (-> environment turns) -> token-exact episodes.

    episodes = rollout(engine, sampler.next_batch(), sampling_params(cfg.rollout), tokenizer,
                       group_size=8, step=step, multi_turn=None)

Engines (``rollout/engines/``) sample token ids with their logprobs; environments
(``rollout/envs/``) answer model turns with observations; agents (``agents.py``, the user's
own loop over an ``LLM`` handle) and environments both run on the agent loop
(``episode_loop.py``, ``batcher.py``, ``llm.py``, ``trajectory.py``); ``workers`` and ``sandbox``
run user code and model-written code in other processes.
"""

from plainrl.rollout.engines.base import Engine
from plainrl.rollout.engines.hf import HFEngine
from plainrl.rollout.episodes import (
    MultiTurn,
    make_agent,
    make_env_factory,
    max_live_episodes,
    rollout,
    sampling_params,
)
from plainrl.rollout.chat import ChatTemplateError, build_env_prompt, prompt_messages, render_chat_continuation
from plainrl.rollout.multiturn import env_metrics, multi_turn_rollout
from plainrl.rollout.agents import AgentError, agent_rollout
from plainrl.rollout.episode_loop import LoopSettings
from plainrl.rollout.llm import LLM, AgentCancelled, Completion, ContextLengthError

__all__ = [
    "LLM",
    "AgentCancelled",
    "AgentError",
    "ChatTemplateError",
    "Completion",
    "ContextLengthError",
    "Engine",
    "HFEngine",
    "LoopSettings",
    "MultiTurn",
    "agent_rollout",
    "build_env_prompt",
    "env_metrics",
    "make_agent",
    "make_env_factory",
    "max_live_episodes",
    "multi_turn_rollout",
    "prompt_messages",
    "render_chat_continuation",
    "rollout",
    "sampling_params",
]
