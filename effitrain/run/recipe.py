"""One run, as a recipe: prepare -> build -> train -> evaluate -> summarize, whatever happens.

The run derives its micro batch first, before any key of its summary exists; the W&B run starts
before validation, so a rejected config shows there too; :func:`prepare` validates the config
(unless ``train.py``'s front door just did and said so) and decides resume, once; everything a
backend needs is then built once (:func:`effitrain.run.build.build_job`); the backend owns only its
loop and returns what evaluation runs on (:class:`effitrain.backends.base.Backend`).
``summary.json`` is written at the end whatever happens, ``status`` saying how the run ended
(:class:`effitrain.run.summary.Summary`), and the W&B run is finished last, with that summary.
"""

from __future__ import annotations

import logging
from pathlib import Path

from hydra.utils import instantiate
from omegaconf import DictConfig

from effitrain.backends.base import backend_of
from effitrain.config.load import derive
from effitrain.config.validate import validate
from effitrain.memory.flops import mfu_keys
from effitrain.memory.predicted import leaves_out, predicted_keys, run_peak_keys
from effitrain.memory.shared_traces import trace_runs
from effitrain.run import folder_policy, results
from effitrain.run.build import build_job
from effitrain.run.folder_policy import check_output_dir
from effitrain.run.rank_figures import write_rank_figures
from effitrain.run.summary import Summary
from effitrain.run.summary_keys import summary_config_keys
from effitrain.train import resume_point
from effitrain.train.adapters.build import check_builds, parameter_counts
from effitrain.train.distributed import process_state, rank, world_size
from effitrain.train.job import Evaluation, Job, evaluate_job
from effitrain.train.loggers import MetricsFile, build_tracker
from effitrain.train.parallel import strategy_of
from effitrain.util.compat import compile_seconds, reset_accelerator_state
from effitrain.util.interrupts import interrupts_raise, one_line, raise_if_interrupted

log = logging.getLogger(__name__)


def run(cfg: DictConfig, output_dir: str | Path, *, validated: bool = False) -> dict:
    """Train and evaluate one configuration; write and return its summary.

    Never raises for a failed run: the summary's ``status`` is ``ok``, ``failed``, ``oom``,
    ``diverged`` or ``interrupted`` and ``error`` holds a one-line message. A summary already
    marked ok in ``output_dir`` is never overwritten by a failed run. ``validated``: the caller
    validated this very config (``train.py``'s front door), so the run does not again.

    The run folder is locked for the run's duration: a second process aiming at the same folder
    (two sweeps started into one ``hydra.sweep.dir``) is refused and writes nothing there.
    """
    output_dir = Path(output_dir)
    with interrupts_raise(), folder_policy.folder_lock(output_dir) as owner:
        if owner is not None:
            error = f"hydra.run.dir={str(output_dir)!r} is invalid: in use by another run (pid {owner})"
            return {"status": "failed", "error": error, "error_type": "config"}
        state = process_state()
        previous = results.read_summary(output_dir)
        derive(cfg, state.num_processes)
        keys = summary_config_keys(cfg, output_dir, state.num_processes)
        summary = Summary(output_dir, state.is_main_process)
        summary.update({**keys, **results.env_info(str(state.device)), "env/rank": state.process_index})
        tracker = job = kept = None  # the W&B run (rank 0, logger=wandb); the job, once built
        trained = False
        try:
            with summary.recording():
                check_output_dir(output_dir)
                kept = finished_and_kept(cfg, output_dir)
                if kept is not None:  # resume of a finished run: its results stay as they are
                    print(kept)
                    return previous
                if state.is_main_process:  # started before validation: a rejected config shows there
                    tracker = build_tracker(cfg, output_dir, keys)
                    summary.update(tracker.identity_keys() if tracker is not None else {})
                resume = prepare(cfg, output_dir, state.num_processes, validated)
                # what a rerun is compared with
                summary.update({folder_policy.CONFIG_KEY: folder_policy.config_record(cfg)})
                metrics = MetricsFile(output_dir / results.METRICS, resume.step if resume else 0)
                loggers = [metrics, tracker] if tracker is not None else [metrics]
                with metrics, build_job(
                    cfg, output_dir, loggers if state.is_main_process else [], state.device,
                    state.is_main_process, resume,
                ) as job:  # fmt: skip
                    summary.update(describe(job))
                    with job.memory:  # the measured region: training alone
                        train_metrics, evaluation = train(job)
                    summary.update(train_metrics)
                    summary.update(evaluate(job, evaluation))  # not measured: its batches are not training's
                    summary.update(predict_step_peak(job))
                    summary.update(derived_speed(job, summary.figures))
                    raise_if_interrupted()  # one that came after the last step
                    trained = True
        finally:
            if job is not None:  # also for a failed run: how far it got, an OOM's peak
                figures = closing_figures(job, summary.status)
                summary.update(figures)
                if trained:  # every rank got here: the gather is a collective; its prediction beside
                    predicted = {
                        k: v for k, v in summary.figures.items() if k.startswith("mem/") and "predicted" in k
                    }
                    write_rank_figures(output_dir, {**figures, **predicted}, state.process_index)
            if trained:
                summary.finished()  # ok, unless a figure it is judged by is not a number
            if kept is None:
                summary.write(previous)
            if tracker is not None:
                tracker.finish(summary.as_dict())  # last: also when writing summary.json failed
    return summary.as_dict()


def finished_and_kept(cfg: DictConfig, output_dir: Path) -> str | None:
    """With ``resume=auto``, a line saying ``output_dir`` holds a finished ok run that is left as it
    is (None: there is a run to do). A changed config is still refused, naming the key."""
    if cfg.get("resume") != "auto":
        return None
    return folder_policy.finished_run(cfg, output_dir)  # checks the checkpoints' config too


def prepare(
    cfg: DictConfig, output_dir: Path, num_processes: int, validated: bool = False
) -> resume_point.ResumePoint | None:
    """The run's decisions on its derived config, once and in this order: validate it (unless the
    front door just did), refuse to overwrite a finished ok run, find the checkpoint to resume
    from (which also checks the number of processes); None: a fresh start.

    Raises:
        ConfigError: a bad config, a finished run in the folder, or a checkpoint it cannot resume.
    """
    if not validated:
        validate(cfg, num_processes, builds=check_builds)
    if cfg.get("resume") != "auto":  # resume=auto asked the folder policy already (finished_and_kept)
        folder_policy.finished_run(cfg, output_dir)  # a new run never overwrites an ok one
    return resume_point.find_resume(cfg, output_dir)


def describe(job: Job) -> dict:
    """What the run trains: parameter counts, the model's vocabulary and tokenizer, the data."""
    total, trainable = parameter_counts(job.model)
    return {
        "params/total": total,
        "params/trainable": trainable,
        "train/scheduled_steps": job.num_steps,
        "model/vocab_size": job.model.config.vocab_size,
        "model/tokenizer": getattr(job.tokenizer, "name_or_path", None),
        "model/tokenizer_note": getattr(job.tokenizer, "effitrain_note", None),
        **job.data_keys,
    }


def train(job: Job) -> tuple[dict, Evaluation]:
    """Restore the resume point, then hand the job to its backend's ``fit`` (the measured region);
    the train metrics and what the final evaluation runs on.

    A backend that ``loads_checkpoint`` (the Trainer) loads weights, optimizer, scheduler and
    generators itself; the job's restore then sets only effitrain's counts.
    """
    from transformers import set_seed

    # accelerate keeps precision and compile settings in a process-wide singleton: a job must
    # not inherit the previous job's (Hydra's basic launcher runs a multirun in one process).
    reset_accelerator_state()
    set_seed(job.cfg.seed)  # dropout draws the same stream in both backends (the Trainer re-seeds too)
    fit_backend = instantiate(job.cfg.backend)
    job.restore(weights=not backend_of(job.cfg.backend).loads_checkpoint)
    compiling = compile_seconds()
    evaluation = fit_backend(job)
    metrics = job.meter.summary()
    metrics["speed/compile_s"] = compile_seconds() - compiling if job.cfg.compile.enabled else None
    return metrics, evaluation


def evaluate(job: Job, evaluation: Evaluation) -> dict:
    """The final evaluation, logged as the last step's, and the best evaluation of the run."""
    final = evaluate_job(job, evaluation)
    job.log_evaluation(job.meter.summary()["train/steps"], final)
    best_loss, best_step = job.meter.best_eval or (None, None)
    return {**final, "eval/best_loss": best_loss, "eval/best_step": best_step}


def derived_speed(job: Job, figures: dict) -> dict:
    """Model FLOPs utilization, from the predicted FLOPs of a step over its median time."""
    return mfu_keys(
        figures.get("speed/flops_per_step"), figures.get("speed/step_s_median"), job.meter.device,
        job.cfg.precision.mixed_precision,
    )  # fmt: skip


def predict_step_peak(job: Job) -> dict:
    """The tracked step replayed on fake tensors, with the CUDA kernels where the run trains on
    CUDA: ``mem/step_peak_bytes_predicted`` and FLOPs; and the run's peak per phase (the first
    step, a later step, evaluation at ``eval_batch_size`` x ``max_length``, the worst case). A
    sharded run of several processes: each rank's own (:func:`effitrain.memory.sharded.trace_sharded`
    with its rank), beside its measurement in ``summary_ranks.json``."""
    memory = job.step_memory
    if memory is None or not memory.batches:
        return {}
    device = "cuda" if next(job.model.parameters()).device.type == "cuda" else "cpu"
    shapes = {key: value for key, value in memory.batches[0].items() if key != "padded"}
    evaluation = {
        key: ((job.cfg.eval_batch_size, *(job.cfg.max_length for _ in shape[1:])), dtype)
        for key, (shape, dtype) in shapes.items()
    }
    sharded = strategy_of(job.cfg).shards and world_size() > 1
    try:
        if sharded:  # this rank's, as estimate --world-size replays it
            from effitrain.memory.sharded import trace_sharded

            trace = trace_sharded(job.model.config, job.cfg.optimizer, job.cfg, memory.batches, device, evaluation,
                                  world_size=world_size(), rank=rank())  # fmt: skip
        else:  # one forward and backward for the first step and a later one, as estimate replays it
            [trace] = trace_runs(job.model.config, {"run": job.cfg.optimizer}, job.cfg, memory.batches, device,
                                 evaluation).values()  # fmt: skip
    except Exception as error:  # a model fake tensors cannot run: the run's own figures stand
        log.warning("the step peak could not be predicted (%s: %s)", type(error).__name__, error)
        return {"mem/step_peak_predicted_error": one_line(error)}
    warm_up = memory.step > 1
    peak, bound = trace.step_peak(warm_up), trace.step_peak_bound(warm_up)
    keys = {**predicted_keys(peak, trace.flops, bound), **run_peak_keys(trace)}
    if said := leaves_out(job.cfg, sharded):  # never silently below
        keys["mem/step_peak_predicted_leaves_out"] = said
    return keys


def closing_figures(job: Job, status: str) -> dict:
    """What the run measured, however it ended: memory around the measured region (an OOM's peak
    too), the tracked step's categories, and how far an interrupted run got."""
    figures = job.memory.summary()
    if status == "interrupted":
        figures.update(job.meter.summary())
    if job.step_memory is not None:
        figures.update(job.step_memory.summary())
    return figures
