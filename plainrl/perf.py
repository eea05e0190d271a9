"""Resource and throughput metrics of each step: ``system/*`` (memory, CPU, GPU memory) and
``perf/*`` (tokens per second, model FLOPs utilisation).

MFU follows PaLM's definition (Chowdhery et al. 2022, arXiv:2204.02311, App. B): the
FLOPs the model needs for the tokens trained, over the device's peak, ignoring
recomputation. Per token, a forward pass costs 2 FLOPs per weight of every linear layer
(the LM head included; the embedding lookup is free) plus attention's 2 * 2 * d * s / 2
per layer (QK^T and AV over on average s/2 causal positions, s the sequence length), and
the backward pass costs the forward twice for full fine-tuning (gradients of the
activations and of the weights) but once for a frozen base under LoRA (activations only;
the adapters' own FLOPs are negligible). The learner's extra forwards (old or reference
logprobs) are not counted, as PaLM does not count rematerialisation.
"""

from __future__ import annotations

import re

import psutil
import torch

# Dense bf16/fp16 tensor-core peaks (FLOP/s, without sparsity) from the vendors' data sheets,
# matched against torch.cuda.get_device_name() by whole words, first match wins: the specific
# forms (H100 PCIe / NVL) come before the plain name, and "L40" never matches "L40S" or "L4"
# (a substring match read "NVIDIA L40S" as L4 and every H100 as the SXM part). Used when
# train.peak_flops is not given and the model is in 16-bit. Float32 peaks differ by device and
# TF32 setting: give train.peak_flops.
PEAK_BF16_FLOPS: tuple[tuple[str, float], ...] = (
    (r"\bB200\b", 2250e12),
    (r"\bH200\b.*\bNVL\b", 835e12),
    (r"\bG?H200\b", 989e12),          # H200 SXM; GH200's GPU is an H100/H200 SXM die
    (r"\bH100\b.*\bPCIe\b", 756e12),
    (r"\bH100\b.*\bNVL\b", 835e12),
    (r"\bH100\b", 989e12),            # "NVIDIA H100 80GB HBM3": the SXM part
    (r"\bH800\b.*\bPCIe\b", 756e12),
    (r"\bH800\b", 989e12),
    (r"\bA[18]00\b", 312e12),          # SXM and PCIe alike
    (r"\bL40S\b", 362e12),
    (r"\bL40\b", 181e12),
    (r"\bL4\b", 121e12),
    (r"\bA10G?\b", 125e12),
)


def device_peak_bf16(name: str) -> float | None:
    """The dense bf16 peak (FLOP/s) of the CUDA device called ``name`` (as
    ``torch.cuda.get_device_name`` gives it, e.g. ``"NVIDIA H100 PCIe"``), or None for a
    device not in :data:`PEAK_BF16_FLOPS`."""
    return next((peak for pattern, peak in PEAK_BF16_FLOPS if re.search(pattern, name, re.IGNORECASE)), None)


def resident_peak_gb() -> float | None:
    """This process's resident high-water mark (``VmHWM`` of ``/proc/self/status``, GB): its
    peak since it started. None where there is no such file (macOS, Windows, some sandboxes).

    The RSS sampled at a step's end misses the step's peak: activations kept for backward
    and a rollout's KV cache are freed by then, and the peak is what runs out of memory.
    Never reset here (``/proc/self/clear_refs``): a reset also lowers the peak that
    ``getrusage`` (``/usr/bin/time``) reports for the process; the memory benchmarks, which
    measure phases, reset it themselves."""
    try:
        with open("/proc/self/status") as f:
            kb = next(int(line.split()[1]) for line in f if line.startswith("VmHWM:"))
    except (OSError, StopIteration, ValueError):
        return None
    return kb * 1024 / 1e9


class SystemMonitor:
    """``system/rss_gb`` (this process's resident memory, GB, at the step's end),
    ``system/rss_peak_gb`` (its resident peak so far, on Linux: :func:`resident_peak_gb`; the
    step that raised it is the step whose value grew), ``system/cpu_percent`` (its CPU use
    since the previous call, 100 = one core busy) and, on CUDA, ``system/gpu_mem_allocated_gb``
    and ``system/gpu_mem_peak_gb`` (the step's peak: the peak counter is reset after each read).
    Worker processes (environments, rewards, the sandbox) are not counted. The resident peak
    is not reset between steps, so that ``/usr/bin/time`` still reports it at the end."""

    def __init__(self, device: torch.device):
        self.process = psutil.Process()
        self.process.cpu_percent(None)  # the first call only starts the measurement
        self.cuda = device.type == "cuda"

    def metrics(self) -> dict[str, float]:
        out = {"system/rss_gb": self.process.memory_info().rss / 1e9,
               "system/cpu_percent": self.process.cpu_percent(None)}
        peak = resident_peak_gb()
        if peak is not None:
            out["system/rss_peak_gb"] = peak
        if self.cuda:
            out["system/gpu_mem_allocated_gb"] = torch.cuda.memory_allocated() / 1e9
            out["system/gpu_mem_peak_gb"] = torch.cuda.max_memory_allocated() / 1e9
            torch.cuda.reset_peak_memory_stats()
        return out


def linear_params(model: torch.nn.Module) -> int:
    """Weights of every ``nn.Linear`` in ``model`` (LoRA's own small matrices included), the
    layers whose matmuls dominate a transformer's FLOPs."""
    return sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear))


def training_flops(seq_lens: list[int], *, linear: int, layers: int, hidden: int, frozen_base: bool,
                   passes: int = 1) -> float:
    """Model FLOPs of training on sequences of ``seq_lens`` tokens, ``passes`` times (PaLM, App. B).

    forward per token = 2 * linear + 2 * layers * hidden * s (causal attention over s/2
    positions on average, QK^T and AV); training = 3x forward, 2x under a frozen base.

    Example: one sequence of 4 tokens, linear = 10, 1 layer, hidden 2, full fine-tuning:
    forward = 4 * (2 * 10 + 2 * 1 * 2 * 4) = 4 * 36 = 144; training = 3 * 144 = 432.
    """
    forward = sum(s * (2 * linear + 2 * layers * hidden * s) for s in seq_lens)
    return forward * (2 if frozen_base else 3) * passes


class FlopCounter:
    """:func:`training_flops` for one model: its linear weights, layers and width read once.

    Args:
        model: the policy (a peft model under LoRA: then the base is frozen).
        passes: optimisation passes over each step's episodes (``algorithm.ppo_epochs``).
    """

    def __init__(self, model: torch.nn.Module, passes: int = 1):
        config = getattr(model, "config", None)
        self.linear = linear_params(model)
        self.layers = int(getattr(config, "num_hidden_layers", 0) or 0)
        heads, head_dim = getattr(config, "num_attention_heads", 0), getattr(config, "head_dim", None)
        self.hidden = int(heads * head_dim) if heads and head_dim else int(getattr(config, "hidden_size", 0) or 0)
        self.frozen_base = hasattr(model, "peft_config")
        self.passes = passes

    def __call__(self, seq_lens: list[int]) -> float:
        return training_flops(seq_lens, linear=self.linear, layers=self.layers, hidden=self.hidden,
                              frozen_base=self.frozen_base, passes=self.passes)


def peak_flops(device: torch.device, dtype: torch.dtype, configured: float | None) -> float | None:
    """FLOP/s to divide by: ``train.peak_flops`` when set, else the data-sheet bf16 peak of a
    known CUDA device in 16-bit, else None (MFU is then not logged)."""
    if configured is not None:
        return configured
    if device.type != "cuda" or dtype not in (torch.bfloat16, torch.float16):
        return None
    return device_peak_bf16(torch.cuda.get_device_name(device))


def throughput(*, completion_tokens: int, generate_s: float, train_tokens: int, update_s: float,
               flops: float | None = None, peak: float | None = None) -> dict[str, float]:
    """``perf/gen_tokens_per_s`` (completion tokens over the generation seconds),
    ``perf/train_tokens_per_s`` (tokens trained over the update seconds) and ``perf/mfu``
    (``flops`` / update seconds / ``peak``, when both are known); a phase of 0 s is omitted."""
    out: dict[str, float] = {}
    if generate_s > 0:
        out["perf/gen_tokens_per_s"] = completion_tokens / generate_s
    if update_s > 0:
        out["perf/train_tokens_per_s"] = train_tokens / update_s
        if flops is not None and peak:
            out["perf/mfu"] = flops / update_s / peak
    return out
