"""A distillation teacher on inference servers (``algorithm.teacher.remote``): the servers' answers
parsed on hand-written responses in vLLM's and SGLang's forms, a loopback server's scores equal to
the in-process teacher's, a dead or hung server failing within its timeouts, a server with another
tokenizer refused before any model loads, and a short run through it. The server here is
tests/served_stub.py answering ``prompt_logprobs`` from a real transformers forward; a real vLLM
server is tests/test_vllm_teacher.py's."""

from __future__ import annotations

import json
import time

import pytest
import torch

from conftest import REPO, free_port, tiny_overrides
from plainrl.config import ConfigError, load_config
from plainrl.rollout.engines.requests import EngineError
from plainrl.rollout.engines.scoring import (ServedScorer, parse_sglang_scores, parse_vllm_scores, request_batches,
                                             sglang_score_body, vllm_score_body)
from served_stub import StubServer

EXAMPLE = REPO / "examples" / "arithmetic_grpo.yaml"


# -- the wire forms, by hand ------------------------------------------------------------------------

def test_vllm_prompt_logprobs_parse_by_hand():
    seq = [5, 7, 9, 11]
    entries = [None,
               {"7": {"logprob": -0.1, "rank": 1, "decoded_token": "a"}, "3": {"logprob": -2.5, "rank": 2}},
               # the actual token is outside the top 2: three entries, ranked 1, 2 and 6
               {"4": {"logprob": -0.3, "rank": 1}, "9": {"logprob": -4.0, "rank": 6}, "8": {"logprob": -1.5, "rank": 2}},
               {"2": {"logprob": -0.2, "rank": 1}, "11": {"logprob": -1.9, "rank": 2}}]
    got = parse_vllm_scores({"prompt_logprobs": entries}, seq, 2, 2, "u")
    assert got.logprobs == [-4.0, -1.9]  # tokens 9 and 11, given their prefixes
    assert got.top_ids == [[4, 8], [2, 11]] and got.top_logps == [[-0.3, -1.5], [-0.2, -1.9]]
    assert parse_vllm_scores({"prompt_logprobs": entries}, seq, 1, 0, "u").top_ids == [[], [], []]
    with pytest.raises(EngineError, match="returned no prompt_logprobs"):
        parse_vllm_scores({"text": ""}, seq, 2, 0, "u")
    with pytest.raises(EngineError, match="no logprob of the token at position 3"):
        parse_vllm_scores({"prompt_logprobs": entries[:3] + [{"2": {"logprob": -0.2, "rank": 1}}]}, seq, 2, 0, "u")
    body = vllm_score_body([seq], model="m", topk=2)
    assert body["prompt"] == [seq] and body["prompt_logprobs"] == 2 and body["max_tokens"] == 1


def test_sglang_input_logprobs_parse_by_hand():
    seq = [5, 7, 9, 11]
    body = sglang_score_body([seq], [2], topk=1)
    assert body["logprob_start_len"] == [1] and body["input_ids"] == [seq] and body["top_logprobs_num"] == [1]
    # from logprob_start_len 1: positions 1..3, each [logprob, id, text]
    out = {"meta_info": {"input_token_logprobs": [[-0.5, 7, None], [-1.25, 9, None], [-0.75, 11, None]],
                         "input_top_logprobs": [[[-0.5, 7, None]], [[-0.2, 4, None]], [[-0.75, 11, None]]]}}
    got = parse_sglang_scores(out, seq, 2, 1, "u")
    assert got.logprobs == [-1.25, -0.75] and got.top_ids == [[4], [11]] and got.top_logps == [[-0.2], [-0.75]]
    with pytest.raises(EngineError, match="not the sequence's"):
        parse_sglang_scores(out, [5, 7, 8, 11], 2, 0, "u")
    with pytest.raises(EngineError, match="returned 0 input token logprobs"):
        parse_sglang_scores({"meta_info": {}}, seq, 2, 0, "u")


def test_requests_are_batched_by_tokens_and_count():
    seqs = [[0] * 5, [0] * 5, [0] * 20, [0] * 1, [0] * 1, [0] * 1]
    assert request_batches(seqs, tokens=10, size=2) == [[0, 1], [2], [3, 4], [5]]


# -- a loopback server ---------------------------------------------------------------------------

def _vllm_prompt_logprobs(model):
    """vLLM's ``prompt_logprobs`` of one prompt from a transformers forward (float32): at each
    position after the first, the actual token and the top ``k``, each with its logprob and rank."""
    def score(ids: list[int], k: int) -> list:
        with torch.no_grad():
            logp = torch.log_softmax(model(torch.tensor([ids])).logits[0, :-1].float(), -1)  # [P-1, V]
        out: list = [None]
        for pos, row in enumerate(logp, start=1):
            tok = ids[pos]
            entry = {str(tok): {"logprob": float(row[tok]), "rank": int((row > row[tok]).sum()) + 1}}
            top = row.topk(k) if k else None
            for r, (v, i) in enumerate(zip(top.values, top.indices) if k else [], start=1):
                entry[str(int(i))] = {"logprob": float(v), "rank": r}
            out.append(entry)
        return out
    return score


@pytest.fixture()
def teacher_server(tiny_model_dir, tokenizer):
    from transformers import AutoModelForCausalLM

    stub = StubServer(0, tokenizer)
    stub.prompt_scorer = _vllm_prompt_logprobs(AutoModelForCausalLM.from_pretrained(tiny_model_dir,
                                                                                    dtype=torch.float32).eval())
    yield stub
    stub.stop()


def _episodes(tokenizer, n=5):
    from plainrl.types import Episode

    g = torch.Generator().manual_seed(0)
    eps = []
    for i in range(n):
        prompt = tokenizer(f"What is {i} + {i}?")["input_ids"]
        comp = torch.randint(0, len(tokenizer), (4 + i,), generator=g).tolist()
        mask = [1] * len(comp)
        mask[1] = 0  # an observation token: not scored
        eps.append(Episode(sample_id=str(i), group=i, row={"prompt": "x"}, prompt_ids=prompt, completion_ids=comp,
                           logprobs=[-1.0] * len(comp), loss_mask=mask, finish_reason="stop"))
    return eps


def test_remote_teacher_scores_equal_the_in_process_teacher(teacher_server, tiny_model_dir, tokenizer, monkeypatch):
    from plainrl.config import AlgorithmConfig, ModelConfig, TrainConfig
    from plainrl.models import load_policy
    from plainrl.rollout.engines import scoring
    from plainrl.train import Learner
    from plainrl.train.distributed import Parallel
    from plainrl.train.teacher import RemoteTeacher, make_teacher

    model = load_policy(ModelConfig(name=str(tiny_model_dir), dtype="float32", lora={"enabled": False}),
                        torch.device("cpu"))
    learner = Learner(model, AlgorithmConfig(), TrainConfig(micro_batch_tokens=32), pad_id=0, temperature=1.0,
                      completion_budget=16, copy_reference=True)
    eps = _episodes(tokenizer)
    monkeypatch.setattr(scoring, "REQUEST_SEQUENCES", 2)  # several requests, in flight together
    scorer = ServedScorer([teacher_server.url], tokenizer, timeout_s=30, connect_timeout_s=5)
    remote = RemoteTeacher(scorer, Parallel(), topk=4).score(eps)
    here = make_teacher(learner, model, "reference", topk=4).score(eps)
    assert remote.logprobs.shape == here.logprobs.shape
    assert torch.allclose(remote.logprobs, here.logprobs, atol=1e-5)
    assert (remote.logprobs[:, 1] == 0).all() and (remote.logprobs[:, 0] < 0).all()  # off the mask 0, on it scored
    assert torch.equal(remote.topk[0], here.topk[0])
    assert torch.allclose(remote.topk[1], here.topk[1], atol=1e-5)
    assert teacher_server.calls("/v1/completions") >= 3 + 1  # three batches and the start-up probe
    scorer.close()


def test_a_server_without_prompt_logprobs_is_refused_at_start(tokenizer):
    stub = StubServer(0, tokenizer)  # answers completions, but without prompt_logprobs
    try:
        with pytest.raises(EngineError, match="returned no prompt_logprobs"):
            ServedScorer([stub.url], tokenizer, timeout_s=5, connect_timeout_s=2)
    finally:
        stub.stop()


def test_a_vllm_server_with_lora_is_refused_before_any_scoring(tokenizer):
    stub = StubServer(0, tokenizer)
    stub.server_info = {"vllm_config": {"lora_config": {"max_lora_rank": 16}}}
    try:
        with pytest.raises(EngineError, match="runs with LoRA enabled.*vllm#16668.*model.lora.enabled=false"):
            ServedScorer([stub.url], tokenizer, timeout_s=5, connect_timeout_s=2)
        assert stub.calls("/v1/completions") == 0  # no scoring request reached it
    finally:
        stub.stop()


def test_a_dead_or_hung_server_fails_within_its_timeouts(teacher_server, tokenizer):
    from plainrl.train.distributed import Parallel
    from plainrl.train.teacher import RemoteTeacher

    eps = _episodes(tokenizer, n=2)
    teacher = RemoteTeacher(ServedScorer([teacher_server.url], tokenizer, timeout_s=1.5, connect_timeout_s=1),
                            Parallel())
    teacher_server.faults.hang.set()
    t0 = time.monotonic()
    with pytest.raises(EngineError, match="no inference server left.*ReadTimeout"):
        teacher.score(eps)
    assert time.monotonic() - t0 < 10
    teacher.close()

    t0 = time.monotonic()  # nothing listening: refused at the start-up check
    with pytest.raises(EngineError, match="is it running"):
        ServedScorer([f"http://127.0.0.1:{free_port()}"], tokenizer, timeout_s=600, connect_timeout_s=1)
    assert time.monotonic() - t0 < 10


# -- before any model loads ----------------------------------------------------------------------

def _remote_cfg(tiny_model_dir, tmp_path, url, *extra):
    return load_config(EXAMPLE, tiny_overrides(tiny_model_dir, tmp_path / "r") + [
        "algorithm.name=opd", f"algorithm.teacher={{remote: {{urls: [{url}], timeout_s: 30}}}}", "rewards=[]",
        "rollout.temperature=1",  # the example samples at 0.7; servers score at 1
        *extra])


def test_remote_teacher_with_another_tokenizer_is_refused_before_loading(tiny_model_dir, tmp_path, tokenizer,
                                                                          monkeypatch):
    from transformers import AutoTokenizer

    import plainrl.run.setup as run_setup

    other = AutoTokenizer.from_pretrained(tiny_model_dir)
    other.add_tokens(["world"])  # the probe text's "world" is one new token there
    stub = StubServer(0, other)
    loaded = []
    monkeypatch.setattr(run_setup, "load_policy", lambda *a, **k: loaded.append(1))
    try:
        cfg = _remote_cfg(tiny_model_dir, tmp_path, stub.url)
        with pytest.raises(ConfigError, match=f"algorithm.teacher.remote cannot score for model.name='{tiny_model_dir}'"
                                              r".*serves 'stub-model', whose tokenizer differs"):
            run_setup.setup(cfg)
    finally:
        stub.stop()
    assert not loaded


def test_remote_teacher_needs_temperature_one_and_one_kind_of_teacher(tiny_model_dir, tmp_path):
    import plainrl.run.setup as run_setup

    cfg = _remote_cfg(tiny_model_dir, tmp_path, f"http://127.0.0.1:{free_port()}", "rollout.temperature=0.7")
    with pytest.raises(ConfigError, match="rollout.temperature=0.7"):
        run_setup.setup(cfg)
    with pytest.raises(ConfigError, match="give name .* or remote"):
        load_config(EXAMPLE, tiny_overrides(tiny_model_dir, tmp_path / "r") + [
            "algorithm.name=opd", "algorithm.teacher={name: x, remote: {urls: [http://h]}}", "rewards=[]"])
    with pytest.raises(ConfigError, match="adapter applies to a teacher loaded here"):
        load_config(EXAMPLE, tiny_overrides(tiny_model_dir, tmp_path / "r") + [
            "algorithm.name=opd", "algorithm.teacher={adapter: a, remote: {urls: [http://h]}}", "rewards=[]"])


# -- a run -------------------------------------------------------------------------------------------

def test_a_run_with_the_student_served_as_teacher_starts_at_zero_reverse_kl(teacher_server, tiny_model_dir,
                                                                            tmp_path):
    """The served teacher is the student's own model, so step 0's reverse KL is 0 (float32), as with
    ``teacher: self``; every step's teacher time is logged."""
    from plainrl.run.loop import train

    cfg = _remote_cfg(tiny_model_dir, tmp_path, teacher_server.url, "train.steps=1", "log.rollouts_per_step=4",
                      "eval.before=false", "eval.after=false")
    run_dir = train(cfg)
    row = next(json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()
               if "distill/reverse_kl" in x)
    assert abs(row["distill/reverse_kl"]) < 1e-4 and row["distill/teacher_logprob"] < 0 and "time/teacher" in row
    assert teacher_server.calls("/v1/completions") >= 2  # the start-up probes and the step's scoring


def test_under_torchrun_each_rank_scores_its_share(teacher_server, tiny_model_dir, tmp_path, tokenizer):
    """A 2-rank run (gloo) with the remote teacher: every sample of the step is sent once, by one
    rank (the probes of each rank's start-up checks aside), and both ranks' scores add up to the
    whole batch (step 0's reverse KL 0, the served teacher being the student's model)."""
    from plainrl.rollout.engines.served import TOKENIZER_PROBE
    from test_distributed import torchrun

    run = tmp_path / "run"
    torchrun("-m", "plainrl", "train", str(EXAMPLE), *tiny_overrides(tiny_model_dir, run), "algorithm.name=opd",
             f"algorithm.teacher={{remote: {{urls: [{teacher_server.url}], timeout_s: 60}}}}", "rewards=[]",
             "rollout.temperature=1", "train.steps=1", "rollout.prompts_per_step=4", "eval.before=false",
             "eval.after=false", "log.tensorboard=false", "train.collective_timeout_s=120")
    probe = tokenizer(TOKENIZER_PROBE, add_special_tokens=False)["input_ids"][:8]
    sent = [p for _, path, body in teacher_server.requests if path == "/v1/completions" for p in body["prompt"]]
    scored = [p for p in sent if p != probe]
    assert len(sent) - len(scored) == 4  # each rank's check before loading and its teacher's start
    assert len(scored) == 4 * 2  # prompts_per_step x group_size, not twice that
    row = next(json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines() if "distill/reverse_kl" in x)
    assert abs(row["distill/reverse_kl"]) < 1e-4
