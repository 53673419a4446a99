"""The step peak predicted: a run's phases (its first optimizer step, a later one, evaluation)
replayed on fake tensors, each under the step tracker a run measures its step with
(:mod:`effitrain.memory.step_peak`); nothing is allocated and no weights are read.

    effitrain estimate model=distilbert_base_cased optimizer=adam8bit    # predicted, nothing allocated

The step is the backends' own (:func:`effitrain.train.step.window_step`) over the recorded
micro-batches as fake zeros (:mod:`effitrain.memory.fake_window`); memory techniques apply to the
replayed model as to the trained one (:mod:`effitrain.config.techniques`).
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import math

import torch

from effitrain.config.errors import ConfigError
from effitrain.config.techniques import (
    GRADIENT_CHECKPOINTING,
    OPTIMIZER_IN_BACKWARD,
    apply_techniques,
    recomputing,
)
from effitrain.memory.fake_window import (
    fake_window,
    flops_key,
    mask_skipping_as_recorded,
    reused,
    window_flops,
)
from effitrain.memory.layer_flops import counted_by_groups
from effitrain.memory.predicted import BOUND_ASSUMED_BRANCH, BOUND_COUNTED_STATE
from effitrain.memory.step_peak import breakdown, step_tracker
from effitrain.util.compat import attention_implementation, fake_tensor_mode, values_assumed

# The phases of a run whose peaks are predicted: the first optimizer step (its state is created in
# it), a later step (the state exists throughout) and evaluation (a forward of eval_batch_size rows
# with no gradients, while the weights and the optimizer state are still held).
PHASES = ("first_step", "later_step", "eval")


@dataclasses.dataclass
class Trace:
    """What one replay found: the peak by category of each phase, and the FLOPs of one step."""

    phases: dict[str, dict[str, int]]
    flops: int
    # phase -> why its figures are an upper bound of what the run holds (BOUND_*); absent: exact
    bounds: dict[str, str] = dataclasses.field(default_factory=dict)
    # of one step, what the memory techniques recompute in backward (counted with them applied, less
    # the model FLOPs): plan's cost of a lever; 0 where none recomputes
    recomputed_flops: int = 0

    def step_peak(self, warm_up: bool) -> dict[str, int]:
        """The step a run tracks: a later one (``warm_up``), or the first when it has only one."""
        return self.phases["later_step" if warm_up else "first_step"]

    def step_peak_bound(self, warm_up: bool) -> str | None:
        return self.bounds.get("later_step" if warm_up else "first_step")

    @property
    def run_peak_phase(self) -> str:
        """The phase with the highest total."""
        return max(self.phases, key=lambda phase: self.phases[phase]["total"])

    @property
    def run_peak(self) -> dict[str, int]:
        return self.phases[self.run_peak_phase]


def trace_step(config, optimizer_cfg, cfg, batches: list[dict], warm_up: bool, device: str = "cpu",
               eval_shapes: dict | None = None) -> tuple[dict, int]:  # fmt: skip
    """The step peak (by category) and FLOPs of one optimizer step of ``batches``, replayed on fake
    tensors: a later step with ``warm_up`` (the optimizer state exists), else the first."""
    trace = trace_run(config, optimizer_cfg, cfg, batches, device, eval_shapes)
    return trace.step_peak(warm_up), trace.flops


def trace_run(config, optimizer_cfg, cfg, batches: list[dict], device: str = "cpu",
              eval_shapes: dict | None = None, every_micro_batch: bool = False) -> Trace:  # fmt: skip
    """Run a run's phases on fake tensors, as the accelerate backend runs them
    (:func:`effitrain.train.step.window_step` for a step of ``batches``, micro-batch shapes), each
    under the step tracker; nothing is allocated and no weights are read.

    ``device``: the kernels whose saved tensors and temporaries are replayed: ``cpu`` runs the CPU's
    own (a CPU run's measurement, to the byte); ``cuda`` those a CUDA GPU runs
    (:mod:`effitrain.memory.cuda`). ``eval_shapes``: the shapes of an eval batch (the ``eval``
    phase); without it the eval phase is left out. A micro-batch inside a run of equal ones is left
    out, the same bytes (:func:`effitrain.memory.fake_window.replayed_as`), unless ``every_micro_batch``.

    A first, untracked step counts the FLOPs, with a stateless SGD at lr 0 and before checkpointing
    is enabled: model FLOPs (the work recomputation repeats does not count, as MFU is defined), and
    ``FlopCounterMode``'s module hooks would keep recomputed activations alive while it runs. A model
    of more than six groups of alike blocks is counted on one, two and three groups and
    extrapolated (:mod:`effitrain.memory.layer_flops`).
    The memory techniques ``cfg`` turns on apply after it (:mod:`effitrain.config.techniques`): with
    gradient checkpointing the tracked steps recompute each layer in backward.
    The optimizer's own step is replayed, temporaries included, eagerly (as the tracked step of a
    run runs: torchao compiles its update, and compiled code cannot run under the tracker). Where
    the update reads a tensor's value (APOLLO's norm-growth limiter compares two norms; its
    projector draws the next seed with ``.tolist()``), fake tensors have none: it is assumed
    (:func:`_assumed_value`), and the branch taken is the one that holds more memory. Optimizers
    fake tensors cannot run at all (bitsandbytes' kernels) are traced as plain SGD, whose step
    keeps no state, and their state is added from the analytic estimate at every moment of every
    phase (the first step's peak is then an upper bound).
    """
    analytic_state = counted_state(config, optimizer_cfg, cfg, device)
    with replayed(config, cfg, batches, device, eval_shapes, every_micro_batch) as replay:
        optimizer = replay.optimizer(optimizer_cfg)
        for phase in ("first_step", "later_step"):  # reset_mod_stats per micro-batch, as StepMemory.saw
            replay.tracked(
                phase,
                lambda tracker: replay.step(optimizer, tracker),
                optimizer,
            )
        if replay.evaluation is not None:
            replay.tracked("eval", replay.evaluate, optimizer)
    trace = Trace(replay.phases, replay.flops, replay.bounds, replay.recomputed_flops)
    return completed(trace, analytic_state, config, cfg, device)


def completed(trace: Trace, analytic_state: int, config, cfg, device: str = "cpu") -> Trace:
    """``trace`` with what its replay cannot hold added to every phase: the state of an optimizer
    counted, not replayed (``analytic_state``: :func:`counted_state`), and a 4-bit base's packed
    weights in place of the full ones it was traced with
    (:func:`effitrain.train.adapters.replay.counted_4bit`); each with the bound it makes."""
    from effitrain.train.adapters.replay import counted_4bit

    for peak in trace.phases.values():
        peak["optimizer_state"] += analytic_state
        peak["total"] += analytic_state
    from effitrain.memory.cuda import in_blocks

    stored = in_blocks if device == "cuda" else (lambda nbytes: nbytes)
    if quantized := counted_4bit(trace.phases, config, cfg, stored):
        for phase in trace.phases:  # a bound already said (a counted optimizer state) is kept
            trace.bounds.setdefault(phase, quantized)
    if analytic_state:
        trace.bounds["first_step"] = BOUND_COUNTED_STATE
    return trace


def counted_state(config, optimizer_cfg, cfg, device: str = "cpu") -> int:
    """The analytic state bytes of an optimizer fake tensors cannot run (0 for one they can, whose
    caches are then filled for real: :func:`_caches_filled_for_real`), each tensor in ``device``'s
    allocation blocks.

    Raises:
        ConfigError: neither replayed nor counted: a prediction without its state would be too low.
    """
    import transformers

    from effitrain.memory import estimate_optimizer_state
    from effitrain.train.adapters.replay import adapted_on_meta
    from effitrain.train.optim import build_optimizer
    from effitrain.train.tasks import build_task

    if _runs_on_fake(optimizer_cfg):
        _caches_filled_for_real(optimizer_cfg, cfg.weight_decay)
        return 0
    task = build_task(cfg)
    shapes_only = adapted_on_meta(getattr(transformers, task.auto_class), config, cfg, task)
    from effitrain.memory.cuda import CUDA_BLOCK

    block = CUDA_BLOCK if device == "cuda" else 1
    state = estimate_optimizer_state(build_optimizer(optimizer_cfg, shapes_only, cfg.weight_decay), block)
    if state is None:
        raise ConfigError(
            f"optimizer._target_={str(optimizer_cfg.get('_target_'))!r} is invalid: with these settings "
            "its state can be neither replayed on fake tensors nor counted by effitrain's estimate"
        )
    return state.bytes


@dataclasses.dataclass
class Replay:
    """A model on fake tensors, ready to replay a run's phases (:func:`replayed`): what a full trace
    (:func:`trace_run`) and a shared one (:mod:`effitrain.memory.shared_traces`) both run."""

    model: torch.nn.Module
    step: object  # step(optimizer, tracker=None): window_step over the recorded micro-batches (FakeWindow)
    evaluate: object  # evaluate(tracker): the eval phase's forward
    evaluation: dict | None  # the eval batch (None: no eval phase)
    flops: int  # of one step, counted before checkpointing is enabled
    cuda: bool
    weight_decay: float
    recomputed_flops: int = 0  # of one step, what the techniques recompute (Trace.recomputed_flops)
    assumed: list = dataclasses.field(default_factory=list)  # dtypes of the values assumed in a phase
    cfg: object = None  # the run's config: what the optimizer attaches (optimizer_in_backward)
    # the hooks of the step in backward of the optimizer built last (the step's clip reads its norm)
    attached: list = dataclasses.field(default_factory=list)
    phases: dict = dataclasses.field(default_factory=dict)
    bounds: dict = dataclasses.field(default_factory=dict)

    def optimizer(self, optimizer_cfg):
        """The optimizer the replay steps: the configured one where fake tensors can run it, else a
        stateless SGD (its state is counted: :func:`counted_state`); its update moved into backward
        where the run's is (``optimizer_in_backward``), as :func:`effitrain.run.build.build_job` moves it."""
        from effitrain.memory.cuda import foreach_by_default
        from effitrain.train.optim import build_optimizer

        if _runs_on_fake(optimizer_cfg):
            optimizer = build_optimizer(optimizer_cfg, self.model, self.weight_decay)
            optimizer.step = _with_values_assumed(optimizer.step, self.assumed)
        else:
            optimizer = torch.optim.SGD(self.model.parameters(), lr=1e-3)
        if self.cuda:
            foreach_by_default(optimizer)
        for hooks in self.attached:  # one optimizer's update in backward at a time
            hooks.remove()
        self.attached[:] = [
            h for h in [OPTIMIZER_IN_BACKWARD.attach(self.model, optimizer, self.cfg)] if h is not None
        ]
        return optimizer

    def tracked(self, phase: str, run, *external) -> None:
        """``run(tracker)`` under a fresh step tracker that knows the model and ``external``; its peak
        by category becomes ``phase``'s."""
        tracker = step_tracker()
        tracker.track_external(self.model, *external)
        self.assumed.clear()
        with tracker:
            run(tracker)
        self.phases[phase] = breakdown(tracker.get_tracker_snapshot("peak"))
        if torch.bool in self.assumed:  # a branch was chosen; a number assumed (a seed) sizes nothing
            self.bounds[phase] = BOUND_ASSUMED_BRANCH


@contextlib.contextmanager
def replayed(config, cfg, batches: list[dict], device: str = "cpu", eval_shapes: dict | None = None,
             every_micro_batch: bool = False, count_flops: bool = True):  # fmt: skip
    """A :class:`Replay` of ``cfg``'s model under fake tensors and ``device``'s kernels, its FLOPs
    counted (unless not ``count_flops``: 0), then the memory techniques ``cfg`` turns on applied
    (see :func:`trace_run`)."""
    import warnings

    import transformers

    from effitrain.config.schema import DEVICES
    from effitrain.memory.cuda import autocast_like, cuda_kernels
    from effitrain.train.adapters.replay import replay_model
    from effitrain.train.step import StepMeter, StepOps
    from effitrain.train.tasks import build_task

    if device not in DEVICES:
        raise ValueError(f"device={device!r}: expected one of {', '.join(DEVICES)}")
    cuda = device == "cuda"
    task = build_task(cfg)
    auto = getattr(transformers, task.auto_class)
    config = copy.deepcopy(config)  # checkpointing switches its use_cache off: not the caller's

    warnings.filterwarnings("ignore", message="Module is None. Skipping", category=UserWarning)
    with fake_tensor_mode(), torch.compiler.set_stance("force_eager"):
        model = replay_model(auto, config, cfg, task)
        attention = attention_implementation(model.config)
        if cuda and attention not in ("sdpa", "eager"):
            raise ConfigError(
                f"the CUDA replay models the sdpa and eager attention of transformers, not {attention!r}: "
                "its kernel's saved tensors are not predicted"
            )
        dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(cfg.precision.mixed_precision)

        def prepared(net):
            """``net`` in training mode, its forward under mixed precision as accelerate prepares it."""
            net.train()
            if dtype is not None:
                from types import MethodType

                from accelerate.utils import convert_outputs_to_fp32

                autocast = autocast_like(device, dtype)
                net.forward = MethodType(convert_outputs_to_fp32(autocast(net.forward.__func__)), net)
            return net

        prepared(model)
        max_norm = cfg.max_grad_norm or math.inf
        window = fake_window(batches, eval_shapes, every_micro_batch=every_micro_batch)
        evaluation = window.evaluation

        def clipping(net):
            return lambda: torch.nn.utils.clip_grad_norm_(net.parameters(), max_norm, foreach=cuda or None)

        def stepper(net, clip):
            """``window_step`` of ``net`` over the recorded micro-batches, with a meter of its own."""
            ops = StepOps(backward=lambda loss: loss.backward(), no_sync=contextlib.nullcontext, clip=clip)
            return window.stepper(task, net, StepMeter(1, [], torch.device("cpu"), False, False, task), ops)

        def flops_of(net, net_step) -> int:  # one step's FLOPs as ``net`` stands
            return window_flops(window, net_step, torch.optim.SGD(net.parameters(), lr=0.0))

        attached: list = []  # Replay.attached: with the update in backward, the norm its hooks took
        clip = clipping(model)
        step = stepper(model, lambda: attached[0].norm() if attached else clip())

        def evaluate(tracker):
            model.eval()
            with torch.no_grad():
                task.loss_sum(model, evaluation)
            model.train()

        kernels = cuda_kernels() if cuda else contextlib.nullcontext()
        with mask_skipping_as_recorded(model, window.unpadded), kernels:
            emulated = autocast_like(device, dtype) if cuda and dtype is not None else None

            def counted_on(smaller, techniques: bool) -> int:
                """One step's FLOPs of the same model built with ``smaller``'s blocks, the memory
                techniques applied or not (:mod:`effitrain.memory.layer_flops`)."""
                net = prepared(replay_model(auto, smaller, cfg, task))
                with mask_skipping_as_recorded(net, window.unpadded):
                    if techniques:
                        apply_techniques(net, cfg, autocast=emulated)
                    return flops_of(net, stepper(net, clipping(net)))

            # counted here (on fewer blocks where that is exact), or by an earlier replay of plan's
            # search (reused_in_search)
            flops = 0 if not count_flops else reused(
                lambda: flops_key(config, cfg, batches, device, techniques=False),
                lambda: counted_by_groups(
                    config, lambda smaller: counted_on(smaller, False), lambda: flops_of(model, step), model=model
                ),
            )
            # after the FLOPs: model FLOPs leave out what recomputation repeats (see trace_run)
            apply_techniques(model, cfg, autocast=emulated)
            recomputed = 0
            if count_flops and recomputing(cfg):  # counted again with the techniques applied: what they repeat
                key = lambda: flops_key(config, cfg, batches, device, techniques=True)  # noqa: E731
                period = GRADIENT_CHECKPOINTING.every(cfg) or 1  # what is recomputed repeats every N blocks
                recomputed = reused(key, lambda: counted_by_groups(
                    config, lambda smaller: counted_on(smaller, True), lambda: flops_of(model, step), period, model,
                ) - flops)  # fmt: skip
            yield Replay(model, step, evaluate, evaluation, flops, cuda, cfg.weight_decay, recomputed,
                         cfg=cfg, attached=attached)  # fmt: skip


def _assumed_value(tensor):
    """The value a fake tensor's ``.item()`` is assumed to have in a replayed update: 0 (``False``
    for a comparison). APOLLO's limiter ``max(norm / last_norm, 1.01)`` then keeps the tensor
    (``1.01 > ratio`` is false), and dividing by it holds that 0-d tensor besides the scaled gradient
    and its quotient, where the float it would otherwise take holds nothing: the larger branch."""
    return False if tensor.dtype == torch.bool else 0.0 if tensor.is_floating_point() else 0


def _with_values_assumed(step, assumed: list):
    """``step`` with :func:`_assumed_value` for the values fake tensors lack, each one's dtype noted
    in ``assumed``."""

    def assume(tensor):
        assumed.append(tensor.dtype)
        return _assumed_value(tensor)

    def stepped(*args, **kwargs):
        with values_assumed(assume):
            return step(*args, **kwargs)

    return stepped


def _caches_filled_for_real(optimizer_cfg, weight_decay: float) -> None:
    """One real step of the optimizer on a small layer, before the replay: a table a library
    computes from tensor values once per process and caches (torchao's quantization maps) is made
    here from real values, never in the replay from assumed ones (a run in this process would then
    read it)."""
    from effitrain.train.optim import build_optimizer

    layer = torch.nn.Linear(128, 64)  # 8,192 weights: torchao quantizes tensors of 4,096 and more
    optimizer = build_optimizer(optimizer_cfg, layer, weight_decay)
    for param in layer.parameters():
        param.grad = torch.zeros_like(param)
    with torch.compiler.set_stance("force_eager"):
        optimizer.step()


def _runs_on_fake(optimizer_cfg) -> bool:
    """Fake tensors can run the optimizer's step (not bitsandbytes' kernels): its family says."""
    from effitrain.config.optimizers import optimizer_family

    return optimizer_family(str(optimizer_cfg.get("_target_", ""))).on_fake
