"""Work kept off the episodes' event loop: chat-template rendering of long contexts, in a
bounded thread pool.

Every episode of a run, and the gateway that serves them, share one event loop
(:mod:`plainrl.rollout.event_loop`). Rendering a conversation with the chat template (jinja) and
tokenizing it is synchronous Python: a 100 000-character context takes tens of milliseconds,
during which no other request is read, no other episode's call is batched. A call whose
messages hold more than :data:`INLINE_CHARS` characters is rendered in :func:`render_pool`'s
threads instead and awaited; a shorter one is rendered in place (a thread hand-off costs about
0.1 ms, more than rendering a short context). The pool is the process's, bounded
(``rollout.render_threads``; default ``min(4, CPU cores)``): rendering holds the GIL most of the
time, so more threads than cores buy nothing, and a burst of long calls queues instead of
starting a thread each.
"""

from __future__ import annotations

import asyncio
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, TypeVar

__all__ = ["INLINE_CHARS", "message_chars", "render_off_loop", "render_pool", "set_render_threads"]

T = TypeVar("T")
INLINE_CHARS = 16_384  # messages up to this many characters are rendered on the loop itself

_lock = threading.Lock()
_pool: ThreadPoolExecutor | None = None
_threads: int | None = None  # rollout.render_threads (None: the default)


def default_threads() -> int:
    """``min(4, CPU cores)``: the pool's size when ``rollout.render_threads`` is not set."""
    return max(1, min(4, os.cpu_count() or 1))


def set_render_threads(threads: int | None) -> None:
    """Size the pool (``rollout.render_threads``; None: :func:`default_threads`). A pool made
    with another size is shut down (its queued renderings finish first) and made again on
    next use.

    Raises:
        ValueError: ``threads`` < 1.
    """
    global _pool, _threads
    if threads is not None and threads < 1:
        raise ValueError(f"rollout.render_threads must be >= 1 or null, got {threads}")
    with _lock:
        if threads == _threads:
            return
        old, _pool, _threads = _pool, None, threads
    if old is not None:
        old.shutdown(wait=False)


def render_pool() -> ThreadPoolExecutor:
    """The process's rendering pool, made on first use."""
    global _pool
    with _lock:
        if _pool is None:
            _pool = ThreadPoolExecutor(_threads or default_threads(), thread_name_prefix="plainrl-render")
        return _pool


def message_chars(messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None) -> int:
    """A cheap size of a chat call: the characters of its messages' string contents and text
    parts, plus a rough 200 per tool call and per tool schema (what the template renders)."""
    n = 200 * len(tools or ())
    for m in messages:
        content = m.get("content")
        if isinstance(content, str):
            n += len(content)
        elif isinstance(content, list):
            n += sum(len(p.get("text") or "") if isinstance(p, dict) else len(str(p)) for p in content)
        n += 200 * len(m.get("tool_calls") or ())
    return n


async def render_off_loop(fn: Callable[[], T], chars: int) -> T:
    """``fn()`` (a rendering that reads nothing the loop may change meanwhile): in place when
    ``chars`` <= :data:`INLINE_CHARS`, else in :func:`render_pool` while the loop serves others.

    Raises:
        Whatever ``fn`` raises.
    """
    if chars <= INLINE_CHARS:
        return fn()
    return await asyncio.get_running_loop().run_in_executor(render_pool(), fn)
