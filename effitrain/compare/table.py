"""The comparison's table as a model: its columns (a summary key each, its unit, its digits and,
from :data:`effitrain.config.summary_schema.BETTER`, which way is better), the rows of the jobs
with ratios against their kind's baseline, each figure's noise and the cells that are best beyond
it, and the seeds table. :mod:`effitrain.compare.render` writes it as text, Markdown and CSV,
:mod:`effitrain.compare.page` as HTML."""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

from effitrain.compare.load import (
    MIB,
    SEED_KEYS,
    Estimate,
    JobResult,
    _finite,
    _is_value,
    baseline,
    beyond_noise,
    choice_headers,
    combination_label,
    job_kind,
    kinds,
    seed_groups,
    seed_stats,
)
from effitrain.config.summary_schema import (
    BETTER,
    CATEGORIES,
    HIGHER,
    LOWER,
    STEADY_SPEED,
    reported_metrics,
    step_peak_key,
)


@dataclass(frozen=True)
class Column:
    header: str
    key: str
    scale: float = 1.0
    digits: int = 4
    ratio: bool = False  # shown as a multiple of the baseline's value
    # a difference that can only be positive (the first step's time over the median): a negative
    # one is timing noise, not a figure, and is left empty
    positive: bool = False

    @property
    def better(self) -> str | None:
        """Which way is better (``lower``, ``higher``; None: no direction), by the figure's key; a
        ratio column repeats the figure before it, so it is not marked."""
        return None if self.ratio else BETTER.get(self.key)

    def text(self, summary: dict, first: dict | None = None) -> str:
        """The cell of a job's figures (:attr:`JobResult.figures`), ratios against ``first``'s."""
        value = summary.get(self.key)
        if self.key == "status":
            return str(value or "missing")
        if not _is_value(value) or (self.positive and value < 0):
            return ""
        if self.ratio:
            base = (first or {}).get(self.key)
            return f"{value / base:.3f}" if _is_value(base) and base else ""
        return f"{value / self.scale:.{self.digits}f}"


# The report's figures; MiB only here on screen and in reports, the CSV keeps the summaries' bytes.
# Ratio columns ("x AdamW"): a multiple of the baseline job's value (see baseline()).
COLUMNS = [
    Column("status", "status"),
    Column("opt state MiB", "mem/optimizer_state_bytes", MIB, 2),
    Column("x base", "mem/optimizer_state_bytes", ratio=True),
    Column("step peak MiB", "mem/step_peak_bytes", MIB, 1),
    Column("x base", "mem/step_peak_bytes", ratio=True),
    Column("predicted MiB", "mem/step_peak_bytes_predicted", MIB, 1),
    Column("train loss (mean)", "train/loss_mean"),
    Column("eval loss", "eval/loss"),
    *(Column(metric.label, metric.key, digits=metric.digits) for metric in reported_metrics()),  # the tasks'
    Column("samples/s", STEADY_SPEED, 1, 1),  # compare's one samples/s (summary_schema.STEADY_SPEED)
    Column("first-step overhead s", "speed/first_step_overhead_s", 1, 2, positive=True),
    Column("compile s", "speed/compile_s", 1, 2),
    Column("wall s", "speed/wall_s", 1, 1),
]

# the summaries' keys, exact (compare's own figures follow them: DERIVED_CSV_KEYS)
CSV_KEYS = list(dict.fromkeys(column.key for column in COLUMNS if column.key != STEADY_SPEED)) + [
    "speed/samples_per_s",  # over all steps, warm-up included: not the page's samples/s
    "error",
    "mem/params_bytes",
    "mem/grads_bytes",
    *(step_peak_key(c) for c in CATEGORIES),
    "mem/process_peak_rss_bytes",
    "mem/cuda_max_allocated_bytes",
    "mem/cuda_max_reserved_bytes",
    "train/loss",
    "train/steps",
    "train/tokens",
    "speed/tokens_per_s",
    "cfg/effective_batch_size",
    "env/pid",
]


# compare's figures in comparison.csv beside the summaries' (CSV_KEYS): samples/s as the page shows it
DERIVED_CSV_KEYS = [STEADY_SPEED, f"{STEADY_SPEED}_std"]


def _bases(jobs: list[JobResult]) -> tuple[str, list[dict]]:
    """The name the ratio columns are headed by, and per job the summary its ratios divide by: its
    kind's baseline (:func:`effitrain.compare.load.kinds`), "base" when the kinds are several."""
    names, base_of = [], {}
    for members in kinds(jobs).values():
        name, base = baseline(jobs, members)
        names.append(name)
        base_of.update({id(job): base for job in members})
    return (names[0] if len(names) == 1 else "base"), [base_of.get(id(job), {}) for job in jobs]


def _columns(jobs: list[JobResult], bases: list[dict]) -> list[Column]:
    """The columns some job has a value for (perplexity only for language models, compile s only with compile)."""
    return [c for c in COLUMNS if c.key == "status" or any(c.text(j.figures, b) for j, b in zip(jobs, bases))]


def table_rows(jobs: list[JobResult]) -> tuple[list[str], list[list[str]]]:
    """The page's table: the job's number (as in every plot), its choices, then the figures."""
    headers = choice_headers(jobs)
    name, bases = _bases(jobs)
    columns = _columns(jobs, bases)
    rows = []
    for number, (job, base) in enumerate(zip(jobs, bases), 1):
        choices = [job.choices.get(h, "") if h != "job" else job.folder.name for h in headers]
        rows.append([str(number)] + choices + [column.text(job.figures, base) for column in columns])
    titles = [f"x {name}" if column.ratio else column.header for column in columns]
    return ["#"] + headers + titles, rows


def _spread(job: JobResult, key: str, seeds: dict | None) -> float | None:
    """One standard deviation of a job's figure: the larger of its own (the eval split's sampling
    error, the steady steps' spread; bytes are exact) and its combination's spread over seeds;
    None where neither is known (one seed: F1, train loss, times)."""
    figures = job.figures
    sem, samples = figures.get("eval/loss_sem"), figures.get("eval/samples")
    own = None
    if key.startswith("mem/"):
        own = 0.0
    elif key == "eval/loss":
        own = sem if _finite(sem) else None
    elif key == "eval/perplexity" and _finite(sem) and _finite(figures.get(key)):
        own = figures[key] * sem  # exp(loss): d ppl = ppl d loss
    elif key == "eval/accuracy" and _finite(figures.get(key)) and _finite(samples) and samples > 0:
        own = math.sqrt(figures[key] * (1 - figures[key]) / samples)  # binomial sampling error
    elif key == STEADY_SPEED:
        own = figures.get(f"{key}_std")
    between = seeds.get(f"{key}/std") if seeds and seeds["seeds"] > 1 else None
    known = [value for value in (own, between) if value is not None]
    return max(known) if known else None


def table_estimates(jobs: list[JobResult]) -> dict[tuple[int, int], Estimate]:
    """(row, column) of the table's figures -> the exact value with its noise (:func:`_spread`):
    what :func:`best_cells` marks by."""
    _, bases = _bases(jobs)
    columns = _columns(jobs, bases)
    offset = 1 + len(choice_headers(jobs))
    seeds = {row["combination"]: row for row in seed_stats(seed_groups(jobs))}
    estimates = {}
    for r, job in enumerate(jobs):
        for c, column in enumerate(columns, offset):
            value = job.figures.get(column.key)
            if not column.ratio and column.key != "status" and _finite(value):
                estimates[(r, c)] = Estimate(
                    value, _spread(job, column.key, seeds.get(combination_label(job)))
                )
    return estimates


# Which way is better, by column title: each column's key's direction (Column.better).
LOWER_IS_BETTER = frozenset(column.header for column in COLUMNS if column.better == LOWER)
HIGHER_IS_BETTER = frozenset(column.header for column in COLUMNS if column.better == HIGHER)


def best_cells(
    headers: list[str],
    rows: list[list[str]],
    ok: list[bool] | None = None,
    estimates: dict[tuple[int, int], Estimate] | None = None,
    kind: list[str] | None = None,
) -> set[tuple[int, int]]:
    """(row, column) of each column's best values among the jobs that finished ok (``ok``, one per
    row; all when None): a failed or interrupted job's short wall time or partial state is no
    best. A cell is best when it is within noise of the column's top value and every other cell is
    worse than it beyond noise (:func:`effitrain.compare.load.beyond_noise`, the verdict's rule),
    the noise from ``estimates`` (:func:`table_estimates`; a cell not in it counts as exact). A
    column whose top values are within noise of all others, or whose noise is unknown, marks none.
    ``kind`` (one per row): rows are compared only with the rows of their kind (task, model, data)."""
    estimates = estimates or {}
    kind = kind or [""] * len(rows)
    best = set()
    for (col, title), group in itertools.product(enumerate(headers), dict.fromkeys(kind)):
        if title not in LOWER_IS_BETTER | HIGHER_IS_BETTER:
            continue
        lower = title in LOWER_IS_BETTER
        values = {
            r: estimates.get((r, col), Estimate(float(row[col]), 0.0))
            for r, row in enumerate(rows)
            if row[col] not in ("", "nan") and (ok is None or ok[r]) and kind[r] == group
        }
        if len({v.value for v in values.values()}) < 2:
            continue
        top = (min if lower else max)(values.values(), key=lambda v: v.value)
        tops = {r for r, v in values.items() if not beyond_noise(top, v, lower)}
        rest = set(values) - tops
        if rest and all(beyond_noise(values[t], values[o], lower) for t in tops for o in rest):
            best |= {(r, col) for r in tops}
    return best


def table_best(jobs: list[JobResult], headers: list[str], rows: list[list[str]]) -> set[tuple[int, int]]:
    """The page's bold cells (:func:`table_rows`' ``headers`` and ``rows``): among the ranked jobs,
    by their noise, each kind apart."""
    ok, kind = [job.ranked for job in jobs], [job_kind(job) for job in jobs]
    return best_cells(headers, rows, ok, table_estimates(jobs), kind)


BEST = ("better than every other job beyond noise (2 standard deviations of the eval split's sampling "
        "error, the steady steps' spread or the seeds' spread; bytes are exact); a column whose values "
        "are within noise of each other, or whose noise is unknown (one seed: F1, train loss, times), "
        "marks none.")  # fmt: skip


# The seeds table's columns: the table's own columns of the keys aggregated over seeds, in their order.
SEED_COLUMNS = [next(c for c in COLUMNS if c.key == key and not c.ratio) for key in SEED_KEYS]


def seed_rows(stats: list[dict]) -> tuple[list[str], list[list[str]]]:
    """Mean +- standard deviation per combination (see :func:`effitrain.compare.load.seed_stats`),
    only the columns some combination has."""
    columns = [c for c in SEED_COLUMNS if any(f"{c.key}/mean" in row for row in stats)]
    headers = ["combination", "seeds"] + [column.header for column in columns]
    rows = []
    for row in stats:
        cells = [row["combination"], str(row["seeds"])]
        for column in columns:
            mean, std = row.get(f"{column.key}/mean"), row.get(f"{column.key}/std")
            scale, digits = column.scale, column.digits
            cells.append("" if mean is None else f"{mean / scale:.{digits}f} +- {std / scale:.{digits}f}")
        rows.append(cells)
    return headers, rows
