"""Whether a comparison's jobs learned anything: each combination's eval loss against what its task
scores without learning (a causal LM's unigram loss; a classifier's loss of predicting the class
prior or uniform), and the verdict's line when nothing was. Where quality has not moved, the
verdict decides on memory and speed alone (:mod:`effitrain.compare.verdict`)."""

from __future__ import annotations

import functools
import json
import math

from effitrain.compare.combinations import Combination
from effitrain.compare.load import SAME, Estimate, JobResult, _finite, beyond_noise
from effitrain.config.summary_schema import reported_metrics

# The quality metrics whose equality across all jobs means nothing was learned measurably: the tasks'.
METRICS = reported_metrics()
QUALITY_KEYS = tuple(metric.key for metric in METRICS)


UNIGRAM = "the unigram loss (ln of the training split's unigram perplexity)"
PRIOR = "the loss of a prediction that ignores the text (the training labels' class prior, or uniform)"


def reference_loss(job: JobResult) -> tuple[str, float] | None:
    """What the job's eval loss must beat to have learned anything, and its value: a causal LM's
    unigram loss (the log of ``train/unigram_perplexity``); a classifier's loss of predicting,
    whatever the text, the training labels' class prior or the uniform distribution, whichever
    scores better on the eval labels (an untrained head predicts about uniformly, and beats a
    prior that the eval split does not share). None where it cannot be known here."""
    blind = job.summary.get("eval/input_blind_loss")  # written by the run since it knows (no data read here)
    if _finite(blind):
        causal = job.summary.get("cfg/task") == "causal_lm"
        return (UNIGRAM if causal else PRIOR), blind
    unigram = job.summary.get("train/unigram_perplexity")  # an older summary's
    if _finite(unigram) and unigram > 0:
        return UNIGRAM, math.log(unigram)
    config = job.summary.get("job/config")
    if job.summary.get("cfg/task") != "classification" or not isinstance(config, dict):
        return None
    data = {k.removeprefix("data."): v for k, v in config.items() if k.startswith("data.")}
    loss = _prior_loss(json.dumps(data, sort_keys=True, default=str)) if data else None
    return None if loss is None else (PRIOR, loss)


@functools.cache
def _prior_loss(data: str) -> float | None:
    """The eval labels' cross-entropy under the training labels' frequencies, or under the uniform
    distribution where that is lower; the data loaded as the job loaded it (its recorded ``data``
    node): a summary written before the run recorded ``eval/input_blind_loss`` itself."""
    from omegaconf import OmegaConf

    from effitrain.train.labels import input_blind_loss
    from effitrain.train.tasks import Classification  # imports torch: the contract's one ignored import

    node: dict = {}
    for key, value in json.loads(data).items():
        *parents, last = key.split(".")
        inner = node
        for part in parents:
            inner = inner.setdefault(part, {})
        inner[last] = value
    try:
        raw = Classification().load(OmegaConf.create(node))
    except (
        Exception
    ):  # the reference is context: data that cannot be read here (moved, hub offline) does not stop compare
        return None
    return input_blind_loss(raw.train["label"], raw.eval["label"], len(raw.label_names))


def learning(combos: list[Combination]) -> tuple[str | None, list[str]]:
    """The line that says nothing was learned (or None) and the note on what learning is judged
    against. A combination learned when its eval loss is below its task's reference
    (:func:`reference_loss`) beyond noise; where no reference is known, nothing learned means every
    quality metric the same for all."""
    references = {id(c): reference_loss(c.jobs[0]) for c in combos}
    known = [(c, references[id(c)]) for c in combos if references[id(c)] is not None]
    losses = [c.quality.value for c in combos if c.quality is not None]
    if not losses:
        return None, []
    if not known:
        return _all_the_same(combos), []
    learned = [
        c for c, (_, value) in known if c.quality and beyond_noise(c.quality, Estimate(value, 0.0), True)
    ]
    what = known[0][1][0]
    values = sorted({round(value, 4) for _, (_, value) in known})
    shown = f"{values[0]:.4f}" if len(values) == 1 else f"{values[0]:.4f} to {values[-1]:.4f}"
    learners = ", ".join(c.numbered for c in learned) or "none"
    note = (f"learning: judged against {what}, {shown}; below it beyond noise (learned): {learners}.")  # fmt: skip
    if learned or len(known) < len(combos):
        return None, [note]
    # accuracy may differ by chance where no job learned (0.28 against 0.58): each range is said
    scores = []
    for key, name, digits in (("eval/loss", "eval loss", 4), *((m.key, m.label, m.digits) for m in METRICS)):
        values = [job.summary[key] for c in combos for job in c.jobs if _finite(job.summary.get(key))]
        if values:
            scores.append(_span(name, values, digits))
    flat = (f"No job learned anything measurable: {', '.join(scores)}; no eval loss is below {shown}, "
            f"{what}, beyond noise. Quality cannot decide here: train longer (max_steps, epochs), raise "
            "optimizer.lr, or give the model a task it can learn (more data.num_train), then compare again.")  # fmt: skip
    return flat, [note]


def _span(name: str, values: list[float], digits: int) -> str:
    low, high = f"{min(values):.{digits}f}", f"{max(values):.{digits}f}"
    return f"{name} {low}" if low == high else f"{name} {low} to {high}"


def _all_the_same(combos: list[Combination]) -> str | None:
    """Without a reference: one line when every job scored the same on every quality metric (eval
    losses within the sampling error, or 0.1%)."""
    done = [job.summary for c in combos for job in c.jobs]
    if len(done) < 2:
        return None
    losses = [s["eval/loss"] for s in done if _finite(s.get("eval/loss"))]
    if len(losses) < len(done):
        return None
    sems = sorted(s["eval/loss_sem"] for s in done if _finite(s.get("eval/loss_sem")))
    tolerance = max([SAME * max(abs(v) for v in losses), *sems[:1]])
    if max(losses) - min(losses) > tolerance:
        return None
    said = []
    for key in QUALITY_KEYS:
        values = {round(s[key], 6) for s in done if _finite(s.get(key))}
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
