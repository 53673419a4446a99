"""One run: derive -> start the W&B run -> prepare -> open metrics -> build -> train -> evaluate ->
summarize.

The run derives its micro batch once, first; the W&B run starts before validation, so a rejected
config shows there too; :func:`prepare` validates the config (unless ``train.py``'s preflight just
did: :func:`effitrain.config.load.validate_once`) and decides resume, once; everything a backend needs is
then built once (:func:`effitrain.run.job.build_job`); the backend gets a
:class:`~effitrain.train.job.Job`, owns only its loop and returns what evaluation runs on
(:class:`effitrain.backends.Backend`). ``summary.json`` is written at the end whatever happens,
with ``status`` saying how the run ended (:mod:`effitrain.run.outcome`).
"""

from __future__ import annotations

import contextlib
import logging
import time
from dataclasses import dataclass
from pathlib import Path

from hydra.utils import instantiate
from omegaconf import DictConfig

from effitrain.backends.base import backend_of
from effitrain.config.load import apply_effective_batch_size, validate_once
from effitrain.config.validate import check_output_dir
from effitrain.memory.flops import mfu_keys
from effitrain.memory.replay import predicted_keys, run_peak_keys, trace_run
from effitrain.run import results
from effitrain.run.job import build_job
from effitrain.run.outcome import interrupts_raise, one_line, recorded
from effitrain.run.summary_keys import summary_config_keys
from effitrain.train import checkpoint
from effitrain.train.distributed import process_state
from effitrain.train.job import Evaluation, Job, evaluate_job
from effitrain.train.loggers import MetricsFile, build_tracker
from effitrain.util.compat import compile_seconds, reset_accelerator_state

log = logging.getLogger(__name__)


def run(cfg: DictConfig, output_dir: str | Path) -> dict:
    """Train and evaluate one configuration; write and return its summary (see :func:`_run`).

    The run folder is locked for the run's duration: a second process aiming at the same folder
    (two sweeps started into one ``hydra.sweep.dir``) is refused and writes nothing there.
    """
    with interrupts_raise(), results.folder_lock(Path(output_dir)) as owner:
        if owner is not None:
            error = f"hydra.run.dir={str(output_dir)!r} is invalid: in use by another run (pid {owner})"
            return {"status": "failed", "error": error, "error_type": "config"}
        return _run(cfg, output_dir)


def _run(cfg: DictConfig, output_dir: str | Path) -> dict:
    """Train and evaluate one configuration; write and return its summary.

    Never raises for a failed run: the returned summary's ``status`` is ``ok``, ``failed``,
    ``oom``, ``diverged`` or ``interrupted`` and ``error`` holds a one-line message. A summary
    already marked ok in ``output_dir`` is never overwritten by a failed run.

    A stack of contexts: whatever ends the run, how it ended is recorded, what was opened is closed,
    summary.json is written, and the W&B run is finished last, with that summary.
    """
    started = time.perf_counter()
    output_dir = Path(output_dir)
    state = process_state()
    previous = results.read_summary(output_dir)
    # the one derivation of the run's config (the Hydra task's too: it only attaches the Hydra node)
    apply_effective_batch_size(cfg, state.num_processes)
    keys = summary_config_keys(cfg, output_dir, state.num_processes)
    summary = {"status": "failed", "error": None, **keys, **results.env_info(str(state.device))}
    summary["env/rank"] = state.process_index
    tracker = None  # the W&B run (rank 0, logger=wandb)
    kept = None  # set when resume=auto finds a finished run: it stays as it is

    def finish_tracker():
        if tracker is not None:
            tracker.finish(summary)

    def write_summary():
        summary["speed/wall_s"] = time.perf_counter() - started
        if kept is None and state.is_main_process:
            if previous and previous.get("status") == "ok" and summary["status"] != "ok":
                log.error("not overwriting the ok summary.json in %s with a failed run", output_dir)
            elif output_dir.is_dir():
                try:
                    results.write_json_atomic(output_dir / results.SUMMARY, summary)
                except OSError as error:  # a full disk: the run failed, and says so in one line
                    unwritten = f"summary.json could not be written in {output_dir} ({error.strerror})"
                    summary["error"] = f"{summary['error']}; {unwritten}" if summary["error"] else unwritten
                    if summary["status"] == "ok":  # its results are not on disk: not ok
                        summary["status"] = "failed"

    with contextlib.ExitStack() as ending:
        ending.callback(finish_tracker)  # unwound last: also when writing summary.json fails
        ending.callback(write_summary)
        with contextlib.ExitStack() as opened, recorded(summary, output_dir, state.is_main_process):
            check_output_dir(output_dir)
            kept = finished_and_kept(cfg, output_dir)
            if kept is not None:  # resume of a finished run: its results stay as they are
                print(kept)
                return previous
            if state.is_main_process:  # started before validation so a rejected config shows as crashed
                tracker = build_tracker(cfg, output_dir, keys)
                summary.update(tracker.identity_keys() if tracker is not None else {})
            spec = prepare(cfg, output_dir, state.num_processes)
            summary[results.CONFIG_KEY] = results.config_record(cfg)  # what a rerun is compared with
            loggers = []
            if state.is_main_process:  # the same records to every logger: metrics.jsonl, W&B
                metrics = MetricsFile(
                    output_dir / results.METRICS, spec.resume.step if spec.resume else 0
                )
                opened.callback(metrics.close)
                loggers = [metrics, *([tracker] if tracker is not None else [])]
            job = build_job(cfg, output_dir, loggers, state.device, state.is_main_process, spec.resume)
            opened.callback(_close_job, job, summary)
            _train_and_evaluate(job, summary, opened)
    return summary


def finished_and_kept(cfg: DictConfig, output_dir: Path) -> str | None:
    """With ``resume=auto``, a line saying ``output_dir`` holds a finished ok run that is left as it
    is (None: there is a run to do). A changed config is still refused, naming the key."""
    if cfg.get("resume") != "auto":
        return None
    kept = results.finished_run(cfg, output_dir)
    if kept is not None:
        checkpoint.find_resume(cfg, output_dir)  # raises for a config that changed
    return kept


@dataclass(frozen=True)
class RunSpec:
    """What :func:`prepare` decided for a run."""

    resume: checkpoint.ResumePoint | None  # the checkpoint the run continues from; None: a fresh start


def prepare(cfg: DictConfig, output_dir: Path, num_processes: int) -> RunSpec:
    """The run's decisions on its derived config, once and in this order: validate it (unless the
    front door just did), refuse to overwrite a finished ok run, find the checkpoint to resume
    from (which also checks the number of processes).

    Raises:
        ConfigError: a bad config, a finished run in the folder, or a checkpoint it cannot resume.
    """
    validate_once(cfg, num_processes)
    results.finished_run(cfg, output_dir)  # a new run never overwrites an ok one
    return RunSpec(checkpoint.find_resume(cfg, output_dir))


def _train_and_evaluate(job: Job, summary: dict, opened: contextlib.ExitStack) -> None:
    """Train (the measured region), then the final evaluation and the derived figures; status ok."""
    cfg, device = job.cfg, job.meter.device
    summary["params/total"] = sum(p.numel() for p in job.model.parameters())
    summary["params/trainable"] = sum(p.numel() for p in job.model.parameters() if p.requires_grad)
    summary["train/scheduled_steps"] = job.num_steps
    summary["model/vocab_size"] = job.model.config.vocab_size
    summary["model/tokenizer"] = getattr(job.tokenizer, "name_or_path", None)
    summary["model/tokenizer_note"] = getattr(job.tokenizer, "effitrain_note", None)
    summary.update(job.data_keys)
    tracked = job.memory
    opened.callback(lambda: summary.update(tracked.summary()))  # also for a failed run: an OOM's peak
    compiling = compile_seconds()
    with tracked:
        metrics, evaluation = train(job)
        summary.update(metrics)
    summary["speed/compile_s"] = compile_seconds() - compiling if cfg.compile.enabled else None
    final = evaluate_job(job, evaluation)  # outside the measured region: its batches are not training's
    job.log_evaluation(summary["train/steps"], final)
    summary.update(final)
    summary["eval/best_loss"], summary["eval/best_step"] = job.best_eval
    summary.update(predict_step_peak(job))
    summary.update(
        mfu_keys(summary.get("speed/flops_per_step"), summary.get("speed/step_s_median"), device,
                 cfg.precision.mixed_precision)
    )  # fmt: skip
    summary["status"] = "ok"


def train(job: Job) -> tuple[dict, Evaluation]:
    """Restore the resume point, then hand the job to its backend's ``fit`` (the measured region);
    the train metrics and what the final evaluation runs on.

    A backend that ``loads_checkpoint`` (the Trainer) loads weights, optimizer, scheduler and
    generators itself; the shared restore then sets only effitrain's counts.
    """
    from transformers import set_seed

    # accelerate keeps precision and compile settings in a process-wide singleton: a job must
    # not inherit the previous job's (Hydra's basic launcher runs a multirun in one process).
    reset_accelerator_state()
    set_seed(job.cfg.seed)  # dropout draws the same stream in both backends (the Trainer re-seeds too)
    fit_backend = instantiate(job.cfg.backend)
    loads_itself = backend_of(job.cfg.backend).loads_checkpoint
    job.start = job.checkpoints.restore(weights=not loads_itself)
    if job.resume is not None and not loads_itself:
        job._data_resume = (job.start, job.resume.rng_state())
    evaluation = fit_backend(job)
    return job.meter.summary(), evaluation


def predict_step_peak(job: Job) -> dict:
    """The tracked step replayed on fake tensors, with the CUDA kernels where the run trains on
    CUDA: ``mem/step_peak_bytes_predicted`` and FLOPs; and the run's peak per phase (the first
    step, a later step, evaluation at ``eval_batch_size`` x ``max_length``, the worst case)."""
    memory = job.step_memory
    if memory is None or not memory.batches:
        return {}
    device = "cuda" if next(job.model.parameters()).device.type == "cuda" else "cpu"
    shapes = {key: value for key, value in memory.batches[0].items() if key != "padded"}
    evaluation = {
        key: ((job.cfg.eval_batch_size, *(job.cfg.max_length for _ in shape[1:])), dtype)
        for key, (shape, dtype) in shapes.items()
    }
    try:
        trace = trace_run(job.model.config, job.cfg.optimizer, job.cfg, memory.batches, device, evaluation)
    except Exception as error:  # a model fake tensors cannot run: the run's own figures stand
        log.warning("the step peak could not be predicted (%s: %s)", type(error).__name__, error)
        return {"mem/step_peak_predicted_error": one_line(error)}
    warm_up = memory.step > 1
    peak, bound = trace.step_peak(warm_up), trace.step_peak_bound(warm_up)
    return {**predicted_keys(peak, trace.flops, bound), **run_peak_keys(trace)}


def _close_job(job: Job, summary: dict) -> None:
    """After the run, however it ended: no tracker left active, the progress bar closed."""
    if summary["status"] == "interrupted":
        summary.update(job.meter.summary())  # how far it got
    if job.step_memory is not None:
        job.step_memory.end()  # a step that failed while tracked leaves no dispatch mode behind
        summary.update(job.step_memory.summary())
    job.meter.close()  # the progress bar, also after a failed step
