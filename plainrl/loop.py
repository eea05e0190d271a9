"""The RL loop: prompts -> rollout -> rewards -> advantages -> update -> sync -> log."""

from __future__ import annotations

import random
import signal
import statistics
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from plainrl.checkpoint import (
    CHECKPOINTS_DIR, FATAL_FIELDS, WARN_FIELDS, CheckpointError, check_compatible, find_latest, load_checkpoint,
    read_config, resolve_resume, save_checkpoint, step_dir_name,
)
from plainrl.config import Config, ConfigError, dump_config
from plainrl.critic import Critic
from plainrl.data import PromptData, PromptSampler, load_prompt_data
from plainrl.engines.hf import HFEngine
from plainrl.envs import EnvWorkers, env_metrics
from plainrl.estimators import Advantages, compute_advantages, reward_kl
from plainrl.evaluate import MultiTurnEval, evaluate
from plainrl.learner import Learner, UpdateStats
from plainrl.metrics import MetricsLogger
from plainrl.models import load_policy, load_tokenizer, load_value_model, resolve_device, save_policy
from plainrl.rewards import RewardFn, RewardWorkers, build_reward_fns, reward_metrics
from plainrl.rewards.model import RewardModel
from plainrl.rollout import (
    dynamic_sampling, make_env_factory, max_live_episodes, rollout, sampling_params, score_episodes, shape_overlong,
)
from plainrl.types import Episode, RewardOutput


@dataclass
class Prepared:
    """Everything that can be checked before a model is loaded."""

    tokenizer: object
    data: PromptData
    reward_fns: list[RewardFn]
    env_factory: object | None  # () -> Environment, for multi-turn rollouts
    reward_workers: RewardWorkers | None = None  # rollout.reward_timeout_s: reward calls in worker processes

    def prestart(self, episodes: int) -> None:
        """Fork the reward and environment workers now, while this process is small: a
        fork after the model loads copies the page tables of gigabytes (0.1-0.5 s each)."""
        if self.reward_workers is not None:
            self.reward_workers.prestart()
        if isinstance(self.env_factory, EnvWorkers):
            self.env_factory.prestart(episodes)

    def close(self) -> None:
        """Stop the reward and environment workers, if any."""
        if self.reward_workers is not None:
            self.reward_workers.close()
        if isinstance(self.env_factory, EnvWorkers):
            self.env_factory.close()


def prepare(cfg: Config) -> Prepared:
    """Load the tokenizer, data and reward functions; fail on bad input before any model loads."""
    tokenizer = load_tokenizer(cfg.model.name, cfg.model.cache_dir)
    reward_fns = build_reward_fns(cfg.rewards)
    for spec in cfg.rewards:
        if spec.model is not None:
            RewardModel.check(spec)
    max_prompt = cfg.model.max_context - cfg.rollout.completion_budget
    data = load_prompt_data(cfg.data, tokenizer, max_prompt_tokens=max_prompt, seed=cfg.seed)
    if cfg.algorithm.advantage == "gae" and cfg.critic.model is not None:
        # the critic reads the policy's token ids, so both must mean the same tokens
        if load_tokenizer(cfg.critic.model, cfg.model.cache_dir).get_vocab() != tokenizer.get_vocab():
            raise ConfigError(f"critic.model={cfg.critic.model!r} has another tokenizer than model.name="
                              f"{cfg.model.name!r}; use a critic of the same model family (or leave critic.model unset)")
    workers = None
    if cfg.rollout.reward_timeout_s is not None and reward_fns:
        workers = RewardWorkers(reward_fns, cfg.rollout.reward_workers)  # forked later, by Prepared.prestart
    return Prepared(tokenizer, data, reward_fns, make_env_factory(cfg.rollout), workers)


def multi_turn_eval(cfg: Config, prep: Prepared) -> MultiTurnEval | None:
    """How held-out prompts are run when the training rollouts are multi-turn (``rollout.env``)."""
    if prep.env_factory is None:
        return None
    return MultiTurnEval(prep.env_factory, cfg.rollout.max_turns, cfg.rollout.completion_budget,
                         cfg.data.system_prompt, cfg.data.prompt_template, max_live=max_live_episodes(cfg))


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def step_metrics(
    episodes: list[Episode], reward_names: list[str], rewards_out, stats: UpdateStats, times: dict,
    extra: dict | None = None,
) -> dict:
    """One step's row of metrics.jsonl; ``extra`` (sampling, shaping, critic, KL metrics) is added last."""
    lengths = [len(e.completion_ids) for e in episodes]
    m = reward_metrics(rewards_out, reward_names)
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
    if stats.optimizer_steps != 1:
        m["optimizer_steps"] = float(stats.optimizer_steps)
    if stats.optimizer_steps > 1:
        m["approx_kl"] = stats.approx_kl
    if stats.entropy:
        m["entropy"] = stats.entropy
    m.update(extra or {})
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


class Preempted(Exception):
    """SIGTERM/SIGINT arrived; the run stopped at a step boundary after writing a checkpoint."""

    exit_code = 75  # EX_TEMPFAIL: a scheduler may simply start the same command again

    def __init__(self, step: int, signum: int, checkpoint: Path):
        super().__init__(f"stopped by {signal.Signals(signum).name} after step {step}; checkpoint {checkpoint}")


class Diverged(RuntimeError):
    """``train.max_bad_steps`` optimiser steps in a row had a non-finite loss or gradient norm."""


class GracefulStop:
    """The first SIGTERM/SIGINT asks the loop to stop at the next step boundary; a second
    SIGINT interrupts at once (KeyboardInterrupt). Handlers are restored on exit."""

    def __enter__(self) -> "GracefulStop":
        self.signum: int | None = None
        self._old = {}
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGTERM, signal.SIGINT):
                self._old[sig] = signal.signal(sig, self._handle)
        return self

    def _handle(self, signum, frame) -> None:
        if self.signum is not None and signum == signal.SIGINT:
            raise KeyboardInterrupt
        self.signum = signum

    def __exit__(self, *exc) -> None:
        for sig, handler in self._old.items():
            signal.signal(sig, handler)


@dataclass
class Run:
    """The live objects of a run, built by :func:`setup`."""

    cfg: Config
    run_dir: Path
    prep: Prepared
    logger: MetricsLogger
    model: torch.nn.Module
    engine: HFEngine
    learner: Learner
    sampler: PromptSampler
    generator: torch.Generator
    start: int  # first step to run (> 0 when resumed)
    critic: Critic | None = None  # algorithm.advantage: gae
    reward_models: list[RewardModel] = field(default_factory=list)  # rewards: [{model: ...}]

    def evaluate(self) -> dict[str, float]:
        c = self.cfg
        return evaluate(
            self.engine, self.prep.data.eval, self.prep.tokenizer,
            max_new_tokens=c.eval.max_new_tokens or c.rollout.max_new_tokens, stop=tuple(c.rollout.stop),
            k=c.eval.k, temperature=c.eval.temperature, generator=self.generator,
            multi_turn=multi_turn_eval(c, self.prep),
        )

    def save(self, step: int) -> Path:
        if self.critic is not None:
            # written first: the policy's checkpoint is the commit point, so a critic
            # checkpoint always exists for the step that `latest` names
            save_checkpoint(
                self.run_dir / "critic", step, model=self.critic.model, optimizer=self.critic.optimizer,
                scheduler=self.critic.scheduler, sampler_state={}, generator=None, config_yaml=dump_config(self.cfg),
                keep_last=self.cfg.checkpoint.keep_last,
            )
        return save_checkpoint(
            self.run_dir, step, model=self.model, optimizer=self.learner.optimizer, scheduler=self.learner.scheduler,
            sampler_state=self.sampler.state_dict(), generator=self.generator, config_yaml=dump_config(self.cfg),
            keep_last=self.cfg.checkpoint.keep_last,
        )


def load_critic(cfg: Config, policy: torch.nn.Module, device: torch.device, pad_id: int) -> Critic:
    """PPO's critic: ``critic.model`` / ``critic.lora`` over the policy's ``model`` section.

    With LoRA on both and the same base, the critic reuses the policy's frozen base
    weights (two adapters, one copy of the base; :func:`plainrl.models.share_frozen_weights`).
    """
    update = {"lora": cfg.critic.lora or cfg.model.lora}
    if cfg.critic.model is not None:
        update["name"] = cfg.critic.model
    model_cfg = cfg.model.model_copy(update=update)
    shared = cfg.model.lora.enabled and model_cfg.lora.enabled and model_cfg.name == cfg.model.name
    model = load_value_model(model_cfg, device, per_token=True, share_with=policy if shared else None)
    return Critic(model, cfg, pad_id=pad_id)


def open_run(cfg: Config) -> tuple[Path, Path | None, list[str]]:
    """Create ``run_dir``, find the checkpoint to resume from (before anything is
    written over), save the resolved config, set threads and seeds.

    Returns:
        (run_dir, checkpoint to resume from or None, warnings about changed settings).
    """
    run_dir = Path(cfg.run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    resume_from, resume_warnings = check_resume(cfg, run_dir)
    (run_dir / "config.yaml").write_text(dump_config(cfg))
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    seed_everything(cfg.seed)
    return run_dir, resume_from, resume_warnings


def setup(cfg: Config) -> Run:
    """Everything before the first step: checks, data, model, engine, learner (and PPO's
    critic); resume or eval-before. The caller closes ``run.prep`` when done."""
    run_dir, resume_from, resume_warnings = open_run(cfg)
    prep = prepare(cfg)
    try:
        return _setup(cfg, prep, run_dir, resume_from, resume_warnings)
    except BaseException:
        prep.close()
        raise


def _setup(cfg: Config, prep: Prepared, run_dir: Path, resume_from: Path | None, resume_warnings: list[str]) -> Run:
    device = resolve_device(cfg.device)
    logger = MetricsLogger(run_dir, total_steps=cfg.train.steps, tensorboard=cfg.log.tensorboard,
                           progress=cfg.log.progress)
    logger.print(f"config ({run_dir / 'config.yaml'}):\n{dump_config(cfg)}")
    for w in resume_warnings:
        logger.print(f"warning: resuming with a changed setting: {w}")
    if prep.data.dropped.total:
        logger.print(f"data: {prep.data.dropped.summary()}")
    for note in prep.data.notes:
        logger.print(f"data: {note}")
    prep.prestart(max_live_episodes(cfg) or 0)
    model = load_policy(cfg.model, device)
    engine = HFEngine(model, prep.tokenizer, batch_size=cfg.rollout.batch_size, merge_lora=cfg.rollout.merge_lora,
                      decoder=cfg.rollout.decoder)
    run = Run(
        cfg, run_dir, prep, logger, model, engine, Learner(model, cfg, pad_id=engine.pad_id),
        PromptSampler(prep.data.train, cfg.rollout.prompts_per_step, seed=cfg.seed, shuffle=cfg.data.shuffle),
        torch.Generator(device=device).manual_seed(cfg.seed), start=0,
    )
    if cfg.algorithm.advantage == "gae":
        run.critic = load_critic(cfg, model, device, engine.pad_id)
    run.reward_models = [
        RewardModel.load(spec, cfg.model, prep.tokenizer, device, share_with=model if cfg.model.lora.enabled else None)
        for spec in cfg.rewards if spec.model is not None
    ]
    if resume_from is not None:
        state = load_checkpoint(resume_from, model=model, optimizer=run.learner.optimizer,
                                scheduler=run.learner.scheduler, generator=run.generator)
        run.sampler.load_state_dict(state.sampler_state)
        run.start = state.step
        if run.critic is not None:
            critic_ckpt = resume_from.parent.parent / "critic" / CHECKPOINTS_DIR / step_dir_name(state.step)
            if not critic_ckpt.is_dir():
                raise CheckpointError(f"cannot resume the critic: {critic_ckpt} is missing")
            load_checkpoint(critic_ckpt, model=run.critic.model, optimizer=run.critic.optimizer,
                            scheduler=run.critic.scheduler, restore_rng=False)
        logger.resume_at(run.start)
        logger.print(f"resumed from {resume_from} at step {run.start}")
    elif cfg.eval.before and prep.data.eval:  # (on resume it ran already; re-running would shift the RNG)
        logger.log_eval(0, run.evaluate())
    return run


def collect(run: Run, params, step: int) -> tuple[list[Episode], RewardOutput, dict[str, float]]:
    """This step's scored episodes: one rollout batch, or DAPO's dynamic sampling
    (``algorithm.dynamic_sampling``), then overlong shaping/filtering when configured.

    Returns:
        ``(episodes, rewards of every episode drawn, metrics)``; ``metrics["time/generate"]``
        is the time spent in the engine (the rest went to reward functions).
    """
    cfg, prep = run.cfg, run.prep
    generating = 0.0

    def draw() -> list[Episode]:
        nonlocal generating
        t = time.perf_counter()
        episodes = rollout(run.engine, run.sampler.next_batch(), params, prep.tokenizer, cfg=cfg,
                           env_factory=prep.env_factory, step=step, generator=run.generator)
        generating += time.perf_counter() - t
        return episodes

    runner = dict(timeout_s=cfg.rollout.reward_timeout_s, pool=prep.reward_workers, fail_fast=cfg.rollout.fail_fast,
                  models=run.reward_models)
    if cfg.algorithm.dynamic_sampling:
        episodes, rewards_out, metrics = dynamic_sampling(
            draw, prep.reward_fns, group_size=cfg.rollout.group_size, num_groups=cfg.rollout.prompts_per_step,
            max_tries=cfg.algorithm.dynamic_sampling_tries, **runner)
    else:
        episodes = draw()
        rewards_out, metrics = score_episodes(episodes, prep.reward_fns, **runner), {}
    metrics.update(shape_overlong(episodes, cfg.algorithm, cfg.rollout.completion_budget))
    metrics["time/generate"] = generating
    return episodes, rewards_out, metrics


def estimate(run: Run, episodes: list[Episode]) -> tuple[Advantages, torch.Tensor | None, dict[str, float]]:
    """Advantages per ``algorithm.advantage``, with what the estimator needs: the KL to
    the reference when it goes into the reward, the critic's values for GAE.

    Returns:
        ``(advantages and the critic's returns, critic values [N, L] or None, metrics)``.
    """
    a = run.cfg.algorithm
    kl = None
    if a.kl_coef > 0 and a.kl_placement == "reward":
        kl = reward_kl(episodes, run.learner.completion_logps(episodes, reference=True), run.cfg)  # [N, L]
    values = run.critic.values(episodes) if run.critic is not None else None
    out = compute_advantages(episodes, run.cfg, kl=kl, values=values)
    tokens = sum(sum(e.loss_mask) for e in episodes)
    return out, values, ({"kl": float(kl.sum()) / max(1, tokens)} if kl is not None else {})


def train(cfg: Config) -> Path:
    """Run the RL algorithm of ``cfg.algorithm`` and save the final policy.

    Returns:
        the run directory (``config.yaml``, ``metrics.jsonl``, ``rollouts.jsonl``, ``tb/``, ``final/``;
        ``critic/`` with PPO).

    Raises:
        Preempted: SIGTERM/SIGINT; a checkpoint of the last finished step was written.
        Diverged: ``train.max_bad_steps`` non-finite steps in a row (no weights were changed by them).
    """
    run = setup(cfg)
    try:
        return _train(run)
    finally:
        run.prep.close()


def _train(run: Run) -> Path:
    cfg, prep, logger = run.cfg, run.prep, run.logger
    params = sampling_params(cfg.rollout)
    bad_steps = 0
    with GracefulStop() as stop:
        for step in range(run.start, cfg.train.steps):
            t0 = time.perf_counter()
            episodes, rewards_out, extra = collect(run, params, step)  # rollout + rewards (+ DAPO's filters)
            adv, values, kl_metrics = estimate(run, episodes)   # per algorithm.advantage
            extra.update(kl_metrics)
            t1 = time.perf_counter()
            if run.critic is not None:
                extra.update(run.critic.update(episodes, adv.returns, values))
            # during PPO's critic warm-up the policy waits until the values mean something
            stats = run.learner.update(episodes, adv.advantages) if step >= cfg.critic.warmup_steps else run.learner.skip()
            run.engine.load_weights(run.model)
            t2 = time.perf_counter()
            gen = extra.pop("time/generate")
            times = {"generate": gen, "reward": t1 - t0 - gen, "update": t2 - t1, "step": t2 - t0}
            names = [f.name for f in prep.reward_fns] + [m.name for m in run.reward_models]
            logger.log(step, step_metrics(episodes, names, rewards_out, stats, times, extra))
            logger.log_rollouts(step, episodes, cfg.log.rollouts_per_step, prep.tokenizer)
            logger.log_errors(step, rewards_out.errors)
            bad_steps = bad_steps + 1 if stats.skipped else 0
            if bad_steps >= cfg.train.max_bad_steps:
                latest = find_latest(run.run_dir)
                raise Diverged(f"step {step}: {bad_steps} steps in a row with a non-finite loss or gradient norm "
                               f"(skipped); last good checkpoint: {latest or 'none'}")
            if cfg.eval.every and (step + 1) % cfg.eval.every == 0 and step + 1 < cfg.train.steps and prep.data.eval:
                logger.log_eval(step + 1, run.evaluate())
            every = cfg.checkpoint.every
            if stop.signum is not None or (every and ((step + 1) % every == 0 or step + 1 == cfg.train.steps)):
                path = run.save(step + 1)
                if stop.signum is not None:
                    logger.close()
                    raise Preempted(step + 1, stop.signum, path)

    if cfg.eval.after and prep.data.eval:
        logger.log_eval(cfg.train.steps, run.evaluate())
    save_policy(run.model, prep.tokenizer, run.run_dir / "final")
    if run.critic is not None:
        save_policy(run.critic.model, prep.tokenizer, run.run_dir / "critic" / "final")
    logger.print(f"saved the final policy to {run.run_dir / 'final'}")
    logger.close()
    return run.run_dir
