"""Score completions with reward functions, turning failures into "unscorable" (None).

    out = score(fns, completions, rows, sample_ids)                 # in-process (default)
    out = score(fns, completions, rows, sample_ids, timeout_s=10)   # worker processes

Each call is ``fn(completion, **columns)`` where columns are the dataset row plus the
spec's ``kwargs`` (kwargs win on a name clash; a row column called ``completion`` is
dropped because the generated completion takes that slot). A function without
``**kwargs`` receives only the parameters it declares.
"""

from __future__ import annotations

import math
import multiprocessing as mp
import numbers
import os
import signal
import sys
import time
import traceback
from collections import deque
from collections.abc import Iterable, Mapping
from multiprocessing.connection import Connection, wait
from typing import Any

from plainrl.rewards.loading import RewardFn
from plainrl.types import RewardOutput

__all__ = ["RewardError", "reward_metrics", "score"]


class RewardError(RuntimeError):
    """A reward function failed while ``fail_fast=True``; names the function and sample."""


# (value, problem, is_error, exception): problem is None on success; a None value by
# intent is recorded but is not an error, so fail_fast does not trip on it. The
# exception object is kept in-process only (it may not pickle), to chain fail_fast.
_Result = tuple[float | None, str | None, bool, BaseException | None]


def _call(rf: RewardFn, completion: str, row: Mapping[str, Any]) -> _Result:
    columns = {**row, **rf.kwargs}
    columns.pop("completion", None)
    if rf.params is not None:
        columns = {k: v for k, v in columns.items() if k in rf.params}
    try:
        value = rf.fn(completion, **columns)
    except Exception as e:
        return None, _describe_exception(e), True, e
    return _check_value(value)


def _describe_exception(e: BaseException) -> str:
    frames = traceback.extract_tb(e.__traceback__)
    where = f" (at {frames[-1].filename}:{frames[-1].lineno})" if frames else ""
    return f"{type(e).__name__}: {e}{where}"


def _check_value(value: Any) -> _Result:
    if value is None:
        return None, "returned None (unscorable)", False, None
    # bool and numpy scalars are numbers.Real; tensors, strings, lists are not.
    if not isinstance(value, numbers.Real):
        return None, f"returned {type(value).__name__} {_short_repr(value)}, expected a float or None", True, None
    out = float(value)
    if not math.isfinite(out):
        return None, f"returned {out}, expected a finite float", True, None
    return out, None, False, None


def _short_repr(value: Any) -> str:
    try:
        r = repr(value)
    except Exception:
        return "<unrepresentable>"
    return r if len(r) <= 60 else r[:57] + "..."


def score(
    fns: list[RewardFn],
    completions: list[str],
    rows: list[dict[str, Any]],
    sample_ids: list[str],
    *,
    timeout_s: float | None = None,
    fail_fast: bool = False,
    workers: int = 1,
) -> RewardOutput:
    """Call every reward function on every completion and combine the results.

    A call that raises, returns NaN/inf or a non-number makes that part None and adds a
    message naming the function, the sample id and the problem to ``errors``; a
    function returning None marks the sample unscorable by intent (also noted in
    ``errors``). ``bool`` counts as 0/1.

    Args:
        fns: from :func:`plainrl.rewards.build_reward_fns` (or built directly).
        completions: [N] generated texts.
        rows: [N] dataset rows; their columns become keyword arguments.
        sample_ids: [N] ids used in error messages.
        timeout_s: None (default): call in this process, no time limit. A number: call
            in forked worker processes, each call limited to ``timeout_s`` seconds; a
            call that runs over gives None with "timed out after Xs" and its worker
            (with its process group) is killed and replaced. Uses the ``fork`` start
            method (Linux/macOS): functions are inherited, not pickled, but rows and
            return values cross a pipe and must pickle. Reward functions must not
            touch CUDA in workers. Workers live for this call only (and, on Linux,
            are killed if this process dies).
        fail_fast: raise :class:`RewardError` at the first failure instead of recording
            it (None returned by intent is not a failure).
        workers: worker processes used when ``timeout_s`` is set.

    Returns:
        ``RewardOutput``: ``total[i] = sum(weight * part)``, or None when a part with
        non-zero weight is None; ``parts[name]`` the raw values; ``errors``.

    Raises:
        ValueError: lengths differ, duplicate names, or ``timeout_s``/``workers`` not positive.
        RewardError: with ``fail_fast=True``, on the first failing call.
    """
    n = len(completions)
    if len(rows) != n or len(sample_ids) != n:
        raise ValueError(
            f"score: got {n} completions, {len(rows)} rows and {len(sample_ids)} sample ids; they must match"
        )
    if timeout_s is not None and not timeout_s > 0:
        raise ValueError(f"score: timeout_s={timeout_s!r} must be > 0 (or None for no limit)")
    if workers < 1:
        raise ValueError(f"score: workers={workers!r} must be >= 1")
    names = [rf.name for rf in fns]
    if len(set(names)) != len(names):
        raise ValueError(f"score: reward names must be unique, got {names}")

    parts: dict[str, list[float | None]] = {rf.name: [None] * n for rf in fns}
    errors: list[str] = []

    def record(k: int, i: int, result: _Result) -> None:
        value, problem, is_error, exc = result
        parts[fns[k].name][i] = value
        if problem is not None:
            msg = f"reward {fns[k].name!r} on sample {sample_ids[i]!r}: {problem}"
            if is_error and fail_fast:
                raise RewardError(msg) from exc
            errors.append(msg)

    if timeout_s is None:
        for k, rf in enumerate(fns):
            for i in range(n):
                record(k, i, _call(rf, completions[i], rows[i]))
    else:
        _score_in_workers(fns, completions, rows, timeout_s, workers, record)

    total: list[float | None] = []
    for i in range(n):
        acc: float | None = 0.0
        for rf in fns:
            part = parts[rf.name][i]
            if rf.weight == 0:
                continue
            if part is None:
                acc = None
                break
            acc += rf.weight * part
        total.append(acc)
    return RewardOutput(total=total, parts=parts, errors=errors)


# ----------------------------------------------------------------------------- workers


def _worker_main(conn: Connection, parent_ends: list[Connection], parent_pid: int, fns: list[RewardFn]) -> None:
    # Own process group, so a timeout can also kill processes the reward started;
    # Ctrl-C is left to the parent, which shuts the workers down.
    os.setpgrp()
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _die_with_parent(parent_pid)
    # Fork copied the parent's ends of every worker pipe; holding them would keep
    # recv() from seeing EOF (and exiting) if the parent dies without stopping us.
    for c in parent_ends:
        c.close()
    while True:
        try:
            task = conn.recv()
        except (EOFError, OSError):
            return
        if task is None:
            return
        k, completion, row = task
        value, problem, is_error, _ = _call(fns[k], completion, row)
        try:
            conn.send((value, problem, is_error, None))
        except Exception as e:  # only plain floats/strs are sent, so this is a broken pipe
            try:
                conn.send((None, f"result could not be sent back: {e}", True, None))
            except Exception:
                return


def _die_with_parent(parent_pid: int) -> None:
    # A worker stuck in a hung reward never reads its pipe again, so pipe EOF alone
    # would not end it if the trainer is killed; on Linux ask the kernel to.
    if not sys.platform.startswith("linux"):
        return
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # 1 = PR_SET_PDEATHSIG
        if os.getppid() != parent_pid:  # the parent died before prctl took effect
            os._exit(0)
    except Exception:
        pass


class _Worker:
    def __init__(self, ctx: Any, fns: list[RewardFn], pool: list[_Worker]) -> None:
        self.conn, child = ctx.Pipe()
        parent_ends = [self.conn] + [w.conn for w in pool if not w.conn.closed]
        self.proc = ctx.Process(target=_worker_main, args=(child, parent_ends, os.getpid(), fns), daemon=False)
        self.proc.start()
        child.close()
        self.task: tuple[int, int] | None = None
        self.deadline = 0.0

    def kill(self) -> None:
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError, OSError):
            pass  # the group may not exist yet (before setpgrp) or already be gone
        self.proc.kill()
        self.proc.join(timeout=5)
        self.conn.close()

    def stop(self) -> None:
        try:
            self.conn.send(None)
        except Exception:
            pass
        self.proc.join(timeout=1)
        if self.proc.is_alive():
            self.kill()
        else:
            self.conn.close()


def _score_in_workers(
    fns: list[RewardFn],
    completions: list[str],
    rows: list[dict[str, Any]],
    timeout_s: float,
    n_workers: int,
    record: Any,
) -> None:
    ctx = mp.get_context("fork")
    pending = deque((k, i) for k in range(len(fns)) for i in range(len(completions)))
    pool: list[_Worker] = []
    try:
        while pending or any(w.task for w in pool):
            # hand out work (starting workers lazily, up to n_workers)
            while pending:
                idle = next((w for w in pool if w.task is None), None)
                if idle is None:
                    if len(pool) >= n_workers:
                        break
                    idle = _Worker(ctx, fns, pool)
                    pool.append(idle)
                k, i = pending.popleft()
                try:
                    idle.conn.send((k, completions[i], rows[i]))
                except Exception as e:
                    record(k, i, (None, f"could not send the row to the worker: {_describe_exception(e)}", True, None))
                    continue
                idle.task, idle.deadline = (k, i), time.monotonic() + timeout_s

            busy = [w for w in pool if w.task is not None]
            if not busy:
                continue
            wait_s = max(0.0, min(w.deadline for w in busy) - time.monotonic())
            ready = set(wait([w.conn for w in busy], timeout=wait_s))
            now = time.monotonic()
            for w in busy:
                k, i = w.task  # type: ignore[misc]
                if w.conn in ready:
                    try:
                        result = w.conn.recv()
                    except (EOFError, OSError):
                        w.proc.join(timeout=1)
                        result = (None, f"worker process died (exit code {w.proc.exitcode})", True, None)
                        _replace(pool, w, ctx, fns)
                    else:
                        w.task = None
                    record(k, i, result)
                elif now >= w.deadline:
                    _replace(pool, w, ctx, fns)
                    record(k, i, (None, f"timed out after {timeout_s:g}s", True, None))
    finally:
        for w in pool:
            if w.task is None:
                w.stop()
            else:
                w.kill()


def _replace(pool: list[_Worker], w: _Worker, ctx: Any, fns: list[RewardFn]) -> None:
    w.kill()
    pool[pool.index(w)] = _Worker(ctx, fns, pool)


# ----------------------------------------------------------------------------- metrics


def reward_metrics(out: RewardOutput, names: Iterable[str] | None = None) -> dict[str, float]:
    """Summary scalars for the logger.

    Args:
        out: a :func:`score` result.
        names: reward names to report (default: every key of ``out.parts``).

    Returns:
        ``reward/mean`` (mean of non-None totals), ``reward/<name>/mean`` (mean of that
        function's non-None values), ``reward/unscorable`` (count of None totals).
        A mean over no values is NaN.
    """

    def mean(xs: Iterable[float | None]) -> float:
        vals = [x for x in xs if x is not None]
        return sum(vals) / len(vals) if vals else math.nan

    metrics = {"reward/mean": mean(out.total)}
    for name in out.parts if names is None else names:
        metrics[f"reward/{name}/mean"] = mean(out.parts.get(name, []))
    metrics["reward/unscorable"] = float(sum(t is None for t in out.total))
    return metrics
