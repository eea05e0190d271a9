"""Data parallelism for the trainers: how a model is wrapped for ``train.strategy`` (DDP or
FSDP2) and the few collectives a trainer needs to make its update equal to the
one-process update on the same batch.

Every trainer (:class:`~plainrl.train.Learner`, :class:`~plainrl.train.Critic`,
:class:`~plainrl.train.offline.OfflineTrainer`) is handed the *whole* step's batch on every
rank and a :class:`Parallel`. It computes on its share of the rows (RL: :meth:`Parallel.share`,
balanced by tokens; offline: :meth:`Parallel.shard`) and
normalises its loss by the *global* count (loss tokens, sequences, pairs: :meth:`Parallel.sum`),
so the gradients summed over the ranks are the gradient of the one-process loss. Both wrappers
average gradients over the ranks by default; here they sum instead (a DDP communication hook,
FSDP2's gradient divide factor 1), which is exact for any world size.

Every forward goes through one module, :class:`ModelCall` (``call(fn, *args)`` runs
``fn(model, *args)``), because plainrl's forwards reach inside the model (the decoder, then
the LM head in chunks, :mod:`plainrl.models.forward`): DDP prepares its gradient reduction in
its own ``forward``, and FSDP2 gathers the parameters outside the decoder layers (embeddings,
final norm, LM head) in the root module's. Under FSDP2 every forward and backward is a
sequence of collectives, so all ranks run the same number of micro-batches
(:meth:`Parallel.even_out` pads with zero-weight ones) and every backward reaches every
trainable parameter (:func:`connected_positions`).

In one process (``Parallel()``, ``active`` False) every collective is the identity and the
model is not wrapped: the single-process path is unchanged.

Sources: PyTorch DistributedDataParallel (``torch.nn.parallel``, comm hooks,
``no_sync``); FSDP2, ``torch.distributed.fsdp.fully_shard`` (per-module sharding, its
``MixedPrecisionPolicy``); Rajbhandari et al. 2020 (ZeRO, arXiv:1910.02054) for what is sharded.
"""

from __future__ import annotations

import contextlib
import copy
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.distributed as dist

from plainrl.config.train import Strategy
from plainrl.frames import split_by_tokens
from plainrl.types import Episode


class ModelCall(torch.nn.Module):
    """The one module a wrapper sees: ``call(fn, *args, **kwargs)`` is ``fn(model, *args,
    **kwargs)``, so DDP's and FSDP2's forward hooks run around any plainrl forward
    (:func:`~plainrl.models.sequence_logps`, :func:`~plainrl.models.token_values`, ...)."""

    def __init__(self, model: torch.nn.Module):
        super().__init__()
        self.model = model

    def forward(self, fn: Callable[..., Any], *args, **kwargs):
        return fn(self.model, *args, **kwargs)


def _sum_hook(pending: list, bucket):
    """DDP communication hook: all-reduce SUM (the default one divides by the world size).

    On CPU (gloo) no Python callback is put on a gloo future: gloo runs ``then`` callbacks on
    its worker thread and drops them there, taking the GIL; a worker late doing so (a loaded
    machine) when its rank has already begun to exit meets a finalizing interpreter, which
    ends the thread inside that destructor, and the rank aborts ("terminate called without an
    active exception", tests/test_gloo_exit.py). So each bucket's all-reduce starts here and
    the hook returns a plain future, which this thread completes (``set_result``) when the
    last bucket's hook waits for every reduction of the backward: the all-reduces still
    overlap the rest of the backward, and DDP waits on the futures only after that call.
    NCCL completes its future as the kernel is queued, so ``then`` runs on this thread (and
    keeps the CUDA stream order).

    Args:
        pending: the state registered with the hook: this backward's (work, buffer, future).
    """
    buffer = bucket.buffer()
    if buffer.device.type != "cpu":
        return dist.all_reduce(buffer, async_op=True).get_future().then(lambda f: f.value()[0])
    done = torch.futures.Future()
    pending.append((dist.all_reduce(buffer, async_op=True), buffer, done))
    if bucket.is_last():
        try:
            for work, reduced, fut in pending:
                work.wait()  # the group's timeout (train.collective_timeout_s) bounds it
                fut.set_result(reduced)
        finally:
            pending.clear()
    return done


def decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The decoder layers of a transformers causal LM or value model (peft-wrapped or not):
    FSDP2's unit of sharding.

    Raises:
        ValueError: the model has no ``get_decoder().layers`` (not a decoder-only transformer).
    """
    from plainrl.models import unwrap

    base = unwrap(model)
    layers = getattr(base.get_decoder(), "layers", None) if hasattr(base, "get_decoder") else None
    if layers is None:
        raise ValueError(f"train.strategy=fsdp2: {type(base).__name__} has no decoder layers to shard "
                         "(get_decoder().layers); use train.strategy=ddp")
    return list(layers)


@dataclass
class Parallel:
    """This process's place in a data-parallel run, and the collectives trainers use.

    ``Parallel()`` is one process: nothing is wrapped and every collective returns its input.

    Attributes:
        active: launched by torchrun (the default process group is initialised), even with one rank.
        strategy: ``train.strategy``.
        rank, world_size: of the default process group.
        device: where this rank computes (``cuda:LOCAL_RANK`` or cpu); collectives run on it
            (NCCL needs CUDA tensors, gloo takes CPU ones).
        fsdp_size: ``train.fsdp_size`` (FSDP2: shard within groups of this many ranks; None: all).
        offload: ``train.offload`` (FSDP2 on CUDA: ``params`` keeps shards in host memory).
    """

    active: bool = False
    strategy: Strategy = "ddp"
    rank: int = 0
    world_size: int = 1
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    fsdp_size: int | None = None
    offload: str = "none"

    @property
    def is_main(self) -> bool:
        """Rank 0: the one that logs and writes."""
        return self.rank == 0

    @property
    def on_meta(self) -> bool:
        """FSDP2 on a rank other than 0: models are built on the meta device, reading and
        allocating no weights; :meth:`wrap` allocates this rank's shards and fills them from rank 0."""
        return self.active and self.strategy == "fsdp2" and not self.is_main

    # ------------------------------------------------------------------ rows

    def shard(self, n: int) -> range:
        """This rank's contiguous block of ``n`` rows (the first ``n % world_size`` ranks get one more)."""
        base, extra = divmod(n, self.world_size)
        start = self.rank * base + min(self.rank, extra)
        return range(start, start + base + (self.rank < extra))

    def share(self, episodes: list[Episode], indices: torch.Tensor, *, share_prompts: bool) -> torch.Tensor:
        """This rank's part of ``indices`` (into ``episodes``, all of the step's): the ranks' parts
        balanced by real tokens (:func:`plainrl.frames.split_by_tokens`; every rank computes the
        same split), so no rank waits long for the busiest. One process: ``indices`` as given.

        Args:
            share_prompts: a prompt counts once per part (``train.share_prompts``).
        Returns:
            [n] int64 indices, in the order the micro-batches take them.
        """
        if not self.active:
            return indices
        parts = split_by_tokens(episodes, indices.tolist(), self.world_size, share_prompts=share_prompts)
        return torch.tensor(parts[self.rank], dtype=torch.long)

    # ------------------------------------------------------------------ collectives

    def sum(self, values: list[float]) -> list[float]:
        """Element-wise sum over the ranks of a few float64 numbers (counts, metric sums)."""
        if not self.active:
            return list(values)
        t = torch.tensor(values, dtype=torch.float64, device=self.device)
        dist.all_reduce(t)
        return t.tolist()

    def max(self, value: int) -> int:
        """The largest ``value`` over the ranks."""
        if not self.active:
            return value
        t = torch.tensor([value], dtype=torch.int64, device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return int(t.item())

    def sum_tensor(self, t: torch.Tensor) -> torch.Tensor:
        """``t`` summed over the ranks (a new tensor on ``t``'s device); ranks that fill
        disjoint rows of a zero tensor assemble the whole this way, exactly."""
        if not self.active:
            return t
        out = t.to(self.device, copy=True)
        dist.all_reduce(out)
        return out.to(t.device)

    def broadcast(self, obj: Any) -> Any:
        """Rank 0's ``obj`` on every rank (a picklable object)."""
        if not self.active:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=0, device=self.device)
        return box[0]

    def gather(self, obj: Any) -> list[Any]:
        """Every rank's ``obj``, in rank order, on every rank (picklable objects)."""
        if not self.active:
            return [obj]
        out: list[Any] = [None] * self.world_size
        dist.all_gather_object(out, obj)
        return out

    def barrier(self) -> None:
        if self.active:
            dist.barrier(device_ids=[self.device.index] if self.device.type == "cuda" else None)

    # ------------------------------------------------------------------ micro-batches

    def even_out(self, count: int) -> int:
        """How many empty micro-batches this rank adds so that every rank runs the same
        number (each forward and backward is a collective under FSDP2, and DDP needs one
        synchronised backward on every rank)."""
        return self.max(count) - count if self.active else 0

    def no_sync(self, call: torch.nn.Module, last: bool):
        """DDP: skip the gradient all-reduce on every micro-batch but the last (gradients
        accumulate locally, one reduction per optimiser step). FSDP2 reduce-scatters after
        every backward, keeping only sharded gradients."""
        if self.active and self.strategy == "ddp" and not last:
            return call.no_sync()
        return contextlib.nullcontext()

    # ------------------------------------------------------------------ wrapping

    def wrap(self, model: torch.nn.Module, *, trainable: bool = True) -> torch.nn.Module:
        """``model`` inside a :class:`ModelCall`, wrapped for ``strategy``; the model's own
        modules keep their names, so state dicts and peft keep working.

        In one process: the bare :class:`ModelCall`. DDP: ``DistributedDataParallel`` with
        a SUM hook, no buffer broadcast (a forward must not be a collective: ranks run
        different numbers of no-grad forwards) and rank 0's weights broadcast at
        construction; a frozen model (``trainable=False``, a reference) is not wrapped.
        FSDP2, with meta-device initialisation: the model moves to the meta device (on ranks
        other than 0 it may have been built there: :func:`plainrl.models.load_policy`'s
        ``meta``), its trainable parameters are cast to float32 there (the sharded copies are
        the optimiser's master weights), ``fully_shard`` is applied to each decoder layer, to a
        value model's ``score`` head (kept float32), and to the root, over every rank or, with
        ``fsdp_size``, within groups of that many ranks and replicated across them (HSDP, a 2-D
        mesh); then each rank allocates its shards alone (in host memory with
        ``offload="params"``) and receives them from rank 0's full tensors, which are the only
        full copy. Computed in the model's dtype (``MixedPrecisionPolicy``, gradients reduced
        in float32). Build the optimiser on the parameters after this call; a tensor of
        ``model`` held elsewhere (a :func:`shared_copy`) keeps its values.

        Raises:
            ValueError: FSDP2, a rank built another model than rank 0 (names, shapes, dtypes).
        """
        call = ModelCall(model)
        if not self.active:
            return call
        if self.strategy == "ddp":
            if not trainable:
                return call
            from torch.nn.parallel import DistributedDataParallel as DDP

            ddp = DDP(call, device_ids=None, broadcast_buffers=False)
            ddp.register_comm_hook([], _sum_hook)
            return ddp
        return self._fully_shard(call, model)

    def frozen_copy(self, model: torch.nn.Module) -> torch.nn.Module:
        """A frozen copy of ``model`` in eval mode (a KL or DPO reference), to be wrapped with
        ``trainable=False``. Under FSDP2 it shares ``model``'s storage instead of copying it:
        wrapping moves each of the two to its own fresh shards (:meth:`wrap`), so nothing
        stays shared once both are wrapped, and a rank never holds a second full copy.
        Elsewhere a deep copy (the policy then trains its own tensors in place)."""
        if self.active and self.strategy == "fsdp2":
            return shared_copy(model).eval().requires_grad_(False)
        return copy.deepcopy(model).eval().requires_grad_(False)

    def _fully_shard(self, call: ModelCall, model: torch.nn.Module) -> torch.nn.Module:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

        from plainrl.models import empty_weights, unwrap

        # Meta-device initialisation (torchtitan's, TRL's and accelerate's order): rank 0's weights
        # are the source (the other ranks may have built the model on the meta device: nothing
        # read, nothing allocated); every rank moves the model to meta, casts there (free), shards
        # there, allocates only its own shards and receives them from rank 0.
        full = model.state_dict() if self.is_main else {}  # references: rank 0's tensors stay alive here
        buffers = {n: b for n, b in model.named_buffers()} if self.is_main else {}  # non-persistent ones too
        self._check_layout(model)
        empty_weights(model, "meta")
        params = [p for p in model.parameters() if p.is_floating_point()]
        compute = next((p.dtype for p in params if p.requires_grad), params[0].dtype)
        for p in params:
            if p.requires_grad and p.dtype != torch.float32:
                p.data = p.data.float()  # the sharded float32 copies are the optimiser's master weights
        mp = MixedPrecisionPolicy(param_dtype=None if compute == torch.float32 else compute,
                                  reduce_dtype=torch.float32)
        shard = self.fsdp_size or self.world_size
        if shard < self.world_size:  # HSDP: fully_shard on a 2-D mesh shards on its last dim, replicates on the first
            mesh = init_device_mesh(self.device.type, (self.world_size // shard, shard),
                                    mesh_dim_names=("replicate", "shard"))
        else:
            mesh = init_device_mesh(self.device.type, (self.world_size,))
        # params: shards, their gradients and (so) the optimizer's state in pinned host memory, each layer
        # copied to the GPU for its forward and backward (torchtitan's and torchtune's offload)
        offload = CPUOffloadPolicy() if self.offload == "params" else OffloadPolicy()
        for layer in decoder_layers(model):
            fully_shard(layer, mesh=mesh, mp_policy=mp, offload_policy=offload)
        head = getattr(unwrap(model), "score", None)
        if isinstance(head, torch.nn.Module):  # a value head reads float32 hidden states
            fully_shard(head, mesh=mesh, mp_policy=MixedPrecisionPolicy(reduce_dtype=torch.float32),
                        offload_policy=offload)
        fully_shard(call, mesh=mesh, mp_policy=mp, offload_policy=offload)
        call.to_empty(device="cpu" if self.offload == "params" else self.device)
        self._load_from_main(model, full, buffers)
        # the logprobs come back as a view; FSDP2 warns that an in-place op on it would skip its
        # pre-backward hook, and plainrl never modifies a forward's output in place
        warnings.filterwarnings("ignore", message=r"FSDP2-wrapped module .* returned a view tensor")
        for m in call.modules():
            if hasattr(m, "set_gradient_divide_factor"):
                m.set_gradient_divide_factor(1.0)  # sum, not mean: the loss is normalised globally
                m.set_force_sum_reduction_for_comms(True)  # gloo has no PREMUL_SUM (a factor of 1 needs none)
        return call

    def _check_layout(self, model: torch.nn.Module) -> None:
        """Every rank built the same parameters and buffers as rank 0 (names, shapes, dtypes):
        a model built from its config on the meta device must match the one loaded from files.

        Raises:
            ValueError: on every rank when one differs (none waits in a collective), naming the
                first difference on that rank.
        """
        layout = {n: (tuple(t.shape), t.dtype) for n, t in [*model.named_parameters(), *model.named_buffers()]}
        main = self.broadcast(layout if self.is_main else None)
        diff = next((n for n in sorted(set(main) | set(layout)) if main.get(n) != layout.get(n)), None)
        if self.max(int(diff is not None)):
            here = f" ({diff}: {layout.get(diff)} here, {main.get(diff)} on rank 0)" if diff else ", see its error"
            raise ValueError(f"train.strategy=fsdp2: a rank built another model than rank 0{here}; every rank "
                             "must load the same model.name and model section")

    @torch.no_grad()
    def _load_from_main(self, model: torch.nn.Module, full: dict[str, torch.Tensor],
                        buffers: dict[str, torch.Tensor]) -> None:
        """Fill the freshly allocated shards from rank 0's full tensors, one tensor at a time
        (``set_model_state_dict`` with ``broadcast_from_rank0``: each rank keeps its slice,
        cast to the shard's dtype), then every buffer (rotary tables are not in the state dict)."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

        set_model_state_dict(model, full, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))
        for name, b in model.named_buffers():
            if self.is_main:
                b.copy_(buffers[name])
            dist.broadcast(b, src=0)


def shared_copy(model: torch.nn.Module) -> torch.nn.Module:
    """A copy of ``model`` (a deep copy of its modules) whose parameters are new
    ``Parameter`` objects over the same storage, and whose buffers are the same tensors:
    no weight is copied. Safe only while ``model``'s tensors are about to be replaced
    (:func:`plainrl.models.empty_weights`, FSDP2's wrap), never for a model that trains in place."""
    memo: dict[int, object] = {}
    for p in model.parameters():
        memo[id(p)] = torch.nn.Parameter(p.detach(), p.requires_grad)
    for b in model.buffers():
        memo[id(b)] = b
    return copy.deepcopy(model, memo)


def connected_positions(positions: torch.Tensor, parallel: Parallel) -> torch.Tensor:
    """The LM-head positions of a micro-batch, with one added when it has none under
    data parallelism: a backward that misses the LM head (no loss token on this rank, or a
    padding micro-batch) would skip its gradient reduction, which the other ranks wait for.
    The added position is off the loss mask, so it adds 0 to the loss and its gradient.

    Args:
        positions: [B, T-1] bool.
    """
    if not parallel.active or bool(positions.any()):
        return positions
    out = positions.clone()
    out.view(-1)[0] = True
    return out


def full_tensor(t: torch.Tensor) -> torch.Tensor:
    """A DTensor gathered to a plain tensor (a collective: every rank calls it); a plain tensor as is."""
    return t.full_tensor() if hasattr(t, "full_tensor") else t
