"""Tool-call formats of each model family, hand-written as their published chat templates write an
assistant's calls (Qwen3-Coder's XML, Mistral's ``[TOOL_CALLS]`` before and after tokenizer v11,
DeepSeek V3's and V3.1's call tokens, hermes, Llama 3's JSON): parsed, written back, detected from a
template's source; malformed blocks counted; ``<think>`` split from the reply."""

from __future__ import annotations

import copy

import pytest

from plainrl.config.rollout import RolloutConfig
from plainrl.rollout.gateway.messages import make_reply, split_reasoning
from plainrl.rollout.gateway.tool_parsers import FORMATS, TOOL_PARSERS, ParsedCall, detect
from plainrl.rollout.gateway.toolcalls import forced_call_prefix, parse_reply, sample_text, tool_format

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {
    "city": {"type": "string"}, "days": {"type": "integer"}, "zip": {"type": "string"}}}}}

# ------------------------------------------------------------------ each format, as the family writes it

QWEN3_CODER = ("Let me check.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nSan Francisco\n"
               "</parameter>\n<parameter=days>\n3\n</parameter>\n<parameter=zip>\n94103\n</parameter>\n"
               "</function>\n</tool_call>")
MISTRAL_V11 = ('Checking.[TOOL_CALLS]get_weather[ARGS]{"city": "Paris", "days": 2}'
               '[TOOL_CALLS]get_time[ARGS]{"tz": "CET"}')
MISTRAL_CALL_ID = '[TOOL_CALLS]get_weather[CALL_ID]a1b2c3d4e[ARGS]{"city": "Paris"}'
MISTRAL_V3 = ('[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris"}}, '
              '{"name": "get_time", "arguments": {}}]')
DEEPSEEK_V3 = ("<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n```json\n"
               '{"city": "Hangzhou"}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>')
DEEPSEEK_V31 = ('Sure.<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{"city": "Hangzhou"}'
                '<｜tool▁call▁end｜><｜tool▁call▁begin｜>get_time<｜tool▁sep｜>{}<｜tool▁call▁end｜><｜tool▁calls▁end｜>')
HERMES = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
LLAMA3 = '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}'


@pytest.mark.parametrize("fmt, text, content, calls", [
    ("qwen3_coder", QWEN3_CODER, "Let me check.",
     # days is an integer by the schema, zip a string (written bare, read as written)
     [ParsedCall("get_weather", {"city": "San Francisco", "days": 3, "zip": "94103"})]),
    ("mistral", MISTRAL_V11, "Checking.", [ParsedCall("get_weather", {"city": "Paris", "days": 2}),
                                           ParsedCall("get_time", {"tz": "CET"})]),
    ("mistral", MISTRAL_CALL_ID, "", [ParsedCall("get_weather", {"city": "Paris"})]),
    ("mistral", MISTRAL_V3, "", [ParsedCall("get_weather", {"city": "Paris"}), ParsedCall("get_time", {})]),
    ("deepseek_v3", DEEPSEEK_V3, "", [ParsedCall("get_weather", {"city": "Hangzhou"})]),
    ("deepseek_v31", DEEPSEEK_V31, "Sure.", [ParsedCall("get_weather", {"city": "Hangzhou"}),
                                             ParsedCall("get_time", {})]),
    ("deepseek_v31", DEEPSEEK_V3, "", [ParsedCall("get_weather", {"city": "Hangzhou"})]),  # either syntax
    ("hermes", HERMES, "", [ParsedCall("get_weather", {"city": "Paris"})]),
    ("llama3_json", LLAMA3, "", [ParsedCall("get_weather", {"city": "Paris"})]),
])
def test_each_format_parses_its_family_s_calls(fmt, text, content, calls):
    out = parse_reply(text, fmt, [WEATHER])
    assert (out.content, out.calls, out.unparsed) == (content, calls, 0)


@pytest.mark.parametrize("fmt, text", [
    ("qwen3_coder", "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"),  # cut off
    ("mistral", '[TOOL_CALLS]get_weather[ARGS]{"city": '),
    ("mistral", "[TOOL_CALLS] [not json]"),
    ("deepseek_v31", "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{bad}<｜tool▁call▁end｜>"),
    ("hermes", '<tool_call>\n{"name": "get_weather", "arguments": \n</tool_call>'),
    ("llama3_json", '<|python_tag|>{"name": "get_weather", "parameters": '),
])
def test_a_call_that_does_not_parse_stays_content_and_is_counted(fmt, text):
    out = parse_reply(text, fmt, [WEATHER])
    assert out.calls == [] and out.unparsed == 1 and out.content == text


@pytest.mark.parametrize("fmt", ["hermes", "llama3_json", "qwen3_coder", "mistral", "deepseek_v3", "deepseek_v31"])
def test_written_calls_read_back_and_plain_text_is_no_call(fmt):
    calls = [("get_weather", {"city": "Paris", "days": 2}), ("get_time", {"tz": "CET"})]
    out = parse_reply(FORMATS[fmt].write(calls), fmt, [WEATHER])
    assert [(c.name, c.arguments) for c in out.calls] == calls and out.unparsed == 0
    assert parse_reply("The answer is 42.", fmt).calls == [] and parse_reply("The answer is 42.", fmt).unparsed == 0
    # a forced call's start is the start of the call as written
    assert FORMATS[fmt].write(calls[:1]).startswith(forced_call_prefix(None, "get_weather", fmt).rstrip())


def test_the_config_names_every_format_and_auto_reads_the_template():
    assert set(TOOL_PARSERS) == set(FORMATS)
    assert RolloutConfig.model_fields["tool_parser"].annotation.__args__ == ("auto", *TOOL_PARSERS)
    # template sources, as each family's chat template writes its calls
    assert detect("{{'<|start_header_id|>ipython<|end_header_id|>'}}") == "llama3_json"
    assert detect("{{'<tool_call>\\n<function=' + tool_call.name + '>\\n'}}{{'<parameter=' + k}}") == "qwen3_coder"
    assert detect("{{ '[TOOL_CALLS]' + tool.name + '[ARGS]' }}") == "mistral"
    assert detect("'<｜tool▁call▁begin｜>' + tool['type'] + '<｜tool▁sep｜>' + name + '\\n```json\\n'") == "deepseek_v3"
    assert detect("'<｜tool▁call▁begin｜>' + name + '<｜tool▁sep｜>' + args") == "deepseek_v31"
    assert detect("{{ '<tool_call>\\n' + tool_call | tojson }}") == "hermes"


def test_a_named_parser_wins_over_the_template(tokenizer):
    assert tool_format(tokenizer) == "hermes"  # SmolLM2: the tools in its system message, hermes calls
    assert tool_format(tokenizer, "qwen3_coder") == "qwen3_coder"


def test_markers_that_are_special_tokens_are_kept_for_parsing(tokenizer):
    tok = copy.deepcopy(tokenizer)
    tok.add_special_tokens({"additional_special_tokens": ["[TOOL_CALLS]", "[ARGS]"]})
    ids = (tok.encode("Checking.", add_special_tokens=False) + tok.convert_tokens_to_ids(["[TOOL_CALLS]"])
           + tok.encode("get_weather", add_special_tokens=False) + tok.convert_tokens_to_ids(["[ARGS]"])
           + tok.encode('{"city": "Paris"}', add_special_tokens=False) + [tok.eos_token_id])
    assert "[TOOL_CALLS]" not in tok.decode(ids, skip_special_tokens=True)  # what a plain decode hands the parser
    text = sample_text(tok, ids, "mistral")
    assert text == 'Checking.[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}'
    assert parse_reply(text, "mistral").calls == [ParsedCall("get_weather", {"city": "Paris"})]
    assert sample_text(tok, tok.encode("no call", add_special_tokens=False), "mistral") is None


# ------------------------------------------------------------------ <think>


@pytest.mark.parametrize("text, reasoning, content", [
    ("<think>\nAdd them.\n</think>\n\nIt is 42.", "Add them.", "It is 42."),  # Qwen3
    ("Add them.\n</think>\n\nIt is 42.", "Add them.", "It is 42."),  # opened by the generation prompt (R1)
    ("<think>\nAdd them and", "Add them and", ""),  # ran out of tokens while thinking
    ("It is 42.", None, "It is 42."),
])
def test_think_text_is_split_from_the_reply(text, reasoning, content):
    assert split_reasoning(text) == (reasoning, content)


def test_a_reply_with_reasoning_and_a_call_hands_back_both():
    reply = make_reply("<think>\nI need the weather.\n</think>\n\n" + QWEN3_CODER, "qwen3_coder", True, True,
                       tools=[WEATHER], think=True)
    assert reply.reasoning == "I need the weather." and reply.content == "Let me check."
    [(_, call)] = reply.calls
    assert call.arguments == {"city": "San Francisco", "days": 3, "zip": "94103"}
    assert reply.openai_message()["reasoning_content"] == "I need the weather."
    assert reply.template["reasoning_content"] == "I need the weather."
