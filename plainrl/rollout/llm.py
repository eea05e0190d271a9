"""The model handle an agent gets: ``await llm.chat(messages)`` / ``await llm.generate(ids)``,
recorded token-exactly (:class:`~plainrl.rollout.trajectory.Trajectory`).

    async def agent(llm, row):
        messages = llm.prompt_messages
        reply = await llm.chat(messages, stop=["</calc>"])
        messages += [reply.message, {"role": "tool", "content": "24"}]
        reply = await llm.chat(messages)
        return 1.0 if "24" in reply.text else 0.0

See docs/agents.md.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from typing import Any, Callable, Coroutine, TypeVar

from plainrl.rollout.batcher import RequestBatcher
from plainrl.rollout.chat import encode_rendered, render_chat_continuation, render_with_tools, same_message
from plainrl.rollout.offload import message_chars, render_off_loop
from plainrl.rollout.seeding import call_seed
from plainrl.rollout.trajectory import Completion, Segment, Trajectory, Turn
from plainrl.types import Generation, SamplingParams

__all__ = ["AgentCancelled", "Completion", "ContextLengthError", "LLM", "NO_TRAIN_HEADER", "NO_TRAIN_SUFFIX",
           "SyncLLM", "Turn"]

T = TypeVar("T")
# what a call may change: the temperature is the run's (the learner's logprobs assume it)
SAMPLING_KEYS = ("max_new_tokens", "stop", "top_p", "top_k", "temperature")
# OpenAI's names for a sampling key, accepted as aliases (an agent written for the OpenAI API keeps its calls)
SAMPLING_ALIASES = {"max_tokens": "max_new_tokens", "max_completion_tokens": "max_new_tokens"}
# how a client marks a call as not trained (a title, a summary, a judge): the model name it asks for
# ends with the suffix (a harness's per-role model setting reaches it unchanged), or the header says so
NO_TRAIN_SUFFIX = "+notrain"
NO_TRAIN_HEADER = "x-plainrl-train"


class ContextLengthError(RuntimeError):
    """A model call would run past the episode's token budget or the model's context."""


class AgentCancelled(RuntimeError):
    """The episode is over (it timed out, or the rollout ended); raised at the agent's next model call."""


class LLM:
    """One episode's access to the policy; every call is recorded token-exactly.

    Attributes:
        row: the prompt's data row.
        prompt_ids: [P] the row's prompt ids, as the data pipeline rendered them.
        prompt_messages: the row's prompt as chat messages (a fresh list per read).
        tokenizer: the policy's tokenizer.
        trajectory: the recorded segments, one per lineage of calls (:class:`Trajectory`).

    Each call continues the segment whose context is the longest prefix of its own (a
    sub-agent, a side call and the main conversation each keep their own lineage), and calls
    may overlap (parallel sub-agents): each is recorded. A call made with ``train=False`` (over
    HTTP: a model name ending in :data:`NO_TRAIN_SUFFIX`, or the header :data:`NO_TRAIN_HEADER`
    ``: false``) is sampled and counted in the budget but recorded in no segment.
    ``rollout.max_total_tokens`` bounds the episode's tokens after its segments' prompts, every
    segment together. The ``k``-th call samples with the random stream ``call_seed(seed, k)``
    (:mod:`plainrl.rollout.seeding`; ``seed``: the episode's, None for unseeded), so an
    episode's samples do not depend on the other episodes.

    Agents written for the OpenAI API reach the same handle over HTTP: ``llm.openai_client()``,
    ``llm.base_url`` / ``llm.api_key``, ``llm.openai_env()``; agents written for Anthropic's
    Messages API through ``llm.anthropic_client()`` / ``llm.anthropic_env()`` (the run's gateway,
    :mod:`plainrl.rollout.gateway`, with a key of this episode's own).
    """

    def __init__(self, batcher: RequestBatcher, order: int, tokenizer, params: SamplingParams, *,
                 row: dict[str, Any], prompt_ids: list[int], prompt_messages: list[dict[str, Any]],
                 max_total_tokens: int, max_context: int | None = None,
                 chat_template_kwargs: dict[str, Any] | None = None, gateway: Any = None,
                 seed: int | None = None, on_abort: Callable[[str], None] | None = None) -> None:
        self._batcher, self._order, self._params = batcher, order, params
        self._seed, self._calls_made = seed, 0  # the episode's seed; model calls sent so far
        self._chat_kwargs = dict(chat_template_kwargs or {})  # data.chat_template_kwargs
        self.tokenizer, self.row = tokenizer, row
        self.prompt_ids = list(prompt_ids)
        self._prompt_messages = [dict(m) for m in prompt_messages]
        self.max_total_tokens, self.max_context = max_total_tokens, max_context
        self.trajectory = Trajectory()
        self._latest: Turn | None = None  # the latest trained call's record
        self._untrained_calls = self._untrained_tokens = 0  # calls marked not trained; what they sampled
        self._closed = False
        self._on_abort = on_abort  # the episode loop's: fails the episode
        self.gateway = gateway  # plainrl.rollout.gateway.Gateway: the HTTP route to this handle
        self.started = time.monotonic()
        self.model_wait_s = 0.0
        self._waiting_since: float | None = None
        self._in_flight = 0

    @property
    def structured_outputs(self) -> bool:
        """Whether the engine takes ``SamplingParams.structured_outputs`` (vLLM's; the embedded engine does not)."""
        engine = getattr(getattr(self._batcher, "calls", None), "engine", None)
        return bool(getattr(engine, "structured_outputs", False))

    @property
    def params(self) -> SamplingParams:
        """The run's sampling settings (a call may narrow ``max_new_tokens`` and add stop strings)."""
        return self._params

    @property
    def prompt_messages(self) -> list[dict[str, Any]]:
        return [dict(m) for m in self._prompt_messages]

    @property
    def token_ids(self) -> list[int]:
        """[C] the context of the latest call's segment, with its sample; [] before the first call."""
        seg = self.trajectory.current
        return seg.context if seg is not None else []

    @property
    def last(self) -> Completion | None:
        """What the latest trained call sampled (None before it returns)."""
        return self._latest.completion if self._latest is not None else None

    @property
    def last_turn(self) -> Turn | None:
        """The latest trained call's record."""
        return self._latest

    @property
    def conversation(self) -> list[dict[str, Any]] | None:
        """The latest trained chat call's messages plus its reply; None when it was ``generate``."""
        return self._latest.conversation if self._latest is not None else None

    @property
    def calls(self) -> int:
        """Model calls that returned, trained or not."""
        return sum(s.calls for s in self.trajectory.segments) + self._untrained_calls

    @property
    def untrained_calls(self) -> int:
        """Calls marked as not trained that returned."""
        return self._untrained_calls

    @property
    def closed(self) -> bool:
        """The episode is over: the next call raises :class:`AgentCancelled`."""
        return self._closed

    def close(self) -> None:
        """End the episode's calls (it ended, timed out, or the rollout is over)."""
        self._closed = True

    def agent_time(self, now: float) -> float:
        """Seconds since the episode started, minus the time spent waiting for the model."""
        waiting = now - self._waiting_since if self._waiting_since is not None else 0.0
        return now - self.started - self.model_wait_s - waiting

    def abort(self, reason: str) -> None:
        """End this episode as failed, with ``reason`` as its error (the gateway: the client
        went away mid-request); its next call raises :class:`AgentCancelled`."""
        self._closed = True
        if self._on_abort is not None:
            self._on_abort(reason)

    # ------------------------------------------------- agents written for the OpenAI API

    @property
    def api_key(self) -> str:
        """This episode's key on the run's gateway (random; requests with it are this episode's calls)."""
        return self._gateway().key_for(self)

    @property
    def base_url(self) -> str:
        """The gateway's OpenAI base URL, ``http://127.0.0.1:PORT/v1`` (loopback; the server starts on first use)."""
        return self._gateway().base_url

    def openai_env(self) -> dict[str, str]:
        """``{"OPENAI_BASE_URL": ..., "OPENAI_API_KEY": ...}``: merge into a subprocess's environment
        so an ``openai`` client made there is this episode's (and the run's ``PLAINRL_RUN_MARK``:
        :func:`plainrl.rollout.gateway.clients.client_env`)."""
        return _clients().client_env(self, "openai")

    def openai_client(self, **kwargs: Any):
        """An ``openai.AsyncOpenAI`` bound to this episode (its base URL and key). Retries are off
        (``max_retries=0``): a retried request would sample again. ``kwargs`` go to the client."""
        return _clients().make_client(self, "openai", **kwargs)

    def anthropic_env(self) -> dict[str, str]:
        """``{"ANTHROPIC_BASE_URL": ..., "ANTHROPIC_API_KEY": ...}`` (and the run's mark, as
        :meth:`openai_env`): an ``anthropic`` client made in a subprocess is this episode's."""
        return _clients().client_env(self, "anthropic")

    def anthropic_client(self, **kwargs: Any):
        """An ``anthropic.AsyncAnthropic`` bound to this episode (the gateway's root, its key);
        retries off, as :meth:`openai_client`. ``kwargs`` go to the client."""
        return _clients().make_client(self, "anthropic", **kwargs)

    def _gateway(self):
        if self.gateway is None:
            raise RuntimeError("this LLM handle has no gateway: it was built outside a rollout "
                               "(plainrl.rollout.agent_rollout gives every episode one)")
        return self.gateway

    def room(self, context: list[int], *, train: bool = True) -> int:
        """How many tokens a call on ``context`` may sample: what is left of the episode's budget
        (its segments' tokens after their prompts, the tokens this call would insert into the
        segment it continues, and what untrained calls sampled), and of the model's context."""
        used = self.trajectory.completion_tokens() + self._untrained_tokens
        seg = self.trajectory.match(context) if train else None
        if seg is not None:
            used += len(context) - len(seg.prompt_ids) - len(seg.completion_ids)
        room = self.max_total_tokens - used
        if self.max_context is not None:
            room = min(room, self.max_context - len(context))
        return room

    # ------------------------------------------------------------------ calls

    async def chat(self, messages: list[dict[str, Any]], *, tools: list[dict[str, Any]] | None = None,
                   train: bool = True, **sampling: Any) -> Completion:
        """Sample the assistant's next message after ``messages``.

        When ``messages`` is an earlier chat call's conversation, its reply (``reply.message``,
        compared by role and stripped content) and new messages after it, only the new
        messages are rendered, as the chat template continues the conversation
        (:func:`~plainrl.rollout.chat.render_chat_continuation`), and appended with loss mask 0
        to the ids that call saw and sampled: the call continues that call's segment. Any other
        ``messages`` are rendered whole (the row's own prompt gives the row's prompt ids) and
        continue the segment whose context their ids start with, or start a new one.

        Args:
            messages: chat messages ``{"role", "content", ...}``.
            tools: JSON schemas for the template's ``tools=``, rendered into a segment's
                first prompt only.
            train: False: sample, but record nothing to train (a title, a summary).
            sampling: ``max_new_tokens`` (or OpenAI's ``max_tokens`` /
                ``max_completion_tokens``; None there: no limit of its own), ``stop`` (added to
                the run's stop strings), ``top_p``, ``top_k``.
        Returns:
            A :class:`Completion`.
        Raises:
            ContextLengthError: no room is left for this call.
            ValueError / TypeError: bad messages or sampling settings; a tokenizer without
                a chat template.
            AgentCancelled: the episode is over.
        """
        return (await self.chat_turn(messages, tools, self._sampling(sampling), train=train)).completion

    async def chat_turn(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None,
                        params: SamplingParams, *, reply: Callable[[Completion], dict[str, Any]] | None = None,
                        stop_token_ids: tuple[int, ...] = (), prefix: str = "", train: bool = True) -> Turn:
        """:meth:`chat` with the sampling settings given whole (the gateway's entry).

        Earlier messages are compared with an earlier call's after dropping None-valued
        keys (an empty ``content`` beside ``tool_calls`` equals none, tool calls compare by
        name and parsed arguments); the reply also up to surrounding whitespace.

        Args:
            params: the call's settings as they are (``max_new_tokens`` is cut to the room left).
            reply: the assistant message handed back for what was sampled (default
                :attr:`Completion.message`); a later call continues the conversation when its
                messages repeat it.
            stop_token_ids: ids that end the completion (kept, finish reason ``stop``): the
                sample is cut after the first one, which is the sample a stop at that id gives.
            prefix: text the reply starts with, written into the context (not sampled, not
                trained) before sampling; ``reply`` gets the completion with its text after it
                (the gateway's forced tool calls).
            train: as :meth:`chat`.
        Returns:
            The call's record (:class:`Turn`).
        Raises:
            As :meth:`chat`.
        """
        if not isinstance(messages, list) or not all(isinstance(m, dict) and "role" in m for m in messages):
            raise TypeError("llm.chat(messages): messages must be a list of {'role': ..., 'content': ...} dicts")
        render = self.chat_render(messages, tools)  # a long context is rendered off the loop
        context = await render_off_loop(lambda: render() + (encode_rendered(self.tokenizer, prefix) if prefix else []),
                                        message_chars(messages, tools))
        asked = tuple(dict(m) for m in messages)

        def record(ctx: list[int], out: Completion) -> Turn:
            if prefix:  # the reply's text is what follows the assistant header: the prefix and the sample
                out = dataclasses.replace(out, text=prefix + out.text)
            message = reply(out) if reply is not None else out.message
            return Turn(ctx, out, message, asked, train)

        return (await self._call(context, params, stop_token_ids, train, record))[1]

    async def generate(self, token_ids: list[int], *, train: bool = True, **sampling: Any) -> Completion:
        """Sample a continuation of ``token_ids`` [C], the whole context. When it extends a
        segment's context, the ids beyond it are recorded with loss mask 0; otherwise it
        starts a new segment. Same ``train``, ``sampling`` settings and errors as :meth:`chat`."""
        return (await self.generate_turn(token_ids, self._sampling(sampling), train=train)).completion

    async def generate_turn(self, token_ids: list[int], params: SamplingParams, *,
                            stop_token_ids: tuple[int, ...] = (), train: bool = True) -> Turn:
        """:meth:`generate` with the sampling settings given whole (the gateway's entry); the
        arguments and errors of :meth:`chat_turn`."""
        if not isinstance(token_ids, list) or not all(isinstance(t, int) for t in token_ids):
            raise TypeError("llm.generate(token_ids): token_ids must be a list of ints (the whole context)")
        return (await self._call(list(token_ids), params, stop_token_ids, train,
                                 lambda ctx, out: Turn(ctx, out, trained=train)))[1]

    async def sample(self, params: SamplingParams) -> Generation:
        """Continue the current context with ``params`` as they are (``max_new_tokens`` cut to
        the room left); for loops that keep their own bookkeeping (the environment adapter)."""
        return (await self._call(self.token_ids, params, (), True, lambda ctx, out: Turn(ctx, out)))[0]

    async def _call(self, context: list[int], params: SamplingParams, stop_token_ids: tuple[int, ...], train: bool,
                    record: Callable[[list[int], Completion], Turn]) -> tuple[Generation, Turn]:
        """One model call on ``context``: fed to its segment (``train``), sampled, cut to what is
        left of the budget when it returns (parallel calls share it), recorded as ``record`` makes it."""
        if self._closed:
            raise AgentCancelled("this episode is over (it timed out, or the rollout ended)")
        if not context:
            raise ValueError("a model call needs at least one context token")
        room = self.room(context, train=train)
        if room <= 0:
            raise ContextLengthError(
                f"no room for another model call: the context has {len(context)} tokens, the episode's budget "
                f"is {self.max_total_tokens} tokens after its segments' prompts (rollout.max_total_tokens), "
                f"{self.trajectory.completion_tokens() + self._untrained_tokens} used"
                + (f", and the model's context {self.max_context} (model.max_context)" if self.max_context else ""))
        seg: Segment | None = self.trajectory.feed(context) if train else None
        params = dataclasses.replace(params, max_new_tokens=min(params.max_new_tokens, room))
        seed, self._calls_made = call_seed(self._seed, self._calls_made), self._calls_made + 1
        if self._in_flight == 0:
            self._waiting_since = time.monotonic()
        self._in_flight += 1
        try:
            gen = await self._batcher.generate(self._order, context, params, seed)
            if stop_token_ids:
                gen = _cut_at(gen, stop_token_ids)
            # parallel calls of the episode share its budget: what is left now, not when this call began
            left = self.max_total_tokens - self.trajectory.completion_tokens() - self._untrained_tokens
            gen = _cut_to(gen, max(left, 0))
            text = self.tokenizer.decode(gen.token_ids, skip_special_tokens=True)
            turn = record(list(context), Completion(text, list(gen.token_ids), [float(x) for x in gen.logprobs],
                                                    gen.finish_reason))
        except BaseException:
            if seg is not None:
                self.trajectory.release(seg)
            raise
        finally:
            self._in_flight -= 1
            if self._in_flight == 0 and self._waiting_since is not None:
                self.model_wait_s += time.monotonic() - self._waiting_since
                self._waiting_since = None
        if seg is None:
            self._untrained_calls += 1
            self._untrained_tokens += len(gen.token_ids)
        else:
            self.trajectory.add_sample(list(gen.token_ids), list(gen.logprobs), gen.finish_reason, gen.versions,
                                       seg=seg, turn=turn)
            self._latest = turn
        return gen, turn

    # ------------------------------------------------------------------ helpers

    def _sampling(self, sampling: dict[str, Any]) -> SamplingParams:
        unknown = sorted(set(sampling) - set(SAMPLING_KEYS) - set(SAMPLING_ALIASES))
        if unknown:
            raise TypeError(f"unknown sampling setting(s) {unknown}; a call takes {', '.join(SAMPLING_KEYS)} "
                            f"(or OpenAI's {' / '.join(SAMPLING_ALIASES)})")
        base, kw = self._params, _resolve_aliases(sampling)
        if "temperature" in kw and kw["temperature"] != base.temperature:
            raise ValueError(f"temperature={kw['temperature']!r}: an agent samples at the run's temperature "
                             f"({base.temperature}, rollout.temperature), which the learner's logprobs assume")
        if "stop" in kw:
            stop = kw["stop"]
            stop = (stop,) if isinstance(stop, str) else tuple(stop)
            if not all(isinstance(s, str) and s for s in stop):
                raise TypeError(f"stop={kw['stop']!r}: stop strings must be non-empty strings")
            kw["stop"] = tuple(dict.fromkeys(base.stop + stop))
        if "max_new_tokens" in kw and not (isinstance(kw["max_new_tokens"], int) and kw["max_new_tokens"] > 0):
            raise ValueError(f"max_new_tokens={kw['max_new_tokens']!r}: must be a positive int")
        return dataclasses.replace(base, **kw)

    def chat_context(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> list[int]:
        """[C] the ids a chat call on ``messages`` would sample after (nothing is recorded): the
        continuation of the latest chat call of a segment whose conversation and reply
        ``messages`` repeat (of several, the longest), else ``messages`` rendered whole.
        Raises ValueError for a tokenizer without a chat template, and whatever the template raises."""
        return self.chat_render(messages, tools)()

    def chat_render(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> Callable[[], list]:
        """:meth:`chat_context`'s segment chosen now (on the loop), its rendering returned to run in a thread."""
        best: Turn | None = None
        for seg in self.trajectory.segments:
            last = seg.last
            if last is None or last.messages is None or last.message is None:
                continue
            n = len(last.messages)
            if (len(messages) > n + 1 and (best is None or n > len(best.messages))
                    and all(same_message(a, b) for a, b in zip(messages, last.messages))
                    and same_message(messages[n], last.message, strip=True)):
                best = last
        if best is not None:
            n, reply, seen = len(best.messages), best.completion, [*best.messages, best.message]
            eos_text = self.tokenizer.decode(reply.token_ids[-1:]) if reply.finish_reason == "eos" else ""
            ids = list(best.context) + list(reply.token_ids)  # what that call saw and sampled (its segment may grow)
            return lambda: ids + encode_rendered(self.tokenizer, render_chat_continuation(
                self.tokenizer, seen, messages[n + 1:], eos_text=eos_text, chat_template_kwargs=self._chat_kwargs))
        if not tools and len(messages) == len(self._prompt_messages) and all(
                same_message(a, b) for a, b in zip(messages, self._prompt_messages)):
            return lambda: list(self.prompt_ids)
        if not getattr(self.tokenizer, "chat_template", None):
            raise ValueError("llm.chat needs a tokenizer with a chat template; use llm.generate(token_ids) instead")
        return lambda: encode_rendered(self.tokenizer, render_with_tools(self.tokenizer, messages, tools,
                                                                         self._chat_kwargs)[0])


def _resolve_aliases(sampling: dict[str, Any]) -> dict[str, Any]:
    """``sampling`` with OpenAI's names (:data:`SAMPLING_ALIASES`) turned into plainrl's; an alias
    set to None (OpenAI's "no limit") is dropped.

    Raises:
        TypeError: two names for one setting (an alias and the native name, or two aliases).
    """
    kw = {k: v for k, v in sampling.items() if k not in SAMPLING_ALIASES}
    for alias, name in SAMPLING_ALIASES.items():
        if alias not in sampling:
            continue
        given = [k for k in (name, *SAMPLING_ALIASES) if k in sampling and SAMPLING_ALIASES.get(k, k) == name]
        if len(given) > 1:
            raise TypeError(f"{' and '.join(given)} name the same setting; pass only one of them")
        if sampling[alias] is not None:
            kw[name] = sampling[alias]
    return kw


def _clients():
    """:mod:`plainrl.rollout.gateway.clients`, imported by the agents that use a vendor client (the
    gateway and the SDK types under it are imported only by runs that make one)."""
    from plainrl.rollout.gateway import clients

    return clients


def _cut_at(gen: Generation, stop_ids: tuple[int, ...]) -> Generation:
    """The generation up to and including its first id in ``stop_ids`` (finish reason ``stop``):
    a sample whose sampling would have stopped there, token for token (the ids before the
    stop, and their logprobs, do not depend on what would have followed)."""
    for i, t in enumerate(gen.token_ids):
        if t in stop_ids:
            return Generation(list(gen.token_ids[: i + 1]), list(gen.logprobs[: i + 1]), "stop",
                              None if gen.versions is None else list(gen.versions[: i + 1]))
    return gen


def _cut_to(gen: Generation, limit: int) -> Generation:
    """The generation's first ``limit`` tokens (finish reason ``length`` when cut): the sample a
    smaller ``max_new_tokens`` gives, its logprobs unchanged."""
    if len(gen.token_ids) <= limit:
        return gen
    return Generation(list(gen.token_ids[:limit]), list(gen.logprobs[:limit]), "length",
                      None if gen.versions is None else list(gen.versions[:limit]))


class SyncLLM:
    """:class:`LLM` for an agent written as a plain function, run in a thread of its own:
    ``llm.chat(...)`` / ``llm.generate(...)`` block until the model answers. Attributes are
    the wrapped handle's."""

    def __init__(self, llm: LLM, loop: asyncio.AbstractEventLoop) -> None:
        self._llm, self._loop = llm, loop

    def __getattr__(self, name: str) -> Any:
        return getattr(self._llm, name)

    def chat(self, messages: list[dict[str, Any]], **kw: Any) -> Completion:
        """Blocking :meth:`LLM.chat`."""
        return self._run(self._llm.chat(messages, **kw))

    def generate(self, token_ids: list[int], **kw: Any) -> Completion:
        """Blocking :meth:`LLM.generate`."""
        return self._run(self._llm.generate(token_ids, **kw))

    def openai_client(self, **kwargs: Any):
        """A blocking ``openai.OpenAI`` client bound to this episode (see :meth:`LLM.openai_client`)."""
        return _clients().make_client(self._llm, "openai", blocking=True, **kwargs)

    def anthropic_client(self, **kwargs: Any):
        """A blocking ``anthropic.Anthropic`` client bound to this episode (see :meth:`LLM.anthropic_client`)."""
        return _clients().make_client(self._llm, "anthropic", blocking=True, **kwargs)

    def _run(self, coro: Coroutine[Any, Any, T]) -> T:
        if self._llm.closed:
            coro.close()
            raise AgentCancelled("this episode is over (it timed out, or the rollout ended)")
        try:
            fut = asyncio.run_coroutine_threadsafe(coro, self._loop)
        except RuntimeError:  # the loop is closed: the rollout is over
            coro.close()
            raise AgentCancelled("the rollout is over") from None
        try:
            return fut.result()
        except asyncio.CancelledError:
            raise AgentCancelled("the rollout is over") from None
