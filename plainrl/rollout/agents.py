"""``rollout.agent``: the user writes the interaction loop, plainrl records it.

    async def agent(llm, row):                 # or a plain function: then llm.chat blocks
        reply = await llm.chat(llm.prompt_messages)
        return 1.0 if row["answer"] in reply.text else 0.0

Each episode runs ``agent(llm, row)`` as its own task of the agent loop
(:func:`plainrl.rollout.episode_loop.run_episodes`); what the agent's calls sampled is
recorded token-exactly by its :class:`~plainrl.rollout.llm.LLM` handle. See docs/agents.md.
"""

from __future__ import annotations

import asyncio
import inspect
import math
import numbers
from typing import Any, Callable

import torch

from plainrl.data import PromptRow
from plainrl.rollout.engines.base import Engine
from plainrl.rollout.envs.base import EnvError
from plainrl.rollout.episode_loop import EpisodeRun, LoopSettings, episode_labels, run_episodes
from plainrl.rollout.llm import LLM, SyncLLM
from plainrl.rollout.event_loop import DaemonThreads
from plainrl.rollout.seeding import rollout_seed
from plainrl.rollout.trajectory import distinct_tokens, token_versions
from plainrl.types import EnvOutcome, Episode, SamplingParams

__all__ = ["AgentError", "agent_rollout", "load_agent"]


class AgentError(EnvError):
    """Every episode of a rollout failed in ``rollout.agent``; the message has the first errors."""


def load_agent(ref: str) -> Callable[..., Any]:
    """Import ``rollout.agent``: ``module:fn`` or ``path/to/file.py:fn``, called as ``fn(llm, row)``.

    Raises:
        UserCodeError: the reference cannot be imported (the message says why), or the
            callable does not take two positional arguments.
    """
    from plainrl.user_code import UserCodeError, load_callable

    fn = load_callable(ref, what="rollout.agent")
    try:
        inspect.signature(fn).bind(None, None)
    except TypeError:
        raise UserCodeError(f"rollout.agent {ref!r} must take two arguments, (llm, row): "
                            f"got {inspect.signature(fn)}") from None
    except ValueError:  # no signature to read (some builtins): called as it is
        pass
    return fn


def is_async_agent(fn: Callable[..., Any]) -> bool:
    """Whether ``fn`` is ``async def`` (a function, a partial of one, or an object whose ``__call__`` is)."""
    return inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(getattr(fn, "__call__", None))


def agent_rollout(
    engine: Engine,
    prompts: list[PromptRow],
    agent: Callable[..., Any],
    params: SamplingParams,
    tokenizer,
    settings: LoopSettings,
    *,
    group_size: int,
    step: int,
    generator: torch.Generator | None = None,
) -> list[Episode]:
    """Run ``agent(llm, row)`` ``group_size`` times per prompt, every episode on its own.

    The agent returns a reward (a real number), ``{"reward": number or None, **info}`` or
    None (the configured rewards score the episode). An episode fails, unscorable with its
    error in ``Episode.env.error``, when the agent raised (a
    :class:`~plainrl.rollout.llm.ContextLengthError` for a call past the budget included),
    returned another type, never called the model, or spent more than
    ``settings.timeout_s`` seconds outside model calls.

    Every segment (:class:`~plainrl.rollout.trajectory.Segment`: a lineage of calls, each
    extending the segment's context; a sub-agent or side call opens its own) is trained as a
    sample of its own. The episode's ``prompt_ids`` is the prompt of its latest call's segment
    and ``completion_ids`` everything after it, sampled tokens with ``loss_mask`` 1 and the
    engine's logprobs, inserted ones (the chat template's continuation, tool output) with 0;
    the other segments, in the order opened, are Episodes of the same form in
    ``Episode.earlier``. ``{"reward": r, "segment_rewards": [...]}`` gives each segment its
    own reward (one per segment, in the order opened; another length fails the episode).
    Calls marked not trained are in no segment.

    Args:
        agent: ``async def agent(llm, row)`` or a plain function (run in a thread of its
            own, its ``llm.chat`` blocking); see :func:`load_agent`.
        settings: budgets and limits (``rollout.max_total_tokens`` per episode,
            ``model.max_context``, ``rollout.agent_timeout_s``, ...): :class:`LoopSettings`.
        step: the training step the episodes are sampled for; negative: a held-out evaluation's
            (each episode's :func:`~plainrl.rollout.episode_loop.current_episode` says which).
        generator: the run's sampling generator: one draw seeds the rollout, each episode and
            each of its model calls its own stream (:mod:`plainrl.rollout.seeding`).
        Others: as :func:`~plainrl.rollout.episode_loop.run_episodes`.
    Returns:
        ``len(prompts) * group_size`` episodes, each prompt's contiguous. ``env`` is an
        :class:`~plainrl.types.EnvOutcome`: the agent's reward, its error, and ``info``:
        the agent's info plus ``generate_calls`` (``untrained_calls`` of them not trained),
        ``segments``, ``model_tokens`` and ``observation_tokens`` (of all segments),
        ``tokens_fed`` (the learner's: every segment's prompt and completion) and
        ``tokens_distinct`` (the same counted once per distinct prefix:
        :func:`~plainrl.rollout.trajectory.distinct_tokens`), ``seconds`` and ``end_reason``
        (``agent_done``, ``agent_error``, ``agent_timeout``).
        ``messages``: the latest trained chat call's messages and its reply (None when it was
        ``llm.generate``).
    Raises:
        AgentError: every episode failed (a broken agent, not a hard prompt).
        ValueError: bad ``group_size`` (or the loop's arguments).
    """
    if group_size < 1:
        raise ValueError(f"group_size must be >= 1, got {group_size}")
    flat = [q for q in prompts for _ in range(group_size)]
    is_async = is_async_agent(agent)
    # a plain-function agent holds a thread for its whole episode: one each, apart from the loop's
    # default executor (bounded: rollout.agent_threads), so they never wait for each other's
    threads = DaemonThreads()

    async def runner(llm: LLM, prompt: PromptRow) -> Any:
        if is_async:
            return await agent(llm, prompt.row)
        return await _in_thread(threads, agent, SyncLLM(llm, asyncio.get_running_loop()), prompt.row)

    labels = episode_labels(flat, step, group_size)
    runs = run_episodes(engine, flat, runner, params, tokenizer, settings, seed=rollout_seed(generator), labels=labels)
    episodes = [_episode(run, flat[i], tokenizer, labels[i].sample_id, i // group_size) for i, run in enumerate(runs)]
    failed = [e for e in episodes if e.env.error is not None]
    if episodes and len(failed) == len(episodes):
        first = "; ".join(f"{e.sample_id}: {e.env.error}" for e in failed[:3])
        raise AgentError(f"every one of the {len(episodes)} episodes of step {step} failed in rollout.agent "
                         f"(first: {first}); see docs/agents.md")
    return episodes


async def _in_thread(threads: DaemonThreads, fn: Callable[..., Any], *args: Any) -> Any:
    """``fn(*args)`` in a daemon thread of ``threads`` (:class:`~plainrl.rollout.event_loop.DaemonThreads`:
    an agent that never returns cannot hold the process at exit), awaited from the loop."""
    value = await asyncio.get_running_loop().run_in_executor(threads, lambda: fn(*args))
    if inspect.isawaitable(value):
        if inspect.iscoroutine(value):
            value.close()
        raise TypeError("the agent returned an awaitable: declare it `async def agent(llm, row)`")
    return value


def _outcome(value: Any) -> tuple[float | None, list[float] | None, dict[str, Any]]:
    """The agent's return value as ``(reward, segment_rewards, info)``.

    Raises:
        TypeError: not a real number, a dict with a numeric or None ``reward`` (and, if
            present, ``segment_rewards`` a list of finite numbers), or None.
    """
    if value is None:
        return None, None, {}
    if isinstance(value, numbers.Real) and not isinstance(value, bool):
        return float(value), None, {}
    if isinstance(value, dict):
        reward = value.get("reward")
        if reward is not None and not _is_number(reward):
            raise TypeError(f"the agent returned reward={reward!r} ({type(reward).__name__}); "
                            "'reward' must be a number or None")
        if not all(isinstance(k, str) for k in value):
            raise TypeError("the agent returned a dict with non-string keys; info keys must be strings")
        per_segment = value.get("segment_rewards")
        if per_segment is not None:
            if not isinstance(per_segment, (list, tuple)) or not all(
                    _is_number(r) and math.isfinite(r) for r in per_segment):
                raise TypeError(f"the agent returned segment_rewards={per_segment!r:.120}; it must be a list "
                                "of finite numbers, one per segment in the order opened")
            per_segment = [float(r) for r in per_segment]
        info = {k: v for k, v in value.items() if k not in ("reward", "segment_rewards")}
        return (None if reward is None else float(reward)), per_segment, info
    raise TypeError(f"the agent returned {type(value).__name__} {value!r:.80}; return a float reward, "
                    "a dict {'reward': float, **info}, or None (the configured rewards score the episode)")


def _is_number(x: Any) -> bool:
    return isinstance(x, numbers.Real) and not isinstance(x, bool)


def _episode(run: EpisodeRun, prompt: PromptRow, tokenizer, sample_id: str, group: int) -> Episode:
    """The episode of one agent run: its last segment as the episode's own ids, the earlier
    segments in ``Episode.earlier`` (each trained as a sample of its own)."""
    llm = run.llm
    reward, per_segment, info, error = None, None, {}, run.error
    if error is None:
        try:
            reward, per_segment, info = _outcome(run.value)
        except TypeError as e:
            error = f"TypeError: {e}"
    if error is None and llm.calls == 0:
        error = "the agent returned without calling the model (llm.chat / llm.generate)"
    segments = llm.trajectory.segments
    if error is None and not segments:
        error = (f"the agent made {llm.untrained_calls} model call(s), none of them trained (each was marked "
                 "not trained: train=False, a model name ending in +notrain or X-PlainRL-Train: false)")
    if error is None and per_segment is not None and len(per_segment) != len(segments):
        error = (f"ValueError: the agent returned {len(per_segment)} segment_rewards for {len(segments)} "
                 "segment(s) (a call whose context extends no earlier call's starts a new one); "
                 "return one reward per segment, in the order they were opened (docs/agents.md)")
    seg = llm.trajectory.current
    # the episode's own sample is the segment of its latest call; the others, in the order opened, are earlier
    others = [s for s in segments if s is not seg]
    if per_segment is not None and error is None and seg is not None:
        own = next(r for s, r in zip(segments, per_segment) if s is seg)
        per_segment = [r for s, r in zip(segments, per_segment) if s is not seg] + [own]
    ids = seg.completion_ids if seg is not None else []
    end = "agent_timeout" if run.timed_out else "agent_error" if error is not None else "agent_done"
    model = sum(sum(s.loss_mask) for s in segments)
    fed = [s.prompt_ids + s.completion_ids for s in segments]
    info.update(generate_calls=llm.calls, untrained_calls=llm.untrained_calls, segments=len(segments),
                model_tokens=model, observation_tokens=sum(len(s.loss_mask) for s in segments) - model,
                tokens_fed=sum(map(len, fed)), tokens_distinct=distinct_tokens(fed),
                seconds=run.seconds, end_reason=end)
    env = EnvOutcome(reward=reward, error=None if error is None else f"rollout.agent: {error}", info=info)
    earlier = tuple(Episode(sample_id=f"{sample_id}-seg{k}", group=group, row=prompt.row, prompt_ids=list(s.prompt_ids),
                       completion_ids=list(s.completion_ids), logprobs=list(s.logprobs), loss_mask=list(s.loss_mask),
                       finish_reason=s.finish_reason, env=env, token_versions=token_versions(s),
                       completion_text=tokenizer.decode(s.completion_ids, skip_special_tokens=True))
               for k, s in enumerate(others))
    return Episode(
        sample_id=sample_id, group=group, row=prompt.row,
        prompt_ids=seg.prompt_ids if seg is not None else list(prompt.prompt_ids),
        completion_ids=list(ids), logprobs=list(seg.logprobs) if seg is not None else [],
        loss_mask=list(seg.loss_mask) if seg is not None else [], token_versions=token_versions(seg),
        finish_reason=llm.last.finish_reason if llm.last is not None else "length",
        completion_text=tokenizer.decode(ids, skip_special_tokens=True), env=env, messages=llm.conversation,
        earlier=earlier, segment_rewards=per_segment if error is None else None,
    )
