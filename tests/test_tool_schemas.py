"""Tool arguments checked all the way down by ``jsonschema``: nested objects, arrays, required keys,
enums; the error the model reads names the path into the arguments."""

from __future__ import annotations

import json
from typing import Optional

import pytest

from plainrl.rollout.envs.base import EnvState
from plainrl.rollout.envs.tools import ToolEnv, function_schema

CALLS: list[dict] = []


def search(query: dict) -> str:
    """Search the catalogue.

    Args:
        query: what to find.
    """
    CALLS.append(query)
    return "found"


SEARCH_SCHEMA = {"type": "function", "function": {
    "name": "search", "description": "Search the catalogue.",
    "parameters": {"type": "object", "required": ["query"], "properties": {"query": {
        "type": "object", "required": ["text"], "additionalProperties": False, "properties": {
            "text": {"type": "string"},
            "filters": {"type": "array", "items": {
                "type": "object", "required": ["field", "op"], "properties": {
                    "field": {"type": "string"}, "op": {"enum": ["eq", "lt", "gt"]}}}}}}}}}}


def _step(env: ToolEnv, args: dict):
    text = f'<tool_call>{json.dumps({"name": "search", "arguments": args})}</tool_call>'
    return env.step(text, EnvState(row={}, text=text, finish_reason="stop"))


@pytest.mark.parametrize("args, why", [
    ({"query": {"filters": []}}, "argument $.query: 'text' is a required property"),
    ({"query": {"text": "x", "filters": [{"field": 7, "op": "eq"}]}},
     "argument $.query.filters[0].field: 7 is not of type 'string'"),
    ({"query": {"text": "x", "filters": [{"field": "a", "op": "eq"}, {"field": "b", "op": "ne"}]}},
     "argument $.query.filters[1].op: 'ne' is not one of ['eq', 'lt', 'gt']"),
    ({"query": {"text": "x", "filters": [{"field": "a"}]}}, "argument $.query.filters[0]: 'op' is a required property"),
    ({"query": {"text": "x", "page": 2}}, "argument $.query: Additional properties are not allowed ('page'"),
    ({"query": {"text": "x", "filters": {"field": "a", "op": "eq"}}},
     "argument $.query.filters: {'field': 'a', 'op': 'eq'} is not of type 'array'"),
])
def test_nested_arguments_are_checked_and_the_path_named(args, why):
    """Old code checked the top-level type only (``query`` is an object) and ran the tool with these."""
    env = ToolEnv([search], schemas=[SEARCH_SCHEMA])
    CALLS.clear()
    res = _step(env, args)
    assert res.info == {"tool_calls": 0, "malformed_calls": 1, "tool_errors": 0}, res.observation
    assert why in res.observation[0]["content"], res.observation
    assert not CALLS


def test_valid_nested_arguments_run():
    env = ToolEnv([search], schemas=[SEARCH_SCHEMA])
    res = _step(env, {"query": {"text": "x", "filters": [{"field": "a", "op": "lt"}]}})
    assert res.observation == [{"role": "tool", "name": "search", "content": "found"}]


def test_optional_arguments_accept_null():
    """transformers' ``get_json_schema`` writes ``Optional`` as OpenAPI's ``nullable``, which is honoured."""
    def greet(name: Optional[str] = None) -> str:
        """Say hello.

        Args:
            name: whom to greet.
        """
        return f"hello {name}"

    env = ToolEnv([greet])
    assert function_schema(greet)["function"]["parameters"]["properties"]["name"].get("nullable") is True
    text = '<tool_call>{"name": "greet", "arguments": {"name": null}}</tool_call>'
    res = env.step(text, EnvState(row={}, text=text, finish_reason="stop"))
    assert res.observation[0]["content"] == "hello None"
    text = '<tool_call>{"name": "greet", "arguments": {"name": 3}}</tool_call>'
    res = env.step(text, EnvState(row={}, text=text, finish_reason="stop"))
    assert "argument $.name: 3 is not of type 'string', 'null'" in res.observation[0]["content"], res.observation


def test_a_schema_that_is_not_a_json_schema_is_refused():
    bad = json.loads(json.dumps(SEARCH_SCHEMA))
    bad["function"]["parameters"]["properties"]["query"]["type"] = "dictionary"
    with pytest.raises(ValueError, match=r"tool 'search': its parameters are not a valid JSON schema at \$.properties.query.type"):
        ToolEnv([search], schemas=[bad])
