"""Request routing over several inference servers (plainrl.rollout.engines.router): least
outstanding requests first, failover when a server is down, a clear end when none is left.
The servers themselves are exercised for real in tests/test_vllm_servers.py."""

import threading

import pytest

from plainrl.rollout.engines.requests import EngineError
from plainrl.rollout.engines.router import ServerDown, ServerPool


def test_least_outstanding_server_first_ties_to_lowest_index():
    pool = ServerPool(["a", "b", "c"])
    assert [pool.acquire() for _ in range(4)] == [0, 1, 2, 0]
    pool.release(1)
    pool.release(2)
    assert pool.acquire() == 1  # 0 has 2 in flight, 1 and 2 have 0
    assert pool.outstanding == [2, 1, 0]


def test_a_down_server_is_marked_dead_and_the_request_goes_elsewhere():
    pool = ServerPool(["a", "b"])
    calls = []

    def request(server):
        calls.append(server)
        if server == 0:
            raise ServerDown("a: connection refused")
        return f"done on {server}"

    assert pool.run(request) == "done on 1"
    assert calls == [0, 1]
    assert pool.live() == [1] and pool.outstanding == [0, 0]
    assert pool.take_failures() == 1 and pool.take_failures() == 0
    assert pool.run(request) == "done on 1" and calls[-1] == 1  # the dead one is not asked again
    pool.revive(0)
    assert pool.live() == [0, 1]


def test_no_server_left_names_every_failure():
    pool = ServerPool(["http://a:1", "http://b:2"])

    def request(server):
        raise ServerDown(f"server {pool.urls[server]}: ConnectError")

    with pytest.raises(EngineError, match=r"no inference server left \(server http://a:1: ConnectError; "
                                          r"server http://b:2: ConnectError\)"):
        pool.run(request)


def test_a_bad_request_is_not_a_dead_server():
    pool = ServerPool(["a", "b"])

    def request(server):
        raise EngineError("answered 400: prompt too long")

    with pytest.raises(EngineError, match="400"):
        pool.run(request)
    assert pool.live() == [0, 1] and pool.outstanding == [0, 0]


def test_concurrent_requests_spread_evenly():
    pool = ServerPool(["a", "b"])
    gate = threading.Barrier(4)
    seen = []

    def request(server):
        seen.append(server)
        gate.wait(timeout=10)  # all four in flight at once
        return server

    threads = [threading.Thread(target=pool.run, args=(request,)) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=10)
    assert sorted(seen) == [0, 0, 1, 1]
