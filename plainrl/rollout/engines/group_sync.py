"""Full weights to inference servers over a process group, shared by every server backend
that can receive them (``plainrl serve``'s vLLM, SGLang): ``rollout.remote.weights_via:
group`` and its ``auto``.

The trainer is rank 0 and hosts the group's TCP store
(:class:`~plainrl.rollout.engines.weight_group.WeightGroup`); each server's workers join at
consecutive ranks from the server's offset (a tensor-parallel server's workers one rank
each). The group is formed at the first full sync and again whenever the set of live
servers changes; a backend says how many ranks a server has (:meth:`GroupSync._group_ranks`),
how a server is told to join (:meth:`GroupSync._group_join`), and how one sync travels
(:meth:`GroupSync._group_send`). Under ``auto`` a group that cannot be formed, or fails a
broadcast, is dropped for the rest of the run and full weights go the backend's other way
(HTTP or disk), which the log says; under ``group`` that is an error.
"""

from __future__ import annotations

import logging
from concurrent.futures import ThreadPoolExecutor

import httpx
import torch

from plainrl.rollout.engines.requests import EngineError
from plainrl.rollout.engines.served import ServedEngine
from plainrl.rollout.engines.router import ServerDown
from plainrl.rollout.engines.sync import policy_weights
from plainrl.rollout.engines.weight_group import PLAINRL_PREFIXES, WeightGroup, route_address

log = logging.getLogger(__name__)


class GroupSync(ServedEngine):
    """A :class:`~plainrl.rollout.engines.served.ServedEngine` whose full syncs go over a
    weight group where ``weights_via`` allows it.

    Args:
        weights_via: ``group`` (always over the group: an error where it cannot form),
            ``auto`` (the group where one forms, else the backend's other route) or another
            of the backend's routes (``http``, ``path``: never the group).
        group_timeout_s: forming the group, and each bucket's broadcast (seconds).
        Other arguments: :class:`~plainrl.rollout.engines.served.ServedEngine`'s.
    """

    def __init__(self, urls: list[str], tokenizer, *, weights_via: str = "auto", group_timeout_s: float = 60.0,
                 **kwargs):
        self.weights_via = weights_via
        self.group_timeout_s = group_timeout_s
        self._group: WeightGroup | None = None
        self._group_members: tuple[int, ...] = ()
        self._group_name = ""
        self._group_failed = False  # weights_via=auto: a group failed once; the rest of the run goes the other way
        self._groups_formed = 0
        super().__init__(urls, tokenizer, **kwargs)

    # -- what a backend provides ----------------------------------------------------------
    def _group_ranks(self, server: int) -> int:
        """How many ranks server ``server`` joins with (its workers).

        Raises:
            EngineError: the server cannot join a weight group (named, with the reason).
        """
        raise NotImplementedError

    def _group_prefixes(self, name: str, backend: str) -> tuple[str, ...]:
        """The store prefixes, outermost first, under which this backend's receivers form
        group ``name``: both sides must use the same keys (default: plainrl's worker extension's)."""
        return PLAINRL_PREFIXES

    #: whether the receivers read a sequence number that rank 0 writes at creation (groups
    #: built by torch's ``_new_process_group_helper``, as SGLang's are)
    _group_sequence = False

    def _group_join(self, server: int, group: WeightGroup, name: str, offset: int) -> None:
        """Tell server ``server`` to join ``group`` (named ``name``) from rank ``offset``;
        returns once it has (the trainer's :meth:`WeightGroup.connect` runs meanwhile)."""
        raise NotImplementedError

    def _group_leave(self, server: int, name: str) -> None:
        """Tell a server to drop group ``name`` (best effort; default nothing)."""

    def _group_send(self, group: WeightGroup, members: tuple[int, ...], tensors: dict[str, torch.Tensor],
                    device: torch.device) -> None:
        """One full sync over ``group`` to the servers ``members``: ``tensors`` (the policy's
        whole merged state, :func:`~plainrl.rollout.engines.sync.policy_weights`, on ``device``),
        the servers' caches of the old weights dropped."""
        raise NotImplementedError

    # -- the shared flow ---------------------------------------------------------------
    def _uses_group(self) -> bool:
        return self.sync == "full" and (self.weights_via == "group"
                                        or (self.weights_via == "auto" and not self._group_failed))

    def load_weights(self, model: torch.nn.Module) -> None:
        """As :meth:`ServedEngine.load_weights`; a full sync goes over the weight group where
        ``weights_via`` allows it (see the class).

        Raises:
            EngineError: no server holds the new weights, or ``weights_via=group`` and the
                group could not be formed or a broadcast failed.
        """
        if self._uses_group():
            try:
                return self._group_push(model)
            except (EngineError, RuntimeError) as e:
                self._close_group()
                if self.weights_via == "group":
                    raise EngineError(f"rollout.remote.weights_via=group: {e}; use weights_via=auto to fall back "
                                      f"to {self._fallback_route}") from e
                self._group_failed = True
                log.warning("full weights go %s from now on: the weight group failed (%s)", self._fallback_route, e)
        super().load_weights(model)

    #: how full weights travel when the group does not (named in the log and in errors)
    _fallback_route = "over HTTP or a shared file"

    def _group_push(self, model: torch.nn.Module) -> None:
        members = tuple(self._push_targets())
        if not members:
            raise self.pool.none_left()
        if self._group is None or members != self._group_members:
            self._form_group(members)
        assert self._group is not None
        # NCCL sends from GPU memory; gloo from host memory
        device = next(model.parameters()).device if self._group.backend == "nccl" else torch.device("cpu")
        self._group_send(self._group, members, policy_weights(model, device), device)
        for i in members:
            self.pool.revive(i)

    def _form_group(self, members: tuple[int, ...]) -> None:
        """The trainer's store and rank 0, every worker of ``members`` joined (ranks in server
        order, a tensor-parallel server's workers at consecutive ranks from its offset)."""
        self._close_group()
        ranks = [self._group_ranks(i) for i in members]
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        self._groups_formed += 1
        name = f"{self._lora_prefix}-weights-{self._groups_formed}"  # a fresh name: a server keeps old groups' names
        peer = httpx.URL(self.urls[members[0]])
        group = WeightGroup(route_address(peer.host, peer.port or 80), 1 + sum(ranks), backend, self.group_timeout_s,
                            prefixes=self._group_prefixes(name, backend), sequence=self._group_sequence)
        offsets = [1 + sum(ranks[:k]) for k in range(len(members))]
        with ThreadPoolExecutor(max_workers=len(members)) as pool:
            futures = [pool.submit(self._group_join, i, group, name, off) for i, off in zip(members, offsets)]
            try:
                group.connect()
            except BaseException:
                group.close()
                raise
            finally:
                errors = [f.exception() for f in futures]
        error = next((e for e in errors if e is not None), None)
        if error is not None:
            group.close()
            raise error if isinstance(error, (EngineError, ServerDown)) else EngineError(str(error))
        self._group, self._group_members, self._group_name = group, members, name
        log.info("full weights go over a %s process group of %d ranks at %s:%d", backend, group.world_size,
                 group.host, group.port)

    def _close_group(self) -> None:
        if self._group is not None:
            for i in self._group_members:
                self._group_leave(i, self._group_name)
            self._group.close()
        self._group, self._group_members = None, ()

    def close(self) -> None:
        """As :meth:`ServedEngine.close`, and the weight group is dropped."""
        self._close_group()
        super().close()
