"""The ``rollout`` section: the engine (embedded, vLLM in process, remote servers), sampling,
multi-turn environments and reward workers."""

from __future__ import annotations

import re
from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from plainrl.config.base import _Section

BUILTIN_ENVS = ("calculator", "python")  # rollout.env names built into plainrl.rollout.make_env_factory


class VLLMConfig(_Section):
    """``rollout.engine: vllm``: vLLM's ``LLM`` in the trainer's process, and ``plainrl serve``."""

    # CUDA: the share of GPU memory vLLM takes for weights and KV cache; the learner gets the rest
    gpu_memory_utilization: float = Field(0.3, gt=0.0, le=1.0)
    # CUDA: offload vLLM's weights and drop its KV cache while the learner trains (vLLM sleep mode)
    sleep: bool = True
    cpu_kv_cache_gb: float = Field(1.0, gt=0)  # CPU: KV cache size (vLLM's VLLM_CPU_KVCACHE_SPACE)
    enforce_eager: bool = False  # skip graph compilation/capture: a faster start, a slower decode
    extra_args: dict[str, Any] = Field(default_factory=dict)  # passed to vllm.LLM / `vllm serve` as they are


class RemoteConfig(_Section):
    """``rollout.engine: remote``: inference servers, vLLM's started by ``plainrl serve``,
    SGLang's or any OpenAI-compatible one (docs/engines.md)."""

    # vllm: `plainrl serve` servers; sglang: SGLang servers (`python -m sglang.launch_server`);
    # openai: any OpenAI-compatible completions server, read-only (plainrl eval), not token-exact
    backend: Literal["vllm", "sglang", "openai"] = "vllm"
    urls: list[str] = Field(default_factory=list)
    model: str | None = None  # the served model's name to request; default the first a server lists
    # the NAME of the environment variable holding the API key (sent as a Bearer token), never the key
    api_key_env: str | None = None
    timeout_s: float = Field(600.0, gt=0)  # per request: a server silent this long counts as dead
    connect_timeout_s: float = Field(10.0, gt=0)
    # full-weight sync: "http" sends the tensors in the request (safetensors bytes), "path" writes
    # them to shared_dir and sends the path; auto: http up to 1 GiB of changed tensors, else path
    weights_via: Literal["auto", "http", "path"] = "auto"
    # a directory the trainer and every server can read (LoRA adapters, weights_via=path);
    # default: a temporary directory on this machine, which suits servers on this machine
    shared_dir: str | None = None

    @field_validator("api_key_env")
    @classmethod
    def _env_name(cls, v: str | None) -> str | None:
        if v is not None and not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", v):
            raise ValueError("rollout.remote.api_key_env names the environment variable that holds the API key "
                             "(e.g. OPENAI_API_KEY), never the key itself: keep keys out of configs and run dirs")
        return v

    @model_validator(mode="after")
    def _backend_settings(self) -> "RemoteConfig":
        if self.backend == "sglang" and self.weights_via == "http":
            raise ValueError("rollout.remote.weights_via=http: SGLang loads full weights from disk "
                             "(/update_weights_from_disk), so use weights_via=path (or auto) with a "
                             "rollout.remote.shared_dir every server can read")
        if self.backend == "sglang" and self.model is not None:
            raise ValueError("rollout.remote.model: an SGLang server's /generate serves its one model (it takes no "
                             "model name); leave rollout.remote.model unset with backend=sglang")
        return self


class RolloutConfig(_Section):
    """Sampling settings for the rollout engine, multi-turn environments and agents."""

    # hf: the embedded engine (the learner's own model); vllm: vLLM's LLM in this process;
    # remote: inference servers at rollout.remote.urls (`plainrl serve`, SGLang: rollout.remote.backend)
    engine: Literal["hf", "vllm", "remote"] = "hf"
    # weight sync to a vllm/remote engine after each update: lora pushes the adapter, full the
    # changed tensors (merged with the adapter under LoRA); auto: lora under LoRA, else full
    sync: Literal["auto", "lora", "full"] = "auto"
    # 1: one-step-off policy: servers sample step t+1 (weights of before update t) while the
    # learner trains on step t (plainrl.run.overlap); needs rollout.engine=remote
    async_steps: Literal[0, 1] = 0
    vllm: VLLMConfig = Field(default_factory=VLLMConfig)
    remote: RemoteConfig = Field(default_factory=RemoteConfig)
    group_size: int = Field(8, gt=0)
    prompts_per_step: int = Field(4, gt=0)
    max_new_tokens: int = Field(64, gt=0)
    temperature: float = Field(1.0, ge=0.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(0, ge=0)
    stop: list[str] = Field(default_factory=list)
    batch_size: int = Field(64, gt=0)  # sequences decoded together
    merge_lora: bool = True  # decode with LoRA folded into the weights (faster; one weight copy)
    # static: fused, prepacked Llama-family decode on a preallocated KV cache (plainrl.rollout.engines.static_decoder);
    # transformers: the model's own forward (any causal LM); auto: static where the model is supported
    decoder: Literal["auto", "static", "transformers"] = "auto"
    # Multi-turn: a built-in environment ("calculator", "python") or a factory
    # "module:fn" / "file.py:fn" returning an Environment (see docs/environments.md).
    env: str | None = None
    max_turns: int = Field(8, gt=0)
    max_total_tokens: int | None = Field(None, gt=0)  # completion budget over all turns; default max_new_tokens
    tool_timeout_s: float = Field(5.0, gt=0)  # per code run of the Python tool (its sandbox's wall-clock limit)
    # per environment call: each episode's environment lives in a worker process and
    # a reset/step past this many seconds is killed, making the episode unscorable
    # (null: environments run in this process, without a limit that can kill)
    env_timeout_s: float | None = Field(60.0, gt=0)
    # environment worker processes, one per episode in flight: in a step with more episodes
    # the next one starts when one ends (generation batches shrink to match)
    env_workers: int = Field(64, gt=0)
    # per reward call: reward functions run in worker processes and a call past this
    # many seconds is killed, making the sample unscorable (null: in process, no limit)
    reward_timeout_s: float | None = Field(60.0, gt=0)
    reward_workers: int = Field(1, gt=0)  # reward worker processes (kept for the run) scoring in parallel
    fail_fast: bool = False  # an unscorable sample stops the run instead of being counted
    # Bring your own agent loop: "module:fn" / "file.py:fn", `async def fn(llm, row)` (or a plain
    # function) calling `await llm.chat(messages)` as often as it likes and returning a reward,
    # {"reward": r, **info} or None (see docs/agents.md); exclusive with rollout.env
    agent: str | None = None
    # episodes in flight at once (rollout.agent and rollout.env); null: a whole step's
    max_concurrent_episodes: int | None = Field(None, gt=0)
    # per agent episode: seconds it may spend outside model calls (its code, its tools) before it
    # is cancelled as a failed episode (null: no limit)
    agent_timeout_s: float | None = Field(600.0, gt=0)

    @field_validator("env")
    @classmethod
    def _env_reference(cls, v: str | None) -> str | None:
        if v is not None and v not in BUILTIN_ENVS and ":" not in v:
            raise ValueError(f"rollout.env={v!r}: use a built-in ({', '.join(BUILTIN_ENVS)}) "
                             "or a factory 'module:fn' / 'path/to/file.py:fn'")
        return v

    @field_validator("agent")
    @classmethod
    def _agent_reference(cls, v: str | None) -> str | None:
        if v is not None and ":" not in v:
            raise ValueError(f"rollout.agent={v!r}: write 'module:fn' or 'path/to/file.py:fn' naming "
                             "`async def fn(llm, row)` (see docs/agents.md)")
        return v

    @model_validator(mode="after")
    def _engine_settings(self) -> "RolloutConfig":
        if self.agent is not None and self.env is not None:
            raise ValueError(f"rollout.agent={self.agent!r} and rollout.env={self.env!r}: an episode runs either "
                             "your agent or an environment; keep one (an agent can call the environment's tools "
                             "itself)")
        if self.engine == "remote" and not self.remote.urls:
            raise ValueError("rollout.engine=remote needs rollout.remote.urls, e.g. "
                             "rollout.remote.urls='[http://127.0.0.1:8000]' (start one with `plainrl serve CONFIG.yaml`, "
                             "or see docs/engines.md for SGLang and OpenAI-compatible servers)")
        if self.async_steps and self.engine != "remote":
            raise ValueError(f"rollout.async_steps=1 samples on inference servers while the learner trains, so it needs "
                             f"rollout.engine=remote (got {self.engine!r}: the {self.engine} engine shares this "
                             f"process's cores/GPU with the learner); set rollout.async_steps=0 or serve the model "
                             f"with `plainrl serve`")
        return self

    @property
    def completion_budget(self) -> int:
        """Tokens after the prompt: max_new_tokens, or max_total_tokens over all turns."""
        return self.max_total_tokens or self.max_new_tokens
