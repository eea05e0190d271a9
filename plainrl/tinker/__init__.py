"""Tinker's training API served by plainrl (``plainrl tinker``): the ``tinker`` SDK's
``ServiceClient(base_url=...)`` trains LoRA adapters of the config's model through plainrl's
forward/backward, AdamW and embedded engine. See docs/tinker.md."""

from plainrl.tinker.server import serve

__all__ = ["serve"]
