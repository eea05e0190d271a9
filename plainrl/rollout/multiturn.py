"""Multi-turn rollout: model turns and environment observations, token-exact.

Every episode's sequence is ``prompt_ids + completion_ids``, where the completion
interleaves model tokens (``loss_mask`` 1, the engine's logprobs) and observation
tokens (``loss_mask`` 0, logprob 0.0). Each turn the engine is given exactly that
sequence so far, so the ids the learner trains on are the ids the engine saw and
sampled: model tokens are never decoded and re-tokenised, and each observation
is tokenised once, on its own, when it is inserted.
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from collections.abc import Mapping
from typing import Any, Callable

import torch

from plainrl.data import PromptRow
from plainrl.rollout.engines.base import Engine
from plainrl.rollout.envs.base import EnvState, Environment, StepResult
from plainrl.rollout.envs.isolated import EnvWorkerError
from plainrl.rollout.chat import build_env_prompt, encode_rendered, render_chat_continuation
from plainrl.types import EnvOutcome, Episode, FinishReason, Generation, SamplingParams
from plainrl.rollout.workers import describe_exception

__all__ = ["env_metrics", "multi_turn_rollout"]


# --------------------------------------------------------------------------- rollout


@dataclass
class _Run:
    """One episode in flight."""

    prompt: PromptRow
    sample_id: str
    group: int
    env: Environment | None  # None: the factory raised
    prompt_ids: list[int]
    state: EnvState
    stop: tuple[str, ...]
    max_turns: int | None
    ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    mask: list[int] = field(default_factory=list)
    turn_ids: list[int] = field(default_factory=list)
    turn_text: str = ""
    reason: FinishReason = "length"
    end: str | None = None
    finish: FinishReason = "length"
    rewards: list[float] = field(default_factory=list)
    info: dict[str, Any] = field(default_factory=dict)
    error: str | None = None
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
    chat_template_kwargs: Mapping[str, Any] | None = None,
    max_workers: int = 8,
    max_live: int | None = None,
) -> list[Episode]:
    """Sample ``group_size`` multi-turn episodes per prompt, all episodes batched per turn.

    Each round: one ``engine.generate`` call over the full context
    (``prompt_ids + completion so far``) of every live episode (one call per
    distinct set of env stop strings), then ``env.step(turn_text, state)`` for
    each of them (in a thread pool: sandboxed tool runs overlap). The sampled ids
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
    - the env raised (building it, ``reset`` or ``step``; with
      :class:`~plainrl.rollout.envs.isolated.EnvWorkers`, also a call over its time
      limit): ``"Type: message (at file:line)"`` goes to ``Episode.env.error``
      and the episode is unscorable (an env that failed to start has an empty
      completion).

    At the end every episode's env is closed (its ``close()``, when it has one),
    also when the rollout raised.

    Generation stops at the env's ``stop`` strings plus ``params.stop``; each
    call samples at most ``min(params.max_new_tokens, room)`` tokens, room being
    what is left of ``max_total_tokens`` for the roomiest episode of the call
    (the others' turns are cut to their own room, which keeps them token-exact:
    a prefix of a sample is a sample with a smaller limit).

    Args:
        engine: any :class:`~plainrl.rollout.engines.base.Engine`.
        prompts: the step's prompts.
        env_factory: called once per episode for a fresh environment
            (``lambda: CalculatorEnv()``); the built-in envs are stateless, so
            ``lambda: env`` sharing one instance works too. An
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
        generator: RNG for sampling.
        system_prompt, prompt_template: the data config's, used only when the env
            re-renders the prompt (see :func:`build_env_prompt`) and for ``state.messages``.
        chat_template_kwargs: ``data.chat_template_kwargs``, for every chat rendering
            (a re-rendered prompt, chat observations).
        max_workers: threads running ``env.step`` concurrently.
        max_live: the most episodes in flight at once (None: all); more run in
            waves of this many, in order. With :class:`~plainrl.rollout.envs.isolated.EnvWorkers`
            it bounds the worker processes (one per live episode).
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
    if max_total_tokens < 1:
        raise ValueError(f"max_total_tokens must be >= 1, got {max_total_tokens}")
    if max_turns is not None and max_turns < 1:
        raise ValueError(f"max_turns must be >= 1 or None, got {max_turns}")

    if max_live is not None and max_live < 1:
        raise ValueError(f"max_live must be >= 1 or None, got {max_live}")
    flat = [q for q in prompts for _ in range(group_size)]
    chat_kwargs = dict(chat_template_kwargs or {})
    wave = max_live or max(1, len(flat))
    episodes: list[Episode] = []
    for first in range(0, len(flat), wave):
        runs: list[_Run] = []
        try:
            for i in range(first, min(first + wave, len(flat))):
                p = flat[i]
                runs.append(_start(p, f"s{step}-r{p.source_index}-{i % group_size}", i // group_size, env_factory,
                                   tokenizer, max_turns, system_prompt, prompt_template, chat_kwargs))
            _run_turns(runs, engine, params, tokenizer, max_total_tokens, generator, max_workers, chat_kwargs)
        finally:
            for r in runs:
                _close(r)
        episodes += [_episode(r, tokenizer) for r in runs]
    return episodes


def _start(p: PromptRow, sample_id: str, group: int, env_factory: Callable[[], Environment], tokenizer,
           max_turns: int | None, system_prompt: str | None, prompt_template: str,
           chat_kwargs: dict[str, Any]) -> _Run:
    """A new episode: a fresh environment and its prompt; one whose environment could not
    be built or reset is over at once, with the error recorded (unscorable)."""
    env = None
    try:
        env = env_factory()
        prompt_ids, messages = build_env_prompt(p, env, tokenizer, system_prompt=system_prompt,
                                                prompt_template=prompt_template, chat_template_kwargs=chat_kwargs)
    except Exception as e:
        r = _Run(prompt=p, sample_id=sample_id, group=group, env=env, prompt_ids=list(p.prompt_ids),
                 state=EnvState(row=p.row), stop=(), max_turns=max_turns)
        r.error = _describe(e)
        _finish(r, "env_error")
        return r
    limits = [m for m in (max_turns, getattr(env, "max_turns", None)) if m is not None]
    return _Run(prompt=p, sample_id=sample_id, group=group, env=env, prompt_ids=prompt_ids,
                state=EnvState(row=p.row, messages=messages), stop=tuple(getattr(env, "stop", ()) or ()),
                max_turns=min(limits) if limits else None)


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


def _run_turns(runs: list[_Run], engine: Engine, params: SamplingParams, tokenizer, max_total_tokens: int,
               generator: torch.Generator | None, max_workers: int, chat_kwargs: dict[str, Any]) -> None:
    """Generate and step every live episode, a round at a time, until all have ended."""
    user_stop = tuple(params.stop)
    with ThreadPoolExecutor(max_workers=max(1, min(max_workers, len(runs) or 1)),
                            thread_name_prefix="plainrl-env") as pool:
        while live := [r for r in runs if r.end is None]:
            by_stop: dict[tuple[str, ...], list[_Run]] = {}
            for r in live:
                by_stop.setdefault(r.stop, []).append(r)
            for stop, group in by_stop.items():
                room = max(max_total_tokens - len(r.ids) for r in group)
                turn_params = dataclasses.replace(
                    params, max_new_tokens=min(params.max_new_tokens, room),
                    stop=tuple(dict.fromkeys(user_stop + stop)),
                )
                gens = engine.generate([r.prompt_ids + r.ids for r in group], turn_params, generator=generator)
                if len(gens) != len(group):
                    raise RuntimeError(f"engine returned {len(gens)} generations for {len(group)} prompts")
                for r, g in zip(group, gens):
                    _absorb(r, g, tokenizer, max_total_tokens)
            results = list(pool.map(_do_step, live))
            for r, (res, err) in zip(live, results):
                _apply(r, res, err, tokenizer, max_total_tokens, user_stop, chat_kwargs)


def _absorb(r: _Run, g: Generation, tokenizer, max_total_tokens: int) -> None:
    ids, lps, reason = list(g.token_ids), [float(x) for x in g.logprobs], g.finish_reason
    if len(ids) != len(lps):
        raise RuntimeError(f"engine returned {len(ids)} token ids but {len(lps)} logprobs")
    room = max_total_tokens - len(r.ids)
    if len(ids) > room:
        ids, lps, reason = ids[:room], lps[:room], "length"
    r.ids += ids
    r.logprobs += lps
    r.mask += [1] * len(ids)
    r.turn_ids, r.reason = ids, reason
    r.calls += 1
    r.turn_text = tokenizer.decode(ids, skip_special_tokens=True)
    # decoded whole, not glued from pieces: a multi-byte character can straddle a turn boundary
    r.state.text = tokenizer.decode(r.ids, skip_special_tokens=True)
    r.state.finish_reason = reason
    if r.open_assistant:
        r.state.messages[-1]["content"] += r.turn_text
    else:
        r.state.messages.append({"role": "assistant", "content": r.turn_text})
        r.open_assistant = True


def _apply(r: _Run, res: StepResult | None, err: str | None, tokenizer, max_total_tokens: int,
           user_stop: tuple[str, ...], chat_kwargs: dict[str, Any]) -> None:
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
    if r.reason == "length":
        return _finish(r, "budget" if len(r.ids) >= max_total_tokens else "length")
    if not obs:
        if r.reason == "eos":
            return _finish(r, "eos")
        if len(r.ids) >= max_total_tokens:
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
                                        chat_template_kwargs=chat_kwargs)
    obs_ids = encode_rendered(tokenizer, text)
    room = max_total_tokens - len(r.ids)
    cut = len(obs_ids) >= room
    obs_ids = obs_ids[:room]
    r.ids += obs_ids
    r.logprobs += [0.0] * len(obs_ids)
    r.mask += [0] * len(obs_ids)
    r.obs_tokens += len(obs_ids)
    r.state.turn += 1
    r.state.text = tokenizer.decode(r.ids, skip_special_tokens=True)
    if isinstance(obs, str):  # verbatim text continues the assistant's own message
        r.state.messages[-1]["content"] += obs
    else:
        r.state.messages.extend(dict(m) for m in obs)
        r.open_assistant = False
    if cut:
        return _finish(r, "budget")
    return None


def _episode(r: _Run, tokenizer) -> Episode:
    info = dict(r.info)
    info.update(turns=r.state.turn + 1, generate_calls=r.calls, model_tokens=sum(r.mask),
                observation_tokens=r.obs_tokens, end_reason=r.end)
    return Episode(
        sample_id=r.sample_id, group=r.group, row=r.prompt.row, prompt_ids=r.prompt_ids, completion_ids=r.ids,
        logprobs=r.logprobs, loss_mask=r.mask, finish_reason=r.finish,
        completion_text=tokenizer.decode(r.ids, skip_special_tokens=True),
        env=EnvOutcome(reward=sum(r.rewards) if r.rewards else None, error=r.error, info=info),
        messages=[dict(m) for m in r.state.messages],
    )


def env_metrics(episodes: list[Episode]) -> dict[str, float]:
    """Step metrics from the episodes' :class:`~plainrl.types.EnvOutcome`: ``env/<key>`` = mean of each
    numeric info value over the episodes (0 where an episode lacks it),
    ``env/end/<reason>`` = fraction of episodes that ended that way,
    ``env/error_rate`` and ``env/reward_mean`` (over episodes with a reward)."""
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
    return out
