"""Few-step runs through both backends: result files, keys, learning, step counts."""

from __future__ import annotations

import copy
import json
import math
import signal
import subprocess
import sys
import time

import pytest
import torch
from hydra.utils import instantiate

from tests.helpers.run import REPO, TINY, compose, read_metrics, run_job, train_py

REQUIRED_KEYS = {
    "status", "error",
    "cfg/optimizer", "cfg/backend", "cfg/compile", "cfg/precision", "cfg/gradient_accumulation_steps",
    "cfg/micro_batch_size", "cfg/effective_batch_size", "cfg/model", "cfg/data", "cfg/seed",
    "params/total", "params/trainable",
    "train/loss", "train/steps", "train/samples", "train/tokens",
    "eval/loss", "eval/accuracy", "eval/f1",
    "speed/samples_per_s", "speed/tokens_per_s", "speed/step_s_median", "speed/compile_s", "speed/wall_s",
    "env/torch", "env/transformers", "env/accelerate", "env/bitsandbytes", "env/device", "env/git_commit",
}  # fmt: skip
STEP_KEYS = {"step", "train/loss", "lr", "grad_norm", "train/samples", "train/tokens", "speed/step_s"}
FEW_STEPS = ["max_steps=3", "data.num_train=48", "data.num_eval=16"]


def eval_reference(run_dir, *overrides: str) -> dict:
    """eval/loss, accuracy and macro F1 of the run's saved final weights on its eval split, computed
    here: the split tokenized as one batch, transformers' own loss, scikit-learn's F1."""
    from safetensors.torch import load_model
    from sklearn.metrics import f1_score

    from effitrain.train.modeling import build_model, build_tokenizer
    from effitrain.train.resume_point import list_checkpoints

    cfg = compose(*overrides)
    raw = instantiate(cfg.data)
    tokenizer = build_tokenizer(cfg.model)
    model = build_model(cfg.model, len(raw.label_names), tokenizer).eval()
    load_model(model, str(list_checkpoints(run_dir)[-1][1] / "model.safetensors"))
    batch = tokenizer(
        list(raw.eval["text"]), truncation=True, max_length=cfg.max_length, padding=True, return_tensors="pt"
    )
    labels = torch.tensor(list(raw.eval["label"]))
    with torch.no_grad():
        out = model(**batch, labels=labels)
    predicted = out.logits.argmax(-1)
    return {
        "eval/loss": out.loss.item(),
        "eval/accuracy": (predicted == labels).double().mean().item(),
        "eval/f1": f1_score(labels, predicted, labels=range(len(raw.label_names)), average="macro"),
    }


@pytest.mark.parametrize("backend", ["accelerator", pytest.param("trainer", marks=pytest.mark.slow)])
@pytest.mark.parametrize(
    "optimizer", ["adamw", *(pytest.param(o, marks=pytest.mark.slow) for o in ("adafactor", "adam8bit"))]
)
def test_few_steps_write_every_required_key(tmp_path, optimizer, backend):
    overrides = [f"optimizer={optimizer}", f"backend={backend}", *FEW_STEPS]
    summary = run_job(tmp_path, *overrides, "checkpoint_every=3")  # the final weights, for the reference
    assert summary["status"] == "ok", summary["error"]
    on_disk = json.loads((tmp_path / "summary.json").read_text())
    assert REQUIRED_KEYS <= set(on_disk)
    assert on_disk["cfg/optimizer"] == optimizer and on_disk["cfg/backend"] == backend
    assert on_disk["train/steps"] == 3 and on_disk["train/samples"] == 3 * 8
    assert on_disk["cfg/effective_batch_size"] == 8
    lines = read_metrics(tmp_path)
    assert [line["step"] for line in lines] == [1, 2, 3]
    assert all(STEP_KEYS <= set(line) for line in lines)
    assert on_disk["train/loss"] == lines[-1]["train/loss"]
    assert on_disk["train/tokens"] == lines[-1]["train/tokens"] > 0
    reference = eval_reference(tmp_path, *overrides)
    assert on_disk["eval/loss"] == pytest.approx(reference["eval/loss"], rel=1e-5)
    assert on_disk["eval/accuracy"] == pytest.approx(reference["eval/accuracy"], abs=1e-7)
    assert on_disk["eval/f1"] == pytest.approx(reference["eval/f1"], abs=1e-12)
    assert on_disk["eval/samples"] == 16
    assert on_disk["speed/samples_per_s"] == pytest.approx(
        on_disk["train/samples"] / on_disk["speed/train_s"]
    )
    assert on_disk["speed/wall_s"] > on_disk["speed/train_s"] > 0


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["accelerator", "trainer"])
def test_loss_falls_clearly_on_a_learnable_task(tmp_path, backend):
    summary = run_job(tmp_path, f"backend={backend}", "epochs=8", "optimizer.lr=3e-3", "warmup_ratio=0.0")
    assert summary["status"] == "ok", summary["error"]
    losses = [line["train/loss"] for line in read_metrics(tmp_path)]
    first, last = sum(losses[:8]) / 8, sum(losses[-8:]) / 8
    assert first == pytest.approx(math.log(3), abs=0.1)  # uniform guess over 3 classes
    assert last < 0.5 * first
    labels = instantiate(compose().data).eval["label"]
    majority = max(labels.count(c) for c in set(labels)) / len(labels)
    assert summary["eval/accuracy"] > majority + 0.2


@pytest.mark.slow
def test_steps_and_schedule_length_follow_accumulation(tmp_path):
    # 100 samples / micro 8 = 13 micro-batches; accumulation 4 -> 4 optimizer steps per epoch
    summary = run_job(
        tmp_path, "data.num_train=100", "gradient_accumulation_steps=4", "epochs=2", "lr_scheduler=linear"
    )
    assert summary["status"] == "ok", summary["error"]
    assert summary["train/steps"] == summary["train/scheduled_steps"] == math.ceil(13 / 4) * 2
    lines = read_metrics(tmp_path)
    # the last window of each epoch holds one micro-batch of 4 samples: 32 + 32 + 32 + 4 per epoch
    assert [line["train/samples"] for line in lines[:4]] == [32, 64, 96, 100]
    assert lines[-1]["train/samples"] == 200
    warmup = math.ceil(0.1 * 8)
    assert lines[0]["lr"] == 0.0 and lines[warmup]["lr"] == pytest.approx(2e-4)
    assert lines[-1]["lr"] == pytest.approx(2e-4 / (8 - warmup))


@pytest.mark.slow
def test_failed_run_writes_failed_summary_and_keeps_an_ok_one(tmp_path):
    summary = run_job(tmp_path, "gradient_accumulation_steps=0")
    assert summary["status"] == "failed"
    assert json.loads((tmp_path / "summary.json").read_text())["error"].startswith(
        "gradient_accumulation_steps=0"
    )

    ok_dir = tmp_path / "ok"
    assert run_job(ok_dir, *FEW_STEPS)["status"] == "ok"
    before = (ok_dir / "summary.json").read_text()
    assert run_job(ok_dir, "micro_batch_size=0")["status"] == "failed"
    assert (ok_dir / "summary.json").read_text() == before


def test_a_new_run_never_overwrites_an_ok_one_and_resume_leaves_it_as_it_is(tmp_path):
    assert run_job(tmp_path, *FEW_STEPS)["status"] == "ok"
    files = {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()}
    refused = run_job(tmp_path, *FEW_STEPS, "optimizer.lr=1e30", "warmup_ratio=0")  # would diverge
    assert refused["status"] == "failed" and refused["error_type"] == "config"
    assert refused["error"].startswith(
        f"hydra.run.dir={str(tmp_path)!r} is invalid: it holds a finished ok run"
    )
    kept = run_job(tmp_path, *FEW_STEPS, "resume=auto")  # a finished run: left as it is
    assert kept["status"] == "ok" and kept["speed/train_s"] > 0
    assert {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()} == files


@pytest.mark.slow
def test_a_rerun_after_a_failed_run_writes_each_step_once(tmp_path):
    failed = run_job(tmp_path, "max_steps=5", "data.num_train=48", "optimizer.lr=1e30", "warmup_ratio=0")
    assert failed["status"] == "diverged"
    assert run_job(tmp_path, *FEW_STEPS)["status"] == "ok"
    assert [line["step"] for line in read_metrics(tmp_path)] == [1, 2, 3]


@pytest.mark.slow
def test_result_files_follow_the_umask(tmp_path):
    import os

    old = os.umask(0o022)
    try:
        assert run_job(tmp_path, *FEW_STEPS)["status"] == "ok"
    finally:
        os.umask(old)
    for name in ("summary.json", "metrics.jsonl"):
        assert (tmp_path / name).stat().st_mode & 0o777 == 0o644, name


@pytest.mark.slow
@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_ctrl_c_or_sigterm_writes_an_interrupted_summary_and_exits_128_plus_signal(tmp_path, signum):
    """A long run interrupted after its first steps: one line, no traceback, the summary says so."""
    from tests.helpers.run import TINY

    args = [
        sys.executable,
        str(REPO / "train.py"),
        *TINY,
        "max_steps=100000",
        "epochs=1000",
        f"hydra.run.dir={tmp_path}",
        *(["checkpoint_every=1"] if signum == signal.SIGTERM else []),  # one with a checkpoint, one without
    ]
    # as from a terminal: a suite started in the background (nohup, `&`) passes SIGINT on ignored,
    # and Python then leaves Ctrl-C ignored, as it should for a background job
    process = subprocess.Popen(args, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                               preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))  # fmt: skip
    deadline = time.time() + 120
    while time.time() < deadline and len(read_lines(tmp_path)) < 3:
        time.sleep(0.2)
    process.send_signal(signum)
    _, stderr = process.communicate(timeout=120)
    assert process.returncode == 128 + signum
    assert "Traceback" not in stderr
    summary = json.loads((tmp_path / "summary.json").read_text())
    if signum == signal.SIGTERM:  # the folder named: a rerun without it would start in a folder of its own
        from effitrain.train.resume_point import list_checkpoints

        newest = list_checkpoints(tmp_path)[-1][0]  # a write the signal cut short is no checkpoint
        hint = f"its newest checkpoint is step {newest}: resume with resume=auto hydra.run.dir='{tmp_path}'"
    else:
        hint = "no checkpoint to resume from (checkpoint_every is off): a rerun starts over; checkpoint_every=N saves one every N steps"
    assert (
        stderr.strip().splitlines()[-1]
        == f"effitrain: error: interrupted: interrupted by {signum.name}; {hint}"
    )
    assert summary["status"] == "interrupted" and summary["signal"] == signum
    assert summary["train/steps"] >= 3


def read_lines(folder):
    path = folder / "metrics.jsonl"
    return path.read_text().splitlines() if path.exists() else []


@pytest.mark.slow
def test_a_folder_in_use_by_another_run_is_refused_and_left_alone(tmp_path):
    import fcntl

    from effitrain.run.folder_policy import LOCK

    tmp_path.mkdir(exist_ok=True)
    with open(tmp_path / LOCK, "a+") as held:  # another process's run, as the lock sees it
        fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)
        held.write("4242")
        held.flush()
        child = subprocess.run(
            [sys.executable, str(REPO / "train.py"), "model=tiny", "data=synthetic", "max_steps=1", "logger=none",
             "progress_bar=false", f"hydra.run.dir={tmp_path}"],
            cwd=REPO, capture_output=True, text=True, timeout=300,
        )  # fmt: skip
    assert child.returncode == 2
    assert f"hydra.run.dir={str(tmp_path)!r} is invalid: in use by another run (pid 4242)" in child.stderr
    assert not (tmp_path / "summary.json").exists() and not (tmp_path / "metrics.jsonl").exists()


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["accelerator", "trainer"])
def test_eval_every_writes_eval_lines_and_the_best_one(tmp_path, backend):
    summary = run_job(tmp_path, f"backend={backend}", "max_steps=6", "eval_every=2", "optimizer.lr=3e-3",
                      "warmup_ratio=0")  # fmt: skip
    assert summary["status"] == "ok", summary["error"]
    lines = read_metrics(tmp_path, kind="all")
    evals = [line for line in lines if "eval/loss" in line]
    assert [line["step"] for line in evals] == [2, 4, 6]  # 6: the final evaluation
    assert all("train/loss" not in line for line in evals)
    assert [line["step"] for line in lines if "train/loss" in line] == [1, 2, 3, 4, 5, 6]
    assert (
        evals[-1]["eval/loss"] == summary["eval/loss"]
        and evals[-1]["eval/accuracy"] == summary["eval/accuracy"]
    )
    best = min(evals, key=lambda line: line["eval/loss"])
    assert (summary["eval/best_loss"], summary["eval/best_step"]) == (best["eval/loss"], best["step"])
    assert len({line["eval/loss"] for line in evals}) == 3  # the model changed between evaluations


def test_a_full_disk_while_writing_metrics_is_a_failed_summary_in_one_line(tmp_path, monkeypatch):
    import errno

    from effitrain.train import loggers

    def full(self, payload, step):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(loggers.MetricsFile, "log_dict", full)
    summary = run_job(tmp_path, *FEW_STEPS)
    assert summary["status"] == "failed"
    assert summary["error"] == "OSError: [Errno 28] No space left on device"
    assert json.loads((tmp_path / "summary.json").read_text())["status"] == "failed"


def test_a_torn_last_metrics_line_is_skipped_by_the_reader(tmp_path):
    from effitrain.train.loggers import read_metrics as read

    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1, "train/loss": 1.5}\n{"step": 2, "train/loss": 1.4}\n{"step": 3, "tra')
    assert read(path) == [{"step": 1, "train/loss": 1.5}, {"step": 2, "train/loss": 1.4}]


@pytest.mark.slow
def test_an_eval_line_equals_evaluating_the_weights_saved_at_its_step(tmp_path):
    """The evaluation at step 2 (eval_every) is an evaluation of step 2's weights, nothing else: a
    fresh model given the checkpoint of step 2 evaluates to the same figures."""
    import torch
    from accelerate import Accelerator
    from safetensors.torch import load_model

    from effitrain.run.build import build_job

    steps = ["max_steps=4", "eval_every=2", "checkpoint_every=2", "optimizer.lr=3e-3", "warmup_ratio=0"]
    summary = run_job(tmp_path / "run", *steps)
    assert summary["status"] == "ok", summary["error"]
    at_2 = next(line for line in read_metrics(tmp_path / "run", kind="eval") if line["step"] == 2)
    job = build_job(compose(*steps), tmp_path / "fresh", [], torch.device("cpu"), True)
    load_model(job.model, str(tmp_path / "run" / "checkpoints" / "step-00000002" / "model.safetensors"))
    again = job.task.evaluate(job.model, job.eval_loader, Accelerator(cpu=True))
    assert again["eval/samples"] == at_2["eval/samples"] > 0
    assert again == pytest.approx({key: at_2[key] for key in again}, rel=1e-6)
    assert at_2["eval/loss"] != summary["eval/loss"]  # step 4's weights evaluate otherwise


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["accelerator", "trainer"])
def test_each_optimizer_step_runs_inside_job_track_step(tmp_path, backend, monkeypatch):
    """The hook the memory tracker plugs into: one context per optimizer step, numbered from 1,
    holding the step's optimizer update and closed before the step's metrics line."""
    import contextlib

    from effitrain.run import recipe as run

    events = []
    original = run.Job.track_step

    @contextlib.contextmanager
    def recording(job, step):
        weight = next(job.model.parameters())
        before = weight.detach().clone()
        with original(job, step):
            events.append(("enter", step, len(job.meter.step_times)))
            yield
        events.append(("exit", step, len(job.meter.step_times), not bool((weight == before).all())))

    monkeypatch.setattr(run.Job, "track_step", recording)
    summary = run_job(tmp_path, f"backend={backend}", *FEW_STEPS)
    assert summary["status"] == "ok", summary["error"]
    expected = []
    for step in (1, 2, 3):  # lr 0 at step 1 (warm-up): the weights move from step 2 on
        expected += [("enter", step, step - 1), ("exit", step, step - 1, step > 1)]
    assert events == expected


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["accelerator", "trainer"])
def test_a_finished_run_leaves_only_its_results(tmp_path, backend):
    """No lock file, no empty train.log, no empty trainer/ folder (the Trainer's own output folder,
    where effitrain saves nothing): the folder holds what the run wrote."""
    done = train_py(*TINY, "max_steps=2", f"backend={backend}", f"hydra.run.dir={tmp_path}")
    assert done.returncode == 0, done.stderr[-3000:]
    assert sorted(p.name for p in tmp_path.iterdir()) == [".hydra", "metrics.jsonl", "summary.json"]
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["status"] == "ok" and summary["cfg/backend"] == backend
    assert [line["step"] for line in read_metrics(tmp_path)] == [1, 2]
    assert [line["step"] for line in read_metrics(tmp_path, "eval")] == [2]


@pytest.mark.slow
def test_a_run_that_logs_keeps_its_train_log(tmp_path):
    """train.log is made at the first log line, and then kept."""
    done = train_py(*TINY, "max_steps=1", "resume=auto", f"hydra.run.dir={tmp_path}")
    assert done.returncode == 0, done.stderr[-3000:]
    logged = (tmp_path / "train.log").read_text()
    assert logged.endswith(f"resume=auto: no checkpoint in {tmp_path}, starting from scratch\n")
    left = [".hydra", "metrics.jsonl", "summary.json", "train.log"]
    assert sorted(p.name for p in tmp_path.iterdir()) == left


@pytest.mark.parametrize("backend", ["accelerator", pytest.param("trainer", marks=pytest.mark.slow)])
def test_the_logged_lr_is_the_step_s_own_with_an_lr_held_in_a_tensor(tmp_path, monkeypatch, backend):
    """torchao's optimizers keep ``lr`` as a tensor, which the scheduler updates in place: a reference
    read before the step would be logged with the next step's value. Warm-up starts from 0."""
    import effitrain.run.build
    from effitrain.train.optim import build_optimizer

    def tensor_lr(optimizer_cfg, model, weight_decay):
        optimizer = build_optimizer(optimizer_cfg, model, weight_decay)
        for group in optimizer.param_groups:
            group["lr"] = torch.tensor(group["lr"], dtype=torch.float64)  # float64: the same values
        return optimizer

    monkeypatch.setattr(effitrain.run.build, "build_optimizer", tensor_lr)
    assert run_job(tmp_path, "max_steps=4", "warmup_ratio=0.5", f"backend={backend}")["status"] == "ok"
    lr = compose().optimizer.lr  # linear warm-up over 2 steps from 0, then linear decay to 0 at step 4
    assert [line["lr"] for line in read_metrics(tmp_path)] == [0.0, lr / 2, lr, lr / 2]


@pytest.fixture
def validations(monkeypatch) -> list:
    """The configs ``validate`` is called on from here on (the front door through
    ``effitrain.config.load``, the run through ``effitrain.run.recipe``)."""
    import effitrain.config.load as config
    import effitrain.run.recipe as recipe

    seen, real_validate = [], config.validate

    def counted(cfg, world_size=1, **validation):  # validation: the build check handed in (builds=)
        seen.append(copy.deepcopy(cfg))
        return real_validate(cfg, world_size, **validation)

    monkeypatch.setattr(config, "validate", counted)
    monkeypatch.setattr(recipe, "validate", counted)
    monkeypatch.setattr(sys, "argv", ["train.py"])  # train() sets it for Hydra
    return seen


def test_train_py_validates_a_run_once_and_derives_its_micro_batch(tmp_path, validations):
    """``train.py`` validates the command line before Hydra starts; the run Hydra then starts with
    that config is not validated again (a config the front door did not see, as ``run_job``'s, is
    validated by its run: the bad-value table's rows through a run say so). The micro batch is
    derived from the effective batch: 16 in the config file, 8 trained."""
    from effitrain.commands.train_command import train

    overrides = [o for o in TINY if not o.startswith("micro_batch_size=")]
    assert compose(*overrides, tiny=False).micro_batch_size == 16  # the file's value
    batch = ["max_steps=2", "effective_batch_size=16", "gradient_accumulation_steps=2"]
    train([*overrides, *batch, f"hydra.run.dir={tmp_path / 'front'}"])
    summary = json.loads((tmp_path / "front" / "summary.json").read_text())
    assert summary["status"] == "ok" and len(validations) == 1  # the preflight's, not the run's
    assert summary["cfg/micro_batch_size"] == 8 and summary["train/samples"] == 2 * 16
    # nothing is remembered in the process: a run of the same config not handed on by the front
    # door (here, run() called directly) validates it
    run_job(tmp_path / "direct", *overrides, *batch, tiny=False)
    assert len(validations) == 2


@pytest.mark.slow
def test_a_sweep_job_is_validated_again_when_it_starts(tmp_path, validations):
    """A sweep's jobs are all validated by the preflight before the first starts, and each again
    when it starts (Hydra's basic launcher runs them in the preflight's process, possibly hours
    later: the files, weights and resume paths validation checks may have changed)."""
    from effitrain.commands.train_command import train

    train(["-m", *TINY, "max_steps=1", "seed=3,4", "hydra/launcher=basic", f"hydra.sweep.dir={tmp_path}"])
    seeds = sorted(json.loads(path.read_text())["cfg/seed"] for path in tmp_path.glob("*/summary.json"))
    assert seeds == [3, 4] and sorted(cfg.seed for cfg in validations) == [3, 3, 4, 4]


def test_a_non_finite_final_evaluation_is_never_an_ok_result(tmp_path):
    """lr 1e30 from the first step: the step's own loss is finite (taken before the update), the
    weights after it are not, and neither is the final evaluation's loss: diverged, not ok."""
    summary = run_job(tmp_path, "max_steps=1", "optimizer.lr=1e30", "warmup_ratio=0")
    assert math.isfinite(summary["train/loss"]) and math.isnan(summary["eval/loss"])
    assert summary["status"] == "diverged"
    assert summary["error"] == "eval/loss is nan: the run's result is not a number"
    written = json.loads((tmp_path / "summary.json").read_text())
    assert (written["status"], written["eval/loss"]) == ("diverged", None)


def _tokens_shapes(rows: int, length: int) -> dict:
    tokens = ((rows, length), torch.int64)
    return {
        "input_ids": tokens,
        "token_type_ids": tokens,
        "attention_mask": tokens,
        "labels": ((rows,), torch.int64),
    }


def test_the_run_traces_its_evaluation_at_eval_batch_size_by_max_length(monkeypatch):
    """predict_step_peak, the run's own path, from a tracked step of 4 rows x 20 tokens: the replay is
    asked for the recorded step and an evaluation of eval_batch_size x max_length (24 x 32)."""
    from types import SimpleNamespace

    import effitrain.run.recipe
    from effitrain.memory.replay import Trace

    asked = []

    def replay(config, optimizer_cfgs, cfg, batches, device, eval_shapes):
        asked.append((batches, device, eval_shapes))
        peak = {
            "weights": 1,
            "gradients": 0,
            "optimizer_state": 0,
            "activations": 0,
            "temporaries": 0,
            "total": 1,
        }
        return {name: Trace({"first_step": peak, "later_step": peak, "eval": peak}, 1) for name in optimizer_cfgs}

    monkeypatch.setattr(effitrain.run.recipe, "trace_runs", replay)
    cfg = compose("max_length=32", "micro_batch_size=4", "eval_batch_size=24")
    recorded = {**_tokens_shapes(4, 20), "padded": True}
    model = torch.nn.Linear(2, 2)
    model.config = None
    job = SimpleNamespace(step_memory=SimpleNamespace(batches=[recorded], step=2), model=model, cfg=cfg)
    effitrain.run.recipe.predict_step_peak(job)
    assert asked == [([recorded], "cpu", _tokens_shapes(24, 32))]


@pytest.mark.slow
def test_the_run_predicts_its_evaluation_at_eval_batch_size_by_max_length():
    """predict_step_peak, the run's own path, from a tracked step of 4 rows x 20 tokens: its eval
    phase is the replay's at eval_batch_size x max_length (24 x 32, written here), not at the
    recorded training micro-batch's shape, which is smaller."""
    from types import SimpleNamespace

    from effitrain.memory.replay import trace_run
    from effitrain.run.recipe import predict_step_peak
    from effitrain.train.modeling import build_model
    from effitrain.train.tasks import build_task

    cfg = compose("max_length=32", "micro_batch_size=4", "eval_batch_size=24")
    task = build_task(cfg)
    model = build_model(cfg.model, 3, None, device="meta", auto_class=task.auto_class)

    shapes = _tokens_shapes
    recorded = {**shapes(4, 20), "padded": True}
    job = SimpleNamespace(step_memory=SimpleNamespace(batches=[recorded], step=2), model=model, cfg=cfg)
    predicted = predict_step_peak(job)
    phases = {size: trace_run(model.config, cfg.optimizer, cfg, [recorded], "cpu", shapes(*size)).phases
              for size in [(24, 32), (4, 20)]}  # fmt: skip
    assert phases[24, 32]["eval"]["total"] > phases[4, 20]["eval"]["total"]  # the test can tell them apart
    assert predicted["mem/run_peak_predicted/eval_bytes"] == phases[24, 32]["eval"]["total"]
    assert predicted["mem/step_peak_bytes_predicted"] == phases[24, 32]["later_step"]["total"]


# in the second step's forward (the second call of loss_sum: one micro-batch a step), or in the final evaluation
@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")  # what Python dropped
@pytest.mark.parametrize(
    ("backend", "during", "call", "steps"),
    [("accelerator", "loss_sum", 2, 1), ("trainer", "loss_sum", 2, 1), ("accelerator", "evaluate", 1, 3)],
)
def test_a_sigterm_whose_raise_python_dropped_still_interrupts_the_run(
    tmp_path, backend, during, call, steps
):
    """SIGTERM handled inside a weakref callback: Python drops the exception its handler raises. The
    run is still interrupted: at the end of the step it came in, or before it is marked ok when it
    came after the last step."""
    task = ["task._target_=tests.helpers.interrupting.SigtermInACallback", f"+task.during={during}"]
    summary = run_job(tmp_path, *FEW_STEPS, f"backend={backend}", *task, f"+task.call={call}")
    assert (summary["status"], summary["signal"], summary["error"]) == (
        "interrupted",
        15,
        "interrupted by SIGTERM",
    )
    assert summary["train/steps"] == steps
    assert [line["step"] for line in read_metrics(tmp_path)] == list(range(1, steps + 1))
    assert json.loads((tmp_path / "summary.json").read_text())["status"] == "interrupted"


@pytest.mark.slow
def test_a_run_that_learned_nothing_says_so_in_its_last_line(tmp_path):
    """Two optimizer steps at a tiny lr leave the classifier at its input-blind loss: the ok line is
    followed by the note, with the two losses the summary holds."""
    from tests.helpers.run import TINY, train_py

    done = train_py(*TINY, "max_steps=2", "optimizer.lr=1e-9", f"hydra.run.dir={tmp_path}")
    assert done.returncode == 0, done.stderr[-2000:]
    summary = json.loads((tmp_path / "summary.json").read_text())
    from effitrain.config.summary_schema import learned_nothing

    loss, blind = learned_nothing(summary)
    assert (loss, blind) == (summary["eval/loss"], summary["eval/input_blind_loss"])
    lines = done.stdout.strip().splitlines()
    assert lines[-2].startswith("effitrain: ok: ")
    assert lines[-1] == (
        f"effitrain: note: learned nothing measurable: eval/loss {loss:.4f} is not below {blind:.4f}, the loss "
        "of a prediction that ignores the input, beyond noise (eval/input_blind_loss, eval/loss_sem)"
    )
