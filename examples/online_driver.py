"""Drive a run's episodes from another process (`rollout.agent: online`).

Start a run whose episodes wait for an outside process, then this script beside it:

    plainrl train examples/arithmetic_grpo.yaml rollout.agent=online 'rewards=[]' &
    python examples/online_driver.py runs/arithmetic_grpo

It reads the run's address and token from RUN_DIR/gateway.json, claims each episode the run
hands out (`POST /rl/episodes`: its key, its data row, the base URLs of every dialect; a 503 with
`Retry-After` between steps), talks
to the model with the `openai` SDK on the episode's key (recorded token-exactly, as any agent's
calls), scores the answer and ends the episode with its reward
(`POST /rl/episodes/{id}/reward`). It stops when the run is over (its gateway closed). See docs/agents.md,
"Online episodes".
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import httpx
import openai

from plainrl.rewards.builtins import correctness


def read_gateway(run_dir: Path, timeout_s: float = 600.0) -> dict:
    """RUN_DIR/gateway.json, once the run (alive) has written it."""
    path, deadline = run_dir / "gateway.json", time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if path.is_file():
            info = json.loads(path.read_text())
            if _alive(info["pid"]):
                return info
        time.sleep(0.2)
    raise TimeoutError(f"no live run wrote {path} within {timeout_s:g} s; start `plainrl train ... rollout.agent=online`")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def play(episode: dict) -> float:
    """One episode: the model answers the row's prompt; the reward is its correctness."""
    client = openai.OpenAI(base_url=episode["base_url"], api_key=episode["api_key"], max_retries=0, timeout=600)
    try:
        r = client.chat.completions.create(model="policy", messages=episode["prompt_messages"], max_tokens=64)
    except openai.BadRequestError:  # no room left in the episode's budget
        return 0.0
    return correctness(r.choices[0].message.content or "", answer=episode["row"]["answer"])


def main(run_dir: str) -> int:
    info = read_gateway(Path(run_dir))
    headers = {"Authorization": f"Bearer {info['token']}"}
    played = 0
    with httpx.Client(headers=headers, timeout=httpx.Timeout(120.0, connect=5.0)) as http:
        while _alive(info["pid"]):
            try:
                r = http.post(info["episodes"], json={"wait_s": 5})
            except httpx.ConnectError:  # the run closed its gateway: it is over
                break
            except httpx.TransportError:  # the connection broke: ask again
                continue
            if r.status_code == 503:  # between steps (the policy updating): come back when it says
                time.sleep(float(r.headers.get("retry-after", "1")))
                continue
            if r.status_code == 204:  # none waiting now
                continue
            if r.status_code != 200:
                raise RuntimeError(f"POST {info['episodes']}: {r.status_code} {r.text}")
            episode = r.json()
            reward = play(episode)
            http.post(f"{info['episodes']}/{episode['id']}/reward", json={"reward": reward}).raise_for_status()
            played += 1
    print(f"online_driver: {played} episodes played; the run is over")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
