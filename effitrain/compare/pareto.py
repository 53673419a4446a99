"""The Pareto plot: step peak against eval loss and throughput against step peak, the verdict's
front ringed, each job's number placed where it overlaps no other label."""

from __future__ import annotations

import math
from pathlib import Path

from effitrain.compare.axes import MARKERS, at_least_a_thousandth, new_figure, plain_axes, save_figure
from effitrain.compare.labels import job_labels
from effitrain.compare.load import MIB, JobResult, _finite, job_kind
from effitrain.config.summary_schema import STEADY_SPEED


def plot_pareto(jobs: list[JobResult], path: Path, front: set[int] | None = None) -> list[dict]:
    """Step peak against eval loss, and throughput against step peak; the jobs of the verdict's
    front (``front``: their numbers, :attr:`effitrain.compare.verdict.Verdict.front_numbers`; the
    verdict is taken here when not given) ringed in both. Points are numbered as in the other plots,
    labels placed where they overlap no other label; the key below names the numbers."""
    if front is None:
        from effitrain.compare.verdict import verdict

        front = verdict(jobs).front_numbers
    plt, fig, axes = new_figure(4.8, columns=2)
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
        at_least_a_thousandth(ax)
        plain_axes(ax)
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
    save_figure(plt, fig, path, tight=False)
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
