"""Everything before the first RL step: checks and data before any model loads
(:func:`prepare`), then the model, engine, learner, critic and reward models, and
resume (:func:`setup`). The only place that reads the whole config and hands each
stage its explicit values."""

from __future__ import annotations

import os
from contextlib import nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch
from transformers import PreTrainedTokenizerBase

from plainrl.algorithms.estimators import AdvantageParams
from plainrl.checkpoint import CHECKPOINTS_DIR, CheckpointError, load_checkpoint, save_checkpoint, step_dir_name
from plainrl.checkpoint.ranked import load_ranked, save_ranked
from plainrl.checkpoint.rng import get_rng_state
from plainrl.config import AlgorithmConfig, Config, ConfigError, RewardSpec, dump_config
from plainrl.data import PromptData, Sampler, load_prompt_data
from plainrl.data.curriculum import check_pass_reward, make_prompt_sampler
from plainrl.metrics import MetricsLogger
from plainrl.models import (
    load_frozen_adapter,
    load_policy,
    load_tokenizer,
    load_value_model,
    model_dtype,
    pad_token_id,
    resolve_device,
    resolve_dtype,
)
from plainrl.models.quantization import check_support as check_quantization
from plainrl.perf import FlopCounter, SystemMonitor, peak_flops
from plainrl.rewards import RewardFn, RewardLoadError, RewardWorkers, build_reward_fns, correctness, load_reward_fn
from plainrl.rewards.combine import RewardCombine, load_reward_combine
from plainrl.rewards.judge import bind_judges
from plainrl.rewards.model import RewardModel
from plainrl.rollout import MultiTurn, make_agent, make_env_factory, max_live_episodes, sampling_params
from plainrl.rollout.engines.base import Engine
from plainrl.rollout.episodes import check_rows_fit_env, env_constructor
from plainrl.rollout.offload import set_render_threads
from plainrl.rollout.event_loop import RunLoop
from plainrl.rollout.envs import Environment, EnvWorkers
from plainrl.run.distributed import RankEngine, main_first, make_logger, rank_engine
from plainrl.run.correction import resolve_correction
from plainrl.rollout.engines.factory import make_engine, require_trainable_engine
from plainrl.run.final import save_final
from plainrl.run.evaluate import evaluate
from plainrl.run.lifecycle import open_run
from plainrl.run.async_rollout import IN_FLIGHT
from plainrl.train import Critic, Learner
from plainrl.train.teacher import TEACHER_ADAPTER, RemoteTeacher, Teacher
from plainrl.run.teacher import check_teacher, load_teacher, placement
from plainrl.train.distributed import Parallel
from plainrl.types import SamplingParams


AGENT_REWARD = "plainrl.rollout.envs:env_reward"  # the reward an agent returned (Episode.env.reward)


@dataclass
class Prepared:
    """Everything that can be checked before a model is loaded."""

    tokenizer: PreTrainedTokenizerBase
    data: PromptData
    reward_fns: list[RewardFn]
    multi_turn: MultiTurn | None  # rollout.env: episodes run in an environment
    reward_workers: RewardWorkers | None = None  # rollout.reward_timeout_s: reward calls in worker processes
    reward_combine: RewardCombine | None = None  # reward_combine: replaces the weighted sum
    grader: Callable[..., Any] = correctness  # eval.grader: scores held-out completions

    @property
    def env_factory(self) -> Callable[[], Environment] | None:
        return None if self.multi_turn is None else self.multi_turn.env_factory

    def prestart(self) -> None:
        """Fork the reward and environment workers now, while this process is small: a
        fork after the model loads copies the page tables of gigabytes (0.1-0.5 s each)."""
        if self.reward_workers is not None:
            self.reward_workers.prestart()
        if isinstance(self.env_factory, EnvWorkers):
            self.env_factory.prestart(self.multi_turn.max_live or 0)

    def close(self) -> None:
        """Stop the reward and environment workers, if any, and close the agents' gateway and the episodes' loop."""
        if self.reward_workers is not None:
            self.reward_workers.close()
        if self.multi_turn is not None and self.multi_turn.gateway is not None:
            self.multi_turn.gateway.close()
        if self.multi_turn is not None and self.multi_turn.loop is not None:
            self.multi_turn.loop.close()
        if isinstance(self.env_factory, EnvWorkers):
            self.env_factory.close()


def prepare(cfg: Config) -> Prepared:
    """Load the tokenizer, data and reward functions; fail on bad input before any model loads."""
    tokenizer = load_tokenizer(cfg.model.name, cfg.model.cache_dir)
    # an agent's own reward (what it returns) scores its episodes when no reward is configured
    specs = cfg.rewards or ([RewardSpec(fn=AGENT_REWARD)] if cfg.rollout.agent else [])
    reward_fns = bind_judges(build_reward_fns(specs), cfg.model.name)  # judge: policy_base, servers checked
    check_pass_reward(cfg.data.curriculum, [f.name for f in reward_fns] +
                      [s.name or "reward_model" for s in cfg.rewards if s.model is not None])
    for spec in cfg.rewards:
        if spec.model is not None:
            RewardModel.check(spec)
    max_prompt = cfg.model.max_context - cfg.rollout.completion_budget
    data = load_prompt_data(cfg.data, tokenizer, max_prompt_tokens=max_prompt, seed=cfg.seed)
    cfg.resolve_steps(len(data.train))  # train.epochs in steps
    if cfg.algorithm.advantage == "gae" and cfg.critic.model is not None:
        # the critic reads the policy's token ids, so both must mean the same tokens
        if load_tokenizer(cfg.critic.model, cfg.model.cache_dir).get_vocab() != tokenizer.get_vocab():
            raise ConfigError(f"critic.model={cfg.critic.model!r} has another tokenizer than model.name="
                              f"{cfg.model.name!r}; use a critic of the same model family (or leave critic.model unset)")
    _check_env_args(cfg, data)
    check_teacher(cfg, tokenizer, data)
    workers = None
    if cfg.rollout.reward_timeout_s is not None and reward_fns:
        workers = RewardWorkers(reward_fns, cfg.rollout.reward_workers)  # forked later, by Prepared.prestart
    return Prepared(tokenizer, data, reward_fns, multi_turn_settings(cfg), workers,
                    load_reward_combine(cfg.reward_combine) if cfg.reward_combine else None,
                    grader=load_eval_grader(cfg.eval.grader))


def _check_env_args(cfg: Config, data: PromptData) -> None:
    """Rows with ``env_args`` need an environment (or an agent, which reads its rows itself)
    whose constructor takes them; checked before any model loads."""
    rows = [p for p in data.train + data.eval if p.row.get("env_args")]
    if not rows:
        return
    if cfg.rollout.env is None and cfg.rollout.agent is None:
        raise ConfigError(f"data row {rows[0].source_index} has env_args, the keyword arguments of rollout.env's "
                          "constructor, but rollout.env is not set; set rollout.env or drop the rows' env_args")
    if cfg.rollout.env is not None:
        check_rows_fit_env(env_constructor(cfg.rollout), rows, cfg.rollout.env)


def multi_turn_settings(cfg: Config) -> MultiTurn | None:
    """``rollout.env`` / ``rollout.agent`` as :class:`MultiTurn` (None: single-turn rollouts).

    Raises:
        RewardLoadError: an environment or agent reference that cannot be loaded.
    """
    r = cfg.rollout
    factory, agent = make_env_factory(r), make_agent(r)
    if factory is None and agent is None:
        return None
    live = max_live_episodes(r)
    # inference servers batch concurrent requests themselves: every episode's call may go at once
    in_flight = (live or r.prompts_per_step * r.group_size) if r.engine == "remote" else 1
    # agents written for the OpenAI API: one gateway for the run, on rollout.gateway_host (its socket bound
    # when an episode first asks for its URL, so runs whose agents never do open no port)
    gateway = None
    set_render_threads(r.render_threads)  # long chat contexts rendered off the episodes' loop
    if agent:  # (imported here: openai's types cost seconds of start-up that other runs need not pay)
        from plainrl.rollout.gateway import Gateway

        gateway = Gateway(model=cfg.model.name, max_model_len=cfg.model.max_context, port=r.gateway_port,
                          online=r.agent == "online", host=r.gateway_host, token=gateway_key(r.gateway_api_key_env))
        gateway.episodes.tool_parser = r.tool_parser  # the format replies' tool calls are parsed in
    return MultiTurn(factory, r.max_turns, r.completion_budget, cfg.data.system_prompt, cfg.data.prompt_template,
                     max_live=live, agent=agent, max_context=cfg.model.max_context if agent else None,
                     timeout_s=r.agent_timeout_s if agent else None, max_in_flight=in_flight,
                     chat_template_kwargs=cfg.data.chat_template_kwargs, gateway=gateway,
                     loop=RunLoop(threads=r.agent_threads))  # every step's episodes on one loop (rollout/event_loop.py)


def gateway_key(env_name: str | None) -> str | None:
    """The key of the gateway's ``/rl/`` routes from the environment variable ``rollout.gateway_api_key_env``
    names (None: unset, the gateway makes a random one).

    Raises:
        ConfigError: the variable is not set, or holds fewer than 16 characters.
    """
    if env_name is None:
        return None
    key = os.environ.get(env_name, "")
    if len(key) < 16:
        raise ConfigError(f"rollout.gateway_api_key_env={env_name}, but the environment variable {env_name} is "
                          f"{'not set' if not key else 'shorter than 16 characters'}; export a long random key "
                          f"(`export {env_name}=$(python -c 'import secrets; print(secrets.token_urlsafe(32))')`)")
    return key


def load_eval_grader(ref: str) -> Callable[..., Any]:
    """``eval.grader``: a reward reference (a built-in's short name, ``module:fn`` or ``file.py:fn``).

    Raises:
        RewardLoadError: the reference does not resolve (the message names ``eval.grader``).
    """
    try:
        return load_reward_fn(ref)
    except RewardLoadError as e:
        raise RewardLoadError(f"eval.grader: {e}") from e.__cause__


def advantage_params(cfg: Config) -> AdvantageParams:
    """The estimator's scalars from the ``algorithm`` and ``rollout`` sections."""
    a = cfg.algorithm
    return AdvantageParams(estimator=a.advantage, group_size=cfg.rollout.group_size, norm_std=cfg.norm_std,
                           gamma=a.gamma, lam=a.lam, kl_coef=a.reward_kl[0], whiten=a.whiten_advantages)


@dataclass
class Run:
    """The live objects of a run, built by :func:`setup`."""

    cfg: Config
    run_dir: Path
    prep: Prepared
    logger: MetricsLogger
    model: torch.nn.Module
    engine: Engine
    learner: Learner
    sampler: Sampler  # epoch by epoch, or data.curriculum: by pass rate
    generator: torch.Generator
    params: SamplingParams  # rollout sampling
    advantages: AdvantageParams
    start: int  # first step to run (> 0 when resumed)
    critic: Critic | None = None  # algorithm.advantage: gae
    reward_models: list[RewardModel] = field(default_factory=list)  # rewards: [{model: ...}]
    in_flight: bytes | None = None  # async_steps > 0, resumed: the checkpoint's batches for steps `start`, ...
    monitor: SystemMonitor | None = None  # system/* metrics
    flops: FlopCounter | None = None  # perf/mfu: the update's model FLOPs
    peak_flops: float | None = None  # perf/mfu's denominator (None: not logged)
    parallel: Parallel = field(default_factory=Parallel)  # under torchrun: this rank
    teacher: Teacher | RemoteTeacher | None = None  # algorithm.teacher: on-policy distillation

    def evaluate(self) -> dict[str, float]:
        """Held-out accuracy. Under torchrun every rank runs it with its own engine (nobody
        waits); with remote servers rank 0 alone sends the requests and shares the result."""
        if self.parallel.active and self.cfg.rollout.engine != "hf":
            return self.parallel.broadcast(self._evaluate() if self.parallel.is_main else None)
        return self._evaluate()

    def _evaluate(self) -> dict[str, float]:
        c = self.cfg
        return evaluate(
            self.engine, self.prep.data.eval, self.prep.tokenizer,
            max_new_tokens=c.eval.max_new_tokens or c.rollout.max_new_tokens, stop=tuple(c.rollout.stop),
            k=c.eval.k, temperature=c.eval.temperature, generator=self.generator, multi_turn=self.prep.multi_turn,
            grader=self.prep.grader, chunk_size=c.rollout.batch_size, progress=c.log.progress,
        )

    def resume_state(self) -> dict[str, Any]:
        """A copy of what a resumed run continues sampling from: ``{"sampler": state_dict,
        "rng": RNG states}`` (``rollout.async_steps``: taken when a batch starts, saved by
        :meth:`save` when a stop abandons that batch)."""
        return {"sampler": self.sampler.state_dict(), "rng": get_rng_state(self.generator)}

    def save(self, step: int, in_flight: bytes | None = None, state: dict[str, Any] | None = None) -> Path:
        """Checkpoint after ``step`` steps; ``in_flight``: the batches of steps ``step``, ``step + 1``,
        ... already sampled (``rollout.async_steps``), saved so a resumed run trains on them (see
        :mod:`plainrl.run.async_rollout`); ``state``: a :meth:`resume_state` to save instead of the live
        sampler and RNG states (a batch abandoned by a stop is sampled again from it)."""
        if state is not None and self.parallel.active:
            raise ValueError("a saved resume state is for one process (rollout.async_steps is not under torchrun)")
        if self.critic is not None:
            # written first: the policy's checkpoint is the commit point, so a critic
            # checkpoint always exists for the step that `latest` names
            self._save(self.run_dir / "critic", step, self.critic.model, self.critic.optimizer,
                       self.critic.scheduler, {}, None)
        return self._save(self.run_dir, step, self.model, self.learner.optimizer, self.learner.scheduler,
                          state["sampler"] if state is not None else self.sampler.state_dict(), self.generator,
                          blobs={IN_FLIGHT: in_flight} if in_flight is not None else None,
                          rng_state=state["rng"] if state is not None else None)

    def _save(self, run_dir: Path, step: int, model, optimizer, scheduler, sampler_state, generator,
              blobs: dict[str, bytes] | None = None, rng_state: dict[str, Any] | None = None) -> Path:
        kw = dict(model=model, optimizer=optimizer, scheduler=scheduler, sampler_state=sampler_state,
                  generator=generator, config_yaml=dump_config(self.cfg), keep_last=self.cfg.checkpoint.keep_last,
                  save_optimizer=self.cfg.checkpoint.save_optimizer)
        if self.parallel.active:
            return save_ranked(run_dir, step, strategy=self.parallel.strategy, **kw)  # (async_steps: not under torchrun)
        return save_checkpoint(run_dir, step, blobs=blobs, rng_state=rng_state, **kw)

    def load(self, ckpt: Path, model, optimizer, scheduler, generator, *, restore_rng: bool = True):
        """Restore a checkpoint written by :meth:`save`; returns its state (warnings printed)."""
        if not self.parallel.active:
            state = load_checkpoint(ckpt, model=model, optimizer=optimizer, scheduler=scheduler,
                                    generator=generator, restore_rng=restore_rng)
            warnings = state.warnings
        else:
            state, warnings = load_ranked(ckpt, strategy=self.parallel.strategy, model=model, optimizer=optimizer,
                                          scheduler=scheduler, generator=generator, restore_rng=restore_rng,
                                          generator_seed=rank_seed(self.cfg.seed, self.parallel) + state_step(ckpt))
        for w in warnings:
            self.logger.print(f"warning: {w}")
        return state

    def save_final(self) -> None:
        """``final/`` (and PPO's ``critic/final/``) in Hugging Face format, by rank 0."""
        tok = self.prep.tokenizer
        save_final(self.cfg, self.model, tok, self.run_dir, parallel=self.parallel)  # + model card, portable base
        if self.critic is not None:
            save_final(self.cfg, self.critic.model, tok, self.run_dir, role="critic", parallel=self.parallel)


def rank_seed(seed: int, parallel: Parallel) -> int:
    """The sampling generator's seed of this rank: ``seed`` on rank 0 (and in one process),
    distinct streams elsewhere (the ranks sample different prompts)."""
    return seed + 1_000_003 * parallel.rank


def state_step(ckpt: Path) -> int:
    """The step number in a checkpoint directory's name."""
    from plainrl.checkpoint.layout import step_of

    return step_of(ckpt.name) or 0




def _algorithm(cfg: Config, model: torch.nn.Module) -> tuple[AlgorithmConfig, str]:
    """``cfg.algorithm`` with ``correction.methods`` resolved for ``model`` (:mod:`plainrl.run.correction`),
    and the reason."""
    dtype = next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.float32)
    a = cfg.algorithm
    section, why = resolve_correction(a.correction, engine=cfg.rollout.engine, weights_dtype=dtype,
                                      async_steps=cfg.rollout.async_steps, ratio_level=a.ratio_level)
    return a.model_copy(update={"correction": section}), why


def make_learner(cfg: Config, model: torch.nn.Module, pad_id: int, parallel: Parallel | None = None, *,
                 algorithm: AlgorithmConfig | None = None) -> Learner:
    """The policy learner for ``model`` with the config's algorithm (``correction.methods: auto``
    resolved by :func:`plainrl.run.correction.resolve_correction`, or ``algorithm`` already resolved),
    optimiser and sampling temperature and filter (top-k/top-p, for the behaviour ratio);
    the reference (a KL, or ``teacher: self``) is a frozen copy only for full fine-tuning.
    ``parallel``: under torchrun, the model is wrapped for ``train.strategy``."""
    return Learner(model, algorithm or _algorithm(cfg, model)[0], cfg.train, pad_id=pad_id,
                   temperature=cfg.rollout.temperature, top_k=cfg.rollout.top_k, top_p=cfg.rollout.top_p,
                   completion_budget=cfg.rollout.completion_budget,
                   copy_reference=cfg.algorithm.needs_reference and not cfg.model.lora.enabled, parallel=parallel)


def load_critic(cfg: Config, policy: torch.nn.Module, device: torch.device, pad_id: int,
                parallel: Parallel | None = None) -> Critic:
    """PPO's critic: ``critic.model`` / ``critic.lora`` over the policy's ``model`` section.

    With LoRA on both and the same base, the critic reuses the policy's frozen base
    weights (two adapters, one copy of the base; :func:`plainrl.models.share_frozen_weights`).
    """
    update = {"lora": cfg.critic.lora or cfg.model.lora}
    if cfg.critic.model is not None:
        update["name"] = cfg.critic.model
    model_cfg = cfg.model.model_copy(update=update)
    shared = cfg.model.lora.enabled and model_cfg.lora.enabled and model_cfg.name == cfg.model.name
    shared = shared and not _sharded(parallel)  # FSDP2 replaced the policy's parameters by its shards
    model = load_value_model(model_cfg, device, per_token=True, share_with=policy if shared else None,
                             meta=parallel is not None and parallel.on_meta)
    return Critic(model, cfg.algorithm, cfg.train, lr=cfg.critic.lr, pad_id=pad_id, parallel=parallel)


def _sharded(parallel: Parallel | None) -> bool:
    return parallel is not None and parallel.active and parallel.strategy == "fsdp2"


def setup(cfg: Config, parallel: Parallel | None = None) -> Run:
    """Everything before the first step: checks, data, model, engine, learner (and PPO's
    critic); resume or eval-before. The caller closes ``run.prep`` when done.
    ``parallel``: under torchrun, this rank (:func:`plainrl.run.distributed.start`)."""
    parallel = parallel or Parallel()
    require_trainable_engine(cfg.rollout)  # a read-only engine fails before the run dir, data and model
    if cfg.rollout.engine == "vllm":  # a missing vLLM fails before the run dir, data and model
        from plainrl.rollout.engines.vllm_local import import_vllm

        import_vllm()
    if cfg.model.quantization != "none":  # an unsupported device fails before the run dir, data and model
        device = resolve_device(cfg.device)
        check_quantization(cfg.model.quantization, device, model_dtype(cfg.model.dtype, device))
    run_dir, resume_from, resume_warnings = open_run(cfg, write=parallel.is_main)
    with main_first(parallel):  # rank 0 fills the model cache (the embedded model's conversion) first
        prep = prepare(cfg)
    try:
        return _setup(cfg, prep, run_dir, resume_from, resume_warnings, parallel)
    except BaseException:
        prep.close()
        raise


def _setup(cfg: Config, prep: Prepared, run_dir: Path, resume_from: Path | None, resume_warnings: list[str],
           parallel: Parallel) -> Run:
    device = parallel.device if parallel.active else resolve_device(cfg.device)
    logger = make_logger(cfg, run_dir, parallel)
    _announce(cfg, prep, logger, run_dir, device, parallel, resume_warnings)
    prep.prestart()
    model, engine = _policy_and_engine(cfg, prep, logger, device, parallel)
    algorithm, why = _algorithm(cfg, model)
    logger.print(f"algorithm.correction.methods: {algorithm.correction.methods} ({why})")
    pad_id = pad_token_id(prep.tokenizer)
    run = Run(
        cfg=cfg, run_dir=run_dir, prep=prep, logger=logger, model=model, engine=engine,
        learner=make_learner(cfg, model, pad_id, parallel, algorithm=algorithm),
        sampler=make_prompt_sampler(prep.data.train, cfg.rollout.prompts_per_step, seed=cfg.seed,
                                    shuffle=cfg.data.shuffle, curriculum=cfg.data.curriculum),
        generator=torch.Generator(device=device).manual_seed(rank_seed(cfg.seed, parallel)),
        params=sampling_params(cfg.rollout), advantages=advantage_params(cfg), start=0, parallel=parallel,
    )
    run.monitor, run.flops = SystemMonitor(device), FlopCounter(model, passes=cfg.algorithm.ppo_epochs)
    run.peak_flops = peak_flops(device, model_dtype(cfg.model.dtype, device), cfg.train.peak_flops)
    _attach_scorers(run, device)
    if resume_from is not None:
        _resume(run, resume_from)
    if cfg.rollout.engine != "hf" or isinstance(engine, RankEngine) or cfg.rollout.async_steps:  # (hf: its copy)
        with logger.phase(f"pushing the policy's weights to the {cfg.rollout.engine} engine"):
            engine.load_weights(model)
    if resume_from is None and cfg.eval.before and prep.data.eval:  # (on resume it ran already: the RNG would shift)
        logger.log_eval(0, run.evaluate())
    return run


def _announce(cfg: Config, prep: Prepared, logger: MetricsLogger, run_dir: Path, device: torch.device,
              parallel: Parallel, resume_warnings: list[str]) -> None:
    """The run's opening lines: ranks, the config, dtype, quantization, resume changes, data notes."""
    if parallel.active:
        logger.print(f"distributed: {parallel.world_size} ranks, train.strategy={parallel.strategy}, {device.type}")
    logger.print(f"config ({run_dir / 'config.yaml'}):\n{dump_config(cfg)}")
    for note in cfg.notes:
        logger.print(f"config: {note}")
    logger.print(f"dtype: {resolve_dtype(cfg.model.dtype, device.type).reason}")
    if note := cfg.rollout.agent_budget_note(cfg.model.max_context):
        logger.print(note)
    gateway = prep.multi_turn.gateway if prep.multi_turn is not None else None
    if gateway is not None and gateway.online is not None:  # rollout.agent: online: tell the outside process
        from plainrl.rollout.gateway.online import announce

        path = announce(run_dir, gateway.url, gateway.online.token)
        prep.multi_turn.loop.submit(gateway.serve_idle()).result(timeout=60)  # claims get 503 until a step starts
        logger.print(f"online episodes: {gateway.url}/rl/episodes (its address and token: {path})")
    if cfg.model.quantization != "none":
        logger.print(check_quantization(cfg.model.quantization, device, model_dtype(cfg.model.dtype, device)))
    for w in resume_warnings:
        logger.print(f"warning: resuming with a changed setting: {w}")
    if prep.data.dropped.total:
        logger.print(f"data: {prep.data.dropped.summary()}")
    for note in prep.data.notes:
        logger.print(f"data: {note}")
    if cfg.train.epochs is not None:
        logger.print(f"train.epochs={cfg.train.epochs}: {cfg.train.total_steps} steps of {cfg.rollout.prompts_per_step} "
                     f"prompts over {len(prep.data.train)} training prompts")


def _policy_and_engine(cfg: Config, prep: Prepared, logger: MetricsLogger, device: torch.device,
                       parallel: Parallel) -> tuple[torch.nn.Module, Engine]:
    """The policy (with a teacher's frozen adapter beside the trained one, when the teacher is the
    same base plus an adapter: loaded before the learner wraps the model) and its engine."""
    a = cfg.algorithm
    # under FSDP2 only rank 0 reads the weights; the other ranks build on the meta device
    model = load_policy(cfg.model, device, reference_adapter=a.needs_reference, meta=parallel.on_meta)
    if a.distilling and placement(cfg) == "adapter":
        load_frozen_adapter(model, a.teacher.adapter, TEACHER_ADAPTER)
    # vLLM's start (loading, compiling) or the servers' checks take a while: not in silence
    hf = cfg.rollout.engine == "hf"
    with nullcontext() if hf else logger.phase(f"starting the {cfg.rollout.engine} engine"):
        # under FSDP2 the embedded engine samples with a full replica made here, before the learner shards
        engine, _ = rank_engine(cfg, model, parallel, lambda m: make_engine(
            cfg.model, cfg.rollout, m, prep.tokenizer, device, seed=cfg.seed))
    return model, engine


def _attach_scorers(run: Run, device: torch.device) -> None:
    """What scores a step beside the policy: PPO's critic, reward models, a distillation teacher."""
    cfg, parallel, tok = run.cfg, run.parallel, run.prep.tokenizer
    if cfg.algorithm.advantage == "gae":
        run.critic = load_critic(cfg, run.model, device, pad_token_id(tok), parallel)
    share = run.model if cfg.model.lora.enabled and not _sharded(parallel) else None
    run.reward_models = [RewardModel.load(spec, cfg.model, tok, device, share_with=share)
                         for spec in cfg.rewards if spec.model is not None]
    if cfg.algorithm.distilling:
        run.teacher = load_teacher(cfg, run.learner, run.model, tok, device, parallel, run.logger)


def _resume(run: Run, resume_from: Path) -> None:
    """Restore the policy, optimiser, sampler, RNG, the batches sampled ahead (async) and the critic."""
    state = run.load(resume_from, run.model, run.learner.optimizer, run.learner.scheduler, run.generator)
    run.sampler.load_state_dict(state.sampler_state)
    run.start = state.step
    run.in_flight = state.blobs.get(IN_FLIGHT)
    if run.critic is not None:
        critic_ckpt = resume_from.parent.parent / "critic" / CHECKPOINTS_DIR / step_dir_name(state.step)
        if not critic_ckpt.is_dir():
            raise CheckpointError(f"cannot resume the critic: {critic_ckpt} is missing")
        run.load(critic_ckpt, run.critic.model, run.critic.optimizer, run.critic.scheduler, None, restore_rng=False)
    run.logger.resume_at(run.start)
    run.logger.print(f"resumed from {resume_from} at step {run.start}")
