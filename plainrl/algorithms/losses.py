"""Policy and value losses, loss aggregation over tokens, and entropy.

Shapes: B = sequences in the call (a micro-batch), T = padded length. ``mask`` is
1 (or True) on loss tokens; any nonzero value counts. Values at mask-0 positions
never reach a result or a gradient, even when they are NaN or inf.

Gradient accumulation: an optimiser batch split into micro-batches gives the same
gradient as one call on the whole batch when every micro-batch call passes the
whole batch's ``num_tokens`` (token-mean) or ``num_seqs`` (seq-mean-*) and one
fixed ``normalizer`` (seq-mean-token-sum-norm), and the micro-batch losses are summed
(not averaged). See :func:`aggregate_loss`.
"""

from __future__ import annotations

from typing import Callable, Literal, get_args

import torch

from plainrl.algorithms.advantages import _check_bt
from plainrl.algorithms.kl import LOG_RATIO_CLAMP, kl_estimate

LossAgg = Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"]
RatioLevel = Literal["token", "sequence"]

Count = int | float | torch.Tensor


def _divisor(count: Count | None, default: torch.Tensor | int, name: str) -> torch.Tensor | float:
    """``count`` (or ``default``) clamped to >= 1, so empty batches give 0 rather than 0/0."""
    if count is None:
        return default.clamp(min=1) if isinstance(default, torch.Tensor) else max(float(default), 1.0)
    if isinstance(count, torch.Tensor):
        # No validation here: reading a (possibly all-reduced, on-GPU) tensor would sync.
        return count.clamp(min=1)
    if isinstance(count, bool) or count < 0:
        raise ValueError(f"{name} must be a non-negative number, got {count!r}")
    return max(float(count), 1.0)


def _token_mean(
    loss: torch.Tensor, m: torch.Tensor, normalizer: float | None, num_tokens: Count | None, num_seqs: Count | None
) -> torch.Tensor:
    total = torch.where(m, loss, torch.zeros_like(loss)).sum()
    return total / _divisor(num_tokens, m.sum(), "num_tokens")


def _seq_mean_token_mean(
    loss: torch.Tensor, m: torch.Tensor, normalizer: float | None, num_tokens: Count | None, num_seqs: Count | None
) -> torch.Tensor:
    per_seq = torch.where(m, loss, torch.zeros_like(loss)).sum(dim=1) / m.sum(dim=1).clamp(min=1)
    return per_seq.sum() / _divisor(num_seqs, loss.shape[0], "num_seqs")


def _seq_mean_token_sum_norm(
    loss: torch.Tensor, m: torch.Tensor, normalizer: float | None, num_tokens: Count | None, num_seqs: Count | None
) -> torch.Tensor:
    norm = float(loss.shape[1]) if normalizer is None else float(normalizer)
    if norm <= 0:
        raise ValueError(f"normalizer must be > 0, got {normalizer!r}")
    per_seq = torch.where(m, loss, torch.zeros_like(loss)).sum(dim=1) / norm
    return per_seq.sum() / _divisor(num_seqs, loss.shape[0], "num_seqs")


_AGGREGATORS: dict[str, Callable[..., torch.Tensor]] = {
    "token-mean": _token_mean,
    "seq-mean-token-mean": _seq_mean_token_mean,
    "seq-mean-token-sum-norm": _seq_mean_token_sum_norm,
}


def _check_agg(mode: str) -> Callable[..., torch.Tensor]:
    fn = _AGGREGATORS.get(mode)
    if fn is None:
        raise ValueError(f"unknown loss aggregation {mode!r}; expected one of {list(get_args(LossAgg))}")
    return fn


def aggregate_loss(
    loss: torch.Tensor,
    mask: torch.Tensor,
    mode: LossAgg,
    *,
    normalizer: float | None = None,
    num_tokens: Count | None = None,
    num_seqs: Count | None = None,
) -> torch.Tensor:
    """Reduce a per-token loss to a scalar over the loss tokens.

    With S_i = sum of row i's masked loss and n_i = row i's loss-token count:

    - ``"token-mean"``: ``sum_i S_i / num_tokens``; default ``num_tokens = sum_i n_i``
      (every token weighs the same; DAPO's token-level loss).
    - ``"seq-mean-token-mean"``: ``sum_i (S_i / n_i) / num_seqs``; default ``num_seqs = B``
      (every sequence weighs the same; the original GRPO, GSPO).
    - ``"seq-mean-token-sum-norm"``: ``sum_i (S_i / normalizer) / num_seqs``; defaults
      ``normalizer = T`` (= ``loss.shape[1]``), ``num_seqs = B`` (Dr. GRPO: a constant
      instead of the length, so no length bias).

    Gradient accumulation: pass the optimiser batch's totals — ``num_tokens`` = loss
    tokens over all micro-batches, ``num_seqs`` = rows over all micro-batches (all-masked
    rows included, as the default counts them) — and sum the micro-batch results.
    For ``seq-mean-token-sum-norm`` also pass a fixed ``normalizer`` (e.g. the
    generation budget ``max_new_tokens``): the default T changes with each
    micro-batch's padding. Arguments a mode does not use are ignored, so a trainer
    may always pass all three. Counts are clamped to >= 1, and an all-masked row
    adds 0 (its per-row n_i is clamped too), so nothing is ever 0/0.

    Args:
        loss:       [B, T] per-token loss; values at mask-0 positions are ignored (NaN ok).
        mask:       [B, T] 1 on loss tokens.
        mode:       one of :data:`LossAgg`.
        normalizer: constant per-row divisor of ``seq-mean-token-sum-norm`` (> 0).
        num_tokens: divisor of ``token-mean`` (int, float or 0-dim tensor, >= 0).
        num_seqs:   divisor of the ``seq-mean-*`` modes (int, float or 0-dim tensor, >= 0).

    Returns:
        0-dim tensor, dtype of ``loss``.

    Raises:
        ValueError: unknown ``mode`` (the message lists the valid ones); ``loss`` and
            ``mask`` not the same 2-D shape; ``normalizer <= 0``; a negative count.

    Source: token-mean: Yu et al. 2025 (DAPO, arXiv:2503.14476) Sec. 3.3, token-level
    policy-gradient loss; seq-mean-token-mean: Shao et al. 2024 (DeepSeekMath,
    arXiv:2402.03300) eq. 3; seq-mean-token-sum-norm: Liu et al. 2025 (Dr. GRPO,
    arXiv:2503.20783) Sec. 3.1 / Fig. 1 (1/|o_i| replaced by a constant).
    """
    fn = _check_agg(mode)
    _check_bt(loss=loss, mask=mask)
    return fn(loss, mask.bool(), normalizer, num_tokens, num_seqs)


def _token_log_ratio(logps: torch.Tensor, old_logps: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    # Zeroing mask-0 positions before exp keeps padding garbage (e.g. -inf) out of the
    # forward pass and, through exp's backward, out of the gradient.
    diff = torch.where(m, logps - old_logps, torch.zeros_like(logps))
    return diff.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)


def _sequence_log_ratio(logps: torch.Tensor, old_logps: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    diff = torch.where(m, logps - old_logps, torch.zeros_like(logps))
    seq = (diff.sum(dim=1) / m.sum(dim=1).clamp(min=1)).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    # GSPO-token: value log s_i at every token, gradient d/d logp_t = 1 per token, so
    # each token's gradient is s_i * A * grad log pi_t.
    per_token = seq.detach().unsqueeze(1) + logps - logps.detach()
    return torch.where(m, per_token, torch.zeros_like(per_token))


_RATIO_FNS: dict[str, Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]] = {
    "token": _token_log_ratio,
    "sequence": _sequence_log_ratio,
}


def _masked_mean(x: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    return torch.where(m, x, torch.zeros_like(x)).sum() / m.sum().clamp(min=1)


def truncated_is_weights(
    logps: torch.Tensor, engine_logps: torch.Tensor, mask: torch.Tensor, cap: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Truncated importance-sampling weights for an engine that is not the learner.

    The tokens were sampled by the engine (pi_engine: vLLM, another precision or kernel),
    while the loss is written for the learner's pi_old. Since
    E_{y ~ pi_engine}[w(y) f(y)] = E_{y ~ pi_old}[f(y)] with w = pi_old / pi_engine,
    weighting each token's loss by w removes the mismatch; truncating, w = min(w, C),
    bounds the variance a near-zero pi_engine would cause, at the cost of a bias on the
    truncated tokens only:

        w_t = min(exp(log pi_old(y_t) - log pi_engine(y_t)), C)      (detached)

    Args:
        logps:        [B, T] log pi_old of the sampled tokens as the learner computes them.
        engine_logps: [B, T] the engine's logprobs of the same tokens.
        mask:         [B, T] 1 on loss tokens.
        cap:          C > 0 (``algorithm.correction.token_tis_cap``; the paper uses 2).
    Returns:
        (weights [B, T] float32, 0 off the mask; fraction of loss tokens truncated, 0-dim).
    Raises:
        ValueError: ``cap <= 0`` or shapes that differ.

    Source: Yao et al. 2025, "Your Efficient RL Framework Secretly Brings You Off-Policy
    RL Training" (fengyao.notion.site/off-policy-rl), the truncated IS correction of
    the policy gradient; truncated IS after Ionides 2008 (J. Comput. Graph. Stat. 17:295).
    """
    if cap <= 0:
        raise ValueError(f"the cap (algorithm.correction.token_tis_cap) must be > 0, got {cap}")
    _check_bt(logps=logps, engine_logps=engine_logps, mask=mask)
    m = mask.bool()
    log_w = (logps.detach().float() - engine_logps.float()).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    raw = torch.exp(log_w)
    weights = torch.where(m, raw.clamp(max=cap), torch.zeros_like(raw))
    return weights, _masked_mean((raw > cap).float(), m)


def policy_loss(
    logps: torch.Tensor,
    old_logps: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    dual_clip: float | None = None,
    ratio_level: RatioLevel = "token",
    agg: LossAgg = "token-mean",
    num_tokens: Count | None = None,
    num_seqs: Count | None = None,
    normalizer: float | None = None,
    is_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """PPO clipped surrogate loss with clip-higher, dual-clip and GSPO sequence ratios.

    Per token, with ratio rho and advantage A (the loss is the negated objective):

        l = max(-A * rho, -A * clip(rho, 1 - clip_low, 1 + clip_high))
        if dual_clip is c and A < 0:  l = min(l, -c * A)     (i.e. l <= c * |A|)

    ``ratio_level="token"``: ``rho_t = pi(y_t) / pi_old(y_t)``.
    ``ratio_level="sequence"`` (GSPO): ``s_i = exp(mean_t (log pi - log pi_old))`` over the
    row's loss tokens, applied at every token as ``sg[s_i] * pi / sg[pi]`` (same value
    s_i, per-token gradient). GSPO as published uses ``agg="seq-mean-token-mean"`` and
    much tighter clip ranges (~3e-4 / 4e-4). Log-ratios are clamped to
    [-20, 20] (:data:`LOG_RATIO_CLAMP`) before ``exp``; math is in float32.
    Advantages are detached.

    Args:
        logps:      [B, T] log pi_theta of the taken tokens (differentiable).
        old_logps:  [B, T] log pi_old of the same tokens (rollout policy).
        advantages: [B, T] per token, or [B] per sequence (broadcast over T).
        mask:       [B, T] 1 on loss tokens.
        clip_low, clip_high: clip range [1 - clip_low, 1 + clip_high]; 0 <= clip_low <= 1,
                    clip_high >= 0.
        dual_clip:  c > 1 bounding the loss of negative-advantage tokens by c * |A|; None: off.
        ratio_level: ``"token"`` (PPO/GRPO/DAPO) or ``"sequence"`` (GSPO).
        agg, num_tokens, num_seqs, normalizer: reduction, see :func:`aggregate_loss`.
        is_weights: [B, T] detached per-token weights of the surrogate (truncated importance
                    sampling against the engine, :func:`truncated_is_weights`); None: 1.

    Returns:
        (loss, stats). ``loss`` is a 0-dim float32 tensor. ``stats`` holds 0-dim detached
        float32 tensors (no device sync; call ``.item()`` when logging), each a mean over
        this call's loss tokens (0 when there are none):
        ``clip_frac`` (tokens whose gradient is cut by any clip: PPO high, PPO low or
        dual), ``clip_frac_low``, ``clip_frac_high``, ``dual_clip_frac``, ``ratio_mean``,
        ``ratio_max``, ``approx_kl`` (k3 estimate of KL(pi_old || pi_theta) from the
        token log-ratios, whatever ``ratio_level``).

    Raises:
        ValueError: bad ``ratio_level`` or ``agg`` (the message lists the options); shapes
            that differ or are not [B, T] (advantages: [B, T] or [B]); clip values out of
            range; ``dual_clip <= 1``; and as :func:`aggregate_loss`.

    Source: Schulman et al. 2017 (PPO, arXiv:1707.06347) eq. 7; clip-higher: Yu et al.
    2025 (DAPO, arXiv:2503.14476) eq. 10; dual-clip: Ye et al. 2020 (arXiv:1912.09729),
    the dual-clip PPO objective max(min(rho A, clip(rho) A), c A) for A < 0; sequence
    ratio: Zheng et al. 2025 (GSPO, arXiv:2507.18071) s_i (Sec. 4.1) and GSPO-token
    (Sec. 4.3).
    """
    ratio_fn = _RATIO_FNS.get(ratio_level)
    if ratio_fn is None:
        raise ValueError(f"unknown ratio_level {ratio_level!r}; expected one of {list(get_args(RatioLevel))}")
    _check_agg(agg)
    _check_bt(logps=logps, old_logps=old_logps, mask=mask)
    if advantages.dim() == 1 and advantages.shape[0] == logps.shape[0]:
        advantages = advantages.unsqueeze(1)
    elif advantages.shape != logps.shape:
        raise ValueError(
            f"advantages must be [B, T] {tuple(logps.shape)} or [B] ({logps.shape[0]},), "
            f"got {tuple(advantages.shape)}"
        )
    if not 0.0 <= clip_low <= 1.0:
        raise ValueError(f"clip_low must be in [0, 1], got {clip_low}")
    if clip_high < 0.0:
        raise ValueError(f"clip_high must be >= 0, got {clip_high}")
    if dual_clip is not None and dual_clip <= 1.0:
        raise ValueError(f"dual_clip must be > 1 (or None), got {dual_clip}")

    m = mask.bool()
    lp, old = logps.float(), old_logps.float().detach()
    adv = advantages.detach().float().expand_as(lp)
    ratio = torch.exp(ratio_fn(lp, old, m))
    clipped = ratio.clamp(1.0 - clip_low, 1.0 + clip_high)
    per_token = torch.maximum(-adv * ratio, -adv * clipped)
    if dual_clip is not None:
        per_token = torch.where(adv < 0, torch.minimum(per_token, -adv * dual_clip), per_token)
    if is_weights is not None:
        _check_bt(logps=logps, is_weights=is_weights)
        per_token = per_token * is_weights.detach().float()
    loss = aggregate_loss(
        per_token, m, agg, normalizer=normalizer, num_tokens=num_tokens, num_seqs=num_seqs
    )

    with torch.no_grad():
        r = ratio.detach()
        high = (adv > 0) & (r > 1.0 + clip_high)
        low = (adv < 0) & (r < 1.0 - clip_low)
        dual = (adv < 0) & (r > dual_clip) if dual_clip is not None else torch.zeros_like(m)
        any_tokens = m.any()
        ratio_max = torch.where(m, r, torch.full_like(r, -torch.inf)).amax() if r.numel() else r.new_zeros(())
        token_lr = _token_log_ratio(lp.detach(), old, m)
        stats = {
            "clip_frac": _masked_mean((high | low | dual).float(), m),
            "clip_frac_low": _masked_mean(low.float(), m),
            "clip_frac_high": _masked_mean(high.float(), m),
            "dual_clip_frac": _masked_mean(dual.float(), m),
            "ratio_mean": _masked_mean(r, m),
            "ratio_max": torch.where(any_tokens, ratio_max, torch.zeros_like(ratio_max)),
            # Samples come from pi_old, so pi_old plays kl_estimate's "policy" role.
            "approx_kl": _masked_mean(kl_estimate(old, old + token_lr, "k3"), m),
        }
    return loss, stats


def value_loss(
    values: torch.Tensor,
    old_values: torch.Tensor,
    returns: torch.Tensor,
    mask: torch.Tensor,
    *,
    clip: float | None = None,
    agg: LossAgg = "token-mean",
    num_tokens: Count | None = None,
    num_seqs: Count | None = None,
    normalizer: float | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Critic loss ``0.5 * (V - R)^2``, optionally with PPO value clipping.

    With ``clip = eps_v``: ``V_clip = V_old + clamp(V - V_old, -eps_v, eps_v)`` and
    per token ``0.5 * max((V - R)^2, (V_clip - R)^2)``, so the critic gains nothing from
    moving more than eps_v away from the values it had at rollout time.

    Args:
        values:     [B, T] current critic values (differentiable).
        old_values: [B, T] critic values at rollout time.
        returns:    [B, T] targets, e.g. the returns of :func:`gae`.
        mask:       [B, T] 1 on loss tokens.
        clip:       eps_v > 0, or None for the plain squared error.
        agg, num_tokens, num_seqs, normalizer: reduction, see :func:`aggregate_loss`.

    Returns:
        (loss, stats): 0-dim float32 loss; ``stats["clip_frac"]`` (0-dim detached): fraction
        of loss tokens where the clipped error is the larger one (0 when ``clip`` is None).

    Raises:
        ValueError: shapes differ or are not [B, T]; ``clip <= 0``; bad ``agg``; and as
            :func:`aggregate_loss`.

    Source: the value clipping of OpenAI Baselines' PPO2, as described in Engstrom et al.
    2020, "Implementation Matters in Deep Policy Gradients" (arXiv:2005.12729) Sec. 3,
    optimisation 1; unclipped form: Schulman et al. 2017 (PPO) eq. 9, L^VF.
    """
    _check_agg(agg)
    _check_bt(values=values, old_values=old_values, returns=returns, mask=mask)
    if clip is not None and clip <= 0:
        raise ValueError(f"clip must be > 0 (or None), got {clip}")
    m = mask.bool()
    zeros = torch.zeros_like(values, dtype=torch.float32)
    v = torch.where(m, values.float(), zeros)
    target = torch.where(m, returns.detach().float(), zeros)
    err = (v - target).square()
    clip_active = torch.zeros_like(m)
    if clip is not None:
        old = torch.where(m, old_values.detach().float(), zeros)
        v_clip = old + (v - old).clamp(-clip, clip)
        err_clip = (v_clip - target).square()
        clip_active = err_clip > err
        err = torch.maximum(err, err_clip)
    loss = aggregate_loss(0.5 * err, m, agg, normalizer=normalizer, num_tokens=num_tokens, num_seqs=num_seqs)
    return loss, {"clip_frac": _masked_mean(clip_active.float(), m).detach()}


def entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """Entropy of the categorical distribution over the last dimension, in float32.

    ``H = -sum_v p_v log p_v`` with ``p = softmax(logits)``; ``-inf`` logits (banned
    tokens) contribute 0 to the value and to the gradient.

    Args:
        logits: [..., V] unnormalised log-probabilities, any float dtype.

    Returns:
        [...] entropy in nats, float32 (differentiable).

    Raises:
        ValueError: ``logits`` has no vocabulary dimension (0-dim).

    Source: Shannon entropy; used as an exploration bonus e.g. in Schulman et al. 2017
    (PPO, arXiv:1707.06347) eq. 9, the S term.
    """
    if logits.dim() == 0:
        raise ValueError("logits must have a vocabulary dimension [..., V], got a 0-dim tensor")
    logp = torch.log_softmax(logits.float(), dim=-1)
    p = logp.exp()
    # p * logp is 0 * -inf = NaN for banned tokens, in the value and in the backward pass.
    safe_logp = torch.where(p > 0, logp, torch.zeros_like(logp))
    return -(p * safe_logp).sum(dim=-1)
