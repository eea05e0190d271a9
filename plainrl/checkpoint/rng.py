"""The random states a checkpoint carries: python, numpy, torch CPU, every CUDA device and
the sampling generator."""

from __future__ import annotations

import logging
import random
from pathlib import Path
from typing import Any, Mapping

import numpy as np
import torch

from plainrl.checkpoint.layout import RNG, CheckpointError

log = logging.getLogger(__name__)


def get_rng_state(generator: torch.Generator | None) -> dict[str, Any]:
    """Every RNG state, in a form ``torch.load(weights_only=True)`` reads back."""
    version, internal, gauss = random.getstate()
    np_name, np_keys, np_pos, np_has_gauss, np_gauss = np.random.get_state()
    state: dict[str, Any] = {
        "python": {"version": version, "state": list(internal), "gauss_next": gauss},
        # int64: torch's safe unpickler takes tensors, not numpy arrays
        "numpy": {"name": np_name, "keys": torch.from_numpy(np_keys.astype(np.int64)), "pos": int(np_pos),
                  "has_gauss": int(np_has_gauss), "cached_gaussian": float(np_gauss)},
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
    }
    if generator is not None:
        state["generator"] = generator.get_state()
        state["generator_device"] = str(generator.device)
    return state


def set_rng_state(state: Mapping[str, Any], generator: torch.Generator | None, path: Path) -> None:
    """Set the global RNGs (and ``generator``) from :func:`get_rng_state`'s output.

    CUDA states are restored for the devices this machine has (with a warning when
    that is fewer, or none).

    Args:
        state: what :func:`get_rng_state` returned.
        generator: restored when given.
        path: the checkpoint directory, for messages.
    Raises:
        CheckpointError: the state is malformed, or ``generator`` is given but no
            generator state was saved, or it was saved on another device type.
    """
    try:
        py = state["python"]
        random.setstate((py["version"], tuple(py["state"]), py["gauss_next"]))
        npst = state["numpy"]
        np.random.set_state((npst["name"], npst["keys"].numpy().astype(np.uint32), npst["pos"],
                             npst["has_gauss"], npst["cached_gaussian"]))
        torch.set_rng_state(state["torch"])
    except (KeyError, TypeError, ValueError, RuntimeError) as e:
        raise CheckpointError(f"{path / RNG}: bad RNG state ({type(e).__name__}: {e})") from e
    cuda = state.get("cuda") or []
    if cuda and torch.cuda.is_available():
        n = min(len(cuda), torch.cuda.device_count())
        if n < len(cuda):
            log.warning("checkpoint has CUDA RNG states for %d devices, this machine has %d; restoring %d",
                        len(cuda), torch.cuda.device_count(), n)
        for i in range(n):
            torch.cuda.set_rng_state(cuda[i], i)
    elif cuda:
        log.warning("checkpoint %s holds CUDA RNG states but CUDA is not available; not restored", path)
    if generator is not None:
        if "generator" not in state:
            raise CheckpointError(f"{path / RNG}: no sampling generator state was saved")
        try:
            generator.set_state(state["generator"])
        except RuntimeError as e:
            raise CheckpointError(
                f"{path / RNG}: the sampling generator state (saved on {state.get('generator_device')}) "
                f"does not fit this generator on {generator.device}: {e}"
            ) from e
