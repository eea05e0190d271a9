"""Models: loading (embedded default, directories, hub ids, GGUF; dtype; LoRA) and the
forward passes every stage shares (chunked float32 logprobs, values, sequence scores;
shared prompts, sequence packing, gradient checkpointing).

    model = load_policy(cfg.model, device)
    logps = sequence_logps(model, input_ids, attention_mask, positions=mask > 0)  # [B, T-1]
"""

from plainrl.models.checkpointing import enable_gradient_checkpointing
from plainrl.models.forward import (
    LOGIT_BLOCK_ELEMENTS,
    sequence_logps,
    sequence_scores,
    sequence_topk,
    shared_prompt_hidden,
    token_values,
)
from plainrl.models.loading import (
    EMBEDDED_MODELS,
    REFERENCE_ADAPTER,
    TRAINED_ADAPTER,
    ModelLoadError,
    active_lora_adapters,
    adapter_policy,
    apply_lora,
    convert_gguf,
    empty_weights,
    load_adapter,
    load_frozen_adapter,
    load_policy,
    load_tokenizer,
    load_value_model,
    lora_delta,
    pad_token_id,
    reference_policy,
    resolve_device,
    resolve_model_path,
    save_policy,
    share_frozen_weights,
    trainable_parameters,
    unwrap,
)
from plainrl.models.packing import pack_sequences, packed_hidden
from plainrl.models.portable import BaseModelRef, describe_base, local_base
from plainrl.models.precision import DTYPES, DtypeChoice, cpu_summary, model_dtype, resolve_dtype
from plainrl.models.quantization import is_quantized

__all__ = [
    "BaseModelRef",
    "DTYPES",
    "DtypeChoice",
    "EMBEDDED_MODELS",
    "LOGIT_BLOCK_ELEMENTS",
    "ModelLoadError",
    "REFERENCE_ADAPTER",
    "TRAINED_ADAPTER",
    "active_lora_adapters",
    "adapter_policy",
    "apply_lora",
    "convert_gguf",
    "cpu_summary",
    "describe_base",
    "empty_weights",
    "enable_gradient_checkpointing",
    "is_quantized",
    "load_adapter",
    "load_frozen_adapter",
    "load_policy",
    "load_tokenizer",
    "load_value_model",
    "local_base",
    "lora_delta",
    "model_dtype",
    "pad_token_id",
    "reference_policy",
    "pack_sequences",
    "packed_hidden",
    "resolve_device",
    "resolve_dtype",
    "resolve_model_path",
    "save_policy",
    "sequence_logps",
    "sequence_scores",
    "sequence_topk",
    "share_frozen_weights",
    "shared_prompt_hidden",
    "token_values",
    "trainable_parameters",
    "unwrap",
]
