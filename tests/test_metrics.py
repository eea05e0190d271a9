"""Step timing and the evaluation's confidence intervals (plainrl.metrics)."""

import math

import pytest

from plainrl.intervals import (
    mean_interval, mean_interval_method, student_t_quantile, student_t_two_sided, wilson_interval,
)
from plainrl.metrics import StepTimer


@pytest.mark.parametrize("s, n, low, high", [
    # hand-computed: z^2 = 3.8416; 0/10: centre = (3.8416/20) / 1.38416 = 0.13877,
    # half = 1.96/1.38416 * sqrt(3.8416/400) = 0.13877
    (0, 10, 0.0, 0.27754),
    # 5/10: centre 0.5, half = 1.416022 * sqrt(0.025 + 0.009604) = 0.26341
    (5, 10, 0.23659, 0.76341),
    (10, 10, 0.72246, 1.0),  # the mirror of 0/10
])
def test_wilson_interval_matches_hand_computed_values(s, n, low, high):
    assert wilson_interval(s, n) == pytest.approx((low, high), abs=1e-5)


def test_wilson_interval_refuses_impossible_counts():
    with pytest.raises(ValueError, match="0 <= successes <= n"):
        wilson_interval(3, 2)


def test_mean_interval_uses_student_t_below_30_values():
    """Old code: the normal 1.96 at any n, (0.099917, 0.900083) here: an interval 38% too narrow."""
    # mean 0.5, s^2 = (0.25 + 0.25 + 0 + 0) / 3, t_{0.975, 3} = 3.182446 (tables: 3.182),
    # half = 3.182446 * sqrt(s^2 / 4) = 3.182446 * 0.204124 = 0.649614
    assert mean_interval_method(4) == "student-t"
    assert mean_interval([0.0, 1.0, 0.5, 0.5]) == pytest.approx((-0.149614, 1.149614), abs=1e-6)
    assert mean_interval([0.25]) == (0.25, 0.25)


def test_mean_interval_is_normal_from_30_values():
    values = [0.0, 1.0] * 15  # mean 0.5, s^2 = 30 * 0.25 / 29
    half = 1.959964 * math.sqrt(30 * 0.25 / 29 / 30)
    assert mean_interval_method(30) == "normal"
    assert mean_interval(values) == pytest.approx((0.5 - half, 0.5 + half), abs=1e-6)


@pytest.mark.parametrize("df, confidence, table", [
    # NIST/SEMATECH e-Handbook of Statistical Methods, 1.3.6.7.2 (upper critical values of t)
    (1, 0.95, 12.706), (2, 0.95, 4.303), (5, 0.95, 2.571), (9, 0.95, 2.262), (10, 0.95, 2.228),
    (29, 0.95, 2.045), (5, 0.99, 4.032), (12, 0.90, 1.782),
])
def test_student_t_quantile_matches_the_tables(df, confidence, table):
    assert student_t_quantile(confidence, df) == pytest.approx(table, abs=6e-4)


def test_student_t_cdf_closed_forms():
    # df = 1 is the Cauchy distribution: P(|T| <= 1) = 2 atan(1) / pi = 0.5
    assert student_t_two_sided(1.0, 1) == pytest.approx(0.5)
    # df = 2: P(|T| <= t) = t / sqrt(2 + t^2)
    assert student_t_two_sided(3.0, 2) == pytest.approx(3 / math.sqrt(11))
    with pytest.raises(ValueError, match="df >= 1"):
        student_t_quantile(0.95, 0)


def test_step_timer_sums_phases_entered_twice():
    timer = StepTimer()
    for _ in range(2):
        with timer("reward"):
            pass
    m = timer.metrics()
    assert set(m) == {"time/reward", "time/step"} and 0 <= m["time/reward"] <= m["time/step"]


def test_progress_line_shows_the_phase_split_and_eta():
    from plainrl.metrics import progress_line

    m = {"reward/mean": 0.125, "kl": 0.0012, "time/generate": 5.21, "time/reward": 0.3, "time/update": 3.6,
         "time/step": 9.1}
    assert progress_line(2, 40, m, 337.0) == (
        "step 3/40 reward 0.125 kl 0.0012 | 9.1s: gen 5.2 rew 0.3 upd 3.6 | eta 5m37s")
    assert progress_line(0, 2, {"loss": 0.5}, None) == "step 1/2 loss +0.5000"


def test_eta_is_the_mean_of_recent_step_times(tmp_path):
    from plainrl.metrics import MetricsLogger

    logger = MetricsLogger(tmp_path, total_steps=10, tensorboard=False, progress=False)
    assert logger.eta_s(0) is None
    for step, t in enumerate([2.0, 4.0]):
        logger.log(step, {"time/step": t})
    assert logger.eta_s(1) == 3.0 * 8
    logger.close()
    logger.close()  # a second close does nothing


def test_eval_names_each_interval_method():
    from plainrl.run.evaluate import interval_methods

    result = {"eval/pass@1": 0.5, "eval/pass@1_ci_low": 0.2, "eval/pass@1_ci_high": 0.8, "eval/n": 12,
              "eval/mean@4": 0.5, "eval/mean@4_ci_low": 0.3, "eval/mean@4_ci_high": 0.7}
    assert interval_methods(result) == {"pass@1": "wilson", "mean@4": "student-t"}
    assert interval_methods({**result, "eval/n": 30})["mean@4"] == "normal"


def test_every_eval_figure_names_its_interval_method_and_n(tmp_path, capsys):
    from plainrl.intervals import eval_figures, figure, method_label
    from plainrl.metrics import MetricsLogger

    row = {"step": 3, "eval/pass@1": 0.42, "eval/pass@1_ci_low": 0.33, "eval/pass@1_ci_high": 0.52, "eval/n": 100,
           "eval/mean@4": 0.41, "eval/mean@4_ci_low": 0.35, "eval/mean@4_ci_high": 0.47, "eval/env/tool_calls": 1.5}
    assert figure(row, "eval/pass@1") == "0.420 [0.330, 0.520] (Wilson 95%, n=100)"
    assert figure(row, "eval/mean@4") == "0.410 [0.350, 0.470] (normal 95% over prompts, n=100)"
    assert figure({**row, "eval/n": 12}, "eval/mean@4") == "0.410 [0.350, 0.470] (Student's t 95% over prompts, n=12)"
    assert figure(row, "eval/env/tool_calls") == "1.500 (no interval, n=100)"
    assert figure({"eval/loss": 1.25}, "eval/loss") == "1.250 (no interval)"
    assert eval_figures(row) == ("eval/pass@1 0.420 [0.330, 0.520] (Wilson 95%, n=100)  "
                                 "eval/mean@4 0.410 [0.350, 0.470] (normal 95% over prompts, n=100)  "
                                 "eval/env/tool_calls 1.500 (no interval, n=100)")
    with pytest.raises(ValueError, match="unknown interval method 'bootstrap'"):
        method_label("bootstrap")
    # the run's eval line on the console
    logger = MetricsLogger(tmp_path, total_steps=10, tensorboard=False, progress=True)
    logger.log_eval(3, {k: v for k, v in row.items() if k != "step"})
    logger.close()
    assert "eval/pass@1 0.420 [0.330, 0.520] (Wilson 95%, n=100)" in capsys.readouterr().err  # (rich: stderr)
