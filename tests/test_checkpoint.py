"""Checkpoints: exact resume, tamper detection, crash safety (SIGKILL mid-save), retention."""

from __future__ import annotations

import copy
import logging
import os
import random
import signal
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from plainrl.checkpoint import resume as resume_mod
from plainrl.checkpoint import save as save_mod
from plainrl.checkpoint import (
    FATAL_FIELDS,
    RESUME_FIELDS,
    WARN_FIELDS,
    CheckpointError,
    check_compatible,
    find_latest,
    load_checkpoint,
    read_config,
    resolve_resume,
    save_checkpoint,
    step_dir_name,
    verify,
)
from plainrl.train import lr_lambda

VOCAB = 96
SAMPLER = {"epoch": 1, "position": 3, "num_rows": 10, "seed": 0, "shuffle": True}
CONFIG_YAML = "seed: 0\nmodel:\n  name: tiny\n"


def tiny_llama(seed: int):
    """1-layer hidden-16 Llama with tied embeddings and attention dropout (so training
    draws from the torch RNG and a resume is exact only if that RNG is restored).
    Every tensor stays below torch's parallel grain size, so a forked child never
    enters an OpenMP region."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1, max_position_embeddings=32, tie_word_embeddings=True, attention_dropout=0.1,
    )
    return LlamaForCausalLM(cfg)


def build(lora: bool, seed: int = 0):
    # the base model is what model.name loads: the same in every run
    model = tiny_llama(0)
    if lora:
        from peft import LoraConfig, get_peft_model

        torch.manual_seed(seed)
        model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, lora_dropout=0.1, target_modules=["q_proj", "v_proj"]))
    elif seed:
        torch.manual_seed(seed)
        for p in model.parameters():
            torch.nn.init.normal_(p, std=0.02)
    model.train()
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-2, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: lr_lambda(s, warmup=3, total=10, schedule="cosine"))
    return model, opt, sched


def train(model, opt, sched, gen: torch.Generator, steps: int) -> None:
    for _ in range(steps):
        ids = torch.randint(0, VOCAB, (2, 8), generator=gen)
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        sched.step()


def save(run_dir, step, model, opt, sched, gen, **kw):
    return save_checkpoint(run_dir, step, model=model, optimizer=opt, scheduler=sched, sampler_state=SAMPLER,
                           generator=gen, config_yaml=CONFIG_YAML, **kw)


def load(path, model, opt, sched, gen):
    return load_checkpoint(path, model=model, optimizer=opt, scheduler=sched, generator=gen)


def rng_snapshot(gen):
    return random.getstate(), np.random.get_state(), torch.get_rng_state(), gen.get_state()


def same_snapshot(a, b) -> bool:
    return (a[0] == b[0] and all(np.array_equal(x, y) for x, y in zip(a[1], b[1]))
            and torch.equal(a[2], b[2]) and torch.equal(a[3], b[3]))


def draws(gen):
    return torch.rand(3), random.random(), np.random.rand(3), torch.rand(3, generator=gen)


def assert_same(a, b):
    """Deep equality of nested dicts/lists/tensors (optimizer state dicts)."""
    if torch.is_tensor(a):
        assert torch.is_tensor(b) and a.dtype == b.dtype and torch.equal(a, b)
    elif isinstance(a, dict):
        assert a.keys() == b.keys()
        for k in a:
            assert_same(a[k], b[k])
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b)
        for x, y in zip(a, b):
            assert_same(x, y)
    else:
        assert a == b


def saved_run(tmp_path, lora=False, steps=(1,)):
    model, opt, sched = build(lora)
    gen = torch.Generator().manual_seed(7)
    for s in steps:
        train(model, opt, sched, gen, 1)
        save(tmp_path, s, model, opt, sched, gen)
    return model, opt, sched, gen


# ----------------------------------------------------------------------------- round trip


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_round_trip_resumes_exactly(tmp_path, lora):
    model, opt, sched = build(lora)
    gen = torch.Generator().manual_seed(7)
    random.seed(1), np.random.seed(2), torch.manual_seed(3)
    train(model, opt, sched, gen, 2)
    path = save(tmp_path, 2, model, opt, sched, gen, extra={"best_reward": 0.5})
    assert path == tmp_path / "checkpoints" / "step-000002"
    assert (tmp_path / "checkpoints" / "latest").read_text().strip() == "step-000002"
    snap = rng_snapshot(gen)
    train(model, opt, sched, gen, 2)
    want_params = {n: p.detach().clone() for n, p in model.named_parameters()}
    want_opt, want_lr, want_draws = copy.deepcopy(opt.state_dict()), sched.get_last_lr(), draws(gen)

    model2, opt2, sched2 = build(lora, seed=1)
    gen2 = torch.Generator().manual_seed(99)
    random.seed(5), np.random.seed(5), torch.manual_seed(5)
    state = load(find_latest(tmp_path), model2, opt2, sched2, gen2)
    assert (state.step, state.sampler_state, state.extra) == (2, SAMPLER, {"best_reward": 0.5})
    assert state.config_yaml == CONFIG_YAML and state.config["model"]["name"] == "tiny"
    assert same_snapshot(rng_snapshot(gen2), snap)
    train(model2, opt2, sched2, gen2, 2)

    got = dict(model2.named_parameters())
    assert got.keys() == want_params.keys()
    for n, p in want_params.items():
        assert torch.equal(got[n].detach(), p), n
    assert_same(opt2.state_dict(), want_opt)
    assert sched2.get_last_lr() == want_lr
    for w, g in zip(want_draws, draws(gen2)):
        assert np.array_equal(np.asarray(w), np.asarray(g))
    if not lora:  # tied weights are stored once and stay tied after loading
        assert model2.lm_head.weight.data_ptr() == model2.model.embed_tokens.weight.data_ptr()


def _learner(lora: bool, seed: int, offload: str = "none", dtype: torch.dtype = torch.bfloat16):
    """The production path: a bf16 model (LoRA via apply_lora) and Learner, whose AdamW
    updates fp32 master copies of the bf16 parameters (host copies, whatever the dtype, with
    ``offload="optimizer"``)."""
    from plainrl.config import Config
    from plainrl.models import apply_lora
    from plainrl.run.setup import make_learner

    cfg = Config.model_validate({
        "data": {"task": "arithmetic"}, "rewards": [{"fn": "m:f"}],
        "model": {"dtype": "bfloat16", "lora": {"enabled": lora, "r": 4, "dropout": 0.1, "target_modules": ["q_proj", "v_proj"]}},
        "train": {"lr": 1e-2, "steps": 10, "warmup_steps": 2, "lr_schedule": "cosine", "offload": offload},
        "rollout": {"max_new_tokens": 8, "group_size": 2},
    })
    model = tiny_llama(0).to(dtype)
    if lora:
        torch.manual_seed(seed)
        model = apply_lora(model, cfg.model.lora)
    model.train()
    return make_learner(cfg, model, pad_id=0)


def learner_steps(learner, gen, steps):
    from plainrl.types import Episode

    for _ in range(steps):
        eps = []
        for i in range(4):
            p, c = torch.randint(1, VOCAB, (5,), generator=gen).tolist(), torch.randint(1, VOCAB, (4,), generator=gen).tolist()
            eps.append(Episode(sample_id=str(i), group=i // 2, row={}, prompt_ids=p, completion_ids=c,
                               logprobs=[0.0] * 4, loss_mask=[1] * 4, finish_reason="length"))
        assert not learner.update(eps, torch.randn(4, generator=gen)).skipped


@pytest.mark.parametrize("lora,offload,dtype", [
    (False, "none", torch.bfloat16), (True, "none", torch.bfloat16), (False, "optimizer", torch.bfloat16),
    (False, "optimizer", torch.float32)], ids=["full", "lora", "offload", "offload-fp32"])
def test_round_trip_with_fp32_master_weights(tmp_path, lora, offload, dtype):
    """Exact resume of a learner whose AdamW updates fp32 masters: bf16 weights, or any weights
    under train.offload=optimizer (host masters); built before loading, its masters are stale."""
    ln = _learner(lora, 0, offload, dtype)
    assert ln.master and all(m is not p and m.dtype == torch.float32 for m, p in zip(ln.master, ln.params))  # fp32 copies
    gen = torch.Generator().manual_seed(7)
    learner_steps(ln, gen, 2)
    path = save_checkpoint(tmp_path, 2, model=ln.model, optimizer=ln.optimizer, scheduler=ln.scheduler,
                           sampler_state=SAMPLER, generator=gen, config_yaml=CONFIG_YAML)
    assert (path / "master.safetensors").is_file()
    learner_steps(ln, gen, 2)

    ln2 = _learner(lora, 1, offload, dtype)  # built before loading, as the loop does: its masters are stale
    gen2 = torch.Generator()
    load(path, ln2.model, ln2.optimizer, ln2.scheduler, gen2)
    learner_steps(ln2, gen2, 2)
    for a, b in zip(ln.master + ln.params, ln2.master + ln2.params):
        assert torch.equal(a.detach(), b.detach())
    assert_same(ln2.optimizer.state_dict(), ln.optimizer.state_dict())


def test_lora_saves_only_the_adapter(tmp_path):
    from safetensors import safe_open

    saved_run(tmp_path, lora=True)
    with safe_open(str(tmp_path / "checkpoints" / "step-000001" / "weights.safetensors"), framework="pt") as f:
        keys = list(f.keys())
    assert keys and all("lora_" in k for k in keys)


def test_weights_kind_mismatch_is_refused(tmp_path):
    saved_run(tmp_path, lora=True)
    model, opt, sched = build(lora=False)
    with pytest.raises(CheckpointError, match="LoRA|lora"):
        load(find_latest(tmp_path), model, opt, sched, torch.Generator())


# ----------------------------------------------------------------------------- tampering


def test_truncated_file_is_named(tmp_path):
    saved_run(tmp_path)
    d = tmp_path / "checkpoints" / "step-000001"
    w = d / "weights.safetensors"
    with open(w, "r+b") as f:
        f.truncate(w.stat().st_size - 10)
    with pytest.raises(CheckpointError, match=r"weights\.safetensors.*truncated"):
        verify(d)
    model, opt, sched = build(False)
    with pytest.raises(CheckpointError, match=r"weights\.safetensors"):
        load(d, model, opt, sched, torch.Generator())


def test_flipped_byte_is_named(tmp_path):
    saved_run(tmp_path)
    d = tmp_path / "checkpoints" / "step-000001"
    o = d / "optimizer.pt"
    data = bytearray(o.read_bytes())
    data[len(data) // 2] ^= 0xFF
    o.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=r"optimizer\.pt.*altered"):
        verify(d)


def test_missing_file_is_named(tmp_path):
    saved_run(tmp_path)
    d = tmp_path / "checkpoints" / "step-000001"
    (d / "rng.pt").unlink()
    with pytest.raises(CheckpointError, match=r"rng\.pt.*missing"):
        verify(d)


def test_missing_manifest_means_partial(tmp_path, caplog):
    saved_run(tmp_path, steps=(1, 2))
    (tmp_path / "checkpoints" / "step-000002" / "manifest.json").unlink()
    with caplog.at_level(logging.WARNING, logger="plainrl.checkpoint"):
        found = find_latest(tmp_path)
    assert found == tmp_path / "checkpoints" / "step-000001"
    assert "step-000002" in caplog.text and "incomplete" in caplog.text


def test_only_checkpoint_partial_gives_none(tmp_path, caplog):
    saved_run(tmp_path)
    (tmp_path / "checkpoints" / "step-000001" / "manifest.json").unlink()
    with caplog.at_level(logging.WARNING, logger="plainrl.checkpoint"):
        assert find_latest(tmp_path) is None
    assert "step-000001" in caplog.text


def test_corrupt_latest_falls_back_with_warning(tmp_path, caplog):
    saved_run(tmp_path, steps=(1, 2))
    w = tmp_path / "checkpoints" / "step-000002" / "weights.safetensors"
    data = bytearray(w.read_bytes())
    data[-1] ^= 0x01
    w.write_bytes(bytes(data))
    with caplog.at_level(logging.WARNING, logger="plainrl.checkpoint"):
        found = find_latest(tmp_path)
    assert found == tmp_path / "checkpoints" / "step-000001"
    assert "weights.safetensors" in caplog.text and "falling back" in caplog.text


# ----------------------------------------------------------------------------- crash safety


# The points of save_checkpoint at which a kill is tested, in order, each meaning "killed
# right after this step": the child dies at the first operation that follows it.
# (module, attribute, whether this call is the one to die at).
KILL_POINTS = {
    "weights": (save_mod, "torch_save", lambda obj, path: path.name == "optimizer.pt"),
    "optimizer": (save_mod, "torch_save", lambda obj, path: path.name == "scheduler.pt"),
    "manifest": (os, "rename", lambda src, dst: Path(src).name.startswith(".tmp-step-")),
    # "rename": the directory has its final name but `latest` still names the previous one
    "rename": (save_mod, "write_atomic", lambda path, data: path.name == "latest"),
    "pointer": (os, "replace", lambda src, dst: Path(dst).name == "latest"),
    "retention": (save_mod, "_apply_retention", lambda *args: True),
}
STAGES = tuple(KILL_POINTS)


def die_at(stage: str) -> None:
    """Make this process SIGKILL itself at ``stage`` of its next save (a forked child only:
    the patch is never undone)."""
    module, attr, when = KILL_POINTS[stage]
    real = getattr(module, attr)

    def wrapper(*args):
        if when(*args):
            os.kill(os.getpid(), signal.SIGKILL)
        return real(*args)

    setattr(module, attr, wrapper)


def on_disk_at(stage: str, root) -> bool:
    """Whether ``root`` (checkpoints/) is as a save of step 2 killed at ``stage`` leaves it,
    so each stage above kills where it says."""
    tmp = [p for p in root.iterdir() if p.name.startswith(".tmp-step-000002-")]
    has = {p.name for p in tmp[0].iterdir()} if len(tmp) == 1 else set()
    latest = (root / "latest").read_text().strip()
    pointers = [p.read_text().strip() for p in root.glob(".tmp-latest-*")]  # write_atomic's temporary
    pointer = pointers[0] if len(pointers) == 1 else None
    renamed = (root / "step-000002" / "manifest.json").is_file()
    return {
        "weights": "weights.safetensors" in has and "optimizer.pt" not in has,
        "optimizer": "optimizer.pt" in has and "scheduler.pt" not in has,
        "manifest": "manifest.json" in has and not renamed,
        "rename": not tmp and renamed and pointer is None and latest == "step-000001",
        "pointer": pointer == "step-000002" and latest == "step-000001",
        "retention": pointer is None and latest == "step-000002",
    }[stage]


@pytest.mark.parametrize("stage", STAGES)
def test_sigkill_during_save_leaves_a_loadable_checkpoint(tmp_path, stage):
    model, opt, sched, gen = saved_run(tmp_path)  # step 1 complete
    train(model, opt, sched, gen, 1)
    pid = os.fork()
    if pid == 0:  # child: save step 2 and die by SIGKILL at `stage`
        try:
            die_at(stage)
            save(tmp_path, 2, model, opt, sched, gen)
        finally:
            os._exit(3)  # the stage was never reached
    _, status = os.waitpid(pid, 0)
    assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL, status
    assert on_disk_at(stage, tmp_path / "checkpoints"), sorted(p.name for p in (tmp_path / "checkpoints").iterdir())

    found = find_latest(tmp_path)
    # `latest` is the commit point: before it moves, the previous checkpoint is the one
    committed = STAGES.index(stage) > STAGES.index("pointer")
    assert found == tmp_path / "checkpoints" / step_dir_name(2 if committed else 1)
    m2, o2, s2 = build(False, seed=1)
    assert load(found, m2, o2, s2, torch.Generator()).step == (2 if committed else 1)

    # the next save recovers: replaces a never-committed step-2, removes the .tmp-* left
    save(tmp_path, 2, model, opt, sched, gen)
    root = tmp_path / "checkpoints"
    assert find_latest(tmp_path) == root / "step-000002"
    assert not [p for p in root.iterdir() if p.name.startswith(".tmp-")]
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step-000001", "step-000002"]


# ----------------------------------------------------------------------------- retention


def test_retention_keeps_newest_and_cleans_stale_tmp(tmp_path):
    model, opt, sched = build(False)
    gen = torch.Generator().manual_seed(0)
    root = tmp_path / "checkpoints"
    root.mkdir()
    stale = root / ".tmp-step-000009-999999999-deadbeef"  # a dead process's interrupted save
    stale.mkdir()
    (stale / "weights.safetensors").write_bytes(b"half")
    old = time.time() - 3600
    os.utime(stale, (old, old))
    for step in range(1, 5):
        train(model, opt, sched, gen, 1)
        path = save(tmp_path, step, model, opt, sched, gen, keep_last=2)
        assert find_latest(tmp_path) == path
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step-000003", "step-000004"]
    verify(root / "step-000003")


def test_retention_never_deletes_the_newest_complete(tmp_path):
    model, opt, sched, gen = saved_run(tmp_path, steps=(10,))
    save(tmp_path, 3, model, opt, sched, gen, keep_last=1)  # e.g. a restarted run's first save
    root = tmp_path / "checkpoints"
    assert {p.name for p in root.iterdir()} == {"latest", "step-000003", "step-000010"}
    assert find_latest(tmp_path) == root / "step-000003"


# ----------------------------------------------------------------------------- non-finite


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_non_finite_weights_refuse_to_save(tmp_path, lora):
    model, opt, sched, gen = saved_run(tmp_path, lora=lora)
    bad = next(n for n, p in model.named_parameters() if p.requires_grad and (not lora or "lora_B" in n))
    with torch.no_grad():
        dict(model.named_parameters())[bad].view(-1)[0] = float("nan")
    name = bad.replace(".default", "") if lora else bad  # peft's saved keys drop the adapter name
    with pytest.raises(CheckpointError, match=r"non-finite.*" + name.split(".")[-2]):
        save(tmp_path, 2, model, opt, sched, gen)
    root = tmp_path / "checkpoints"
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step-000001"]
    m2, o2, s2 = build(lora, seed=1)
    assert load(find_latest(tmp_path), m2, o2, s2, torch.Generator()).step == 1


# ----------------------------------------------------------------------------- compatibility / resume


def _cfg(**over):
    from plainrl.config import Config

    c = Config.model_validate({"data": {"task": "arithmetic"}, "rewards": [{"fn": "m:f"}]}).model_dump(mode="json")
    for dotted, v in over.items():
        node = c
        *parents, last = dotted.split("__")
        for p in parents:
            node = node[p]
        node[last] = v
    return c


def test_resume_fields_exist_in_config():
    c = _cfg()
    for f in RESUME_FIELDS:
        assert resume_mod._get(c, f) is not resume_mod._UNSET, f
    assert set(FATAL_FIELDS) | set(WARN_FIELDS) == set(RESUME_FIELDS)


def test_check_compatible_messages():
    saved = _cfg()
    assert check_compatible(saved, _cfg()) == []
    # target_modules is a set to peft: another order is no change
    reordered = list(reversed(saved["model"]["lora"]["target_modules"]))
    assert check_compatible(saved, _cfg(model__lora__target_modules=reordered)) == []
    cur = _cfg(model__lora__r=8, seed=3, rollout__group_size=4, model__name="other")
    msgs = check_compatible(saved, cur)
    assert "model.lora.r: checkpoint has 16, this run has 8" in msgs
    assert "seed: checkpoint has 0, this run has 3" in msgs
    assert "rollout.group_size: checkpoint has 8, this run has 4" in msgs
    assert "model.name: checkpoint has 'smollm2-135m-instruct', this run has 'other'" in msgs
    assert len(msgs) == 4
    assert len(check_compatible(saved, cur, fields=FATAL_FIELDS)) == 2
    del cur["algorithm"]
    assert "algorithm.name: checkpoint has 'grpo', this run has <unset>" in check_compatible(saved, cur)


def test_resolve_resume(tmp_path):
    run = tmp_path / "run"
    assert resolve_resume(run, "auto") is None
    assert resolve_resume(run, "never") is None
    saved_run(run, steps=(1, 2))
    root = run / "checkpoints"
    assert resolve_resume(run, "auto") == root / "step-000002"
    assert read_config(root / "step-000002") == {"seed": 0, "model": {"name": "tiny"}}
    assert resolve_resume(tmp_path / "other", str(root / "step-000001")) == root / "step-000001"
    assert resolve_resume(tmp_path / "other", run) == root / "step-000002"
    with pytest.raises(CheckpointError, match="resume=never"):
        resolve_resume(run, "never")
    with pytest.raises(CheckpointError, match="no such"):
        resolve_resume(run, tmp_path / "missing")
