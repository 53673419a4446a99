"""The one check of every ``_target_`` node's keys (effitrain/config/targets.py ``check_targets``) and
the signatures it binds them to (effitrain/config/registry.py ``target_definition``)."""

from __future__ import annotations

import inspect

import pytest
import torch
from omegaconf import OmegaConf

from effitrain.config.errors import ConfigError, ConfigErrors
from effitrain.config.registry import (
    CONF_DIR,
    Allowed,
    _source_signature,
    group_names,
    group_options,
    target_definition,
)
from effitrain.config.targets import check_targets
from effitrain.config.validate import validate
from effitrain.train.optim import build_scheduler
from tests.helpers.run import compose


def takes_one(a, b=2):
    return a, b


def takes_any(a, **rest):
    return a, rest


def _targets() -> list[str]:
    """Every ``_target_`` an option of conf/ names (the task group's node is ``task``)."""
    targets = set()
    for group in group_names():
        for option in group_options(group):
            node = OmegaConf.load(CONF_DIR / group / f"{option}.yaml")
            target = (node.get("task") or node).get("_target_") if group == "task" else node.get("_target_")
            if target:
                targets.add(target)
    return sorted(targets)


def _shape(signature: inspect.Signature) -> list[tuple[str, inspect._ParameterKind]]:
    return [(p.name, p.kind) for p in signature.parameters.values()]


@pytest.mark.parametrize("target", _targets())
def test_a_target_s_signature_read_from_its_source_is_the_imported_one(target):
    from hydra.utils import get_object

    module, _, name = target.rpartition(".")
    pytest.importorskip(module.split(".")[0])  # an optional extra (torchao) may be absent
    imported = inspect.signature(get_object(target))
    assert _shape(target_definition(target)[0]) == _shape(imported)
    source = _source_signature(module, name)
    if source is not None:
        assert _shape(source[0]) == _shape(imported)
    # the loaders and backends are read from source: checking a config loads neither datasets nor the Trainer
    if module in ("effitrain.train.data", "effitrain.backends.accelerator", "effitrain.backends.trainer"):
        assert source is not None


def test_every_node_s_keys_are_bound_to_its_target_s_arguments():
    cfg = OmegaConf.create(
        {
            "outer": {
                "_target_": f"{__name__}.takes_one",
                "_partial_": True,  # `a` is passed later: a partial node may leave it out
                "b": {"_target_": f"{__name__}.takes_one", "a": 1, "c": [4, 5]},  # a node in the arguments
            },
            "other": {"_target_": f"{__name__}.takes_one", "d": "x"},
            "listed": [None, {"_target_": f"{__name__}.takes_one", "a": 1, "e": 2}],  # Hydra builds these too
            "open": {"_target_": f"{__name__}.takes_any", "anything": 1},  # **rest takes any key
            "none": {"_target_": None, "typo": 1},  # logger=none: builds nothing, nothing bound
            "empty": None,
            "missing": "???",  # validate names it; nothing to bind
            "hydra": {"callback": {"_target_": f"{__name__}.takes_one", "x": 1}},  # Hydra's own node
        }
    )
    # this module's functions allowed under each key, as conf/'s groups allow their packages
    allowed = {key: Allowed((__name__,), "a function", is_class=False) for key in cfg if key != "hydra"}
    with pytest.raises(ConfigErrors) as error:  # every node's problem at once, one line each
        check_targets(cfg, allowed)
    assert error.value.problems == [
        "outer.b.c=[4, 5] is invalid: takes_one takes no such argument: choose from a, b",
        "other.d='x' is invalid: takes_one takes no such argument: choose from a, b",
        "listed.1.e=2 is invalid: takes_one takes no such argument: choose from a, b",
    ]
    cfg.outer.b.pop("c")
    cfg.other.pop("d")
    cfg.listed[1].pop("e")
    check_targets(cfg, allowed)  # nothing left to refuse


def test_a_group_s_misspelled_or_supplied_key_is_named_with_what_its_target_takes():
    with pytest.raises(ConfigError) as error:
        validate(compose("logger=wandb", "+logger.projekt=x"))
    assert str(error.value) == (
        "logger.projekt='x' is invalid: WandbLogger takes no such argument: choose from mode, project, "
        "entity, group, tags, notes, name, job_type, init_timeout_s"
    )
    with pytest.raises(ConfigError) as error:  # param_groups set it per group: the key would be lost
        validate(compose("+optimizer.weight_decay=0.1"))
    assert str(error.value) == (
        "optimizer.weight_decay=0.1 is invalid: the root key weight_decay sets it per parameter group: "
        "give weight_decay instead"
    )
    with pytest.raises(ConfigError) as error:
        validate(compose("data._target_=effitrain.train.data.load_synthetik"))
    assert str(error.value) == (
        "data._target_='effitrain.train.data.load_synthetik' is invalid: effitrain.train.data has no load_synthetik: "
        "give an importable class or function"
    )
    with pytest.raises(ConfigError, match=r"^logger\.mode='offline' adds a key nothing reads"):
        compose("logger=none", "+logger.mode=offline")  # no target: nothing reads the key


def test_an_argument_added_to_a_target_node_reaches_the_target():
    # a +key under a _target_ node composes and validates when the target takes it, and is used:
    # cosine's num_cycles=1 brings the learning rate back to its peak at the last step
    cfg = compose("lr_scheduler=cosine", "+lr_scheduler.scheduler_specific_kwargs={num_cycles: 1.0}")
    validate(cfg)
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    scheduler = build_scheduler(cfg.lr_scheduler, optimizer, num_training_steps=10, warmup_ratio=0.0)
    rates = []
    for _ in range(10):
        rates.append(scheduler.get_last_lr()[0])
        optimizer.step()
        scheduler.step()
    assert rates[0] == 1.0 and rates[5] == pytest.approx(0.0, abs=1e-12)
    assert scheduler.get_last_lr()[0] == pytest.approx(1.0)


def test_a_target_outside_its_groups_allow_list_is_refused_without_importing_it(capsys, monkeypatch):
    import sys

    from effitrain.cli import main

    monkeypatch.delitem(sys.modules, "this", raising=False)
    with pytest.raises(SystemExit) as done:
        main(["check", "model=tiny", "data=synthetic", "logger=none", "optimizer._target_=this.x"])
    assert done.value.code == 2 and "this" not in sys.modules  # the module was never run
    assert capsys.readouterr().err == (
        "effitrain: error: optimizer._target_='this.x' is invalid: optimizer takes a torch.optim.Optimizer "
        "class from torch.optim, transformers.optimization, bitsandbytes.optim, torchao.optim, lion_pytorch, "
        "effitrain.train.apollo\n"
    )


def test_a_group_file_naming_torch_load_is_refused_before_anything_runs(tmp_path):
    """A pickle payload behind ``_target_: torch.load`` (``weights_only: false``) never runs: the
    data group builds loaders of effitrain.train.data only."""
    from tests.helpers.run import run_job

    marker = tmp_path / "payload-ran"
    torch.save(_Payload(str(marker)), tmp_path / "payload.pt")
    summary = run_job(tmp_path / "run", "data._target_=torch.load", f"+data.f={tmp_path}/payload.pt",
                      "+data.weights_only=false")  # fmt: skip
    assert summary["status"] == "failed" and summary["error_type"] == "config"
    assert summary["error"] == (
        "data._target_='torch.load' is invalid: data takes a loader function from effitrain.train.data"
    )
    assert not marker.exists()
    torch.load(tmp_path / "payload.pt", weights_only=False)  # the payload is live: it would have run
    assert marker.exists()


class _Payload:
    """Unpickling it writes a file: what a planted pickle could do."""

    def __init__(self, path: str):
        self.path = path

    def __reduce__(self):
        return (_touch, (self.path,))


def _touch(path: str) -> None:
    from pathlib import Path

    Path(path).touch()


def test_a_lazy_package_s_reexport_is_read_from_the_module_that_defines_it():
    """transformers.get_scheduler is transformers.optimization's, which imports peft and bitsandbytes
    (seconds): its signature is read from that module's source, through the package's re-export."""
    from transformers.optimization import get_scheduler

    source = _source_signature("transformers", "get_scheduler")
    assert source is not None and source[1] == "function"
    assert _shape(source[0]) == _shape(inspect.signature(get_scheduler))


def test_checking_a_config_imports_neither_the_scheduler_s_module_nor_peft():
    """The preflight of a default config reads the scheduler's signature from source: checking it does
    not import transformers.optimization, and with it peft and bitsandbytes."""
    import subprocess
    import sys

    code = (
        "import sys; from effitrain.config.load import load; load(['model=tiny'], device='cpu', loads=False); "
        "print(sorted(m for m in ('transformers.optimization', 'peft', 'bitsandbytes') if m in sys.modules))"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.splitlines()[-1] == "[]"


def test_a_reexport_is_followed_through_relative_imports_and_never_into_itself(tmp_path, monkeypatch):
    """``from .impl import f`` (in ``if TYPE_CHECKING:`` too) is followed from a package and from a
    module beside ``impl``; ``from . import g`` names the package itself: no signature, no recursion."""
    package = tmp_path / "reexporting_pkg"
    (package / "sub").mkdir(parents=True)
    (package / "__init__.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .impl import f\nfrom . import g\n"
    )
    (package / "impl.py").write_text("def f(a, *rest, b=1, **more):\n    return a\n")
    (package / "sub" / "__init__.py").write_text("")
    (package / "sub" / "again.py").write_text("from ..impl import f\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    for module in ("reexporting_pkg", "reexporting_pkg.sub.again"):
        signature, kind = _source_signature(module, "f")
        assert kind == "function" and _shape(signature) == _shape(
            inspect.signature(lambda a, *rest, b=1, **more: a)
        )
    assert _source_signature("reexporting_pkg", "g") is None
