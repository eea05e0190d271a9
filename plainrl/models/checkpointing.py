"""Activation checkpointing of the decoder layers (``train.gradient_checkpointing``).

Under autograd a decoder layer normally keeps every intermediate its backward needs:
normalised inputs, queries, keys, values, attention outputs, the MLP's gate, up and
activation products, roughly 15-20 hidden-sized tensors per token. With checkpointing a
layer keeps only its input [B, T, H]; its forward runs again in backward to rebuild
the rest. That trades about one more decoder forward per update for activation memory
that no longer grows with the number of layers times those intermediates.

Why not transformers' ``gradient_checkpointing_enable()``: its checkpointed layers set
``use_cache=False`` and drop the cache (transformers 5.x ``GradientCheckpointingLayer``)
because the backward replay would append the same keys and values to the cache a second
time. plainrl's shared-prompt forward (:func:`plainrl.models.shared_prompt_hidden`)
needs that cache: its completions attend to the prompt's keys and values through it,
so dropping it would silently compute the wrong thing. Here each layer's checkpointed
function instead puts its own cache entry back to the state the first call saw before
running, so the replay sees the same keys and values and appends the same ones.

Why non-reentrant (``use_reentrant=False``): backward runs through the original graph and
the replay only supplies the saved tensors, so gradients reach tensors the layer takes
from outside its arguments (the cached prompt keys and values) and reach LoRA adapters
even when the layer's input does not require grad (frozen embeddings), which the
reentrant variant would drop without ``enable_input_require_grads``. Its default check
that the replay saves tensors of the same shapes turns any cache mismatch into an error.
"""

from __future__ import annotations

import functools

import torch
from torch.utils.checkpoint import checkpoint

from plainrl.models.loading import unwrap


def enable_gradient_checkpointing(model: torch.nn.Module) -> int:
    """Checkpoint every decoder layer of ``model`` whenever it runs with grad enabled.

    Without grad (rollouts, reference and old logprobs, evaluation) the layers run as
    before. Parameter names and the state dict are unchanged: the layer's own
    ``forward`` is shadowed by an instance attribute, which ``copy.deepcopy`` carries
    over to the copy. Calling it twice wraps nothing twice.

    Args:
        model: a transformers causal LM, value or reward model, or a peft wrapper of one.
    Returns:
        the number of decoder layers wrapped.
    Raises:
        ValueError: the model has no ``get_decoder().layers`` list to wrap.
    """
    base = unwrap(model)
    decoder = base.get_decoder() if hasattr(base, "get_decoder") else None
    layers = getattr(decoder, "layers", None)
    if not isinstance(layers, torch.nn.ModuleList) or len(layers) == 0:
        raise ValueError(f"train.gradient_checkpointing: {type(base).__name__} has no get_decoder().layers "
                         "list of decoder layers to checkpoint")
    for index, layer in enumerate(layers):
        if not is_checkpointed(layer):
            # the layer's position is its cache index (transformers' layer_idx) in every decoder-only model
            layer.forward = functools.partial(_checkpointed_forward, layer, index)
    return len(layers)


def is_checkpointed(layer: torch.nn.Module) -> bool:
    """Whether :func:`enable_gradient_checkpointing` wrapped this decoder layer."""
    forward = vars(layer).get("forward")
    return isinstance(forward, functools.partial) and forward.func is _checkpointed_forward


def _checkpointed_forward(layer: torch.nn.Module, index: int, *args, **kwargs):
    run = type(layer).forward.__get__(layer)  # the class's forward: the layer as transformers wrote it
    if not torch.is_grad_enabled():
        return run(*args, **kwargs)
    # the layers' name for the cache: `cache` from transformers 5.24 (`past_key_values`, deprecated
    # there, before); missing it would let the replay append the prompt's keys a second time
    cache = kwargs.get("cache", kwargs.get("past_key_values"))
    if cache is None:
        return checkpoint(run, *args, use_reentrant=False, **kwargs)
    entry = _cache_entry(cache, index)
    # A shallow copy of the entry's attributes: DynamicLayer.update rebinds keys/values to
    # a new torch.cat result rather than writing into them, so the tensors referenced here
    # still hold exactly what this call saw. Restoring by object rather than cropping to a
    # length makes the replay independent of the order in which backward replays the
    # prompt pass and the completion pass of the same layer. The cost: the entry's pre-call
    # keys and values (the prompt's, repeated to the rows that share it) stay alive until
    # backward, at most the size of the cache itself.
    before = dict(vars(entry))

    def replayable(*a, **kw):
        vars(entry).clear()
        vars(entry).update(before)
        return run(*a, **kw)

    return checkpoint(replayable, *args, use_reentrant=False, **kwargs)


def _cache_entry(cache, index: int):
    """Layer ``index``'s entry of a transformers ``DynamicCache``, created as its ``update`` would."""
    from transformers import DynamicCache

    if not isinstance(cache, DynamicCache) or not hasattr(cache, "layers"):
        # a static cache writes into preallocated tensors: a shallow copy could not restore it
        raise TypeError(f"train.gradient_checkpointing: a {type(cache).__name__} under autograd is not supported; "
                        "checkpointed layers need a DynamicCache with per-layer entries (transformers >= 4.56)")
    factory = getattr(cache, "layer_class_to_replicate", None)
    while len(cache.layers) <= index and factory is not None:
        cache.layers.append(factory())
    if len(cache.layers) <= index:
        raise TypeError(f"train.gradient_checkpointing: the cache has no entry for decoder layer {index}")
    return cache.layers[index]
