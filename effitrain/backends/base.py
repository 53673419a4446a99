"""The backend contract: what a training backend provides (:class:`Backend`).

A backend is a module (``effitrain.backends.accelerator``, ``effitrain.backends.trainer``); the
config group ``backend`` names its ``fit`` (``_target_: effitrain.backends.<name>.fit``,
``_partial_: true``). A module implements a protocol through its module-level names (PEP 544), so
each backend module declares ``loads_checkpoint`` and ``fit``, and :func:`backend_of` checks them.
"""

from __future__ import annotations

import importlib
from typing import Protocol, runtime_checkable

from effitrain.config.errors import ConfigError
from effitrain.train.job import Evaluation, Job


@runtime_checkable
class Backend(Protocol):
    """A training loop over a :class:`~effitrain.train.job.Job` that the shared code built.

    ``fit(job)`` trains from ``job.start`` to ``job.num_steps`` optimizer steps, each inside
    ``job.track_step(step)`` and ended by ``job.end_step(step, lr, grad_norm, evaluation)``, and
    returns what the final evaluation runs on. It fills in nothing on the job.

    ``loads_checkpoint``: True when ``fit`` itself loads weights, optimizer, scheduler and
    generators from ``job.resume`` (the Trainer's own resume); the shared restore then sets only
    effitrain's counts. False: the shared restore loads everything before ``fit``.
    """

    loads_checkpoint: bool

    def fit(self, job: Job) -> Evaluation: ...


def backend_of(node) -> Backend:
    """The backend the config's ``backend`` node names: the module of its ``_target_``
    (``effitrain.backends.accelerator.fit`` -> ``effitrain.backends.accelerator``).

    Raises:
        ConfigError: that module does not keep the contract (one line, naming ``backend._target_``).
    """
    target = str(node.get("_target_") or "")
    try:
        module = importlib.import_module(target.rpartition(".")[0])
    except ImportError:
        module = None
    if module is None or not isinstance(module, Backend):
        raise ConfigError(
            f"backend._target_={target!r} is invalid: a backend is a module declaring loads_checkpoint "
            "and fit(job) -> Evaluation (effitrain.backends.Backend)"
        )
    return module
