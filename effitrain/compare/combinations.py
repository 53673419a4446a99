"""The verdict's units: a combination (the ranked jobs of one kind that differ only in their seed)
with its step peak, quality and speed, each with one standard deviation, and each one's ratio
against the baseline's (:class:`Ratio`, within noise or not)."""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field

from effitrain.compare.load import (
    NOISE_SIGMAS,
    SAME,
    Estimate,
    JobResult,
    _finite,
    combination_label,
    job_kind,
)
from effitrain.config.summary_schema import BETTER, LOWER, STEADY_SPEED

# A combination's axes, each the summary figure it is measured by; which way is better is the
# figure's own (config/summary_schema.BETTER), as in the table.
AXIS_KEYS = {"memory": "mem/step_peak_bytes", "quality": "eval/loss", "speed": STEADY_SPEED}
AXES = tuple(AXIS_KEYS)


def lower_is_better(axis: str) -> bool:
    return BETTER[AXIS_KEYS[axis]] == LOWER


@dataclass
class Ratio:
    """A combination's value over the baseline's, with one standard deviation of the ratio."""

    value: float
    std: float | None
    base: bool = False  # the baseline's own row

    @property
    def noise(self) -> bool:
        """Within noise of the baseline; an unknown spread (fewer than three steady steps) is no
        evidence either."""
        if self.base or self.std is None:
            return True
        return abs(self.value - 1.0) < max(NOISE_SIGMAS * self.std, SAME)

    def text(self, digits: int = 2) -> str:
        if self.base:
            return "1 (base)"
        cell = f"{self.value:.{digits}f}"
        if self.std is None:
            return cell + " ?"
        if self.std:
            cell += f" ± {self.std:.{digits}f}"
        return cell + (" ~" if self.noise else "")


def ratio(a: Estimate | None, b: Estimate | None, is_base: bool) -> Ratio | None:
    if a is None or b is None or not b.value:
        return None
    value = a.value / b.value
    if a.relative is None or b.relative is None:
        std = None
    else:
        std = abs(value) * math.hypot(a.relative, b.relative)
    return Ratio(value, std, base=is_base)


@dataclass
class Combination:
    numbers: list[int]  # the jobs' numbers, 1-based, as in the table and the plots
    label: str
    jobs: list[JobResult]
    kind: str = ""
    memory: Estimate | None = None
    quality: Estimate | None = None
    speed: Estimate | None = None
    ratios: dict[str, Ratio | None] = field(default_factory=dict)

    @property
    def numbered(self) -> str:
        """Its jobs' numbers, ``1=4``."""
        return "=".join(map(str, self.numbers))

    @property
    def name(self) -> str:
        return f"{self.numbered}. {self.label}"


def _over_seeds(values: list[Estimate]) -> Estimate | None:
    """One seed: its own estimate; several: their mean, and the spread between them."""
    if len(values) > 1:
        return Estimate(statistics.fmean(v.value for v in values), statistics.stdev(v.value for v in values))
    return values[0] if values else None


def combinations(jobs: list[JobResult]) -> list[Combination]:
    """The ranked jobs grouped by kind and every choice but the seed, in job order."""
    groups: dict[tuple[str, str], Combination] = {}
    for number, job in enumerate(jobs, 1):
        if not job.ranked:
            continue
        label = combination_label(job)  # as the seeds table groups them
        group = groups.setdefault((job_kind(job), label), Combination([], label, [], job_kind(job)))
        group.numbers.append(number)
        group.jobs.append(job)
    kinds_seen = {c.kind for c in groups.values()}
    for kind in kinds_seen if len(kinds_seen) > 1 else []:  # named by what differs within their kind
        mine = [c for c in groups.values() if c.kind == kind]
        members = [job for c in mine for job in c.jobs]
        shared = frozenset(k for k in members[0].choices if len({job.choices.get(k) for job in members}) == 1)
        for combo in mine if len(mine) > 1 else []:  # one combination keeps every choice as its name
            combo.label = combination_label(combo.jobs[0], shared)
    for group in groups.values():
        summaries = [job.summary for job in group.jobs]
        # bytes of tensors: exact for one run
        group.memory = _over_seeds([Estimate(s["mem/step_peak_bytes"], 0.0) for s in summaries
                                    if _finite(s.get("mem/step_peak_bytes"))])  # fmt: skip
        sems = [s.get("eval/loss_sem") for s in summaries]
        group.quality = _over_seeds([Estimate(s["eval/loss"], sem if _finite(sem) else None)
                                     for s, sem in zip(summaries, sems) if _finite(s.get("eval/loss"))])  # fmt: skip
        group.speed = _over_seeds([job.speed for job in group.jobs if job.speed is not None])
    return list(groups.values())
