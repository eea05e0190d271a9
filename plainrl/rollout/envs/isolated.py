"""Environments in worker processes, each call under a time limit (``rollout.env_timeout_s``).

    workers = EnvWorkers(lambda: MyEnv(), timeout_s=10)
    episodes = multi_turn_rollout(engine, batch, workers, params, tokenizer, ...)
    workers.close()

:class:`EnvWorkers` is an environment factory: each call gives a :class:`RemoteEnv`,
a stand-in whose real environment is built by the factory inside a worker process
(:class:`plainrl.rollout.workers.Worker`) and lives there for the whole episode, so it
keeps its state across turns. ``reset``, ``tools_schema``, ``step`` and ``final_reward`` are
forwarded to it, each limited to ``timeout_s`` seconds. A call that runs over gets
its worker's whole process group killed; the call raises :class:`EnvWorkerError`,
which ends that episode as unscorable (``Episode.env.error``) while the other
episodes go on. A worker serves one episode at a time and is reused by later
episodes once the rollout closes the environment.
"""

from __future__ import annotations

import multiprocessing as mp
from dataclasses import dataclass
from typing import Any, Callable

from plainrl.rollout.envs.base import EnvState, EnvTimeoutError, Environment, StepResult
from plainrl.rollout.workers import Worker, WorkerDied, WorkerPool, WorkerTimeout

__all__ = ["EnvWorkerError", "EnvWorkerTimeout", "EnvWorkers", "RemoteEnv"]


class EnvWorkerError(RuntimeError):
    """An environment call in a worker failed; the message says how, self-contained
    (``"RuntimeError: boom (at env.py:12)"``, ``"env.step did not return within 5 s; ..."``)."""


class EnvWorkerTimeout(EnvWorkerError, EnvTimeoutError):
    """An environment call in a worker ran over ``timeout_s``; the worker was killed."""


@dataclass(frozen=True)
class _Spec:
    """What the rollout reads from an environment object, sent back when it is built."""

    stop: tuple[str, ...]
    max_turns: int | None
    has_tools: bool
    has_final_reward: bool = False


def _host(factory: Callable[[], Environment]) -> Callable[[tuple], Any]:
    """The worker's side: one environment at a time, built by ``factory``, and its
    ``EnvState.scratch`` (kept here: it may hold what does not pickle)."""
    held: dict[str, Any] = {"env": None, "scratch": {}}

    def handle(task: tuple) -> Any:
        op, *args = task
        env = held["env"]
        if op == "new":
            env = held["env"] = factory(**(args[0] if args else {}))
            held["scratch"] = {}
            return _Spec(tuple(getattr(env, "stop", ()) or ()), getattr(env, "max_turns", None),
                         callable(getattr(env, "tools_schema", None)), callable(getattr(env, "final_reward", None)))
        if env is None:
            raise RuntimeError(f"no environment in this worker for {op!r} (it was closed or never built)")
        if op == "reset":
            return env.reset(*args)
        if op == "tools_schema":
            return env.tools_schema()
        if op == "step":
            turn_text, state = args
            state.scratch = held["scratch"]
            res = env.step(turn_text, state)
            if not isinstance(res, StepResult):
                raise TypeError(f"env.step must return a StepResult, got {type(res).__name__}")
            return res
        if op == "final_reward":
            return env.final_reward()
        if op == "close":
            held["env"], held["scratch"] = None, {}
            close = getattr(env, "close", None)
            return close() if callable(close) else None
        raise ValueError(f"unknown environment operation {op!r}")

    return handle


class RemoteEnv:
    """An :class:`~plainrl.rollout.envs.base.Environment` whose real object lives in a worker process.

    Built by :class:`EnvWorkers`; ``stop`` and ``max_turns`` are the real
    environment's. Every method call is sent to the worker and waits at most the
    pool's ``timeout_s``.

    Raises (from every method):
        EnvWorkerTimeout: the call ran over; the worker and what it started were killed.
        EnvWorkerError: the call raised in the worker (the message has its type,
            text and the line it was raised at), the worker died, or this
            environment was already closed or killed.
    """

    def __init__(self, pool: EnvWorkers, worker: Worker, spec: _Spec) -> None:
        self._pool, self._worker = pool, worker
        self.stop, self.max_turns, self._has_tools = spec.stop, spec.max_turns, spec.has_tools
        if spec.has_final_reward:  # present only when the real environment has one
            self.final_reward = lambda: self._call("final_reward")

    def reset(self, row: dict[str, Any]) -> list[dict[str, Any]] | str | None:
        return self._call("reset", row)

    def tools_schema(self) -> list[dict[str, Any]] | None:
        return self._call("tools_schema") if self._has_tools else None

    def step(self, turn_text: str, state: EnvState) -> StepResult:
        # scratch stays in the worker; everything else of the state is the rollout's
        remote_state = EnvState(row=state.row, turn=state.turn, text=state.text, messages=state.messages,
                                finish_reason=state.finish_reason)
        return self._call("step", turn_text, remote_state)

    def close(self) -> None:
        """Close the real environment (its ``close()``, if any) and give the worker back to the pool."""
        worker, self._worker = self._worker, None
        if worker is None:
            return
        try:
            _call(worker, ("close",), self._pool.timeout_s)
        except EnvWorkerError:
            return  # killed or dead: not given back
        self._pool.give_back(worker)

    def _call(self, op: str, *args: Any) -> Any:
        if self._worker is None:
            raise EnvWorkerError(f"env.{op}: the environment was closed, or its worker was killed by an earlier call")
        try:
            return _call(self._worker, (op, *args), self._pool.timeout_s)
        except EnvWorkerError:
            self._worker = None
            raise


def _call(worker: Worker, task: tuple, timeout_s: float) -> Any:
    op = task[0]
    try:
        status, value = worker.call(task, timeout_s)
    except WorkerTimeout as e:
        raise EnvWorkerTimeout(f"env.{op} {e}") from None
    except WorkerDied as e:
        raise EnvWorkerError(f"env.{op}: the environment's {e}") from None
    if status != "ok":
        worker.kill()  # the environment's state after a failed call is unknown: not reused
        raise EnvWorkerError(value)
    return value


class EnvWorkers(WorkerPool):
    """A factory of :class:`RemoteEnv`: each episode's environment in a worker process.

    Args:
        factory: (**env_args) -> a fresh environment; called inside the worker (inherited
            through ``fork``, never pickled). Rows, messages and step results
            cross a pipe and must pickle; ``EnvState.scratch`` stays in the worker.
        timeout_s: the time limit of each call (building the environment,
            ``reset``, ``tools_schema``, ``step``, ``final_reward``, ``close``), in seconds.
    Raises:
        ValueError: ``timeout_s`` is not positive, or this OS cannot ``fork`` (Windows).

    A :class:`~plainrl.rollout.workers.WorkerPool`: workers are kept between episodes (one
    episode per worker at a time) and replaced when one is killed; :meth:`prestart`
    forks them early, before the trainer's memory grows. :meth:`close` stops them
    all. Environments must not use CUDA.
    """

    def __init__(self, factory: Callable[[], Environment], *, timeout_s: float) -> None:
        if not timeout_s > 0:
            raise ValueError(f"timeout_s={timeout_s!r} must be > 0")
        if "fork" not in mp.get_all_start_methods():
            raise ValueError("environment workers need the 'fork' start method (Linux, macOS); "
                             "set rollout.env_timeout_s: null to run environments in this process")
        super().__init__(_host(factory), name="plainrl-env")
        self.timeout_s = timeout_s

    def __call__(self, **env_args: Any) -> RemoteEnv:
        """A new environment, built in an idle (or newly forked) worker as ``factory(**env_args)``
        (a data row's ``env_args``; they cross the pipe, so they must pickle).

        Raises:
            EnvWorkerError: building it raised, hung or killed the worker.
        """
        worker = self.take()
        return RemoteEnv(self, worker, _call(worker, ("new", env_args), self.timeout_s))
