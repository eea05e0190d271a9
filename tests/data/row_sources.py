"""Datasets from code (``data.source: tests/data/row_sources.py:FN``) and an environment built
per row from its ``env_args`` (``rollout.env: tests/data/row_sources.py:SecretFileEnv``), for
tests/test_data_source.py."""

import shutil
import tempfile
from pathlib import Path

import torch

from plainrl.rollout.envs import StepResult


def secret_rows(n: int = 4) -> list[dict]:
    """Arithmetic prompts, each with its own environment: ``env_args`` give the secret its
    environment writes to its own file; the row's ``answer`` is the same secret."""
    return [{"prompt": f"What is {i} + {i}?", "answer": f"secret-{i}", "env_args": {"secret": f"secret-{i}"}}
            for i in range(n)]


class SecretDataset(torch.utils.data.Dataset):
    """:func:`secret_rows` as a map-style torch dataset (what the end-to-end run reads)."""

    def __init__(self, n: int):
        self.rows = secret_rows(n)

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> dict:
        return self.rows[i]


def generated(n: int = 3):
    """A generator of chat rows with an extra column."""
    for i in range(n):
        yield {"messages": [{"role": "user", "content": f"Say {i}."}], "answer": str(i), "level": i}


class Squares(torch.utils.data.Dataset):
    """A map-style torch dataset: ``__len__`` and ``__getitem__``, no ``__iter__``."""

    def __init__(self, n: int):
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict:
        if not 0 <= i < self.n:
            raise IndexError(i)
        return {"prompt": f"What is {i} squared?", "answer": str(i * i)}


def torch_map(n: int = 3) -> torch.utils.data.Dataset:
    return Squares(n)


class Counting(torch.utils.data.IterableDataset):
    """An endless iterable torch dataset (``data.max_rows`` bounds it)."""

    def __iter__(self):
        i = 0
        while True:
            yield {"prompt": f"Count to {i}.", "answer": str(i)}
            i += 1


def torch_endless() -> torch.utils.data.IterableDataset:
    return Counting()


def hf_dataset(n: int = 3):
    import datasets

    return datasets.Dataset.from_list([{"prompt": f"Spell {i}.", "answer": str(i)} for i in range(n)])


def hf_dataset_dict():
    import datasets

    rows = [{"prompt": f"Name {i}.", "answer": str(i)} for i in range(4)]
    return datasets.DatasetDict({"train": datasets.Dataset.from_list(rows[:3]),
                                 "test": datasets.Dataset.from_list(rows[3:])})


def broken():
    raise ConnectionError("the database is down")


def breaks_at_row_2():
    yield {"prompt": "fine"}
    yield {"prompt": "fine too"}
    raise KeyError("row 2 has no id")


def missing_prompt() -> list[dict]:
    return [{"prompt": "a question"}, {"prompt": "another"}, {"question": "no prompt here", "answer": "1"}]


def one_row() -> dict:
    return {"prompt": "a single row, not a list of them"}


def rl2_preferences():
    """DPO/RM rows in RL2's format, as a ``datasets.Dataset``: the prompt chat in ``messages``,
    the responses as text."""
    import datasets

    return datasets.Dataset.from_list([{"messages": [{"role": "user", "content": f"Which is larger, {i} or {i + 1}?"}],
                                        "chosen": f"{i + 1} is larger.", "rejected": f"{i} is larger."} for i in range(3)])


class SecretFileEnv:
    """A one-turn environment with its own files and state: the constructor writes ``secret``
    (the row's ``env_args``) into a file of a fresh directory; ``step`` reads it back and rewards
    1 when it is the row's ``answer``. Rows sharing one environment, or built without their
    ``env_args``, would read another secret (or fail)."""

    stop: tuple[str, ...] = ()
    max_turns = 1

    def __init__(self, secret: str):
        self.dir = Path(tempfile.mkdtemp(prefix="plainrl-test-env-"))
        (self.dir / "secret.txt").write_text(secret)

    def reset(self, row: dict):
        return None

    def step(self, turn_text: str, state) -> StepResult:
        secret = (self.dir / "secret.txt").read_text()
        return StepResult(done=True, reward=float(secret == state.row["answer"]), info={"secret": secret})

    def close(self) -> None:
        shutil.rmtree(self.dir, ignore_errors=True)
