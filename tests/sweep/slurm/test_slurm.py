"""SLURM for real: a single-node cluster on this machine (tests/sweep/slurm/cluster.sh: Debian's slurm-wlm
and munge, installed when missing) runs sweeps through sbatch with ``hydra/launcher=submitit_slurm``.

The results must equal the same sweep run locally, and a job requeued mid-training (what a
preemption does) must resume from its last checkpoint and end bit-identical to an uninterrupted run.
Skipped, with the reason, only where SLURM cannot be installed.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.helpers.run import REPO, TINY, read_metrics, train_py
from tests.train.test_checkpoint import RESUMABLE, STEPS, assert_bit_identical, final_weights

CLUSTER = Path(__file__).with_name("cluster.sh")
# Both jobs see the machine's two cores (one job at a time on SLURM, one at a time locally), so
# torch uses the same threads in both and the floating-point results can be compared exactly.
ON_SLURM = [
    "hydra/launcher=submitit_slurm",
    "hydra.launcher.partition=debug",
    "hydra.launcher.cpus_per_task=2",
    "hydra.launcher.timeout_min=30",
]


@pytest.fixture(scope="module")
def slurm(tmp_path_factory):
    """The cluster's environment (SLURM_CONF); the daemons are stopped after the module."""
    installed = subprocess.run([str(CLUSTER), "install"], capture_output=True, text=True, timeout=900)
    if installed.returncode != 0:
        pytest.skip(f"SLURM cannot be installed here: {installed.stderr.strip() or installed.stdout.strip()}")
    folder = tmp_path_factory.mktemp("slurm")
    try:
        started = subprocess.run(
            [str(CLUSTER), "start", str(folder)], capture_output=True, text=True, timeout=120
        )
        assert started.returncode == 0, started.stdout + started.stderr
        yield {"SLURM_CONF": str(folder / "slurm.conf")}
    finally:
        subprocess.run([str(CLUSTER), "stop", str(folder)], capture_output=True, timeout=120)


def summaries(sweep: Path) -> dict[str, dict]:
    return {p.parent.name: json.loads(p.read_text()) for p in sweep.glob("*/summary.json")}


def losses(folder: Path) -> list[float]:
    return [line["train/loss"] for line in read_metrics(folder)]


@pytest.mark.slow
def test_a_sweep_through_sbatch_gives_the_local_results(tmp_path, slurm):
    args = ["-m", *TINY, "max_steps=3", "data.num_train=32", "data.num_eval=16", "optimizer=adamw,adafactor"]
    local = train_py(*args, f"hydra.sweep.dir={tmp_path / 'local'}")
    assert local.returncode == 0, local.stdout[-3000:] + local.stderr[-3000:]
    on_slurm = train_py(*args, *ON_SLURM, f"hydra.sweep.dir={tmp_path / 'slurm'}", env=slurm)
    assert on_slurm.returncode == 0, on_slurm.stdout[-3000:] + on_slurm.stderr[-3000:]
    assert "effitrain: 0 of 2 jobs failed" in on_slurm.stdout
    # the jobs went through sbatch: submitit's records of two SLURM jobs
    submitted = sorted((tmp_path / "slurm" / ".submitit").glob("*/*_submitted.pkl"))
    assert len(submitted) == 2
    expected, got = summaries(tmp_path / "local"), summaries(tmp_path / "slurm")
    assert sorted(got) == sorted(expected) and len(got) == 2
    for name, summary in got.items():
        assert summary["status"] == "ok"
        for key in ("train/loss", "train/loss_mean", "eval/loss", "train/steps", "train/samples"):
            assert summary[key] == expected[name][key], key
        assert losses(tmp_path / "slurm" / name) == losses(tmp_path / "local" / name)
        assert summary["env/pid"] != expected[name]["env/pid"]


def _requeue_when(slurm: dict, metrics: Path, at_step: int, timeout: float = 600) -> str:
    """``scontrol requeue`` the one running job once ``metrics`` shows ``at_step``; its id."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        steps = [line["step"] for line in read_metrics(metrics.parent)] if metrics.exists() else []
        if steps and steps[-1] >= at_step:
            queue = subprocess.run(
                ["squeue", "-h", "-t", "RUNNING", "-o", "%i"], capture_output=True, text=True, env=_env(slurm)
            )
            (job_id,) = queue.stdout.split()
            subprocess.run(["scontrol", "requeue", job_id], check=True, env=_env(slurm))
            return job_id
        time.sleep(0.005)
    raise AssertionError("the job never reached the step to requeue it at")


def _env(extra: dict) -> dict:
    return dict(os.environ, **extra)


@pytest.mark.slow
def test_a_requeued_job_resumes_and_ends_bit_identical(tmp_path, slurm):
    job = [*TINY, *RESUMABLE, "resume=auto", "optimizer=adamw"]
    reference = train_py("-m", *job, f"hydra.sweep.dir={tmp_path / 'local'}")
    assert reference.returncode == 0, reference.stdout[-3000:] + reference.stderr[-3000:]
    (name,) = summaries(tmp_path / "local")

    sweep = tmp_path / "slurm"
    process = subprocess.Popen(
        [sys.executable, str(REPO / "train.py"), "-m", *job, *ON_SLURM, f"hydra.sweep.dir={sweep}"],
        cwd=REPO,
        env=_env(slurm),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        _requeue_when(slurm, sweep / name / "metrics.jsonl", at_step=4)
        out, err = process.communicate(timeout=900)
    finally:
        process.kill()
    assert process.returncode == 0, out[-3000:] + err[-3000:]
    resumed = summaries(sweep)[name]
    assert resumed["status"] == "ok"
    assert 3 <= resumed["train/resumed_from_step"] < STEPS  # it did stop, and went on from a checkpoint
    expected = summaries(tmp_path / "local")[name]
    assert resumed["train/steps"] == expected["train/steps"] == STEPS
    assert resumed["train/loss_mean"] == expected["train/loss_mean"]
    assert resumed["eval/loss"] == expected["eval/loss"]
    assert losses(sweep / name) == losses(tmp_path / "local" / name)
    assert_bit_identical(final_weights(sweep / name), final_weights(tmp_path / "local" / name))


@pytest.mark.slow
def test_an_fsdp_job_of_two_slurm_tasks_trains_as_torchrun_does(tmp_path, slurm):
    """hydra.launcher.tasks_per_node=2: submitit runs the job in two SLURM tasks, which become its two
    ranks (effitrain.sweep.job_start); the steps are those of torchrun's two processes."""
    from tests.train.test_distributed import torchrun

    job = [*TINY, "max_steps=4", "data.num_train=64", "data.num_eval=16", "parallel=fsdp"]
    reference = torchrun(*job, f"hydra.run.dir={tmp_path / 'torchrun'}", cwd=tmp_path)
    assert reference.returncode == 0, reference.stderr[-3000:]
    on_slurm = train_py(
        "-m", *job, *ON_SLURM, "hydra.launcher.cpus_per_task=1", "hydra.launcher.tasks_per_node=2",
        f"hydra.sweep.dir={tmp_path / 'slurm'}", env=slurm,
    )  # fmt: skip
    assert on_slurm.returncode == 0, on_slurm.stdout[-3000:] + on_slurm.stderr[-3000:]
    [(name, summary)] = summaries(tmp_path / "slurm").items()
    assert (summary["status"], summary["cfg/world_size"], summary["cfg/parallel"]) == ("ok", 2, "fsdp")
    ranks = json.loads((tmp_path / "slurm" / name / "summary_ranks.json").read_text())
    assert [figures["env/rank"] for figures in ranks] == [0, 1]
    assert losses(tmp_path / "slurm" / name) == pytest.approx(losses(tmp_path / "torchrun"), rel=1e-6)
