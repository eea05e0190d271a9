"""The episodes a gateway serves, by key: what every route shares, whatever its dialect.

Each episode's :class:`~plainrl.rollout.llm.LLM` gets a random key on first use; a request
carrying it is a call of that episode. What the gateway keeps per episode (its key, the
Responses API's stored responses) lives here, in
weak maps keyed by the handle: nothing is written onto the handle, and an episode's entries
go when its handle does.
"""

from __future__ import annotations

import secrets
import threading
import weakref
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from plainrl.rollout.llm import LLM

__all__ = ["Episodes"]


@dataclass
class _Entry:
    key: str
    responses: dict[str, Any] | None = None  # Responses API: response id -> the conversation after it


class Episodes:
    """The keys handed out this run and what is kept per live episode.

    Args:
        model: the model id responses name and ``GET /v1/models`` lists.
        max_model_len: the model's context, listed as ``max_model_len`` (None: unknown).
        tool_parser: the tool-call format replies are parsed in (``rollout.tool_parser``; ``auto``:
            the chat template's, :func:`~plainrl.rollout.gateway.toolcalls.tool_format`).
    """

    def __init__(self, model: str, max_model_len: int | None = None, tool_parser: str = "auto") -> None:
        self.model, self.max_model_len, self.tool_parser = model, max_model_len, tool_parser
        self._lock = threading.Lock()
        self._by_key: dict[str, weakref.ref[LLM]] = {}  # every key handed out; a dead ref: ended
        self._by_llm: weakref.WeakKeyDictionary[LLM, _Entry] = weakref.WeakKeyDictionary()
        self.sampling_overrides = 0  # requests whose temperature/top_p/top_k the run replaced
        self.dropped_tools = 0  # tools left out of requests: the vendor's hosted ones, unknown types
        self.unparsed_tool_calls = 0  # call blocks in replies that did not parse (left in the content)
        self.cap_noted = False  # a request's max_tokens above rollout.max_new_tokens was printed (once a run)

    def key_for(self, llm: LLM) -> str:
        """The episode's key (``sk-plainrl-`` and 32 random bytes), made on first use."""
        with self._lock:
            entry = self._by_llm.get(llm)
            if entry is None:
                entry = self._by_llm[llm] = _Entry("sk-plainrl-" + secrets.token_urlsafe(32))
                self._by_key[entry.key] = weakref.ref(llm)
            return entry.key

    def lookup(self, key: str) -> tuple[LLM | None, bool]:
        """``(the live episode's handle, known)``: ``(None, False)`` for a key never handed
        out, ``(None, True)`` for one whose episode has ended."""
        ref = self._by_key.get(key)
        if ref is None:
            return None, False
        llm = ref()
        if llm is None or llm.closed:
            return None, True
        return llm, True

    def responses(self, llm: LLM) -> dict[str, Any]:
        """The episode's stored responses (``previous_response_id`` -> what it continues)."""
        entry = self._entry(llm)
        if entry.responses is None:
            entry.responses = {}
        return entry.responses

    def _entry(self, llm: LLM) -> _Entry:
        entry = self._by_llm.get(llm)
        if entry is None:
            raise KeyError("this episode was never given a key")
        return entry
