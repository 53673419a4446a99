"""``summary.json`` as a run builds it (:class:`Summary`): how the run ended, typed, and its figures
(flat keys, bytes and seconds in their names), written once at the end whatever happened."""

from __future__ import annotations

import contextlib
import logging
import math
import signal
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path

import torch

from effitrain.config.errors import ConfigError
from effitrain.run import results
from effitrain.train.step import TrainingDiverged
from effitrain.util.interrupts import Interrupted, one_line

log = logging.getLogger(__name__)

STATUSES = ("ok", "failed", "oom", "diverged", "interrupted", "killed", "timeout")


@dataclass
class Summary:
    """How a run ended and what it measured. ``status`` stays ``failed`` until the run says ``ok``
    (:meth:`finished`); :meth:`recording` turns whatever ends the run early into a status and a
    one-line ``error``."""

    folder: Path
    is_main: bool = True  # only rank 0 writes the folder's files
    status: str = "failed"
    error: str | None = None
    error_type: str | None = None  # "config": a bad config (the exit code says 2)
    signal: int | None = None  # the signal that interrupted the run
    figures: dict = field(default_factory=dict)  # every other key of summary.json
    started: float = field(default_factory=time.perf_counter)

    def update(self, figures: dict) -> None:
        self.figures.update(figures)

    def as_dict(self) -> dict:
        outcome = {"status": self.status, "error": self.error}
        outcome.update({"error_type": self.error_type} if self.error_type else {})
        outcome.update({"signal": self.signal} if self.signal is not None else {})
        return {**outcome, **self.figures}

    def finished(self) -> None:
        """The run trained and evaluated: ok, unless a figure it is judged by is not a number (a
        NaN evaluation loss or memory figure is never an ok result)."""
        bad = [key for key in NEVER_NAN if key in self.figures and not _number(key, self.figures[key])]
        if bad:
            self.error = f"{bad[0]} is {self.figures[bad[0]]}: the run's result is not a number"
            self.status = "diverged" if bad[0].startswith("eval/") else "failed"
            return
        self.status = "ok"

    @contextlib.contextmanager
    def recording(self):
        """How the run ends, recorded rather than raised: a bad config, a divergence, an OOM, a failure
        (its traceback beside the summary) or an interruption. Anything else that stops the process
        (SystemExit) passes through; the run still writes its summary on the way out."""
        try:
            yield
        except ConfigError as error:
            self.error, self.error_type = str(error), "config"
        except TrainingDiverged as error:
            self.status, self.error = "diverged", str(error)
        except torch.OutOfMemoryError as error:
            self.status, self.error = "oom", one_line(error)
        except Exception as error:
            self.error = one_line(error)
            if self.is_main and self.folder.is_dir():
                written = self.folder / "traceback.txt"
                try:
                    written.write_text(traceback.format_exc())
                except OSError:  # a full disk: the summary's line says what failed; no empty file
                    written.unlink(missing_ok=True)
        except (KeyboardInterrupt, Interrupted) as error:  # Ctrl-C or SIGTERM: W&B ends it as crashed
            signum = error.signum if isinstance(error, Interrupted) else signal.SIGINT
            self.status, self.signal = "interrupted", int(signum)
            self.error = f"interrupted by {signal.Signals(signum).name}"

    def write(self, previous: dict | None) -> None:
        """``summary.json``, atomically, by rank 0; an earlier ok summary is never replaced by a run
        that did not end ok. A full disk makes an ok run failed, and says so in its error."""
        self.figures["speed/wall_s"] = time.perf_counter() - self.started
        if not self.is_main or not self.folder.is_dir():
            return
        if previous and previous.get("status") == "ok" and self.status != "ok":
            log.error("not overwriting the ok summary.json in %s with a failed run", self.folder)
            return
        try:
            results.write_json_atomic(self.folder / results.SUMMARY, self.as_dict())
        except OSError as error:
            unwritten = f"summary.json could not be written in {self.folder} ({error.strerror})"
            self.error = f"{self.error}; {unwritten}" if self.error else unwritten
            if self.status == "ok":  # its results are not on disk: not ok
                self.status = "failed"


# the figures a run is judged and compared by: a non-finite one is never an ok result
NEVER_NAN = ("eval/loss", "mem/step_peak_bytes", "mem/params_bytes")


def _number(key: str, value) -> bool:
    if value is None:
        return key != "eval/loss"  # a memory figure may be absent (no step was tracked); the loss not
    return not isinstance(value, float) or math.isfinite(value)
