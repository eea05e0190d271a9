"""Environments and tasks from other libraries, run from configuration (docs/environments.md).

Each module here adapts one library and is an optional extra: ``pip install 'plainrl[NAME]'``.
Nothing in plainrl imports these modules; a config names one (``data.source:
plainrl.integrations.reasoning_gym:rows``, ``rollout.env: plainrl.integrations.textarena:TextArenaEnv``)
and it is imported when that config is prepared, before any model loads. The one exception is
:mod:`plainrl.integrations.openenv`: the config names the user's own OpenEnv class
(``rollout.env: my_env.py:MyEnvironment``), and ``rollout.env``'s class loader imports the adapter
when the class subclasses OpenEnv's ``Environment`` (openenv is then imported already). A module whose
library is missing fails that import with :class:`MissingExtra`, naming the extra to install.

    from plainrl.integrations import require
    rg = require("reasoning_gym", extra="reasoning-gym")   # at the top of the adapter module
"""

from __future__ import annotations

import importlib
from types import ModuleType

from plainrl.user_code import UserCodeError

__all__ = ["MissingExtra", "require"]


class MissingExtra(UserCodeError):
    """An integration's library is not installed; the message names the extra that installs it.

    A :class:`plainrl.user_code.UserCodeError` (so a ``ValueError``): the reference loaders
    (``rewards``, ``data.source``, ``rollout.env``, ``rollout.agent``, ``eval.grader``) report it as
    the configuration error it is, before any model loads.
    """


def require(module: str, *, extra: str) -> ModuleType:
    """Import ``module`` (an optional dependency) or fail naming the extra that installs it.

    Args:
        module: the import name, e.g. ``"reasoning_gym"``.
        extra: the name in ``plainrl[...]`` that installs it, e.g. ``"reasoning-gym"``.

    Returns:
        the imported module.

    Raises:
        MissingExtra: ``module`` (or a package it needs) is not installed; the message says
            ``pip install 'plainrl[<extra>]'``.
    """
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as e:
        missing = e.name or module
        what = f"{module!r}" if missing == module or module.startswith(missing + ".") else \
            f"{module!r} (it imports {missing!r}, which is missing)"
        raise MissingExtra(
            f"this needs the optional package {what}, which is not installed: "
            f"pip install 'plainrl[{extra}]'"
        ) from e
