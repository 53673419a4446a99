"""One run in a process of its own: what a benchmark case or a ``plan --probe-steps`` probe needs, so
that the allocator's peaks (``max_memory_allocated``/``reserved``), the compile caches and whatever
an earlier case left allocated never carry from one case into the next."""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from pathlib import Path


def run_isolated(overrides: list[str], timeout: float | None = None) -> dict:
    """``effitrain train OVERRIDES logger=none progress_bar=false`` in a fresh Python process;
    its ``summary.json``. A process that ends without one (killed, crashed before the summary)
    gives ``{"status": "failed", "error": ...}``, one that runs past ``timeout`` seconds
    ``{"status": "timeout", "error": ...}``: the caller records it and goes on."""
    with tempfile.TemporaryDirectory() as folder:
        command = [sys.executable, "-m", "effitrain.cli", "train", *overrides, "logger=none",
                   "progress_bar=false", f"hydra.run.dir={folder}"]  # fmt: skip
        try:
            done = subprocess.run(command, capture_output=True, text=True, timeout=timeout, check=False)
        except subprocess.TimeoutExpired:
            return {"status": "timeout", "error": f"no summary within {timeout} s"}
        summary_file = Path(folder) / "summary.json"
        if not summary_file.exists():
            last = (done.stderr.strip().splitlines() or ["no output"])[-1]
            return {"status": "failed", "error": f"exit {done.returncode} without a summary: {last}"}
        return json.loads(summary_file.read_text())
