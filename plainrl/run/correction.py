"""``algorithm.correction.methods: auto`` resolved for the run, with the reason the run's log
prints: the one place that decides which off-policy correction a run applies (the
corrections themselves: :mod:`plainrl.algorithms.is_correction`)."""

from __future__ import annotations

import torch

from plainrl.config.correction import CorrectionConfig


def resolve_correction(section: CorrectionConfig, *, engine: str, weights_dtype: torch.dtype, async_steps: int,
                       ratio_level: str) -> tuple[CorrectionConfig, str]:
    """``section`` with ``methods: auto`` resolved to a list, and why (for the run's log).

    ``auto`` corrects whenever the engine's logprobs can differ from the learner's: a vLLM or
    server engine (other kernels, its own copy of the weights), 16-bit weights (the embedded
    engine decodes in bf16 while the learner's logprobs are float32), or rollouts behind
    (``rollout.async_steps``). Only the embedded engine sampling with the learner's own
    float32 weights in step is on-policy to float tolerance, and there it stays off.

    - the weighting: ``token_tis`` (Yao et al. 2025; TRL's ``token_truncate`` mode: TRL's default
      for vLLM rollouts is ``sequence_mask``, cap 3.0, a mask on the sequence's ratio), or
      ``sequence_tis`` under ``ratio_level: sequence``: GSPO's objective is a sequence-level
      ratio, so its correction is the sequence's ratio too (Zheng et al. 2025, "Group Sequence
      Policy Optimization", and the sequence-level IS of Liu, Li et al. 2025);
    - ``geometric_mask`` added with ``async_steps > 0``: a stale batch's whole sequences can
      drift while each token's truncated ratio stays small; SkyRL's fully-async runs use the
      geometric mask, and Liu, Li et al. 2025 ("When Speed Kills Stability") show token-level
      truncation leaving a sequence-level bias that rejection removes.

    A top-k/top-p sampler needs nothing here: the learner takes the ratio after the same filter
    (:mod:`plainrl.algorithms.sampling_filter`).

    Args:
        section: ``algorithm.correction``.
        engine: ``rollout.engine``.
        weights_dtype: the policy's parameter dtype.
        async_steps: ``rollout.async_steps``.
        ratio_level: ``algorithm.ratio_level`` (``token`` or ``sequence``).
    Returns:
        ``(section with a list of methods, reason)``.
    """
    if section.methods != "auto":
        return section, "as configured" if section.methods else "off, as configured"
    why = [f"the {engine} engine samples with its own copy of the weights"] if engine != "hf" else []
    if weights_dtype != torch.float32:
        why.append(f"the policy's weights are {str(weights_dtype).removeprefix('torch.')}")
    if async_steps:
        why.append(f"rollouts are up to {async_steps} step(s) behind (rollout.async_steps)")
    if not why:
        return section.model_copy(update={"methods": []}), \
            "auto: off, the embedded engine samples with the learner's float32 weights in step"
    methods = ["sequence_tis" if ratio_level == "sequence" else "token_tis"]
    if async_steps:
        methods.append("geometric_mask")
    cap = section.sequence_tis_cap if ratio_level == "sequence" else section.token_tis_cap
    reason = f"auto: {methods[0]} capped at {cap}" + (" (algorithm.ratio_level: sequence)" if ratio_level == "sequence"
                                                       else "")
    if async_steps:
        reason += f" and geometric_mask {list(section.geometric_mask)}"
    return section.model_copy(update={"methods": methods}), reason + " since " + " and ".join(why)


REJECTION_WARN = 0.5  # a step that drops at least half its loss tokens trains on what is left: say so


def rejection_warning(metrics: dict[str, float]) -> str | None:
    """A line for the run's log when the correction rejected at least :data:`REJECTION_WARN` of a
    step's loss tokens (``is/masked_fraction``), naming the diagnostics that tell why; None otherwise."""
    masked = metrics.get("is/masked_fraction", 0.0)
    if masked < REJECTION_WARN:
        return None
    what = "nothing: the step was skipped" if masked >= 1.0 else f"the other {1 - masked:.0%}"
    return (f"the off-policy correction rejected {masked:.0%} of the loss tokens and trained on {what} "
            f"(is/kl {metrics.get('is/kl', 0.0):.3g}, is/chi2 {metrics.get('is/chi2', 0.0):.3g}); widen "
            "algorithm.correction's band, lower rollout.async_steps, or check that engine and learner run the "
            "same weights and sampler (docs/algorithms.md, \"Off-policy correction\")")


class MismatchWatch:
    """Says once per run when ``rollout/logprob_diff`` (the mean |engine - learner| logprob of a
    step's sampled tokens) has stayed above ``threshold`` nats for ``steps`` steps in a row: the
    rollouts then come from a policy the learner is not training, by more than the off-policy
    correction is meant to absorb (the bf16 demo runs where it stayed near 0.05-0.1 were the ones
    that failed to learn; docs/engines.md, "Engine/learner mismatch").

    Args:
        threshold: nats; the engine and learner of a float32 run agree to ~1e-5, bfloat16's
            rounding alone to ~0.02.
        steps: consecutive steps above it before the warning.
    """

    def __init__(self, threshold: float = 0.05, steps: int = 3):
        self.threshold, self.steps = threshold, steps
        self.recent: list[float] = []
        self.warned = False

    def observe(self, diff: float) -> str | None:
        """One step's ``rollout/logprob_diff``; the warning line the first time the condition holds,
        else None."""
        self.recent = self.recent + [diff] if diff > self.threshold else []
        if self.warned or len(self.recent) < self.steps:
            return None
        self.warned = True
        seen = ", ".join(f"{d:.3f}" for d in self.recent[-self.steps:])
        return (f"rollout/logprob_diff has stayed above {self.threshold} nats for {self.steps} steps ({seen}): the "
                "engine samples a policy the learner is not training. Likely causes: precision (16-bit weights, or "
                "LoRA merged into them by rollout.sync=full), the engine (other kernels or sampler "
                "settings than the learner's), or weight sync (the engine runs older or other weights; "
                "rollout.async_steps adds its staleness to this figure). "
                "See docs/engines.md, \"Engine/learner mismatch\"; this is said once per run")
