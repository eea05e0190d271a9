"""Score completions with reward functions, turning failures into "unscorable" (None).

    out = score(fns, completions, rows, sample_ids)                 # in-process (default)
    out = score(fns, completions, rows, sample_ids, timeout_s=10)   # worker processes
    with RewardWorkers(fns) as pool:                                 # workers kept across calls
        out = score(fns, completions, rows, sample_ids, timeout_s=10, pool=pool)

Each call is ``fn(completion, **columns)`` where columns are the dataset row plus the
spec's ``kwargs`` (kwargs win on a name clash; a row column called ``completion`` is
dropped because the generated completion takes that slot). A function without
``**kwargs`` receives only the parameters it declares.

A function marked with :func:`plainrl.rewards.batched` is called once per chunk instead:
``fn(completions, **columns)`` with each column a list aligned with ``completions``
(kwargs as given). In this process the chunk is the whole batch; with workers the
batch is split into one chunk per worker, and ``timeout_s`` bounds each chunk's call.
"""

from __future__ import annotations

import math
import numbers
import time
from collections import deque
from collections.abc import Iterable, Mapping
from multiprocessing.connection import wait
from typing import Any

from plainrl.rewards.loading import RewardFn
from plainrl.types import RewardOutput, SampleError
from plainrl.rollout.workers import Worker, WorkerDied, WorkerPool, describe_exception

__all__ = ["RewardError", "RewardWorkers", "reward_metrics", "score", "weighted_total"]


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
        return None, describe_exception(e), True, e
    return _check_value(value)


def _call_batched(rf: RewardFn, completions: list[str], rows: list[Mapping[str, Any]]) -> list[_Result] | str:
    """Per-sample results of one batched call, or a message (str) when the function broke
    its contract (wrong length, not a list): the caller raises :class:`RewardError` with it."""
    names: dict[str, None] = {}
    for row in rows:
        names.update(dict.fromkeys(row))
    names.pop("completion", None)
    if rf.params is not None:
        names = {k: None for k in names if k in rf.params}
    columns: dict[str, Any] = {k: [row.get(k) for row in rows] for k in names}
    columns.update(rf.kwargs)
    if rf.params is not None:
        columns = {k: v for k, v in columns.items() if k in rf.params}
    try:
        values = rf.fn(list(completions), **columns)
    except Exception as e:
        problem = f"batched call on {len(completions)} completions raised {describe_exception(e)}"
        return [(None, problem, True, e)] * len(completions)
    if isinstance(values, (str, bytes, Mapping)) or not hasattr(values, "__len__") or not hasattr(values, "__iter__"):
        return (f"batched reward {rf.name!r} returned {type(values).__name__} {_short_repr(values)}; "
                f"expected a list of {len(completions)} floats or None, one per completion")
    if len(values) != len(completions):
        return (f"batched reward {rf.name!r} returned {len(values)} values for {len(completions)} "
                "completions; return exactly one float or None per completion, in order")
    return [_check_value(v) for v in values]


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
    pool: RewardWorkers | None = None,
    combine: Any = None,
) -> RewardOutput:
    """Call every reward function on every completion and combine the results.

    A call that raises, returns NaN/inf or a non-number makes that part None and adds a
    message naming the function, the sample id and the problem to ``errors``; a
    function returning None marks the sample unscorable by intent (also noted in
    ``errors``, as :class:`~plainrl.types.SampleError`). ``bool`` counts as 0/1.

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
            touch CUDA in workers. The workers are ``pool``'s, or else forked for this
            call only; on Linux they are killed if this process dies.
        fail_fast: raise :class:`RewardError` at the first failure instead of recording
            it (None returned by intent is not a failure).
        workers: worker processes used when ``timeout_s`` is set and no ``pool`` is given.
        pool: a :class:`RewardWorkers` built for this same ``fns`` list, whose workers
            are reused across calls (what the trainer does).

        combine: a :class:`plainrl.rewards.RewardCombine` (``reward_combine``) that turns the
            parts into the totals instead of the weighted sum.

    Returns:
        ``RewardOutput``: ``total[i] = sum(weight * part)``, or None when a part with
        non-zero weight is None (or what ``combine`` returned); ``parts[name]`` the raw
        values; ``errors``.

    Raises:
        ValueError: lengths differ, duplicate names, ``timeout_s``/``workers`` not positive,
            or ``pool`` was built for other functions.
        RewardError: with ``fail_fast=True``, on the first failing call; always, when a
            batched function returns the wrong number of values or a ``combine`` breaks
            its contract (both name the function).
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
    if pool is not None and pool.fns is not fns:
        raise ValueError("score: the pool's workers were forked with another list of reward functions")
    names = [rf.name for rf in fns]
    if len(set(names)) != len(names):
        raise ValueError(f"score: reward names must be unique, got {names}")

    parts: dict[str, list[float | None]] = {rf.name: [None] * n for rf in fns}
    errors: list[SampleError] = []

    def record(k: int, i: int, result: _Result) -> None:
        value, problem, is_error, exc = result
        parts[fns[k].name][i] = value
        if problem is not None:
            err = SampleError(sample_ids[i], f"reward {fns[k].name!r}", problem)
            if is_error and fail_fast:
                raise RewardError(str(err)) from exc
            errors.append(err)

    def record_chunk(k: int, idxs: list[int], results: list[_Result] | str) -> None:
        if isinstance(results, str):
            raise RewardError(results)
        for i, result in zip(idxs, results):
            record(k, i, result)

    if timeout_s is None:
        for k, rf in enumerate(fns):
            if rf.batched:
                if n:
                    record_chunk(k, list(range(n)), _call_batched(rf, completions, rows))
                continue
            for i in range(n):
                record(k, i, _call(rf, completions[i], rows[i]))
    elif pool is not None:
        _score_in_workers(pool, completions, rows, timeout_s, record_chunk)
    else:
        with RewardWorkers(fns, workers) as own:
            _score_in_workers(own, completions, rows, timeout_s, record_chunk)

    if combine is not None:
        total = combine(parts, rows)
    else:
        total = weighted_total(parts, {rf.name: rf.weight for rf in fns}, n)
    return RewardOutput(total=total, parts=parts, errors=errors)


def weighted_total(parts: Mapping[str, list[float | None]], weights: Mapping[str, float],
                   n: int) -> list[float | None]:
    """``total[i] = sum(weight * parts[name][i])``; None when a part with non-zero weight is
    None (weight 0 parts are logged, never used).

    Args:
        parts: {name: [N] values or None}.
        weights: {name: weight}, the same names.
        n: N (the totals of no parts are N zeros).
    """
    total: list[float | None] = []
    for i in range(n):
        acc: float | None = 0.0
        for name, w in weights.items():
            if w == 0:
                continue
            if parts[name][i] is None:
                acc = None
                break
            acc += w * parts[name][i]
        total.append(acc)
    return total


# ----------------------------------------------------------------------------- workers


class RewardWorkers(WorkerPool):
    """Worker processes that call reward functions, kept between :func:`score` calls.

    A :class:`~plainrl.rollout.workers.WorkerPool`: the trainer forks these once, before the
    model loads (:meth:`prestart`), and reuses them every step; a worker killed after
    a timeout is replaced by a new fork. Each worker inherits ``fns`` through
    ``fork`` and calls them by index, so the pool serves exactly this list.

    Args:
        fns: the reward functions (the list later given to :func:`score`).
        size: worker processes scoring at once.
    Raises:
        ValueError: ``size`` < 1.
    """

    def __init__(self, fns: list[RewardFn], size: int = 1) -> None:
        if size < 1:
            raise ValueError(f"RewardWorkers: size={size!r} must be >= 1")
        super().__init__(self._handle, name="plainrl-reward")
        self.fns, self.size = fns, size

    def _handle(self, task: tuple[int, Any, Any]) -> list[_Result] | str:
        # per-sample: (k, completion, row); batched: (k, completions, rows). Always answers
        # a list of results (or a batched contract message); exceptions may not pickle.
        k, completion, row = task
        if self.fns[k].batched:
            got = _call_batched(self.fns[k], completion, row)
            return got if isinstance(got, str) else [r[:3] + (None,) for r in got]
        value, problem, is_error, _ = _call(self.fns[k], completion, row)
        return [(value, problem, is_error, None)]

    def prestart(self, n: int | None = None) -> None:
        """Fork workers until ``n`` (default ``size``) are idle."""
        super().prestart(self.size if n is None else n)


def _score_in_workers(
    pool: RewardWorkers,
    completions: list[str],
    rows: list[dict[str, Any]],
    timeout_s: float,
    record_chunk: Any,
) -> None:
    n = len(completions)
    size = -(-n // pool.size) if n else 1  # a batched function's chunk: one per worker
    pending: deque[tuple[int, list[int]]] = deque()
    for k, rf in enumerate(pool.fns):
        if rf.batched:
            pending.extend((k, list(range(a, min(n, a + size)))) for a in range(0, n, size))
        else:
            pending.extend((k, [i]) for i in range(n))
    mine: list[Worker] = []  # taken from the pool for this call
    tasks: dict[Worker, tuple[int, list[int], float]] = {}  # busy worker -> (function, samples, deadline)

    def fail(k: int, idxs: list[int], problem: str) -> None:
        record_chunk(k, idxs, [(None, problem, True, None)] * len(idxs))
    try:
        while pending or tasks:
            # hand out work (taking workers as needed, up to the pool's size)
            while pending:
                idle = next((w for w in mine if w not in tasks), None)
                if idle is None:
                    if len(mine) >= pool.size:
                        break
                    idle = pool.take()
                    mine.append(idle)
                k, idxs = pending.popleft()
                if pool.fns[k].batched:
                    task = (k, [completions[i] for i in idxs], [rows[i] for i in idxs])
                else:
                    task = (k, completions[idxs[0]], rows[idxs[0]])
                try:
                    idle.send(task)
                except WorkerDied as e:
                    mine.remove(idle)
                    fail(k, idxs, str(e))
                    continue
                except Exception as e:
                    fail(k, idxs, f"could not send the row to the worker: {describe_exception(e)}")
                    continue
                tasks[idle] = (k, idxs, time.monotonic() + timeout_s)

            if not tasks:
                continue
            wait_s = max(0.0, min(d for _, _, d in tasks.values()) - time.monotonic())
            ready = set(wait([w.conn for w in tasks], timeout=wait_s))
            now = time.monotonic()
            for w, (k, idxs, deadline) in list(tasks.items()):
                if w.conn in ready:
                    del tasks[w]
                    try:
                        status, value = w.recv()
                    except WorkerDied as e:
                        mine.remove(w)
                        fail(k, idxs, str(e))
                        continue
                    if status == "ok":
                        record_chunk(k, idxs, value)
                    else:
                        fail(k, idxs, value)
                elif now >= deadline:
                    del tasks[w]
                    w.kill()
                    mine.remove(w)
                    fail(k, idxs, f"timed out after {timeout_s:g}s")
    finally:
        for w in mine:
            if w in tasks:  # interrupted mid-call (fail_fast, Ctrl-C): its state is unknown
                w.kill()
            else:
                pool.give_back(w)


# ----------------------------------------------------------------------------- metrics


def reward_metrics(out: RewardOutput, names: Iterable[str] | None = None) -> dict[str, float]:
    """Summary scalars for the logger.

    Args:
        out: a :func:`score` result.
        names: reward names to report (default: every key of ``out.parts``).

    Returns:
        ``reward/mean`` (mean of non-None totals), ``reward/<name>/mean`` (mean of that
        function's non-None values), ``reward/<name>/unscorable`` (count of that
        function's None values: failures and None by intent), ``reward/unscorable``
        (count of None totals). A mean over no values is NaN.
    """

    def mean(xs: Iterable[float | None]) -> float:
        vals = [x for x in xs if x is not None]
        return sum(vals) / len(vals) if vals else math.nan

    metrics = {"reward/mean": mean(out.total)}
    for name in out.parts if names is None else names:
        metrics[f"reward/{name}/mean"] = mean(out.parts.get(name, []))
        metrics[f"reward/{name}/unscorable"] = float(sum(v is None for v in out.parts.get(name, [])))
    metrics["reward/unscorable"] = float(sum(t is None for t in out.total))
    return metrics
