"""The run config's schema: typed dataclasses in Hydra's ConfigStore, so a value of the wrong type
or outside a closed set (``seed=x``, ``compile.mode=fast``, ``model.init=randm``) fails while the
config is composed, before anything is built.

``conf/config.yaml`` lists ``effitrain_schema`` first in its defaults: every YAML file merges into
these types. Groups whose keys are a target's arguments (optimizer, data, logger, ...) stay open
(``Any``); their keys are checked against the target's signature by ``target_checks.check_targets``.
A root key added to ``conf/config.yaml`` needs its field here.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import Any, Dict, List, Optional

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING

# The devices whose kernels a memory prediction replays (effitrain estimate --device, plan --device).
DEVICES = ("cpu", "cuda")


class Choice(str, Enum):
    """A closed set of strings: compares, hashes, formats and serializes as its plain value."""

    def __str__(self) -> str:
        return self.value


def _choice(name: str, values: tuple[str, ...]) -> type[Choice]:
    # named by the values themselves: OmegaConf matches a string against member names, and
    # torch's names (reduce-overhead) are not identifiers
    return Choice(name, {value: value for value in values}, module=__name__, qualname=name)


CompileMode = _choice(
    "CompileMode", ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")
)
InitMode = _choice("InitMode", ("pretrained", "random"))
MixedPrecision = _choice("MixedPrecision", ("no", "fp16", "bf16"))


@dataclass
class CompileConfig:
    enabled: bool = False
    backend: str = "inductor"  # checked against torch.compiler.list_backends() by validate
    mode: CompileMode = CompileMode["default"]


@dataclass
class ModelConfig:
    name_or_path: str = MISSING
    tokenizer: Optional[str] = None
    init: InitMode = InitMode["pretrained"]
    architecture: Dict[str, Any] = field(default_factory=dict)
    config_overrides: Dict[str, Any] = field(default_factory=dict)
    trust_remote_code: bool = False
    offline_tokenizer: Optional[str] = None


@dataclass
class PrecisionConfig:
    mixed_precision: MixedPrecision = MixedPrecision["no"]


@dataclass
class RunConfig:
    """The root: conf/config.yaml's keys with their types (ranges are validate's)."""

    model: ModelConfig = field(default_factory=ModelConfig)
    compile: CompileConfig = field(default_factory=CompileConfig)
    precision: PrecisionConfig = field(default_factory=PrecisionConfig)
    data: Any = None
    optimizer: Any = None
    lr_scheduler: Any = None
    backend: Any = None
    logger: Any = None
    task: Any = None

    seed: int = 42
    epochs: int = 3
    max_steps: Optional[int] = None
    micro_batch_size: int = 16
    effective_batch_size: Optional[int] = None
    gradient_accumulation_steps: int = 1
    warmup_ratio: float = 0.1
    weight_decay: float = 0.01
    max_grad_norm: float = 1.0
    gradient_checkpointing: bool = False
    max_length: int = 96
    eval_batch_size: int = 64
    eval_every: Optional[int] = None
    progress_bar: bool = True
    checkpoint_every: Optional[int] = None
    checkpoint_keep: int = 2
    resume: Optional[str] = None
    cache_dir: Optional[str] = None
    skip_ok_jobs: bool = True
    optimized_metric: str = "eval/loss"
    run_invariant_keys: List[str] = field(default_factory=list)


@dataclass
class LauncherConfig:
    """``hydra/launcher=effitrain``'s settings (``conf/hydra/launcher/effitrain.yaml`` merges into it),
    as hydra_submitit_launcher types its own; ranges are ``sweep_slots.launcher_settings``'s."""

    _target_: str = "hydra_plugins.effitrain_launcher.effitrain_launcher.EffitrainLauncher"
    max_parallel: int = 1
    devices: Any = None  # an id, a list of ids or null (OmegaConf has no Union): checked by hand
    gpus_per_job: int = 1
    cpu_pinning: bool = True
    timeout_min: Any = 1440  # minutes, an int or a float (0.5): a float field would show 1440.0
    kill_grace_s: Any = 30  # seconds, likewise


def register() -> None:
    ConfigStore.instance().store(name="effitrain_schema", node=RunConfig)
    ConfigStore.instance().store(group="hydra/launcher", name="effitrain_schema", node=LauncherConfig)


# What a user is told a typed key accepts, in validate's words (a composition error names the type).
def allowed(node_type) -> str:
    if isinstance(node_type, type) and issubclass(node_type, Enum):
        return f"choose one of {', '.join(m.value for m in node_type)}"
    return {
        int: "must be an integer",
        float: "must be a number",
        bool: "must be true or false",
        str: "must be a string",
    }.get(node_type, f"must be of type {getattr(node_type, '__name__', node_type)}")


def field_type(object_type, key: str):
    """The declared type of ``object_type``'s field ``key`` (``Optional[X]`` gives X); None if unknown."""
    import typing

    try:
        hint = typing.get_type_hints(object_type).get(str(key))
    except (TypeError, NameError):
        return None
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    return args[0] if typing.get_origin(hint) is typing.Union and len(args) == 1 else hint
