"""How every figure of a comparison is drawn: matplotlib's Agg backend (files only, no display),
plain numbers on the axes, a line style and marker per curve, the colours, legends below their
panel, a y range of at least 0.1%; the figures are :mod:`effitrain.compare.plots`' and
:mod:`effitrain.compare.pareto`'s."""

from __future__ import annotations

from pathlib import Path


def new_figure(height: float, columns: int = 1):
    """matplotlib's pyplot, a figure and its ``columns`` panels side by side, drawn for files only."""
    import matplotlib

    matplotlib.use("Agg")  # files only: no display on servers and in CI
    import matplotlib.pyplot as plt

    return plt, *plt.subplots(1, columns, figsize=(11 if columns > 1 else 9, height), dpi=110)


def save_figure(plt, fig, path: Path, tight: bool = True) -> None:
    """Write ``fig`` to ``path`` (``tight``: laid out first) and close it, so a sweep of many plots
    holds no figure open."""
    if tight:
        import warnings

        with warnings.catch_warnings():  # tall legends: bbox_inches="tight" below makes the room
            warnings.simplefilter("ignore", UserWarning)
            fig.tight_layout()
    fig.savefig(path, bbox_inches="tight")  # legends placed outside the axes stay in the picture
    plt.close(fig)


def plain_axes(ax, ticks: int = 6) -> None:
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


MARKERS = ["o", "s", "^", "v", "D", "x", "+", "*"]
LINE_STYLES = ["-", "--", ":", "-."]


def line_style(number: int, points: int) -> dict:
    """The ``number``-th line's style and marker: curves that nearly coincide (not identical, so
    not merged) stay visible, the markers staggered so that one does not sit on the other."""
    return {"linestyle": LINE_STYLES[number % len(LINE_STYLES)], "marker": MARKERS[number % len(MARKERS)],
            "markersize": 5, "fillstyle": "none", "markevery": (number % 3, 3) if points > 6 else None}  # fmt: skip


def palette(count: int) -> list:
    import matplotlib

    cmap = matplotlib.colormaps["tab10" if count <= 10 else "tab20"]
    return [cmap(i % cmap.N) for i in range(count)]


def legend_below(ax, entries: int, title: str | None = None) -> None:
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


def at_least_a_thousandth(ax) -> None:
    """A y range of at least 0.1% of the values: differences in the seventh digit (float noise
    between runs that compute the same thing) stay flat instead of filling the plot."""
    low, high = ax.get_ylim()
    middle, span = (low + high) / 2, 1e-3 * max(abs(low), abs(high))
    if high - low < span:
        ax.set_ylim(middle - span / 2, middle + span / 2)
