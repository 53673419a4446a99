"""The optimizer families (effitrain/config/optimizers.py): every option of conf/optimizer finds
exactly one row from its target, and what each row says holds for the real class: its state formula
equals the state one step allocates, its step runs on fake tensors or not as the row says, torch's
CUDA default is what the row says, and its package is one effitrain installs or names an extra for."""

from __future__ import annotations

import importlib
import re

import pytest
import torch
from omegaconf import OmegaConf

from effitrain import memory
from effitrain.config.optimizers import (
    OPTIMIZER_FAMILIES,
    PROJECT_FAMILY,
    OptimizerSettings,
    optimizer_family,
    state_family,
)
from effitrain.config.registry import CONF_DIR, GROUP_TARGETS, group_options, install_hint
from effitrain.train.optim import build_optimizer
from tests.helpers.run import optimizer_option

OPTIONS = [optimizer_option(name) for name in group_options("optimizer")]


def _node(option: str):
    return OmegaConf.load(CONF_DIR / "optimizer" / f"{option}.yaml")


def _tiny():
    """8,192 weights in the first layer: 8-bit in bitsandbytes and quantized in torchao (4,096 and
    more), both sides above APOLLO's rank 32; a normalization (no weight decay) and a 3-wide head."""
    return torch.nn.Sequential(torch.nn.Linear(128, 64), torch.nn.LayerNorm(64), torch.nn.Linear(64, 3))


def _formula(family):
    module, _, name = family.state_formula.rpartition(".")
    return getattr(importlib.import_module(module), name)


def test_every_option_resolves_to_exactly_one_row_and_every_row_has_an_option():
    reached = []
    for option in group_options("optimizer"):
        target = _node(option)._target_
        covering = [family for family in OPTIMIZER_FAMILIES if family.covers(target)]
        assert covering == [optimizer_family(target)], option
        reached.append(covering[0].target)
    assert sorted(set(reached)) == sorted(family.target for family in OPTIMIZER_FAMILIES)
    # no row's prefix covers another's, so a target's row never depends on the rows' order
    targets = [family.target for family in OPTIMIZER_FAMILIES]
    assert [(a, b) for a in targets for b in targets if a != b and b.startswith(f"{a}.")] == []
    assert GROUP_TARGETS["optimizer"].names == tuple(targets)  # the allow-list is the rows'


def test_a_target_of_the_user_s_own_project_gets_the_project_family():
    family = optimizer_family("my_optimizers.Sophia")
    assert family is PROJECT_FAMILY and family.settings is OptimizerSettings
    assert (family.on_fake, family.on_dtensor, family.state_formula) == (True, True, None)
    assert optimizer_family("torch.optimizer_of_mine.X") is PROJECT_FAMILY  # a prefix ends at a dot


def test_each_row_names_a_formula_for_the_class_it_describes():
    for family in OPTIMIZER_FAMILIES:
        assert (family.state_of is None) == (family.state_formula is None), family.target
        if family.state_formula is not None:
            assert callable(_formula(family)), family.target


@pytest.mark.parametrize("option", OPTIONS)
def test_each_row_s_state_formula_equals_the_state_after_one_step(option):
    node = _node(option)
    family = optimizer_family(node._target_)
    torch.manual_seed(0)
    model = _tiny()
    optimizer = build_optimizer(node, model, weight_decay=0.01)
    assert state_family(type(optimizer)) is family  # the row its target finds describes its class
    estimated = _formula(family)(optimizer)
    assert memory.estimate_optimizer_state(optimizer) == estimated
    model(torch.randn(4, 128)).sum().backward()
    optimizer.step()
    measured = memory.optimizer_state_footprint(optimizer)
    assert measured.bytes > 0 and estimated.bytes == measured.bytes
    assert estimated == measured  # elements, storages and Python values too


@pytest.mark.parametrize("option", OPTIONS)
def test_a_step_runs_on_fake_tensors_as_the_row_says(option):
    from effitrain.util.compat import fake_tensor_mode, values_assumed

    node = _node(option)
    model = _tiny()
    build_optimizer(node, model, weight_decay=0.01)  # a real step first, as the replay takes
    model(torch.randn(4, 128)).sum().backward()
    build_optimizer(node, model, weight_decay=0.01).step()  # (caches filled from real values)
    ran = True
    try:
        with fake_tensor_mode(), torch.compiler.set_stance("force_eager"):
            fake = _tiny()
            optimizer = build_optimizer(node, fake, weight_decay=0.01)
            fake(torch.randn(4, 128)).sum().backward()
            with values_assumed(lambda tensor: False if tensor.dtype == torch.bool else 0):
                optimizer.step()
    except Exception:  # noqa: BLE001 - whatever stops a fake step: the row must say it cannot
        ran = False
    assert ran == optimizer_family(node._target_).on_fake


@pytest.mark.parametrize("option", OPTIONS)
def test_the_cuda_default_is_foreach_as_the_row_says(option):
    from effitrain.memory.cuda import foreach_by_default

    node = _node(option)
    optimizer = build_optimizer(node, _tiny(), weight_decay=0.01)
    foreach_by_default(optimizer)  # what the replay's CUDA profile does to it
    chose_foreach = any(group.get("foreach") for group in optimizer.param_groups)
    left_to_default = node.get("fused") is None and node.get("foreach") is None
    assert chose_foreach == (optimizer_family(node._target_).foreach_on_cuda and left_to_default)


def test_each_row_s_package_is_a_dependency_or_installed_by_its_extra():
    from importlib.metadata import requires

    from effitrain.memory.trace_cache import LIBRARIES

    installs = {}  # effitrain's metadata: each package it requires, by extra (None: a dependency)
    for requirement in requires("effitrain"):  # 'torchao>=0.13; extra == "torchao"'
        extra = re.search(r"""extra\s*==\s*['"]([^'"]+)['"]""", requirement)
        package = re.split(r"[\s<>=!~\[;(]", requirement, maxsplit=1)[0]
        installs.setdefault(extra.group(1) if extra else None, set()).add(package)
    for family in OPTIMIZER_FAMILIES:
        assert family.package in installs[family.extra], family.target
        assert family.package in LIBRARIES, family.target  # its version keys the traces kept on disk
        if family.extra is not None:
            top = family.target.split(".")[0]
            assert install_hint(top) == f"pip install 'effitrain[{family.extra}]'"
    assert install_hint("lion_pytorch") == "install the package that provides lion_pytorch"
