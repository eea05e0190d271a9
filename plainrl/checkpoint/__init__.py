"""Resumable training checkpoints: atomic on disk, checksummed, loaded with safe loaders only.

    path = save_checkpoint(run_dir, step, model=..., optimizer=..., scheduler=...,
                           sampler_state=sampler.state_dict(), generator=generator,
                           config_yaml=dump_config(cfg), keep_last=3)
    ckpt = resolve_resume(run_dir, "auto")          # None: start from scratch
    if ckpt is not None:
        state = load_checkpoint(ckpt, model=..., optimizer=..., scheduler=..., generator=generator)
        sampler.load_state_dict(state.sampler_state)

Layout (see docs/checkpointing.md)::

    run_dir/checkpoints/
        latest                  # one line: "step-000123" (the commit point)
        step-000123/
            weights.safetensors # LoRA adapter only, or every parameter (tied ones once)
            master.safetensors  # fp32 master weights, when the optimizer updates copies (bf16)
            optimizer.pt        # optimizer.state_dict()
            scheduler.pt        # scheduler.state_dict()
            rng.pt              # python, numpy, torch CPU/CUDA, sampling generator
            state.json          # step, sampler state, extra, weights kind
            config.yaml         # the resolved config of the run that wrote it
            manifest.json       # sha256 + size of every file above; written last

A checkpoint directory is written under ``.tmp-*``, fsynced, renamed into place and
only then named by ``latest``; a process killed at any point leaves the previous
checkpoint loadable. ``.pt`` files are read with ``torch.load(weights_only=True)``, so
a checkpoint cannot run code when loaded.

Modules: ``layout`` (file names, CheckpointError), ``files`` (durable writes, manifest,
verify), ``weights`` and ``rng`` (what is saved), ``save``, ``load``, ``resume``
(find_latest, resolve_resume, check_compatible).
"""

from plainrl.checkpoint.files import verify
from plainrl.checkpoint.layout import (
    CHECKPOINTS_DIR, CONFIG, FORMAT_VERSION, LATEST, MANIFEST, MASTER, OPTIMIZER, REQUIRED_FILES, RNG, SCHEDULER,
    STATE, TMP_PREFIX, WEIGHTS, CheckpointError, step_dir_name,
)
from plainrl.checkpoint.load import CheckpointState, load_checkpoint
from plainrl.checkpoint.resume import (
    FATAL_FIELDS, RESUME_FIELDS, WARN_FIELDS, check_compatible, find_latest, read_config, resolve_resume,
)
from plainrl.checkpoint.save import save_checkpoint

__all__ = [
    "CHECKPOINTS_DIR", "CONFIG", "FATAL_FIELDS", "FORMAT_VERSION", "LATEST", "MANIFEST", "MASTER", "OPTIMIZER",
    "REQUIRED_FILES", "RESUME_FIELDS", "RNG", "SCHEDULER", "STATE", "TMP_PREFIX", "WARN_FIELDS", "WEIGHTS",
    "CheckpointError", "CheckpointState", "check_compatible", "find_latest", "load_checkpoint", "read_config",
    "resolve_resume", "save_checkpoint", "step_dir_name", "verify",
]
