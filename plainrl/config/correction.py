"""``algorithm.correction``: the off-policy correction of the policy loss between the engine's
policy (the behaviour policy) and the learner's: which methods, and every threshold
(the math and sources: :mod:`plainrl.algorithms.is_correction`; ``auto`` resolved by
:mod:`plainrl.run.correction`). The keys it replaced (``algorithm.tis_cap``,
``algorithm.is_correction``, ``algorithm.is_bounds``) are read for one release with a
deprecation message (:func:`migrate_deprecated`)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from plainrl.config.base import _Section

ISMethod = Literal["token_tis", "sequence_tis", "token_mis", "sequence_mis", "icepop", "geometric_mask"]
IS_WEIGHTINGS = ("token_tis", "sequence_tis", "token_mis", "sequence_mis", "icepop")
DEPRECATED_KEYS = ("tis_cap", "is_correction", "is_bounds")


class CorrectionConfig(_Section):
    """The off-policy correction: each loss token of a sequence the engine sampled is weighted (or dropped) by the
    behaviour ratio rho = pi_learner / pi_engine (both after the sampler's top-k/top-p filter), and the step logs
    `is/*` (docs/algorithms.md, "Off-policy correction")."""

    methods: list[ISMethod] | Literal["auto"] = "auto"
    """A list of at most one weighting, `token_tis` (min(rho, token_tis_cap) per token), `sequence_tis`, `token_mis`,
    `sequence_mis` (masked IS: rho kept, tokens/sequences outside the band dropped) or `icepop`, plus
    `geometric_mask` (drops sequences whose geometric mean ratio leaves its band) or not; [] off. `auto`: off when
    the embedded engine samples with the learner's own float32 weights in step; otherwise `token_tis`
    (`sequence_tis` under `algorithm.ratio_level: sequence`), plus `geometric_mask` when `rollout.async_steps > 0`
    (`plainrl.run.correction`; the run's log says which). With 16-bit weights the embedded engine's logprobs still
    differ from the learner's by kernel rounding (0.013-0.022 nats at step 0 on a CPU with native bfloat16; none on
    AVX2), which this corrects (docs/engines.md, "Engine/learner mismatch"). Dropped tokens leave the
    loss's normaliser and its KL and entropy terms."""
    token_tis_cap: float = Field(2.0, gt=0.0)
    """`token_tis`: the cap C of each token's ratio (Yao et al. 2025's 2). TRL's `vllm_importance_sampling_cap` is
    3.0, applied by default to the sequence's ratio (`vllm_importance_sampling_mode: sequence_mask`); its
    `token_truncate` mode is this one."""
    sequence_tis_cap: float = Field(2.0, gt=0.0)
    """`sequence_tis`: the cap C of the sequence's ratio prod_t rho_t (verl's `seq_is` default)."""
    token_mis: tuple[float, float] = (0.0, 2.0)
    """`token_mis`: [low, high]; a token whose ratio leaves it is dropped (the MIS estimator rho * 1[rho <= 2])."""
    sequence_mis: tuple[float, float] = (0.0, 2.0)
    """`sequence_mis`: [low, high] of the sequence's ratio prod_t rho_t; outside, the whole sequence is dropped
    (verl's `seq_mis`)."""
    icepop: tuple[float, float] = (0.5, 5.0)
    """`icepop`: [alpha, beta]; a token whose ratio leaves it is dropped (IcePop's 0.5 and 5)."""
    geometric_mask: tuple[float, float] = (0.99, 1.01)
    """`geometric_mask`: [low, high] of the sequence's geometric mean ratio exp(mean_t log rho_t); outside, the
    sequence is dropped (SkyRL's fully-async example)."""

    @field_validator("methods")
    @classmethod
    def _one_weighting(cls, methods):
        if methods != "auto" and sum(m in IS_WEIGHTINGS for m in methods) > 1:
            raise ValueError(f"algorithm.correction.methods takes one weighting of {list(IS_WEIGHTINGS)} (plus "
                             f"geometric_mask), got {methods}: each corrects the same mismatch, so two would correct "
                             "it twice")
        return methods

    @model_validator(mode="after")
    def _ordered(self):
        for name in ("token_mis", "sequence_mis", "icepop", "geometric_mask"):
            low, high = getattr(self, name)
            if not 0.0 <= low <= high:
                raise ValueError(f"algorithm.correction.{name} must be [low, high] with 0 <= low <= high, "
                                 f"got {[low, high]}")
        return self

    def bounds(self) -> dict[str, Any]:
        """The thresholds as :class:`plainrl.algorithms.is_correction.Bounds` takes them."""
        return self.model_dump(exclude={"methods"})


def migrate_deprecated(data: dict[str, Any]) -> tuple[dict[str, Any], list[str]]:
    """The ``algorithm`` mapping with the keys ``algorithm.correction`` replaced moved into it,
    and one deprecation message per key found (the keys are read for one release).

    ``tis_cap: C`` -> ``correction.token_tis_cap: C`` and, with ``methods`` still ``auto``,
    ``methods: [token_tis]`` (a cap always meant token TIS on); ``tis_cap: null`` -> ``methods:
    []`` unless methods are given; ``tis_cap: auto`` -> nothing (the default);
    ``is_correction: X`` -> ``methods: X``; ``is_bounds.K`` -> ``correction.K``
    (``sequence_tis_cap`` and the bands keep their names).

    Raises:
        ValueError: a deprecated key given beside ``algorithm.correction`` setting the same thing.
    """
    found = [k for k in DEPRECATED_KEYS if k in data]
    if not found:
        return data, []
    data = dict(data)
    section = dict(data.get("correction") or {})
    messages = []
    if "is_bounds" in data:
        bounds = data.pop("is_bounds") or {}
        if not isinstance(bounds, dict):
            raise ValueError(f"algorithm.is_bounds must be a mapping, got {bounds!r} (it is deprecated: write the "
                             "thresholds under algorithm.correction)")
        if clash := sorted(set(bounds) & set(section)):
            raise ValueError(f"algorithm.is_bounds.{clash[0]} and algorithm.correction.{clash[0]} are both set; "
                             f"keep algorithm.correction.{clash[0]} (algorithm.is_bounds is deprecated)")
        section.update(bounds)
        messages.append("algorithm.is_bounds is deprecated and will be removed in the next release: its keys are now "
                        "under algorithm.correction (e.g. algorithm.correction.geometric_mask)")
    if "is_correction" in data:
        methods = data.pop("is_correction")
        if "methods" in section:
            raise ValueError("algorithm.is_correction and algorithm.correction.methods are both set; keep "
                             "algorithm.correction.methods (algorithm.is_correction is deprecated)")
        section["methods"] = methods
        messages.append(f"algorithm.is_correction is deprecated and will be removed in the next release: write "
                        f"algorithm.correction.methods: {methods}")
    if "tis_cap" in data:
        cap = data.pop("tis_cap")
        if cap is None:
            section.setdefault("methods", [])
            now = "algorithm.correction.methods: [] turns the correction off"
        elif cap != "auto":
            if "token_tis_cap" in section:
                raise ValueError("algorithm.tis_cap and algorithm.correction.token_tis_cap are both set; keep "
                                 "algorithm.correction.token_tis_cap (algorithm.tis_cap is deprecated)")
            section["token_tis_cap"] = cap
            if section.get("methods", "auto") == "auto":
                section["methods"] = ["token_tis"]
            now = f"algorithm.correction.token_tis_cap: {cap} (with methods: [token_tis] to keep it always on)"
        else:
            now = "algorithm.correction.methods: auto is the default"
        messages.append(f"algorithm.tis_cap is deprecated and will be removed in the next release: {now}")
    data["correction"] = section
    return data, messages
