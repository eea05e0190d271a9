"""One base model and the LoRA adapters of the service's training clients and sampler snapshots,
as named peft adapters on the same module (Tinker's "several training clients on one base").

Each training client owns adapter ``m<k>``; a sampler snapshot saved to disk is loaded as adapter
``s<k>`` when sampled from (at most :data:`SNAPSHOTS_LOADED` at once, least recently used
evicted). :meth:`Adapters.use` makes one adapter the active one, or none (the base model); every
computation runs inside it, on the service's one worker thread. Created, filled and switched by
:mod:`plainrl.models.named_adapters` and :func:`~plainrl.models.adapter_policy`, saved by
:func:`~plainrl.models.save_policy`.
"""

from __future__ import annotations

import contextlib
import json
from collections import OrderedDict
from pathlib import Path

import torch

from plainrl.checkpoint.files import torch_load
from plainrl.config import ModelConfig
from plainrl.durable import write_atomic
from plainrl.models import ModelLoadError, load_policy, load_tokenizer, resolve_model_path, save_policy
from plainrl.models import named_adapters
from plainrl.models.portable import describe_base
from plainrl.tinker.errors import UserError

SNAPSHOTS_LOADED = 4

WEIGHTS_FILE = named_adapters.WEIGHTS_FILE


def checkpoint_key(directory: Path) -> str:
    """What tells a saved adapter directory's contents apart: its path and its weights file's
    mtime (a checkpoint saved again under the same name is a new directory, a new file)."""
    return f"{directory}@{(directory / WEIGHTS_FILE).stat().st_mtime_ns}"


class Adapters:
    """The base model (``model.name`` of the config, LoRA off) and its named adapters.

    Args:
        model_cfg: the config's ``model`` section (name, dtype, cache_dir, attention).
        device: where the model lives.
    Raises:
        ModelLoadError: as :func:`plainrl.models.load_policy`.
    """

    def __init__(self, model_cfg: ModelConfig, device: torch.device):
        self.name = model_cfg.name
        local = resolve_model_path(model_cfg.name, model_cfg.cache_dir)
        self.base_ref = describe_base(model_cfg.name, local)
        self.tokenizer = load_tokenizer(model_cfg.name, model_cfg.cache_dir)
        no_lora = model_cfg.lora.model_copy(update={"enabled": False})
        self.base = load_policy(model_cfg.model_copy(update={"lora": no_lora, "adapter": None}), device)
        self.base.eval()
        self.model: torch.nn.Module = self.base  # the PeftModel once an adapter exists
        self.local_path = local
        # read before peft wraps any of them
        self.linear_names = {n.rsplit(".", 1)[-1] for n, m in self.base.named_modules() if isinstance(m, torch.nn.Linear)}
        config = self.base.config
        # a tied LM head is the input embedding: a LoRA on it would be merged into both (peft
        # cannot keep it on the output alone), so exports would differ from the trained model
        self.tied_head = bool(getattr(config, "tie_word_embeddings", False))
        self.vocab_size = int(config.vocab_size)
        self.context = int(getattr(config, "max_position_embeddings", 0) or model_cfg.max_context)
        self.arch = (config.architectures or [config.model_type])[0]
        self._snapshots: OrderedDict[str, str] = OrderedDict()  # directory@mtime -> adapter name, LRU order
        self._trained: set[str] = set()  # training clients' adapters (the rest: frozen sampler snapshots)
        self._counter = 0

    # -- adapters ---------------------------------------------------------------------------------

    def create(self, name: str, *, rank: int, targets: list[str], seed: int | None) -> None:
        """A new LoRA adapter ``name`` (rank ``rank``, alpha = 32 as Tinker's, on ``targets``); with
        ``seed`` its initialisation is reproducible."""
        self.model = named_adapters.add_lora(self.model, name, rank=rank, alpha=32, targets=targets, seed=seed)
        self._trained.add(name)

    def create_from(self, name: str, directory: Path) -> None:
        """A new trainable adapter ``name`` with the config and weights saved in ``directory``."""
        self.model = named_adapters.add_saved(self.model, name, directory, trainable=True)
        self._trained.add(name)

    def copy(self, source: str, name: str) -> None:
        """A frozen adapter ``name`` holding adapter ``source``'s weights as they are now (an
        ephemeral sampler's snapshot, kept in memory)."""
        self.model = named_adapters.add_copy(self.model, name, source)

    def refill(self, source: str, name: str) -> None:
        """Overwrite the frozen snapshot ``name`` (of the same training client) with adapter
        ``source``'s weights as they are now: a superseded snapshot's adapter reused."""
        named_adapters.copy_weights(self.model, source, name)

    def forget(self, directory: Path) -> None:
        """Drop the snapshot loaded from ``directory`` (about to be deleted), if one is loaded."""
        key = checkpoint_key(directory)
        if key in self._snapshots:
            self.drop(self._snapshots.pop(key))

    def drop(self, name: str) -> None:
        """Delete adapter ``name``."""
        self._trained.discard(name)
        named_adapters.drop(self.model, name)

    def load_weights(self, name: str, directory: Path) -> None:
        """Put the weights saved in ``directory`` into adapter ``name``.

        Raises:
            UserError: the saved adapter's shapes do not fit (another rank or other layers).
        """
        try:
            named_adapters.load_weights(self.model, name, directory)
        except ModelLoadError as e:
            raise UserError(f"{e}; load it with create_training_client_from_state") from e

    def parameters(self, name: str) -> list[torch.nn.Parameter]:
        """Adapter ``name``'s parameters."""
        return named_adapters.parameters(self.model, name)

    def rank(self, name: str) -> int:
        return int(self.model.peft_config[name].r)

    def targets(self, name: str) -> list[str]:
        return sorted(self.model.peft_config[name].target_modules)

    @contextlib.contextmanager
    def use(self, name: str | None):
        """Run the block with adapter ``name`` active (None: the base model, adapters off); a
        training client's adapter requires gradients inside it (:func:`~plainrl.models.named_adapters.active`)."""
        if self.model is self.base:  # no adapter yet: the base is all there is
            yield self.model
            return
        with named_adapters.active(self.model, name, trainable=name in self._trained):
            yield self.model

    def snapshot(self, directory: Path) -> str:
        """The adapter name of the sampler checkpoint in ``directory``, loaded (frozen) if it is not."""
        key = checkpoint_key(directory)
        if key in self._snapshots:
            self._snapshots.move_to_end(key)
            return self._snapshots[key]
        if len(self._snapshots) >= SNAPSHOTS_LOADED:
            _, old = self._snapshots.popitem(last=False)
            self.drop(old)
        self._counter += 1
        name = f"s{self._counter}"
        self.model = named_adapters.add_saved(self.model, name, directory, trainable=False)
        self._snapshots[key] = name
        return name

    # -- saving -----------------------------------------------------------------------------------

    def save(self, name: str, directory: Path, *, card: str, extra: dict[str, object]) -> None:
        """Write adapter ``name`` as the peft adapter directory ``directory``
        (:func:`~plainrl.models.save_policy`: ``adapter_config.json`` naming the base portably,
        ``adapter_model.safetensors``, tokenizer, ``plainrl_base.json``, ``README.md`` = ``card``)
        with ``tinker.json`` = ``extra``."""
        save_policy(self.model, self.tokenizer, directory, base=self.base_ref, card=card, adapter=name)
        write_atomic(directory / "tinker.json", json.dumps(extra, indent=2))


def read_optimizer(path: Path) -> dict:
    """The optimizer state ``save_state`` wrote (``optimizer.pt``)."""
    return torch_load(path)
