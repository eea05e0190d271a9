"""The example configs that ship inside the package (``plainrl examples``, ``plainrl train NAME``).

The repository's ``examples/`` directory is installed as ``plainrl.examples`` (setup.py maps it),
so an installed plainrl carries every example config and the files those configs name (agents,
row sources). A config names such a file by its repository path, ``examples/agent_calculator.py:agent``,
which resolves from the repository root. This module finds the examples wherever they are, lists
them with a one-line description, copies one with its files into a directory of the user's, and
loads one by name with its file references pointed at the packaged copies.
"""

from __future__ import annotations

import importlib.util
import os
import re
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from plainrl.config.schema import ConfigError

__all__ = ["Example", "copy_example", "example_text", "examples_dir", "find_example", "list_examples"]

# `examples/<relative path>` in a config, not preceded by a path character (so `my_examples/x.py`
# is left alone); the path ends at `:` (a `file.py:function` reference), whitespace or a quote.
_REFERENCE = re.compile(r"(?<![\w./-])examples/([\w./-]+\.\w+)")


@dataclass(frozen=True)
class Example:
    """One packaged example config.

    Attributes:
        name: the file's stem, what ``plainrl train NAME`` takes (``arithmetic_grpo``).
        path: the YAML file.
        description: the first sentence of the file's header comment, on one line.
    """

    name: str
    path: Path
    description: str


def examples_dir() -> Path:
    """The directory of the example configs: ``plainrl/examples`` in an installed wheel (or an
    editable install), else ``examples/`` beside the ``plainrl`` package in a source checkout.

    Raises:
        FileNotFoundError: neither exists (a broken install).
    """
    try:
        spec = importlib.util.find_spec("plainrl.examples")
    except ImportError:
        spec = None
    for location in (spec.submodule_search_locations or []) if spec else []:
        if Path(location).is_dir():
            return Path(location)
    checkout = Path(__file__).resolve().parents[2] / "examples"
    if checkout.is_dir():
        return checkout
    raise FileNotFoundError("plainrl's example configs are missing: neither the package's plainrl/examples nor a "
                            "checkout's examples/ exists; reinstall plainrl")


def _describe(text: str) -> str:
    """The header comment's first sentence: the leading ``#`` lines joined, cut at the first
    ``: ``, ``. `` (not after an abbreviation such as "Dr" or "e.g") or ``; `` outside brackets and quotes."""
    header = []
    for line in text.splitlines():
        if not line.startswith("#"):
            break
        header.append(line.lstrip("#").strip())
    prose = " ".join(w for w in header if w)
    depth, quoted = 0, False
    for i, ch in enumerate(prose):
        if ch == '"':
            quoted = not quoted
        elif ch in "([{":
            depth += 1
        elif ch in ")]}":
            depth = max(0, depth - 1)
        elif ch in ":.;" and not depth and not quoted and prose[i + 1:i + 2] in (" ", ""):
            word = re.split(r"[\s(]", prose[:i])[-1]
            if ch != "." or not re.fullmatch(r"[A-Za-z.]{1,3}", word):  # "Dr. GRPO", "e.g. x": not an end
                return prose[:i]
    return prose


def list_examples() -> list[Example]:
    """Every packaged example config (``*.yaml``), sorted by name."""
    return [Example(p.stem, p, _describe(p.read_text())) for p in sorted(examples_dir().glob("*.yaml"))]


def find_example(name: str) -> Example | None:
    """The packaged example called ``name`` (with or without ``.yaml``), or None."""
    stem = name.removesuffix(".yaml")
    if not stem or os.sep in stem or "/" in stem:
        return None
    return next((e for e in list_examples() if e.name == stem), None)


def _named_files(text: str, root: Path) -> list[str]:
    """The files under ``root`` that a config's values name as ``examples/<path>`` (comments aside)."""
    found: list[str] = []

    def walk(node: Any) -> None:
        if isinstance(node, dict):
            for v in node.values():
                walk(v)
        elif isinstance(node, list):
            for v in node:
                walk(v)
        elif isinstance(node, str):
            for rel in _REFERENCE.findall(node):
                if (root / rel).is_file() and rel not in found:
                    found.append(rel)

    walk(yaml.safe_load(text))
    return found


def _repoint(text: str, rels: list[str], prefix: str) -> str:
    """``examples/<rel>`` -> ``<prefix><rel>`` for each named file, in values and comments alike."""
    return _REFERENCE.sub(lambda m: prefix + m.group(1) if m.group(1) in rels else m.group(0), text)


def example_text(example: Example) -> str:
    """The example's YAML with each file it names pointed at the packaged copy (an absolute path),
    so the config runs from any directory."""
    root = examples_dir()
    text = example.path.read_text()
    return _repoint(text, _named_files(text, root), f"{root.resolve()}/")


def copy_example(name: str, dest: str | Path = ".") -> list[Path]:
    """Copy a packaged example config and the files it names into ``dest`` (created if missing).

    The copy names its files by their new paths as given (``dest/agent_calculator.py:agent``), so
    ``plainrl train dest/NAME.yaml`` runs from the directory the copy was made in.

    Returns:
        the files written, the config first.

    Raises:
        ConfigError: no example of that name, or a file that would be overwritten.
    """
    example = find_example(name)
    if example is None:
        known = ", ".join(e.name for e in list_examples())
        raise ConfigError(f"no packaged example {name!r}; `plainrl examples` lists them: {known}")
    root = examples_dir()
    text = example.path.read_text()
    rels = _named_files(text, root)
    dest = Path(dest)
    prefix = "" if str(dest) in ("", ".") else f"{dest.as_posix().rstrip('/')}/"
    targets = [(example.path, dest / example.path.name), *((root / rel, dest / rel) for rel in rels)]
    clash = [str(t) for _, t in targets if t.exists()]
    if clash:
        raise ConfigError(f"not copying {name}: {', '.join(clash)} already exist(s); remove it or copy to another "
                          f"directory (plainrl examples copy {name} DIR)")
    for source, target in targets:
        target.parent.mkdir(parents=True, exist_ok=True)
        if source == example.path:
            target.write_text(_repoint(text, [*rels, example.path.name], prefix))
        else:
            shutil.copyfile(source, target)
    return [t for _, t in targets]
