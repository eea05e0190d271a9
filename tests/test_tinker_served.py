"""`plainrl tinker` sampling on a real `plainrl serve` (vLLM) server on loopback
(``rollout.engine=remote``), driven by the real `tinker` SDK: a sampler checkpoint is pushed to the
server as a LoRA adapter of its own after ``save_weights_for_sampler``, and what the server samples
has the logprobs that the service's own forward gives the sampled tokens under the new weights;
an older sampler and the base still sample their own weights. Then ``rollout.sync=full``: the
sampler's adapter merged into the server's base weights. Runs under `make test-vllm`; skipped
where vLLM is not installed."""

from __future__ import annotations

import os
import subprocess
import sys

import httpx
import numpy as np
import pytest

pytest.importorskip("vllm", reason="vLLM is not installed in this venv; `make test-vllm` runs these tests")
tinker = pytest.importorskip("tinker")

from conftest import REPO, free_port, wait_healthy  # noqa: E402
from tinker import types  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(1800)]
BASE = "HuggingFaceTB/SmolLM2-135M-Instruct"
LOGPROB_TOL = 2e-3  # vLLM's CPU kernels against the service's forward, float32 (as tests/test_vllm_remote.py)


@pytest.fixture()
def vllm_server(serve_pool):
    """The session's `plainrl serve` of the demo config (LoRA up to rank 16, float32, context 512)."""
    [(_, url)] = serve_pool.get()
    return url


def _start_tinker(root, vllm_url: str, *overrides: str):
    port = free_port()
    log = root / "tinker.log"
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    with open(log, "w") as out:
        proc = subprocess.Popen([sys.executable, "-m", "plainrl", "tinker", f"run_dir={root}", "model.dtype=float32",
                                 "model.max_context=512", "rollout.engine=remote", f"rollout.remote.urls=[{vllm_url}]",
                                 *overrides, "--port", str(port)],
                                env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    proc.log = log
    url = f"http://127.0.0.1:{port}"
    wait_healthy(proc, url, timeout_s=300, name="plainrl tinker", health="/api/v1/healthz")
    return proc, url


def _datum(ids):
    n = len(ids) - 1
    return types.Datum(model_input=types.ModelInput.from_ints(ids[:-1]),
                       loss_fn_inputs={"target_tokens": np.array(ids[1:], dtype=np.int64),
                                       "weights": np.ones(n, dtype=np.float32)})


def _forward(tc, ids) -> np.ndarray:
    return tc.forward([_datum(ids)], "cross_entropy").result().loss_fn_outputs[0]["logprobs"].to_numpy()


def _step(tc, ids, lr=5e-2):
    tc.forward_backward([_datum(ids)], "cross_entropy").result()
    tc.optim_step(types.AdamParams(learning_rate=lr)).result()


def _check_samples(sampler, tc_or_base, prompt, *, n=2, max_tokens=6, seed=7) -> list[list[int]]:
    """Sample and compare each sequence's logprobs to ``tc_or_base(prompt + tokens)`` (the service's forward)."""
    params = types.SamplingParams(max_tokens=max_tokens, temperature=1.0, seed=seed, stop=[])
    res = sampler.sample(types.ModelInput.from_ints(prompt), n, params).result()
    for seq in res.sequences:
        assert len(seq.tokens) == max_tokens and seq.stop_reason == "length"  # stop=[]: the EOS does not stop
        np.testing.assert_allclose(seq.logprobs, tc_or_base(prompt + seq.tokens)[-max_tokens:], atol=LOGPROB_TOL)
    return [s.tokens for s in res.sequences]


def _adapters_on(url: str) -> set[str]:
    return {m["id"] for m in httpx.get(url + "/v1/models", timeout=10).json()["data"] if m["id"].startswith("tinker-")}


def test_samplers_on_a_plainrl_serve_server(vllm_server, tmp_path):
    proc, url = _start_tinker(tmp_path, vllm_server, "tinker.ephemeral_samplers=2")
    try:
        sc = tinker.ServiceClient(base_url=url, api_key="tml-local")
        tc = sc.create_lora_training_client(base_model=BASE, rank=4, seed=3).result()
        tok = tc.get_tokenizer()
        prompt = tok.encode("Count: one, two, three,")
        base = sc.create_sampling_client(base_model=BASE).result()

        def base_forward(ids):
            return np.asarray(base.compute_logprobs(types.ModelInput.from_ints(ids)).result()[1:], dtype=np.float32)

        _step(tc, prompt)
        assert _adapters_on(vllm_server) == set()
        first = tc.save_weights_and_get_sampling_client().result()
        assert len(_adapters_on(vllm_server)) == 1  # pushed by save_weights_for_sampler, before any sample
        at_first = sc.create_training_client_from_state(tc.save_state("first").result().path).result()
        tokens = _check_samples(first, lambda ids: _forward(tc, ids), prompt)
        # the adapter was sampled, not the base: the base gives the same tokens other logprobs
        full = prompt + tokens[0]
        assert np.abs(base_forward(full)[-6:] - _forward(tc, full)[-6:]).max() > 10 * LOGPROB_TOL

        # a second step and a second sampler: both adapters on the server, each sampled with its own weights
        _step(tc, prompt)
        second = tc.save_weights_and_get_sampling_client().result()
        assert len(_adapters_on(vllm_server)) == 2
        _check_samples(second, lambda ids: _forward(tc, ids), prompt, seed=8)
        assert np.abs(_forward(tc, full) - _forward(at_first, full)).max() > 10 * LOGPROB_TOL
        _check_samples(first, lambda ids: _forward(at_first, ids), prompt, seed=11)
        # a second training client on the same base, its own sampler beside the others
        tc2 = sc.create_lora_training_client(base_model=BASE, rank=8, seed=4).result()
        _step(tc2, prompt)
        third = tc2.save_weights_and_get_sampling_client().result()
        _check_samples(third, lambda ids: _forward(tc2, ids), prompt, seed=9)
        _check_samples(base, base_forward, prompt, seed=10)
        # the token-id stop of Tinker's renderers: the sampled stop id ends the sequence
        stop_id = tokens[0][2]
        end = tokens[0].index(stop_id) + 1
        res = first.sample(types.ModelInput.from_ints(prompt), 2,
                           types.SamplingParams(max_tokens=6, temperature=1.0, seed=7, stop=[stop_id])).result()
        assert res.sequences[0].tokens == tokens[0][:end] and res.sequences[0].stop_reason == "stop"
        # snapshots are ephemeral: tinker.ephemeral_samplers=2 of tc's are kept, on disk and on the server
        snapshots = tmp_path / tc.model_id.replace(":", "_") / "ephemeral"
        assert len(list(snapshots.iterdir())) == 2
        loaded = len(_adapters_on(vllm_server))
        for _ in range(3):
            _step(tc, prompt)
            newest = tc.save_weights_and_get_sampling_client().result()
        assert len(list(snapshots.iterdir())) == 2 and len(_adapters_on(vllm_server)) == loaded
        _check_samples(newest, lambda ids: _forward(tc, ids), prompt, seed=12)
        with pytest.raises(tinker.BadRequestError, match="freed once its training client had saved 2 newer"):
            first.sample(types.ModelInput.from_ints(prompt), 1, types.SamplingParams(max_tokens=2)).result()
        # a sample is checked against the server's context (its /v1/models max_model_len), not the model's
        served = min(m["max_model_len"] for m in httpx.get(vllm_server + "/v1/models", timeout=10).json()["data"]
                     if m.get("max_model_len"))  # the base's (vLLM lists its adapters with none)
        assert {m.max_context_length for m in sc.get_server_capabilities().supported_models} == {served}
        with pytest.raises(tinker.BadRequestError, match=f"over the model's context of {served}"):
            base.sample(types.ModelInput.from_ints(prompt), 1,
                        types.SamplingParams(max_tokens=served - len(prompt) + 1)).result()
        sc.close("success").result()
    finally:
        proc.terminate()
        proc.wait(timeout=60)
    assert _adapters_on(vllm_server) == set()  # the service unloads its adapters when it stops


def test_full_sync_pushes_the_merged_adapter(vllm_server, tmp_path):
    import torch

    from plainrl.config import ModelConfig
    from plainrl.models import load_policy, load_tokenizer
    from plainrl.rollout.engines.remote import RemoteEngine

    # the pooled server's base weights, pushed back at the end for the tests that share it
    restore = RemoteEngine([vllm_server], load_tokenizer("smollm2-135m-instruct"), sync="full", max_model_len=512)
    probe = "model.layers.0.mlp.down_proj.weight"
    base_sum = restore.weight_sum(probe)
    proc, url = _start_tinker(tmp_path, vllm_server, "rollout.sync=full")
    try:
        sc = tinker.ServiceClient(base_url=url, api_key="tml-local")
        tc = sc.create_lora_training_client(base_model=BASE, rank=4, seed=5).result()
        prompt = tc.get_tokenizer().encode("Colours: red, green,")
        _step(tc, prompt)
        sampler = tc.save_weights_and_get_sampling_client().result()
        assert _adapters_on(vllm_server) == set()
        _check_samples(sampler, lambda ids: _forward(tc, ids), prompt)
        base = sc.create_sampling_client(base_model=BASE).result()
        _check_samples(base, lambda ids: np.asarray(
            base.compute_logprobs(types.ModelInput.from_ints(ids)).result()[1:], dtype=np.float32), prompt, seed=3)
        _check_samples(sampler, lambda ids: _forward(tc, ids), prompt, seed=4)  # pushed again after the base
        sc.close("success").result()
    finally:
        proc.terminate()
        proc.wait(timeout=60)
        try:
            restore.load_weights(load_policy(ModelConfig(name="smollm2-135m-instruct", dtype="float32", lora={"enabled": False}),
                                             torch.device("cpu")))
            assert restore.weight_sum(probe) == pytest.approx(base_sum, rel=1e-6)
        finally:
            restore.close()
