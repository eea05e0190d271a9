"""The HTTP routes of Tinker's API (``/api/v1/...``, as the ``tinker`` SDK 0.38 calls them), a
Starlette app over a :class:`~plainrl.tinker.service.Service`.

Requests are parsed into the SDK's own pydantic request types and answered with its response
types; ``forward_backward`` arrives as protobuf and ``ForwardBackwardOutput`` / ``SampleResponse``
results leave as protobuf (:mod:`plainrl.tinker.wire`). Long work returns an ``UntypedAPIFuture``
at once; ``retrieve_future`` then waits up to :data:`POLL_WAIT_S` for it and otherwise answers
``try_again``, which the SDK polls again.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import hmac
import json
import logging
import uuid
from typing import Any, Awaitable, Callable

import pydantic
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route
from tinker import types

from plainrl.tinker.checkpoints import list_checkpoints, training_run, training_runs
from plainrl.tinker.errors import UserError, not_found
from plainrl.tinker.sampling import check_sample
from plainrl.tinker.service import Service
from plainrl.tinker.training import check_call
from plainrl.tinker.wire import decode_forward_backward

log = logging.getLogger(__name__)

POLL_WAIT_S = 20.0  # under the SDK's 45 s timeout of a retrieve_future call
PROTOBUF = "application/x-protobuf"
HEALTH = "/api/v1/healthz"  # answered without an API key (a liveness probe's)


def _json(model: Any, status: int = 200) -> JSONResponse:
    return JSONResponse(model.model_dump(mode="json") if hasattr(model, "model_dump") else model, status)


def _error(message: str, status: int) -> JSONResponse:
    return JSONResponse({"detail": message, "error": message, "category": "user"}, status)


async def _parse(request: Request, cls: type[pydantic.BaseModel]):
    try:
        return cls.model_validate(await request.json())
    except ValueError as e:  # JSON decode errors and pydantic's ValidationError
        raise UserError(f"{request.url.path}: the body is not a {cls.__name__}: {e}") from e


async def _capabilities(s: Service, request: Request) -> Response:
    # per base, what both training (the model's context) and sampling (the servers' under remote) take
    models = [types.SupportedModel(model_name=n, max_context_length=min(b.adapters.context, s.context(b)),
                                   trainable=True, sampleable=True) for b in s.bases for n in b.names]
    return _json(types.GetServerCapabilitiesResponse(supported_models=models))


async def _create_session(s: Service, request: Request) -> Response:
    await _parse(request, types.CreateSessionRequest)
    return _json(types.CreateSessionResponse(session_id=s.create_session()))


async def _heartbeat(s: Service, request: Request) -> Response:
    req = await _parse(request, types.SessionHeartbeatRequest)
    if req.session_id not in s.sessions:  # the SDK stops its heartbeats on a 410
        return _error(f"session {req.session_id!r} has ended or never existed", 410)
    s.check_session(req.session_id)
    return _json(types.SessionHeartbeatResponse())


async def _finish_session(s: Service, request: Request) -> Response:
    s.finish_session(request.path_params["session_id"])
    return Response(status_code=204)


async def _get_info(s: Service, request: Request) -> Response:
    return _json(s.info((await _parse(request, types.GetInfoRequest)).model_id))


async def _forward_backward(s: Service, request: Request) -> Response:
    body = await request.body()
    if request.headers.get("content-encoding") == "zstd":
        import zstandard

        body = zstandard.ZstdDecompressor().decompress(body)
    if PROTOBUF not in request.headers.get("content-type", ""):
        raise UserError(f"forward_backward takes a {PROTOBUF} ForwardBackwardRequest, as the tinker SDK sends")
    call = decode_forward_backward(body)
    adapters = s.base(s.model(call.model_id).base_model).adapters
    check_call(call, vocab_size=adapters.vocab_size, context=adapters.context, stability=s.stability)
    return _json(s.forward_backward(call))


async def _save_state(s: Service, request: Request) -> Response:
    req = await _parse(request, types.SaveWeightsRequest)
    run = s.save(req.model_id, "weights", req.path, with_optimizer=True)
    return _json(s.submit(lambda: types.SaveWeightsResponse(path=run()[0]), req.model_id))


async def _save_for_sampler(s: Service, request: Request) -> Response:
    req = await _parse(request, types.SaveWeightsForSamplerRequest)
    if req.path is None:  # save_weights_and_get_sampling_client: an ephemeral snapshot
        if req.sampling_session_seq_id is None:
            raise UserError("save_weights_for_sampler: give path (a name) or sampling_session_seq_id")
        snapshot = s.save_ephemeral(req.model_id, req.sampling_session_seq_id)
        return _json(s.submit(lambda: types.SaveWeightsForSamplerResponseInternal(
            sampling_session_id=snapshot().sampler_id), req.model_id))
    run = s.save(req.model_id, "sampler_weights", req.path, with_optimizer=False)

    def work() -> types.SaveWeightsForSamplerResponseInternal:
        path, directory = run()
        s.publish(directory)
        return types.SaveWeightsForSamplerResponseInternal(path=path)

    return _json(s.submit(work, req.model_id))


async def _create_sampling_session(s: Service, request: Request) -> Response:
    req = await _parse(request, types.CreateSamplingSessionRequest)
    s.check_session(req.session_id)
    sampler = s.add_sampler(req.session_id, req.sampling_session_seq_id, req.model_path, req.base_model)
    return _json(types.CreateSamplingSessionResponse(sampling_session_id=sampler.sampler_id))


async def _get_sampler(s: Service, request: Request) -> Response:
    sp = s.sampler(request.path_params["sampler_id"])
    return _json(types.GetSamplerResponse(sampler_id=sp.sampler_id, base_model=sp.base_model,
                                          model_path=sp.model_path))


async def _asample(s: Service, request: Request) -> Response:
    req = await _parse(request, types.SampleRequest)
    if req.sampling_session_id is not None:
        sampler = s.sampler(req.sampling_session_id)
    elif req.model_path is not None or req.base_model is not None:
        sampler = s.add_sampler("direct", 0, req.model_path, req.base_model)
    else:
        raise UserError("sample: give sampling_session_id, model_path or base_model")
    unsupported = [k for k in ("topk_sample_logprobs", "prompt_alt_tokens_k")
                   if getattr(req, k)] + (["target_prompt_logprobs"] if req.target_prompt_logprobs else [])
    if unsupported:
        raise UserError(f"sample: {unsupported} are not computed by this service")
    base = s.base(sampler.base_model)
    call = check_sample(req, vocab_size=base.adapters.vocab_size, context=s.context(base))
    # the ids the SDK stamps on the sequences, by which stable_reinforce's provenance names them
    ids = [f"{uuid.uuid4().hex[:12]}:{i}" for i in range(call.num_samples)]
    fut = s.sample(sampler, call, record_as=ids if req.record_stability_info else None)
    return _json(fut.model_copy(update={"sample_sequence_ids": ids}))


async def _retrieve_future(s: Service, request: Request) -> Response:
    req = await _parse(request, types.FutureRetrieveRequest)
    fut = s.futures.get(req.request_id)
    if fut is None:
        raise not_found("request", req.request_id, "a future's id is what the request that started it returned")
    try:
        result = await asyncio.wait_for(asyncio.shield(asyncio.wrap_future(fut)), POLL_WAIT_S)
    except asyncio.TimeoutError:
        return _json(types.TryAgainResponse(request_id=req.request_id, queue_state="active"))
    except UserError as e:
        return _json(types.RequestFailedResponse(error=str(e), category=types.RequestErrorCategory.User))
    except Exception as e:  # the work failed: the SDK raises RequestFailedError with this message
        log.exception("request %s failed", req.request_id)
        return _json(types.RequestFailedResponse(error=f"{type(e).__name__}: {e}",
                                                 category=types.RequestErrorCategory.Server))
    if isinstance(result, bytes):
        return Response(result, media_type=PROTOBUF)
    return _json(result)


async def _list_checkpoints(s: Service, request: Request) -> Response:
    return _json(list_checkpoints(s.root, request.path_params["model_id"]))


async def _training_run(s: Service, request: Request) -> Response:
    return _json(training_run(s.root, request.path_params["model_id"]))


async def _training_runs(s: Service, request: Request) -> Response:
    try:
        offset, limit = int(request.query_params.get("offset", 0)), int(request.query_params.get("limit", 20))
    except ValueError as e:
        raise UserError(f"training_runs: offset and limit are integers ({e})") from e
    return _json(training_runs(s.root, offset, limit))


async def _weights_info(s: Service, request: Request) -> Response:
    body = await request.json()
    _, _, directory = s.resolve(str(body.get("tinker_path", "")))
    cfg = json.loads((directory / "final" / "adapter_config.json").read_text())
    return _json(types.WeightsInfoResponse(base_model=s.checkpoint_base(directory).name, is_lora=True,
                                           lora_rank=cfg.get("r")))


Handler = Callable[[Service, Request], Awaitable[Response]]


async def _constant(answer: pydantic.BaseModel, s: Service, request: Request) -> Response:
    return _json(answer)


async def _call(cls: type[pydantic.BaseModel], method: Callable[[Service, Any], Any], s: Service,
                request: Request) -> Response:
    """``method(s, request)`` on the body parsed as ``cls``."""
    return _json(method(s, await _parse(request, cls)))


def _static(answer: pydantic.BaseModel) -> Handler:
    return functools.partial(_constant, answer)


def _typed(cls: type[pydantic.BaseModel], method: Callable[[Service, Any], Any]) -> Handler:
    return functools.partial(_call, cls, method)


# httpx transport, API keys (no JWT exchange), fwd/bwd chunks sent one after another (the worker
# runs them in arrival order), plain retrieve_future polling for samples
_CLIENT_CONFIG = types.ClientConfigResponse(
    use_pyqwest_transport=False, pjwt_auth_enabled=False, parallel_fwdbwd_chunks=False,
    sample_use_retrieve_futures=False, custom_loss_server_side=False, sample_join_sampling_session=False)

# (path, handler, method): the SDK's endpoints
ROUTES: list[tuple[str, Handler, str]] = [
    (HEALTH, _static(types.HealthResponse(status="ok")), "GET"),
    ("/api/v1/get_server_capabilities", _capabilities, "GET"),
    ("/api/v1/client/config", _static(_CLIENT_CONFIG), "POST"),
    ("/api/v1/client/dynamic_config", _static(types.ClientDynamicConfigResponse()), "POST"),
    ("/api/v1/telemetry", _static(types.TelemetryResponse(status="accepted")), "POST"),
    ("/api/v1/create_session", _create_session, "POST"),
    ("/api/v1/session_heartbeat", _heartbeat, "POST"),
    ("/api/v1/sessions/{session_id}/finish", _finish_session, "POST"),
    ("/api/v1/create_model", _typed(types.CreateModelRequest, Service.create_model), "POST"),
    ("/api/v1/get_info", _get_info, "POST"),
    ("/api/v1/forward_backward", _forward_backward, "POST"),
    ("/api/v1/optim_step", _typed(types.OptimStepRequest, Service.optim_step), "POST"),
    ("/api/v1/save_weights", _save_state, "POST"),
    ("/api/v1/save_weights_for_sampler", _save_for_sampler, "POST"),
    ("/api/v1/load_weights", _typed(types.LoadWeightsRequest, Service.load), "POST"),
    ("/api/v1/create_sampling_session", _create_sampling_session, "POST"),
    ("/api/v1/samplers/{sampler_id}", _get_sampler, "GET"),
    ("/api/v1/asample", _asample, "POST"),
    ("/api/v1/retrieve_future", _retrieve_future, "POST"),
    ("/api/v1/training_runs", _training_runs, "GET"),
    ("/api/v1/training_runs/{model_id}", _training_run, "GET"),
    ("/api/v1/training_runs/{model_id}/checkpoints", _list_checkpoints, "GET"),
    ("/api/v1/weights_info", _weights_info, "POST"),
]


def key_matches(expected: str | None, given: str | None) -> bool:
    """Whether a request's ``X-API-Key`` (``given``) passes: any key when the service has none
    (``expected`` None), else the same key (compared in constant time)."""
    return expected is None or (given is not None and hmac.compare_digest(given.encode(), expected.encode()))


async def _guarded(handler: Handler, s: Service, api_key: str | None, request: Request) -> Response:
    """``handler``'s answer, or a bad request's :class:`UserError` as its 4xx; a 401 when the
    service has ``api_key`` and the request's ``X-API-Key`` is not it."""
    if not key_matches(api_key, request.headers.get("x-api-key")):
        return _error("X-API-Key: not this service's API key (plainrl tinker --api-key or TINKER_API_KEY); give "
                      "the same key to tinker.ServiceClient(api_key=...)", 401)
    try:
        return await handler(s, request)
    except UserError as e:
        return _error(str(e), e.status)


def build_app(service: Service, api_key: str | None = None) -> Starlette:
    """The Starlette app serving ``service``: :data:`ROUTES` (with ``api_key``, each but the health
    check answers only requests whose ``X-API-Key`` is that key), and the service closed on shutdown."""

    @contextlib.asynccontextmanager
    async def lifespan(app):
        # uvicorn re-raises SIGTERM/SIGINT once it has shut down, which ends the process at once:
        # the servers' adapters are unloaded here, before that
        yield
        service.close()

    routes = [Route(path, functools.partial(_guarded, handler, service, None if path == HEALTH else api_key),
                    methods=[method]) for path, handler, method in ROUTES]
    return Starlette(routes=routes, lifespan=lifespan)
