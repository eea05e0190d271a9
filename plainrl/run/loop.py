"""The RL loop: prompts -> rollout -> rewards -> advantages -> update -> sync -> log."""

from __future__ import annotations

import statistics
from pathlib import Path

import torch

from plainrl.algorithms.estimators import Advantages, compute_advantages, reward_kl, with_teacher
from plainrl.config import Config
from plainrl.frames import CompletionFrame, completion_frame
from plainrl.metrics import StepTimer
from plainrl.perf import throughput
from plainrl.rewards import reward_metrics, score_episodes
from plainrl.rollout import env_metrics, rollout
from plainrl.rollout.reaper import Reaper
from plainrl.run.collect import dynamic_sampling, observe_batch, shape_overlong
from plainrl.run.distributed import gather_episodes, join, leave, local_rows
from plainrl.run.correction import MismatchWatch, rejection_warning
from plainrl.run.lifecycle import GracefulStop, StepBoundary, attach_trackers, finish_run
from plainrl.run.async_rollout import Rollouts, StopRequested
from plainrl.run.setup import Run, setup
from plainrl.samples import training_samples
from plainrl.train import UpdateStats
from plainrl.train.teacher import TeacherScores, distill_metrics
from plainrl.types import Episode, RewardOutput


def step_metrics(
    episodes: list[Episode], reward_names: list[str], rewards_out: RewardOutput, stats: UpdateStats,
    times: dict[str, float], extra: dict[str, float] | None = None, samples: list[Episode] | None = None,
) -> dict[str, float]:
    """One step's row of metrics.jsonl; ``extra`` (sampling, shaping, critic, KL metrics) is added last.
    ``samples``: the trained samples (:func:`plainrl.samples.training_samples`; None: the episodes),
    whose completions the ``response_length/*`` and ``tokens/completion`` figures count."""
    samples = episodes if samples is None else samples
    lengths = [len(e.completion_ids) for e in samples]
    m = reward_metrics(rewards_out, reward_names)
    m["reward/unscorable"] = float(sum(e.reward is None for e in episodes))
    if any(e.env is not None for e in episodes):
        m.update(env_metrics(episodes))
        m["rollout/segments_per_episode"] = len(samples) / max(1, len(episodes))
    m.update({
        "loss": stats.loss, "kl": stats.kl, "grad_norm": stats.grad_norm, "clip_frac": stats.clip_frac,
        "lr": stats.lr, "skipped_step": float(stats.skipped), "rollout/logprob_diff": stats.logprob_diff,
        "response_length/mean": statistics.fmean(lengths), "response_length/max": max(lengths),
        "response_length/clipped_frac": statistics.fmean(e.finish_reason == "length" for e in samples),
        "tokens/completion": sum(lengths), **times,
    })
    if stats.optimizer_steps != 1:
        m["optimizer_steps"] = float(stats.optimizer_steps)
    if stats.optimizer_steps > 1:
        m["approx_kl"] = stats.approx_kl
    if stats.entropy:
        m["entropy"] = stats.entropy
    m.update(extra or {})
    return m


def collect(run: Run, step: int, timer: StepTimer) -> tuple[list[Episode], RewardOutput, dict[str, float]]:
    """This step's scored episodes: one rollout batch, or DAPO's dynamic sampling
    (``algorithm.dynamic_sampling``) or the curriculum's zero-signal gate (``data.curriculum.redraws``).
    Engine time goes to ``timer``'s ``generate`` phase, scoring to ``reward``; under
    ``data.curriculum`` every scored batch updates the pass rates before the next is drawn.

    Returns:
        ``(episodes, rewards of every episode drawn, metrics)``.
    """
    cfg, prep = run.cfg, run.prep
    curriculum = cfg.data.curriculum
    scored: list[RewardOutput] = []

    def draw(n: int | None = None) -> list[Episode]:
        """A rollout batch (``n`` prompts: the curriculum's re-draw), scored; under torchrun each rank
        samples and scores its share of the prompt groups, then every rank gets the whole batch (so
        every later stage sees it all)."""
        rows = run.sampler.next_batch() if n is None else run.sampler.next_batch(n)
        with timer("generate"):
            episodes = rollout(run.engine, local_rows(run.parallel, rows), run.params,
                               prep.tokenizer, group_size=cfg.rollout.group_size, step=step,
                               multi_turn=prep.multi_turn, generator=run.generator)
        with timer("reward"):
            rewards = score_episodes(episodes, prep.reward_fns, models=run.reward_models,
                                     timeout_s=cfg.rollout.reward_timeout_s, pool=prep.reward_workers,
                                     fail_fast=cfg.rollout.fail_fast, combine=prep.reward_combine)
        episodes, rewards = gather_episodes(run.parallel, episodes, rewards)
        observe_batch(run.sampler, rows, episodes, cfg.rollout.group_size)
        scored.append(rewards)
        return episodes

    def score(episodes: list[Episode]) -> RewardOutput:  # draw() scored them where they were sampled
        return scored.pop()

    gateway = prep.multi_turn.gateway if prep.multi_turn is not None else None
    if gateway is not None:
        gateway.take_metrics()  # what evaluation counted belongs to no step
    if cfg.algorithm.dynamic_sampling:
        episodes, rewards_out, metrics = dynamic_sampling(
            draw, score, group_size=cfg.rollout.group_size, num_groups=cfg.rollout.prompts_per_step,
            max_tries=cfg.algorithm.dynamic_sampling_tries)
    elif curriculum is not None and curriculum.redraws:
        ranks = run.parallel.world_size if run.parallel.active else 1  # every rank gets a share of a re-draw
        episodes, rewards_out, metrics = dynamic_sampling(
            draw, score, group_size=cfg.rollout.group_size, num_groups=cfg.rollout.prompts_per_step,
            max_tries=1 + curriculum.redraws, redraw=lambda missing: draw(-(-missing // ranks) * ranks))
    else:
        episodes = draw()
        rewards_out, metrics = score(episodes), {}
    metrics.update(run.sampler.take_metrics())
    if gateway is not None:
        metrics.update(gateway.take_metrics())  # rollout/sampling_overrides
    return episodes, rewards_out, metrics


def samples_of(run: Run, episodes: list[Episode], timer: StepTimer) -> tuple[list[Episode], dict[str, float]]:
    """The step's training samples (every segment of an agent episode one,
    :func:`plainrl.samples.training_samples`), with DAPO's overlong shaping/filtering when
    configured (timed as ``reward``).

    Returns:
        ``(samples, shaping metrics)``.
    """
    samples = training_samples(episodes)
    with timer("reward"):
        return samples, shape_overlong(samples, run.cfg.algorithm, run.cfg.rollout.completion_budget)


def resource_metrics(run: Run, episodes: list[Episode], times: dict[str, float]) -> dict[str, float]:
    """``system/*`` and ``perf/*`` of the step (:mod:`plainrl.perf`): memory and CPU, tokens per
    second of generation and of the update, and MFU where the device's peak is known."""
    lengths = [len(e.prompt_ids) + len(e.completion_ids) for e in episodes]
    flops = run.flops(lengths) if run.flops is not None and run.peak_flops else None
    out = run.monitor.metrics() if run.monitor is not None else {}
    out.update(throughput(completion_tokens=sum(len(e.completion_ids) for e in episodes),
                          generate_s=times.get("time/generate", 0.0),
                          train_tokens=sum(lengths) * run.cfg.algorithm.ppo_epochs,
                          update_s=times.get("time/update", 0.0), flops=flops, peak=run.peak_flops))
    return out


def estimate(run: Run, episodes: list[Episode], frame: CompletionFrame, teacher: TeacherScores | None = None
             ) -> tuple[Advantages, torch.Tensor | None, dict[str, float]]:
    """Advantages per ``algorithm.advantage``, with what the estimator needs: the KL to
    the reference when it goes into the reward, the critic's values for GAE; with a
    distillation teacher's scores, mixed with its per-token signal (:func:`with_teacher`).

    Returns:
        ``(advantages and the critic's returns, critic values [N, L] or None, metrics)``.
    """
    a = run.cfg.algorithm
    kl, metrics = None, {}
    coef, estimator = a.reward_kl  # algorithm.kl_reward_*, or kl_coef under kl_placement: reward
    if coef > 0:
        kl = reward_kl(frame, run.learner.completion_logps(episodes, reference=True), estimator)  # [N, L]
        # kl_reward beside the loss's kl (algorithm.kl_reward_coef); kl alone under kl_placement: reward
        metrics["kl_reward" if a.kl_reward_coef > 0 else "kl"] = float(kl.sum()) / max(1.0, float(frame.mask.sum()))
    values = run.critic.values(episodes) if run.critic is not None else None
    out = compute_advantages(episodes, frame.mask, run.advantages, kl=kl, values=values)
    if teacher is not None:
        out = with_teacher(out, episodes, frame, teacher.logprobs, distill_loss=a.distill_loss,
                           distill_coef=a.distill_coef, reward_coef=a.reward_coef)
    return out, values, metrics


def train(cfg: Config) -> Path:
    """Run the RL algorithm of ``cfg.algorithm`` and save the final policy.

    Returns:
        the run directory (``config.yaml``, ``metrics.jsonl``, ``rollouts.jsonl``, ``tb/``, ``final/``;
        ``critic/`` with PPO).

    Raises:
        Preempted: SIGTERM/SIGINT; a checkpoint of the last finished step was written.
        Diverged: ``train.max_bad_steps`` non-finite steps in a row (no weights were changed by them).
    """
    if cfg.log.wandb is not None:  # a missing library fails before the model loads
        from plainrl.tracking import require_wandb

        require_wandb()
    # what user code starts from here (an agent's harness, its tools) is killed if this process dies
    with Reaper():
        parallel = join(cfg)  # under torchrun: this rank (checks the launch first); else one process
        try:
            run = setup(cfg, parallel)
            try:
                if parallel.is_main:
                    attach_trackers(cfg, run.run_dir, run.logger)
                return _train(run)
            finally:
                run.logger.close()  # (once: a finished run closed it already) a failed run's trackers finish too
                run.prep.close()
                run.engine.close()
                if run.teacher is not None:
                    run.teacher.close()
        finally:
            leave(parallel)


def _train(run: Run) -> Path:
    cfg, prep, logger = run.cfg, run.prep, run.logger
    names = [f.name for f in prep.reward_fns] + [m.name for m in run.reward_models]
    boundary = StepBoundary.for_run(cfg, run.run_dir)
    rollouts = Rollouts(lambda step, timer: collect(run, step, timer), run.engine,
                        async_steps=cfg.rollout.async_steps, start=run.start, total_steps=cfg.train.total_steps,
                        partial=cfg.rollout.partial, snapshot=run.resume_state)
    if run.in_flight is not None:
        rollouts.restore(run.in_flight, run.start)
    mismatch = MismatchWatch()
    try:
        with GracefulStop(agree=run.parallel.max if run.parallel.active else None) as stop:
            stopping = lambda: stop.signum is not None  # noqa: E731  (async: not under torchrun, no agreement)

            def save(done: int) -> Path:  # async: a stop abandons the batch being sampled
                saved = rollouts.in_flight(stopping)
                for note in saved.notes:
                    logger.print(f"warning: checkpoint after step {done}: saved as its repr (does not pickle): {note}")
                return run.save(done, in_flight=saved.blob, state=saved.state)

            for step in range(run.start, cfg.train.total_steps):
                timer = StepTimer()
                try:  # rollout + rewards (+ DAPO's filters); async: sampled ahead
                    batch = rollouts.take(step, timer, stopping)
                except StopRequested:  # (async) the batch would take up to rollout.agent_timeout_s
                    boundary.preempt(step, signum=stop.signum, logger=logger, save=save)
                episodes, rewards_out, extra = batch.episodes, batch.rewards, batch.metrics
                samples, shaping = samples_of(run, episodes, timer)  # an agent's segments: one sample each
                extra.update(shaping)
                frame = completion_frame(samples)  # [N, L] loss masks and engine logprobs
                # vLLM's sleep mode on CUDA: the learner gets its GPU memory for every forward from here
                # on (the reference's and the critic's in the estimate, then the update)
                run.engine.offload()
                teacher = None
                if run.teacher is not None:  # on-policy distillation: the teacher scores every sampled token
                    with timer("teacher"):
                        teacher = run.teacher.score(samples)
                    extra.update(distill_metrics(samples, teacher, frame.logprobs, frame.mask))
                with timer("reward"):
                    adv, values, kl_metrics = estimate(run, samples, frame, teacher)  # per algorithm.advantage
                extra.update(kl_metrics)
                with timer("update"):
                    if run.critic is not None:
                        extra.update(run.critic.update(samples, adv.returns, values, frame.mask))
                    # during PPO's critic warm-up the policy waits until the values mean something
                    warm = step >= cfg.critic.warmup_steps
                    topk = teacher.topk if teacher is not None else None  # gkd_topk: the teacher's top-k
                    stats = run.learner.update(samples, adv.advantages, topk) if warm else run.learner.skip()
                extra.update(is_metrics := run.learner.is_tally.take(run.learner.parallel.sum))  # is/*
                if warning := rejection_warning(is_metrics):
                    logger.print(f"step {step}: {warning}")
                if warm and (warning := mismatch.observe(stats.logprob_diff)):
                    logger.print(f"step {step}: {warning}")
                rollouts.sync(run.model, step, timer)  # async: after the next batch finished sampling
                extra.update(run.engine.take_metrics())
                times = dict(batch.times)  # the batch's sampling and scoring, then this step's phases
                for k, v in timer.metrics().items():
                    times[k] = times.get(k, 0.0) + v
                extra.update(resource_metrics(run, samples, times))
                logger.log(step, step_metrics(episodes, names, rewards_out, stats, times, extra, samples))
                logger.log_rollouts(step, episodes, cfg.log.rollouts_per_step, prep.tokenizer)
                logger.log_errors(step, rewards_out.errors)
                boundary(step, skipped=stats.skipped, stop=stop, logger=logger,
                         evaluate=(lambda: rollouts.paused(run.evaluate, stopping)) if prep.data.eval else None,
                         save=save)
    finally:
        rollouts.close()

    if cfg.eval.after and prep.data.eval:
        logger.log_eval(cfg.train.total_steps, run.evaluate())
    with logger.phase(f"saving the final policy to {run.run_dir / 'final'}"):
        run.save_final()  # (and the critic's) by rank 0
    if run.parallel.is_main:
        finish_run(cfg, run.run_dir, logger)  # trackers get final/; log.report: report.html
    return run.run_dir
