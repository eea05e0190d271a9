"""A verifiers (0.4.0) taskset that runs offline, for examples/verifiers_grpo.yaml: say the word the
task names. verifiers finds it as it finds every taskset plugin, by the Taskset subclass in `__all__`;
its reward is a `@vf.reward` method scoring the trace (verifiers records it, plainrl trains on it)."""

import verifiers.v1 as vf

WORDS = ["apple", "river", "stone", "cloud", "ember", "maple", "delta", "orbit", "cedar", "flint",
         "amber", "coral", "ivory", "lemon", "otter", "pearl"]


class SayWordTask(vf.Task[vf.TaskData, vf.State, vf.TaskConfig]):
    @vf.reward
    async def said_it(self, task, trace) -> float:
        """1.0 when the final reply contains the task's word."""
        return 1.0 if task.name in (trace.root_reply or "").lower() else 0.0


class SayWordTaskset(vf.Taskset[SayWordTask, vf.TasksetConfig]):
    def load(self):
        for word in WORDS:
            yield SayWordTask(vf.TaskData(name=word, prompt=f"Reply with the single word: {word}"), self.config.task)


__all__ = ["SayWordTaskset"]
