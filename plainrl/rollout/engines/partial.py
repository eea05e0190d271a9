"""Partial rollouts (``rollout.partial``): a weight push lands between decode chunks instead of
waiting for every completion in flight, and sampling continues under the new weights from the
tokens already sampled.

:class:`PartialEngine` wraps any :class:`~plainrl.rollout.engines.base.Engine`. A ``generate``
call decodes in chunks of ``chunk`` tokens: each chunk is one call of the inner engine on the
prompt plus the completion so far (continuing from token ids, never re-tokenised: the server's
prefix cache or the embedded engine's prefill recomputes the context under the weights of the
chunk), and rows that ended (EOS, a stop string, the token budget) leave. ``load_weights``
closes a gate, waits for the chunks running in every thread to finish, pushes, and reopens it,
so a push waits for one chunk at most and no chunk mixes two versions. Each token records the
version of the chunk that sampled it (``Generation.versions``) next to its logprob under that
version, which the loss uses as the behaviour logprob.

The same design as AReaL's interruptible generation and slime's partial rollouts (abort at a
weight update, continue from the tokens kept), with the abort placed at chunk boundaries.
A chunk's seed is derived from the call's seed and the chunk index
(:func:`plainrl.rollout.seeding.derive_seed`), so the completion depends on its seed and on
where the pushes landed.
"""

from __future__ import annotations

import dataclasses
import threading

import torch

from plainrl.rollout.engines.base import Engine
from plainrl.rollout.seeding import derive_seed
from plainrl.types import Generation, SamplingParams


class PartialEngine:
    """An engine whose weight pushes land between decode chunks (module docstring).

    Args:
        inner: the engine that samples.
        tokenizer: to find a stop string that spans two chunks.
        chunk: decode tokens per inner call (the most a push waits for).
        version: the version the inner engine's weights hold now.

    Raises:
        ValueError: ``chunk < 1``.
    """

    def __init__(self, inner: Engine, tokenizer, *, chunk: int, version: int = 0):
        if chunk < 1:
            raise ValueError(f"rollout.partial_chunk must be at least 1 token, got {chunk}")
        self.inner, self.tokenizer, self.chunk, self.version = inner, tokenizer, chunk, version
        self._cv = threading.Condition()
        self._running = 0  # chunks being decoded, over every thread
        self._closed_gate = False

    def __getattr__(self, name):  # pad_id, model, device, pushed(), ...: the inner engine's
        if name == "inner":  # (not set yet: a copy or unpickling in progress)
            raise AttributeError(name)
        return getattr(self.inner, name)

    def load_weights(self, model: torch.nn.Module, version: int | None = None) -> None:
        """Push ``model``'s weights once no chunk is running (new chunks wait meanwhile);
        ``version``: what later chunks record (None: unchanged)."""
        with self._cv:
            self._closed_gate = True
            while self._running:
                self._cv.wait()
        try:
            self.inner.load_weights(model)
            if version is not None:
                self.version = version
        finally:
            with self._cv:
                self._closed_gate = False
                self._cv.notify_all()

    def _chunk(self, prompts: list[list[int]], params: SamplingParams,
               seeds: list[int] | None) -> tuple[list[Generation], int]:
        with self._cv:
            while self._closed_gate:
                self._cv.wait()
            self._running += 1
            version = self.version
        try:
            return self.inner.generate(prompts, params, seeds=seeds), version
        finally:
            with self._cv:
                self._running -= 1
                self._cv.notify_all()

    def _stop_at(self, tokens: list[int], stop: tuple[str, ...]) -> int | None:
        """The length of the shortest prefix of ``tokens`` whose text holds a stop string."""
        text = self.tokenizer.decode(tokens, skip_special_tokens=True)
        if not any(s in text for s in stop):
            return None
        for k in range(1, len(tokens) + 1):
            if any(s in self.tokenizer.decode(tokens[:k], skip_special_tokens=True) for s in stop):
                return k
        return None

    def generate(self, prompts: list[list[int]], params: SamplingParams, *,
                 seeds: list[int] | None = None) -> list[Generation]:
        """Sample as the inner engine does, in chunks (module docstring); every returned
        :class:`Generation` carries ``versions``, one per token."""
        toks: list[list[int]] = [[] for _ in prompts]
        lps: list[list[float]] = [[] for _ in prompts]
        vers: list[list[int]] = [[] for _ in prompts]
        finish: list[str | None] = [None] * len(prompts)
        c = 0
        while True:
            live = [i for i, f in enumerate(finish) if f is None]
            if not live:
                break
            n = min(self.chunk, params.max_new_tokens - len(toks[live[0]]))
            chunk_seeds = None if seeds is None else [derive_seed(seeds[i], c) for i in live]
            gens, version = self._chunk([prompts[i] + toks[i] for i in live],
                                        dataclasses.replace(params, max_new_tokens=n), chunk_seeds)
            for i, g in zip(live, gens):
                toks[i] += g.token_ids
                lps[i] += g.logprobs
                vers[i] += [version] * len(g.token_ids)
                cut = self._stop_at(toks[i], params.stop) if params.stop and g.finish_reason != "stop" else None
                if cut is not None:  # a stop string across two chunks
                    toks[i], lps[i], vers[i], finish[i] = toks[i][:cut], lps[i][:cut], vers[i][:cut], "stop"
                elif g.finish_reason != "length" or len(toks[i]) >= params.max_new_tokens:
                    finish[i] = g.finish_reason
            c += 1
        return [Generation(token_ids=t, logprobs=lp, finish_reason=f, versions=v)
                for t, lp, f, v in zip(toks, lps, finish, vers)]

    def offload(self) -> None:
        self.inner.offload()

    def take_metrics(self) -> dict[str, float]:
        return self.inner.take_metrics()

    def close(self) -> None:
        self.inner.close()
