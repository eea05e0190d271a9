"""Off-policy corrections between the policy that sampled the tokens (the engine's: another
kernel or precision, or older weights under ``rollout.async_steps``) and the learner's pi_old.

Every method starts from the per-token ratio of the loss tokens

    rho_t = pi_old(y_t) / pi_engine(y_t),   log rho_t clamped to [-20, 20] (LOG_RATIO_CLAMP)

and yields detached per-token weights for the policy loss (:func:`plainrl.algorithms.policy_loss`'s
``is_weights``). Since E_{y ~ pi_engine}[rho(y) f(y)] = E_{y ~ pi_old}[f(y)], weighting by rho
removes the mismatch; the methods differ in how they bound its variance:

- ``token_tis``: w_t = min(rho_t, C) (truncated IS; the bias falls on truncated tokens only).
- ``sequence_tis``: w = min(prod_t rho_t, C) at every token of the sequence (the unbiased
  sequence-level ratio, truncated).
- ``token_mis``: w_t = rho_t if low <= rho_t <= high, else 0 (masked IS: an outlier token is
  dropped rather than truncated, so it adds no biased gradient).
- ``sequence_mis``: w = prod_t rho_t if low <= prod_t rho_t <= high, else the sequence is dropped.
- ``icepop``: token MIS with IcePop's two-sided band, M(k) = k on [alpha, beta], else 0.
- ``geometric_mask``: a sequence whose geometric mean ratio exp(mean_t log rho_t) leaves
  [low, high] is dropped, every other token weighs 1 (length-independent, unlike the product);
  it combines with one of the weightings above.

A dropped token (``Correction.dropped``) is rejected: the learner removes it from the loss's
normaliser and from the KL and entropy terms as well, as verl's rejection sampling removes
rejected tokens from its response mask (docs/algo/rollout_corr.md), so a step that drops
half its tokens is the mean over the other half, not half of it.

The ratio is the *behaviour* ratio: under a top-k/top-p sampler pi_old is the learner's
policy after the same filter (:mod:`plainrl.algorithms.sampling_filter`), since the engine's
logprobs are of the filtered distribution it sampled from.

Each step also reports (:class:`Tally`, over the loss tokens, y ~ mu = pi_engine):
KL(mu || pi_old) = E_mu[-log rho] (the k1 estimator), chi^2(pi_old || mu) = E_mu[rho^2] - 1
and the normalised effective sample size of the applied weights, ESS = (sum w)^2 / (n sum w^2)
in (0, 1] (Kong 1992; verl's ``rollout_is_eff_sample_size``, ``rollout_corr/chi2_token``): KL
and chi^2 grow with staleness, precision mismatch or an unmatched filter, ESS says how much of
the batch the weights still use.

Sources: token TIS: Yao et al. 2025, "Your Efficient RL Framework Secretly Brings You Off-Policy
RL Training" (fengyao.notion.site/off-policy-rl); sequence TIS and token/sequence MIS: Liu, Li
et al. 2025, "When Speed Kills Stability: Demystifying RL Collapse from the Training-Inference
Mismatch" (richardli.xyz/rl-collapse, the MIS estimator rho * 1[rho <= C]) and verl's
docs/algo/rollout_corr.md (``token_is``, ``seq_is``, ``seq_mis``; the geometric rejection
level); the geometric sequence mask: SkyRL's off-policy correction (``sequence_mask_metric:
geometric``, its fully-async example's band [0.99, 1.01]); IcePop: Ling Team 2025, "Every Step
Evolves: Scaling Reinforcement Learning for Trillion-Scale Thinking Model" (arXiv:2510.18855),
IcePop's masked objective with M(k) = k for k in [alpha, beta] else 0, alpha = 0.5, beta = 5.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Literal, get_args

import torch

from plainrl.algorithms.advantages import _check_bt
from plainrl.algorithms.kl import LOG_RATIO_CLAMP
from plainrl.algorithms.losses import truncated_is_weights

ISMethod = Literal["token_tis", "sequence_tis", "token_mis", "sequence_mis", "icepop", "geometric_mask"]
WEIGHTINGS = ("token_tis", "sequence_tis", "token_mis", "sequence_mis", "icepop")  # at most one per run


@dataclass(frozen=True)
class Bounds:
    """The thresholds of every method (``algorithm.correction``, whose defaults are the only ones:
    :meth:`plainrl.config.correction.CorrectionConfig.bounds`).

    token_tis_cap: token TIS's C. sequence_tis_cap: sequence TIS's C.
    The others: the [low, high] band a ratio must stay in to be kept.
    """

    token_tis_cap: float
    sequence_tis_cap: float
    token_mis: tuple[float, float]
    sequence_mis: tuple[float, float]
    icepop: tuple[float, float]
    geometric_mask: tuple[float, float]


@dataclass
class Correction:
    """What one call of :func:`correct` returns, all [B, T] and detached.

    weights: float32 per-token weights, 0 off the mask and on dropped tokens.
    dropped: bool, loss tokens a mask rejected (the learner takes them out of the loss).
    truncated: bool, loss tokens whose weight a TIS cap lowered.
    ratio: float32 per-token rho_t, 0 off the mask (for ``is/ratio_mean``).
    mask: bool, the loss tokens.
    """

    weights: torch.Tensor
    dropped: torch.Tensor
    truncated: torch.Tensor
    ratio: torch.Tensor
    mask: torch.Tensor
    log_ratio: torch.Tensor | None = None  # [B, T] log rho_t clamped, 0 off the mask (for is/kl)

    @property
    def kept(self) -> torch.Tensor:
        """[B, T] bool: the loss tokens no mask rejected."""
        return self.mask & ~self.dropped


def _log_ratio(old_logps: torch.Tensor, engine_logps: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    diff = torch.where(m, old_logps.detach().float() - engine_logps.float(), torch.zeros_like(old_logps.float()))
    return diff.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)


def _in_band(x: torch.Tensor, band: tuple[float, float]) -> torch.Tensor:
    return (x >= band[0]) & (x <= band[1])


def sequence_ratio(log_ratio: torch.Tensor, m: torch.Tensor, *, geometric: bool) -> torch.Tensor:
    """Per-sequence ratio broadcast to [B, T]: the product prod_t rho_t over the row's loss
    tokens, or (``geometric``) their geometric mean exp(mean_t log rho_t); log space is
    clamped to [-20, 20] before ``exp``. A row without loss tokens gets 1.

    Args:
        log_ratio: [B, T] log rho_t, 0 off the mask.
        m: [B, T] bool loss mask.
    """
    total = torch.where(m, log_ratio, torch.zeros_like(log_ratio)).sum(dim=1, keepdim=True)  # [B, 1]
    if geometric:
        total = total / m.sum(dim=1, keepdim=True).clamp(min=1)
    return torch.exp(total.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)).expand_as(log_ratio)


def correct(old_logps: torch.Tensor, engine_logps: torch.Tensor, mask: torch.Tensor,
            methods: tuple[ISMethod, ...] | list[ISMethod], bounds: Bounds) -> Correction:
    """The off-policy correction of ``methods`` (module docstring) for one batch of rows.

    Args:
        old_logps: [B, T] log pi_old of the sampled tokens as the learner computes them (after the
            sampler's top-k/top-p filter when there is one; -inf outside it is clamped).
        engine_logps: [B, T] log pi_engine of the same tokens (the behaviour policy's).
        mask: [B, T] 1 on loss tokens.
        methods: at most one of :data:`WEIGHTINGS`, plus ``geometric_mask`` or not; empty: every
            loss token weighs 1.
        bounds: the thresholds.

    Returns:
        :class:`Correction`.

    Raises:
        ValueError: an unknown method, two weightings, shapes that differ, a cap <= 0 or a band
            with low > high.
    """
    if isinstance(methods, str):
        raise ValueError(f"methods must be a list of method names, got {methods!r} ('auto' is resolved by "
                         "plainrl.run.correction.resolve_correction)")
    unknown = [x for x in methods if x not in get_args(ISMethod)]
    if unknown:
        raise ValueError(f"unknown correction method(s) {unknown}; expected some of {list(get_args(ISMethod))}")
    weighting = [x for x in methods if x in WEIGHTINGS]
    if len(weighting) > 1:
        raise ValueError(f"a correction takes one weighting of {list(WEIGHTINGS)}, got {weighting}: each "
                         "corrects the same mismatch, so two would correct it twice")
    _check_bt(old_logps=old_logps, engine_logps=engine_logps, mask=mask)
    for name in ("token_mis", "sequence_mis", "icepop", "geometric_mask"):
        low, high = getattr(bounds, name)
        if not 0 <= low <= high:
            raise ValueError(f"correction.{name} must be [low, high] with 0 <= low <= high, got {[low, high]}")
    for name in ("token_tis_cap", "sequence_tis_cap"):
        if getattr(bounds, name) <= 0:
            raise ValueError(f"correction.{name} must be > 0, got {getattr(bounds, name)}")
    m = mask.bool()
    log_ratio = _log_ratio(old_logps, engine_logps, m)
    rho = torch.where(m, torch.exp(log_ratio), torch.zeros_like(log_ratio))
    weights = m.float()
    truncated = dropped = torch.zeros_like(m)
    kind = weighting[0] if weighting else None
    if kind == "token_tis":
        weights, _ = truncated_is_weights(old_logps, engine_logps, mask, bounds.token_tis_cap)
        truncated = m & (rho > bounds.token_tis_cap)
    elif kind == "sequence_tis":
        seq = sequence_ratio(log_ratio, m, geometric=False)
        weights = torch.where(m, seq.clamp(max=bounds.sequence_tis_cap), torch.zeros_like(seq))
        truncated = m & (seq > bounds.sequence_tis_cap)
    elif kind in ("token_mis", "icepop"):
        keep = _in_band(rho, getattr(bounds, kind))
        weights = torch.where(m & keep, rho, torch.zeros_like(rho))
        dropped = m & ~keep
    elif kind == "sequence_mis":
        seq = sequence_ratio(log_ratio, m, geometric=False)
        keep = _in_band(seq, bounds.sequence_mis)
        weights = torch.where(m & keep, seq, torch.zeros_like(seq))
        dropped = m & ~keep
    if "geometric_mask" in methods:
        out = m & ~_in_band(sequence_ratio(log_ratio, m, geometric=True), bounds.geometric_mask)
        weights = torch.where(out, torch.zeros_like(weights), weights)
        dropped = dropped | out
    return Correction(weights=weights, dropped=dropped, truncated=truncated & ~dropped, ratio=rho,
                      mask=m, log_ratio=log_ratio)


@dataclass
class Tally:
    """Loss-token sums of the corrections applied in one update, turned into the step's ``is/*``
    metrics (the module docstring gives the formulas):

    - ``is/ratio_mean``: mean rho_t;  ``is/kl``: KL(behaviour || learner), mean -log rho_t;
    - ``is/chi2``: mean rho_t^2 - 1;  ``is/ess``: (sum w_t)^2 / (n sum w_t^2) of the applied weights;
    - ``is/masked_fraction``: share of loss tokens a mask rejected;
    - ``is/truncated_fraction``: share whose weight a TIS cap lowered.
    """

    tokens: float = 0.0
    ratio: float = 0.0
    ratio_sq: float = 0.0
    neg_log_ratio: float = 0.0
    weight: float = 0.0
    weight_sq: float = 0.0
    dropped: float = 0.0
    truncated: float = 0.0

    def add(self, c: Correction) -> None:
        """Count one micro-batch's correction (its ratio, log-ratio and weights are 0 off the mask)."""
        w = c.weights.double()
        rho = c.ratio.double()
        self.tokens += float(c.mask.sum())
        self.ratio += float(rho.sum())
        self.ratio_sq += float((rho * rho).sum())
        if c.log_ratio is not None:
            self.neg_log_ratio -= float(torch.where(c.mask, c.log_ratio.double(), torch.zeros_like(rho)).sum())
        self.weight += float(w.sum())
        self.weight_sq += float((w * w).sum())
        self.dropped += float(c.dropped.sum())
        self.truncated += float(c.truncated.sum())

    def take(self, reduce: Callable[[list[float]], list[float]] | None = None) -> dict[str, float]:
        """The metrics since the last call (then reset); ``reduce``: sums a list of floats over
        ranks (:meth:`plainrl.train.distributed.Parallel.sum`), None in one process."""
        names = ("tokens", "ratio", "ratio_sq", "neg_log_ratio", "weight", "weight_sq", "dropped", "truncated")
        sums = [getattr(self, k) for k in names]
        t = dict(zip(names, reduce(sums) if reduce is not None else sums))
        for k in names:
            setattr(self, k, 0.0)
        n = t["tokens"]
        if not n:
            return {}
        return {"is/ratio_mean": t["ratio"] / n, "is/kl": t["neg_log_ratio"] / n, "is/chi2": t["ratio_sq"] / n - 1.0,
                "is/ess": t["weight"] ** 2 / (n * t["weight_sq"]) if t["weight_sq"] > 0 else 0.0,
                "is/masked_fraction": t["dropped"] / n, "is/truncated_fraction": t["truncated"] / n}
