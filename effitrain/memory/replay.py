"""The step peak: tensor memory by category at the highest point of one optimizer step, measured on a
real step of a run and predicted by running the same step on fake tensors.

Both use PyTorch's dispatch-level ``MemTracker``, which attributes every live tensor to parameters,
buffers, gradients, activations, temporaries or optimizer state. It counts tensors, not processes,
so the figure is the same on CPU and CUDA and comparable across jobs even in one process. Tensors
that exist before the step and belong to none of the model or optimizer (the micro-batches the data
loader already made) are not counted, in the measurement and the prediction alike, until an
operation in the step views one (a causal LM shifts its labels, GPT-2 reshapes its inputs): its
storage then counts as an activation from that moment on, in both.

    effitrain estimate model=distilbert_base_cased optimizer=adam8bit    # predicted, nothing allocated
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import math

import torch

from effitrain.config.errors import ConfigError
from effitrain.config.summary_schema import CATEGORIES
from effitrain.util.compat import (
    attention_implementation,
    checkpointing_wrapped,
    fake_tensor_mode,
    mask_skipping_replaced,
    step_peak_tracker_class,
    values_assumed,
)

# MemTracker's categories -> effitrain's (the summary's keys); buffers are model state like weights.
CATEGORY_OF = {
    "Parameter": "weights",
    "Buffer": "weights",
    "Gradient": "gradients",
    "Optstate": "optimizer_state",
    "Activation": "activations",
    "Temp": "temporaries",
    "Other": "temporaries",
}


def step_tracker():
    """A ``MemTracker`` that keeps only the whole step's peak. MemTracker also keeps every module's
    own peak, at the cost of a pass over all modules on each operator; nothing here reads those,
    and skipping them is what brings a tracked step near a plain one's time."""
    return step_peak_tracker_class()()


def breakdown(snapshot: dict) -> dict[str, int]:
    """Bytes per category of a MemTracker snapshot (all devices together), and ``total``."""
    totals = dict.fromkeys(CATEGORIES, 0)
    for per_device in snapshot.values():
        for kind, nbytes in per_device.items():
            kind = getattr(kind, "value", kind)
            if kind in CATEGORY_OF:
                totals[CATEGORY_OF[kind]] += int(nbytes)
    totals["total"] = sum(totals[c] for c in CATEGORIES)
    return totals


class StepMemory:
    """Measures one optimizer step of a run (``step``, 1-based) and remembers its micro-batches'
    shapes, so the prediction can replay exactly that step.

    ``job.track_step(step)`` enters :meth:`track`: a context around an optimizer step that tracks
    only the chosen one; :meth:`saw` is called before each micro-batch's forward. A backend that
    cannot wrap its step in a ``with`` (the Trainer) calls :meth:`begin` and :meth:`end` itself.
    """

    def __init__(self, model, optimizer, step: int, meter=None):
        self.model, self.optimizer, self.step, self.meter = model, optimizer, step, meter
        self.peak: dict[str, int] | None = None
        self.batches: list[dict] = []  # {key: (shape, dtype)} of each micro-batch of the tracked step
        self._tracker = None

    @contextlib.contextmanager
    def track(self, step: int):
        if step != self.step:
            yield
            return
        self.begin(step)
        try:
            yield
        finally:
            self.end()

    @property
    def active(self) -> bool:
        return self._tracker is not None

    def begin(self, step: int) -> None:
        if step != self.step or self.peak is not None:
            return
        tracker = step_tracker()
        tracker.track_external(self.model, self.optimizer)
        # torch.compile cannot run under the tracker's dispatch mode: the tracked step runs eagerly
        # (a compiled model falls back to eager there anyway; torchao's optimizers compile their
        # update with fullgraph=True, which would fail instead)
        with contextlib.ExitStack() as entered:  # both or neither: a failed enter leaves no stance behind
            entered.enter_context(torch.compiler.set_stance("force_eager"))
            entered.enter_context(tracker)
            self._entered = entered.pop_all()
        self._tracker = tracker
        if self.meter is not None:
            self.meter.leave_untimed()

    def saw(self, batch) -> None:
        """A micro-batch of the step starts (called before its forward)."""
        if not self.active:
            return
        if self.batches:  # the model runs again in this step: MemTracker wants fresh module stats
            self._tracker.reset_mod_stats()
        shapes = {k: (tuple(v.shape), v.dtype) for k, v in batch.items() if torch.is_tensor(v)}
        mask = batch.get("attention_mask")
        # a model skips building its attention mask when nothing is padded: the replay must too
        shapes["padded"] = bool((mask == 0).any()) if mask is not None else False
        self.batches.append(shapes)

    def end(self) -> None:
        """Leave the tracker (also after a failed step, so no dispatch mode outlives the run)."""
        tracker, self._tracker = self._tracker, None
        if tracker is None:
            return
        self._entered.close()  # the tracker, then the stance (also when the tracker's exit raises)
        self.peak = breakdown(tracker.get_tracker_snapshot("peak"))
        tracker.reset_mod_stats()

    def summary(self) -> dict:
        if self.peak is None:
            return {}
        return {**peak_keys(self.peak), "mem/step_peak_tracked_step": self.step}


def peak_keys(peak: dict[str, int], suffix: str = "") -> dict:
    """``mem/step_peak_bytes<suffix>`` and ``mem/step_peak<suffix>/<category>_bytes``: the measured
    step peak (no suffix) or the predicted one (``_predicted``)."""
    keys = {f"mem/step_peak_bytes{suffix}": peak["total"]}
    keys.update({f"mem/step_peak{suffix}/{c}_bytes": peak[c] for c in CATEGORIES})
    return keys


def predicted_keys(peak: dict[str, int], flops: int, bound: str | None = None) -> dict:
    """The predicted step peak's keys, with ``mem/step_peak_predicted_bound``: why the figures are an
    upper bound of the step rather than the step itself (None where the replay is the step)."""
    return {
        **peak_keys(peak, "_predicted"),
        "speed/flops_per_step": flops,
        "mem/step_peak_predicted_bound": bound,
    }


def run_peak_keys(trace: Trace) -> dict:
    """``mem/run_peak_bytes_predicted`` (the largest phase), ``mem/run_peak_predicted/<phase>_bytes``
    and ``mem/run_peak_predicted_bound`` (as ``mem/step_peak_predicted_bound``, for the largest phase)."""
    keys = {
        "mem/run_peak_bytes_predicted": trace.run_peak["total"],
        "mem/run_peak_predicted_bound": trace.bounds.get(trace.run_peak_phase),
    }
    keys.update(
        {f"mem/run_peak_predicted/{phase}_bytes": peak["total"] for phase, peak in trace.phases.items()}
    )
    return keys


def fake_batch(shapes: dict) -> dict:
    """Zeros of the recorded shapes and dtypes (an attention mask of ones): made under fake mode."""
    batch = {}
    for key, (shape, dtype) in ((k, v) for k, v in shapes.items() if k != "padded"):
        batch[key] = (
            torch.ones(shape, dtype=dtype) if key == "attention_mask" else torch.zeros(shape, dtype=dtype)
        )
    return batch


@dataclasses.dataclass
class FakeWindow:
    """A step's recorded micro-batches as fake zeros (:func:`fake_window`), made under fake mode."""

    batches: list[dict]  # the micro-batches replayed
    evaluation: dict | None  # the eval batch
    items: int  # the items (labels) of the whole recorded window
    unpadded: set[int]  # ids of the attention masks recorded without padding (_mask_skipping_as_recorded)
    # per recorded micro-batch, the index in ``batches`` of the first with its shapes (its FLOPs)
    shaped_as: list[int]
    # id(a replayed batch) -> the left-out (batch, stand-in) pairs to count before it begins
    left_out: dict[int, list[tuple[dict, dict]]]

    def stepper(self, task, model, meter, ops):
        """``step(optimizer, tracker=None, before_forward=None, only=None)``: :func:`window_step` over
        ``batches`` (those of the indices ``only``). Under ``tracker``: fresh module stats per
        micro-batch (as ``StepMemory.saw``) and, before a micro-batch that ends a run of repeats, the
        left-out ones' tensors counted as their stand-in's were (:func:`stand_ins`)."""
        from effitrain.train.step import window_step
        from effitrain.util.compat import counting_like

        count = counting_like()

        def step(optimizer, tracker=None, before_forward=None, only=None):
            batches = self.batches if only is None else [self.batches[index] for index in only]

            def begin(batch):
                if tracker is not None:
                    tracker.reset_mod_stats()
                    for left_out, stand_in in self.left_out.get(id(batch), ()):
                        for key, tensor in left_out.items():
                            count(tracker, tensor, stand_in[key])
                if before_forward is not None:
                    before_forward(batch)

            return window_step(task, model, optimizer, batches, self.items, meter, ops, begin)

        return step


def fake_window(batches: list[dict], eval_shapes: dict | None, synchronized_last: bool = False,
                every_micro_batch: bool = False) -> FakeWindow:  # fmt: skip
    """The recorded micro-batches and eval batch as fake zeros (:func:`fake_batch`, made under fake
    mode), the repeats left out (:func:`stand_ins`; ``synchronized_last``: a sharded step's) unless
    ``every_micro_batch``."""
    from effitrain.util.compat import counting_like

    window = [fake_batch(shapes) for shapes in batches]
    leave_out = not every_micro_batch and counting_like() is not None
    stands_for = stand_ins(batches, synchronized_last) if leave_out else list(range(len(batches)))
    kept = [index for index, stand_in in enumerate(stands_for) if stand_in == index]
    left_out: dict[int, list[tuple[dict, dict]]] = {}
    for index, stand_in in enumerate(stands_for):
        if stand_in != index:  # counted before the next replayed one, the last of its run, begins
            ends_run = next(k for k in kept if k > index)
            left_out.setdefault(id(window[ends_run]), []).append((window[index], window[stand_in]))
    evaluation = fake_batch(eval_shapes) if eval_shapes is not None else None
    unpadded = {
        id(b["attention_mask"])
        for b, s in [*zip(window, batches), (evaluation, eval_shapes)]
        if b is not None and "attention_mask" in b and not s.get("padded", True)
    }
    return FakeWindow(
        [window[k] for k in kept], evaluation, sum(len(b["labels"]) for b in window), unpadded,
        [next(n for n, k in enumerate(kept) if batches[k] == shapes) for shapes in batches], left_out,
    )  # fmt: skip


def stand_ins(batches: list[dict], synchronized_last: bool = False) -> list[int]:
    """For each recorded micro-batch, the one replayed in its place: itself, or the first of its run
    when it lies inside a run of micro-batches of the same shapes (neither the run's first nor last).

    From the second micro-batch on, each starts with the gradients made and the meter's running sums
    and the last loss held (0-d tensors), and leaves them as it found them, except for the tensors of
    its own batch that MemTracker came to count (a view of the labels a causal LM shifts, of the
    inputs GPT-2 reshapes): the run's last, replayed, holds what it would have held once the left-out
    ones' tensors are counted as the run's first's were (:meth:`FakeWindow.stepper`), and its highest
    point is at least any left-out one's (above it by the batch tensors counted since; else equal,
    category by category). ``synchronized_last``: the last micro-batch synchronizes the gradients (a
    sharded step), so the one before it ends its run. ``tests/memory/test_replay.py`` holds this to
    full windows, byte for byte."""
    last_inside = len(batches) - (3 if synchronized_last else 2)
    stands_for: list[int] = []
    for index, shapes in enumerate(batches):
        inside = 1 <= index <= last_inside and batches[index - 1] == shapes == batches[index + 1]
        stands_for.append(stands_for[-1] if inside else index)
    return stands_for


def window_flops(window: FakeWindow, step, optimizer) -> int:
    """The FLOPs of one optimizer step over the whole recorded window: ``step`` replays one micro-batch
    of each shape under ``FlopCounterMode``, each one's count read as the next begins, and every
    recorded micro-batch counts as the one of its shapes (FlopCounterMode counts matrix products,
    which the shapes decide: ``tests/memory/test_replay.py`` holds this to full windows)."""
    from torch.utils.flop_counter import FlopCounterMode

    distinct = sorted(set(window.shaped_as))
    marks: list[int] = []
    with FlopCounterMode(display=False) as counter:
        step(optimizer, before_forward=lambda batch: marks.append(counter.get_total_flops()), only=distinct)
        marks.append(counter.get_total_flops())
    own = dict(zip(distinct, (after - before for before, after in zip(marks, marks[1:]))))
    return sum(own[index] for index in window.shaped_as)


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


# Why a predicted figure can exceed the real one (Trace.bounds); elsewhere the replay is the step.
BOUND_COUNTED_STATE = (
    "the optimizer state is counted, not replayed: held from the first step's start, where the real "
    "step creates it"
)
BOUND_ASSUMED_BRANCH = (
    "the update compares values fake tensors lack (APOLLO's norm-growth limiter): the branch that "
    "holds more memory is taken"
)


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
    out, the same bytes (:func:`stand_ins`), unless ``every_micro_batch``.

    A first, untracked step counts the FLOPs, with a stateless SGD at lr 0 and before checkpointing
    is enabled: model FLOPs (the work recomputation repeats does not count, as MFU is defined), and
    ``FlopCounterMode``'s module hooks would keep recomputed activations alive while it runs.
    ``cfg.gradient_checkpointing``: the tracked steps recompute each layer in backward.
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
    return completed(Trace(replay.phases, replay.flops, replay.bounds), analytic_state, config, cfg, device)


def completed(trace: Trace, analytic_state: int, config, cfg, device: str = "cpu") -> Trace:
    """``trace`` with what its replay cannot hold added to every phase: the state of an optimizer
    counted, not replayed (``analytic_state``: :func:`counted_state`), and a 4-bit base's packed
    weights in place of the full ones it was traced with
    (:func:`effitrain.train.adapters.replay.counted_4bit`); each with the bound it makes."""
    from effitrain.train.adapters.replay import counted_4bit

    for peak in trace.phases.values():
        peak["optimizer_state"] += analytic_state
        peak["total"] += analytic_state
    if quantized := counted_4bit(trace.phases, config, cfg, device):
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
    (:func:`trace_run`) and a shared one (:mod:`effitrain.memory.shared`) both run."""

    model: torch.nn.Module
    step: object  # step(optimizer, tracker=None): window_step over the recorded micro-batches (FakeWindow)
    evaluate: object  # evaluate(tracker): the eval phase's forward
    evaluation: dict | None  # the eval batch (None: no eval phase)
    flops: int  # of one step, counted before checkpointing is enabled
    cuda: bool
    weight_decay: float
    assumed: list = dataclasses.field(default_factory=list)  # dtypes of the values assumed in a phase
    phases: dict = dataclasses.field(default_factory=dict)
    bounds: dict = dataclasses.field(default_factory=dict)

    def optimizer(self, optimizer_cfg):
        """The optimizer the replay steps: the configured one where fake tensors can run it, else a
        stateless SGD (its state is counted: :func:`counted_state`)."""
        from effitrain.memory.cuda import foreach_by_default
        from effitrain.train.optim import build_optimizer

        if _runs_on_fake(optimizer_cfg):
            optimizer = build_optimizer(optimizer_cfg, self.model, self.weight_decay)
            optimizer.step = _with_values_assumed(optimizer.step, self.assumed)
        else:
            optimizer = torch.optim.SGD(self.model.parameters(), lr=1e-3)
        if self.cuda:
            foreach_by_default(optimizer)
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
             every_micro_batch: bool = False):  # fmt: skip
    """A :class:`Replay` of ``cfg``'s model under fake tensors and ``device``'s kernels, its FLOPs
    counted and checkpointing enabled as ``cfg`` says (see :func:`trace_run`)."""
    import warnings

    import transformers

    from effitrain.config.schema import DEVICES
    from effitrain.memory.cuda import autocast_like, cuda_kernels
    from effitrain.train.adapters.replay import replay_model
    from effitrain.train.modeling import enable_activation_checkpointing
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
        model.train()
        dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(cfg.precision.mixed_precision)
        if dtype is not None:  # as accelerate prepares a model for mixed precision
            from types import MethodType

            from accelerate.utils import convert_outputs_to_fp32

            autocast = autocast_like(device, dtype)
            model.forward = MethodType(convert_outputs_to_fp32(autocast(model.forward.__func__)), model)

        meter = StepMeter(1, [], torch.device("cpu"), False, False, task)
        max_norm = cfg.max_grad_norm or math.inf
        window = fake_window(batches, eval_shapes, every_micro_batch=every_micro_batch)
        evaluation = window.evaluation

        ops = StepOps(
            backward=lambda loss: loss.backward(),
            no_sync=contextlib.nullcontext,
            clip=lambda: torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm, foreach=cuda or None),
        )

        step = window.stepper(task, model, meter, ops)

        def evaluate(tracker):
            model.eval()
            with torch.no_grad():
                task.loss_sum(model, evaluation)
            model.train()

        kernels = cuda_kernels() if cuda else contextlib.nullcontext()
        with _mask_skipping_as_recorded(model, window.unpadded), kernels:
            flops = window_flops(window, step, torch.optim.SGD(model.parameters(), lr=0.0))
            if cfg.get("gradient_checkpointing"):
                enable_activation_checkpointing(model)
                # checkpointing recomputes a layer under the autocast its forward ran in (it saves and
                # restores autocast state); the emulated CUDA autocast is a mode, not that state, so it
                # is opened around the checkpointed function itself, in forward and recomputation alike
                if (
                    cuda
                    and dtype is not None
                    and not checkpointing_wrapped(model, autocast_like(device, dtype))
                ):
                    raise ConfigError(
                        "the CUDA replay cannot recompute this model's layers under CUDA's autocast "
                        "(no transformers _gradient_checkpointing_func): gradient checkpointing with "
                        f"precision={cfg.precision.mixed_precision} is not modeled"
                    )
            yield Replay(model, step, evaluate, evaluation, flops, cuda, cfg.weight_decay)


@contextlib.contextmanager
def _mask_skipping_as_recorded(model, unpadded: set[int]):
    """transformers skips building an attention mask for a batch without padding, a decision it
    cannot take on fake tensors (it assumes padding). Take it as the recorded micro-batch did: a
    hook on the model's forward notes which micro-batch is running."""
    current = {"unpadded": False}

    def note(module, args, kwargs):
        current["unpadded"] = id(kwargs.get("attention_mask")) in unpadded

    def follow(original):
        def decide(*args, **kwargs):
            return True if current["unpadded"] else original(*args, **kwargs)

        return decide

    hook = model.register_forward_pre_hook(note, with_kwargs=True)
    try:
        with mask_skipping_replaced(follow):
            yield
    finally:
        hook.remove()


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
