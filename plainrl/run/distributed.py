"""A run under ``torchrun``: reading the launcher's environment and checking it against the
config before any model loads, the process group (with a collective timeout), this rank's
device and threads, and what differs between ranks in a run (rank 0 alone logs and
writes; the step's prompts are split by whole groups; episodes are gathered so every rank
sees the whole batch). Without torchrun, :func:`start` returns ``Parallel()`` and nothing
here changes the single-process run.

See docs/distributed.md for launch commands.
"""

from __future__ import annotations

import datetime
import os
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator, Mapping

import torch
import torch.distributed as dist

from plainrl.config import Config, ConfigError
from plainrl.metrics import MetricsLogger
from plainrl.models import empty_weights
from plainrl.train.distributed import Parallel, full_tensor, shared_copy
from plainrl.types import Episode, RewardOutput

# what torchrun (torch.distributed.run) sets in every worker's environment
TORCHRUN_VARS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
# the ones that mean "launched by torchrun" when set: LOCAL_RANK and LOCAL_WORLD_SIZE alone do not
# (vLLM's CPU platform sets LOCAL_WORLD_SIZE in its own process, its XPU worker LOCAL_RANK)
LAUNCH_MARKERS = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def launch_env(env: Mapping[str, str] | None = None) -> dict[str, int | str] | None:
    """The torchrun variables of this process, None when it was not launched by torchrun
    (none of :data:`LAUNCH_MARKERS` set).

    Raises:
        ConfigError: some are set and others missing (a hand-made launch, or a scheduler
            script that forgot one), naming the missing ones.
    """
    env = os.environ if env is None else env
    if not any(v in env for v in LAUNCH_MARKERS):
        return None
    present = [v for v in TORCHRUN_VARS if v in env]
    missing = [v for v in TORCHRUN_VARS if v not in env]
    if missing:
        raise ConfigError(
            f"distributed launch: {', '.join(present)} set but {', '.join(missing)} missing; launch with "
            "`torchrun --nproc-per-node N -m plainrl train CONFIG` (several nodes: add --nnodes and "
            "--rdzv-endpoint HOST:PORT; see docs/distributed.md), or unset them for one process"
        )
    try:
        out: dict[str, int | str] = {v: int(env[v]) for v in TORCHRUN_VARS if v not in ("MASTER_ADDR",)}
    except ValueError as e:
        raise ConfigError(f"distributed launch: a torchrun variable is not an integer: {e}") from e
    out["MASTER_ADDR"] = env["MASTER_ADDR"]
    return out


def check_launch(cfg: Config, world_size: int) -> None:
    """Refuse a config that cannot run on ``world_size`` ranks, before any model loads.

    Raises:
        ConfigError: the ranks cannot split the step's prompt groups (RL) or rows (sft/dpo/rm)
            evenly, ``train.fsdp_size`` does not divide them, or the engine cannot run under torchrun.
    """
    if cfg.train.fsdp_size is not None and world_size % cfg.train.fsdp_size:
        raise ConfigError(
            f"train.fsdp_size={cfg.train.fsdp_size} must divide the {world_size} ranks (HSDP shards within groups of "
            f"that size and replicates across them); use a divisor of {world_size}, or null to shard over all")
    if cfg.algorithm.offline:
        if cfg.train.batch_size % world_size:
            raise ConfigError(
                f"train.batch_size={cfg.train.batch_size} rows cannot be split evenly over {world_size} ranks; "
                f"use a multiple of {world_size} (or another --nproc-per-node)")
        return
    groups = cfg.rollout.prompts_per_step
    if groups % world_size:
        # a group on one rank keeps its statistics exact (GRPO's mean and std, RLOO's leave-one-out)
        raise ConfigError(
            f"rollout.prompts_per_step={groups} prompt groups cannot be split evenly over {world_size} ranks "
            f"(a group is never split); set rollout.prompts_per_step to a multiple of {world_size}, or launch "
            f"with --nproc-per-node (x --nnodes) dividing {groups}")
    if cfg.rollout.async_steps:
        raise ConfigError(
            f"rollout.async_steps={cfg.rollout.async_steps} is not supported under torchrun (the rollout thread's "
            "episode gathering would race the learner's gradient collectives); set rollout.async_steps=0")
    if cfg.rollout.engine == "vllm":
        raise ConfigError(
            "rollout.engine=vllm starts vLLM inside the training process, which is not supported under torchrun; "
            "run `plainrl serve` servers and set rollout.engine=remote (docs/distributed.md), or use rollout.engine=hf")


def _device(requested: str, local_rank: int) -> torch.device:
    if requested == "cpu" or (requested == "auto" and not torch.cuda.is_available()):
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise ConfigError("device=cuda but CUDA is not available on this node; set device=cpu or auto")
    if local_rank >= torch.cuda.device_count():
        raise ConfigError(f"LOCAL_RANK={local_rank} but this node has {torch.cuda.device_count()} GPUs; "
                          "lower --nproc-per-node to the number of GPUs")
    return torch.device("cuda", local_rank)


def join(cfg: Config) -> Parallel:
    """Join the run's process group when launched by torchrun (``Parallel()`` otherwise).

    Checks the launch (:func:`launch_env`, :func:`check_launch`) first; then NCCL on CUDA
    (``cuda:LOCAL_RANK``) or gloo on CPU, with ``train.collective_timeout_s`` as the
    timeout of every collective, so a dead or stuck rank ends the run instead of hanging it.
    On CPU, without ``threads``, each rank takes its share of the cores.

    Raises:
        ConfigError: see :func:`launch_env` and :func:`check_launch`; an unusable device.
    """
    env = launch_env()
    if env is None:
        if cfg.train.offload == "params":
            raise ConfigError("train.offload=params offloads FSDP2's shards, and one process does not shard: launch "
                              "with torchrun and train.strategy=fsdp2, or use train.offload=optimizer")
        return Parallel()
    world, rank, local = int(env["WORLD_SIZE"]), int(env["RANK"]), int(env["LOCAL_RANK"])
    check_launch(cfg, world)
    device = _device(cfg.device, local)
    if cfg.train.offload == "params" and device.type != "cuda":
        raise ConfigError(f"train.offload=params moves FSDP2's shards from the GPU to host memory; on "
                          f"{device.type} they are in host memory already: set train.offload=none")
    if not dist.is_initialized():
        timeout = datetime.timedelta(seconds=cfg.train.collective_timeout_s)
        if device.type == "cuda":
            torch.cuda.set_device(device)
            dist.init_process_group("nccl", timeout=timeout, device_id=device)
        else:
            dist.init_process_group("gloo", timeout=timeout)
    if device.type == "cpu" and cfg.threads is None:
        torch.set_num_threads(max(1, len(os.sched_getaffinity(0)) // max(1, int(env["LOCAL_WORLD_SIZE"]))))
    return Parallel(active=True, strategy=cfg.train.strategy, rank=rank, world_size=world, device=device,
                    fsdp_size=cfg.train.fsdp_size, offload=cfg.train.offload)


def leave(parallel: Parallel) -> None:
    """Leave the process group (a no-op in one process)."""
    if parallel.active and dist.is_initialized():
        dist.destroy_process_group()


def local_rows(parallel: Parallel, rows: list) -> list:
    """This rank's share of the step's prompts (whole groups: a prompt's samples are drawn on one rank)."""
    if not parallel.active:
        return rows
    s = parallel.shard(len(rows))
    return rows[s.start: s.stop]


def gather_episodes(parallel: Parallel, episodes: list[Episode], rewards: RewardOutput
                    ) -> tuple[list[Episode], RewardOutput]:
    """Every rank's scored episodes, in rank order (the order one process would have drawn
    them in), on every rank, with groups renumbered over the whole batch; their rewards too.
    Episodes are a few kilobytes each: token ids, logprobs, the data row."""
    if not parallel.active:
        return episodes, rewards
    parts = parallel.gather((episodes, rewards))
    out: list[Episode] = []
    for eps, _ in parts:
        offset = 1 + max((e.group for e in out), default=-1)
        for e in eps:
            e.group += offset
        out.extend(eps)
    outs = [r for _, r in parts]
    merged = RewardOutput(total=[t for r in outs for t in r.total],
                          parts={k: [v for r in outs for v in r.parts[k]] for k in outs[0].parts},
                          errors=[m for r in outs for m in r.errors])
    return out, merged


@contextmanager
def main_first(parallel: Parallel) -> Iterator[None]:
    """Rank 0 runs the block before the others (e.g. converting the embedded model into the
    shared cache once); the others wait for it at a barrier."""
    if parallel.active and not parallel.is_main:
        parallel.barrier()
    yield
    if parallel.active and parallel.is_main:
        parallel.barrier()


class RankLogger(MetricsLogger):
    """The logger of ranks other than 0: it writes nothing and prints nothing (rank 0 logs
    the whole batch, which every rank holds)."""

    def __init__(self, run_dir: Path, *, total_steps: int):  # no files, no TensorBoard writer
        self.run_dir, self.total_steps, self.sinks, self.closed = Path(run_dir), total_steps, [], False

    def add_sink(self, sink) -> None:
        pass

    @contextmanager
    def phase(self, what: str) -> Iterator[None]:
        yield

    def resume_at(self, step: int) -> None:
        pass

    def log(self, step: int, metrics: dict[str, float]) -> None:
        pass

    def log_eval(self, step: int, metrics: dict[str, float]) -> None:
        pass

    def log_rollouts(self, step: int, episodes: list[Episode], count: int, tokenizer) -> None:
        pass

    def log_errors(self, step: int, errors) -> None:
        pass

    def print(self, msg: str) -> None:
        pass

    def close(self, final_dir: Path | None = None) -> None:
        self.closed = True


def make_logger(cfg: Config, run_dir: Path, parallel: Parallel) -> MetricsLogger:
    """Rank 0's (or the one process's) :class:`MetricsLogger`; a :class:`RankLogger` elsewhere."""
    if not parallel.is_main:
        return RankLogger(run_dir, total_steps=cfg.train.total_steps)
    return MetricsLogger(run_dir, total_steps=cfg.train.total_steps, tensorboard=cfg.log.tensorboard,
                         progress=cfg.log.progress, ranks=parallel.world_size if parallel.active else 1)


class RankEngine:
    """The rollout engine of a rank under torchrun, when the learner's model cannot serve
    it directly: under FSDP2 the embedded engine samples with a *replica*, a full copy of
    the weights on each rank (in the model's dtype), refreshed after every update by
    gathering the trainable shards (the frozen base once, at start: LoRA then moves only
    the adapters); a remote engine (``rollout.engine=remote``) gets the weights from rank 0
    alone, once per step, while the other ranks wait, and every rank sends its own prompts,
    naming the adapter rank 0 pushed, to the servers that received it.

    Args:
        inner: the engine (built on ``replica`` when there is one).
        parallel: this rank.
        replica: FSDP2: the copy of the model made before sharding (on rank 0 only for a remote
            engine), filled whole by the first :meth:`load_weights`; None under DDP.
        local: the engine runs in this process (the embedded one); False for remote servers.
        gather: FSDP2: take part in gathering the weights (every rank must, replica or not).
    """

    def __init__(self, inner, parallel: Parallel, replica: torch.nn.Module | None, *, local: bool,
                 gather: bool):
        self.inner, self.parallel, self.replica, self.local, self.gather = inner, parallel, replica, local, gather
        self._frozen_synced = False

    def generate(self, prompts, params, *, seeds=None):
        return self.inner.generate(prompts, params, seeds=seeds)

    def offload(self) -> None:
        self.inner.offload()

    def take_metrics(self) -> dict[str, float]:
        return self.inner.take_metrics()

    def close(self) -> None:
        self.inner.close()

    @torch.no_grad()
    def _gather(self, model: torch.nn.Module) -> None:
        target = dict(self.replica.named_parameters()) if self.replica is not None else {}
        for name, p in model.named_parameters():
            if p.requires_grad or not self._frozen_synced:
                full = full_tensor(p.detach())  # a collective: every rank, in the same order
                if name in target:
                    target[name].copy_(full)
        if not self._frozen_synced and self.replica is not None:  # buffers are whole on every rank
            replica_buffers = dict(self.replica.named_buffers())
            for name, b in model.named_buffers():
                replica_buffers[name].copy_(b)
        self._frozen_synced = True

    def load_weights(self, model: torch.nn.Module) -> None:
        source = model
        if self.gather:
            self._gather(model)
            source = self.replica
        if self.local:
            self.inner.load_weights(source)
            return
        if self.parallel.is_main:
            self.inner.load_weights(source)
        # Rank 0 alone knows what its push left: the new adapter's name (a server serves the
        # base model under its own name, so a rank still naming the base samples another policy)
        # and the servers that took it. The broadcast hands that to every rank and, as it waits
        # for rank 0, is also the barrier: nobody samples before the servers have the weights.
        pushed = self.parallel.broadcast(self.inner.pushed() if self.parallel.is_main else None)
        if not self.parallel.is_main:
            self.inner.follow(pushed)


def rank_engine(cfg: Config, model: torch.nn.Module, parallel: Parallel, build) -> tuple[object, torch.nn.Module]:
    """The engine for this rank: ``build(model_for_the_engine)``, wrapped in a :class:`RankEngine`
    where needed (FSDP2, or a remote engine under torchrun).

    Under FSDP2 the replica is made here, before the learner shards ``model``, as a
    :func:`~plainrl.train.distributed.shared_copy`: on rank 0 it keeps the loaded weights
    (sharding gives the learner fresh tensors), so rank 0 holds one full copy, not two; on
    the other ranks, where ``model`` was built on the meta device, it is allocated empty here
    and filled by the engine's first ``load_weights`` (the setup's first sync).

    Returns:
        ``(engine, model the engine reads)``: under FSDP2 the replica, else ``model``.
    """
    local = cfg.rollout.engine == "hf"
    if not parallel.active or (parallel.strategy == "ddp" and local):
        return build(model), model
    replica, sharded = None, parallel.strategy == "fsdp2"
    if sharded and (local or parallel.is_main):  # a remote engine reads the weights on rank 0 only
        replica = shared_copy(model)
        if parallel.on_meta:
            empty_weights(replica, parallel.device)
    engine = RankEngine(build(replica if replica is not None else model), parallel, replica, local=local,
                        gather=sharded)
    return engine, replica if replica is not None else model


def full_state_dict(parallel: Parallel, model: torch.nn.Module) -> dict | None:
    """Under FSDP2, the full trainable weights gathered to rank 0's CPU memory
    (``get_model_state_dict``; every rank must call it); None otherwise (the model's own
    state is whole)."""
    if not (parallel.active and parallel.strategy == "fsdp2"):
        return None
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    return get_model_state_dict(model, options=StateDictOptions(
        full_state_dict=True, cpu_offload=True, ignore_frozen_params=hasattr(model, "peft_config")))
