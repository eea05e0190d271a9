"""The judge's server path against a real HTTP server on loopback that answers 429 (with
Retry-After) and 503 before it answers 200: the ``openai`` client's retries make the chunk
scorable, after the wait the server asked for."""

from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from plainrl.rewards.judge import judge

RETRY_AFTER_S = 1


class JudgeStub:
    """``/v1/models`` and ``/v1/chat/completions`` (reply "8"); the first ``failures`` chat requests
    answer each status of ``failures`` in turn (429 with ``Retry-After``)."""

    def __init__(self, failures: list[int]):
        self.failures = list(failures)
        self.seen: list[tuple[float, int]] = []  # (monotonic time, status answered)
        self.lock = threading.Lock()
        stub = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def _send(self, status: int, body: dict, headers: dict[str, str] | None = None):
                data = json.dumps(body).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                for k, v in (headers or {}).items():
                    self.send_header(k, v)
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self):
                self._send(200, {"object": "list", "data": [{"id": "judge-stub", "object": "model",
                                                             "created": 0, "owned_by": "test"}]})

            def do_POST(self):
                self.rfile.read(int(self.headers["Content-Length"]))
                with stub.lock:
                    status = stub.failures.pop(0) if stub.failures else 200
                    stub.seen.append((time.monotonic(), status))
                if status == 429:
                    self._send(429, {"error": {"message": "rate limited", "type": "rate_limit"}},
                               {"Retry-After": str(RETRY_AFTER_S)})
                elif status != 200:
                    self._send(status, {"error": {"message": "overloaded", "type": "server_error"}})
                else:
                    self._send(200, {"id": "c", "object": "chat.completion", "created": 0, "model": "judge-stub",
                                     "choices": [{"index": 0, "finish_reason": "stop",
                                                  "message": {"role": "assistant", "content": "8"}}]})

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self):
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def stub_factory():
    made = []

    def make(failures):
        made.append(JudgeStub(failures))
        return made[-1]

    yield make
    for s in made:
        s.close()


def test_a_rate_limited_judge_is_retried_after_retry_after(stub_factory):
    """Old code: the first 429 raised httpx.HTTPStatusError and the whole chunk was unscorable."""
    stub = stub_factory([429])
    started = time.monotonic()
    scores = judge(["4"], prompt=["2+2?"], answer=["4"], model=stub.url, served_model="judge-stub", timeout_s=10)
    assert scores == [pytest.approx(0.8)]
    (t429, s429), (t200, s200) = stub.seen
    assert (s429, s200) == (429, 200)
    assert t200 - t429 >= RETRY_AFTER_S - 0.05, "the retry did not wait for Retry-After"
    assert time.monotonic() - started < 10


def test_a_judge_answering_503_recovers_and_one_that_keeps_failing_raises(stub_factory):
    import openai

    stub = stub_factory([503, 503])
    assert judge(["4"], prompt=["2+2?"], model=stub.url, timeout_s=10) == [pytest.approx(0.8)]
    assert [s for _, s in stub.seen] == [503, 503, 200]
    down = stub_factory([503] * 10)
    with pytest.raises(openai.InternalServerError):
        judge(["4"], prompt=["2+2?"], model=down.url, served_model="judge-stub", timeout_s=10, max_retries=1)
    assert [s for _, s in down.seen] == [503, 503]
