"""Prompt data: built-in tasks, file/hub loading, validation, tokenisation and sampling.

    data = load_prompt_data(cfg.data, tokenizer, max_prompt_tokens=budget, seed=cfg.seed)
    sampler = PromptSampler(data.train, cfg.rollout.prompts_per_step, seed=cfg.seed, shuffle=cfg.data.shuffle)
    batch = sampler.next_batch()   # list[PromptRow]
"""

from plainrl.data.loading import PromptData, PromptRow, load_prompt_data
from plainrl.data.prompts import build_prompt_ids, check_prompt_lengths, render_prompt
from plainrl.data.rows import DataError, DropReport, to_prompt_rows
from plainrl.data.sampler import PromptSampler, Sampler
from plainrl.data.sources import load_rows
from plainrl.data.tasks import TASKS, arithmetic, make_task_rows, make_task_split, task_arg_names

__all__ = [
    "TASKS",
    "DataError",
    "DropReport",
    "PromptData",
    "PromptRow",
    "PromptSampler",
    "Sampler",
    "arithmetic",
    "build_prompt_ids",
    "check_prompt_lengths",
    "load_prompt_data",
    "load_rows",
    "make_task_rows",
    "make_task_split",
    "render_prompt",
    "task_arg_names",
    "to_prompt_rows",
]
