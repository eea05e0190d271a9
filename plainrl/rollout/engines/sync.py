"""The trainer's side of weight sync to a separate engine (vLLM in process or a server):
what to push after an update, and in which form.

``lora``: the adapter alone, saved with peft's ``save_pretrained`` and loaded by vLLM as a
LoRA request with a new id per update (vLLM applies it with its punica kernels; the base
weights never move). ``full``: the policy's weights under their Hugging Face names (merged
W + s * B @ A for each adapted layer when a LoRA model is pushed in full), reloaded in
place by the engine (:mod:`plainrl.rollout.engines.vllm_worker`).
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path
from typing import Literal

import torch

from plainrl.models import TRAINED_ADAPTER, is_quantized, lora_delta, unwrap

SyncMode = Literal["lora", "full"]


def resolve_sync(requested: str, model: torch.nn.Module, *, lora_is_slow: bool = False) -> SyncMode:
    """``rollout.sync`` for this model: ``auto`` is ``lora`` for a LoRA model, else ``full``;
    with ``lora_is_slow`` (vLLM in process on a CPU, whose LoRA path sampled the demo's
    rollouts 4.3x slower than merged weights, docs/benchmarks.md) ``auto`` pushes a LoRA
    model merged, in ``full``, unless its base is quantized or its weights are 16-bit:
    W + s * B @ A rounded to bfloat16 loses the part of each update below W's spacing
    (2^-9 |W|), so the engine would sample a policy the learner is not training.

    Raises:
        ValueError: ``lora`` for a model without adapters, or ``full`` for a quantized
            (QLoRA) model, whose 4-/8-bit base cannot take merged weights.
    """
    has_lora = hasattr(model, "peft_config")
    if requested == "auto":
        mergeable = not is_quantized(model) and unwrap(model).get_input_embeddings().weight.dtype == torch.float32
        return "lora" if has_lora and not (lora_is_slow and mergeable) else "full"
    if requested == "lora" and not has_lora:
        raise ValueError("rollout.sync=lora needs a LoRA model (model.lora.enabled=true); "
                         "use rollout.sync=full or auto for full fine-tuning")
    if requested == "full" and is_quantized(model):
        raise ValueError("rollout.sync=full cannot push a quantized (model.quantization) model's merged weights; "
                         "use rollout.sync=lora or auto")
    if requested not in ("lora", "full"):
        raise ValueError(f"rollout.sync must be auto, lora or full, got {requested!r}")
    return requested  # type: ignore[return-value]


@torch.no_grad()
def policy_weights(model: torch.nn.Module, device: torch.device | str = "cpu") -> dict[str, torch.Tensor]:
    """The policy's whole state under Hugging Face names, for a ``full`` sync: the weights
    as they are for full fine-tuning; for a LoRA model, the base with each adapted layer's
    weight merged, W + s * B @ A.

    Whole, not only the tensors that changed: vLLM fuses layers (q/k/v into one qkv_proj)
    and its in-place reload must see every tensor of a fused layer, so sending the frozen
    ones too is what keeps a partial adapter (say q_proj and v_proj only) correct.

    Args:
        device: where the tensors go (``cpu`` for HTTP and disk; the model's CUDA device for an
            NCCL broadcast, which sends from GPU memory).

    Returns:
        name -> contiguous tensor on ``device`` in the model's dtype.
    """
    base = unwrap(model)
    merged = {}
    if hasattr(model, "peft_config"):
        for name, module in base.named_modules():
            delta = lora_delta(module)
            if delta is not None:
                merged[name + ".weight"] = module.base_layer.weight + delta
    out: dict[str, torch.Tensor] = {}
    seen: set[int] = set()  # tied weights (lm_head = embed_tokens) go once, as in a checkpoint
    for name, p in base.state_dict().items():
        if ".lora_" in name or p.data_ptr() in seen:
            continue
        seen.add(p.data_ptr())
        name = name.replace(".base_layer.", ".").replace(".modules_to_save.default.", ".")
        if ".original_module." in name:
            continue
        out[name] = merged.get(name, p).detach().to(device).contiguous()
    return out


def to_safetensors(tensors: dict[str, torch.Tensor]) -> bytes:
    """The tensors as safetensors bytes (what the worker extension decodes)."""
    from safetensors.torch import save

    return save(tensors)


def save_hf_weights(model: torch.nn.Module, directory: Path) -> Path:
    """:func:`policy_weights` as a Hugging Face model directory (``config.json`` and
    ``model.safetensors``), what an engine that reloads weights from disk reads (SGLang's
    ``/update_weights_from_disk``). Returns ``directory``."""
    from safetensors.torch import save_file

    directory.mkdir(parents=True, exist_ok=True)
    unwrap(model).config.to_json_file(directory / "config.json")
    save_file(policy_weights(model), directory / "model.safetensors", metadata={"format": "pt"})
    return directory


class AdapterVersions:
    """Saved adapter directories, one per sync, under ``root``; the newest ``keep`` are kept
    (an engine may still read the previous one while the next is written).

    Args:
        root: where to write; default a fresh temporary directory (removed by :meth:`close`).
    """

    def __init__(self, root: str | Path | None = None, keep: int = 2):
        self._owned = root is None
        self.root = Path(tempfile.mkdtemp(prefix="plainrl-sync-")) if root is None else Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        self.keep = keep
        self.version = 0
        self._dirs: list[Path] = []

    def save(self, model: torch.nn.Module) -> tuple[int, Path]:
        """Save the model's adapter as the next version; returns (version >= 1, directory)."""
        self.version += 1
        path = self.root / f"adapter-v{self.version}"
        model.save_pretrained(path, selected_adapters=[TRAINED_ADAPTER])  # not a frozen reference copy
        self._dirs.append(path)
        while len(self._dirs) > self.keep:
            shutil.rmtree(self._dirs.pop(0), ignore_errors=True)
        return self.version, path

    def close(self) -> None:
        """Remove the adapters written (the whole directory when it was a temporary one)."""
        for d in self._dirs:
            shutil.rmtree(d, ignore_errors=True)
        self._dirs.clear()
        if self._owned:
            shutil.rmtree(self.root, ignore_errors=True)
