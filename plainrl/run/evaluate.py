"""Held-out evaluation: greedy pass@1 and, when ``eval.k > 1``, mean@k of sampled
completions, graded by ``eval.grader`` (default: the built-in final-answer check,
math-verify), each with a 95% confidence interval; multi-turn runs are evaluated in their
environment."""

from __future__ import annotations

import inspect
import statistics
import time
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Callable

import torch
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

from plainrl.data import PromptRow
from plainrl.intervals import interval_method, mean_interval, wilson_interval
from plainrl.metrics import format_duration
from plainrl.rewards import correctness
from plainrl.rollout import Engine, MultiTurn, env_metrics, rollout
from plainrl.rollout.seeding import episode_seeds
from plainrl.types import Episode, SamplingParams


Grader = Callable[..., Any]  # fn(completion, **row columns) -> 1.0 right, 0.0 wrong, None unscorable (as wrong)


def _accuracy(engine: Engine, rows: list[PromptRow], params: SamplingParams, tokenizer, n: int, generator,
              multi_turn: MultiTurn | None, grader: Grader) -> tuple[list[float], list[Episode]]:
    """Scores [len(rows) * n] (row-major: a row's n samples are adjacent), and the
    episodes when ``multi_turn`` (else [])."""
    flat = [r for r in rows for _ in range(n)]
    if multi_turn is None:
        gens = engine.generate([r.prompt_ids for r in flat], params, seeds=episode_seeds(generator, len(flat)))
        texts, episodes = [tokenizer.decode(g.token_ids, skip_special_tokens=True) for g in gens], []
    else:
        episodes = rollout(engine, flat, params, tokenizer, group_size=1, step=-1, multi_turn=multi_turn,
                           generator=generator)
        texts = [e.completion_text for e in episodes]
    env_cols = _env_columns_taken(grader)
    scores = []
    for i, (r, text) in enumerate(zip(flat, texts)):
        cols = r.row
        if episodes and env_cols:  # an environment's outcome, for a grader that reads it (env_reward)
            cols = {**r.row, **{k: v for k, v in episodes[i].columns().items() if k in env_cols}}
        s = grader(text, **cols)
        scores.append(0.0 if s is None else float(s))
    return scores, episodes


_ENV_COLUMNS = ("env_reward", "env_error", "env_info")


def _env_columns_taken(grader: Grader) -> tuple[str, ...]:
    """The environment columns ``grader`` names as parameters (none for ``**kwargs``: graders written
    for data rows keep getting only the row's columns)."""
    try:
        params = inspect.signature(grader).parameters
    except (TypeError, ValueError):
        return ()
    return tuple(k for k in _ENV_COLUMNS if k in params)


@dataclass
class _Task:
    name: str
    total: int  # prompts
    done: int
    start: float  # time.monotonic()


class _LineProgress:
    """Progress off a terminal (a log file, nohup, a batch job): one line per advance on
    stderr, "eval pass@1: 64/500 rows, 1m05s, ~7m25s left". rich's live bar draws nothing
    there, so a long evaluation looked hung."""

    def __init__(self, console: Console):
        self.console = console
        self.tasks: list[_Task] = []

    def add_task(self, description: str, total: int) -> int:
        self.tasks.append(_Task(description, total, 0, time.monotonic()))
        return len(self.tasks) - 1

    def advance(self, task: int, n: int) -> None:
        t = self.tasks[task]
        t.done += n
        spent = time.monotonic() - t.start
        left = spent / t.done * (t.total - t.done)
        self.console.print(f"eval {t.name}: {t.done}/{t.total} rows, {format_duration(spent)}, "
                           f"~{format_duration(left)} left", highlight=False, soft_wrap=True)


@contextmanager
def _progress(show: bool):
    if not show:
        yield None
        return
    console = Console(stderr=True)
    if not console.is_terminal:
        yield _LineProgress(console)
        return
    with Progress(TextColumn("eval {task.description}"), BarColumn(), MofNCompleteColumn(), TimeRemainingColumn(),
                  console=console, transient=True) as bar:
        yield bar


def evaluate(
    engine: Engine,
    rows: list[PromptRow],
    tokenizer,
    *,
    max_new_tokens: int,
    stop: tuple[str, ...] = (),
    k: int = 1,
    temperature: float = 1.0,
    generator: torch.Generator | None = None,
    multi_turn: MultiTurn | None = None,
    grader: Grader = correctness,
    chunk_size: int = 64,
    progress: bool = False,
) -> dict[str, float]:
    """Accuracy on ``rows`` (each needs the columns ``grader`` reads: ``answer`` for ``correctness``).

    Args:
        max_new_tokens: tokens per completion (per turn with ``multi_turn``).
        multi_turn: run each prompt as a multi-turn episode in the training
            environment (a tool-using policy is graded with its tools), graded on
            the whole completion text, tool output included.
        grader: scores a completion given the row's columns as keywords (``eval.grader``):
            1.0 right, 0.0 wrong; None counts as wrong. With ``multi_turn``, a grader that
            names ``env_reward``, ``env_error`` or ``env_info`` as parameters gets the episode's
            (``plainrl.rollout.envs:env_reward`` grades by the environment's reward).
        chunk_size: prompts handed to the engine at a time (the unit of progress); a
            multiple of the engine's batch size leaves the batches, and so the greedy
            results, as one call would make them.
        progress: show a progress bar (prompts done, time left) on stderr.
    Returns:
        ``{"eval/pass@1": greedy accuracy, "eval/pass@1_ci_low"/"_ci_high": its 95% Wilson
        interval, "eval/mean@k": mean accuracy of k samples per prompt at ``temperature``
        and its 95% interval over prompts (only when k > 1; Student's t below 30 prompts, normal
        from 30: :func:`plainrl.intervals.mean_interval`), "eval/n": number of prompts}``;
        with ``multi_turn``, also the greedy episodes' environment metrics as
        ``eval/env/...`` (e.g. ``eval/env/tool_calls`` per episode).
    """
    if not rows:
        return {}
    chunks = [rows[i: i + chunk_size] for i in range(0, len(rows), chunk_size)]
    greedy = SamplingParams(max_new_tokens=max_new_tokens, temperature=0.0, stop=stop)
    sampled = SamplingParams(max_new_tokens=max_new_tokens, temperature=temperature, stop=stop)
    passes: list[float] = []
    per_prompt: list[float] = []  # each prompt's mean over its k samples
    episodes: list[Episode] = []  # multi-turn: the greedy episodes, for their environment metrics
    with _progress(progress) as bar:
        task = bar.add_task("pass@1", total=len(rows)) if bar else None
        for chunk in chunks:
            scores, chunk_episodes = _accuracy(engine, chunk, greedy, tokenizer, 1, generator, multi_turn, grader)
            passes += scores
            episodes += chunk_episodes
            if bar:
                bar.advance(task, len(chunk))
        if k > 1:
            task = bar.add_task(f"mean@{k}", total=len(rows)) if bar else None
            for chunk in chunks:
                scores = _accuracy(engine, chunk, sampled, tokenizer, k, generator, multi_turn, grader)[0]
                per_prompt += [statistics.fmean(scores[i: i + k]) for i in range(0, len(scores), k)]
                if bar:
                    bar.advance(task, len(chunk))
    low, high = wilson_interval(int(sum(passes)), len(passes))
    out = {"eval/pass@1": statistics.fmean(passes), "eval/pass@1_ci_low": low, "eval/pass@1_ci_high": high,
           "eval/n": len(rows), **{f"eval/{name}": v for name, v in env_metrics(episodes).items()}}
    if k > 1:
        low, high = mean_interval(per_prompt)
        out.update({f"eval/mean@{k}": statistics.fmean(per_prompt), f"eval/mean@{k}_ci_low": max(0.0, low),
                    f"eval/mean@{k}_ci_high": min(1.0, high)})
    return out


def interval_methods(result: dict[str, float]) -> dict[str, str]:
    """How each interval of an :func:`evaluate` result was computed, by metric: ``"wilson"``
    for pass@1, ``"student-t"`` or ``"normal"`` (by the number of prompts) for mean@k
    (:func:`plainrl.intervals.interval_method`)."""
    return {key[len("eval/"):-len("_ci_low")]: interval_method(key[:-len("_ci_low")], int(result["eval/n"]))
            for key in result if key.endswith("_ci_low")}
