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
from dataclasses import dataclass, field
from pathlib import Path

from effitrain import results
from effitrain.config import ConfigError
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

    def text(self, summary: dict) -> str:
        value = summary.get(self.key)
        if self.key == "status":
            return str(value or "missing")
        if not isinstance(value, (int, float)) or isinstance(value, bool):
            return ""
        return f"{value / self.scale:.{self.digits}f}"


# The report's figures; MiB only here on screen and in reports, the CSV keeps the summaries' bytes.
COLUMNS = [
    Column("status", "status"),
    Column("opt state MiB", "mem/optimizer_state_bytes", MIB, 2),
    Column("bytes/param", "mem/optimizer_bytes_per_param", 1, 2),
    Column("peak MiB", "mem/peak_bytes", MIB, 1),
    Column("train loss", "train/loss"),
    Column("eval loss", "eval/loss"),
    Column("accuracy", "eval/accuracy"),
    Column("F1", "eval/f1"),
    Column("samples/s", "speed/samples_per_s", 1, 1),
    Column("compile s", "speed/compile_s", 1, 2),
    Column("wall s", "speed/wall_s", 1, 1),
]

CSV_KEYS = [column.key for column in COLUMNS] + [
    "error",
    "mem/params_bytes",
    "mem/grads_bytes",
    "mem/peak_source",
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


def table_rows(jobs: list[JobResult]) -> tuple[list[str], list[list[str]]]:
    headers = choice_headers(jobs)
    rows = []
    for job in jobs:
        choices = [job.choices.get(h, "") if h != "job" else job.folder.name for h in headers]
        rows.append(choices + [column.text(job.summary) for column in COLUMNS])
    return headers + [column.header for column in COLUMNS], rows


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


def _figure(height: float):
    import matplotlib

    matplotlib.use("Agg")  # files only: no display on servers and in CI
    import matplotlib.pyplot as plt

    return plt, *plt.subplots(figsize=(9, height), dpi=110)


def _save(plt, fig, path: Path) -> None:
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def plot_memory(jobs: list[JobResult], path: Path) -> None:
    """Bars per job: parameters + gradients + optimizer state, stacked; the measured peak beside them."""
    plt, fig, ax = _figure(max(3.0, 1.2 + 0.45 * len(jobs)))
    parts = [
        ("parameters", "mem/params_bytes", "#4c72b0"),
        ("gradients", "mem/grads_bytes", "#55a868"),
        ("optimizer state", "mem/optimizer_state_bytes", "#c44e52"),
    ]
    ys = range(len(jobs))
    left = [0.0] * len(jobs)
    drawn = False
    for name, key, color in parts:
        widths = [(job.summary.get(key) or 0) / MIB for job in jobs]
        if any(widths):
            ax.barh([y - 0.18 for y in ys], widths, height=0.36, left=left, color=color, label=name)
            left = [a + b for a, b in zip(left, widths)]
            drawn = True
    peaks = [(job.summary.get("mem/peak_bytes") or 0) / MIB for job in jobs]
    if any(peaks):
        ax.barh([y + 0.18 for y in ys], peaks, height=0.36, color="#8172b2", label="peak")
        for y, peak in zip(ys, peaks):
            if peak:
                ax.text(peak, y + 0.18, f" {peak:.0f}", va="center", fontsize=8)
        drawn = True
    if not drawn:
        ax.text(
            0.5, 0.5, "no mem/* figures in these summaries", ha="center", va="center", transform=ax.transAxes
        )
    ax.set_yticks(list(ys), [_short(job) for job in jobs], fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel("MiB")
    ax.set_title("Memory per combination")
    if drawn:
        ax.legend(fontsize=8, loc="best")
    _save(plt, fig, path)


def plot_losses(jobs: list[JobResult], path: Path) -> None:
    """Training loss per optimizer step, every job overlaid; its eval loss as a dot at the last step."""
    plt, fig, ax = _figure(4.5)
    for job in jobs:
        points = [(m["step"], m["train/loss"]) for m in job.metrics if "train/loss" in m and "step" in m]
        if not points:
            continue
        steps, losses = zip(*points)
        (line,) = ax.plot(steps, losses, linewidth=1.2, label=_short(job))
        if isinstance(job.summary.get("eval/loss"), (int, float)):
            ax.plot([steps[-1]], [job.summary["eval/loss"]], "o", color=line.get_color())
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("train loss (dot: eval loss)")
    ax.set_title("Loss curves")
    if ax.lines:
        ax.legend(fontsize=7, ncol=2)
    else:
        ax.text(0.5, 0.5, "no metrics.jsonl lines", ha="center", va="center", transform=ax.transAxes)
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
    """Peak memory against eval loss; the jobs no other job beats on both are joined as the front."""
    plt, fig, ax = _figure(4.5)
    placed = [
        j
        for j in jobs
        if isinstance(j.summary.get("mem/peak_bytes"), (int, float))
        and isinstance(j.summary.get("eval/loss"), (int, float))
    ]
    points = [(job.summary["mem/peak_bytes"] / MIB, job.summary["eval/loss"]) for job in placed]
    if points:
        ax.scatter(*zip(*points), color="#4c72b0", zorder=2)
        front = pareto_front(points)
        ax.step(
            [points[i][0] for i in front],
            [points[i][1] for i in front],
            where="post",
            color="#c44e52",
            linewidth=1.5,
            zorder=1,
            label="Pareto front",
        )
        ax.scatter(
            [points[i][0] for i in front],
            [points[i][1] for i in front],
            s=90,
            facecolors="none",
            edgecolors="#c44e52",
            zorder=3,
        )
        for job, (x, y) in zip(placed, points):
            ax.annotate(_short(job), (x, y), textcoords="offset points", xytext=(4, 4), fontsize=7)
        ax.margins(x=0.25, y=0.1)  # room for the labels of the rightmost points
        ax.legend(fontsize=8)
    else:
        ax.text(
            0.5,
            0.5,
            "no job has both mem/peak_bytes and eval/loss",
            ha="center",
            va="center",
            transform=ax.transAxes,
        )
    ax.set_xlabel("peak memory (MiB)")
    ax.set_ylabel("eval loss")
    ax.set_title("Peak memory vs eval loss (lower left is better)")
    _save(plt, fig, path)


def _short(job: JobResult) -> str:
    label = job.label
    return label if len(label) <= 60 else label[:57] + "..."


PLOTS = {"memory.png": plot_memory, "loss.png": plot_losses, "pareto.png": plot_pareto}


# ---------------------------------------------------------------- report


def write_html(
    headers, rows, jobs: list[JobResult], plots: list[Path], path: Path, sources: list[Path]
) -> None:
    def cells(tag, values):
        return "".join(f"<{tag}>{html.escape(v)}</{tag}>" for v in values)

    body = [f"<tr>{cells('th', headers)}</tr>"]
    for job, row in zip(jobs, rows):
        body.append(f'<tr class="{"" if job.ok else "failed"}">{cells("td", row)}</tr>')
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
th, td {{ border: 1px solid #ccc; padding: 3px 8px; text-align: right; }}
tr.failed td {{ background: #fde8e8; }}
img {{ max-width: 100%; }}
</style></head><body>
<h1>effitrain comparison</h1>
<p>{html.escape(", ".join(str(s) for s in sources))}: {len(jobs)} jobs, {sum(not j.ok for j in jobs)} not ok.</p>
<table>{"".join(body)}</table>
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
    if problems:
        markdown += ["Jobs that did not finish ok:", ""] + [f"- {line}" for line in problems] + [""]
    markdown += [f"![{plot.stem}]({plot.name})" for plot in plots]
    written["md"].write_text("\n".join(markdown) + "\n")
    write_html(headers, rows, jobs, plots, written["html"], sweeps)
    print(text_table(headers, rows))
    for line in problems:
        print(f"not ok: {line}")
    print(f"effitrain: compare: {len(jobs)} jobs -> {written['md']}, {written['html']}")
    log_to_wandb(jobs, sweeps, wandb_mode)
    return written
