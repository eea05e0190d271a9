"""Faults between the trainer and its inference servers, over real HTTP on loopback
(tests/served_stub.py: servers speaking ``plainrl serve``'s routes, with faults switched on):
a 5xx is retried once, then the server is marked dead and its requests go to another; a hung
server is given up after ``timeout_s`` without a retry; a refused connection fails over; a
slow first byte within ``timeout_s`` is no failure; a dead server that answers again gets the
weights at the next sync and is used again; with none left the error names every server."""

from __future__ import annotations

import threading
import time

import httpx
import pytest
import torch

from plainrl.rollout.engines.remote import RemoteEngine
from plainrl.rollout.engines.requests import EngineError
from plainrl.rollout.engines.served import RETRY_BASE_S, RETRY_CAP_S, retry_delay_s
from plainrl.types import SamplingParams
from served_stub import StubServer

PARAMS = SamplingParams(max_new_tokens=3, temperature=1.0)
COMPLETIONS = "/v1/completions"


@pytest.fixture()
def servers(tokenizer):
    made = [StubServer(0, tokenizer), StubServer(1, tokenizer)]
    yield made
    for s in made:
        s.stop()


def _engine(servers, tokenizer, tmp_path, **kw) -> RemoteEngine:
    kw = {"timeout_s": 30.0, "connect_timeout_s": 5.0, **kw}
    return RemoteEngine([s.url for s in servers], tokenizer, sync="lora", shared_dir=str(tmp_path / "shared"), **kw)


def _served_by(gens) -> list[int]:
    """The server each completion came from (the stub's ids are ``server_id * 1000 + i``)."""
    return [g.token_ids[0] // 1000 for g in gens]


def _lora_model(tiny_model_dir):
    from plainrl.config import load_config
    from plainrl.models import load_policy

    cfg = load_config(None, ["data.task=arithmetic", "rewards=[{fn: plainrl.rewards.builtins:correctness}]",
                             f"model.name={tiny_model_dir}", "model.dtype=float32"])
    return load_policy(cfg.model, torch.device("cpu"))


def test_start_up_checks_each_server_then_requests_spread(servers, tokenizer, tmp_path):
    engine = _engine(servers, tokenizer, tmp_path)
    try:
        assert [s.calls("/tokenize") for s in servers] == [1, 1]  # each server's tokenizer was probed
        together = threading.Barrier(2)  # both requests in flight at once, wherever they went
        for s in servers:
            s.faults.together = together
        gens = engine.generate([[1, 2]] * 2 + [[3, 4]] * 2, PARAMS)  # two groups: one request each
        assert sorted(_served_by(gens)) == [0, 0, 1, 1] and _served_by(gens)[:2] in ([0, 0], [1, 1])
        assert [len(g.token_ids) for g in gens] == [3] * 4 and gens[0].logprobs == [-0.5] * 3
        assert engine.take_metrics() == {"rollout/server_failures": 0.0}
    finally:
        engine.close()


def test_a_5xx_is_retried_once_on_the_same_server(servers, tokenizer, tmp_path):
    engine = _engine(servers[:1], tokenizer, tmp_path)
    try:
        servers[0].faults.fail_5xx = 1
        gens = engine.generate([[1, 2]] * 2, PARAMS)
        assert _served_by(gens) == [0, 0] and servers[0].calls(COMPLETIONS) == 2  # the 503, then the retry
        assert engine.take_metrics()["rollout/server_failures"] == 0.0 and engine.pool.live() == [0]
    finally:
        engine.close()


def test_the_retry_after_a_5xx_waits_a_jittered_backoff(servers, tokenizer, tmp_path):
    """Old code retried at once: the 503 and the retry arrived within milliseconds."""
    engine = _engine(servers[:1], tokenizer, tmp_path)
    try:
        servers[0].faults.fail_5xx = 1
        engine.generate([[1, 2]] * 2, PARAMS)
        first, retry = [t for (_, p, _), t in zip(servers[0].requests, servers[0].times) if p == COMPLETIONS]
        assert RETRY_BASE_S / 2 <= retry - first < RETRY_BASE_S + 0.5, retry - first
    finally:
        engine.close()


def test_a_429_is_retried_after_its_retry_after(servers, tokenizer, tmp_path):
    """A rate-limited server (a hosted one behind rollout.remote.backend: openai) answers 429, then 200.
    Old code: a 429 was a 4xx, an EngineError at once."""
    engine = _engine(servers[:1], tokenizer, tmp_path)
    try:
        servers[0].faults.fail_5xx, servers[0].faults.fail_status, servers[0].faults.retry_after = 1, 429, "1"
        gens = engine.generate([[1, 2]] * 2, PARAMS)
        assert _served_by(gens) == [0, 0] and engine.pool.live() == [0]
        first, retry = [t for (_, p, _), t in zip(servers[0].requests, servers[0].times) if p == COMPLETIONS]
        assert retry - first >= 1.0 - 0.05, retry - first
    finally:
        engine.close()


def test_retry_delay_is_jittered_exponential_or_the_servers_retry_after():
    import random

    rng = random.Random(0)
    delays = [retry_delay_s(a, rand=rng.random) for a in range(8) for _ in range(50)]
    for a in range(8):
        d = min(RETRY_CAP_S, RETRY_BASE_S * 2 ** a)
        mine = delays[a * 50:(a + 1) * 50]
        assert all(d / 2 <= x <= d for x in mine) and len(set(mine)) == 50  # jittered, never 0
    assert retry_delay_s(0, "3") == 3.0 and retry_delay_s(0, "0") == 0.0
    assert RETRY_BASE_S / 2 <= retry_delay_s(0, "Wed, 21 Oct 2015 07:28:00 GMT") <= RETRY_BASE_S  # a date: backoff
    assert retry_delay_s(0, "3600") <= RETRY_BASE_S  # beyond the cap: backoff


def test_a_server_failing_twice_is_marked_dead_and_its_requests_fail_over(servers, tokenizer, tmp_path):
    engine = _engine(servers, tokenizer, tmp_path)
    try:
        servers[0].faults.fail_5xx = 2
        gens = engine.generate([[1, 2]] * 2, PARAMS)  # one request: it goes to server 0 first (fewest in flight)
        assert _served_by(gens) == [1, 1]
        assert servers[0].calls(COMPLETIONS) == 2 and servers[1].calls(COMPLETIONS) == 1
        assert engine.pool.live() == [1] and engine.take_metrics()["rollout/server_failures"] == 1.0
        assert "answered 503" in engine.pool.errors[0]
        engine.generate([[5]] * 2, PARAMS)
        assert servers[0].calls(COMPLETIONS) == 2  # a dead server gets no more requests
    finally:
        engine.close()


def test_a_hung_server_is_given_up_after_the_timeout_without_a_retry(servers, tokenizer, tmp_path):
    start = time.monotonic()
    engine = _engine(servers, tokenizer, tmp_path)  # the start-up checks: 3 calls to each server
    # the timeout: far above what an answer takes on this machine now, so only the hung server misses it
    engine.client.timeout = httpx.Timeout(max(2.0, 10 * (time.monotonic() - start)), connect=5.0)
    servers[0].faults.hang.set()
    try:
        gens = engine.generate([[1, 2]] * 2, PARAMS)
        assert servers[0].entered.is_set() and _served_by(gens) == [1, 1]
        assert servers[0].calls(COMPLETIONS) == 1  # a timeout is not retried: the server is presumed hung
        assert "ReadTimeout" in engine.pool.errors[0] and engine.pool.live() == [1]
    finally:
        servers[0].faults.hang.clear()
        engine.close()


def test_a_refused_connection_fails_over_and_none_left_names_every_server(servers, tokenizer, tmp_path):
    engine = _engine(servers, tokenizer, tmp_path)
    try:
        servers[0].stop()
        assert _served_by(engine.generate([[1, 2]] * 2, PARAMS)) == [1, 1]
        assert "ConnectError" in engine.pool.errors[0]
        servers[1].stop()
        with pytest.raises(EngineError, match=rf"no inference server left \(inference server {servers[0].url}.*"
                                              rf"inference server {servers[1].url}.*plainrl serve"):
            engine.generate([[1, 2]] * 2, PARAMS)
    finally:
        engine.close()


def test_a_slow_first_byte_within_the_timeout_is_no_failure(servers, tokenizer, tmp_path):
    # the first byte comes after the connect timeout but well within timeout_s: the connect
    # timeout must not apply to an answer being computed
    engine = _engine(servers[:1], tokenizer, tmp_path)
    engine.client.timeout = httpx.Timeout(30.0, connect=0.3)  # after the start-up checks, which use the connect timeout
    servers[0].faults.first_byte_s = 1.0
    try:
        assert _served_by(engine.generate([[1, 2]] * 2, PARAMS)) == [0, 0]
        assert servers[0].calls(COMPLETIONS) == 1 and engine.pool.live() == [0]
    finally:
        engine.close()


def test_a_4xx_is_the_requests_fault_not_the_servers(servers, tokenizer, tmp_path):
    engine = _engine(servers, tokenizer, tmp_path)
    try:
        engine._lora = "never-loaded"  # the server answers 404 for a model it does not hold
        with pytest.raises(EngineError, match="answered 404.*never-loaded"):
            engine.generate([[1, 2]] * 2, PARAMS)
        assert engine.pool.live() == [0, 1] and servers[0].calls(COMPLETIONS) + servers[1].calls(COMPLETIONS) == 1
    finally:
        engine.close()


def test_a_dead_server_that_answers_again_gets_the_weights_and_is_used_again(servers, tokenizer, tmp_path,
                                                                             tiny_model_dir):
    model = _lora_model(tiny_model_dir)
    engine = _engine(servers, tokenizer, tmp_path)
    try:
        engine.load_weights(model)
        first = engine._lora
        assert all(s.adapters == {first} for s in servers)
        servers[0].stop()
        engine.generate([[1, 2]] * 2, PARAMS)
        assert engine.pool.live() == [1]
        servers[0] = servers[0].restart()  # back on the same port, without the adapter
        engine.load_weights(model)  # the sync re-checks the dead server and pushes to it too
        second = engine._lora
        assert second != first and engine.pool.live() == [0, 1]
        assert servers[0].adapters == {second} and servers[1].adapters == {second}  # the old one unloaded
        assert [s.calls("/tokenize") for s in servers] == [1, 1]  # the revived one passed its start-up check again
        seen = [len(s.requests) for s in servers]
        together = threading.Barrier(2)  # both requests in flight at once
        for s in servers:
            s.faults.together = together
        gens = engine.generate([[1, 2]] * 2 + [[3, 4]] * 2, PARAMS)
        assert sorted(_served_by(gens)) == [0, 0, 1, 1]  # used again, with the current adapter
        assert [body["model"] for s, n in zip(servers, seen) for _, p, body in s.requests[n:] if p == COMPLETIONS] \
            == [second, second]
    finally:
        engine.close()


def test_a_server_failing_the_weight_push_is_marked_dead_the_others_hold_the_weights(servers, tokenizer, tmp_path,
                                                                                     tiny_model_dir):
    model = _lora_model(tiny_model_dir)
    engine = _engine(servers, tokenizer, tmp_path)
    try:
        servers[0].faults.fail_paths, servers[0].faults.fail_5xx = ("/v1/load_lora_adapter",), 2
        engine.load_weights(model)
        assert engine.pool.live() == [1] and servers[1].adapters == {engine._lora} and not servers[0].adapters
        assert _served_by(engine.generate([[1, 2]] * 2, PARAMS)) == [1, 1]
        servers[1].faults.fail_paths, servers[1].faults.fail_5xx = ("/v1/load_lora_adapter",), 2
        servers[0].faults.fail_5xx = 2
        with pytest.raises(EngineError, match="no inference server left"):
            engine.load_weights(model)
    finally:
        engine.close()


def test_concurrent_requests_during_a_failure_all_complete(servers, tokenizer, tmp_path):
    """Several groups in flight when a server starts failing: every request completes, on the other server."""
    engine = _engine(servers, tokenizer, tmp_path)
    try:
        servers[0].faults.fail_5xx = 100
        prompts = [[i, i] for i in range(8) for _ in range(2)]  # 8 groups of 2, sent concurrently
        gens = engine.generate(prompts, PARAMS)
        assert _served_by(gens) == [1] * 16 and engine.pool.live() == [1]
    finally:
        engine.close()
