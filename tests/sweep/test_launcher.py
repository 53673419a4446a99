"""effitrain's launcher on a light task (tests/helpers/launcher_app.py: each job sleeps and records what its
process was given), so these run in seconds: device and core assignment, killed, timed-out and
interrupted jobs, two sweeps into one folder, job folders that would leave their sweep.
The same paths under real training runs are in tests/sweep/test_sweep.py (slow)."""

from __future__ import annotations

import json
import os
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from effitrain.config.errors import ConfigError
from effitrain.config.schema import launcher_settings
from effitrain.sweep.launcher import LAUNCHER_DIR, LAUNCHES
from tests.helpers.run import REPO, wait_for_lines

APP = REPO / "tests" / "helpers" / "launcher_app.py"


def app_command(sweep_dir: Path, *args: str) -> list[str]:
    return [sys.executable, str(APP), "-m", *args, f"hydra.sweep.dir={sweep_dir}"]


def run_app(sweep_dir: Path, *args: str, timeout: int = 120) -> subprocess.CompletedProcess:
    return subprocess.run(app_command(sweep_dir, *args), capture_output=True, text=True, timeout=timeout)


def start_app(sweep_dir: Path, *args: str) -> subprocess.Popen:
    return subprocess.Popen(
        app_command(sweep_dir, *args), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )


def records(sweep_dir: Path) -> dict[int, dict]:
    """What each job's process saw, by seed."""
    found = [json.loads(p.read_text()) for p in sweep_dir.glob("*/record.json")]
    return {r["seed"]: r for r in found}


def launches(sweep_dir: Path) -> list[dict]:
    path = sweep_dir / LAUNCHER_DIR / LAUNCHES
    return [json.loads(line) for line in path.read_text().splitlines()]


def summary(sweep_dir: Path, seed: int) -> dict:
    (folder,) = [p for p in sweep_dir.iterdir() if p.name.endswith(f"seed={seed}")]
    return json.loads((folder / "summary.json").read_text())


def overlapping(a: dict, b: dict) -> bool:
    return a["started"] < b["ended"] and b["started"] < a["ended"]


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


@pytest.mark.slow
def test_running_jobs_never_share_a_device_or_a_core(tmp_path):
    # a given device list is handed out as given: this works on a machine without GPUs
    done = run_app(
        tmp_path,
        "seed=1,2,3,4",
        "+sleep_s=1.5",
        "hydra.launcher.max_parallel=2",
        "hydra.launcher.devices=[0,1,2,3]",
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "effitrain: 0 of 4 jobs failed (0 skipped: ok before)" in done.stdout
    seen = records(tmp_path)
    assert sorted(seen) == [1, 2, 3, 4]
    folders = list(tmp_path.glob("*seed=*"))
    assert len(folders) == 4
    left = [".hydra", "job.log", "record.json", "summary.json"]
    for folder in folders:  # the launcher held each job's lock: no lock file left
        assert sorted(p.name for p in folder.iterdir()) == left
    # what the processes saw is what the launcher recorded
    by_pid = {line["pid"]: line for line in launches(tmp_path)}
    for record in seen.values():
        assert record["cuda_visible_devices"] == by_pid[record["pid"]]["cuda_visible_devices"]
        assert record["cpus"] == by_pid[record["pid"]]["cpus"]
    # one device per job, all four used (freed devices go to the back of the queue)
    assert sorted(r["cuda_visible_devices"] for r in seen.values()) == ["0", "1", "2", "3"]
    pairs = [(a, b) for a in seen.values() for b in seen.values() if a["seed"] < b["seed"]]
    concurrent = [(a, b) for a, b in pairs if overlapping(a, b)]
    assert concurrent, "with max_parallel=2 some jobs ran at once"
    cpus = sorted(os.sched_getaffinity(0))
    for a, b in concurrent:
        assert a["cuda_visible_devices"] != b["cuda_visible_devices"]
        if len(cpus) >= 2:
            assert not set(a["cpus"]) & set(b["cpus"])
    # never more than two at once
    starts = sorted([(r["started"], 1) for r in seen.values()] + [(r["ended"], -1) for r in seen.values()])
    running = peak = 0
    for _, step in starts:
        running += step
        peak = max(peak, running)
    assert peak == 2
    share = len(cpus) // 2 if len(cpus) >= 2 else 1
    assert all(len(r["cpus"]) == share and r["omp_num_threads"] == str(share) for r in seen.values())


@pytest.mark.slow
def test_gpus_per_job_hands_out_disjoint_groups(tmp_path):
    done = run_app(
        tmp_path,
        "seed=1,2,3",
        "+sleep_s=1",
        "hydra.launcher.max_parallel=4",  # only two groups of two: two jobs at once
        "hydra.launcher.devices=[4,5,6,7]",
        "hydra.launcher.gpus_per_job=2",
    )
    assert done.returncode == 0, done.stdout + done.stderr
    seen = records(tmp_path)
    assert {r["cuda_visible_devices"] for r in seen.values()} <= {"4,5", "6,7"}
    for a in seen.values():
        for b in seen.values():
            if a is not b and overlapping(a, b):
                assert a["cuda_visible_devices"] != b["cuda_visible_devices"]
    assert not any(
        overlapping(a, b) and overlapping(b, c) and overlapping(a, c)
        for a in seen.values()
        for b in seen.values()
        for c in seen.values()
        if len({a["seed"], b["seed"], c["seed"]}) == 3
    )


@pytest.mark.slow
def test_killed_job_is_recorded_the_others_finish_and_a_rerun_repeats_only_it(tmp_path):
    marker = tmp_path / "die"
    marker.mkdir()
    (marker / "2").touch()  # job seed=2 SIGKILLs itself once
    sweep = tmp_path / "sweep"
    args = ["seed=1,2,3", "+sleep_s=0.2", f"+die_marker={marker}"]
    first = run_app(sweep, *args)
    assert first.returncode == 1, first.stdout + first.stderr
    killed = summary(sweep, 2)
    assert (killed["status"], killed["signal"]) == ("killed", signal.SIGKILL)
    assert killed["error"].startswith("killed by SIGKILL")
    assert killed["cfg/seed"] == 2 and killed["job/overrides"] == [
        f"+die_marker={marker}",
        "+sleep_s=0.2",
        "seed=2",
    ]
    assert summary(sweep, 1)["status"] == summary(sweep, 3)["status"] == "ok"
    assert "effitrain: 1 of 3 jobs failed (0 skipped: ok before)" in first.stdout
    killed_line = next(line for line in first.stdout.splitlines() if line.startswith("effitrain: killed:"))
    assert killed_line.endswith("seed=2/job.log)")  # the job's own log, named in its line
    pids = {line["job"]: line["pid"] for line in launches(sweep)}

    second = run_app(sweep, *args)
    assert second.returncode == 0, second.stdout + second.stderr
    assert "effitrain: 0 of 3 jobs failed (2 skipped: ok before)" in second.stdout
    rerun = launches(sweep)[len(pids) :]
    # skipped jobs were settled without a process; only the killed one started again
    assert [line.get("pid") is not None for line in rerun] == [False, True, False]
    assert [line["job"] for line in rerun if line.get("pid")] == [1]
    assert summary(sweep, 2)["status"] == "ok"


@pytest.mark.slow
@pytest.mark.parametrize("checkpointed", [False, True])
def test_the_printed_rerun_command_resumes_a_job_that_left_checkpoints(tmp_path, checkpointed):
    # a fresh start into a folder holding checkpoints is refused: the command must say resume=auto
    marker = tmp_path / "die"
    marker.mkdir()
    (marker / "2").touch()
    sweep = tmp_path / "sweep"
    args = ["seed=1,2", f"+die_marker={marker}", f"+checkpoint_first={checkpointed}"]
    first = run_app(sweep, *args)
    assert first.returncode == 1, first.stdout + first.stderr
    [line] = [line for line in first.stdout.splitlines() if line.startswith("effitrain: rerun the jobs")]
    command = shlex.split(line.removeprefix("effitrain: rerun the jobs that are not ok: "))
    assert command[0] == "python" and command[1] == str(APP)
    assert command[2:] == [
        "-m",
        *args,
        *(["resume=auto"] if checkpointed else []),
        f"hydra.sweep.dir={sweep}",
    ]


@pytest.mark.slow
def test_a_rerun_skips_only_the_ok_jobs(tmp_path):
    """The skip decision, through the launcher (in process: tests/run/test_folder_policy.py): of a finished sweep, a job whose summary says failed, oom or is
    missing runs again; only an ok one is settled without a process."""
    args = ["seed=1,2,3,4"]
    first = run_app(tmp_path, *args)
    assert first.returncode == 0, first.stdout + first.stderr
    for seed, status in ((2, "failed"), (3, "oom")):
        (folder,) = [p for p in tmp_path.iterdir() if p.name.endswith(f"seed={seed}")]
        (folder / "summary.json").write_text(json.dumps({"status": status, "error": "planted"}))
    (folder,) = [p for p in tmp_path.iterdir() if p.name.endswith("seed=4")]
    (folder / "summary.json").unlink()
    before = len(launches(tmp_path))

    second = run_app(tmp_path, *args)
    assert second.returncode == 0, second.stdout + second.stderr
    assert "effitrain: 0 of 4 jobs failed (1 skipped: ok before)" in second.stdout
    rerun = launches(tmp_path)[before:]
    assert [line.get("pid") is not None for line in rerun] == [False, True, True, True]
    assert [summary(tmp_path, seed)["status"] for seed in (1, 2, 3, 4)] == ["ok"] * 4


def test_a_job_started_by_another_launcher_skips_only_an_ok_summary(tmp_path, monkeypatch, capsys):
    """The same decision where Hydra's own launchers (submitit) start the job: start_job."""
    from omegaconf import OmegaConf

    from effitrain.sweep.worker import INDUCTOR_CACHE, start_job

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", "restored after the test")
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR")
    job = tmp_path / "j"
    hydra_cfg = OmegaConf.create({"sweep": {"dir": str(tmp_path)}, "runtime": {"output_dir": str(job)}})
    job.mkdir()
    from effitrain.run.folder_policy import CONFIG_KEY, config_record
    from tests.helpers.run import compose

    cfg = compose()
    assert start_job(cfg, hydra_cfg) is None  # no summary yet
    # the sweep's jobs share one Inductor cache under the sweep folder
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(tmp_path.resolve() / INDUCTOR_CACHE)
    for status in ("failed", "oom", "killed"):
        (job / "summary.json").write_text(json.dumps({"status": status}))
        assert start_job(cfg, hydra_cfg) is None, status
    assert capsys.readouterr().out == ""
    (job / "summary.json").write_text(json.dumps({"status": "ok", "eval/loss": 0.5}))  # no record
    assert start_job(cfg, hydra_cfg) is None
    finished = {"status": "ok", "eval/loss": 0.5, CONFIG_KEY: config_record(cfg)}  # as a run writes it
    (job / "summary.json").write_text(json.dumps(finished))
    assert start_job(cfg, hydra_cfg) == finished
    assert capsys.readouterr().out == (
        f"effitrain: skip: {job} already holds an ok summary.json (skip_ok_jobs=true)\n"
    )
    unset = OmegaConf.create(OmegaConf.to_container(cfg))
    del unset["skip_ok_jobs"]
    assert start_job(unset, hydra_cfg) == finished  # on by default
    assert start_job(OmegaConf.merge(cfg, {"skip_ok_jobs": False}), hydra_cfg) is None


@pytest.mark.slow
def test_a_job_past_its_time_limit_is_stopped_and_recorded_as_timeout(tmp_path):
    done = run_app(tmp_path, "seed=1", "+sleep_s=60", "hydra.launcher.timeout_min=0.02", timeout=60)
    assert done.returncode == 1, done.stdout + done.stderr
    timed_out = summary(tmp_path, 1)
    assert (timed_out["status"], timed_out["signal"]) == ("timeout", signal.SIGTERM)
    assert "hydra.launcher.timeout_min=0.02" in timed_out["error"]
    (line,) = launches(tmp_path)
    assert line["ended"] - line["started"] < 30


@pytest.mark.slow
@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_to_the_sweep_reaches_every_running_job(tmp_path, signum):
    sweep = start_app(tmp_path, "seed=1,2,3", "+sleep_s=60", "hydra.launcher.max_parallel=2")
    lines = wait_for_lines(sweep, "started (pid", 2, timeout=90)
    pids = [
        int(line.split("(pid ")[1].split(",")[0].split(")")[0]) for line in lines if "started (pid" in line
    ]
    sweep.send_signal(signum)
    out, err = sweep.communicate(timeout=60)
    assert sweep.returncode == 128 + signum, out + err
    assert "Traceback" not in err
    assert f"the sweep was stopped by {signal.Signals(signum).name}" in err
    for seed in (1, 2):
        stopped = summary(tmp_path, seed)
        (log,) = tmp_path.glob(f"*seed={seed}/job.log")
        assert (stopped["status"], stopped["signal"]) == ("interrupted", signum), log.read_text()[-2000:]
    assert "effitrain: not started: +sleep_s=60,seed=3" in out
    assert "(0 skipped: ok before, 1 not started)" in out
    assert not any(alive(pid) for pid in pids)


@pytest.mark.slow
@pytest.mark.parametrize("again", [False, True])
def test_a_job_that_ignores_the_sweep_s_signal_is_killed_after_kill_grace_s_or_a_second_one(tmp_path, again):
    grace = 120 if again else 2
    sweep = start_app(
        tmp_path, "seed=1", "+sleep_s=120", "+ignore_sigint=true", f"hydra.launcher.kill_grace_s={grace}"
    )
    deadline = time.time() + 90
    while not list(tmp_path.glob("*seed=1/ignoring")) and time.time() < deadline:
        time.sleep(0.05)
    sent = time.time()
    sweep.send_signal(signal.SIGINT)
    if again:
        time.sleep(0.5)
        sweep.send_signal(signal.SIGINT)
    out, err = sweep.communicate(timeout=90)
    assert sweep.returncode == 128 + signal.SIGINT, out + err
    killed = summary(tmp_path, 1)
    assert (killed["status"], killed["signal"]) == ("killed", signal.SIGKILL)
    assert killed["error"] == (
        "killed by SIGKILL after SIGINT: it did not stop within hydra.launcher.kill_grace_s"
    )
    (line,) = launches(tmp_path)
    # killed once the grace ran out (not before it), or at the second signal, long before it would have
    took = line["ended"] - sent
    assert took < 30 if again else took >= grace


@pytest.mark.slow
def test_jobs_end_when_the_sweep_process_is_killed(tmp_path):
    sweep = start_app(tmp_path, "seed=1,2", "+sleep_s=60", "hydra.launcher.max_parallel=2")
    lines = wait_for_lines(sweep, "started (pid", 2, timeout=90)
    pids = [
        int(line.split("(pid ")[1].split(",")[0].split(")")[0]) for line in lines if "started (pid" in line
    ]
    sweep.kill()  # SIGKILL: the sweep can forward nothing; the jobs' parent-death signal ends them
    sweep.communicate(timeout=30)
    deadline = time.time() + 20
    while any(alive(pid) for pid in pids) and time.time() < deadline:
        time.sleep(0.1)
    assert not any(alive(pid) for pid in pids)


@pytest.mark.slow
def test_a_second_sweep_into_the_same_folder_leaves_running_jobs_alone(tmp_path):
    args = ["seed=1,2", "+sleep_s=4", "hydra.launcher.max_parallel=2"]
    first = start_app(tmp_path, *args)
    wait_for_lines(first, "started (pid", 2, timeout=90)
    second = run_app(tmp_path, *args)
    out, err = first.communicate(timeout=60)
    assert first.returncode == 0, out + err
    assert "effitrain: 0 of 2 jobs failed (0 skipped: ok before)" in out
    assert second.returncode == 1, second.stdout + second.stderr
    assert "effitrain: 0 of 2 jobs failed (0 skipped: ok before, 2 in use by another sweep, not run)" in (
        second.stdout
    )
    assert (
        second.stdout.count("effitrain: busy:") == 2
        and "in use by another sweep or run (pid" in second.stdout
    )
    # the second sweep started no process and wrote nothing into the job folders
    assert [line.get("pid") for line in launches(tmp_path)].count(None) == 2
    assert {r["seed"] for r in records(tmp_path).values()} == {1, 2}
    assert all(len(list(tmp_path.glob(f"*seed={s}/record.json"))) == 1 for s in (1, 2))


@pytest.mark.slow
def test_a_job_folder_cannot_leave_its_sweep(tmp_path):
    sweep = tmp_path / "sweep"
    # a value holding ../ stays one folder name inside the sweep
    inside = run_app(sweep, "seed=1", "+note=../../escaped")
    assert inside.returncode == 0, inside.stdout + inside.stderr
    assert [p.name for p in sweep.iterdir() if not p.name.startswith(".") and p.is_dir()] == [
        "+note=..%2F..%2Fescaped,seed=1"
    ]
    # a subdir pattern that points outside is refused for that job, and counted
    outside = run_app(sweep, "seed=1", "hydra.sweep.subdir=../escaped_${seed}")
    assert outside.returncode == 1, outside.stdout + outside.stderr
    assert "effitrain: 1 of 1 jobs failed (0 skipped: ok before)" in outside.stdout
    assert "a job folder must be inside the sweep folder" in outside.stdout
    assert not (tmp_path / "escaped_1").exists()


def test_launcher_settings_are_checked_in_one_line():
    assert launcher_settings({"max_parallel": 2, "devices": [0, 1]})["devices"] == ["0", "1"]
    bad = [
        ({"max_parallel": 0}, "hydra.launcher.max_parallel=0 is invalid: a whole number >= 1"),
        ({"devices": [0, 0]}, "hydra.launcher.devices=[0, 0] is invalid: a list of distinct GPU ids"),
        (
            {"devices": [0], "gpus_per_job": 2},
            "hydra.launcher.gpus_per_job=2 is invalid: at most the 1 devices",
        ),
        ({"timeout_min": -1}, "hydra.launcher.timeout_min=-1 is invalid: a number > 0"),
        (
            {"max_paralel": 2},
            "hydra.launcher.max_paralel is not a setting of effitrain's launcher: use max_parallel",
        ),
    ]
    for params, message in bad:
        with pytest.raises(ConfigError, match=message.replace("[", r"\[").replace("]", r"\]")):
            launcher_settings(params)


def test_launcher_settings_keep_a_whole_number_whole_and_refuse_what_is_not_a_number():
    settings = launcher_settings({"timeout_min": 2, "kill_grace_s": 0.5, "devices": 3})
    assert (settings["timeout_min"], type(settings["timeout_min"])) == (2, int)  # shown as given, not 2.0
    assert (settings["kill_grace_s"], settings["devices"]) == (0.5, ["3"])
    bad = [
        ({"kill_grace_s": True}, "hydra.launcher.kill_grace_s=true is invalid: a number > 0"),
        ({"timeout_min": "2"}, "hydra.launcher.timeout_min='2' is invalid: a number > 0"),
        ({"devices": []}, "hydra.launcher.devices=[] is invalid: a list of distinct GPU ids, e.g. [0,1]"),
        (
            {"devices": [0, "0"]},
            "hydra.launcher.devices=[0, '0'] is invalid: a list of distinct GPU ids, e.g. [0,1]",
        ),
    ]
    for params, message in bad:
        with pytest.raises(ConfigError) as error:
            launcher_settings(params)
        assert str(error.value) == message


def test_launcher_settings_are_typed_when_composed():
    """The settings' types come from schema.LauncherConfig in the ConfigStore: a wrong type fails
    while the sweep's config is composed, in one line (the sweep's, not each job's)."""
    from omegaconf import OmegaConf

    from effitrain.commands.train_command import preflight
    from effitrain.config.compose import compose
    from effitrain.config.schema import LauncherConfig

    cfg = compose(["hydra.launcher.max_parallel=3", "hydra.launcher.timeout_min=0.5"])
    assert OmegaConf.get_type(cfg.hydra.launcher) is LauncherConfig
    assert launcher_settings(cfg.hydra.launcher)["max_parallel"] == 3
    assert launcher_settings(cfg.hydra.launcher)["timeout_min"] == 0.5
    bad = [
        ("hydra.launcher.max_parallel=x", "hydra.launcher.max_parallel='x' is invalid: must be an integer"),
        (
            "hydra.launcher.cpu_pinning=maybe",
            "hydra.launcher.cpu_pinning='maybe' is invalid: must be true or false",
        ),
    ]
    for override, message in bad:
        with pytest.raises(ConfigError) as error:
            preflight(["-m", "seed=1,2", override])
        assert str(error.value) == message
    with pytest.raises(ConfigError) as error:  # a plain dict (the launcher's own check) is typed alike
        launcher_settings({"cpu_pinning": "maybe"})
    assert str(error.value) == "hydra.launcher.cpu_pinning='maybe' is invalid: true or false"


@pytest.mark.slow
def test_bad_launcher_settings_stop_train_py_before_anything_runs(tmp_path):
    from tests.helpers.run import TINY, train_py

    done = train_py("-m", *TINY, "seed=1,2", "hydra.launcher.max_parallel=0", f"hydra.sweep.dir={tmp_path}")
    assert done.returncode == 2
    assert (
        done.stderr.strip()
        == "effitrain: error: hydra.launcher.max_parallel=0 is invalid: a whole number >= 1"
    )
    assert not tmp_path.exists() or not any(tmp_path.iterdir())


class Planted:
    """A pickle payload: unpickling it makes the file ``marker`` (code run from a file)."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (os.mkdir, (self.marker,))


def test_a_job_s_spec_is_read_from_a_file_without_a_name_and_nothing_is_left_behind(tmp_path):
    """A job's spec is code its process unpickles: it lies in an unnamed file (its stdin), so no one
    can plant another in its place, even where colleagues may write to the sweep folder."""
    done = run_app(tmp_path, "seed=1,2")
    assert done.returncode == 0, done.stdout + done.stderr
    seen = records(tmp_path)
    assert [seen[seed]["stdin"].endswith(" (deleted)") for seed in (1, 2)] == [True, True]
    assert [p.name for p in (tmp_path / LAUNCHER_DIR).iterdir()] == [LAUNCHES]


def test_a_summary_is_read_as_json_never_as_a_pickle(tmp_path):
    import pickle

    from effitrain.run.results import read_json

    result = tmp_path / "summary.json"
    result.write_bytes(pickle.dumps(Planted(tmp_path / "ran")))  # planted in a shared sweep folder
    assert read_json(result) is None and not (tmp_path / "ran").exists()
    result.write_text(json.dumps({"completed": True, "return_value": 0.5}))
    assert read_json(result) == {"completed": True, "return_value": 0.5}
    assert read_json(tmp_path / "none.json") is None


def test_a_job_result_cut_short_or_not_an_object_is_no_result():
    """What the launcher reads from a job's result file: a process killed while writing it, or one
    that wrote nothing, said nothing of its task."""
    from effitrain.run.results import json_object

    assert json_object(b'{"completed": true, "return_value": 0.5}') == {
        "completed": True,
        "return_value": 0.5,
    }
    assert [json_object(data) for data in (b"", b'{"completed": tr', b"[0.5]", b"\xff")] == [None] * 4


def test_a_sweep_says_the_shared_overrides_once_and_each_job_what_differs():
    from effitrain.sweep.launcher import split_shared

    jobs = [["model=tiny", "data=synthetic", "seed=1", "optimizer=adamw"],
            ["model=tiny", "data=synthetic", "seed=2", "optimizer=adamw"],
            ["data=synthetic", "model=tiny", "seed=1", "optimizer=lion"]]  # fmt: skip
    shared, labels = split_shared(jobs)
    assert shared == ["model=tiny", "data=synthetic"]
    assert labels == ["seed=1 optimizer=adamw", "seed=2 optimizer=adamw", "seed=1 optimizer=lion"]
    assert split_shared([["seed=1"]]) == ([], ["seed=1"])


@pytest.mark.slow
@pytest.mark.parametrize("planted", ["job.log", "launches.jsonl"])
def test_a_sweep_folder_holding_a_planted_link_is_refused_and_the_target_keeps_its_bytes(tmp_path, planted):
    """``job.log`` or ``.effitrain/launches.jsonl`` linked to another file: the sweep is refused in one
    line before any job starts (it overwrote or appended to the target before)."""
    sweep = tmp_path / "sweep"
    done = run_app(sweep, "seed=1")
    assert done.returncode == 0, done.stderr
    (job,) = [p for p in sweep.iterdir() if p.name.endswith("seed=1")]
    link = job / "job.log" if planted == "job.log" else sweep / LAUNCHER_DIR / LAUNCHES
    victim = tmp_path / "victim"
    victim.write_text("precious\n")
    link.unlink()
    link.symlink_to(victim)
    again = run_app(sweep, "seed=1,2")
    assert again.returncode == 2
    assert again.stderr.strip().splitlines()[-1] == (
        f"effitrain: error: hydra.sweep.dir={str(sweep)!r} is invalid: {link} is a symbolic link (to {victim}), "
        "and effitrain writes through no link it did not make: remove the link, or give another folder"
    )
    assert victim.read_text() == "precious\n"
    assert not [p for p in sweep.iterdir() if p.name.endswith("seed=2")]


@pytest.mark.parametrize(
    ("code", "result", "summary", "expected"),
    [
        (0, None, None, ("failed", "its process exited with code 0 and no summary.json")),  # no word at all
        (0, {"completed": True, "return_value": 0.5}, None, ("ok", None)),  # a task that writes no summary
        (0, {"completed": False, "error": "boom"}, None, ("failed", "boom")),
        (0, None, {"status": "ok"}, ("ok", None)),  # its own new summary says so
        (1, None, {"status": "failed", "error": "bad"}, ("failed", "bad")),
    ],
)
def test_a_job_is_ok_only_where_its_summary_or_its_result_says_so(tmp_path, code, result, summary, expected):
    """How a job ended, read from its exit code, its result and its summary: a process that exits 0
    but said nothing (no result, no summary) did not finish ok."""
    from effitrain.run import results
    from effitrain.sweep.launcher import LaunchedJob, file_id, job_outcome

    folder = tmp_path / "job"
    folder.mkdir()
    job = LaunchedJob(0, [], None, folder, "job")
    job.before = {name: file_id(folder / name) for name in (results.SUMMARY, results.METRICS)}
    if summary is not None:
        results.write_json_atomic(folder / results.SUMMARY, summary)
    outcome = job_outcome(job, code, result, timeout_min=60)
    assert outcome.status == expected[0]
    assert (outcome.error is None) if expected[1] is None else expected[1] in outcome.error
