"""The configuration schema: one pydantic model per section, ``extra="forbid"`` so an
unknown key, a wrong type or an impossible combination fails validation naming the
dotted path, the value given and how to fix it."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, PrivateAttr, field_validator, model_validator

from plainrl.config.base import ConfigError, _Section  # noqa: F401  (ConfigError is re-exported)
from plainrl.config.algorithm import (  # noqa: F401  (re-exported)
    OFFLINE_ALGORITHMS,
    PRESETS,
    AdvantageEstimator,
    AlgorithmConfig,
    AlgorithmName,
    KLPlacement,
)
from plainrl.config.chat import ChatTemplateKwargs
from plainrl.config.curriculum import CurriculumConfig
from plainrl.config.rollout import BUILTIN_ENVS, RemoteConfig, RolloutConfig, VLLMConfig, agent_budget  # noqa: F401
from plainrl.config.tinker import TinkerConfig
from plainrl.config.train import TrainConfig, strategy_problem

ENV_REWARD = "plainrl.rollout.envs:env_reward"  # Episode.env.reward: an environment's (or agent's) own reward


class LoraConfig(_Section):
    """LoRA adapters via peft (Hu et al. 2021, arXiv:2106.09685)."""

    enabled: bool = True
    """Train LoRA adapters (true) or the full weights (false)."""
    r: int = Field(16, gt=0)
    """LoRA rank."""
    alpha: float = Field(32.0, gt=0)
    """LoRA scaling numerator (the update is scaled by alpha / r)."""
    dropout: float = Field(0.0, ge=0.0, lt=1.0)
    """Dropout on the LoRA input."""
    target_modules: list[str] | Literal["all-linear"] = Field(
        default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    )
    """Module names that get adapters, or `all-linear`."""


class ModelConfig(_Section):
    """Which policy to load.

    name: ``smollm2-135m-instruct`` (the embedded default), a local directory with
    a transformers checkpoint, a ``.gguf`` file, or a hub id.
    """

    name: str = "smollm2-135m-instruct"
    """`smollm2-135m-instruct` (the embedded model), a local transformers directory, a `.gguf` file or a hub id."""
    dtype: Literal["auto", "float32", "bfloat16"] = "auto"
    """`auto`: bfloat16 where the device runs it natively (CUDA with bf16, CPUs with AVX512-BF16, AMX or ARM bf16),
    float32 elsewhere; or `bfloat16` / `float32` as asked."""
    lora: LoraConfig = Field(default_factory=LoraConfig)
    """LoRA adapters (peft); `enabled: false` trains the full weights."""
    adapter: str | None = None
    """A saved peft LoRA adapter to start from and train further (e.g. an SFT run's `final/`); its own r, alpha and
    target modules are used; needs `model.lora.enabled`."""
    cache_dir: str | None = None
    """Where GGUF conversions are cached; null: `$PLAINRL_CACHE`, else `~/.cache/plainrl`."""
    max_context: int = Field(1024, gt=0)
    """Prompt plus completion tokens, at most."""
    attn_implementation: Literal["auto", "eager", "sdpa", "flash_attention_2"] = "auto"
    """`auto`: eager attention on CPU (its backward is about 4x faster than the CPU SDPA kernel's at RL lengths); on
    GPU `flash_attention_2` where the `flash-attn` package imports, else SDPA; or `eager` / `sdpa` /
    `flash_attention_2` (CUDA and `flash-attn` only). With flash attention packed micro-batches (`train.packing`) run
    through its variable-length kernel (position ids restart per episode, no dense mask)."""
    quantization: Literal["none", "nf4", "int8"] = "none"
    """QLoRA: `nf4` or `int8` loads the frozen base 4-/8-bit with bitsandbytes (`pip install 'plainrl[qlora]'`), LoRA
    trains on top (QLoRA, Dettmers et al. 2023, arXiv:2305.14314); needs `model.lora.enabled`. `none`: no
    quantization."""

    @model_validator(mode="after")
    def _quantization_needs_lora(self) -> "ModelConfig":
        if self.quantization != "none" and not self.lora.enabled:
            raise ValueError(
                f"model.quantization={self.quantization!r} freezes the base weights in {self.quantization}, so only "
                "LoRA adapters can train: set model.lora.enabled=true, or model.quantization=none for full fine-tuning"
            )
        return self


class DataConfig(_Section):
    """Where prompts come from: a built-in procedural ``task``, a ``path``/hub id, or ``source``,
    a Python function returning the rows (:mod:`plainrl.data.sources`).

    Rows carry ``messages`` (chat) or ``prompt`` (text) plus ``answer`` and any other
    columns, and optionally ``env_args`` (keyword arguments of ``rollout.env`` for that row);
    ``format: gsm8k`` maps GSM8K's ``question``/``answer`` rows onto that.
    """

    task: Literal["arithmetic", "countdown", "search"] | None = None
    """A built-in procedural task: `arithmetic`, `countdown` or `search` (seeded; held-out rows disjoint from
    training)."""
    task_args: dict[str, Any] = Field(default_factory=dict)
    """Arguments of the built-in task (see the data page), e.g. `{min_value: 0, max_value: 99}` for arithmetic or
    `num_train` (training rows generated)."""
    path: str | None = None
    """A JSON/JSONL/CSV/Parquet/Arrow file, a `save_to_disk` directory or a hub dataset id."""
    source: str | None = None
    """`module:fn` or `path/to/file.py:fn`: `fn(**data.source_args)` returns the rows (an iterable of dicts, a torch
    `Dataset` or a `datasets.Dataset`); called once, before any model loads."""
    source_args: dict[str, Any] = Field(default_factory=dict)
    """Keyword arguments of `data.source`."""
    eval_source_args: dict[str, Any] | None = None
    """With `data.source`: the eval rows are `data.source` called again with `data.source_args` updated by these
    (e.g. `{seed: 1000000}`, another seed of a procedural source), the first `data.eval_size` of them; rows whose
    prompt is also a training prompt are dropped."""
    split: str = "train"
    """The split of a hub dataset or `DatasetDict` to train on."""
    subset: str | None = None
    """A hub dataset's configuration, e.g. `main` for `openai/gsm8k`."""
    format: Literal["auto", "gsm8k"] = "auto"
    """`gsm8k` maps GSM8K's `question`/`answer` rows (the reference is the number after `####`); `auto` reads
    `messages` or `prompt` rows as they are."""
    prompt_column: str | None = None
    """The column holding the prompt; null: `messages` if the rows have it, else `prompt`."""
    system_prompt: str | None = None
    """A system message put before every chat prompt."""
    prompt_template: str = "{prompt}"
    """Python format string applied to text prompts, e.g. `"{prompt}\\nAnswer: "`."""
    chat_template_kwargs: ChatTemplateKwargs = Field(default_factory=dict)
    """Variables for the tokenizer's chat template wherever plainrl renders a chat, e.g. `{enable_thinking: false}`
    for Qwen3."""
    on_invalid: Literal["error", "drop"] = "error"
    """A row without a usable prompt, or one too long: `error` stops the run naming file, row and column; `drop`
    drops it and logs how many and why."""
    max_rows: int | None = Field(None, gt=0)
    """Read at most this many rows (bounds an endless `data.source`)."""
    eval_path: str | None = None
    """A file or hub id of held-out rows."""
    eval_split: str | None = None
    """A split of `data.path` to evaluate on."""
    eval_size: int = Field(100, ge=0)
    """Held-out rows a built-in task generates for evaluation."""
    eval_holdout: int = Field(0, ge=0)
    """With `data.path` or `data.source` and no `eval_path`/`eval_split`: this many rows, chosen by `seed`, held out
    of training for evaluation."""
    shuffle: bool = True
    """Visit the training rows in a new order each epoch, drawn from `seed` (false: in file order); a resumed run
    continues the same order."""
    curriculum: CurriculumConfig | None = None
    """A section (even `{}`) draws RL training prompts by their running pass rate instead of epoch by epoch (see
    the data page); null: every row once per epoch."""

    @model_validator(mode="after")
    def _source_settings(self) -> "DataConfig":
        if self.source_args and self.source is None:
            raise ValueError("data.source_args are the keyword arguments of data.source, which is not set; "
                             "set data.source (module:fn) or remove data.source_args")
        if self.eval_source_args is not None:
            if self.source is None:
                raise ValueError("data.eval_source_args update data.source_args for the eval rows, but data.source "
                                 "is not set; set data.source (module:fn) or remove data.eval_source_args")
            others = [k for k in ("eval_path", "eval_split") if getattr(self, k) is not None]
            others += ["eval_holdout"] if self.eval_holdout else []
            if others:
                raise ValueError(f"data.eval_source_args and data.{others[0]} both choose the eval rows; keep one")
        if self.source is not None and self.eval_split is not None and self.eval_path is None:
            raise ValueError(f"data.eval_split={self.eval_split!r} picks a split of data.path; with data.source, "
                             "give eval rows by data.eval_path or data.eval_holdout")
        return self


class RewardSpec(_Section):
    """One reward, with a weight: a function ``fn`` (``module:fn`` or ``path/to/file.py:fn``)
    or a trained reward model ``model`` (:class:`plainrl.rewards.model.RewardModel`)."""

    fn: str | None = None
    """A reward function: a built-in short name (`correctness`), `module:fn` or `path/to/file.py:fn`, called as
    `fn(completion, **columns)`, returning a float or None."""
    model: str | None = None
    """A reward model instead of a function: an `algorithm.name: rm` run's `final/`, or a one-label
    sequence-classification model with the policy's tokenizer."""
    weight: float = 1.0
    """Weight in the summed reward (0: logged, not trained on)."""
    name: str | None = None
    """Metric name (`reward/<name>/mean`); null: the function's name, or `reward_model`."""
    kwargs: dict[str, Any] = Field(default_factory=dict)
    """Extra keyword arguments of `fn`."""

    @model_validator(mode="after")
    def _one_source(self) -> "RewardSpec":
        if (self.fn is None) == (self.model is None):
            raise ValueError(f"a reward needs exactly one of fn (a function) or model (a reward model); "
                             f"got fn={self.fn!r}, model={self.model!r}")
        if self.model is not None and self.kwargs:
            raise ValueError(f"kwargs go to reward functions; the reward model {self.model!r} takes none")
        return self


class CriticConfig(_Section):
    """The value model of ``algorithm.advantage: gae`` (PPO): a transformers backbone
    with a linear value head, trained by its own optimiser (see docs/algorithms.md)."""

    model: str | None = None
    """The critic's backbone; null: `model.name` (same dtype and `max_context`)."""
    lora: LoraConfig | None = None
    """The critic's LoRA; null: `model.lora` (its own adapter); `enabled: false`: full weights."""
    lr: float | None = Field(None, gt=0.0)
    """The critic's learning rate; null: `train.lr`."""
    warmup_steps: int = Field(0, ge=0)
    """The first N steps train only the critic."""


class EvalConfig(_Section):
    """Held-out evaluation: greedy pass@1, and mean@k when k > 1 (sampled)."""

    before: bool = True
    """Evaluate before training."""
    after: bool = True
    """Evaluate after training."""
    every: int = Field(0, ge=0)
    """Also evaluate every N steps (0: never)."""
    k: int = Field(1, gt=0)
    """Sampled completions per prompt for `eval/mean@k` (1: greedy pass@1 only)."""
    temperature: float = Field(1.0, ge=0.0)
    """Temperature of the k sampled completions."""
    max_new_tokens: int | None = Field(None, gt=0)
    """Completion budget of evaluation; null: `rollout.max_new_tokens`."""
    grader: str = "correctness"
    """The reward function grading each held-out completion 1 (right) or 0: `correctness`, e.g. `countdown`, or
    `module:fn`; it gets the row's columns, and in an environment or agent episode also `env_reward`, `env_error`
    or `env_info` when it names them as parameters."""


class CheckpointConfig(_Section):
    """Resumable checkpoints under ``run_dir/checkpoints`` (see docs/checkpointing.md)."""

    every: int = Field(0, ge=0)
    """Save every N steps and at the end (0: never)."""
    keep_last: int | None = Field(3, gt=0)
    """Checkpoints kept (null: all)."""
    resume: str = "auto"
    """`auto` (the latest complete checkpoint in `run_dir`, if any), `never`, or a checkpoint path."""
    save_optimizer: bool = True
    """false: checkpoints without AdamW's moments (twice the trainable weights in float32); a resumed run restarts
    them from zero."""


class WandbConfig(_Section):
    """Weights & Biases logging (``pip install 'plainrl[wandb]'``): the resolved config, every
    metric, each step's sampled rollouts as a ``wandb.Table`` and optionally ``final/`` as an
    artifact (plainrl.tracking). ``mode: offline`` writes ``run_dir/wandb/`` without network
    (``wandb sync`` uploads it later)."""

    project: str = "plainrl"
    """W&B project."""
    name: str | None = None
    """W&B run name; null: the run directory's name."""
    entity: str | None = None
    """W&B entity; null: the API key's default."""
    tags: list[str] = Field(default_factory=list)
    """W&B tags."""
    mode: Literal["online", "offline", "disabled"] = "online"
    """`online`, `offline` (writes `run_dir/wandb/`, upload later with `wandb sync`) or `disabled`."""
    artifact: bool = False
    """Log `final/` (adapter or weights) as a `model` artifact at the end."""


class LogConfig(_Section):
    tensorboard: bool = True
    """Write TensorBoard event files to `run_dir/tb/`."""
    rollouts_per_step: int = Field(4, ge=0)
    """Sampled episodes written to `rollouts.jsonl` per step."""
    progress: bool = True
    """Print one progress line per step (and progress bars and spinners)."""
    report: bool = True
    """Write `run_dir/report.html` at the end."""
    wandb: WandbConfig | None = None
    """A section (even `{}`) turns Weights & Biases logging on."""


class Config(_Section):
    """The whole run. ``run_dir`` receives config.yaml, metrics.jsonl, rollouts.jsonl, final/."""

    run_dir: str = "runs/default"
    """Where the run writes `config.yaml`, `metrics.jsonl`, `rollouts.jsonl`, `errors.jsonl`, `report.html`, `tb/`,
    `checkpoints/` and `final/`; running the same command again resumes from it."""
    seed: int = 0
    """Seeds Python, NumPy and torch, the prompt order, the built-in tasks' rows and `data.eval_holdout`'s choice of
    rows."""
    device: Literal["auto", "cpu", "cuda"] = "auto"
    """Where the model runs: `auto` (CUDA when available, else CPU), `cpu` or `cuda`."""
    threads: int | None = Field(None, gt=0)
    """CPU threads for torch (`torch.set_num_threads`); null: torch's default (under torchrun: the cores divided
    among the local ranks)."""
    model: ModelConfig = Field(default_factory=ModelConfig)
    """The policy: which model, its dtype, LoRA, quantization."""
    data: DataConfig = Field(default_factory=DataConfig)
    """Where prompts (or SFT/DPO/RM rows) come from and how they are rendered."""
    rollout: RolloutConfig = Field(default_factory=RolloutConfig)
    """Sampling: the engine, group size, budgets, multi-turn environments, agents and the worker processes."""
    rewards: list[RewardSpec] = Field(default_factory=list)
    """A list of rewards `{fn, weight, name, kwargs}` or `{model, weight, name}`, summed with their weights. Empty
    with a `rollout.env` of your own: the environment's reward (`plainrl.rollout.envs:env_reward`); with
    `rollout.agent`: the reward the agent returns."""
    reward_combine: str | None = None
    """`module:fn` or `path/to/file.py:fn`, `fn(scores: {name: [N]}, **columns) -> [N]`, replacing the weighted sum
    of `rewards`; null: the weighted sum."""
    algorithm: AlgorithmConfig = Field(default_factory=AlgorithmConfig)
    """The algorithm: a preset `name` and the knobs it sets defaults for."""
    critic: CriticConfig = Field(default_factory=CriticConfig)
    """PPO's value model (`algorithm.advantage: gae` only)."""
    train: TrainConfig = Field(default_factory=TrainConfig)
    """Optimisation, micro-batching and the distributed strategy."""
    eval: EvalConfig = Field(default_factory=EvalConfig)
    """Held-out evaluation before, during and after training."""
    log: LogConfig = Field(default_factory=LogConfig)
    """TensorBoard, the progress line, rollouts written per step, the HTML report, Weights & Biases."""
    checkpoint: CheckpointConfig = Field(default_factory=CheckpointConfig)
    """Resumable checkpoints under `run_dir/checkpoints`."""
    tinker: TinkerConfig = Field(default_factory=TinkerConfig)
    """`plainrl tinker`'s base models, idle clients and sampler snapshots (other commands ignore it)."""
    _notes: list[str] = PrivateAttr(default_factory=list)  # what loading chose for the user; printed with the config

    @property
    def notes(self) -> list[str]:
        """What loading decided that the config did not say (the environment's reward as the reward,
        a warm-up shortened to a shortened run); the run prints them with the config."""
        return self._notes

    @model_validator(mode="after")
    def _check_combinations(self) -> "Config":
        a = self.algorithm
        t = self.train
        self._notes.extend(m for m in a._deprecations if m not in self._notes)
        r = self.rollout
        if (r.top_p < 1.0 or r.top_k > 0) and r.engine == "remote" and r.remote.backend == "sglang" and not a.offline:
            raise ValueError(
                f"rollout.top_p={r.top_p} / rollout.top_k={r.top_k} with SGLang servers: the learner takes the "
                "off-policy ratio after the same top-k/top-p filter as the engine's logprobs, which is checked for "
                "vLLM (processed logprobs) and the embedded engine, not for SGLang's; set rollout.top_p=1 and "
                "rollout.top_k=0, or use rollout.remote.backend=vllm (plainrl serve) or rollout.engine=hf"
            )
        if t.steps is not None and t.warmup_steps is not None and t.warmup_steps > t.steps:
            raise ValueError(f"train.warmup_steps={t.warmup_steps} exceeds train.steps={t.steps}; lower it")
        if problem := strategy_problem(self.train, self.model.quantization, rl=not a.offline):
            raise ValueError(problem)
        if a.offline:
            return self._check_offline()
        d = self.data
        if [d.task, d.path, d.source].count(None) != 2:
            raise ValueError(
                "data: set exactly one of data.task (a built-in task, e.g. 'arithmetic'), data.path (a file "
                f"or hub id) or data.source (module:fn); got task={d.task!r}, path={d.path!r}, source={d.source!r}"
            )
        if self.rollout.agent is not None and self.rollout.max_total_tokens is None:
            self.rollout.max_total_tokens = agent_budget(self.rollout.max_new_tokens, self.model.max_context)
        if self.rollout.completion_budget >= self.model.max_context:
            raise ValueError(
                f"rollout.max_new_tokens={self.rollout.max_new_tokens} (rollout.max_total_tokens="
                f"{self.rollout.max_total_tokens} for multi-turn) must be smaller than model.max_context="
                f"{self.model.max_context}; raise model.max_context or lower the completion budget"
            )
        if self.rollout.env is None and self.rollout.agent is None and self.rollout.max_total_tokens is not None:
            raise ValueError(
                "rollout.max_total_tokens applies to multi-turn rollouts only; set rollout.env or "
                "rollout.agent, or remove it"
            )
        if not self.rewards and self.rollout.env is not None and self.rollout.env not in BUILTIN_ENVS:
            # as TRL does with an environment_factory: the environment's reward (get_reward, step rewards,
            # final_reward) is the reward; written into the config so config.yaml and the printout show it
            self.rewards = [RewardSpec(fn=ENV_REWARD)]
            self._notes.append(f"rewards: none given, so the environment's reward scores the episodes "
                               f"(rewards: [{{fn: {ENV_REWARD}}}]); an episode whose environment gives none "
                               "is unscorable")
        # an agent's own reward needs no function; nor does distillation with no weight on a reward
        if not self.rewards and self.rollout.agent is None and a.reward_coef > 0:
            raise ValueError(
                "rewards: no reward function given; add at least one, e.g. "
                "rewards: [{fn: plainrl.rewards.builtins:correctness, weight: 1.0}] (or set rollout.agent: "
                "the reward your agent returns scores its episodes; or a rollout.env of your own: its reward "
                "does; the built-in tool environments give none; or distil a teacher with algorithm.name: opd, "
                "whose reward_coef is 0)"
            )
        group_relative = a.advantage in ("grpo", "rloo") and a.reward_coef > 0  # (distillation alone: per token)
        if self.rollout.group_size < 2 and (group_relative or a.dynamic_sampling):
            why = "dynamic sampling keeps groups" if a.dynamic_sampling else "group-relative advantages need"
            raise ValueError(
                f"rollout.group_size={self.rollout.group_size}: {why} at least 2 samples per prompt "
                f"(algorithm.advantage={a.advantage!r}); set rollout.group_size>=2"
            )
        if self.rollout.temperature == 0 and self.rollout.group_size > 1:
            raise ValueError(
                "rollout.temperature=0 (greedy) makes every sample of a group identical, so every "
                "advantage is 0; use a temperature > 0 for training"
            )
        if (problem := self._curriculum_problem()) is not None:
            raise ValueError(problem)
        episodes = self.rollout.prompts_per_step * self.rollout.group_size
        if a.mini_batches > episodes:
            raise ValueError(
                f"algorithm.mini_batches={a.mini_batches} exceeds the {episodes} episodes of a step "
                "(rollout.prompts_per_step x rollout.group_size); lower it"
            )
        changed = [k for k, f in CriticConfig.model_fields.items() if getattr(self.critic, k) != f.default]
        if a.advantage != "gae" and (unused := changed):
            raise ValueError(
                f"critic.{unused[0]}={getattr(self.critic, unused[0])!r}: the critic is only used by "
                f"algorithm.advantage=gae (PPO), not {a.advantage!r}; remove the critic section or set "
                "algorithm.name=ppo"
            )
        if self.model.quantization != "none" and self.rollout.decoder == "static":
            raise ValueError(
                f"rollout.decoder=static fuses the weights into its own float copies and cannot read "
                f"{self.model.quantization}-quantized ones (model.quantization={self.model.quantization!r}); "
                "use rollout.decoder=auto or transformers"
            )
        if self.model.quantization != "none" and a.advantage == "gae" and self.critic.lora is not None \
                and not self.critic.lora.enabled:
            raise ValueError(
                f"critic.lora.enabled=false trains the critic's full weights, which cannot be "
                f"{self.model.quantization}-quantized (model.quantization={self.model.quantization!r}, which the "
                "critic shares); enable critic.lora or set model.quantization=none"
            )
        steps = self.train.steps
        if steps is not None and (problem := self.critic_warmup_problem(steps, f"train.steps={steps}")):
            raise ValueError(problem)
        return self

    def _curriculum_problem(self) -> str | None:
        c = self.data.curriculum
        if c is None or not c.redraws:
            return None
        if self.algorithm.dynamic_sampling:
            return ("data.curriculum.redraws and algorithm.dynamic_sampling both re-draw groups whose rewards are "
                    "all equal; keep one (set data.curriculum.redraws=0 or algorithm.dynamic_sampling=false)")
        if self.rollout.group_size < 2:
            return (f"data.curriculum.redraws re-draws groups whose rewards are all equal, which a group of "
                    f"rollout.group_size={self.rollout.group_size} always is; set rollout.group_size>=2")
        return None

    def critic_warmup_problem(self, steps: int, what: str) -> str | None:
        """Why ``critic.warmup_steps`` leaves no policy step out of ``steps`` (``what``: where
        they come from, for the message); None when it does not."""
        if self.critic.warmup_steps < steps:
            return None
        return f"critic.warmup_steps={self.critic.warmup_steps} leaves no policy step out of {what}; lower it"

    def resolve_steps(self, rows: int) -> int:
        """The run's optimiser steps once its ``rows`` usable training rows are known: ``train.steps``,
        or ``train.epochs`` passes of ``rollout.prompts_per_step`` prompts (sft/dpo/rm:
        ``train.batch_size`` rows) a step (:meth:`TrainConfig.resolve_epochs`).

        Raises:
            ConfigError: ``train.warmup_steps`` or ``critic.warmup_steps`` leave no room in those steps.
        """
        per_step = self.train.batch_size if self.algorithm.offline else self.rollout.prompts_per_step
        steps = self.train.resolve_epochs(rows, per_step)
        if self.train._warmup_note and self.train._warmup_note not in self._notes:
            self._notes.append(self.train._warmup_note)
        what = f"the {steps} steps of train.epochs={self.train.epochs}"
        if not self.algorithm.offline and self.algorithm.advantage == "gae" and \
                (problem := self.critic_warmup_problem(steps, what)):
            raise ConfigError(problem)
        return steps

    def _check_offline(self) -> "Config":
        a, d = self.algorithm, self.data
        if d.task is not None or (d.path is None) == (d.source is None):
            columns = "messages (or prompt + completion)" if a.name == "sft" else "chosen and rejected"
            raise ValueError(
                f"algorithm.name={a.name!r} trains on rows with {columns} from data.path or data.source; got "
                f"data.path={d.path!r}, data.source={d.source!r}, data.task={d.task!r}: set one of data.path and "
                "data.source (and not data.task)"
            )
        if d.curriculum is not None:
            raise ValueError(f"data.curriculum draws RL prompts by their pass rate; algorithm.name={a.name!r} has no "
                             "rewards to pass; remove data.curriculum")
        if self.rewards:
            raise ValueError(
                f"rewards: algorithm.name={a.name!r} learns from data rows, not reward functions; remove rewards"
            )
        if a.name == "rm" and a.kl_coef > 0:
            raise ValueError("algorithm.kl_coef: a reward model has no reference policy; set algorithm.kl_coef=0")
        if a.kl_reward_coef > 0:
            raise ValueError(f"algorithm.kl_reward_coef: algorithm.name={a.name!r} learns from data rows and has no "
                             "reward to put a KL into; set algorithm.kl_reward_coef=0")
        return self

    @property
    def norm_std(self) -> bool:
        """Whether group advantages divide by the group std (GRPO) or not (Dr. GRPO)."""
        return self.algorithm.norm_std
