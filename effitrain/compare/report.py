"""Rendering a comparison: the table (terminal, Markdown, CSV with the summaries' exact values) and
the self-contained HTML page."""

from __future__ import annotations

import base64
import csv
import html
from dataclasses import dataclass
from pathlib import Path

from effitrain.compare.load import MIB, JobResult, _is_value, baseline, choice_headers, failures
from effitrain.step_memory import CATEGORIES


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
    Column("accuracy", "eval/accuracy"),
    Column("F1", "eval/f1"),
    Column("perplexity", "eval/perplexity", 1, 2),
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
    headers = choice_headers(jobs)
    name, base = baseline(jobs)
    # the columns some job has a value for (perplexity only for language models, compile s only with compile)
    columns = [c for c in COLUMNS if c.key == "status" or any(c.text(job.summary, base) for job in jobs)]
    rows = []
    for job in jobs:
        choices = [job.choices.get(h, "") if h != "job" else job.folder.name for h in headers]
        rows.append(choices + [column.text(job.summary, base) for column in columns])
    titles = [f"x {name}" if column.ratio else column.header for column in columns]
    return headers + titles, rows


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


def markdown_table(headers: list[str], rows: list[list[str]]) -> str:
    numeric = [all(_is_number(row[i]) for row in rows) for i in range(len(headers))]
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


# The seeds table's columns: title, summary key, scale, digits.
SEED_COLUMNS = [
    ("eval loss", "eval/loss", 1, 4),
    ("accuracy", "eval/accuracy", 1, 4),
    ("F1", "eval/f1", 1, 4),
    ("perplexity", "eval/perplexity", 1, 2),
    ("train loss (mean)", "train/loss_mean", 1, 4),
    ("step peak MiB", "mem/step_peak_bytes", MIB, 1),
    ("samples/s", "speed/samples_per_s", 1, 1),
]


def seed_rows(stats: list[dict]) -> tuple[list[str], list[list[str]]]:
    """Mean +- standard deviation per combination (see :func:`effitrain.compare.load.seed_stats`),
    only the columns some combination has."""
    columns = [c for c in SEED_COLUMNS if any(f"{c[1]}/mean" in row for row in stats)]
    headers = ["combination", "seeds"] + [title for title, *_ in columns]
    rows = []
    for row in stats:
        cells = [row["combination"], str(row["seeds"])]
        for _title, key, scale, digits in columns:
            mean, std = row.get(f"{key}/mean"), row.get(f"{key}/std")
            cells.append("" if mean is None else f"{mean / scale:.{digits}f} +- {std / scale:.{digits}f}")
        rows.append(cells)
    return headers, rows


def write_seeds_csv(stats: list[dict], path: Path) -> None:
    """The seeds' exact means and standard deviations, one row per combination."""
    with open(path, "w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=list(dict.fromkeys(k for row in stats for k in row)))
        writer.writeheader()
        writer.writerows(stats)


def write_markdown(headers, rows, jobs: list[JobResult], plots: list[Path], path: Path, seeds=None) -> None:
    """The table, the seeds table (``seeds``: its headers and rows), the jobs not ok, the figures."""
    lines = [markdown_table(headers, rows), ""]
    if seeds:
        lines += ["Repeated seeds (mean +- standard deviation):", "", markdown_table(*seeds), ""]
    problems = failures(jobs)
    if problems:
        lines += ["Jobs that did not finish ok:", ""] + [f"- {line}" for line in problems] + [""]
    lines += [f"![{plot.stem}]({plot.name})" for plot in plots]
    path.write_text("\n".join(lines) + "\n")


def html_table(headers: list[str], rows: list[list[str]], row_classes: list[str] | None = None) -> str:
    """A table with text columns left-aligned and number columns right-aligned."""
    numeric = [all(_is_number(row[i]) for row in rows) for i in range(len(headers))]

    def cells(tag, values):
        return "".join(
            f'<{tag} class="{"num" if n else "text"}">{html.escape(v)}</{tag}>'
            for v, n in zip(values, numeric)
        )

    body = [f"<tr>{cells('th', headers)}</tr>"]
    for row, css in zip(rows, row_classes or [""] * len(rows)):
        body.append(f'<tr class="{css}">{cells("td", row)}</tr>')
    return f"<table>{''.join(body)}</table>"


def write_html(headers, rows, jobs: list[JobResult], plots: list[Path], path: Path, sources: list[Path],
               seeds=None) -> None:  # fmt: skip
    """One page that needs nothing else: the tables, the jobs not ok and every figure as base64 data."""
    table = html_table(headers, rows, ["" if job.ok else "failed" for job in jobs])
    seeds_table = ""
    if seeds:
        seeds_table = "<h2>Repeated seeds (mean &plusmn; standard deviation)</h2>" + html_table(*seeds)
    images = []
    for plot in plots:
        data = base64.b64encode(plot.read_bytes()).decode("ascii")
        images.append(f'<figure><img alt="{plot.stem}" src="data:image/png;base64,{data}"></figure>')
    errors = "".join(f"<li>{html.escape(line)}</li>" for line in failures(jobs))
    page = f"""<!doctype html>
<html><head><meta charset="utf-8"><title>effitrain comparison</title>
<style>
body {{ font-family: system-ui, sans-serif; margin: 2em; }}
table {{ border-collapse: collapse; font-size: 13px; }}
th, td {{ border: 1px solid #ccc; padding: 3px 8px; }}
.num {{ text-align: right; }} .text {{ text-align: left; }}
tr.failed td {{ background: #fde8e8; }}
img {{ max-width: 100%; }}
</style></head><body>
<h1>effitrain comparison</h1>
<p>{html.escape(", ".join(str(s) for s in sources))}: {len(jobs)} jobs, {sum(not j.ok for j in jobs)} not ok.</p>
{table}
{seeds_table}
{f"<h2>Jobs that did not finish ok</h2><ul>{errors}</ul>" if errors else ""}
{"".join(images)}
</body></html>
"""
    path.write_text(page)
