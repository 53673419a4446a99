"""How the comparison's figures name jobs: one short label per job (the choices that tell the jobs
apart), and one name for jobs whose curves are identical (``1=4``, ``adamw | accelerator/trainer``)."""

from __future__ import annotations

import os

from effitrain.compare.load import JobResult, _is_value


def job_labels(jobs: list[JobResult], width: int = 48) -> list[str]:
    """The jobs' labels for the plots, at most about ``width`` characters: a prefix every job
    shares in one choice (``data.path=/long/shared/folder/``) becomes ``…``, and a part still too
    long loses its middle, so the part that tells the jobs apart stays."""
    from effitrain.compare.load import _label_groups
    from effitrain.config.overrides import short_part

    keys = list(dict.fromkeys(key for job in jobs for key in job.choices))
    values = {key: [str(job.choices.get(key, "")) for job in jobs] for key in keys}
    for key, column in values.items():
        shared = os.path.commonprefix(column) if len(set(column)) > 1 else ""
        cut = max((shared.rfind(c) for c in "/_-.=,"), default=-1) + 1
        if cut > 6:
            values[key] = ["…" + value[cut:] for value in column]
    labels = []
    for index, job in enumerate(jobs):
        parts = [short_part(key, values[key][index], _label_groups()) for key in keys if values[key][index]]
        if not parts:
            labels.append(job.folder.name[:width])
            continue
        room = max(8, (width - 3 * (len(parts) - 1)) // len(parts))
        if len(" | ".join(parts)) > width:
            parts = [
                p if len(p) <= room else p[: room // 2 - 1] + "…" + p[-(room - room // 2) :] for p in parts
            ]
        labels.append(" | ".join(parts))
    return labels


def merged_label(labels: list[str], width: int = 44) -> str:
    """One name for several jobs: the parts they share once, the parts that differ joined by ``/``
    (``adamw | accelerator/trainer``, ``lion | seed=42/43``); when that is too long, the first
    part's values and the number of jobs (``adamw/apollo: 6 jobs``)."""
    split = [label.split(" | ") for label in labels]
    if len(split) == 1:
        return labels[0]
    merged = " / ".join(labels)
    if len({len(parts) for parts in split}) == 1:
        columns = [_joined_values(list(dict.fromkeys(column))) for column in zip(*split)]
        merged = " | ".join(columns)
        if len(merged) > width:
            merged = f"{columns[0]}: {len(labels)} jobs"
    return merged if len(merged) <= width else f"{len(labels)} jobs (named on the right)"


def _joined_values(values: list[str]) -> str:
    """Distinct parts joined by ``/``, the key written once when all name the same one (``seed=42/43``)."""
    keys = {value.split("=", 1)[0] for value in values if "=" in value}
    if len(keys) == 1 and all("=" in value for value in values):
        return f"{keys.pop()}=" + "/".join(value.split("=", 1)[1] for value in values)
    return "/".join(values)


def joined_numbers(indices: list[int]) -> str:
    """Jobs' numbers (1-based) of identical curves: ``1=4``, runs shortened (``9-24``)."""
    runs: list[list[int]] = []
    for number in sorted(i + 1 for i in indices):
        if runs and number == runs[-1][-1] + 1:
            runs[-1].append(number)
        else:
            runs.append([number])
    return "=".join(f"{r[0]}-{r[-1]}" if len(r) > 2 else "=".join(map(str, r)) for r in runs)


def identical_groups(jobs: list[JobResult], series) -> list[list[int]]:
    """Indices of the jobs grouped by identical ``series(job)`` (empty series left out), in job order."""
    groups: dict[tuple, list[int]] = {}
    for index, job in enumerate(jobs):
        values = series(job)
        if values:
            groups.setdefault(tuple(round(v, 10) if _is_value(v) else v for v in values), []).append(index)
    return list(groups.values())
