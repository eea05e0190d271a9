"""Environment classes written for other trainers, run as plainrl environments (``rollout.env: file.py:MyEnv``).

A class named by ``rollout.env`` is one of three kinds (:func:`env_class_kind`):

- a plainrl :class:`~plainrl.rollout.envs.base.Environment` (it defines ``step(turn_text, state)``):
  built as it is;
- an OpenEnv ``Environment`` subclass (``openenv`` 0.10): run in process through
  :mod:`plainrl.rollout.envs.openenv`, on the adapter below;
- anything else is a TRL ``environment_factory`` class (TRL 1.16, ``GRPOTrainer``), run by
  :class:`ClassEnv`: ``reset(**row)`` starts an episode and may return text for the prompt, every
  public method (``inspect.getmembers(cls, inspect.isfunction)``, names not starting with ``_``,
  ``reset`` and ``get_reward`` excepted: TRL's own rule) is a tool whose schema comes from its type
  hints and Google-style docstring (:func:`~plainrl.rollout.envs.tools.function_schema`), called with
  ``<tool_call>`` blocks (:class:`~plainrl.rollout.envs.tools.ToolEnv`), and ``get_reward()`` is read
  once the episode is over.
"""

from __future__ import annotations

import functools
import inspect
import sys
from typing import Any, Callable, Literal

from plainrl.rollout.envs.base import EnvState, StepResult
from plainrl.rollout.envs.tools import ToolEnv, function_schema, run_sync
from plainrl.user_code import UserCodeError

__all__ = ["ClassEnv", "EnvClassError", "adapt_env_class", "env_class_kind", "tool_methods"]

EnvClassKind = Literal["plainrl", "openenv", "trl"]
RESERVED = ("reset", "get_reward")  # TRL's lifecycle methods: never tools

ACCEPTED = ("a plainrl Environment (reset(row), step(turn_text, state)), a TRL environment_factory class "
            "(reset(**row) returning text or None, its public methods as tools, an optional get_reward()) or an "
            "OpenEnv Environment subclass (docs/environments.md)")


class EnvClassError(UserCodeError):
    """``rollout.env`` names a class that is none of the accepted kinds, or whose tools have no usable schema;
    reported as a configuration error before any model loads."""


def _is_openenv(cls: type) -> bool:
    # a subclass of OpenEnv's base has imported it: nothing to import to find out
    base = getattr(sys.modules.get("openenv.core.env_server.interfaces"), "Environment", None)
    return base is not None and issubclass(cls, base)


def _has_plainrl_step(cls: type) -> bool:
    step = inspect.getattr_static(cls, "step", None)
    if not inspect.isfunction(step):
        return False
    positional = [p for p in inspect.signature(step).parameters.values()
                  if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    return len(positional) >= 3  # self, turn_text, state


def env_class_kind(cls: type) -> EnvClassKind:
    """Which kind of environment class ``cls`` is: ``"openenv"`` (a subclass of OpenEnv's ``Environment``),
    ``"plainrl"`` (it defines ``step(self, turn_text, state)``) or ``"trl"`` (anything else: TRL's
    ``environment_factory`` contract)."""
    if _is_openenv(cls):
        return "openenv"
    return "plainrl" if _has_plainrl_step(cls) else "trl"


def tool_methods(cls: type) -> list[str]:
    """The names of ``cls``'s methods that are tools under TRL's rule (``GRPOTrainer.__init__``, trl 1.16):
    functions defined on the class (static methods too), not starting with ``_``, except ``reset`` and
    ``get_reward``; sorted by name, as ``inspect.getmembers`` gives them."""
    return [name for name, _ in inspect.getmembers(cls, predicate=inspect.isfunction)
            if name not in RESERVED and not name.startswith("_")]


def _schemas(cls: type, ref: str) -> list[dict[str, Any]]:
    out = []
    for name in tool_methods(cls):
        try:
            out.append(function_schema(getattr(cls, name)))
        except ValueError as e:
            raise EnvClassError(f"rollout.env {ref!r}: the public method {cls.__name__}.{name} is a tool, so it "
                                f"needs type hints and a Google-style docstring with an Args: entry per argument "
                                f"(or a leading '_' to keep it from the model): {e}") from None
    return out


class ClassEnv:
    """A TRL-style environment object as a plainrl environment: its public methods are tools.

    Each episode gets a fresh object (``rollout.env``'s class, built with the row's ``env_args``).
    ``reset(row)`` calls ``obj.reset(**columns)`` with the row's columns (all but ``env_args``) and
    returns its text, which is appended to the last prompt message, as TRL does; the model calls the
    tools with ``<tool_call>`` blocks; a tool that raises is answered with its error (``Error: Type:
    message``) and the episode goes on, a tool that does not return within ``tool_timeout_s`` fails the
    episode (the object's state is unknown while the call may still run); a turn without a tool call
    ends the episode (:class:`~plainrl.rollout.envs.tools.ToolEnv`). ``final_reward()`` returns
    ``obj.get_reward()`` when the class has one. ``async`` methods are run to completion.

    Args:
        obj: the environment object.
        tools: the bound methods exposed as tools.
        schemas: their JSON schemas (same order).
        tool_timeout_s: the most seconds a tool call may take (None: no limit).
        max_turns: the environment's own turn limit (None: the rollout's).
    """

    def __init__(self, obj: Any, tools: list[Callable[..., Any]], schemas: list[dict[str, Any]], *,
                 tool_timeout_s: float | None, max_turns: int | None = None) -> None:
        self.obj = obj
        self._tools = ToolEnv(tools, schemas=schemas, timeout_s=tool_timeout_s, max_turns=max_turns,
                              fail_on_timeout=True)
        self.stop = self._tools.stop
        self.max_turns = max_turns
        if callable(getattr(obj, "get_reward", None)):  # only then: an environment without one gives no reward
            self.final_reward = self._get_reward

    def tools_schema(self) -> list[dict[str, Any]]:
        """The tools' JSON schemas, for the chat template."""
        return self._tools.tools_schema()

    def reset(self, row: dict[str, Any]) -> str | None:
        """``obj.reset(**columns)``; its text (or None) for the end of the prompt.

        Raises:
            TypeError: ``reset`` returned something other than a string or None.
        """
        reset = getattr(self.obj, "reset", None)
        if not callable(reset):
            return None
        out = run_sync(reset, **{k: v for k, v in row.items() if k != "env_args"})
        if out is not None and not isinstance(out, str):
            raise TypeError(f"{type(self.obj).__name__}.reset must return a string (the text appended to the "
                            f"prompt) or None, got {type(out).__name__}")
        return out

    def step(self, turn_text: str, state: EnvState) -> StepResult:
        """Run the turn's tool calls against the object."""
        return self._tools.step(turn_text, state)

    def _get_reward(self) -> float:
        value = run_sync(self.obj.get_reward)
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise TypeError(f"{type(self.obj).__name__}.get_reward must return a number, got {value!r:.100}")
        return float(value)


def _build_trl(cls: type, tool_timeout_s: float | None, **env_args: Any) -> ClassEnv:
    obj = cls(**env_args)
    names = tool_methods(cls)
    tools = [getattr(obj, n) for n in names]
    return ClassEnv(obj, tools, [function_schema(t) for t in tools], tool_timeout_s=tool_timeout_s)


def adapt_env_class(cls: type, ref: str, *, tool_timeout_s: float | None) -> Callable[..., Any]:
    """``rollout.env``'s class as the factory of one episode's environment, ``factory(**env_args)``.

    A plainrl environment class is returned as it is; a TRL class is wrapped in :class:`ClassEnv`; an
    OpenEnv class in :class:`plainrl.rollout.envs.openenv.OpenEnvAdapter`. The factory has the class's
    signature, so rows' ``env_args`` are checked against it before any model loads.

    Raises:
        EnvClassError: a class with no public method and no ``reset``, a tool method without type hints or
            documented arguments, or an OpenEnv class whose action type cannot be told (the message names
            ``rollout.env`` and what it accepts).
    """
    kind = env_class_kind(cls)
    if kind == "plainrl":
        return cls
    if kind == "openenv":
        from plainrl.rollout.envs.openenv import openenv_factory

        factory = openenv_factory(cls, ref, tool_timeout_s=tool_timeout_s)
    else:
        if not tool_methods(cls) and not callable(getattr(cls, "reset", None)):
            raise EnvClassError(f"rollout.env {ref!r}: the class {cls.__name__} has no public method and no reset(), "
                                f"so it is no environment; rollout.env accepts {ACCEPTED}")
        _schemas(cls, ref)  # every tool's schema, checked now rather than in every episode
        factory = functools.partial(_build_trl, cls, tool_timeout_s)
    try:
        factory.__signature__ = inspect.signature(cls)  # env_args are the class's
    except (TypeError, ValueError):
        pass
    return factory
