"""A light Hydra app on effitrain's config and launcher, for the launcher's fast tests: each job
sleeps, records what its process was given (devices, cores, threads, times) and writes an ok
summary.json, or dies as told by a marker file (so the same command then runs normally), or
ignores Ctrl-C (``+ignore_sigint=true``, once it has made ``<job>/ignoring``).

    python tests/helpers/launcher_app.py -m seed=1,2 +sleep_s=1 hydra.sweep.dir=D
"""

import json
import os
import signal
import sys
import time
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig

from effitrain.config.registry import CONF_DIR
from effitrain.run import results
from effitrain.run.folder_policy import CONFIG_KEY, config_record
from effitrain.sweep.launcher import expose_launcher_plugin


def task(cfg) -> float:
    folder = Path(HydraConfig.get().runtime.output_dir)
    started = time.time()
    marker = cfg.get("die_marker")
    if marker and Path(marker, str(cfg.seed)).exists():
        Path(marker, str(cfg.seed)).unlink()  # dies once: a rerun of the same command runs normally
        if cfg.get("checkpoint_first"):  # as a run does at checkpoint_every before it is killed
            (folder / "checkpoints" / "step-00000001").mkdir(parents=True)
        os.kill(os.getpid(), signal.SIGKILL)
    if cfg.get("ignore_sigint"):  # a job that does not stop when the sweep forwards Ctrl-C
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        (folder / "ignoring").touch()
    time.sleep(float(cfg.get("sleep_s", 0)))
    record = {
        "seed": cfg.seed,
        "pid": os.getpid(),
        "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
        "cpus": sorted(os.sched_getaffinity(0)),
        "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
        "stdin": os.readlink("/proc/self/fd/0"),  # where its process read the job's spec from
        "started": started,
        "ended": time.time(),
    }
    (folder / "record.json").write_text(json.dumps(record))
    # as a run writes it: a finished ok summary holds its config record (run/folder_policy.finished_ok)
    summary = {"status": "ok", "eval/loss": float(cfg.seed), CONFIG_KEY: config_record(cfg)}
    results.write_json_atomic(folder / results.SUMMARY, summary)
    return float(cfg.seed)


if __name__ == "__main__":
    expose_launcher_plugin()
    hydra.main(version_base="1.3", config_path=str(CONF_DIR), config_name="config")(task)()
    sys.exit(0)
