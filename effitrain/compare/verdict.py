"""The verdict: which combination to use, or that the evidence does not decide.

Per combination (the jobs that differ only in their seed; every job on its own without repeated
seeds) three ratios against the baseline (:func:`effitrain.compare.load.baseline`: AdamW where the
optimizer varies, else job 1), each with one standard deviation:

- step peak: ``mem/step_peak_bytes`` / the baseline's (exact bytes; the spread over seeds, if any);
- quality: ``eval/loss`` / the baseline's (lower is better); the spread over seeds where a
  combination ran with several, else the eval split's sampling error (``eval/loss_sem``);
- speed: samples per second / the baseline's, from every optimizer step's own time in
  ``metrics.jsonl`` (the steady steps: the first :data:`WARMUP_STEPS` left out), so a machine that
  was busy shows as a wide spread instead of a ranking.

A ratio is *within noise* when it is less than two of its standard deviations (or 0.1%) away from
1. The front holds the combinations no other one beats beyond noise on one axis without being worse beyond
noise on another.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field

from effitrain.compare.load import MIB, JobResult, _is_value, baseline, combination_label
from effitrain.train.step import WARMUP_STEPS
from effitrain.train.tasks import reported_metrics

NOISE_SIGMAS = 2.0  # a ratio closer to 1 than this many standard deviations is noise
# Closer than this (relative) is the same, whatever the spread: a step peak 4 bytes apart under
# the other backend, float noise in the seventh digit of a loss.
SAME = 1e-3
# The quality metrics whose equality across all jobs means nothing was learned measurably: the tasks'.
QUALITY_KEYS = tuple(metric.key for metric in reported_metrics())
AXES = ("memory", "quality", "speed")


@dataclass
class Estimate:
    """A value with one standard deviation (``None``: unknown)."""

    value: float
    std: float | None

    @property
    def relative(self) -> float | None:
        return None if self.std is None or not self.value else abs(self.std / self.value)


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
    memory: Estimate | None = None
    quality: Estimate | None = None
    speed: Estimate | None = None
    ratios: dict[str, Ratio | None] = field(default_factory=dict)

    @property
    def name(self) -> str:
        return f"{'='.join(map(str, self.numbers))}. {self.label}"


def step_rates(job: JobResult) -> list[float]:
    """Samples per second of each steady optimizer step in ``metrics.jsonl``."""
    lines = [m for m in job.metrics if "train/loss" in m and _is_value(m.get("speed/step_s"))]
    rates, before = [], None
    for index, line in enumerate(lines):
        samples = line.get("train/samples")
        if _is_value(samples) and before is not None and index >= WARMUP_STEPS and line["speed/step_s"] > 0:
            rates.append((samples - before) / line["speed/step_s"])
        before = samples if _is_value(samples) else None
    return rates


def _robust(values: list[float]) -> Estimate | None:
    """The median, with the spread of the values as a standard deviation (1.4826 x the median
    absolute deviation: one slow step, such as the memory-tracked one, does not widen it)."""
    if not values:
        return None
    middle = statistics.median(values)
    if len(values) < 3:
        return Estimate(middle, None)
    mad = statistics.median(abs(v - middle) for v in values)
    return Estimate(middle, 1.4826 * mad)


def _over_seeds(values: list[float], one_std: float | None) -> Estimate | None:
    if not values:
        return None
    if len(values) > 1:
        return Estimate(statistics.fmean(values), statistics.stdev(values))
    return Estimate(values[0], one_std)


def combinations(jobs: list[JobResult]) -> list[Combination]:
    """The finished jobs grouped by every choice but the seed, in job order."""
    groups: dict[str, Combination] = {}
    for number, job in enumerate(jobs, 1):
        if not job.ok:
            continue
        label = combination_label(job)  # as the seeds table groups them
        group = groups.setdefault(label, Combination([], label, []))
        group.numbers.append(number)
        group.jobs.append(job)
    for group in groups.values():
        summaries = [job.summary for job in group.jobs]
        peaks = [s["mem/step_peak_bytes"] for s in summaries if _is_value(s.get("mem/step_peak_bytes"))]
        group.memory = _over_seeds(peaks, 0.0)  # bytes of tensors: exact for one run
        losses = [s["eval/loss"] for s in summaries if _is_value(s.get("eval/loss"))]
        sem = summaries[0].get("eval/loss_sem")
        group.quality = _over_seeds(losses, sem if _is_value(sem) else None)
        group.speed = _robust([rate for job in group.jobs for rate in step_rates(job)])
        if group.speed is None:  # no per-step lines: the summary's figure, spread unknown
            speeds = [s["speed/samples_per_s"] for s in summaries if _is_value(s.get("speed/samples_per_s"))]
            group.speed = Estimate(statistics.fmean(speeds), None) if speeds else None
    return list(groups.values())


def dominates(a: Combination, b: Combination) -> bool:
    """``a`` is better than ``b`` beyond noise on some axis and worse beyond noise on none."""
    return any(dominates_axis(a, b, axis) for axis in AXES) and not any(
        dominates_axis(b, a, axis) for axis in AXES
    )


@dataclass
class Verdict:
    baseline: str  # "AdamW" or "job 1"
    combos: list[Combination]
    front: list[Combination]
    lines: list[str]  # the verdict in words, first the decision
    headers: list[str]
    rows: list[list[str]]
    notes: list[str]

    def text(self) -> str:
        from effitrain.compare.render import text_table

        parts = (
            ["Verdict", *self.lines, "", text_table(self.headers, self.rows)]
            if self.rows
            else ["Verdict", *self.lines]
        )
        return "\n".join(parts + [f"  {note}" for note in self.notes])

    def summary(self) -> dict:
        """The verdict as flat keys, for the W&B comparison run's summary."""
        keys = {"verdict": "\n".join(self.lines), "verdict/baseline": self.baseline,
                "verdict/front": [c.name for c in self.front]}  # fmt: skip
        for combo in self.combos:
            for axis, value in combo.ratios.items():
                if value is not None:
                    keys[f"verdict/{combo.name}/{axis}_x_base"] = value.value
                    keys[f"verdict/{combo.name}/{axis}_x_base_std"] = value.std
        return keys


def _nothing_learned(jobs: list[JobResult]) -> str | None:
    """One line when every finished job scored the same on every quality metric (and eval losses
    agree within the sampling error, or to 0.1%), with what to change; else None."""
    done = [job.summary for job in jobs if job.ok]
    if len(done) < 2:
        return None
    losses = [s["eval/loss"] for s in done if _is_value(s.get("eval/loss"))]
    if len(losses) < len(done):
        return None
    sems = sorted(s["eval/loss_sem"] for s in done if _is_value(s.get("eval/loss_sem")))
    tolerance = max([1e-3 * max(abs(v) for v in losses), *sems[:1]])
    if max(losses) - min(losses) > tolerance:
        return None
    said = []
    for key in QUALITY_KEYS:
        values = {round(s[key], 6) for s in done if _is_value(s.get(key))}
        if len(values) > 1:
            return None
        if values:
            said.append(f"{key.removeprefix('eval/')} {values.pop():.4f}")
    said.insert(0, f"eval loss {min(losses):.4f} to {max(losses):.4f}")
    return (
        f"No job learned anything measurable: all {len(done)} have {', '.join(said)}. Quality cannot "
        "decide here: train longer (max_steps, epochs), raise optimizer.lr, or give the model a task "
        "it can learn (more data.num_train), then compare again."
    )


def _fmt_pct(ratio_: Ratio, what_less: str, what_more: str) -> str:
    change = ratio_.value - 1.0
    return f"{abs(change) * 100:.0f}% {what_less if change < 0 else what_more}"


def verdict(jobs: list[JobResult]) -> Verdict:
    """The combinations' ratios against the baseline, the front, and the decision in words."""
    name, base_summary = baseline(jobs)
    combos = combinations(jobs)
    base_combo = next((c for c in combos if any(j.summary is base_summary for j in c.jobs)), None)
    if base_combo is None or not combos:
        lines = ["No job finished ok: nothing to compare (see the jobs that did not finish below)."]
        return Verdict(name, combos, [], lines, [], [], [])
    for combo in combos:
        is_base = combo is base_combo
        combo.ratios = {
            "memory": ratio(combo.memory, base_combo.memory, is_base),
            "quality": ratio(combo.quality, base_combo.quality, is_base),
            "speed": ratio(combo.speed, base_combo.speed, is_base),
        }
    front = [c for c in combos if not any(dominates(o, c) for o in combos if o is not c)]
    lines = []
    flat = _nothing_learned(jobs)
    if len(combos) == 1:
        lines.append(f"One combination ({combos[0].name}): nothing to choose between.")
    elif len(front) == 1:
        winner = front[0]
        reasons = []
        for axis, less, more in (("memory", "less memory", "more memory"), ("quality", "lower eval loss",
                                 "higher eval loss"), ("speed", "slower", "faster")):  # fmt: skip
            r = winner.ratios[axis]
            if r is not None and not r.base:
                unknown = f"{axis} spread unknown" if r.std is None else f"{axis} within noise"
                reasons.append(unknown if r.noise else _fmt_pct(r, less, more))
        why = f"against {name}: {', '.join(reasons)}" if reasons else "it is the baseline"
        lines.append(f"Use {winner.name} ({why}); no other combination beats it beyond noise on "
                     "memory, quality or speed.")  # fmt: skip
    else:
        lines.append(f"The evidence does not decide between {len(front)} combinations on the "
                     "memory/quality/speed front; pick by the constraint you have:")  # fmt: skip
        for axis, what, lower in (("memory", "least step peak", True), ("quality", "lowest eval loss", True),
                                  ("speed", "fastest", False)):  # fmt: skip
            placed = [c for c in front if getattr(c, axis) is not None]
            if not placed:
                continue
            best = (min if lower else max)(placed, key=lambda c: getattr(c, axis).value)
            tied = [c for c in placed if c is not best and not dominates_axis(best, c, axis)]
            r = best.ratios[axis]
            if len(tied) == len(placed) - 1:
                lines.append(f"  {axis}: the front's combinations are within noise of each other")
                continue
            figure = "" if r is None else " (the baseline)" if r.base else f" ({r.text()} x {name})"
            tie = f"; the same within noise: {', '.join(_numbers(c) for c in tied)}" if tied else ""
            lines.append(f"  {what}: {best.name}{figure}{tie}")
    others = [c.name for c in combos if c not in front]
    if front and len(combos) > 1:
        named = [c.name for c in front] if len(front) <= 6 else [_numbers(c) for c in front]
        beaten = f"; beaten: {', '.join(_numbers(c) for c in combos if c not in front)}" if others else ""
        lines.append(f"Front (memory/quality/speed): {', '.join(named)}{beaten}.")
    if flat:
        lines.insert(0, flat)
    notes = [f"ratios: x {name} (1 = same; step peak and eval loss: lower is better, samples/s: higher);"
             f" ± one standard deviation; ~ within noise (less than {NOISE_SIGMAS:g} of them, or 0.1%, from 1)."]  # fmt: skip
    if any(r is not None and r.std is None and not r.base for c in combos for r in c.ratios.values()):
        notes.append("? no spread (fewer than 3 steady steps, or no eval/loss_sem): not evidence either.")
    seeds = max(len(c.jobs) for c in combos)
    if seeds == 1:
        sems = [c.quality.std for c in combos if c.quality and c.quality.std]
        samples = base_summary.get("eval/samples")
        where = f" ({samples} examples, eval loss ± {statistics.fmean(sems):.4f})" if sems and samples else ""
        notes.append(f"one seed per combination: quality differences below the eval split's sampling "
                     f"error{where} are not evidence; repeat seeds (seed=1,2,3) to measure them.")  # fmt: skip
    else:
        notes.append("quality: mean ± standard deviation over each combination's seeds.")
    notes.append("speed: median samples/s over each job's steady optimizer steps (metrics.jsonl), ± their "
                 "spread: a busy machine widens it.")  # fmt: skip
    headers = ["#", "combination", "step peak MiB", f"step peak x {name}", "eval loss",
               f"eval loss x {name}", "samples/s", f"samples/s x {name}", "front"]  # fmt: skip
    rows = []
    for combo in combos:
        cells = ["=".join(map(str, combo.numbers)), combo.label]
        for axis, scale, digits in (("memory", MIB, 1), ("quality", 1, 4), ("speed", 1, 1)):
            estimate, r = getattr(combo, axis), combo.ratios[axis]
            value = ""
            if estimate is not None:
                value = f"{estimate.value / scale:.{digits}f}"
                if estimate.std:
                    value += f" ± {estimate.std / scale:.{digits}f}"
            cells += [value, "" if r is None else r.text(3 if axis == "memory" else 2)]
        cells.append("yes" if combo in front else "")
        rows.append(cells)
    return Verdict(name, combos, front, lines, headers, rows, notes)


def _numbers(combo: Combination) -> str:
    return "=".join(map(str, combo.numbers))


def dominates_axis(a: Combination, b: Combination, axis: str) -> bool:
    """``a`` better than ``b`` on one axis beyond noise (an unknown spread never decides; exact
    step peaks decide when more than :data:`SAME` apart)."""
    x, y = getattr(a, axis), getattr(b, axis)
    if x is None or y is None or x.std is None or y.std is None:
        return False
    gap = (y.value - x.value) if axis != "speed" else (x.value - y.value)
    return gap > max(NOISE_SIGMAS * math.hypot(x.std, y.std), SAME * max(abs(x.value), abs(y.value)))
