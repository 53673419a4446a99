"""The launcher's skip decision, in process and fast: which job folder effitrain's launcher settles
without starting a process (outside the sweep, ok before, ok before with another config, in use),
what it records, and the same decision in a job started by another launcher (``start_job``).
No job runs here (tests/sweep/test_launcher.py runs the real sweeps)."""

from __future__ import annotations

import json
import os

import pytest
from omegaconf import OmegaConf

from effitrain.run import folders as results
from effitrain.sweep.launcher import LAUNCHER_DIR, LAUNCHES, LocalSweep
from effitrain.sweep.outcome import LaunchedJob
from tests.helpers.run import compose


@pytest.fixture(scope="module")
def cfg():
    return compose()


def _with(cfg, **values):
    changed = OmegaConf.create(OmegaConf.to_container(cfg))
    for key, value in values.items():
        OmegaConf.update(changed, key, value, force_add=True)
    return changed


def _without(cfg, *keys):
    """``cfg`` without ``keys``: a config written before they existed takes their defaults."""
    trimmed = OmegaConf.to_container(cfg)
    for key in keys:
        trimmed.pop(key)
    return OmegaConf.create(trimmed)


def _ok_summary(folder, cfg, **extra):
    folder.mkdir(parents=True, exist_ok=True)
    summary = {"status": "ok", "eval/loss": 0.5, results.CONFIG_KEY: results.config_record(cfg), **extra}
    (folder / "summary.json").write_text(json.dumps(summary))
    return summary


def _sweep(tmp_path):
    sweep = LocalSweep.__new__(LocalSweep)  # the decision needs only the sweep folder
    sweep.sweep_dir = tmp_path / "sweep"
    (sweep.sweep_dir / LAUNCHER_DIR).mkdir(parents=True)
    return sweep


def _records(sweep):
    path = sweep.sweep_dir / LAUNCHER_DIR / LAUNCHES
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def _job(sweep, name, config, idx=0):
    return LaunchedJob(idx, [f"seed={idx}"], config, sweep.sweep_dir / name, name)


def test_skip_refusal_names_the_key_that_changed(tmp_path, cfg):
    previous = {"status": "ok", results.CONFIG_KEY: results.config_record(cfg)}
    assert results.skip_refusal(tmp_path, previous, cfg) is None
    assert results.skip_refusal(tmp_path, {"status": "ok"}, _with(cfg, seed=43)) is None  # nothing recorded
    assert results.skip_refusal(tmp_path, previous, _with(cfg, seed=43)) == (
        f"seed=43 is invalid: {tmp_path} holds an ok run with seed=42, which this sweep would skip "
        "as done: give another hydra.sweep.dir"
    )
    # a key recorded on one side only is a change too (a key this version added, or dropped)
    older = dict(previous[results.CONFIG_KEY])
    del older["seed"]
    assert results.config_change({results.CONFIG_KEY: older}, cfg) == ("seed", 42, None)
    assert results.config_change(previous, _with(cfg, new_key=1)) == ("new_key", 1, None)


def test_a_job_folder_outside_the_sweep_fails_without_a_process(tmp_path, cfg):
    sweep = _sweep(tmp_path)
    for name in ("../elsewhere", "."):
        job = LaunchedJob(1, ["seed=1", "lr=2"], cfg, sweep.sweep_dir / name, name)
        assert sweep._decide_without_process(job) is True
        assert (job.outcome.folder, job.outcome.status, job.outcome.skipped) == (job.folder, "failed", False)
        assert job.outcome.error == (
            f"hydra.sweep.subdir={name!r} is invalid: a job folder must be inside the sweep folder "
            f"{sweep.sweep_dir} (overrides seed=1 lr=2)"
        )
    assert _records(sweep) == []


def test_only_an_ok_job_of_the_same_config_is_skipped(tmp_path, cfg):
    sweep = _sweep(tmp_path)
    # a config without skip_ok_jobs and optimized_metric: skipping is on, the metric eval/loss
    ok = _job(sweep, "ok", _without(cfg, "skip_ok_jobs", "optimized_metric"), 0)
    _ok_summary(ok.folder, ok.config, **{"eval/accuracy": 0.75})
    assert sweep._decide_without_process(ok) is True
    assert (ok.outcome.folder, ok.outcome.status, ok.outcome.skipped, ok.outcome.error) == (
        ok.folder,
        "ok",
        True,
        None,
    )
    assert ok.value == 0.5  # the optimized metric (eval/loss by default) for Hydra's sweeper
    metric = _job(sweep, "ok", _with(cfg, optimized_metric="eval/accuracy"), 1)
    _ok_summary(ok.folder, metric.config, **{"eval/accuracy": 0.75})
    assert sweep._decide_without_process(metric) is True and metric.value == 0.75

    other = _job(sweep, "other", _with(cfg, seed=43), 2)
    _ok_summary(other.folder, cfg)
    assert sweep._decide_without_process(other) is True
    assert (other.outcome.folder, other.outcome.status, other.outcome.skipped) == (
        other.folder,
        "failed",
        False,
    )
    assert other.outcome.error == results.skip_refusal(
        other.folder, json.loads((other.folder / "summary.json").read_text()), other.config
    )
    assert other.outcome.error.startswith("seed=43 is invalid")

    assert _records(sweep) == [
        {"job": 0, "folder": "ok", "status": "ok", "skipped": True},
        {"job": 1, "folder": "ok", "status": "ok", "skipped": True},
        {"job": 2, "folder": "other", "status": "failed", "error": other.outcome.error},
    ]


@pytest.mark.parametrize("status", ["failed", "oom", "killed", None])
def test_a_job_not_ok_before_gets_a_process_and_its_folder_locked(tmp_path, cfg, status):
    sweep = _sweep(tmp_path)
    job = _job(sweep, "j", cfg)
    job.folder.mkdir()
    if status is not None:
        (job.folder / "summary.json").write_text(json.dumps({"status": status}))
    assert sweep._decide_without_process(job) is False
    assert job.outcome is None and job.lock is not None
    assert (job.folder / results.LOCK).read_text() == str(os.getpid())  # held for the job
    job.lock.close()
    assert _records(sweep) == []


def test_skip_ok_jobs_false_runs_an_ok_job_again(tmp_path, cfg):
    sweep = _sweep(tmp_path)
    job = _job(sweep, "j", _with(cfg, skip_ok_jobs=False))
    _ok_summary(job.folder, cfg)
    assert sweep._decide_without_process(job) is False
    job.lock.close()


def test_a_folder_in_use_is_left_to_its_owner(tmp_path, cfg):
    sweep = _sweep(tmp_path)
    job = _job(sweep, "j", cfg)
    with results.folder_lock(job.folder) as owner:  # another open file: flock refuses it below
        assert owner is None
        assert sweep._decide_without_process(job) is True
    assert (job.outcome.folder, job.outcome.status, job.outcome.skipped) == (job.folder, "busy", False)
    assert job.outcome.error == f"in use by another sweep or run (pid {os.getpid()}): left to it"
    assert job.lock is None
    assert _records(sweep) == [{"job": 0, "folder": "j", "status": "busy", "owner": str(os.getpid())}]


def test_start_job_runs_an_ok_folder_of_another_config_again(tmp_path, cfg, capsys):
    from effitrain.sweep.job_start import start_job

    job = tmp_path / "j"
    hydra_cfg = OmegaConf.create({"sweep": {"dir": str(tmp_path)}, "runtime": {"output_dir": str(job)}})
    summary = _ok_summary(job, cfg)
    assert start_job(cfg, hydra_cfg) == summary
    capsys.readouterr()
    assert start_job(_with(cfg, seed=43), hydra_cfg) is None  # the run itself then refuses the folder
    assert capsys.readouterr().out == ""
