"""verifiers (0.4.0) tasksets and environments, trained by plainrl through its gateway's token route.

    data:
      source: plainrl.integrations.verifiers:rows
      source_args: {taskset: my-taskset, size: 512, args: {...}}
    rollout:
      agent: plainrl.integrations.verifiers:agent

:func:`rows` turns a verifiers ``Taskset`` (an installed package exporting one, named by its id) into
data rows, one per task: the task's wire data (``TaskData``) rides along in ``vf_task``. :func:`agent`
runs each row's task as one verifiers episode, ``Env.run_episode``, in the environment the taskset
resolves to (its own ``Env``, else ``SingleAgentEnv``), every agent seat with the ``null`` harness and
the ``subprocess`` runtime unless :func:`configure` says otherwise. The seats call the model through
verifiers' ``TrainClientConfig``: verifiers renders each prompt to token ids with its ``renderers``
package (the policy's tokenizer) and posts them to ``POST /inference/v1/generate`` on this episode's
gateway (``llm.base_url``, ``llm.api_key``), which samples from the policy and records every call
token-exactly. Each call that extends the episode's last context continues its segment; any other
starts a new one, so the segments are the trace's branches (root-to-leaf message paths). The episode's
reward is what the traces record (``Trace.reward``: the weighted sum of its ``rewards``), and each
segment gets the reward of the trace whose branch it is (``segment_rewards``).

A verifiers episode that fails (``Episode.ok`` false: a harness, task or scoring error, a timeout)
raises here, failing the plainrl episode (``errors.jsonl``).
"""

from __future__ import annotations

import hashlib
import importlib.util
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from plainrl.integrations import require

require("verifiers.v1", extra="verifiers")
import verifiers.v1 as vf  # noqa: E402
from verifiers.v1.utils import loaders as _loaders  # noqa: E402
from verifiers.v1.utils.generic import concrete_type  # noqa: E402

__all__ = ["VerifiersError", "agent", "configure", "rows"]

NO_KEY_VAR = "PLAINRL_VERIFIERS_UNSET_KEY"  # verifiers reads a key from a variable; ours goes in a header


class VerifiersError(RuntimeError):
    """A verifiers episode did not finish cleanly; the message has verifiers' own errors."""


@dataclass(frozen=True)
class _Settings:
    harness: str = "null"
    runtime: str = "subprocess"
    max_tokens: int | None = None


_settings = _Settings()


def configure(*, harness: str = "null", runtime: str = "subprocess", max_tokens: int | None = None) -> None:
    """Change the defaults :func:`agent` runs seats with (call it from a wrapper agent module).

    Args:
        harness: the verifiers harness id of seats that do not pin one (``null``: a chat loop).
        runtime: the runtime type of every seat (``subprocess``: on this machine).
        max_tokens: the most tokens per model call (None: the run's ``rollout.max_new_tokens``).
    """
    global _settings
    _settings = _Settings(harness, runtime, max_tokens)


def _plugin_id(taskset: str) -> str:
    """The verifiers plugin id of ``taskset``: an installed package's id as it is, or a ``.py`` file
    imported here under a name derived from its path (verifiers then finds it in ``sys.modules``)."""
    if not (taskset.endswith(".py") or "/" in taskset):
        return taskset
    path = Path(taskset).resolve()
    name = "plainrl_vf_" + hashlib.sha1(str(path).encode()).hexdigest()[:12]
    if name not in sys.modules:
        if not path.is_file():
            raise ValueError(f"verifiers taskset file {taskset!r} does not exist")
        spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        try:
            spec.loader.exec_module(module)
        except BaseException:
            del sys.modules[name]
            raise
    return name


def _taskset(taskset: str, args: dict[str, Any] | None) -> Any:
    taskset = _plugin_id(taskset)
    try:
        config = _loaders.taskset_config_type(taskset).model_validate({**(args or {}), "id": taskset})
        return _loaders.load_taskset(config)
    except (ModuleNotFoundError, TypeError, AttributeError, ValueError) as e:
        raise ValueError(f"verifiers taskset {taskset!r} with args {args or {}}: {e}") from e


def rows(taskset: str, size: int | None = None, args: dict[str, Any] | None = None, skip: int = 0) -> list[dict]:
    """One data row per task of a verifiers taskset, for ``data.source``.

    Args:
        taskset: the taskset's id (an installed package exporting a ``vf.Taskset`` subclass in ``__all__``,
            as verifiers finds its plugins), or a ``.py`` file exporting one the same way.
        size: the most tasks (needed for an infinite taskset); None: all of them.
        args: the taskset's config fields (``TasksetConfig`` of its type), e.g. ``{"game": "Wordle-v0"}``.
        skip: tasks skipped first (another slice for held-out rows: ``data.eval_source_args``).
    Returns:
        rows with ``prompt`` (the task's prompt text, shown in logs; the agent renders its own),
        ``vf_taskset``, ``vf_args`` and ``vf_task`` (the task's data as JSON).
    Raises:
        ValueError: an unknown taskset, bad ``args``, or an infinite taskset without ``size``.
    """
    ts = _taskset(taskset, args)
    view = ts.skip(skip) if skip else ts
    if size is not None:
        view = view.take(size)
    elif not ts.bounded:
        raise ValueError(f"verifiers taskset {taskset!r} is infinite: give data.source_args.size")
    out = []
    for task in view:
        data = task.data
        out.append({"prompt": data.prompt_text or data.name or f"{taskset} task {data.idx}",
                    "vf_taskset": taskset, "vf_args": dict(args or {}),
                    "vf_task": data.model_dump(mode="json")})
    return out


def _env(taskset: str, args: dict[str, Any]) -> Any:
    """A new verifiers ``Env`` of a taskset, every seat on the configured harness and runtime. One per
    episode: ``Env.serving()`` keeps the episode's interception server on the ``Env`` object itself."""
    taskset = _plugin_id(taskset)
    env_cls = _loaders.environment_class(taskset)
    config_cls = concrete_type(env_cls, vf.EnvConfig, origin=vf.Env) or vf.EnvConfig
    runtime = {"type": _settings.runtime}
    seats = {name: {"runtime": runtime} for name, field in config_cls.model_fields.items()
             if isinstance(field.default, vf.AgentConfig)}
    config = config_cls.model_validate({"taskset": {**args, "id": taskset}, **seats})
    for name in seats:  # the taskset's own default harness is replaced only where the seat pins none
        seat = getattr(config, name)
        if seat.harness is None:
            harness = _loaders.harness_config_type(_settings.harness).model_validate({"id": _settings.harness})
            setattr(config, name, seat.model_copy(update={"harness": harness}))
    return env_cls(config)


def _context(llm: Any) -> Any:
    client = vf.TrainClientConfig(
        base_url=llm.base_url, api_key_var=NO_KEY_VAR, headers={"Authorization": f"Bearer {llm.api_key}"},
        renderer_model_name=str(llm.tokenizer.name_or_path),
    )
    sampling = vf.SamplingConfig(max_tokens=_settings.max_tokens) if _settings.max_tokens else vf.SamplingConfig()
    return vf.ModelContext(model="policy", client=client, sampling=sampling)


def _segment_rewards(llm: Any, traces: list[Any], default: float) -> tuple[list[float], int]:
    """Each recorded segment's reward: that of the trace with a branch whose tokens begin with the
    segment's (prompt and completion; a branch may end in messages no call answered), else ``default``.
    Returns the rewards and how many segments matched no branch."""
    branches = [(tuple(b.token_ids), t.reward) for t in traces for b in t.branches]
    out, unmatched = [], 0
    for seg in llm.trajectory.segments:
        key = tuple(seg.prompt_ids) + tuple(seg.completion_ids)
        match = next((r for ids, r in branches if ids[: len(key)] == key), None)
        unmatched += match is None
        out.append(default if match is None else match)
    return out, unmatched


async def agent(llm: Any, row: dict[str, Any]) -> dict[str, Any]:
    """One verifiers episode of the row's task (see the module docstring).

    Returns:
        ``{"reward": the trainable traces' ``Trace.reward`` summed, "segment_rewards": one per recorded
        segment (its trace's reward), "vf_unmatched_segments": segments that are no trace branch (they
        get the episode's reward), "vf_branches": the traces' trainable branches, "vf_<metric>": the
        traces' numeric metrics}``.
    Raises:
        VerifiersError: the verifiers episode failed (its errors in the message).
    """
    env = _env(row["vf_taskset"], row.get("vf_args") or {})
    task_cls = type(env.taskset).task_type()
    task = task_cls(task_cls.data_type().model_validate(row["vf_task"]), env.taskset.config.task)
    async with env.serving():
        episode = await env.run_episode(task, _context(llm))
    if not episode.ok:
        errors = [e for t in episode.traces for e in t.errors] + list(episode.errors)
        raise VerifiersError("; ".join(f"{e.type}: {e.message}" for e in errors) or "the episode is not ok")
    trained = [t for t in episode.traces if t.agent.trainable]
    reward = sum(t.reward for t in trained)
    seg_rewards, unmatched = _segment_rewards(llm, trained, reward)
    out: dict[str, Any] = {"reward": reward, "segment_rewards": seg_rewards, "vf_unmatched_segments": unmatched,
                           "vf_branches": sum(b.trainable for t in trained for b in t.branches)}
    metrics = {k: v for t in trained for k, v in t.metrics.items() if isinstance(v, (int, float))}
    out.update({f"vf_{k}": v for k, v in metrics.items()})
    return out
