"""The vLLM server ``plainrl serve`` starts for a config (which engine a run samples with is
:mod:`plainrl.rollout.engines.factory`'s)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import NoReturn

from plainrl.config import Config, ConfigError
from plainrl.models import resolve_device
from plainrl.rollout.engines.factory import vllm_args


def serve_command(cfg: Config, *, host: str, port: int, colocated: bool = False) -> tuple[list[str], dict[str, str]]:
    """The argv and environment of a vLLM server for ``cfg``'s model that a run with
    ``rollout.engine=remote`` and the same model can sample from and sync weights to.

    LoRA is enabled when the run would sync adapters (``model.lora.enabled`` and
    ``rollout.sync`` not ``full``), with the adapter's rank (``model.adapter``'s own). On a GPU
    of its own (the default) the server takes 0.9 of its memory (``gpu_memory_utilization:
    auto``) and no sleep mode; ``colocated`` (it shares the trainer's GPU) keeps the config's
    sleep mode and needs an explicit share.

    Raises:
        ConfigError: ``colocated`` with ``rollout.vllm.gpu_memory_utilization: auto``.
    """
    from plainrl.rollout.engines.serve_command import server_argv, server_env

    lora_rank = None
    if cfg.model.lora.enabled and cfg.rollout.sync != "full":
        lora_rank = cfg.model.lora.r
        if cfg.model.adapter is not None:
            adapter_cfg = Path(cfg.model.adapter) / "adapter_config.json"
            if adapter_cfg.is_file():
                lora_rank = int(json.loads(adapter_cfg.read_text())["r"])
    from plainrl.rollout.engines.vllm_local import SERVER_MEMORY_SHARE

    share = cfg.rollout.vllm.gpu_memory_utilization
    if colocated and share == "auto":
        raise ConfigError("plainrl serve --colocated shares the trainer's GPU, whose free memory the server cannot "
                          "see: give its share as rollout.vllm.gpu_memory_utilization=0.3 (say)")
    args = vllm_args(cfg.model, cfg.rollout, resolve_device(cfg.device), lora_rank, seed=cfg.seed,
                     memory_share=SERVER_MEMORY_SHARE if share == "auto" else share,
                     sleep=cfg.rollout.vllm.sleep and colocated)
    return (server_argv(args, served_name=cfg.model.name, host=host, port=port),
            server_env(cfg.rollout.vllm.cpu_kv_cache_gb, shared_dir=cfg.rollout.remote.shared_dir))


def serve(cfg: Config, *, host: str, port: int, colocated: bool = False) -> NoReturn:
    """Replace this process with the vLLM server of :func:`serve_command`.

    Raises:
        EngineError: vLLM is not installed.
    """
    from plainrl.rollout.engines.vllm_local import import_vllm

    import_vllm()
    argv, env = serve_command(cfg, host=host, port=port, colocated=colocated)
    print("plainrl serve: " + " ".join(argv[1:]), flush=True)
    os.execvpe(argv[0], argv, env)
