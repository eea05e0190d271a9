"""Online episodes (rollout.agent: online): a second process claims the run's episodes, talks to
the model through the gateway and posts rewards; the run trains on what arrives."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import httpx
import pytest

from conftest import REPO, tiny_overrides
from plainrl.cli import main
from plainrl.rollout.gateway import Gateway


@pytest.mark.e2e
def test_online_episodes_are_driven_from_a_second_process(tiny_model_dir, tmp_path):
    run = tmp_path / "run"
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    driver = subprocess.Popen([sys.executable, str(REPO / "examples" / "online_driver.py"), str(run)], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        code = main(["train", str(REPO / "examples" / "arithmetic_grpo.yaml"), *tiny_overrides(tiny_model_dir, run),
                     "rollout.agent=online", "rewards=[]", "rollout.agent_timeout_s=20", "eval.before=false",
                     "eval.after=false"])
        out, _ = driver.communicate(timeout=60)
    finally:
        driver.kill()
    assert code == 0, out
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "reward/mean" in r]
    assert [r["step"] for r in steps] == [0, 1]
    assert all(r["reward/unscorable"] == 0 for r in steps) if "reward/unscorable" in steps[0] else True
    # every episode of both steps was played by the driver (2 prompts x 2 samples per step)
    assert "online_driver: 8 episodes played; the run is over" in out, out
    info = json.loads((run / "gateway.json").read_text())
    assert oct((run / "gateway.json").stat().st_mode & 0o777) == "0o600"
    assert set(info) == {"url", "episodes", "token", "pid"}


def test_the_rl_routes_ask_for_the_run_token():
    import asyncio


    gateway = Gateway("policy", online=True)

    async def go():
        async with gateway.serving():
            async with httpx.AsyncClient(base_url=gateway.url, timeout=10) as http:
                wrong = await http.post("/rl/episodes", headers={"Authorization": "Bearer nope"})
                none = await http.post("/rl/episodes", json={"wait_s": 0},
                                       headers={"Authorization": f"Bearer {gateway.online.token}"})
                gone = await http.post("/rl/episodes/abc/reward", json={"reward": 1.0},
                                       headers={"Authorization": f"Bearer {gateway.online.token}"})
                return wrong, none, gone

    try:
        wrong, none, gone = asyncio.run(go())
    finally:
        gateway.close()
    assert wrong.status_code == 401 and wrong.json()["error"]["code"] == "invalid_api_key"
    assert none.status_code == 204  # no episode waiting
    assert gone.status_code == 404 and "no claimed episode 'abc'" in gone.json()["error"]["message"]


def test_a_client_group_name_gets_the_episodes_of_one_of_the_runs_groups(tokenizer):
    import threading

    import torch

    from plainrl.rollout import agent_rollout
    from plainrl.rollout.episode_loop import LoopSettings
    from plainrl.rollout.gateway.online import online_agent
    from plainrl.types import SamplingParams
    from test_gateway import ScriptedEngine, prompts

    gateway = Gateway("policy", 2048, online=True)
    headers = {"Authorization": f"Bearer {gateway.online.token}"}
    claimed: dict[str, list[dict]] = {"a": [], "b": []}

    def client() -> None:  # claims and plays as the outside process would, over the socket
        import openai

        with httpx.Client(base_url=gateway.url, headers=headers, timeout=60) as http:
            for group in ("a", "b", "a", "b"):
                ep = http.post("/rl/episodes", json={"group": group, "wait_s": 30}).json()
                claimed[group].append(ep)
                reply = openai.OpenAI(base_url=ep["base_url"], api_key=ep["api_key"], max_retries=0).chat.completions \
                    .create(model="policy", messages=ep["prompt_messages"], max_tokens=8)
                reward = 1.0 if group == "a" else 0.0
                http.post(f"/rl/episodes/{ep['id']}/reward",
                          json={"reward": reward, "info": {"chars": len(reply.choices[0].message.content)}})

    thread = threading.Thread(target=client, daemon=True)
    thread.start()
    try:
        eps = agent_rollout(ScriptedEngine(tokenizer), prompts(tokenizer, 2), online_agent,
                            SamplingParams(max_new_tokens=8), tokenizer, LoopSettings(64, gateway=gateway, timeout_s=60),
                            group_size=2, step=0, generator=torch.Generator().manual_seed(0))
    finally:
        gateway.close()
    thread.join(timeout=10)
    # a group name's episodes are the two of one row; the other name got the other row
    rows = {g: {e["row"]["i"] for e in claimed[g]} for g in claimed}
    assert len(rows["a"]) == 1 and len(rows["b"]) == 1 and rows["a"] != rows["b"]
    assert all(e["group"] == g for g in claimed for e in claimed[g])
    by_row = {e.row["i"]: [] for e in eps}
    for e in eps:
        assert e.env.error is None, e.env.error
        by_row[e.row["i"]].append(e.env.reward)
        assert e.env.info["chars"] >= 0 and e.env.info["segments"] == 1
    assert by_row[next(iter(rows["a"]))] == [1.0, 1.0] and by_row[next(iter(rows["b"]))] == [0.0, 0.0]
