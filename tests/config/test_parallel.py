"""The parallel group's checks (effitrain/config/parallel.py); the refusals' messages are rows of
tests/helpers/bad_inputs.py's table."""

from __future__ import annotations

import pytest

from effitrain.config import parallel
from effitrain.config.errors import ConfigError
from effitrain.config.parallel import check_parallel
from tests.helpers.run import compose


@pytest.mark.parametrize("optimizer", ["adamw", "adamw_fused", "lion"])
def test_optimizers_that_update_dtensor_parameters_are_accepted(optimizer):
    check_parallel(compose("parallel=fsdp", f"optimizer={optimizer}"), "cpu")


@pytest.mark.parametrize("processes, gpus, refused", [(2, 2, False), (4, 2, True), (4, 0, False)])
def test_no_more_processes_on_a_machine_than_its_gpus(monkeypatch, processes, gpus, refused):
    """nccl needs a device per rank; with no GPU the mesh is the CPU's (gloo), any size."""
    monkeypatch.setenv("LOCAL_WORLD_SIZE", str(processes))
    monkeypatch.setattr(parallel, "_cuda_devices", lambda: gpus)
    cfg = compose("parallel=fsdp")
    if not refused:
        check_parallel(cfg)
        return
    with pytest.raises(ConfigError, match=f"{processes} processes on this machine and {gpus} GPUs"):
        check_parallel(cfg)
    check_parallel(cfg, "cpu")  # a check for the CPU (estimate --device cpu) asks no GPU count


def test_ddp_leaves_the_default_fsdp_keys_alone():
    check_parallel(compose(), None)
