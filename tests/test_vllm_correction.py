"""The off-policy correction on vLLM under a nucleus sampler: one `plainrl serve` from the
session's pool, a run one step off-policy at rollout.top_p 0.9 (what made the geometric mask
reject every sequence, and the run train on nothing, while vLLM's logprobs were of the filtered
distribution and the learner's were not). Runs under `make test-vllm`; skipped where vLLM is not installed."""

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed in this venv; `make test-vllm` runs these tests")

from conftest import demo_steps_with_engine  # noqa: E402

pytestmark = pytest.mark.vllm


def test_an_async_run_at_top_p_keeps_its_tokens(serve_pool, tmp_path):
    """A learning rate small enough that one update leaves the policy where it was, so the
    geometric mask's band [0.99, 1.01] measures the engine/learner match alone: every token kept
    at both steps. (At the demo's own rate, one update already moves the 135M model's tokens by
    is/kl ~0.035 nats, and the mask rejects the stale step: staleness, which the warning names.)"""
    [(_, url)] = serve_pool.get()
    steps = demo_steps_with_engine(tmp_path / "run", ["rollout.engine=remote", f"rollout.remote.urls=[{url}]",
                                                      "eval.before=false", "rollout.async_steps=1",
                                                      "rollout.top_p=0.9", "train.lr=1e-8"])
    assert len(steps) == 2
    for r in steps:
        diag = {k: v for k, v in r.items() if k.startswith("is/")}
        assert r["is/masked_fraction"] == 0.0 and r["skipped_step"] == 0.0, diag
        assert r["is/ratio_mean"] == pytest.approx(1.0, abs=0.02) and abs(r["is/kl"]) < 0.01, diag
        assert r["is/ess"] > 0.95, diag
