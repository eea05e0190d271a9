"""The algorithm family as configuration: presets, advantage dispatch, DAPO's sampling and
shaping, several passes over a rollout batch, the PPO critic. (Every preset also runs end
to end through its example in tests/test_loop.py.)"""

import json
import shutil
from typing import get_args

import pytest
import torch

import plainrl.train.learner as learner_mod
import plainrl.run.loop as loop
import plainrl.run.setup as run_setup
from conftest import REPO, Preempted, preempt_after_checkpoint, tiny_overrides
from plainrl.config import (
    OFFLINE_ALGORITHMS, PRESETS, AdvantageEstimator, AlgorithmConfig, AlgorithmName, ConfigError, dump_config,
    load_config,
)
from plainrl.algorithms.estimators import ADVANTAGE_ESTIMATORS, compute_advantages
from plainrl.checkpoint import CheckpointError
from plainrl.frames import completion_frame
from plainrl.rewards import score_episodes
from plainrl.run.setup import advantage_params, make_learner
from plainrl.rewards import build_reward_fns
from plainrl.run.collect import dynamic_sampling, shape_overlong
from plainrl.types import Episode
from test_engine_learner import _episodes

DATA = REPO / "tests" / "data"
RL = ["data.task=arithmetic", "rewards=[{fn: plainrl.rewards.builtins:correctness}]"]
OFFLINE = [f"data.path={DATA / 'sft_mini.jsonl'}"]


def _cfg(name: str, *extra: str):
    return load_config(None, (OFFLINE if name in OFFLINE_ALGORITHMS else RL) + [f"algorithm.name={name}", *extra])


def _advantages(episodes, cfg, **kw):
    return compute_advantages(episodes, completion_frame(episodes).mask, advantage_params(cfg), **kw)


# ----------------------------------------------------------------------------- presets


def test_dispatch_tables_match_literals():
    assert set(PRESETS) == set(get_args(AlgorithmName))
    assert set(ADVANTAGE_ESTIMATORS) == set(get_args(AdvantageEstimator))
    from plainrl.train.offline import OBJECTIVES

    assert set(OBJECTIVES) == set(OFFLINE_ALGORITHMS)


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_preset_sets_its_defaults_and_the_saved_config_shows_them(name, tmp_path):
    cfg = _cfg(name, *(["algorithm.teacher=self"] if name == "opd" else []))  # opd needs a teacher
    for key, value in PRESETS[name].items():
        assert getattr(cfg.algorithm, key) == value, key
    saved = tmp_path / "config.yaml"
    saved.write_text(dump_config(cfg))
    assert load_config(saved) == cfg  # the resolved values reload to the same run


def test_explicit_values_win_over_the_preset():
    cfg = _cfg("dapo", "algorithm.clip_high=0.3", "algorithm.dynamic_sampling=false")
    assert cfg.algorithm.clip_high == 0.3 and cfg.algorithm.dynamic_sampling is False
    assert cfg.algorithm.overlong_buffer == 0.2 and cfg.algorithm.loss_agg == "token-mean"  # the rest of the preset
    ppo = _cfg("ppo", "algorithm.lam=1.0", "algorithm.kl_placement=loss")
    assert (ppo.algorithm.lam, ppo.algorithm.kl_placement, ppo.algorithm.advantage) == (1.0, "loss", "gae")
    # any knob on its own, on any preset: GRPO advantages with GSPO's sequence ratio
    mixed = _cfg("grpo", "algorithm.ratio_level=sequence", "algorithm.advantage=rloo")
    assert (mixed.algorithm.ratio_level, mixed.algorithm.advantage) == ("sequence", "rloo")


def test_configs_saved_before_presets_still_load():
    # norm_std: null meant "the preset's choice"
    assert AlgorithmConfig.model_validate({"name": "dr_grpo", "norm_std": None}).norm_std is False
    assert AlgorithmConfig.model_validate({"name": "grpo", "norm_std": None}).norm_std is True


@pytest.mark.parametrize("override, needles", [
    (RL + ["algorithm.name=grpo", "critic.lr=1e-3"], ["critic.lr=0.001", "algorithm.advantage=gae", "grpo"]),
    (RL + ["algorithm.mini_batches=64"], ["algorithm.mini_batches=64", "32 episodes"]),
    (RL + ["algorithm.name=ppo", "critic.warmup_steps=50"], ["critic.warmup_steps=50", "train.steps=50"]),
    (RL + ["algorithm.name=dapo", "rollout.group_size=1"], ["rollout.group_size=1", "dynamic sampling"]),
    (RL + ["algorithm.name=rloo", "rollout.group_size=1"], ["rollout.group_size=1", "'rloo'"]),
    (RL + ["algorithm.name=ppo2"], ["algorithm.name", "'ppo2'", "reinforce_pp"]),
    (RL + ["algorithm.kl_placement=advantage"], ["algorithm.kl_placement", "'loss'", "'reward'"]),
    (RL + ["algorithm.overlong_buffer=2"], ["algorithm.overlong_buffer", "less than or equal to 1"]),
    (["data.task=arithmetic", "algorithm.name=sft"], ["algorithm.name='sft'", "data.path"]),
    (OFFLINE + RL[1:] + ["algorithm.name=dpo"], ["rewards", "remove rewards"]),
    (OFFLINE + ["algorithm.name=rm", "algorithm.kl_coef=0.1"], ["algorithm.kl_coef", "reward model"]),
])
def test_bad_combinations_name_path_value_and_fix(override, needles):
    with pytest.raises(ConfigError) as e:
        load_config(None, override)
    for n in needles:
        assert n in str(e.value), (n, str(e.value))


def test_reinforce_pp_needs_no_groups():
    """REINFORCE++ normalises over the batch and PPO uses a critic, so one sample per prompt
    is valid for them; the group estimators refuse it."""
    for name, estimator in (("reinforce_pp", "reinforce_pp"), ("ppo", "gae")):
        cfg = load_config(None, RL + [f"algorithm.name={name}", "rollout.group_size=1"])
        assert cfg.rollout.group_size == 1 and cfg.algorithm.advantage == estimator
    for name in ("grpo", "rloo"):
        with pytest.raises(ConfigError, match="rollout.group_size>=2"):
            load_config(None, RL + [f"algorithm.name={name}", "rollout.group_size=1"])


# ----------------------------------------------------------------------------- advantages


def _scored(rewards, lengths=None, reasons=None, texts=None, answer="7"):
    eps = []
    for i, r in enumerate(rewards):
        n = lengths[i] if lengths else 3
        eps.append(Episode(sample_id=f"s{i}", group=i // 2, row={"answer": answer}, prompt_ids=[1, 2],
                           completion_ids=[5] * n, logprobs=[-1.0] * n, loss_mask=[1] * n,
                           finish_reason=reasons[i] if reasons else "eos",
                           completion_text=texts[i] if texts else "", reward=r))
    return eps


def test_token_level_estimators_give_token_advantages_and_zero_for_unscorable():
    cfg = _cfg("reinforce_pp", "rollout.group_size=2")
    eps = _scored([1.0, 0.0, None, 1.0], lengths=[2, 3, 3, 1])
    adv = _advantages(eps, cfg).advantages
    assert adv.shape == (4, 3)
    assert torch.equal(adv[2], torch.zeros(3)) and eps[2].advantage == 0.0
    assert adv[0, 2] == 0 and adv[3, 1:].eq(0).all()  # beyond each completion: 0
    # returns-to-go with gamma 1: every token of a rewarded row above every token of an unrewarded one
    assert adv[0, :2].min() > adv[1].max()


def test_kl_in_the_reward_lowers_sequence_rewards_by_the_summed_kl():
    from plainrl.algorithms import grpo_advantages

    cfg = _cfg("grpo", "algorithm.kl_coef=0.5", "algorithm.kl_placement=reward", "rollout.group_size=2")
    eps = _scored([1.0, 1.0, 0.0, 1.0])
    kl = torch.tensor([[0.2, 0.2, 0.2], [0.0, 0.0, 0.0], [0.0, 0.0, 0.0], [0.0, 0.0, 0.0]])
    adv = _advantages(eps, cfg, kl=kl).advantages
    # rewards 1 - 0.5 * 0.6 = 0.7 and 1: the equal-reward group becomes informative
    torch.testing.assert_close(adv, grpo_advantages(torch.tensor([0.7, 1.0, 0.0, 1.0]), 2))


def test_ppo_whitens_advantages_but_the_critic_gets_raw_returns():
    from plainrl.algorithms import gae, token_rewards

    cfg = _cfg("ppo", "algorithm.kl_coef=0", "rollout.group_size=2")
    assert cfg.algorithm.whiten_advantages  # the preset's default
    eps = _scored([1.0, 0.0, None, 1.0], lengths=[2, 3, 3, 1])
    values = torch.tensor([[0.5, 0.2, 9.0], [0.1, 0.3, 0.4], [0.0, 0.0, 0.0], [0.7, 9.0, 9.0]])
    out = _advantages(eps, cfg, values=values)
    mask = torch.tensor([[1, 1, 0], [1, 1, 1], [1, 1, 1], [1, 0, 0]])
    valid = torch.tensor([1, 1, 0, 1])[:, None]
    raw, returns = gae(token_rewards(torch.tensor([1.0, 0.0, 0.0, 1.0]), mask), values, mask * valid, gamma=1.0, lam=0.95)
    # the critic's targets are the lambda-returns A + V of the raw advantages
    torch.testing.assert_close(out.returns * (mask * valid), returns)
    # the policy's advantages are whitened over the scorable rows' loss tokens; the unscorable row is 0
    m = (mask * valid).bool()
    torch.testing.assert_close(out.advantages[m], (raw[m] - raw[m].mean()) / raw[m].std(unbiased=False))
    assert torch.equal(out.advantages[2], torch.zeros(3))
    unwhitened = _advantages(eps, _cfg("ppo", "algorithm.kl_coef=0", "rollout.group_size=2",
                                               "algorithm.whiten_advantages=false"), values=values)
    torch.testing.assert_close(unwhitened.advantages, raw)


def test_gae_without_a_critic_is_an_error():
    with pytest.raises(ValueError, match="critic values"):
        _advantages(_scored([1.0, 0.0]), _cfg("ppo"))


# ----------------------------------------------------------------------------- DAPO


def test_dynamic_sampling_keeps_informative_groups_until_full():
    reward = f"rewards=[{{fn: '{DATA / 'my_reward.py'}:contains_answer'}}]"
    fns = build_reward_fns(load_config(None, RL + [reward]).rewards)
    score = lambda batch: score_episodes(batch, fns)  # noqa: E731
    # contains_answer scores 1 when "7" is in the text: groups of 2
    batches = [
        _scored([None] * 4, texts=["7", "7", "7", "no"]),   # [equal, mixed]
        _scored([None] * 4, texts=["no", "7", "no", "no"]),  # [mixed, equal]
        _scored([None] * 4, texts=["7", "no", "7", "no"]),   # never drawn
    ]
    draws = iter(batches)
    eps, rewards_out, m = dynamic_sampling(lambda: next(draws), score, group_size=2, num_groups=2, max_tries=5)
    assert [e.completion_text for e in eps] == ["7", "no", "no", "7"]
    assert [e.group for e in eps] == [0, 0, 1, 1]
    assert m == {"sampling/tries": 2.0, "sampling/filtered_frac": 0.5, "sampling/kept_groups": 2.0}
    assert len(rewards_out.total) == 8  # every sample drawn is logged

    # the cap: one try, one informative group -> train on it alone
    draws = iter(batches)
    eps, _, m = dynamic_sampling(lambda: next(draws), score, group_size=2, num_groups=2, max_tries=1)
    assert len(eps) == 2 and m["sampling/kept_groups"] == 1.0
    # nothing informative at all: the last batch, whose advantages are all 0
    equal = iter([_scored([None] * 4, texts=["7", "7", "no", "no"])] * 2)
    eps, _, m = dynamic_sampling(lambda: next(equal), score, group_size=2, num_groups=2, max_tries=2)
    assert len(eps) == 4 and m["sampling/filtered_frac"] == 1.0


def test_overlong_shaping_and_filtering():
    # budget 10, overlong_buffer 0.2 -> L_cache 2: free up to 8 tokens; 9 -> -0.5; 10 -> -1
    cfg = AlgorithmConfig(name="dapo")
    eps = _scored([1.0, 1.0, 1.0, None], lengths=[8, 9, 10, 10], reasons=["eos", "eos", "length", "length"])
    m = shape_overlong(eps, cfg, budget=10)
    assert [e.reward for e in eps] == [1.0, 0.5, 0.0, None]
    assert eps[1].reward_parts["overlong"] == -0.5
    assert m["reward/overlong_penalty"] == pytest.approx(-0.5)
    assert [sum(e.loss_mask) for e in eps] == [8, 9, 0, 0]  # truncated: out of the loss
    assert m["response_length/filtered_frac"] == 0.5
    assert shape_overlong(eps, AlgorithmConfig(name="grpo"), budget=10) == {}


# ----------------------------------------------------------------------------- several passes


def _learner(tiny_model_dir, *extra):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    cfg = load_config(None, RL + ["model.lora.enabled=false", "train.lr=1e-2", "train.micro_batch_tokens=20",
                                  *extra])
    return make_learner(cfg, model, pad_id=0)


def _spy(monkeypatch):
    calls = []
    real = learner_mod.policy_loss

    def spy(logps, old, adv, mask, **kw):
        calls.append(dict(logps=logps.detach().clone(), old=old.clone(), mask=mask.clone(), **kw))
        return real(logps, old, adv, mask, **kw)

    monkeypatch.setattr(learner_mod, "policy_loss", spy)
    return calls


def test_ppo_epochs_recompute_old_logprobs_before_the_first_pass(tiny_model_dir, monkeypatch):
    learner = _learner(tiny_model_dir, "algorithm.ppo_epochs=2", "train.micro_batch_tokens=10000")
    calls = _spy(monkeypatch)
    stats = learner.update(_episodes(6), torch.tensor([1.0, -1.0, 0.5, -0.5, 2.0, -2.0]))
    assert stats.optimizer_steps == 2 and len(calls) == 2
    first, second = calls
    m = first["mask"] > 0
    # pass 1: pi_old is the learner's own (not the engine's 0.0 logprobs), so the ratio is 1
    torch.testing.assert_close(first["old"][m], first["logps"][m], atol=1e-6, rtol=0)
    assert not torch.equal(first["old"][m], torch.zeros_like(first["old"][m]))
    # pass 2: the same pi_old, a moved policy
    assert torch.equal(second["old"], first["old"])
    assert (second["logps"][m] - second["old"][m]).abs().max() > 1e-4
    assert stats.approx_kl > 0


def test_mini_batches_normalise_over_their_own_tokens(tiny_model_dir, monkeypatch):
    learner = _learner(tiny_model_dir, "algorithm.mini_batches=2", "algorithm.loss_agg=token-mean")
    calls = _spy(monkeypatch)
    eps = _episodes(6)
    stats = learner.update(eps, torch.tensor([1.0, -1.0, 0.5, -0.5, 2.0, -2.0]))
    assert stats.optimizer_steps == 2 and len(calls) == stats.micro_batches
    assert all(c["num_seqs"] == 3 for c in calls)  # each optimiser step: half the episodes
    # the micro-batches of one optimiser step pass that mini-batch's token total, in sequence
    totals, i = [], 0
    while i < len(calls):
        n, seen = calls[i]["num_tokens"], 0
        while seen < n:
            assert calls[i]["num_tokens"] == n
            seen += int(calls[i]["mask"].sum())
            i += 1
        assert seen == n
        totals.append(n)
    assert len(totals) == 2 and sum(totals) == sum(len(e.completion_ids) for e in eps) == stats.num_tokens


def test_single_pass_keeps_the_cheap_on_policy_path(tiny_model_dir, monkeypatch):
    learner = _learner(tiny_model_dir)
    monkeypatch.setattr(learner, "completion_logps", lambda *a, **k: pytest.fail("no recompute for one pass"))
    calls = _spy(monkeypatch)
    stats = learner.update(_episodes(4), torch.tensor([1.0, -1.0, 1.0, -1.0]))
    assert len(calls) == stats.micro_batches >= 1  # the spy saw every micro-batch's loss
    assert all(torch.equal(c["old"], c["logps"]) for c in calls)


def test_entropy_bonus_is_computed_and_moves_the_loss(tiny_model_dir):
    eps, adv = _episodes(4), torch.tensor([1.0, -1.0, 1.0, -1.0])
    plain = _learner(tiny_model_dir).update(eps, adv)
    bonus = _learner(tiny_model_dir, "algorithm.entropy_coef=0.1").update(eps, adv)
    assert plain.entropy == 0.0 and bonus.entropy > 1.0  # a random model over ~49k tokens: high entropy
    assert bonus.loss == pytest.approx(plain.loss - 0.1 * bonus.entropy, abs=1e-4)


# ----------------------------------------------------------------------------- PPO end to end


def _ppo(tiny_model_dir, run_dir, *extra):
    over = tiny_overrides(tiny_model_dir, run_dir) + [
        "train.lr=1e-2", "critic.lr=1e-2", "log.tensorboard=false", "eval.before=false", "eval.after=false",
        "critic.warmup_steps=0",  # the example waits 2 steps; these 2-step runs must move the policy
        f"rewards=[{{fn: '{DATA / 'my_reward.py'}:length_bonus'}}]", *extra,
    ]
    return load_config(REPO / "examples" / "arithmetic_ppo.yaml", over)


def _rows(run_dir):
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in r.items() if not k.startswith(("time/", "system/", "perf/"))} for r in rows]


def test_ppo_critic_warmup_trains_only_the_critic_first(tiny_model_dir, tmp_path):
    run = loop.train(_ppo(tiny_model_dir, tmp_path / "run", "critic.warmup_steps=1"))
    first, second = _rows(run)
    assert first["optimizer_steps"] == 0.0 and first["grad_norm"] == 0.0  # the policy waited
    assert second["optimizer_steps"] == 2.0 and second["grad_norm"] > 0  # ppo_epochs=2
    assert first["critic/loss"] > 0 and first["critic/grad_norm"] > 0
    assert first["critic/value_mean"] != second["critic/value_mean"]  # the critic learned
    assert (run / "critic" / "final" / "adapter_config.json").is_file()
    assert (run / "final" / "adapter_config.json").is_file()


def test_ppo_resume_restores_the_critic_exactly(tiny_model_dir, tmp_path, monkeypatch):
    full = loop.train(_ppo(tiny_model_dir, tmp_path / "full", "checkpoint.every=1"))
    cut = tmp_path / "cut"
    # after the policy's checkpoint (the critic's, in cut/critic, comes first)
    real = preempt_after_checkpoint(monkeypatch, run_setup, step=1, run_dir=cut)
    with pytest.raises(Preempted):
        loop.train(_ppo(tiny_model_dir, cut, "checkpoint.every=1"))
    monkeypatch.setattr(run_setup, "save_checkpoint", real)
    # a policy checkpoint whose critic checkpoint is gone is refused, naming what is missing
    broken = tmp_path / "broken"
    shutil.copytree(cut, broken)
    shutil.rmtree(broken / "critic" / "checkpoints" / "step-000001")
    with pytest.raises(CheckpointError, match=r"cannot resume the critic: .*critic/checkpoints/step-000001 is missing"):
        loop.train(_ppo(tiny_model_dir, broken, "checkpoint.every=1"))
    loop.train(_ppo(tiny_model_dir, cut, "checkpoint.every=1"))
    assert _rows(cut) == _rows(full)
    assert (cut / "critic" / "checkpoints" / "step-000002").is_dir()


def test_a_critic_with_another_tokenizer_is_refused_before_loading(tiny_model_dir, tmp_path, tokenizer):
    import copy

    other = copy.deepcopy(tokenizer)
    other.add_tokens(["<not-in-the-policy>"])
    other.save_pretrained(tmp_path / "other")
    base = tiny_overrides(tiny_model_dir, tmp_path / "run") + ["algorithm.name=ppo"]
    cfg = load_config(REPO / "examples" / "arithmetic_ppo.yaml", base + [f"critic.model={tiny_model_dir}"])
    run_setup.prepare(cfg)  # the same tokenizer: fine
    cfg = load_config(REPO / "examples" / "arithmetic_ppo.yaml", base + [f"critic.model={tmp_path / 'other'}"])
    with pytest.raises(ConfigError, match="critic.model=.*another tokenizer"):
        run_setup.prepare(cfg)


def test_lora_critic_shares_the_policys_frozen_base_and_generation_leaves_it_intact(tiny_model_dir, tmp_path):
    run = loop.setup(_ppo(tiny_model_dir, tmp_path / "run"))
    policy = {n.removeprefix("base_model.model.").replace(".base_layer", ""): p
              for n, p in run.model.named_parameters() if not p.requires_grad}
    critic = {n.removeprefix("base_model.model.").replace(".base_layer", ""): p
              for n, p in run.critic.model.named_parameters()}
    shared = [n for n in critic if n in policy and critic[n] is policy[n]]
    assert any("q_proj" in n for n in shared) and any("embed_tokens" in n for n in shared)
    assert all(not critic[n].requires_grad for n in shared)
    assert any(p.requires_grad for p in critic.values())  # its own adapter and head
    for n, p in run.model.named_parameters():  # non-zero policy adapters, so merging changes weights
        if "lora_B" in n:
            torch.nn.init.normal_(p, std=0.5)
    eps = loop.rollout(run.engine, run.sampler.next_batch(), run.params, run.prep.tokenizer,
                       group_size=run.cfg.rollout.group_size, step=0, generator=run.generator)
    before = run.critic.values(eps)
    loop.rollout(run.engine, run.sampler.next_batch(), run.params, run.prep.tokenizer,
                 group_size=run.cfg.rollout.group_size, step=1, generator=run.generator)  # decodes with LoRA merged into the shared weights
    assert torch.equal(run.critic.values(eps), before)
    run.logger.close()
    run.prep.close()


# ----------------------------------------------------------------------------- correction: auto


@pytest.mark.parametrize("dtype, expected", [(torch.float32, []), (torch.bfloat16, ["token_tis"])])
def test_make_learner_resolves_correction_auto_from_the_model(dtype, expected):
    cfg = _cfg("grpo")
    assert cfg.algorithm.correction.methods == "auto"
    model = torch.nn.Linear(2, 2).to(dtype)
    learner = make_learner(cfg, model, pad_id=0)
    assert learner.algorithm.correction.methods == expected == learner.is_methods


def test_correction_caps_must_be_positive():
    with pytest.raises(ConfigError, match="token_tis_cap"):
        _cfg("grpo", "algorithm.correction.token_tis_cap=0")
    with pytest.raises(ConfigError, match="methods"):
        _cfg("grpo", "algorithm.correction.methods=always")
