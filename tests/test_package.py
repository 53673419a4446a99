"""The package installs and works outside the checkout: a real wheel in a fresh virtual environment."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import sysconfig
import venv

import pytest

from tests.helpers.run import REPO


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    """A venv holding the wheel built from this checkout (not an editable install); the heavy
    dependencies come from the test environment's site-packages as a plain path, so nothing is
    downloaded and the checkout's editable finder is not loaded."""
    root = tmp_path_factory.mktemp("pkg")
    wheels = root / "wheels"
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", wheels, REPO],
        check=True, capture_output=True, timeout=300,
    )  # fmt: skip
    env_dir = root / "venv"
    # no pip of its own (ensurepip's install is most of a venv's cost): this pip installs into it
    venv.create(env_dir)
    python = env_dir / "bin" / "python"
    site = subprocess.run(
        [python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        check=True, capture_output=True, text=True,
    ).stdout.strip()  # fmt: skip
    (root / "venv" / site.removeprefix(str(env_dir) + "/") / "deps.pth").write_text(
        sysconfig.get_paths()["purelib"] + "\n"
    )
    [wheel] = wheels.glob("effitrain-*.whl")
    subprocess.run(
        [sys.executable, "-m", "pip", "--python", python, "install", "-q", "--no-deps", "--no-index", wheel],
        check=True, timeout=300,
    )  # fmt: skip
    return env_dir


def effitrain(env_dir, *args, cwd):
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    return subprocess.run(
        [env_dir / "bin" / "effitrain", *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=600
    )


@pytest.mark.slow
def test_an_installed_wheel_trains_estimates_and_sweeps_outside_the_checkout(installed, tmp_path):
    where = subprocess.run(
        [installed / "bin" / "python", "-c", "import effitrain; print(effitrain.__file__)"],
        cwd=tmp_path, capture_output=True, text=True, check=True,
    ).stdout  # fmt: skip
    assert str(installed) in where and str(REPO) not in where  # the wheel's copy, not the checkout
    version = effitrain(installed, "--version", cwd=tmp_path)
    assert version.stdout.strip().startswith("effitrain ")

    tiny = ["model=tiny", "data=synthetic", "max_steps=2", "logger=none", "progress_bar=false"]
    done = effitrain(installed, "train", *tiny, "hydra.run.dir=run", cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["status"] == "ok" and summary["train/steps"] == 2

    estimate = effitrain(installed, "estimate", "model=tiny", "data=synthetic", "--json", cwd=tmp_path)
    assert estimate.returncode == 0, estimate.stderr[-3000:]
    rows = json.loads(estimate.stdout)["optimizers"]
    from effitrain.commands.estimate import estimate_memory
    from tests.helpers.run import compose

    here = estimate_memory(compose("model=tiny", "data=synthetic"))["chosen"]  # the checkout's own figure
    assert rows["adamw"]["optimizer_state_bytes"] == here["optimizer_state_bytes"] > 2 * here["weights_bytes"]

    sweep = effitrain(installed, "train", "-m", *tiny, "optimizer=adamw,adafactor", "hydra.sweep.dir=sweep",
                      cwd=tmp_path)  # fmt: skip
    assert sweep.returncode == 0, sweep.stdout[-2000:] + sweep.stderr[-3000:]
    assert "effitrain: 0 of 2 jobs failed" in sweep.stdout
    statuses = [json.loads(p.read_text())["status"] for p in (tmp_path / "sweep").glob("*/summary.json")]
    assert statuses == ["ok", "ok"]
    named = effitrain(installed, "check", "sweep=optimizers", *tiny, cwd=tmp_path)  # multirun_sweeps/ shipped
    assert named.returncode == 0 and "the configuration is valid" in named.stdout, named.stderr[-2000:]


def test_every_package_of_effitrain_is_in_the_wheel_s_list():
    """pyproject.toml lists the wheel's packages by hand (conf/ is mapped in as effitrain.conf): a new
    package left out of it installs without its modules (config.techniques did: a ModuleNotFoundError
    in the installed command only)."""
    import tomllib

    listed = set(tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    found = {".".join(p.parent.relative_to(REPO).parts) for p in (REPO / "effitrain").rglob("__init__.py")}
    assert found <= listed, sorted(found - listed)
