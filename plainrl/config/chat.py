"""``data.chat_template_kwargs``: extra variables for the tokenizer's chat template.

transformers passes keyword arguments of ``tokenizer.apply_chat_template`` that it does not
know itself to the Jinja template as variables (``enable_thinking=False`` for Qwen3's
template, which then opens the assistant turn with an empty ``<think>\\n\\n</think>`` block;
``reasoning_effort``, ``custom_instructions`` for others). plainrl passes this mapping to
every rendering of a chat: training and eval prompts, environment prompts and observations,
SFT/DPO/reward-model conversations.
"""

from __future__ import annotations

import json
from typing import Annotated, Any

from pydantic import AfterValidator

# The parameters of transformers' ``PreTrainedTokenizerBase.apply_chat_template`` (v5) and the
# variables its renderer sets itself (``messages``, ``tools``, ``documents``,
# ``add_generation_prompt``: utils/chat_template_utils.py::render_jinja_template): as a template
# variable these would collide with what plainrl passes or change what the call returns.
# tests/test_config.py checks the list against the installed transformers.
RESERVED_NAMES = frozenset({
    "conversation", "messages", "tools", "documents", "chat_template", "add_generation_prompt",
    "continue_final_message", "tokenize", "sanitize_control_tokens", "padding", "truncation", "max_length",
    "return_tensors", "return_dict", "return_assistant_tokens_mask", "tokenizer_kwargs",
})


def check_chat_template_kwargs(value: dict[str, Any]) -> dict[str, Any]:
    """Validate ``data.chat_template_kwargs``: names usable as Jinja variables, not reserved by
    ``apply_chat_template``, with JSON values (what a YAML config and ``config.yaml`` hold).

    Raises:
        ValueError: a bad name or value; the message names it and says what is allowed.
    """
    for name, v in value.items():
        where = f"data.chat_template_kwargs.{name}"
        if not name.isidentifier():
            raise ValueError(f"{where}: {name!r} is not a template variable name (letters, digits, _; "
                             "not starting with a digit)")
        if name in RESERVED_NAMES:
            raise ValueError(f"{where}: {name!r} is an argument of tokenizer.apply_chat_template that plainrl "
                             f"sets itself; template variables must avoid {sorted(RESERVED_NAMES)}")
        try:
            json.dumps(v, allow_nan=False)
        except (TypeError, ValueError) as e:
            raise ValueError(f"{where}: {v!r} is not a JSON value ({e}); use booleans, numbers, strings, "
                             "null, lists and mappings") from None
    return value


# the schema's field type: a mapping of template variable names to JSON values
ChatTemplateKwargs = Annotated[dict[str, Any], AfterValidator(check_chat_template_kwargs)]
