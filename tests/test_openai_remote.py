"""rollout.remote.backend=openai against a real OpenAI-compatible server: the vLLM server
`plainrl serve` starts (its /v1/completions is OpenAI's API), run here with an API key
(vLLM's --api-key) so the key path is exercised: greedy text as the embedded engine's, the
server's logprobs kept where they line up with the re-tokenised ids, the refusals (no key,
an unknown model, a weight push), and `plainrl eval` through it. One server for the module.
Runs under `make test-vllm`; skipped where vLLM is not installed."""

from __future__ import annotations

import json
import math
import pytest
import torch

pytest.importorskip("vllm", reason="vLLM is not installed in this venv; `make test-vllm` runs these tests")

from conftest import (  # noqa: E402
    READ_ONLY_SERVER, REPO, SERVED_API_KEY, chat_prompt_ids, greedy_against_embedded, learner_logps,
)

from plainrl.cli import main  # noqa: E402
from plainrl.config import ModelConfig  # noqa: E402
from plainrl.models import load_policy, load_tokenizer  # noqa: E402
from plainrl.rollout.engines.openai_compat import OpenAICompatEngine  # noqa: E402
from plainrl.rollout.engines.requests import EngineError  # noqa: E402
from plainrl.types import SamplingParams  # noqa: E402

pytestmark = pytest.mark.vllm
MODEL = "smollm2-135m-instruct"
KEY_ENV, KEY = "PLAINRL_TEST_OPENAI_KEY", SERVED_API_KEY
LOGPROB_TOL = 2e-3


@pytest.fixture()
def server(serve_pool):
    """The session's read-only `plainrl serve` of the demo config in float32 (tests/conftest.py),
    answering /v1 only with the API key (its /health, which the pool waits on, is outside vLLM's
    key check)."""
    [(_, url)] = serve_pool.get(*READ_ONLY_SERVER)
    return url


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer(MODEL)


def test_greedy_text_as_the_embedded_engine_with_the_servers_logprobs(server, tok):
    policy = load_policy(ModelConfig(name=MODEL, dtype="float32", lora={"enabled": False}), torch.device("cpu"))
    engine = OpenAICompatEngine([server], tok, api_key=KEY, max_model_len=512)
    try:
        assert engine.models == [MODEL]  # the only model served: no rollout.remote.model needed
        prompts = [chat_prompt_ids(tok, "What is 12 + 7?"), chat_prompt_ids(tok, "Name three colours.")]
        theirs, ours = greedy_against_embedded(engine, policy, tok, prompts)
        for prompt, o, t in zip(prompts, ours, theirs):
            assert tok.decode(t.token_ids, skip_special_tokens=True) == tok.decode(o.token_ids, skip_special_tokens=True)
            # the server's tokens spell its text in the trainer's pieces: its logprobs are kept,
            # and they are the policy's (greedy: log softmax(z))
            assert not any(math.isnan(x) for x in t.logprobs)
            diff = (learner_logps(policy, prompt, t.token_ids) - torch.tensor(t.logprobs)).abs().mean()
            assert diff < LOGPROB_TOL
        # unseeded, a group is one request with n samples: n completions come back
        sampled = engine.generate([prompts[0]] * 3, SamplingParams(max_new_tokens=8, temperature=1.0))
        assert len(sampled) == 3 and all(0 < len(g.token_ids) <= 9 for g in sampled)
        # seeded, a request per sample with its seed: the same seed, the same text, wherever it is in the call
        params = SamplingParams(max_new_tokens=8, temperature=1.0)
        a = engine.generate([prompts[0]] * 3, params, seeds=[5, 6, 7])
        b = engine.generate([prompts[1], prompts[0]], params, seeds=[6, 7])
        assert b[1].token_ids == a[2].token_ids
        with pytest.raises(EngineError, match="read-only"):
            engine.load_weights(policy)
    finally:
        engine.close()


def test_a_missing_key_or_an_unknown_model_is_refused(server, tok):
    with pytest.raises(EngineError, match="401"):
        OpenAICompatEngine([server], tok, max_model_len=512)
    with pytest.raises(EngineError, match="does not serve rollout.remote.model='gpt-nope'"):
        OpenAICompatEngine([server], tok, api_key=KEY, model="gpt-nope", max_model_len=512)


def test_plainrl_eval_through_the_server(server, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv(KEY_ENV, KEY)
    common = [str(REPO / "examples" / "arithmetic_grpo.yaml"), "model.dtype=float32", "model.max_context=512",
              "data.eval_size=4", "eval.max_new_tokens=32", "rollout.batch_size=4"]
    assert main(["eval", *common, "rollout.engine=remote", f"rollout.remote.urls=[{server}]",
                 "rollout.remote.backend=openai", f"rollout.remote.api_key_env={KEY_ENV}", "eval.k=2"]) == 0
    served = json.loads(capsys.readouterr().out)
    assert served["model"] == f"{MODEL} at {server}" and served["eval/n"] == 4 and "eval/mean@2" in served
    assert main(["eval", *common]) == 0  # the same model, embedded: greedy pass@1 agrees
    embedded = json.loads(capsys.readouterr().out)
    assert served["eval/pass@1"] == embedded["eval/pass@1"]
