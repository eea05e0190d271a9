"""Turn ``rewards:`` config entries into callables, before any model loads.

A reference is :mod:`plainrl.user_code`'s ``package.module:fn`` or ``path/to/file.py:fn``, or
a built-in's short name.

    fns = build_reward_fns([RewardSpec(fn="plainrl.rewards:correctness", weight=1.0)])

Everything here raises :class:`RewardLoadError` (a ``ValueError``, so pydantic
validators report it as a config error) with what is wrong and how to fix it.
"""

from __future__ import annotations

import difflib
import inspect
import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable

from plainrl.rewards.forms import is_batched
from plainrl.user_code import UserCodeError, load_callable

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


#: A reward reference that cannot be resolved: the error of every ``module:fn`` reference
RewardLoadError = UserCodeError


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
    """Import the callable named by ``ref``: :func:`plainrl.user_code.load_callable`, and for
    ``what="reward"`` also a built-in's short name (:data:`BUILTIN_REWARDS`, e.g. ``correctness``).

    Returns:
        The callable (not yet checked for its signature; see :func:`build_reward_fns`).

    Raises:
        RewardLoadError: as :func:`~plainrl.user_code.load_callable`; a reward reference without a
            colon that is no built-in name gets the built-ins listed and the closest.
    """
    hint = ""
    if what == "reward" and isinstance(ref, str):
        if ref.strip() in BUILTIN_REWARDS:
            ref = BUILTIN_REWARDS[ref.strip()]
        elif ":" not in ref:
            close = difflib.get_close_matches(ref.strip(), list(BUILTIN_REWARDS), n=1)
            hint = (f" Did you mean the built-in {close[0]!r}?" if close else "") + \
                f" Built-in rewards by name: {', '.join(sorted(BUILTIN_REWARDS))}."
    return load_callable(ref, what=what, hint=hint)


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
