"""Hydra's plugin entry for effitrain's launcher (``hydra/launcher=effitrain``, the default). Hydra imports
it at every start-up, so the launcher itself (:mod:`effitrain.sweep.launcher`) is imported only to launch."""

from hydra.plugins.launcher import Launcher


class EffitrainLauncher(Launcher):
    """One process per job, ``max_parallel`` at once, each with its own GPUs or CPU cores."""

    def __init__(self, **params) -> None:
        self.params = params

    def setup(self, *, hydra_context, task_function, config) -> None:
        self.config, self.hydra_context, self.task_function = config, hydra_context, task_function

    def launch(self, job_overrides, initial_job_idx: int):
        from effitrain.sweep.launcher import LocalSweep

        return LocalSweep(self, job_overrides, initial_job_idx).run()
