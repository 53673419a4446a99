"""The summary schema: what ``summary.json`` holds that the run writes and ``effitrain compare``
reads, in one place that imports nothing (no torch, no effitrain module).

The torch side imports it (the step meter's warm-up, the memory replay's categories, the tasks'
metrics) and so does compare (its tables, verdict and plots): compare draws a table without
importing torch, and a category, a task's metric or a column's direction is changed here once.

* :data:`CATEGORIES`: what holds each byte of a step peak (``mem/step_peak/<category>_bytes``);
* :data:`WARMUP_STEPS`: the optimizer steps left out of the steady step time;
* :data:`TASK_METRICS`: the metrics each task writes beside ``eval/loss`` (``Task.metrics``);
* :data:`BETTER`: which way is better for each figure a comparison ranks or marks (``lower`` or
  ``higher``), the table's bold cells and the verdict's axes alike;
* :func:`beyond_noise`: when one figure beats another (the verdict's one rule), and
  :func:`learned_nothing`: a run's eval loss not below its input-blind loss beyond noise.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

# The step peak's categories, in the order every table and plot shows them: the tracker's
# attribution of each live tensor of one tracked optimizer step.
CATEGORIES = ("weights", "gradients", "optimizer_state", "activations", "temporaries")

# Optimizer steps left out of the steady-state step time (compilation, allocator warm-up): the
# step meter's median (speed/step_s_median) and compare's samples/s leave out the same ones.
WARMUP_STEPS = 2

# compare's one samples/s, in comparison.csv beside the summaries' keys: the median over the steady
# optimizer steps of metrics.jsonl (the summary's speed/samples_per_s holds the warm-up steps and
# the slow memory-tracked one).
STEADY_SPEED = "speed/steady_samples_per_s"

LOWER, HIGHER = "lower", "higher"


def step_peak_key(category: str) -> str:
    """The summary key of one category's bytes at the step peak (``mem/step_peak/weights_bytes``)."""
    return f"mem/step_peak/{category}_bytes"


@dataclass(frozen=True)
class Metric:
    """A summary key a task writes, and how reports show it."""

    key: str  # the summary key, eval/accuracy
    label: str | None  # its column in compare's tables (None: printed at the end of a run only)
    digits: int = 4  # decimals in compare's tables
    higher_is_better: bool = True

    @property
    def better(self) -> str:
        return HIGHER if self.higher_is_better else LOWER


# What each task (by its ``name``) writes beside eval/loss, in the order of the task classes.
TASK_METRICS: dict[str, tuple[Metric, ...]] = {
    "classification": (Metric("eval/accuracy", "accuracy"), Metric("eval/f1", "F1")),
    "causal_lm": (
        Metric("eval/perplexity", "perplexity", digits=2, higher_is_better=False),
        Metric("train/unigram_perplexity", None),  # the baseline eval/perplexity must beat
    ),
}


def reported_metrics() -> list[Metric]:
    """The metrics with a column in compare's tables: every task's labelled ones, in
    :data:`TASK_METRICS`' order (classification's, then the causal LM's), each key once."""
    found: dict[str, Metric] = {}
    for metrics in TASK_METRICS.values():
        for metric in metrics:
            if metric.label is not None:
                found.setdefault(metric.key, metric)
    return list(found.values())


# Which way is better, per figure: memory, losses and times lower, throughput higher, the tasks'
# metrics as they declare. A key not here has no direction (status, counts, a ratio column).
BETTER: dict[str, str] = {
    "mem/optimizer_state_bytes": LOWER,
    "mem/step_peak_bytes": LOWER,
    "mem/step_peak_bytes_predicted": LOWER,
    "train/loss_mean": LOWER,
    "eval/loss": LOWER,
    **{metric.key: metric.better for metric in reported_metrics()},
    STEADY_SPEED: HIGHER,
    "speed/first_step_overhead_s": LOWER,
    "speed/compile_s": LOWER,
    "speed/wall_s": LOWER,
}


NOISE_SIGMAS = 2.0  # a difference smaller than this many standard deviations is noise
# Closer than this (relative) is the same, whatever the spread: a step peak 4 bytes apart under
# the other backend, float noise in the seventh digit of a loss.
SAME = 1e-3


@dataclass
class Estimate:
    """A value with one standard deviation (``None``: unknown)."""

    value: float
    std: float | None

    @property
    def relative(self) -> float | None:
        return None if self.std is None or not self.value else abs(self.std / self.value)


def beyond_noise(better: Estimate, worse: Estimate, lower_is_better: bool) -> bool:
    """``better`` beats ``worse`` by more than :data:`NOISE_SIGMAS` of their combined standard
    deviation and more than :data:`SAME` (an unknown spread never decides). The one rule of the
    verdict's front and the table's best cells."""
    if better.std is None or worse.std is None:
        return False
    gap = (worse.value - better.value) if lower_is_better else (better.value - worse.value)
    return gap > max(
        NOISE_SIGMAS * math.hypot(better.std, worse.std), SAME * max(abs(better.value), abs(worse.value))
    )


def learned_nothing(summary: dict) -> tuple[float, float] | None:
    """``(eval/loss, eval/input_blind_loss)`` when a finished run's eval loss is not below what its task
    scores without reading the input, beyond noise (its ``eval/loss_sem``; plainly below where that is
    unknown); None when it learned, or where either figure is missing. The run's last line says it,
    as compare's verdict does for a sweep."""
    loss, blind, sem = (summary.get(k) for k in ("eval/loss", "eval/input_blind_loss", "eval/loss_sem"))
    if not all(isinstance(v, (int, float)) and math.isfinite(v) for v in (loss, blind)):
        return None
    spread = sem if isinstance(sem, (int, float)) and math.isfinite(sem) else 0.0
    return None if beyond_noise(Estimate(loss, spread), Estimate(blind, 0.0), True) else (loss, blind)
