"""Bad input is caught before training: a one-line message naming key and value, exit code 2,
no summary marked ok, and the results already in the run folder left byte for byte as they were."""

from __future__ import annotations

import errno
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.helpers.bad_inputs import DATA, VALUES, every_nth_fast, fill
from tests.helpers.run import REPO, TINY, run_job, train_py

NO_CUDA = not torch.cuda.is_available()


@pytest.fixture(scope="module")
def ok_run(tmp_path_factory):
    """A finished run whose files every bad input below must leave untouched."""
    folder = tmp_path_factory.mktemp("ok-run")
    summary = run_job(folder, "max_steps=2", "checkpoint_every=2")
    assert summary["status"] == "ok", summary["error"]
    return folder


def snapshot(folder: Path, hydra_record: bool = True) -> dict:
    """Every file's bytes; ``hydra_record=False`` leaves out what Hydra writes for each invocation
    (``.hydra/`` and the job's log)."""
    files = {p.relative_to(folder): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}
    return {
        k: v for k, v in files.items() if hydra_record or not (k.parts[0] == ".hydra" or k.suffix == ".log")
    }


# every row through the run in the full suite; every fourth in the fast selection (test_config's
# preflight table takes every third there)
RUN_ROWS = every_nth_fast(VALUES, 4)


@pytest.mark.parametrize("overrides, message", RUN_ROWS)
def test_bad_value_fails_up_front_and_keeps_earlier_results(ok_run, csv_files, overrides, message):
    overrides, message = fill(overrides, message, csv_files)
    before = snapshot(ok_run)
    summary = run_job(ok_run, *overrides)
    assert summary["status"] == "failed" and summary["error_type"] == "config"
    assert summary["error"].startswith(message) and "\n" not in summary["error"]
    assert snapshot(ok_run) == before


@pytest.mark.parametrize("overrides, message", DATA)
def test_bad_data_fails_before_the_model_is_built(tmp_path, csv_files, overrides, message):
    overrides, message = fill(overrides, message, csv_files)
    summary = run_job(tmp_path, *overrides)
    assert summary["status"] == "failed" and summary["error_type"] == "config"
    assert summary["error"].startswith(message)
    assert "params/total" not in summary  # no model was built
    assert json.loads((tmp_path / "summary.json").read_text())["status"] == "failed"


@pytest.mark.slow  # train.py in a subprocess for each
@pytest.mark.parametrize(
    "override, message, before_hydra",
    [
        ("checkpoint_every=0", "checkpoint_every=0 is invalid: must be an integer >= 1 (or null)", True),
        ("warmup_ratio=1.5", "warmup_ratio=1.5 is invalid: must be in [0, 1)", True),
        # a valid config, but the folder holds an ok run that a new run would overwrite
        ("seed=7", "is invalid: it holds a finished ok run (summary.json); give another folder", True),
    ],
)
def test_command_line_exits_2_with_one_line_and_leaves_the_folder(ok_run, override, message, before_hydra):
    before = snapshot(ok_run, hydra_record=before_hydra)
    done = train_py(*TINY, override, f"hydra.run.dir={ok_run}")
    assert done.returncode == 2
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("effitrain: error: ") and message in last
    assert "effitrain: ok" not in done.stdout and "Traceback" not in done.stderr
    assert snapshot(ok_run, hydra_record=before_hydra) == before
    assert json.loads((ok_run / "summary.json").read_text())["status"] == "ok"


def test_output_folder_that_cannot_be_written_is_refused_before_hydra(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    done = train_py(*TINY, f"hydra.run.dir={blocker}/run")
    assert done.returncode == 2
    assert done.stderr.strip().splitlines()[-1] == (
        f"effitrain: error: hydra.run.dir='{blocker}/run' is invalid: {blocker} is a file, not a folder"
    )
    assert blocker.read_text() == "not a folder"


# ``python train.py ARGS`` in a process where writes fail as on a full disk: os.fsync (every
# flush to disk: a probe, an atomic write) raises ENOSPC, or, with a second argument, so does
# ``effitrain.run.results.write_json_atomic`` (summary.json) alone.
FULL_DISK = """
import errno, os, runpy, sys

def full(*args):
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

if sys.argv[1] == "summary":
    import effitrain.run.results
    effitrain.run.results.write_json_atomic = full
else:
    os.fsync = full
sys.argv = sys.argv[2:]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def train_py_on_a_full_disk(what: str, *args: str, **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", FULL_DISK, what, str(REPO / "train.py"), *args], cwd=REPO,
                          capture_output=True, text=True, timeout=600, **kwargs)  # fmt: skip


def test_a_full_disk_before_the_run_is_one_line_and_writes_nothing(tmp_path):
    done = train_py_on_a_full_disk("all", *TINY, f"hydra.run.dir={tmp_path}/run")
    assert done.returncode == 2, done.stderr[-3000:]
    assert done.stderr.strip().splitlines() == [
        f"effitrain: error: hydra.run.dir='{tmp_path}/run' is invalid: {tmp_path} cannot be written "
        "(No space left on device)"
    ]
    assert list(tmp_path.iterdir()) == []  # refused before Hydra made the folder


def test_a_file_size_limit_is_refused_as_a_full_disk_is(tmp_path):
    """A real refusal by the kernel: no byte may be written (RLIMIT_FSIZE 0; EFBIG, not a signal)."""
    import resource
    import signal

    def no_bytes():
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (0, 0))

    done = subprocess.run([sys.executable, str(REPO / "train.py"), *TINY, f"hydra.run.dir={tmp_path}/run"],
                          cwd=REPO, capture_output=True, text=True, timeout=600, preexec_fn=no_bytes)  # fmt: skip
    assert done.returncode == 2, done.stderr[-3000:]
    assert done.stderr.strip().splitlines()[-1] == (
        f"effitrain: error: hydra.run.dir='{tmp_path}/run' is invalid: {tmp_path} cannot be written (File too large)"
    )
    assert "Traceback" not in done.stderr and list(tmp_path.iterdir()) == []


def test_a_disk_full_at_the_runs_first_write_is_a_failed_summary(tmp_path, monkeypatch):
    """The disk fills between the command's check and the run: the run's own probe refuses the
    folder, the summary cannot be written either, and the returned summary says both: no traceback."""

    def full(fd):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "fsync", full)
    summary = run_job(tmp_path, "max_steps=1")
    assert summary["status"] == "failed" and summary["error_type"] == "config"
    assert summary["error"] == (
        f"hydra.run.dir={str(tmp_path)!r} is invalid: the output folder cannot be written (No space left on "
        f"device); summary.json could not be written in {tmp_path} (No space left on device)"
    )
    assert "params/total" not in summary  # nothing heavy was built
    assert os.listdir(tmp_path) == []  # no summary, no half-written one, no lock file


@pytest.mark.slow
def test_a_run_whose_summary_cannot_be_written_is_not_ok(tmp_path):
    """It trained, but its record is not on disk: exit 1 with one line, never "ok"."""
    done = train_py_on_a_full_disk("summary", *TINY, "max_steps=2", f"hydra.run.dir={tmp_path}")
    assert done.returncode == 1, done.stderr[-3000:]
    assert done.stderr.strip().splitlines()[-1] == (
        f"effitrain: error: failed: summary.json could not be written in {tmp_path} (No space left on device)"
    )
    assert "effitrain: ok" not in done.stdout and "Traceback" not in done.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == [".hydra", "metrics.jsonl"]
    lines = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [line["step"] for line in lines if "train/loss" in line] == [1, 2]  # it trained


@pytest.mark.slow
def test_effective_batch_size_sets_the_micro_batch(tmp_path):
    without_micro = [o for o in TINY if not o.startswith("micro_batch_size=")]  # it would contradict
    summary = run_job(tmp_path, *without_micro, "effective_batch_size=16", "gradient_accumulation_steps=4",
                      "max_steps=2", tiny=False)  # fmt: skip
    assert summary["status"] == "ok", summary["error"]
    assert summary["cfg/micro_batch_size"] == 4 and summary["cfg/effective_batch_size"] == 16
    assert summary["train/samples"] == 2 * 16


def test_trust_remote_code_is_off_in_every_model_option():
    from effitrain.config.registry import group_options
    from tests.helpers.run import compose

    for option in group_options("model"):
        assert compose(f"model={option}").model.trust_remote_code is False, option


@pytest.mark.slow
def test_resume_auto_with_a_changed_key_into_a_finished_run_is_refused(ok_run):
    """resume=auto keeps a finished ok run as it is only for the config it ran: a changed
    result-changing key is named, not ignored; an unchanged one (or a run-invariant key) is kept."""
    before = snapshot(ok_run)
    same = run_job(ok_run, "max_steps=2", "checkpoint_every=2", "resume=auto", "progress_bar=true")
    assert same["status"] == "ok" and snapshot(ok_run) == before
    changed = run_job(ok_run, "max_steps=2", "checkpoint_every=2", "resume=auto", "seed=7")
    assert changed["status"] == "failed" and changed["error_type"] == "config"
    assert changed["error"].startswith(f"seed=7 is invalid: the finished ok run in {ok_run} ran with 42")
    assert snapshot(ok_run) == before
    done = train_py(*TINY, "max_steps=2", "checkpoint_every=2", "resume=auto", "optimizer.lr=1e-3",
                    f"hydra.run.dir={ok_run}")  # fmt: skip
    assert done.returncode == 2, done.stderr[-2000:]
    assert (
        done.stderr.strip()
        .splitlines()[-1]
        .startswith("effitrain: error: optimizer.lr=0.001 is invalid: the finished ok run")
    )
    assert snapshot(ok_run) == before  # refused before Hydra wrote its record


@pytest.mark.slow
def test_a_folder_in_use_is_refused_before_hydra_writes_there(ok_run):
    from effitrain.run.folder_policy import folder_lock

    before = snapshot(ok_run)
    with folder_lock(ok_run) as owner:  # held as a running run holds it
        assert owner is None
        done = train_py(*TINY, "seed=7", f"hydra.run.dir={ok_run}")
    assert done.returncode == 2
    assert done.stderr.strip().splitlines()[-1] == (
        f"effitrain: error: hydra.run.dir={str(ok_run)!r} is invalid: in use by another run (pid {os.getpid()})"
    )
    assert snapshot(ok_run) == before  # .hydra/ included


@pytest.mark.slow
def test_a_fresh_run_into_an_interrupted_runs_folder_is_refused(tmp_path):
    """Without resume=, a new run would start at step 0 and rotate the checkpoints away."""
    from tests.train.test_checkpoint import start_and_kill

    start_and_kill(tmp_path, "checkpoint_every=1", "max_steps=40", at_step=2)
    before = snapshot(tmp_path)
    assert any(path.parts[0] == "checkpoints" for path in before)
    done = train_py(*TINY, "checkpoint_every=1", "max_steps=40", f"hydra.run.dir={tmp_path}")
    assert done.returncode == 2
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith(
        f"effitrain: error: hydra.run.dir={str(tmp_path)!r} is invalid: it holds an unfinished run's checkpoints"
    )
    assert last.endswith("add resume=auto to continue it, or give another folder")
    assert snapshot(tmp_path) == before
    summary = run_job(tmp_path, "checkpoint_every=1", "max_steps=40")  # the run itself refuses too
    assert summary["status"] == "failed" and "unfinished run's checkpoints" in summary["error"]
