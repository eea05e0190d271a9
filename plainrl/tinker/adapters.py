"""One base model and the LoRA adapters of the service's training clients and sampler snapshots,
as named peft adapters on the same module (Tinker's "several training clients on one base").

Each training client owns adapter ``m<k>``; a sampler snapshot saved to disk is loaded as adapter
``s<k>`` when sampled from (at most :data:`SNAPSHOTS_LOADED` at once, least recently used
evicted). :meth:`Adapters.use` makes one adapter the active one (peft's ``set_adapter``), or none
(the base model); every computation runs inside it, on the service's one worker thread.
"""

from __future__ import annotations

import contextlib
import json
from collections import OrderedDict
from pathlib import Path

import torch
from safetensors.torch import load_file

from plainrl.checkpoint.files import torch_load
from plainrl.config import ModelConfig
from plainrl.durable import write_atomic
from plainrl.models import load_policy, load_tokenizer, resolve_model_path, save_policy
from plainrl.models.portable import describe_base
from plainrl.tinker.errors import UserError

SNAPSHOTS_LOADED = 4

WEIGHTS_FILE = "adapter_model.safetensors"


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
        self._counter = 0

    # -- adapters ---------------------------------------------------------------------------------

    def _add(self, name: str, peft_cfg) -> None:
        from peft import get_peft_model

        if self.model is self.base:
            self.model = get_peft_model(self.base, peft_cfg, adapter_name=name, autocast_adapter_dtype=False)
        else:
            self.model.add_adapter(name, peft_cfg)
        self.model.eval()

    def create(self, name: str, *, rank: int, targets: list[str], seed: int | None) -> None:
        """A new LoRA adapter ``name`` (rank ``rank``, alpha = 32 as Tinker's, on ``targets``); with
        ``seed`` its initialisation is reproducible (peft draws lora_A from torch's generator, B = 0)."""
        from peft import LoraConfig

        cfg = LoraConfig(r=rank, lora_alpha=32, lora_dropout=0.0, target_modules=targets, task_type="CAUSAL_LM")
        with torch.random.fork_rng(devices=[]):
            if seed is not None:
                torch.manual_seed(seed)
            self._add(name, cfg)

    def create_from(self, name: str, directory: Path) -> None:
        """A new trainable adapter ``name`` with the config and weights saved in ``directory``."""
        from peft import PeftConfig

        self._add(name, PeftConfig.from_pretrained(str(directory)))
        self.load_weights(name, directory)

    def drop(self, name: str) -> None:
        """Delete adapter ``name`` (peft keeps at least one adapter: the last one stays, inactive)."""
        if len(self.model.peft_config) > 1:
            self.model.delete_adapter(name)

    def load_weights(self, name: str, directory: Path) -> None:
        """Put the weights saved in ``directory`` into adapter ``name``.

        Raises:
            UserError: the saved adapter's shapes do not fit (another rank or other layers).
        """
        from peft import set_peft_model_state_dict

        saved = load_file(str(directory / WEIGHTS_FILE))
        mine = self.state_dict(name)
        if set(saved) != set(mine) or any(saved[k].shape != mine[k].shape for k in saved):
            raise UserError(f"the checkpoint at {directory} is an adapter of another shape (LoRA rank or "
                            "layers) than this training client's; load it with create_training_client_from_state")
        set_peft_model_state_dict(self.model, saved, adapter_name=name)

    def state_dict(self, name: str) -> dict[str, torch.Tensor]:
        """Adapter ``name``'s weights under peft's saved names (no adapter name in them)."""
        from peft import get_peft_model_state_dict

        # the LoRA weights only: a LoRA on a tied LM head would otherwise carry the whole embedding too
        return get_peft_model_state_dict(self.model, adapter_name=name, save_embedding_layers=False)

    def parameters(self, name: str) -> list[torch.nn.Parameter]:
        """Adapter ``name``'s parameters (peft names them ``...lora_A.<name>.weight``)."""
        return [p for n, p in self.model.named_parameters() if f".{name}." in n]

    def rank(self, name: str) -> int:
        return int(self.model.peft_config[name].r)

    @contextlib.contextmanager
    def use(self, name: str | None):
        """Run the block with adapter ``name`` active (None: the base model, adapters off). Only
        the active adapter's parameters require gradients inside it."""
        if name is None:
            ctx = self.model.disable_adapter() if self.model is not self.base else contextlib.nullcontext()
            with ctx:
                yield self.model
            return
        self.model.set_adapter(name)
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
        from peft import PeftConfig

        self._add(name, PeftConfig.from_pretrained(str(directory)))
        self.load_weights(name, directory)
        for p in self.parameters(name):
            p.requires_grad_(False)
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
