"""Token-exact recording of one episode's model calls, for agent loops.

Every call to the model sends a full context of token ids. When that context extends
the previous call's (its prompt, what was sampled, and what was inserted since), only
the new tokens are recorded, as inserted tokens (``loss_mask`` 0, logprob 0.0), and the
sampled ids follow (``loss_mask`` 1, the engine's logprobs): the learner later trains on
exactly the ids the engine saw and sampled, never on a re-tokenisation. A context that
does not extend the previous one starts a new :class:`Segment` (its own prompt).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from plainrl.types import FinishReason

__all__ = ["Segment", "Trajectory"]


@dataclass
class Segment:
    """One unbroken sequence of model calls: each call's context extended the previous one's.

    prompt_ids:     [P] the context of the segment's first call.
    completion_ids: [L] every token after the prompt: sampled and inserted, in order.
    logprobs:       [L] the engine's logprob on sampled tokens, 0.0 on inserted ones.
    loss_mask:      [L] 1 on sampled tokens, 0 on inserted ones.
    versions:       [L] the policy version that sampled each token (``rollout.partial``), -1 on
                    inserted tokens and where the engine gave none.
    calls:          model calls made in this segment.
    finish_reason:  how its latest call ended.
    """

    prompt_ids: list[int]
    completion_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    loss_mask: list[int] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    calls: int = 0
    finish_reason: FinishReason = "length"

    @property
    def context(self) -> list[int]:
        """[P + L] what the next call continues."""
        return self.prompt_ids + self.completion_ids


class Trajectory:
    """The segments of one episode, in call order; the last one is the current segment."""

    def __init__(self) -> None:
        self.segments: list[Segment] = []

    @property
    def current(self) -> Segment | None:
        return self.segments[-1] if self.segments else None

    def start(self, prompt_ids: list[int]) -> Segment:
        """Open a new segment whose prompt is ``prompt_ids`` [P].

        Raises:
            ValueError: an empty prompt (the engine has nothing to condition on).
        """
        if not prompt_ids:
            raise ValueError("a model call needs at least one context token; the prompt is empty")
        seg = Segment(prompt_ids=list(prompt_ids))
        self.segments.append(seg)
        return seg

    def feed(self, context: list[int]) -> bool:
        """Prepare a call on ``context`` [C]: when it starts with the current segment's
        context, the tokens beyond it are recorded as inserted; otherwise a new segment
        starts with ``context`` as its prompt.

        Returns:
            True when a new segment was started.
        Raises:
            ValueError: ``context`` is empty.
        """
        seg = self.current
        if seg is not None:
            ctx = seg.context
            if len(context) >= len(ctx) and context[: len(ctx)] == ctx:
                self.insert(context[len(ctx):])
                return False
        self.start(context)
        return True

    def insert(self, ids: list[int]) -> None:
        """Append tokens the model did not sample (tool output, template tokens): mask 0.

        Raises:
            RuntimeError: no segment is open yet.
        """
        seg = self._open()
        seg.completion_ids += ids
        seg.logprobs += [0.0] * len(ids)
        seg.loss_mask += [0] * len(ids)
        seg.versions += [-1] * len(ids)

    def add_sample(self, ids: list[int], logprobs: list[float], finish_reason: FinishReason = "length",
                   versions: list[int] | None = None) -> None:
        """Append what the engine sampled [n] with its logprobs [n] (mask 1), and how the call ended;
        ``versions`` [n]: the version that sampled each token (:attr:`Generation.versions`).

        Raises:
            RuntimeError: no segment is open, or ``ids`` and ``logprobs`` differ in length.
        """
        if len(ids) != len(logprobs):
            raise RuntimeError(f"engine returned {len(ids)} token ids but {len(logprobs)} logprobs")
        seg = self._open()
        seg.completion_ids += ids
        seg.logprobs += [float(x) for x in logprobs]
        seg.loss_mask += [1] * len(ids)
        seg.versions += list(versions) if versions is not None else [-1] * len(ids)
        seg.calls += 1
        seg.finish_reason = finish_reason

    def _open(self) -> Segment:
        if self.current is None:
            raise RuntimeError("no segment is open: the first model call starts one")
        return self.current


def token_versions(seg: Segment | None) -> list[int] | None:
    """``seg``'s per-token versions for :attr:`Episode.token_versions`: None when no token has one."""
    if seg is None or all(v < 0 for v in seg.versions):
        return None
    return list(seg.versions)
