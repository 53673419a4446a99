"""Loading a comparison: every job folder of the sweeps, its summary.json and metrics.jsonl, the
choices that tell the jobs apart, and the groups of repeated seeds.

Only what each job wrote about itself is read (``job/overrides``, ``cfg/*``); never Hydra's
``.hydra/hydra.yaml``, which holds unresolved interpolations such as ``${now:...}``.
"""

from __future__ import annotations

import functools
import json
import statistics
from dataclasses import dataclass, field
from pathlib import Path

from effitrain.config.errors import ConfigError
from effitrain.run import results
from effitrain.sweep.report import job_folders
from effitrain.train.loggers import read_metrics
from effitrain.train.tasks import reported_metrics

MIB = 2**20

# The summary's keys that name what a job was (``cfg/<group>`` and the run-shaping scalars): a
# column when their values differ between jobs and no override column says it already.
CHOICE_PREFIX = "cfg/"


def _is_value(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


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
        """The choices that set this job apart, short (``adafactor | ga4 | recompute``)."""
        return choices_label(self.choices) or self.folder.name

    @property
    def ok(self) -> bool:
        return self.summary.get("status") == "ok"


def choices_label(choices: dict[str, str]) -> str:
    """``adafactor | ga4 | recompute``: the job names' short forms (:func:`effitrain.config.overrides.short_part`)."""
    from effitrain.config.overrides import short_part

    return " | ".join(short_part(key, value, _label_groups()) for key, value in choices.items() if value)


@functools.cache
def _label_groups() -> frozenset[str]:
    """The keys a label shows by their value alone: the config groups, and the sweep folder."""
    from effitrain.config.registry import group_names

    return frozenset(group_names()) | {"sweep"}


@functools.cache
def _run_invariant_keys() -> frozenset[str]:
    """``run_invariant_keys`` of ``conf/config.yaml``: the keys that change neither results nor memory."""
    from omegaconf import OmegaConf

    from effitrain.config.registry import CONF_DIR

    return frozenset(OmegaConf.load(CONF_DIR / "config.yaml").get("run_invariant_keys") or [])


def _overrides(summary: dict) -> dict[str, str]:
    """The job's result-changing overrides, as its summary recorded them (``job/overrides``)."""
    from effitrain.config.overrides import parse, values

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
                    read_metrics(folder / results.METRICS),
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
    invariant = _run_invariant_keys()  # logger, sweep, ...: never a column, even when they differ
    cfg_keys = list(dict.fromkeys(k for job in finished for k in job.summary if k.startswith(CHOICE_PREFIX)
                                  and k.removeprefix(CHOICE_PREFIX) not in invariant))  # fmt: skip
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
    """The job ratios are taken against: the first finished AdamW job (the usual reference) where
    the optimizer varies, else the first finished job. Returns its name for the header and its
    summary."""
    finished = [job for job in jobs if job.ok] or jobs
    adamw = [job for job in finished if job.summary.get("cfg/optimizer") == "adamw"]
    if adamw and len({job.summary.get("cfg/optimizer") for job in finished}) > 1:
        return "AdamW", adamw[0].summary
    return f"job {jobs.index(finished[0]) + 1}", finished[0].summary


def failures(jobs: list[JobResult]) -> list[str]:
    return [
        f"{job.label}: {job.summary.get('status')}: {job.summary.get('error')}" for job in jobs if not job.ok
    ]


def combination_label(job: JobResult) -> str:
    """The job's combination: every choice but the seed ("defaults" when only the seed varies)."""
    return (
        choices_label({k: v for k, v in job.choices.items() if k not in ("seed", "cfg/seed")}) or "defaults"
    )


def seed_groups(jobs: list[JobResult]) -> dict[str, list[JobResult]]:
    """Finished jobs grouped by every choice but the seed: the combinations a seeds study repeats.
    Empty unless some combination ran with more than one seed."""
    groups: dict[str, list[JobResult]] = {}
    for job in jobs:
        if job.ok:
            groups.setdefault(combination_label(job), []).append(job)
    return groups if any(len(group) > 1 for group in groups.values()) else {}


# Summary keys aggregated over the seeds of a combination: eval/loss, the tasks' own metrics, then
# training loss, memory and speed (the seeds table's columns, in this order).
SEED_KEYS = [
    "eval/loss",
    *(metric.key for metric in reported_metrics()),
    "train/loss_mean",
    "mem/step_peak_bytes",
    "speed/samples_per_s",
]


def seed_stats(groups: dict[str, list[JobResult]]) -> list[dict]:
    """Per combination: its label, the number of seeds and, per key some job has, ``<key>/mean`` and
    ``<key>/std`` (the sample standard deviation, n - 1; 0 for a single value)."""
    stats = []
    for label, group in groups.items():
        numbers = {"combination": label, "seeds": len(group)}
        for key in SEED_KEYS:
            values = [job.summary[key] for job in group if _is_value(job.summary.get(key))]
            if values:
                numbers[f"{key}/mean"] = statistics.fmean(values)
                numbers[f"{key}/std"] = statistics.stdev(values) if len(values) > 1 else 0.0
        stats.append(numbers)
    return stats
