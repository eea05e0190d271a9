"""`plainrl tinker` over a long run, driven by the real `tinker` SDK against the service in this
process (uvicorn on a thread, the tiny random Llama): ephemeral sampler snapshots leave nothing
on disk and the superseded ones are freed, sessions that stop sending heartbeats expire and free
their adapters and optimizer state, ``load_state`` resets AdamW and ``load_state_with_optimizer``
restores it, the API key, and the context sampling is checked against."""

from __future__ import annotations

import contextlib
import gc
import threading
import time
import weakref
from pathlib import Path

import httpx
import numpy as np
import pytest
import torch

tinker = pytest.importorskip("tinker")
from conftest import free_port  # noqa: E402
from tinker import types  # noqa: E402

RULES = ["data.task=arithmetic", "rewards=[{fn: 'plainrl.rewards.builtins:correctness'}]"]


def _start(model_dir: Path, run_dir: Path, *overrides: str, api_key: str | None = None):
    """The service of the tiny model on a free port, in this process: (url, service, stop)."""
    import uvicorn

    from plainrl.config import load_config
    from plainrl.tinker.routes import build_app
    from plainrl.tinker.server import build_service

    cfg = load_config(None, [*RULES, f"model.name={model_dir}", "model.dtype=float32", f"run_dir={run_dir}",
                             *overrides])
    service = build_service(cfg)
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(build_app(service, api_key), host="127.0.0.1", port=port,
                                           log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "the service did not start"
        time.sleep(0.05)

    def stop():
        server.should_exit = True
        thread.join(timeout=30)
        service.close()

    return f"http://127.0.0.1:{port}", service, stop


@pytest.fixture(scope="module")
def live(tiny_model_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("tinker-life")
    url, service, stop = _start(tiny_model_dir, root, "tinker.ephemeral_samplers=2")
    client = tinker.ServiceClient(base_url=url, api_key="tml-local")
    yield url, service, client, str(tiny_model_dir)
    client.close("success").result()
    stop()


def _datum(ids):
    return types.Datum(model_input=types.ModelInput.from_ints(ids[:-1]),
                       loss_fn_inputs={"target_tokens": np.array(ids[1:], dtype=np.int64),
                                       "weights": np.ones(len(ids) - 1, dtype=np.float32)})


def _step(tc, ids, lr=1e-2):
    tc.forward_backward([_datum(ids)], "cross_entropy").result()
    tc.optim_step(types.AdamParams(learning_rate=lr)).result()


def _logps(sampler, ids):
    return np.asarray(sampler.compute_logprobs(types.ModelInput.from_ints(ids)).result()[1:], dtype=np.float32)


def _files(root: Path) -> dict[str, int]:
    return {str(p.relative_to(root)): p.stat().st_size for p in root.rglob("*") if p.is_file()}


def test_ephemeral_samplers_write_nothing_and_the_superseded_are_freed(live):
    url, service, client, base = live
    tc = client.create_lora_training_client(base_model=base, rank=4, seed=1).result()
    ids = tc.get_tokenizer().encode("Count: one, two, three, four,")
    forward = []  # the training client's logprobs of ids at each save
    samplers = []
    for step in range(6):
        _step(tc, ids)
        forward.append(tc.forward([_datum(ids)], "cross_entropy").result().loss_fn_outputs[0]["logprobs"].to_numpy())
        samplers.append(tc.save_weights_and_get_sampling_client().result())
        if step == 0:
            after_one = _files(service.root)
    first = samplers[0]
    assert _files(service.root) == after_one  # five more snapshots, not one byte more on disk
    assert not any("ephemeral" in f or "sampler_weights" in f for f in after_one)
    # a snapshot keeps the weights of its save, whatever the steps after it
    np.testing.assert_allclose(_logps(samplers[-1], ids), forward[-1], atol=2e-4)
    np.testing.assert_allclose(_logps(samplers[-2], ids), forward[-2], atol=2e-4)
    assert np.abs(forward[-1] - forward[-2]).max() > 1e-3
    now = forward[-1]
    # only the newest tinker.ephemeral_samplers=2 are kept: the first is refused, saying why
    with pytest.raises(tinker.BadRequestError, match="freed once its training client had saved 2 newer"):
        first.sample(types.ModelInput.from_ints(ids), 1, types.SamplingParams(max_tokens=2)).result()
    snapshots = [n for n in service.adapters.model.peft_config if n.startswith("e")]
    assert len(snapshots) == 2
    # what the user saves by name stays, and is all that the run directory gains
    path = tc.save_weights_for_sampler("keep").result().path
    added = set(_files(service.root)) - set(after_one)
    assert added and all(f.startswith(f"{tc.model_id.replace(':', '_')}/sampler_weights/keep/") for f in added)
    np.testing.assert_allclose(_logps(client.create_sampling_client(model_path=path), ids), now, atol=2e-4)


def test_load_state_resets_adam_and_load_state_with_optimizer_restores_it(live):
    _, service, client, base = live
    tc = client.create_lora_training_client(base_model=base, rank=4, seed=2).result()
    ids = tc.get_tokenizer().encode("The capital of France is Paris.")
    _step(tc, ids)
    _step(tc, ids)

    def moments():
        state = service.models[tc.model_id].optimizer.state_dict()["optimizer"]["state"]
        return {k: (v["exp_avg"].clone(), v["exp_avg_sq"].clone(), float(v["step"])) for k, v in state.items()}

    path = tc.save_state("two").result().path
    saved = moments()
    assert saved and all(step == 2 and a.abs().max() > 0 for a, _, step in saved.values())
    _step(tc, ids)
    tc.load_state(path).result()
    assert moments() == {}  # a fresh AdamW: no moments, no steps
    _step(tc, ids)
    assert all(step == 1 for _, _, step in moments().values())
    tc.load_state_with_optimizer(path).result()
    restored = moments()
    assert restored.keys() == saved.keys()
    for k, (a, b, step) in saved.items():
        torch.testing.assert_close(restored[k][0], a, rtol=0, atol=0)
        torch.testing.assert_close(restored[k][1], b, rtol=0, atol=0)
        assert restored[k][2] == step


def test_sampling_is_checked_against_the_sampling_context(live, monkeypatch):
    """Under remote sampling the servers' max_model_len (read from their /v1/models) bounds a
    sample, not the model's context: here set on the service as build_service sets it."""
    from plainrl.tinker.served import served_context

    url, service, client, base = live
    # vLLM's /v1/models: the base and its LoRA adapters, each with the server's max_model_len
    listed = {"object": "list", "data": [
        {"id": "HuggingFaceTB/SmolLM2-135M-Instruct", "object": "model", "max_model_len": 513},
        {"id": "tinker-ab12cd34-1", "object": "model", "parent": "HuggingFaceTB/SmolLM2-135M-Instruct",
         "max_model_len": 513}]}
    assert served_context(listed["data"]) == 513
    assert served_context([{"id": "m", "max_model_len": 600}, {"id": "m", "max_model_len": 513}]) == 513
    assert served_context([{"id": "m"}]) is None
    monkeypatch.setattr(service, "sample_context", 513)
    caps = client.get_server_capabilities()
    assert {m.max_context_length for m in caps.supported_models} == {513}  # the model's own is 2048
    sampler = client.create_sampling_client(base_model=base)
    prompt = types.ModelInput.from_ints([1] * 500)
    with pytest.raises(tinker.BadRequestError, match=r"prompt \(500 tokens\) \+ sampling_params.max_tokens \(14\) "
                                                     r"is over the model's context of 513"):
        sampler.sample(prompt, 1, types.SamplingParams(max_tokens=14)).result()
    assert len(sampler.sample(prompt, 1, types.SamplingParams(max_tokens=13, stop=[])).result()
               .sequences[0].tokens) == 13


def test_checkpoint_paths_are_absolute(live, tmp_path, monkeypatch):
    from plainrl.tinker.service import Service

    _, service, _, _ = live
    monkeypatch.chdir(tmp_path)
    relative = Service(service.bases, Path("runs/tinker"))
    assert relative.root == tmp_path / "runs" / "tinker" and relative.root.is_absolute()
    assert relative.checkpoint_path("m:train:0", "sampler_weights", "x")[1].is_absolute()
    relative.close()


def test_a_session_that_misses_its_heartbeats_expires(tiny_model_dir, tmp_path):
    url, service, stop = _start(tiny_model_dir, tmp_path, "tinker.session_expiry_s=3")
    kept = tinker.ServiceClient(base_url=url, api_key="tml-local")
    base = str(tiny_model_dir)
    other = kept.create_lora_training_client(base_model=base, rank=4, seed=4).result()
    ids = other.get_tokenizer().encode("One plus one is two.")
    alive = threading.Event()

    def keep_alive():  # `kept`'s requests count as its heartbeats (the SDK sends one every 10 s only)
        while not alive.wait(0.2):
            other.forward([_datum(ids)], "cross_entropy").result()

    keeper = threading.Thread(target=keep_alive, daemon=True)
    keeper.start()
    gone = tinker.ServiceClient(base_url=url, api_key="tml-local")
    try:
        tc = gone.create_lora_training_client(base_model=base, rank=4, seed=3).result()
        _step(tc, ids)
        sampler = tc.save_weights_and_get_sampling_client().result()
        tm = service.models[tc.model_id]
        adapter, optimizer = tm.adapter, weakref.ref(tm.optimizer)
        del tm
        last = time.monotonic()  # `gone` sends nothing from here on
        while tc.model_id in service.models and time.monotonic() < last + 10:
            time.sleep(0.1)
        assert time.monotonic() - last >= 3.0 and tc.model_id not in service.models
        session = tc.model_id.split(":")[0]
        assert other.model_id in service.models and other.model_id.split(":")[0] in service.sessions
        with pytest.raises(tinker.NotFoundError, match=r"missed its heartbeats for over 3 s"):
            tc.forward([_datum(ids)], "cross_entropy").result()
        with pytest.raises(tinker.NotFoundError, match="missed its heartbeats"):
            sampler.sample(types.ModelInput.from_ints(ids), 1, types.SamplingParams(max_tokens=2)).result()
        # the SDK's heartbeat is answered 410 (it stops its loop); the adapters and AdamW are freed
        r = httpx.post(f"{url}/api/v1/session_heartbeat", json={"session_id": session}, timeout=10)
        assert r.status_code == 410
        service._worker.submit(lambda: None).result(timeout=30)  # the frees were queued before this
        names = set(service.adapters.model.peft_config)
        assert adapter not in names and not any(n.startswith("e") for n in names)
        gc.collect()
        assert optimizer() is None
        alive.set()
        keeper.join(timeout=30)
        _step(other, ids)  # the live session trains on
    finally:
        alive.set()
        kept.close("success").result()
        with contextlib.suppress(tinker.TinkerError):  # its session expired: the SDK's heartbeats stop here
            gone.close("success").result(timeout=30)
        stop()


def test_an_api_key_is_checked_when_the_service_has_one(tiny_model_dir, tmp_path, monkeypatch):
    from plainrl.config import ConfigError
    from plainrl.tinker.server import check_api_key

    url, service, stop = _start(tiny_model_dir, tmp_path, "tinker.session_expiry_s=null", api_key="tml-secret")
    try:
        assert httpx.get(f"{url}/api/v1/healthz", timeout=10).status_code == 200  # a liveness probe needs none
        caps = httpx.get(f"{url}/api/v1/get_server_capabilities", headers={"X-API-Key": "tml-other"}, timeout=10)
        assert caps.status_code == 401 and "not this service's API key" in caps.json()["detail"]
        with pytest.raises(tinker.AuthenticationError):
            tinker.ServiceClient(base_url=url, api_key="tml-other").get_server_capabilities()
        good = tinker.ServiceClient(base_url=url, api_key="tml-secret")
        assert good.get_server_capabilities().supported_models
        good.close("success").result()
    finally:
        stop()
    with pytest.raises(ConfigError, match="must start with 'tml-'"):
        check_api_key("secret")
    # `plainrl tinker` takes --api-key, else TINKER_API_KEY
    import plainrl.tinker
    from plainrl.cli import main

    seen = []
    monkeypatch.setattr(plainrl.tinker, "serve", lambda cfg, **kw: seen.append(kw["api_key"]))
    monkeypatch.setenv("TINKER_API_KEY", "tml-env")
    assert main(["tinker", "--api-key", "tml-flag"]) == 0 and main(["tinker"]) == 0
    monkeypatch.delenv("TINKER_API_KEY")
    assert main(["tinker"]) == 0
    assert seen == ["tml-flag", "tml-env", None]
