"""The comparison's table written out: as text (the terminal), Markdown and CSV (the summaries'
exact values); the model it writes is :mod:`effitrain.compare.table`'s."""

from __future__ import annotations

import csv
from pathlib import Path

from effitrain.compare.load import JobResult, choice_headers, failures
from effitrain.compare.table import BEST, CSV_KEYS, DERIVED_CSV_KEYS, table_best


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
    numeric = numeric_columns(headers, rows)

    def line(cells):
        return "  ".join(c.rjust(w) if n else c.ljust(w) for c, w, n in zip(cells, widths, numeric)).rstrip()

    return "\n".join([line(headers), line(["-" * w for w in widths])] + [line(row) for row in rows])


def numeric_columns(headers: list[str], rows: list[list[str]]) -> list[bool]:
    """Per column, whether every cell is a number (or empty): those are right-aligned."""
    return [all(_is_number(row[i]) for row in rows) for i in range(len(headers))]


def markdown_table(headers: list[str], rows: list[list[str]], numeric: list[bool] | None = None) -> str:
    numeric = numeric or numeric_columns(headers, rows)
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
    lines += [markdown_table(headers, shown, numeric=numeric_columns(headers, rows)), "",
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
