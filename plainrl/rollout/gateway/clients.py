"""The vendor SDK clients an episode's agent is handed: ``openai`` and ``anthropic``, async or
blocking, bound to the episode's key on the run's gateway (``llm.openai_client()``,
``llm.anthropic_client()``, ``llm.openai_env()``, ``llm.anthropic_env()`` and their
:class:`~plainrl.rollout.llm.SyncLLM` twins all come here).

Retries are off (``max_retries=0``): a retried request would sample again.
"""

from __future__ import annotations

import importlib
import os
from typing import TYPE_CHECKING, Any, Literal

from plainrl.rollout.reaper import MARK_ENV

if TYPE_CHECKING:
    from plainrl.rollout.llm import LLM

__all__ = ["Vendor", "client_env", "make_client"]

Vendor = Literal["openai", "anthropic"]


def client_env(llm: LLM, vendor: Vendor) -> dict[str, str]:
    """``{"OPENAI_BASE_URL", "OPENAI_API_KEY"}`` (``/v1``) or ``{"ANTHROPIC_BASE_URL",
    "ANTHROPIC_API_KEY"}`` (the root): merge into a subprocess's environment so a client made
    there is this episode's. In a run it also carries the run's ``PLAINRL_RUN_MARK``, by which
    the subprocess and what it starts are killed if the trainer dies (:mod:`plainrl.rollout.reaper`).

    Raises:
        ValueError: an unknown ``vendor``.
    """
    gateway = _gateway(llm)
    if vendor == "openai":
        env = {"OPENAI_BASE_URL": gateway.base_url, "OPENAI_API_KEY": gateway.key_for(llm)}
    elif vendor == "anthropic":
        env = {"ANTHROPIC_BASE_URL": gateway.url, "ANTHROPIC_API_KEY": gateway.key_for(llm)}
    else:
        raise ValueError(f"vendor {vendor!r}: one of 'openai', 'anthropic'")
    if MARK_ENV in os.environ:
        env[MARK_ENV] = os.environ[MARK_ENV]
    return env


def make_client(llm: LLM, vendor: Vendor, *, blocking: bool = False, **kwargs: Any) -> Any:
    """``openai.AsyncOpenAI`` / ``openai.OpenAI`` or ``anthropic.AsyncAnthropic`` /
    ``anthropic.Anthropic`` bound to ``llm``'s episode, over the gateway's HTTP client
    (:meth:`~plainrl.rollout.gateway.Gateway.http_client`); ``kwargs`` go to the client.

    Raises:
        ValueError: an unknown ``vendor``.
        RuntimeError: the handle has no gateway.
    """
    gateway = _gateway(llm)
    kwargs.setdefault("max_retries", 0)
    if vendor == "openai":
        import openai

        kwargs.setdefault("http_client", gateway.http_client(blocking=blocking))
        cls = openai.OpenAI if blocking else openai.AsyncOpenAI
        return cls(base_url=gateway.base_url, api_key=gateway.key_for(llm), **kwargs)
    if vendor == "anthropic":
        import anthropic

        kwargs.setdefault("http_client", gateway.http_client(blocking=blocking, httpx_module=_httpx_of(anthropic)))
        cls = anthropic.Anthropic if blocking else anthropic.AsyncAnthropic
        return cls(base_url=gateway.url, api_key=gateway.key_for(llm), **kwargs)
    raise ValueError(f"vendor {vendor!r}: one of 'openai', 'anthropic'")


def _gateway(llm: LLM) -> Any:
    if llm.gateway is None:
        raise RuntimeError("this LLM handle has no gateway: it was built outside a rollout "
                           "(plainrl.rollout.agent_rollout gives every episode one)")
    return llm.gateway


def _httpx_of(sdk: Any) -> Any:
    """The package ``sdk`` takes its HTTP clients from: ``httpx``, or ``httpx2`` (the
    ``anthropic`` SDK's since 2.14, which refuses an ``httpx`` client)."""
    for cls in sdk.DefaultAsyncHttpxClient.__mro__:
        if cls.__name__ == "AsyncClient" and cls.__module__.startswith("httpx"):
            return importlib.import_module(cls.__module__.split(".")[0])
    raise TypeError(f"{sdk.__name__}.DefaultAsyncHttpxClient is no httpx AsyncClient")
