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
``/unload_lora_adapter``); full weights as a Hugging Face directory in ``shared_dir``
loaded by ``/update_weights_from_disk``, then ``/flush_cache`` drops the radix cache.
SGLang's ``/update_weights_from_tensor`` (CUDA IPC handles: same machine only) and
``/update_weights_from_distributed`` (an NCCL group) are not wired: both need CUDA, which
this project's machines lack.

Source: SGLang's ``python/sglang/srt/entrypoints/http_server.py`` (the endpoints),
``managers/io_struct.py`` (``GenerateReqInput``, ``UpdateWeightFromDiskReqInput``,
``LoadLoRAAdapterReqInput``), ``sampling/sampling_params.py`` and
``managers/tokenizer_manager.py`` (the response), read at SGLang 0.5.x.
"""

from __future__ import annotations

import shutil
import uuid
from contextlib import contextmanager
from typing import Any, Callable, Iterator

import torch

from plainrl.rollout.engines.requests import EngineError, Request, finish_reason
from plainrl.rollout.engines.served import ServedEngine
from plainrl.rollout.engines.sync import SyncMode, save_hf_weights
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


class SGLangEngine(ServedEngine):
    """The :class:`~plainrl.rollout.engines.base.Engine` protocol over SGLang servers.
    Arguments as :class:`~plainrl.rollout.engines.served.ServedEngine`'s.

    Raises:
        EngineError: a server is unreachable, serves another tokenizer or a shorter context,
            is not a generation model, runs with ``--skip-tokenizer-init`` (stop strings and
            ``/tokenize`` need its tokenizer), or lacks ``--enable-lora`` for a LoRA sync.
    """

    backend = "sglang"
    start_hint = START_HINT
    lora_endpoints = ("/load_lora_adapter", "/unload_lora_adapter")

    def __init__(self, urls: list[str], tokenizer, *, sync: SyncMode, **kwargs):
        self._seeded: dict[str, bool] = {}  # url -> runs with --enable-deterministic-inference
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

    def _complete(self, server: int, req: Request, params: SamplingParams) -> list[Generation]:
        url = self.urls[server]
        body = generate_body(req.prompt_ids, params, n=len(req.rows), seed=req.seed,
                             seeded=self._seeded.get(url, False), lora=self._lora)
        outputs = self._call("POST", url, "/generate", json=body).json()
        if not isinstance(outputs, list):
            raise EngineError(f"SGLang server {url}: /generate answered a batch of {len(req.rows)} with {outputs!r:.300}")
        return [parse_generation(o, url) for o in outputs]

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
