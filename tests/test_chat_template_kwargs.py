"""``data.chat_template_kwargs`` reaches every chat rendering: RL and eval prompts, environment
prompts and observations, SFT and DPO conversations; and its validation.

The template is Qwen3's (tests/data/Qwen-Qwen3-0.6B.jinja: the one shipped with Qwen/Qwen3-0.6B,
as llama.cpp keeps it under models/templates/). With ``enable_thinking=False`` it opens the
assistant turn with an empty reasoning block, which is what these tests look for. Qwen3's
tokenizer cannot be downloaded here; the stand-in is built as Qwen3's is (transformers'
``Qwen2Tokenizer``: Qwen's pre-tokenizer, which keeps ``"\n\n"`` one piece before text, and
``<think>``/``</think>`` as added tokens) over SmolLM2's byte-level BPE vocabulary, which has
the same ChatML tokens. SmolLM2's own pre-tokenizer splits ``"</think>\n\n5"`` into
``\n``, ``\n``, ``5`` but a prompt ending in ``"\n\n"`` into one token, so SFT turns would
not line up with the generation prompt; Qwen's keeps them aligned."""

from __future__ import annotations

import inspect
import json
from pathlib import Path

import pytest
from tokenizers import AddedToken
from transformers import PreTrainedTokenizerBase, Qwen2Tokenizer

from test_envs import ScriptedEngine, add, ids, turn

from plainrl.config import ConfigError, load_config
from plainrl.config.chat import RESERVED_NAMES
from plainrl.data import PromptRow, build_prompt_ids
from plainrl.data.offline import load_offline_data
from plainrl.rollout import MultiTurn, build_env_prompt, render_chat_continuation, rollout
from plainrl.rollout.envs import ToolEnv
from plainrl.types import SamplingParams

REPO = Path(__file__).resolve().parents[1]
QWEN3_TEMPLATE = (REPO / "tests" / "data" / "Qwen-Qwen3-0.6B.jinja").read_text()
OPEN = "<|im_start|>assistant\n"
NO_THINK = "<|im_start|>assistant\n<think>\n\n</think>\n\n"  # Qwen3's assistant opening, thinking off
OFF = {"enable_thinking": False}


@pytest.fixture(scope="module")
def qwen3_tokenizer(tokenizer):
    spec = json.loads(tokenizer.backend_tokenizer.to_str())["model"]  # SmolLM2's BPE
    tok = Qwen2Tokenizer(vocab=spec["vocab"], merges=[tuple(m) for m in spec["merges"]],
                         eos_token="<|im_end|>", pad_token="<|endoftext|>")
    tok.add_special_tokens({"additional_special_tokens": ["<|im_start|>"]})
    tok.add_tokens([AddedToken(t, normalized=False, special=False) for t in ("<think>", "</think>")])
    tok.chat_template = QWEN3_TEMPLATE
    return tok


@pytest.fixture()
def qwen3_model_dir(tiny_model_dir, tmp_path, qwen3_tokenizer):
    """The tiny Llama's files with the Qwen3 template on its tokenizer: a model.name for configs."""
    d = tmp_path / "tiny-qwen3-template"
    d.mkdir()
    for f in tiny_model_dir.iterdir():
        if f.is_file() and not f.name.startswith(("tokenizer", "special_tokens", "chat_template")):
            (d / f.name).symlink_to(f)
    qwen3_tokenizer.save_pretrained(d)
    return d


def _text(tok, token_ids) -> str:
    return tok.decode(token_ids, skip_special_tokens=False)


# ----------------------------------------------------------------------------- validation


EXAMPLE = REPO / "examples" / "arithmetic_grpo.yaml"


def test_valid_kwargs_load_from_yaml_overrides():
    cfg = load_config(EXAMPLE, ["data.chat_template_kwargs={enable_thinking: false, style: {tone: terse}}"])
    assert cfg.data.chat_template_kwargs == {"enable_thinking": False, "style": {"tone": "terse"}}
    assert load_config(EXAMPLE).data.chat_template_kwargs == {}


@pytest.mark.parametrize("value, needles", [
    ({"tokenize": False}, ["data.chat_template_kwargs.tokenize", "apply_chat_template"]),
    ({"add_generation_prompt": True}, ["add_generation_prompt", "plainrl", "sets itself"]),
    ({"enable-thinking": False}, ["'enable-thinking'", "not a template variable name"]),
    ({"enable_thinking": float("nan")}, ["enable_thinking", "not a JSON value"]),
    ({"enable_thinking": {1, 2}}, ["enable_thinking", "not a JSON value"]),
    ("enable_thinking", ["data.chat_template_kwargs", "dictionary"]),
])
def test_bad_kwargs_are_config_errors_naming_the_key(value, needles):
    with pytest.raises(ConfigError) as e:
        load_config(EXAMPLE, {"data.chat_template_kwargs": value})
    for n in needles:
        assert n in str(e.value), (n, str(e.value))


def test_reserved_names_cover_apply_chat_template_parameters():
    params = set(inspect.signature(PreTrainedTokenizerBase.apply_chat_template).parameters) - {"self", "kwargs"}
    assert params <= RESERVED_NAMES, sorted(params - RESERVED_NAMES)
    assert {"messages", "tools", "documents", "add_generation_prompt"} <= RESERVED_NAMES  # the renderer's own


# ----------------------------------------------------------------------------- RL and eval prompts


def test_prompt_ids_carry_the_kwargs(qwen3_tokenizer):
    row = {"prompt": "What is 2 + 3?"}
    assert _text(qwen3_tokenizer, build_prompt_ids(row, qwen3_tokenizer)).endswith("What is 2 + 3?<|im_end|>\n" + OPEN)
    off = _text(qwen3_tokenizer, build_prompt_ids(row, qwen3_tokenizer, chat_template_kwargs=OFF))
    assert off.endswith("What is 2 + 3?<|im_end|>\n" + NO_THINK)


def test_prepare_renders_training_and_eval_prompts_with_the_kwargs(qwen3_model_dir, tmp_path):
    from plainrl.run import setup as run_setup
    from conftest import tiny_overrides

    base = tiny_overrides(qwen3_model_dir, tmp_path / "run") + ["rollout.env=calculator"]
    prepared = run_setup.prepare(load_config(EXAMPLE,
                                             base + ["data.chat_template_kwargs={enable_thinking: false}"]))
    tok = prepared.tokenizer
    assert prepared.data.train and prepared.data.eval
    for row in prepared.data.train[:5] + prepared.data.eval:
        assert _text(tok, row.prompt_ids).endswith(NO_THINK)
    assert prepared.multi_turn.chat_template_kwargs == OFF  # environment renderings, in training and eval
    plain = run_setup.prepare(load_config(EXAMPLE, base))
    assert all(not _text(tok, r.prompt_ids).endswith(NO_THINK) for r in plain.data.train[:5] + plain.data.eval)


# ----------------------------------------------------------------------------- environments


def test_environment_prompt_and_observation_carry_the_kwargs(qwen3_tokenizer):
    tok, env = qwen3_tokenizer, ToolEnv([add])
    row = {"prompt": "What is 2+3?"}
    p = PromptRow(row=row, prompt_ids=build_prompt_ids(row, tok, chat_template_kwargs=OFF), source_index=0)
    prompt_ids, messages = build_env_prompt(p, env, tok, chat_template_kwargs=OFF)
    text = _text(tok, prompt_ids)
    assert "<tools>" in text and '"add"' in text  # Qwen3's template takes tools= itself
    assert text.endswith("What is 2+3?<|im_end|>\n" + NO_THINK)
    assert not _text(tok, build_env_prompt(p, env, tok)[0]).endswith(NO_THINK)

    call = '<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>'
    history = messages + [{"role": "assistant", "content": call}]
    obs = [{"role": "tool", "name": "add", "content": "5"}]
    # the turn paused at </tool_call>: the closing, the tool turn as Qwen3 writes it, the next opening
    tool_turn = "<|im_end|>\n<|im_start|>user\n<tool_response>\n5\n</tool_response><|im_end|>\n"
    assert render_chat_continuation(tok, history, obs, chat_template_kwargs=OFF) == tool_turn + NO_THINK
    assert render_chat_continuation(tok, history, obs) == tool_turn + OPEN

    # through the rollout: the engine must see exactly prompt + turn + observation (ScriptedEngine checks)
    turns = [turn(tok, call, eos=False, reason="stop", base=-0.1), turn(tok, "It is 5.", eos=True, reason="eos", base=-0.2)]
    observed = [ids(tok, tool_turn + NO_THINK), []]
    engine = ScriptedEngine({tuple(prompt_ids): turns}, {tuple(prompt_ids): observed})
    (e,) = rollout(engine, [p], SamplingParams(), tok, group_size=1, step=0,
                   multi_turn=MultiTurn(lambda: env, max_turns=4, max_total_tokens=200, chat_template_kwargs=OFF))
    assert e.prompt_ids == prompt_ids
    assert e.completion_ids == turns[0][0] + observed[0] + turns[1][0]
    assert e.env.info["end_reason"] == "eos"


# ----------------------------------------------------------------------------- SFT and DPO


def _trained_text(tok, seq) -> str:
    return tok.decode([t for t, m in zip(seq.ids, seq.mask) if m], skip_special_tokens=False)


@pytest.mark.parametrize("name, rows", [
    ("sft", [{"messages": [{"role": "user", "content": "What is 2 + 3?"}, {"role": "assistant", "content": "5"}]}]),
    ("dpo", [{"prompt": "What is 2 + 3?", "chosen": "5", "rejected": "6"}]),
])
def test_offline_conversations_carry_the_kwargs(qwen3_tokenizer, tmp_path, name, rows):
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    overrides = [f"data.path={path}", f"algorithm.name={name}"]
    off = load_offline_data(load_config(None, overrides + ["data.chat_template_kwargs={enable_thinking: false}"]),
                            qwen3_tokenizer).train[0]
    on = load_offline_data(load_config(None, overrides), qwen3_tokenizer).train[0]
    for seq_off, seq_on in zip(off.seqs, on.seqs):
        # thinking off: the empty block belongs to the prompt, as at generation; the policy learns the answer
        assert NO_THINK in _text(qwen3_tokenizer, seq_off.ids)
        assert _trained_text(qwen3_tokenizer, seq_off) in ("5<|im_end|>", "6<|im_end|>")
        # template defaults: the last assistant turn is written with the block, and it is trained on
        assert _trained_text(qwen3_tokenizer, seq_on).startswith("<think>\n\n</think>\n\n")
