"""``rollout.remote.backend: sglang``: sampling through SGLang servers, which users start
themselves (``python -m sglang.launch_server ...``; ``plainrl serve`` starts vLLM only:
docs/engines.md, "SGLang"), with the learner's weights pushed after each update.

Sampling uses SGLang's native ``/generate`` with token ids in (``input_ids``) and out
(``output_ids``, and ``meta_info.output_token_logprobs``: one ``[logprob, token_id, text]``
per generated token, with ``return_logprob``). A group is one HTTP request holding its
prompt ``n`` times, one sampling-params entry each: SGLang's docs advise repeating a
prompt over ``n > 1`` (its radix cache shares the prefix). Seeded calls (every run's) send
one request per sample with its own seed as ``sampling_seed`` (reduced modulo 2**31 - 1),
which SGLang honours only when started with ``--enable-deterministic-inference``; without
that flag SGLang's sampling is not seeded, and a run's samples are not reproducible.

SGLang's logprobs are of the distribution after temperature (log softmax(z / T); greedy:
log softmax(z)), plainrl's convention with top-k/top-p off, unless the server runs with
``SGLANG_RETURN_ORIGINAL_LOGPROB=1`` (logprobs before temperature): leave it unset.

Weight sync: LoRA adapters through ``/load_lora_adapter`` under a new name per update
(requests name it as ``lora_path``; the previous one is unloaded with
``/unload_lora_adapter``). Full weights (``weights_via``): ``group`` over a process group
(:mod:`~plainrl.rollout.engines.group_sync`): each server joins through
``/init_weights_update_group`` (its tensor-parallel workers at ``rank_offset + tp_rank``,
NCCL on CUDA, gloo on CPU), and each bucket of whole layers goes as one
``/update_weights_from_distributed`` request with ``load_format: flattened_bucket`` while the
trainer broadcasts the bucket (SGLang 0.5.6 or later; the last bucket's request flushes the
radix cache). ``path``: a Hugging Face directory in ``shared_dir`` loaded by
``/update_weights_from_disk``, then ``/flush_cache``. ``auto``: the group where one forms,
else the directory. SGLang's ``/update_weights_from_tensor`` (CUDA IPC handles: same machine
only) is not wired.

Source: SGLang's ``python/sglang/srt/entrypoints/http_server.py`` (the endpoints),
``managers/io_struct.py`` (``GenerateReqInput``, ``UpdateWeightFromDiskReqInput``,
``InitWeightsUpdateGroupReqInput``, ``UpdateWeightsFromDistributedReqInput``,
``LoadLoRAAdapterReqInput``), ``sampling/sampling_params.py``,
``managers/tokenizer_manager.py`` (the response), ``utils/common.py``
(``init_custom_process_group``), ``weight_sync/tensor_bucket.py`` (``FlattenedTensorBucket``)
and ``model_executor/model_runner_components/weight_updater.py``, read at SGLang 0.5.23
(the flattened bucket over a group since 0.5.6, sglang#13824).
"""

from __future__ import annotations

import shutil
import uuid
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from typing import Any, Callable, Iterator

import httpx
import torch

from plainrl.rollout.engines.group_sync import GroupSync
from plainrl.rollout.engines.requests import EngineError, Request, finish_reason
from plainrl.rollout.engines.sync import SyncMode, save_hf_weights
from plainrl.rollout.engines.weight_group import WeightGroup, broadcast, pack, plan_buckets
from plainrl.types import Generation, SamplingParams

START_HINT = ("start one with `python -m sglang.launch_server --model-path MODEL_DIR --port PORT` "
              "(docs/engines.md, \"SGLang\", gives the flags a run needs)")


def generate_body(prompt_ids: list[int], params: SamplingParams, *, n: int, seed: int | None, seeded: bool,
                  lora: str | None) -> dict[str, Any]:
    """SGLang's ``/generate`` request for ``n`` samples of one prompt.

    Every sampling parameter is sent, neutral penalties included: SGLang otherwise takes
    defaults from the model's ``generation_config.json``. ``top_k = -1`` is SGLang's "off";
    ``temperature = 0`` is greedy there too. ``no_stop_trim`` keeps the stop string in the
    text, as its tokens stay in ``output_ids``.

    Args:
        prompt_ids: [P] token ids.
        seed: the request's seed (None: unseeded); sample i gets ``seed + i`` as ``sampling_seed``
            when ``seeded``.
        seeded: the server runs with ``--enable-deterministic-inference`` (else SGLang ignores seeds).
        lora: the adapter name to sample with (None: the base weights).
    """
    base = dict(max_new_tokens=params.max_new_tokens, temperature=params.temperature, top_p=params.top_p,
                top_k=params.top_k if params.top_k > 0 else -1, min_p=0.0, repetition_penalty=1.0,
                frequency_penalty=0.0, presence_penalty=0.0, stop=list(params.stop), no_stop_trim=True,
                skip_special_tokens=False)
    if params.stop_token_ids is not None:  # those ids instead of the EOS, as the embedded engine's
        base.update(stop_token_ids=list(params.stop_token_ids), ignore_eos=True)
    sampling = [dict(base, sampling_seed=(seed + i) % (2**31 - 1)) if seeded and seed is not None else base
                for i in range(n)]
    body: dict[str, Any] = {"input_ids": [list(prompt_ids)] * n, "sampling_params": sampling, "return_logprob": True}
    if lora is not None:
        body["lora_path"] = [lora] * n
    return body


def parse_generation(output: dict[str, Any], url: str) -> Generation:
    """One ``/generate`` output as a :class:`Generation`: the ids and logprobs of
    ``meta_info.output_token_logprobs`` (``[logprob, token_id, text]`` per generated token,
    the EOS token included), the finish reason from ``meta_info.finish_reason``
    (``{"type": "stop", "matched": EOS id (int) or stop string (str)}`` or ``{"type": "length"}``).

    Raises:
        EngineError: ``output_ids`` and the logprobs' ids disagree, or the request was aborted.
    """
    meta = output["meta_info"]
    pairs = meta["output_token_logprobs"]
    ids = [int(p[1]) for p in pairs]
    if output.get("output_ids") is not None and list(output["output_ids"]) != ids:
        raise EngineError(f"SGLang server {url} returned {len(output['output_ids'])} output ids that differ from the "
                          f"{len(ids)} ids of its output_token_logprobs")
    reason = meta.get("finish_reason") or {}
    return Generation(token_ids=ids, logprobs=[float(p[0]) for p in pairs],
                      finish_reason=finish_reason(reason.get("type"), reason.get("matched"), f"SGLang server {url}"))


GROUP_MIN_VERSION = (0, 5, 6)  # the first SGLang whose /update_weights_from_distributed takes a flattened bucket


def sglang_prefixes(name: str, backend: str) -> tuple[str, ...]:
    """The store prefixes SGLang's ``init_custom_process_group`` puts before group ``name``'s
    keys, outermost first: its own ``PrefixStore(group_name)``, then torch's
    ``_new_process_group_helper``'s ``"{group_name}/"`` and ``"{device}/"`` (``cuda`` for NCCL,
    ``cpu`` for gloo). The trainer's rank 0 must use the same to meet the receivers."""
    return (name, f"{name}/", "cuda/" if backend == "nccl" else "cpu/")


def distributed_body(bucket, name: str, *, flush_cache: bool) -> dict[str, Any]:
    """``/update_weights_from_distributed``'s request (SGLang's
    ``UpdateWeightsFromDistributedReqInput``) for one tight bucket
    (:func:`~plainrl.rollout.engines.weight_group.plan_buckets` with ``tight``) broadcast as
    one flat ``uint8`` tensor into SGLang's ``FlattenedTensorBucket``."""
    return {"names": [s.name for s in bucket], "dtypes": [s.dtype for s in bucket],
            "shapes": [list(s.shape) for s in bucket], "group_name": name, "load_format": "flattened_bucket",
            "flush_cache": flush_cache}


def _version(text: str) -> tuple[int, ...]:
    """``"0.5.10rc0"`` -> ``(0, 5, 10)`` (the release numbers); ``()`` for no version."""
    from packaging.version import InvalidVersion, Version

    try:
        return Version(str(text)).release
    except InvalidVersion:
        return ()


class SGLangEngine(GroupSync):
    """The :class:`~plainrl.rollout.engines.base.Engine` protocol over SGLang servers.
    Arguments as :class:`~plainrl.rollout.engines.group_sync.GroupSync`'s, with
    ``weights_via``: ``group``, ``path`` (a directory in ``shared_dir``) or ``auto``.

    Raises:
        EngineError: a server is unreachable, serves another tokenizer or a shorter context,
            is not a generation model, runs with ``--skip-tokenizer-init`` (stop strings and
            ``/tokenize`` need its tokenizer), or lacks ``--enable-lora`` for a LoRA sync.
    """

    backend = "sglang"
    start_hint = START_HINT
    lora_endpoints = ("/load_lora_adapter", "/unload_lora_adapter")
    _fallback_route = "through a directory in rollout.remote.shared_dir (/update_weights_from_disk)"
    _group_sequence = True  # SGLang's groups come from torch's _new_process_group_helper

    def __init__(self, urls: list[str], tokenizer, *, sync: SyncMode, **kwargs):
        self._seeded: dict[str, bool] = {}  # url -> runs with --enable-deterministic-inference
        self._server_info: dict[str, dict] = {}  # url -> /get_server_info
        super().__init__(urls, tokenizer, sync=sync, **kwargs)

    def _check_backend(self, url: str) -> None:
        info = self._call("GET", url, "/get_model_info", timeout=self._probe_timeout).json()
        if not info.get("is_generation", True):
            raise EngineError(f"SGLang server {url} serves {info.get('model_path')!r} as an embedding/reward model, "
                              f"not a generation model")
        args = self._call("GET", url, "/get_server_info", timeout=self._probe_timeout).json()
        if args.get("skip_tokenizer_init"):
            raise EngineError(f"SGLang server {url} runs with --skip-tokenizer-init: plainrl needs its tokenizer "
                              f"(stop strings, the tokenizer check); start it without that flag")
        if self.sync == "lora" and not (args.get("enable_lora") or args.get("lora_paths")):
            raise EngineError(f"SGLang server {url} runs without LoRA, so it cannot load the run's adapter: start it "
                              f"with --enable-lora --max-lora-rank R --lora-target-modules all (R >= model.lora.r), "
                              f"or push merged weights with rollout.sync=full")
        self._seeded[url] = bool(args.get("enable_deterministic_inference"))
        self._server_info[url] = args

    # -- the weight group (GroupSync's hooks) --------------------------------------------
    def _group_ranks(self, server: int) -> int:
        """A server's tensor-parallel size; SGLang 0.5.6+ with one data-parallel replica and
        one pipeline stage (its workers would otherwise share ranks in the group).

        Raises:
            EngineError: an older SGLang, or data or pipeline parallelism.
        """
        url = self.urls[server]
        info = self._server_info.get(url) or {}
        version = _version(info.get("version", ""))
        if version < GROUP_MIN_VERSION:
            raise EngineError(f"SGLang server {url} is version {info.get('version')!r}: a weight group needs SGLang "
                              f">= 0.5.6 (/update_weights_from_distributed with load_format=flattened_bucket)")
        for key in ("dp_size", "pp_size"):
            if int(info.get(key) or 1) != 1:
                raise EngineError(f"SGLang server {url} runs with {key}={info[key]}: a weight group reaches servers of "
                                  f"one data-parallel replica and one pipeline stage; start one server per replica")
        return int(info.get("tp_size") or 1)

    def _group_prefixes(self, name: str, backend: str) -> tuple[str, ...]:
        return sglang_prefixes(name, backend)

    def _group_join(self, server: int, group: WeightGroup, name: str, offset: int) -> None:
        self._call("POST", self.urls[server], "/init_weights_update_group", retries=0, json={
            "master_address": group.host, "master_port": group.port, "rank_offset": offset,
            "world_size": group.world_size, "group_name": name, "backend": group.backend})

    def _group_leave(self, server: int, name: str) -> None:
        try:
            self.client.post(self.urls[server] + "/destroy_weights_update_group", json={"group_name": name},
                             timeout=self._probe_timeout)
        except httpx.HTTPError:  # best effort: a dead server has no group to drop
            pass

    def _group_send(self, group: WeightGroup, members: tuple[int, ...], tensors: dict[str, torch.Tensor],
                    device: torch.device) -> None:
        """Bucket by bucket: every server is sent the bucket's request (it allocates the
        bucket and joins the broadcast), the trainer broadcasts it, and the requests return
        once each server has loaded it. One bucket at a time: a server takes its requests in
        order, and a second one sent early could overtake the first."""
        buckets = plan_buckets(tensors.items(), tight=True)
        assert group.group is not None
        pool = ThreadPoolExecutor(max_workers=len(members))
        try:
            for k, bucket in enumerate(buckets):
                flat = pack(bucket, tensors, device)
                body = distributed_body(bucket, self._group_name, flush_cache=k == len(buckets) - 1)
                futures = [pool.submit(self._call, "POST", self.urls[i], "/update_weights_from_distributed",
                                       json=body, retries=0) for i in members]
                broadcast(group.group, flat, group.timeout_s)
                for f in futures:
                    f.result()
        finally:  # after a failed broadcast, the servers' requests are not waited for (they end on their own)
            pool.shutdown(wait=False, cancel_futures=True)

    @contextmanager
    def _full_push(self, model: torch.nn.Module) -> Iterator[Callable[[str], None]]:
        """The merged weights as a Hugging Face directory in ``shared_dir`` (every server must
        read it at the same path), loaded by ``/update_weights_from_disk``; then
        ``/flush_cache`` drops the radix cache, whose entries were computed with the old weights."""
        directory = save_hf_weights(model, self._adapters.root / f"weights-{uuid.uuid4().hex}")

        def push(url: str) -> None:
            self._call("POST", url, "/update_weights_from_disk", json={"model_path": str(directory)})
            self._call("POST", url, "/flush_cache")

        try:
            yield push
        finally:
            shutil.rmtree(directory, ignore_errors=True)
