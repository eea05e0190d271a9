"""textarena's single-player games as plainrl environments (``pip install 'plainrl[textarena]'``;
docs/environments.md, "textarena").

    data:
      source: plainrl.integrations.textarena:rows
      source_args: {env_id: GuessTheNumber-v0, n: 2000, seed: 0}
    rollout: {env: plainrl.integrations.textarena:TextArenaEnv, max_turns: 20}
    rewards: [{fn: plainrl.integrations.textarena:reward}]
    eval: {grader: plainrl.integrations.textarena:won}

Each row is one game: its first observation (the game's prompt) as the user turn and
``env_args: {env_id, seed}``, so every episode of the row plays its own copy of the same game.
Each model turn is sent to the game as its action; what the game tells the player next is the
next user turn; the game's final ``state.rewards`` is the episode's reward.

textarena draws its games from Python's global ``random`` (``State`` calls ``random.seed(seed)``).
Every call into a game here runs on that episode's own ``random`` state, swapped in and out under a
lock, so episodes running at once (threads, or one environment worker after another) each replay
exactly their seed's game, and the run's own use of ``random`` is left as it was.
"""

from __future__ import annotations

import difflib
import random
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from plainrl.config import ConfigError
from plainrl.integrations import require
from plainrl.rollout.envs.base import EnvState, EnvTimeoutError, StepResult

ta = require("textarena", extra="textarena")

__all__ = ["TextArenaEnv", "reward", "rows", "won"]

ARGS = "data.source_args"
# textarena's single-player games that need no network, no model and no extra package: what is tested
OFFLINE_GAMES = ("GuessTheNumber-v0", "TowerOfHanoi-v0", "Mastermind-v0", "FrozenLake-v0")
_RANDOM = threading.Lock()  # guards the swap of the global random state
_LOCK_TIMEOUT_S = 60.0  # a game call that holds the lock longer fails the waiting episode, not the run


class Game:
    """One textarena game on its own ``random`` state.

    Args:
        env_id: a textarena registry id (``GuessTheNumber-v0``; ``-raw``/``-train`` variants too).
        seed: the game's seed (textarena's ``reset(seed=)``).

    Raises:
        ConfigError: ``env_id`` is not registered (the message lists close ids).
    """

    def __init__(self, env_id: str, seed: int):
        check_env_id(env_id)
        self.env_id, self.seed = env_id, seed
        self._state = random.Random(seed).getstate()  # whatever the game draws before it seeds itself
        with self._own_random():
            self.env = ta.make(env_id)
        self._base = self.env
        while isinstance(self._base, ta.Wrapper):  # observations from the game, not a wrapper's transcript
            self._base = self._base.env

    @contextmanager
    def _own_random(self) -> Iterator[None]:
        if not _RANDOM.acquire(timeout=_LOCK_TIMEOUT_S):
            raise EnvTimeoutError(f"textarena game {self.env_id!r} (seed {self.seed}): another game's call held the "
                                  f"random state for over {_LOCK_TIMEOUT_S:g} s")
        outside = random.getstate()
        try:
            random.setstate(self._state)
            yield
        finally:
            self._state = random.getstate()
            random.setstate(outside)
            _RANDOM.release()

    def reset(self) -> str:
        """Start the game; returns its first observation (the prompt)."""
        with self._own_random():
            self.env.reset(num_players=1, seed=self.seed)
            return self.observation()

    def observation(self) -> str:
        """What the game told the player since the last call (its own echo of the player's action left out)."""
        _, messages = self._base.get_observation()
        return "\n".join(m for _, m, kind in messages if kind != ta.ObservationType.PLAYER_ACTION).strip()

    def step(self, action: str) -> tuple[bool, str, float | None, dict[str, Any]]:
        """Play ``action``. Returns ``(done, next observation, final reward or None, game info)``."""
        with self._own_random():
            done, _ = self.env.step(action=action)
            if not done:
                return False, self.observation(), None, {}
            rewards, game_info = self.env.close()
        if not rewards or 0 not in rewards:
            raise RuntimeError(f"textarena game {self.env_id!r} ended without a reward for player 0 ({rewards!r})")
        return True, "", float(rewards[0]), dict(game_info.get(0, {}))


def check_env_id(env_id: Any) -> None:
    """Raise :class:`ConfigError` unless ``env_id`` is a registered textarena game id."""
    from textarena.envs.registration import ENV_REGISTRY

    if not isinstance(env_id, str) or env_id not in ENV_REGISTRY:
        close = difflib.get_close_matches(str(env_id), list(ENV_REGISTRY), n=3)
        hint = f" Did you mean {', '.join(map(repr, close))}?" if close else ""
        raise ConfigError(f"{ARGS}.env_id: {env_id!r} is not a textarena game.{hint} Single-player games that run "
                          f"offline: {', '.join(OFFLINE_GAMES)}")


def rows(env_id: str, n: int = 1000, seed: int = 0) -> list[dict[str, Any]]:
    """``data.source``: ``n`` games of ``env_id``, seeds ``seed .. seed + n - 1``.

    Returns:
        rows with ``messages`` (the game's first observation as the user turn) and ``env_args``
        (``{env_id, seed}``: :class:`TextArenaEnv`'s arguments, so each episode replays that game).

    Raises:
        ConfigError: an unknown ``env_id`` (close ids named), a bad ``n`` or ``seed``, or a game that
            cannot start as a single-player game (a multi-player game; one that needs a network or
            another package); the message names the key and the games that run.
    """
    check_env_id(env_id)
    if isinstance(n, bool) or not isinstance(n, int) or n <= 0:
        raise ConfigError(f"{ARGS}.n: expected a positive number of games, got {n!r}")
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise ConfigError(f"{ARGS}.seed: expected an integer, got {seed!r}")
    out = []
    for s in range(seed, seed + n):
        try:
            prompt = Game(env_id, s).reset()
        except Exception as e:
            raise ConfigError(f"{ARGS}.env_id: textarena's {env_id!r} did not start as a one-player game (seed {s}): "
                              f"{type(e).__name__}: {e}. Single-player games that run offline: "
                              f"{', '.join(OFFLINE_GAMES)}") from None
        out.append({"messages": [{"role": "user", "content": prompt}], "env_args": {"env_id": env_id, "seed": s}})
    return out


class TextArenaEnv:
    """``rollout.env``: one textarena game per episode (plainrl's ``Environment`` protocol).

    Every model turn ends at EOS and is the game's action; the game's answer is the next user
    turn; when the game ends the episode does, with the game's reward for player 0
    (``Episode.env.reward``: ``plainrl.rollout.envs:env_reward``) and ``info`` ``won`` (reward 1),
    ``invalid_move`` (the game ended on one) and ``game_turns`` (textarena's count of valid moves).
    A game that raises fails its own episode; with ``rollout.env_timeout_s`` (the default) one that
    hangs is killed with its worker and fails its episode too.

    Args:
        env_id: the textarena game id (the row's ``env_args``).
        seed: the game's seed (the row's ``env_args``).
    """

    stop: tuple[str, ...] = ()
    max_turns: int | None = None

    def __init__(self, env_id: str, seed: int):
        self.game = Game(env_id, seed)

    def reset(self, row: dict[str, Any]) -> None:
        """Start the row's game; its first observation must be the row's prompt (it was made by :func:`rows`)."""
        first = self.game.reset()
        prompt = (row.get("messages") or [{}])[-1].get("content")
        if prompt is not None and prompt.strip() != first:
            raise RuntimeError(f"textarena game {self.game.env_id!r} seed {self.game.seed} began with another "
                               "observation than the row's prompt; make the rows with plainrl.integrations.textarena:rows")
        return None

    def step(self, turn_text: str, state: EnvState) -> StepResult:
        """Send the model's turn to the game as its action."""
        done, observation, reward, info = self.game.step(turn_text)
        if not done:
            return StepResult(observation=[{"role": "user", "content": observation}])
        return StepResult(done=True, reward=reward, info={
            "won": int(reward == 1.0), "invalid_move": int(bool(info.get("invalid_move"))),
            "game_turns": int(info.get("turn_count", 0)),
        })


def reward(completion: str, env_reward: float | None = None, env_error: str | None = None,
           **_columns: Any) -> float | None:
    """Reward: the game's final reward; 0.0 for a game the run's limits cut short (a reply reaching
    ``rollout.max_new_tokens``, ``rollout.max_total_tokens`` or ``rollout.max_turns``: the player did not
    finish it); None (unscorable) when the game failed (``env_error``)."""
    if env_error is not None:
        return None
    return 0.0 if env_reward is None else float(env_reward)


def won(completion: str, env_reward: float | None = None, **_columns: Any) -> float:
    """``eval.grader``: 1.0 when the episode's game ended with reward 1 (won), else 0.0."""
    return 1.0 if env_reward == 1.0 else 0.0
