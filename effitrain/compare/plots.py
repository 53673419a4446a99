"""The comparison's figures (PNG, drawn with matplotlib's Agg backend: files only, no display)."""

from __future__ import annotations

import math
from pathlib import Path

from effitrain.compare.load import MIB, JobResult, _is_value
from effitrain.step_memory import CATEGORIES


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
    """Plain numbers on both axes: no offset notation (``1e-5+1.097``) a reader has to decode, and
    at most six ticks, so that long plain numbers do not run into each other."""
    from matplotlib.ticker import MaxNLocator

    for axis in (ax.xaxis, ax.yaxis):
        if type(axis.get_major_locator()).__name__ == "AutoLocator":  # not categorical or set ticks
            axis.set_major_locator(MaxNLocator(nbins=6))
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
        _at_least_a_thousandth(ax)
        _plain_axes(ax)
    key = "\n".join(f"{n}. {_short(j)}" for n, j in numbered)
    fig.text(0.01, 0.01, key, fontsize=7, va="bottom", family="monospace")
    fig.subplots_adjust(bottom=0.17 + 0.03 * len(jobs), top=0.92, wspace=0.25)
    _save(plt, fig, path, tight=False)


def _numbered_points(ax, placed, points) -> None:
    """One marker per job with its number beside it; coinciding points share one label (``1=2``)."""
    groups: dict[tuple, list[tuple]] = {}
    for (n, _), point in zip(placed, points):
        groups.setdefault((round(point[0], 3), round(point[1], 5)), []).append((n, point))
    ax.scatter([p[0] for p in points], [p[1] for p in points], color="#4c72b0", zorder=2)
    for members in groups.values():  # the label at the first member's own point, not the rounded key
        ax.annotate("=".join(str(n) for n, _ in members), members[0][1], textcoords="offset points",
                    xytext=(5, 4), fontsize=8)  # fmt: skip


def _at_least_a_thousandth(ax) -> None:
    """A y range of at least 0.1% of the values: differences in the seventh digit (float noise
    between runs that compute the same thing) stay flat instead of filling the plot."""
    low, high = ax.get_ylim()
    middle, span = (low + high) / 2, 1e-3 * max(abs(low), abs(high))
    if high - low < span:
        ax.set_ylim(middle - span / 2, middle + span / 2)


def _short(job: JobResult) -> str:
    label = job.label
    return label if len(label) <= 60 else label[:57] + "..."


PLOTS = {
    "memory.png": plot_memory,
    "loss.png": plot_losses,
    "pareto.png": plot_pareto,
    "lr_grad_norm.png": plot_lr_and_grad_norm,
}


def plot_seeds(exact: list[dict], path: Path) -> None:
    """Eval loss and step peak per combination (:func:`effitrain.compare.load.seed_stats`), mean
    with one standard deviation as error bars."""
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
