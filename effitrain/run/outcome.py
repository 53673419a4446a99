"""How a run ends, recorded rather than raised: SIGTERM raises like Ctrl-C (:func:`interrupts_raise`),
and a failure, a divergence, an OOM or an interruption becomes the summary's ``status`` and one-line
``error`` (:func:`recorded`)."""

from __future__ import annotations

import contextlib
import signal
import traceback
from pathlib import Path

import torch

from effitrain.config.errors import ConfigError
from effitrain.train.step import TrainingDiverged


class Interrupted(BaseException):
    """SIGTERM (a scheduler, ``kill``) arrived: handled like Ctrl-C, so the run records it."""

    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = signum


@contextlib.contextmanager
def interrupts_raise():
    """SIGTERM raises :class:`Interrupted` in the main thread for the duration (Ctrl-C already
    raises KeyboardInterrupt), so ``run`` writes an ``interrupted`` summary before exiting."""
    import threading

    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(signum, frame):
        raise Interrupted(signum)

    previous = signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


@contextlib.contextmanager
def recorded(summary: dict, output_dir: Path, is_main: bool):
    """How the run ended, into ``summary``: a failure, a divergence, an OOM or an interruption is
    recorded, not raised. Anything else that stops the process (SystemExit) passes through; the
    stack around still writes the failed summary and finishes the W&B run."""
    try:
        yield
    except ConfigError as error:
        summary["error"] = str(error)
        summary["error_type"] = "config"
    except TrainingDiverged as error:
        summary["status"], summary["error"] = "diverged", str(error)
    except torch.OutOfMemoryError as error:
        summary["status"], summary["error"] = "oom", one_line(error)
    except Exception as error:  # any other failure is recorded, with its traceback beside the summary
        summary["error"] = one_line(error)
        if is_main and output_dir.is_dir():
            with contextlib.suppress(OSError):  # a full disk: the summary's line says what failed
                (output_dir / "traceback.txt").write_text(traceback.format_exc())
    except (KeyboardInterrupt, Interrupted) as error:  # Ctrl-C or SIGTERM: recorded, W&B ends as crashed
        signum = error.signum if isinstance(error, Interrupted) else signal.SIGINT
        summary["status"], summary["signal"] = "interrupted", int(signum)
        summary["error"] = f"interrupted by {signal.Signals(signum).name}"


def one_line(error: BaseException) -> str:
    text = " ".join(str(error).split())
    return f"{type(error).__name__}: {text}"[:2000]
