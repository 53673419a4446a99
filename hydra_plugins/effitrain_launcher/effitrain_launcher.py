"""Hydra's plugin entry for effitrain's launcher (``hydra/launcher=effitrain``, the default).

Hydra imports every module under ``hydra_plugins`` at start-up to find plugins, so this one stays
light: the launcher itself lives in :mod:`effitrain.sweep.launcher` and is imported when a sweep launches.
"""

from __future__ import annotations

from typing import Any, Sequence

from hydra.plugins.launcher import Launcher


class EffitrainLauncher(Launcher):
    """One process per job, ``max_parallel`` at once, each with its own GPUs or CPU cores."""

    def __init__(self, **params: Any) -> None:
        self.params = params

    def setup(self, *, hydra_context, task_function, config) -> None:
        self.config, self.hydra_context, self.task_function = config, hydra_context, task_function

    def launch(self, job_overrides: Sequence[Sequence[str]], initial_job_idx: int):
        from effitrain.sweep.launcher import LocalSweep

        return LocalSweep(self, job_overrides, initial_job_idx).run()
