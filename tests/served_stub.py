"""A small inference server on loopback speaking the routes ``plainrl serve`` answers (what
:class:`~plainrl.rollout.engines.remote.RemoteEngine` calls), with faults a test switches on:
5xx answers, a hung request, a slow first byte, being down (connection refused) and coming
back on the same port. It is a real HTTP server (the standard library's threading server) in
the test's process, so the engine's client, timeouts, retries and pool run as they do
against vLLM; only the model is fake: a completion's token ids name the server that
sampled it (``server_id * 1000 + i``), so a test can tell where each request went. A
request for ``prompt_logprobs`` (a teacher's scoring) is answered in vLLM's form by
``prompt_scorer`` when a test sets one (a real model's forward), else without them, as a
server that does not score prompts.
"""

from __future__ import annotations

import json
import socket
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


@dataclass
class Faults:
    """What the server does to its next requests (a test changes these between calls).

    fail_5xx:  the next N requests to ``fail_paths`` answer ``fail_status`` (503; 429: rate limited),
               with a ``Retry-After`` header when ``retry_after`` is set.
    fail_paths: the routes the 5xx faults apply to.
    hang:      while set, completions requests block until it is cleared (or the server stops).
    first_byte_s: seconds a completions request waits before its status line is sent.
    together:  a barrier every completions request waits at before answering (shared by
               several servers: requests that must be in flight at the same time).
    """

    fail_5xx: int = 0
    fail_status: int = 503
    retry_after: str | None = None
    fail_paths: tuple[str, ...] = ("/v1/completions",)
    hang: threading.Event = field(default_factory=threading.Event)
    first_byte_s: float = 0.0
    together: threading.Barrier | None = None


class StubServer:
    """One stub server on ``127.0.0.1:port`` (a free port unless given).

    ``requests``: ``(method, path, json body or None)`` for every request received, in order;
    ``times``: when each arrived (``time.monotonic()``).
    ``adapters``: LoRA names loaded and not unloaded. ``entered``: set once a hung request
    has arrived (a test waits on it instead of sleeping). ``prompt_scorer(ids, k)``: vLLM's
    ``prompt_logprobs`` list for one prompt (None: requests for them get none).
    """

    def __init__(self, server_id: int, tokenizer, port: int = 0):
        self.server_id, self.tokenizer = server_id, tokenizer
        self.faults = Faults()
        self.requests: list[tuple[str, str, dict | None]] = []
        self.times: list[float] = []
        self.adapters: set[str] = set()
        self.prompt_scorer = None
        self.server_info: dict | None = None  # GET /server_info's answer (None: 404, as vLLM outside dev mode)
        self.entered = threading.Event()
        self._lock = threading.Lock()
        self._connections: set[socket.socket] = set()  # open keep-alive connections, closed by stop()
        self._httpd = ThreadingHTTPServer(("127.0.0.1", port), self._handler())
        self._httpd.daemon_threads = True
        self.port = self._httpd.server_address[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self._thread = threading.Thread(target=self._httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Die as a killed server does: the listening socket closes (new connections are
        refused), open connections are cut, hung requests are released."""
        self.faults.hang.clear()
        self._httpd.shutdown()
        self._httpd.server_close()
        with self._lock:
            for conn in self._connections:
                try:
                    conn.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
        self._thread.join(timeout=10)

    def restart(self) -> "StubServer":
        """A fresh server (no adapters, no faults) on the same port: a server that came back."""
        return StubServer(self.server_id, self.tokenizer, port=self.port)

    def calls(self, path: str) -> int:
        """How many requests ``path`` has received."""
        with self._lock:
            return sum(1 for _, p, _ in self.requests if p == path)

    # -- the routes ------------------------------------------------------------------------
    def _answer(self, method: str, path: str, body: dict | None) -> tuple[int, dict]:
        if method == "GET" and path == "/health":
            return 200, {}
        if method == "GET" and path == "/v1/models":
            return 200, {"data": [{"id": "stub-model", "max_model_len": 4096}]}
        if path == "/tokenize":
            return 200, {"tokens": self.tokenizer(body["prompt"], add_special_tokens=False)["input_ids"]}
        if path.startswith("/server_info") and self.server_info is not None:
            return 200, self.server_info
        if path == "/collective_rpc":
            return 200, {"results": [None]}
        if path == "/v1/load_lora_adapter":
            self.adapters.add(body["lora_name"])
            return 200, {}
        if path == "/v1/unload_lora_adapter":
            if body["lora_name"] not in self.adapters:
                return 404, {"error": f"no adapter {body['lora_name']}"}
            self.adapters.discard(body["lora_name"])
            return 200, {}
        if path == "/v1/completions":
            if body["model"] not in ({"stub-model"} | self.adapters):
                return 404, {"error": f"model {body['model']!r} not loaded"}
            if "prompt_logprobs" in body:
                scorer, k = self.prompt_scorer, body["prompt_logprobs"]
                return 200, {"choices": [{"index": i, "text": "", "finish_reason": "length",
                                          "prompt_logprobs": None if scorer is None else scorer(p, k)}
                                         for i, p in enumerate(body["prompt"])]}
            n, length = body["n"], body["max_tokens"]
            choices = [{"index": i, "token_ids": [self.server_id * 1000 + i] * length,
                        "logprobs": {"token_logprobs": [-0.5] * length}, "finish_reason": "length",
                        "stop_reason": None} for i in range(n)]
            return 200, {"choices": choices}
        return 404, {"error": f"no route {method} {path}"}

    def _handler(self):
        stub = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"  # keep-alive, as vLLM's server: the client reuses connections

            def log_message(self, *args):  # quiet
                pass

            def setup(self):
                super().setup()
                with stub._lock:
                    stub._connections.add(self.connection)

            def finish(self):
                with stub._lock:
                    stub._connections.discard(self.connection)
                super().finish()

            def _serve(self, method: str) -> None:
                size = int(self.headers.get("Content-Length") or 0)
                body = json.loads(self.rfile.read(size)) if size else None
                with stub._lock:
                    stub.requests.append((method, self.path, body))
                    stub.times.append(time.monotonic())
                    fail = stub.faults.fail_5xx > 0 and self.path in stub.faults.fail_paths
                    if fail:
                        stub.faults.fail_5xx -= 1
                if self.path == "/v1/completions":
                    if stub.faults.hang.is_set():
                        stub.entered.set()
                        while stub.faults.hang.is_set():  # until the test or stop() releases it
                            time.sleep(0.01)
                        return  # a hung server never answers: the connection just ends
                    time.sleep(stub.faults.first_byte_s)
                    if stub.faults.together is not None:
                        stub.faults.together.wait(timeout=60)
                status, payload = ((stub.faults.fail_status, {"error": "overloaded"}) if fail
                                   else stub._answer(method, self.path, body))
                data = json.dumps(payload).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                if fail and stub.faults.retry_after is not None:
                    self.send_header("Retry-After", stub.faults.retry_after)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self):
                self._serve("GET")

            def do_POST(self):
                self._serve("POST")

        return Handler
