"""The comparison's self-contained HTML page: the verdict box, the tables with their best cells
marked, every figure embedded as base64 data with a line on how to read it, and the page's style."""

from __future__ import annotations

import base64
import html
from pathlib import Path

from effitrain.compare.load import JobResult, failures
from effitrain.compare.render import numeric_columns
from effitrain.compare.table import BEST, table_best


def html_table(headers: list[str], rows: list[list[str]], row_classes: list[str] | None = None,
               marked: set[tuple[int, int]] = frozenset()) -> str:  # fmt: skip
    """A table with text columns left-aligned and number columns right-aligned; ``marked`` cells
    (row, column) are the best of their column."""
    numeric = numeric_columns(headers, rows)
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
