"""The run config's schema, declared once: typed dataclasses in Hydra's ConfigStore, so a value of the
wrong type or outside a closed set (``seed=x``, ``compile.mode=fast``, ``model.init=randm``) fails
while the config is composed, and each field's range beside its type (``Annotated[int, Field(ge=1,
...)]``), checked by pydantic over the composed values (:func:`range_problems`), every problem at
once and before anything is built. OmegaConf reads the plain type of an ``Annotated`` field and
pydantic its constraints: one declaration serves both. Pydantic and not ``__post_init__``: a
``__post_init__`` stops at its first ``raise``, and OmegaConf runs it only when it builds the
objects, while pydantic reports every field's problem with its location and input.

``conf/config.yaml`` lists ``effitrain_schema`` first in its defaults: every YAML file merges into
these types. Groups whose keys are a target's arguments (optimizer, data, logger, ...) stay open
(``Any``); their keys are checked against the target's signature by ``targets.check_targets``, and
the values a target's own code would accept but that silently disable what they configure by the
settings of its optimizer family (:mod:`effitrain.config.optimizers`) and :class:`SyntheticData`. A
root key added to ``conf/config.yaml`` needs its field here.
"""

from __future__ import annotations

import dataclasses
import typing
from dataclasses import dataclass, field
from enum import Enum
from typing import Annotated, Any, Dict, List, Optional, Union

import pydantic
from hydra.core.config_store import ConfigStore
from omegaconf import MISSING
from pydantic import BaseModel, ConfigDict, Field

from effitrain.config.errors import ConfigError, invalid
from effitrain.config.optimizers import optimizer_family
from effitrain.config.parallel import CHECKS as PARALLEL_CHECKS
from effitrain.config.ranges import at_least, finite, ranged
from effitrain.config.techniques.chunked_loss import ALLOWED as LOSS_CHUNKS_ALLOWED

MAX_SEED = 2**32 - 1  # numpy's generators take no larger seed (transformers.set_seed seeds numpy too)
SYNTHETIC_MAX_LABELS = 6  # the keyword classes load_synthetic makes (a test holds them equal)


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
ParallelStrategy = _choice("ParallelStrategy", tuple(PARALLEL_CHECKS))  # config/parallel names them


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
class ParallelConfig:
    """``parallel``: ``ddp`` (every process holds the whole model) or ``fsdp`` (FSDP2 sharding, whose
    keys these are; effitrain.train.sharding)."""

    strategy: ParallelStrategy = ParallelStrategy["ddp"]
    reshard_after_forward: bool = True  # true: ZeRO-3; false: ZeRO-2
    offload: bool = False  # parameters, gradients and optimizer state in CPU memory


@dataclass
class RunConfig:
    """The root: conf/config.yaml's keys with their types and ranges."""

    model: ModelConfig = field(default_factory=ModelConfig)
    compile: CompileConfig = field(default_factory=CompileConfig)
    precision: PrecisionConfig = field(default_factory=PrecisionConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    data: Any = None
    optimizer: Any = None
    lr_scheduler: Any = None
    backend: Any = None
    logger: Any = None
    task: Any = None
    adapter: Any = None

    seed: ranged(int, f"must be an integer in 0..{MAX_SEED}", ge=0, le=MAX_SEED) = 42
    epochs: at_least(1) = 3
    max_steps: at_least(1, null=True) = None
    micro_batch_size: at_least(1) = 16
    effective_batch_size: at_least(1, null=True) = None
    gradient_accumulation_steps: at_least(1) = 1
    warmup_ratio: finite("must be in [0, 1)", ge=0, lt=1) = 0.1
    weight_decay: finite("must be >= 0", ge=0) = 0.01
    max_grad_norm: finite("must be >= 0 (0 disables clipping)", ge=0) = 1.0
    gradient_checkpointing: Union[bool, int] = (
        False  # true, false or N: every N-th block (checked by its technique)
    )
    loss_chunks: ranged(int, LOSS_CHUNKS_ALLOWED, ge=1) = 1  # a causal LM's head and loss over N chunks
    activation_offloading: Union[bool, int] = (
        False  # true, false or N: saved tensors of N bytes and more to host memory (checked by its technique)
    )
    optimizer_in_backward: bool = False  # each parameter's update in backward (checked by its technique)
    max_length: at_least(2) = 96
    eval_batch_size: at_least(1) = 64
    eval_every: at_least(1, null=True) = None
    progress_bar: bool = True
    checkpoint_every: at_least(1, null=True) = None
    checkpoint_keep: at_least(1) = 2
    resume: Optional[str] = None
    cache_dir: Optional[str] = None
    skip_ok_jobs: bool = True
    optimized_metric: str = "eval/loss"
    run_invariant_keys: List[str] = field(default_factory=list)


def _device_ids(devices):
    listed = [devices] if isinstance(devices, (int, str)) else devices
    if devices is not None and (
        not isinstance(listed, list) or not listed or len(set(map(str, listed))) != len(listed)
    ):
        raise ValueError(devices)  # the field's description names what is allowed
    return None if devices is None else [str(d) for d in listed]


# Typed Any for OmegaConf, checked by pydantic: an int or a float (0.5) above 0 (a float field would
# show 1440 as 1440.0, OmegaConf names a Union badly), and one GPU id, a list of them or null.
POSITIVE_NUMBER = Annotated[
    ranged(Any, "a number > 0"),
    pydantic.AfterValidator(
        pydantic.TypeAdapter(
            Annotated[Union[pydantic.StrictInt, pydantic.StrictFloat], Field(gt=0)]
        ).validate_python
    ),
]
DEVICE_IDS = Annotated[
    ranged(Any, "a list of distinct GPU ids, e.g. [0,1]"), pydantic.AfterValidator(_device_ids)
]


@dataclass
class LauncherConfig:
    """``hydra/launcher=effitrain``'s settings (``conf/hydra/launcher/effitrain.yaml`` merges into it),
    as hydra_submitit_launcher types its own, each with its range (:func:`launcher_settings`)."""

    __pydantic_config__ = ConfigDict(extra="forbid")  # a misspelt setting is named, not ignored

    _target_: str = "hydra_plugins.effitrain_launcher.effitrain_launcher.EffitrainLauncher"
    max_parallel: ranged(int, "a whole number >= 1", ge=1) = 1
    devices: DEVICE_IDS = None  # null: every GPU this process sees
    gpus_per_job: ranged(int, "a whole number >= 1", ge=1) = 1
    cpu_pinning: ranged(bool, "true or false") = True
    timeout_min: POSITIVE_NUMBER = 1440  # minutes
    kill_grace_s: POSITIVE_NUMBER = 30  # seconds


def launcher_settings(params) -> dict:
    """``hydra.launcher``'s settings (Hydra's node, or a plain dict) typed (``"2"`` is 2, as OmegaConf
    types it) and checked: no unknown key, each value in its range, no more GPUs per job than devices;
    ``devices`` as a list of strings.

    Raises:
        ConfigError: the first problem, in one line naming it.
    """
    from dataclasses import asdict

    from omegaconf import OmegaConf

    values = OmegaConf.to_container(OmegaConf.create(dict(params)), resolve=True)
    try:
        settings = asdict(pydantic.TypeAdapter(LauncherConfig).validate_python(values))
    except pydantic.ValidationError as error:
        unknown = [e for e in error.errors() if e["type"] == "unexpected_keyword_argument"]
        name = str((unknown or error.errors())[0]["loc"][0])
        if unknown:
            known = ", ".join(key for key in LauncherConfig.__dataclass_fields__ if key != "_target_")
            message = f"hydra.launcher.{name} is not a setting of effitrain's launcher: use {known}"
            raise ConfigError(message) from None
        raise invalid(f"hydra.launcher.{name}", values[name], _allowed_words(LauncherConfig, name)) from None
    if settings["devices"] is not None and len(settings["devices"]) < settings["gpus_per_job"]:
        allowed = f"at most the {len(settings['devices'])} devices of hydra.launcher.devices"
        raise invalid("hydra.launcher.gpus_per_job", settings["gpus_per_job"], allowed)
    return settings


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


class AdapterSettings(BaseModel):
    """A LoRA node's values peft would take but that train nothing or fail later (``conf/adapter``)."""

    model_config = ConfigDict(extra="allow")
    r: ranged(int, "must be an integer >= 1 (the rank of each update)", ge=1, strict=True) = 8
    lora_alpha: finite("must be a number > 0 (the update is scaled by lora_alpha / r)", gt=0) = 8
    lora_dropout: finite("must be in [0, 1)", ge=0, lt=1) = 0.0
    lr: ranged(Optional[float], "must be a finite number > 0 (or null)", gt=0, allow_inf_nan=False) = None


class SyntheticData(BaseModel):
    """``data=synthetic``'s sizes (``effitrain.train.data.load_synthetic``): refused before it runs."""

    model_config = ConfigDict(extra="allow")
    num_train: at_least(1) = 256
    num_eval: at_least(1) = 64
    words_per_text: at_least(1) = 12
    min_words_per_text: at_least(1, null=True) = None
    num_labels: ranged(
        int, f"must be an integer between 2 and {SYNTHETIC_MAX_LABELS}", ge=2, le=SYNTHETIC_MAX_LABELS
    ) = 3


def group_settings(group: str, target: str):
    """The settings model a group's node with this ``_target_`` is checked against, or None."""
    if group == "optimizer":
        return optimizer_family(target).settings
    if group == "data" and target.endswith(".load_synthetic"):
        return SyntheticData
    if group == "adapter" and target == "peft.LoraConfig":
        return AdapterSettings
    return None


def range_problems(cfg) -> list[str]:
    """One line per value outside its declared range (or of a wrong type in an open group's settings),
    in declaration order: the root's fields, then each group's settings. A key whose value does not
    resolve is left to the check that names it (``validate._assets``, ``_missing_values``)."""
    from pydantic import TypeAdapter, ValidationError

    problems = []
    root = {f: _plain(cfg, f) for f in typing.get_type_hints(RunConfig) if f in cfg}
    checks = [("", RunConfig, {k: v for k, v in root.items() if v is not _UNRESOLVED})]
    for group in ("optimizer", "data", "adapter"):
        node = root.get(group)
        settings = group_settings(group, str(node.get("_target_"))) if isinstance(node, dict) else None
        if settings is not None:
            checks.append((f"{group}.", settings, node))
    for prefix, schema, values in checks:
        try:
            TypeAdapter(schema).validate_python(values)
        except ValidationError as error:
            for problem in error.errors():
                name = str(problem["loc"][0])
                value = values.get(name) if problem["type"] != "missing" else None
                if value == "???":
                    continue  # a missing value: _missing_values names it
                problems.append(invalid(f"{prefix}{name}", value, _allowed_words(schema, name)).args[0])
    return list(dict.fromkeys(problems))  # one line per key, though pydantic reports each tuple item


_UNRESOLVED = object()


def _plain(cfg, key: str):
    from omegaconf import OmegaConf

    try:
        value = cfg[key]
        return OmegaConf.to_container(value, resolve=True) if OmegaConf.is_config(value) else value
    except Exception:  # noqa: BLE001 - an interpolation that does not resolve: named by its own check
        return _UNRESOLVED


def _allowed_words(schema, name: str) -> str:
    """The ``allowed`` words :func:`ranged` declared for field ``name`` of ``schema``."""
    hint = typing.get_type_hints(schema, include_extras=True)[name]
    return next(m.description for m in getattr(hint, "__metadata__", ()) if getattr(m, "description", None))


def switch_keys() -> set[str]:
    """The keys typed ``bool`` in the schema (``progress_bar``, ``parallel.offload``, ...): OmegaConf
    takes 2, ``yes`` or ``on`` for true there, which a command line must say as true or false."""
    keys = set()
    for name, kind in typing.get_type_hints(RunConfig).items():
        if kind is bool:
            keys.add(name)
        elif dataclasses.is_dataclass(kind):
            keys |= {f"{name}.{inner}" for inner, t in typing.get_type_hints(kind).items() if t is bool}
    return keys
