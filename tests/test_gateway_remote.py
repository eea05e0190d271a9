"""Online episodes for harnesses on other machines: the gateway's address and key
(rollout.gateway_host, rollout.gateway_api_key_env), claims between rollouts answered 503 with
Retry-After on the run's loop (no reset connection, no backlog), evaluation episodes marked in
the claim, and a client's group mapped onto the rollout's group, not onto the row object."""

from __future__ import annotations

import threading

import httpx
import openai
import pytest
import torch

from plainrl.config import ConfigError
from plainrl.config.rollout import RolloutConfig
from plainrl.rollout import agent_rollout
from plainrl.rollout.episode_loop import LoopSettings
from plainrl.rollout.gateway import Gateway
from plainrl.rollout.gateway.online import online_agent
from plainrl.rollout.event_loop import RunLoop
from plainrl.run.setup import gateway_key
from plainrl.types import SamplingParams
from test_gateway import ScriptedEngine, prompts


def test_a_gateway_host_other_than_loopback_needs_a_key(monkeypatch):
    for host in ("127.0.0.1", "127.0.0.2", "::1", "localhost"):
        assert RolloutConfig(gateway_host=host).gateway_host == host
    with pytest.raises(ValueError) as e:
        RolloutConfig(gateway_host="0.0.0.0")
    assert "rollout.gateway_host='0.0.0.0'" in str(e.value) and "rollout.gateway_api_key_env" in str(e.value)
    with pytest.raises(ValueError, match="names the environment variable"):
        RolloutConfig(gateway_host="0.0.0.0", gateway_api_key_env="sk-not-a-name")
    cfg = RolloutConfig(gateway_host="0.0.0.0", gateway_api_key_env="TEST_GATEWAY_KEY")
    monkeypatch.delenv("TEST_GATEWAY_KEY", raising=False)
    with pytest.raises(ConfigError, match="TEST_GATEWAY_KEY is not set"):
        gateway_key(cfg.gateway_api_key_env)
    monkeypatch.setenv("TEST_GATEWAY_KEY", "short")
    with pytest.raises(ConfigError, match="shorter than 16"):
        gateway_key(cfg.gateway_api_key_env)
    assert gateway_key(None) is None


def test_a_gateway_on_every_interface_takes_the_configured_key():
    import asyncio

    key = "k" * 32
    gateway = Gateway("policy", online=True, host="0.0.0.0", token=key)

    async def go():
        async with gateway.serving():
            async with httpx.AsyncClient(base_url=gateway.url, timeout=10) as http:
                ok = await http.post("/rl/episodes", json={"wait_s": 0}, headers={"Authorization": f"Bearer {key}"})
                bad = await http.post("/rl/episodes", json={"wait_s": 0}, headers={"Authorization": "Bearer x"})
                return ok, bad

    try:
        assert gateway.url.startswith("http://127.0.0.1:")  # this process's way to it
        assert gateway._sock.getsockname()[0] == "0.0.0.0"  # every interface
        ok, bad = asyncio.run(go())
    finally:
        gateway.close()
    assert ok.status_code == 204 and bad.status_code == 401


def _play(http: httpx.Client, n: int, group: str | None = None) -> list[dict]:
    """Claim ``n`` episodes (of ``group``), answer each with one chat call, end each with reward 1."""
    out = []
    for _ in range(n):
        r = http.post("/rl/episodes", json={"wait_s": 30, **({"group": group} if group else {})})
        assert r.status_code == 200, (r.status_code, r.text)
        ep = r.json()
        openai.OpenAI(base_url=ep["base_url"], api_key=ep["api_key"], max_retries=0, timeout=30).chat.completions \
            .create(model="policy", messages=ep["prompt_messages"], max_tokens=8)
        http.post(f"/rl/episodes/{ep['id']}/reward", json={"reward": 1.0}).raise_for_status()
        out.append(ep)
    return out


@pytest.mark.timeout(60)
def test_between_rollouts_a_claim_gets_503_with_retry_after_and_claims_mark_evaluation(tokenizer):
    gateway = Gateway("policy", 2048, online=True)
    run_loop = RunLoop()  # the run's loop: the gateway keeps serving on it between rollouts
    settings = LoopSettings(64, gateway=gateway, timeout_s=30, loop=run_loop)
    headers = {"Authorization": f"Bearer {gateway.online.token}"}
    url, seen = gateway.url, {}

    def client(name: str, n: int, then_claim: bool = False) -> None:
        with httpx.Client(base_url=url, headers=headers, timeout=10) as http:
            seen[name] = _play(http, n)
            if then_claim:  # the rollout ends while this waits (or before it arrives): either way a 503
                seen["pending"] = http.post("/rl/episodes", json={"wait_s": 30})

    def rollout(step: int, group_size: int, name: str, then_claim: bool = False) -> list:
        thread = threading.Thread(target=client, args=(name, group_size, then_claim), daemon=True)
        thread.start()
        eps = agent_rollout(ScriptedEngine(tokenizer), prompts(tokenizer, 1), online_agent,
                            SamplingParams(max_new_tokens=8), tokenizer, settings, group_size=group_size, step=step,
                            generator=torch.Generator().manual_seed(0))
        thread.join(timeout=20)
        return eps

    try:
        run_loop.submit(gateway.serve_idle()).result(timeout=30)  # as the run does once the gateway is announced
        with httpx.Client(base_url=url, headers=headers, timeout=5) as http:
            before = http.post("/rl/episodes", json={"wait_s": 5})  # no rollout yet
        train = rollout(0, 2, "train", then_claim=True)
        with httpx.Client(base_url=url, headers=headers, timeout=5) as http:  # a fresh connection, between rollouts
            between = http.post("/rl/episodes", json={"wait_s": 5})
        evaluation = rollout(-1, 1, "eval")
    finally:
        gateway.close()
        run_loop.close()
    assert all(e.env.error is None for e in train + evaluation)
    for r in (before, seen["pending"], between):
        assert r.status_code == 503 and r.headers["retry-after"] == "2", (r.status_code, r.text)
        assert r.json()["error"]["code"] == "between_rollouts"
    assert [e["evaluation"] for e in seen["train"]] == [False, False]
    assert sorted(e["sample_id"] for e in seen["train"]) == ["s0-r0-0", "s0-r0-1"]
    assert [(e["evaluation"], e["sample_id"]) for e in seen["eval"]] == [(True, "s-1-r0-0")]


@pytest.mark.timeout(60)
def test_client_groups_follow_the_rollouts_groups_when_two_groups_share_a_row_object(tokenizer):
    """The same PromptRow twice in a step (a sampler repeating a row): two groups of one row object.
    Keyed by the row object, the second name found no group of its own (204 after wait_s)."""
    gateway = Gateway("policy", 2048, online=True)
    headers = {"Authorization": f"Bearer {gateway.online.token}"}
    url, claimed = gateway.url, {}

    def client() -> None:
        with httpx.Client(base_url=url, headers=headers, timeout=40) as http:
            for name in ("a", "b", "a", "b"):
                claimed.setdefault(name, []).extend(_play(http, 1, name))

    thread = threading.Thread(target=client, daemon=True)
    thread.start()
    row = prompts(tokenizer, 1)[0]
    try:
        eps = agent_rollout(ScriptedEngine(tokenizer), [row, row], online_agent, SamplingParams(max_new_tokens=8),
                            tokenizer, LoopSettings(64, gateway=gateway, timeout_s=30), group_size=2, step=3,
                            generator=torch.Generator().manual_seed(0))
    finally:
        gateway.close()
    thread.join(timeout=10)
    assert all(e.env.error is None for e in eps), [e.env.error for e in eps]
    assert len(claimed["a"]) == 2 and len(claimed["b"]) == 2
    ids = [e["id"] for g in claimed.values() for e in g]
    assert len(set(ids)) == 4
    # each name got one whole group of the rollout: sample ids -0 and -1 of the row
    assert all(sorted(e["sample_id"] for e in claimed[g]) == ["s3-r0-0", "s3-r0-1"] for g in claimed)
