"""Tinker's training API served by plainrl (``plainrl tinker``): the ``tinker`` SDK's
``ServiceClient(base_url=...)`` trains LoRA adapters of the config's model through plainrl's
forward/backward and AdamW, sampling on the embedded engine or a run's inference servers. See
docs/tinker.md."""

from plainrl.tinker.server import serve

__all__ = ["serve"]
