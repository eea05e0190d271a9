"""Group-relative advantages when an episode gives several training samples (an agent's
segments, :mod:`plainrl.samples`), each episode counting once in its group's statistics.

Shapes: S = samples; ``group`` [S] and ``episode`` [S] are integer ids (an episode's samples
share its group). Each sample has a reward r_s (its episode's, or its segment's own).

Weighting. Sample s of an episode with n_e valid samples gets the weight w_s = 1 / n_e, so
the weights of an episode sum to 1 and those of a group to E_g, its number of valid
episodes. With m_e = sum_{s in e} w_s r_s, the episode's mean sample reward:

    GRPO   mean_g = (1 / E_g) sum_{s in g} w_s r_s = mean over the group's episodes of m_e
           var_g  = sum_{s in g} w_s (r_s - mean_g)^2 / (E_g - 1)
           A_s    = (r_s - mean_g) / (sqrt(var_g) + eps)          (Dr. GRPO: r_s - mean_g)
    RLOO   A_s    = r_s - (sum_{s' in g} w_s' r_s' - m_e(s)) / (E_g - 1)
                  = r_s - mean of m_e over the group's *other* episodes

When every sample of an episode has the episode's reward (r_s = R_e, no segment rewards),
m_e = R_e and the within-episode spread is 0, so mean_g, var_g and the leave-one-out
baseline are exactly those of the episode-level estimator over R_e, and every segment gets
its episode's advantage: what prime-rl (``sample.advantage = advantage`` for each sample
of a rollout), SkyRL's step-wise training and rLLM's ``stepwise_advantage: broadcast`` do.
Counting each sample once instead would let an episode with more segments weigh more in
its group's baseline and spread; the baseline would then depend on how an agent managed
its context, not on the prompt. With segment rewards the same statistics stay in the
units of the rewards being compared, each episode still counting once.

Exactly 0, as for :func:`plainrl.algorithms.grpo_advantages`: invalid samples, and groups
with fewer than 2 valid episodes or whose valid sample rewards are all equal.

Sources: Shao et al. 2024 (DeepSeekMath, arXiv:2402.03300) Sec. 4.1.2 (GRPO); Liu et al.
2025 (Dr. GRPO, arXiv:2503.20783) Sec. 3.1; Ahmadian et al. 2024 (arXiv:2402.14740) and
Kool et al. 2019 (RLOO). Broadcasting an episode's advantage to its samples: prime-rl's
orchestrator (PrimeIntellect-ai/prime-rl, ``interleave_rollout`` and the advantage loop
after it), SkyRL's step-wise example (``compute_advantages_step_wise``: last step's
advantage broadcast to the trajectory's steps).
"""

from __future__ import annotations

from typing import Literal

import torch

__all__ = ["episode_weighted_advantages", "informative_episode_groups"]


class _Stats:
    """Per-group statistics of S samples under the episode weights (see the module docstring)."""

    def __init__(self, rewards: torch.Tensor, group: torch.Tensor, episode: torch.Tensor,
                 valid: torch.Tensor | None) -> None:
        if rewards.dim() != 1 or group.shape != rewards.shape or episode.shape != rewards.shape:
            raise ValueError(f"rewards, group and episode must be 1-D of one length; got {tuple(rewards.shape)}, "
                             f"{tuple(group.shape)} and {tuple(episode.shape)}")
        if valid is None:
            valid = torch.ones_like(rewards, dtype=torch.bool)
        if valid.dtype != torch.bool or valid.shape != rewards.shape:
            raise ValueError(f"valid must be a bool tensor of shape {tuple(rewards.shape)}")
        if group.numel() and (group.min() < 0 or episode.min() < 0):
            raise ValueError("group and episode ids must be >= 0")
        r = rewards.detach()
        r = r if r.is_floating_point() else r.float()
        if not torch.isfinite(r[valid]).all():
            raise ValueError("a reward marked valid is NaN or infinite; mark that sample invalid (valid=False)")
        n_groups = int(group.max()) + 1 if group.numel() else 0
        n_episodes = int(episode.max()) + 1 if episode.numel() else 0
        ep_group = torch.zeros(n_episodes, dtype=torch.long, device=r.device).scatter_(0, episode, group)
        if not torch.equal(ep_group[episode], group):
            raise ValueError("every sample of an episode must be in its episode's group")
        per_episode = torch.bincount(episode[valid], minlength=n_episodes)  # n_e, valid samples
        self.episodes = torch.bincount(ep_group[per_episode > 0], minlength=n_groups).to(r.dtype)  # E_g [G]
        self.valid, self.group, self.episode = valid, group, episode
        self.w = torch.where(valid, 1.0 / per_episode[episode].clamp(min=1).to(r.dtype), torch.zeros_like(r))
        inf = torch.full((n_groups,), torch.inf, dtype=r.dtype, device=r.device)
        lo = inf.scatter_reduce(0, group[valid], r[valid], "amin")
        hi = (-inf).scatter_reduce(0, group[valid], r[valid], "amax")
        self.informative = (self.episodes >= 2) & (hi > lo)  # [G]
        # shifting by the group's minimum first keeps differences of nearly equal rewards exact
        # (Sterbenz), as plainrl.algorithms.advantages._group_stats does
        lo = torch.where(torch.isfinite(lo), lo, torch.zeros_like(lo))
        self.shifted = torch.where(valid, r - lo[group], torch.zeros_like(r))
        self.total = torch.zeros(n_groups, dtype=r.dtype, device=r.device).index_add_(0, group, self.w * self.shifted)  # [G]
        self.centred = torch.where(valid, self.shifted - (self.total / self.episodes.clamp(min=1))[group],
                                   torch.zeros_like(r))

    def sum_by_group(self, x: torch.Tensor) -> torch.Tensor:
        return torch.zeros_like(self.total).index_add_(0, self.group, x)

    def sum_by_episode(self, x: torch.Tensor) -> torch.Tensor:
        n = int(self.episode.max()) + 1 if self.episode.numel() else 0
        return torch.zeros(n, dtype=x.dtype, device=x.device).index_add_(0, self.episode, x)

    def finish(self, adv: torch.Tensor) -> torch.Tensor:
        return torch.where(self.valid & self.informative[self.group], adv, torch.zeros_like(adv))


def episode_weighted_advantages(
    rewards: torch.Tensor,
    group: torch.Tensor,
    episode: torch.Tensor,
    *,
    estimator: Literal["grpo", "rloo"],
    norm_std: bool = True,
    eps: float = 1e-6,
    valid: torch.Tensor | None = None,
) -> torch.Tensor:
    """GRPO (Dr. GRPO with ``norm_std=False``) or RLOO advantages of samples, each episode
    weighing 1 in its group's statistics however many samples it has (module docstring).

    Args:
        rewards: [S] each sample's reward; entries with ``valid=False`` may be NaN.
        group:   [S] long, the sample's group id (>= 0).
        episode: [S] long, the sample's episode id (>= 0); an episode's samples share a group.
        estimator: ``"grpo"`` or ``"rloo"``.
        norm_std: GRPO: divide by the group's (episode-weighted, unbiased) std.
        eps:     added to the std before dividing (>= 0).
        valid:   [S] bool, False for unscorable samples; None: all valid.
    Returns:
        [S] advantages (detached), float dtype of ``rewards``. Equal to
        :func:`~plainrl.algorithms.grpo_advantages` / :func:`~plainrl.algorithms.rloo_advantages`
        when every episode has one sample.
    Raises:
        ValueError: shapes or ids that do not fit, an episode split over groups, a valid
            reward that is NaN/inf, ``eps < 0``, an unknown ``estimator``.
    """
    if eps < 0:
        raise ValueError(f"eps must be >= 0, got {eps}")
    if estimator not in ("grpo", "rloo"):
        raise ValueError(f"estimator must be 'grpo' or 'rloo', got {estimator!r}")
    st = _Stats(rewards, group, episode, valid)
    others = (st.episodes - 1).clamp(min=1)  # [G] E_g - 1
    if estimator == "grpo":
        adv = st.centred
        if norm_std:
            var = st.sum_by_group(st.w * st.centred.square()) / others
            adv = adv / (var.sqrt() + eps)[st.group]
    else:
        own = st.sum_by_episode(st.w * st.shifted)[st.episode]  # m_e of the sample's episode (shifted)
        adv = st.shifted - (st.total[st.group] - own) / others[st.group]
    return st.finish(adv)


def informative_episode_groups(
    rewards: torch.Tensor, group: torch.Tensor, episode: torch.Tensor, *, valid: torch.Tensor | None = None
) -> torch.Tensor:
    """Which groups carry a learning signal: at least two valid episodes, and valid sample
    rewards not all equal (where :func:`episode_weighted_advantages` is not all 0; DAPO's
    dynamic sampling keeps these). Arguments as there.

    Returns:
        [G] bool, G = ``group.max() + 1``.

    Source: Yu et al. 2025 (DAPO, arXiv:2503.14476) Sec. 3.2, eq. 11 (dynamic sampling).
    """
    return _Stats(rewards, group, episode, valid).informative
