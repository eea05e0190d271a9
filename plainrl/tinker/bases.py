"""The base models of ``plainrl tinker``: ``tinker.base_models`` (default: ``model.name`` alone),
each loaded once with the config's ``model`` settings, its LoRA adapters beside it; the first
is the default, the base of a request that names none."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from plainrl.config import Config
from plainrl.tinker.adapters import Adapters


@dataclass
class Base:
    """A base model the service trains and samples: its adapters, the names it answers to (the
    hub id first, then plainrl's ``model.name``), and the service's config with it as
    ``model.name`` (each checkpoint's ``config.yaml``, so ``plainrl eval DIR`` loads this base)."""

    adapters: Adapters
    names: list[str]
    config_yaml: str

    @property
    def name(self) -> str:
        return self.names[0]


def model_names(name: str, hub_id: str | None) -> list[str]:
    """The names the service answers to for a base: the hub id first (what Tinker code names),
    then plainrl's ``model.name``."""
    return [n for n in dict.fromkeys([hub_id, name]) if n]


def load_bases(cfg: Config, device: torch.device) -> list[Base]:
    """Each of ``tinker.base_models`` (or ``model.name``) loaded on ``device``, in order.

    Raises:
        ModelLoadError: a model cannot be loaded.
        ConfigError: two entries name the same model.
    """
    from plainrl.config import ConfigError
    from plainrl.config.loading import dump_config

    bases: list[Base] = []
    for name in cfg.tinker.base_models or [cfg.model.name]:
        model = cfg.model.model_copy(update={"name": name})
        adapters = Adapters(model, device)
        names = model_names(name, adapters.base_ref.hub_id)
        if taken := [n for b in bases for n in b.names if n in names]:
            raise ConfigError(f"tinker.base_models: {name!r} is {taken[0]!r}, listed before; list each model once")
        bases.append(Base(adapters, names, dump_config(cfg.model_copy(update={"model": model}))))
    return bases
