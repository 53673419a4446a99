"""Compare the jobs of one or more sweeps: a table (CSV, Markdown, terminal), plots, one HTML page.

    effitrain compare multirun/optimizers/2026-01-01_12-00-00
    effitrain compare multirun/optimizers/<a> multirun/compile/<b> --output report/

Reads each job's ``summary.json`` and ``metrics.jsonl`` (and Hydra's ``.hydra/overrides.yaml`` to
name the choices that were swapped) and writes, beside them: ``comparison.csv`` (exact values, bytes
as in the summaries), ``comparison.md``, ``memory.png``, ``loss.png``, ``pareto.png`` and a
self-contained ``comparison.html``.
"""

from __future__ import annotations

import base64
import csv
import html
import json
import math
from dataclasses import dataclass, field
from pathlib import Path

from effitrain import results
from effitrain.config import ConfigError
from effitrain.step_memory import CATEGORIES
from effitrain.sweep import job_folders

MIB = 2**20

# The summary's keys that name what a job was (``cfg/<group>`` and the run-shaping scalars): a
# column when their values differ between jobs and no override column says it already.
CHOICE_PREFIX = "cfg/"


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


def _is_value(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


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
    "cfg/effective_batch_size",
    "env/pid",
]


@dataclass
class JobResult:
    sweep: Path
    folder: Path
    summary: dict
    overrides: dict[str, str]
    metrics: list[dict] = field(default_factory=list)
    choices: dict[str, str] = field(default_factory=dict)  # filled by label_jobs()

    @property
    def label(self) -> str:
        return " ".join(f"{key}={value}" for key, value in self.choices.items() if value) or self.folder.name

    @property
    def ok(self) -> bool:
        return self.summary.get("status") == "ok"


def _overrides(summary: dict) -> dict[str, str]:
    """The job's result-changing overrides, as its summary recorded them (``job/overrides``)."""
    from effitrain.overrides import parse, values

    try:
        parsed = parse(summary.get("job/overrides") or [])
    except ConfigError:
        return {}
    return {o.key_or_group: (values(o) or [""])[0] for o in parsed}


def load_jobs(sweeps: list[Path]) -> list[JobResult]:
    """Every job folder under the sweep folders, in folder order, with the choices that differ.

    A folder Hydra started but that holds no summary.json (its process died) is kept, status missing.

    Raises:
        ConfigError: a folder does not exist or holds no job.
    """
    jobs = []
    for sweep in sweeps:
        if not sweep.is_dir():
            raise ConfigError(f"compare: {str(sweep)!r} is not a folder: give a sweep folder (multirun/...)")
        found = job_folders(sweep)
        if not found:
            raise ConfigError(
                f"compare: no summary.json under {str(sweep)!r}: give a sweep folder (multirun/...)"
            )
        for folder in found:
            summary = results.read_summary(folder)
            if summary is None:
                exists = (folder / results.SUMMARY).exists()
                reason = "summary.json cannot be read (damaged)" if exists else "no summary.json"
                summary = {"status": "missing", "error": reason}
            jobs.append(
                JobResult(
                    sweep,
                    folder,
                    summary,
                    _overrides(summary),
                    results.read_metrics(folder / results.METRICS),
                )
            )
    label_jobs(jobs, several_sweeps=len(sweeps) > 1)
    return jobs


def label_jobs(jobs: list[JobResult], several_sweeps: bool) -> None:
    """Set each job's ``choices``: the overrides and config keys whose value differs between jobs."""

    def differs(values: list) -> bool:
        return len({json.dumps(v, sort_keys=True, default=str) for v in values}) > 1

    finished = [job for job in jobs if job.summary.get("status") != "missing"]
    names: list[str] = []
    for job in finished:
        names += [key for key in job.overrides if key not in names]
    columns = [name for name in names if differs([job.overrides.get(name) for job in finished])]
    cfg_keys = list(dict.fromkeys(k for job in finished for k in job.summary if k.startswith(CHOICE_PREFIX)))
    derived = {}
    for key in cfg_keys:
        short = key.removeprefix(CHOICE_PREFIX)
        # an override column says it already (optimizer.lr for cfg/lr)
        said = any(column == short or column.endswith(f".{short}") for column in columns)
        if not said and differs([job.summary.get(key) for job in finished]):
            derived[short] = key
    for job in jobs:
        job.choices = {}
        if several_sweeps:
            job.choices["sweep"] = job.sweep.name
        for name in columns:
            job.choices[name] = job.overrides.get(name, "")
        for short, key in derived.items():
            value = job.summary.get(key)
            job.choices[short] = "" if value is None else str(value)


def choice_headers(jobs: list[JobResult]) -> list[str]:
    headers: list[str] = []
    for job in jobs:
        headers += [key for key in job.choices if key not in headers]
    return headers or ["job"]


def baseline(jobs: list[JobResult]) -> tuple[str, dict]:
    """The job ratios are taken against: the first finished AdamW job (the usual reference), else
    the first finished job. Returns its name for the header and its summary."""
    finished = [job for job in jobs if job.ok] or jobs
    adamw = [job for job in finished if job.summary.get("cfg/optimizer") == "adamw"]
    if adamw:
        return "AdamW", adamw[0].summary
    return f"job {jobs.index(finished[0]) + 1}", finished[0].summary


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


def failures(jobs: list[JobResult]) -> list[str]:
    return [
        f"{job.label}: {job.summary.get('status')}: {job.summary.get('error')}" for job in jobs if not job.ok
    ]


# ---------------------------------------------------------------- plots


def _figure(height: float, columns: int = 1):
    import matplotlib

    matplotlib.use("Agg")  # files only: no display on servers and in CI
    import matplotlib.pyplot as plt

    return plt, *plt.subplots(1, columns, figsize=(11 if columns > 1 else 9, height), dpi=110)


def _save(plt, fig, path: Path, tight: bool = True) -> None:
    if tight:
        fig.tight_layout()
    fig.savefig(path, bbox_inches="tight")  # legends placed outside the axes stay in the picture
    plt.close(fig)


COLORS = {
    "weights": "#4c72b0",
    "gradients": "#55a868",
    "optimizer_state": "#c44e52",
    "activations": "#dd8452",
    "temporaries": "#937860",
}


def _plain_axes(ax) -> None:
    """Plain numbers on both axes: no offset notation (``1e-5+1.097``) a reader has to decode."""
    for axis in (ax.xaxis, ax.yaxis):
        formatter = axis.get_major_formatter()
        if hasattr(formatter, "set_useOffset"):
            formatter.set_useOffset(False)
            formatter.set_scientific(False)


def plot_memory(jobs: list[JobResult], path: Path) -> None:
    """Per job, the step peak stacked by category (what the comparison ranks by), the predicted
    peak marked beside it; the process-level figure (RSS or CUDA reserved) in a panel of its own."""
    plt, fig, _ = _figure(max(3.6, 1.8 + 0.5 * len(jobs)))
    fig.clf()
    grid = fig.add_gridspec(1, 4)
    ax, side = fig.add_subplot(grid[0, :3]), fig.add_subplot(grid[0, 3])
    ys = list(range(len(jobs)))
    left = [0.0] * len(jobs)
    for category in CATEGORIES:
        widths = [(job.summary.get(f"mem/step_peak/{category}_bytes") or 0) / MIB for job in jobs]
        if any(widths):
            label = category.replace("_", " ")
            ax.barh(ys, widths, height=0.6, left=left, color=COLORS[category], label=label)
            left = [a + b for a, b in zip(left, widths)]
    predicted = [(y, job.summary.get("mem/step_peak_bytes_predicted")) for y, job in zip(ys, jobs)]
    predicted = [(y, p / MIB) for y, p in predicted if _is_value(p)]
    if predicted:
        ax.scatter([p for _, p in predicted], [y for y, _ in predicted], marker="D", s=40, color="black",
                   zorder=3, label="predicted peak")  # fmt: skip
    for y, total in zip(ys, left):
        if total:
            ax.annotate(
                f"{total:.1f}", (total, y), textcoords="offset points", xytext=(8, 0), va="center", fontsize=8
            )
    if not any(left):
        ax.text(0.5, 0.5, "no step peak in these summaries", ha="center", va="center", transform=ax.transAxes)
    ax.set_yticks(ys, [f"{i + 1}. {_short(job)}" for i, job in enumerate(jobs)], fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel("MiB at the step peak (tensor memory of one optimizer step)")
    ax.set_title("Step peak by category")
    ax.set_xlim(0, max(left + [0.0]) * 1.15 or 1.0)  # room for the value labels and markers
    _plain_axes(ax)
    if ax.get_legend_handles_labels()[0]:  # below the bars, never over them
        ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.16), ncol=6, frameon=False)
    key, title = ("mem/cuda_max_reserved_bytes", "CUDA reserved")
    if not any(_is_value(job.summary.get(key)) for job in jobs):
        key, title = ("mem/process_peak_rss_bytes", "process RSS")
    values = [(job.summary.get(key) or 0) / MIB for job in jobs]
    side.barh(ys, values, height=0.6, color="#bbbbbb")
    side.set_yticks(ys, [str(i + 1) for i in ys], fontsize=8)
    side.invert_yaxis()
    side.set_title(f"{title}\n(context only)", fontsize=8)
    side.set_xlabel("MiB", fontsize=8)
    side.tick_params(labelsize=7)
    _plain_axes(side)
    _save(plt, fig, path)


def _curves(job: JobResult):
    lines = [m for m in job.metrics if "train/loss" in m and "step" in m]
    steps = [m["step"] for m in lines]
    seconds, total = [], 0.0
    for m in lines:
        total += m.get("speed/step_s") or 0.0
        seconds.append(total)
    return steps, seconds, [m["train/loss"] for m in lines]


def plot_losses(jobs: list[JobResult], path: Path) -> None:
    """Train loss against optimizer steps and against training seconds; eval points (eval_every
    lines, else the final eval loss). Curves identical to an earlier job's are drawn dashed and
    thicker underneath, so each stays visible, and the legend names the job they coincide with."""
    plt, fig, axes = _figure(4.8, columns=2)
    seen: dict[tuple, int] = {}
    styles = ["-", "--", ":", "-."]
    for index, job in enumerate(jobs):
        steps, seconds, losses = _curves(job)
        if not steps:
            continue
        key = tuple(round(v, 10) for v in losses)
        same = seen.setdefault(key, index)
        repeat = sum(1 for k, v in seen.items() if v == same and k == key) and index != same
        label = f"{index + 1}. {_short(job)}" + (f" (= {same + 1})" if repeat else "")
        style = styles[(index - same) % len(styles)] if repeat else "-"
        width = 3.0 if not repeat else 1.4
        for ax, xs in zip(axes, (steps, seconds)):
            (line,) = ax.plot(xs, losses, style, linewidth=width, label=label, alpha=0.9)
            evals = [
                (m["step"], m["eval/loss"]) for m in job.metrics if "eval/loss" in m and "train/loss" not in m
            ]
            if not evals and _is_value(job.summary.get("eval/loss")):
                evals = [(steps[-1], job.summary["eval/loss"])]
            to_x = dict(zip(steps, xs))
            points = [(to_x.get(s, xs[-1]), v) for s, v in evals]
            if points:
                ax.plot(*zip(*points), "o", color=line.get_color(), markersize=5)
    for ax, xlabel in zip(axes, ("optimizer step", "training seconds")):
        ax.set_xlabel(xlabel)
        ax.set_ylabel("train loss (dots: eval loss)")
        _plain_axes(ax)
    axes[0].set_title("Loss against steps")
    axes[1].set_title("Loss against time")
    if axes[0].lines:
        # below the panels: inside, it would cover the curves it names
        axes[0].legend(fontsize=7, loc="upper left", bbox_to_anchor=(0.0, -0.14), ncol=2, frameon=False)
    else:
        axes[0].text(
            0.5, 0.5, "no metrics.jsonl lines", ha="center", va="center", transform=axes[0].transAxes
        )
    _save(plt, fig, path)


def plot_lr_and_grad_norm(jobs: list[JobResult], path: Path) -> None:
    """Learning rate and gradient norm per optimizer step."""
    plt, fig, axes = _figure(4.2, columns=2)
    for index, job in enumerate(jobs):
        lines = [m for m in job.metrics if "train/loss" in m and "step" in m]
        if not lines:
            continue
        label = f"{index + 1}. {_short(job)}"
        axes[0].plot([m["step"] for m in lines], [m.get("lr") for m in lines], linewidth=1.4, label=label)
        norms = [(m["step"], m["grad_norm"]) for m in lines if _is_value(m.get("grad_norm"))]
        if norms:
            axes[1].plot(*zip(*norms), linewidth=1.2, label=label)
    axes[0].set_title("Learning rate")
    axes[1].set_title("Gradient norm (before clipping)")
    for ax in axes:
        ax.set_xlabel("optimizer step")
        _plain_axes(ax)
    if axes[0].lines:
        axes[0].legend(fontsize=7, loc="upper left", bbox_to_anchor=(0.0, -0.14), ncol=2, frameon=False)
    _save(plt, fig, path)


def pareto_front(points: list[tuple[float, float]]) -> list[int]:
    """Indices of the points no other point beats on both axes (lower is better on both)."""
    front = []
    for i, (x, y) in enumerate(points):
        beaten = any((a <= x and b <= y) and (a < x or b < y) for j, (a, b) in enumerate(points) if j != i)
        if not beaten:
            front.append(i)
    return sorted(front, key=lambda i: points[i])


def plot_pareto(jobs: list[JobResult], path: Path) -> None:
    """Step peak against eval loss (the front: jobs nothing beats on both), and throughput against
    step peak. Points are numbered as in the other plots; the key is the legend."""
    plt, fig, axes = _figure(4.8, columns=2)
    numbered = [(i + 1, job) for i, job in enumerate(jobs)]
    placed = [(n, j) for n, j in numbered if _is_value(j.summary.get("mem/step_peak_bytes"))
              and _is_value(j.summary.get("eval/loss"))]  # fmt: skip
    ax = axes[0]
    if placed:
        points = [(j.summary["mem/step_peak_bytes"] / MIB, j.summary["eval/loss"]) for _, j in placed]
        front = pareto_front(points)
        ax.step([points[i][0] for i in front], [points[i][1] for i in front], where="post", color="#c44e52",
                linewidth=1.5, zorder=1, label="Pareto front")  # fmt: skip
        # ringed too: a front of one point draws no line
        ax.scatter([points[i][0] for i in front], [points[i][1] for i in front], s=110, facecolors="none",
                   edgecolors="#c44e52", zorder=3)  # fmt: skip
        _numbered_points(ax, placed, points)
        ax.legend(fontsize=7, loc="upper right")
    else:
        ax.text(
            0.5,
            0.5,
            "no job has a step peak and an eval loss",
            ha="center",
            va="center",
            transform=ax.transAxes,
        )
    ax.set_xlabel("step peak (MiB)")
    ax.set_ylabel("eval loss")
    ax.set_title("Memory vs eval loss (lower left is better)")
    ax = axes[1]
    placed = [(n, j) for n, j in numbered if _is_value(j.summary.get("mem/step_peak_bytes"))
              and _is_value(j.summary.get("speed/samples_per_s"))]  # fmt: skip
    if placed:
        points = [
            (j.summary["mem/step_peak_bytes"] / MIB, j.summary["speed/samples_per_s"]) for _, j in placed
        ]
        _numbered_points(ax, placed, points)
    ax.set_xlabel("step peak (MiB)")
    ax.set_ylabel("samples / s")
    ax.set_title("Throughput vs memory (upper left is better)")
    for ax in axes:
        ax.margins(0.2)
        _plain_axes(ax)
    key = "\n".join(f"{n}. {_short(j)}" for n, j in numbered)
    fig.text(0.01, 0.01, key, fontsize=7, va="bottom", family="monospace")
    fig.subplots_adjust(bottom=0.17 + 0.03 * len(jobs), top=0.92, wspace=0.25)
    _save(plt, fig, path, tight=False)


def _numbered_points(ax, placed, points) -> None:
    """One marker per job with its number beside it; coinciding points share one label (``1=2``)."""
    groups: dict[tuple, list[int]] = {}
    for (n, _), point in zip(placed, points):
        groups.setdefault((round(point[0], 3), round(point[1], 5)), []).append(n)
    ax.scatter([p[0] for p in points], [p[1] for p in points], color="#4c72b0", zorder=2)
    for (x, y), numbers in groups.items():
        ax.annotate(
            "=".join(map(str, numbers)), (x, y), textcoords="offset points", xytext=(5, 4), fontsize=8
        )


def _short(job: JobResult) -> str:
    label = job.label
    return label if len(label) <= 60 else label[:57] + "..."


PLOTS = {
    "memory.png": plot_memory,
    "loss.png": plot_losses,
    "pareto.png": plot_pareto,
    "lr_grad_norm.png": plot_lr_and_grad_norm,
}


# ---------------------------------------------------------------- report


# Summary keys aggregated over the seeds of a combination (mean and sample standard deviation).
SEED_KEYS = [
    ("eval loss", "eval/loss", 1, 4),
    ("accuracy", "eval/accuracy", 1, 4),
    ("F1", "eval/f1", 1, 4),
    ("perplexity", "eval/perplexity", 1, 2),
    ("train loss (mean)", "train/loss_mean", 1, 4),
    ("step peak MiB", "mem/step_peak_bytes", MIB, 1),
    ("samples/s", "speed/samples_per_s", 1, 1),
]


def seed_groups(jobs: list[JobResult]) -> dict[str, list[JobResult]]:
    """Finished jobs grouped by every choice but the seed: the combinations a seeds study repeats.
    Empty unless some combination ran with more than one seed."""
    groups: dict[str, list[JobResult]] = {}
    for job in jobs:
        if job.ok:
            label = " ".join(
                f"{k}={v}" for k, v in job.choices.items() if k not in ("seed", "cfg/seed") and v
            )
            groups.setdefault(label or "defaults", []).append(job)
    return groups if any(len(group) > 1 for group in groups.values()) else {}


def seed_rows(groups: dict[str, list[JobResult]]) -> tuple[list[str], list[list[str]], list[dict]]:
    """Mean +- standard deviation per combination; the exact numbers too, for the CSV and plots."""
    import statistics

    headers = ["combination", "seeds"] + [title for title, *_ in SEED_KEYS]
    rows, exact = [], []
    for label, group in groups.items():
        cells, numbers = [label, str(len(group))], {"combination": label, "seeds": len(group)}
        for _title, key, scale, digits in SEED_KEYS:
            values = [job.summary[key] for job in group if _is_value(job.summary.get(key))]
            if not values:
                cells.append("")
                continue
            mean = statistics.fmean(values)
            std = statistics.stdev(values) if len(values) > 1 else 0.0
            numbers[f"{key}/mean"], numbers[f"{key}/std"] = mean, std
            cells.append(f"{mean / scale:.{digits}f} +- {std / scale:.{digits}f}")
        rows.append(cells)
        exact.append(numbers)
    kept = [i for i in range(len(headers)) if i < 2 or any(row[i] for row in rows)]  # no empty columns
    return [headers[i] for i in kept], [[row[i] for i in kept] for row in rows], exact


def plot_seeds(groups: dict[str, list[JobResult]], path: Path) -> None:
    """Eval loss and step peak per combination, mean with one standard deviation as error bars."""
    _, _, exact = seed_rows(groups)
    plt, fig, axes = _figure(max(3.0, 1.2 + 0.45 * len(exact)), columns=2)
    ys = list(range(len(exact)))
    for ax, key, scale, xlabel in (
        (axes[0], "eval/loss", 1, "eval loss (mean +- std over seeds)"),
        (axes[1], "mem/step_peak_bytes", MIB, "step peak MiB (mean +- std)"),
    ):
        means = [row.get(f"{key}/mean", math.nan) / scale for row in exact]
        stds = [row.get(f"{key}/std", 0.0) / scale for row in exact]
        ax.errorbar(means, ys, xerr=stds, fmt="o", capsize=4, color="#4c72b0")
        ax.set_xlabel(xlabel)
        _plain_axes(ax)
    axes[0].set_yticks(ys, [f"{row['combination']} (n={row['seeds']})" for row in exact], fontsize=8)
    axes[1].set_yticks(ys, [""] * len(ys))
    for ax in axes:
        ax.invert_yaxis()
        ax.margins(x=0.2)
    axes[0].set_title("Repeated seeds: a difference smaller than the bars is noise")
    _save(plt, fig, path)


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


def write_html(
    headers, rows, jobs: list[JobResult], plots: list[Path], path: Path, sources: list[Path], extra: str = ""
) -> None:
    table = html_table(headers, rows, ["" if job.ok else "failed" for job in jobs])
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
{extra}
{f"<h2>Jobs that did not finish ok</h2><ul>{errors}</ul>" if errors else ""}
{"".join(images)}
</body></html>
"""
    path.write_text(page)


def log_to_wandb(jobs: list[JobResult], sweeps: list[Path], mode: str | None) -> None:
    """Each sweep whose jobs logged to W&B gets the table as a W&B Table, in a run of its own in the
    project, entity and group its jobs recorded (``wandb/*`` in their summaries)."""
    from effitrain.loggers import log_comparison_table

    for sweep in sweeps:
        own = [job for job in jobs if job.sweep == sweep]
        logged = [job.summary for job in own if job.summary.get("wandb/mode") in ("online", "offline")]
        if not logged:
            continue
        where = logged[0]
        rows = [
            {"job": job.folder.relative_to(sweep).as_posix(), **job.choices, **job.summary} for job in own
        ]
        log_comparison_table(
            rows,
            group=where.get("wandb/group"),
            wandb_dir=sweep,
            project=where.get("wandb/project") or "effitrain",
            entity=where.get("wandb/entity"),
            mode=mode,
        )


def compare(sweeps: list[Path], output: Path | None = None, wandb_mode: str | None = None) -> dict[str, Path]:
    """Write the comparison of the jobs under ``sweeps`` into ``output`` (default: the first sweep folder).

    Sweeps that logged to W&B also get the table as a W&B Table (``wandb_mode="disabled"`` skips it).
    Returns the paths written, by name. Raises ConfigError for a folder with no jobs.
    """
    sweeps = [Path(s) for s in sweeps]
    jobs = load_jobs(sweeps)
    output = Path(output) if output else sweeps[0]
    try:
        output.mkdir(parents=True, exist_ok=True)
        probe = output / ".effitrain-write-probe"
        probe.write_text("")
        probe.unlink()
    except OSError as error:
        raise ConfigError(
            f"--output={str(output)!r} is invalid: cannot be written ({error.strerror})"
        ) from None
    headers, rows = table_rows(jobs)
    written = {
        "csv": output / "comparison.csv",
        "md": output / "comparison.md",
        "html": output / "comparison.html",
    }
    write_csv(jobs, written["csv"])
    plots = []
    for name, plot in PLOTS.items():
        plot(jobs, output / name)
        plots.append(output / name)
        written[name] = output / name
    problems = failures(jobs)
    markdown = [markdown_table(headers, rows), ""]
    extra = ""
    groups = seed_groups(jobs)
    if groups:  # repeated seeds: mean +- std per combination, in a table and a plot of their own
        seed_headers, seed_table, exact = seed_rows(groups)
        written["seeds_csv"] = output / "comparison_seeds.csv"
        with open(written["seeds_csv"], "w", newline="") as handle:
            columns = list(dict.fromkeys(k for row in exact for k in row))
            writer = csv.DictWriter(handle, fieldnames=columns)
            writer.writeheader()
            writer.writerows(exact)
        plot_seeds(groups, output / "seeds.png")
        plots.append(output / "seeds.png")
        written["seeds.png"] = output / "seeds.png"
        markdown += [
            "Repeated seeds (mean +- standard deviation):",
            "",
            markdown_table(seed_headers, seed_table),
            "",
        ]
        extra = "<h2>Repeated seeds (mean &plusmn; standard deviation)</h2>" + html_table(
            seed_headers, seed_table
        )
    if problems:
        markdown += ["Jobs that did not finish ok:", ""] + [f"- {line}" for line in problems] + [""]
    markdown += [f"![{plot.stem}]({plot.name})" for plot in plots]
    written["md"].write_text("\n".join(markdown) + "\n")
    write_html(headers, rows, jobs, plots, written["html"], sweeps, extra)
    print(text_table(headers, rows))
    if groups:
        print(text_table(seed_headers, seed_table))
    for line in problems:
        print(f"not ok: {line}")
    print(f"effitrain: compare: {len(jobs)} jobs -> {written['md']}, {written['html']}")
    log_to_wandb(jobs, sweeps, wandb_mode)
    return written
