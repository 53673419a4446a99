"""Rendering a comparison: the table (terminal, Markdown, CSV with the summaries' exact values) and
the self-contained HTML page."""

from __future__ import annotations

import base64
import csv
import html
import itertools
import math
from dataclasses import dataclass
from pathlib import Path

from effitrain.compare.load import (
    MIB,
    SEED_KEYS,
    STEADY_SPEED,
    Estimate,
    JobResult,
    _finite,
    _is_value,
    baseline,
    beyond_noise,
    choice_headers,
    combination_label,
    failures,
    job_kind,
    kinds,
    seed_groups,
    seed_stats,
)
from effitrain.memory.step_peak import CATEGORIES
from effitrain.train.tasks import reported_metrics


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
    Column("samples/s", STEADY_SPEED, 1, 1),  # compare's one samples/s (load.STEADY_SPEED)
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
    *(f"mem/step_peak/{c}_bytes" for c in CATEGORIES),
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


# Which way is better, by column title (ratio columns repeat the figure before them: not marked).
# The tasks' own metrics declare their direction.
LOWER_IS_BETTER = {"opt state MiB", "step peak MiB", "predicted MiB", "train loss (mean)", "eval loss",
                   "first-step overhead s", "compile s", "wall s"} | {
                   m.label for m in reported_metrics() if not m.higher_is_better}  # fmt: skip
HIGHER_IS_BETTER = {"samples/s"} | {m.label for m in reported_metrics() if m.higher_is_better}


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


def write_csv(jobs: list[JobResult], path: Path) -> None:
    headers = choice_headers(jobs)
    keys = CSV_KEYS + DERIVED_CSV_KEYS
    with open(path, "w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(["sweep", "job"] + [h for h in headers if h not in ("sweep", "job")] + keys)
        for job in jobs:
            choices = [job.choices.get(h, "") for h in headers if h not in ("sweep", "job")]
            values = ["" if job.figures.get(key) is None else job.figures.get(key) for key in keys]
            writer.writerow([str(job.sweep), job.folder.relative_to(job.sweep).as_posix()] + choices + values)


def text_table(headers: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(cell) for cell in column) for column in zip(headers, *rows)]
    numeric = [all(_is_number(row[i]) for row in rows) for i in range(len(headers))]

    def line(cells):
        return "  ".join(c.rjust(w) if n else c.ljust(w) for c, w, n in zip(cells, widths, numeric)).rstrip()

    return "\n".join([line(headers), line(["-" * w for w in widths])] + [line(row) for row in rows])


def _numeric(headers: list[str], rows: list[list[str]]) -> list[bool]:
    return [all(_is_number(row[i]) for row in rows) for i in range(len(headers))]


def markdown_table(headers: list[str], rows: list[list[str]], numeric: list[bool] | None = None) -> str:
    numeric = numeric or _numeric(headers, rows)
    lines = ["| " + " | ".join(headers) + " |", "|" + "|".join("---:" if n else "---" for n in numeric) + "|"]
    lines += ["| " + " | ".join(cell.replace("|", "\\|") for cell in row) + " |" for row in rows]
    return "\n".join(lines)


def _is_number(cell: str) -> bool:
    if cell == "":
        return True
    try:
        float(cell)
    except ValueError:
        return False
    return True


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


def write_seeds_csv(stats: list[dict], path: Path) -> None:
    """The seeds' exact means and standard deviations, one row per combination."""
    with open(path, "w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=list(dict.fromkeys(k for row in stats for k in row)))
        writer.writeheader()
        writer.writerows(stats)


def write_markdown(headers, rows, jobs: list[JobResult], plots: list[Path], path: Path, seeds=None,
                   verdict=None) -> None:  # fmt: skip
    """The verdict, the table (each column's best value in bold), the seeds table (``seeds``: its
    headers and rows), the jobs not ok, the figures."""
    lines = []
    if verdict is not None:
        lines += ["## Verdict", "", *[line.replace("  ", "- ", 1) if line.startswith("  ") else line
                                     for line in verdict.lines], ""]  # fmt: skip
        if verdict.rows:
            lines += [markdown_table(verdict.headers, verdict.rows), ""]
        lines += [f"- {note}" for note in verdict.notes] + ["", "## All jobs", ""]
    marked = table_best(jobs, headers, rows)
    shown = [
        [f"**{cell}**" if (r, c) in marked else cell for c, cell in enumerate(row)]
        for r, row in enumerate(rows)
    ]
    lines += [markdown_table(headers, shown, numeric=_numeric(headers, rows)), "",
              f"Bold: {BEST}", ""]  # fmt: skip
    if seeds:
        lines += ["Repeated seeds (mean +- standard deviation):", "", markdown_table(*seeds), ""]
    problems = failures(jobs)
    if problems:
        lines += (
            ["Jobs not ranked (not finished ok, or a figure not finite):", ""]
            + [f"- {line}" for line in problems]
            + [""]
        )
    lines += [f"![{plot.stem}]({plot.name})" for plot in plots]
    path.write_text("\n".join(lines) + "\n")


def html_table(headers: list[str], rows: list[list[str]], row_classes: list[str] | None = None,
               marked: set[tuple[int, int]] = frozenset()) -> str:  # fmt: skip
    """A table with text columns left-aligned and number columns right-aligned; ``marked`` cells
    (row, column) are the best of their column."""
    numeric = _numeric(headers, rows)
    head = "".join(
        f'<th class="{"num" if n else "text"}">{_breakable(v)}</th>' for v, n in zip(headers, numeric)
    )
    body = [f"<tr>{head}</tr>"]
    for r, (row, css) in enumerate(zip(rows, row_classes or [""] * len(rows))):
        cells = "".join(
            f'<td class="{"num" if n else "text"}{" best" if (r, c) in marked else ""}">{html.escape(v)}</td>'
            for c, (v, n) in enumerate(zip(row, numeric))
        )
        body.append(f'<tr class="{css}">{cells}</tr>')
    return f"<table>{''.join(body)}</table>"


BEST = ("better than every other job beyond noise (2 standard deviations of the eval split's sampling "
        "error, the steady steps' spread or the seeds' spread; bytes are exact); a column whose values "
        "are within noise of each other, or whose noise is unknown (one seed: F1, train loss, times), "
        "marks none.")  # fmt: skip
SPEED = ("the median over the job's steady optimizer steps (warm-up left out), as in the verdict and "
         "the plots; comparison.csv also holds the summary's speed/samples_per_s, over all steps. A "
         "negative first-step overhead (the first step no slower than the median) is left empty.")  # fmt: skip


def _breakable(header: str) -> str:
    """A header that may wrap after ``_`` and ``.`` (``gradient_accumulation_steps``), so that a
    12-job table's columns fit a 1,400-pixel window instead of scrolling sideways."""
    return html.escape(header).replace("_", "_<wbr>").replace(".", ".<wbr>")


# One line per figure: what a reader looks at and which way is better.
HOW_TO_READ = {
    "memory": "Each bar is one job's tensor memory at its step peak, split by what holds it: shorter "
    "is better. Optimizer state is the state's own bytes; optimizer update temporaries are the "
    "tensors the optimizer's update makes while it runs (counted in the tracker's optimizer "
    "category). The diamond is the peak predicted before running; the grey panel is the whole "
    "process, context only.",
    "loss": "Train loss per optimizer step (left) and per training second (right), eval losses as "
    "dots; lower is better. Jobs whose losses are identical are one line, named by all their numbers "
    "(such as 1=4, each such line in the title); each line has its own style and marker, so curves "
    "that nearly coincide stay visible. On the right, the curve that drops first reaches a loss "
    "soonest.",
    "pareto": "Each number is a job, as in the table. Left: lower left is less memory for a lower "
    "eval loss. Right: upper left is faster (samples/s as in the table) with less memory. Ringed in "
    "red: the jobs of the verdict's front (memory, quality and speed, beyond noise), the same list "
    "the verdict writes. Jobs of several kinds (task, model, data) each have their own marker: compare "
    "points of one marker only.",
    "lr_grad_norm": "The learning rate each step used, and the gradient norm before clipping: a norm "
    "that jumps or keeps growing warns of instability.",
    "seeds": "Mean and one standard deviation over each combination's seeds: where two bars "
    "overlap, the seeds do not tell the combinations apart.",
}

STYLE = """
body { font-family: system-ui, sans-serif; margin: 1.5em 2em; color: #222; }
table { border-collapse: collapse; font-size: 12px; margin: 0.5em 0; }
th, td { border: 1px solid #ccc; padding: 2px 6px; }
td.text { max-width: 24em; overflow-wrap: break-word; }
th { background: #f3f3f3; }
.num { text-align: right; } .text { text-align: left; }
td.best { font-weight: bold; background: #e3f4e1; }
tr.failed td { background: #fde8e8; }
tr.front td:first-child { border-left: 4px solid #2e7d32; }
.verdict { border: 2px solid #2e7d32; border-radius: 6px; padding: 0.6em 1.2em; background: #f7fbf6; }
.verdict .decision { font-size: 17px; font-weight: 600; margin: 0.4em 0; }
.verdict .line { margin: 0.15em 0 0.15em 1.2em; } .verdict .plain { margin: 0.4em 0; }
.note { color: #555; font-size: 13px; margin: 0.2em 0; }
.how { color: #444; font-size: 13px; font-style: italic; max-width: 70em; }
figure { margin: 1em 0 2em 0; } img { max-width: 100%; }
"""


def verdict_html(verdict) -> str:
    """The verdict box: the decision, the ratios table (front rows marked), the notes."""
    parts = []
    for index, line in enumerate(verdict.lines):
        first = index == 0 or (index == 1 and verdict.lines[0].startswith("No job learned"))
        css = "line" if line.startswith("  ") else "decision" if first else "plain"
        parts.append(f'<p class="{css}">{html.escape(line.strip())}</p>')
    if verdict.rows:
        front = {c.name for c in verdict.front}
        classes = ["front" if c.name in front else "" for c in verdict.combos]
        parts.append(html_table(verdict.headers, verdict.rows, classes))
    parts += [f'<p class="note">{html.escape(note)}</p>' for note in verdict.notes]
    return f'<section class="verdict"><h2>Verdict</h2>{"".join(parts)}</section>'


def write_html(headers, rows, jobs: list[JobResult], plots: list[Path], path: Path, sources: list[Path],
               seeds=None, verdict=None) -> None:  # fmt: skip
    """One page that needs nothing else: the verdict first, the tables (each column's best value
    marked), the jobs not ok and every figure as base64 data with a line on how to read it."""
    table = html_table(
        headers,
        rows,
        ["" if job.ranked else "failed" for job in jobs],
        table_best(jobs, headers, rows),
    )
    seeds_table = ""
    if seeds:
        seeds_table = "<h2>Repeated seeds (mean &plusmn; standard deviation)</h2>" + html_table(*seeds)
    images = []
    for plot in plots:
        data = base64.b64encode(plot.read_bytes()).decode("ascii")
        how = HOW_TO_READ.get(plot.stem, "")
        images.append(
            f'<figure><h3>{html.escape(plot.stem)}</h3><p class="how">How to read this: {html.escape(how)}</p>'
            f'<img alt="{plot.stem}" src="data:image/png;base64,{data}"></figure>'
        )
    errors = "".join(f"<li>{html.escape(line)}</li>" for line in failures(jobs))
    page = f"""<!doctype html>
<html><head><meta charset="utf-8"><title>effitrain comparison</title>
<style>{STYLE}</style></head><body>
<h1>effitrain comparison</h1>
<p class="note">{html.escape(", ".join(str(s) for s in sources))}: {len(jobs)} jobs, {sum(not j.ok for j in jobs)} not ok.</p>
{verdict_html(verdict) if verdict is not None else ""}
<h2>All jobs</h2>
<p class="how">How to read this: one row per job, numbered as in every plot. Bold on green: {html.escape(BEST)}
x columns are multiples of the baseline's value. samples/s: {html.escape(SPEED)}</p>
{table}
{seeds_table}
{f"<h2>Jobs not ranked (not finished ok, or a figure not finite)</h2><ul>{errors}</ul>" if errors else ""}
{"".join(images)}
</body></html>
"""
    path.write_text(page)
