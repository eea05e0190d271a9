"""Held-out evaluation: greedy pass@1 and, when ``eval.k > 1``, mean@k of sampled
completions, graded by the built-in final-answer check (math-verify)."""

from __future__ import annotations

import statistics

import torch

from plainrl.data import PromptRow
from plainrl.engines.base import Engine
from plainrl.rewards import correctness
from plainrl.types import SamplingParams


def _accuracy(engine: Engine, rows: list[PromptRow], params: SamplingParams, tokenizer, n: int, generator) -> list[float]:
    flat = [r for r in rows for _ in range(n)]
    gens = engine.generate([r.prompt_ids for r in flat], params, generator=generator)
    scores = []
    for r, g in zip(flat, gens):
        s = correctness(tokenizer.decode(g.token_ids, skip_special_tokens=True), **r.row)
        scores.append(0.0 if s is None else float(s))
    return scores


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
) -> dict[str, float]:
    """Accuracy on ``rows`` (each needs an ``answer`` column).

    Returns:
        ``{"eval/pass@1": greedy accuracy, "eval/mean@k": mean accuracy of k samples
        per prompt at ``temperature`` (only when k > 1), "eval/n": number of prompts}``.
    """
    if not rows:
        return {}
    greedy = SamplingParams(max_new_tokens=max_new_tokens, temperature=0.0, stop=stop)
    out = {"eval/pass@1": statistics.fmean(_accuracy(engine, rows, greedy, tokenizer, 1, generator)), "eval/n": len(rows)}
    if k > 1:
        sampled = SamplingParams(max_new_tokens=max_new_tokens, temperature=temperature, stop=stop)
        out[f"eval/mean@{k}"] = statistics.fmean(_accuracy(engine, rows, sampled, tokenizer, k, generator))
    return out
