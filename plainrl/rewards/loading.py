"""Turn ``rewards:`` config entries into callables, before any model loads.

A reference is ``package.module:fn`` (imported with :func:`importlib.import_module`)
or ``path/to/file.py:fn`` (a relative path is resolved against the current
directory). The part after the colon may be dotted (``module:obj.method``).

    fns = build_reward_fns([RewardSpec(fn="plainrl.rewards:correctness", weight=1.0)])

Everything here raises :class:`RewardLoadError` (a ``ValueError``, so pydantic
validators report it as a config error) with what is wrong and how to fix it.
"""

from __future__ import annotations

import difflib
import hashlib
import importlib
import importlib.util
import inspect
import math
import sys
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Any, Callable

from plainrl.rewards.forms import is_batched

if TYPE_CHECKING:
    from plainrl.config import RewardSpec

__all__ = ["BUILTIN_REWARDS", "RewardFn", "RewardLoadError", "build_reward_fns", "load_reward_fn"]

# Built-in rewards by short name (``fn: correctness``): name -> reference.
BUILTIN_REWARDS: dict[str, str] = {
    **{name: f"plainrl.rewards.builtins:{name}"
       for name in ("code_tests", "correctness", "countdown", "exact_match", "format_reward", "last_number_correct",
                    "length", "numeric_closeness", "think_format", "tool_success")},
    "judge": "plainrl.rewards.judge:judge",
}


class RewardLoadError(ValueError):
    """A reward reference that cannot be resolved; the message says what is wrong and the fix."""


@dataclass(frozen=True)
class RewardFn:
    """One reward function ready to be scored.

    name:   metric name (``reward/<name>/mean``) and key of ``RewardOutput.parts``.
    fn:     ``fn(completion, **columns, **kwargs) -> float | None``, or when ``batched``
            ``fn(completions, **columns_as_lists, **kwargs) -> list[float | None]``.
    weight: multiplier in the weighted total; weight 0 logs the reward without using it.
    kwargs: extra keyword arguments from the config; they win over dataset columns
            of the same name.
    params: keyword names ``fn`` declares (after the completion), or None when it
            takes ``**kwargs`` (or its signature cannot be read): then every column
            is passed. Computed once here so the scoring loop does not re-inspect.
    batched: ``fn`` was marked with :func:`plainrl.rewards.batched` (computed here).
    """

    name: str
    fn: Callable[..., Any]
    weight: float = 1.0
    kwargs: dict[str, Any] = field(default_factory=dict)
    params: frozenset[str] | None = field(default=None, init=False, repr=False, compare=False)
    batched: bool = field(default=False, init=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "kwargs", dict(self.kwargs))
        object.__setattr__(self, "params", _keyword_params(self.fn))
        object.__setattr__(self, "batched", is_batched(self.fn))


def _keyword_params(fn: Callable[..., Any]) -> frozenset[str] | None:
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):  # some builtins / C callables have no signature
        return None
    names: list[str] = []
    completion_slot_taken = False
    for p in sig.parameters.values():
        if p.kind is p.VAR_KEYWORD:
            return None
        if not completion_slot_taken and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD):
            completion_slot_taken = True  # receives the completion positionally
            continue
        if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY):
            names.append(p.name)
    return frozenset(names)


# ----------------------------------------------------------------------------- loading


def load_reward_fn(ref: str, *, what: str = "reward") -> Callable[..., Any]:
    """Import the callable named by ``ref``.

    Args:
        ref: ``package.module:fn`` or ``path/to/file.py:fn``; for ``what="reward"`` also a
            built-in's short name (:data:`BUILTIN_REWARDS`, e.g. ``correctness``). A target ending in
            ``.py`` or containing a path separator is a file; it is imported under a
            unique module name derived from its absolute path (so two files both
            called ``rewards.py`` do not collide, and loading the same file twice
            reuses one module), and its directory is appended to ``sys.path`` so it
            can import sibling helper modules.
        what: what the reference is for, named in error messages (``"reward"``,
            ``"rollout.env"``).

    Returns:
        The callable (not yet checked for its signature; see :func:`build_reward_fns`).

    Raises:
        RewardLoadError: no colon (and, for a reward, not a built-in name: the message
            lists them and the closest); module or file not found; the module raised while
            importing; attribute missing (the message lists the module's callables);
            the attribute is not callable.
    """
    if what == "reward" and isinstance(ref, str) and ref.strip() in BUILTIN_REWARDS:
        ref = BUILTIN_REWARDS[ref.strip()]
    if not isinstance(ref, str) or ":" not in ref:
        hint = ""
        if what == "reward" and isinstance(ref, str):
            close = difflib.get_close_matches(ref.strip(), list(BUILTIN_REWARDS), n=1)
            hint = (f" Did you mean the built-in {close[0]!r}?" if close else "") + \
                f" Built-in rewards by name: {', '.join(sorted(BUILTIN_REWARDS))}."
        raise RewardLoadError(
            f"{what} reference {ref!r} has no ':'; write 'package.module:function' or "
            f"'path/to/file.py:function'.{hint}"
        )
    target, _, attr_path = ref.strip().rpartition(":")
    if not target or not attr_path:
        raise RewardLoadError(
            f"{what} reference {ref!r} is missing the {'module/file' if not target else 'function'} "
            "part; write 'package.module:function' or 'path/to/file.py:function'"
        )
    label = f"{what} {ref!r}"
    if target.endswith(".py") or "/" in target or "\\" in target:
        module = _import_file(target, label)
        shown = str(module.__file__)
    else:
        module = _import_module(target, label)
        shown = module.__name__
    return _resolve_attr(module, shown, attr_path, label)


def _import_module(name: str, label: str) -> ModuleType:
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as e:
        missing = e.name or ""
        if missing == name or name.startswith(missing + "."):
            hint = ""
            as_file = Path.cwd() / (name.replace(".", "/") + ".py")
            if as_file.is_file():
                # console scripts do not put the current directory on sys.path
                hint = f" A file {as_file} exists: reference it as '{name.replace('.', '/')}.py:...'."
            raise RewardLoadError(
                f"{label}: module {name!r} not found (no module named {missing!r}). "
                f"Check the spelling, install the package, or put it on PYTHONPATH; for a "
                f"file, use 'path/to/file.py:function'.{hint}"
            ) from e
        raise RewardLoadError(
            f"{label}: importing module {name!r} failed because it imports {missing!r}, "
            "which is not installed; install it"
        ) from e
    except RewardLoadError as e:  # e.g. plainrl.integrations.MissingExtra: it names the fix already
        raise RewardLoadError(f"{label}: {e}") from e
    except Exception as e:
        raise RewardLoadError(
            f"{label}: importing module {name!r} raised {type(e).__name__}: {e}"
        ) from e


def _import_file(target: str, label: str) -> ModuleType:
    given = Path(target).expanduser()
    path = (given if given.is_absolute() else Path.cwd() / given).resolve()
    if not path.is_file():
        where = "" if given.is_absolute() else f" (resolved against the current directory {Path.cwd()})"
        raise RewardLoadError(
            f"{label}: file {str(path)!r} not found{where}; check the path, or give an absolute one"
        )
    if path.suffix != ".py":
        raise RewardLoadError(f"{label}: {str(path)!r} is not a .py file")
    digest = hashlib.sha1(str(path).encode()).hexdigest()[:10]
    stem = "".join(c if c.isalnum() else "_" for c in path.stem)
    mod_name = f"plainrl_user_reward_{stem}_{digest}"  # no dot: pickle must find it in sys.modules
    if mod_name in sys.modules:
        return sys.modules[mod_name]
    spec = importlib.util.spec_from_file_location(mod_name, path)
    if spec is None or spec.loader is None:
        raise RewardLoadError(f"{label}: cannot import {str(path)!r} as a Python module")
    module = importlib.util.module_from_spec(spec)
    if str(path.parent) not in sys.path:
        sys.path.append(str(path.parent))
    # registered before executing so dataclasses/pickle inside the file can find it
    sys.modules[mod_name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException as e:
        del sys.modules[mod_name]
        if not isinstance(e, Exception):
            raise
        if isinstance(e, RewardLoadError):
            raise RewardLoadError(f"{label}: {e}") from e
        raise RewardLoadError(
            f"{label}: importing {str(path)!r} raised {type(e).__name__}: {e}"
        ) from e
    return module


def _resolve_attr(module: ModuleType, shown: str, attr_path: str, label: str) -> Callable[..., Any]:
    obj: Any = module
    for i, part in enumerate(attr_path.split(".")):
        if not hasattr(obj, part):
            if i == 0:
                available = _module_callables(module)
                close = difflib.get_close_matches(part, available, n=1)
                did_you_mean = f" Did you mean {close[0]!r}?" if close else ""
                listing = ", ".join(available) if available else "(none)"
                raise RewardLoadError(
                    f"{label}: {shown!r} has no attribute {part!r}.{did_you_mean} "
                    f"Callables defined there: {listing}"
                )
            raise RewardLoadError(
                f"{label}: {'.'.join(attr_path.split('.')[:i])!r} has no attribute {part!r}"
            )
        obj = getattr(obj, part)
    if not callable(obj):
        raise RewardLoadError(
            f"{label}: {attr_path!r} is a {type(obj).__name__}, not a function; "
            "point the reference at a callable"
        )
    return obj


def _module_callables(module: ModuleType) -> list[str]:
    public = {n: v for n, v in vars(module).items() if not n.startswith("_") and callable(v)}
    # Prefer what the module defines (or re-exports from its own package) over
    # helpers it merely imported, like `math` functions or `Path`.
    root = module.__name__.split(".")[0]
    own = [n for n, v in public.items() if str(getattr(v, "__module__", "")).split(".")[0] == root]
    return sorted(own or public)


# ----------------------------------------------------------------------------- specs


def build_reward_fns(specs: list[RewardSpec]) -> list[RewardFn]:
    """Load and check every reward spec; safe to call during config validation.

    Checks, without calling anything: the reference resolves; the function can take
    the completion as its first positional argument; every ``kwargs`` key is a
    parameter it declares (unless it takes ``**kwargs``); the weight is finite;
    names are unique.

    Args:
        specs: ``config.rewards`` entries (anything with ``fn``, ``weight``, ``name``,
            ``kwargs`` attributes).

    Returns:
        One :class:`RewardFn` per function spec, in order (specs with ``model`` are
        reward models, loaded by :class:`plainrl.rewards.model.RewardModel`; only
        their names are checked here). ``name`` defaults to the function's
        ``__name__`` (the class name for callable objects).

    Raises:
        RewardLoadError: any problem above; messages start with ``rewards[i]``.
    """
    out: list[RewardFn] = []
    seen: dict[str, str] = {}  # name -> where it was first given
    for i, spec in enumerate(specs):
        weight = float(spec.weight)
        fn = None
        if getattr(spec, "fn", None) is None:  # a reward model: loaded with the models (plainrl.rewards.model)
            where, name = f"rewards[{i}] (model={spec.model!r})", spec.name or "reward_model"
        else:
            where = f"rewards[{i}] (fn={spec.fn!r})"
            try:
                fn = load_reward_fn(spec.fn)
            except RewardLoadError as e:
                raise RewardLoadError(f"rewards[{i}]: {e}") from e.__cause__
            _check_signature(fn, dict(spec.kwargs or {}), where)
            name = spec.name or getattr(fn, "__name__", None) or type(fn).__name__
        if not math.isfinite(weight):
            raise RewardLoadError(f"{where}: weight={spec.weight!r} must be a finite number")
        if name in seen:
            raise RewardLoadError(
                f"reward name {name!r} is used twice: {seen[name]} and {where}; "
                "give one of them a distinct 'name:'"
            )
        seen[name] = where
        if fn is not None:
            out.append(RewardFn(name=name, fn=fn, weight=weight, kwargs=dict(spec.kwargs or {})))
    return out


def _check_signature(fn: Callable[..., Any], kwargs: dict[str, Any], where: str) -> None:
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        return  # cannot inspect: trust it and let calls report problems
    params = list(sig.parameters.values())
    takes_positional = any(
        p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD, p.VAR_POSITIONAL) for p in params
    )
    if not takes_positional:
        form = "fn(completions, **columns) (batched)" if is_batched(fn) else "fn(completion, **columns)"
        raise RewardLoadError(
            f"{where}: {sig} cannot take the completion{'s' if is_batched(fn) else ''} as its first "
            f"positional argument; define it as {form}"
        )
    accepted = _keyword_params(fn)
    if accepted is not None:
        unknown = sorted(set(kwargs) - accepted)
        if unknown:
            raise RewardLoadError(
                f"{where}: kwargs {unknown} are not parameters of {sig}; "
                f"it accepts {sorted(accepted) or 'no keyword arguments'} (or add **kwargs)"
            )
