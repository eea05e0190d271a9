"""What every engine over inference servers shares, whatever serves the model (vLLM
started by ``plainrl serve``, SGLang, any OpenAI-compatible server): the HTTP client and
its timeouts, one call with its retry, the pool of servers (least outstanding requests,
failover, :mod:`~plainrl.rollout.engines.router`), concurrent sampling, and the weight
push to every live server in parallel that takes dead servers back once they answer.

A backend says how a server is checked (:meth:`ServedEngine._check_backend`), how one
request maps onto its API (:meth:`ServedEngine._complete`) and how full weights reach it
(:meth:`ServedEngine._full_push`); LoRA adapters go through the load/unload endpoints its
``lora_endpoints`` name. Every call has a timeout; a request that fails on the network or
with a server error is retried once (a timeout is not: the server is presumed hung), then
its server is marked dead and the request goes to another.
"""

from __future__ import annotations

import dataclasses
import json
import random
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator, TypeVar

import httpx
import torch

from plainrl.rollout.engines.requests import EngineError, Request, make_requests
from plainrl.rollout.engines.router import ServerDown, ServerPool
from plainrl.rollout.engines.sync import AdapterVersions, SyncMode
from plainrl.types import Generation, SamplingParams

T = TypeVar("T")
# text whose tokenisation tells tokenizers apart (digits, spaces, code, non-ASCII, a chat marker)
TOKENIZER_PROBE = "Hello, world! 12 + 345 = 357.\n  def f(x):\treturn x**2  # café 東京 <|im_start|>user"


RETRY_BASE_S = 0.5  # the first retry waits 0.25-0.5 s: a restarting or overloaded server gets a moment
RETRY_CAP_S = 8.0  # the longest backoff of a retry
RETRY_AFTER_CAP_S = 60.0  # the longest Retry-After honoured (as the openai client: a longer one is ignored)


def retry_delay_s(attempt: int, retry_after: str | None = None, *, rand: Callable[[], float] = random.random) -> float:
    """Seconds to wait before retrying a call whose try number ``attempt`` (0-based) failed.

    The server's ``Retry-After`` when it sends one in seconds (RFC 9110, 10.2.3; at most
    :data:`RETRY_AFTER_CAP_S`); else exponential backoff with "equal jitter" (Brooker 2015,
    "Exponential Backoff And Jitter", AWS Architecture Blog): with
    d = min(RETRY_CAP_S, RETRY_BASE_S * 2**attempt), wait d/2 + U(0, d/2), so clients that failed
    together do not come back together, and none comes back at once.

    Args:
        rand: a source of U(0, 1) draws (a seeded ``random.Random().random`` in tests).
    """
    if retry_after is not None:
        try:
            seconds = float(retry_after)
        except ValueError:  # an HTTP-date: the backoff instead
            seconds = -1.0
        if 0.0 <= seconds <= RETRY_AFTER_CAP_S:
            return seconds
    d = min(RETRY_CAP_S, RETRY_BASE_S * 2 ** attempt)
    return d / 2 + rand() * d / 2


@dataclass(frozen=True)
class PushedWeights:
    """What a weight push left on the servers, for processes that sample without having pushed
    (under torchrun rank 0 pushes and every rank samples: :meth:`ServedEngine.follow`).

    adapter: the LoRA adapter name every request must name (None: full weights, which the
             servers serve under the base model's name).
    servers: indices (into ``urls``) of the servers that hold the pushed weights.
    """

    adapter: str | None
    servers: tuple[int, ...]


class ServedEngine:
    """The :class:`~plainrl.rollout.engines.base.Engine` protocol over inference servers.

    Subclasses set ``backend`` (the ``rollout.remote.backend`` name), ``start_hint`` (how a
    user starts a server, quoted in errors) and ``lora_endpoints`` (load, unload), and
    implement :meth:`_complete`, :meth:`_check_backend` and :meth:`_full_push`.

    Args:
        urls: server base URLs, e.g. ``["http://127.0.0.1:8000"]``; a group's request
            goes to one server, the one with the fewest requests in flight.
        tokenizer: the trainer's; each server's tokenizer must encode a probe text to the
            same ids.
        sync: ``lora`` or ``full`` (None for a read-only engine).
        timeout_s / connect_timeout_s: per request (seconds); health checks take
            ``connect_timeout_s`` so a hung server cannot hold a sync for ``timeout_s``.
        shared_dir: a directory the servers can read (adapters, weight files); default a
            temporary directory on this machine.
        max_model_len: the trainer's context (``model.max_context``); a server with less fails.
        model: the served model's name to request; default the first ``/v1/models`` lists.
        api_key: sent as ``Authorization: Bearer ...`` on every call.

    Raises:
        EngineError: no URL, or a server is unreachable, serves another tokenizer or a
            shorter context, or lacks what the backend needs (:meth:`_check_backend`).
    """

    backend = "served"
    interruptible = False  # True: _stream aborts a request mid-stream (generate_until)
    section = "rollout.remote"  # the config section quoted in errors
    start_hint = ""
    lora_endpoints: tuple[str, str] = ("", "")

    def __init__(self, urls: list[str], tokenizer, *, sync: SyncMode | None, timeout_s: float = 600.0,
                 connect_timeout_s: float = 10.0, shared_dir: str | None = None, max_model_len: int = 1024,
                 model: str | None = None, api_key: str | None = None):
        if not urls:
            raise EngineError(f"{self.section}.urls is empty; give at least one server's URL ({self.start_hint})")
        self.urls = [u.rstrip("/") for u in urls]
        self.sync = sync
        self.client = httpx.Client(timeout=httpx.Timeout(timeout_s, connect=connect_timeout_s),
                                   limits=httpx.Limits(max_connections=None, max_keepalive_connections=64),
                                   headers={"Authorization": f"Bearer {api_key}"} if api_key else None)
        self._tokenizer, self._max_model_len, self._model = tokenizer, max_model_len, model
        self._probe_timeout = connect_timeout_s  # start-up checks: a hung server must not hold a sync for timeout_s
        try:
            self.models = [self._check(url) for url in self.urls]  # the served model's name, per server
        except BaseException:
            self.client.close()
            raise
        self.pool = ServerPool(self.urls, restart_hint=self.start_hint)
        self._adapters = AdapterVersions(shared_dir)  # adapters and weight files
        self._lora: str | None = None  # the adapter name requests ask for, once synced
        # adapter names unique to this engine: a server outlives runs (and may serve several), and
        # vLLM refuses to load a name it already holds (a previous run's last adapter stays loaded)
        self._lora_prefix = f"plainrl-{uuid.uuid4().hex[:8]}"

    # -- what a backend provides ----------------------------------------------------------
    def _complete(self, server: int, req: Request, params: SamplingParams) -> list[Generation]:
        """Sample ``len(req.rows)`` completions of ``req.prompt_ids`` on ``server`` (one HTTP request)."""
        raise NotImplementedError

    def _stream(self, server: int, req: Request, params: SamplingParams,
                interrupt: threading.Event) -> list[tuple[Generation, bool]]:
        """:meth:`_complete` streamed, closed once ``interrupt`` is set (``interruptible`` backends)."""
        raise NotImplementedError

    def _check_backend(self, url: str) -> None:
        """What this backend needs of a server beyond health, tokenizer and context.

        Raises:
            EngineError: the server lacks it (naming the URL and how to start one that has it).
        """

    def _full_push(self, model: torch.nn.Module) -> AbstractContextManager[Callable[[str], None]]:
        """A context yielding ``push(url)``, which loads ``model``'s whole merged state on one
        server; the context removes what it wrote once every server is done."""
        raise NotImplementedError

    # -- HTTP -------------------------------------------------------------------------
    def _call(self, method: str, url: str, path: str, *, retries: int = 1, **kwargs) -> httpx.Response:
        """One HTTP call with the client's timeouts.

        Raises:
            ServerDown: no answer (connection error, timeout) or a 5xx, after ``retries`` more
                tries for anything but a timeout, each after :func:`retry_delay_s`.
            EngineError: a 4xx answer (the request is wrong; retrying cannot help), or a 429
                (rate limited) still after ``retries`` more tries.
        """
        for attempt in range(retries + 1):
            try:
                response = self.client.request(method, url + path, **kwargs)
            except httpx.HTTPError as e:
                if attempt < retries and not isinstance(e, httpx.TimeoutException):
                    time.sleep(retry_delay_s(attempt))
                    continue
                raise ServerDown(f"inference server {url}: {method} {path} failed after {attempt + 1} "
                                 f"attempt(s): {type(e).__name__}: {e}; is it running? {self.start_hint}") from e
            if (response.status_code >= 500 or response.status_code == 429) and attempt < retries:
                # an overloaded or restarting server: hammering it at once makes it worse
                time.sleep(retry_delay_s(attempt, response.headers.get("retry-after")))
                continue
            if response.status_code >= 500:
                raise ServerDown(f"inference server {url}: {method} {path} answered {response.status_code}: "
                                 f"{response.text[:500]}")
            if response.status_code >= 400:
                raise EngineError(f"inference server {url}: {method} {path} answered {response.status_code}: "
                                  f"{response.text[:500]}")
            return response
        raise AssertionError("unreachable")

    @contextmanager
    def _sse(self, url: str, path: str, body: dict) -> Iterator[Iterator[dict]]:
        """POST ``body`` and yield the server-sent events' JSON objects as they arrive (until
        ``[DONE]``); leaving the context closes the connection, which a vLLM server takes as
        the request's abort. No retry: a streamed answer cannot be resumed.

        Raises:
            ServerDown: no answer, a dropped stream or a 5xx. EngineError: a 4xx.
        """
        try:
            with self.client.stream("POST", url + path, json=body) as response:
                if response.status_code >= 400:
                    text = response.read().decode(errors="replace")[:500]
                    error = ServerDown if response.status_code >= 500 else EngineError
                    raise error(f"inference server {url}: POST {path} answered {response.status_code}: {text}")

                def events() -> Iterator[dict]:
                    for line in response.iter_lines():
                        if line.startswith("data:"):
                            data = line[5:].strip()
                            if data == "[DONE]":
                                return
                            yield json.loads(data)

                yield events()
        except httpx.HTTPError as e:
            raise ServerDown(f"inference server {url}: POST {path} failed: {type(e).__name__}: {e}; is it "
                             f"running? {self.start_hint}") from e

    def _served_model(self, url: str, *, retries: int = 1, unique: bool = False) -> dict:
        """The ``/v1/models`` entry of the model to request (``model`` or the first listed).

        Args:
            unique: without ``model``, a server listing several models is an error (a vLLM
                server lists its LoRA adapters too: there the base comes first).

        Raises:
            EngineError: ``model`` is not served there (or not named where ``unique`` needs it),
                or its context is below ``max_model_len``.
        """
        served = self._call("GET", url, "/v1/models", retries=retries, timeout=self._probe_timeout).json()["data"]
        names = [m["id"] for m in served]
        if unique and self._model is None and len(names) > 1:
            raise EngineError(f"inference server {url} serves {len(names)} models ({names[:5]}...); name one "
                              f"with {self.section}.model")
        entry = served[names.index(self._model)] if self._model in names else None
        if entry is None and self._model is not None:
            raise EngineError(f"inference server {url} does not serve {self.section}.model={self._model!r}; "
                              f"it serves {names}")
        entry = entry or served[0]
        if entry.get("max_model_len") is not None and entry["max_model_len"] < self._max_model_len:
            raise EngineError(f"inference server {url} serves {entry['id']!r} with max_model_len="
                              f"{entry['max_model_len']}, less than {self._context_need()}")
        return entry

    def _context_need(self) -> str:
        """What the context a server must have is, for errors."""
        return f"model.max_context={self._max_model_len}"

    def _check(self, url: str) -> str:
        """A server's start-up check: healthy, the trainer's tokenizer (a probe text must encode
        to the same ids through its ``/tokenize``), the context, then :meth:`_check_backend`.
        Returns the served model's name."""
        self._call("GET", url, "/health", retries=0, timeout=self._probe_timeout)
        name = self._served_model(url)["id"]
        ids = self._call("POST", url, "/tokenize", timeout=self._probe_timeout,
                         json={"model": name, "prompt": TOKENIZER_PROBE, "add_special_tokens": False}).json()["tokens"]
        ours = self._tokenizer(TOKENIZER_PROBE, add_special_tokens=False)["input_ids"]
        if ids != ours:
            raise EngineError(f"inference server {url} serves {name!r}, whose tokenizer differs from the "
                              f"trainer's ({self._tokenizer.name_or_path}): a probe text gave {ids[:12]}... there, "
                              f"{ours[:12]}... here; serve the trainer's model ({self.start_hint})")
        self._check_backend(url)
        return name

    # -- sampling -----------------------------------------------------------------------
    def generate(self, prompts: list[list[int]], params: SamplingParams, *,
                 seeds: list[int] | None = None) -> list[Generation]:
        """Sample one completion per prompt; requests run concurrently so each server
        batches them. Each prompt's seed goes with its request (the request's ``seed``; see
        :func:`~plainrl.rollout.engines.requests.make_requests`). See
        :meth:`plainrl.rollout.engines.hf.HFEngine.generate`.

        Raises:
            EngineError: every server failed, or a server refused a request (4xx).
        """
        if not prompts:
            return []
        return self._run(make_requests(prompts, seeds), len(prompts), lambda server, r: self._complete(server, r, params))

    def generate_until(self, prompts: list[list[int]], params: SamplingParams, *, budgets: list[int],
                       interrupt: threading.Event, seeds: list[int] | None = None) -> list[tuple[Generation, bool]]:
        """Sample as :meth:`generate`, each prompt with its own token budget (``budgets[i]``
        replaces ``params.max_new_tokens``), until done or until ``interrupt`` is set: then every
        request still open is aborted at its next streamed token (closed, so the server drops
        it) and returns the tokens it has. Partial rollouts' abort
        (:class:`~plainrl.rollout.engines.partial.PartialEngine`). Returns ``(generation, done)``
        per prompt; an interrupted one is not done (its ``finish_reason`` is meaningless).

        Raises:
            EngineError: the backend cannot stream (``interruptible`` False), or as :meth:`generate`.
        """
        if not self.interruptible:
            raise EngineError(f"rollout.remote.backend={self.backend} cannot abort a request mid-stream; use "
                              "rollout.partial_by=chunks")
        if not prompts:
            return []
        requests = []  # a request's samples share one budget: split any whose rows differ
        for r in make_requests(prompts, seeds):
            by_budget: dict[int, list[int]] = {}
            for row in r.rows:
                by_budget.setdefault(budgets[row], []).append(row)
            requests += [Request(r.prompt_ids, rows, r.seed) for rows in by_budget.values()]
        return self._run(requests, len(prompts), lambda server, r: self._stream(
            server, r, dataclasses.replace(params, max_new_tokens=budgets[r.rows[0]]), interrupt))

    def _run(self, requests: list[Request], size: int, complete: Callable[[int, Request], list[T]]) -> list[T]:
        """``complete(server, request)`` of every request, concurrently (so each server batches
        them), on the server :class:`ServerPool` picks; the answers in prompt order."""
        out: list[T | None] = [None] * size
        with ThreadPoolExecutor(max_workers=min(64, len(requests))) as pool:
            futures = [pool.submit(self.pool.run, lambda server, r=r: complete(server, r)) for r in requests]
            for req, fut in zip(requests, futures):
                gens = fut.result()
                if len(gens) != len(req.rows):
                    raise EngineError(f"a {self.backend} server returned {len(gens)} completions for a request "
                                      f"of {len(req.rows)}")
                for row, gen in zip(req.rows, gens):
                    out[row] = gen
        return out  # type: ignore[return-value]

    # -- weight sync ----------------------------------------------------------------------
    def load_weights(self, model: torch.nn.Module) -> None:
        """Push the learner's weights to every server, in parallel: the adapter under a new
        name (the previous one is unloaded), or the whole merged state dict
        (:meth:`_full_push`). A server that fails is marked dead; dead servers that answer
        their start-up check again get the weights and are used again.

        Raises:
            EngineError: no server holds the new weights.
        """
        if self.sync == "lora":
            version, path = self._adapters.save(model)
            name, previous = f"{self._lora_prefix}-v{version}", self._lora

            def push(url: str) -> None:
                self._call("POST", url, self.lora_endpoints[0], json={"lora_name": name, "lora_path": str(path)})
                if previous is not None:
                    self._unload(url, previous)

            self._push_all(push)
            self._lora = name
            return
        with self._full_push(model) as push:
            self._push_all(push)

    def load_adapter(self, name: str, path: str | Path) -> PushedWeights:
        """Load the peft adapter directory ``path`` (readable by the servers) on every live server
        as adapter ``name``, beside those already loaded (several policies on one base, as
        Tinker's samplers); sample it with :meth:`follow` of the result. The LoRA push of
        :meth:`load_weights`, for an adapter saved elsewhere.

        Raises:
            EngineError: no server holds it, or a server refused it (4xx: another rank than
                its ``--max-lora-rank``, LoRA off, a name it already has).
        """
        self._push_all(lambda url: self._call("POST", url, self.lora_endpoints[0],
                                              json={"lora_name": name, "lora_path": str(path)}))
        return PushedWeights(adapter=name, servers=tuple(self.pool.live()))

    def unload_adapter(self, name: str) -> None:
        """Unload adapter ``name`` (:meth:`load_adapter`'s) from the live servers, best effort."""
        for i in self.pool.live():
            self._unload(self.urls[i], name)

    def _unload(self, url: str, name: str) -> None:
        """Unload adapter ``name`` from ``url``, best effort: a server that never had it (revived
        since) answers 4xx, a dead one shows at its next request; neither is a failure here."""
        try:
            self.client.post(url + self.lora_endpoints[1], json={"lora_name": name}, timeout=self._probe_timeout)
        except httpx.HTTPError:
            pass

    def _push_all(self, push: Callable[[str], None]) -> None:
        targets = self._push_targets()
        with ThreadPoolExecutor(max_workers=max(1, len(targets))) as pool:
            results = {i: pool.submit(push, self.urls[i]) for i in targets}
        for i, fut in results.items():
            error = fut.exception()
            if error is None:
                self.pool.revive(i)
            elif isinstance(error, ServerDown):
                self.pool.mark_dead(i, error)
            else:
                raise error
        if not self.pool.live():
            raise self.pool.none_left()

    def pushed(self) -> PushedWeights:
        """What this engine's latest :meth:`load_weights` left on the servers."""
        return PushedWeights(adapter=self._lora, servers=tuple(self.pool.live()))

    def follow(self, pushed: PushedWeights) -> None:
        """Sample what another process's engine pushed (:meth:`pushed` there): requests name its
        adapter (a server that no longer holds that name refuses them: an error, never another
        policy), and go only to the servers that received the push.

        Raises:
            EngineError: ``pushed`` names no server.
        """
        if not pushed.servers:
            raise self.pool.none_left()
        self._lora = pushed.adapter
        for i in range(len(self.urls)):
            if i in pushed.servers:
                self.pool.revive(i)
            else:
                self.pool.mark_dead(i, EngineError(f"inference server {self.urls[i]} did not receive the "
                                                   "learner's latest weights"))

    def _push_targets(self) -> list[int]:
        """The servers a weight push goes to: the live ones, and dead ones that answer again."""
        live = set(self.pool.live())
        return [i for i in range(len(self.urls)) if i in live or self._answers(i)]

    def _answers(self, server: int) -> bool:
        """Whether a dead server is back: it passes the start-up check again."""
        try:
            self._check(self.urls[server])
            return True
        except EngineError:
            return False

    def take_metrics(self) -> dict[str, float]:
        """``rollout/server_failures``: servers marked dead since the last call."""
        return {"rollout/server_failures": float(self.pool.take_failures())}

    def offload(self) -> None:
        """No-op: the servers' memory is their own."""

    def close(self) -> None:
        """Unload this engine's adapter from the servers (best effort), close the connections and
        remove the synced adapter files (the servers keep running)."""
        if self._lora is not None:
            for i in self.pool.live():
                self._unload(self.urls[i], self._lora)
        self.client.close()
        self._adapters.close()
