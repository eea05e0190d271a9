"""Every tool a client sends, with the real ``openai`` and ``anthropic`` SDKs against the gateway:
Responses' ``local_shell`` and ``custom`` (freeform) tools and Anthropic's ``bash_*`` and
``text_editor_*`` rendered as functions with their published schemas, their calls handed back in
each dialect's own item or block and sent back as the same segment; hosted tools (web search,
file search) dropped and counted (``gateway/dropped_tools``), never a 400; images and documents a
400 naming the part."""

from __future__ import annotations

import json

import anthropic
import openai
import pytest

from plainrl.rollout.gateway import Gateway
from plainrl.types import Generation
from test_gateway import CALC, rollout


def call(name: str, arguments: dict) -> str:
    return f'<tool_call>\n{json.dumps({"name": name, "arguments": arguments})}\n</tool_call>'


class ToolScript:
    """A real Engine-protocol object: the n-th reply of ``replies`` once the context holds n tool
    results; records the contexts it was given."""

    def __init__(self, tokenizer, replies: list[str]):
        self.tok, self.replies, self.contexts = tokenizer, replies, []

    def generate(self, prompts, params, *, seeds=None):
        out = []
        for p in prompts:
            text = self.tok.decode(p)
            self.contexts.append(text)
            n = max(text.count("<|im_start|>tool"), text.count("<tool_response>"))
            ids = self.tok(self.replies[min(n, len(self.replies) - 1)], add_special_tokens=False)["input_ids"]
            ids = (ids + [self.tok.eos_token_id])[: params.max_new_tokens]
            out.append(Generation(ids, [-0.02] * len(ids), "eos" if ids[-1] == self.tok.eos_token_id else "length"))
        return out

    def load_weights(self, model):
        pass


def run(tokenizer, agent, replies):
    engine, gateway = ToolScript(tokenizer, replies), Gateway("policy", 4096)
    try:
        [ep] = rollout(engine, tokenizer, agent, 1, budget=2000, params=None, gateway=gateway)
        metrics = gateway.take_metrics()
    finally:
        gateway.close()
    return engine, ep, metrics


RESPONSES_TOOLS = [
    {"type": "function", "name": "calc", "description": "Evaluate arithmetic.", "parameters": CALC["function"]["parameters"]},
    {"type": "web_search"},
    {"type": "file_search", "vector_store_ids": ["vs_1"]},
    {"type": "local_shell"},
    {"type": "custom", "name": "apply_patch", "description": "Apply a patch.",
     "format": {"type": "grammar", "syntax": "lark", "definition": "start: /[\\s\\S]+/"}},
]
PATCH = "*** Begin Patch\n*** End Patch"


async def responses_agent(llm, row):
    client = llm.openai_client()
    items, seen = [{"role": "user", "content": "List the files, then patch."}], []
    for _ in range(3):
        # a hosted tool's choice: its tool is dropped, so the choice is auto
        r = await client.responses.create(model="policy", input=items, tools=RESPONSES_TOOLS,
                                          tool_choice={"type": "file_search"})
        seen.append(r)
        items += [o.model_dump(exclude_none=True) for o in r.output]
        for o in r.output:
            if o.type == "local_shell_call":
                items.append({"type": "local_shell_call_output", "id": o.id, "output": "a.py\nb.py"})
            elif o.type == "custom_tool_call":
                items.append({"type": "custom_tool_call_output", "call_id": o.call_id, "output": "patched"})
    llm.row["seen"] = seen
    return 1.0


def test_responses_hosted_and_custom_tools_are_served_or_dropped(tokenizer):
    replies = [call("local_shell", {"command": ["ls", "-a"]}), call("apply_patch", {"input": PATCH}), "Done."]
    engine, ep, metrics = run(tokenizer, responses_agent, replies)
    assert ep.env.error is None
    first, second, third = ep.row["seen"]
    [shell] = first.output
    assert shell.type == "local_shell_call" and shell.action.command == ["ls", "-a"] and shell.action.type == "exec"
    assert first.tool_choice == "auto"
    [patch] = second.output
    assert patch.type == "custom_tool_call" and patch.name == "apply_patch" and patch.input == PATCH
    assert third.output_text == "Done."
    # local_shell and the custom tool rendered with their schemas (the grammar in the input's
    # description); web_search and file_search (run by OpenAI's servers) dropped, 2 per request
    prompt = engine.contexts[0]
    assert '"name": "local_shell"' in prompt and '"working_directory"' in prompt
    assert '"name": "apply_patch"' in prompt and "lark grammar" in prompt and "web_search" not in prompt
    assert metrics["gateway/dropped_tools"] == 6.0
    # the items sent back continued the segment: one sample, each call's tokens trained as sampled
    assert ep.env.info["segments"] == 1 and ep.env.info["generate_calls"] == 3


async def responses_stream_agent(llm, row):
    client = llm.openai_client()
    stream = await client.responses.create(model="policy", input="Patch it.", tools=RESPONSES_TOOLS, stream=True,
                                           tool_choice={"type": "custom", "name": "apply_patch"})
    events = [e async for e in stream]
    llm.row["events"] = events
    return 1.0


def test_a_custom_tool_call_streams_as_its_own_events(tokenizer):
    # the forced choice writes the call's start; the model writes the rest
    rest = json.dumps({"input": PATCH}) + "}\n</tool_call>"
    _, ep, _ = run(tokenizer, responses_stream_agent, [rest])
    assert ep.env.error is None
    kinds = [e.type for e in ep.row["events"]]
    assert "response.custom_tool_call_input.delta" in kinds and kinds[-1] == "response.completed"
    [item] = ep.row["events"][-1].response.output
    assert item.type == "custom_tool_call" and item.input == PATCH


ANTHROPIC_TOOLS = [
    {"name": "calc", "description": "Evaluate arithmetic.", "input_schema": CALC["function"]["parameters"]},
    {"type": "bash_20250124", "name": "bash"},
    {"type": "text_editor_20250728", "name": "str_replace_based_edit_tool", "max_characters": 1000},
    {"type": "web_search_20250305", "name": "web_search", "max_uses": 3},
]


async def anthropic_agent(llm, row):
    client = llm.anthropic_client()
    messages = [{"role": "user", "content": "What is in this directory?"}]
    first = await client.messages.create(model="policy", max_tokens=64, messages=messages, tools=ANTHROPIC_TOOLS)
    [use] = [b for b in first.content if b.type == "tool_use"]
    messages += [{"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in first.content]},
                 {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "a.py"}]}]
    second = await client.messages.create(model="policy", max_tokens=64, messages=messages, tools=ANTHROPIC_TOOLS)
    llm.row["seen"] = (first, second)
    return 1.0


def test_anthropic_versioned_tools_are_rendered_with_their_published_schemas(tokenizer):
    engine, ep, metrics = run(tokenizer, anthropic_agent, [call("bash", {"command": "ls"}), "One file: a.py."])
    assert ep.env.error is None
    first, second = ep.row["seen"]
    assert first.stop_reason == "tool_use" and first.content[0].name == "bash"
    assert first.content[0].input == {"command": "ls"} and second.content[0].text == "One file: a.py."
    prompt = engine.contexts[0]
    assert '"name": "bash"' in prompt and '"restart"' in prompt
    assert '"name": "str_replace_based_edit_tool"' in prompt and '"insert_line"' in prompt
    assert "undo_edit" not in prompt  # not a command of text_editor_20250728
    assert '"web_search"' not in prompt and metrics["gateway/dropped_tools"] == 2.0  # one per request
    assert ep.env.info["segments"] == 1


async def media_agent(llm, row):
    oa, an = llm.openai_client(), llm.anthropic_client()
    image = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}
    with pytest.raises(openai.BadRequestError) as chat:
        await oa.chat.completions.create(model="policy", messages=[
            {"role": "user", "content": [{"type": "text", "text": "What is this?"}, image]}])
    with pytest.raises(openai.BadRequestError) as resp:
        await oa.responses.create(model="policy", input=[{"role": "user", "content": [
            {"type": "input_text", "text": "Read it."}, {"type": "input_file", "file_id": "file_1"}]}])
    with pytest.raises(anthropic.BadRequestError) as msg:
        await an.messages.create(model="policy", max_tokens=8, messages=[{"role": "user", "content": [
            {"type": "document", "source": {"type": "text", "media_type": "text/plain", "data": "x"}}]}])
    # a chat request with a custom tool: dropped and counted, answered
    r = await oa.chat.completions.create(model="policy", messages=[{"role": "user", "content": "Hi"}],
                                         tools=[{"type": "custom", "custom": {"name": "raw"}}, CALC])
    llm.row["errors"] = (chat.value, resp.value, msg.value, r.choices[0].message.content)
    return 1.0


def test_images_and_documents_are_a_400_naming_the_part(tokenizer):
    _, ep, metrics = run(tokenizer, media_agent, ["Hello."])
    assert ep.env.error is None
    chat, resp, msg, answered = ep.row["errors"]
    assert chat.status_code == resp.status_code == msg.status_code == 400
    assert chat.body["param"] == "messages[0].content[1]" and "'image_url' part" in chat.message
    assert resp.body["param"] == "input[0].content[1]" and "'input_file' part" in resp.message
    assert "messages[0].content[0]" in msg.message and "'document' part" in msg.message
    assert all("text-only" in e.message for e in (chat, resp, msg))
    assert answered == "Hello." and metrics["gateway/dropped_tools"] == 1.0
