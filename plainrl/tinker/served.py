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

from plainrl.rollout.engines.served import PushedWeights, ServedEngine
from plainrl.tinker.adapters import Adapters, checkpoint_key
from plainrl.tinker.sampling import SampleCall, engine_params, sequences

ADAPTERS_LOADED = 8
BASE = ""  # the key of the base model's weights


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
        for pushed in self._loaded.values():
            self.engine.unload_adapter(pushed.adapter)
        self._loaded.clear()
        self.engine.close()
