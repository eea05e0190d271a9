"""``rollout.engine: remote`` with ``rollout.remote.backend: vllm`` (the default): sampling
through vLLM servers started by ``plainrl serve``, with the learner's weights pushed to
every server after each update.

Requests go to vLLM's OpenAI-compatible completions endpoint with token ids in
(``prompt`` as a list of ids) and out (``return_token_ids``), and the sampled token's
logprob (``logprobs=0``, the server started with ``--logprobs-mode processed_logprobs``).
A group's samples are one request with ``n`` samples, so the server prefills the
prompt once. Weight sync uses the endpoints ``plainrl serve`` enables: the LoRA-loading
endpoint (``/v1/load_lora_adapter``, a new adapter name per update) and ``/collective_rpc``
into :class:`~plainrl.rollout.engines.vllm_worker.WeightSyncExtension` for full weights,
which go over a process group the trainer and every server worker join
(:mod:`~plainrl.rollout.engines.weight_group`; the RPC only starts the receive) where one
forms, else in the request or through a file.

What every server backend shares (several servers with least-outstanding routing and
failover, timeouts and retries, the parallel weight push that takes revived servers back)
is :class:`~plainrl.rollout.engines.served.ServedEngine`.
"""

from __future__ import annotations

import base64
import json
import threading
import uuid
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Iterator

import httpx
import torch

from plainrl.rollout.engines.group_sync import GroupSync
from plainrl.rollout.engines.requests import EngineError, Request, finish_reason, sampling_kwargs
from plainrl.rollout.engines.router import ServerDown
from plainrl.rollout.engines.sync import policy_weights, to_safetensors
from plainrl.rollout.engines.weight_group import WeightGroup, layout_json, plan_buckets
from plainrl.types import Generation, SamplingParams

HTTP_WEIGHTS_LIMIT = 1 << 30  # weights_via=auto: larger full-weight payloads go by path
START_HINT = "start one with `plainrl serve CONFIG.yaml --port PORT` (it needs the same config's model)"


class RemoteEngine(GroupSync):
    """The :class:`~plainrl.rollout.engines.base.Engine` protocol over vLLM servers started
    by ``plainrl serve``. Arguments as :class:`~plainrl.rollout.engines.group_sync.GroupSync`'s,
    with ``weights_via``: ``group``, ``http`` (safetensors bytes in the request), ``path`` (a
    file in ``shared_dir``) or ``auto`` (``group`` where one forms, else http up to 1 GiB,
    else path).

    Raises:
        EngineError: a server is unreachable, serves another tokenizer or a shorter context,
            or was not started by ``plainrl serve`` (no weight-sync endpoints).
    """

    backend = "vllm"
    interruptible = True
    structured_outputs = True  # SamplingParams.structured_outputs: vLLM's structured outputs
    start_hint = START_HINT
    lora_endpoints = ("/v1/load_lora_adapter", "/v1/unload_lora_adapter")

    def _check_backend(self, url: str) -> None:
        # asked directly, not through _call: the answer's status tells what the server lacks
        try:
            ping = self.client.post(url + "/collective_rpc", json={"method": "plainrl_ping"}, timeout=self._probe_timeout)
        except httpx.HTTPError as e:
            raise EngineError(f"inference server {url}: POST /collective_rpc failed: {type(e).__name__}: {e}") from e
        if ping.status_code == 404:
            raise EngineError(f"inference server {url} has no weight-sync endpoints (/collective_rpc): it was "
                              f"not started by `plainrl serve`, so the trainer cannot push weights; {START_HINT}")
        if ping.status_code >= 400:
            raise EngineError(f"inference server {url} runs without plainrl's worker extension (POST /collective_rpc "
                              f"plainrl_ping answered {ping.status_code}: {ping.text[:300]}); {START_HINT}")

    def _body(self, server: int, req: Request, params: SamplingParams, **extra: Any) -> dict[str, Any]:
        """The completions request of ``req``: token ids in and out, the sampled tokens' logprobs."""
        return dict(model=self._lora or self.models[server], prompt=req.prompt_ids, return_token_ids=True,
                    skip_special_tokens=False, **sampling_kwargs(params, n=len(req.rows), seed=req.seed), **extra)

    def _complete(self, server: int, req: Request, params: SamplingParams) -> list[Generation]:
        url = self.urls[server]
        body = self._body(server, req, params)
        choices = sorted(self._call("POST", url, "/v1/completions", json=body).json()["choices"],
                         key=lambda c: c["index"])
        out = []
        for c in choices:
            logprobs = c["logprobs"]["token_logprobs"]
            if len(logprobs) != len(c["token_ids"]):
                raise EngineError(f"inference server {url} returned {len(c['token_ids'])} token ids but "
                                  f"{len(logprobs)} logprobs")
            out.append(Generation(token_ids=list(c["token_ids"]), logprobs=[float(x) for x in logprobs],
                                  finish_reason=finish_reason(c["finish_reason"], c.get("stop_reason"), url)))
        return out

    def _stream(self, server: int, req: Request, params: SamplingParams,
                interrupt: threading.Event) -> list[tuple[Generation, bool]]:
        """The request streamed (each event carries a choice's new token ids and their logprobs);
        once ``interrupt`` is set the stream is closed at the next event, and vLLM aborts a
        request whose client has gone (its engine frees the sequence)."""
        url = self.urls[server]
        body = self._body(server, req, params, stream=True)
        toks: list[list[int]] = [[] for _ in req.rows]
        lps: list[list[float]] = [[] for _ in req.rows]
        reasons: list[str | None] = [None] * len(req.rows)
        with self._sse(url, "/v1/completions", body) as events:
            for event in events:
                if "error" in event:  # vLLM reports a failure mid-stream as an event
                    raise EngineError(f"inference server {url}: a streamed request failed: {event['error']}")
                for c in event.get("choices") or []:
                    i, ids = c["index"], c.get("token_ids") or []
                    logprobs = (c.get("logprobs") or {}).get("token_logprobs") or []
                    if len(logprobs) != len(ids):
                        raise EngineError(f"inference server {url} streamed {len(ids)} token ids but "
                                          f"{len(logprobs)} logprobs")
                    toks[i] += ids
                    lps[i] += [float(x) for x in logprobs]
                    if c.get("finish_reason") is not None:
                        reasons[i] = finish_reason(c["finish_reason"], c.get("stop_reason"), url)
                if interrupt.is_set() and not all(r is not None for r in reasons):
                    break
        if not interrupt.is_set() and None in reasons:
            raise ServerDown(f"inference server {url}: a streamed completion ended without a finish reason")
        return [(Generation(token_ids=t, logprobs=lp, finish_reason=r or "length"), r is not None)
                for t, lp, r in zip(toks, lps, reasons)]

    # -- the weight group (GroupSync's hooks) --------------------------------------------
    def _group_ranks(self, server: int) -> int:
        return len(self._call("POST", self.urls[server], "/collective_rpc", json={"method": "plainrl_ping"}).json()["results"])

    def _group_join(self, server: int, group: WeightGroup, name: str, offset: int) -> None:
        self._call("POST", self.urls[server], "/collective_rpc", retries=0, json={
            "method": "plainrl_join_weight_group",
            "args": [group.host, group.port, group.world_size, offset, group.backend, self.group_timeout_s]})

    def _group_send(self, group: WeightGroup, members: tuple[int, ...], tensors: dict[str, torch.Tensor],
                    device: torch.device) -> None:
        """Each server is told by one RPC to receive the buckets' layout (sent once the first
        bucket is packed: :meth:`WeightGroup.send`), the trainer broadcasts, then every prefix
        cache is reset."""
        buckets = plan_buckets(tensors.items())
        body = {"method": "plainrl_receive_weights", "args": [layout_json(buckets)]}
        with ThreadPoolExecutor(max_workers=len(members)) as pool:
            futures = []
            group.send(tensors, buckets, device, start=lambda: futures.extend(
                pool.submit(self._call, "POST", self.urls[i], "/collective_rpc", json=body, retries=0) for i in members))
            for f in futures:
                f.result()
        for i in members:
            self._call("POST", self.urls[i], "/reset_prefix_cache")

    @contextmanager
    def _full_push(self, model: torch.nn.Module) -> Iterator[Callable[[str], None]]:
        """The whole merged state dict as safetensors, in the request or as a file in
        ``shared_dir``, loaded in place by the worker extension; then the prefix cache is reset."""
        blob = to_safetensors(policy_weights(model))
        file = None
        if self.weights_via == "http" or (self.weights_via == "auto" and len(blob) <= HTTP_WEIGHTS_LIMIT):
            payload = json.dumps({"safetensors_b64": base64.b64encode(blob).decode()})
        else:
            file = self._adapters.root / f"weights-{uuid.uuid4().hex}.safetensors"
            file.write_bytes(blob)
            payload = json.dumps({"path": str(file)})

        def push(url: str) -> None:
            self._call("POST", url, "/collective_rpc", json={"method": "plainrl_load_weights", "args": [payload]})
            self._call("POST", url, "/reset_prefix_cache")

        try:
            yield push
        finally:
            if file is not None:
                Path(file).unlink(missing_ok=True)

    def weight_sum(self, name: str, server: int = 0) -> float:
        """Sum of one of a server's vLLM parameters (tests check a sync landed)."""
        body = {"method": "plainrl_weight_sum", "args": [name]}
        return float(self._call("POST", self.urls[server], "/collective_rpc", json=body).json()["results"][0])
