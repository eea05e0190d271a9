"""Partial rollouts (``rollout.partial``): a weight push lands mid-batch instead of waiting for
every completion in flight, and sampling continues under the new weights from the tokens
already sampled.

:class:`PartialEngine` wraps any :class:`~plainrl.rollout.engines.base.Engine` and samples a
``generate`` call in pieces, each one call of the inner engine on the prompt plus the
completion so far (continuing from token ids, never re-tokenised: the server's prefix cache or
the embedded engine's prefill recomputes the context under the piece's weights); rows that
ended (EOS, a stop string, the token budget) leave. ``load_weights`` closes a gate, waits for
the pieces running in every thread to stop, pushes, and reopens it, so no piece mixes two
versions. How a piece ends (``rollout.partial_by``):

- ``abort`` (vLLM servers): a piece runs to the end of the completion, streamed; a push sets an
  interrupt, every open request is closed at its next streamed token (vLLM aborts a request
  whose client has gone) and keeps the tokens it streamed. A push waits for one token.
- ``chunks`` (any engine): a piece is at most ``partial_chunk`` tokens, so a push waits for one
  chunk at most, at the price of a prefill per chunk.

Each token records the version of the piece that sampled it (``Generation.versions``) next
to its logprob under that version, which the loss uses as the behaviour logprob. The same
design as AReaL's interruptible generation and slime's partial rollouts (abort at a weight
update, continue from the tokens kept). A piece's seed is derived from the call's seed and the
piece's index (:func:`plainrl.rollout.seeding.derive_seed`), so a completion depends on its
seed and on where the pushes landed.
"""

from __future__ import annotations

import dataclasses
import threading
from typing import Callable

import torch

from plainrl.rollout.engines.base import Engine
from plainrl.rollout.seeding import derive_seed
from plainrl.types import Generation, SamplingParams


STOP_MARGIN = 4  # tokens of context beyond a stop string's length around a piece boundary


def stop_cut(tokens: list[int], boundary: int, stop: tuple[str, ...], decode: Callable[[list[int]], str], *,
             margin: int = STOP_MARGIN) -> int | None:
    """Where a stop string that spans a piece boundary ends: the length of the shortest prefix of
    ``tokens`` whose text holds one of ``stop``, searched only around ``boundary``.

    ``tokens[:boundary]`` are the earlier pieces (whose text held no stop string) and
    ``tokens[boundary:]`` the new piece, whose engine already stopped at any stop string wholly
    inside it (``SamplingParams.stop``). So a stop string still to find starts before the
    boundary and ends after it. A token decodes to at least one character (but for a few: special
    tokens, pieces of one UTF-8 character), so it lies within ``reach = max(len(s) for s in stop)
    + margin`` tokens on either side; the margin covers those few, and that the first tokens of a
    decoded slice may read differently than in context (a leading space).
    Only that window is decoded: a check per piece costs O(reach) tokens, not the completion's
    length (it was the whole completion, then every prefix of it, per piece).

    Args:
        tokens: [L] the completion so far, the new piece included.
        boundary: the new piece's first index (0 < boundary <= L).
        stop: the stop strings (non-empty strings).
        decode: token ids -> text (the tokenizer's, special tokens skipped).
        margin: tokens of context beyond the longest stop string.
    Returns:
        k in (boundary, L]: ``tokens[:k]`` is the completion up to the end of the first stop
        string that spans the boundary (or lies within reach after it); None when none does.
    """
    if not stop or boundary >= len(tokens):
        return None
    reach = max(len(s) for s in stop) + margin
    start, end = max(0, boundary - reach), min(len(tokens), boundary + reach)
    if not any(s in decode(tokens[start:end]) for s in stop):
        return None
    for k in range(boundary + 1, end + 1):
        if any(s in decode(tokens[start:k]) for s in stop):
            return k
    return None


class PartialEngine:
    """An engine whose weight pushes land mid-batch (module docstring).

    Args:
        inner: the engine that samples.
        tokenizer: to find a stop string that spans two pieces.
        chunk: ``by="chunks"``: decode tokens per inner call (the most a push waits for).
        by: ``chunks``, ``abort`` (the inner engine's ``generate_until``: vLLM servers) or
            ``auto`` (abort where the inner engine is ``interruptible``), ``rollout.partial_by``.
        version: the version the inner engine's weights hold now.

    Raises:
        ValueError: ``chunk < 1``; ``by="abort"`` over an engine that cannot abort a request.
    """

    def __init__(self, inner: Engine, tokenizer, *, chunk: int, by: str = "auto", version: int = 0):
        if chunk < 1:
            raise ValueError(f"rollout.partial_chunk must be at least 1 token, got {chunk}")
        if by not in ("auto", "abort", "chunks"):
            raise ValueError(f"rollout.partial_by must be auto, abort or chunks, got {by!r}")
        can_abort = bool(getattr(inner, "interruptible", False))
        if by == "abort" and not can_abort:
            raise ValueError(f"rollout.partial_by=abort: {type(inner).__name__} cannot abort a request mid-stream "
                             "(only vLLM servers can); set rollout.partial_by=chunks")
        self.inner, self.tokenizer, self.chunk, self.version = inner, tokenizer, chunk, version
        self.by = "abort" if by == "abort" or (by == "auto" and can_abort) else "chunks"
        self._cv = threading.Condition()
        self._running = 0  # engine calls running, over every thread
        self._closed_gate = False
        self._interrupt = threading.Event()  # by abort: set while a push waits for the calls to stop

    def __getattr__(self, name):  # pad_id, model, device, pushed(), ...: the inner engine's
        if name == "inner":  # (not set yet: a copy or unpickling in progress)
            raise AttributeError(name)
        return getattr(self.inner, name)

    def load_weights(self, model: torch.nn.Module, version: int | None = None) -> None:
        """Push ``model``'s weights once no engine call is running (by abort: once the calls
        running have aborted their requests; new calls wait meanwhile); ``version``: what later
        tokens record (None: unchanged)."""
        with self._cv:
            self._closed_gate = True
            if self.by == "abort":
                self._interrupt.set()
            while self._running:
                self._cv.wait()
        try:
            self.inner.load_weights(model)
            if version is not None:
                self.version = version
        finally:
            with self._cv:
                self._interrupt.clear()
                self._closed_gate = False
                self._cv.notify_all()

    def _piece(self, prompts: list[list[int]], params: SamplingParams, seeds: list[int] | None,
               budgets: list[int]) -> tuple[list[tuple[Generation, bool]], int]:
        """One inner call on ``prompts`` (prompt + tokens so far), each with its token budget:
        ``(generation, finished)`` per prompt and the version that sampled them. By chunks, a
        piece is at most ``chunk`` tokens; by abort, it runs until done or a push interrupts it."""
        with self._cv:
            while self._closed_gate:
                self._cv.wait()
            self._running += 1
            version = self.version
        try:
            if params.structured_outputs is not None:  # whole (a push waits for it): see generate
                gens = self.inner.generate(prompts, dataclasses.replace(params, max_new_tokens=budgets[0]), seeds=seeds)
                return [(g, True) for g in gens], version
            if self.by == "abort":
                return self.inner.generate_until(prompts, params, budgets=budgets, interrupt=self._interrupt,
                                                 seeds=seeds), version
            n = min(self.chunk, budgets[0])  # (by chunks every live row has sampled as many tokens)
            gens = self.inner.generate(prompts, dataclasses.replace(params, max_new_tokens=n), seeds=seeds)
            return [(g, g.finish_reason != "length" or len(g.token_ids) >= b) for g, b in zip(gens, budgets)], version
        finally:
            with self._cv:
                self._running -= 1
                self._cv.notify_all()

    def _decode(self, tokens: list[int]) -> str:
        return self.tokenizer.decode(tokens, skip_special_tokens=True)

    def generate(self, prompts: list[list[int]], params: SamplingParams, *,
                 seeds: list[int] | None = None) -> list[Generation]:
        """Sample as the inner engine does, in pieces (module docstring); every returned
        :class:`Generation` carries ``versions``, one per token. A structured-outputs request
        (``params.structured_outputs``) is one piece, never continued: the grammar's state is the
        sample's, which a continuation from token ids would restart."""
        toks: list[list[int]] = [[] for _ in prompts]
        lps: list[list[float]] = [[] for _ in prompts]
        vers: list[list[int]] = [[] for _ in prompts]
        finish: list[str | None] = [None] * len(prompts)
        c = 0
        while True:
            live = [i for i, f in enumerate(finish) if f is None]
            if not live:
                break
            piece_seeds = None if seeds is None else [derive_seed(seeds[i], c) for i in live]
            pieces, version = self._piece([prompts[i] + toks[i] for i in live], params, piece_seeds,
                                          [params.max_new_tokens - len(toks[i]) for i in live])
            for i, (g, finished) in zip(live, pieces):
                boundary = len(toks[i])
                toks[i] += g.token_ids
                lps[i] += g.logprobs
                vers[i] += [version] * len(g.token_ids)
                spans = params.stop and boundary and not (finished and g.finish_reason == "stop")
                cut = stop_cut(toks[i], boundary, params.stop, self._decode) if spans else None
                if cut is not None:  # a stop string across two pieces
                    toks[i], lps[i], vers[i], finish[i] = toks[i][:cut], lps[i][:cut], vers[i][:cut], "stop"
                elif finished:
                    finish[i] = g.finish_reason
                elif len(toks[i]) >= params.max_new_tokens:  # interrupted on its last token
                    finish[i] = "length"
            c += 1
        return [Generation(token_ids=t, logprobs=lp, finish_reason=f, versions=v)
                for t, lp, f, v in zip(toks, lps, finish, vers)]

    def offload(self) -> None:
        self.inner.offload()

    def take_metrics(self) -> dict[str, float]:
        return self.inner.take_metrics()

    def close(self) -> None:
        self.inner.close()
