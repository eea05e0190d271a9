"""Held-out evaluation: greedy pass@1 and, when ``eval.k > 1``, mean@k of sampled
completions, graded by the built-in final-answer check (math-verify); multi-turn runs
are evaluated in their environment."""

from __future__ import annotations

import statistics

import torch

from plainrl.data import PromptRow
from plainrl.rewards import correctness
from plainrl.rollout import Engine, MultiTurn, env_metrics, rollout
from plainrl.types import SamplingParams


def _accuracy(engine: Engine, rows: list[PromptRow], params: SamplingParams, tokenizer, n: int, generator,
              multi_turn: MultiTurn | None) -> tuple[list[float], dict[str, float]]:
    flat = [r for r in rows for _ in range(n)]
    if multi_turn is None:
        gens = engine.generate([r.prompt_ids for r in flat], params, generator=generator)
        texts, extra = [tokenizer.decode(g.token_ids, skip_special_tokens=True) for g in gens], {}
    else:
        episodes = rollout(engine, flat, params, tokenizer, group_size=1, step=-1, multi_turn=multi_turn,
                           generator=generator)
        texts, extra = [e.completion_text for e in episodes], env_metrics(episodes)
    scores = []
    for r, text in zip(flat, texts):
        s = correctness(text, **r.row)
        scores.append(0.0 if s is None else float(s))
    return scores, extra


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
) -> dict[str, float]:
    """Accuracy on ``rows`` (each needs an ``answer`` column).

    Args:
        max_new_tokens: tokens per completion (per turn with ``multi_turn``).
        multi_turn: run each prompt as a multi-turn episode in the training
            environment (a tool-using policy is graded with its tools), graded on
            the whole completion text, tool output included.
    Returns:
        ``{"eval/pass@1": greedy accuracy, "eval/mean@k": mean accuracy of k samples
        per prompt at ``temperature`` (only when k > 1), "eval/n": number of prompts}``;
        with ``multi_turn``, also the greedy episodes' environment metrics as
        ``eval/env/...`` (e.g. ``eval/env/tool_calls`` per episode).
    """
    if not rows:
        return {}
    greedy = SamplingParams(max_new_tokens=max_new_tokens, temperature=0.0, stop=stop)
    scores, extra = _accuracy(engine, rows, greedy, tokenizer, 1, generator, multi_turn)
    out = {"eval/pass@1": statistics.fmean(scores), "eval/n": len(rows),
           **{f"eval/{k_}": v for k_, v in extra.items()}}
    if k > 1:
        sampled = SamplingParams(max_new_tokens=max_new_tokens, temperature=temperature, stop=stop)
        out[f"eval/mean@{k}"] = statistics.fmean(_accuracy(engine, rows, sampled, tokenizer, k, generator,
                                                            multi_turn)[0])
    return out
