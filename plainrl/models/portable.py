"""What a saved model was trained on, recorded so that the output loads on any machine.

A peft adapter names its base in ``adapter_config.json`` (``base_model_name_or_path``),
and ``AutoPeftModelForCausalLM.from_pretrained(dir)`` loads that name. plainrl loads
GGUF bases from a conversion in its cache, a path that exists on no other machine, so
saved outputs name the base's hub id instead when one is known (the embedded model's,
a GGUF file's ``general.source`` metadata, a hub id as ``model.name``, a directory inside
a hub cache), and ``plainrl_base.json`` beside them keeps what plainrl needs to find the
exact base offline: the name as configured and, for GGUF bases, the file's sha256.
"""

from __future__ import annotations

import json
import re
from dataclasses import asdict, dataclass
from pathlib import Path

from plainrl.durable import write_atomic
from plainrl.models.cache import SOURCE_RECORD, cache_root, find_conversion
from plainrl.models.gguf import EMBEDDED_MODELS

BASE_RECORD = "plainrl_base.json"
_HUB_SNAPSHOT = re.compile(r"models--([\w.-]+)--([\w.-]+)/snapshots/[^/]+/?$")


@dataclass(frozen=True)
class BaseModelRef:
    """The base model of a saved output.

    name: ``model.name`` as configured (an embedded name, a directory, a ``.gguf`` file, a hub id).
    local: where it was loaded from on the machine that trained (absolute; a cache
        directory for GGUF bases): for this machine only, never written as the base's name.
    hub_id: the hub repository of the base, when known.
    source_file / source_sha256: for a GGUF base, the file's name and content hash (the
        conversion plainrl trained on, found again by this hash in any plainrl cache).
    dequantized: the weights trained on are a GGUF quantisation of ``hub_id``'s, not
        its own; the adapter then fits the hub's weights approximately, and
        ``plainrl export --merge`` gives the exact merged model.
    """

    name: str
    local: str
    hub_id: str | None = None
    source_file: str | None = None
    source_sha256: str | None = None
    dequantized: bool = False

    @property
    def portable_name(self) -> str:
        """The name outputs give their base: the hub id, else ``name`` as configured."""
        return self.hub_id or self.name


def describe_base(name: str, local: str) -> BaseModelRef:
    """The :class:`BaseModelRef` of ``model.name`` ``name``, which was loaded from ``local``
    (``resolve_model_path(name)``: a GGUF base's conversion directory holds its source record)."""
    record = Path(local) / SOURCE_RECORD
    if record.is_file():  # a GGUF conversion (the embedded model or a .gguf file)
        src = json.loads(record.read_text())
        hub = src.get("hub_id") or (EMBEDDED_MODELS[name].hub_id if name in EMBEDDED_MODELS else None)
        return BaseModelRef(name=name, local=str(Path(local).resolve()), hub_id=hub,
                            source_file=src.get("source_file"), source_sha256=src.get("source_sha256"),
                            dequantized=True)
    p = Path(local)
    if p.exists():
        m = _HUB_SNAPSHOT.search(p.resolve().as_posix())
        return BaseModelRef(name=name, local=str(p.resolve()), hub_id=f"{m.group(1)}/{m.group(2)}" if m else None)
    return BaseModelRef(name=name, local=local, hub_id=name)  # a hub id, loaded through the hub cache


def record_base(directory: Path, base: BaseModelRef) -> None:
    """Make a saved model directory name ``base`` portably: ``adapter_config.json``'s
    ``base_model_name_or_path`` (when it is an adapter) becomes ``base.portable_name``, and
    ``plainrl_base.json`` records ``base`` for :func:`local_base`."""
    adapter = directory / "adapter_config.json"
    if adapter.is_file():
        meta = json.loads(adapter.read_text())
        meta["base_model_name_or_path"] = base.portable_name
        write_atomic(adapter, json.dumps(meta, indent=2, sort_keys=True).encode())
    fields = asdict(base)
    fields.pop("local")  # machine-local: kept out of outputs
    write_atomic(directory / BASE_RECORD, json.dumps(fields, indent=1).encode())


def read_base(directory: Path) -> BaseModelRef | None:
    """The base recorded in a saved model directory's ``plainrl_base.json`` (``local``
    empty: that was the training machine's), or None when there is none or it is unreadable."""
    try:
        data = json.loads((Path(directory) / BASE_RECORD).read_text())
        return BaseModelRef(local="", **{k: v for k, v in data.items() if k in BaseModelRef.__dataclass_fields__})
    except (OSError, ValueError, TypeError):
        return None


def local_base(directory: Path, cache_dir: str | None = None) -> str | None:
    """The ``model.name`` to load a saved adapter's base with on this machine, offline
    where possible: the embedded model or the configured path when they are here, else a
    conversion of the same GGUF content in the plainrl cache, else the hub id (which the
    hub cache or the hub must provide), else the adapter's ``base_model_name_or_path``.
    None when the directory names no base at all."""
    directory = Path(directory)
    rec = read_base(directory)
    name = rec.name if rec else None
    if name in EMBEDDED_MODELS or (name and Path(name).exists()):
        return name
    if rec and rec.source_sha256:
        hit = find_conversion(cache_root(cache_dir), rec.source_sha256)
        if hit is not None:
            return str(hit)
    if rec and rec.hub_id:
        return rec.hub_id
    try:
        return json.loads((directory / "adapter_config.json").read_text()).get("base_model_name_or_path") or name
    except (OSError, ValueError):
        return name
