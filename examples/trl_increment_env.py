"""A TRL ``environment_factory`` class run by plainrl as it is (``rollout.env: examples/trl_increment_env.py:IncrementEnv``).

``IncrementEnv`` is copied unchanged from TRL's documentation (docs/source/grpo_trainer.md, "Environments",
trl 1.16): ``reset`` self-samples a target and returns the task, appended to the row's prompt; the public
method ``increment`` is the model's tool (its schema from the type hints and docstring); ``get_reward`` scores
the episode once it is over. ``rows`` is plainrl's part: the prompts the task text is appended to.
"""

import random


class IncrementEnv:
    # Reserved methods
    def reset(self, **kwargs) -> str | None:  # required; called at the start of each rollout
        self.counter = 0
        self.target = random.randint(1, 6)  # self-sample the task
        return f"Increment the counter by {self.target}."  # returned string becomes the prompt

    def get_reward(self) -> float:  # optional: the environment scores itself from its own state
        return float(self.counter == self.target)

    # Public methods (exposed as tools)
    def increment(self, step: int) -> int:
        """
        Increment the internal counter.

        Args:
            step: Value to add to the counter.

        Returns:
            The updated counter value.
        """
        self.counter += step
        return self.counter


def rows(n: int = 64) -> list[dict]:
    """``n`` prompts for ``data.source``: the environment's task text is appended to each."""
    return [{"prompt": "Call the increment tool once with the right step. Task: "} for _ in range(n)]
