"""Typed containers passed between the stages of one RL step.

Shapes are given in brackets: N = number of episodes in a step
(prompts_per_step x group_size), B = sequences in a micro-batch,
T = padded sequence length (prompt + completion).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

import torch

FinishReason = Literal["eos", "stop", "length"]


@dataclass(frozen=True)
class SamplingParams:
    """How the engine samples one completion.

    ``top_k = 0`` and ``top_p = 1.0`` disable those filters; ``temperature = 0``
    means greedy decoding. ``stop`` strings end a completion; the tokens that
    produced the stop string are kept (token-exact bookkeeping). ``stop_token_ids``
    None ends a completion at the model's EOS ids; a tuple ends it at those ids only
    (the EOS then does not stop it; ``()``: nothing but ``max_new_tokens`` does), the id kept.
    ``structured_outputs``: vLLM's structured outputs (``{"json": SCHEMA}`` or
    ``{"json_object": true}``) as JSON text, the completion constrained to match (None: free);
    only engines whose ``structured_outputs`` attribute is True (vLLM's) take it.
    """

    max_new_tokens: int = 64
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] | None = None
    structured_outputs: str | None = None


@dataclass
class Generation:
    """One sampled completion exactly as the engine produced it.

    token_ids: [L] sampled ids (no padding; includes the EOS id when it ended on EOS).
    logprobs:  [L] log mu(token | prefix), float32, of the distribution sampled from: the
               tempered policy softmax(logits / T) after the top-k/top-p filter, renormalised
               (T = 1 and no filter when greedy), as vLLM's processed logprobs; the learner
               filters its own logits alike for the off-policy ratio
               (:mod:`plainrl.algorithms.sampling_filter`).
    versions:  [L] the policy version that sampled each token (``rollout.partial``: a
               completion may span weight pushes); None: one version throughout.
    """

    token_ids: list[int]
    logprobs: list[float]
    finish_reason: FinishReason
    versions: list[int] | None = None


@dataclass
class EnvOutcome:
    """What an episode's environment, or its agent (``rollout.agent``), reported (multi-turn rollouts only).

    reward: the sum of the steps' rewards; None when no step gave one.
    error:  ``"Type: message (at file:line)"`` when the environment or agent failed (the episode
            is then unscorable), else None.
    info:   the steps' info merged (numbers summed), plus ``turns``, ``generate_calls``,
            ``model_tokens``, ``observation_tokens`` and ``end_reason``.
    """

    reward: float | None = None
    error: str | None = None
    info: dict[str, Any] = field(default_factory=dict)


@dataclass
class Episode:
    """One rollout: a prompt, the completion sampled for it, and its scores.

    prompt_ids:     [P] token ids fed to the engine.
    completion_ids: [L] token ids the engine sampled (never re-tokenised).
    logprobs:       [L] engine logprobs of ``completion_ids``.
    loss_mask:      [L] 1 for tokens the policy produced, 0 for tokens inserted by an
                    environment (tool output); the loss only sees mask-1 tokens.
    group:          index of the prompt group inside the step (episodes of one
                    group are contiguous).
    reward:         weighted total, or None when any weighted reward function
                    could not score it (unscorable: excluded from group stats).
    env:            the environment's outcome (multi-turn), None for single-turn episodes.
    messages:       the multi-turn episode as chat messages (None for single-turn episodes).
    earlier:        ``rollout.agent``: the episode's earlier segments (runs of model calls whose
                    context a later call did not extend), each an Episode of its own prompt and
                    completion, in call order; the episode's own ids are its last segment. Every
                    segment is trained as a sample (:func:`plainrl.samples.training_samples`).
    segment_rewards: one reward per segment (``len(earlier) + 1``), when the agent returned
                    them; None: every segment takes the episode's ``reward``.
    segment, segments: a training sample's segment index in its episode, and the episode's
                    number of segments (0 and 1 for an episode of one segment).
    teacher_logprob: on-policy distillation: the completion's summed teacher logprob over its
                    loss tokens (None without a teacher).
    policy_version: the learner version (updates applied) whose weights sampled it, set by
                    :mod:`plainrl.run.async_rollout`; None before.
    token_versions: [L] with ``rollout.partial``, the version that sampled each completion
                    token (-1 on inserted tokens); None: ``policy_version`` throughout.
    """

    sample_id: str
    group: int
    row: dict[str, Any]
    prompt_ids: list[int]
    completion_ids: list[int]
    logprobs: list[float]
    loss_mask: list[int]
    finish_reason: FinishReason
    completion_text: str = ""
    reward: float | None = None
    reward_parts: dict[str, float | None] = field(default_factory=dict)
    advantage: float = 0.0
    env: EnvOutcome | None = None
    # multi-turn: the episode as chat messages (prompt, assistant turns, tool/environment turns),
    # what rewards naming a ``messages`` parameter receive; None for single-turn episodes
    messages: list[dict[str, Any]] | None = None
    earlier: tuple[Episode, ...] = ()
    segment_rewards: list[float] | None = None
    segment: int = 0
    segments: int = 1
    teacher_logprob: float | None = None
    policy_version: int | None = None
    token_versions: list[int] | None = None

    def columns(self) -> dict[str, Any]:
        """The columns reward functions receive as keyword arguments: the data row, plus
        ``env_reward``, ``env_error`` and ``env_info`` when an environment ran."""
        if self.env is None:
            return self.row
        return {**self.row, "env_reward": self.env.reward, "env_error": self.env.error, "env_info": self.env.info}


@dataclass(frozen=True)
class SampleError:
    """Why a sample could not be scored (or a part of it).

    sample_id: the episode's ``sample_id``.
    source:    what failed: ``"reward 'name'"`` or ``"environment"``.
    message:   the problem, e.g. ``"ValueError: bad (at my_reward.py:3)"``, ``"timed out after 5s"``.
    """

    sample_id: str
    source: str
    message: str

    def __str__(self) -> str:
        return f"{self.source} on sample {self.sample_id!r}: {self.message}"


@dataclass
class RewardOutput:
    """Scores for N completions.

    total: [N] weighted sum of the parts, None when a part with non-zero weight is None.
    parts: {function name: [N]} each function's raw value (None = unscorable).
    errors: one record per unscorable (function, sample) pair, and per episode
            whose environment failed.
    """

    total: list[float | None]
    parts: dict[str, list[float | None]]
    errors: list[SampleError] = field(default_factory=list)


@dataclass
class MicroBatch:
    """Padded tensors for one learner forward/backward.

    Target index t predicts token t+1, so per-token tensors are [B, T-1]; completion
    token k of a row with a P-token prompt sits at target P-1+k.

    input_ids:      [B, T] prompt + completion, right-padded with pad id.
    attention_mask: [B, T] 1 on real tokens.
    loss_mask:      [B, T-1] 1 where target token t+1 is a policy token to train on.
    old_logps:      [B, T-1] logprobs of targets under the sampling policy (the engine's,
                    or the learner's own recomputed ones before several passes).
    advantages:     [B] one advantage per sequence (broadcast over its tokens), or
                    [B, T-1] per token (REINFORCE++, GAE).
    index:          [B] each row's position in the step's episode list.
    completion_pos: [B, T-1] the completion position k of each target, -1 elsewhere
                    (maps results back to the [N, L] completion frame).
    old_values:     [B, T-1] critic values at rollout time (GAE).
    returns:        [B, T-1] the critic's targets (GAE's lambda-returns).
    prompt_lens:    [B] prompt tokens of each row (rows with equal prompts share their
                    computation in :func:`plainrl.models.sequence_logps`).
    engine_logps:   [B, T-1] the engine's logprobs of the targets, whatever ``old_logps``
                    holds (the off-policy correction, ``algorithm.correction``).
    teacher_ids:    [B, T-1, k] a distillation teacher's top-k token ids at each target
                    (``algorithm.distill_loss: gkd_topk``), 0 off the completion.
    teacher_logps:  [B, T-1, k] the teacher's logprobs of those tokens.
    behaviour_logps: [B, T-1] the recomputed ``old_logps`` after the sampler's top-k/top-p
                    filter (several passes with a filtering sampler; the correction's pi_old).
    """

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    loss_mask: torch.Tensor
    old_logps: torch.Tensor
    advantages: torch.Tensor
    index: torch.Tensor | None = None
    completion_pos: torch.Tensor | None = None
    old_values: torch.Tensor | None = None
    returns: torch.Tensor | None = None
    prompt_lens: torch.Tensor | None = None
    engine_logps: torch.Tensor | None = None
    teacher_ids: torch.Tensor | None = None
    teacher_logps: torch.Tensor | None = None
    behaviour_logps: torch.Tensor | None = None
