"""Reproducible by seed: an episode's samples depend on the run's seed, the episode and the
call's index within it, not on how the engine calls were batched or how many episodes ran
at once (docs/engines.md, "Seeds")."""

from __future__ import annotations

import asyncio

import pytest
import torch

from plainrl.data import PromptRow, build_prompt_ids
from plainrl.rollout import agent_rollout, rollout
from plainrl.rollout.engines.hf import HFEngine
from plainrl.rollout.episode_loop import LoopSettings
from plainrl.types import SamplingParams


@pytest.fixture(scope="module")
def tiny(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)


def prompts(tok, n: int) -> list[PromptRow]:
    rows = [{"prompt": f"What is {i} + {2 * i}?", "answer": str(3 * i)} for i in range(n)]
    return [PromptRow(r, build_prompt_ids(r, tok), i) for i, r in enumerate(rows)]


async def two_calls(llm, row):
    """Two chat calls with a tool message between them; episodes pause for different times, so
    the batches they share depend on timing and on how many run at once."""
    messages = llm.prompt_messages
    for turn in range(2):
        reply = await llm.chat(messages, max_new_tokens=4 + 2 * turn)
        await asyncio.sleep(0.001 * (int(row["answer"]) % 5))
        messages += [reply.message, {"role": "tool", "content": str(turn)}]
    return 1.0


def agent_completions(model, tok, *, max_live: int, batch_size: int) -> list[list[int]]:
    eps = agent_rollout(HFEngine(model, tok, batch_size=batch_size), prompts(tok, 2), two_calls,
                        SamplingParams(max_new_tokens=8), tok, LoopSettings(200, max_context=2048, max_live=max_live),
                        group_size=4, step=0, generator=torch.Generator().manual_seed(0))
    assert all(e.env.error is None and e.env.info["generate_calls"] == 2 for e in eps)
    return [e.completion_ids for e in eps]


def test_agent_episodes_do_not_depend_on_how_many_run_at_once(tokenizer, tiny):
    """rollout.max_concurrent_episodes 1 vs 8 (and the engine's batches split in threes)."""
    one = agent_completions(tiny, tokenizer, max_live=1, batch_size=16)
    assert agent_completions(tiny, tokenizer, max_live=8, batch_size=3) == one
    assert len({tuple(c) for c in one}) == len(one)  # sampled: the episodes of a group differ


def test_single_turn_samples_do_not_depend_on_the_batch_split(tokenizer, tiny):
    """rollout.batch_size 6, 4 and 1 over one step's 3 groups of 2."""
    def completions(batch_size: int) -> list[list[int]]:
        eps = rollout(HFEngine(tiny, tokenizer, batch_size=batch_size), prompts(tokenizer, 3),
                      SamplingParams(max_new_tokens=8), tokenizer, group_size=2, step=0,
                      generator=torch.Generator().manual_seed(0))
        return [e.completion_ids for e in eps]

    whole = completions(6)
    assert completions(4) == whole == completions(1)
    assert len({tuple(c) for c in whole}) == len(whole)
