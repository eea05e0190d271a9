"""The gateway's 400s name the request field at fault (OpenAI's ``error.param``) by its path in the
request, through the schema's tagged unions: the union member is chosen by the value's JSON kind (or
a message's role), so the error is that member's own, and no pydantic member name leaks into the path."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from plainrl.rollout.gateway.errors import validation_error
from plainrl.rollout.gateway.schema import ChatRequest, CompletionRequest

USER = [{"role": "user", "content": "x"}]


@pytest.mark.parametrize("model, body, param, says", [
    # old code: "messages[0].content", "Input should be a valid string (got list ...)"
    (ChatRequest, {"model": "m", "messages": [{"role": "user", "content": [{"type": "text", "text": 3}]}]},
     "messages[0].content[0].text", "Input should be a valid string (got int 3)"),
    (ChatRequest, {"model": "m", "messages": [{"role": "user", "content": 5}]},
     "messages[0].content", "must be a string or a list of text parts"),
    (ChatRequest, {"model": "m", "messages": [{"role": "robot", "content": "x"}]},
     "messages[0]", "role is system, developer, user, assistant or tool"),
    # old code: "tool_choice", "Input should be 'none', 'auto' or 'required' (got dict ...)"
    (ChatRequest, {"model": "m", "messages": USER, "tool_choice": {"type": "function", "function": {"name": 3}}},
     "tool_choice.function.name", "Input should be a valid string"),
    (ChatRequest, {"model": "m", "messages": USER, "tool_choice": "sometimes"},
     "tool_choice", "Input should be 'none', 'auto' or 'required'"),
    (ChatRequest, {"model": "m", "messages": USER, "stop": 3}, "stop", "must be a string or a list of strings"),
    (ChatRequest, {"model": "m", "messages": USER, "stop": ["a", 4]}, "stop[1]", "Input should be a valid string"),
    # old code: "prompt", "Input should be a valid string (got list ...)"
    (CompletionRequest, {"model": "m", "prompt": [1, "a"]}, "prompt[1]", "Input should be a valid integer"),
    (CompletionRequest, {"model": "m", "prompt": [[1, 2], [3, "b"]]}, "prompt[1][1]", "Input should be a valid integer"),
])
def test_a_bad_field_is_named_by_its_path(model, body, param, says):
    with pytest.raises(ValidationError) as e:
        model.model_validate(body)
    err = validation_error(e.value)
    assert (err.status, err.param) == (400, param) and err.message.startswith(f"{param}: "), err.message
    assert says in err.message, err.message


def test_good_requests_keep_their_values():
    req = ChatRequest.model_validate({"model": "m", "messages": [
        {"role": "system", "content": "s"}, {"role": "user", "content": [{"type": "text", "text": "t"}]}],
        "stop": "x", "tool_choice": {"type": "function", "function": {"name": "f"}}})
    assert [type(m).__name__ for m in req.messages] == ["SystemMessage", "UserMessage"]
    assert req.messages[1].content[0].text == "t" and req.stop == "x" and req.tool_choice.function.name == "f"
    assert CompletionRequest.model_validate({"model": "m", "prompt": []}).prompt == []
    assert CompletionRequest.model_validate({"model": "m", "prompt": ["a", "b"]}).prompt == ["a", "b"]
