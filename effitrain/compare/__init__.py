"""Compare the jobs of one or more sweeps: a table (CSV, Markdown, terminal), plots, one HTML page.

    effitrain compare multirun/optimizers/2026-01-01_12-00-00
    effitrain compare multirun/optimizers/<a> multirun/compile/<b> --output report/

Reads each job's ``summary.json`` (self-describing: ``job/overrides`` names the choices that were
swapped, ``wandb/*`` where its W&B run went) and ``metrics.jsonl``, and writes: ``comparison.csv``
(exact values, bytes as in the summaries), ``comparison.md``, ``memory.png``, ``loss.png``,
``pareto.png``, ``lr_grad_norm.png``, for repeated seeds ``comparison_seeds.csv`` and ``seeds.png``,
and a self-contained ``comparison.html``.

    load.py          job folders -> JobResult (summary, metrics, the choices that differ), seed
                     statistics
    combinations.py  per combination its step peak, quality and speed with their noise, and their
                     ratios against the baseline
    learning.py      whether anything was learned: the eval loss against the task's reference
    verdict.py       the front (the one the Pareto plot rings) and the decision in words, each kind
                     of job (task, model, data) apart (first in the terminal, Markdown and page)
    table.py         the table's model: columns, rows, each figure's noise, the best cells, seeds
    render.py        the table as text, Markdown and CSV
    page.py          the self-contained HTML page
    plots.py         the figures; pareto.py the Pareto plot; axes.py how every figure is drawn
    labels.py        how the figures name jobs (short labels; one name for identical curves)

The summary's keys, memory categories and each figure's direction are
:mod:`effitrain.config.summary_schema`'s: nothing here imports torch.
"""

from __future__ import annotations

from pathlib import Path

from effitrain.compare.load import JobResult, failures, load_jobs, seed_groups, seed_stats
from effitrain.compare.page import write_html
from effitrain.compare.plots import plot_all, plot_seeds
from effitrain.compare.render import text_table, write_csv, write_markdown, write_seeds_csv
from effitrain.compare.table import CSV_KEYS, seed_rows, table_rows
from effitrain.compare.verdict import Verdict, verdict
from effitrain.config.errors import ConfigError

__all__ = ["CSV_KEYS", "JobResult", "Verdict", "compare", "load_jobs", "verdict"]


def log_to_wandb(jobs: list[JobResult], sweeps: list[Path], mode: str | None) -> None:
    """Each sweep whose jobs logged to W&B gets its one comparison run (updated by every compare),
    in the project, entity and group its jobs recorded (``wandb/*`` in their summaries): the page's
    table, the exact values and the verdict in the run's summary, each of that sweep's jobs alone
    (several sweeps compared at once do not mix into one sweep's run)."""
    from effitrain.compare.wandb import log_comparison_table

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
            page=_numbers(table_rows(own)),
            summary=verdict(own).summary(),
        )


def _numbers(page):
    """The page's cells with the numbers as numbers, so the dashboard sorts and plots them; an empty
    cell (a value the job does not have) as null, so its column stays a column of numbers."""
    headers, rows = page

    def value(cell):
        if cell == "":
            return None
        try:
            return float(cell)
        except ValueError:
            return cell

    # W&B needs unique column names: a ratio column is named after the figure before it
    unique = [f"{headers[i - 1]} {h}" if h.startswith("x ") and i else h for i, h in enumerate(headers)]
    return unique, [[value(cell) for cell in row] for row in rows]


def compare(sweeps: list[Path], output: Path | None = None, wandb_mode: str | None = None) -> dict[str, Path]:
    """Write the comparison of the jobs under ``sweeps`` into ``output`` (default: the first sweep folder).

    Sweeps that logged to W&B also get the table as a W&B Table (``wandb_mode="disabled"`` skips it).
    Returns the paths written, by name.

    Raises:
        ConfigError: a folder with no jobs, an output folder that cannot be written.
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
    written = {name: output / f"comparison.{name}" for name in ("csv", "md", "html")}
    write_csv(jobs, written["csv"])
    decided = verdict(jobs)  # once: its front is the one the page writes and the Pareto plot rings
    for path in plot_all(jobs, output, decided.front_numbers):
        written[path.name] = path
    seeds = None
    stats = seed_stats(seed_groups(jobs))
    if stats:  # repeated seeds: mean +- std per combination, in a table and a plot of their own
        seeds = seed_rows(stats)
        written["seeds_csv"] = output / "comparison_seeds.csv"
        write_seeds_csv(stats, written["seeds_csv"])
        plot_seeds(stats, output / "seeds.png")
        written["seeds.png"] = output / "seeds.png"
    plots = [path for name, path in written.items() if name.endswith(".png")]
    write_markdown(headers, rows, jobs, plots, written["md"], seeds, decided)
    write_html(headers, rows, jobs, plots, written["html"], sweeps, seeds, decided)
    print(decided.text())
    print()
    print(text_table(headers, rows))
    if seeds:
        print(text_table(*seeds))
    for line in failures(jobs):
        print(f"not ok: {line}")
    print(f"effitrain: compare: {len(jobs)} jobs -> {written['md']}, {written['html']}")
    log_to_wandb(jobs, sweeps, wandb_mode)
    return written
