"""``algorithm.is_correction: auto`` resolved for the run, with the reason the run's log prints
(the corrections themselves: :mod:`plainrl.algorithms.is_correction`)."""

from __future__ import annotations

TIS_CAP_AUTO = 2.0  # Yao et al. 2025's cap, TRL's vllm_importance_sampling_cap default


def resolve_is_correction(methods: list[str] | str, *, tis_cap: float | None,
                          async_steps: int) -> tuple[list[str], float | None, str]:
    """The correction methods of ``algorithm.is_correction``, token TIS's cap, and why.

    ``auto``: token TIS when ``tis_cap`` (already resolved) is a cap, as before this knob
    existed; with ``rollout.async_steps > 0`` the geometric sequence mask is added, since a
    stale batch's whole sequences can drift from the learner while each token's truncated
    ratio stays small: SkyRL's off-policy correction recommends the geometric mask for its
    fully-async runs, and Liu, Li et al. 2025 ("When Speed Kills Stability") show token-level
    truncation leaving a sequence-level bias that rejection removes.

    Args:
        methods: ``algorithm.is_correction`` (a list, or ``"auto"``).
        tis_cap: ``algorithm.tis_cap`` resolved (None: off).
        async_steps: ``rollout.async_steps``.

    Returns:
        ``(methods, cap for token_tis or None, reason)``; a configured ``token_tis`` with
        ``tis_cap`` off gets :data:`TIS_CAP_AUTO`.
    """
    if methods != "auto":
        chosen = list(methods)
        if "token_tis" in chosen and tis_cap is None:
            return chosen, TIS_CAP_AUTO, f"as configured, token_tis capped at {TIS_CAP_AUTO} since tis_cap is off"
        return chosen, tis_cap, "as configured" if chosen else "off, as configured"
    chosen = ["token_tis"] if tis_cap is not None else []
    why = [f"token_tis since tis_cap is {tis_cap}"] if chosen else ["no token_tis since tis_cap is off"]
    if async_steps > 0:
        chosen.append("geometric_mask")
        why.append(f"geometric_mask since batches are up to {async_steps} update(s) stale (rollout.async_steps)")
    return chosen, tis_cap, "auto: " + ", ".join(why)
