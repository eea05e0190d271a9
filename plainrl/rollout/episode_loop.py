"""The one loop every multi-turn rollout runs on: each episode its own asyncio task,
model calls batched across episodes (:class:`~plainrl.rollout.batcher.RequestBatcher`).

User agents (``rollout.agent``, :mod:`plainrl.rollout.agents`) and environments
(``rollout.env``, :mod:`plainrl.rollout.multiturn`) are both *runners*:
``async runner(llm, prompt) -> value`` driving an :class:`~plainrl.rollout.llm.LLM`. The
event loop is the run's (:class:`~plainrl.rollout.event_loop.RunLoop`, in a thread of its own,
the same for every step); the engine is called from the thread that called
:func:`run_episodes`, so the model, CUDA and Ctrl-C stay where they were.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from contextvars import ContextVar
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Awaitable, Callable, Sequence

from plainrl.data import PromptRow
from plainrl.rollout.batcher import EngineCalls, RequestBatcher
from plainrl.rollout.chat import prompt_messages
from plainrl.rollout.engines.base import Engine
from plainrl.rollout.llm import LLM
from plainrl.rollout.event_loop import DaemonThreads, RunLoop
from plainrl.rollout.seeding import episode_seed
from plainrl.rollout.workers import describe_exception
from plainrl.types import SamplingParams

if TYPE_CHECKING:  # the gateway (and openai's types under it) is imported by the rollouts that make one
    from plainrl.rollout.gateway import Gateway

__all__ = ["DaemonThreads", "EpisodeLabel", "EpisodeRun", "LoopSettings", "Runner", "current_episode", "episode_labels",
           "run_episodes"]

Runner = Callable[[LLM, PromptRow], Awaitable[Any]]


@dataclass(frozen=True)
class EpisodeLabel:
    """Which sample of which rollout an episode is (:func:`current_episode` in its task).

    sample_id:  the episode's ``Episode.sample_id`` (``s{step}-r{row}-{k}``).
    group:      its group's key, unique in the process: (the rollout's serial number, the group's
                index in the rollout); the episodes of one group share their advantage baseline.
    evaluation: an episode of a held-out evaluation (scored, never trained).
    """

    sample_id: str
    group: tuple[int, int]
    evaluation: bool = False


_EPISODE: ContextVar[EpisodeLabel | None] = ContextVar("plainrl_episode", default=None)
_ROLLOUTS = itertools.count()  # the serial numbers of labelled rollouts


def current_episode() -> EpisodeLabel | None:
    """The label of the episode whose task (or a task it started) calls this; None elsewhere,
    or when its rollout gave none."""
    return _EPISODE.get()


def episode_labels(prompts: list[PromptRow], step: int, group_size: int) -> list[EpisodeLabel]:
    """The labels of a rollout's episodes: ``prompts`` holds each prompt ``group_size`` times,
    contiguous; ``step`` < 0: a held-out evaluation's."""
    serial = next(_ROLLOUTS)
    return [EpisodeLabel(f"s{step}-r{p.source_index}-{i % group_size}", (serial, i // group_size), step < 0)
            for i, p in enumerate(prompts)]


@dataclass
class EpisodeRun:
    """How one episode's runner ended.

    llm:       its handle (the recorded trajectory, the last call, the chat messages).
    value:     what the runner returned (None when it failed).
    error:     ``"Type: message (at file:line)"`` when it raised or timed out, else None.
    timed_out: it ran past the time limit and was cancelled.
    seconds:   wall-clock time from start to end.
    """

    llm: LLM
    value: Any = None
    error: str | None = None
    timed_out: bool = False
    seconds: float = 0.0


@dataclass(frozen=True)
class LoopSettings:
    """How :func:`run_episodes` runs a rollout's episodes (the config's values, set at setup).

    max_total_tokens: an episode's tokens after its segments' prompts (model and inserted tokens, every
                      segment together).
    max_context:      the model's context; a call that would run past it raises
                      :class:`~plainrl.rollout.llm.ContextLengthError` in the runner (None: unchecked).
    max_live:         episodes in flight at once (None: all).
    timeout_s:        the most seconds an episode may spend outside model calls (its own code,
                      tools); past it the episode is cancelled and fails. None: no limit.
    max_in_flight:    engine calls at once (1 for the embedded and in-process engines; more
                      for servers, which batch concurrent requests themselves).
    busy_wait_s:      how long a batch waits for an episode that just got busy with its own work
                      (:class:`RequestBatcher`).
    system_prompt, prompt_template: the data config's, for ``llm.prompt_messages``.
    chat_template_kwargs: ``data.chat_template_kwargs``, variables for every chat rendering.
    gateway:          the OpenAI-compatible HTTP route to the episodes' handles (``llm.base_url``,
                      :class:`~plainrl.rollout.gateway.Gateway`), served on the rollout's event loop
                      while its episodes run; None: one of the rollout's own (its server starts
                      only if an episode asks for its URL).
    loop:             the run's event loop (:class:`~plainrl.rollout.event_loop.RunLoop`), on which
                      every rollout's episodes run, so clients that agents' libraries cache across
                      calls keep working from step to step; None: one for this rollout alone.

    Raises:
        ValueError: bad ``max_live``, ``max_total_tokens`` or ``timeout_s``.
    """

    max_total_tokens: int
    max_context: int | None = None
    max_live: int | None = None
    timeout_s: float | None = None
    max_in_flight: int = 1
    busy_wait_s: float = 0.05
    system_prompt: str | None = None
    prompt_template: str = "{prompt}"
    chat_template_kwargs: dict[str, Any] | None = None
    gateway: Gateway | None = None
    loop: RunLoop | None = None

    def __post_init__(self) -> None:
        if self.max_live is not None and self.max_live < 1:
            raise ValueError(f"max_live must be >= 1 or None, got {self.max_live}")
        if self.max_total_tokens < 1:
            raise ValueError(f"max_total_tokens must be >= 1, got {self.max_total_tokens}")
        if self.timeout_s is not None and not self.timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0 or None, got {self.timeout_s}")


def run_episodes(
    engine: Engine,
    prompts: list[PromptRow],
    runner: Runner,
    params: SamplingParams,
    tokenizer,
    settings: LoopSettings,
    *,
    seed: int | None = None,
    labels: Sequence[EpisodeLabel] | None = None,
) -> list[EpisodeRun]:
    """Run ``runner`` once per prompt, every episode independently; return in prompt order.

    At most ``settings.max_live`` episodes run at once (a new one starts as soon as one
    ends). An episode's model calls wait in the batcher, which sends every pending call to
    the engine as one batch whenever the engine is free (see :class:`RequestBatcher`), so
    an episode that is busy (a slow tool) never holds the others.

    Args:
        engine: any :class:`~plainrl.rollout.engines.base.Engine`.
        prompts: one episode each (repeat a prompt for a group).
        runner: ``async (llm, prompt) -> value``; raising ends that episode only.
        params: the run's sampling settings (each call may narrow them).
        tokenizer: the policy's tokenizer.
        settings: budgets, limits and prompt rendering (:class:`LoopSettings`).
        seed: the rollout's seed (:func:`~plainrl.rollout.seeding.rollout_seed`): episode ``i``
            samples with ``episode_seed(seed, i)``, whatever ran beside it (None: unseeded).
        labels: one per prompt, what :func:`current_episode` gives in that episode's task (None: none).
    Returns:
        One :class:`EpisodeRun` per prompt.
    Raises:
        Exception: whatever the engine raised (the rollout stops: no episode can go on).
    """
    if not prompts:
        return []
    s = settings
    calls = EngineCalls(engine, max_in_flight=s.max_in_flight)
    gateway, own_gateway = s.gateway, s.gateway is None
    if gateway is None:
        from plainrl.rollout.gateway import Gateway

        gateway = Gateway(model=str(getattr(tokenizer, "name_or_path", "") or "plainrl"), max_model_len=s.max_context)
    run_loop, own_loop = s.loop, s.loop is None
    if run_loop is None:
        run_loop = RunLoop()

    def make_llm(batcher: RequestBatcher, i: int, on_abort: Callable[[str], None]) -> LLM:
        p = prompts[i]
        return LLM(batcher, i, tokenizer, params, row=p.row, prompt_ids=p.prompt_ids,
                   prompt_messages=_messages(p, s.system_prompt, s.prompt_template),
                   max_total_tokens=s.max_total_tokens, max_context=s.max_context,
                   chat_template_kwargs=s.chat_template_kwargs, gateway=gateway, seed=episode_seed(seed, i),
                   on_abort=on_abort)

    async def main() -> list[EpisodeRun]:
        # the run's loop and gateway: served between rollouts too (503 to claims, no connection reset)
        async with gateway.serving(keep=not own_loop and not own_gateway):
            return await _run_all(prompts, runner, make_llm, calls, s.max_live or len(prompts), s.timeout_s,
                                  s.busy_wait_s, labels)

    try:
        done = run_loop.submit(main())
        done.add_done_callback(lambda _: calls.stop())
        try:
            calls.serve(done=done.done)
        except BaseException:  # Ctrl-C while the engine ran, or a stop while the loop was blocked:
            done.cancel()  # the episodes are cancelled on the loop (closing it waits for them, 5 s at most)
            raise
        return done.result()
    finally:
        if own_gateway:
            gateway.close()
        if own_loop:
            run_loop.close()


def _messages(p: PromptRow, system_prompt: str | None, prompt_template: str) -> list[dict[str, Any]]:
    try:
        return prompt_messages(p.row, system_prompt, prompt_template)
    except Exception:  # a row the data pipeline rendered some other way: llm.prompt_ids still serve
        return []


async def _run_all(prompts: list[PromptRow], runner: Runner,
                   make_llm: Callable[[RequestBatcher, int, Callable[[str], None]], LLM],
                   calls: EngineCalls, max_live: int, timeout_s: float | None, busy_wait_s: float,
                   labels: Sequence[EpisodeLabel] | None) -> list[EpisodeRun]:
    batcher = RequestBatcher(calls, busy_wait_s=busy_wait_s)
    slots = asyncio.Semaphore(max_live)
    runs: list[EpisodeRun | None] = [None] * len(prompts)
    expired: dict[int, asyncio.Future] = {}  # live episodes: set when one runs out of time
    live: dict[int, LLM] = {}

    async def one(i: int) -> None:
        async with slots:
            ended = asyncio.get_running_loop().create_future()  # None when out of time, else why it was aborted
            llm = make_llm(batcher, i, lambda reason: None if ended.done() else ended.set_result(reason))
            run = runs[i] = EpisodeRun(llm)
            batcher.start_episode(i)
            live[i], expired[i] = llm, ended
            if labels is not None:
                _EPISODE.set(labels[i])  # this task's context, copied into the runner's
            inner = asyncio.create_task(runner(llm, prompts[i]), name=f"episode {i}")
            try:
                await asyncio.wait({inner, expired[i]}, return_when=asyncio.FIRST_COMPLETED)
                if inner.done():
                    try:
                        run.value = inner.result()
                    except asyncio.CancelledError:
                        run.error = "CancelledError: the episode was cancelled"
                    except Exception as e:
                        run.error = describe_exception(e)
                else:  # out of time or aborted: cancelled, and not waited for (it may not stop at once)
                    reason = ended.result()
                    run.timed_out = reason is None
                    run.error = reason or (f"TimeoutError: the episode spent more than {timeout_s:g} s outside "
                                           "model calls (rollout.agent_timeout_s) and was cancelled")
                    inner.cancel()
                    inner.add_done_callback(_consume)
            finally:
                if not inner.done():  # the rollout itself is being cancelled
                    inner.cancel()
                llm.close()
                run.seconds = time.monotonic() - llm.started
                live.pop(i, None)
                expired.pop(i, None)
                batcher.end_episode(i)

    async def watchdog() -> None:
        interval = min(0.1, timeout_s / 10)
        while True:
            await asyncio.sleep(interval)
            now = time.monotonic()
            for i, llm in list(live.items()):
                if llm.agent_time(now) > timeout_s and not expired[i].done():
                    llm.close()
                    expired[i].set_result(None)

    batching = asyncio.create_task(batcher.run())
    helpers = [batching] + ([asyncio.create_task(watchdog())] if timeout_s is not None else [])
    episodes = asyncio.gather(*(one(i) for i in range(len(prompts))))
    try:
        await asyncio.wait({episodes, batching}, return_when=asyncio.FIRST_COMPLETED)
        if batcher.fatal is not None:
            raise batcher.fatal
        if batching.done():  # the batcher cannot stop without an engine failure: a bug
            batching.result()
            raise RuntimeError("the request batcher stopped while episodes were running")
        await episodes
    finally:
        for t in helpers:
            t.cancel()
        if not episodes.done():
            episodes.cancel()
        await asyncio.gather(episodes, *helpers, return_exceptions=True)
    return runs  # type: ignore[return-value]


def _consume(task: asyncio.Task) -> None:
    if not task.cancelled():
        task.exception()
