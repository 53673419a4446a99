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


@pytest.mark.parametrize("rank, said", [(None, 1), ("0", 1), ("1", 0)])
def test_bad_input_is_said_once_by_the_processes_a_launcher_started(monkeypatch, capsys, rank, said):
    """Every process torchrun starts checks the same config and refuses it alike (exit 2): only the
    first says the line, so the launcher's log holds it once; other failures are said by every rank."""
    from effitrain.config.errors import fail

    if rank is None:
        monkeypatch.delenv("RANK", raising=False)
    else:
        monkeypatch.setenv("RANK", rank)
    with pytest.raises(SystemExit) as exited:
        fail("optimizer='adamw_typo' is not an option")
    assert exited.value.code == 2
    assert capsys.readouterr().err.count("effitrain: error: optimizer='adamw_typo'") == said
    with pytest.raises(SystemExit) as exited:
        fail("a write failed", code=1)
    assert (exited.value.code, capsys.readouterr().err.count("a write failed")) == (1, 1)
