"""Beside RL: supervised fine-tuning (SFT), DPO and a Bradley-Terry reward model (RM),
trained on data rows with the RL loop's config, optimiser (:class:`MasterAdamW`),
logging, checkpoints and saving. ``plainrl train CONFIG`` runs this module when
``algorithm.name`` is ``sft``, ``dpo`` or ``rm``.

The rows and their tokenisation are :mod:`plainrl.data.offline`; the objectives and
the optimiser step are :mod:`plainrl.train.offline`; this module is the run around
them (:func:`train_offline`).
"""

from __future__ import annotations

from pathlib import Path

from plainrl.checkpoint import load_checkpoint, save_checkpoint
from plainrl.checkpoint.ranked import load_ranked, save_ranked
from plainrl.config import Config, dump_config
from plainrl.data import PromptSampler
from plainrl.data.offline import load_offline_data
from plainrl.metrics import MetricsLogger, StepTimer
from plainrl.models import load_policy, load_tokenizer, load_value_model, pad_token_id, resolve_device, resolve_dtype
from plainrl.perf import SystemMonitor
from plainrl.run.distributed import join, leave, main_first, make_logger
from plainrl.run.final import save_final
from plainrl.run.lifecycle import GracefulStop, StepBoundary, attach_trackers, finish_run, open_run
from plainrl.train.distributed import Parallel
from plainrl.train.offline import OfflineTrainer

__all__ = ["train_offline"]


def train_offline(cfg: Config) -> Path:
    """Train ``cfg.algorithm.name`` (sft, dpo or rm) on ``data.path`` or ``data.source`` and save the model.

    Steps: ``train.steps`` optimiser steps of ``train.batch_size`` rows (pairs), or ``train.epochs``
    passes over the rows (``ceil(epochs * rows / batch_size)`` steps), cycling through the data epoch by epoch; eval on held-out rows (``eval.before``, ``every``,
    ``after``); checkpoints and exact resume as the RL loop (``checkpoint.*``).

    Returns:
        the run directory: ``config.yaml``, ``metrics.jsonl`` (``loss``, ``grad_norm``,
        ``lr``; sft ``nll``; dpo/rm ``accuracy``, ``margin``; ``eval/*``; ``system/*`` as the RL
        loop's), ``tb/``,
        ``final/`` (the policy, or for rm an ``AutoModelForSequenceClassification`` with
        one label: a peft adapter including its ``score`` head under LoRA).
    Raises:
        Preempted: SIGTERM/SIGINT (a checkpoint was written).
        Diverged: ``train.max_bad_steps`` non-finite steps in a row.

    Under torchrun each rank computes on its share of every batch (``train.batch_size`` must
    divide by the world size), the loss normalised over the whole batch; rank 0 logs and saves.
    """
    parallel = join(cfg)
    try:
        run_dir, resume_from, resume_warnings = open_run(cfg, write=parallel.is_main)
        with main_first(parallel):
            tokenizer = load_tokenizer(cfg.model.name, cfg.model.cache_dir)
            data = load_offline_data(cfg, tokenizer)
        cfg.resolve_steps(len(data.train))  # train.epochs in steps
        logger = make_logger(cfg, run_dir, parallel)
        try:
            return _train_offline(cfg, run_dir, resume_from, resume_warnings, tokenizer, data, logger, parallel)
        finally:
            logger.close()  # (once) a failed run's trackers finish too
    finally:
        leave(parallel)


def _train_offline(cfg: Config, run_dir: Path, resume_from: Path | None, resume_warnings: list[str], tokenizer,
                   data, logger: MetricsLogger, parallel: Parallel) -> Path:
    if parallel.is_main:
        attach_trackers(cfg, run_dir, logger)
    logger.print(f"config ({run_dir / 'config.yaml'}):\n{dump_config(cfg)}")
    for note in [*resume_warnings, *data.notes] + ([data.dropped.summary()] if data.dropped.total else []):
        logger.print(f"note: {note}")
    if cfg.train.epochs is not None:
        logger.print(f"train.epochs={cfg.train.epochs}: {cfg.train.total_steps} steps of {cfg.train.batch_size} "
                     f"rows over {len(data.train)} training rows")
    device = parallel.device if parallel.active else resolve_device(cfg.device)
    logger.print(f"dtype: {resolve_dtype(cfg.model.dtype, device.type).reason}")
    if cfg.algorithm.name == "rm":
        model = load_value_model(cfg.model, device, per_token=False, meta=parallel.on_meta)
    else:
        model = load_policy(cfg.model, device, reference_adapter=cfg.algorithm.name == "dpo", meta=parallel.on_meta)
    trainer = OfflineTrainer(model, cfg, pad_id=pad_token_id(tokenizer), parallel=parallel)
    sampler = PromptSampler(data.train, cfg.train.batch_size, seed=cfg.seed, shuffle=cfg.data.shuffle)
    start = 0
    if resume_from is not None:
        if parallel.active:
            state, notes = load_ranked(resume_from, strategy=parallel.strategy, model=model,
                                       optimizer=trainer.opt.optimizer, scheduler=trainer.opt.scheduler,
                                       generator=None, generator_seed=cfg.seed)
            for note in notes:
                logger.print(f"warning: {note}")
        else:
            state = load_checkpoint(resume_from, model=model, optimizer=trainer.opt.optimizer,
                                    scheduler=trainer.opt.scheduler)
            for note in state.warnings:
                logger.print(f"warning: {note}")
        sampler.load_state_dict(state.sampler_state)
        start = state.step
        logger.resume_at(start)
        logger.print(f"resumed from {resume_from} at step {start}")
    elif cfg.eval.before and data.eval:
        logger.log_eval(0, trainer.evaluate(data.eval))

    def save(step: int) -> Path:
        kw = dict(model=model, optimizer=trainer.opt.optimizer, scheduler=trainer.opt.scheduler,
                  sampler_state=sampler.state_dict(), generator=None, config_yaml=dump_config(cfg),
                  keep_last=cfg.checkpoint.keep_last, save_optimizer=cfg.checkpoint.save_optimizer)
        if parallel.active:
            return save_ranked(run_dir, step, strategy=parallel.strategy, **kw)
        return save_checkpoint(run_dir, step, **kw)

    boundary = StepBoundary.for_run(cfg, run_dir)
    monitor = SystemMonitor(device)
    with GracefulStop(agree=parallel.max if parallel.active else None) as stop:
        for step in range(start, cfg.train.total_steps):
            timer = StepTimer()
            metrics = trainer.step(sampler.next_batch())
            logger.log(step, {**metrics, **timer.metrics(), **monitor.metrics()})
            boundary(step, skipped=bool(metrics["skipped_step"]), stop=stop, logger=logger,
                     evaluate=(lambda: trainer.evaluate(data.eval)) if data.eval else None, save=save)
    if cfg.eval.after and data.eval:
        logger.log_eval(cfg.train.total_steps, trainer.evaluate(data.eval))
    with logger.phase(f"saving the final {cfg.algorithm.name} model to {run_dir / 'final'}"):
        save_final(cfg, model, tokenizer, run_dir, parallel=parallel)  # + model card, portable base name
    if parallel.is_main:
        finish_run(cfg, run_dir, logger)  # trackers get final/; log.report: report.html
    return run_dir
