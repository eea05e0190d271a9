"""``plainrl tinker``: load the config's model once and serve Tinker's API on it with uvicorn
until the process is stopped (Ctrl-C or SIGTERM: uvicorn closes the socket, so no port stays
bound; the worker thread dies with the process)."""

from __future__ import annotations

from pathlib import Path

from plainrl.config import Config


def build_service(cfg: Config):
    """The :class:`~plainrl.tinker.service.Service` of ``cfg``: its ``tinker.base_models`` (default
    ``model.name``; LoRA settings come from each ``create_lora_training_client`` call), checkpoints
    under ``cfg.run_dir``, sampling on the embedded engine or, under ``rollout.engine: remote``,
    on the servers of ``rollout.remote`` (one base).

    Raises:
        ConfigError: ``rollout.engine: vllm`` (in process), a read-only remote backend, several
            bases with remote sampling, a base listed twice.
        EngineError: a server is unreachable or serves another model.
    """
    import torch

    from plainrl.config import ConfigError
    from plainrl.models import resolve_device
    from plainrl.rollout.engines.factory import adapter_servers, require_trainable_engine
    from plainrl.tinker.bases import load_bases
    from plainrl.tinker.served import ServedSampling
    from plainrl.tinker.service import Service

    if cfg.rollout.engine == "remote":
        require_trainable_engine(cfg.rollout)  # before the model loads
        if len(cfg.tinker.base_models) > 1:
            raise ConfigError(f"tinker.base_models lists {len(cfg.tinker.base_models)} models, and rollout.engine="
                              "remote samples one base on its servers; list one, or sample with rollout.engine=hf")
    elif cfg.rollout.engine != "hf":
        raise ConfigError(f"rollout.engine={cfg.rollout.engine}: plainrl tinker samples with the embedded engine "
                          "(rollout.engine=hf) or on inference servers (rollout.engine=remote, e.g. `plainrl serve "
                          "CONFIG` and rollout.remote.urls=[...]), not with vLLM in its own process")
    torch.manual_seed(cfg.seed)
    bases = load_bases(cfg, resolve_device(cfg.device))
    served = sample_context = None
    if cfg.rollout.engine == "remote":
        model = cfg.model.model_copy(update={"name": bases[0].adapters.name})
        served = ServedSampling(adapter_servers(model, cfg.rollout, bases[0].adapters.tokenizer), bases[0].adapters)
        sample_context = served.context()  # what the servers take, not what the model could
    return Service(bases, Path(cfg.run_dir), micro_batch_tokens=cfg.train.micro_batch_tokens, served=served,
                   sample_context=sample_context, session_expiry_s=cfg.tinker.session_expiry_s,
                   ephemeral_samplers=cfg.tinker.ephemeral_samplers)


def check_api_key(api_key: str | None) -> str | None:
    """``api_key`` if the SDK can send it (it sends only keys starting ``tml-``).

    Raises:
        ConfigError: another key.
    """
    from plainrl.config import ConfigError

    if api_key is not None and not api_key.startswith("tml-"):
        raise ConfigError("--api-key / TINKER_API_KEY must start with 'tml-': the tinker SDK refuses other keys, so "
                          "no client could send it")
    return api_key


def serve(cfg: Config, *, host: str = "127.0.0.1", port: int = 8000, api_key: str | None = None) -> None:
    """Serve until interrupted; prints the base URL and the names of the model once listening.
    With ``api_key`` (starting ``tml-``) only requests carrying it are answered; without, any key.

    Raises:
        ConfigError: an ``api_key`` the SDK cannot send, or as :func:`build_service`.
    """
    import uvicorn

    from plainrl.tinker.routes import build_app

    check_api_key(api_key)
    service = build_service(cfg)
    config = uvicorn.Config(build_app(service, api_key), host=host, port=port, log_level="warning",
                            access_log=False, timeout_keep_alive=75)
    server = uvicorn.Server(config)
    key = "the service's API key" if api_key else "'tml-local'"
    print(f"plainrl tinker: serving {service.model_names} at http://{host}:{port} "
          f"(checkpoints under {service.root}); tinker.ServiceClient(base_url='http://{host}:{port}', "
          f"api_key={key})", flush=True)
    try:
        server.run()
    finally:
        service.close()
