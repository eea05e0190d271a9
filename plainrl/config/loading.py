"""Reading a config: a YAML file plus dotted CLI overrides, validated into
:class:`~plainrl.config.schema.Config` before any model loads; and writing it back."""

from __future__ import annotations

import copy
import difflib
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ValidationError

from plainrl.config.examples import example_text, find_example
from plainrl.config.schema import Config, ConfigError


def _dotted(key: Any) -> bool:
    return isinstance(key, str) and bool(key.strip()) and all(key.strip().split("."))


def _nest(items: list[tuple[str, Any, str]]) -> dict[str, Any]:
    """``[(dotted key, value, as the user wrote it)]`` -> a nested dict (later keys win; dict values merge)."""
    nested: dict[str, Any] = {}
    for key, value, item in items:
        node = nested
        parts = key.strip().split(".")
        for p in parts[:-1]:
            node = node.setdefault(p, {})
            if not isinstance(node, dict):
                raise ConfigError(f"override {item!r} conflicts with an earlier override of {p!r}")
        last = parts[-1]
        node[last] = _merge(node[last], value) if isinstance(value, dict) and isinstance(node.get(last), dict) else value
    return nested


def parse_overrides(overrides: list[str]) -> dict[str, Any]:
    """Turn ``["train.lr=1e-5", "model.lora.enabled=false"]`` into a nested dict.

    Values are parsed as YAML (so numbers, booleans, lists work).

    Raises:
        ConfigError: an override without ``=`` or with an empty key.
    """
    items = []
    for item in overrides:
        key, sep, raw = item.partition("=")
        if not sep or not _dotted(key):
            raise ConfigError(
                f"override {item!r} is not of the form dotted.key=value (e.g. train.lr=1e-5)"
            )
        try:
            value = yaml.safe_load(raw) if raw != "" else ""
        except yaml.YAMLError:
            value = raw
        # YAML reads 1e-5 as a string (no dot in the mantissa); numbers are what users mean.
        if isinstance(value, str):
            try:
                value = float(value) if any(c in value.lower() for c in ".e") else int(value)
            except ValueError:
                pass
        items.append((key, value, item))
    return _nest(items)


def nest_overrides(overrides: Mapping[str, Any]) -> dict[str, Any]:
    """Turn ``{"train.lr": 1e-5, "model.lora.enabled": False}`` into a nested dict.

    Values are Python values, used as given (not parsed as YAML); a dict value overrides
    the keys it names (``{"train": {"lr": 1e-5}}`` is ``{"train.lr": 1e-5}``).

    Raises:
        ConfigError: a key that is not a dotted config path.
    """
    items = []
    for key, value in overrides.items():
        if not _dotted(key):
            raise ConfigError(f"override key {key!r} is not a dotted config key (e.g. train.lr)")
        items.append((key, copy.deepcopy(value), f"{key}={value!r}"))
    return _nest(items)


def _merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for k, v in over.items():
        if isinstance(v, dict) and isinstance(out.get(k), dict):
            out[k] = _merge(out[k], v)
        else:
            out[k] = v
    return out


def _fields_at(path: tuple[Any, ...]) -> list[str]:
    """Known field names of the section at a dotted path (for 'did you mean')."""
    model: Any = Config
    for part in path:
        if isinstance(part, int):
            continue
        field = getattr(model, "model_fields", {}).get(part)
        if field is None:
            return []
        ann = field.annotation
        args = getattr(ann, "__args__", ())
        model = next((a for a in (ann, *args) if isinstance(a, type) and issubclass(a, BaseModel)), None)
        if model is None:
            return []
    return list(getattr(model, "model_fields", {}))


def _format_error(err: ValidationError, source: str) -> str:
    lines = [f"invalid configuration ({source}):"]
    for e in err.errors():
        loc = tuple(e["loc"])
        dotted = ".".join(str(p) for p in loc) or "<root>"
        if e["type"] == "extra_forbidden":
            known = _fields_at(loc[:-1])
            guess = difflib.get_close_matches(str(loc[-1]), known, n=1)
            hint = f"did you mean {'.'.join([*map(str, loc[:-1]), guess[0]])}?" if guess else (
                f"known keys here: {', '.join(known)}" if known else "remove it"
            )
            lines.append(f"  {dotted}: unknown key (value {e['input']!r}); {hint}")
        elif e["type"] == "value_error":
            lines.append(f"  {e['msg'].removeprefix('Value error, ')}")
        else:
            lines.append(f"  {dotted}: {e['msg']} (got {e.get('input')!r})")
    return "\n".join(lines)


def load_config(path: str | Path | None, overrides: list[str] | Mapping[str, Any] | None = None) -> Config:
    """Load a YAML config, apply dotted overrides, validate.

    Args:
        path: YAML file, the name of a packaged example (``arithmetic_grpo``: see
            :mod:`plainrl.config.examples`) when no such file exists, or None for all defaults
            (overrides still apply).
        overrides: ``["section.key=value", ...]`` (values parsed as YAML), or a mapping
            ``{"section.key": value}`` of Python values (see :func:`build_config`).

    Raises:
        ConfigError: missing file, bad YAML, unknown key, wrong type or impossible
            combination; the message names the dotted path, the value and the fix.
    """
    raw: dict[str, Any] = {}
    source = "defaults"
    if path is not None:
        p = Path(path)
        example = None if p.is_file() else find_example(str(path))
        if not p.is_file() and example is None:
            raise ConfigError(f"config file {str(p)!r} does not exist, nor is it the name of a packaged example "
                              "(`plainrl examples` lists them)")
        text, source = (example_text(example), f"packaged example {example.name}") if example else (p.read_text(), str(p))
        try:
            raw = yaml.safe_load(text) or {}
        except yaml.YAMLError as e:
            raise ConfigError(f"config file {source!r} is not valid YAML: {e}") from None
        if not isinstance(raw, dict):
            raise ConfigError(f"config file {source!r} must hold a mapping at top level, got {type(raw).__name__}")
    return build_config(raw, overrides, source)


def build_config(raw: Mapping[str, Any], overrides: list[str] | Mapping[str, Any] | None = None,
                 source: str = "a dict") -> Config:
    """Validate a config mapping (what a YAML file holds) with overrides applied.

    Args:
        raw: the config as nested dicts, e.g. ``{"train": {"lr": 1e-5}}``.
        overrides: CLI strings ``["train.lr=1e-5"]`` (values parsed as YAML), or a mapping
            of dotted keys to Python values ``{"train.lr": 1e-5}`` (:func:`nest_overrides`).
        source: where ``raw`` came from, for error messages.

    Raises:
        ConfigError: as :func:`load_config`.
    """
    if not isinstance(raw, Mapping):
        raise ConfigError(f"a config must be a mapping of sections, got {type(raw).__name__}")
    raw = dict(raw)
    over: dict[str, Any] = {}
    if overrides:
        if isinstance(overrides, Mapping):
            over = nest_overrides(overrides)
            source += " + overrides " + " ".join(f"{k}={v!r}" for k, v in overrides.items())
        else:
            over = parse_overrides(list(overrides))
            source += " + overrides " + " ".join(overrides)
        raw = _merge(raw, over)
    raw, note = _fit_warmup(raw, over)
    try:
        cfg = Config.model_validate(raw)
    except ValidationError as e:
        raise ConfigError(_format_error(e, source)) from None
    if note:
        cfg.notes.insert(0, note)
    train_over = over.get("train") if isinstance(over.get("train"), Mapping) else {}
    # train.epochs from an override: its steps are known once the data is; resolve_epochs fits the warm-up then
    cfg.train._fit_warmup = "epochs" in train_over and "warmup_steps" not in train_over
    return cfg


def _fit_warmup(raw: dict[str, Any], over: Mapping[str, Any]) -> tuple[dict[str, Any], str | None]:
    """``raw`` with ``train.warmup_steps`` lowered to ``train.steps`` when an override shortened the run
    below the config's warm-up and did not set the warm-up too (a smoke test of an example:
    ``train.steps=1``), and the note saying so; unchanged (the schema then refuses it) where the
    same place set both."""
    train, train_over = raw.get("train"), over.get("train")
    if not isinstance(train, Mapping) or not isinstance(train_over, Mapping):
        return raw, None
    steps, warmup = train.get("steps"), train.get("warmup_steps")
    if ("steps" not in train_over or "warmup_steps" in train_over
            or not all(isinstance(v, int) and not isinstance(v, bool) for v in (steps, warmup)) or not 0 < steps < warmup):
        return raw, None
    note = (f"train.warmup_steps: {warmup} from the config is longer than train.steps={steps} from the "
            f"overrides, so warm-up lasts the whole run of {steps} step{'s' if steps > 1 else ''} (set both to keep your own)")
    return {**raw, "train": {**train, "warmup_steps": steps}}, note


def dump_config(cfg: Config) -> str:
    """The resolved config as YAML (what is saved to ``run_dir/config.yaml``)."""
    return yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False)
