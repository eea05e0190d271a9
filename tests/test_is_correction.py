"""The off-policy corrections of algorithm.is_correction (plainrl.algorithms.is_correction),
each against values computed by hand."""

import itertools
import math

import pytest
import torch

from plainrl.algorithms import truncated_is_weights
from plainrl.algorithms.is_correction import Bounds, Tally, correct, sequence_ratio

# rho_t = pi_old / pi_engine: row 0 [0.5, 3.0, 1.0] (product 1.5, geometric mean 1.5^(1/3) = 1.1447),
# row 1 [1.2, 0.9] and a padding token (product 1.08, geometric mean sqrt(1.08) = 1.0392)
RHO = torch.tensor([[0.5, 3.0, 1.0], [1.2, 0.9, 7.0]])
ENGINE = torch.log(torch.tensor([[0.2, 0.1, 0.5], [0.5, 0.6, 0.1]]))
OLD = ENGINE + torch.log(RHO)
MASK = torch.tensor([[1, 1, 1], [1, 1, 0]])


def _close(actual, expected):
    torch.testing.assert_close(actual, torch.tensor(expected, dtype=actual.dtype), atol=1e-5, rtol=1e-5)


def test_no_method_weighs_every_loss_token_1():
    c = correct(OLD, ENGINE, MASK, [])
    _close(c.weights, [[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    assert not c.dropped.any() and not c.truncated.any()
    _close(c.ratio, [[0.5, 3.0, 1.0], [1.2, 0.9, 0.0]])


def test_token_tis_truncates_each_token_at_the_cap_as_tis_cap_did():
    c = correct(OLD, ENGINE, MASK, ["token_tis"], Bounds(tis_cap=2.0))
    _close(c.weights, [[0.5, 2.0, 1.0], [1.2, 0.9, 0.0]])
    assert c.truncated.tolist() == [[False, True, False], [False, False, False]]
    assert torch.equal(c.weights, truncated_is_weights(OLD, ENGINE, MASK, 2.0)[0])  # bit for bit


def test_sequence_tis_truncates_the_product_of_the_ratios():
    c = correct(OLD, ENGINE, MASK, ["sequence_tis"], Bounds(sequence_tis_cap=1.25))
    _close(c.weights, [[1.25, 1.25, 1.25], [1.08, 1.08, 0.0]])  # 1.5 -> 1.25; 1.08 kept
    assert c.truncated.tolist() == [[True, True, True], [False, False, False]]


def test_token_mis_drops_tokens_outside_the_band_and_keeps_the_ratio_of_the_others():
    c = correct(OLD, ENGINE, MASK, ["token_mis"], Bounds(token_mis=(0.0, 2.0)))
    _close(c.weights, [[0.5, 0.0, 1.0], [1.2, 0.9, 0.0]])
    assert c.dropped.tolist() == [[False, True, False], [False, False, False]]


def test_icepop_keeps_ratios_in_its_two_sided_band():
    _close(correct(OLD, ENGINE, MASK, ["icepop"]).weights, [[0.5, 3.0, 1.0], [1.2, 0.9, 0.0]])  # [0.5, 5]: all in
    c = correct(OLD, ENGINE, MASK, ["icepop"], Bounds(icepop=(0.6, 2.5)))
    _close(c.weights, [[0.0, 0.0, 1.0], [1.2, 0.9, 0.0]])
    assert c.dropped.tolist() == [[True, True, False], [False, False, False]]


def test_sequence_mis_drops_whole_sequences_whose_product_leaves_the_band():
    c = correct(OLD, ENGINE, MASK, ["sequence_mis"], Bounds(sequence_mis=(0.0, 1.2)))
    _close(c.weights, [[0.0, 0.0, 0.0], [1.08, 1.08, 0.0]])
    assert c.dropped.tolist() == [[True, True, True], [False, False, False]]


def test_the_geometric_mask_drops_sequences_by_their_mean_log_ratio_and_combines_with_tis():
    c = correct(OLD, ENGINE, MASK, ["geometric_mask"], Bounds(geometric_mask=(0.99, 1.1)))
    _close(c.weights, [[0.0, 0.0, 0.0], [1.0, 1.0, 0.0]])  # 1.1447 out, 1.0392 in
    c = correct(OLD, ENGINE, MASK, ["token_tis", "geometric_mask"], Bounds(tis_cap=1.1, geometric_mask=(0.99, 1.1)))
    _close(c.weights, [[0.0, 0.0, 0.0], [1.1, 0.9, 0.0]])
    # the truncated token of row 0 was dropped: it counts as dropped, not truncated
    assert c.truncated.tolist() == [[False, False, False], [True, False, False]]
    assert c.dropped.tolist() == [[True, True, True], [False, False, False]]
    # SkyRL's band [0.99, 1.01] (the default) drops both
    assert correct(OLD, ENGINE, MASK, ["geometric_mask"]).dropped.sum() == 5


def test_sequence_ratio_of_a_row_without_loss_tokens_is_1_and_padding_garbage_stays_out():
    engine = ENGINE.clone()
    engine[1, 2] = float("-inf")  # a padding position's garbage
    m = torch.tensor([[0, 0, 0], [1, 1, 0]]).bool()
    log_ratio = torch.where(m, OLD - engine, torch.zeros_like(OLD))
    _close(sequence_ratio(log_ratio, m, geometric=True), [[1.0] * 3, [math.sqrt(1.08)] * 3])
    c = correct(OLD, engine, m.int(), ["sequence_mis"], Bounds(sequence_mis=(0.0, 10.0)))
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
    w = correct(old, engine, torch.ones(4, 2), ["sequence_tis"], Bounds(sequence_tis_cap=100.0)).weights[:, 0]
    estimate = sum(math.exp(engine[i].sum()) * w[i] * f[y] for i, y in enumerate(seqs))
    exact = sum(math.exp(old[i].sum()) * f[y] for i, y in enumerate(seqs))
    assert float(estimate) == pytest.approx(exact, rel=1e-5)


def test_the_tally_gives_the_mean_ratio_and_the_dropped_share_of_loss_tokens():
    tally = Tally()
    tally.add(correct(OLD, ENGINE, MASK, ["token_mis"]))
    metrics = tally.take()
    assert metrics["is/ratio_mean"] == pytest.approx((0.5 + 3.0 + 1.0 + 1.2 + 0.9) / 5)
    assert metrics["is/masked_fraction"] == pytest.approx(1 / 5)
    assert tally.take() == {}  # reset


@pytest.mark.parametrize("methods, bounds, match", [
    (["token_tis", "icepop"], Bounds(), "one weighting"),
    (["token_is"], Bounds(), "unknown is_correction"),
    (["token_mis"], Bounds(token_mis=(2.0, 1.0)), "is_bounds.token_mis"),
    (["sequence_tis"], Bounds(sequence_tis_cap=0.0), "sequence_tis_cap"),
    (["token_tis"], Bounds(tis_cap=-1.0), "tis_cap"),
])
def test_bad_methods_and_bounds_are_refused(methods, bounds, match):
    with pytest.raises(ValueError, match=match):
        correct(OLD, ENGINE, MASK, methods, bounds)


# ----------------------------------------------------------------------------- auto, and in the learner

from plainrl.config import load_config  # noqa: E402
from plainrl.run.correction import TIS_CAP_AUTO, resolve_is_correction  # noqa: E402
from plainrl.run.setup import make_learner  # noqa: E402
from plainrl.types import Episode  # noqa: E402

RL = ["data.task=arithmetic", "rewards=[{fn: plainrl.rewards.builtins:correctness}]"]


@pytest.mark.parametrize("tis_cap, async_steps, expected", [
    (None, 0, []),                                # the embedded engine in float32, in step: on-policy, nothing
    (2.0, 0, ["token_tis"]),                      # another engine's numerics: token TIS as before
    (2.0, 2, ["token_tis", "geometric_mask"]),    # stale batches: the geometric mask too
    (None, 1, ["geometric_mask"]),                # tis_cap: null keeps token TIS off
])
def test_auto_is_token_tis_when_capped_plus_the_geometric_mask_when_async(tis_cap, async_steps, expected):
    methods, cap, why = resolve_is_correction("auto", tis_cap=tis_cap, async_steps=async_steps)
    assert methods == expected and cap == tis_cap and why.startswith("auto")
    assert ("rollout.async_steps" in why) == (async_steps > 0)


def test_a_configured_list_is_kept_and_token_tis_gets_a_cap():
    assert resolve_is_correction(["icepop"], tis_cap=None, async_steps=2)[:2] == (["icepop"], None)
    assert resolve_is_correction(["token_tis"], tis_cap=None, async_steps=0)[:2] == (["token_tis"], TIS_CAP_AUTO)
    assert resolve_is_correction([], tis_cap=2.0, async_steps=2)[0] == []


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
    for extra in (["algorithm.is_correction=[]"],
                  ["algorithm.is_correction=[token_mis]", "algorithm.is_bounds.token_mis=[0,3]"],
                  ["algorithm.is_correction=[icepop]", "algorithm.is_bounds.icepop=[0.5,1.5]"]):
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
