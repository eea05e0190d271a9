"""rollout.remote.backend without a server: the config checks, the one dispatch in
make_engine (each backend's own start-up error against a port nothing listens on), the
refusal to train with the read-only OpenAI-compatible backend, what the SGLang engine
sends, how an OpenAI-compatible answer is read back, and the weight directory SGLang's
/update_weights_from_disk loads. The engines against real servers: tests/test_openai_remote.py
(a vLLM server, `make test-vllm`) and tests/test_sglang_remote.py (needs SGLang)."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from plainrl.cli import main
from plainrl.config import ConfigError, load_config
from plainrl.rollout.engines.openai_compat import OpenAICompatEngine, completion_body, parse_choice
from plainrl.rollout.engines.remote import RemoteEngine
from plainrl.rollout.engines.requests import EngineError
from plainrl.rollout.engines.sglang import SGLangEngine, generate_body, parse_generation
from plainrl.rollout.engines.sync import policy_weights, save_hf_weights
from plainrl.rollout.engines.factory import make_engine
from plainrl.types import SamplingParams

EXAMPLE = str(Path(__file__).resolve().parents[1] / "examples" / "arithmetic_grpo.yaml")
DEAD = "http://127.0.0.1:9"  # the discard port: nothing listens
REMOTE = ["rollout.engine=remote", f"rollout.remote.urls=[{DEAD}]",
          "rollout.remote.connect_timeout_s=2"]


def test_backend_settings_are_checked_at_load():
    with pytest.raises(ConfigError, match="backend"):
        load_config(EXAMPLE, [*REMOTE, "rollout.remote.backend=tgi"])
    with pytest.raises(ConfigError, match="never the key itself"):
        load_config(EXAMPLE, [*REMOTE, "rollout.remote.api_key_env=sk-abc123"])
    with pytest.raises(ConfigError, match="SGLang takes full weights over a process group or from disk"):
        load_config(EXAMPLE, [*REMOTE, "rollout.remote.backend=sglang", "rollout.remote.weights_via=http"])
    assert load_config(EXAMPLE, [*REMOTE, "rollout.remote.backend=sglang",
                                 "rollout.remote.weights_via=group"]).rollout.remote.weights_via == "group"
    with pytest.raises(ConfigError, match="takes no model name"):
        load_config(EXAMPLE, [*REMOTE, "rollout.remote.backend=sglang", "rollout.remote.model=smol"])
    cfg = load_config(EXAMPLE, [*REMOTE, "rollout.remote.backend=sglang", "rollout.async_steps=1",
                             "rollout.remote.api_key_env=MY_KEY"])
    assert (cfg.rollout.remote.backend, cfg.rollout.async_steps, cfg.rollout.remote.api_key_env) == ("sglang", 1, "MY_KEY")


@pytest.mark.parametrize("backend, cls, hint", [("vllm", RemoteEngine, "plainrl serve"),
                                                ("sglang", SGLangEngine, "sglang.launch_server"),
                                                ("openai", OpenAICompatEngine, "OpenAI-compatible")])
def test_make_engine_dispatches_on_the_backend(backend, cls, hint, tokenizer, tiny_model_dir, monkeypatch):
    cfg = load_config(EXAMPLE, [*REMOTE, f"rollout.remote.backend={backend}", f"model.name={tiny_model_dir}",
                             "rollout.sync=full"])
    # each engine's own start-up check runs against a real closed port and names the URL and its own hint
    with pytest.raises(EngineError, match=rf"{DEAD}.*{hint}") as e:
        make_engine(cfg.model, cfg.rollout, torch.nn.Linear(1, 1), tokenizer, torch.device("cpu"), seed=cfg.seed)
    assert cls.start_hint in str(e.value)


def test_an_api_key_comes_from_the_named_variable(tokenizer, monkeypatch):
    cfg = load_config(EXAMPLE, [*REMOTE, "rollout.remote.backend=openai", "rollout.remote.api_key_env=PLAINRL_TEST_KEY"])
    monkeypatch.delenv("PLAINRL_TEST_KEY", raising=False)
    with pytest.raises(ConfigError, match="PLAINRL_TEST_KEY is not set"):
        make_engine(cfg.model, cfg.rollout, None, tokenizer, torch.device("cpu"), seed=cfg.seed)
    monkeypatch.setenv("PLAINRL_TEST_KEY", "secret-value")
    with pytest.raises(EngineError) as e:  # the key is read (the server is down), and no message shows it
        make_engine(cfg.model, cfg.rollout, None, tokenizer, torch.device("cpu"), seed=cfg.seed)
    assert "secret-value" not in str(e.value)


def test_training_with_the_openai_backend_is_refused_before_anything_loads(tmp_path, capsys):
    code = main(["train", EXAMPLE, f"run_dir={tmp_path / 'run'}", *REMOTE,
                 "rollout.remote.backend=openai"])
    assert code == 2  # the CLI's exit code for a configuration error
    err = capsys.readouterr().err
    assert "rollout.remote.backend=openai is read-only" in err and "plainrl eval" in err
    assert not (tmp_path / "run").exists()


def test_sglang_versions_are_compared_as_numbers_for_the_weight_group():
    from plainrl.rollout.engines.sglang import GROUP_MIN_VERSION, _version

    assert _version("0.5.23") == (0, 5, 23) > GROUP_MIN_VERSION > _version("0.5.5") == (0, 5, 5)
    assert _version("0.5.6.post1") == GROUP_MIN_VERSION and _version("0.5.10rc0") == (0, 5, 10)
    assert _version("") == () < GROUP_MIN_VERSION  # a server that does not say is not trusted with the group


def test_sglang_request_repeats_the_prompt_with_a_seed_per_sample():
    params = SamplingParams(max_new_tokens=5, temperature=0.7, top_p=0.9, top_k=0, stop=("\n\n",))
    body = generate_body([1, 2, 3], params, n=3, seed=10, seeded=True, lora="plainrl-v2")
    assert body["input_ids"] == [[1, 2, 3]] * 3 and body["return_logprob"] is True
    assert body["lora_path"] == ["plainrl-v2"] * 3
    assert [sp["sampling_seed"] for sp in body["sampling_params"]] == [10, 11, 12]
    sp = body["sampling_params"][0]
    assert (sp["max_new_tokens"], sp["temperature"], sp["top_p"], sp["top_k"], sp["stop"]) == (5, 0.7, 0.9, -1, ["\n\n"])
    # neutral penalties and min_p are sent: SGLang would otherwise take generation_config.json's
    assert (sp["min_p"], sp["repetition_penalty"], sp["frequency_penalty"], sp["presence_penalty"]) == (0.0, 1.0, 0.0, 0.0)
    assert "stop_token_ids" not in sp
    none = generate_body([1], SamplingParams(stop_token_ids=()), n=1, seed=None, seeded=False, lora=None)
    assert (none["sampling_params"][0]["stop_token_ids"], none["sampling_params"][0]["ignore_eos"]) == ([], True)
    plain = generate_body([1], SamplingParams(top_k=20), n=2, seed=10, seeded=False, lora=None)
    assert "lora_path" not in plain and all("sampling_seed" not in s for s in plain["sampling_params"])
    assert plain["sampling_params"][0]["top_k"] == 20


def test_sglang_output_is_read_as_ids_logprobs_and_finish_reason():
    # the response shape of SGLang's tokenizer_manager (python/sglang/srt/managers/tokenizer_manager.py,
    # _handle_batch_output): output_ids, meta_info.output_token_logprobs as [logprob, token_id, text]
    eos = {"output_ids": [5, 2], "meta_info": {"output_token_logprobs": [[-0.5, 5, None], [-0.25, 2, None]],
                                               "finish_reason": {"type": "stop", "matched": 2}}}
    gen = parse_generation(eos, "u")
    assert (gen.token_ids, gen.logprobs, gen.finish_reason) == ([5, 2], [-0.5, -0.25], "eos")
    stop = {"meta_info": {"output_token_logprobs": [[-1.0, 7, None]], "finish_reason": {"type": "stop", "matched": "\n"}}}
    assert parse_generation(stop, "u").finish_reason == "stop"
    length = {"meta_info": {"output_token_logprobs": [], "finish_reason": {"type": "length", "length": 0}}}
    assert parse_generation(length, "u").finish_reason == "length"
    with pytest.raises(EngineError, match="abort"):
        parse_generation({"meta_info": {"output_token_logprobs": [], "finish_reason": {"type": "abort"}}}, "u")
    with pytest.raises(EngineError, match="differ"):
        parse_generation({**eos, "output_ids": [5, 3]}, "u")


def test_an_openai_answer_is_re_tokenised_and_its_logprobs_kept_only_where_they_line_up(tokenizer):
    body = completion_body("Q: 1+1?", SamplingParams(max_new_tokens=4, temperature=0.0), model="m", n=2, seed=3)
    assert body == dict(model="m", prompt="Q: 1+1?", n=2, max_tokens=4, temperature=0.0, top_p=1.0, seed=3, logprobs=0)
    assert "seed" not in completion_body("Q", SamplingParams(), model="m", n=2, seed=None)  # unseeded
    text = " The answer is 2."
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    pieces = [tokenizer.decode([i]) for i in ids]
    choice = {"index": 0, "text": text, "finish_reason": "stop",
              "logprobs": {"tokens": pieces, "token_logprobs": [-0.1 * (k + 1) for k in range(len(ids))]}}
    gen = parse_choice(choice, tokenizer, "u")
    assert gen.token_ids == ids and gen.finish_reason == "eos"
    assert gen.logprobs == pytest.approx([-0.1 * (k + 1) for k in range(len(ids))])
    # the server's tokens spell another split (its tokenizer differs): logprobs unknown
    other = {**choice, "logprobs": {"tokens": [text], "token_logprobs": [-1.0]}, "finish_reason": "length"}
    gen = parse_choice(other, tokenizer, "u")
    assert gen.token_ids == ids and gen.finish_reason == "length" and all(math.isnan(x) for x in gen.logprobs)


def test_the_weight_directory_for_update_weights_from_disk_loads_as_the_policy(tiny_model_dir, tmp_path):
    from transformers import AutoModelForCausalLM

    from plainrl.config import ModelConfig
    from plainrl.models import load_policy

    policy = load_policy(ModelConfig(name=str(tiny_model_dir), dtype="float32", lora={"enabled": True, "r": 4}),
                         torch.device("cpu"))
    with torch.no_grad():  # a trained adapter: the directory must hold W + s * B @ A
        for name, p in policy.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.1)
    directory = save_hf_weights(policy, tmp_path / "weights")
    loaded = AutoModelForCausalLM.from_pretrained(directory, torch_dtype=torch.float32)
    expected = policy_weights(policy)
    for name, tensor in loaded.state_dict().items():
        key = "model.embed_tokens.weight" if name == "lm_head.weight" else name  # tied, stored once
        torch.testing.assert_close(tensor, expected[key], rtol=0, atol=0)
    x = torch.tensor([[1, 5, 9, 2]])
    with torch.no_grad():
        torch.testing.assert_close(loaded(x).logits, policy(x).logits, rtol=1e-5, atol=1e-5)
