"""What a prediction says beside its figures: the summary's predicted keys
(``mem/step_peak_predicted/*``, ``mem/run_peak_predicted/*``), why a figure can be above the step
(a bound, :data:`BOUND_COUNTED_STATE`, :data:`BOUND_ASSUMED_BRANCH`) and what the step holds that
the replay does not, so the measurement can be above it (:func:`leaves_out`): never silently below.
"""

from __future__ import annotations

from effitrain.memory.step_peak import peak_keys

# The Trainer's own loss scalars (its step's loss, kept detached, and the running total it adds it
# to: 0-d fp32 tensors) are held in its step, which the replay (the accelerate loop's step) is not:
# measured 0 to 8 bytes above the prediction (tests/memory/test_memory.py).
TRAINER_LEAVES_OUT = "the Trainer's own loss scalars (up to 8 bytes)"

# What one rank's replay does not hold, said beside its figures (the run's summary, estimate): gloo's
# reduce-scatter clone is replayed (equal to the byte, tests/train/test_sharding.py); with accumulation
# a rank was measured 18,056 B (0.1%) above once, on either rank from run to run, not explained yet.
SHARDED_LEAVES_OUT = (
    "what the backend holds outside the replayed calls (with accumulation one rank of two was measured "
    "0.1% above): the measured step peak can exceed this prediction by it"
)


def leaves_out(cfg, sharded: bool) -> str | None:
    """What a run's step holds that its prediction does not, said beside the prediction (the run's
    ``mem/step_peak_predicted_leaves_out``, estimate's ``step_peak_leaves_out``): the measured step
    peak can exceed the prediction by it. None where the replay holds all of it."""
    from effitrain.config.registry import uses_trainer

    parts = []
    if uses_trainer(cfg):
        parts.append(TRAINER_LEAVES_OUT)
    if sharded:
        parts.append(SHARDED_LEAVES_OUT)
    return "; ".join(parts) or None


def predicted_keys(peak: dict[str, int], flops: int, bound: str | None = None) -> dict:
    """The predicted step peak's keys, with ``mem/step_peak_predicted_bound``: why the figures are an
    upper bound of the step rather than the step itself (None where the replay is the step)."""
    return {
        **peak_keys(peak, "_predicted"),
        "speed/flops_per_step": flops,
        "mem/step_peak_predicted_bound": bound,
    }


def run_peak_keys(trace) -> dict:
    """``mem/run_peak_bytes_predicted`` (the largest phase), ``mem/run_peak_predicted/<phase>_bytes``
    and ``mem/run_peak_predicted_bound`` (as ``mem/step_peak_predicted_bound``, for the largest phase)
    of a :class:`effitrain.memory.replay.Trace`."""
    keys = {
        "mem/run_peak_bytes_predicted": trace.run_peak["total"],
        "mem/run_peak_predicted_bound": trace.bounds.get(trace.run_peak_phase),
    }
    keys.update(
        {f"mem/run_peak_predicted/{phase}_bytes": peak["total"] for phase, peak in trace.phases.items()}
    )
    return keys


# Why a predicted figure can exceed the real one (Trace.bounds); elsewhere the replay is the step.
BOUND_COUNTED_STATE = (
    "the optimizer state is counted, not replayed: held from the first step's start, where the real "
    "step creates it"
)
BOUND_ASSUMED_BRANCH = (
    "the update compares values fake tensors lack (APOLLO's norm-growth limiter): the branch that "
    "holds more memory is taken"
)
