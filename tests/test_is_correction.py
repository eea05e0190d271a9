"""The off-policy corrections of algorithm.correction (plainrl.algorithms.is_correction),
each against values computed by hand; the one resolver of `auto`; the deprecated keys."""

import itertools
import math

import pytest
import torch

from plainrl.algorithms import truncated_is_weights
from plainrl.algorithms.is_correction import Bounds, Tally, correct, sequence_ratio
from plainrl.config.correction import CorrectionConfig


def B(**kw) -> Bounds:
    """The configured defaults (the only ones there are) with ``kw`` changed."""
    return Bounds(**{**CorrectionConfig().bounds(), **kw})


# rho_t = pi_old / pi_engine: row 0 [0.5, 3.0, 1.0] (product 1.5, geometric mean 1.5^(1/3) = 1.1447),
# row 1 [1.2, 0.9] and a padding token (product 1.08, geometric mean sqrt(1.08) = 1.0392)
RHO = torch.tensor([[0.5, 3.0, 1.0], [1.2, 0.9, 7.0]])
ENGINE = torch.log(torch.tensor([[0.2, 0.1, 0.5], [0.5, 0.6, 0.1]]))
OLD = ENGINE + torch.log(RHO)
MASK = torch.tensor([[1, 1, 1], [1, 1, 0]])


def _close(actual, expected):
    torch.testing.assert_close(actual, torch.tensor(expected, dtype=actual.dtype), atol=1e-5, rtol=1e-5)


def test_no_method_weighs_every_loss_token_1():
    c = correct(OLD, ENGINE, MASK, [], B())
    _close(c.weights, [[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    assert not c.dropped.any() and not c.truncated.any()
    _close(c.ratio, [[0.5, 3.0, 1.0], [1.2, 0.9, 0.0]])


def test_token_tis_truncates_each_token_at_the_cap_as_tis_cap_did():
    c = correct(OLD, ENGINE, MASK, ["token_tis"], B(token_tis_cap=2.0))
    _close(c.weights, [[0.5, 2.0, 1.0], [1.2, 0.9, 0.0]])
    assert c.truncated.tolist() == [[False, True, False], [False, False, False]]
    assert torch.equal(c.weights, truncated_is_weights(OLD, ENGINE, MASK, 2.0)[0])  # bit for bit


def test_sequence_tis_truncates_the_product_of_the_ratios():
    c = correct(OLD, ENGINE, MASK, ["sequence_tis"], B(sequence_tis_cap=1.25))
    _close(c.weights, [[1.25, 1.25, 1.25], [1.08, 1.08, 0.0]])  # 1.5 -> 1.25; 1.08 kept
    assert c.truncated.tolist() == [[True, True, True], [False, False, False]]


def test_token_mis_drops_tokens_outside_the_band_and_keeps_the_ratio_of_the_others():
    c = correct(OLD, ENGINE, MASK, ["token_mis"], B(token_mis=(0.0, 2.0)))
    _close(c.weights, [[0.5, 0.0, 1.0], [1.2, 0.9, 0.0]])
    assert c.dropped.tolist() == [[False, True, False], [False, False, False]]


def test_icepop_keeps_ratios_in_its_two_sided_band():
    _close(correct(OLD, ENGINE, MASK, ["icepop"], B()).weights, [[0.5, 3.0, 1.0], [1.2, 0.9, 0.0]])  # [0.5, 5]: all in
    c = correct(OLD, ENGINE, MASK, ["icepop"], B(icepop=(0.6, 2.5)))
    _close(c.weights, [[0.0, 0.0, 1.0], [1.2, 0.9, 0.0]])
    assert c.dropped.tolist() == [[True, True, False], [False, False, False]]


def test_sequence_mis_drops_whole_sequences_whose_product_leaves_the_band():
    c = correct(OLD, ENGINE, MASK, ["sequence_mis"], B(sequence_mis=(0.0, 1.2)))
    _close(c.weights, [[0.0, 0.0, 0.0], [1.08, 1.08, 0.0]])
    assert c.dropped.tolist() == [[True, True, True], [False, False, False]]


def test_the_geometric_mask_drops_sequences_by_their_mean_log_ratio_and_combines_with_tis():
    c = correct(OLD, ENGINE, MASK, ["geometric_mask"], B(geometric_mask=(0.99, 1.1)))
    _close(c.weights, [[0.0, 0.0, 0.0], [1.0, 1.0, 0.0]])  # 1.1447 out, 1.0392 in
    c = correct(OLD, ENGINE, MASK, ["token_tis", "geometric_mask"], B(token_tis_cap=1.1, geometric_mask=(0.99, 1.1)))
    _close(c.weights, [[0.0, 0.0, 0.0], [1.1, 0.9, 0.0]])
    # the truncated token of row 0 was dropped: it counts as dropped, not truncated
    assert c.truncated.tolist() == [[False, False, False], [True, False, False]]
    assert c.dropped.tolist() == [[True, True, True], [False, False, False]]
    # SkyRL's band [0.99, 1.01] (the default) drops both
    assert correct(OLD, ENGINE, MASK, ["geometric_mask"], B()).dropped.sum() == 5


def test_sequence_ratio_of_a_row_without_loss_tokens_is_1_and_padding_garbage_stays_out():
    engine = ENGINE.clone()
    engine[1, 2] = float("-inf")  # a padding position's garbage
    m = torch.tensor([[0, 0, 0], [1, 1, 0]]).bool()
    log_ratio = torch.where(m, OLD - engine, torch.zeros_like(OLD))
    _close(sequence_ratio(log_ratio, m, geometric=True), [[1.0] * 3, [math.sqrt(1.08)] * 3])
    c = correct(OLD, engine, m.int(), ["sequence_mis"], B(sequence_mis=(0.0, 10.0)))
    assert torch.isfinite(c.weights).all()
    _close(c.weights, [[0.0, 0.0, 0.0], [1.08, 1.08, 0.0]])


def test_the_sequence_ratio_makes_engine_samples_an_unbiased_estimate_under_the_learner():
    # two independent tokens from {a, b}: pi_engine = (0.7, 0.3) at both, pi_old = (0.4, 0.6) and
    # (0.5, 0.5); f(y) an arbitrary reward. sum_y p_engine(y) w(y) f(y) = sum_y p_old(y) f(y).
    p_engine, p_old = [(0.7, 0.3), (0.7, 0.3)], [(0.4, 0.6), (0.5, 0.5)]
    f = {(0, 0): 1.0, (0, 1): -2.0, (1, 0): 0.5, (1, 1): 3.0}
    seqs = list(itertools.product((0, 1), repeat=2))
    engine = torch.log(torch.tensor([[p_engine[t][y[t]] for t in range(2)] for y in seqs]))
    old = torch.log(torch.tensor([[p_old[t][y[t]] for t in range(2)] for y in seqs]))
    w = correct(old, engine, torch.ones(4, 2), ["sequence_tis"], B(sequence_tis_cap=100.0)).weights[:, 0]
    estimate = sum(math.exp(engine[i].sum()) * w[i] * f[y] for i, y in enumerate(seqs))
    exact = sum(math.exp(old[i].sum()) * f[y] for i, y in enumerate(seqs))
    assert float(estimate) == pytest.approx(exact, rel=1e-5)


def test_the_tally_gives_the_mean_ratio_and_the_dropped_share_of_loss_tokens():
    tally = Tally()
    tally.add(correct(OLD, ENGINE, MASK, ["token_mis"], B()))
    metrics = tally.take()
    assert metrics["is/ratio_mean"] == pytest.approx((0.5 + 3.0 + 1.0 + 1.2 + 0.9) / 5)
    assert metrics["is/masked_fraction"] == pytest.approx(1 / 5)
    assert tally.take() == {}  # reset


def test_the_tally_gives_kl_chi_square_ess_and_the_truncated_share():
    """rho = [0.5, 3, 1, 1.2, 0.9] over the 5 loss tokens; token MIS [0, 2] applies weights
    w = [0.5, 0, 1, 1.2, 0.9]; token TIS at 2 truncates the 3."""
    tally = Tally()
    tally.add(correct(OLD, ENGINE, MASK, ["token_mis"], B()))
    m = tally.take()
    assert m["is/kl"] == pytest.approx(-(math.log(0.5) + math.log(3) + math.log(1.2) + math.log(0.9)) / 5, rel=1e-5)
    assert m["is/chi2"] == pytest.approx((0.25 + 9 + 1 + 1.44 + 0.81) / 5 - 1, rel=1e-5)  # 1.5
    assert m["is/ess"] == pytest.approx(3.6 ** 2 / (5 * (0.25 + 1 + 1.44 + 0.81)), rel=1e-5)  # 0.7406
    assert m["is/truncated_fraction"] == 0
    tally.add(correct(OLD, ENGINE, MASK, ["token_tis"], B()))
    m = tally.take()
    assert m["is/truncated_fraction"] == pytest.approx(1 / 5) and m["is/masked_fraction"] == 0
    assert m["is/ess"] == pytest.approx(5.6 ** 2 / (5 * (0.25 + 4 + 1 + 1.44 + 0.81)), rel=1e-5)  # w: 3 -> 2
    tally.add(correct(ENGINE, ENGINE, MASK, [], B()))  # on-policy: rho = 1 everywhere
    assert tally.take() == pytest.approx({"is/ratio_mean": 1.0, "is/kl": 0.0, "is/chi2": 0.0, "is/ess": 1.0,
                                          "is/masked_fraction": 0.0, "is/truncated_fraction": 0.0})


@pytest.mark.parametrize("methods, bounds, match", [
    (["token_tis", "icepop"], B(), "one weighting"),
    (["token_is"], B(), "unknown correction"),
    (["token_mis"], B(token_mis=(2.0, 1.0)), "correction.token_mis"),
    (["sequence_tis"], B(sequence_tis_cap=0.0), "sequence_tis_cap"),
    (["token_tis"], B(token_tis_cap=-1.0), "token_tis_cap"),
])
def test_bad_methods_and_bounds_are_refused(methods, bounds, match):
    with pytest.raises(ValueError, match=match):
        correct(OLD, ENGINE, MASK, methods, bounds)


# ----------------------------------------------------------------------------- auto, and in the learner

from plainrl.config import load_config  # noqa: E402
from plainrl.config.base import ConfigError  # noqa: E402
from plainrl.run.correction import MismatchWatch, rejection_warning, resolve_correction  # noqa: E402
from plainrl.run.setup import make_learner  # noqa: E402
from plainrl.types import Episode  # noqa: E402

RL = ["data.task=arithmetic", "rewards=[{fn: plainrl.rewards.builtins:correctness}]"]
F32, BF16 = torch.float32, torch.bfloat16


@pytest.mark.parametrize("engine, dtype, async_steps, ratio_level, expected", [
    ("hf", F32, 0, "token", []),                                       # the learner's own float32 weights, in step
    ("hf", BF16, 0, "token", ["token_tis"]),                           # bf16 decode vs float32 learner logprobs
    ("vllm", F32, 0, "token", ["token_tis"]),                          # another engine's kernels and weights
    ("remote", F32, 2, "token", ["token_tis", "geometric_mask"]),      # stale batches: the geometric mask too
    ("remote", F32, 0, "sequence", ["sequence_tis"]),                  # GSPO: a sequence-level correction
    ("hf", F32, 1, "sequence", ["sequence_tis", "geometric_mask"]),
])
def test_auto_is_one_resolver_of_engine_dtype_staleness_and_ratio_level(engine, dtype, async_steps, ratio_level,
                                                                         expected):
    section, why = resolve_correction(CorrectionConfig(), engine=engine, weights_dtype=dtype,
                                      async_steps=async_steps, ratio_level=ratio_level)
    assert section.methods == expected and why.startswith("auto")
    assert ("rollout.async_steps" in why) == (async_steps > 0)
    configured = CorrectionConfig(methods=["icepop"])
    assert resolve_correction(configured, engine=engine, weights_dtype=dtype, async_steps=async_steps,
                              ratio_level=ratio_level) == (configured, "as configured")


def test_the_gspo_preset_gets_sequence_tis_through_make_learner():
    cfg = load_config(None, RL + ["algorithm.name=gspo", "rollout.async_steps=1", "rollout.prompts_per_step=4"])
    learner = make_learner(cfg, torch.nn.Linear(2, 2), pad_id=0)
    assert learner.is_methods == ["sequence_tis", "geometric_mask"]


@pytest.mark.parametrize("old, expected", [
    (["algorithm.tis_cap=1.5"], {"methods": ["token_tis"], "token_tis_cap": 1.5}),
    (["algorithm.tis_cap=null"], {"methods": []}),
    (["algorithm.tis_cap=auto"], {"methods": "auto"}),
    (["algorithm.is_correction=[icepop]", "algorithm.is_bounds.icepop=[0.6,2]"],
     {"methods": ["icepop"], "icepop": (0.6, 2.0)}),
    (["algorithm.tis_cap=3", "algorithm.is_correction=[token_tis,geometric_mask]"],
     {"methods": ["token_tis", "geometric_mask"], "token_tis_cap": 3.0}),
])
def test_the_deprecated_keys_are_read_into_the_section_with_a_deprecation_message(old, expected):
    with pytest.warns(FutureWarning, match="deprecated and will be removed in the next release") as caught:
        cfg = load_config(None, RL + old)
    section = cfg.algorithm.correction
    assert {k: getattr(section, k) for k in expected} == expected
    keys = sorted({o.split("=")[0].split(".")[1] for o in old})
    assert [str(w.message).split()[0] for w in caught] == [f"algorithm.{k}" for k in
                                                           ("is_bounds", "is_correction", "tis_cap") if k in keys]
    assert all(any(f"algorithm.{k} is deprecated" in n for n in cfg.notes) for k in keys)  # printed by the run


def test_a_deprecated_key_beside_its_replacement_is_refused():
    with pytest.raises(ConfigError, match="algorithm.tis_cap and algorithm.correction.token_tis_cap are both set"):
        load_config(None, RL + ["algorithm.tis_cap=1.5", "algorithm.correction.token_tis_cap=2"])
    with pytest.raises(ConfigError, match="algorithm.correction.methods takes one weighting"):
        load_config(None, RL + ["algorithm.correction.methods=[token_tis,icepop]"])


def test_a_step_that_rejects_most_tokens_says_so():
    assert rejection_warning({"is/masked_fraction": 0.2}) is None
    assert "rejected 100% of the loss tokens and trained on nothing" in rejection_warning(
        {"is/masked_fraction": 1.0, "is/kl": 0.1, "is/chi2": 0.2})
    assert "trained on the other 40%" in rejection_warning({"is/masked_fraction": 0.6})


def test_a_lasting_engine_learner_mismatch_is_said_once():
    """rollout/logprob_diff above 0.05 for 3 steps in a row: one warning naming the causes and the
    page; a run of 2 broken by a step at or below the threshold says nothing."""
    watch = MismatchWatch()
    assert [watch.observe(d) for d in (0.06, 0.07, 0.05, 0.2, 0.3)] == [None] * 5
    warning = watch.observe(0.08)
    assert "stayed above 0.05 nats for 3 steps (0.200, 0.300, 0.080)" in warning
    assert all(w in warning for w in ("precision", "engine", "weight sync", "docs/engines.md"))
    assert [watch.observe(d) for d in (0.1, 0.1, 0.1, 0.0, 0.1, 0.1, 0.1)] == [None] * 7  # once per run


def _eps(n=4, seed=0):
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        p = torch.randint(0, 1000, (4,), generator=g).tolist()
        c = torch.randint(0, 1000, (3 + i % 2,), generator=g).tolist()
        out.append(Episode(sample_id=str(i), group=i // 2, row={}, prompt_ids=p, completion_ids=c,
                           logprobs=[0.0] * len(c), loss_mask=[1] * len(c), finish_reason="eos"))
    return out


def test_the_learner_weighs_the_gradient_by_the_configured_correction(tiny_model_dir):
    """An engine that gave every sampled token half the learner's probability (rho = 2): token
    MIS with the band [0, 3] keeps every token at weight 2 (gradient 2x the uncorrected one),
    icepop's band [0.5, 1.5] drops them all (no gradient), and the step's is/* metrics say so."""
    from transformers import AutoModelForCausalLM

    eps, adv = _eps(), torch.tensor([1.0, -1.0, 0.5, -0.5])
    grads, metrics = [], []
    for extra in (["algorithm.correction.methods=[]"],
                  ["algorithm.correction.methods=[token_mis]", "algorithm.correction.token_mis=[0,3]"],
                  ["algorithm.correction.methods=[icepop]", "algorithm.correction.icepop=[0.5,1.5]"]):
        torch.manual_seed(0)
        m = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
        cfg = load_config(None, RL + ["model.lora.enabled=false", "train.max_grad_norm=null", *extra])
        learner = make_learner(cfg, m, pad_id=0)
        lp = learner.completion_logps(eps)  # [N, L]
        for i, e in enumerate(eps):
            e.logprobs = (lp[i, : len(e.completion_ids)] - math.log(2)).tolist()
        learner.optimizer.step = lambda: None  # keep the gradient for inspection
        learner.optimizer.zero_grad = lambda set_to_none=True: None
        learner.update(eps, adv)
        grads.append(torch.cat([p.grad.flatten() for p in learner.master]))
        metrics.append(learner.is_tally.take())
    assert grads[0].abs().sum() > 0
    torch.testing.assert_close(grads[1], 2 * grads[0], atol=1e-6, rtol=1e-4)
    assert grads[2].abs().sum() == 0
    assert metrics[0] == {}
    assert metrics[1]["is/ratio_mean"] == pytest.approx(2.0, rel=1e-4) and metrics[1]["is/masked_fraction"] == 0
    assert metrics[2]["is/masked_fraction"] == 1.0


@pytest.mark.parametrize("loss_agg", ["token-mean", "seq-mean-token-mean"])
def test_rejected_tokens_leave_the_normaliser_and_the_kl_and_entropy_terms(tiny_model_dir, loss_agg):
    """Four episodes, the engine far from the learner on the last one only: the geometric mask
    rejects it, and the gradient (policy loss, KL to the reference and entropy bonus together) is
    the gradient of the same update on the other three alone, as if it had never been sampled."""
    from transformers import AutoModelForCausalLM

    eps, adv = _eps(), torch.tensor([1.0, -1.0, 0.5, -0.5])
    grads, metrics = [], []
    for keep, methods in ((slice(0, 4), "[geometric_mask]"), (slice(0, 3), "[]")):
        torch.manual_seed(0)
        m = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
        cfg = load_config(None, RL + ["model.lora.enabled=false", "train.max_grad_norm=null",
                                      f"algorithm.correction.methods={methods}", f"algorithm.loss_agg={loss_agg}",
                                      "algorithm.kl_coef=0.5", "algorithm.entropy_coef=0.3"])
        learner = make_learner(cfg, m, pad_id=0)
        lp = learner.completion_logps(eps)  # [N, L]
        for i, e in enumerate(eps):  # on-policy, but the last episode's engine gave each token 1/3 the probability
            e.logprobs = (lp[i, : len(e.completion_ids)] - (math.log(3) if i == 3 else 0.0)).tolist()
        learner.optimizer.step = lambda: None  # keep the gradient for inspection
        learner.optimizer.zero_grad = lambda set_to_none=True: None
        learner.update(eps[keep], adv[keep])
        grads.append(torch.cat([p.grad.flatten() for p in learner.master]))
        metrics.append(learner.is_tally.take())
    assert metrics[0]["is/masked_fraction"] == pytest.approx(len(eps[3].completion_ids) / sum(
        len(e.completion_ids) for e in eps))
    assert grads[1].abs().sum() > 0
    torch.testing.assert_close(grads[0], grads[1], atol=1e-6, rtol=1e-4)
