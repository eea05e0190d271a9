"""Several LoRA adapters on one base model, each under its own name (``plainrl tinker``: one
per training client and per loaded sampler checkpoint), created, filled, saved and dropped
here; computed with through :func:`active` (:func:`plainrl.models.loading.adapter_policy`, which
switches the active adapter without peft's ``set_adapter``: that call also flips ``requires_grad``).

peft names an adapter's parameters ``...lora_A.<name>.weight``; its saved state dicts carry no
adapter name, so a directory saved from one name loads into another.
"""

from __future__ import annotations

import contextlib
from pathlib import Path

import torch

from plainrl.models.errors import ModelLoadError
from plainrl.models.loading import adapter_policy

WEIGHTS_FILE = "adapter_model.safetensors"


def add_lora(model: torch.nn.Module, name: str, *, rank: int, alpha: float, targets: list[str],
             seed: int | None = None) -> torch.nn.Module:
    """A new trainable LoRA adapter ``name`` (rank ``rank``, scale ``alpha / rank``, on the linear
    layers named ``targets``) on ``model``, in the model's dtype; with ``seed`` its initialisation
    is reproducible (peft draws lora_A from torch's generator, B = 0; the global one is left as it was).

    Returns:
        the peft model (``model`` wrapped the first time, ``model`` itself after).
    """
    from peft import LoraConfig

    cfg = LoraConfig(r=rank, lora_alpha=alpha, lora_dropout=0.0, target_modules=targets, task_type="CAUSAL_LM")
    with torch.random.fork_rng(devices=[]):
        if seed is not None:
            torch.manual_seed(seed)
        return _add(model, name, cfg, trainable=True)


def add_saved(model: torch.nn.Module, name: str, directory: Path, *, trainable: bool) -> torch.nn.Module:
    """A new adapter ``name`` with the config and weights of the peft adapter directory ``directory``.

    Returns:
        the peft model, as :func:`add_lora`.
    Raises:
        ModelLoadError: no adapter there.
    """
    from peft import PeftConfig

    if not (Path(directory) / "adapter_config.json").is_file():
        raise ModelLoadError(f"{directory}: no adapter_config.json there; give a peft adapter directory")
    model = _add(model, name, PeftConfig.from_pretrained(str(directory)), trainable=trainable)
    load_weights(model, name, directory)
    return model


def add_copy(model: torch.nn.Module, name: str, source: str) -> torch.nn.Module:
    """A new frozen adapter ``name`` holding a copy of adapter ``source``'s config and weights as
    they are now (a snapshot that later steps of ``source`` leave as it was).

    Returns:
        the peft model, as :func:`add_lora`.
    """
    import copy

    model = _add(model, name, copy.deepcopy(model.peft_config[source]), trainable=False)
    copy_weights(model, source, name)
    return model


def copy_weights(model: torch.nn.Module, source: str, dest: str) -> None:
    """Overwrite adapter ``dest``'s weights with adapter ``source``'s, tensor by tensor in place
    (no module is added or replaced: the cheap way to refresh a snapshot).

    Raises:
        ModelLoadError: the two adapters differ in rank or layers.
    """
    params = dict(model.named_parameters())
    pairs = [(p, params.get(n.replace(f".{source}.", f".{dest}."))) for n, p in params.items() if f".{source}." in n]
    if not pairs or any(d is None or d.shape != p.shape for p, d in pairs):
        raise ModelLoadError(f"adapter {dest!r} has another shape (LoRA rank or layers) than adapter {source!r}")
    with torch.no_grad():
        for p, d in pairs:
            d.copy_(p)


def _add(model: torch.nn.Module, name: str, peft_cfg, *, trainable: bool) -> torch.nn.Module:
    from peft import get_peft_model

    if hasattr(model, "peft_config"):
        model.add_adapter(name, peft_cfg)
    else:  # adapters in the model's dtype, as apply_lora's
        model = get_peft_model(model, peft_cfg, adapter_name=name, autocast_adapter_dtype=False)
    model.eval()
    for p in parameters(model, name):
        p.requires_grad_(trainable)
    return model


def load_weights(model: torch.nn.Module, name: str, directory: Path) -> None:
    """Put the weights saved in ``directory`` into adapter ``name``.

    Raises:
        ModelLoadError: the saved adapter's tensors are not this one's (another rank or other layers).
    """
    from peft import set_peft_model_state_dict
    from safetensors.torch import load_file

    saved = load_file(str(Path(directory) / WEIGHTS_FILE))
    mine = state_dict(model, name)
    if set(saved) != set(mine) or any(saved[k].shape != mine[k].shape for k in saved):
        raise ModelLoadError(f"the adapter at {directory} has another shape (LoRA rank or layers) than adapter {name!r}")
    set_peft_model_state_dict(model, saved, adapter_name=name)


def state_dict(model: torch.nn.Module, name: str) -> dict[str, torch.Tensor]:
    """Adapter ``name``'s weights under peft's saved names (no adapter name in them)."""
    from peft import get_peft_model_state_dict

    # the LoRA weights only: a LoRA on a tied LM head would otherwise carry the whole embedding too
    return get_peft_model_state_dict(model, adapter_name=name, save_embedding_layers=False)


@contextlib.contextmanager
def active(model: torch.nn.Module, name: str | None, *, trainable: bool = False):
    """Compute with adapter ``name`` (None: the base, adapters off) within the block
    (:func:`~plainrl.models.loading.adapter_policy`); with ``trainable`` its parameters require
    gradients there (peft freezes every inactive adapter when one is added or adapters are
    enabled again, so a flag set at creation does not last)."""
    if name is not None and trainable:
        for p in parameters(model, name):
            p.requires_grad_(True)
    with adapter_policy(model, name):
        yield model


def parameters(model: torch.nn.Module, name: str) -> list[torch.nn.Parameter]:
    """Adapter ``name``'s parameters."""
    return [p for n, p in model.named_parameters() if f".{name}." in n]


def drop(model: torch.nn.Module, name: str) -> None:
    """Delete adapter ``name`` (peft keeps at least one adapter: the last one stays, unused)."""
    if len(model.peft_config) > 1:
        model.delete_adapter(name)
