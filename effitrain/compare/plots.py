"""The comparison's figures (PNG, drawn with matplotlib's Agg backend: files only, no display)."""

from __future__ import annotations

import math
import textwrap
from pathlib import Path

from effitrain.compare.labels import identical_groups, job_labels, joined_numbers, merged_label
from effitrain.compare.load import MIB, STEADY_SPEED, JobResult, _finite, _is_value, job_kind
from effitrain.memory.step_peak import CATEGORIES


def _figure(height: float, columns: int = 1):
    import matplotlib

    matplotlib.use("Agg")  # files only: no display on servers and in CI
    import matplotlib.pyplot as plt

    return plt, *plt.subplots(1, columns, figsize=(11 if columns > 1 else 9, height), dpi=110)


def _save(plt, fig, path: Path, tight: bool = True) -> None:
    if tight:
        import warnings

        with warnings.catch_warnings():  # tall legends: bbox_inches="tight" below makes the room
            warnings.simplefilter("ignore", UserWarning)
            fig.tight_layout()
    fig.savefig(path, bbox_inches="tight")  # legends placed outside the axes stay in the picture
    plt.close(fig)


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
        value = summary.get(f"mem/step_peak/{category}_bytes")
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


def _plain_axes(ax, ticks: int = 6) -> None:
    """Plain numbers on both axes: no offset notation (``1e-5+1.097``) a reader has to decode, and
    at most ``ticks`` ticks, so that long plain numbers do not run into each other."""
    from matplotlib.ticker import MaxNLocator

    for axis in (ax.xaxis, ax.yaxis):
        if type(axis.get_major_locator()).__name__ == "AutoLocator":  # not categorical or set ticks
            axis.set_major_locator(MaxNLocator(nbins=ticks))
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
    _plain_axes(ax)
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
    _plain_axes(side, ticks=2)  # a narrow panel: two plain numbers never run together
    _save(plt, fig, path)


def _curves(job: JobResult):
    lines = [m for m in job.metrics if "train/loss" in m and "step" in m]
    steps = [m["step"] for m in lines]
    seconds, total = [], 0.0
    for m in lines:
        total += m.get("speed/step_s") or 0.0
        seconds.append(total)
    return steps, seconds, [m["train/loss"] for m in lines]


MARKERS = ["o", "s", "^", "v", "D", "x", "+", "*"]
LINE_STYLES = ["-", "--", ":", "-."]


def _line_style(number: int, points: int) -> dict:
    """The ``number``-th line's style and marker: curves that nearly coincide (not identical, so
    not merged) stay visible, the markers staggered so that one does not sit on the other."""
    return {"linestyle": LINE_STYLES[number % len(LINE_STYLES)], "marker": MARKERS[number % len(MARKERS)],
            "markersize": 5, "fillstyle": "none", "markevery": (number % 3, 3) if points > 6 else None}  # fmt: skip


def _colors(count: int) -> list:
    import matplotlib

    cmap = matplotlib.colormaps["tab10" if count <= 10 else "tab20"]
    return [cmap(i % cmap.N) for i in range(count)]


def _legend(ax, entries: int, title: str | None = None) -> None:
    """Below its own panel and its axis label, never over the curves it names: a fixed distance in
    points under the axes, so a panel that the layout shrinks to make room for a tall legend does
    not pull the legend up over its x label."""
    from matplotlib.transforms import offset_copy

    longest = max(
        (len(t.get_label()) for t in ax.get_lines() if not t.get_label().startswith("_")), default=0
    )
    ncol = 1 if longest > 38 or entries <= 3 else 2
    below = offset_copy(ax.transAxes, fig=ax.figure, y=-32, units="points")  # tick labels, then the x label
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(0.0, 0.0), bbox_transform=below, ncol=ncol,
              frameon=False, title=title, title_fontsize=7, alignment="left")  # fmt: skip


def plot_losses(jobs: list[JobResult], path: Path) -> None:
    """Train loss against optimizer steps and against training seconds; eval points (eval_every
    lines, else the final eval loss). Jobs whose losses are identical are one curve on the steps
    panel, named by all their numbers (``1=4``); on the time panel each job keeps its own curve
    (their times differ), in its group's colour, with a legend of its own."""
    plt, fig, axes = _figure(4.8, columns=2)
    labels = job_labels(jobs)
    groups = identical_groups(jobs, lambda job: _curves(job)[2])
    colors = _colors(len(groups))
    styles = ["-", "--", ":", "-."]
    for number, (group, color) in enumerate(zip(groups, colors)):
        numbers = joined_numbers(group)
        first = jobs[group[0]]
        steps, _, losses = _curves(first)
        # curves that nearly coincide (not identical, so not merged) stay visible: each its own
        # line style and marker, the markers staggered so that one does not sit on the other
        axes[0].plot(steps, losses, color=color, linewidth=1.8, **_line_style(number, len(steps)),
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
        _at_least_a_thousandth(ax)
        _plain_axes(ax)
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
        _legend(axes[0], len(groups))
        _legend(axes[1], sum(len(g) for g in groups))
    else:
        axes[0].text(
            0.5, 0.5, "no metrics.jsonl lines", ha="center", va="center", transform=axes[0].transAxes
        )
    _save(plt, fig, path)


def plot_lr_and_grad_norm(jobs: list[JobResult], path: Path) -> None:
    """Learning rate and gradient norm per optimizer step; identical curves drawn once, named by
    all their jobs' numbers."""
    from matplotlib.ticker import MaxNLocator

    plt, fig, axes = _figure(4.2, columns=2)
    labels = job_labels(jobs)

    def points(job, key):
        return [(m["step"], m[key]) for m in job.metrics if "train/loss" in m and _is_value(m.get(key))]

    for ax, key in ((axes[0], "lr"), (axes[1], "grad_norm")):
        groups = identical_groups(jobs, lambda job, key=key: [v for pair in points(job, key) for v in pair])
        for number, (group, color) in enumerate(zip(groups, _colors(len(groups)))):
            name = "all jobs" if len(group) == len(jobs) > 1 else merged_label([labels[i] for i in group])
            if name.endswith("(named on the right)"):
                name = f"{len(group)} jobs"
            xs, ys = zip(*points(jobs[group[0]], key))
            ax.plot(xs, ys, color=color, linewidth=1.4, **_line_style(number, len(xs)),
                    label=f"{joined_numbers(group)}. {name}")  # fmt: skip
        if groups:
            _legend(ax, len(groups))
    axes[0].set_title("Learning rate")
    axes[1].set_title("Gradient norm (before clipping)")
    for ax in axes:
        ax.set_xlabel("optimizer step")
        _plain_axes(ax)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # optimizer steps are whole numbers
    _save(plt, fig, path)


def plot_pareto(jobs: list[JobResult], path: Path, front: set[int] | None = None) -> list[dict]:
    """Step peak against eval loss, and throughput against step peak; the jobs of the verdict's
    front (``front``: their numbers, :attr:`effitrain.compare.verdict.Verdict.front_numbers`; the
    verdict is taken here when not given) ringed in both. Points are numbered as in the other plots,
    labels placed where they overlap no other label; the key below names the numbers."""
    if front is None:
        from effitrain.compare.verdict import verdict

        front = verdict(jobs).front_numbers
    plt, fig, axes = _figure(4.8, columns=2)
    labels = job_labels(jobs)
    numbered = [(i + 1, job) for i, job in enumerate(jobs) if job.ranked]  # a NaN is no point
    panels = []
    placed = [(n, j) for n, j in numbered if _finite(j.summary.get("mem/step_peak_bytes"))
              and _finite(j.summary.get("eval/loss"))]  # fmt: skip
    ax = axes[0]
    if placed:
        points = [(j.summary["mem/step_peak_bytes"] / MIB, j.summary["eval/loss"]) for _, j in placed]
        _ring_front(ax, placed, points, front)
        _scatter_by_kind(ax, placed, points)
        panels.append((ax, placed, points))
    else:
        ax.text(0.5, 0.5, "no job has a step peak and an eval loss", ha="center", va="center",
                transform=ax.transAxes)  # fmt: skip
    ax.set_xlabel("step peak (MiB)")
    ax.set_ylabel("eval loss")
    ax.set_title("Memory vs eval loss (lower left is better)")
    ax = axes[1]
    placed = [(n, j) for n, j in numbered if _finite(j.summary.get("mem/step_peak_bytes"))
              and _finite(j.figures.get(STEADY_SPEED))]  # fmt: skip
    if placed:
        points = [(j.summary["mem/step_peak_bytes"] / MIB, j.figures[STEADY_SPEED]) for _, j in placed]
        _ring_front(ax, placed, points, front)
        _scatter_by_kind(ax, placed, points)
        panels.append((ax, placed, points))
    ax.set_xlabel("step peak (MiB)")
    ax.set_ylabel("samples / s (median of the steady steps)")
    ax.set_title("Throughput vs memory (upper left is better)")
    for ax in axes:
        ax.margins(0.2)
        _at_least_a_thousandth(ax)
        _plain_axes(ax)
    # the key: the numbers' names, in columns of at most 12 below the panels
    per_column = 12
    columns = [list(range(i, min(i + per_column, len(jobs)))) for i in range(0, len(jobs), per_column)]
    rows = min(len(jobs), per_column)
    key_in = 0.125 * rows + 0.2
    height = 4.4 + key_in
    fig.set_size_inches(11, height)
    fig.subplots_adjust(bottom=(key_in + 0.75) / height, top=1 - 0.45 / height, wspace=0.25)
    width = 1.0 / max(len(columns), 1)
    for c, column in enumerate(columns):
        text = "\n".join(f"{i + 1:>2}. {labels[i][: int(110 * width)]}" for i in column)
        fig.text(0.01 + c * width, 0.1 / height, text, fontsize=7, va="bottom", family="monospace")
    drawn = [
        {"boxes": _numbered_points(fig, ax, placed, points),  # the labels' boxes in pixels
         "points": {n: point for (n, _), point in zip(placed, points)},
         "ringed": {n for n, _ in placed if n in front}}
        for ax, placed, points in panels
    ]  # fmt: skip
    _save(plt, fig, path, tight=False)
    return drawn  # per panel what it shows, by job number: what the tests hold against the verdict


def _scatter_by_kind(ax, placed, points) -> None:
    """The points, one marker and colour per kind (task | model | data) where the jobs are of
    several, named in the legend: points of different kinds sit on one pair of axes, but only a
    kind's own points compare."""
    by_kind: dict[str, list] = {}
    for (_, job), point in zip(placed, points):
        by_kind.setdefault(job_kind(job), []).append(point)
    several = len(by_kind) > 1
    for index, (kind, mine) in enumerate(by_kind.items()):
        ax.scatter([p[0] for p in mine], [p[1] for p in mine], zorder=2, marker=MARKERS[index % len(MARKERS)],
                   color=["#4c72b0", "#dd8452", "#55a868", "#8172b3"][index % 4],
                   label=f"{kind} (compare within it)" if several else None)  # fmt: skip
    if several:
        ax.legend(fontsize=7, loc="best")  # where it covers the fewest points


def _ring_front(ax, placed, points, front: set[int]) -> None:
    """Ring the points of the jobs on the verdict's front (the same list the verdict writes)."""
    ringed = [point for (n, _), point in zip(placed, points) if n in front]
    if ringed:
        ax.scatter([p[0] for p in ringed], [p[1] for p in ringed], s=110, facecolors="none",
                   edgecolors="#c44e52", zorder=3, label="the verdict's front")  # fmt: skip
        ax.legend(fontsize=7, loc="best")  # where it covers the fewest points


def _numbered_points(fig, ax, placed, points) -> list[tuple]:
    """The jobs' numbers beside their points; coinciding points share one label (``1=2``). Each
    label takes the first spot around its point (ever farther, with a leader line) that overlaps
    no label placed before it and no other point."""
    groups: dict[tuple, list[tuple]] = {}
    for (n, _), point in zip(placed, points):
        groups.setdefault((round(point[0], 3), round(point[1], 5)), []).append((n, point))
    renderer = fig.canvas.get_renderer()
    to_pixels = ax.transData.transform
    dots = [to_pixels(point) for point in points]
    taken = [(x - 4, y - 4, x + 4, y + 4) for x, y in dots]  # the markers themselves
    frame = ax.get_window_extent(renderer)
    spots = [(6 * r, a) for r in (1, 2, 3, 4.5, 6, 8) for a in (30, -30, 150, -150, 90, -90, 0, 180)]
    for members in groups.values():
        text = "=".join(str(n) for n, _ in members)
        anchor = members[0][1]
        for distance, angle in spots:
            dx, dy = distance * math.cos(math.radians(angle)), distance * math.sin(math.radians(angle))
            note = ax.annotate(text, anchor, textcoords="offset points", xytext=(dx, dy), fontsize=8,
                               ha="left" if dx >= 0 else "right", va="center", zorder=4,
                               arrowprops={"arrowstyle": "-", "color": "#999999", "lw": 0.6}
                               if distance > 12 else None)  # fmt: skip
            box = note.get_window_extent(renderer)
            edges = (box.x0, box.y0, box.x1, box.y1)
            inside = frame.x0 <= box.x0 and box.x1 <= frame.x1 and frame.y0 <= box.y0 and box.y1 <= frame.y1
            if inside and not any(_overlap(edges, other) for other in taken):
                taken.append(edges)
                break
            note.remove()
        else:  # nowhere free: the nearest spot, over whatever is there
            note = ax.annotate(text, anchor, textcoords="offset points", xytext=(6, 4), fontsize=8)
            box = note.get_window_extent(renderer)
            taken.append((box.x0, box.y0, box.x1, box.y1))
    return taken[len(dots) :]


def _overlap(a, b) -> bool:
    return a[0] < b[2] and b[0] < a[2] and a[1] < b[3] and b[1] < a[3]


def _at_least_a_thousandth(ax) -> None:
    """A y range of at least 0.1% of the values: differences in the seventh digit (float noise
    between runs that compute the same thing) stay flat instead of filling the plot."""
    low, high = ax.get_ylim()
    middle, span = (low + high) / 2, 1e-3 * max(abs(low), abs(high))
    if high - low < span:
        ax.set_ylim(middle - span / 2, middle + span / 2)


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
