"""Reward shaping by completion length (DAPO's overlong reward shaping)."""

from __future__ import annotations

import torch


def overlong_penalty(lengths: torch.Tensor, max_len: int, cache_len: int, *, factor: float = 1.0) -> torch.Tensor:
    """DAPO's soft overlong punishment, a length-aware penalty added to the reward.

    With L_max = ``max_len`` (the completion budget), L_cache = ``cache_len``::

        R_length(y) = 0                                  |y| <= L_max - L_cache
                    = (L_max - L_cache - |y|) / L_cache   L_max - L_cache < |y| <= L_max
                    = -1                                 L_max < |y|

    times ``factor``: no penalty up to L_max - L_cache tokens, then linear down to
    ``-factor`` at the budget.

    Args:
        lengths:   [N] completion lengths in tokens (int or float).
        max_len:   L_max > 0.
        cache_len: L_cache, 0 < L_cache <= L_max.
        factor:    the largest penalty (>= 0).

    Returns:
        [N] float32 penalties in [-factor, 0].

    Raises:
        ValueError: ``max_len <= 0``, ``cache_len`` outside (0, max_len], ``factor < 0``,
            ``lengths`` not 1-D.

    Source: Yu et al. 2025 (DAPO, arXiv:2503.14476) Sec. 3.4, eq. 13.
    """
    if max_len <= 0:
        raise ValueError(f"max_len must be > 0, got {max_len}")
    if not 0 < cache_len <= max_len:
        raise ValueError(f"cache_len must be in (0, max_len={max_len}], got {cache_len}")
    if factor < 0:
        raise ValueError(f"factor must be >= 0, got {factor}")
    if lengths.dim() != 1:
        raise ValueError(f"lengths must be 1-D [N], got shape {tuple(lengths.shape)}")
    n = lengths.float()
    soft = (max_len - cache_len - n) / cache_len  # > 0 below the interval, -1 at its end
    pen = torch.where(n > max_len, torch.full_like(n, -1.0), soft.clamp(max=0.0))
    return factor * pen
