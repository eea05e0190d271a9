"""Offline data: the rows that supervised fine-tuning (SFT), DPO and the reward model
(RM) train on, validated and tokenised into :class:`Example` objects
(:func:`load_offline_data`). The trainers are in :mod:`plainrl.train.offline`.

Rows (``data.path``: any file or hub id :func:`plainrl.data.load_rows` reads):

- sft: ``messages`` (a chat; the loss is on assistant turns only), or ``prompt``
  (text, rendered with ``data.prompt_template``, or a chat) + ``completion`` (text or
  assistant messages). ``data.format: gsm8k`` trains on GSM8K's worked solutions.
- dpo, rm: ``chosen`` and ``rejected``, either with a ``prompt`` column (text or chat;
  the responses text or assistant messages), with a ``messages`` column holding the
  prompt chat instead (RL2's rows: ``{"messages": [...], "chosen": "...", "rejected": "..."}``),
  or as two whole chats that differ only in their last (assistant) message.

Or the rows a Python function returns (``data.source``, :func:`plainrl.data.sources.source_rows`).

Every conversation goes through the tokenizer's chat template; the tokens trained
on (SFT) or scored (DPO's log pi(y|x), the RM's score) are the assistant turns after
the prompt, each up to and including the first EOS (:func:`assistant_tokens`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from plainrl.data.prompts import as_id_list, render_prompt
from plainrl.data.rows import DataError, DropReport, InvalidRow, check_messages, gsm8k_row, handle_invalid
from plainrl.data.sources import held_out_indices, load_rows, training_rows

if TYPE_CHECKING:
    from plainrl.config import Config, DataConfig

__all__ = [
    "ChatTokens",
    "Example",
    "OfflineData",
    "assistant_tokens",
    "load_offline_data",
    "preference_conversations",
    "sft_conversation",
]


@dataclass
class ChatTokens:
    """One tokenised conversation.

    ids:  [T] token ids (the whole chat, through the chat template).
    mask: [T] 1 on the tokens trained on / scored (assistant turns after the prompt).
    """

    ids: list[int]
    mask: list[int]


@dataclass
class Example:
    """One training row: ``(conversation,)`` for sft, ``(chosen, rejected)`` for dpo/rm."""

    seqs: tuple[ChatTokens, ...]
    source_index: int

    @property
    def width(self) -> int:
        """Tokens of its longest sequence (what it pads a micro-batch to)."""
        return max(len(s.ids) for s in self.seqs)


def _render(tokenizer, messages: list[dict], generation_prompt: bool, chat_kwargs: Mapping[str, Any]) -> list[int]:
    if not messages and not generation_prompt:
        return []
    return as_id_list(tokenizer.apply_chat_template(messages, add_generation_prompt=generation_prompt, tokenize=True,
                                                    **chat_kwargs))


def assistant_tokens(messages: list[dict], tokenizer, *, train_from: int = 0,
                     chat_template_kwargs: Mapping[str, Any] | None = None) -> ChatTokens:
    """Token ids of a chat and the mask of its assistant tokens.

    For each assistant message i >= ``train_from``, its tokens are those between the
    rendering of ``messages[:i]`` with the generation prompt (which ends with the
    assistant header) and the rendering of ``messages[:i+1]``, cut after the first
    EOS token: what the policy itself would generate for that turn (ChatML:
    ``content<|im_end|>``, not the ``\\n`` the template writes after it).

    Args:
        messages: ``[{"role", "content"}, ...]``.
        tokenizer: with a chat template.
        train_from: messages before this index are the prompt (never trained on).
        chat_template_kwargs: variables for the chat template (``data.chat_template_kwargs``).
    Returns:
        :class:`ChatTokens` over the rendering of the whole chat.
    Raises:
        ValueError: the tokenizer has no chat template, or the template is not
            prefix-consistent (rendering more messages changes the earlier tokens,
            e.g. templates that drop earlier reasoning), so turns cannot be located.
    """
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError("the tokenizer has no chat template; sft/dpo/rm need one to find the assistant turns")
    kw = dict(chat_template_kwargs or {})
    ids = _render(tokenizer, messages, False, kw)
    mask = [0] * len(ids)
    eos = tokenizer.eos_token_id
    for i, m in enumerate(messages):
        if m["role"] != "assistant" or i < train_from:
            continue
        start = _render(tokenizer, messages[:i], True, kw)
        end = _render(tokenizer, messages[: i + 1], False, kw)
        if ids[: len(start)] != start or ids[: len(end)] != end or len(end) < len(start):
            raise ValueError(
                f"the chat template is not prefix-consistent at message {i} (rendering later messages changes "
                "earlier tokens), so assistant turns cannot be located"
            )
        for k in range(len(start), len(end)):
            mask[k] = 1
            if ids[k] == eos:
                break
    return ChatTokens(ids, mask)


def _prompt_messages(value: Any, row: dict, data: DataConfig, column: str) -> list[dict]:
    """The prompt as chat messages, as :func:`plainrl.data.build_prompt_ids` builds it."""
    if isinstance(value, list):
        msgs = check_messages(value, column)
        if data.system_prompt and msgs[0]["role"] != "system":
            msgs.insert(0, {"role": "system", "content": data.system_prompt})
        return msgs
    if not isinstance(value, str) or not value.strip():
        raise InvalidRow("bad_type", column, f"expected text or chat messages, got {value!r:.60}")
    msgs = [{"role": "system", "content": data.system_prompt}] if data.system_prompt else []
    return msgs + [{"role": "user", "content": render_prompt({**row, "prompt": value}, data.prompt_template)}]


def _response(value: Any, column: str) -> list[dict]:
    if isinstance(value, str):
        if not value.strip():
            raise InvalidRow("empty_prompt", column, "empty response")
        return [{"role": "assistant", "content": value}]
    msgs = check_messages(value, column)
    if msgs[-1]["role"] != "assistant":
        raise InvalidRow("bad_messages", column, "the response must end with an assistant message")
    return msgs


def _missing(row: dict, column: str) -> InvalidRow:
    return InvalidRow("missing_column", column, f"missing column (row has {', '.join(map(repr, row)) or 'none'})")


def sft_conversation(row: dict, data: DataConfig) -> tuple[list[dict], int]:
    """An SFT row as ``(messages, train_from)``; see the module docstring for the row formats."""
    prompt_col = data.prompt_column or "prompt"
    if data.format == "gsm8k":  # question -> prompt, the worked solution is the completion
        row = gsm8k_row(row, data.prompt_column)
        row["completion"], prompt_col = row["solution"], "prompt"
    if prompt_col == "prompt" and row.get("messages") is not None:
        msgs = _prompt_messages(row["messages"], row, data, "messages")
        if not any(m["role"] == "assistant" for m in msgs):
            raise InvalidRow("bad_messages", "messages", "no assistant message to train on")
        return msgs, 0
    if row.get(prompt_col) is None:
        raise _missing(row, "messages" if prompt_col == "prompt" else prompt_col)
    if row.get("completion") is None:
        raise _missing(row, "completion")
    prompt = _prompt_messages(row[prompt_col], row, data, prompt_col)
    return prompt + _response(row["completion"], "completion"), len(prompt)


def preference_conversations(row: dict, data: DataConfig) -> tuple[list[dict], list[dict], int]:
    """A preference row as ``(chosen messages, rejected messages, train_from)``."""
    for col in ("chosen", "rejected"):
        if row.get(col) is None:
            raise _missing(row, col)
    prompt_col = data.prompt_column or "prompt"
    if data.prompt_column is None and row.get("prompt") is None and row.get("messages") is not None:
        prompt_col = "messages"  # RL2's preference rows: {messages (the prompt chat), chosen, rejected}
    if row.get(prompt_col) is not None:
        prompt = _prompt_messages(row[prompt_col], row, data, prompt_col)
        return prompt + _response(row["chosen"], "chosen"), prompt + _response(row["rejected"], "rejected"), len(prompt)
    chosen, rejected = _response(row["chosen"], "chosen"), _response(row["rejected"], "rejected")
    if chosen[:-1] != rejected[:-1] or len(chosen) < 2:
        raise InvalidRow(
            "bad_messages", "chosen",
            "without a 'prompt' column, chosen and rejected must be chats that share every message but the last",
        )
    prompt = _prompt_messages(chosen[:-1], row, data, "chosen")
    return prompt + chosen[-1:], prompt + rejected[-1:], len(prompt)


def _tokenise(row: Any, cfg: Config, tokenizer) -> tuple[ChatTokens, ...]:
    if not isinstance(row, dict):
        raise InvalidRow("bad_type", None, f"expected a mapping of columns, got {type(row).__name__}")
    if cfg.algorithm.name == "sft":
        msgs, start = sft_conversation(row, cfg.data)
        convs, columns = [msgs], ["messages"]
    else:
        chosen, rejected, start = preference_conversations(row, cfg.data)
        convs, columns = [chosen, rejected], ["chosen", "rejected"]
    seqs = []
    for msgs, column in zip(convs, columns):
        try:
            seq = assistant_tokens(msgs, tokenizer, train_from=start,
                                   chat_template_kwargs=cfg.data.chat_template_kwargs)
        except Exception as e:  # the template's own errors (e.g. roles out of order) are row problems
            raise InvalidRow("chat_template", column, f"{type(e).__name__}: {e}") from None
        if not any(seq.mask):
            raise InvalidRow("bad_messages", column, "no assistant tokens to train on")
        if len(seq.ids) > cfg.model.max_context:
            raise InvalidRow("too_long", column, f"{len(seq.ids)} tokens, over model.max_context="
                           f"{cfg.model.max_context}; raise it or shorten the row")
        seqs.append(seq)
    return tuple(seqs)


@dataclass
class OfflineData:
    """Tokenised training and eval examples; ``dropped`` and ``notes`` for the log."""

    train: list[Example]
    eval: list[Example]
    dropped: DropReport = field(default_factory=DropReport)
    notes: list[str] = field(default_factory=list)


def load_offline_data(cfg: Config, tokenizer) -> OfflineData:
    """Load and tokenise the rows of ``data.path`` or ``data.source`` (eval rows: ``data.eval_path`` /
    ``data.eval_split``, or ``data.eval_holdout`` rows held out by a seeded shuffle).

    Raises:
        DataError: an invalid row under ``data.on_invalid=error`` (naming the source,
            row and column), unreadable data, or no training rows left.
    """
    d, report, notes = cfg.data, DropReport(), []

    def prepare(rows: list, source: str) -> list[Example]:
        out = []
        for i, row in enumerate(rows):
            try:
                out.append(Example(_tokenise(row, cfg, tokenizer), i))
            except InvalidRow as err:
                handle_invalid(err, source=source, index=i, on_invalid=d.on_invalid, report=report)
        return out

    rows, source = training_rows(d)
    train = prepare(rows, source)
    evals: list[Example] = []
    if d.eval_path is not None or d.eval_split is not None:
        path, label = (d.eval_path, "data.eval_path") if d.eval_path is not None else (d.path, "data.path")
        split = d.eval_split or d.split
        rows = load_rows(path, split, d.eval_size, label=label, subset=d.subset if label == "data.path" else None)
        evals = prepare(rows, f"{label} {path!r} (eval, split {split!r})")
    elif d.eval_holdout > 0:
        # chosen among the raw rows, so the RL run after this one (and plainrl eval) holds out the same rows
        held = held_out_indices(len(rows), d.eval_holdout, cfg.seed)
        train, evals = [e for e in train if e.source_index not in held], [e for e in train if e.source_index in held]
        notes.append(f"data.eval_holdout: {len(evals)} rows held out of training for eval")
    if not train:
        raise DataError(f"no usable training rows left: {report.summary()}")
    return OfflineData(train, evals, report, notes)
