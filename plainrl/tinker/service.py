"""The Tinker service's state: sessions, training models, samplers, checkpoints on disk, and the
futures the SDK polls.

Every computation on the model runs on one worker thread, in the order the requests arrived (the
SDK sends a training client's requests one after another, in its own order), so adapters can be
switched safely and a ``forward_backward`` followed by an ``optim_step`` applies in that order.
A request is checked when it arrives (a bad one is a 4xx at once and queues nothing); its work
is queued and its future id returned; ``retrieve_future`` waits for it.

Checkpoints: ``tinker://<model_id>/weights/<name>`` (``save_state``) and
``tinker://<model_id>/sampler_weights/<name>`` (``save_weights_for_sampler``) are the directories
``ROOT/<model_id with ':' as '_'>/weights/<name>`` and ``.../sampler_weights/<name>``, each a plainrl
run directory: ``config.yaml`` (the service's config) and ``final/`` (the peft adapter with its
model card), so ``plainrl eval DIR`` and ``plainrl export DIR --merge OUT`` take it; ``save_state``
adds ``optimizer.pt`` (AdamW's state) beside them.
"""

from __future__ import annotations

import concurrent.futures
import itertools
import json
import logging
import shutil
import threading
import uuid
from collections import Counter, OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from tinker import types

from plainrl.durable import write_atomic
from plainrl.models.errors import ModelLoadError
from plainrl.models.lora_targets import lora_target_modules
from plainrl.tinker.adapters import read_optimizer
from plainrl.tinker.bases import Base
from plainrl.tinker.checkpoints import OPTIMIZER_FILE, checkpoint_path, model_dir, resolve, write_checkpoint
from plainrl.tinker.errors import UserError, not_found
from plainrl.tinker.lifecycle import ENDED_KEPT, EphemeralSamplers, Sessions, superseded
from plainrl.tinker.sampling import SampleCall, prompt_logprobs, sample, topk_prompt_logprobs
from plainrl.tinker.served import ServedSampling
from plainrl.tinker.stability import StabilityRecords, session_of
from plainrl.tinker.training import TrainingModel, forward_backward, make_optimizer, optim_step
from plainrl.tinker.wire import ForwardBackwardCall, encode_sample_response

log = logging.getLogger(__name__)

MAX_FUTURES = 10_000


@dataclass
class Sampler:
    """A sampling session: the base model, a sampler checkpoint (``directory``, its ``final/``), or
    an ephemeral snapshot (``ephemeral``): the frozen in-memory adapter ``adapter`` on the embedded
    engine, the checkpoint ``directory`` under ``ROOT/<model>/ephemeral/`` on servers."""

    sampler_id: str
    base_model: str
    model_path: str | None
    directory: Path | None
    adapter: str | None = None
    ephemeral: bool = False
    freed: bool = False  # an ephemeral snapshot superseded (its weights are gone)


class Service:
    """Everything the routes act on.

    Args:
        bases: the base models, the default (a request that names none) first.
        root: where training models' checkpoints go (``tinker://`` paths resolve under it).
        micro_batch_tokens: padded tokens per forward/backward micro-batch.
        served: sampling on inference servers (None: the embedded engine on ``adapters``).
        sample_context: the longest prompt plus ``max_tokens`` a sample of the default base may ask
            for (the servers' context under ``served``); default the model's.
        session_expiry_s: a session unheard of for longer ends and its state is freed (None: never).
        ephemeral_samplers: the ``save_weights_and_get_sampling_client`` snapshots a training
            client keeps (older ones are freed).
    """

    def __init__(self, bases: list[Base], root: Path, *, micro_batch_tokens: int = 4096,
                 served: ServedSampling | None = None, sample_context: int | None = None,
                 session_expiry_s: float | None = None, ephemeral_samplers: int = 4):
        self.bases = bases
        self._by_name = {n: b for b in bases for n in b.names}
        self.adapters = bases[0].adapters  # the default base's
        self.served = served
        self.root = Path(root).resolve()  # absolute: servers are handed checkpoint paths under it
        self.model_names = list(self._by_name)
        self.base_model = bases[0].name
        self.micro_batch_tokens = micro_batch_tokens
        self.sample_context = sample_context or self.adapters.context
        self.sessions = Sessions(session_expiry_s)
        self.models: dict[str, TrainingModel] = {}
        self.samplers: dict[str, Sampler] = {}
        self.ephemeral = EphemeralSamplers(ephemeral_samplers)
        self.freed_samplers: OrderedDict[str, None] = OrderedDict()  # superseded snapshots, the newest ENDED_KEPT
        self.futures: dict[str, concurrent.futures.Future] = {}
        self.stability = StabilityRecords()  # sequences sampled with record_stability_info (stable_reinforce)
        self._ids = itertools.count(1)
        self._adapter_ids = itertools.count(1)
        self._lock = threading.Lock()
        self._pending: Counter[str] = Counter()  # session -> its requests queued or running
        self._worker = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="tinker-worker")
        self._closed = False
        self._stop = threading.Event()
        if session_expiry_s is not None:
            threading.Thread(target=self._expire_loop, name="tinker-expiry", daemon=True).start()

    def close(self) -> None:
        """Stop the worker (the process is exiting) and unload this service's adapters from the
        servers; once (the app's shutdown and the server's exit both call it)."""
        if self._closed:
            return
        self._closed = True
        self._stop.set()
        self._worker.shutdown(wait=False, cancel_futures=True)
        if self.served is not None:
            self.served.close()

    # -- futures ----------------------------------------------------------------------------------

    def submit(self, fn: Callable[[], Any], model_id: str | None = None,
               session: str | None = None) -> types.UntypedAPIFuture:
        """Queue ``fn`` on the worker; the SDK's handle to its result. The session (``session``,
        else ``model_id``'s) does not expire while the work waits or runs, and is seen when it ends."""
        session = session or (None if model_id is None else session_of(model_id))
        with self._lock:
            request_id = f"req-{next(self._ids)}"
            if session is not None:
                self._pending[session] += 1
            future = self._worker.submit(fn)
            self.futures[request_id] = future
            while len(self.futures) > MAX_FUTURES:
                self.futures.pop(next(iter(self.futures)))
        if session is not None:
            future.add_done_callback(lambda _: self._done(session))
        return types.UntypedAPIFuture(request_id=request_id, model_id=model_id)

    def _done(self, session: str) -> None:
        with self._lock:
            self._pending[session] -= 1
            if self._pending[session] <= 0:
                del self._pending[session]
        self.sessions.seen(session)

    # -- sessions and models ----------------------------------------------------------------------

    def create_session(self) -> str:
        return self.sessions.create()

    def check_session(self, session_id: str) -> None:
        """Note a sign of life of ``session_id``; a 404 saying why if it has ended."""
        self.sessions.touch(session_id)

    def model(self, model_id: str) -> TrainingModel:
        """Training model ``model_id`` (its session is alive: a request of it counts as a heartbeat)."""
        tm = self.models.get(model_id)
        if tm is None:
            self.check_session(session_of(model_id))  # an ended session says why
            raise not_found("training model", model_id, "create one with create_lora_training_client")
        self.check_session(session_of(model_id))
        return tm

    def check_base(self, base_model: str | None) -> Base:
        """The base named ``base_model`` (None: the default).

        Raises:
            UserError: no base of that name.
        """
        if base_model is None:
            return self.bases[0]
        if base_model not in self._by_name:
            raise UserError(f"base_model={base_model!r} is not served here; this service trains {self.model_names} "
                            "(start `plainrl tinker` with tinker.base_models=[...] for others)")
        return self._by_name[base_model]

    def base(self, name: str) -> Base:
        """The base a training model or sampler names (by its first name)."""
        return self._by_name[name]

    def context(self, base: Base) -> int:
        """The longest prompt plus ``max_tokens`` a sample of ``base`` may ask for."""
        return self.sample_context if base is self.bases[0] else base.adapters.context

    def create_model(self, req: types.CreateModelRequest) -> types.UntypedAPIFuture:
        self.check_session(req.session_id)
        base = self.check_base(req.base_model)
        adapters = base.adapters
        lora = req.lora_config or types.LoraConfig(rank=32)
        if lora.rank < 1:
            raise UserError(f"lora_config.rank={lora.rank} must be at least 1")
        if lora.train_unembed and adapters.tied_head and not (lora.train_attn or lora.train_mlp):
            raise UserError("lora_config: train_unembed alone on a model whose LM head is tied to its input "
                            "embedding; this service trains no LoRA on a tied head (docs/tinker.md): set "
                            "train_attn or train_mlp")
        try:  # the layer groups' module names, by the base's architecture
            targets = lora_target_modules(adapters.base.config, adapters.linear_names,
                                          attn=lora.train_attn, mlp=lora.train_mlp,
                                          unembed=lora.train_unembed and not adapters.tied_head,
                                          name=adapters.name)
        except ModelLoadError as e:
            raise UserError(f"lora_config: {e}") from e
        model_id = f"{req.session_id}:train:{req.model_seq_id}"

        def run() -> types.CreateModelResponse:
            name = f"m{next(self._adapter_ids)}"
            adapters.create(name, rank=lora.rank, targets=targets, seed=lora.seed)
            self._register(model_id, base, name, lora.rank, targets)
            return types.CreateModelResponse(model_id=model_id)

        return self.submit(run, model_id)

    def _register(self, model_id: str, base: Base, adapter: str, rank: int, targets: list[str]) -> TrainingModel:
        tm = TrainingModel(model_id, adapter, base.name, rank, targets,
                           make_optimizer(base.adapters.parameters(adapter)))
        with self._lock:
            self.models[model_id] = tm
        if session_of(model_id) not in self.sessions:  # it ended while this was queued
            self.end_session(session_of(model_id), "")
        d = self.model_dir(model_id)
        d.mkdir(parents=True, exist_ok=True)
        write_atomic(d / "training_run.json", json.dumps(
            {"model_id": model_id, "base_model": base.name, "lora_rank": rank, "targets": targets}))
        return tm

    def info(self, model_id: str) -> types.GetInfoResponse:
        tm = self.model(model_id)
        adapters = self.base(tm.base_model).adapters
        return types.GetInfoResponse(
            model_id=model_id, is_lora=True, lora_rank=tm.rank, model_name=tm.base_model,
            model_data=types.ModelData(arch=adapters.arch, model_name=tm.base_model, tokenizer_id=adapters.local_path))

    def end_session(self, session_id: str, why: str) -> None:
        """End ``session_id`` (``why``: for the error a later request of it gets): its training
        models, their optimizer state and its samplers are dropped, their adapters and ephemeral
        snapshots freed on the worker (after the work already queued)."""
        self.sessions.end(session_id, why)
        with self._lock:
            models = [self.models.pop(m) for m in list(self.models) if session_of(m) == session_id]
            samplers = [self.samplers.pop(x) for x in list(self.samplers) if session_of(x) == session_id]
            for tm in models:
                self.ephemeral.drop_model(tm.model_id)
        for sp in samplers:
            sp.freed = True

        def run() -> None:
            for tm in models:
                self.base(tm.base_model).adapters.drop(tm.adapter)
            for sp in samplers:
                self._free(sp)

        if models or samplers:
            self._worker.submit(run)

    def finish_session(self, session_id: str) -> None:
        """The client closed ``session_id``."""
        self.end_session(session_id, "was closed")

    def expire(self, now: float | None = None) -> list[str]:
        """End the sessions unheard of for longer than ``tinker.session_expiry_s`` (at ``now``,
        ``time.monotonic()`` seconds; default now); their ids."""
        with self._lock:  # a session whose work waits or runs is not idle
            gone = [x for x in self.sessions.expired(now) if not self._pending.get(x)]
        for session_id in gone:
            self.end_session(session_id, f"missed its heartbeats for over {self.sessions.expiry_s:g} s "
                                         "(tinker.session_expiry_s) and was ended")
        if gone:
            log.info("sessions expired: %s", gone)
        return gone

    def _expire_loop(self) -> None:
        while not self._stop.wait(min(self.sessions.expiry_s / 4, 30.0)):
            self.expire()

    # -- training ---------------------------------------------------------------------------------

    def forward_backward(self, call: ForwardBackwardCall) -> types.UntypedAPIFuture:
        tm = self.model(call.model_id)
        return self.submit(lambda: forward_backward(self.base(tm.base_model).adapters, tm, call,
                                                    micro_batch_tokens=self.micro_batch_tokens), call.model_id)

    def optim_step(self, req: types.OptimStepRequest) -> types.UntypedAPIFuture:
        tm = self.model(req.model_id)
        p = req.optim_params
        if not isinstance(p, types.AdamParams):
            raise UserError(f"optim_params of type {getattr(p, 'type', '?')!r}: this service steps AdamW only "
                            "(pass types.AdamParams)")
        if p.learning_rate < 0 or not (0 <= p.beta1 < 1 and 0 <= p.beta2 < 1) or p.eps <= 0:
            raise UserError(f"adam_params: learning_rate={p.learning_rate} must be >= 0, beta1={p.beta1} and "
                            f"beta2={p.beta2} in [0, 1), eps={p.eps} > 0")

        def run() -> types.OptimStepResponse:
            return types.OptimStepResponse(metrics=optim_step(
                tm, learning_rate=p.learning_rate, beta1=p.beta1, beta2=p.beta2, eps=p.eps,
                weight_decay=p.weight_decay, grad_clip_norm=p.grad_clip_norm))

        return self.submit(run, req.model_id)

    # -- checkpoints ------------------------------------------------------------------------------

    def model_dir(self, model_id: str) -> Path:
        return model_dir(self.root, model_id)

    def checkpoint_path(self, model_id: str, kind: str, name: str) -> tuple[str, Path]:
        return checkpoint_path(self.root, model_id, kind, name)

    def resolve(self, tinker_path: str) -> tuple[str, str, Path]:
        return resolve(self.root, tinker_path)

    def checkpoint_base(self, directory: Path) -> Base:
        """The base checkpoint ``directory`` is an adapter of (its ``tinker.json``; the default
        base for a checkpoint without one).

        Raises:
            UserError: a base this service does not serve.
        """
        record = directory / "final" / "tinker.json"
        name = json.loads(record.read_text()).get("base_model") if record.is_file() else None
        if name is not None and name not in self._by_name:
            raise UserError(f"{directory} is an adapter of {name!r}, which this service does not serve "
                            f"({self.model_names}); add it to tinker.base_models")
        return self.bases[0] if name is None else self._by_name[name]

    def save(self, model_id: str, kind: str, name: str | None, *, with_optimizer: bool) -> Callable[[], tuple[str, Path]]:
        """The work that saves ``model_id``'s adapter (and optimizer) as checkpoint ``name``; checked now."""
        tm = self.model(model_id)
        name = name or f"ephemeral-{uuid.uuid4().hex[:8]}"
        path, directory = self.checkpoint_path(model_id, kind, name)

        def run() -> tuple[str, Path]:
            base = self.base(tm.base_model)
            write_checkpoint(base.adapters, tm, directory, path, config_yaml=base.config_yaml,
                             optimizer=tm.optimizer.state_dict() if with_optimizer else None)
            return path, directory

        return run

    def load(self, req: types.LoadWeightsRequest) -> types.UntypedAPIFuture:
        """``load_state`` into an existing model, or a new model created from a checkpoint."""
        _, kind, directory = self.resolve(req.path)
        if req.optimizer and not (directory / OPTIMIZER_FILE).is_file():
            raise UserError(f"path={req.path!r} holds no optimizer state (a sampler checkpoint); load it without "
                            "the optimizer, or save with save_state")
        base = self.checkpoint_base(directory)
        if req.model_id is not None:
            tm = self.model(req.model_id)
            asked = tm.base_model
        else:
            if req.session_id is None or req.model_seq_id is None:
                raise UserError("load_weights: give model_id, or session_id and model_seq_id")
            self.check_session(req.session_id)
            tm, asked = None, self.check_base(req.base_model or base.name).name
        if asked != base.name:
            raise UserError(f"path={req.path!r} is an adapter of {base.name!r}, not of {asked!r}")
        adapters = base.adapters
        model_id = req.model_id or f"{req.session_id}:train:{req.model_seq_id}"

        def run() -> types.LoadWeightsResponse:
            target = tm
            if target is None:
                name = f"m{next(self._adapter_ids)}"
                adapters.create_from(name, directory / "final")
                target = self._register(model_id, base, name, adapters.rank(name), adapters.targets(name))
            else:
                adapters.load_weights(target.adapter, directory / "final")
                # load_state: a fresh AdamW (zero moments); with the optimizer, the 16-bit adapters'
                # masters follow the loaded weights before the saved state replaces them
                if req.optimizer:
                    target.optimizer.masters_from_params()
                else:
                    target.optimizer = make_optimizer(adapters.parameters(target.adapter))
            if req.optimizer:
                state = read_optimizer(directory / OPTIMIZER_FILE)
                target.optimizer.load_state_dict(state)
                target.steps = int(state["steps"])
            return types.LoadWeightsResponse(path=req.path, model_id=model_id)

        return self.submit(run, model_id)

    # -- sampling ---------------------------------------------------------------------------------

    def add_sampler(self, session_id: str, seq: int, model_path: str | None, base_model: str | None) -> Sampler:
        directory = None
        if model_path is not None:
            _, _, directory = self.resolve(model_path)
            base = self.checkpoint_base(directory)
        else:
            base = self.check_base(base_model)
        sampler = Sampler(f"{session_id}:sample:{seq}", base.name, model_path,
                          None if directory is None else directory / "final")
        self.samplers[sampler.sampler_id] = sampler
        return sampler

    def sampler(self, sampler_id: str) -> Sampler:
        """Sampler ``sampler_id`` (a request of it counts as its session's heartbeat).

        Raises:
            UserError: an unknown sampler, one of an ended session (404), a superseded snapshot (400).
        """
        s = self.samplers.get(sampler_id)
        if s is None:
            if sampler_id in self.freed_samplers:
                raise superseded(sampler_id, self.ephemeral.kept)
            if session_of(sampler_id) in self.sessions.ended:
                self.check_session(session_of(sampler_id))
            raise not_found("sampling session", sampler_id, "create one with create_sampling_client")
        if s.ephemeral:
            self.check_session(session_of(sampler_id))
        return s

    def save_ephemeral(self, model_id: str, seq: int) -> Callable[[], Sampler]:
        """The work of ``save_weights_and_get_sampling_client``: a snapshot of ``model_id``'s
        adapter as sampler ``<session>:sample:<seq>``, in memory (the embedded engine) or as a
        checkpoint under ``ROOT/<model>/ephemeral/`` pushed to the servers; the training model's
        snapshots beyond ``tinker.ephemeral_samplers`` are freed. Checked now."""
        tm = self.model(model_id)
        sampler_id = f"{session_of(model_id)}:sample:{seq}"
        save = None if self.served is None else self.save(model_id, "ephemeral", str(seq), with_optimizer=False)

        def run() -> Sampler:
            with self._lock:
                gone = [self.samplers.pop(x) for x in self.ephemeral.add(model_id, sampler_id) if x in self.samplers]
                for old in gone:
                    old.freed = True
                    self.freed_samplers[old.sampler_id] = None
                while len(self.freed_samplers) > ENDED_KEPT:
                    self.freed_samplers.popitem(last=False)
            adapters = self.base(tm.base_model).adapters
            # a superseded snapshot's adapter takes the new weights in place (adding one costs seconds)
            reuse = next((old.adapter for old in gone if old.adapter is not None), None)
            for old in gone:
                if old.adapter is None or old.adapter != reuse:
                    self._free(old)
            if save is None:
                name = reuse or f"e{next(self._adapter_ids)}"
                adapters.refill(tm.adapter, name) if reuse else adapters.copy(tm.adapter, name)
                sampler = Sampler(sampler_id, tm.base_model, None, None, adapter=name, ephemeral=True)
            else:
                _, directory = save()
                self.publish(directory)
                sampler = Sampler(sampler_id, tm.base_model, None, directory / "final", ephemeral=True)
            with self._lock:
                self.samplers[sampler_id] = sampler
            if model_id not in self.models:  # its session ended while this was queued
                self.end_session(session_of(model_id), "")
            return sampler

        return run

    def _free(self, sampler: Sampler) -> None:
        """Free an ephemeral snapshot's weights (on the worker): its in-memory adapter, or its
        checkpoint directory and the servers' copy."""
        if not sampler.ephemeral:
            return
        adapters = self.base(sampler.base_model).adapters
        if sampler.adapter is not None:
            adapters.drop(sampler.adapter)
        elif sampler.directory is not None and sampler.directory.is_dir():
            adapters.forget(sampler.directory)
            if self.served is not None:
                self.served.forget(sampler.directory)
            shutil.rmtree(sampler.directory.parent, ignore_errors=True)

    def publish(self, directory: Path) -> None:
        """After ``save_weights_for_sampler`` wrote ``directory``: push it to the servers (on the
        worker), so the first sample finds it there; nothing for the embedded engine."""
        if self.served is not None:
            self.served.push(directory / "final")

    def sample(self, sampler: Sampler, call: SampleCall,
               record_as: list[str] | None = None) -> types.UntypedAPIFuture:
        """Queue ``call`` on ``sampler``; with ``record_as`` (one sequence id per sample) what each
        sample drew is recorded in :attr:`stability` under its id (``record_stability_info``)."""
        def run() -> bytes:
            if sampler.freed:  # superseded, or its session ended, while this waited
                raise UserError(f"sampler {sampler.sampler_id!r} was freed while this request waited (a newer "
                                "snapshot superseded it, or its session ended)")
            seqs = None if self.served is None else self.served.sample(sampler.directory, call)
            prompt_lp = topk = None
            if seqs is None or call.prompt_logprobs or call.topk:
                adapters = self.base(sampler.base_model).adapters
                name = sampler.adapter or (None if sampler.directory is None else adapters.snapshot(sampler.directory))
                with adapters.use(name) as model:
                    if seqs is None:
                        seqs = sample(model, adapters.tokenizer, call)
                    if call.prompt_logprobs:
                        prompt_lp = prompt_logprobs(model, call)
                    if call.topk:
                        topk = topk_prompt_logprobs(model, call)
            for sequence_id, (tokens, logprobs, _) in zip(record_as or [], seqs):
                self.stability.record(sequence_id, session_of(sampler.sampler_id), call.prompt, tokens, logprobs)
            return encode_sample_response(seqs, prompt_lp, topk)

        return self.submit(run, session=session_of(sampler.sampler_id))
