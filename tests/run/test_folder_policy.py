"""The launcher's skip decision, in process and fast: which job folder effitrain's launcher settles
without starting a process (outside the sweep, ok before, ok before with another config, in use),
what it records, and the same decision in a job started by another launcher (``start_job``).
No job runs here (tests/sweep/test_launcher.py runs the real sweeps)."""

from __future__ import annotations

import json
import os

import pytest
from omegaconf import OmegaConf

from effitrain.run import folder_policy as results
from effitrain.sweep.launcher import LAUNCHER_DIR, LAUNCHES, LaunchedJob, LocalSweep
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
    from effitrain.sweep.worker import start_job

    job = tmp_path / "j"
    hydra_cfg = OmegaConf.create({"sweep": {"dir": str(tmp_path)}, "runtime": {"output_dir": str(job)}})
    summary = _ok_summary(job, cfg)
    assert start_job(cfg, hydra_cfg) == summary
    capsys.readouterr()
    assert start_job(_with(cfg, seed=43), hydra_cfg) is None  # the run itself then refuses the folder
    assert capsys.readouterr().out == ""


# -- the one folder policy (folder_policy.decide), as each caller asks it ---------------------------------


def test_decide_answers_the_run_and_the_sweep_for_each_folder(tmp_path, cfg):
    empty, ok = tmp_path / "empty", tmp_path / "ok"
    _ok_summary(ok, cfg)
    assert results.decide(empty, cfg).action == "run" and not empty.exists()  # nothing written
    assert results.decide(empty, cfg, job_of_sweep=True).action == "run"
    refused = results.decide(ok, cfg)  # a new run never overwrites an ok one
    assert (refused.action, refused.reason) == ("refuse", (
        f"hydra.run.dir={str(ok)!r} is invalid: it holds a finished ok run (summary.json); give another folder, "
        "or add resume=auto to keep it as it is"))  # fmt: skip
    kept = results.decide(ok, _with(cfg, resume="auto"))
    assert (kept.action, kept.previous["eval/loss"]) == ("keep", 0.5)
    assert kept.reason == f"effitrain: {ok} already holds a finished ok run (resume=auto): left as it is"
    changed = results.decide(ok, _with(cfg, resume="auto", seed=7))
    assert (changed.action, changed.reason) == ("refuse", (
        f"seed=7 is invalid: the finished ok run in {ok} ran with 42, and resume=auto keeps it as it is: "
        "give another folder for this config"))  # fmt: skip
    skipped = results.decide(ok, cfg, job_of_sweep=True)
    assert (skipped.action, skipped.previous["eval/loss"]) == ("skip", 0.5)
    assert skipped.reason == f"effitrain: skip: {ok} already holds an ok summary.json (skip_ok_jobs=true)"
    other = results.decide(ok, _with(cfg, seed=7), job_of_sweep=True)
    assert (other.action, other.reason) == (
        "refuse",
        results.skip_refusal(ok, other.previous, _with(cfg, seed=7)),
    )
    assert results.decide(ok, _with(cfg, skip_ok_jobs=False), job_of_sweep=True).action == "run"


def test_an_ok_summary_without_its_config_record_is_compared_on_its_cfg_keys(tmp_path, cfg):
    """An older version's summary (no job/config): its own cfg/* keys decide, read by hand here."""
    folder = tmp_path / "old"
    folder.mkdir()
    said = {
        "status": "ok",
        "eval/loss": 0.5,
        "cfg/seed": 42,
        "cfg/optimizer": "adamw",
        "cfg/lr": cfg.optimizer.lr,
    }
    (folder / "summary.json").write_text(json.dumps(said))
    assert results.decide(folder, cfg, job_of_sweep=True).action == "skip"
    seed = results.decide(folder, _with(cfg, seed=43), job_of_sweep=True)
    assert seed.action == "refuse" and seed.reason.startswith(
        f"seed=43 is invalid: {folder} holds an ok run with seed=42"
    )
    lr = results.decide(folder, _with(cfg, **{"optimizer.lr": 0.5}), job_of_sweep=True)
    assert lr.action == "refuse" and lr.reason.startswith("optimizer.lr=0.5 is invalid")
    (folder / "summary.json").write_text(json.dumps(dict(said, **{"cfg/optimizer": "lion"})))
    lion = results.decide(folder, _with(cfg, resume="auto"))  # resume=auto no longer leaves it "as it is"
    assert lion.action == "refuse" and lion.reason.startswith(
        f"optimizer='adamw' is invalid: the finished ok run in {folder} ran with 'lion'"
    )


def test_claimed_locks_then_decides(tmp_path, cfg):
    folder = tmp_path / "j"
    with results.folder_lock(folder) as owner:  # another holder
        assert owner is None
        with results.claimed(folder, cfg) as decision:
            assert (decision.action, decision.owner) == ("busy", str(os.getpid()))
    with results.claimed(folder, cfg) as decision:
        assert decision.action == "run" and (folder / results.LOCK).read_text() == str(os.getpid())
    assert os.listdir(folder) == []


# -- train.py's preflight: the folder decided and locked before Hydra writes .hydra/ ----------------


def _planted_ok_run(folder):
    """An ok run's folder as train.py leaves it, with a Hydra record that must stay as it is."""
    (folder / ".hydra").mkdir(parents=True)
    (folder / ".hydra" / "config.yaml").write_text("optimizer: planted\n")
    # what a finished run writes beside its status: its figure and config keys (run/folder_policy.finished_ok)
    (folder / "summary.json").write_text(json.dumps({"status": "ok", "eval/loss": 0.5, "cfg/seed": 7}))


@pytest.mark.slow
def test_a_run_locked_by_a_preflight_refuses_the_second_before_hydra_writes(tmp_path):
    """Two runs started at the same moment into one folder: the first's preflight holds the folder
    (as it does across its Hydra run), so the second is refused before its Hydra writes .hydra/."""
    from effitrain.commands.train_command import check_overrides_or_exit
    from tests.helpers.run import TINY, train_py

    folder = tmp_path / "run"
    held, argv, _ = check_overrides_or_exit([*TINY, f"hydra.run.dir={folder}"])
    with held:
        assert argv == [*TINY, f"hydra.run.dir={folder}"]
        done = train_py(*TINY, "seed=7", f"hydra.run.dir={folder}")
    assert done.returncode == 2, done.stderr[-2000:]
    assert done.stderr.strip().splitlines()[-1] == (
        f"effitrain: error: hydra.run.dir={str(folder)!r} is invalid: in use by another run (pid {os.getpid()})"
    )
    assert os.listdir(folder) == []  # no .hydra/ of the refused run, and the lock let go


@pytest.mark.slow
def test_config_dir_and_config_name_go_through_the_preflight(tmp_path):
    from tests.helpers.run import TINY, train_py

    conf = tmp_path / "conf"
    conf.mkdir()
    (conf / "exp.yaml").write_text("defaults:\n  - config\n  - _self_\n\nseed: 7\n")
    folder = tmp_path / "ok"
    _planted_ok_run(folder)
    flags = ["--config-dir", str(conf), "--config-name", "exp"]
    done = train_py(*flags, *TINY, f"hydra.run.dir={folder}")
    assert done.returncode == 2, done.stderr[-2000:]
    assert done.stderr.strip().splitlines()[-1] == (
        f"effitrain: error: hydra.run.dir={str(folder)!r} is invalid: it holds a finished ok run (summary.json); "
        "give another folder, or add resume=auto to keep it as it is"
    )
    assert (folder / ".hydra" / "config.yaml").read_text() == "optimizer: planted\n"  # not rewritten
    bad = train_py(*flags, *TINY, "eval_batch_size=0", f"hydra.run.dir={tmp_path / 'new'}")
    assert bad.returncode == 2 and not (tmp_path / "new").exists()
    assert bad.stderr.strip().splitlines() == [
        "effitrain: error: eval_batch_size=0 is invalid: must be an integer >= 1"
    ]


@pytest.mark.slow
def test_a_refused_resume_into_an_interrupted_run_leaves_its_folder_as_it_was(tmp_path):
    """resume=auto with another seed than the checkpoints': refused before Hydra writes, and the
    interrupted run's summary stays interrupted (not failed)."""
    import signal
    import subprocess
    import sys
    import time

    from tests.helpers.run import REPO, TINY, train_py

    # 200 steps to run (not the 32 of TINY's data): it is still training when SIGTERM comes, however
    # late a loaded machine lets this process see the first checkpoint
    args = [*TINY, "data.num_train=1600", "checkpoint_every=1", "max_steps=200", f"hydra.run.dir={tmp_path}"]
    process = subprocess.Popen([sys.executable, str(REPO / "train.py"), *args], cwd=REPO,
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # fmt: skip
    deadline = time.monotonic() + 300
    while not list(tmp_path.glob("checkpoints/step-*/")) and time.monotonic() < deadline:
        time.sleep(0.05)
    process.send_signal(signal.SIGTERM)
    process.wait(timeout=300)
    assert json.loads((tmp_path / "summary.json").read_text())["status"] == "interrupted"
    before = {p: p.read_bytes() for p in sorted(tmp_path.rglob("*")) if p.is_file()}
    done = train_py(*args, "resume=auto", "seed=7")
    assert done.returncode == 2, done.stderr[-2000:]
    assert (
        done.stderr.strip()
        .splitlines()[-1]
        .startswith("effitrain: error: seed=7 is invalid: differs from the checkpoint")
    )
    assert {p: p.read_bytes() for p in sorted(tmp_path.rglob("*")) if p.is_file()} == before
    # a sweep's job into that folder is refused as well, before any process starts
    from tests.helpers.run import compose

    job = compose("data.num_train=1600", "checkpoint_every=1", "max_steps=200", "resume=auto", "seed=7")
    refused = results.decide(tmp_path, job, job_of_sweep=True)
    assert refused.action == "refuse" and refused.reason.startswith(
        "seed=7 is invalid: differs from the checkpoint"
    )
    assert (
        results.decide(
            tmp_path,
            compose("data.num_train=1600", "checkpoint_every=1", "max_steps=200", "resume=auto"),
            job_of_sweep=True,
        ).action
        == "run"
    )


def test_a_settled_folder_is_left_as_it_was_even_a_dead_holders_lock_file(tmp_path, cfg):
    """kill -9 leaves the lock file: a run refused there (or a job skipped) does not replace it."""
    folder = tmp_path / "ok"
    _ok_summary(folder, cfg)
    (folder / results.LOCK).write_text("4242")
    before = {p.name: p.read_bytes() for p in folder.iterdir()}
    for job_of_sweep, action in ((False, "refuse"), (True, "skip")):
        with results.claimed(folder, cfg, job_of_sweep) as decision:
            assert decision.action == action
        assert {p.name: p.read_bytes() for p in folder.iterdir()} == before


def test_an_adapter_run_is_found_again_at_the_lr_it_ran_at(tmp_path):
    from effitrain.config.load import apply_adapter_lr

    composed = compose("adapter=lora")
    ran = compose("adapter=lora")
    assert apply_adapter_lr(ran) and ran.optimizer.lr != composed.optimizer.lr  # as the run derives it
    previous = {"status": "ok", results.CONFIG_KEY: results.config_record(ran)}
    assert results.skip_refusal(tmp_path, previous, composed) is None  # the sweep rerun skips it
    assert results.skip_refusal(tmp_path, previous, _with(composed, **{"adapter.lr": 5e-4})) is not None


# -- planted links: refused before anything is read, locked or written there ------------------------


@pytest.mark.parametrize("name", [results.LOCK, ".hydra", "checkpoints", "metrics.jsonl"])
def test_a_folder_holding_a_planted_link_is_refused_before_its_lock_is_opened(tmp_path, cfg, name):
    victim = tmp_path / "victim"
    victim.mkdir() if name in (".hydra", "checkpoints") else victim.write_text("precious\n")
    folder = tmp_path / "run"
    folder.mkdir()
    (folder / name).symlink_to(victim)
    refusal = (
        f"hydra.run.dir={str(folder)!r} is invalid: {folder / name} is a symbolic link (to {victim}), and "
        "effitrain writes through no link it did not make: remove the link, or give another folder"
    )
    for job_of_sweep in (False, True):
        with results.claimed(folder, cfg, job_of_sweep) as decision:
            assert (decision.action, decision.reason) == ("refuse", refusal)
    with pytest.raises(results.ConfigError, match="is a symbolic link"):
        results.check_output_dir(folder)
    from effitrain.config.validate import check_output_folder

    with pytest.raises(results.ConfigError) as raised:
        check_output_folder("hydra.run.dir", str(folder))
    assert str(raised.value) == refusal
    assert sorted(os.listdir(folder)) == [name]
    if victim.is_file():
        assert victim.read_text() == "precious\n"
    else:
        assert os.listdir(victim) == []


def test_a_run_with_a_checkpoint_linked_outside_is_refused_before_it_trains(tmp_path):
    from tests.helpers.run import run_job

    victim = tmp_path / "elsewhere"
    (victim / "model.safetensors").parent.mkdir()
    (victim / "model.safetensors").write_bytes(b"someone else's")
    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    (run / "checkpoints" / "step-00000001").symlink_to(victim)
    summary = run_job(run, "max_steps=2", "checkpoint_every=1", "resume=auto")
    assert summary["status"] == "failed" and summary["error_type"] == "config"
    assert "step-00000001 is a symbolic link" in summary["error"]
    assert "train/steps" not in summary or not summary["train/steps"]
    assert os.listdir(victim) == ["model.safetensors"]
    assert (victim / "model.safetensors").read_bytes() == b"someone else's"


@pytest.mark.slow
def test_train_py_refuses_a_planted_hydra_link_in_one_line_before_hydra_writes(tmp_path):
    from tests.helpers.run import TINY, train_py

    elsewhere, folder = tmp_path / "elsewhere", tmp_path / "run"
    elsewhere.mkdir()
    folder.mkdir()
    (folder / ".hydra").symlink_to(elsewhere)
    done = train_py(*TINY, f"hydra.run.dir={folder}")
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [
        f"effitrain: error: hydra.run.dir={str(folder)!r} is invalid: {folder}/.hydra is a symbolic link (to "
        f"{elsewhere}), and effitrain writes through no link it did not make: remove the link, or give another folder"
    ]
    assert os.listdir(elsewhere) == [] and os.listdir(folder) == [".hydra"]


@pytest.mark.parametrize(
    "forged",
    [
        {"status": "ok"},  # no figure, no record
        {"status": "ok", "eval/loss": 0.5},  # no record: what was run is unknown
        {"status": "ok", "eval/loss": float("nan"), "cfg/seed": 42},  # a NaN result
        {"status": "ok", "eval/loss": "0.5", "cfg/seed": 42},  # not a number
    ],
)
def test_an_ok_status_without_its_figure_or_its_record_is_run_again(tmp_path, cfg, forged):
    """A summary that says ok but lacks what a finished run writes is never skipped as done (a rerun
    of the sweep skipped it before), and its folder is run again, not refused as a finished run."""
    folder = tmp_path / "forged"
    folder.mkdir()
    (folder / "summary.json").write_text(json.dumps(forged))
    assert not results.finished_ok(json.loads((folder / "summary.json").read_text()), cfg)
    assert results.decide(folder, cfg, job_of_sweep=True).action == "run"
    assert results.decide(folder, cfg).action == "run"
    complete = {"status": "ok", "eval/loss": 0.5, results.CONFIG_KEY: results.config_record(cfg)}
    assert results.finished_ok(complete, cfg)
    assert results.finished_ok({**forged, **complete}, cfg)
