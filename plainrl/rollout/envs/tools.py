"""Three simple ways to write an environment, each mapping onto :class:`~plainrl.rollout.envs.base.Environment`.

1. :class:`TriggerEnv` -- pause at stop strings and insert what a handler returns.
2. :class:`InteractEnv` -- an ``interact(messages) -> messages`` function answering
   each assistant message with chat messages (a user, a tool, a game...).
3. :class:`ToolEnv` -- typed Python functions called through Hermes/Qwen-style
   ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` blocks.
"""

from __future__ import annotations

import asyncio
import inspect
import json
import re
from dataclasses import dataclass
from typing import Any, Callable

import jsonschema

from plainrl.rollout.envs.base import EnvState, EnvTimeoutError, StepResult, call_with_timeout

__all__ = [
    "InteractEnv",
    "ToolCall",
    "ToolCallError",
    "ToolEnv",
    "TriggerEnv",
    "function_schema",
    "hermes_tools_prompt",
    "parse_tool_calls",
    "run_sync",
]


class TriggerEnv:
    """Pause at ``stop`` strings and insert ``handler(text)``.

    Args:
        stop: strings at which generation pauses (e.g. ``("=",)``).
        handler: ``fn(text) -> str | None`` called with the whole completion so
            far (``state.text``, ending with the stop string) after a pause;
            the returned string is inserted verbatim, None inserts nothing and
            generation resumes.
        max_turns: the most turns (insertions + 1); None = no own limit.
        timeout_s: limit per handler call (see :func:`call_with_timeout`);
            None = no limit. A handler that raises or times out ends the episode.
    """

    def __init__(self, stop: tuple[str, ...], handler: Callable[[str], str | None], *,
                 max_turns: int | None = None, timeout_s: float | None = 30.0):
        if not stop:
            raise ValueError("TriggerEnv needs at least one stop string")
        self.stop = tuple(stop)
        self.handler = handler
        self.max_turns = max_turns
        self.timeout_s = timeout_s

    def reset(self, row: dict[str, Any]) -> None:
        """No extra prompt messages."""
        return None

    def step(self, turn_text: str, state: EnvState) -> StepResult:
        """Call the handler after a pause at a stop string; nothing after EOS or length."""
        if state.finish_reason != "stop":
            return StepResult()
        out = call_with_timeout(self.handler, state.text, timeout_s=self.timeout_s)
        if out is not None and not isinstance(out, str):
            raise TypeError(f"TriggerEnv handler must return str or None, got {type(out).__name__}")
        return StepResult(observation=out or "")


class InteractEnv:
    """Answer each assistant turn with chat messages from ``interact(messages)``.

    The model's turn ends on EOS (or a pause at ``stop``); ``interact`` receives
    the conversation so far (a copy of ``state.messages``, ending with the
    assistant message just written) and returns the messages to add, e.g.
    ``[{"role": "tool", "content": "..."}]`` or a user reply. They are rendered
    with the chat template as a continuation of the conversation. An empty list
    or None ends the episode.

    Args:
        interact: ``fn(messages: list[dict]) -> list[dict] | None``.
        stop: optional pause strings (e.g. ``("</tool_call>",)``).
        max_turns: the most assistant turns; None = no own limit.
        timeout_s: limit per ``interact`` call; None = no limit. Raising or
            timing out ends the episode with an error.
    """

    def __init__(self, interact: Callable[[list[dict[str, Any]]], list[dict[str, Any]] | None], *,
                 stop: tuple[str, ...] = (), max_turns: int | None = None, timeout_s: float | None = 30.0):
        self.interact = interact
        self.stop = tuple(stop)
        self.max_turns = max_turns
        self.timeout_s = timeout_s

    def reset(self, row: dict[str, Any]) -> None:
        """No extra prompt messages."""
        return None

    def step(self, turn_text: str, state: EnvState) -> StepResult:
        """Ask ``interact`` for the next messages.

        Raises:
            TypeError: ``interact`` returned something other than a list of dicts with a role.
        """
        msgs = [dict(m) for m in state.messages]
        out = call_with_timeout(self.interact, msgs, timeout_s=self.timeout_s)
        if not out:
            return StepResult(done=True)
        if not isinstance(out, list) or not all(isinstance(m, dict) and "role" in m for m in out):
            raise TypeError(f"interact must return a list of messages (dicts with 'role'), got {out!r:.200}")
        return StepResult(observation=out)


# ------------------------------------------------------------------------------ tools


def function_schema(fn: Callable[..., Any]) -> dict[str, Any]:
    """JSON schema of a typed, documented function, as chat templates expect it.

    Uses :func:`transformers.utils.get_json_schema`: the type hints give the
    parameter types, the Google-style docstring the description (first
    paragraph) and each argument's description (``Args:`` section, every argument
    needed; ``(choices: [...])`` becomes an ``enum``).

    Returns:
        ``{"type": "function", "function": {"name", "description", "parameters", ...}}``.
    Raises:
        ValueError: no docstring, an undocumented argument, or a hint with no JSON type.
    """
    from transformers.utils import get_json_schema

    try:
        return get_json_schema(fn)
    except Exception as e:  # DocstringParsingException / TypeHintParsingException
        raise ValueError(f"cannot build a tool schema for {getattr(fn, '__name__', fn)!r}: {e}") from e


def hermes_tools_prompt(schemas: list[dict[str, Any]]) -> str:
    """System-prompt text describing tools in the Hermes/Qwen format.

    Used when the tokenizer's chat template ignores ``tools=`` (SmolLM2's does),
    so the model still learns the tools and the call syntax.
    """
    lines = "\n".join(json.dumps(s, ensure_ascii=False) for s in schemas)
    return (
        "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
        "You are provided with function signatures within <tools></tools> XML tags:\n"
        f"<tools>\n{lines}\n</tools>\n\n"
        "For each function call, return a json object with function name and arguments within "
        "<tool_call></tool_call> XML tags:\n"
        '<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>'
    )


@dataclass
class ToolCall:
    """One parsed call: the tool's name and its arguments."""

    name: str
    arguments: dict[str, Any]


@dataclass
class ToolCallError:
    """A ``<tool_call>`` block that could not be parsed; ``message`` says why (shown to the model)."""

    text: str
    message: str


_CALL_RE = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)


def parse_tool_calls(text: str) -> list[ToolCall | ToolCallError]:
    """Every ``<tool_call>{json}</tool_call>`` block in ``text``, in order.

    The JSON must be an object with a string ``name`` and an object
    ``arguments`` (a JSON string holding an object is accepted too; missing
    ``arguments`` means none). A ``<tool_call>`` left open at the end of the text
    is reported as an error.

    Returns:
        A :class:`ToolCall` or a :class:`ToolCallError` per block (empty: no call).
    """
    out: list[ToolCall | ToolCallError] = []
    end = 0
    for m in _CALL_RE.finditer(text):
        end = m.end()
        body = m.group(1).strip()
        try:
            obj = json.loads(body)
        except json.JSONDecodeError as e:
            out.append(ToolCallError(body, f"the tool call is not valid JSON: {e}"))
            continue
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
            out.append(ToolCallError(body, 'a tool call must be a JSON object {"name": ..., "arguments": {...}}'))
            continue
        args = obj.get("arguments", {})
        if isinstance(args, str):
            try:
                args = json.loads(args) if args.strip() else {}
            except json.JSONDecodeError as e:
                out.append(ToolCallError(body, f"'arguments' is a string that is not valid JSON: {e}"))
                continue
        if not isinstance(args, dict):
            out.append(ToolCallError(body, "'arguments' must be a JSON object"))
            continue
        out.append(ToolCall(obj["name"], args))
    if "<tool_call>" in text[end:]:
        out.append(ToolCallError(text[end:], "the tool call was not closed with </tool_call>"))
    return out


def _with_nullable(schema: Any) -> Any:
    """``schema`` with OpenAPI's ``"nullable": true`` (what transformers' ``get_json_schema`` writes for
    ``Optional[...]``, which JSON Schema does not know) spelled as JSON Schema's ``"null"`` type."""
    if isinstance(schema, list):
        return [_with_nullable(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: _with_nullable(v) for k, v in schema.items()}
    if out.pop("nullable", False) and "type" in out:
        types = [out["type"]] if isinstance(out["type"], str) else list(out["type"])
        out["type"] = types + ["null"] if "null" not in types else types
    return out


def arguments_validator(name: str, parameters: dict[str, Any]) -> jsonschema.protocols.Validator:
    """A ``jsonschema`` validator of a tool's ``parameters`` schema (the draft it names in
    ``$schema``, else 2020-12), checking nested objects, arrays, required keys and enums.

    Raises:
        ValueError: the schema itself is not a valid JSON schema (names the tool and the path).
    """
    schema = _with_nullable(parameters)
    cls = jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator)
    try:
        cls.check_schema(schema)
    except jsonschema.SchemaError as e:
        raise ValueError(f"tool {name!r}: its parameters are not a valid JSON schema at "
                         f"{e.json_path}: {e.message}") from e
    return cls(schema)


def argument_problem(validator: jsonschema.protocols.Validator, arguments: dict[str, Any]) -> str | None:
    """The most relevant schema violation of ``arguments`` (``jsonschema.exceptions.best_match``),
    as the model will read it: ``argument $.query.filters[1].field: 7 is not of type 'string'``; None if valid."""
    error = jsonschema.exceptions.best_match(validator.iter_errors(arguments))
    if error is None:
        return None
    return f"argument {error.json_path}: {error.message}"


def run_sync(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """``fn(*args, **kwargs)``, awaited to its result when it returns an awaitable (an ``async`` tool or
    method), on an event loop of its own (``asyncio.run``): call it from a thread without a running loop."""
    out = fn(*args, **kwargs)
    if inspect.isawaitable(out):
        async def wait() -> Any:
            return await out
        return asyncio.run(wait())
    return out


class ToolEnv:
    """Tools as typed Python functions, called with ``<tool_call>`` blocks.

    Each function's JSON schema comes from its signature and docstring
    (:func:`function_schema`); :meth:`tools_schema` gives them to the chat
    template (``tools=``), or, when the template ignores tools, the rollout puts
    :func:`hermes_tools_prompt` into the system message. Generation pauses at
    ``</tool_call>``; every call in the turn is checked (known tool, arguments
    match the schema) and run, and the results come back as ``tool`` messages
    rendered by the chat template. A turn without a call ends the episode when
    the model ends it (EOS).

    Counted in ``info``: ``tool_calls`` (well-formed calls run), ``malformed_calls``
    (bad JSON, unknown tool, bad arguments: answered with an error message),
    ``tool_errors`` (well-formed calls whose function raised or timed out: the
    error is shown to the model).

    Args:
        tools: the functions (names must be unique); ``async`` ones are run to completion
            (``asyncio.run``, in the call's own thread).
        max_turns: the most assistant turns; None = no own limit.
        timeout_s: limit per function call (see :func:`call_with_timeout`);
            None = no limit.
        max_output_chars: the most characters of a result shown to the model.
        schemas: the tools' JSON schemas, one per function in the same order, when they do not
            come from the functions' signatures (tools described by another library); None:
            :func:`function_schema` of each.
        fail_on_timeout: a call past ``timeout_s`` raises :class:`EnvTimeoutError` (ending the
            episode as an environment error) instead of being shown to the model: for tools
            that share an object's state, which is unknown while the call may still be running.
    Raises:
        ValueError: a function has no usable schema, a schema's parameters are not a valid JSON
            schema, or two tools share a name.
    """

    stop: tuple[str, ...] = ("</tool_call>",)

    def __init__(self, tools: list[Callable[..., Any]], *, max_turns: int | None = None,
                 timeout_s: float | None = 10.0, max_output_chars: int = 2000,
                 schemas: list[dict[str, Any]] | None = None, fail_on_timeout: bool = False):
        if schemas is not None and len(schemas) != len(tools):
            raise ValueError(f"{len(schemas)} schemas for {len(tools)} tools")
        self.schemas = list(schemas) if schemas is not None else [function_schema(fn) for fn in tools]
        names = [s["function"]["name"] for s in self.schemas]
        dup = {n for n in names if names.count(n) > 1}
        if dup:
            raise ValueError(f"tool names must be unique, repeated: {sorted(dup)}")
        self.tools = dict(zip(names, tools))
        self._params = {s["function"]["name"]: s["function"].get("parameters", {}) for s in self.schemas}
        self._validators = {n: arguments_validator(n, p) for n, p in self._params.items()}
        self.max_turns = max_turns
        self.timeout_s = timeout_s
        self.max_output_chars = max_output_chars
        self.fail_on_timeout = fail_on_timeout

    def tools_schema(self) -> list[dict[str, Any]]:
        """The tools' JSON schemas, for ``tokenizer.apply_chat_template(..., tools=...)``."""
        return [dict(s) for s in self.schemas]

    def reset(self, row: dict[str, Any]) -> None:
        """No extra messages: the rollout adds the tools to the prompt via :meth:`tools_schema`."""
        return None

    def step(self, turn_text: str, state: EnvState) -> StepResult:
        """Run the tool calls of this turn; no observation when there are none."""
        calls = parse_tool_calls(turn_text)
        if not calls:
            return StepResult()
        msgs: list[dict[str, Any]] = []
        info = {"tool_calls": 0, "malformed_calls": 0, "tool_errors": 0}
        for call in calls:
            if isinstance(call, ToolCallError):
                info["malformed_calls"] += 1
                msgs.append({"role": "tool", "name": "error", "content": f"Error: {call.message}"})
                continue
            problem = self.check_call(call)
            if problem is not None:
                info["malformed_calls"] += 1
                msgs.append({"role": "tool", "name": call.name, "content": f"Error: {problem}"})
                continue
            info["tool_calls"] += 1
            try:
                fn, args = self.tools[call.name], call.arguments
                # a closure, so tool arguments cannot collide with call_with_timeout's own
                result = call_with_timeout(lambda: run_sync(fn, **args), timeout_s=self.timeout_s)
                content = result if isinstance(result, str) else json.dumps(result, ensure_ascii=False, default=str)
            except EnvTimeoutError:
                if self.fail_on_timeout:
                    raise EnvTimeoutError(f"tool {call.name} did not return within {self.timeout_s:g} s") from None
                info["tool_errors"] += 1
                content = f"Error: {call.name} did not return within {self.timeout_s:g} s"
            except Exception as e:  # a tool's failure is information for the model, not a crash
                info["tool_errors"] += 1
                content = f"Error: {type(e).__name__}: {e}"
            if len(content) > self.max_output_chars:
                content = content[: self.max_output_chars] + "...[truncated]"
            msgs.append({"role": "tool", "name": call.name, "content": content})
        return StepResult(observation=msgs, info=info)

    def check_call(self, call: ToolCall) -> str | None:
        """Why ``call`` cannot be run, or None: an unknown tool, a missing or unknown argument, or any
        violation of the tool's JSON schema at any depth (``jsonschema``: types, nested objects'
        required keys, array items, enums), named by its path in the arguments (``$.filters[1].field``)."""
        if call.name not in self.tools:
            return f"unknown tool {call.name!r}; available: {', '.join(self.tools)}"
        params = self._params[call.name]
        props = params.get("properties", {})
        missing = [p for p in params.get("required", []) if p not in call.arguments]
        if missing:
            return f"missing required argument(s) {missing} for {call.name}"
        unknown = [a for a in call.arguments if a not in props]
        if unknown:
            return f"unknown argument(s) {unknown} for {call.name}; it takes {list(props)}"
        problem = argument_problem(self._validators[call.name], call.arguments)
        if problem is not None:
            return f"{problem} (calling {call.name})"
        try:
            inspect.signature(self.tools[call.name]).bind(**call.arguments)
        except TypeError as e:
            return f"bad arguments for {call.name}: {e}"
        return None
