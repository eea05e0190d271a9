"""The side of weight sync that runs inside vLLM's worker processes.

vLLM loads this class into every worker (``worker_extension_cls``, vLLM's mechanism
for RL weight updates, as TRL and verl use it) and calls its methods through
``collective_rpc``: in process by ``LLM.collective_rpc``, over HTTP by the server's
``POST /collective_rpc`` (``plainrl serve`` starts vLLM with it). Methods are prefixed
``plainrl_`` because vLLM refuses an extension whose names clash with the worker's.

Full weights travel over a process group where one can be formed (the trainer broadcasts
buckets of whole layers, :mod:`plainrl.rollout.engines.weight_group`; the RPC carries only
their JSON layout), else as safetensors (a file path, or the bytes themselves, base64 over
HTTP): vLLM's RPC passes strings and bytes between processes, and safetensors carries
names, dtypes and shapes without pickle.
"""

from __future__ import annotations

import base64
import json
import os
from pathlib import Path

import torch

WORKER_EXTENSION = "plainrl.rollout.engines.vllm_worker.WeightSyncExtension"


SHARED_DIR_ENV = "PLAINRL_SHARED_DIR"  # set by `plainrl serve` from rollout.remote.shared_dir


def allowed_weight_dirs() -> list[Path]:
    """Where a ``{"path": ...}`` payload may point: ``$PLAINRL_SHARED_DIR`` (``plainrl serve``
    sets it from ``rollout.remote.shared_dir``), else the temporary directories a trainer on
    this machine writes (``<tmp>/plainrl-sync-*``, :class:`~plainrl.rollout.engines.sync.AdapterVersions`)."""
    import tempfile

    shared = os.environ.get(SHARED_DIR_ENV)
    if shared:
        return [Path(shared).resolve()]
    return sorted(Path(tempfile.gettempdir()).resolve().glob("plainrl-sync-*"))


def checked_weight_path(path: str) -> Path:
    """``path`` resolved, if it is a ``.safetensors`` file inside :func:`allowed_weight_dirs`.

    Raises:
        ValueError: anywhere else (``/collective_rpc`` is open to whoever reaches the server, so
            a load may not read arbitrary files of the server's machine).
    """
    resolved = Path(path).resolve()
    allowed = allowed_weight_dirs()
    if resolved.suffix != ".safetensors" or not any(resolved.is_relative_to(d) for d in allowed):
        raise ValueError(f"refused to load weights from {path}: a weight file must be a .safetensors file inside the "
                         f"server's shared directory ({', '.join(map(str, allowed)) or 'none'}; `plainrl serve` takes "
                         f"it from rollout.remote.shared_dir, exported as {SHARED_DIR_ENV})")
    return resolved


def decode_payload(payload: str | bytes) -> dict[str, torch.Tensor]:
    """Named tensors from a sync payload.

    Args:
        payload: safetensors bytes, or a JSON string ``{"path": file}`` (a file inside the
            server's shared directory, :func:`checked_weight_path`) or ``{"safetensors_b64": text}``.
    Returns:
        name -> tensor, Hugging Face parameter names (``model.layers.0.mlp.up_proj.weight``).
    Raises:
        ValueError: a payload of neither form, or a path outside the shared directory.
    """
    from safetensors.torch import load, load_file

    if isinstance(payload, bytes):
        return load(payload)
    spec = json.loads(payload)
    if "path" in spec:
        return load_file(checked_weight_path(spec["path"]))
    if "safetensors_b64" in spec:
        return load(base64.b64decode(spec["safetensors_b64"]))
    raise ValueError(f"weight payload needs 'path' or 'safetensors_b64', got keys {sorted(spec)}")


class WeightSyncExtension:
    """Mixed into vLLM's worker class; ``self.model_runner`` is the worker's."""

    def plainrl_load_weights(self, payload: str | bytes) -> int:
        """Load named tensors (Hugging Face names) into the served model in place.

        Goes through vLLM's in-place reload (``model_runner.reload_weights``), which maps
        Hugging Face names onto vLLM's fused layers (q/k/v into qkv_proj, gate/up into
        gate_up_proj) and redoes the processing vLLM applies after loading (the CPU
        backend repacks weights), then drops the LoRA state derived from the old weights.
        A layer receives all of its tensors or none (a partly loaded fused layer would
        be wrong), which is why the trainer sends whole state dicts.
        Returns the number of tensors received.
        """
        named = decode_payload(payload)
        self.model_runner.reload_weights(weights_iterator=iter(named.items()))
        return len(named)

    def plainrl_join_weight_group(self, host: str, port: int, world_size: int, rank_offset: int, backend: str,
                                  timeout_s: float) -> int:
        """Join the trainer's weight group (its TCP store at ``host:port``) as rank
        ``rank_offset`` + this worker's rank, replacing any group joined before. Blocks until
        every rank has joined. Returns this worker's rank in the group."""
        from plainrl.rollout.engines.weight_group import join_group

        self._plainrl_group = None  # a previous group's ranks are gone with its store
        rank = rank_offset + int(getattr(self, "rank", 0))
        self._plainrl_group = join_group(host, port, world_size, rank, backend, timeout_s)  # type: ignore[arg-type]
        self._plainrl_group_timeout = timeout_s
        return rank

    def plainrl_receive_weights(self, layout: str) -> int:
        """Receive one full sync over the weight group (buckets as ``layout``, the JSON of
        :func:`~plainrl.rollout.engines.weight_group.layout_json`) and load each bucket in place
        as it arrives, through the same reload as :meth:`plainrl_load_weights`. Returns the
        number of tensors received.

        Raises:
            RuntimeError: no group joined, or a broadcast timed out.
        """
        from plainrl.rollout.engines.weight_group import layout_from_json, receive

        group = getattr(self, "_plainrl_group", None)
        if group is None:
            raise RuntimeError("plainrl_receive_weights before plainrl_join_weight_group")
        buckets = layout_from_json(layout)
        device = getattr(self, "device", None) or torch.device("cpu")
        self.model_runner.reload_weights(weights_iterator=receive(group, buckets, device, self._plainrl_group_timeout))
        return sum(len(b) for b in buckets)

    def plainrl_ping(self) -> str:
        """The plainrl version this worker runs (the trainer's start-up check that the
        extension is loaded and the RPC endpoint open)."""
        from importlib.metadata import version

        return version("plainrl")

    def plainrl_weight_sum(self, name: str) -> float:
        """The float64 sum of one of vLLM's own parameters (tests check that a sync landed);
        ``x.weight`` also finds ``x.base_layer.weight`` when vLLM serves with LoRA."""
        params = dict(self.model_runner.model.named_parameters())
        if name not in params and name.endswith(".weight"):
            name = name.removesuffix(".weight") + ".base_layer.weight"
        if name not in params:
            raise KeyError(f"no parameter {name!r}; some are {sorted(params)[:8]}")
        return float(params[name].double().sum())
