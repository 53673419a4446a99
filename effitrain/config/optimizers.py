"""Optimizer families, one row each: everything effitrain knows of a family of optimizers beyond what
its YAML file says, in one place.

``conf/optimizer/*.yaml`` stays the registry of choices: an option is a file naming a ``_target_``.
The row is found from that target by its dotted prefix (:func:`optimizer_family`), never from the
option's name, and says:

* where the family's targets come from: the optimizer group's allow-list
  (:data:`effitrain.config.registry.GROUP_TARGETS`) is the rows' targets;
* the pip package that provides it and, when effitrain does not depend on it, the extra that
  installs it (:func:`effitrain.config.registry.install_hint`);
* its settings: values its class would take but that silently disable what they configure
  (:func:`effitrain.config.schema.range_problems`);
* its state formula, the state after its first step from parameter shapes alone
  (:func:`effitrain.memory.optimizer_state.estimate_optimizer_state`): named by its dotted path,
  since a formula needs torch and this layer imports none, and matched on a built optimizer by the
  class it describes, found in the optimizer's MRO (a subclass gets its base's formula);
* whether fake tensors can run its step (:mod:`effitrain.memory.replay` counts the state of one
  that cannot), whether its update takes FSDP's sharded DTensor parameters
  (:func:`effitrain.config.parallel.check_parallel`, :mod:`effitrain.memory.sharded`), and whether
  torch gives it its foreach implementation on CUDA tensors (what
  :func:`effitrain.memory.cuda.foreach_by_default` models), and whether its step can run for one
  parameter at a time inside backward (:mod:`effitrain.config.techniques.in_backward`).

A new family is one YAML file plus one row here (and its formula function, for an estimate of its
state). A target no row covers, a class of the user's own project (allowed by
:func:`effitrain.config.registry.project_module`), gets :data:`PROJECT_FAMILY`; an optimizer from a
row without a formula, or whose class no formula describes (torch's SGD), has no estimate.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Tuple

from pydantic import BaseModel, ConfigDict

from effitrain.config.ranges import finite, ranged
from effitrain.util.compat.optimizers import TORCHAO_ADAM_BASE


class OptimizerSettings(BaseModel):
    """What every optimizer node holds; its other keys are its target's (``check_targets``)."""

    model_config = ConfigDict(extra="allow")
    lr: finite("must be a finite number > 0", gt=0, strict=True)


class AdafactorSettings(OptimizerSettings):
    clip_threshold: finite(
        "must be a finite number > 0 (Adafactor divides an update by max(1, its RMS / clip_threshold): "
        "0 makes every update zero, below 0 turns clipping off)", gt=0, strict=True,
    ) = 1.0  # fmt: skip
    beta1: ranged(
        Optional[float], "must be null (no first moment) or a number in [0, 1)", ge=0, lt=1, strict=True
    ) = None


class ApolloSettings(OptimizerSettings):
    scale: finite(
        "must be a finite number > 0 (it multiplies the projected update: 0 leaves every projected weight "
        "matrix unchanged, below 0 steps uphill)", gt=0, strict=True,
    ) = 1.0  # fmt: skip


class LionSettings(OptimizerSettings):
    # lion-pytorch asserts them with no message
    betas: ranged(
        Tuple[ranged(float, "", ge=0, le=1, strict=True), ranged(float, "", ge=0, le=1, strict=True)],
        "must be two numbers in [0, 1]",
    ) = (0.9, 0.99)


class Bitsandbytes8bitSettings(OptimizerSettings):
    min_8bit_size: ranged(
        int, "must be an integer >= 0 (tensors with fewer elements keep 32-bit state)", ge=0, strict=True
    ) = 4096


@dataclass(frozen=True)
class OptimizerFamily:
    """A family of optimizers: the targets under one dotted prefix, and what holds for all of them."""

    target: str  # a module (every optimizer class under it) or one class
    package: str | None  # the pip package that provides it (None: the user's own project)
    extra: str | None = None  # effitrain's extra that installs it (None: a dependency of effitrain)
    settings: type[OptimizerSettings] = OptimizerSettings
    state_of: str | None = None  # the class (module.qualname) whose state the formula describes
    state_formula: str | None = None  # module.function: (optimizer) -> Footprint, or None if not covered
    on_fake: bool = True  # fake tensors run its step (bitsandbytes' kernels need real ones)
    on_dtensor: bool = True  # its update takes FSDP's DTensor parameters
    foreach_on_cuda: bool = False  # left to its default, torch runs its foreach update on CUDA tensors
    in_backward: bool = (
        True  # its step updates each parameter alone (optimizer_in_backward runs it per parameter)
    )

    def covers(self, target: str) -> bool:
        return target == self.target or target.startswith(f"{self.target}.")


_FORMULAS = "effitrain.memory.optimizer_state"

# In the order the allow-list names them in its error message. Not on DTensors: bitsandbytes' 8-bit
# kernels, and the plain tensors of Adafactor's factored statistics and of APOLLO's projections, which
# DTensor refuses to mix with the sharded parameters ("got mixed torch.Tensor and DTensor").
OPTIMIZER_FAMILIES = (
    OptimizerFamily(
        "torch.optim", "torch",
        state_of="torch.optim.adam.Adam", state_formula=f"{_FORMULAS}.adam_state", foreach_on_cuda=True,
    ),
    OptimizerFamily(
        "transformers.optimization", "transformers", settings=AdafactorSettings,
        state_of="transformers.optimization.Adafactor", state_formula=f"{_FORMULAS}.adafactor_state",
        on_dtensor=False,
    ),
    OptimizerFamily(
        "bitsandbytes.optim", "bitsandbytes", settings=Bitsandbytes8bitSettings,
        state_of="bitsandbytes.optim.optimizer.Optimizer2State", state_formula=f"{_FORMULAS}.bnb_two_state",
        on_fake=False, on_dtensor=False,
    ),
    OptimizerFamily(
        "torchao.optim", "torchao", extra="torchao",
        state_of=TORCHAO_ADAM_BASE, state_formula=f"{_FORMULAS}.torchao_adam_state",
        in_backward=False,  # its update is compiled: not built to run inside backward's hooks
    ),
    OptimizerFamily(
        "lion_pytorch", "lion-pytorch", settings=LionSettings,
        state_of="lion_pytorch.lion_pytorch.Lion", state_formula=f"{_FORMULAS}.lion_state",
    ),
    OptimizerFamily(
        "effitrain.train.apollo", "apollo-torch", settings=ApolloSettings,
        state_of="apollo_torch.apollo.AdamW", state_formula=f"{_FORMULAS}.apollo_state", on_dtensor=False,
    ),
)  # fmt: skip

# A class of the user's own project: checked as every optimizer is, assumed to run anywhere.
PROJECT_FAMILY = OptimizerFamily("", None)


def optimizer_family(target: str) -> OptimizerFamily:
    """The row whose prefix covers ``target``, an optimizer node's ``_target_`` (the rows do not
    overlap); :data:`PROJECT_FAMILY` for one no row covers."""
    return next((family for family in OPTIMIZER_FAMILIES if family.covers(target)), PROJECT_FAMILY)


def state_family(cls: type) -> OptimizerFamily | None:
    """The row whose state formula describes ``cls``, an optimizer's class: the one whose
    ``state_of`` is a class of its MRO, compared by name so that nothing is imported for it; None
    for a class no formula describes."""
    names = {f"{c.__module__}.{c.__qualname__}" for c in cls.__mro__}
    return next((family for family in OPTIMIZER_FAMILIES if family.state_of in names), None)


def optional_extra(module: str) -> str | None:
    """The extra (``pip install 'effitrain[X]'``) that installs ``module``'s package, or None for a
    package effitrain depends on or knows nothing of."""
    top = module.split(".")[0]
    return next((f.extra for f in OPTIMIZER_FAMILIES if f.extra and f.target.split(".")[0] == top), None)
