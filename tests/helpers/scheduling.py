"""How pytest-xdist's workers share the tests (tests/conftest.py installs it): as ``--dist load``
does, except that each module whose module-scoped fixture makes real runs goes whole to one worker,
so those runs are made once rather than on each worker that gets one of its tests. xdist's
``loadgroup`` would do this from ``xdist_group`` marks, but under pytest 9.2 it silently does not
group (pytest-xdist issue 1386)."""

from __future__ import annotations

from xdist.scheduler import LoadScopeScheduling

# Modules whose module-scoped fixture makes real runs: sweeps, reference runs, a SLURM cluster,
# two spawned processes.
SHARED_RUNS = {
    "tests/compare/test_compare.py",
    "tests/config/test_guards.py",
    "tests/sweep/slurm/test_slurm.py",
    "tests/test_extending.py",
    "tests/train/test_checkpoint.py",
    "tests/train/test_distributed.py",
    "tests/train/test_sharding.py",
}


def unit_of(nodeid: str) -> str:
    """The unit of work a test belongs to: its module for SHARED_RUNS' modules, else the test alone."""
    module = nodeid.split("::", 1)[0]
    return module if module in SHARED_RUNS else nodeid


class SharedRunsScheduling(LoadScopeScheduling):
    """xdist's loadscope over :func:`unit_of`'s units; loadscope starts the largest units first, so a
    whole module is never the last thing left running on one worker while the other waits."""

    def _split_scope(self, nodeid: str) -> str:
        return unit_of(nodeid)
