"""Rollout: prompts -> engine (-> environment turns) -> :class:`Episode` records, token-exact."""

from __future__ import annotations

import functools
import inspect
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from plainrl.config import RolloutConfig
from plainrl.data import DataError, PromptRow
from plainrl.rollout.engines.base import Engine
from plainrl.rollout.episode_loop import LoopSettings
from plainrl.rollout.seeding import episode_seeds
from plainrl.types import Episode, SamplingParams


def sampling_params(cfg: RolloutConfig, **overrides) -> SamplingParams:
    """The engine's sampling settings from the ``rollout`` config section."""
    base = dict(
        max_new_tokens=cfg.max_new_tokens, temperature=cfg.temperature,
        top_p=cfg.top_p, top_k=cfg.top_k, stop=tuple(cfg.stop),
    )
    return SamplingParams(**{**base, **overrides})


def env_constructor(cfg: RolloutConfig) -> Callable[..., Any] | None:
    """``rollout.env`` as the callable that builds one environment, ``factory(**env_args)``
    (a data row's ``env_args``), or None (single turn). A class is taken as it is when it is a
    plainrl environment, or adapted when it is a TRL ``environment_factory`` class or an OpenEnv
    environment (:func:`plainrl.rollout.envs.classes.adapt_env_class`).

    Raises:
        UserCodeError: a ``module:fn`` reference that cannot be loaded, or a class that is no
            environment (before any model loads; the config already refused names that are neither
            built-in nor references).
    """
    if cfg.env is None:
        return None
    from plainrl.rollout.envs import CalculatorEnv, PythonToolEnv

    builtins = {"calculator": CalculatorEnv, "python": functools.partial(PythonToolEnv, timeout_s=cfg.tool_timeout_s)}
    if cfg.env in builtins:
        return builtins[cfg.env]
    from plainrl.user_code import load_callable

    target = load_callable(cfg.env, what="rollout.env")
    if inspect.isclass(target):
        from plainrl.rollout.envs.classes import adapt_env_class

        return adapt_env_class(target, cfg.env, tool_timeout_s=cfg.tool_timeout_s)
    return target


def make_env_factory(cfg: RolloutConfig):
    """``rollout.env`` -> a factory of environments, called once per episode with the row's
    ``env_args`` (:func:`env_constructor`), or None (single turn).

    With ``rollout.env_timeout_s`` set (the default) the factory is an
    :class:`~plainrl.rollout.envs.EnvWorkers` (each episode's environment in a worker process,
    every call time-limited; call its ``close()`` when done); no worker starts here.

    Raises:
        UserCodeError: as :func:`env_constructor`.
    """
    factory = env_constructor(cfg)
    if factory is None or cfg.env_timeout_s is None:
        return factory
    from plainrl.rollout.envs import EnvWorkers

    return EnvWorkers(factory, timeout_s=cfg.env_timeout_s)


def check_rows_fit_env(factory: Callable[..., Any], rows: list[PromptRow], ref: str) -> None:
    """Check, before any model loads, that every row's ``env_args`` fit the signature of
    ``rollout.env``'s constructor ``factory`` (``ref``), so that a misspelt argument is a data
    error rather than every episode of that row failing in its environment.

    Raises:
        DataError: the first row whose ``env_args`` the constructor cannot take (names the row,
            the arguments and the signature).
    """
    try:
        sig = inspect.signature(factory)
    except (TypeError, ValueError):
        return  # cannot inspect (a C callable): building the environment will tell
    for p in rows:
        args = p.row.get("env_args")
        if not args:
            continue
        try:
            sig.bind(**args)
        except TypeError as e:
            raise DataError(f"training/eval row {p.source_index}: env_args {args!r:.200} do not fit rollout.env "
                            f"{ref!r}{sig}: {e}; fix the row's env_args or the constructor") from None


def make_agent(cfg: RolloutConfig):
    """``rollout.agent`` -> the agent callable, or None.

    Raises:
        UserCodeError: the reference cannot be loaded or does not take ``(llm, row)``.
    """
    if cfg.agent is None:
        return None
    if cfg.agent == "online":  # episodes driven from outside the run (plainrl.rollout.gateway.online)
        from plainrl.rollout.gateway.online import online_agent

        return online_agent
    from plainrl.rollout.agents import load_agent

    return load_agent(cfg.agent)


def max_live_episodes(cfg: RolloutConfig) -> int | None:
    """Multi-turn episodes in flight at once: a step's worth, at most ``rollout.max_concurrent_episodes``
    and, when environments run in worker processes (one each), ``rollout.env_workers``; None (all)
    when nothing bounds them."""
    bounds = [cfg.max_concurrent_episodes]
    if cfg.env is not None and cfg.env_timeout_s is not None:
        bounds.append(cfg.env_workers)
    bounds = [b for b in bounds if b is not None]
    return min([cfg.prompts_per_step * cfg.group_size, *bounds]) if bounds else None


@dataclass(frozen=True)
class MultiTurn:
    """How episodes run in an environment (``rollout.env``) or an agent (``rollout.agent``), in
    training and held-out eval: the arguments of :func:`plainrl.rollout.multi_turn_rollout` and
    :func:`plainrl.rollout.agents.agent_rollout` that the config sets. Exactly one of
    ``env_factory`` and ``agent`` is set.

    env_factory:      (**env_args) -> a fresh environment per episode, with its row's ``env_args``
                      (an ``EnvWorkers`` runs each in a worker process).
    max_turns:        the most model turns per episode (None: the environment's limit; environments only).
    max_total_tokens: the completion budget in tokens, model and observation tokens together
                      (for agents: the episode's, every segment together).
    max_live:         the most episodes in flight at once (the pre-forked environment
                      workers serve them), None for all.
    agent:            ``fn(llm, row)``, the user's interaction loop.
    max_context:      the model's context (agents: a call past it fails the episode).
    timeout_s:        agents: seconds an episode may spend outside model calls (None: no limit).
    max_in_flight:    engine calls at once (1, or more for inference servers).
    chat_template_kwargs: ``data.chat_template_kwargs``, variables for the chat template.
    gateway:          agents: the run's OpenAI-compatible gateway (:class:`~plainrl.rollout.gateway.Gateway`,
                      its socket bound on first use), None for one per rollout.
    loop:             the run's event loop (:class:`~plainrl.rollout.event_loop.RunLoop`): every
                      rollout's episodes run on it; None for one per rollout.
    """

    env_factory: Callable[[], Any] | None
    max_turns: int | None
    max_total_tokens: int
    system_prompt: str | None = None
    prompt_template: str = "{prompt}"
    max_live: int | None = None
    agent: Callable[..., Any] | None = None
    max_context: int | None = None
    timeout_s: float | None = None
    max_in_flight: int = 1
    chat_template_kwargs: dict[str, Any] = field(default_factory=dict)
    gateway: Any = None
    loop: Any = None

    def __post_init__(self) -> None:
        if (self.env_factory is None) == (self.agent is None):
            raise ValueError("MultiTurn needs exactly one of env_factory and agent")

    def loop_settings(self) -> LoopSettings:
        """These settings as the agent loop's (:class:`~plainrl.rollout.episode_loop.LoopSettings`)."""
        return LoopSettings(self.max_total_tokens, max_context=self.max_context, max_live=self.max_live,
                            timeout_s=self.timeout_s, max_in_flight=self.max_in_flight,
                            system_prompt=self.system_prompt, prompt_template=self.prompt_template,
                            chat_template_kwargs=self.chat_template_kwargs, gateway=self.gateway,
                            loop=self.loop)


def rollout(
    engine: Engine,
    prompts: list[PromptRow],
    params: SamplingParams,
    tokenizer,
    *,
    group_size: int,
    step: int,
    multi_turn: MultiTurn | None = None,
    generator: torch.Generator | None = None,
) -> list[Episode]:
    """Sample ``group_size`` completions for each prompt, single-turn or, with ``multi_turn``,
    in an environment (:func:`plainrl.rollout.multi_turn_rollout`) or the user's agent
    (:func:`plainrl.rollout.agents.agent_rollout`).

    ``generator`` (the run's sampling generator) is drawn from once: episode ``i`` (of the
    ``len(prompts) * group_size``) and each of its model calls sample with their own seed
    (:mod:`plainrl.rollout.seeding`), so the samples do not depend on the engine's batching
    or on how many episodes run at once.

    Returns:
        len(prompts) * group_size episodes, the samples of one prompt contiguous.
        ``completion_text`` is decoded for reward functions and logs only; training
        uses ``completion_ids`` exactly as sampled. An episode whose environment raised
        (or whose agent failed) is unscorable (``reward`` stays None after scoring).
    Raises:
        AgentError: every episode of an agent rollout failed.
    """
    m = multi_turn
    if m is not None and m.agent is not None:
        from plainrl.rollout.agents import agent_rollout

        return agent_rollout(engine, prompts, m.agent, params, tokenizer, m.loop_settings(), group_size=group_size,
                             step=step, generator=generator)
    if m is not None:
        from plainrl.rollout.multiturn import multi_turn_rollout

        return multi_turn_rollout(
            engine, prompts, m.env_factory, params, tokenizer, group_size=group_size, step=step,
            max_turns=m.max_turns, max_total_tokens=m.max_total_tokens, generator=generator,
            system_prompt=m.system_prompt, prompt_template=m.prompt_template, max_live=m.max_live,
            max_in_flight=m.max_in_flight, chat_template_kwargs=m.chat_template_kwargs,
        )
    flat = [p for p in prompts for _ in range(group_size)]
    gens = engine.generate([p.prompt_ids for p in flat], params, seeds=episode_seeds(generator, len(flat)))
    episodes = []
    for i, (p, g) in enumerate(zip(flat, gens)):
        episodes.append(
            Episode(
                sample_id=f"s{step}-r{p.source_index}-{i % group_size}",
                group=i // group_size,
                row=p.row,
                prompt_ids=p.prompt_ids,
                completion_ids=g.token_ids,
                logprobs=g.logprobs,
                loss_mask=[1] * len(g.token_ids),
                finish_reason=g.finish_reason,
                completion_text=tokenizer.decode(g.token_ids, skip_special_tokens=True),
                token_versions=g.versions,
            )
        )
    return episodes
