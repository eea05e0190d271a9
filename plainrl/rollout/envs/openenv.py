"""OpenEnv environments (``openenv`` 0.10) in process, as ``rollout.env: my_env.py:MyEnvironment``.

An OpenEnv ``Environment`` is a server-side object with ``reset(seed=None, episode_id=None, **kwargs)
-> Observation``, ``step(action) -> Observation`` (pydantic ``Action`` / ``Observation`` models; an
observation carries ``done`` and ``reward``) and ``close()``. plainrl builds one per episode in its
own process (an environment worker, under ``rollout.env_timeout_s``), with no server or container,
and runs it on the same adapter as TRL ``environment_factory`` classes
(:class:`~plainrl.rollout.envs.classes.ClassEnv`): the model acts through tools.

- An environment whose actions are OpenEnv's MCP actions (an ``MCPEnvironment``, or ``step`` annotated
  with ``CallToolAction``) exposes its MCP tools: their names, descriptions and input schemas come from
  ``step(ListToolsAction())``, and a call is ``step(CallToolAction(tool_name=..., arguments=...))``;
  the result's text is the tool's answer, its error (``observation.error`` or an ``is_error`` result)
  the tool's error.
- Any other environment exposes one tool, ``step``, whose arguments are the fields of its ``Action``
  type (the annotation of ``step``'s ``action``, or the first type argument of ``Environment[...]``),
  described by the action's pydantic JSON schema without ``metadata``; the tool builds the action
  (a validation error is the tool's error) and answers with the observation's fields as JSON, without
  ``done``, ``reward`` and ``metadata``.

The rewards of the episode's observations (``reset``'s included; None ones skipped) are summed into
the episode's environment reward (``env_reward``) when it is over; an observation with ``done`` ends
the episode after that turn. ``reset`` gets the
row's columns that its signature takes (all of them when it takes ``**kwargs``); the fields of its
observation are appended to the prompt as JSON, when it has any. ``close()`` is called when the
episode is over.
"""

from __future__ import annotations

import functools
import inspect
import json
import types
import typing
from typing import Any, Callable

from plainrl.user_code import require
from plainrl.rollout.envs.base import EnvState, StepResult
from plainrl.rollout.envs.classes import ACCEPTED, ClassEnv, EnvClassError

require("openenv", extra="openenv")
import openenv.core.env_server as _server  # noqa: E402
from openenv.core.env_server import interfaces as _interfaces  # noqa: E402
from openenv.core.env_server import mcp_types as _mcp  # noqa: E402
from openenv.core.env_server import types as _types  # noqa: E402

__all__ = ["OpenEnvAdapter", "action_type", "openenv_factory"]

_OBS_SKIP = {"done", "reward", "metadata"}


def _action_types(hint: Any) -> list[type]:
    union = typing.get_origin(hint) in (typing.Union, types.UnionType)
    options = typing.get_args(hint) if union else (hint,)
    return [t for t in options if inspect.isclass(t) and issubclass(t, _types.Action)]


def action_type(cls: type) -> type | None:
    """The ``Action`` class ``cls.step`` takes: ``CallToolAction`` for an MCP environment, else the
    annotation of ``step``'s ``action`` parameter, else the first type argument of ``Environment[...]``;
    None when none names a concrete ``Action`` subclass."""
    mcp_env = getattr(_server, "MCPEnvironment", None)  # None without fastmcp: then no subclass of it exists
    if mcp_env is not None and issubclass(cls, mcp_env):
        return _mcp.CallToolAction
    try:
        hints = typing.get_type_hints(cls.step)
    except Exception:  # an annotation that does not resolve: fall back to the generic base
        hints = {}
    params = [p for p in inspect.signature(cls.step).parameters if p != "self"]
    found = _action_types(hints.get(params[0])) if params else []
    if not found:
        for base in getattr(cls, "__orig_bases__", ()):
            if typing.get_origin(base) is _interfaces.Environment and typing.get_args(base):
                found = _action_types(typing.get_args(base)[0])
    if _mcp.CallToolAction in found:
        return _mcp.CallToolAction
    found = [t for t in found if t is not _types.Action]
    return found[0] if found else None


def _fields_json(obs: Any) -> str:
    return json.dumps(obs.model_dump(mode="json", exclude=_OBS_SKIP), ensure_ascii=False)


def _tool_result_text(obs: Any) -> str:
    """A ``CallToolObservation``'s answer for the model. Raises its error (shown to the model as the tool's)."""
    if obs.error is not None:
        raise RuntimeError(f"{obs.error.error_type.value}: {obs.error.message}")
    result = obs.result
    content = getattr(result, "content", None)
    if isinstance(content, list):  # an MCP CallToolResult: its text blocks
        text = "\n".join(str(getattr(c, "text", None) or json.dumps(getattr(c, "model_dump", dict)(), default=str))
                         for c in content)
        if getattr(result, "is_error", False) or getattr(result, "isError", False):
            raise RuntimeError(text)
        return text
    data = getattr(result, "data", result)
    return data if isinstance(data, str) else json.dumps(data, ensure_ascii=False, default=str)


class OpenEnvAdapter(ClassEnv):
    """One OpenEnv environment object as a plainrl environment (see the module docstring).

    Args:
        env: the OpenEnv ``Environment``.
        action: its ``Action`` class (:func:`action_type`); ``CallToolAction`` for MCP tools.
        tool_timeout_s: the most seconds one tool call (one ``step``) may take; passed to ``step``
            as its ``timeout_s`` too.
    Raises:
        RuntimeError: an MCP environment that lists no tools (or fails to list them).
    """

    def __init__(self, env: Any, action: type, *, tool_timeout_s: float | None) -> None:
        self.env, self._action = env, action
        self._rewards: list[float] = []
        self._done = False
        if action is _mcp.CallToolAction:
            listed = env.step(_mcp.ListToolsAction())
            if listed.metadata.get("error") or not listed.tools:
                raise RuntimeError(f"{type(env).__name__} lists no MCP tools: {listed.metadata.get('error', 'none')}")
            tools = [functools.partial(self._call_tool, t.name) for t in listed.tools]
            schemas = [{"type": "function", "function": {"name": t.name, "description": t.description,
                                                          "parameters": t.input_schema or {"type": "object"}}}
                       for t in listed.tools]
        else:
            params = action.model_json_schema()
            params.get("properties", {}).pop("metadata", None)
            params.pop("title", None)
            doc = inspect.getdoc(action) or f"Act in the {type(env).__name__} environment."
            tools = [self._step]
            schemas = [{"type": "function", "function": {"name": "step", "description": doc, "parameters": params}}]
        super().__init__(env, tools, schemas, tool_timeout_s=tool_timeout_s)
        takes = inspect.signature(env.step).parameters
        timed = "timeout_s" in takes or any(p.kind is p.VAR_KEYWORD for p in takes.values())
        self._step_kwargs = {"timeout_s": tool_timeout_s} if timed and tool_timeout_s is not None else {}

    def reset(self, row: dict[str, Any]) -> str | None:
        """``env.reset`` with the row's columns its signature takes; the observation's fields as JSON text."""
        sig = inspect.signature(self.env.reset)
        takes_all = any(p.kind is p.VAR_KEYWORD for p in sig.parameters.values())
        kwargs = {k: v for k, v in row.items() if k != "env_args" and (takes_all or k in sig.parameters)}
        obs = self.env.reset(**kwargs)
        self._rewards, self._done = [], False
        self._observe(obs)
        fields = obs.model_dump(mode="json", exclude=_OBS_SKIP)
        return f"\n\n{json.dumps(fields, ensure_ascii=False)}" if fields else None

    def step(self, turn_text: str, state: EnvState) -> StepResult:
        """The turn's tool calls; ``done`` when an observation ended the episode."""
        res = super().step(turn_text, state)
        res.done = self._done
        return res

    def final_reward(self) -> float | None:
        """The sum of every observation's reward (``reset``'s included); None when none gave one."""
        return sum(self._rewards) if self._rewards else None

    def close(self) -> None:
        """The environment's own ``close()``."""
        self.env.close()

    def _observe(self, obs: Any) -> Any:
        if obs.reward is not None:
            self._rewards.append(float(obs.reward))
        self._done = self._done or bool(obs.done)
        return obs

    def _act(self, action: Any) -> Any:
        if self._done:
            raise RuntimeError("the episode is over (the environment reported done)")
        return self._observe(self.env.step(action, **self._step_kwargs))

    def _step(self, **arguments: Any) -> str:
        return _fields_json(self._act(self._action(**arguments)))

    def _call_tool(self, name: str, **arguments: Any) -> str:
        return _tool_result_text(self._act(_mcp.CallToolAction(tool_name=name, arguments=arguments)))


def _build(cls: type, action: type, tool_timeout_s: float | None, **env_args: Any) -> OpenEnvAdapter:
    env = cls(**env_args)
    try:
        return OpenEnvAdapter(env, action, tool_timeout_s=tool_timeout_s)
    except BaseException:
        env.close()
        raise


def openenv_factory(cls: type, ref: str, *, tool_timeout_s: float | None) -> Callable[..., OpenEnvAdapter]:
    """The factory of one episode's :class:`OpenEnvAdapter` around a new ``cls(**env_args)``.

    Raises:
        EnvClassError: ``cls`` is abstract (``reset``, ``step`` or ``state`` missing), or its ``Action``
            type cannot be told (:func:`action_type`).
    """
    if inspect.isabstract(cls):
        missing = ", ".join(sorted(getattr(cls, "__abstractmethods__", ())))
        raise EnvClassError(f"rollout.env {ref!r}: the OpenEnv environment {cls.__name__} does not implement "
                            f"{missing}; rollout.env accepts {ACCEPTED}")
    action = action_type(cls)
    if action is None:
        raise EnvClassError(f"rollout.env {ref!r}: cannot tell the Action type of {cls.__name__}.step; annotate its "
                            "parameter (def step(self, action: MyAction, ...)) or subclass "
                            "Environment[MyAction, MyObservation, State]")
    return functools.partial(_build, cls, action, tool_timeout_s)
