"""The stability information of ``stable_reinforce``: what the service records about a sampled
sequence when the sampling request asks for it (``record_stability_info``), and how a training
datum's provenance (``Datum.with_provenance``: runs of positions, each naming a sampled sequence
by its ``sequence_id``) is resolved against those records.

A record holds the sequence's prompt ids, sampled ids and the sampler's logprobs of them. A datum's
``loss_fn_input_spans`` tile its targets: a :class:`Span` of kind ``sampled`` claims that targets
``[i, i + length)`` are the named sequence's sampled tokens ``[offset, offset + length)``, one of
kind ``prompt`` that they are positions of its prompt. Sampled runs are checked token by token,
and take the recorded logprobs as the sampling policy's; prompt runs are checked to lie within
the prompt only (the cookbook's ``rl_loop`` writes 0 as their target tokens; its advantages are 0
there) and keep the client's ``logprobs``. A record belongs to the session that sampled it: only
that session's training clients may name it (Tinker's "provenance works only within one
session"). Records live for
:data:`TTL_S` after their last use (Tinker's docs: one day after sampling, restarted by each
training request that uses them), at most :data:`MAX_RECORDS` of them.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Literal

import numpy as np

from plainrl.tinker.errors import UserError

TTL_S = 24 * 3600.0
# a bound on memory whatever the TTL: 64k sequences of ~1k tokens, ~1 GB of int32 ids and float32 logprobs
MAX_RECORDS = 65536


def session_of(client_id: str) -> str:
    """The session of a training model's or a sampler's id (``<session>:train:<k>``, ``<session>:sample:<k>``)."""
    return client_id.split(":", 1)[0]


@dataclass(frozen=True)
class Span:
    """One run of a datum's provenance (the SDK's ``PromptProvenanceSpan`` / ``SampledProvenanceSpan``)."""

    kind: Literal["prompt", "sampled"]
    sequence_id: str
    offset: int
    length: int


@dataclass
class Record:
    """One sampled sequence as the sampler produced it: ``prompt`` [P] and ``tokens`` [L] ids,
    ``logprobs`` [L] the sampler's logprobs of ``tokens``."""

    prompt: np.ndarray
    tokens: np.ndarray
    logprobs: np.ndarray
    session: str
    used: float


class StabilityRecords:
    """The recorded sequences of this service, by ``sequence_id`` (thread-safe: the routes record,
    the worker resolves)."""

    def __init__(self, ttl_s: float = TTL_S, max_records: int = MAX_RECORDS):
        self.ttl_s, self.max_records = ttl_s, max_records
        self._records: OrderedDict[str, Record] = OrderedDict()
        self._lock = threading.Lock()

    def record(self, sequence_id: str, session: str, prompt: list[int], tokens: list[int],
               logprobs: list[float]) -> None:
        """Keep what ``sequence_id`` sampled in ``session`` (evicting the least recently used beyond the bound)."""
        rec = Record(np.asarray(prompt, dtype=np.int64), np.asarray(tokens, dtype=np.int64),
                     np.asarray(logprobs, dtype=np.float32), session, time.time())
        with self._lock:
            self._records[sequence_id] = rec
            self._records.move_to_end(sequence_id)
            self._expire()

    def _expire(self) -> None:
        now = time.time()
        while self._records:
            key, oldest = next(iter(self._records.items()))
            if len(self._records) <= self.max_records and now - oldest.used <= self.ttl_s:
                break
            del self._records[key]

    def get(self, sequence_id: str, session: str, where: str) -> Record:
        """The record of ``sequence_id`` for a training client of ``session``, its lifetime restarted.

        Raises:
            UserError: no such record (never sampled with ``record_stability_info``, or expired), or
                one sampled in another session.
        """
        with self._lock:
            self._expire()
            rec = self._records.get(sequence_id)
            if rec is None:
                raise UserError(f"{where}: sequence_id {sequence_id!r} has no stability information here; sample it "
                                "with a sampling client created with record_stability_info=True (records expire a day "
                                "after their last use)")
            if rec.session != session:
                raise UserError(f"{where}: sequence_id {sequence_id!r} was sampled in another session; provenance "
                                "names sequences of the training client's own session only")
            rec.used = time.time()
            self._records.move_to_end(sequence_id)
            return rec

    def sampling_logprobs(self, spans: list[Span], targets: np.ndarray, client_logprobs: np.ndarray,
                          session: str, where: str) -> tuple[np.ndarray, np.ndarray]:
        """The sampling policy's logprobs [N] of a datum's targets [N]: the recorded ones on the
        positions its spans name as sampled tokens, the client's elsewhere; and ``sampled`` [N]
        float32, 1 on those positions.

        Raises:
            UserError: spans that do not tile the targets, an unknown sequence, a run outside its
                sequence, or a target that is not the sampled token its span claims (the message names
                the datum, the position and both tokens).
        """
        total = sum(s.length for s in spans)
        if total != len(targets):
            raise UserError(f"{where}: the provenance spans cover {total} positions, and target_tokens has "
                            f"{len(targets)}; they must tile it exactly (Datum.with_provenance)")
        out = np.array(client_logprobs, dtype=np.float32, copy=True)
        sampled = np.zeros(len(targets), dtype=np.float32)
        pos = 0
        for s in spans:
            rec = self.get(s.sequence_id, session, where)
            source = rec.tokens if s.kind == "sampled" else rec.prompt
            if s.offset + s.length > len(source):
                raise UserError(f"{where}: a {s.kind} span [{s.offset}, {s.offset + s.length}) of sequence "
                                f"{s.sequence_id!r}, which has {len(source)} {s.kind} tokens")
            claimed = source[s.offset: s.offset + s.length]
            given = targets[pos: pos + s.length]
            bad = np.nonzero(claimed != given)[0] if s.kind == "sampled" else ()
            if len(bad):
                i = int(bad[0])
                raise UserError(f"{where}: target_tokens[{pos + i}] is {int(given[i])}, but its provenance names "
                                f"{s.kind} token {s.offset + i} of sequence {s.sequence_id!r}, which is "
                                f"{int(claimed[i])}")
            if s.kind == "sampled":
                out[pos: pos + s.length] = rec.logprobs[s.offset: s.offset + s.length]
                sampled[pos: pos + s.length] = 1.0
            pos += s.length
        return out, sampled
