"""The ``rollout`` section: the engine (embedded, vLLM in process, remote servers), sampling,
multi-turn environments and reward workers."""

from __future__ import annotations

import ipaddress
import re
from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from plainrl.config.base import _Section

BUILTIN_ENVS = ("calculator", "python")  # rollout.env names built into plainrl.rollout.make_env_factory


class VLLMConfig(_Section):
    """``rollout.engine: vllm``: vLLM's ``LLM`` in the trainer's process, and ``plainrl serve``."""

    gpu_memory_utilization: float | Literal["auto"] = "auto"
    """CUDA: the share of GPU memory vLLM takes for weights and KV cache; the learner gets the rest. `auto`: in the
    trainer's process, the weights plus a KV cache for the step's sequences cut to the free memory (the run's log
    gives the figures; an error when not even one sequence fits); `plainrl serve` 0.9 (a GPU of its own) unless
    started with `--colocated`, which needs a number here."""
    sleep: bool = True
    """CUDA: free vLLM's GPU memory while the learner runs (vLLM sleep mode: level 2 for a full sync, whose weights
    are all rewritten, level 1 for LoRA). `plainrl serve` uses it only with `--colocated`."""

    @field_validator("gpu_memory_utilization")
    @classmethod
    def _share(cls, v):
        if isinstance(v, float) and not 0.0 < v <= 1.0:
            raise ValueError(f"rollout.vllm.gpu_memory_utilization must be in (0, 1] or auto, got {v}")
        return v
    cpu_kv_cache_gb: float = Field(1.0, gt=0)
    """CPU: KV cache size in GB (vLLM's `VLLM_CPU_KVCACHE_SPACE`)."""
    enforce_eager: bool = False
    """Skip graph compilation and capture: a faster start, a slower decode."""
    extra_args: dict[str, Any] = Field(default_factory=dict)
    """Passed to `vllm.LLM` / `vllm serve` as they are."""


class ServersConfig(_Section):
    """Inference servers plainrl sends token ids to (``rollout.remote``, ``algorithm.teacher.remote``):
    where they are, which served model to name, the key and the timeouts."""

    backend: str = "vllm"
    """What serves the model (each section narrows the choice)."""
    urls: list[str] = Field(default_factory=list)
    """The servers' base URLs, e.g. `[http://127.0.0.1:8000]`."""
    model: str | None = None
    """The served model's name to request; null: the first a server lists."""
    api_key_env: str | None = None
    """The name of the environment variable holding the API key (sent as a Bearer token), never the key itself."""
    timeout_s: float = Field(600.0, gt=0)
    """Per request: a server silent this long counts as dead."""
    connect_timeout_s: float = Field(10.0, gt=0)
    """Seconds to connect to a server."""

    @field_validator("api_key_env")
    @classmethod
    def _env_name(cls, v: str | None) -> str | None:
        if v is not None and not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", v):
            raise ValueError("api_key_env names the environment variable that holds the API key "
                             "(e.g. OPENAI_API_KEY), never the key itself: keep keys out of configs and run dirs")
        return v

    def _sglang_names_no_model(self, section: str) -> None:
        if self.backend == "sglang" and self.model is not None:
            raise ValueError(f"{section}.model: an SGLang server's /generate serves its one model (it takes no "
                             f"model name); leave {section}.model unset with backend=sglang")


class RemoteConfig(ServersConfig):
    """``rollout.engine: remote``: inference servers, vLLM's started by ``plainrl serve``,
    SGLang's or any OpenAI-compatible one (docs/engines.md)."""

    backend: Literal["vllm", "sglang", "openai"] = "vllm"
    """`vllm`: `plainrl serve` servers; `sglang`: SGLang servers; `openai`: any OpenAI-compatible completions server,
    read-only (`plainrl eval`), not token-exact."""
    weights_via: Literal["auto", "group", "http", "path"] = "auto"
    """Full-weight sync: `group` broadcasts buckets of whole layers over a process group the trainer and every server
    worker join (gloo on CPU, NCCL on CUDA; `plainrl serve` servers, and SGLang 0.5.6 or later through its
    `/init_weights_update_group`), `http` sends the tensors in the request (vLLM only), `path` writes them to
    `shared_dir` and sends the path; `auto`: `group` where one forms, else http up to 1 GiB (vLLM), else path (the
    log says which)."""
    group_timeout_s: float = Field(60.0, gt=0)
    """`weights_via: group`: seconds for the trainer and the servers to form the group, and for each bucket's
    broadcast; a server that misses it ends the group (`auto` then falls back to http or path)."""
    shared_dir: str | None = None
    """A directory the trainer and every server can read (LoRA adapters, `weights_via: path`); null: a temporary
    directory on this machine."""

    @model_validator(mode="after")
    def _backend_settings(self) -> "RemoteConfig":
        if self.backend == "sglang" and self.weights_via == "http":
            raise ValueError("rollout.remote.weights_via=http: SGLang takes full weights over a process group "
                             "or from disk (/update_weights_from_disk), so use weights_via=group or auto, or path "
                             "with a rollout.remote.shared_dir every server can read")
        self._sglang_names_no_model("rollout.remote")
        return self


class RolloutConfig(_Section):
    """Sampling settings for the rollout engine, multi-turn environments and agents."""

    engine: Literal["hf", "vllm", "remote"] = "hf"
    """`hf`: the embedded engine (the learner's own model); `vllm`: vLLM's `LLM` in this process; `remote`: inference
    servers at `rollout.remote.urls`."""
    sync: Literal["auto", "lora", "full"] = "auto"
    """Weight sync to a vllm/remote engine after each update: `lora` pushes the adapter, `full` the changed tensors
    (merged under LoRA; in bfloat16 the merge loses the part of each update below the weights' spacing); `auto`:
    lora under LoRA, else full (`rollout.engine: vllm` on a CPU: full for a float32 LoRA model, docs/engines.md)."""
    async_steps: int = Field(0, ge=0)
    """N > 0: batches are sampled up to N steps ahead on a rollout thread while the learner trains; a batch sampled with
    the weights of update v is trained at step v + N at the latest (the sampler waits, nothing is dropped for age); 1
    is one-step-off. Needs `rollout.engine: remote`, or `hf`, which then samples with a copy of the model
    (docs/engines.md); 0: synchronous."""
    partial: bool = False
    """Partial rollouts (needs `async_steps > 0`): a weight push interrupts the completions in flight (`partial_by`)
    instead of waiting for the batch being sampled; the tokens are kept, sampling continues under the new weights,
    and each token records the version that sampled it (`plainrl.rollout.engines.partial`)."""
    partial_by: Literal["auto", "abort", "chunks"] = "auto"
    """`partial`: how a push interrupts sampling. `abort`: requests in flight are aborted at the next streamed token
    and continued from their token ids under the new weights (vLLM servers: `plainrl serve` or `vllm serve`);
    `chunks`: every engine call decodes at most `partial_chunk` tokens and a push lands between calls (any engine);
    `auto`: abort where the engine can, else chunks."""
    partial_chunk: int = Field(32, gt=0)
    """`partial` by chunks: decode tokens per engine call, the most a weight push waits for."""
    vllm: VLLMConfig = Field(default_factory=VLLMConfig)
    """`rollout.engine: vllm` and `plainrl serve` settings."""
    remote: RemoteConfig = Field(default_factory=RemoteConfig)
    """`rollout.engine: remote` settings."""
    group_size: int = Field(8, gt=0)
    """Completions sampled per prompt."""
    prompts_per_step: int = Field(4, gt=0)
    """Prompts per step (episodes per step: prompts_per_step x group_size)."""
    max_new_tokens: int = Field(64, gt=0)
    """Completion budget of one turn."""
    temperature: float = Field(1.0, ge=0.0)
    """Sampling temperature."""
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    """Nucleus sampling threshold (1: off)."""
    top_k: int = Field(0, ge=0)
    """Top-k sampling (0: off)."""
    stop: list[str] = Field(default_factory=list)
    """Stop strings ending a completion."""
    batch_size: int = Field(64, gt=0)
    """Sequences decoded together."""
    merge_lora: bool = True
    """Decode float32 weights with LoRA folded in (faster; one weight copy). 16-bit weights always decode with LoRA
    unmerged: folded into bfloat16, the update below the weights' spacing is rounded away."""
    decoder: Literal["auto", "static", "transformers"] = "auto"
    """Embedded engine's forward: `static` (fused, prepacked Llama-family decode), `transformers` (any causal LM),
    `auto` (static where the model is supported)."""
    env: str | None = None
    """Multi-turn: a built-in environment (`calculator`, `python`) or a factory `module:fn` / `file.py:fn` returning
    an `Environment`, or a class: a plainrl `Environment`, a TRL `environment_factory` class or an OpenEnv
    `Environment` (docs/environments.md)."""
    max_turns: int = Field(8, gt=0)
    """Model turns per multi-turn episode at most."""
    max_total_tokens: int | None = Field(None, gt=0)
    """Multi-turn completion budget over all turns (for agents: per episode, every segment and untrained call
    together); null: `max_new_tokens` for environments, and for agents room for several calls: `AGENT_BUDGET_CALLS`
    (4) x `max_new_tokens`, at most half of `model.max_context` (the run prints the value it chose)."""
    tool_timeout_s: float = Field(5.0, gt=0)
    """Wall-clock limit of one code run of the Python tool's sandbox, and of one tool call of an environment class
    (TRL `environment_factory`, OpenEnv): one that runs over fails its episode."""
    env_timeout_s: float | None = Field(60.0, gt=0)
    """Per environment call: each episode's environment lives in a worker process, and a reset or step past this is
    killed, the episode unscorable (null: in this process, no limit that can kill)."""
    env_workers: int = Field(64, gt=0)
    """Environment worker processes, one per episode in flight."""
    reward_timeout_s: float | None = Field(60.0, gt=0)
    """Per reward call: rewards run in worker processes and a call past this is killed, the sample unscorable (null:
    in process, no limit)."""
    reward_workers: int = Field(1, gt=0)
    """Reward worker processes (kept for the run) scoring in parallel."""
    fail_fast: bool = False
    """An unscorable sample stops the run (exit status 1) instead of being counted."""
    agent: str | None = None
    """Your own agent loop: `module:fn` / `file.py:fn`, `async def fn(llm, row)` returning a reward, `{"reward": r,
    **info}` or None; exclusive with `rollout.env`. `online`: a process outside the run drives the episodes through
    the gateway and posts their rewards (docs/agents.md, "Online episodes")."""
    gateway_host: str = "127.0.0.1"
    """The address the agents' gateway listens on: loopback (`127.0.0.1`, `::1`, `localhost`) by default; any other
    (`0.0.0.0`, a LAN address, for `rollout.agent: online` harnesses on other machines) needs
    `rollout.gateway_api_key_env`. Plain HTTP: use a private network or a tunnel."""
    gateway_port: int = Field(0, ge=0, le=65535)
    """The agents' gateway's port on `rollout.gateway_host` (0: a free one). With `rollout.agent: online` its address
    and token are printed and written to `RUN_DIR/gateway.json`."""
    gateway_api_key_env: str | None = None
    """The name of the environment variable holding the key the gateway's `/rl/` routes ask for (`rollout.agent:
    online`; sent as `Authorization: Bearer KEY`), never the key itself; null: a random one, written to
    `RUN_DIR/gateway.json`. Needed for a `rollout.gateway_host` other than loopback."""
    render_threads: int | None = Field(None, gt=0)
    """Threads that render chat templates and tokenize long contexts off the episodes' event loop (agents, the
    gateway); null: min(4, CPU cores)."""
    agent_threads: int = Field(256, gt=0)
    """The most threads the episodes' event loop runs blocking calls in at once (plain-function agents,
    `asyncio.to_thread`); more wait for a free one."""
    tool_parser: Literal["auto", "hermes", "llama3_json", "qwen3_coder", "mistral", "deepseek_v3",
                         "deepseek_v31"] = "auto"
    """The format the agents' gateway reads tool calls in from the model's replies: `hermes` (`<tool_call>` JSON: Qwen
    2.5/3, Hermes, SmolLM2), `llama3_json` (Llama 3.1-3.3), `qwen3_coder` (Qwen3-Coder's XML), `mistral`
    (`[TOOL_CALLS]`), `deepseek_v3` / `deepseek_v31` (DeepSeek's tool-call tokens); `auto`: the one the chat template
    writes (docs/agents.md, "Three dialects")."""
    max_concurrent_episodes: int | None = Field(None, gt=0)
    """Episodes in flight at once (`rollout.agent` and `rollout.env`); null: a whole step's."""
    agent_timeout_s: float | None = Field(600.0, gt=0)
    """Per agent episode: seconds it may spend outside model calls before it is cancelled as failed (null: no limit)."""

    @field_validator("env")
    @classmethod
    def _env_reference(cls, v: str | None) -> str | None:
        if v is not None and v not in BUILTIN_ENVS and ":" not in v:
            raise ValueError(f"rollout.env={v!r}: use a built-in ({', '.join(BUILTIN_ENVS)}) "
                             "or a factory 'module:fn' / 'path/to/file.py:fn'")
        return v

    @field_validator("gateway_api_key_env")
    @classmethod
    def _gateway_key_env(cls, v: str | None) -> str | None:
        if v is not None and not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", v):
            raise ValueError("rollout.gateway_api_key_env names the environment variable that holds the key "
                             "(e.g. PLAINRL_GATEWAY_KEY), never the key itself: keep keys out of configs and run dirs")
        return v

    @field_validator("agent")
    @classmethod
    def _agent_reference(cls, v: str | None) -> str | None:
        if v is not None and v != "online" and ":" not in v:
            raise ValueError(f"rollout.agent={v!r}: write 'module:fn' or 'path/to/file.py:fn' naming "
                             "`async def fn(llm, row)` (see docs/agents.md)")
        return v

    @model_validator(mode="after")
    def _engine_settings(self) -> "RolloutConfig":
        if self.agent is not None and self.env is not None:
            raise ValueError(f"rollout.agent={self.agent!r} and rollout.env={self.env!r}: an episode runs either "
                             "your agent or an environment; keep one (an agent can call the environment's tools "
                             "itself)")
        if not is_loopback(self.gateway_host) and self.gateway_api_key_env is None:
            raise ValueError(f"rollout.gateway_host={self.gateway_host!r} is not a loopback address, and "
                             "rollout.gateway_api_key_env is not set: a gateway other machines can reach needs a key "
                             "of your own for its /rl/ routes; set rollout.gateway_api_key_env to the name of an "
                             "environment variable holding it, or keep rollout.gateway_host=127.0.0.1")
        if self.engine == "remote" and not self.remote.urls:
            raise ValueError("rollout.engine=remote needs rollout.remote.urls, e.g. "
                             "rollout.remote.urls='[http://127.0.0.1:8000]' (start one with `plainrl serve CONFIG.yaml`, "
                             "or see docs/engines.md for SGLang and OpenAI-compatible servers)")
        if self.partial and not self.async_steps:
            raise ValueError("rollout.partial=true lets a weight push land mid-batch, which only happens with "
                             "rollout.async_steps > 0; set rollout.async_steps (e.g. 2) or rollout.partial=false")
        if self.partial and self.partial_by == "abort" and not (self.engine == "remote" and self.remote.backend == "vllm"):
            where = f"rollout.engine={self.engine}" + (f" with backend {self.remote.backend}" if self.engine == "remote" else "")
            raise ValueError(f"rollout.partial_by=abort needs vLLM servers (rollout.engine=remote, backend vllm), which "
                             f"stream tokens and abort a request when it is closed; {where} cannot, so set "
                             "rollout.partial_by=chunks (or auto)")
        if self.async_steps and self.engine == "vllm":
            raise ValueError(f"rollout.async_steps={self.async_steps} samples while the learner trains, which vLLM in "
                             "this process cannot (it shares the learner's GPU by sleep mode); set "
                             "rollout.engine=remote and serve the model with `plainrl serve`, use rollout.engine=hf, "
                             "or set rollout.async_steps=0")
        return self

    def agent_budget_note(self, max_context: int) -> str | None:
        """Why ``max_total_tokens`` has the value it has, when it is :func:`agent_budget`'s default (else None)."""
        if self.agent is None or self.max_total_tokens != agent_budget(self.max_new_tokens, max_context):
            return None
        return (f"rollout.max_total_tokens: {self.max_total_tokens} tokens per episode segment (not set: room for "
                f"{AGENT_BUDGET_CALLS} calls of rollout.max_new_tokens={self.max_new_tokens}, model and tool tokens "
                f"together, at most half of model.max_context={max_context}; set it to change)")

    @property
    def completion_budget(self) -> int:
        """Tokens after the prompt: max_new_tokens, or max_total_tokens over all turns."""
        return self.max_total_tokens or self.max_new_tokens


def is_loopback(host: str) -> bool:
    """Whether ``host`` (an IP address or ``localhost``) names this machine's loopback interface
    only; a host name other than ``localhost`` is not taken for one."""
    if host.strip().lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip().strip("[]")).is_loopback
    except ValueError:
        return False


# an agent makes several model calls per episode; a budget of one call's max_new_tokens refused every second
# call ("no room for another model call"), so agent runs without max_total_tokens get room for this many
AGENT_BUDGET_CALLS = 4


def agent_budget(max_new_tokens: int, max_context: int) -> int:
    """The default completion budget of an agent's episode segment: :data:`AGENT_BUDGET_CALLS`
    calls of ``max_new_tokens``, at most half the model's context (the rest is for the prompt),
    never below one call."""
    return max(max_new_tokens, min(AGENT_BUDGET_CALLS * max_new_tokens, max_context // 2))
