"""Checkpoints that must be refused, and a save that fails for lack of space: a manifest or a
``latest`` pointer naming a path outside the checkpoint, an optimizer or a sampling generator
that does not fit the saved state, and a write that runs out of room (a real ENOSPC on a
small tmpfs where this process may mount one, a real EFBIG under RLIMIT_FSIZE always), after
which the previous checkpoint is the latest one and loads."""

from __future__ import annotations

import json
import os
import resource
import signal
import subprocess

import pytest
import torch

from plainrl.checkpoint import CheckpointError, find_latest, resolve_resume, verify
from plainrl.checkpoint.rng import get_rng_state, set_rng_state
from test_checkpoint import build, load, save, saved_run, train

STEP1 = "step-000001"


def _rewrite_manifest(ckpt, edit) -> None:
    path = ckpt / "manifest.json"
    manifest = json.loads(path.read_text())
    edit(manifest["files"])
    path.write_text(json.dumps(manifest))


@pytest.mark.parametrize("name", ["../step-000001/weights.safetensors", "..", "/etc/passwd", "sub/rng.pt"])
def test_a_manifest_naming_a_path_outside_its_directory_is_refused(tmp_path, name):
    saved_run(tmp_path, steps=(1, 2))
    root = tmp_path / "checkpoints"
    step2 = root / "step-000002"
    (tmp_path / "outside").write_bytes(b"x")  # something a '..' could reach
    _rewrite_manifest(step2, lambda files: files.update({name: {"size": 1, "sha256": "0" * 64}}))
    with pytest.raises(CheckpointError, match=rf"file name '{name}' is not a plain name"):
        verify(step2)
    assert find_latest(tmp_path) == root / STEP1  # the newest is refused: the one before is used
    with pytest.raises(CheckpointError, match=rf"step-000002/manifest.json: file name '{name}' is not a plain name"):
        resolve_resume(tmp_path, step2)  # named explicitly: refused, not loaded


def test_a_latest_pointer_leading_outside_is_ignored(tmp_path):
    saved_run(tmp_path, steps=(1,))
    root = tmp_path / "checkpoints"
    elsewhere = tmp_path / "elsewhere" / "step-000009"
    elsewhere.mkdir(parents=True)
    for pointer in ("../elsewhere/step-000009", str(elsewhere), "step-000001/.."):
        (root / "latest").write_text(pointer + "\n")
        assert find_latest(tmp_path) == root / STEP1


def test_an_optimizer_that_does_not_fit_is_refused(tmp_path):
    saved_run(tmp_path, lora=False)
    ckpt = find_latest(tmp_path)
    model, opt, sched = build(lora=False)
    # the same parameters in two groups: the saved single group does not map onto them
    params = [p for p in model.parameters() if p.requires_grad]
    split = torch.optim.AdamW([{"params": params[:2]}, {"params": params[2:]}], lr=1e-2)
    with pytest.raises(CheckpointError, match=r"optimizer.pt: the optimizer was saved for parameter groups of sizes "
                                              rf"\[{len(params)}\], this one has \[2, {len(params) - 2}\]"):
        load(ckpt, model, split, sched, torch.Generator())
    # the same number of parameters, one of another shape: named before any optimizer step
    model2, _, _ = build(lora=False)
    swapped = [p for p in model2.parameters() if p.requires_grad]
    swapped[0], swapped[1] = swapped[1], swapped[0]
    assert swapped[0].shape != swapped[1].shape
    opt2 = torch.optim.AdamW(swapped, lr=1e-2)
    with pytest.raises(CheckpointError, match=r"optimizer state 'exp_avg' of parameter 0 has shape"):
        load(ckpt, model2, opt2, sched, torch.Generator())


def test_a_sampling_generator_of_another_device_or_none_saved_is_refused(tmp_path):
    # saved without a sampling generator: a run that needs one cannot resume from it
    model, opt, sched = build(False)
    save(tmp_path, 1, model, opt, sched, None)
    with pytest.raises(CheckpointError, match=r"rng.pt: no sampling generator state was saved"):
        load(find_latest(tmp_path), *build(False), torch.Generator())
    # a CUDA generator's state (seed and offset, 16 bytes) does not fit a CPU generator: named, with both devices
    state = get_rng_state(torch.Generator().manual_seed(1))
    state["generator"], state["generator_device"] = torch.zeros(16, dtype=torch.uint8), "cuda:0"
    with pytest.raises(CheckpointError, match=r"the sampling generator state \(saved on cuda:0\) does not fit "
                                              r"this generator on cpu"):
        set_rng_state(state, torch.Generator(), tmp_path)


def _save_in_child(tmp_path, trained, limit_bytes: int | None) -> int:
    """Save step 2 of ``trained`` (:func:`saved_run` + a step) in a forked child, under
    RLIMIT_FSIZE ``limit_bytes`` when given. Returns its exit code: 0 the save failed with a
    CheckpointError naming the write, 1 it succeeded, 2 anything else."""
    model, opt, sched, gen = trained
    pid = os.fork()
    if pid == 0:
        code = 2
        try:
            if limit_bytes is not None:
                signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails with EFBIG
                resource.setrlimit(resource.RLIMIT_FSIZE, (limit_bytes, limit_bytes))
            save(tmp_path, 2, model, opt, sched, gen)
            code = 1
        except CheckpointError as e:
            code = 0 if "could not write checkpoint" in str(e) else 2
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status)


def _step_after_1(run):
    model, opt, sched, gen = saved_run(run)
    train(model, opt, sched, gen, 1)
    return model, opt, sched, gen


def _previous_survives(tmp_path) -> None:
    root = tmp_path / "checkpoints"
    assert find_latest(tmp_path) == root / STEP1
    assert sorted(p.name for p in root.iterdir()) == ["latest", STEP1]  # the failed save left nothing behind
    assert load(root / STEP1, *build(False, seed=1), torch.Generator()).step == 1


def test_a_save_past_the_file_size_limit_fails_and_the_previous_checkpoint_survives(tmp_path):
    weights = 0
    saved_run(tmp_path / "probe")
    for p in (tmp_path / "probe" / "checkpoints" / STEP1).iterdir():
        weights = max(weights, p.stat().st_size)
    # every file of step 2 but the largest fits: the write fails part-way through the checkpoint
    assert _save_in_child(tmp_path / "run", _step_after_1(tmp_path / "run"), limit_bytes=weights // 2) == 0
    _previous_survives(tmp_path / "run")


@pytest.fixture()
def small_tmpfs(tmp_path):
    """A tmpfs of 2 MiB at tmp_path/fs (needs root and mount(8); skipped elsewhere)."""
    where = tmp_path / "fs"
    where.mkdir()
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    out = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(where)], capture_output=True, text=True)
    if out.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {out.stderr.strip()}")
    try:
        yield where
    finally:
        subprocess.run(["umount", "-l", str(where)], check=False)


def test_a_save_that_runs_out_of_space_fails_and_the_previous_checkpoint_survives(small_tmpfs):
    run = small_tmpfs / "run"
    trained = _step_after_1(run)  # step 1 fits
    used = sum(p.stat().st_size for p in (run / "checkpoints" / STEP1).iterdir())
    filler = small_tmpfs / "filler"
    free = os.statvfs(small_tmpfs).f_bavail * os.statvfs(small_tmpfs).f_frsize
    filler.write_bytes(b"\0" * max(0, free - used // 2))  # room for half of another checkpoint
    assert _save_in_child(run, trained, limit_bytes=None) == 0  # ENOSPC, reported as a failed write
    _previous_survives(run)
