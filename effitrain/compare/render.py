"""Rendering a comparison: the table (terminal, Markdown, CSV with the summaries' exact values) and
the self-contained HTML page."""

from __future__ import annotations

import base64
import csv
import html
from dataclasses import dataclass
from pathlib import Path

from effitrain.compare.load import MIB, SEED_KEYS, JobResult, _is_value, baseline, choice_headers, failures
from effitrain.memory.replay import CATEGORIES
from effitrain.train.tasks import reported_metrics


@dataclass(frozen=True)
class Column:
    header: str
    key: str
    scale: float = 1.0
    digits: int = 4
    ratio: bool = False  # shown as a multiple of the first job's value

    def text(self, summary: dict, first: dict | None = None) -> str:
        value = summary.get(self.key)
        if self.key == "status":
            return str(value or "missing")
        if not _is_value(value):
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
    Column("samples/s", "speed/samples_per_s", 1, 1),
    Column("first-step overhead s", "speed/first_step_overhead_s", 1, 2),
    Column("compile s", "speed/compile_s", 1, 2),
    Column("wall s", "speed/wall_s", 1, 1),
]

CSV_KEYS = list(dict.fromkeys(column.key for column in COLUMNS)) + [
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


def table_rows(jobs: list[JobResult]) -> tuple[list[str], list[list[str]]]:
    """The page's table: the job's number (as in every plot), its choices, then the figures."""
    headers = choice_headers(jobs)
    name, base = baseline(jobs)
    # the columns some job has a value for (perplexity only for language models, compile s only with compile)
    columns = [c for c in COLUMNS if c.key == "status" or any(c.text(job.summary, base) for job in jobs)]
    rows = []
    for number, job in enumerate(jobs, 1):
        choices = [job.choices.get(h, "") if h != "job" else job.folder.name for h in headers]
        rows.append([str(number)] + choices + [column.text(job.summary, base) for column in columns])
    titles = [f"x {name}" if column.ratio else column.header for column in columns]
    return ["#"] + headers + titles, rows


# Which way is better, by column title (ratio columns repeat the figure before them: not marked).
# The tasks' own metrics declare their direction.
LOWER_IS_BETTER = {"opt state MiB", "step peak MiB", "predicted MiB", "train loss (mean)", "eval loss",
                   "first-step overhead s", "compile s", "wall s"} | {
                   m.label for m in reported_metrics() if not m.higher_is_better}  # fmt: skip
HIGHER_IS_BETTER = {"samples/s"} | {m.label for m in reported_metrics() if m.higher_is_better}


def best_cells(
    headers: list[str], rows: list[list[str]], ok: list[bool] | None = None
) -> set[tuple[int, int]]:
    """(row, column) of each column's best value among the jobs that finished ok (``ok``, one per
    row; all when None): a failed or interrupted job's short wall time or partial state is no
    best. Only where the values differ; ties are all marked."""
    best = set()
    for col, title in enumerate(headers):
        if title not in LOWER_IS_BETTER | HIGHER_IS_BETTER:
            continue
        values = {
            r: float(row[col])
            for r, row in enumerate(rows)
            if row[col] not in ("", "nan") and (ok is None or ok[r])
        }
        if len(set(values.values())) < 2:
            continue
        top = (min if title in LOWER_IS_BETTER else max)(values.values())
        best |= {(r, col) for r, value in values.items() if value == top}
    return best


def write_csv(jobs: list[JobResult], path: Path) -> None:
    headers = choice_headers(jobs)
    with open(path, "w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(["sweep", "job"] + [h for h in headers if h not in ("sweep", "job")] + CSV_KEYS)
        for job in jobs:
            choices = [job.choices.get(h, "") for h in headers if h not in ("sweep", "job")]
            values = ["" if job.summary.get(key) is None else job.summary.get(key) for key in CSV_KEYS]
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
    marked = best_cells(headers, rows, [job.ok for job in jobs])
    shown = [
        [f"**{cell}**" if (r, c) in marked else cell for c, cell in enumerate(row)]
        for r, row in enumerate(rows)
    ]
    lines += [markdown_table(headers, shown, numeric=_numeric(headers, rows)), "",
              "Bold: the best value of its column.", ""]  # fmt: skip
    if seeds:
        lines += ["Repeated seeds (mean +- standard deviation):", "", markdown_table(*seeds), ""]
    problems = failures(jobs)
    if problems:
        lines += ["Jobs that did not finish ok:", ""] + [f"- {line}" for line in problems] + [""]
    lines += [f"![{plot.stem}]({plot.name})" for plot in plots]
    path.write_text("\n".join(lines) + "\n")


def html_table(headers: list[str], rows: list[list[str]], row_classes: list[str] | None = None,
               marked: set[tuple[int, int]] = frozenset()) -> str:  # fmt: skip
    """A table with text columns left-aligned and number columns right-aligned; ``marked`` cells
    (row, column) are the best of their column."""
    numeric = _numeric(headers, rows)
    head = "".join(
        f'<th class="{"num" if n else "text"}">{html.escape(v)}</th>' for v, n in zip(headers, numeric)
    )
    body = [f"<tr>{head}</tr>"]
    for r, (row, css) in enumerate(zip(rows, row_classes or [""] * len(rows))):
        cells = "".join(
            f'<td class="{"num" if n else "text"}{" best" if (r, c) in marked else ""}">{html.escape(v)}</td>'
            for c, (v, n) in enumerate(zip(row, numeric))
        )
        body.append(f'<tr class="{css}">{cells}</tr>')
    return f"<table>{''.join(body)}</table>"


# One line per figure: what a reader looks at and which way is better.
HOW_TO_READ = {
    "memory": "Each bar is one job's tensor memory at its step peak, split by what holds it: shorter "
    "is better. The diamond is the peak predicted before running; the grey panel is the whole "
    "process, context only.",
    "loss": "Train loss per optimizer step (left) and per training second (right), eval losses as "
    "dots; lower is better. Jobs whose losses are identical are one line, named by all their numbers "
    "(such as 1=4). On the right, the curve that drops first reaches a loss soonest.",
    "pareto": "Each number is a job, as in the table. Left: lower left is less memory for a lower "
    "eval loss; the red line joins the jobs nothing beats on both. Right: upper left is faster with "
    "less memory.",
    "lr_grad_norm": "The learning rate each step used, and the gradient norm before clipping: a norm "
    "that jumps or keeps growing warns of instability.",
    "seeds": "Mean and one standard deviation over each combination's seeds: where two bars "
    "overlap, the seeds do not tell the combinations apart.",
}

STYLE = """
body { font-family: system-ui, sans-serif; margin: 1.5em 2em; color: #222; }
table { border-collapse: collapse; font-size: 13px; margin: 0.5em 0; }
th, td { border: 1px solid #ccc; padding: 3px 8px; }
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
        ["" if job.ok else "failed" for job in jobs],
        best_cells(headers, rows, [job.ok for job in jobs]),
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
<p class="how">How to read this: one row per job, numbered as in every plot; the best value of each
column is bold on green; x columns are multiples of the baseline's value.</p>
{table}
{seeds_table}
{f"<h2>Jobs that did not finish ok</h2><ul>{errors}</ul>" if errors else ""}
{"".join(images)}
</body></html>
"""
    path.write_text(page)
