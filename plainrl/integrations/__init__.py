"""Environments and tasks from other libraries, run from configuration (docs/environments.md).

Each module here adapts one library and is an optional extra: ``pip install 'plainrl[NAME]'``.
Nothing in plainrl imports these modules; a config names one (``data.source:
plainrl.integrations.reasoning_gym:rows``, ``rollout.env: plainrl.integrations.textarena:TextArenaEnv``)
and it is imported when that config is prepared, before any model loads. (OpenEnv's adapter is
``rollout.env``'s class loader's own: :mod:`plainrl.rollout.envs.openenv`.) A module whose library
is missing fails that import with :class:`MissingExtra`, naming the extra to install.

    from plainrl.integrations import require
    rg = require("reasoning_gym", extra="reasoning-gym")   # at the top of the adapter module
"""

from __future__ import annotations

# defined beside the loader that reports them (plainrl/user_code.py), so that rollout/'s OpenEnv
# adapter can name its extra without importing this package
from plainrl.user_code import MissingExtra, require

__all__ = ["MissingExtra", "require"]
