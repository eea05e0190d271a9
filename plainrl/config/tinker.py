"""``tinker``: the settings of ``plainrl tinker`` (Tinker's training API on this machine) that no
other section holds; ``plainrl train`` ignores them."""

from __future__ import annotations

from pydantic import Field

from plainrl.config.base import _Section


class TinkerConfig(_Section):
    """`plainrl tinker`'s base models, idle clients and sampler snapshots (docs/tinker.md)."""

    base_models: list[str] = Field(default_factory=list)
    """The base models served, each named as `model.name` takes it (a hub id, a local directory, `smollm2-135m-instruct`)
    and loaded with the `model` section's other settings; the first is the default; empty: `model.name` alone."""
    session_expiry_s: float | None = Field(300.0, gt=0)
    """A `ServiceClient` from which nothing (a heartbeat, which the SDK sends every 10 s, or a request of its clients)
    has reached the service for this long, and none of whose requests waits, expires: its training clients' adapters
    and optimizer state and its samplers are freed; null: it lasts until `close()` or the service stops."""
    ephemeral_samplers: int = Field(4, ge=1)
    """How many of a training client's newest `save_weights_and_get_sampling_client` snapshots it keeps; an older one
    is freed (sampling it is a 400 that says so)."""
