"""On-policy distillation: the math on hand-computed tensors, the teacher's scores against a plain
transformers forward, the checks before any model loads, and short runs (teacher: self is the
student at step 0; the reverse KL to a fixed teacher falls; exact resume)."""

from __future__ import annotations

import json
import math

import pytest
import torch
from transformers import AutoTokenizer

from conftest import REPO, Preempted, preempt_after_checkpoint, tiny_overrides
from plainrl.algorithms.distill import mix_advantages, reverse_kl_advantages, topk_generalized_jsd, with_tail
from plainrl.config import ConfigError, load_config
from plainrl.data.rows import DataError

EXAMPLE = REPO / "examples" / "arithmetic_grpo.yaml"


# -- the math ---------------------------------------------------------------------------------------

def test_reverse_kl_advantage_is_teacher_minus_behaviour_on_the_mask():
    teacher = torch.tensor([[-0.5, -1.0, -2.0], [-0.1, float("nan"), 0.0]])
    behaviour = torch.tensor([[-1.0, -1.0, -0.5], [-0.3, -0.2, float("inf")]])
    mask = torch.tensor([[1, 1, 1], [1, 0, 0]])
    adv = reverse_kl_advantages(teacher, behaviour, mask)
    # by hand: -0.5 - -1.0 = 0.5; -1 - -1 = 0; -2 - -0.5 = -1.5; -0.1 - -0.3 = 0.2; off the mask 0 (even NaN/inf)
    assert torch.allclose(adv, torch.tensor([[0.5, 0.0, -1.5], [0.2, 0.0, 0.0]]))


def test_mix_broadcasts_the_sequence_advantage_and_weights_both():
    distill = torch.tensor([[0.5, -1.0], [2.0, 0.0]])
    reward = torch.tensor([1.0, -1.0])
    mask = torch.tensor([[1, 1], [1, 0]])
    out = mix_advantages(distill, reward, mask, distill_coef=2.0, reward_coef=0.5)
    # 2*0.5 + 0.5*1 = 1.5; 2*-1 + 0.5 = -1.5; 2*2 + 0.5*-1 = 3.5; masked 0
    assert torch.allclose(out, torch.tensor([[1.5, -1.5], [3.5, 0.0]]))
    # a zero weight adds nothing even where its term is not finite
    nan_reward = torch.tensor([float("nan"), 0.0])
    assert torch.allclose(mix_advantages(distill, nan_reward, mask, distill_coef=1.0, reward_coef=0.0),
                          torch.tensor([[0.5, -1.0], [2.0, 0.0]]))
    with pytest.raises(ValueError, match="must be >= 0"):
        mix_advantages(distill, reward, mask, distill_coef=-1.0, reward_coef=1.0)


def test_tail_class_holds_the_rest_of_the_mass():
    lp = torch.log(torch.tensor([[0.5, 0.2]]))
    out = with_tail(lp).exp()
    assert torch.allclose(out, torch.tensor([[0.5, 0.2, 0.3]]), atol=1e-6)


def test_topk_generalized_jsd_by_hand():
    # teacher over its top-2 + rest: (0.5, 0.3 | 0.2); student: (0.25, 0.25 | 0.5)
    t = torch.log(torch.tensor([0.5, 0.3]))
    s = torch.log(torch.tensor([0.25, 0.25]))
    T, S = [0.5, 0.3, 0.2], [0.25, 0.25, 0.5]
    fwd = sum(p * math.log(p / q) for p, q in zip(T, S))  # KL(T || S)
    rev = sum(q * math.log(q / p) for p, q in zip(T, S))  # KL(S || T)
    assert topk_generalized_jsd(s, t, 0.0).item() == pytest.approx(fwd, rel=1e-5)
    assert topk_generalized_jsd(s, t, 1.0).item() == pytest.approx(rev, rel=1e-5)
    beta = 0.5
    M = [beta * p + (1 - beta) * q for p, q in zip(T, S)]
    jsd = beta * sum(p * math.log(p / m) for p, m in zip(T, M)) + (1 - beta) * sum(
        q * math.log(q / m) for q, m in zip(S, M))
    assert topk_generalized_jsd(s, t, beta).item() == pytest.approx(jsd, rel=1e-5)
    # equal distributions: 0; the gradient reaches the student only
    s2 = t.clone().requires_grad_(True)
    assert topk_generalized_jsd(s2, t, 0.3).item() == pytest.approx(0.0, abs=1e-7)
    with pytest.raises(ValueError, match="beta"):
        topk_generalized_jsd(s, t, 1.5)


def test_generalized_jsd_moves_from_forward_to_reverse_kl_across_beta():
    # the same T, S over top-2 + rest as above, in plain Python
    t = torch.log(torch.tensor([0.5, 0.3]))
    s = torch.log(torch.tensor([0.25, 0.25]))
    T, S = [0.5, 0.3, 0.2], [0.25, 0.25, 0.5]

    def kl(p, q):
        return sum(a * math.log(a / b) for a, b in zip(p, q))

    fwd, rev = kl(T, S), kl(S, T)  # 0.2180..., 0.2393...
    for beta in (0.1, 0.25, 0.9):
        M = [beta * a + (1 - beta) * b for a, b in zip(T, S)]
        by_hand = (1 - beta) * kl(T, M) + beta * kl(S, M)
        assert topk_generalized_jsd(s, t, beta).item() == pytest.approx(by_hand, rel=1e-5)
    # continuous at both ends: the interior tends to the endpoint branches, not to 0
    assert topk_generalized_jsd(s, t, 1e-4).item() == pytest.approx(fwd, rel=2e-3)
    assert topk_generalized_jsd(s, t, 1 - 1e-4).item() == pytest.approx(rev, rel=2e-3)
    # beta = 0.9 carries most of beta = 1's signal (the coefficient-matched form gave ~1/15 of it)
    assert topk_generalized_jsd(s, t, 0.9).item() > 0.5 * rev
    # and its gradient on the student is of the reverse KL's size and direction
    g = {}
    for beta in (0.9, 1.0):
        x = s.clone().requires_grad_(True)
        topk_generalized_jsd(x, t, beta).backward()
        g[beta] = x.grad
    assert torch.nn.functional.cosine_similarity(g[0.9], g[1.0], dim=0).item() > 0.95
    assert g[0.9].norm().item() > 0.5 * g[1.0].norm().item()


def test_mass_moved_off_the_top_k_is_penalised():
    # renormalising over the top-k would call these equal; the tail class does not
    t = torch.log(torch.tensor([0.6, 0.3]))
    s = torch.log(torch.tensor([0.06, 0.03]))  # the same shape over the k, 90% of the mass elsewhere
    assert topk_generalized_jsd(s, t, 0.0).item() > 1.0


# -- the config ------------------------------------------------------------------------------------

def test_opd_needs_a_teacher_and_no_reward(tiny_model_dir, tmp_path):
    over = tiny_overrides(tiny_model_dir, tmp_path / "r") + ["algorithm.name=opd", "rewards=[]"]
    with pytest.raises(ConfigError, match="needs a teacher"):
        load_config(EXAMPLE, over)
    cfg = load_config(EXAMPLE, over + ["algorithm.teacher=self", "rollout.group_size=1"])
    assert cfg.algorithm.reward_coef == 0 and cfg.algorithm.distill_coef == 1 and cfg.algorithm.needs_reference
    with pytest.raises(ConfigError, match="distill_coef=0 gives it no weight"):
        load_config(EXAMPLE, tiny_overrides(tiny_model_dir, tmp_path / "r") + ["algorithm.teacher=self"])


def test_a_teacher_with_another_tokenizer_is_refused_before_loading(tiny_model_dir, tmp_path, tokenizer,
                                                                   monkeypatch):
    from transformers import AutoTokenizer

    import plainrl.run.setup as run_setup

    other = tmp_path / "other"
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    tok.add_tokens(["<not-in-the-student>"])
    tok.save_pretrained(other)  # a tokenizer only: any model load would fail on it
    loaded = []
    monkeypatch.setattr(run_setup, "load_policy", lambda *a, **k: loaded.append(1))
    cfg = load_config(EXAMPLE, tiny_overrides(tiny_model_dir, tmp_path / "r") + [
        "algorithm.name=opd", f"algorithm.teacher={{name: {other}}}"])
    with pytest.raises(ConfigError, match=f"algorithm.teacher.name='{other}' has another tokenizer than model.name"):
        run_setup.setup(cfg)
    assert not loaded


def test_teacher_context_placeholder_is_checked_before_loading(tiny_model_dir, tmp_path):
    import plainrl.run.setup as run_setup
    from plainrl.data.rows import DataError

    cfg = load_config(EXAMPLE, tiny_overrides(tiny_model_dir, tmp_path / "r") + [
        "algorithm.name=opd", "algorithm.teacher=self", "algorithm.teacher_context='Solution: {solution}'"])
    with pytest.raises(DataError, match="algorithm.teacher_context.*solution"):
        run_setup.setup(cfg)


def _prompt_data(rows):
    from plainrl.data.loading import PromptData, PromptRow

    return PromptData(train=[PromptRow(row=r, prompt_ids=[1], source_index=i) for i, r in enumerate(rows)], eval=[])


def test_every_rows_teacher_prompt_is_checked_against_the_context(tiny_model_dir, tmp_path, tokenizer):
    from plainrl.run.teacher import check_teacher

    rows = [{"prompt": "1 + 1?", "solution": "2"}, {"prompt": "2 + 2?", "solution": "4"},
            {"prompt": "3 + 3?", "solution": "six " * 300}]  # only the last row's teacher prompt is too long
    over = tiny_overrides(tiny_model_dir, tmp_path / "r") + [
        "algorithm.name=opd", "algorithm.teacher=self", "algorithm.teacher_context='Solution: {solution}'",
        "model.max_context=256", "rollout.max_new_tokens=32"]
    with pytest.raises(ConfigError, match="row 2.*over the budget of 224 prompt tokens"):
        check_teacher(load_config(EXAMPLE, over), tokenizer, _prompt_data(rows))
    data = _prompt_data(rows)
    check_teacher(load_config(EXAMPLE, over + ["data.on_invalid=drop"]), tokenizer, data)
    assert [r.source_index for r in data.train] == [0, 1] and data.dropped.total == 1
    # a placeholder only a later row lacks is found too
    with pytest.raises(DataError, match="training row 1: .*algorithm.teacher_context.*solution"):
        check_teacher(load_config(EXAMPLE, over), tokenizer, _prompt_data([rows[0], {"prompt": "x"}]))


def test_the_teacher_has_its_own_chat_template_and_system_prompt(tiny_model_dir, tmp_path, tokenizer):
    from transformers import AutoTokenizer

    from plainrl.data.prompts import teacher_prompt_ids
    from plainrl.run.teacher import teacher_prompt_args

    jinja = "{% for m in messages %}<{{ m.role }}>{{ m.content }}\n{% endfor %}<assistant>"
    teacher_dir = tmp_path / "teacher"
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    tok.chat_template = jinja
    tok.save_pretrained(teacher_dir)  # the same vocabulary, another chat template
    row = {"prompt": "What is 1 + 1?", "solution": "2"}
    base = tiny_overrides(tiny_model_dir, tmp_path / "r") + ["algorithm.name=opd", "data.system_prompt=Be brief.",
                                                          "data.prompt_template='{prompt}'"]
    want = tokenizer("<system>Be exact.\n<user>What is 1 + 1?\n<assistant>", add_special_tokens=False)["input_ids"]
    for template in ("teacher", jinja):
        cfg = load_config(EXAMPLE, base + [f"algorithm.teacher={{name: {teacher_dir}}}",
                                           "algorithm.teacher.system='Be exact.'"])
        cfg.algorithm.teacher.template = template
        got = teacher_prompt_ids(row, tokenizer, **teacher_prompt_args(cfg, tokenizer))
        assert got == want, tokenizer.decode(got)
    # teacher_context appends to the user message under the teacher's template; "" drops the system prompt
    cfg.algorithm.teacher.system = ""
    cfg.algorithm.teacher_context = "Solution: {solution}"
    assert teacher_prompt_ids(row, tokenizer, **teacher_prompt_args(cfg, tokenizer)) == tokenizer(
        "<user>What is 1 + 1?\n\nSolution: 2\n<assistant>", add_special_tokens=False)["input_ids"]
    # unset, the teacher's prompt is the student's (data.system_prompt, the policy's template)
    from plainrl.data.prompts import build_prompt_ids

    plain = load_config(EXAMPLE, base + [f"algorithm.teacher={{name: {teacher_dir}}}"])
    assert teacher_prompt_ids(row, tokenizer, **teacher_prompt_args(plain, tokenizer)) == build_prompt_ids(
        row, tokenizer, system_prompt="Be brief.")
    with pytest.raises(ConfigError, match="template=teacher.*remote"):
        load_config(EXAMPLE, base + ["algorithm.teacher={remote: {urls: ['http://127.0.0.1:1']}, template: teacher}"])


# -- the teacher's scores ----------------------------------------------------------------------------

def _episodes(tokenizer, n=3):
    from plainrl.types import Episode

    g = torch.Generator().manual_seed(0)
    eps = []
    for i in range(n):
        prompt = tokenizer(f"What is {i} + {i}?")["input_ids"]
        comp = torch.randint(0, len(tokenizer), (5 + i,), generator=g).tolist()
        mask = [1] * len(comp)
        mask[1] = 0  # an observation token: not scored
        eps.append(Episode(sample_id=str(i), group=i, row={"prompt": "x"}, prompt_ids=prompt, completion_ids=comp,
                           logprobs=[-1.0] * len(comp), loss_mask=mask, finish_reason="stop"))
    return eps


@pytest.fixture()
def learner_of(tiny_model_dir):
    from plainrl.config import AlgorithmConfig, ModelConfig, TrainConfig
    from plainrl.models import load_policy
    from plainrl.train import Learner

    def make(lora=True):
        model = load_policy(ModelConfig(name=str(tiny_model_dir), dtype="float32", lora={"enabled": lora}),
                            torch.device("cpu"))
        return model, Learner(model, AlgorithmConfig(), TrainConfig(micro_batch_tokens=32), pad_id=0,
                              temperature=1.0, completion_budget=16, copy_reference=not lora)
    return make


def _plain_logps(model_dir, episodes, k=0):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    out, top = [], []
    with torch.no_grad():
        for e in episodes:
            ids = torch.tensor([e.prompt_ids + e.completion_ids])
            logp = torch.log_softmax(model(ids).logits[0, :-1].float(), -1)[len(e.prompt_ids) - 1:]  # [L, V]
            out.append(logp.gather(-1, torch.tensor(e.completion_ids)[:, None]).squeeze(-1) * torch.tensor(e.loss_mask))
            top.append(logp.topk(k, -1) if k else None)
    return out, top


def test_separate_teacher_scores_equal_a_transformers_forward(learner_of, tiny_model_dir, tmp_path, tokenizer):
    from transformers import LlamaForCausalLM

    from plainrl.config import ModelConfig
    from plainrl.config.algorithm import TeacherConfig
    from plainrl.train.teacher import load_teacher_model, make_teacher

    torch.manual_seed(1)  # another random model of the same family: the teacher
    teacher_dir = tmp_path / "teacher"
    LlamaForCausalLM(LlamaForCausalLM.from_pretrained(tiny_model_dir).config).save_pretrained(teacher_dir)
    tokenizer.save_pretrained(teacher_dir)
    model, learner = learner_of()
    tm = load_teacher_model(TeacherConfig(name=str(teacher_dir)), ModelConfig(name=str(tiny_model_dir), dtype="float32"),
                            torch.device("cpu"))
    eps = _episodes(tokenizer)
    scores = make_teacher(learner, model, "model", teacher_model=tm, topk=4).score(eps)
    want, top = _plain_logps(teacher_dir, eps, k=4)
    for i, e in enumerate(eps):
        n = len(e.completion_ids)
        assert torch.allclose(scores.logprobs[i, :n], want[i], atol=1e-5)
        on = torch.tensor(e.loss_mask, dtype=torch.bool)
        assert torch.equal(scores.topk[0][i, :n][on], top[i].indices[on])
        assert torch.allclose(scores.topk[1][i, :n][on], top[i].values[on], atol=1e-5)
    # the student's own scores differ (a real test: the teacher is another model)
    assert not torch.allclose(learner.completion_logps(eps), scores.logprobs, atol=1e-3)


def test_adapter_teacher_shares_the_base_and_equals_the_merged_model(learner_of, tiny_model_dir, tmp_path, tokenizer):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from plainrl.models import load_frozen_adapter
    from plainrl.train.teacher import TEACHER_ADAPTER, make_teacher

    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    torch.manual_seed(2)
    peft = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], init_lora_weights=False))
    adapter = tmp_path / "adapter"
    peft.save_pretrained(adapter)
    merged = tmp_path / "merged"
    peft.merge_and_unload().save_pretrained(merged)
    tokenizer.save_pretrained(merged)

    model, _ = learner_of()
    load_frozen_adapter(model, adapter, TEACHER_ADAPTER)
    from plainrl.config import AlgorithmConfig, TrainConfig
    from plainrl.train import Learner

    learner = Learner(model, AlgorithmConfig(), TrainConfig(micro_batch_tokens=32), pad_id=0, temperature=1.0,
                      completion_budget=16, copy_reference=False)
    eps = _episodes(tokenizer)
    before = learner.completion_logps(eps)
    scores = make_teacher(learner, model, "adapter").score(eps)
    want, _ = _plain_logps(merged, eps)
    for i, e in enumerate(eps):
        assert torch.allclose(scores.logprobs[i, : len(e.completion_ids)], want[i], atol=1e-5)
    assert torch.equal(learner.completion_logps(eps), before)  # the trained adapter is active again
    assert not any(p.requires_grad for n, p in model.named_parameters() if TEACHER_ADAPTER in n)


# -- runs ----------------------------------------------------------------------------------------------

def _rows(run_dir):
    return [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_self_teacher_is_the_student_at_step_zero(tiny_model_dir, tmp_path):
    from plainrl.run.loop import train

    cfg = load_config(EXAMPLE, tiny_overrides(tiny_model_dir, tmp_path / "r") + [
        "algorithm.name=opd", "algorithm.teacher=self", "rewards=[]", "train.steps=1", "rollout.temperature=0.7",
        "log.rollouts_per_step=4", "eval.before=false", "eval.after=false"])
    run_dir = train(cfg)
    row = next(r for r in _rows(run_dir) if "distill/reverse_kl" in r)
    assert abs(row["distill/reverse_kl"]) < 1e-5
    assert row["distill/teacher_logprob"] < 0 and "time/teacher" in row
    recs = [json.loads(x) for x in (run_dir / "rollouts.jsonl").read_text().splitlines()]
    assert recs and all(abs(r["advantage"]) < 1e-5 and r["teacher_logprob"] < 0 for r in recs)


def _fixed_teacher_cfg(tiny_model_dir, tmp_path, run_dir, *extra):
    """The tiny student; its teacher the same model with the final norm scaled (another
    distribution, the same preferences), a separate model."""
    from transformers import AutoModelForCausalLM

    teacher = tmp_path / "sharp-teacher"
    if not teacher.exists():
        model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
        with torch.no_grad():
            model.model.norm.weight.mul_(4.0)
        model.save_pretrained(teacher)
        AutoTokenizer.from_pretrained(tiny_model_dir).save_pretrained(teacher)
    return load_config(EXAMPLE, tiny_overrides(tiny_model_dir, run_dir) + [
        "algorithm.name=opd", f"algorithm.teacher={{name: {teacher}}}", "rewards=[]",
        "train.lr=1e-2", "rollout.group_size=4", "rollout.prompts_per_step=2", "rollout.max_new_tokens=8",
        "eval.before=false", "eval.after=false", *extra])


def _exact_reverse_kl(student, teacher, student_ids, teacher_ids) -> float:
    """KL(student || teacher) over the whole vocabulary at the next position."""
    with torch.no_grad():
        s = torch.log_softmax(student(torch.tensor([student_ids])).logits[0, -1].float(), -1)
        t = torch.log_softmax(teacher(torch.tensor([teacher_ids])).logits[0, -1].float(), -1)
    return float((s.exp() * (s - t)).sum())


@pytest.mark.parametrize("loss", ["reverse_kl", "gkd_topk"])
def test_distillation_lowers_the_reverse_kl(loss, tokenizer):
    """The real model: the student answers a question, the teacher is the model as it starts shown
    an instruction the student never sees. 64 one-token completions sampled from the student per
    update; after each update the exact reverse KL at that position (the whole vocabulary) is
    lower. (On a tiny random model the per-token estimate's noise over a near-uniform 49k-token
    vocabulary hides the signal; a real model's peaked distribution does not.)"""
    from plainrl.algorithms.estimators import Advantages, with_teacher
    from plainrl.config import AlgorithmConfig, ModelConfig, TrainConfig
    from plainrl.frames import completion_frame
    from plainrl.models import load_policy
    from plainrl.train import Learner
    from plainrl.train.teacher import make_teacher
    from plainrl.types import Episode

    torch.manual_seed(0)
    model = load_policy(ModelConfig(dtype="float32", lora={"enabled": True, "r": 8, "alpha": 16}), torch.device("cpu"))
    algo = AlgorithmConfig(name="opd", teacher="self", correction={"methods": []}, distill_loss=loss,
                           distill_topk=64, distill_beta=1.0)
    learner = Learner(model, algo, TrainConfig(lr=3e-4, warmup_steps=0, max_grad_norm=1.0), pad_id=0,
                      temperature=1.0, completion_budget=1, copy_reference=False)
    chat = lambda text: tokenizer.apply_chat_template([{"role": "user", "content": text}],  # noqa: E731
                                                      add_generation_prompt=True, tokenize=True)["input_ids"]
    question = "Name a fruit."
    prompt, teacher_prompt = chat(question), chat(question + "\n\nAnswer with the single word: Banana.")
    teacher = make_teacher(learner, model, "reference", topk=64 if loss == "gkd_topk" else 0,
                           prompt_ids=lambda e: teacher_prompt)
    g = torch.Generator().manual_seed(0)

    def kl() -> float:
        with learner.reference_context():
            ref_logits = model(torch.tensor([teacher_prompt])).logits[0, -1].detach()
        with torch.no_grad():
            s = torch.log_softmax(model(torch.tensor([prompt])).logits[0, -1].float(), -1)
        t = torch.log_softmax(ref_logits.float(), -1)
        return float((s.exp() * (s - t)).sum())

    kls = [kl()]
    for _ in range(3):
        with torch.no_grad():
            logp = torch.log_softmax(model(torch.tensor([prompt])).logits[0, -1].float(), -1)
        ys = torch.multinomial(logp.exp(), 64, replacement=True, generator=g).tolist()
        eps = [Episode(sample_id=str(i), group=0, row={}, prompt_ids=prompt, completion_ids=[y],
                       logprobs=[float(logp[y])], loss_mask=[1], finish_reason="length") for i, y in enumerate(ys)]
        frame = completion_frame(eps)
        scores = teacher.score(eps)
        adv = with_teacher(Advantages(torch.zeros(len(eps)), None), eps, frame, scores.logprobs, distill_loss=loss,
                           distill_coef=1.0, reward_coef=0.0)
        learner.update(eps, adv.advantages, scores.topk)
        kls.append(kl())
    assert kls[0] > 0.5, kls  # the instruction moves the teacher: a real signal to learn
    assert all(b < a for a, b in zip(kls, kls[1:])), kls
    assert kls[-1] < 0.8 * kls[0], kls


@pytest.mark.parametrize("loss", ["reverse_kl", "gkd_topk"])
def test_distillation_resumes_exactly(tiny_model_dir, tmp_path, monkeypatch, loss):
    import plainrl.run.loop as loop
    import plainrl.run.setup as run_setup

    extra = ["train.steps=4", "checkpoint.every=2", "log.tensorboard=false", f"algorithm.distill_loss={loss}",
             "algorithm.distill_topk=4"]
    full = loop.train(_fixed_teacher_cfg(tiny_model_dir, tmp_path, tmp_path / "full", *extra))
    real_save = preempt_after_checkpoint(monkeypatch, run_setup, step=2)
    cut = tmp_path / "cut"
    with pytest.raises(Preempted):
        loop.train(_fixed_teacher_cfg(tiny_model_dir, tmp_path, cut, *extra))
    monkeypatch.setattr(run_setup, "save_checkpoint", real_save)
    loop.train(_fixed_teacher_cfg(tiny_model_dir, tmp_path, cut, *extra))

    def strip(rows):
        return [{k: v for k, v in r.items() if not k.startswith(("time/", "system/", "perf/"))} for r in rows]
    assert strip(_rows(cut)) == strip(_rows(full))
    assert (cut / "rollouts.jsonl").read_text() == (full / "rollouts.jsonl").read_text()


def test_two_rank_distillation_equals_one_process(two_rank_updates):
    """Under torchrun (gloo, DDP and FSDP2) each rank scores its share of the samples with the
    teacher and the GKD term joins the loss: the update equals the one-process update (the case
    rides on the session's launch of tests/dist_update.py: tests/conftest.py::two_rank_updates)."""
    from test_distributed import assert_updates_equal

    results = two_rank_updates
    assert results[("gkd", "single")]["stats"]["teacher_logps_sum"] < 0
    assert_updates_equal(results, ("gkd",))
