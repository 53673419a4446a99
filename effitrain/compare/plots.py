"""The comparison's figures (PNG, drawn with matplotlib's Agg backend: files only, no display): the
step peak by category, the losses, the learning rate and gradient norm, the seeds; the Pareto plot
is :mod:`effitrain.compare.pareto`'s, how each is drawn :mod:`effitrain.compare.axes`'."""

from __future__ import annotations

import math
import textwrap
from pathlib import Path

from effitrain.compare.axes import (
    at_least_a_thousandth,
    legend_below,
    line_style,
    new_figure,
    palette,
    plain_axes,
    save_figure,
)
from effitrain.compare.labels import identical_groups, job_labels, joined_numbers, merged_label
from effitrain.compare.load import MIB, JobResult, _finite, _is_value
from effitrain.compare.pareto import plot_pareto
from effitrain.config.summary_schema import CATEGORIES, step_peak_key

COLORS = {
    "weights": "#4c72b0",
    "gradients": "#55a868",
    "optimizer state": "#c44e52",
    "optimizer update temporaries": "#eba3a5",
    "optimizer state and update temporaries": "#c44e52",
    "activations": "#dd8452",
    "temporaries": "#937860",
}


def step_peak_parts(summary: dict) -> dict[str, float]:
    """The step peak's bytes by what holds them. The tracker's optimizer category holds the state
    and the tensors the update makes while it runs (foreach intermediates, Adafactor's factored
    products): split at the state's own bytes (``mem/optimizer_state_bytes``), so a bar never says
    state where it is the update's temporaries."""
    parts = {}
    for category in CATEGORIES:
        value = summary.get(step_peak_key(category))
        value = value if _finite(value) else 0
        if category != "optimizer_state":
            parts[category.replace("_", " ")] = value
            continue
        state = summary.get("mem/optimizer_state_bytes")
        if not _finite(state):
            parts["optimizer state and update temporaries"] = value
            continue
        parts["optimizer state"] = min(value, state)
        parts["optimizer update temporaries"] = value - min(value, state)
    return parts


def plot_memory(jobs: list[JobResult], path: Path) -> None:
    """Per job, the step peak stacked by category (what the comparison ranks by), the predicted
    peak marked beside it; the process-level figure (RSS or CUDA reserved) in a panel of its own."""
    plt, fig, _ = new_figure(max(3.6, 1.8 + 0.5 * len(jobs)))
    fig.clf()
    grid = fig.add_gridspec(1, 4)
    ax, side = fig.add_subplot(grid[0, :3]), fig.add_subplot(grid[0, 3])
    ys = list(range(len(jobs)))
    left = [0.0] * len(jobs)
    parts = [step_peak_parts(job.summary) for job in jobs]
    for label in dict.fromkeys(name for part in parts for name in part):
        widths = [part.get(label, 0) / MIB for part in parts]
        if any(widths):
            ax.barh(ys, widths, height=0.6, left=left, color=COLORS[label], label=label)
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
    ax.set_yticks(ys, [f"{i + 1}. {label}" for i, label in enumerate(job_labels(jobs))], fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel("MiB at the step peak (tensor memory of one optimizer step)")
    ax.set_title("Step peak by category")
    ax.set_xlim(0, max(left + [0.0]) * 1.15 or 1.0)  # room for the value labels and markers
    plain_axes(ax)
    if ax.get_legend_handles_labels()[0]:  # below the bars and the axis title, never over them
        below = 0.62 / (fig.get_figheight() * 0.85)  # in axes height: the same distance at 2 or 24 jobs
        entries = len(ax.get_legend_handles_labels()[0])  # rows of equal length: 7 entries in 4 + 3
        ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -below), ncol=math.ceil(entries / math.ceil(entries / 6)),
                  frameon=False)  # fmt: skip
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
    plain_axes(side, ticks=2)  # a narrow panel: two plain numbers never run together
    save_figure(plt, fig, path)


def job_colors(jobs: list[JobResult]) -> list:
    """One colour per job, by its number, in every panel and figure: a line standing for several
    identical jobs takes its first job's."""
    return palette(len(jobs))


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
    lines, else the final eval loss). Jobs whose losses are identical are one curve on the steps
    panel, named by all their numbers (``1=4``); on the time panel each job keeps its own curve
    (their times differ), in its group's colour, with a legend of its own."""
    plt, fig, axes = new_figure(4.8, columns=2)
    labels = job_labels(jobs)
    groups = identical_groups(jobs, lambda job: _curves(job)[2])
    colors = [job_colors(jobs)[group[0]] for group in groups]
    styles = ["-", "--", ":", "-."]
    for number, (group, color) in enumerate(zip(groups, colors)):
        numbers = joined_numbers(group)
        first = jobs[group[0]]
        steps, _, losses = _curves(first)
        # curves that nearly coincide (not identical, so not merged) stay visible: each its own
        # line style and marker, the markers staggered so that one does not sit on the other
        axes[0].plot(steps, losses, color=color, linewidth=1.8, **line_style(number, len(steps)),
                     label=f"{numbers}. {merged_label([labels[i] for i in group])}")  # fmt: skip
        for member, index in enumerate(group):
            job = jobs[index]
            steps, seconds, losses = _curves(job)
            axes[1].plot(seconds, losses, styles[member % len(styles)], color=color, linewidth=1.5,
                         label=f"{index + 1}. {labels[index]}")  # fmt: skip
            evals = [
                (m["step"], m["eval/loss"]) for m in job.metrics if "eval/loss" in m and "train/loss" not in m
            ]
            if not evals and _is_value(job.summary.get("eval/loss")):
                evals = [(steps[-1], job.summary["eval/loss"])]
            to_seconds = dict(zip(steps, seconds))
            for ax, xs in ((axes[0], None), (axes[1], to_seconds)):
                if ax is axes[0] and member:
                    continue  # the same points as the group's first job
                points = [(s if xs is None else xs.get(s, seconds[-1]), v) for s, v in evals]
                if points:
                    ax.plot(*zip(*points), "o", color=color, markersize=5)
    for ax, xlabel in zip(axes, ("optimizer step", "training seconds")):
        ax.set_xlabel(xlabel)
        ax.set_ylabel("train loss (dots: eval loss)")
        at_least_a_thousandth(ax)
        plain_axes(ax)
    from matplotlib.ticker import MaxNLocator

    axes[0].xaxis.set_major_locator(MaxNLocator(integer=True))  # optimizer steps are whole numbers
    merged = [joined_numbers(group) for group in groups if len(group) > 1]
    # the title names every line that stands for several jobs
    title = "Loss against steps"
    if merged:
        title += f" (identical curves, one line each: {', '.join(merged)})"
    if merged:  # a long list wraps, in a smaller font
        axes[0].set_title("\n".join(textwrap.wrap(title, 60)), fontsize=10)
    else:
        axes[0].set_title(title)
    axes[1].set_title("Loss against time (each job)")
    if groups:
        legend_below(axes[0], len(groups))
        legend_below(axes[1], sum(len(g) for g in groups))
    else:
        axes[0].text(
            0.5, 0.5, "no metrics.jsonl lines", ha="center", va="center", transform=axes[0].transAxes
        )
    save_figure(plt, fig, path)


def plot_lr_and_grad_norm(jobs: list[JobResult], path: Path) -> None:
    """Learning rate and gradient norm per optimizer step; identical curves drawn once, named by
    all their jobs' numbers."""
    from matplotlib.ticker import MaxNLocator

    plt, fig, axes = new_figure(4.2, columns=2)
    labels = job_labels(jobs)

    def points(job, key):
        return [(m["step"], m[key]) for m in job.metrics if "train/loss" in m and _is_value(m.get(key))]

    for ax, key in ((axes[0], "lr"), (axes[1], "grad_norm")):
        groups = identical_groups(jobs, lambda job, key=key: [v for pair in points(job, key) for v in pair])
        for number, group in enumerate(groups):
            color = job_colors(jobs)[group[0]]  # a job's colour in every panel: its first job's
            name = "all jobs" if len(group) == len(jobs) > 1 else merged_label([labels[i] for i in group])
            if name.endswith("(named on the right)"):
                name = f"{len(group)} jobs"
            xs, ys = zip(*points(jobs[group[0]], key))
            ax.plot(xs, ys, color=color, linewidth=1.4, **line_style(number, len(xs)),
                    label=f"{joined_numbers(group)}. {name}")  # fmt: skip
        if groups:
            legend_below(ax, len(groups))
    axes[0].set_title("Learning rate")
    axes[1].set_title("Gradient norm (before clipping)")
    for ax in axes:
        ax.set_xlabel("optimizer step")
        plain_axes(ax)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # optimizer steps are whole numbers
    save_figure(plt, fig, path)


def plot_all(jobs: list[JobResult], output: Path, front: set[int]) -> list[Path]:
    """Every figure of the page into ``output``; the Pareto plot rings ``front`` (the verdict's)."""
    paths = [output / name for name in ("memory.png", "loss.png", "pareto.png", "lr_grad_norm.png")]
    plot_memory(jobs, paths[0])
    plot_losses(jobs, paths[1])
    plot_pareto(jobs, paths[2], front)
    plot_lr_and_grad_norm(jobs, paths[3])
    return paths


def plot_seeds(exact: list[dict], path: Path) -> None:
    """Eval loss and step peak per combination (:func:`effitrain.compare.load.seed_stats`), mean
    with one standard deviation as error bars."""
    plt, fig, axes = new_figure(max(3.0, 1.2 + 0.45 * len(exact)), columns=2)
    ys = list(range(len(exact)))
    for ax, key, scale, xlabel in (
        (axes[0], "eval/loss", 1, "eval loss (mean +- std over seeds)"),
        (axes[1], "mem/step_peak_bytes", MIB, "step peak MiB (mean +- std)"),
    ):
        means = [row.get(f"{key}/mean", math.nan) / scale for row in exact]
        stds = [row.get(f"{key}/std", 0.0) / scale for row in exact]
        ax.errorbar(means, ys, xerr=stds, fmt="o", capsize=4, color="#4c72b0")
        ax.set_xlabel(xlabel)
        plain_axes(ax)
    axes[0].set_yticks(ys, [f"{row['combination']} (n={row['seeds']})" for row in exact], fontsize=8)
    axes[1].set_yticks(ys, [""] * len(ys))
    for ax in axes:
        ax.invert_yaxis()
        ax.margins(x=0.2)
    axes[0].set_title("Repeated seeds: a difference smaller than the bars is noise")
    save_figure(plt, fig, path)
