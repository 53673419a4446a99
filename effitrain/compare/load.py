"""Loading a comparison: every job folder of the sweeps, its summary.json and metrics.jsonl, the
choices that tell the jobs apart, and the groups of repeated seeds; and what every part of the
page (verdict, tables, plots) takes from one place so that none contradicts another: compare's
one samples/s (:attr:`JobResult.speed`), the noise rule (:func:`beyond_noise`), which jobs are
ranked (:attr:`JobResult.ranked`) and their kinds (:func:`job_kind`).

Only what each job wrote about itself is read (``job/overrides``, ``cfg/*``); never Hydra's
``.hydra/hydra.yaml``, which holds unresolved interpolations such as ``${now:...}``.
"""

from __future__ import annotations

import functools
import json
import math
import statistics
from dataclasses import dataclass, field
from pathlib import Path

from effitrain.config.errors import ConfigError
from effitrain.config.summary_schema import (  # noqa: F401 (Estimate, beyond_noise: compare's names too)
    NOISE_SIGMAS,
    SAME,
    STEADY_SPEED,
    WARMUP_STEPS,
    Estimate,
    beyond_noise,
    reported_metrics,
)
from effitrain.run import results
from effitrain.run.results import job_folders
from effitrain.train.loggers import read_metrics

MIB = 2**20

# The summary's keys that name what a job was (``cfg/<group>`` and the run-shaping scalars): a
# column when their values differ between jobs and no override column says it already.
CHOICE_PREFIX = "cfg/"


def _is_value(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _finite(value) -> bool:
    return _is_value(value) and math.isfinite(value)


# The figures compare ranks a job by: a job without a finite value of each is shown, never ranked.
# compare's one samples/s (the table's, the plots', the seeds table's and the verdict's) is
# STEADY_SPEED (config/summary_schema), computed here (JobResult.speed).
RANKED_KEYS = ("eval/loss", "mem/step_peak_bytes")


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

    @property
    def unranked(self) -> str | None:
        """Why a job that finished ok is still not ranked, else None: a figure missing or not finite
        (NaN, infinite, null), or no config record (``job/config``, or an older summary's ``cfg/*``):
        a summary edited or forged to say ok is shown, never ranked."""
        if not self.ok:
            return None
        bad = [key for key in RANKED_KEYS if not _finite(self.summary.get(key))]
        if bad:
            return f"{' and '.join(bad)} not a finite number: not ranked"
        if not isinstance(self.summary.get("job/config"), dict) and not any(
            k.startswith("cfg/") for k in self.summary
        ):
            return "no config record (job/config): not ranked"
        return None

    @property
    def ranked(self) -> bool:
        """Finished ok with a finite eval loss and step peak: a job the verdict, the front and the
        baseline may take."""
        return self.ok and self.unranked is None

    @functools.cached_property
    def speed(self) -> Estimate | None:
        """Samples per second: the median over the steady steps, with their spread (1.4826 x the
        median absolute deviation, so one slow step, such as the memory-tracked one, does not widen
        it; unknown under three steps). Without per-step lines, the summary's figure, spread unknown."""
        rates = step_rates(self)
        if not rates:
            overall = self.summary.get("speed/samples_per_s")
            return Estimate(overall, None) if _finite(overall) else None
        middle = statistics.median(rates)
        if len(rates) < 3:
            return Estimate(middle, None)
        return Estimate(middle, 1.4826 * statistics.median(abs(r - middle) for r in rates))

    @functools.cached_property
    def figures(self) -> dict:
        """The summary with compare's own figures beside it: :data:`STEADY_SPEED` and its spread."""
        speed = self.speed
        return {
            **self.summary,
            STEADY_SPEED: speed and speed.value,
            f"{STEADY_SPEED}_std": speed and speed.std,
        }


def step_rates(job: JobResult) -> list[float]:
    """Samples per second of each steady optimizer step in ``metrics.jsonl`` (the first
    :data:`~effitrain.config.summary_schema.WARMUP_STEPS` left out, as the step meter's median does)."""
    lines = [m for m in job.metrics if "train/loss" in m and _is_value(m.get("speed/step_s"))]
    rates, before = [], None
    for index, line in enumerate(lines):
        samples = line.get("train/samples")
        if _is_value(samples) and before is not None and index >= WARMUP_STEPS and line["speed/step_s"] > 0:
            rates.append((samples - before) / line["speed/step_s"])
        before = samples if _is_value(samples) else None
    return rates


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


# What makes two jobs comparable at all: the same task, model and data. Jobs of different kinds
# (a causal LM's 30k-token loss beside a 3-class loss) are compared only within their kind.
KIND_KEYS = ("cfg/task", "cfg/model_name_or_path", "cfg/data")


def job_kind(job: JobResult) -> str:
    """``classification | tiny-bert | synthetic``: the task, model and data the job ran."""
    summary = job.summary
    parts = [summary.get(key) or (summary.get("cfg/model") if key == "cfg/model_name_or_path" else None)
             for key in KIND_KEYS]  # fmt: skip
    return " | ".join(str(part) for part in parts if part is not None)


def kinds(jobs: list[JobResult]) -> dict[str, list[JobResult]]:
    """The jobs by kind (:func:`job_kind`), in job order; jobs without a summary join the first kind."""
    grouped: dict[str, list[JobResult]] = {}
    for job in jobs:
        if job.summary.get("status") != "missing":
            grouped.setdefault(job_kind(job), []).append(job)
    first = next(iter(grouped), "")
    for job in jobs:
        if job.summary.get("status") == "missing":
            grouped.setdefault(first, []).append(job)
    return grouped


def baseline(jobs: list[JobResult], among: list[JobResult] | None = None) -> tuple[str, dict]:
    """The job ratios are taken against, among ``among`` (default: all ``jobs``; one kind's jobs
    when the jobs are of several): the first ranked job of the default combination (each varying
    config group at conf/config.yaml's default: AdamW, full fine-tuning, ...) where the sweep holds
    it, named whole (``adamw | none``; ``AdamW`` where the optimizer alone varies); else the first
    ranked job. A job whose eval loss or step peak is not finite never, unless no job is ranked (then
    the first that finished ok). Returns its name for the header (numbered in ``jobs``) and its summary."""
    among = jobs if among is None else among
    # where none is ranked (a study of memory alone, no eval loss), the first that finished ok
    finished = [job for job in among if job.ranked] or [job for job in among if job.ok] or among
    defaults = default_choices()
    varying = [
        key for key in dict.fromkeys(k for job in finished for k in job.choices)
        if key in defaults and len({_option(job, key) for job in finished}) > 1
    ]  # fmt: skip
    if varying:
        default = [job for job in finished if all(_option(job, key) == defaults[key] for key in varying)]
        if default:
            name = (
                "AdamW"
                if varying == ["optimizer"]
                else choices_label({k: default[0].choices[k] for k in varying})
            )
            return name, default[0].summary
    return f"job {jobs.index(finished[0]) + 1}", finished[0].summary


def _option(job: JobResult, group: str) -> str | None:
    """The job's option of ``group``: its choice where one was set, else what its summary records."""
    return job.choices.get(group) or job.summary.get(f"cfg/{group}")


@functools.cache
def default_choices() -> dict[str, str]:
    """conf/config.yaml's default option of each config group (``optimizer: adamw``, ``adapter: none``)."""
    from omegaconf import OmegaConf

    from effitrain.config.registry import CONF_DIR

    found = {}
    for entry in OmegaConf.to_container(OmegaConf.load(CONF_DIR / "config.yaml")).get("defaults", []):
        if isinstance(entry, dict):
            found.update(
                {
                    str(k): str(v)
                    for k, v in entry.items()
                    if v is not None and not str(k).startswith("override")
                }
            )
    return found


def failures(jobs: list[JobResult]) -> list[str]:
    """One line per job that did not finish ok or is not ranked, with why."""
    return [f"{job.label}: {job.summary.get('status')}: {job.summary.get('error') or job.unranked}"
            for job in jobs if not job.ranked]  # fmt: skip


def combination_label(job: JobResult, shared: frozenset[str] = frozenset()) -> str:
    """The job's combination: every choice but the seed and the ``shared`` ones (those its kind's
    jobs all share), "defaults" when nothing else varies."""
    skip = {"seed", "cfg/seed", *shared}
    return choices_label({k: v for k, v in job.choices.items() if k not in skip}) or "defaults"


def seed_groups(jobs: list[JobResult]) -> dict[str, list[JobResult]]:
    """Ranked jobs grouped by every choice but the seed: the combinations a seeds study repeats.
    Empty unless some combination ran with more than one seed."""
    groups: dict[str, list[JobResult]] = {}
    for job in jobs:
        if job.ranked:
            groups.setdefault(combination_label(job), []).append(job)
    return groups if any(len(group) > 1 for group in groups.values()) else {}


# Summary keys aggregated over the seeds of a combination: eval/loss, the tasks' own metrics, then
# training loss, memory and speed (the seeds table's columns, in this order).
SEED_KEYS = [
    "eval/loss",
    *(metric.key for metric in reported_metrics()),
    "train/loss_mean",
    "mem/step_peak_bytes",
    STEADY_SPEED,
]


def seed_stats(groups: dict[str, list[JobResult]]) -> list[dict]:
    """Per combination: its label, the number of seeds and, per key some job has, ``<key>/mean`` and
    ``<key>/std`` (the sample standard deviation, n - 1; 0 for a single value)."""
    stats = []
    for label, group in groups.items():
        numbers = {"combination": label, "seeds": len(group)}
        for key in SEED_KEYS:
            values = [job.figures[key] for job in group if _finite(job.figures.get(key))]
            if values:
                numbers[f"{key}/mean"] = statistics.fmean(values)
                numbers[f"{key}/std"] = statistics.stdev(values) if len(values) > 1 else 0.0
        stats.append(numbers)
    return stats
