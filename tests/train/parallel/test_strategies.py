"""The parallel strategies as objects (effitrain/train/parallel/__init__.py): one per choice of the
schema, found from the config in one function, and the only code that names a strategy."""

from __future__ import annotations

import re

import pytest

from effitrain.config.parallel import CHECKS
from effitrain.config.schema import ParallelStrategy
from effitrain.train.parallel import STRATEGIES, strategy_of
from tests.helpers.run import REPO, compose


def test_every_choice_of_the_schema_is_one_object_with_its_checks():
    assert [str(choice) for choice in ParallelStrategy] == list(CHECKS) == list(STRATEGIES) == ["ddp", "fsdp"]
    for name, strategy in STRATEGIES.items():
        assert strategy.name == name and strategy.check is CHECKS[name]


@pytest.mark.parametrize("override, name, shards", [(None, "ddp", False), ("parallel=fsdp", "fsdp", True)])
def test_the_config_finds_its_strategy(override, name, shards):
    strategy = strategy_of(compose(*([override] if override else [])))
    assert (strategy.name, strategy.shards) == (name, shards)


@pytest.mark.parametrize(
    "batches, processes, each", [(10, 1, 10), (10, 3, 4), (9, 3, 3), (1, 2, 1), (7, 8, 1)]
)
def test_each_process_trains_on_ceil_batches_over_processes(batches, processes, each):
    """accelerate's split of the batches; sharding splits the model, not the data."""
    assert {s.batches_per_process(batches, processes) for s in STRATEGIES.values()} == {each}


def test_no_module_outside_the_home_names_a_strategy():
    """The name is quoted in the config layer's checks and in its object only; nothing else compares
    ``parallel.strategy`` with a string."""
    quoted, compared = [], []
    for path in sorted((REPO / "effitrain").rglob("*.py")):
        text, where = path.read_text(), str(path.relative_to(REPO))
        if re.search(r"[\"']fsdp[\"']", text):
            quoted.append(where)
        if re.search(r"strategy\s*[!=]=", text):
            compared.append(where)
    assert quoted == ["effitrain/config/parallel.py", "effitrain/train/parallel/fsdp.py"]
    assert compared == []
