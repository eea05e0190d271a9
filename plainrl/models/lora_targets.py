"""Which linear layers LoRA wraps, by the model's architecture: Tinker's three layer groups
(``create_lora_training_client``'s ``train_attn``, ``train_mlp``, ``train_unembed``) as the module
names of each architecture plainrl knows (transformers' ``config.model_type``).

Attention is every layer that mixes positions: the softmax attention's q/k/v/o projections, and in
Qwen3.5's hybrid decoder also the Gated DeltaNet (linear-attention) layers' input projections
(``in_proj_qkv``, ``in_proj_z``, and the decay/gate heads ``in_proj_a``, ``in_proj_b``) and their
``out_proj`` (transformers' ``models/qwen3_5/modeling_qwen3_5.py::Qwen3_5GatedDeltaNet``). The MLP
is the gated feed-forward (gate/up/down), the unembedding the LM head.
"""

from __future__ import annotations

from typing import Any

from plainrl.models.errors import ModelLoadError

_ATTN = ("q_proj", "k_proj", "v_proj", "o_proj")
_MLP = ("gate_proj", "up_proj", "down_proj")
_UNEMBED = ("lm_head",)
_LINEAR_ATTN = ("in_proj_qkv", "in_proj_z", "in_proj_a", "in_proj_b", "out_proj")
_DENSE = {"attn": _ATTN, "mlp": _MLP, "unembed": _UNEMBED}

# config.model_type -> the module names of each layer group
ARCHITECTURES: dict[str, dict[str, tuple[str, ...]]] = {
    "llama": _DENSE,  # Llama 2/3, SmolLM2
    "mistral": _DENSE,
    "qwen2": _DENSE,
    "qwen3": _DENSE,
    "qwen3_5": {**_DENSE, "attn": _ATTN + _LINEAR_ATTN},  # the multimodal wrapper (its text model's names)
    "qwen3_5_text": {**_DENSE, "attn": _ATTN + _LINEAR_ATTN},
}


def lora_target_modules(config: Any, present: set[str], *, attn: bool, mlp: bool, unembed: bool,
                        name: str) -> list[str]:
    """The module names (peft ``target_modules``) of the chosen layer groups of a model.

    Args:
        config: the model's transformers config (``model_type`` picks the names).
        present: the last component of the model's ``nn.Linear`` module names; names of the
            architecture the model lacks are left out (a Qwen3.5 with no linear-attention layer).
        attn, mlp, unembed: the layer groups to train.
        name: the model as the user named it, for messages.
    Returns:
        The module names, in the groups' order.
    Raises:
        ModelLoadError: an architecture whose layer names plainrl does not know, or none of the
            chosen groups' layers in the model (the message names the model and what it has).
    """
    model_type = getattr(config, "model_type", None)
    groups = ARCHITECTURES.get(model_type)
    if groups is None:
        arch = (getattr(config, "architectures", None) or [model_type])[0]
        raise ModelLoadError(f"{name!r} is a {arch} (model_type {model_type!r}), whose layers plainrl cannot map to "
                             f"LoRA's attention / MLP / unembedding groups; it knows {sorted(ARCHITECTURES)}")
    wanted = [m for g, on in (("attn", attn), ("mlp", mlp), ("unembed", unembed)) if on for m in groups[g]]
    targets = [m for m in wanted if m in present]
    if not targets:
        raise ModelLoadError(f"{name!r}: none of {wanted} is a linear layer of this model (it has {sorted(present)}); "
                             "choose other layer groups")
    return targets
