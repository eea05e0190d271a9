"""Step timing and the evaluation's confidence intervals (plainrl.metrics)."""

import pytest

from plainrl.metrics import StepTimer, mean_interval, wilson_interval


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


def test_mean_interval_uses_the_sample_standard_deviation():
    # mean 0.5, s^2 = (0.25 + 0.25 + 0 + 0) / 3, half = 1.96 * sqrt(s^2 / 4) = 0.400083
    assert mean_interval([0.0, 1.0, 0.5, 0.5]) == pytest.approx((0.099917, 0.900083), abs=1e-6)
    assert mean_interval([0.25]) == (0.25, 0.25)


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
