"""Multi-turn rollout in an environment: model turns and environment observations, token-exact.

Every episode's sequence is ``prompt_ids + completion_ids``, where the completion
interleaves model tokens (``loss_mask`` 1, the engine's logprobs) and observation
tokens (``loss_mask`` 0, logprob 0.0). Each turn the engine is given exactly that
sequence so far, so the ids the learner trains on are the ids the engine saw and
sampled: model tokens are never decoded and re-tokenised, and each observation
is tokenised once, on its own, when it is inserted.

An environment episode is an agent of the agent loop (:mod:`plainrl.rollout.episode_loop`):
each episode runs on its own, its environment calls in threads of their own, and the model
calls of all episodes are batched whenever the engine is free; the token bookkeeping
is the :class:`~plainrl.rollout.llm.LLM` handle's.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from plainrl.data import PromptRow
from plainrl.rollout.chat import build_env_prompt, encode_rendered, render_chat_continuation
from plainrl.rollout.engines.base import Engine
from plainrl.rollout.envs.base import EnvState, Environment, StepResult
from plainrl.rollout.envs.isolated import EnvWorkerError
from plainrl.rollout.episode_loop import DaemonThreads, LoopSettings, run_episodes
from plainrl.rollout.llm import LLM
from plainrl.rollout.seeding import rollout_seed
from plainrl.rollout.trajectory import token_versions
from plainrl.rollout.workers import describe_exception
from plainrl.types import EnvOutcome, Episode, FinishReason, Generation, SamplingParams

__all__ = ["env_metrics", "multi_turn_rollout"]

# --------------------------------------------------------------------------- rollout


@dataclass
class _Run:
    """One episode in flight (its tokens are in the LLM handle's trajectory)."""

    prompt: PromptRow
    prompt_ids: list[int] = field(default_factory=list)  # the env may re-render the prompt
    env: Environment | None = None  # None: not built yet, or the factory raised
    state: EnvState = field(default_factory=lambda: EnvState(row={}))
    stop: tuple[str, ...] = ()
    max_turns: int | None = None
    turn_ids: list[int] = field(default_factory=list)
    turn_text: str = ""
    reason: FinishReason = "length"
    end: str | None = None
    finish: FinishReason = "length"
    rewards: list[float] = field(default_factory=list)
    info: dict[str, Any] = field(default_factory=dict)
    error: str | None = None
    chat_kwargs: dict[str, Any] = field(default_factory=dict)  # data.chat_template_kwargs
    open_assistant: bool = False
    calls: int = 0
    obs_tokens: int = 0


def _merge_info(into: dict[str, Any], new: dict[str, Any]) -> None:
    for k, v in new.items():
        num = isinstance(v, (int, float)) and not isinstance(v, bool)
        if num and isinstance(into.get(k), (int, float)) and not isinstance(into.get(k), bool):
            into[k] += v
        else:
            into[k] = v


def _finish(r: _Run, end: str) -> None:
    r.end = end
    r.finish = "length" if end in ("length", "budget") else r.reason


def _do_step(r: _Run) -> tuple[StepResult | None, str | None]:
    try:
        res = r.env.step(r.turn_text, r.state)
        if not isinstance(res, StepResult):
            raise TypeError(f"env.step must return a StepResult, got {type(res).__name__}")
        return res, None
    except Exception as e:  # recorded on the episode: the caller makes it unscorable
        return None, _describe(e)


def multi_turn_rollout(
    engine: Engine,
    prompts: list[PromptRow],
    env_factory: Callable[[], Environment],
    params: SamplingParams,
    tokenizer,
    *,
    group_size: int,
    step: int,
    max_turns: int | None,
    max_total_tokens: int,
    generator: torch.Generator | None = None,
    system_prompt: str | None = None,
    prompt_template: str = "{prompt}",
    chat_template_kwargs: dict[str, Any] | None = None,
    max_live: int | None = None,
    max_in_flight: int = 1,
) -> list[Episode]:
    """Sample ``group_size`` multi-turn episodes per prompt, each episode on its own.

    Each episode: generate over its full context (``prompt_ids + completion so far``),
    then ``env.step(turn_text, state)`` (in a thread, so tool runs overlap), and
    again; the model calls of all episodes that are waiting are batched into one
    ``engine.generate`` call whenever the engine is free (one call per distinct set of
    env stop strings; :class:`~plainrl.rollout.batcher.RequestBatcher`), so an episode
    whose environment is slow does not hold the others. The sampled ids
    are appended with ``loss_mask`` 1 and the engine's logprobs; an observation
    is tokenised once and appended with ``loss_mask`` 0 and logprob 0.0. An
    episode ends when:
    - ``StepResult.done`` (the observation is then not inserted);
    - the model ended its turn (EOS) and the env had no observation;
    - the turn ended on ``length`` (``params.max_new_tokens`` per generate call);
    - the turn hit one of ``params.stop`` (those end episodes; env stop strings pause them);
    - the env had an observation at the last allowed turn (``min(max_turns,
      env.max_turns)``; a turn ends where an observation is inserted: resuming
      after an empty one continues the same turn);
    - the completion reached ``max_total_tokens`` (an observation that does not
      fit is cut to fit; ``finish_reason`` is ``"length"``);
    - the env raised (building it, ``reset``, ``step`` or ``final_reward``; with
      :class:`~plainrl.rollout.envs.isolated.EnvWorkers`, also a call over its time
      limit): ``"Type: message (at file:line)"`` goes to ``Episode.env.error``
      and the episode is unscorable (an env that failed to start has an empty
      completion).

    At the end of each episode its env is closed (its ``close()``, when it has one),
    also when the rollout raised.

    Generation stops at the env's ``stop`` strings plus ``params.stop``; each
    call samples at most ``min(params.max_new_tokens, room)`` tokens, room being
    what is left of the episode's ``max_total_tokens`` (episodes batched into one
    engine call share the largest limit, and each is cut to its own, which keeps
    them token-exact: a prefix of a sample is a sample with a smaller limit).

    Args:
        engine: any :class:`~plainrl.rollout.engines.base.Engine`.
        prompts: the step's prompts.
        env_factory: called once per episode for a fresh environment, with the row's
            ``env_args`` as keyword arguments (``CalculatorEnv``; none for rows without them);
            the built-in envs are stateless, so ``lambda **kw: env`` sharing one instance works too. An
            :class:`~plainrl.rollout.envs.isolated.EnvWorkers` runs each episode's env
            in a worker process, every call under a time limit.
        params: sampling settings; ``max_new_tokens`` is the per-turn limit.
        tokenizer: the policy's tokenizer (decoding turns for the env, tokenising
            observations, rendering chat observations).
        group_size: episodes per prompt (contiguous in the output).
        step: the RL step, for sample ids.
        max_turns: the most model turns per episode (None: only the env's limit).
        max_total_tokens: the most completion tokens (model + observation) per
            episode; keep ``len(prompt_ids) + max_total_tokens`` within the
            model's context.
        generator: the run's sampling generator: one draw seeds the rollout, each episode and
            each of its model calls its own stream (:mod:`plainrl.rollout.seeding`).
        system_prompt, prompt_template: the data config's, used only when the env
            re-renders the prompt (see :func:`build_env_prompt`) and for ``state.messages``.
        chat_template_kwargs: ``data.chat_template_kwargs``, for every chat rendering
            (a re-rendered prompt, chat observations).
        max_live: the most episodes in flight at once (None: all); the next one starts
            when one ends, in order. With :class:`~plainrl.rollout.envs.isolated.EnvWorkers`
            it bounds the worker processes (one per live episode).
        max_in_flight: engine calls at once (more than 1 for inference servers).
    Returns:
        ``len(prompts) * group_size`` :class:`Episode`\\ s. ``completion_ids`` [L]
        are all tokens after the prompt, ``loss_mask`` [L] is 1 exactly on model
        tokens, ``logprobs`` [L] hold the engine's logprobs there and 0.0 on
        observation tokens; ``completion_text`` decodes all of them (special
        tokens skipped). ``prompt_ids`` may differ from the PromptRow's when the
        env re-rendered the prompt. ``row`` is the prompt row; ``env`` is the
        :class:`~plainrl.types.EnvOutcome` (the summed step rewards, the error if the
        env raised, and the merged step info with ``turns``, ``generate_calls``,
        ``model_tokens``, ``observation_tokens`` and ``end_reason``).
    Raises:
        ValueError: bad ``group_size``, ``max_turns``, ``max_total_tokens`` or ``max_live``.
        RuntimeError: the engine returned the wrong number of generations, or
            ids and logprobs of different lengths.
    """
    if group_size < 1:
        raise ValueError(f"group_size must be >= 1, got {group_size}")
    if max_turns is not None and max_turns < 1:
        raise ValueError(f"max_turns must be >= 1 or None, got {max_turns}")
    flat = [q for q in prompts for _ in range(group_size)]
    pool = DaemonThreads()  # environment calls block (a worker's pipe, a tool): each in a thread
    user_stop = tuple(params.stop)

    async def runner(llm: LLM, prompt: PromptRow) -> _Run:
        r = _Run(prompt=prompt, state=EnvState(row=prompt.row), max_turns=max_turns,
                 chat_kwargs=dict(chat_template_kwargs or {}))
        loop = asyncio.get_running_loop()

        def blocking(fn, *args, **kw):
            return loop.run_in_executor(pool, functools.partial(fn, *args, **kw))

        try:
            if await blocking(_start, r, env_factory, tokenizer, system_prompt, prompt_template, max_turns):
                llm.trajectory.start(r.prompt_ids)
            while r.end is None:
                turn_params = dataclasses.replace(params, stop=tuple(dict.fromkeys(user_stop + r.stop)))
                _absorb(r, await llm.sample(turn_params), llm, tokenizer)
                res, err = await blocking(_do_step, r)
                _apply(r, res, err, llm, tokenizer, max_total_tokens, user_stop)
            if r.env is not None and r.error is None:
                await blocking(_final_reward, r)
        finally:
            if r.env is not None:
                await blocking(_close, r)
        return r

    settings = LoopSettings(max_total_tokens, max_live=max_live, max_in_flight=max_in_flight,
                            system_prompt=system_prompt, prompt_template=prompt_template,
                            chat_template_kwargs=chat_template_kwargs)
    runs = run_episodes(engine, flat, runner, params, tokenizer, settings, seed=rollout_seed(generator))
    episodes = []
    for i, run in enumerate(runs):
        if run.error is not None:  # a bug of the adapter itself: environment errors are recorded, not raised
            raise RuntimeError(f"multi-turn episode {i} failed: {run.error}")
        p = flat[i]
        episodes.append(_episode(run.value, run.llm, tokenizer, f"s{step}-r{p.source_index}-{i % group_size}",
                                 i // group_size))
    return episodes


def _start(r: _Run, env_factory: Callable[[], Environment], tokenizer, system_prompt: str | None,
           prompt_template: str, max_turns: int | None) -> bool:
    """Build the episode's environment and its prompt; False (the episode is over, the error
    recorded: unscorable) when it could not be built or reset."""
    r.prompt_ids = list(r.prompt.prompt_ids)
    try:
        r.env = env_factory(**r.prompt.row.get("env_args", {}))  # the row's own environment (data: env_args)
        prompt_ids, messages = build_env_prompt(r.prompt, r.env, tokenizer, system_prompt=system_prompt,
                                                prompt_template=prompt_template, chat_template_kwargs=r.chat_kwargs)
    except Exception as e:
        r.error = _describe(e)
        _finish(r, "env_error")
        return False
    limits = [m for m in (max_turns, getattr(r.env, "max_turns", None)) if m is not None]
    r.prompt_ids, r.state.messages = prompt_ids, messages
    r.stop = tuple(getattr(r.env, "stop", ()) or ())
    r.max_turns = min(limits) if limits else None
    return True


def _final_reward(r: _Run) -> None:
    """The environment's ``final_reward()`` (when it has one), read once the episode is over, into its
    rewards; raising fails the episode."""
    final = getattr(r.env, "final_reward", None)
    if not callable(final):
        return
    try:
        value = final()
        if value is not None:
            r.rewards.append(float(value))
    except Exception as e:  # recorded on the episode: the caller makes it unscorable
        r.error = f"env.final_reward: {_describe(e)}"
        r.end = "env_error"


def _close(r: _Run) -> None:
    close = getattr(r.env, "close", None)
    if not callable(close):
        return
    try:
        close()
    except Exception as e:  # the episode is complete; a failing close only taints it
        r.error = r.error or f"env.close: {_describe(e)}"


def _describe(e: Exception) -> str:
    # a worker's errors already say where they were raised, in the worker
    return str(e) if isinstance(e, EnvWorkerError) else describe_exception(e)


def _completion(llm: LLM) -> list[int]:
    seg = llm.trajectory.current
    return seg.completion_ids if seg is not None else []


def _absorb(r: _Run, g: Generation, llm: LLM, tokenizer) -> None:
    """Take in one generate call (the handle recorded its ids, cut to the room left)."""
    r.turn_ids, r.reason = list(g.token_ids), g.finish_reason
    r.calls += 1
    r.turn_text = tokenizer.decode(r.turn_ids, skip_special_tokens=True)
    # decoded whole, not glued from pieces: a multi-byte character can straddle a turn boundary
    r.state.text = tokenizer.decode(_completion(llm), skip_special_tokens=True)
    r.state.finish_reason = r.reason
    if r.open_assistant:
        r.state.messages[-1]["content"] += r.turn_text
    else:
        r.state.messages.append({"role": "assistant", "content": r.turn_text})
        r.open_assistant = True


def _apply(r: _Run, res: StepResult | None, err: str | None, llm: LLM, tokenizer, max_total_tokens: int,
           user_stop: tuple[str, ...]) -> None:
    if err is not None:
        r.error = err
        return _finish(r, "env_error")
    _merge_info(r.info, res.info or {})
    if res.reward is not None:
        r.rewards.append(float(res.reward))
    obs = res.observation
    if res.done:
        return _finish(r, "env_done")
    if r.reason == "stop" and user_stop:
        # the engine stops at the first stop string it sees in its recent tokens; look at the same tail
        tail = tokenizer.decode(r.turn_ids[-(max(len(s) for s in user_stop) + 4):])
        if any(s in tail for s in user_stop):
            return _finish(r, "stop")
    used = len(_completion(llm))
    if r.reason == "length":
        return _finish(r, "budget" if used >= max_total_tokens else "length")
    if not obs:
        if r.reason == "eos":
            return _finish(r, "eos")
        if used >= max_total_tokens:
            return _finish(r, "budget")
        if not r.turn_ids:  # an engine that returns nothing would loop forever
            return _finish(r, "empty_turn")
        return None  # paused on an env stop string with nothing to add: generation resumes
    if r.max_turns is not None and r.state.turn + 1 >= r.max_turns:
        return _finish(r, "max_turns")
    if isinstance(obs, str):
        text = obs
    else:
        eos_text = tokenizer.decode(r.turn_ids[-1:]) if r.reason == "eos" else ""
        text = render_chat_continuation(tokenizer, r.state.messages, list(obs), eos_text=eos_text,
                                        chat_template_kwargs=r.chat_kwargs)
    obs_ids = encode_rendered(tokenizer, text)
    room = max_total_tokens - used
    cut = len(obs_ids) >= room
    obs_ids = obs_ids[:room]
    llm.trajectory.insert(obs_ids)
    r.obs_tokens += len(obs_ids)
    r.state.turn += 1
    r.state.text = tokenizer.decode(_completion(llm), skip_special_tokens=True)
    if isinstance(obs, str):  # verbatim text continues the assistant's own message
        r.state.messages[-1]["content"] += obs
    else:
        r.state.messages.extend(dict(m) for m in obs)
        r.open_assistant = False
    if cut:
        return _finish(r, "budget")
    return None


def _episode(r: _Run, llm: LLM, tokenizer, sample_id: str, group: int) -> Episode:
    seg = llm.trajectory.current
    ids = seg.completion_ids if seg is not None else []
    mask = seg.loss_mask if seg is not None else []
    info = dict(r.info)
    info.update(turns=r.state.turn + 1, generate_calls=r.calls, model_tokens=sum(mask),
                observation_tokens=r.obs_tokens, end_reason=r.end)
    return Episode(
        sample_id=sample_id, group=group, row=r.prompt.row, prompt_ids=r.prompt_ids, completion_ids=ids,
        logprobs=seg.logprobs if seg is not None else [], loss_mask=mask, finish_reason=r.finish,
        token_versions=token_versions(seg),
        completion_text=tokenizer.decode(ids, skip_special_tokens=True),
        env=EnvOutcome(reward=sum(r.rewards) if r.rewards else None, error=r.error, info=info),
        messages=[dict(m) for m in r.state.messages],
    )


def env_metrics(episodes: list[Episode]) -> dict[str, float]:
    """Step metrics from the episodes' :class:`~plainrl.types.EnvOutcome`: ``env/<key>`` = mean of each
    numeric info value over the episodes (0 where an episode lacks it),
    ``env/end/<reason>`` = fraction of episodes that ended that way,
    ``env/error_rate`` and ``env/reward_mean`` (over episodes with a reward); for
    ``rollout.agent`` episodes also ``rollout/agent_failures``, the number of episodes whose
    agent failed (raised, timed out, returned a wrong type or never called the model), and
    ``rollout/tokens_refed_fraction``, the share of the learner's tokens (every segment's
    prompt and completion) that repeat tokens already fed for the same episode."""
    if not episodes:
        return {}
    n = len(episodes)
    outcomes = [e.env or EnvOutcome() for e in episodes]
    infos = [o.info for o in outcomes]
    sums: Counter[str] = Counter()
    for info in infos:
        for k, v in info.items():
            if isinstance(v, (int, float)) and not isinstance(v, bool):
                sums[k] += v
    out = {f"env/{k}": v / n for k, v in sorted(sums.items())}
    for reason, c in Counter(info.get("end_reason") for info in infos).items():
        out[f"env/end/{reason}"] = c / n
    out["env/error_rate"] = sum(o.error is not None for o in outcomes) / n
    rewards = [o.reward for o in outcomes if o.reward is not None]
    if rewards:
        out["env/reward_mean"] = sum(rewards) / len(rewards)
    agent = [o for o in outcomes if str(o.info.get("end_reason", "")).startswith("agent_")]
    if agent:
        out["rollout/agent_failures"] = float(sum(o.error is not None for o in agent))
        fed = sum(o.info.get("tokens_fed", 0) for o in agent)
        if fed:  # the share of the learner's tokens that repeat tokens it was already fed for the episode
            out["rollout/tokens_refed_fraction"] = 1.0 - sum(o.info.get("tokens_distinct", 0) for o in agent) / fed
    return out
