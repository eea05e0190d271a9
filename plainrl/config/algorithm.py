"""The ``algorithm`` section: the algorithm's name, its presets and every knob of the pure
functions in :mod:`plainrl.algorithms` (formulas and papers: docs/algorithms.md)."""

from __future__ import annotations

import warnings
from typing import Any, Literal

from pydantic import Field, PrivateAttr, field_validator, model_validator

from plainrl.config.base import _Section
from plainrl.config.correction import CorrectionConfig, migrate_deprecated
from plainrl.config.rollout import ServersConfig

AlgorithmName = Literal["grpo", "dr_grpo", "dapo", "rloo", "reinforce_pp", "gspo", "ppo", "opd", "sft", "dpo", "rm"]
AdvantageEstimator = Literal["grpo", "rloo", "reinforce_pp", "gae"]
KLPlacement = Literal["loss", "reward"]
DistillLoss = Literal["reverse_kl", "gkd_topk"]

# Trained on rows from data.path by plainrl.run.offline, not by the RL loop.
OFFLINE_ALGORITHMS = ("sft", "dpo", "rm")

# algorithm.name -> defaults of the other algorithm.* knobs. A preset only fills in
# keys the user did not set, so an explicit value always wins; the resolved values
# are what config.yaml records. Sources and reasoning: docs/algorithms.md, "Presets".
PRESETS: dict[str, dict[str, Any]] = {
    "grpo": {"advantage": "grpo", "norm_std": True, "loss_agg": "token-mean"},
    "dr_grpo": {"advantage": "grpo", "norm_std": False, "loss_agg": "seq-mean-token-sum-norm"},
    "dapo": {
        "advantage": "grpo", "norm_std": True, "loss_agg": "token-mean", "clip_low": 0.2, "clip_high": 0.28,
        "kl_coef": 0.0, "dynamic_sampling": True, "overlong_buffer": 0.2, "overlong_filter": True,
    },
    "rloo": {"advantage": "rloo", "loss_agg": "seq-mean-token-sum-norm"},
    "reinforce_pp": {
        "advantage": "reinforce_pp", "loss_agg": "token-mean", "kl_coef": 0.01, "kl_estimator": "k1",
        "kl_placement": "reward", "gamma": 1.0,
    },
    "gspo": {
        "advantage": "grpo", "norm_std": True, "ratio_level": "sequence", "loss_agg": "seq-mean-token-mean",
        "clip_low": 3e-4, "clip_high": 4e-4, "mini_batches": 4,
    },
    "ppo": {
        "advantage": "gae", "gamma": 1.0, "lam": 0.95, "value_clip": 0.2, "loss_agg": "token-mean",
        "kl_coef": 0.01, "kl_estimator": "k1", "kl_placement": "reward", "ppo_epochs": 2,
        "whiten_advantages": True,
    },
    # on-policy distillation (Agarwal et al. 2024; Thinking Machines 2025): the teacher's per-token
    # reverse KL is the whole signal; a task reward only when reward_coef is raised
    "opd": {"advantage": "grpo", "loss_agg": "token-mean", "distill_coef": 1.0, "reward_coef": 0.0},
    "sft": {"loss_agg": "token-mean"},
    "dpo": {"beta": 0.1},
    "rm": {},
}


class TeacherServersConfig(ServersConfig):
    """``algorithm.teacher.remote``: inference servers serving the teacher, which score the student's
    tokens by their prompt logprobs (token ids in; docs/algorithms.md, "A remote teacher")."""

    backend: Literal["vllm", "sglang"] = "vllm"
    """`vllm`: any vLLM server (`plainrl serve` or `vllm serve`; `/v1/completions` with `prompt_logprobs`); `sglang`:
    SGLang servers (`/generate` with `input_ids` and `return_logprob`)."""

    @model_validator(mode="after")
    def _backend_settings(self) -> "TeacherServersConfig":
        if not self.urls:
            raise ValueError("algorithm.teacher.remote.urls is empty; give the teacher servers' base URLs, e.g. "
                             "[http://127.0.0.1:8001]")
        self._sglang_names_no_model("algorithm.teacher.remote")
        return self


class TeacherConfig(_Section):
    """The teacher of on-policy distillation: a model loaded as ``model.name`` is (in the policy's
    dtype), or inference servers that serve it (``remote``)."""

    name: str | None = None
    """The teacher model: `smollm2-135m-instruct` (the embedded model), a local transformers directory, a `.gguf`
    file or a hub id; its tokenizer must be the policy's. Null with `remote`."""
    adapter: str | None = None
    """A peft LoRA adapter on `name` (e.g. a plainrl run's `final/`); with a LoRA policy on the same base the teacher
    shares the policy's frozen base weights (one copy in memory)."""
    remote: TeacherServersConfig | None = None
    """Servers that serve the teacher (`backend`, `urls`, `model`, `api_key_env`, timeouts as in `rollout.remote`);
    their tokenizer must be the policy's, and they score at temperature 1."""
    template: str | None = None
    """The chat template the teacher's prompt is rendered with: `teacher` (the one of `name`'s tokenizer, e.g. an
    instruct teacher of a base student), or a Jinja chat template's text; null: the policy's. The completion the
    teacher scores is the student's token ids, unchanged."""
    system: str | None = None
    """The teacher's system prompt, in place of `data.system_prompt` (`""`: none); null: `data.system_prompt`. A
    `messages` row that starts with a system message keeps its own."""

    @model_validator(mode="after")
    def _one_teacher(self) -> "TeacherConfig":
        if (self.name is None) == (self.remote is None):
            raise ValueError("algorithm.teacher: give name (a model loaded in this process) or remote (servers that "
                             "serve the teacher: {urls: [...]}), exactly one of them")
        if self.template == "teacher" and self.name is None:
            raise ValueError("algorithm.teacher.template=teacher takes the chat template of algorithm.teacher.name's "
                             "tokenizer, and a remote teacher has no name here; give the template's Jinja text")
        if self.remote is not None and self.adapter is not None:
            raise ValueError("algorithm.teacher.adapter applies to a teacher loaded here; a remote teacher's adapter "
                             "is the servers' (serve it, e.g. vLLM's --lora-modules NAME=DIR, and name it with "
                             "algorithm.teacher.remote.model)")
        return self


class AlgorithmConfig(_Section):
    """Which algorithm, as configuration of the pure functions in plainrl.algorithms
    (formulas, knobs and papers: docs/algorithms.md).

    ``name`` is a preset: it sets defaults of the other knobs (:data:`PRESETS`) for
    the keys not given explicitly; every knob can still be set on its own.
    """

    name: AlgorithmName = "grpo"
    """The preset: sets defaults of the other `algorithm.*` knobs that are not given (`grpo`, `dr_grpo`, `dapo`,
    `rloo`, `reinforce_pp`, `gspo`, `ppo`; `opd`: on-policy distillation from `algorithm.teacher`; `sft`, `dpo`,
    `rm` train on rows instead)."""
    # advantages
    advantage: AdvantageEstimator = "grpo"
    """Advantage estimator: `grpo` (group mean/std), `rloo` (leave-one-out), `reinforce_pp` (batch-normalised
    returns) or `gae` (learned critic)."""
    norm_std: bool = True
    """`grpo` advantages: divide by the group's std (false: Dr. GRPO)."""
    gamma: float = Field(1.0, ge=0.0, le=1.0)
    """Discount per token (`reinforce_pp`, `gae`)."""
    lam: float = Field(1.0, ge=0.0, le=1.0)
    """GAE's lambda."""
    whiten_advantages: bool = False
    """Normalise advantages over the batch's loss tokens (PPO)."""
    # policy loss
    clip_low: float = Field(0.2, ge=0.0, le=1.0)
    """Lower clip range of the importance ratio (1 - clip_low)."""
    clip_high: float = Field(0.2, ge=0.0)
    """Upper clip range of the importance ratio (1 + clip_high; DAPO's clip-higher: 0.28)."""
    dual_clip: float | None = Field(None, gt=1.0)
    """Dual-clip bound on the ratio for negative advantages (null: off)."""
    correction: CorrectionConfig = Field(default_factory=CorrectionConfig)
    """Off-policy correction of the policy loss for tokens the engine sampled with other numerics, older weights or
    a top-k/top-p filter: `methods` (`auto`: by engine, dtype, `rollout.async_steps` and `ratio_level`) and their
    thresholds; docs/algorithms.md, "Off-policy correction"."""

    ratio_level: Literal["token", "sequence"] = "token"
    """`token` ratios, or `sequence` (GSPO's length-normalised sequence ratio)."""
    loss_agg: Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"] = "token-mean"
    """How token losses are averaged: `token-mean`, `seq-mean-token-mean` or `seq-mean-token-sum-norm` (a constant
    normaliser, Dr. GRPO)."""
    entropy_coef: float = Field(0.0, ge=0.0)
    """Weight of an entropy bonus in the loss."""
    kl_coef: float = Field(0.0, ge=0.0)
    """Weight of the KL to the reference policy (the policy the run starts from)."""
    kl_estimator: Literal["k1", "k2", "k3"] = "k3"
    """KL estimator: `k1`, `k2` or `k3`."""
    kl_placement: KLPlacement = "loss"
    """`loss`: a penalty term in the loss; `reward`: folded into the per-token reward."""
    kl_reward_coef: float = Field(0.0, ge=0.0)
    """A KL penalty in the reward beside the one in the loss (PPO-RLHF's per-token penalty), logged as `kl_reward`."""
    kl_reward_estimator: Literal["k1", "k2", "k3"] = "k1"
    """Estimator of `kl_reward_coef`'s KL."""
    ppo_epochs: int = Field(1, gt=0)
    """Passes over one rollout batch; more than one pass in all recomputes old logprobs first."""
    mini_batches: int = Field(1, gt=0)
    """Optimiser steps per pass."""
    value_clip: float | None = Field(0.2, gt=0.0)
    """`gae`: clip range of the critic's value update (null: off)."""
    # DAPO
    dynamic_sampling: bool = False
    """DAPO: drop groups whose rewards are all equal and sample more prompts."""
    dynamic_sampling_tries: int = Field(4, gt=0)
    """Rollout batches per step at most under dynamic sampling."""
    overlong_buffer: float | None = Field(None, gt=0.0, le=1.0)
    """DAPO's soft overlong punishment: the last fraction of the completion budget over which a length penalty grows
    (null: off)."""
    overlong_penalty: float = Field(1.0, ge=0.0)
    """The largest overlong length penalty."""
    overlong_filter: bool = False
    """Truncated completions get loss mask 0."""
    # distillation (docs/algorithms.md, "On-policy distillation")
    teacher: TeacherConfig | Literal["self"] | None = None
    """The teacher that scores every sampled completion token: `{name: ..., adapter: ...}` (`name` as `model.name`
    takes it: the embedded model, a local directory, a `.gguf` file or a hub id; `adapter`: a peft adapter on it),
    `{remote: {urls: [...]}}` (servers that serve it: `plainrl serve`, vLLM, SGLang), or `self`: the policy as the run
    starts (as the KL reference is); null: no teacher."""
    teacher_context: str | None = None
    """Self-distillation: a template over the row's columns (e.g. `"Reference solution: {solution}"`) appended to the
    teacher's prompt only; the student never sees it. Null: the teacher sees the student's prompt."""
    distill_coef: float = Field(0.0, ge=0.0)
    """Weight of the teacher's signal (`reverse_kl`: the per-token advantage log pi_teacher - log pi_old; `gkd_topk`:
    the divergence term in the loss); `opd` sets 1."""
    reward_coef: float = Field(1.0, ge=0.0)
    """Weight of the task reward's advantage beside the teacher's signal; `opd` sets 0, and then the run needs no
    `rewards:`."""
    distill_loss: DistillLoss = "reverse_kl"
    """`reverse_kl`: the teacher's logprob of each sampled token as a per-token advantage through the policy loss;
    `gkd_topk`: GKD's generalised JSD over the teacher's top `distill_topk` tokens (plus the rest) as a loss term."""
    distill_topk: int = Field(20, gt=0, le=1024)
    """`gkd_topk`: the teacher's tokens per position the divergence is computed over."""
    distill_beta: float = Field(0.0, ge=0.0, le=1.0)
    """`gkd_topk`: the generalised JSD's beta (0: the forward KL from teacher to student, 1: the reverse KL; between:
    (1 - beta) KL(T, M) + beta KL(S, M) with M = beta T + (1 - beta) S, continuous from one to the other)."""
    # DPO
    beta: float = Field(0.1, gt=0.0)
    """DPO's beta."""

    @model_validator(mode="before")
    @classmethod
    def _apply_preset(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        data = dict(data)
        if data.get("norm_std", True) is None:  # configs saved before presets: null meant "the preset's"
            del data["norm_std"]
        preset = PRESETS.get(data.get("name", "grpo"), {})  # an unknown name is reported by the Literal check
        return {**preset, **data}

    _deprecations: list[str] = PrivateAttr(default_factory=list)  # deprecated keys read; printed with the config

    @model_validator(mode="wrap")
    @classmethod
    def _deprecated_keys(cls, data: Any, handler: Any) -> "AlgorithmConfig":
        messages: list[str] = []
        if isinstance(data, dict):
            data, messages = migrate_deprecated(data)
        for message in messages:  # FutureWarning: shown to users (DeprecationWarning is hidden outside __main__)
            warnings.warn(message, FutureWarning, stacklevel=2)
        out = handler(data)
        if messages:
            out._deprecations = messages
        return out

    @model_validator(mode="after")
    def _one_reward_kl(self) -> "AlgorithmConfig":
        if self.kl_reward_coef > 0 and self.kl_placement == "reward" and self.kl_coef > 0:
            raise ValueError(
                f"algorithm.kl_reward_coef={self.kl_reward_coef} puts a KL into the reward, and algorithm.kl_placement="
                f"reward puts algorithm.kl_coef={self.kl_coef} there too (the preset {self.name!r} may set it); set "
                "algorithm.kl_placement=loss to have kl_coef in the loss beside kl_reward_coef in the reward, or "
                "algorithm.kl_reward_coef=0"
            )
        return self

    @model_validator(mode="after")
    def _teacher_when_distilling(self) -> "AlgorithmConfig":
        if self.distill_coef > 0 and self.teacher is None:
            raise ValueError(
                f"algorithm.distill_coef={self.distill_coef} (the preset {self.name!r} may set it) needs a teacher; set "
                "algorithm.teacher: {name: <model>} (a hub id, local directory or .gguf; adapter: optional) or "
                "algorithm.teacher: self"
            )
        if self.teacher is not None and self.distill_coef == 0:
            raise ValueError(f"algorithm.teacher is set but algorithm.distill_coef=0 gives it no weight; set "
                             f"algorithm.distill_coef > 0 (algorithm.name: opd sets 1) or remove the teacher")
        if self.teacher_context is not None and self.teacher is None:
            raise ValueError("algorithm.teacher_context extends the teacher's prompt, but no algorithm.teacher is "
                             "set; add algorithm.teacher: self for self-distillation")
        if self.distill_coef == 0 and self.reward_coef == 0:
            raise ValueError("algorithm.reward_coef=0 and algorithm.distill_coef=0 leave nothing to learn from; "
                             "raise one of them")
        return self

    @property
    def distilling(self) -> bool:
        """A teacher scores the sampled tokens (``distill_coef > 0``)."""
        return self.distill_coef > 0

    @property
    def reward_kl(self) -> tuple[float, str]:
        """``(coefficient, estimator)`` of the KL subtracted from the reward: ``kl_reward_*``, or
        ``kl_coef``/``kl_estimator`` under ``kl_placement: reward``; coefficient 0 when none."""
        if self.kl_reward_coef > 0:
            return self.kl_reward_coef, self.kl_reward_estimator
        return (self.kl_coef, self.kl_estimator) if self.kl_placement == "reward" else (0.0, self.kl_estimator)

    @property
    def loss_kl_coef(self) -> float:
        """The weight of the KL term of the loss (``kl_coef`` under ``kl_placement: loss``, else 0)."""
        return self.kl_coef if self.kl_placement == "loss" else 0.0

    @property
    def uses_reference(self) -> bool:
        """A KL to the reference policy is computed (in the loss, the reward, or both)."""
        return self.kl_coef > 0 or self.kl_reward_coef > 0

    @property
    def needs_reference(self) -> bool:
        """The policy as the run starts is computed: a KL to it, or it is the teacher (``teacher: self``)."""
        return self.uses_reference or self.teacher == "self"

    @property
    def offline(self) -> bool:
        """Trained on data rows (sft, dpo, rm) rather than by RL."""
        return self.name in OFFLINE_ALGORITHMS

    @property
    def multi_pass(self) -> bool:
        """More than one optimiser step per rollout batch (old logprobs must be recomputed)."""
        return self.ppo_epochs > 1 or self.mini_batches > 1
