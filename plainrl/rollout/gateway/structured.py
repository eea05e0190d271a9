"""Structured outputs: honoured where the engine can constrain decoding, refused where it cannot,
never ignored.

A request that asks for JSON (Chat Completions' ``response_format`` ``json_schema`` /
``json_object``, the Responses API's ``text.format``, vLLM's own ``structured_outputs``
extension) gets, on vLLM engines (``rollout.engine: remote`` with vLLM servers, ``rollout.engine:
vllm``), vLLM's structured outputs: the sample is constrained to the schema
(``SamplingParams.structured_outputs``, sent as the completions API's ``structured_outputs``).
vLLM applies the grammar's mask to the logits before sampling, so the sampled tokens' logprobs
are of the constrained distribution (the policy renormalised over the tokens the grammar allows),
while the learner's are of the policy itself: a token where the grammar removed probability
mass reads as off-policy by exactly that mass (``rollout/logprob_diff``, the correction's weights).

On the embedded engine, which has no grammar, the request is a 400 that names the option: a
schema the model was never held to would hand the agent text that may not parse while the run
trains as if it had asked for free text. ``{"type": "text"}`` is free text everywhere.
"""

from __future__ import annotations

import json
from typing import Any

from plainrl.rollout.gateway.errors import GatewayError

__all__ = ["structured_outputs"]

# vLLM's StructuredOutputsParams fields that pick a constraint (one per request)
_VLLM_KINDS = ("json", "json_object", "regex", "choice", "grammar", "structural_tag")


def structured_outputs(llm: Any, fmt: dict[str, Any] | None, param: str, *,
                       vllm: dict[str, Any] | None = None) -> str | None:
    """The request's format as vLLM's ``structured_outputs`` JSON text, or None for free text.

    Args:
        llm: the episode's handle (:attr:`~plainrl.rollout.llm.LLM.structured_outputs`: whether its
            engine constrains decoding).
        fmt: ``response_format`` (Chat: ``{"type": "json_schema", "json_schema": {"name", "schema",
            "strict"}}``) or ``text.format`` (Responses: ``{"type": "json_schema", "name", "schema",
            "strict"}``), ``{"type": "json_object"}`` or ``{"type": "text"}``; None: not asked.
        param: the field named in errors (``response_format``, ``text.format``).
        vllm: vLLM's ``structured_outputs`` extension as sent (``{"json": ...}``, ``{"regex": ...}``, ...).
    Raises:
        GatewayError: 400 naming ``param`` for a format of another type or without its schema, and
            for any constraint on an engine that cannot apply it (the embedded engine).
    """
    spec: dict[str, Any] | None = None
    if fmt is not None:
        kind = fmt.get("type")
        if kind == "json_object":
            spec = {"json_object": True}
        elif kind == "json_schema":
            holder = fmt.get("json_schema", fmt) if param == "response_format" else fmt
            where = f"{param}.json_schema.schema" if param == "response_format" else f"{param}.schema"
            schema = holder.get("schema") if isinstance(holder, dict) else None
            if not isinstance(schema, dict):
                raise GatewayError(400, f"{where}: a json_schema format needs its JSON schema (an object)", param=where)
            spec = {"json": schema}
        elif kind != "text":
            raise GatewayError(400, f"{param}: type {kind!r} is not one of text, json_object, json_schema",
                               param=param)
    if vllm:
        kinds = [k for k in _VLLM_KINDS if vllm.get(k) not in (None, False)]
        if len(kinds) != 1 or spec is not None:
            raise GatewayError(400, "structured_outputs: give exactly one of " + ", ".join(_VLLM_KINDS)
                               + (f", and not beside {param}" if spec is not None else ""), param="structured_outputs")
        spec, param = dict(vllm), "structured_outputs"
    if spec is None:
        return None
    if not llm.structured_outputs:
        raise GatewayError(400, f"{param}: structured outputs need an engine that constrains decoding to the schema "
                                "(vLLM: rollout.engine remote or vllm); the embedded engine has no grammar, and "
                                "an unconstrained reply would not be what was asked for. Leave the option out and "
                                "ask for JSON in the prompt, or have the model call a tool whose parameters are "
                                "the schema", param=param)
    return json.dumps(spec, sort_keys=True, ensure_ascii=False)
