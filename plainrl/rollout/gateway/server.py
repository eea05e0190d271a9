"""The gateway's lifetime: its socket (loopback unless ``rollout.gateway_host`` says otherwise),
and serving each rollout.

Where the server runs. The episodes of a rollout are tasks of one asyncio event loop (the
run's, in a thread of its own: :class:`plainrl.rollout.event_loop.RunLoop`), and everything a
request touches lives there: the episode's :class:`~plainrl.rollout.llm.LLM`, its trajectory,
the request batcher. None of it is thread-safe, so uvicorn serves *on that same loop*: a
request reaches its episode by a plain ``await``, batches with every ``llm.chat`` call of the
step, and costs no thread hand-off (a server loop in a thread of its own would hand every
request to the episodes' loop and back, two busy Python threads taking turns on the GIL, up to
its 5 ms switch interval per turn under load). The listening socket is the run's: bound once,
on first use (``llm.base_url``), so the port stays the same for the whole run and belongs to
the trainer process (nothing outlives it, ``kill -9`` included); the first rollout that needs
it starts serving it on the loop. On the run's loop (``serving(keep=True)``) the server stays
up between rollouts, while the learner updates and the weights are pushed: connections stay
open, requests are answered (an ended episode's key gets 409, an online claim 503 with
``Retry-After``, :mod:`~plainrl.rollout.gateway.online`), none is reset or left in the
backlog. A rollout on a loop of its own closes what it accepted when its episodes are done.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import threading
from typing import TYPE_CHECKING, Any, AsyncIterator

from plainrl.rollout.gateway.keys import Episodes
from plainrl.rollout.gateway.online import OnlineEpisodes

if TYPE_CHECKING:
    from plainrl.rollout.llm import LLM

__all__ = ["Gateway"]

HOST = "127.0.0.1"  # the default: loopback (rollout.gateway_host: another address needs the run's own key)


class Gateway:
    """An OpenAI- and Anthropic-compatible HTTP server in front of a run's rollouts (one per trainer process).

    Each episode's :class:`~plainrl.rollout.llm.LLM` gets a random key on first use
    (``llm.api_key``); a request with that key is a call of that episode, recorded on its
    trajectory exactly as ``llm.chat`` / ``llm.generate`` would record it. Routes:
    :mod:`plainrl.rollout.gateway.app`.

    Args:
        model: the model id ``GET /v1/models`` lists and responses name (``model.name``).
        max_model_len: the model's context (``model.max_context``), listed as ``max_model_len``.
        port: the port to bind (0: a free one; ``rollout.gateway_port``).
        online: serve ``rollout.agent: online``'s ``/rl/`` routes (:mod:`plainrl.rollout.gateway.online`).
        host: the address to bind (``rollout.gateway_host``); ``0.0.0.0`` / ``::`` bind every
            interface (this process's clients still use loopback).
        token: the key the ``/rl/`` routes ask for (``rollout.gateway_api_key_env``'s); None: a random one.
    """

    def __init__(self, model: str, max_model_len: int | None = None, *, port: int = 0, online: bool = False,
                 host: str = HOST, token: str | None = None) -> None:
        self.model, self.max_model_len, self.port, self.host = model, max_model_len, port, host
        self.episodes = Episodes(model, max_model_len)  # the keys and what is kept per episode
        self.online = OnlineEpisodes(token) if online else None
        self._sock: socket.socket | None = None
        self._lock = threading.Lock()
        self._loop: asyncio.AbstractEventLoop | None = None  # the rollout being served
        self._server: Any = None  # uvicorn.Server on _server_loop, once started
        self._server_loop: asyncio.AbstractEventLoop | None = None  # the loop serving the socket (or starting to)
        self._listening: socket.socket | None = None  # the server's duplicate of the socket
        self._starting: asyncio.Task | None = None
        self._app: Any = None
        self._http: list[Any] = []  # the episodes' httpx.AsyncClients, on the served loop
        self._sync_http: dict[str, Any] = {}  # httpx module -> Client for plain-function agents' (thread-safe)

    # ------------------------------------------------------------------ addresses and keys

    @property
    def base_url(self) -> str:
        """``http://127.0.0.1:PORT/v1``; binds the socket (and starts serving) on first use."""
        return f"{self.url}/v1"

    @property
    def url(self) -> str:
        """``http://HOST:PORT``, the server's root (``/inference/v1/generate`` lives there); for a
        socket on every interface, this process's way to it (``127.0.0.1`` / ``[::1]``)."""
        self._bind()
        host = {"0.0.0.0": "127.0.0.1", "": "127.0.0.1", "::": "::1"}.get(self.host, self.host)
        return f"http://{f'[{host}]' if ':' in host else host}:{self._sock.getsockname()[1]}"

    def key_for(self, llm: LLM) -> str:
        """The episode's key, made (random, 32 bytes) on first use; binds the socket."""
        key = self.episodes.key_for(llm)
        self._bind()
        return key

    def http_client(self, *, blocking: bool = False, httpx_module: Any = None):
        """An HTTP client for an episode's ``openai`` client (``llm.openai_client()``), closed with
        the rollout.

        The async client (for agents on the episodes' loop) hands each request to the app as
        an ASGI call on that loop, without the socket: the agent and the routes run in one
        process on one loop, and the wire (httpx's connection pool and HTTP/1.1 writer,
        uvicorn's parser) was about half of the gateway's CPU per call (0.85 -> 0.48 ms,
        docs/benchmarks.md). Everything else is the same request: the same
        routes, keys, errors and read timeout (:class:`_LoopTransport`). ``blocking``: one
        ``httpx.Client`` over the socket for plain-function agents (they run in threads of
        their own), shared by their threads, made without TLS set-up (a default client loads
        the system's CA certificates, ~10 ms, though loopback needs none). ``httpx_module``: the
        package the client's SDK takes its clients from (``httpx``, the default, or ``httpx2``,
        the ``anthropic`` SDK's since 2.14)."""
        import httpx as default

        httpx = httpx_module or default

        # the openai SDK's own defaults: 600 s per request, 5 s to connect
        kw = dict(timeout=httpx.Timeout(600.0, connect=5.0), verify=False, trust_env=False)
        if blocking:
            with self._lock:
                if httpx.__name__ not in self._sync_http:
                    self._sync_http[httpx.__name__] = httpx.Client(limits=httpx.Limits(max_connections=None), **kw)
                return self._sync_http[httpx.__name__]
        self._bind()
        client = httpx.AsyncClient(transport=_loop_transport(self._app, httpx), **kw)
        self._http.append(client)
        return client

    def lookup(self, key: str) -> tuple[LLM | None, bool]:
        """``(the live episode's handle, known)`` for a key (:meth:`Episodes.lookup`)."""
        return self.episodes.lookup(key)

    def take_metrics(self) -> dict[str, float]:
        """``rollout/sampling_overrides`` (requests whose sampling settings the run's replaced) and
        ``gateway/dropped_tools`` (tools left out of requests: hosted by the vendor, or of an unknown
        type) and ``gateway/unparsed_tool_calls`` (tool-call blocks in replies that did not parse, left
        in the content) since the last call; {} when the gateway never served."""
        if self._sock is None:
            return {}
        e = self.episodes
        n, dropped, e.sampling_overrides, e.dropped_tools = e.sampling_overrides, e.dropped_tools, 0, 0
        unparsed, e.unparsed_tool_calls = e.unparsed_tool_calls, 0
        return {"rollout/sampling_overrides": float(n), "gateway/dropped_tools": float(dropped),
                "gateway/unparsed_tool_calls": float(unparsed)}

    # ------------------------------------------------------------------ serving

    @contextlib.asynccontextmanager
    async def serving(self, *, keep: bool = False) -> AsyncIterator[None]:
        """Serve on the running loop while the block runs (a rollout's episodes); the server
        starts now if the socket is bound, else when an episode first asks for the URL.

        Args:
            keep: the loop outlives the rollout (the run's): the server goes on answering
                between rollouts (see the module's docstring) until :meth:`close` or a rollout
                on another loop; False: it stops when the block ends.
        Raises:
            RuntimeError: another rollout is being served (one at a time per gateway).
        """
        loop = asyncio.get_running_loop()
        with self._lock:
            if self._loop is not None:
                raise RuntimeError("this gateway already serves another rollout; one rollout at a time")
            self._loop = loop
            stale = self._server_loop is not None and self._server_loop is not loop
        if stale:  # still serving on the loop of an earlier rollout
            await asyncio.to_thread(self._drop_server)
        with self._lock:
            if self._sock is not None and self._server_loop is None:
                self._server_loop, self._starting = loop, loop.create_task(self._start())
        if self.online is not None:
            await self.online.set_open(True)
        try:
            yield
        finally:
            if self.online is not None:
                await self.online.set_open(False)
            with self._lock:
                starting, self._starting, self._loop = self._starting, None, None
            await self._stop(starting, keep)

    async def serve_idle(self) -> None:
        """Start serving on the running loop (the run's) before any rollout, so that requests
        arriving meanwhile (a harness's claims while the model loads) are answered (503 and
        ``Retry-After``) instead of waiting in the socket's backlog; binds the socket. The
        rollouts served on this loop later keep the server (``serving(keep=True)``)."""
        self._bind()
        loop = asyncio.get_running_loop()
        with self._lock:
            if self._server_loop is not None or self._loop is not None:
                return
            self._server_loop = loop
        await self._start()

    def _bind(self) -> None:
        if self._app is None:  # built here, in the caller's thread: a missing package fails the caller
            import uvicorn  # noqa: F401

            from plainrl.rollout.gateway.app import build_app

            self._app = build_app(self.episodes, self.online)
        with self._lock:
            if self._sock is None:
                # proto=IPPROTO_TCP: asyncio turns Nagle off (TCP_NODELAY) only on sockets that say
                # they are TCP; with proto 0 every response waited for the client's delayed ACK (~40 ms)
                family = socket.AF_INET6 if ":" in self.host else socket.AF_INET
                sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                sock.bind((self.host.strip("[]"), self.port))
                sock.listen(1024)
                sock.setblocking(False)
                self._sock = sock
            if self._loop is not None and self._server_loop is None:  # bound mid-rollout: start serving it
                loop = self._server_loop = self._loop
                self._starting = asyncio.run_coroutine_threadsafe(self._start(), loop) \
                    if _running_loop() is not loop else loop.create_task(self._start())

    async def _start(self) -> None:
        import uvicorn

        config = uvicorn.Config(self._app, lifespan="off", log_config=None, access_log=False,
                                timeout_keep_alive=600)
        server = uvicorn.Server(config)
        config.load()
        server.lifespan = config.lifespan_class(config)
        # a duplicate of the run's socket: closing it when serving ends leaves the run's listening
        self._listening = self._sock.dup()
        await server.startup(sockets=[self._listening])
        self._server = server

    async def _stop(self, starting: Any, keep: bool = False) -> None:
        """A rollout's end: its in-process clients closed and, unless ``keep``, the server stopped."""
        if starting is not None:
            with contextlib.suppress(Exception):  # (a server that failed to start has nothing to stop)
                await (asyncio.wrap_future(starting) if not isinstance(starting, asyncio.Future) else starting)
        http, self._http = self._http, []
        for client in http:
            await client.aclose()
        if keep:
            return
        with self._lock:
            server, self._server, self._server_loop, self._listening = self._server, None, None, None
        await _shutdown(server)  # (closing its listening socket)

    def _drop_server(self) -> None:
        """Stop the server of a loop no rollout serves now (from another thread than that loop's):
        on its loop if that still runs, else by closing its listening socket."""
        with self._lock:
            server, loop, self._server, self._server_loop = self._server, self._server_loop, None, None
            listening, self._listening = self._listening, None
        if server is None or loop is None or loop is _running_loop():
            return
        if loop.is_running():
            with contextlib.suppress(Exception):  # (a loop that closes meanwhile ends it anyway)
                asyncio.run_coroutine_threadsafe(_shutdown(server), loop).result(timeout=5)
                return
        if listening is not None:  # the loop is closed: nothing accepts on it, the socket is all that is left
            listening.close()

    def close(self) -> None:
        """Close the listening socket (the run is over), and stop a server kept between
        rollouts; a later use binds a new one."""
        self._drop_server()
        with self._lock:
            if self._sock is not None:
                self._sock.close()
                self._sock = None
            for client in self._sync_http.values():
                client.close()
            self._sync_http = {}


async def _shutdown(server: Any) -> None:
    """Stop ``server`` (a uvicorn.Server on the running loop): no more accepts, open connections
    closed, handlers cancelled. (uvicorn's own shutdown waits in 0.1 s sleeps for what this does
    at once; every episode has ended, so nothing in flight is worth waiting for.)"""
    if server is None:
        return
    for s in server.servers:
        s.close()
    for c in list(server.server_state.connections):
        c.shutdown()
    for t in list(server.server_state.tasks):
        t.cancel()
    await asyncio.sleep(0)


def _loop_transport(app: Any, httpx: Any):
    """An ``httpx.ASGITransport`` to ``app`` that honours the request's read timeout (the
    in-process transport has no network to time): a call not answered within it raises
    ``httpx.ReadTimeout``, as a socket's would, and its handler is cancelled (the gateway then
    fails the episode, as for a client that disconnects mid-call)."""
    class _LoopTransport(httpx.ASGITransport):
        async def handle_async_request(self, request: Any) -> Any:
            limit = request.extensions.get("timeout", {}).get("read")
            try:
                async with asyncio.timeout(limit):
                    return await super().handle_async_request(request)
            except TimeoutError:
                raise httpx.ReadTimeout(f"no response within {limit} s", request=request) from None

    return _LoopTransport(app=app)


def _running_loop() -> asyncio.AbstractEventLoop | None:
    try:
        return asyncio.get_running_loop()
    except RuntimeError:
        return None
