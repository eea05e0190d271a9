"""reasoning-gym's procedural tasks as plainrl rows, scored by reasoning-gym's own scorers
(``pip install 'plainrl[reasoning-gym]'``; docs/environments.md, "reasoning-gym").

    data:
      source: plainrl.integrations.reasoning_gym:rows
      source_args: {datasets: {chain_sum: {max_terms: 3}, leg_counting: {weight: 2}}, size: 2000, seed: 0}
      eval_source_args: {seed: 1}
    rewards: [{fn: plainrl.integrations.reasoning_gym:score}]
    eval: {grader: plainrl.integrations.reasoning_gym:solved}

Rows come from reasoning-gym's ``CompositeDataset`` (one dataset or a weighted mix). Each row keeps
the dataset's name and its full configuration (``rg_dataset``, ``rg_config``) and the entry's
``metadata``: :func:`score` rebuilds that same configuration to score, because several scorers read
it (``decimal_arithmetic``'s tolerance, ``time_intervals``' ranges, ``polynomial_equations``'
penalties, ``puzzle24``'s number range), so a default-configuration scorer would mis-grade
non-default rows. Scores are reasoning-gym's floats, not all 0/1 (partial credit, 0.01 for a
wrong decimal).
"""

from __future__ import annotations

import dataclasses
import difflib
import json
from collections.abc import Iterator, Mapping
from typing import Any

from plainrl.config import ConfigError
from plainrl.integrations import require

rg = require("reasoning_gym", extra="reasoning-gym")
from reasoning_gym.composite import CompositeConfig, CompositeDataset, DatasetSpec  # noqa: E402
from reasoning_gym.factory import DATASETS  # noqa: E402
from reasoning_gym.utils import SYSTEM_PROMPTS, extract_answer  # noqa: E402

__all__ = ["answered", "rows", "score", "solved"]

ARGS = "data.source_args"
# set once for the whole mix by rows(size=, seed=): a per-dataset seed would also pin the held-out rows
_RESERVED = ("seed", "size")


def _dataset_names() -> list[str]:
    return sorted(n for n in DATASETS if n != "composite")


def _config_fields(name: str) -> list[str]:
    return [f.name for f in dataclasses.fields(DATASETS[name][1]) if f.init]


def _specs(datasets: str | list[str] | Mapping[str, Any]) -> list[DatasetSpec]:
    """``datasets`` as reasoning-gym ``DatasetSpec``s, every name and key checked."""
    if isinstance(datasets, str):
        datasets = [datasets]
    if isinstance(datasets, (list, tuple)):
        if not datasets:
            raise ConfigError(f"{ARGS}.datasets is empty; name at least one reasoning-gym dataset")
        bad = [d for d in datasets if not isinstance(d, str)]
        if bad:
            raise ConfigError(f"{ARGS}.datasets: {bad[0]!r} is not a dataset name; give names, or a mapping "
                              "name -> that dataset's configuration")
        datasets = {name: {} for name in datasets}
    if not isinstance(datasets, Mapping) or not datasets:
        raise ConfigError(f"{ARGS}.datasets: expected a dataset name, a list of names or a mapping name -> "
                          f"configuration, got {datasets!r}")
    names = _dataset_names()
    specs = []
    # in name order: the composite seeds its i-th dataset seed + i + 1, so a mapping's order (which a
    # YAML round trip may change) must not change the rows
    for name, conf in sorted(datasets.items(), key=lambda kv: str(kv[0])):
        key = f"{ARGS}.datasets.{name}"
        if name not in DATASETS or name == "composite":
            close = difflib.get_close_matches(str(name), names, n=3)
            hint = f" Did you mean {', '.join(map(repr, close))}?" if close else ""
            raise ConfigError(f"{ARGS}.datasets: unknown reasoning-gym dataset {name!r}.{hint} "
                              f"Its datasets: {', '.join(names)}")
        conf = dict(conf or {})
        if not isinstance(conf, dict):
            raise ConfigError(f"{key}: expected that dataset's configuration (a mapping), got {conf!r}")
        weight = conf.pop("weight", 1.0)
        if isinstance(weight, bool) or not isinstance(weight, (int, float)) or not weight > 0:
            raise ConfigError(f"{key}.weight: expected a positive number (its share of the mix), got {weight!r}")
        accepted = _config_fields(name)
        for k in conf:
            if k in _RESERVED:
                raise ConfigError(f"{key}.{k}: {k} is set for the whole mix by {ARGS}.{k}; remove it here")
            if k not in accepted:
                close = difflib.get_close_matches(k, accepted, n=1)
                hint = f" Did you mean {close[0]!r}?" if close else ""
                raise ConfigError(f"{key}: {name} takes no key {k!r}.{hint} It accepts: "
                                  f"{', '.join(a for a in accepted if a not in _RESERVED)}, and weight")
        specs.append(DatasetSpec(name=name, weight=float(weight), config=conf))
    return specs


def _system_prompt(system_prompt: str | None) -> str | None:
    if system_prompt is None:
        return None
    if not isinstance(system_prompt, str):
        raise ConfigError(f"{ARGS}.system_prompt: expected a name ({', '.join(SYSTEM_PROMPTS)}), text or null, "
                          f"got {system_prompt!r}")
    return SYSTEM_PROMPTS.get(system_prompt, system_prompt)


def rows(datasets: str | list[str] | Mapping[str, Any], size: int = 500, seed: int = 0,
         system_prompt: str | None = "default") -> Iterator[dict[str, Any]]:
    """``data.source``: ``size`` entries of one reasoning-gym dataset or a weighted mix, as chat rows.

    Args:
        datasets: a dataset name (``"chain_sum"``), a list of names (an equal mix), or a mapping
            name -> that dataset's configuration (its config dataclass's keys, e.g.
            ``{max_terms: 3}``) with an optional ``weight`` (default 1) for its share of the mix.
        size: entries generated (reasoning-gym's ``size``).
        seed: reasoning-gym's seed; the mix's datasets, in name order, get ``seed + 1``, ``seed + 2``, ...
            as in reasoning-gym's ``CompositeDataset``. Held-out rows: another seed (``data.eval_source_args``)
            at least ``size`` away: reasoning-gym draws entry i from ``seed + i``, so nearer seeds repeat
            training entries.
        system_prompt: a name of reasoning-gym's ``SYSTEM_PROMPTS`` (``default``, ``DeepSeekZero``,
            ``simple``, ``direct``, ``chain_of_draft``), any other text as the system message, or None.

    Returns:
        the rows, lazily (entry i is generated when read): ``messages`` (system, user: the question),
        ``answer`` (reasoning-gym's oracle answer), ``question``, ``metadata``, ``rg_dataset`` (the
        entry's dataset) and ``rg_config`` (that dataset's whole configuration, what :func:`score` uses).

    Raises:
        ConfigError: an unknown dataset name, a configuration key the dataset does not take, a bad
            weight, size or seed (each message names the key and what is accepted); a configuration
            reasoning-gym's own validation rejects.
    """
    if isinstance(size, bool) or not isinstance(size, int) or size <= 0:
        raise ConfigError(f"{ARGS}.size: expected a positive integer, got {size!r}")
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise ConfigError(f"{ARGS}.seed: expected an integer, got {seed!r}")
    system = _system_prompt(system_prompt)
    specs = _specs(datasets)
    try:
        mix = CompositeDataset(CompositeConfig(size=size, seed=seed, datasets=specs))
    except (AssertionError, ValueError, TypeError) as e:  # the datasets' own validate()
        raise ConfigError(f"{ARGS}.datasets: reasoning-gym rejected the configuration "
                          f"({', '.join(s.name for s in specs)}): {type(e).__name__}: {e}") from None
    configs = {name: _config_dict(ds.config) for name, ds in mix.datasets.items()}
    return _generate(mix, configs, system)


def _generate(mix: Any, configs: dict[str, dict[str, Any]], system: str | None) -> Iterator[dict[str, Any]]:
    for i in range(len(mix)):
        entry = mix[i]
        name = entry["metadata"]["source_dataset"]
        messages = [{"role": "system", "content": system}] if system else []
        messages.append({"role": "user", "content": entry["question"]})
        yield {"messages": messages, "answer": entry["answer"], "question": entry["question"],
               "metadata": entry["metadata"], "rg_dataset": name, "rg_config": configs[name]}


def _config_dict(config: Any) -> dict[str, Any]:
    # the constructor's own arguments, values as they are (asdict would turn nested dataclasses into dicts)
    return {f.name: getattr(config, f.name) for f in dataclasses.fields(config) if f.init}


_SCORERS: dict[tuple[str, str], Any] = {}  # (name, configuration as JSON) -> the dataset that scores


def _dataset(name: str, config: dict[str, Any]) -> Any:
    """The dataset ``name`` built with exactly ``config`` (once per process and configuration)."""
    key = (name, json.dumps(config, sort_keys=True, default=repr))
    if key not in _SCORERS:
        _SCORERS[key] = rg.create_dataset(name, **config)
    return _SCORERS[key]


def score(completion: str, *, question: str, answer: Any, metadata: dict[str, Any], rg_dataset: str,
          rg_config: dict[str, Any], **_columns: Any) -> float:
    """Reward: the last ``<answer>...</answer>`` of ``completion`` (reasoning-gym's ``extract_answer``)
    scored by the row's own dataset configuration (``score_answer``).

    Args:
        completion: the policy's text.
        question, answer, metadata, rg_dataset, rg_config: the row's columns, as :func:`rows` made them.

    Returns:
        reasoning-gym's score, a float in [0, 1] (not always 0 or 1); 0.0 with no answer block
        (whatever the dataset's scorer gives ``None``).
    """
    entry = {"question": question, "answer": answer, "metadata": metadata}
    return float(_dataset(rg_dataset, rg_config).score_answer(extract_answer(completion), entry))


def answered(completion: str, **_columns: Any) -> float:
    """Shaping reward: 1.0 when ``completion`` has an ``<answer>...</answer>`` block (reasoning-gym's
    ``extract_answer`` finds one), right or wrong, else 0.0: a model that never writes the block
    never gets a non-zero :func:`score` to learn from."""
    return 0.0 if extract_answer(completion) is None else 1.0


def solved(completion: str, **columns: Any) -> float:
    """``eval.grader``: 1.0 when :func:`score` is exactly 1.0 (partial credit counts as unsolved), else 0.0."""
    return 1.0 if score(completion, **columns) == 1.0 else 0.0
