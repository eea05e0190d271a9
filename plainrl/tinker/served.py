"""Tinker's ``sample`` through the inference servers of ``rollout.engine: remote`` (vLLM started
by ``plainrl serve``, or SGLang), with the weights pushed by the run's weight sync
(:class:`~plainrl.rollout.engines.served.ServedEngine`).

A sampler is a sampler checkpoint (a peft adapter directory) or the base model. Under
``rollout.sync`` ``auto`` / ``lora`` each sampler checkpoint is loaded on every server as a LoRA
adapter of its own name (at most :data:`ADAPTERS_LOADED` at once, least recently used unloaded),
right after ``save_weights_for_sampler`` writes it and again if it was unloaded, and a request
names the sampler's adapter; the base is the served model itself. Under ``full`` the servers hold
one policy at a time: the sampler's adapter merged into the base, pushed when the sampler differs
from the last one pushed. The directories must be readable by the servers (the same machine,
or ``run_dir`` on a shared file system).
"""

from __future__ import annotations

import uuid
from collections import OrderedDict
from pathlib import Path

import httpx

from plainrl.rollout.engines.requests import EngineError
from plainrl.rollout.engines.served import PushedWeights, ServedEngine
from plainrl.tinker.adapters import Adapters, checkpoint_key
from plainrl.tinker.sampling import SampleCall, engine_params, sequences

ADAPTERS_LOADED = 8
PROBE_TIMEOUT_S = 10.0
BASE = ""  # the key of the base model's weights


def served_context(entries: list[dict]) -> int | None:
    """The least ``max_model_len`` of the servers' ``/v1/models`` entries of their model (vLLM's
    and SGLang's field; an entry without it does not count; None: no entry has it)."""
    lengths = [int(e["max_model_len"]) for e in entries if e.get("max_model_len") is not None]
    return min(lengths) if lengths else None


class ServedSampling:
    """Sampling for the service's samplers on ``engine``'s servers.

    Args:
        engine: the servers (:func:`plainrl.rollout.engines.factory.adapter_servers`), ``sync`` ``lora`` or ``full``.
        adapters: the service's model, whose adapter a ``full`` push merges into the base.
    """

    def __init__(self, engine: ServedEngine, adapters: Adapters):
        self.engine = engine
        self.adapters = adapters
        self._loaded: OrderedDict[str, PushedWeights] = OrderedDict()  # lora: checkpoint key -> its push
        self._current = BASE  # full: the key whose merged weights the servers hold (they start with the base)
        self._prefix = f"tinker-{uuid.uuid4().hex[:8]}"  # a server may outlive this process: names of its own
        self._count = 0

    def context(self) -> int | None:
        """The longest prompt plus completion every server takes: the least ``max_model_len`` their
        ``/v1/models`` entries of the served model list (None: none lists one).

        Raises:
            EngineError: a server did not answer.
        """
        entries = []
        for url, name in zip(self.engine.urls, self.engine.models):
            try:
                listed = self.engine.client.get(f"{url}/v1/models", timeout=PROBE_TIMEOUT_S).raise_for_status().json()
            except httpx.HTTPError as e:
                raise EngineError(f"inference server {url}: GET /v1/models failed ({e})") from e
            entries += [m for m in listed.get("data", []) if m.get("id") == name]
        return served_context(entries)

    def push(self, directory: Path | None) -> PushedWeights:
        """Make the servers hold the sampler checkpoint in ``directory`` (None: the base model),
        unless they do; runs on the service's worker (a ``full`` push reads the model).

        Raises:
            EngineError: no server took the weights.
        """
        key = BASE if directory is None else checkpoint_key(directory)
        if self.engine.sync == "full":
            if key != self._current:
                name = None if directory is None else self.adapters.snapshot(directory)
                with self.adapters.use(name) as model:
                    self.engine.load_weights(model)
                self._current = key
            return self.engine.pushed()
        if directory is None:
            return PushedWeights(adapter=None, servers=tuple(self.engine.pool.live()))
        if key in self._loaded:
            self._loaded.move_to_end(key)
            return self._loaded[key]
        while len(self._loaded) >= ADAPTERS_LOADED:
            _, old = self._loaded.popitem(last=False)
            self.engine.unload_adapter(old.adapter)
        self._count += 1
        pushed = self.engine.load_adapter(f"{self._prefix}-{self._count}", directory)
        self._loaded[key] = pushed
        return pushed

    def forget(self, directory: Path) -> None:
        """Unload the sampler checkpoint in ``directory`` (about to be deleted) from the servers,
        if it is loaded there as an adapter of its own (``lora``; under ``full`` the servers keep
        whatever they hold until the next push)."""
        key = checkpoint_key(directory)
        pushed = self._loaded.get(key)
        if pushed is not None:  # unloaded, then forgotten: a close() meanwhile unloads it (again) itself
            self.engine.unload_adapter(pushed.adapter)
            self._loaded.pop(key, None)

    def sample(self, directory: Path | None, call: SampleCall) -> list[tuple[list[int], list[float], str]]:
        """``call``'s samples from the sampler in ``directory`` (None: the base), on the servers.

        Returns:
            per sample (token ids, logprobs as the server computed them, ``stop`` | ``length``).
        Raises:
            EngineError: no server answered, or one refused the request.
        """
        self.engine.follow(self.push(directory))
        params, seeds = engine_params(call)
        return sequences(self.engine.generate([call.prompt] * call.num_samples, params, seeds=seeds))

    def close(self) -> None:
        """Unload this service's adapters from the servers (best effort); they keep running."""
        for pushed in list(self._loaded.values()):  # the worker may be forgetting one meanwhile
            self.engine.unload_adapter(pushed.adapter)
        self._loaded.clear()
        self.engine.close()
