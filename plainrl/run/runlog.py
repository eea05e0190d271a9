"""A run's log file, ``RUN_DIR/log.txt``, and a console kept to what the user acts on.

During a run (:func:`run_log`), third-party output that a user cannot act on goes to the log
file only: library logging (bitsandbytes' "Failed to load CPU gemm_4bit_forward" on import by
peft, transformers' and the hub's notices) and ``warnings`` raised inside installed libraries
(transformers' ``is_gradient_checkpointing`` deprecation, called by peft). Progress bars of
transformers, the hub and datasets (a bar per weight load and per GGUF conversion step) are
off. What stays on the console: plainrl's own lines (the resolved config, the dtype, one
line per step, the eval lines), plainrl's log records at WARNING and above, and warnings raised
by plainrl or by the user's own code (reward functions, agents), each also in the file.
Everything is restored when the run ends, so a notebook's later cells see libraries as before
(except datasets' progress bars when datasets was first imported during the run: it reads the
switch once).
"""

from __future__ import annotations

import logging
import os
import sys
import sysconfig
import warnings
from collections import deque
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

__all__ = ["LOG_NAME", "run_log"]

LOG_NAME = "log.txt"

# libraries whose own stderr handlers are taken off for the run (their records reach the file through
# the root logger); a library imported later keeps the handler it installs then
_LIBRARIES = ("transformers", "datasets", "huggingface_hub", "peft", "accelerate", "bitsandbytes", "torch")
_PLAINRL = str(Path(__file__).resolve().parents[1]) + os.sep
_INSTALLED = tuple({sysconfig.get_path(k) + os.sep for k in ("stdlib", "platstdlib", "purelib", "platlib")})


def _third_party(filename: str) -> bool:
    """A warning raised inside an installed library or the standard library (not plainrl, not
    the user's own files)."""
    path = os.path.abspath(filename)
    if path.startswith(_PLAINRL):
        return False
    return filename.startswith("<") or path.startswith(_INSTALLED) or \
        f"{os.sep}site-packages{os.sep}" in path or f"{os.sep}dist-packages{os.sep}" in path


def _ours(record: logging.LogRecord) -> bool:
    return record.name == "plainrl" or record.name.startswith("plainrl.")


class _RunFile(logging.Handler):
    """Records to the run's log file, held in memory until the run has made its directory (a run
    that stops at a check before it leaves no directory behind); a run that never made it gets
    the held records on stderr when the handler closes, so nothing is lost."""

    def __init__(self, path: Path):
        super().__init__()
        self.path = path
        self._file = None
        self._held: deque[str] = deque(maxlen=10_000)
        self.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))

    def emit(self, record: logging.LogRecord) -> None:
        try:
            line = self.format(record) + "\n"
            if self._file is None and self.path.parent.is_dir():
                self._file = open(self.path, "a", encoding="utf-8")  # a resumed run appends
                self._file.writelines(self._held)
                self._held.clear()
            if self._file is None:
                self._held.append(line)
            else:
                self._file.write(line)
                self._file.flush()
        except Exception:
            self.handleError(record)

    def close(self) -> None:
        self.acquire()
        try:
            if self._file is not None:
                self._file.close()
            elif self._held:
                sys.stderr.writelines(self._held)
                self._held.clear()
        finally:
            self.release()
        super().close()


def _log_file(run_dir: Path) -> Path:
    rank = int(os.environ.get("RANK", "0") or 0)  # under torchrun each rank keeps its own file
    return run_dir / (LOG_NAME if rank == 0 else f"log.rank{rank}.txt")


@contextmanager
def run_log(run_dir: str | Path) -> Iterator[Path]:
    """Route a run's third-party warnings and library logging to ``run_dir/log.txt`` (appended:
    a resumed run adds to it; written once the run has made ``run_dir``) and turn library
    progress bars off, for the duration of the block.

    Yields:
        the log file's path.
    """
    path = _log_file(Path(run_dir))
    file = _RunFile(path)
    console = logging.StreamHandler(sys.stderr)  # plainrl's own warnings: the user acts on them
    console.setLevel(logging.WARNING)
    console.addFilter(_ours)
    root, ours = logging.getLogger(), logging.getLogger("plainrl")
    ours_level = ours.level
    if ours.level == logging.NOTSET:
        ours.setLevel(logging.INFO)  # plainrl's notes (a GGUF conversion, a removed checkpoint) in the file
    root.addHandler(file)
    # unless the user's own logging set-up already prints to the terminal
    if not any(type(h) is logging.StreamHandler and h.stream in (sys.stderr, sys.stdout) for h in root.handlers):
        root.addHandler(console)
    detached = []
    for name in _LIBRARIES:
        if name not in sys.modules:
            continue
        lib = logging.getLogger(name)
        streams = [h for h in lib.handlers if type(h) is logging.StreamHandler]
        for h in streams:
            lib.removeHandler(h)
        detached.append((lib, streams, lib.propagate))
        lib.propagate = True
    show = warnings.showwarning

    def showwarning(message, category, filename, lineno, file_=None, line=None):
        text = warnings.formatwarning(message, category, filename, lineno, line).rstrip()
        file.handle(logging.LogRecord("py.warnings", logging.WARNING, filename, lineno, text, None, None))
        if not _third_party(filename):
            show(message, category, filename, lineno, file_, line)

    warnings.showwarning = showwarning
    restore_bars = _progress_bars_off()
    try:
        yield path
    finally:
        restore_bars()
        warnings.showwarning = show
        for lib, streams, propagate in detached:
            for h in streams:
                lib.addHandler(h)
            lib.propagate = propagate
        root.removeHandler(console)
        root.removeHandler(file)
        ours.setLevel(ours_level)
        file.close()


def _progress_bars_off():
    """Turn off the progress bars of transformers, the hub and datasets; returns the undo."""
    undo = []
    from huggingface_hub.utils import are_progress_bars_disabled, disable_progress_bars, enable_progress_bars
    from transformers.utils import logging as hf_logging

    if hf_logging.is_progress_bar_enabled():
        hf_logging.disable_progress_bar()
        undo.append(hf_logging.enable_progress_bar)
    if not are_progress_bars_disabled():
        disable_progress_bars()
        undo.append(enable_progress_bars)
    if "datasets" in sys.modules:
        # datasets' public switch (datasets.utils.logging); `from datasets.utils import tqdm` is its tqdm
        # class in datasets 5, not the module with the switch
        from datasets.utils import logging as ds_logging

        if ds_logging.is_progress_bar_enabled():
            ds_logging.disable_progress_bar()
            undo.append(ds_logging.enable_progress_bar)
    elif "HF_DATASETS_DISABLE_PROGRESS_BARS" not in os.environ:
        # datasets reads this once, when first imported (importing it here would cost a second or two
        # in runs that never use it): its bars then stay off in this process
        os.environ["HF_DATASETS_DISABLE_PROGRESS_BARS"] = "1"

    def restore():
        for fn in undo:
            fn()

    return restore
