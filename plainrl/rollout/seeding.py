"""Sampling seeds per episode and per model call, so a run's samples depend on its seed alone.

Each rollout takes one number from the run's sampling generator (``rollout_seed``: the
generator is seeded from ``seed`` and saved in checkpoints, so a resumed run draws the same
numbers). Episode ``i`` of the rollout (its index in the rollout's episode list, a group's
samples contiguous) gets ``episode_seed(base, i)``, and the ``k``-th model call of that
episode ``call_seed(episode, k)``. An engine turns a call's seed into that call's random
stream alone (:func:`row_uniforms` for the embedded engine, vLLM's per-request ``seed``,
SGLang's ``sampling_seed``), so the tokens of a call depend on its context and its seed,
not on which other calls shared its batch, in what order, or how many episodes ran at once.

Seeds are 63-bit: the first 8 bytes of a BLAKE2b digest of the parts (Aumasson et al. 2013,
RFC 7693), so nearby parts (episode 3 and 4) give unrelated streams.
"""

from __future__ import annotations

import hashlib

import torch

__all__ = ["call_seed", "derive_seed", "episode_seed", "episode_seeds", "rollout_seed", "row_uniforms"]

SEED_BITS = 63  # every engine takes a non-negative int64 (vLLM checks the range of torch.long)


def derive_seed(*parts: int) -> int:
    """A seed in [0, 2**63) determined by ``parts`` (integers) alone.

    Raises:
        TypeError: a part is not an int.
    """
    if not all(isinstance(p, int) for p in parts):
        raise TypeError(f"seed parts must be ints, got {parts!r}")
    digest = hashlib.blake2b(repr(parts).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> (64 - SEED_BITS)


def rollout_seed(generator: torch.Generator | None) -> int | None:
    """One draw from the run's sampling generator: the base of a rollout's seeds (None: unseeded)."""
    if generator is None:
        return None
    return int(torch.randint(0, 2**SEED_BITS - 1, (1,), generator=generator, device=generator.device))


def episode_seed(base: int | None, episode: int) -> int | None:
    """Episode ``episode``'s seed in the rollout whose base is ``base`` (None stays None)."""
    return None if base is None else derive_seed(base, episode)


def call_seed(episode: int | None, call: int) -> int | None:
    """The seed of an episode's ``call``-th model call (0 for the first; None stays None)."""
    return None if episode is None else derive_seed(episode, call)


def episode_seeds(generator: torch.Generator | None, n: int) -> list[int] | None:
    """The first-call seeds of ``n`` single-call episodes (a single-turn rollout), from one
    draw of ``generator``; None when it is None."""
    base = rollout_seed(generator)
    if base is None:
        return None
    return [call_seed(episode_seed(base, i), 0) for i in range(n)]


def row_uniforms(seeds: list[int] | None, n: int, steps: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """The uniform draws of ``n`` sequences for ``steps`` decode steps: [n, steps] float32 in [0, 1).

    Row ``i`` is the first ``steps`` numbers of a CPU ``torch.Generator`` seeded with
    ``seeds[i]``: the draw of a row's token ``t`` depends on its seed and ``t`` alone (a
    prefix of a longer call's row is the shorter call's row), and is the same on every
    device. ``seeds=None`` draws from torch's global generator (unseeded).

    Cost: one generator per row per engine call (~5 us each on a CPU), against decode
    steps of milliseconds.

    Raises:
        ValueError: ``len(seeds) != n``.
    """
    if seeds is None:
        return torch.rand(n, steps).to(device)
    if len(seeds) != n:
        raise ValueError(f"{len(seeds)} seeds for {n} sequences; give one seed per prompt")
    out = torch.empty(n, steps)
    g = torch.Generator()
    for i, s in enumerate(seeds):
        torch.rand(steps, generator=g.manual_seed(s), out=out[i])
    return out.to(device)
