"""QLoRA: the frozen base model's linear layers quantized by bitsandbytes, LoRA trained on top
(``model.quantization: nf4 | int8``).

- ``nf4``: 4-bit NormalFloat weights with double-quantized block scales, computed in the
  run's dtype (Dettmers et al. 2023, "QLoRA", arXiv:2305.14314). About 0.52 bytes a weight
  (4 bits plus an 8-bit scale per 64 weights and a float32 per 256 scales).
- ``int8``: LLM.int8() (Dettmers et al. 2022, arXiv:2208.07339): int8 weights, activations
  quantized per row, outlier features kept in 16 bit. About 1 byte a weight.

transformers loads the model through :func:`bnb_config`; the embeddings, the LM head and
the norms stay unquantized. Where bitsandbytes runs: its CUDA backend, and in recent
releases a CPU backend (checked for real on an AVX2-only CPU with bitsandbytes 0.50.2, torch 2.13:
nf4 and int8 forward and backward through LoRA). :func:`check_support` tries a
quantized matmul with a backward pass on the run's device before any model loads, so an
unsupported device fails at start with the fix in the message.
"""

from __future__ import annotations

import functools
import logging

import torch

from plainrl.models.errors import ModelLoadError

# the floor of plainrl's qlora extra (the multi-backend releases; CPU is verified with 0.50.2)
MIN_BITSANDBYTES = "0.46"


def _probe(bnb, quantization: str, device: torch.device, dtype: torch.dtype) -> None:
    """One quantized 64x64 matmul, forward and backward to the input (what LoRA training
    needs of a frozen quantized layer), on ``device``. Raises whatever bitsandbytes raises."""
    weight = torch.randn(64, 64, dtype=dtype)
    x = torch.randn(2, 64, device=device, dtype=dtype, requires_grad=True)
    if quantization == "nf4":
        q, state = bnb.functional.quantize_4bit(weight.to(device), quant_type="nf4", compress_statistics=True)
        y = bnb.matmul_4bit(x, q.t(), quant_state=state)
    else:
        layer = bnb.nn.Linear8bitLt(64, 64, bias=False, has_fp16_weights=False)
        layer.weight = bnb.nn.Int8Params(weight.half(), requires_grad=False, has_fp16_weights=False)
        y = layer.to(device)(x)  # the move to the device quantizes
    y.float().sum().backward()
    if x.grad is None or not torch.isfinite(x.grad).all():
        raise RuntimeError("the backward pass through the quantized matmul gave no finite gradient")


@functools.lru_cache(maxsize=None)
def check_support(quantization: str, device: torch.device, dtype: torch.dtype) -> str:
    """Check that bitsandbytes is installed and runs ``quantization`` on ``device`` in ``dtype``.

    Args:
        quantization: ``nf4`` or ``int8``.
        device: the run's device (``cpu`` or ``cuda``).
        dtype: the run's compute dtype (:func:`plainrl.models.model_dtype`).
    Returns:
        a line for the run's log naming the bitsandbytes version and device.
    Raises:
        ModelLoadError: bitsandbytes missing or too old, or its kernels fail on this device;
            the message names the device and the fix.
    """
    fix = "or set model.quantization=none"
    try:
        import bitsandbytes as bnb
    except ImportError as e:
        raise ModelLoadError(f"model.quantization={quantization} loads the base model through bitsandbytes, which is not "
                             f"installed ({e}): pip install 'bitsandbytes>={MIN_BITSANDBYTES}' (or the plainrl[qlora] "
                             f"extra), {fix}") from None
    from packaging.version import Version

    version = getattr(bnb, "__version__", "0")
    if Version(version) < Version(MIN_BITSANDBYTES):
        raise ModelLoadError(f"model.quantization={quantization}: bitsandbytes {version} is older than {MIN_BITSANDBYTES}, "
                             f"which plainrl needs: pip install -U 'bitsandbytes>={MIN_BITSANDBYTES}', {fix}")
    supported = getattr(bnb, "supported_torch_devices", {"cuda"})
    if device.type not in supported:
        raise ModelLoadError(f"model.quantization={quantization}: bitsandbytes {version} has no backend for device "
                             f"{device.type!r} (it supports {sorted(supported)}); set device=cuda or cpu, {fix}")
    try:
        quiet_int8_cast()
        _probe(bnb, quantization, device, dtype)
    except Exception as e:  # bitsandbytes raises many types for a missing kernel or library
        raise ModelLoadError(f"model.quantization={quantization}: bitsandbytes {version} cannot run {quantization} on "
                             f"{device} in {str(dtype).removeprefix('torch.')} here ({type(e).__name__}: {e}); use a "
                             f"device it supports (CUDA; CPU with a recent bitsandbytes, e.g. 0.50), {fix}") from e
    return f"quantization: {quantization} by bitsandbytes {version} on {device}"


def bnb_config(quantization: str, compute_dtype: torch.dtype, skip_modules: list[str] | None = None):
    """The transformers ``BitsAndBytesConfig`` for ``quantization`` (``nf4`` or ``int8``).

    nf4 takes the QLoRA paper's settings: NF4 weights, double quantization of the block
    scales (~0.4 bits a weight saved), matmuls in ``compute_dtype`` (the run's dtype).
    ``skip_modules``: module names kept in float besides the ones transformers keeps
    (the LM head); a value model's new ``score`` head must be, since it is trained.
    """
    from transformers import BitsAndBytesConfig

    if quantization == "nf4":
        return BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=compute_dtype,
                                  bnb_4bit_use_double_quant=True, llm_int8_skip_modules=skip_modules)
    if quantization == "int8":
        return BitsAndBytesConfig(load_in_8bit=True, llm_int8_skip_modules=skip_modules)
    raise ValueError(f"quantization must be nf4 or int8, got {quantization!r}")


def keep_training_layout(model: torch.nn.Module) -> int:
    """Stop bitsandbytes from repacking nf4 weights for its CPU inference kernel.

    On CPUs with AVX512-BF16, bitsandbytes (0.50) rewrites each 4-bit layer's weight and
    block scales into an inference-only layout at the first forward without gradient (the
    rollout's). After that the layer's base weights differ from the loaded ones (the scales
    are quantized again) and its forward runs ``gemv_4bit``, which has no autograd kernel,
    so the learner's backward through the layer is wrong (torch warns "an autograd kernel
    was not registered"); it also asserts on layers whose output size is not a multiple
    of 32. A policy both samples and trains with the same layers, so they keep the layout
    that training uses (the one every other CPU runs).

    Returns:
        the number of 4-bit layers changed (0 where bitsandbytes would not repack).
    """
    changed = 0
    for module in model.modules():
        if getattr(module, "support_avx512bf16_for_cpu", False):
            module.support_avx512bf16_for_cpu = False
            changed += 1
    return changed


def prepare_for_training(model: torch.nn.Module) -> torch.nn.Module:
    """peft's ``prepare_model_for_kbit_training`` before LoRA is applied: freezes every
    parameter and casts the unquantized float16/bfloat16 ones (embeddings, norms, LM head)
    to float32, the QLoRA recipe for stable training on a low-precision base.

    Gradient checkpointing, which peft turns on by default, stays off: it is a separate
    memory/speed trade and not a consequence of quantization.
    """
    from peft import prepare_model_for_kbit_training

    return prepare_model_for_kbit_training(model, use_gradient_checkpointing=False)


def is_quantized(model: torch.nn.Module) -> bool:
    """Whether ``model`` (or the transformers model under its peft wrapper) was loaded
    with quantized weights (``model.quantization``)."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    return bool(getattr(base, "is_quantized", False))


def quiet_int8_cast() -> None:
    """Silence bitsandbytes' notice that LLM.int8() casts non-float16 inputs to float16:
    the cast is how int8 works, and the notice is logged for every layer of every forward."""
    logging.getLogger("bitsandbytes.autograd._functions").setLevel(logging.ERROR)
