"""Token-exact recording of one episode's model calls, for agent loops: one lineage per segment.

Every call to the model sends a full context of token ids. The call continues the episode's
*segment* (lineage) whose context is the longest prefix of its own: only the new tokens are
recorded, as inserted tokens (``loss_mask`` 0, logprob 0.0), and the sampled ids follow
(``loss_mask`` 1, the engine's logprobs): the learner later trains on exactly the ids the
engine saw and sampled, never on a re-tokenisation. A context that extends no segment starts
a new :class:`Segment` (its own prompt). Every segment stays open: a sub-agent or a side call
(a title, a summary) opens one of its own, and the main conversation's next call still
continues its own lineage, so the learner never re-feeds the history (once per segment, not
once per call). A segment with a call in flight is not continued by another call (parallel
calls of one episode each get their own record).

:class:`Turn` is the one record of a model call, from the engine's sample to the trajectory:
each segment keeps its latest (:attr:`Segment.last`), by which a chat call that repeats it
is recognised as that lineage's continuation (:meth:`plainrl.rollout.llm.LLM.chat_turn`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from plainrl.types import FinishReason

__all__ = ["Completion", "Segment", "Trajectory", "Turn", "distinct_tokens", "token_versions"]


@dataclass(frozen=True)
class Completion:
    """What one model call sampled.

    text:          the sampled tokens decoded, special tokens skipped (a stop string is kept).
    token_ids:     [n] the sampled ids, exactly as the engine returned them.
    logprobs:      [n] their logprobs under the sampling policy.
    finish_reason: ``"eos"``, ``"stop"`` (a stop string) or ``"length"`` (``max_new_tokens``
                   or the episode's budget).
    """

    text: str
    token_ids: list[int]
    logprobs: list[float]
    finish_reason: FinishReason

    @property
    def message(self) -> dict[str, str]:
        """``{"role": "assistant", "content": text}``: append it to continue the conversation."""
        return {"role": "assistant", "content": self.text}


@dataclass(frozen=True)
class Turn:
    """The record of one model call (:meth:`~plainrl.rollout.llm.LLM.chat_turn`,
    :meth:`~plainrl.rollout.llm.LLM.generate_turn`).

    context:    [C] the ids the engine continued (prompt, earlier turns, inserted tokens).
    completion: what it sampled.
    message:    the assistant message handed back (chat calls; None for ``generate``).
    messages:   the chat call's conversation before the reply (None for ``generate``).
    trained:    False for a call the agent marked as not trained (recorded in no segment).
    """

    context: list[int]
    completion: Completion
    message: dict[str, Any] | None = None
    messages: tuple[dict[str, Any], ...] | None = None
    trained: bool = True

    @property
    def conversation(self) -> list[dict[str, Any]] | None:
        """The chat call's messages and its reply (fresh dicts); None for a ``generate`` call."""
        if self.messages is None or self.message is None:
            return None
        return [dict(m) for m in self.messages] + [dict(self.message)]


@dataclass
class Segment:
    """One lineage of model calls: each call's context extended the segment's context.

    prompt_ids:     [P] the context of the segment's first call.
    completion_ids: [L] every token after the prompt: sampled and inserted, in order.
    logprobs:       [L] the engine's logprob on sampled tokens, 0.0 on inserted ones.
    loss_mask:      [L] 1 on sampled tokens, 0 on inserted ones.
    versions:       [L] the policy version that sampled each token (``rollout.partial``), -1 on
                    inserted tokens and where the engine gave none.
    calls:          model calls made in this segment.
    finish_reason:  how its latest call ended.
    last:           its latest call's record (None before its first call returns).
    """

    prompt_ids: list[int]
    completion_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    loss_mask: list[int] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    calls: int = 0
    finish_reason: FinishReason = "length"
    last: Turn | None = None

    @property
    def context(self) -> list[int]:
        """[P + L] what the next call continues."""
        return self.prompt_ids + self.completion_ids


class Trajectory:
    """The segments of one episode, in the order they were opened.

    :attr:`current` is the segment of the latest call (the one the episode's last turn is in);
    a segment whose call is in flight is *busy* until :meth:`add_sample` or :meth:`release`.
    """

    def __init__(self) -> None:
        self.segments: list[Segment] = []
        self._current: Segment | None = None
        self._busy: set[int] = set()  # id() of segments with a call in flight
        self._used: dict[int, int] = {}  # id(segment) -> the call count when it was last fed (ties go to the latest)
        self._feeds = 0

    @property
    def current(self) -> Segment | None:
        return self._current

    def start(self, prompt_ids: list[int]) -> Segment:
        """Open a new segment whose prompt is ``prompt_ids`` [P]; it becomes :attr:`current`.

        Raises:
            ValueError: an empty prompt (the engine has nothing to condition on).
        """
        if not prompt_ids:
            raise ValueError("a model call needs at least one context token; the prompt is empty")
        seg = Segment(prompt_ids=list(prompt_ids))
        self.segments.append(seg)
        self._current = seg
        return seg

    def match(self, context: list[int]) -> Segment | None:
        """The segment a call on ``context`` [C] continues: of the segments not busy whose context
        is a prefix of ``context``, the longest (of equal ones, the latest fed); None when none is."""
        best, key = None, (-1, -1)
        for seg in self.segments:
            if id(seg) in self._busy:
                continue
            n = len(seg.prompt_ids) + len(seg.completion_ids)
            if n > len(context) or (n, self._used.get(id(seg), -1)) <= key:
                continue
            if context[: len(seg.prompt_ids)] == seg.prompt_ids and \
                    context[len(seg.prompt_ids): n] == seg.completion_ids:
                best, key = seg, (n, self._used.get(id(seg), -1))
        return best

    def feed(self, context: list[int]) -> Segment:
        """Prepare a call on ``context`` [C]: the segment it continues (:meth:`match`) gets the
        tokens beyond its context as inserted ones; otherwise a new segment starts with
        ``context`` as its prompt. The segment is busy until the call's sample is added.

        Returns:
            The segment the call samples into.
        Raises:
            ValueError: ``context`` is empty.
        """
        seg = self.match(context)
        if seg is None:
            current = self._current
            seg = self.start(context)
            self._current = current if current is not None else seg
        else:
            self.insert(context[len(seg.prompt_ids) + len(seg.completion_ids):], seg)
        self._busy.add(id(seg))
        self._feeds += 1
        self._used[id(seg)] = self._feeds
        return seg

    def insert(self, ids: list[int], seg: Segment | None = None) -> None:
        """Append tokens the model did not sample (tool output, template tokens) to ``seg``
        (default :attr:`current`): mask 0.

        Raises:
            RuntimeError: no segment is open yet.
        """
        seg = seg or self._open()
        seg.completion_ids += ids
        seg.logprobs += [0.0] * len(ids)
        seg.loss_mask += [0] * len(ids)
        seg.versions += [-1] * len(ids)

    def add_sample(self, ids: list[int], logprobs: list[float], finish_reason: FinishReason = "length",
                   versions: list[int] | None = None, *, seg: Segment | None = None, turn: Turn | None = None) -> None:
        """Append what the engine sampled [n] with its logprobs [n] (mask 1) to ``seg`` (default
        :attr:`current`), which becomes current and is no longer busy; ``versions`` [n]: the
        version that sampled each token (:attr:`Generation.versions`); ``turn``: the call's record.

        Raises:
            RuntimeError: no segment is open, or ``ids`` and ``logprobs`` differ in length.
        """
        if len(ids) != len(logprobs):
            raise RuntimeError(f"engine returned {len(ids)} token ids but {len(logprobs)} logprobs")
        seg = seg or self._open()
        seg.completion_ids += ids
        seg.logprobs += [float(x) for x in logprobs]
        seg.loss_mask += [1] * len(ids)
        seg.versions += list(versions) if versions is not None else [-1] * len(ids)
        seg.calls += 1
        seg.finish_reason = finish_reason
        seg.last = turn
        self.release(seg)
        self._current = seg

    def release(self, seg: Segment) -> None:
        """``seg``'s call ended (sampled, failed or cancelled): later calls may continue it. A
        segment whose first call failed is dropped (it holds nothing sampled)."""
        self._busy.discard(id(seg))
        if seg.calls == 0 and any(s is seg for s in self.segments):
            self.segments = [s for s in self.segments if s is not seg]
            if self._current is seg:
                self._current = self.segments[-1] if self.segments else None

    def completion_tokens(self) -> int:
        """Tokens recorded after the segments' prompts, every segment together (the episode's
        budget, ``rollout.max_total_tokens``, counts these)."""
        return sum(len(s.completion_ids) for s in self.segments)

    def _open(self) -> Segment:
        if self._current is None:
            raise RuntimeError("no segment is open: the first model call starts one")
        return self._current


def distinct_tokens(sequences: list[list[int]]) -> int:
    """How many distinct token positions ``sequences`` hold: the nodes of their prefix tree
    (a token counts once however many sequences share the prefix up to it). With the
    sequences a learner is fed, ``sum(len) - distinct_tokens`` is what it re-fed."""
    root: dict[int, dict] = {}
    count = 0
    for seq in sequences:
        node = root
        for t in seq:
            nxt = node.get(t)
            if nxt is None:
                nxt = node[t] = {}
                count += 1
            node = nxt
    return count


def token_versions(seg: Segment | None) -> list[int] | None:
    """``seg``'s per-token versions for :attr:`Episode.token_versions`: None when no token has one."""
    if seg is None or all(v < 0 for v in seg.versions):
        return None
    return list(seg.versions)
