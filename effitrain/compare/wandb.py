"""A sweep's comparison in W&B: one run per sweep, in the sweep's group, holding compare's tables
(the page's and every job's exact values) and the verdict in its summary. Written by
``effitrain compare`` (:mod:`effitrain.compare`); the training runs are :mod:`effitrain.train.loggers`'."""

from __future__ import annotations

import sys
from pathlib import Path

from effitrain.train.loggers import plain, resolve_mode


def comparison_run_id(sweep_dir: str | Path) -> str:
    """The id of a sweep's one comparison run: the same for every ``effitrain compare`` of it."""
    import hashlib

    return "compare-" + hashlib.sha1(str(Path(sweep_dir).absolute()).encode()).hexdigest()[:16]


def table_cells(data: list[list]) -> list[list]:
    """``data`` (rows of cells) as a W&B Table takes it. A Table types each column from its values
    and refuses a row whose cell has another type: a nested dict with other keys (``job/config`` of
    two optimizers), text beside numbers. So a dict or list becomes its JSON text, and a column
    whose cells are of more than one kind (text, number, bool) becomes text throughout; a null stays
    null and a column of one kind keeps its values as they are (numbers sort and plot as numbers)."""
    import json

    def kind(cell):
        if isinstance(cell, bool):
            return bool
        return float if isinstance(cell, (int, float)) else type(cell)

    def text(cell):
        return cell if isinstance(cell, str) else json.dumps(cell)

    cells = [[json.dumps(c) if isinstance(c, (dict, list, tuple)) else c for c in row] for row in data]
    for col in range(len(cells[0]) if cells else 0):
        if len({kind(row[col]) for row in cells if row[col] is not None}) > 1:
            for row in cells:
                if row[col] is not None:
                    row[col] = text(row[col])
    return cells


def log_comparison_table(
    rows: list[dict],
    group: str | None,
    wandb_dir: str | Path,
    project: str = "effitrain",
    entity: str | None = None,
    mode: str | None = None,
    name: str = "comparison",
    table_key: str = "comparison",
    page: tuple[list[str], list[list]] | None = None,
    summary: dict | None = None,
):
    """Log a sweep's comparison as W&B Tables in the sweep's one comparison run, in its group.

    ``page`` (headers, rows) is the page's table, logged as ``table_key``; ``rows`` (one dict per
    job: its exact values) as ``<table_key>_values``, columns the union of the rows' keys in
    first-seen order, a value missing from a row null. ``summary`` (the verdict) goes into the
    run's summary. The run's id is :func:`comparison_run_id` of ``wandb_dir``: comparing the sweep
    again updates that run instead of adding one (offline, the earlier offline copy is replaced).
    Returns the finished run's folder (None when W&B is disabled or unavailable); like the
    training logger it warns and returns instead of raising when W&B fails.

    Raises:
        ConfigError: an invalid ``mode``.
    """
    import shutil

    mode = resolve_mode(mode)
    if mode == "disabled":
        return None
    try:
        import wandb

        columns = list(dict.fromkeys(key for row in rows for key in row))
        data = [[plain(row.get(column)) for column in columns] for row in rows]
        Path(wandb_dir).mkdir(parents=True, exist_ok=True)
        run_id = comparison_run_id(wandb_dir)
        if mode == "offline":  # one offline copy per sweep: `wandb sync offline-run-*` uploads one run
            for earlier in (Path(wandb_dir) / "wandb").glob(f"offline-run-*-{run_id}"):
                shutil.rmtree(earlier, ignore_errors=True)
        run = wandb.init(
            project=project,
            entity=entity,
            group=group,
            name=name,
            id=run_id,
            resume="allow" if mode == "online" else None,
            job_type="compare",
            dir=str(wandb_dir),
            mode=mode,
            reinit="finish_previous",
            settings=wandb.Settings(silent=True),
        )
        folder = run.settings.sync_dir
        try:
            # the summary first: the verdict reaches the run even when a table cannot be logged
            run.summary["jobs"] = len(rows)
            for key in [
                k for k in run.summary.keys() if k.startswith("verdict/") and k not in (summary or {})
            ]:
                del run.summary[key]  # a resumed run's verdict of an earlier compare is replaced, not merged
            for key, value in (summary or {}).items():
                run.summary[key] = plain(value)
            tables = {f"{table_key}_values": wandb.Table(columns=columns, data=table_cells(data))}
            if page is not None:
                headers, cells = page
                tables[table_key] = wandb.Table(
                    columns=list(headers), data=table_cells([[plain(c) for c in row] for row in cells])
                )
            run.log(tables)
        except Exception:
            run.finish(exit_code=1)  # finished as failed, never left open to the process's exit
            raise
        run.finish()
        return folder
    except Exception as error:
        print(
            # one line: wandb's type errors list every key of every row
            f"effitrain: warning: W&B: the comparison table was not logged ({type(error).__name__}: "
            f"{(str(error).splitlines() or [''])[0][:300]})",
            file=sys.stderr,
            flush=True,
        )
        return None
