"""Several base models in one `plainrl tinker` (``tinker.base_models``), driven by the real
`tinker` SDK: two tiny random Llamas of different sizes, each with its training and sampling
clients, checked against transformers on the right base."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
import yaml

tinker = pytest.importorskip("tinker")
from test_tinker_lifecycle import _datum, _logps, _start, _step  # noqa: E402
from tinker import types  # noqa: E402


@pytest.fixture(scope="module")
def small_model_dir(tmp_path_factory, tokenizer) -> Path:
    """A 1-layer, hidden-32 random Llama with the real tokenizer: another size than tiny_model_dir's."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(1)
    cfg = LlamaConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=1024,
                      tie_word_embeddings=True, bos_token_id=tokenizer.bos_token_id,
                      eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    d = tmp_path_factory.mktemp("small-llama")
    LlamaForCausalLM(cfg).save_pretrained(d)
    tokenizer.save_pretrained(d)
    return d


def _reference(model_dir: Path, ids: list[int]) -> np.ndarray:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([ids[:-1]])).logits.float()[0]
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(ids[1:])[:, None]).squeeze(-1).numpy()


def test_two_base_models_each_train_and_sample(tiny_model_dir, small_model_dir, tmp_path):
    big, small = str(tiny_model_dir), str(small_model_dir)
    url, service, stop = _start(tiny_model_dir, tmp_path, f"tinker.base_models=[{big}, {small}]",
                                "tinker.session_expiry_s=null")
    sc = tinker.ServiceClient(base_url=url, api_key="tml-local")
    try:
        caps = tinker.RestClient(base_url=url, api_key="tml-local").get_server_capabilities().result()
        assert [(m.model_name, m.max_context_length) for m in caps.supported_models] == [(big, 2048), (small, 1024)]
        ta = sc.create_lora_training_client(base_model=big, rank=4, seed=0).result()  # the first: the default
        tb = sc.create_lora_training_client(base_model=small, rank=4, seed=0).result()
        assert (ta.get_info().model_name, tb.get_info().model_name) == (big, small)
        ids = tb.get_tokenizer().encode("Red, green, blue, red, green,")
        # a fresh adapter (B = 0) is its base: each client's forward is its own base's
        for tc, d in ((ta, tiny_model_dir), (tb, small_model_dir)):
            lp = tc.forward([_datum(ids)], "cross_entropy").result().loss_fn_outputs[0]["logprobs"].to_numpy()
            np.testing.assert_allclose(lp, _reference(d, ids), atol=2e-4)
            base_sampler = sc.create_sampling_client(base_model=str(d))
            np.testing.assert_allclose(_logps(base_sampler, ids), _reference(d, ids), atol=2e-4)
        assert np.abs(_reference(tiny_model_dir, ids) - _reference(small_model_dir, ids)).max() > 1e-2
        with pytest.raises(tinker.BadRequestError, match=r"over the model's context of 1024"):
            sc.create_sampling_client(base_model=small).sample(
                types.ModelInput.from_ints(ids), 1, types.SamplingParams(max_tokens=1020)).result()
        # the small base's client trains, samples its snapshot and saves checkpoints of its own base
        before = ta.forward([_datum(ids)], "cross_entropy").result().loss_fn_outputs[0]["logprobs"].to_numpy()
        _step(tb, ids)
        now = tb.forward([_datum(ids)], "cross_entropy").result().loss_fn_outputs[0]["logprobs"].to_numpy()
        assert np.abs(now - _reference(small_model_dir, ids)).max() > 1e-3
        np.testing.assert_allclose(_logps(tb.save_weights_and_get_sampling_client().result(), ids), now, atol=2e-4)
        path = tb.save_state("small-1").result().path
        directory = service.resolve(path)[2]
        assert yaml.safe_load((directory / "config.yaml").read_text())["model"]["name"] == small
        rest = tinker.RestClient(base_url=url, api_key="tml-local")
        assert rest.get_weights_info_by_tinker_path(path).result().base_model == small
        again = sc.create_training_client_from_state(path).result()
        assert again.get_info().model_name == small
        np.testing.assert_allclose(again.forward([_datum(ids)], "cross_entropy").result()
                                   .loss_fn_outputs[0]["logprobs"].to_numpy(), now, atol=1e-5)
        with pytest.raises(tinker.BadRequestError, match=f"is an adapter of '{small}', not of '{big}'"):
            ta.load_state(path).result()
        # the other base's client is as it was
        np.testing.assert_allclose(ta.forward([_datum(ids)], "cross_entropy").result()
                                   .loss_fn_outputs[0]["logprobs"].to_numpy(), before, atol=0)
    finally:
        sc.close("success").result()
        stop()


def test_bases_are_refused_where_they_cannot_be_served(tiny_model_dir):
    from plainrl.config import ConfigError, load_config
    from plainrl.tinker.server import build_service

    rules = ["data.task=arithmetic", "rewards=[{fn: 'plainrl.rewards.builtins:correctness'}]"]
    remote = load_config(None, [*rules, "tinker.base_models=[a, b]", "rollout.engine=remote",
                                "rollout.remote.urls=[http://127.0.0.1:9]"])
    with pytest.raises(ConfigError, match="tinker.base_models lists 2 models, and rollout.engine=remote"):
        build_service(remote)
    twice = load_config(None, [*rules, f"model.name={tiny_model_dir}", "model.dtype=float32",
                               f"tinker.base_models=[{tiny_model_dir}, {tiny_model_dir}]"])
    with pytest.raises(ConfigError, match="listed before; list each model once"):
        build_service(twice)
