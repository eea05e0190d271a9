"""``rollout.engine: remote``: sampling through vLLM servers started by ``plainrl serve``,
with the learner's weights pushed to every server after each update.

Requests go to vLLM's OpenAI-compatible completions endpoint with token ids in
(``prompt`` as a list of ids) and out (``return_token_ids``), and the sampled token's
logprob (``logprobs=0``, the server started with ``--logprobs-mode processed_logprobs``).
A group's samples are one request with ``n`` samples, so the server prefills the
prompt once. Weight sync uses the endpoints ``plainrl serve`` enables: the LoRA-loading
endpoint (``/v1/load_lora_adapter``, a new adapter name per update) and ``/collective_rpc``
into :class:`~plainrl.rollout.engines.vllm_worker.WeightSyncExtension` for full weights.

Several servers: each group's request goes to the live server with the fewest requests
in flight (:class:`~plainrl.rollout.engines.servers.ServerPool`), and weights are pushed
to all of them in parallel; a step samples only once every live server holds the new
weights. Every call has a timeout; a request that fails on the network or with a server
error is retried once (a timeout is not: the server is presumed hung), then its server is
marked dead (a warning, ``rollout/server_failures``) and the request goes to another. A
dead server is probed again at each weight sync and used again once it answers. With no
server left the step fails with an :class:`EngineError` naming the URLs.
"""

from __future__ import annotations

import base64
import json
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import torch

from plainrl.rollout.engines.requests import EngineError, Request, finish_reason, make_requests, sampling_kwargs
from plainrl.rollout.engines.servers import ServerDown, ServerPool
from plainrl.rollout.engines.sync import AdapterVersions, SyncMode, policy_weights, to_safetensors
from plainrl.types import Generation, SamplingParams

# text whose tokenisation tells tokenizers apart (digits, spaces, code, non-ASCII, a chat marker)
TOKENIZER_PROBE = "Hello, world! 12 + 345 = 357.\n  def f(x):\treturn x**2  # café 東京 <|im_start|>user"
HTTP_WEIGHTS_LIMIT = 1 << 30  # weights_via=auto: larger full-weight payloads go by path
START_HINT = "start one with `plainrl serve CONFIG.yaml --port PORT` (it needs the same config's model)"


class RemoteEngine:
    """The :class:`~plainrl.rollout.engines.base.Engine` protocol over vLLM servers.

    Args:
        urls: server base URLs, e.g. ``["http://127.0.0.1:8000"]``; a group's request
            goes to one server, the one with the fewest requests in flight.
        tokenizer: the trainer's; each server's tokenizer must encode a probe text to the
            same ids.
        sync: ``lora`` or ``full``.
        timeout_s / connect_timeout_s: per request (seconds).
        weights_via: full sync as ``http`` (safetensors bytes in the request), ``path``
            (a file in ``shared_dir``) or ``auto`` (http up to 1 GiB).
        shared_dir: a directory the servers can read (adapters, weight files); default a
            temporary directory on this machine.
        max_model_len: the trainer's context (``model.max_context``); a server with less fails.

    Raises:
        EngineError: a server is unreachable, serves another tokenizer or a shorter context,
            or was not started by ``plainrl serve`` (no weight-sync endpoints).
    """

    def __init__(self, urls: list[str], tokenizer, *, sync: SyncMode, timeout_s: float = 600.0,
                 connect_timeout_s: float = 10.0, weights_via: str = "auto", shared_dir: str | None = None,
                 max_model_len: int = 1024):
        if not urls:
            raise EngineError(f"rollout.engine=remote needs at least one URL in rollout.remote.urls; {START_HINT}")
        self.urls = [u.rstrip("/") for u in urls]
        self.sync, self.weights_via = sync, weights_via
        self.client = httpx.Client(timeout=httpx.Timeout(timeout_s, connect=connect_timeout_s),
                                   limits=httpx.Limits(max_connections=None, max_keepalive_connections=64))
        self._tokenizer, self._max_model_len = tokenizer, max_model_len
        self._probe_timeout = connect_timeout_s  # health checks: a hung server must not hold a sync for timeout_s
        self.models = [self._check(url, tokenizer, max_model_len) for url in self.urls]
        self.pool = ServerPool(self.urls)
        self._adapters = AdapterVersions(shared_dir)  # adapters and weights_via=path files
        self._lora: str | None = None  # the adapter name requests ask for, once synced

    # -- HTTP -------------------------------------------------------------------------
    def _call(self, method: str, url: str, path: str, *, retries: int = 1, **kwargs) -> httpx.Response:
        """One HTTP call with the client's timeouts.

        Raises:
            ServerDown: no answer (connection error, timeout) or a 5xx, after ``retries`` more
                tries for anything but a timeout.
            EngineError: a 4xx answer (the request is wrong; retrying cannot help).
        """
        for attempt in range(retries + 1):
            try:
                response = self.client.request(method, url + path, **kwargs)
            except httpx.HTTPError as e:
                if attempt < retries and not isinstance(e, httpx.TimeoutException):
                    continue
                raise ServerDown(f"inference server {url}: {method} {path} failed after {attempt + 1} "
                                 f"attempt(s): {type(e).__name__}: {e}; is it running? {START_HINT}") from e
            if response.status_code >= 500 and attempt < retries:
                continue
            if response.status_code >= 500:
                raise ServerDown(f"inference server {url}: {method} {path} answered {response.status_code}: "
                                 f"{response.text[:500]}")
            if response.status_code >= 400:
                raise EngineError(f"inference server {url}: {method} {path} answered {response.status_code}: "
                                  f"{response.text[:500]}")
            return response
        raise AssertionError("unreachable")

    def _check(self, url: str, tokenizer, max_model_len: int) -> str:
        self._call("GET", url, "/health", retries=0, timeout=self._probe_timeout)
        models = self._call("GET", url, "/v1/models").json()["data"]
        served = models[0]
        if served.get("max_model_len") is not None and served["max_model_len"] < max_model_len:
            raise EngineError(f"inference server {url} serves {served['id']!r} with max_model_len="
                              f"{served['max_model_len']}, less than model.max_context={max_model_len}")
        ids = self._call("POST", url, "/tokenize", json={"model": served["id"], "prompt": TOKENIZER_PROBE,
                                                           "add_special_tokens": False}).json()["tokens"]
        ours = tokenizer(TOKENIZER_PROBE, add_special_tokens=False)["input_ids"]
        if ids != ours:
            raise EngineError(f"inference server {url} serves {served['id']!r}, whose tokenizer differs from the "
                              f"trainer's ({tokenizer.name_or_path}): a probe text gave {ids[:12]}... there, "
                              f"{ours[:12]}... here; serve the trainer's model ({START_HINT})")
        # asked directly, not through _call: the answer's status tells what the server lacks
        try:
            ping = self.client.post(url + "/collective_rpc", json={"method": "plainrl_ping"})
        except httpx.HTTPError as e:
            raise EngineError(f"inference server {url}: POST /collective_rpc failed: {type(e).__name__}: {e}") from e
        if ping.status_code == 404:
            raise EngineError(f"inference server {url} has no weight-sync endpoints (/collective_rpc): it was "
                              f"not started by `plainrl serve`, so the trainer cannot push weights; {START_HINT}")
        if ping.status_code >= 400:
            raise EngineError(f"inference server {url} runs without plainrl's worker extension (POST /collective_rpc "
                              f"plainrl_ping answered {ping.status_code}: {ping.text[:300]}); {START_HINT}")
        return served["id"]

    # -- sampling -----------------------------------------------------------------------
    def _complete(self, server: int, req: Request, params: SamplingParams) -> list[Generation]:
        url = self.urls[server]
        body: dict[str, Any] = dict(model=self._lora or self.models[server], prompt=req.prompt_ids,
                                    return_token_ids=True, skip_special_tokens=False,
                                    **sampling_kwargs(params, n=len(req.rows), seed=req.seed))
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

    def generate(self, prompts: list[list[int]], params: SamplingParams, *,
                 generator: torch.Generator | None = None) -> list[Generation]:
        """Sample one completion per prompt; requests run concurrently so each server
        batches them. See :meth:`plainrl.rollout.engines.hf.HFEngine.generate`.

        Raises:
            EngineError: a request failed twice.
        """
        if not prompts:
            return []
        requests = make_requests(prompts, generator)
        out: list[Generation | None] = [None] * len(prompts)
        with ThreadPoolExecutor(max_workers=min(64, len(requests))) as pool:
            futures = [pool.submit(self.pool.run, lambda server, r=r: self._complete(server, r, params))
                       for r in requests]
            for req, fut in zip(requests, futures):
                for row, gen in zip(req.rows, fut.result()):
                    out[row] = gen
        return out  # type: ignore[return-value]

    # -- weight sync ----------------------------------------------------------------------
    def load_weights(self, model: torch.nn.Module) -> None:
        """Push the learner's weights to every server, in parallel: the adapter under a new
        name (the previous one is unloaded), or the whole merged state dict through the
        worker extension, after which each server's prefix cache is reset. A server that
        fails is marked dead; dead servers that answer their health check again get the
        weights and are used again.

        Raises:
            EngineError: no server holds the new weights.
        """
        if self.sync == "lora":
            version, path = self._adapters.save(model)
            name, previous = f"plainrl-v{version}", self._lora

            def push(url: str) -> None:
                self._call("POST", url, "/v1/load_lora_adapter", json={"lora_name": name, "lora_path": str(path)})
                if previous is not None:  # a revived server never had it: a 4xx there is no failure
                    self.client.post(url + "/v1/unload_lora_adapter", json={"lora_name": previous})

            self._push_all(push)
            self._lora = name
            return
        blob = to_safetensors(policy_weights(model))
        file = None
        if self.weights_via == "http" or (self.weights_via == "auto" and len(blob) <= HTTP_WEIGHTS_LIMIT):
            payload = json.dumps({"safetensors_b64": base64.b64encode(blob).decode()})
        else:
            file = self._adapters.root / f"weights-{uuid.uuid4().hex}.safetensors"
            file.write_bytes(blob)
            payload = json.dumps({"path": str(file)})

        def push_full(url: str) -> None:
            self._call("POST", url, "/collective_rpc", json={"method": "plainrl_load_weights", "args": [payload]})
            self._call("POST", url, "/reset_prefix_cache")

        try:
            self._push_all(push_full)
        finally:
            if file is not None:
                Path(file).unlink(missing_ok=True)

    def _push_all(self, push) -> None:
        live = set(self.pool.live())
        targets = [i for i in range(len(self.urls)) if i in live or self._answers(i)]
        with ThreadPoolExecutor(max_workers=max(1, len(targets))) as pool:
            results = {i: pool.submit(push, self.urls[i]) for i in targets}
        for i, fut in results.items():
            error = fut.exception()
            if error is None:
                self.pool.revive(i)
            elif isinstance(error, ServerDown):
                self.pool.mark_dead(i, error)
            else:
                raise error
        if not self.pool.live():
            raise self.pool.none_left()

    def _answers(self, server: int) -> bool:
        """Whether a dead server is back: healthy, the same tokenizer and context, plainrl's endpoints."""
        try:
            self._check(self.urls[server], self._tokenizer, self._max_model_len)
            return True
        except EngineError:
            return False

    def take_metrics(self) -> dict[str, float]:
        """``rollout/server_failures``: servers marked dead since the last call."""
        return {"rollout/server_failures": float(self.pool.take_failures())}

    def offload(self) -> None:
        """No-op: the servers' memory is their own."""

    def weight_sum(self, name: str, server: int = 0) -> float:
        """Sum of one of a server's vLLM parameters (tests check a sync landed)."""
        body = {"method": "plainrl_weight_sum", "args": [name]}
        return float(self._call("POST", self.urls[server], "/collective_rpc", json=body).json()["results"][0])

    def close(self) -> None:
        """Close the connections and remove the synced adapters (the servers keep running)."""
        self.client.close()
        self._adapters.close()
