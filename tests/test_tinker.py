"""`plainrl tinker` against the real `tinker` SDK on loopback: the service in its own process
(a tiny random Llama on the embedded model's tokenizer, float32, kept where a hub cache keeps
``BASE``, so that it has a hub id as the embedded model does), the SDK's
ServiceClient/TrainingClient/SamplingClient/RestClient in this one, and transformers + peft here
as the reference."""

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import numpy as np
import pytest
import torch

tinker = pytest.importorskip("tinker")
from tinker import types  # noqa: E402

BASE = "plainrl-tests/tiny-llama"  # the hub id of the served base (its directory names it)
REPO = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.timeout(900)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def base_dir(tmp_path_factory, tokenizer) -> Path:
    """A 2-layer, hidden-64 random Llama with the real tokenizer and an 8192-token context, saved
    as a hub cache's snapshot of ``BASE`` (plainrl names such a directory's base by its hub id)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    d = tmp_path_factory.mktemp("hub") / f"models--{BASE.replace('/', '--')}" / "snapshots" / "0"
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=8192,
                      tie_word_embeddings=True, bos_token_id=tokenizer.bos_token_id,
                      eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    LlamaForCausalLM(cfg).save_pretrained(d)
    tokenizer.save_pretrained(d)
    return d


@pytest.fixture(scope="module")
def server(tmp_path_factory, base_dir):
    root = tmp_path_factory.mktemp("tinker")
    port = _free_port()
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    log = open(root / "server.log", "w")
    proc = subprocess.Popen([sys.executable, "-m", "plainrl", "tinker", f"run_dir={root}", f"model.name={base_dir}",
                             "model.dtype=float32", "--port", str(port)], env=env, stdout=log,
                            stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 300
    while True:
        assert proc.poll() is None, (root / "server.log").read_text()
        try:
            if httpx.get(f"{url}/api/v1/healthz", timeout=2).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        assert time.monotonic() < deadline, "the service did not start in 300 s"
        time.sleep(0.5)
    yield url, root, port
    proc.terminate()
    assert proc.wait(timeout=60) is not None
    log.close()
    with socket.socket() as s:  # nothing listens there any more (SO_REUSEADDR: closed connections may linger)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind(("127.0.0.1", port))
        s.listen()


@pytest.fixture(scope="module")
def client(server):
    sc = tinker.ServiceClient(base_url=server[0], api_key="tml-local")
    yield sc
    sc.close("success").result()


@pytest.fixture(scope="module")
def reference(client):
    """The directory of the base model (what get_info names as the tokenizer) and the tokenizer."""
    tc = client.create_lora_training_client(base_model=BASE, rank=4, seed=0).result()
    path = tc.get_info().model_data.tokenizer_id
    return path, tc.get_tokenizer()


def _datum(ids, weights=None, **extra):
    n = len(ids) - 1
    inputs = {"target_tokens": np.array(ids[1:], dtype=np.int64),
              "weights": np.ones(n, dtype=np.float32) if weights is None else np.asarray(weights, dtype=np.float32)}
    inputs.update(extra)
    return types.Datum(model_input=types.ModelInput.from_ints(ids[:-1]), loss_fn_inputs=inputs)


def _peft(base_path, adapter_dir):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(base_path, dtype=torch.float32)
    return PeftModel.from_pretrained(base, str(adapter_dir), is_trainable=True)


def _local(server, tinker_path: str) -> Path:
    model_id, kind, name = tinker_path[len("tinker://"):].split("/")
    return Path(server[1]) / model_id.replace(":", "_") / kind / name / "final"


def _logps(model, ids):
    x = torch.tensor([ids[:-1]])
    logits = model(input_ids=x).logits.float()[0]
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(ids[1:])[:, None]).squeeze(-1)


def test_train_step_matches_transformers_peft_and_adamw(server, client, reference):
    base_path, tok = reference
    ids = tok.encode("The capital of France is Paris. The capital of Italy is Rome.")
    weights = np.r_[np.zeros(4), np.ones(len(ids) - 5)].astype(np.float32)
    tc = client.create_lora_training_client(base_model=BASE, rank=4, seed=1, train_unembed=False).result()
    assert tc.get_info().lora_rank == 4
    before = tc.save_state("before").result().path
    out = tc.forward_backward([_datum(ids, weights)], "cross_entropy").result()
    # a weight decay large enough to show in the step (lr * wd * |w| ~ 4e-5 for lora_A)
    adam = types.AdamParams(learning_rate=1e-3, beta1=0.9, beta2=0.95, eps=1e-6, weight_decay=1.0, grad_clip_norm=0.5)
    metrics = tc.optim_step(adam).result().metrics
    after = tc.save_state("after").result().path

    # the same forward, loss and AdamW step by transformers + peft + torch
    model = _peft(base_path, _local(server, before))
    lp = _logps(model, ids)
    np.testing.assert_allclose(out.loss_fn_outputs[0]["logprobs"].to_numpy(), lp.detach().numpy(), atol=2e-4)
    loss = -(lp * torch.from_numpy(weights)).sum()
    assert out.metrics["loss:sum"] == pytest.approx(loss.item(), rel=1e-4)
    loss.backward()
    params = [p for p in model.parameters() if p.requires_grad]
    norm = torch.nn.utils.clip_grad_norm_(params, 0.5)
    assert metrics["grad_norm"] == pytest.approx(norm.item(), rel=1e-3)
    opt = torch.optim.AdamW(params, lr=1e-3, betas=(0.9, 0.95), eps=1e-6, weight_decay=1.0)
    opt.step()
    from safetensors.torch import load_file

    served = load_file(str(_local(server, after) / "adapter_model.safetensors"))
    mine = {k.replace(".default", ""): v for k, v in model.state_dict().items() if "lora_" in k}
    assert set(served) == set(mine)
    moved = 0.0
    for k, v in served.items():
        # the two forwards differ in float rounding (chunked LM head): 1% of the 1e-3 step
        torch.testing.assert_close(v, mine[k].detach(), atol=1e-5, rtol=0)
        moved = max(moved, (v - load_file(str(_local(server, before) / "adapter_model.safetensors"))[k]).abs().max().item())
    assert moved > 1e-5  # the step changed the weights

    # saved, loaded with its optimizer, continued: the same weights as continuing the original
    tc2 = client.create_training_client_from_state_with_optimizer(after).result()
    for c in (tc, tc2):
        c.forward_backward([_datum(ids, weights)], "cross_entropy").result()
        c.optim_step(adam).result()
    a = load_file(str(_local(server, tc.save_state("a2").result().path) / "adapter_model.safetensors"))
    b = load_file(str(_local(server, tc2.save_state("b2").result().path) / "adapter_model.safetensors"))
    for k in a:
        torch.testing.assert_close(a[k], b[k], atol=1e-6, rtol=1e-5)
    # two clients, two adapters: a step of one leaves the other as it was
    tc2.forward_backward([_datum(ids, weights)], "cross_entropy").result()
    tc2.optim_step(adam).result()
    a_again = load_file(str(_local(server, tc.save_state("a3").result().path) / "adapter_model.safetensors"))
    for k in a:
        torch.testing.assert_close(a[k], a_again[k], atol=0, rtol=0)
    # load_state puts the saved weights back: the first forward's logprobs again
    tc.load_state(before).result()
    again = tc.forward([_datum(ids, weights)], "cross_entropy").result()
    np.testing.assert_allclose(again.loss_fn_outputs[0]["logprobs"].to_numpy(),
                               out.loss_fn_outputs[0]["logprobs"].to_numpy(), atol=1e-5)
    rest = tinker.RestClient(base_url=server[0], api_key="tml-local")
    ckpts = rest.list_checkpoints(tc.model_id).result()
    assert {c.checkpoint_id for c in ckpts.checkpoints} >= {"weights/before", "weights/after", "weights/a3"}
    run = rest.get_training_run(tc.model_id).result()
    assert run.lora_rank == 4 and run.last_checkpoint.checkpoint_id == "weights/a3"
    info = rest.get_weights_info_by_tinker_path(before).result()
    assert (info.base_model, info.is_lora, info.lora_rank) == (BASE, True, 4)
    assert tc2.model_id in {r.training_run_id for r in rest.list_training_runs().result().training_runs}


def test_policy_gradient_losses_against_hand_computed(client, reference):
    _, tok = reference
    ids = tok.encode("One plus one is two.")
    n = len(ids) - 1
    tc = client.create_lora_training_client(base_model=BASE, rank=4, seed=2).result()
    lp = tc.forward([_datum(ids)], "cross_entropy").result().loss_fn_outputs[0]["logprobs"].to_numpy()
    q = (lp + np.linspace(-0.5, 0.5, n)).astype(np.float32)  # ratios exp(-0.5) .. exp(0.5)
    adv = np.where(np.arange(n) % 2 == 0, 1.0, -2.0).astype(np.float32)
    ratio = np.exp(lp - q)
    expected = {
        "importance_sampling": -(ratio * adv),
        "ppo": -np.minimum(ratio * adv, np.clip(ratio, 0.8, 1.2) * adv),
        "cispo": -(np.clip(ratio, 0.0, 4.0) * adv * lp),
        "dro": -(lp * adv - 0.5 * 0.05 * (lp - q) ** 2),
    }
    # gspo: the sequence ratio over the tokens the mask marks (all but the first), clipped as one
    mask = (np.arange(n) > 0).astype(np.float32)
    s = np.exp((lp - q)[1:].mean())
    expected["gspo"] = -np.minimum(s * adv, np.clip(s, 0.9, 1.1) * adv)
    config = {"dro": {"beta": 0.05}, "gspo": {"clip_low_threshold": 0.9, "clip_high_threshold": 1.1}}
    for loss_fn, want in expected.items():
        inputs = {"target_tokens": np.array(ids[1:]), "logprobs": q, "advantages": adv}
        if loss_fn == "gspo":
            inputs["sequence_ratio_mask"] = mask
        d = types.Datum(model_input=types.ModelInput.from_ints(ids[:-1]), loss_fn_inputs=inputs)
        out = tc.forward([d], loss_fn, config.get(loss_fn)).result()
        np.testing.assert_allclose(out.loss_fn_outputs[0]["elementwise_loss"].to_numpy(), want, rtol=1e-4, atol=1e-5)
        assert out.metrics["loss:sum"] == pytest.approx(float(want.sum()), rel=1e-4, abs=1e-4)


def test_stable_reinforce_trains_on_the_recorded_samples(server, client, reference):
    """The cookbook's rl_loop datum (tinker_cookbook/recipes/rl_loop.py, its default loss): sampled
    with record_stability_info, each token's sequence named by provenance."""
    _, tok = reference
    tc = client.create_lora_training_client(base_model=BASE, rank=4, seed=6).result()
    sampler = tc.save_weights_and_get_sampling_client(record_stability_info=True).result()
    prompt = types.ModelInput.from_ints(tok.encode("Count: one, two,"))
    seqs = sampler.sample(prompt, 2, types.SamplingParams(max_tokens=5, seed=3, stop=[])).result().sequences
    advantages = [1.0, -1.0]

    def datum(seq, adv, logprobs=None, targets=None):
        ob = prompt.length - 1
        d = types.Datum(model_input=prompt.append(types.EncodedTextChunk(tokens=seq.tokens[:-1])), loss_fn_inputs={
            "target_tokens": np.array(targets or [0] * ob + seq.tokens),
            "logprobs": np.array([0.0] * ob + (logprobs or seq.logprobs), dtype=np.float32),
            "advantages": np.array([0.0] * ob + [adv] * len(seq.tokens), dtype=np.float32)})
        return d.with_provenance(
            model_input=[types.PromptProvenanceSpan(sequence_id=seq.sequence_id, length=prompt.length),
                         types.SampledProvenanceSpan(sequence_id=seq.sequence_id, length=len(seq.tokens) - 1)],
            loss_fn_inputs=[types.PromptProvenanceSpan(sequence_id=seq.sequence_id, offset=1, length=ob),
                            types.SampledProvenanceSpan(sequence_id=seq.sequence_id, length=len(seq.tokens))])

    # wrong logprobs from the client: the recorded ones are used on the sampled tokens
    data = [datum(s, a, logprobs=[-9.0] * len(s.tokens)) for s, a in zip(seqs, advantages)]
    out = tc.forward(data, "stable_reinforce", {"kl_coeff": 0.1}).result()
    for d, s, a, o in zip(data, seqs, advantages, out.loss_fn_outputs):
        lp = o["logprobs"].to_numpy()[-len(s.tokens):]
        q = np.array(s.logprobs)
        want = -np.minimum(np.exp(lp - q), 2.0) * a * lp + 0.05 * (lp - q) ** 2
        np.testing.assert_allclose(o["elementwise_loss"].to_numpy()[-len(s.tokens):], want, rtol=1e-4, atol=1e-5)
        assert np.abs(o["elementwise_loss"].to_numpy()[: -len(s.tokens)]).max() == 0.0  # prompt: advantage 0
    tc.forward_backward(data, "stable_reinforce").result()
    assert tc.optim_step(types.AdamParams(learning_rate=1e-3)).result().metrics["skipped"] == 0.0
    # provenance that does not hold, or is missing, or names a sequence never recorded: a 400 naming it
    s = seqs[0]
    bad = [0] * (prompt.length - 1) + [(s.tokens[0] + 1) % len(tok)] + s.tokens[1:]
    with pytest.raises(tinker.BadRequestError, match=rf"target_tokens\[{prompt.length - 1}\].*sampled token 0"):
        tc.forward([datum(s, 1.0, targets=bad)], "stable_reinforce").result()
    plain = types.Datum(model_input=data[0].model_input, loss_fn_inputs=data[0].loss_fn_inputs)
    with pytest.raises(tinker.BadRequestError, match="needs provenance"):
        tc.forward([plain], "stable_reinforce").result()
    unrecorded = client.create_sampling_client(base_model=BASE).sample(
        prompt, 1, types.SamplingParams(max_tokens=5, seed=3, stop=[])).result().sequences[0]
    with pytest.raises(tinker.BadRequestError, match="has no stability information"):
        tc.forward([datum(unrecorded, 1.0)], "stable_reinforce").result()
    # provenance works within one session: another session's training client cannot name these samples
    other = tinker.ServiceClient(base_url=server[0], api_key="tml-local")
    try:
        theirs = other.create_lora_training_client(base_model=BASE, rank=4, seed=6).result()
        with pytest.raises(tinker.BadRequestError, match="sampled in another session"):
            theirs.forward([datum(seqs[0], 1.0)], "stable_reinforce").result()
    finally:
        other.close("success").result()


def test_topk_prompt_logprobs_and_cross_entropy_over_k_targets(client, reference):
    """Tinker's top-K distillation as the cookbook's sdft does it: a teacher's top-K prompt
    logprobs, then cross_entropy with (N, K) targets and weights."""
    from transformers import AutoModelForCausalLM

    base_path, tok = reference
    ids = tok.encode("The capital of France is Paris.")
    k = 3
    res = client.create_sampling_client(base_model=BASE).sample(
        types.ModelInput.from_ints(ids), 1, types.SamplingParams(max_tokens=1), include_prompt_logprobs=True,
        topk_prompt_logprobs=k).result()
    model = AutoModelForCausalLM.from_pretrained(base_path, dtype=torch.float32)
    with torch.no_grad():
        ref = torch.log_softmax(model(input_ids=torch.tensor([ids])).logits.float()[0, :-1], -1).topk(k)  # [P-1, k]
    top = res.topk_prompt_logprobs
    assert len(top) == len(ids) and top[0] is None
    for i, entries in enumerate(top[1:]):
        assert [t for t, _ in entries] == ref.indices[i].tolist()
        np.testing.assert_allclose([lp for _, lp in entries], ref.values[i].numpy(), atol=2e-4)
    # the student trains on the teacher's renormalised top-K at every position
    targets = np.array([[t for t, _ in e] for e in top[1:]], dtype=np.int64)  # [N, K], N = P - 1
    w = torch.softmax(torch.tensor([[lp for _, lp in e] for e in top[1:]]), -1).numpy().astype(np.float32)
    tc = client.create_lora_training_client(base_model=BASE, rank=4, seed=7).result()
    d = types.Datum(model_input=types.ModelInput.from_ints(ids[:-1]),
                    loss_fn_inputs={"target_tokens": targets, "weights": w})
    out = tc.forward_backward([d], "cross_entropy").result()
    lp = out.loss_fn_outputs[0]["logprobs"].to_numpy()
    assert lp.shape == (len(ids) - 1, k)
    np.testing.assert_allclose(lp, ref.values.numpy(), atol=2e-4)  # a fresh adapter (B = 0) is the base
    np.testing.assert_allclose(out.loss_fn_outputs[0]["elementwise_loss"].to_numpy(), -(w * lp).sum(-1), rtol=1e-4)
    assert tc.optim_step(types.AdamParams(learning_rate=1e-3)).result().metrics["grad_norm"] > 0


def test_sample_logprobs_equal_a_forward_of_the_sampled_tokens(server, client, reference, capsys):
    base_path, tok = reference
    tc = client.create_lora_training_client(base_model=BASE, rank=4, seed=3).result()
    prompt = tok.encode("Count: one, two, three,")
    tc.forward_backward([_datum(prompt)], "cross_entropy").result()
    tc.optim_step(types.AdamParams(learning_rate=1e-2)).result()
    sampler = tc.save_weights_and_get_sampling_client().result()
    params = types.SamplingParams(max_tokens=6, temperature=1.0, seed=7, stop=[])
    res = sampler.sample(types.ModelInput.from_ints(prompt), 2, params).result()
    again = sampler.sample(types.ModelInput.from_ints(prompt), 2, params).result()
    assert [s.tokens for s in res.sequences] == [s.tokens for s in again.sequences]  # seeded
    for seq in res.sequences:
        assert len(seq.tokens) == 6 and seq.stop_reason == "length"
        full = prompt + seq.tokens
        fwd = tc.forward([_datum(full)], "cross_entropy").result().loss_fn_outputs[0]["logprobs"].to_numpy()
        np.testing.assert_allclose(seq.logprobs, fwd[-6:], atol=2e-4)
        scored = sampler.compute_logprobs(types.ModelInput.from_ints(full)).result()
        assert scored[0] is None
        np.testing.assert_allclose(scored[1:], fwd, atol=2e-4)
    # the sampler checkpoint is a peft adapter directory with a card that transformers + peft read
    path = tc.save_weights_for_sampler("named").result().path
    d = _local(server, path)
    assert (d / "README.md").is_file() and (d / "plainrl_base.json").is_file()
    model = _peft(base_path, d)
    np.testing.assert_allclose(_logps(model, prompt).detach().numpy(),
                               tc.forward([_datum(prompt)], "cross_entropy").result()
                               .loss_fn_outputs[0]["logprobs"].to_numpy(), atol=2e-4)
    # ... and a plainrl run directory (config.yaml + final/) that `plainrl export --merge` merges
    from transformers import AutoModelForCausalLM

    from plainrl.run.export import export_merged

    merged = AutoModelForCausalLM.from_pretrained(str(export_merged(d.parent, d.parent.parent / "merged")),
                                                  dtype=torch.float32)
    np.testing.assert_allclose(_logps(merged, prompt).detach().numpy(), _logps(model, prompt).detach().numpy(),
                               atol=2e-4)
    from plainrl.cli import main

    capsys.readouterr()
    assert main(["eval", str(d.parent), "data.eval_size=2", "eval.max_new_tokens=4"]) == 0
    evaluated = capsys.readouterr().out
    assert '"eval/n": 2' in evaluated and str(d) in evaluated
    from_path = client.create_sampling_client(model_path=path)
    np.testing.assert_allclose(from_path.compute_logprobs(types.ModelInput.from_ints(prompt)).result()[1:],
                               _logps(model, prompt).detach().numpy(), atol=2e-4)
    # saved again under the same name after a step: a sampler of that path samples the new weights
    tc.forward_backward([_datum(prompt)], "cross_entropy").result()
    tc.optim_step(types.AdamParams(learning_rate=1e-2)).result()
    assert tc.save_weights_for_sampler("named").result().path == path
    now = tc.forward([_datum(prompt)], "cross_entropy").result().loss_fn_outputs[0]["logprobs"].to_numpy()
    np.testing.assert_allclose(client.create_sampling_client(model_path=path).compute_logprobs(
        types.ModelInput.from_ints(prompt)).result()[1:], now, atol=2e-4)
    assert np.abs(now - _logps(model, prompt).detach().numpy()).max() > 1e-3
    base_sampler = client.create_sampling_client(base_model=BASE)
    assert base_sampler.compute_logprobs(types.ModelInput.from_ints(prompt)).result()[0] is None


def test_bad_input_is_a_4xx_naming_the_field(client, reference):
    _, tok = reference
    ids = tok.encode("Hello there, friend.")
    with pytest.raises(tinker.BadRequestError, match="base_model='no/such-model'"):
        client.create_lora_training_client(base_model="no/such-model", rank=4).result()
    tc = client.create_lora_training_client(base_model=BASE, rank=4, seed=4).result()
    with pytest.raises(tinker.BadRequestError, match="outside the vocabulary"):
        tc.forward_backward([_datum([ids[0], 10**7, ids[1]])], "cross_entropy").result()
    with pytest.raises(tinker.BadRequestError, match=r"loss_fn_inputs\['weights'\]: shape"):
        tc.forward_backward([_datum(ids, weights=np.ones(2))], "cross_entropy").result()
    with pytest.raises(tinker.BadRequestError, match=r"loss_fn='dro' needs loss_fn_config \['beta'\]"):
        tc.forward_backward([_datum(ids, advantages=np.ones(len(ids) - 1, dtype=np.float32),
                                    logprobs=np.zeros(len(ids) - 1, dtype=np.float32))], "dro").result()
    with pytest.raises(tinker.BadRequestError, match="advantages"):
        tc.forward_backward([_datum(ids)], "ppo").result()
    with pytest.raises(tinker.BadRequestError, match="over the model's context of 8192"):
        tc.forward([_datum(ids[:1] * 8194)], "cross_entropy").result()
    with pytest.raises(tinker.NotFoundError, match="no checkpoint"):
        client.create_training_client_from_state("tinker://nobody:train:0/weights/none").result()
    sampler = client.create_sampling_client(base_model=BASE)
    with pytest.raises(tinker.BadRequestError, match="context"):
        sampler.sample(types.ModelInput.from_ints(ids), 1, types.SamplingParams(max_tokens=10**6)).result()
    # nothing was lost: the client trains on
    out = tc.forward_backward([_datum(ids)], "cross_entropy").result()
    assert np.isfinite(out.metrics["loss:sum"])
    assert tc.optim_step(types.AdamParams(learning_rate=1e-4)).result().metrics["skipped"] == 0.0


def test_forward_backward_custom_runs_as_cross_entropy_weights(client, reference):
    _, tok = reference
    ids = tok.encode("Two plus two is four.")
    tc = client.create_lora_training_client(base_model=BASE, rank=4, seed=5).result()

    def neg_sum_sq(data, logprobs_list):  # C = sum(lp^2): dC/dlp = 2 lp, sent as weights -2 lp
        loss = sum((lp ** 2).sum() for lp in logprobs_list)
        return loss, {"custom:sum": float(loss)}

    out = tc.forward_backward_custom([_datum(ids)], neg_sum_sq).result()
    lp = tc.forward([_datum(ids)], "cross_entropy").result().loss_fn_outputs[0]["logprobs"].to_numpy()
    assert out.metrics["loss:sum"] == pytest.approx(float((lp ** 2).sum()), rel=1e-4)
    # the backward pass was the surrogate sum(-w * lp) with w = -2 lp, i.e. sum(2 lp^2)
    assert out.metrics["surrogate_loss:sum"] == pytest.approx(float(2 * (lp ** 2).sum()), rel=1e-4)


@pytest.mark.e2e
@pytest.mark.parametrize("script, args", [("tinker_sl.py", ["--steps", "2", "--batch-size", "2", "--rank", "4"]),
                                          ("tinker_rl.py", ["--steps", "1", "--problems", "2", "--group-size", "2",
                                                            "--max-tokens", "4", "--rank", "4"])])
def test_examples_run_against_the_service(server, script, args, monkeypatch, capsys):
    import runpy

    # run as `python examples/SCRIPT ...` runs it (as __main__), in this process: a client needs no interpreter of its own
    monkeypatch.setattr(sys, "argv", [str(REPO / "examples" / script), "--base-url", server[0], "--model", BASE, *args])
    runpy.run_path(str(REPO / "examples" / script), run_name="__main__")
    assert "step 0:" in capsys.readouterr().out


@pytest.mark.parametrize("overrides, match", [
    (["rollout.engine=vllm"], "not with vLLM in its own process"),
    (["rollout.engine=remote", "rollout.remote.backend=openai", "rollout.remote.urls=[http://127.0.0.1:9]"],
     "read-only"),
])
def test_an_engine_that_cannot_take_the_adapters_is_refused_before_the_model_loads(overrides, match):
    from plainrl.config import ConfigError, load_config
    from plainrl.tinker.server import build_service

    cfg = load_config(None, ["data.task=arithmetic", "rewards=[{fn: 'plainrl.rewards.builtins:correctness'}]",
                             *overrides])
    with pytest.raises(ConfigError, match=match):
        build_service(cfg)
