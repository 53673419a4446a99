"""The summary schema: what ``summary.json`` holds that the run writes and ``effitrain compare``
reads, in one place that imports nothing (no torch, no effitrain module).

The torch side imports it (the step meter's warm-up, the memory replay's categories, the tasks'
metrics) and so does compare (its tables, verdict and plots): compare draws a table without
importing torch, and a category, a task's metric or a column's direction is changed here once.

* :data:`CATEGORIES`: what holds each byte of a step peak (``mem/step_peak/<category>_bytes``);
* :data:`WARMUP_STEPS`: the optimizer steps left out of the steady step time;
* :data:`TASK_METRICS`: the metrics each task writes beside ``eval/loss`` (``Task.metrics``);
* :data:`BETTER`: which way is better for each figure a comparison ranks or marks (``lower`` or
  ``higher``), the table's bold cells and the verdict's axes alike.
"""

from __future__ import annotations

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
