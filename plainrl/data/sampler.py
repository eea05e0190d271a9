"""The prompt samplers' protocol (:class:`Sampler`) and the default one, :class:`PromptSampler`:
endless, resumable batches of training rows, epoch by epoch (``data.curriculum``'s draws by pass
rate: :class:`plainrl.data.curriculum.CurriculumSampler`)."""

from __future__ import annotations

import random
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, Iterator, Protocol

if TYPE_CHECKING:
    from plainrl.types import Episode

__all__ = ["PromptSampler", "Sampler"]


class Sampler(Protocol):
    """What the RL loop asks of a prompt sampler: batches of rows, what the scored batches showed
    (a sampler that learns from them, as the curriculum does), its metrics, and its position for a
    checkpoint."""

    def next_batch(self, n: int | None = None) -> list[Any]:
        """The next ``n`` rows (default: the sampler's ``prompts_per_step``)."""

    def observe(self, rows: Sequence[Any], episodes: list[Episode], informative: Sequence[bool]) -> None:
        """A scored batch: ``rows`` as :meth:`next_batch` gave them, ``episodes`` their groups
        (``Episode.group`` indexes ``rows``), ``informative`` per group whether any advantage can be
        non-zero."""

    def take_metrics(self) -> dict[str, float]:
        """Metrics since the last call (``data/...``), then reset."""

    def state_dict(self) -> dict[str, Any]:
        """The position, JSON-serialisable."""

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Continue from a :meth:`state_dict`."""


class PromptSampler:
    """Endless batches of training prompts, epoch by epoch, resumable exactly.

    Each epoch visits every row once, in an order shuffled with
    ``random.Random(seed + epoch)`` (file order when ``shuffle`` is false). A batch
    that crosses an epoch boundary finishes one epoch and continues into the next.
    ``state_dict()`` captures (epoch, position); a sampler built on the same rows
    with the same seed and ``load_state_dict`` continues with the same batches.

    Args:
        rows: the training prompts (non-empty).
        prompts_per_step: rows per batch (``rollout.prompts_per_step``).
        seed: shuffle seed.
        shuffle: ``data.shuffle``.

    Raises:
        ValueError: no rows, or ``prompts_per_step < 1``.
    """

    def __init__(self, rows: Sequence[Any], prompts_per_step: int, *, seed: int, shuffle: bool = True):
        if not rows:
            raise ValueError("PromptSampler needs at least one row")
        if prompts_per_step < 1:
            raise ValueError(f"prompts_per_step must be >= 1, got {prompts_per_step}")
        self.rows = rows
        self.prompts_per_step = prompts_per_step
        self.seed = seed
        self.shuffle = shuffle
        self.epoch = 0
        self.position = 0
        self._order = self._epoch_order(0)

    def _epoch_order(self, epoch: int) -> list[int]:
        order = list(range(len(self.rows)))
        if self.shuffle:
            random.Random(self.seed + epoch).shuffle(order)
        return order

    def next_batch(self, n: int | None = None) -> list[Any]:
        """The next ``n`` rows (default ``prompts_per_step``; can hold a row twice when the data is smaller)."""
        n = self.prompts_per_step if n is None else n
        out: list[Any] = []
        while len(out) < n:
            if self.position >= len(self.rows):
                self.epoch += 1
                self.position = 0
                self._order = self._epoch_order(self.epoch)
            take = min(n - len(out), len(self.rows) - self.position)
            out.extend(self.rows[j] for j in self._order[self.position : self.position + take])
            self.position += take
        return out

    def observe(self, rows: Sequence[Any], episodes: list[Episode], informative: Sequence[bool]) -> None:
        """Nothing: the epoch order does not depend on what the batches scored."""

    def take_metrics(self) -> dict[str, float]:
        """No metrics of its own."""
        return {}

    def __iter__(self) -> Iterator[list[Any]]:
        return self

    def __next__(self) -> list[Any]:
        return self.next_batch()

    def state_dict(self) -> dict[str, Any]:
        """``{"epoch", "position", "num_rows", "seed", "shuffle"}`` (JSON-serialisable)."""
        return {
            "epoch": self.epoch,
            "position": self.position,
            "num_rows": len(self.rows),
            "seed": self.seed,
            "shuffle": self.shuffle,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Continue from a :meth:`state_dict`.

        Raises:
            ValueError: the state was saved for a different number of rows, seed or
                shuffle setting (the data or config changed since the checkpoint),
                or its position is out of range.
        """
        if state.get("curriculum"):
            raise ValueError("the checkpoint was written with data.curriculum, whose prompt draws an epoch-by-epoch "
                             "sampler cannot continue; resume with the same data.curriculum, or start a new run_dir")
        for key, mine in (("num_rows", len(self.rows)), ("seed", self.seed), ("shuffle", self.shuffle)):
            if key in state and state[key] != mine:
                raise ValueError(
                    f"sampler state was saved with {key}={state[key]!r} but this run has {key}={mine!r}; "
                    "the training data or seed changed since the checkpoint, so the data position cannot be resumed"
                )
        epoch, position = int(state["epoch"]), int(state["position"])
        if epoch < 0 or not 0 <= position <= len(self.rows):
            raise ValueError(f"sampler state out of range: epoch={epoch}, position={position}")
        self.epoch, self.position = epoch, position
        self._order = self._epoch_order(epoch)
