"""The private APIs of OmegaConf and Hydra in effitrain/util/compat/omegaconf_hydra.py, each against
the installed release."""

from __future__ import annotations

import pytest
from hydra.core.utils import JobStatus
from omegaconf import DictConfig, OmegaConf

from effitrain.util import compat


def test_config_node_is_the_node_as_stored(monkeypatch):
    """An interpolation unresolved, a missing value without raising, a list's item by index."""
    cfg = OmegaConf.create({"a": 1, "b": "${a}", "c": {"d": "???"}, "layers": [{"x": 2}]})
    assert cfg.b == 1 and str(compat.config_node(cfg, "b")) == "${a}"
    child = compat.config_node(cfg, "c")
    assert isinstance(child, DictConfig) and OmegaConf.is_missing(child, "d")
    assert compat.config_node(cfg.layers, 0).x == 2
    monkeypatch.setitem(compat.CHECKED_BELOW, "omegaconf", "2.0")  # no fallback: an error naming it
    with pytest.raises(RuntimeError, match=r"omegaconf 2\.3.* has no Container\._get_node"):
        compat.config_node(cfg, "b")


@pytest.mark.parametrize("unchecked", [False, True])
def test_a_job_s_return_value_is_its_result_or_its_error(unchecked, monkeypatch, capsys):
    """What the job returned, or the error it raised; Hydra's property raises that error instead."""
    if unchecked:  # the fallback: the public property, its error caught (and its stderr line written)
        monkeypatch.setitem(compat.CHECKED_BELOW, "hydra-core", "1.0")
    done = compat.job_return(["lr=0.1"], OmegaConf.create({"lr": 0.1}), 0.25, status=JobStatus.COMPLETED)
    assert done.return_value == 0.25 and compat.job_return_value(done) == 0.25
    error = ValueError("diverged")
    failed = compat.job_return(["lr=9"], None, error, status=JobStatus.FAILED)
    assert compat.job_return_value(failed) is error
    assert capsys.readouterr().err == (
        "" if not unchecked else "Error executing job with overrides: ['lr=9']\n"
    )
    with pytest.raises(ValueError, match="diverged"):
        failed.return_value  # noqa: B018 (Hydra's property raises the job's error)
