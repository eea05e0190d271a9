"""A user's code named in a config: ``package.module:fn`` or ``path/to/file.py:fn``, imported before
any model loads (rewards, ``rollout.env``, ``rollout.agent``, ``data.source``, ``eval.grader``).

A reference is ``package.module:fn`` (imported with :func:`importlib.import_module`) or
``path/to/file.py:fn`` (a relative path is resolved against the current directory). The part after
the colon may be dotted (``module:obj.method``). Everything here raises :class:`UserCodeError` (a
``ValueError``, so pydantic validators report it as a config error) with what is wrong and the fix.
"""

from __future__ import annotations

import difflib
import hashlib
import importlib
import importlib.util
import sys
from pathlib import Path
from types import ModuleType
from typing import Any, Callable

__all__ = ["MissingExtra", "UserCodeError", "load_callable", "require"]


class UserCodeError(ValueError):
    """A ``module:fn`` reference that cannot be resolved; the message says what is wrong and the fix."""


class MissingExtra(UserCodeError):
    """An optional library is not installed; the message names the extra that installs it.

    A :class:`UserCodeError` (so a ``ValueError``): the reference loaders (``rewards``,
    ``data.source``, ``rollout.env``, ``rollout.agent``, ``eval.grader``) report it as the
    configuration error it is, before any model loads.
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


def load_callable(ref: str, *, what: str, hint: str = "") -> Callable[..., Any]:
    """Import the callable named by ``ref``.

    Args:
        ref: ``package.module:fn`` or ``path/to/file.py:fn``. A target ending in ``.py`` or
            containing a path separator is a file; it is imported under a unique module name derived
            from its absolute path (so two files both called ``rewards.py`` do not collide, and
            loading the same file twice reuses one module), and its directory is appended to
            ``sys.path`` so it can import sibling helper modules.
        what: what the reference is for, named in error messages (``"reward"``, ``"rollout.env"``).
        hint: appended to the message of a reference without a colon (e.g. the built-in names).

    Returns:
        The callable (its signature is the caller's to check).

    Raises:
        UserCodeError: no colon; module or file not found; the module raised while importing;
            attribute missing (the message lists the module's callables); not callable.
    """
    if not isinstance(ref, str) or ":" not in ref:
        raise UserCodeError(
            f"{what} reference {ref!r} has no ':'; write 'package.module:function' or "
            f"'path/to/file.py:function'.{hint}"
        )
    target, _, attr_path = ref.strip().rpartition(":")
    if not target or not attr_path:
        raise UserCodeError(
            f"{what} reference {ref!r} is missing the {'module/file' if not target else 'function'} "
            "part; write 'package.module:function' or 'path/to/file.py:function'"
        )
    label = f"{what} {ref!r}"
    if target.endswith(".py") or "/" in target or "\\" in target:
        module = _import_file(target, label)
        shown = str(module.__file__)
    else:
        module = _import_module(target, label)
        shown = module.__name__
    return _resolve_attr(module, shown, attr_path, label)


def _import_module(name: str, label: str) -> ModuleType:
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as e:
        missing = e.name or ""
        if missing == name or name.startswith(missing + "."):
            hint = ""
            as_file = Path.cwd() / (name.replace(".", "/") + ".py")
            if as_file.is_file():
                # console scripts do not put the current directory on sys.path
                hint = f" A file {as_file} exists: reference it as '{name.replace('.', '/')}.py:...'."
            raise UserCodeError(
                f"{label}: module {name!r} not found (no module named {missing!r}). "
                f"Check the spelling, install the package, or put it on PYTHONPATH; for a "
                f"file, use 'path/to/file.py:function'.{hint}"
            ) from e
        raise UserCodeError(
            f"{label}: importing module {name!r} failed because it imports {missing!r}, "
            "which is not installed; install it"
        ) from e
    except UserCodeError as e:  # e.g. MissingExtra: it names the fix already
        raise UserCodeError(f"{label}: {e}") from e
    except Exception as e:
        raise UserCodeError(
            f"{label}: importing module {name!r} raised {type(e).__name__}: {e}"
        ) from e


def _import_file(target: str, label: str) -> ModuleType:
    given = Path(target).expanduser()
    path = (given if given.is_absolute() else Path.cwd() / given).resolve()
    if not path.is_file():
        where = "" if given.is_absolute() else f" (resolved against the current directory {Path.cwd()})"
        raise UserCodeError(
            f"{label}: file {str(path)!r} not found{where}; check the path, or give an absolute one"
        )
    if path.suffix != ".py":
        raise UserCodeError(f"{label}: {str(path)!r} is not a .py file")
    digest = hashlib.sha1(str(path).encode()).hexdigest()[:10]
    stem = "".join(c if c.isalnum() else "_" for c in path.stem)
    # no dot: pickle must find it in sys.modules (the name predates other kinds of user code; kept so that
    # what earlier runs pickled still loads)
    mod_name = f"plainrl_user_reward_{stem}_{digest}"
    if mod_name in sys.modules:
        return sys.modules[mod_name]
    spec = importlib.util.spec_from_file_location(mod_name, path)
    if spec is None or spec.loader is None:
        raise UserCodeError(f"{label}: cannot import {str(path)!r} as a Python module")
    module = importlib.util.module_from_spec(spec)
    if str(path.parent) not in sys.path:
        sys.path.append(str(path.parent))
    # registered before executing so dataclasses/pickle inside the file can find it
    sys.modules[mod_name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException as e:
        del sys.modules[mod_name]
        if not isinstance(e, Exception):
            raise
        if isinstance(e, UserCodeError):
            raise UserCodeError(f"{label}: {e}") from e
        raise UserCodeError(
            f"{label}: importing {str(path)!r} raised {type(e).__name__}: {e}"
        ) from e
    return module


def _resolve_attr(module: ModuleType, shown: str, attr_path: str, label: str) -> Callable[..., Any]:
    obj: Any = module
    for i, part in enumerate(attr_path.split(".")):
        if not hasattr(obj, part):
            if i == 0:
                available = _module_callables(module)
                close = difflib.get_close_matches(part, available, n=1)
                did_you_mean = f" Did you mean {close[0]!r}?" if close else ""
                listing = ", ".join(available) if available else "(none)"
                raise UserCodeError(
                    f"{label}: {shown!r} has no attribute {part!r}.{did_you_mean} "
                    f"Callables defined there: {listing}"
                )
            raise UserCodeError(
                f"{label}: {'.'.join(attr_path.split('.')[:i])!r} has no attribute {part!r}"
            )
        obj = getattr(obj, part)
    if not callable(obj):
        raise UserCodeError(
            f"{label}: {attr_path!r} is a {type(obj).__name__}, not a function; "
            "point the reference at a callable"
        )
    return obj


def _module_callables(module: ModuleType) -> list[str]:
    public = {n: v for n, v in vars(module).items() if not n.startswith("_") and callable(v)}
    # Prefer what the module defines (or re-exports from its own package) over
    # helpers it merely imported, like `math` functions or `Path`.
    root = module.__name__.split(".")[0]
    own = [n for n, v in public.items() if str(getattr(v, "__module__", "")).split(".")[0] == root]
    return sorted(own or public)
