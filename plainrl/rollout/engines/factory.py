"""Which rollout engine a run samples with (``rollout.engine``): the one place that turns the
config's ``model`` and ``rollout`` sections into an engine (``plainrl train``, ``plainrl eval``,
``plainrl tinker``'s servers). Takes the sections and explicit values, not the whole config, so
that ``tinker/`` and ``run/`` both build engines here."""

from __future__ import annotations

import copy
import os
from typing import Any

import torch
from transformers import PreTrainedTokenizerBase

from plainrl.config import ConfigError, ModelConfig, RolloutConfig
from plainrl.models import model_dtype, resolve_model_path
from plainrl.rollout.engines.base import Engine
from plainrl.rollout.engines.hf import HFEngine
from plainrl.rollout.engines.partial import PartialEngine
from plainrl.rollout.engines.sync import SyncMode, resolve_sync


def vllm_args(model_cfg: ModelConfig, rollout: RolloutConfig, device: torch.device, lora_rank: int | None, *,
              seed: int, memory_share: float, sleep: bool) -> dict[str, Any]:
    """vLLM engine arguments for ``model_cfg``'s model, in the learner's dtype; ``memory_share``
    and ``sleep`` as resolved for where vLLM runs (:func:`colocated_memory_share`, serve's)."""
    from plainrl.rollout.engines.vllm_local import engine_args

    v = rollout.vllm
    return engine_args(resolve_model_path(model_cfg.name, model_cfg.cache_dir),
                       dtype=str(model_dtype(model_cfg.dtype, device)).removeprefix("torch."),
                       max_model_len=model_cfg.max_context, seed=seed, lora_rank=lora_rank, device=device.type,
                       gpu_memory_utilization=memory_share, sleep=sleep, enforce_eager=v.enforce_eager,
                       extra=v.extra_args)


def colocated_memory_share(model_cfg: ModelConfig, rollout: RolloutConfig, model: torch.nn.Module,
                           device: torch.device) -> tuple[float, str | None]:
    """``rollout.vllm.gpu_memory_utilization`` for vLLM in the trainer's process: as configured,
    or ``auto`` sized from ``model``'s weights, the step's sequences and the device's free memory
    now (:func:`~plainrl.rollout.engines.vllm_local.auto_memory_share`); with the log line of an
    ``auto`` choice (None otherwise, and on CPU, where the share does not apply)."""
    from plainrl.models import unwrap
    from plainrl.rollout.engines.vllm_local import auto_memory_share, kv_bytes_per_token

    share = rollout.vllm.gpu_memory_utilization
    if share != "auto":
        return share, None
    if device.type != "cuda":
        return 0.9, None
    free, total = torch.cuda.mem_get_info(device)
    weights = sum(p.numel() * p.element_size() for p in unwrap(model).parameters())
    r = rollout
    return auto_memory_share(weight_bytes=weights, kv_per_token=kv_bytes_per_token(unwrap(model).config),
                             sequences=r.prompts_per_step * r.group_size, max_model_len=model_cfg.max_context,
                             free_bytes=free, total_bytes=total, sleep=r.vllm.sleep)


def make_engine(model_cfg: ModelConfig, rollout: RolloutConfig, model: torch.nn.Module | None,
                tokenizer: PreTrainedTokenizerBase, device: torch.device, *, seed: int) -> Engine:
    """The rollout engine of ``rollout.engine`` (:func:`_engine`), wrapped in a
    :class:`~plainrl.rollout.engines.partial.PartialEngine` under ``rollout.partial``; ``seed``
    seeds vLLM's sampler."""
    engine = _engine(model_cfg, rollout, model, tokenizer, device, seed)
    if rollout.partial:
        partial = PartialEngine(engine, tokenizer, chunk=rollout.partial_chunk, by=rollout.partial_by)
        if rollout.partial_by == "auto":
            why = ("the servers stream tokens and drop a closed request" if partial.by == "abort" else
                   f"this engine cannot abort a request mid-stream; a push waits for a chunk of "
                   f"rollout.partial_chunk={rollout.partial_chunk} tokens at most")
            print(f"rollout.partial_by: {partial.by} (auto: {why})", flush=True)
        return partial
    return engine


def _engine(model_cfg: ModelConfig, rollout: RolloutConfig, model: torch.nn.Module | None,
            tokenizer: PreTrainedTokenizerBase, device: torch.device, seed: int) -> Engine:
    """The rollout engine of ``rollout.engine`` (and, for ``remote``, ``rollout.remote.backend``:
    vLLM, SGLang or a read-only OpenAI-compatible server; dispatched here only).

    ``hf`` samples with ``model`` itself. ``vllm`` and ``remote`` hold their own copy of the
    weights: the caller pushes ``model``'s with ``engine.load_weights(model)`` before the
    first rollout (an adapter to start from, or a resumed checkpoint, already differs
    from the base the engine loaded), unless :func:`read_only` (then ``model`` may be None).

    Raises:
        ConfigError: ``rollout.sync`` does not fit the model, or the API key's variable is unset.
        EngineError: vLLM missing, or a server unreachable or serving another model.
    """
    r = rollout
    if r.engine == "hf":
        sampler = model if not r.async_steps else sampling_copy(model)
        return HFEngine(sampler, tokenizer, batch_size=r.batch_size, merge_lora=r.merge_lora, decoder=r.decoder)
    if r.engine == "remote":
        return _remote_engine(model_cfg, rollout, model, tokenizer)
    sync = _sync(r.sync, model, lora_is_slow=device.type == "cpu")
    from plainrl.rollout.engines.vllm_local import VLLMEngine

    lora_rank = max(c.r for c in model.peft_config.values()) if sync == "lora" else None
    share, why = colocated_memory_share(model_cfg, rollout, model, device)
    if why is not None:
        print(why, flush=True)
    return VLLMEngine(vllm_args(model_cfg, rollout, device, lora_rank, seed=seed, memory_share=share,
                                sleep=r.vllm.sleep), sync=sync,
                      cpu_kv_cache_gb=r.vllm.cpu_kv_cache_gb)


def sampling_copy(model: torch.nn.Module) -> torch.nn.Module:
    """A frozen copy of ``model`` for the embedded engine under ``rollout.async_steps``: the
    rollout thread samples with it while the learner changes the original, and each weight push
    (``HFEngine.load_weights``) copies the trainable parameters over.

    Raises:
        ConfigError: the model cannot be copied (e.g. some quantized models).
    """
    try:
        clone = copy.deepcopy(model)
    except Exception as e:  # noqa: BLE001  (what deepcopy raises depends on the model's classes)
        raise ConfigError(f"rollout.async_steps with rollout.engine=hf samples with a copy of the model, and this "
                          f"model cannot be copied ({type(e).__name__}: {e}); serve it (rollout.engine=remote) or "
                          "set rollout.async_steps=0") from e
    return clone.requires_grad_(False).eval()


def _sync(requested: str, model: torch.nn.Module, *, lora_is_slow: bool = False) -> SyncMode:
    try:
        return resolve_sync(requested, model, lora_is_slow=lora_is_slow)
    except ValueError as e:
        raise ConfigError(str(e)) from e


def _remote_engine(model_cfg: ModelConfig, rollout: RolloutConfig, model: torch.nn.Module | None,
                   tokenizer: PreTrainedTokenizerBase) -> Engine:
    """The engine of ``rollout.remote.backend`` over the servers at ``rollout.remote.urls``."""
    from plainrl.rollout.engines.openai_compat import OpenAICompatEngine

    rc = rollout.remote
    if rc.backend == "openai":
        return OpenAICompatEngine(rc.urls, tokenizer, timeout_s=rc.timeout_s, connect_timeout_s=rc.connect_timeout_s,
                                  max_model_len=model_cfg.max_context, model=rc.model, api_key=api_key(rc.api_key_env))
    return _servers(model_cfg, rollout, tokenizer, _sync(rollout.sync, model))


def _servers(model_cfg: ModelConfig, rollout: RolloutConfig, tokenizer: PreTrainedTokenizerBase, sync: SyncMode):
    """The trainable engine of ``rollout.remote.backend`` (vLLM's ``plainrl serve`` or SGLang)."""
    from plainrl.rollout.engines.remote import RemoteEngine
    from plainrl.rollout.engines.sglang import SGLangEngine

    rc = rollout.remote
    engine = SGLangEngine if rc.backend == "sglang" else RemoteEngine
    return engine(rc.urls, tokenizer, sync=sync, weights_via=rc.weights_via, group_timeout_s=rc.group_timeout_s,
                  shared_dir=rc.shared_dir, timeout_s=rc.timeout_s, connect_timeout_s=rc.connect_timeout_s,
                  max_model_len=model_cfg.max_context, model=rc.model, api_key=api_key(rc.api_key_env))


def adapter_servers(model_cfg: ModelConfig, rollout: RolloutConfig, tokenizer: PreTrainedTokenizerBase):
    """The servers of ``rollout.engine: remote`` for a process whose policies are LoRA adapters
    of one base that it pushes itself (``plainrl tinker``'s samplers): ``rollout.sync: full``
    pushes an adapter merged into the base, ``auto`` and ``lora`` the adapter.

    Returns:
        a :class:`~plainrl.rollout.engines.served.ServedEngine`.
    Raises:
        ConfigError: ``rollout.engine`` is not ``remote``, or the backend is the read-only
            ``openai``; or the API key's variable is unset.
        EngineError: a server is unreachable or serves another model.
    """
    if rollout.engine != "remote":
        raise ConfigError(f"rollout.engine={rollout.engine}: only the embedded engine (hf) or inference "
                          "servers (remote) sample for plainrl tinker")
    require_trainable_engine(rollout)
    return _servers(model_cfg, rollout, tokenizer, "full" if rollout.sync == "full" else "lora")


def api_key(env_name: str | None) -> str | None:
    """The API key from the environment variable ``rollout.remote.api_key_env`` names.

    Raises:
        ConfigError: the variable is not set.
    """
    if env_name is None:
        return None
    key = os.environ.get(env_name)
    if not key:
        raise ConfigError(f"rollout.remote.api_key_env={env_name}, but the environment variable {env_name} is not "
                          f"set; export it (`export {env_name}=...`) before running")
    return key


def read_only(rollout: RolloutConfig) -> bool:
    """Whether the run's engine samples a served model that the trainer cannot push weights
    to (``rollout.remote.backend: openai``): usable by ``plainrl eval`` only."""
    return rollout.engine == "remote" and rollout.remote.backend == "openai"


def require_trainable_engine(rollout: RolloutConfig) -> None:
    """Refuse, before anything loads, to train with a read-only engine.

    Raises:
        ConfigError: ``rollout.remote.backend=openai`` in a training run.
    """
    if read_only(rollout):
        raise ConfigError("rollout.remote.backend=openai is read-only: an OpenAI-compatible server takes text, not "
                          "the trainer's weights, and its token ids and logprobs are re-tokenised, not exact. It "
                          "serves `plainrl eval` only; to train, use rollout.remote.backend=vllm (`plainrl serve`) "
                          "or sglang (docs/engines.md)")
