"""The optimizer step in backward (``optimizer_in_backward=true``): each parameter is updated as soon as
backward has accumulated its gradient, and that gradient is freed at once, so the whole model's
gradient term never exists at once (torchtune's ``optimizer_in_bwd``; what is held is one gradient
and the step's temporaries for one parameter). The same arithmetic as the step after backward for
an optimizer whose update is per parameter (torch's AdamW on CPU: bit-identical).

    python train.py optimizer_in_backward=true max_grad_norm=0

One optimizer object stays the run's: in each parameter's hook its ``step()`` runs while that
parameter alone holds a gradient (every other one is None, so the optimizer skips it), then the
gradient is set to None. The LR scheduler, checkpoints (every parameter's state), the optimizer
state's count and accelerate's ``AcceleratedOptimizer`` see the optimizer they always see; the
backend's own ``optimizer.step()`` after backward finds no gradient and changes nothing, and the
schedule still steps once per optimizer step. The price: each call walks all the optimizer's
parameters to find the one with a gradient, quadratic in the number of parameter tensors (a
7B Llama's 291: about 0.1 s of Python per optimizer step on a busy CPU, against 0.03 s for one step
after backward), where one optimizer per parameter (torchtune's) would lose the single optimizer.

The update must run after everything else that reads the gradient: the memory trackers'
post-accumulate-grad hooks (:class:`effitrain.memory.track.GradientRecorder`, MemTracker's in
:mod:`effitrain.memory.step_peak`) are registered later than this, at the measured region and the
tracked step. So the update is not a post-accumulate-grad hook (those run in registration order) but
a post hook of the parameter's gradient accumulator node (``AccumulateGrad``), which autograd runs
after all of the parameter's post-accumulate-grad hooks, whenever they were registered; the node is
held (autograd keeps it only weakly), as DDP holds it for its reducer.

The gradient norm a run logs (``grad_norm``) is each gradient's 2-norm taken in its hook, combined
in parameter order after backward (:meth:`InBackward.norm`), as ``clip_grad_norm_`` combines them:
the same figure, with nothing to clip.

It applies after the optimizer is built (the technique's :meth:`apply` to the model does nothing):
:func:`effitrain.run.build.build_job` and the replay's optimizer
(:meth:`effitrain.memory.replay.Replay.optimizer`) call :meth:`OptimizerInBackward.attach`, one code
path, so what is predicted is what runs; the accelerate backend and the replay take the step's
gradient norm from what it returns. A shared replay of several optimizers (one backward, each
optimizer's step on its gradients) cannot hold for a step inside backward: each optimizer is then
replayed in full (:func:`effitrain.memory.shared_traces.trace_runs`).

Refused, each in one line, where the update cannot run per parameter in backward: gradients
accumulated over micro-batches, clipping to a global norm (``max_grad_norm`` above 0: it needs every
gradient at once), fp16's grad scaler (it unscales and checks all gradients together), more than one
process (DDP and FSDP reduce gradients after the hook), the Trainer backend (it steps, clips and
scales through its own loop), a compiled model (tried on CPU: equal losses but weights 2e-9 apart
from the compiled run without it, unexplained, so not offered), and an optimizer family whose row
says its update does not run per parameter in backward (:mod:`effitrain.config.optimizers`: torchao,
whose update is compiled). ``max_grad_norm`` defaults to 1.0: a user types ``max_grad_norm=0``.

What it saves, measured equal to the prediction on CPU (tests/memory/test_optimizer_in_backward.py):
the step peak's gradients fall from every gradient to the largest one (llama_tiny, one sequence:
7,896,192 B to 3,906,816 B, its embedding's); where activations set the peak it saves nothing.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from omegaconf import DictConfig

from effitrain.config.errors import chosen, invalid
from effitrain.config.parallel import shards
from effitrain.config.registry import uses_trainer


@dataclass(frozen=True)
class OptimizerInBackward:
    """The technique (:class:`effitrain.config.techniques.Technique`) of ``optimizer_in_backward``."""

    key: str = "optimizer_in_backward"

    def on(self, cfg: DictConfig) -> bool:
        return bool(cfg.get(self.key))

    def check(self, cfg: DictConfig) -> None:
        """On, with a run whose update can be made per parameter inside backward.

        Raises:
            ConfigError: the first setting that keeps it from running (:meth:`refusal`).
        """
        if self.on(cfg) and (refused := self.refusal(cfg)) is not None:
            raise refused

    def refusal(self, cfg: DictConfig):
        """The ConfigError naming the first setting of ``cfg`` the step in backward cannot run with
        (each one line: key, value, what is allowed), or None."""
        from effitrain.config.optimizers import optimizer_family

        on = f"with {self.key}=true"
        accumulation = cfg.get("gradient_accumulation_steps")
        if isinstance(accumulation, int) and accumulation > 1:
            return invalid("gradient_accumulation_steps", accumulation, f"{on} each gradient updates its "
                           "parameter as backward makes it, so none accumulates over micro-batches: give 1 "
                           "(a larger micro_batch_size instead), or optimizer_in_backward=false")  # fmt: skip
        norm = cfg.get("max_grad_norm")
        if norm:
            return invalid("max_grad_norm", norm, f"{on} each gradient is applied and freed in backward, "
                           "before the global norm could clip it: give max_grad_norm=0 (no clipping), or "
                           "optimizer_in_backward=false")  # fmt: skip
        backend, parallel, precision, compiled = (
            cfg.get(g) or {} for g in ("backend", "parallel", "precision", "compile")
        )
        if uses_trainer(cfg):
            return invalid(*chosen(cfg, "backend"), f"{on}: the Trainer steps, clips and scales the "
                           "optimizer in its own loop; use backend=accelerator")  # fmt: skip
        strategy = str(parallel.get("strategy", "ddp"))
        if shards(cfg):
            return invalid("parallel", strategy, f"{on}: FSDP reduces each gradient after backward made "
                           "it, after the update has used it; use parallel=ddp with one process")  # fmt: skip
        processes = int(os.environ.get("WORLD_SIZE", "1"))
        if processes > 1:
            return invalid("parallel", strategy, f"{on} one process trains alone: DDP averages gradients "
                           f"after the update has used them ({processes} processes); launch one")  # fmt: skip
        if precision.get("mixed_precision") == "fp16":
            return invalid(*chosen(cfg, "precision"), f"{on}: fp16's grad scaler unscales and checks "
                           "every gradient together before the step; use precision=bf16 or fp32")  # fmt: skip
        if compiled.get("enabled"):
            return invalid(*chosen(cfg, "compile"), f"{on} a compiled model is not built or tested: "
                           "use compile=off")  # fmt: skip
        target = str((cfg.get("optimizer") or {}).get("_target_", ""))
        if not optimizer_family(target).in_backward:
            return invalid(*chosen(cfg, "optimizer"), f"{on}: its update is compiled over the parameters "
                           "and is not run per parameter inside backward; use adamw, adamw_fused, "
                           "adafactor, adam8bit, lion or apollo")  # fmt: skip
        return None

    def apply(self, model, cfg: DictConfig, autocast=None) -> None:
        """Nothing to the model: the step in backward attaches to the optimizer (:meth:`attach`)."""

    def attach(self, model, optimizer, cfg: DictConfig):
        """Where ``cfg`` turns it on, ``optimizer``'s update of ``model`` moved into backward: an
        :class:`effitrain.config.techniques.in_backward_hooks.InBackward` (its ``norm()`` is the
        step's gradient norm); None where it is off. Called once the optimizer is built, before
        the first backward.

        Raises:
            ConfigError: a setting it cannot run with (:meth:`refusal`): a replay of a candidate the
                run would refuse (``plan``'s accumulation above 1) predicts nothing that runs.
        """
        if not self.on(cfg):
            return None
        self.check(cfg)
        from effitrain.config.techniques.in_backward_hooks import InBackward

        return InBackward(model, optimizer)

    def replay_key(self, cfg: DictConfig) -> dict:
        return {self.key: self.on(cfg)}

    def plan_values(self, cfg: DictConfig, given: bool, asked=None, device: str = "cpu") -> list:
        """Off, then on (``asked``: a subset); the user's own setting alone when given; off alone
        where ``cfg`` refuses it (clipping, the Trainer, several processes, fp16, compile, the
        optimizer: :meth:`refusal`), on any device alike."""
        if given:
            return [self.on(cfg)]
        if self.refusal(cfg) is not None:
            return [False]
        return [value for value in (False, True) if asked is None or value in asked]

    def recomputes(self, cfg: DictConfig) -> bool:
        return False  # the update moves, no forward work is repeated

    def override(self, value) -> str:
        return f"{self.key}={str(bool(value)).lower()}"

    def described(self, cfg: DictConfig) -> str:
        return self.override(self.on(cfg))


OPTIMIZER_IN_BACKWARD = OptimizerInBackward()
