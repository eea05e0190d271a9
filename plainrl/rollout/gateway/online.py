"""Online episodes (``rollout.agent: online``): a process outside the run drives them.

The run's episodes are handed out instead of run by an agent function: each waits until an
outside process claims it (``POST /rl/episodes`` -> its id, its key, its data row, the base URLs
of every dialect, its ``sample_id`` and whether it is an ``evaluation``'s), talks to the model
through any dialect with that key (recorded as any agent's calls, whatever prompt the process
sends), and ends it with a reward (``POST /rl/episodes/{id}/reward``). The run trains on what
arrives; an episode that is never claimed or never ended fails after ``rollout.agent_timeout_s``
of its own time, as any agent's. Between rollouts (the learner updating, the weights being
pushed) a claim gets 503 with ``Retry-After``. Groups: a claim may name a ``group`` of its own;
the first claim of a name takes one of the rollout's groups (the ``rollout.group_size`` episodes
sampled together for one prompt: :attr:`~plainrl.rollout.episode_loop.EpisodeLabel.group`), and
later claims of that name get the rest of it, so the episodes a client plays as one group share
their advantage baseline. The routes are guarded by the run's token (``Authorization: Bearer
TOKEN``; ``rollout.gateway_api_key_env``'s, else random), written with the address to
``RUN_DIR/gateway.json`` (:func:`announce`).
"""

from __future__ import annotations

import asyncio
import hmac
import json
import os
import secrets
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pydantic import Field
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from plainrl.durable import write_atomic
from plainrl.rollout.episode_loop import EpisodeLabel, current_episode
from plainrl.rollout.gateway.errors import GatewayError, error_response, parse_body
from plainrl.rollout.gateway.recorder import bearer_key
from plainrl.rollout.gateway.schema import StrictModel

__all__ = ["OnlineEpisodes", "announce", "claim", "online_agent", "reward"]


RETRY_AFTER_S = 2  # a claim between rollouts (the learner updating, the weights being pushed): retry after this


@dataclass
class _Waiting:
    id: str
    llm: Any
    ended: asyncio.Future = field(repr=False)
    label: EpisodeLabel | None = None  # its sample id, group and whether it is an evaluation's

    @property
    def group(self) -> Any:
        """Its rollout group's key (an unlabelled episode is a group of its own)."""
        return self.label.group if self.label is not None else ("episode", self.id)


class ClaimRequest(StrictModel):
    wait_s: float = Field(30.0, ge=0, le=600)
    group: str | None = None


class RewardRequest(StrictModel):
    reward: float | None
    info: dict[str, Any] | None = None


class OnlineEpisodes:
    """The episodes waiting for an outside process, the claimed ones, and the run's token.

    Args:
        token: the secret the ``/rl/`` routes ask for (random when None).
    """

    def __init__(self, token: str | None = None) -> None:
        self.token = token or secrets.token_urlsafe(32)
        self._changed: asyncio.Condition | None = None  # made on the episodes' loop
        self._loop: asyncio.AbstractEventLoop | None = None  # the loop it was made on
        self._waiting: list[_Waiting] = []
        self._claimed: dict[str, _Waiting] = {}
        # a client's group name -> the run's group it took (EpisodeLabel.group)
        self._groups: dict[str, Any] = {}
        self.open = False  # a rollout is being served (else claims get 503 and Retry-After)

    def changed(self) -> asyncio.Condition:
        """Notified whenever an episode starts waiting, and when a rollout's serving starts or ends."""
        loop = asyncio.get_running_loop()
        if self._changed is None or self._loop is not loop:
            self._changed, self._loop = asyncio.Condition(), loop
        return self._changed

    async def set_open(self, value: bool) -> None:
        """Open (a rollout is served) or close the claims; claims waiting are woken to see it."""
        self.open = value
        async with self.changed():
            self.changed().notify_all()

    def take(self, group: str | None) -> _Waiting | None:
        """The waiting episode a claim gets, or None: of the client's ``group`` when it named
        one (a new name takes a run's group no other name holds), else preferably of a run's
        group no name holds. Episodes that ended while waiting (timed out) are dropped."""
        self._waiting = [w for w in self._waiting if not w.llm.closed]
        live = {w.group for w in self._waiting} | {w.group for w in self._claimed.values()}
        self._groups = {g: r for g, r in self._groups.items() if r in live}  # finished groups let go
        held = set(self._groups.values())
        if group is not None and group in self._groups:
            pick = [w for w in self._waiting if w.group == self._groups[group]]
        else:
            pick = [w for w in self._waiting if w.group not in held]
            if group is None:
                pick = pick or self._waiting
        if not pick:
            return None
        if group is not None:
            self._groups[group] = pick[0].group
        self._waiting.remove(pick[0])
        return pick[0]

    def check(self, request: Request) -> None:
        """Raises GatewayError 401 unless the request carries the run's token."""
        if not hmac.compare_digest(bearer_key(request).encode(), self.token.encode()):
            raise GatewayError(401, "the /rl/ routes need the run's token (Authorization: Bearer TOKEN, from "
                                    "RUN_DIR/gateway.json)", code="invalid_api_key")


async def online_agent(llm, row: dict[str, Any]) -> Any:
    """``rollout.agent: online``: wait for an outside process to claim this episode and post its
    reward; the reward (and its ``info``) is the episode's."""
    online: OnlineEpisodes | None = getattr(llm.gateway, "online", None)
    if online is None:
        raise RuntimeError("rollout.agent: online needs a gateway with online episodes (plainrl.run.setup makes one)")
    llm.api_key  # noqa: B018 (the key, made now: the claim hands it out)
    waiting = _Waiting(secrets.token_hex(8), llm, asyncio.get_running_loop().create_future(), current_episode())
    async with online.changed():
        online._waiting.append(waiting)
        online.changed().notify_all()
    try:
        return await waiting.ended
    finally:
        online._claimed.pop(waiting.id, None)
        if waiting in online._waiting:
            online._waiting.remove(waiting)


async def claim(online: OnlineEpisodes, episodes: Any, request: Request) -> Response:
    """``POST /rl/episodes``: the next waiting episode (of the ``group`` named, see the module's
    docstring); waits up to ``wait_s``, 204 when none came. Between rollouts (the learner
    updating, the weights being pushed), and for a claim still waiting when its rollout ends:
    503 with ``Retry-After`` (:data:`RETRY_AFTER_S`)."""
    online.check(request)
    req = await parse_body(request, ClaimRequest) if await request.body() else ClaimRequest()
    changed = online.changed()
    try:
        async with asyncio.timeout(req.wait_s):
            async with changed:
                while online.open and (waiting := online.take(req.group)) is None:
                    await changed.wait()
    except TimeoutError:
        return Response(status_code=204)
    if not online.open:
        return _between_rollouts()
    online._claimed[waiting.id] = waiting
    llm, root, label = waiting.llm, str(request.base_url).rstrip("/"), waiting.label
    return JSONResponse({"id": waiting.id, "group": req.group, "api_key": episodes.key_for(llm),
                         "base_url": f"{root}/v1",
                         "anthropic_base_url": root, "row": _jsonable(llm.row),
                         "prompt_messages": llm.prompt_messages,
                         "sample_id": label.sample_id if label else None,
                         "evaluation": bool(label and label.evaluation)})


async def reward(online: OnlineEpisodes, episodes: Any, request: Request) -> Response:
    """``POST /rl/episodes/{id}/reward``: end a claimed episode with ``reward`` (and ``info``)."""
    online.check(request)
    episode_id = request.path_params["id"]
    waiting = online._claimed.get(episode_id)
    if waiting is None:
        raise GatewayError(404, f"no claimed episode {episode_id!r} is running (ended, timed out, or never claimed)",
                           code="not_found")
    req = await parse_body(request, RewardRequest)
    if not waiting.ended.done():
        waiting.ended.set_result({"reward": req.reward, **(req.info or {})})
    return JSONResponse({"id": episode_id, "ended": True})


def announce(run_dir: Path, url: str, token: str) -> Path:
    """Write ``RUN_DIR/gateway.json`` (the address, the token; readable by the owner only),
    atomically. Returns its path."""
    record = {"url": url, "episodes": f"{url}/rl/episodes", "token": token, "pid": os.getpid()}
    return write_atomic(Path(run_dir) / "gateway.json", json.dumps(record), mode=0o600)


def _between_rollouts() -> Response:
    response = error_response(503, "no rollout is running: the run is between rollouts (updating the policy, "
                                   f"pushing its weights, or not started yet); retry after {RETRY_AFTER_S} s",
                              code="between_rollouts")
    response.headers["retry-after"] = str(RETRY_AFTER_S)
    response.headers["x-should-retry"] = "true"
    return response


def _jsonable(row: dict[str, Any]) -> dict[str, Any]:
    return json.loads(json.dumps(row, default=str))
