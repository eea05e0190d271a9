"""The episodes' event loop stays free: a long chat context is rendered and tokenized in a
bounded thread pool (plainrl.rollout.offload) while the gateway goes on answering other
requests, and the loop's default executor runs a bounded number of threads."""

from __future__ import annotations

import asyncio
import json
import random
import subprocess
import sys
import threading
import time

import openai
import pytest

from plainrl.rollout import offload
from plainrl.rollout.event_loop import DaemonThreads, RunLoop
from test_gateway import ScriptedEngine, rollout


PINGER = """
import json, os, sys, time
import httpx
out = []
with httpx.Client(base_url=sys.argv[1], timeout=30) as http:
    while not os.path.exists(sys.argv[2]):  # until the test says stop
        t = time.time()
        http.get("/health").raise_for_status()
        out.append((t, time.time()))
        if len(out) == 1:
            print("ready", flush=True)
        time.sleep(0.005)
print(json.dumps(out))
"""


@pytest.mark.timeout(60)
def test_a_long_rendering_does_not_hold_another_request(tokenizer, tmp_path):
    random.seed(0)
    words = ["alpha", "beta", "gamma", "delta", "x1", "42", "foo", "bar"]
    text = " ".join(random.choice(words) for _ in range(150_000))  # ~700k characters, ~1 s to tokenize
    assert offload.message_chars([{"role": "user", "content": text}]) > offload.INLINE_CHARS
    out: dict = {}

    def agent(llm, row):  # a plain function: its own thread, the blocking openai client over the socket
        client = llm.openai_client(max_retries=0, timeout=60)
        client.chat.completions.create(model="policy", messages=[{"role": "user", "content": "hi"}], max_tokens=8)
        # another client of the gateway, in a process of its own, asking all the time
        stop = tmp_path / "stop"
        pinger = subprocess.Popen([sys.executable, "-c", PINGER, llm.gateway.url, str(stop)], stdout=subprocess.PIPE,
                                  text=True)
        assert pinger.stdout.readline() == "ready\n"
        time.sleep(0.1)
        t0 = time.time()
        with pytest.raises(openai.BadRequestError) as e:  # rendered, tokenized, then refused: past max_context
            client.chat.completions.create(model="policy", messages=[{"role": "user", "content": text}],
                                           max_tokens=8)
        out["long"], out["code"] = (t0, time.time()), e.value.code
        stop.touch()
        out["pings"] = json.loads(pinger.communicate(timeout=30)[0])
        return 1.0

    (ep,) = rollout(ScriptedEngine(tokenizer), tokenizer, agent)
    assert ep.env.error is None, ep.env.error
    assert out["code"] == "context_length_exceeded"
    t0, t1 = out["long"]
    during = [(a, b) for a, b in out["pings"] if t0 <= a < t1]
    longest = max(b - a for a, b in during)
    # the long call took a while; meanwhile the health checks kept being answered in milliseconds
    # (rendered on the loop, the pings waited for the whole tokenization: 1.5 s of a 2.3 s call, measured)
    assert t1 - t0 > 0.3, t1 - t0
    assert len(during) >= 5 and longest < max(0.1, (t1 - t0) / 4), (t1 - t0, len(during), longest)


def test_the_render_pool_is_bounded_and_sized_from_config():
    try:
        offload.set_render_threads(2)
        assert offload.render_pool()._max_workers == 2
        offload.set_render_threads(None)
        assert offload.render_pool()._max_workers == offload.default_threads() <= 4
        with pytest.raises(ValueError, match="render_threads"):
            offload.set_render_threads(0)
    finally:
        offload.set_render_threads(None)


def test_the_loops_default_executor_runs_a_bounded_number_of_threads():
    running, lock, release = 0, threading.Lock(), threading.Event()

    def work() -> None:  # holds its thread until released
        nonlocal running
        with lock:
            running += 1
        release.wait(20)

    def reaches(n: int) -> bool:
        deadline = time.monotonic() + 10
        while running < n and time.monotonic() < deadline:
            time.sleep(0.01)
        time.sleep(0.2)  # any thread past the bound would have started by now
        return running == n

    run_loop = RunLoop(threads=3)

    async def many() -> None:
        await asyncio.gather(*(asyncio.to_thread(work) for _ in range(12)))

    try:
        done = run_loop.submit(many())
        assert reaches(3)  # 12 calls, 3 at a time (a thread per call before: 12 at once)
        release.set()
        done.result(timeout=20)
    finally:
        run_loop.close()
    running = 0
    release.clear()
    unbounded = DaemonThreads()
    futures = [unbounded.submit(work) for _ in range(6)]
    assert reaches(6)
    release.set()
    assert [f.result(timeout=10) for f in futures] == [None] * 6
    with pytest.raises(ValueError):
        DaemonThreads(0)
