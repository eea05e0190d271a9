"""Data-parallel training under real ``torchrun`` with the gloo backend, 2 processes on CPU:
the DDP and FSDP2 updates equal the one-process update on the same episodes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]


def torchrun(*args: str, nproc: int = 2, timeout: float = 600, env: dict | None = None,
             check: bool = True) -> subprocess.CompletedProcess:
    """``python -m torch.distributed.run --standalone --nproc-per-node NPROC ARGS`` with this
    checkout on PYTHONPATH and one thread per rank."""
    full_env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", **(env or {})}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}", *args]
    proc = subprocess.run(cmd, cwd=REPO, env=full_env, capture_output=True, text=True, timeout=timeout)
    if check and proc.returncode != 0:
        raise AssertionError(f"torchrun exited {proc.returncode}:\n{proc.stdout[-4000:]}\n{proc.stderr[-8000:]}")
    return proc


def test_two_rank_ddp_and_fsdp2_update_equals_one_process(two_rank_updates):
    """The heart of data parallelism: on the same rows, the loss, its statistics and the
    updated weights of 2 ranks (DDP, FSDP2) are the one-process update's, to float32
    rounding (Adam's first steps amplify gradient rounding a little: 2e-5 on updates of ~1e-2).
    Policy learner (LoRA; full fine-tuning), PPO's critic, DPO and SFT (tests/dist_update.py)."""
    assert_updates_equal(two_rank_updates, ("lora", "full", "critic", "dpo", "sft"))


def assert_updates_equal(results: dict, cases, strategies=("ddp", "fsdp2")) -> None:
    """tests/dist_update.py's results: each strategy's update is the one-process update of its case."""
    for case in cases:
        single = results[(case, "single")]
        moved = max(float((single["weights"][n] - single["initial"][n]).abs().max()) for n in single["weights"])
        assert moved > 1e-3, f"{case}: the update must change the weights for the comparison to mean anything"
        for strategy in strategies:
            got = results[(case, strategy)]
            for key, value in single["stats"].items():
                if key in ("micro_batches", "optimizer_steps", "skipped") or not isinstance(value, (int, float)):
                    continue  # micro-batches are packed per rank
                # a clip fraction counts tokens at a threshold: rounding may move one across it (1/188 here)
                tol = 0.01 if key.endswith("clip_frac") else 1e-6
                assert got["stats"][key] == pytest.approx(value, rel=1e-5, abs=tol), (case, strategy, key)
            assert set(got["weights"]) == set(single["weights"])
            for name, w in single["weights"].items():
                torch.testing.assert_close(got["weights"][name], w, rtol=1e-4, atol=2e-5,
                                           msg=lambda m: f"{case}/{strategy} {name}: {m}")


@pytest.fixture(scope="module")
def mid_model_dir(tmp_path_factory) -> Path:
    """A random 40M-parameter Llama (160 MB in float32, no tensor above 4 MB), large enough
    for its load to stand out of a rank's resident memory."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=2048, hidden_size=512, intermediate_size=1536, num_hidden_layers=12,
                      num_attention_heads=8, num_key_value_heads=4, tie_word_embeddings=False)
    d = tmp_path_factory.mktemp("mid-llama")
    LlamaForCausalLM(cfg).save_pretrained(d)
    return d


@pytest.fixture(scope="module")
def meta_memory(mid_model_dir, tiny_model_dir, tmp_path_factory) -> Path:
    """One 2-rank launch of tests/dist_meta_memory.py for the two tests below: the memory of loading
    ``mid_model_dir``, then the mismatched build of ``tiny_model_dir``; returns its OUT path."""
    out = tmp_path_factory.mktemp("meta") / "memory.pt"
    torchrun(str(REPO / "tests" / "dist_meta_memory.py"), str(mid_model_dir), str(out), str(tiny_model_dir),
             timeout=300)
    return out


def test_fsdp2_ranks_other_than_0_never_hold_the_full_weights(meta_memory):
    """Meta-device initialisation: rank 1 builds the model on the meta device and allocates only
    its float32 shards (half the model), so its peak resident memory over loading and sharding
    stays well under the full model's size; rank 0, which reads the weights, holds them all
    (the control that the measurement sees a full load)."""
    out = meta_memory
    main, other = torch.load(out, weights_only=False)
    full = main["full_bytes"]
    assert full > 150e6 and not main["built_on_meta"] and other["built_on_meta"]
    assert main["peak_bytes"] > 0.9 * full, main
    assert other["peak_bytes"] < 0.8 * full, other  # its shards: 0.5 (measured 0.61); a full load: over 1


def test_fsdp2_stops_every_rank_when_one_built_another_model(meta_memory):
    """Rank 1 builds its meta model in bfloat16, rank 0 loads float32: both raise before any shard is
    filled (none is left waiting in a collective: the launch, which ends with this, exits 0), rank 1
    naming the first differing tensor."""
    out = meta_memory
    main, other = (Path(f"{out}.rank{r}").read_text() for r in (0, 1))
    assert "a rank built another model than rank 0, see its error" in main
    assert "torch.bfloat16) here" in other and "torch.float32) on rank 0" in other


def test_four_rank_hsdp_update_equals_one_process(tiny_model_dir, tmp_path):
    """HSDP (train.fsdp_size=2 on 4 ranks: a 2x2 mesh, shards within pairs, replicas across them)
    gives the one-process update, for the LoRA and the full fine-tuning policy cases."""
    out = tmp_path / "updates.pt"
    torchrun(str(REPO / "tests" / "dist_update.py"), str(tiny_model_dir), str(out), nproc=4, timeout=900,
             env={"DIST_STRATEGIES": "hsdp", "DIST_CASES": "lora,full"})
    results = torch.load(out, weights_only=False)
    for case in ("lora", "full"):
        single, got = results[(case, "single")], results[(case, "hsdp")]
        for key in ("loss", "kl", "grad_norm"):
            assert got["stats"][key] == pytest.approx(single["stats"][key], rel=1e-5, abs=1e-6), (case, key)
        moved = max(float((single["weights"][n] - single["initial"][n]).abs().max()) for n in single["weights"])
        assert moved > 1e-3, f"{case}: the update must change the weights for the comparison to mean anything"
        assert set(got["weights"]) == set(single["weights"])
        for name, w in single["weights"].items():
            torch.testing.assert_close(got["weights"][name], w, rtol=1e-4, atol=2e-5,
                                       msg=lambda m: f"{case}/hsdp {name}: {m}")


def test_two_rank_ddp_with_optimizer_offload_equals_one_process(two_rank_updates):
    """train.offload=optimizer under DDP (the all-reduced gradients copied to host buffers, a
    fused CPU AdamW step on host masters, the weights copied back on each rank) gives the
    one-process update without offload: full fine-tuning with clipping, two PPO epochs."""
    results = two_rank_updates
    single, got = results[("full", "single")], results[("full", "ddp-offload")]
    assert got["offload"] and not single["offload"]
    for key in ("loss", "kl", "grad_norm"):
        assert got["stats"][key] == pytest.approx(single["stats"][key], rel=1e-5, abs=1e-6), key
    moved = max(float((single["weights"][n] - single["initial"][n]).abs().max()) for n in single["weights"])
    assert moved > 1e-3, "the update must change the weights for the comparison to mean anything"
    assert set(got["weights"]) == set(single["weights"])
    for name, w in single["weights"].items():
        torch.testing.assert_close(got["weights"][name], w, rtol=1e-4, atol=2e-5, msg=lambda m: f"{name}: {m}")


def test_hsdp_size_must_divide_the_world_and_offload_needs_fsdp2_on_cuda():
    from plainrl.config import ConfigError, load_config
    from plainrl.run.distributed import check_launch

    base = [f"data.path={REPO / 'tests' / 'data' / 'sft_mini.jsonl'}", "algorithm.name=sft"]
    with pytest.raises(ConfigError, match="train.fsdp_size=3 must divide the 4 ranks"):
        check_launch(load_config(None, [*base, "train.strategy=fsdp2", "train.fsdp_size=3", "train.batch_size=4"]), 4)
    with pytest.raises(ConfigError, match="train.strategy=fsdp2"):
        load_config(None, [*base, "train.strategy=ddp", "train.offload=params"])


def _rows(run_dir: Path) -> list[dict]:
    import json

    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_fsdp2_run_samples_with_replicas_filled_from_rank_0(tiny_model_dir, tmp_path):
    """A 2-rank FSDP2 run, full fine-tuning with a KL (the reference sharded too), embedded engine:
    rank 1 built its model on the meta device, so its engine's replica starts empty and is filled
    by the first sync (weights and the rotary buffers); both ranks' episodes are in the batch, and
    the learner's logprobs of their sampled tokens are the engines' (garbage in rank 1's replica
    would show here), before and after the first update."""
    from conftest import tiny_overrides

    run = tmp_path / "run"
    torchrun("-m", "plainrl", "train", str(REPO / "examples" / "arithmetic_grpo.yaml"),
             *tiny_overrides(tiny_model_dir, run), "train.strategy=fsdp2", "model.lora.enabled=false",
             "algorithm.kl_coef=0.05", "train.lr=1e-3", "eval.before=false", "eval.after=false",
             "log.tensorboard=false", "train.collective_timeout_s=120",
             f"rewards=[{{fn: {REPO / 'tests' / 'data' / 'gate_reward.py'}:length_bonus}}]")
    steps = [r for r in _rows(run) if "loss" in r]
    assert len(steps) == 2
    for r in steps:
        assert r["rollout/logprob_diff"] < 1e-4, r
    assert steps[1]["kl"] > 0  # the policy moved away from the reference


def test_sigkilled_rank_ends_the_job_and_rerun_resumes(tiny_model_dir, tmp_path):
    """A 2-rank FSDP2 run of examples/arithmetic_grpo.yaml (tiny model): SIGKILL of rank 1,
    once a step past the last checkpoint is logged (tests/data/gate_reward.py holds the run
    there, inside the next step's reward call), ends the whole job non-zero within 60 s;
    the same command then resumes from the last checkpoint and finishes, every step logged
    once, the adapter trained, and the step redone after the resume equals the one the killed
    run logged (exact resume at the same world size: weights, optimizer, RNGs, data position).
    4 steps: the checkpoint after 2, step 2 logged, step 3 held; the rerun redoes 2 and does 3."""
    import signal
    import time

    import psutil
    from safetensors.torch import load_file

    from conftest import tiny_overrides

    run = tmp_path / "run"
    # the collective timeout is not what ends the job (gloo fails the survivor's next collective at
    # once and torchrun stops it); it only has to outlast a slow start on a loaded machine
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", "-m", "plainrl",
           "train", str(REPO / "examples" / "arithmetic_grpo.yaml"),
           *tiny_overrides(tiny_model_dir, run), "train.steps=4", "checkpoint.every=2", "train.strategy=fsdp2",
           "train.collective_timeout_s=120", "data.eval_size=2", "train.lr=1e-2", "log.tensorboard=false",
           # the random tiny model never answers right: a reward that varies (text length) gives it a gradient
           f"rewards=[{{fn: {REPO / 'tests' / 'data' / 'gate_reward.py'}:length_bonus}}]"]
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    log = open(tmp_path / "job.log", "w")
    # torchrun stops rank 0 (held in the gate, where its SIGTERM handler waits for a step boundary that
    # never comes) with SIGTERM, then SIGKILL after its grace: 2 s, not the default 30 (the variable is
    # torchrun's documented twin of --shutdown-timeout; a torch without it ignores it: slower only)
    job = subprocess.Popen(cmd, cwd=REPO, stdout=log, stderr=subprocess.STDOUT, text=True,
                           env={**env, "PLAINRL_TEST_GATE": str(run), "TORCH_ELASTIC_SHUTDOWN_TIMEOUT": "2"})
    latest = run / "checkpoints" / "latest"
    try:
        deadline = time.monotonic() + 600
        while not (tmp_path / "gated").exists():  # a step past the checkpoint logged, the next one held
            assert job.poll() is None, (tmp_path / "job.log").read_text()[-4000:]
            assert time.monotonic() < deadline, "no step past a checkpoint in 600 s"
            time.sleep(0.05)
        # torchrun's workers are its own children (their reward workers, forked, inherit RANK too)
        ranks = {int(p.environ()["RANK"]): p for p in psutil.Process(job.pid).children() if "RANK" in p.environ()}
        ranks[1].send_signal(signal.SIGKILL)
        killed = time.monotonic()
        code = job.wait(timeout=90)
        assert time.monotonic() - killed < 60
        assert code != 0, (tmp_path / "job.log").read_text()[-4000:]
        assert not (run / "final").exists()
    finally:
        if job.poll() is None:
            job.kill()
        log.close()
    before = {r["step"]: r for r in _rows(run) if "loss" in r}
    resume_at = int(latest.read_text().strip().split("-")[1])
    assert max(before) < 3  # it stopped early
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    assert "resumed from" in proc.stderr + proc.stdout
    after = {r["step"]: r for r in _rows(run) if "loss" in r}
    assert sorted(after) == list(range(4))  # each step once: the rows after the checkpoint were dropped
    # the killed run logged the step after its last checkpoint and no more (the gate held the next one)
    assert max(before) == resume_at
    for key in ("loss", "reward/mean", "grad_norm", "response_length/mean", "tokens/completion"):
        assert after[resume_at][key] == pytest.approx(before[resume_at][key], rel=1e-6), key
    adapter = load_file(run / "final" / "adapter_model.safetensors")
    assert any(t.abs().max() > 0 for n, t in adapter.items() if "lora_B" in n)  # B starts at 0: it trained


TORCHRUN_ENV = {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2",
                "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29999"}


def _config(*over: str):
    from plainrl.config import load_config

    return load_config(REPO / "examples" / "arithmetic_grpo.yaml", list(over))


def test_two_ranks_train_every_segment_of_agent_episodes(tiny_model_dir, tmp_path):
    """Each rank runs its share of the agent episodes (two segments each, tests/data/segment_agent.py);
    gathered with their earlier segments, every rank trains the same samples: the job finishes (the
    ranks agree on the batch), both segments of every episode of both ranks are trained, and the
    learner's logprobs of their sampled tokens are the engines'."""
    from conftest import tiny_overrides

    run = tmp_path / "run"
    torchrun("-m", "plainrl", "train", str(REPO / "examples" / "agent_calculator.yaml"),
             *tiny_overrides(tiny_model_dir, run), "train.steps=1", "train.strategy=ddp", "rewards=[]",
             f"rollout.agent={REPO / 'tests' / 'data' / 'segment_agent.py'}:agent", "rollout.max_total_tokens=24",
             "eval.before=false", "eval.after=false", "log.tensorboard=false", "log.rollouts_per_step=4",
             "train.collective_timeout_s=120")
    (step,) = [r for r in _rows(run) if "loss" in r]
    assert step["rollout/segments_per_episode"] == 2.0 and step["rollout/agent_failures"] == 0.0
    assert step["rollout/logprob_diff"] < 1e-4
    logged = [json.loads(line) for line in (run / "rollouts.jsonl").read_text().splitlines()]
    assert {rec["group"] for rec in logged} == {0, 1}  # both ranks' groups, renumbered over the batch
    assert all(len(rec["earlier_segments"]) == 1 and rec["earlier_segments"][0]["advantage"] is not None
               for rec in logged)


def test_bad_launches_stop_before_any_model_loads(monkeypatch):
    """join() refuses, naming the fix, before the process group or a model: a missing torchrun
    variable, prompt groups the ranks cannot split, an offline batch they cannot split, vLLM in process."""
    from plainrl.config import ConfigError
    from plainrl.run import distributed

    monkeypatch.setattr(distributed.dist, "init_process_group",
                        lambda *a, **k: pytest.fail("the process group must not start"))
    for k, v in TORCHRUN_ENV.items():
        monkeypatch.setenv(k, v)
    monkeypatch.delenv("MASTER_PORT")
    with pytest.raises(ConfigError, match="MASTER_PORT missing.*torchrun --nproc-per-node"):
        distributed.join(_config())
    monkeypatch.setenv("MASTER_PORT", "29999")
    assert distributed.launch_env({"LOCAL_WORLD_SIZE": "1"}) is None  # vLLM on CPU sets it in its own process
    with pytest.raises(ConfigError, match=r"prompts_per_step=3 prompt groups cannot be split evenly over 2 ranks.*"
                                          r"multiple of 2"):
        distributed.join(_config("rollout.prompts_per_step=3"))
    with pytest.raises(ConfigError, match="rollout.engine=remote"):
        distributed.join(_config("rollout.engine=vllm"))
    from plainrl.config import load_config

    sft = load_config(REPO / "examples" / "sft_chat.yaml", ["data.path=x.jsonl", "train.batch_size=3"])
    with pytest.raises(ConfigError, match="train.batch_size=3 rows cannot be split evenly over 2 ranks"):
        distributed.join(sft)


def test_fsdp2_with_a_quantized_base_or_unpacked_shared_prompts_fails_at_load():
    from plainrl.config import ConfigError

    with pytest.raises(ConfigError, match="cannot shard a nf4-quantized base.*train.strategy=ddp"):
        _config("train.strategy=fsdp2", "model.quantization=nf4")
    with pytest.raises(ConfigError, match="train.packing=true"):
        _config("train.strategy=fsdp2", "train.packing=false")
    assert _config("train.strategy=fsdp2", "train.packing=false", "train.share_prompts=false")


def test_one_process_is_unchanged_without_torchrun(monkeypatch):
    from plainrl.run import distributed
    from plainrl.train.distributed import ModelCall, Parallel

    for k in TORCHRUN_ENV:
        monkeypatch.delenv(k, raising=False)
    parallel = distributed.join(_config())
    assert parallel == Parallel() and not parallel.active
    model = torch.nn.Linear(2, 2)
    call = parallel.wrap(model)
    assert type(call) is ModelCall and call.model is model  # no DDP, no FSDP
    assert parallel.sum([1.5, 2.0]) == [1.5, 2.0] and parallel.shard(8) == range(8) and parallel.even_out(3) == 0


def test_shards_and_group_split():
    from plainrl.run.distributed import local_rows
    from plainrl.train.distributed import Parallel

    shards = [Parallel(active=True, rank=r, world_size=3).shard(8) for r in range(3)]
    assert shards == [range(0, 3), range(3, 6), range(6, 8)]
    ranks = [Parallel(active=True, rank=r, world_size=2) for r in range(2)]
    assert [local_rows(p, list("abcd")) for p in ranks] == [["a", "b"], ["c", "d"]]
    # the ranks' shares of a (mini-)batch balance real tokens, not rows: episode 0 costs 10 tokens, the
    # others 2 (a 1-token prompt each); by rows rank 0 would get 16 tokens, rank 1 8
    from plainrl.types import Episode

    eps = [Episode(sample_id=str(i), group=i, row={}, prompt_ids=[i], completion_ids=[7] * (9 if i == 0 else 1),
                   logprobs=[], loss_mask=[], finish_reason="eos") for i in range(8)]
    shares = [p.share(eps, torch.arange(8), share_prompts=True).tolist() for p in ranks]
    assert shares == [[0, 1], [2, 3, 4, 5, 6, 7]]  # 12 and 12 tokens
    idx = torch.tensor([5, 0, 7, 2])  # a mini-batch: 2, 10, 2, 2 tokens
    assert [p.share(eps, idx, share_prompts=True).tolist() for p in ranks] == [[5, 0], [7, 2]]
    assert Parallel().share(eps, idx, share_prompts=True) is idx  # one process: as given


def test_meta_build_matches_the_loaded_model(tiny_model_dir, tmp_path):
    """What a rank other than 0 builds under FSDP2 (``meta=True``): the loaded model's parameter and
    buffer names, shapes, dtypes and requires_grad (``Parallel.wrap`` checks the same across ranks),
    every tensor on the meta device; for a LoRA policy, one started from a saved adapter with its
    frozen reference copy, a full policy in bfloat16, and a value model with its float32 head."""
    from plainrl.config import ModelConfig
    from plainrl.models import load_policy, load_value_model, save_policy

    def layout(m):
        return {n: (tuple(t.shape), t.dtype, t.requires_grad) for n, t in [*m.named_parameters(), *m.named_buffers()]}

    lora = ModelConfig(name=str(tiny_model_dir), dtype="float32", lora={"enabled": True, "r": 4})
    adapter = tmp_path / "adapter"
    save_policy(load_policy(lora, torch.device("cpu")), _tokenizer(tiny_model_dir), adapter)
    cases = [(lambda **kw: load_policy(lora, torch.device("cpu"), **kw)),
             (lambda **kw: load_policy(lora.model_copy(update={"adapter": str(adapter)}), torch.device("cpu"),
                                       reference_adapter=True, **kw)),
             (lambda **kw: load_policy(ModelConfig(name=str(tiny_model_dir), dtype="bfloat16",
                                                   lora={"enabled": False}), torch.device("cpu"), **kw)),
             (lambda **kw: load_value_model(lora, torch.device("cpu"), per_token=True, **kw))]
    for load in cases:
        real, meta = load(), load(meta=True)
        assert layout(meta) == layout(real)
        assert all(t.is_meta for t in [*meta.parameters(), *meta.buffers()])


def _tokenizer(model_dir: Path):
    from plainrl.models import load_tokenizer

    return load_tokenizer(str(model_dir))
