"""The RL loop: prompts -> rollout -> rewards -> advantages -> update -> sync -> log."""

from __future__ import annotations

import random
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from plainrl.algorithms import grpo_advantages
from plainrl.checkpoint import (
    FATAL_FIELDS, WARN_FIELDS, CheckpointError, check_compatible, load_checkpoint, read_config, resolve_resume,
    save_checkpoint,
)
from plainrl.config import Config, dump_config
from plainrl.data import PromptData, PromptSampler, load_prompt_data
from plainrl.engines.hf import HFEngine
from plainrl.envs import env_metrics
from plainrl.evaluate import evaluate
from plainrl.learner import Learner
from plainrl.metrics import MetricsLogger
from plainrl.models import load_policy, load_tokenizer, resolve_device, save_policy
from plainrl.rewards import RewardFn, build_reward_fns, reward_metrics
from plainrl.rollout import make_env_factory, rollout, sampling_params, score_episodes
from plainrl.types import Episode


@dataclass
class Prepared:
    """Everything that can be checked before a model is loaded."""

    tokenizer: object
    data: PromptData
    reward_fns: list[RewardFn]
    env_factory: object | None  # () -> Environment, for multi-turn rollouts


def prepare(cfg: Config) -> Prepared:
    """Load the tokenizer, data and reward functions; fail on bad input before any model loads."""
    tokenizer = load_tokenizer(cfg.model.name, cfg.model.cache_dir)
    reward_fns = build_reward_fns(cfg.rewards)
    max_prompt = cfg.model.max_context - cfg.rollout.completion_budget
    data = load_prompt_data(cfg.data, tokenizer, max_prompt_tokens=max_prompt, seed=cfg.seed)
    return Prepared(tokenizer, data, reward_fns, make_env_factory(cfg.rollout))


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def compute_advantages(episodes: list[Episode], cfg: Config) -> torch.Tensor:
    """Group-relative advantages [N]; unscorable episodes (reward None) get exactly 0."""
    valid = torch.tensor([e.reward is not None for e in episodes])
    rewards = torch.tensor([e.reward if e.reward is not None else float("nan") for e in episodes])
    adv = grpo_advantages(rewards, cfg.rollout.group_size, norm_std=cfg.norm_std, valid=valid)
    for e, a in zip(episodes, adv.tolist()):
        e.advantage = a
    return adv


def step_metrics(episodes: list[Episode], reward_fns: list[RewardFn], rewards_out, stats, times: dict) -> dict:
    lengths = [len(e.completion_ids) for e in episodes]
    m = reward_metrics(rewards_out, [f.name for f in reward_fns])
    m["reward/unscorable"] = float(sum(e.reward is None for e in episodes))
    if any("env_info" in e.row for e in episodes):
        m.update(env_metrics(episodes))
    m.update({
        "loss": stats.loss, "kl": stats.kl, "grad_norm": stats.grad_norm, "clip_frac": stats.clip_frac,
        "lr": stats.lr, "skipped_step": float(stats.skipped),
        "response_length/mean": statistics.fmean(lengths), "response_length/max": max(lengths),
        "response_length/clipped_frac": statistics.fmean(e.finish_reason == "length" for e in episodes),
        "tokens/completion": sum(lengths), **{f"time/{k}": v for k, v in times.items()},
    })
    return m


def check_resume(cfg: Config, run_dir: Path) -> tuple[Path | None, list[str]]:
    """The checkpoint to resume from (per ``checkpoint.resume``) and warnings about changed fields.

    Raises:
        CheckpointError: the checkpoint's model or LoRA shape differs from this config.
    """
    resume_from = resolve_resume(run_dir, cfg.checkpoint.resume)
    if resume_from is None:
        return None, []
    saved, current = read_config(resume_from), cfg.model_dump(mode="json")
    if fatal := check_compatible(saved, current, fields=FATAL_FIELDS):
        raise CheckpointError(f"cannot resume from {resume_from}:\n  " + "\n  ".join(fatal))
    return resume_from, check_compatible(saved, current, fields=WARN_FIELDS)


def train(cfg: Config) -> Path:
    """Run GRPO (or a relative, per ``cfg.algorithm``) and save the final policy.

    Returns:
        the run directory (``config.yaml``, ``metrics.jsonl``, ``rollouts.jsonl``, ``tb/``, ``final/``).
    """
    run_dir = Path(cfg.run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    resume_from, resume_warnings = check_resume(cfg, run_dir)
    (run_dir / "config.yaml").write_text(dump_config(cfg))
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    seed_everything(cfg.seed)
    prep = prepare(cfg)
    device = resolve_device(cfg.device)
    logger = MetricsLogger(run_dir, total_steps=cfg.train.steps, tensorboard=cfg.log.tensorboard, progress=cfg.log.progress)
    logger.print(f"config ({run_dir / 'config.yaml'}):\n{dump_config(cfg)}")
    for w in resume_warnings:
        logger.print(f"warning: resuming with a changed setting: {w}")
    if prep.data.dropped.total:
        logger.print(f"data: {prep.data.dropped.summary()}")
    for note in prep.data.notes:
        logger.print(f"data: {note}")
    model = load_policy(cfg.model, device)
    engine = HFEngine(model, prep.tokenizer, batch_size=cfg.rollout.batch_size, merge_lora=cfg.rollout.merge_lora)
    learner = Learner(model, cfg, pad_id=engine.pad_id)
    sampler = PromptSampler(prep.data.train, cfg.rollout.prompts_per_step, seed=cfg.seed, shuffle=cfg.data.shuffle)
    generator = torch.Generator(device=device).manual_seed(cfg.seed)
    params = sampling_params(cfg.rollout)
    eval_kw = dict(
        max_new_tokens=cfg.eval.max_new_tokens or cfg.rollout.max_new_tokens, stop=tuple(cfg.rollout.stop),
        k=cfg.eval.k, temperature=cfg.eval.temperature, generator=generator,
    )
    start = 0
    if resume_from is not None:
        state = load_checkpoint(resume_from, model=model, optimizer=learner.optimizer,
                                scheduler=learner.scheduler, generator=generator)
        sampler.load_state_dict(state.sampler_state)
        start = state.step
        logger.resume_at(start)
        logger.print(f"resumed from {resume_from} at step {start}")
    elif cfg.eval.before and prep.data.eval:  # (on resume it ran already; re-running would shift the RNG)
        logger.log_eval(0, evaluate(engine, prep.data.eval, prep.tokenizer, **eval_kw))

    for step in range(start, cfg.train.steps):
        t0 = time.perf_counter()
        episodes = rollout(engine, sampler.next_batch(), params, prep.tokenizer, cfg=cfg,
                           env_factory=prep.env_factory, step=step, generator=generator)
        t1 = time.perf_counter()
        rewards_out = score_episodes(episodes, prep.reward_fns)
        advantages = compute_advantages(episodes, cfg)
        t2 = time.perf_counter()
        stats = learner.update(episodes, advantages)
        engine.load_weights(model)
        t3 = time.perf_counter()
        times = {"generate": t1 - t0, "reward": t2 - t1, "update": t3 - t2, "step": t3 - t0}
        logger.log(step, step_metrics(episodes, prep.reward_fns, rewards_out, stats, times))
        shown = episodes[:: max(1, len(episodes) // cfg.log.rollouts_per_step)][: cfg.log.rollouts_per_step] if cfg.log.rollouts_per_step else []
        logger.log_rollouts(step, shown, [prep.tokenizer.decode(e.prompt_ids) for e in shown])
        if cfg.eval.every and (step + 1) % cfg.eval.every == 0 and step + 1 < cfg.train.steps and prep.data.eval:
            logger.log_eval(step + 1, evaluate(engine, prep.data.eval, prep.tokenizer, **eval_kw))
        every = cfg.checkpoint.every
        if every and ((step + 1) % every == 0 or step + 1 == cfg.train.steps):
            save_checkpoint(run_dir, step + 1, model=model, optimizer=learner.optimizer, scheduler=learner.scheduler,
                            sampler_state=sampler.state_dict(), generator=generator, config_yaml=dump_config(cfg),
                            keep_last=cfg.checkpoint.keep_last)

    if cfg.eval.after and prep.data.eval:
        logger.log_eval(cfg.train.steps, evaluate(engine, prep.data.eval, prep.tokenizer, **eval_kw))
    save_policy(model, prep.tokenizer, run_dir / "final")
    logger.print(f"saved the final policy to {run_dir / 'final'}")
    logger.close()
    return run_dir
