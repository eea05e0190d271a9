"""No guessed chat format: a continuation the model's own template cannot render is an error that
names the model, never ChatML written by hand (a non-ChatML model would train on tokens it never uses)."""

from __future__ import annotations

import copy

import pytest

from plainrl.rollout import ChatTemplateError, render_chat_continuation

# Gemma's turn markers; only the roles user and assistant (written "model"), as Gemma's own template
TURNS = ("{% for message in messages %}"
         "{% if message['role'] not in ['user', 'assistant'] %}"
         "{{ raise_exception('Unknown role ' + message['role'] + '; only user and assistant') }}{% endif %}"
         "{% set role = 'model' if message['role'] == 'assistant' else message['role'] %}"
         "{{ '<start_of_turn>' + role + '\\n' + message['content'] | trim + '<end_of_turn>\\n' }}"
         "{% endfor %}{% if add_generation_prompt %}{{ '<start_of_turn>model\\n' }}{% endif %}")
# a template that renders only the user's messages (some base models ship one like it)
USER_ONLY = ("{% for message in messages %}{% if message['role'] == 'assistant' %}"
             "{{ raise_exception('assistant messages are not supported') }}{% endif %}"
             "{{ message['content'] + '\\n' }}{% endfor %}")

HISTORY = [{"role": "user", "content": "What is 6 * 7?"}, {"role": "assistant", "content": "<calc>6*7</calc>"}]


def _with_template(tokenizer, template: str):
    tok = copy.deepcopy(tokenizer)
    tok.chat_template = template
    return tok


def test_a_non_chatml_template_renders_its_own_turns(tokenizer):
    tok = _with_template(tokenizer, TURNS)
    text = render_chat_continuation(tok, HISTORY, [{"role": "user", "content": "42"}])
    assert text == "<end_of_turn>\n<start_of_turn>user\n42<end_of_turn>\n<start_of_turn>model\n"


def test_a_role_the_template_rejects_is_an_error_not_chatml(tokenizer):
    """Old code: ``<|im_end|>\\n<|im_start|>tool\\n42<|im_end|>\\n<|im_start|>assistant\\n`` for a Gemma-style model."""
    tok = _with_template(tokenizer, TURNS)
    with pytest.raises(ChatTemplateError) as e:
        render_chat_continuation(tok, HISTORY, [{"role": "tool", "content": "42"}])
    msg = str(e.value)
    assert tok.name_or_path in msg and "'tool'" in msg and "Unknown role tool" in msg, msg


def test_an_unknown_assistant_closing_is_an_error_not_im_end(tokenizer):
    """Old code: ``_assistant_closing`` returned ``<|im_end|>\\n`` when the template raised."""
    tok = _with_template(tokenizer, USER_ONLY)
    with pytest.raises(ChatTemplateError, match="assistant messages are not supported") as e:
        render_chat_continuation(tok, HISTORY, [{"role": "user", "content": "42"}])
    assert tok.name_or_path in str(e.value)
