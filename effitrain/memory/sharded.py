"""One rank's memory under FSDP2 sharding (``parallel=fsdp``), predicted for any world size from one
CPU process: the run's phases replayed on fake tensors, as :mod:`effitrain.memory.replay` replays
an unsharded run, with the model sharded by training's own strategy object
(:class:`effitrain.train.parallel.fsdp.FSDP`: its ``apply_on_mesh``, ``no_sync`` and ``replay_refusal``).

    effitrain estimate task=causal_lm model=llama_7b parallel=fsdp --world-size 8 --optimizers adamw

How: torch's fake process group (backend ``fake``: collectives return at once and move nothing)
makes this process one rank (0 by default) of ``world_size``; the CPU device mesh is built outside
``FakeTensorMode`` (inside, ``init_device_mesh`` fails on a data-dependent op); the model is built
and sharded inside it, so each parameter is a DTensor whose local part has rank 0's rows. Rank 0
holds ``ceil(dim0 / world_size)`` rows of every parameter, the most any rank holds (the last ranks'
rows may be padding only), so its figures are the largest rank's. ``FSDPMemTracker`` tracks each
phase and sorts every live tensor into FSDP's categories; they map to effitrain's as follows (the
fine ones are kept beside, in :attr:`ShardedTrace.fsdp_phases`):

==================  ==================  ======================================================
FSDPMemTracker      effitrain           what it is on one rank
==================  ==================  ======================================================
Sharded Param       weights             this rank's rows of every parameter (padding included)
Unsharded Param     weights             a block's gathered weights while it runs
All Gather          weights             the buffer the gathered weights arrive in
Buffer              weights             the model's buffers (not sharded)
Sharded Grad        gradients           this rank's rows of every gradient
Unsharded Grad      gradients           a block's whole gradients before they are reduce-scattered
Reduce Scatter      temporaries         the buffer the gradients leave in (a run's MemTracker: a temporary)
OptState            optimizer_state     the optimizer's state of this rank's rows, its step's temporaries
Activation          activations         as unsharded
Temp                temporaries         as unsharded
Inputs              (not counted)       the micro-batches exist before the step, as unsharded
==================  ==================  ======================================================

A communication buffer is counted with the tensors it carries. On CPU the run's backend is gloo,
whose reduce-scatter (``ProcessGroupGloo::reduce_scatter_tensor_coalesced``) clones its whole input
on the calling thread, all-reduces the clone and copies this rank's chunk out: the replay holds the
same clone for the same call (:func:`gloo_reduce_scatter`), a temporary the size of the block's
reduce-scatter buffer. What the fake group does not model: a backend's staging memory outside
torch's tensors or on its own threads (gloo's all-gather, nccl's buffers), which no tensor tracker
sees in a real run either.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import math

import torch

from effitrain.config.errors import ConfigError
from effitrain.config.summary_schema import CATEGORIES
from effitrain.config.techniques import apply_techniques, recomputing
from effitrain.memory.fake_window import fake_window, mask_skipping_as_recorded, window_flops
from effitrain.memory.predicted import BOUND_ASSUMED_BRANCH
from effitrain.memory.replay import Trace, _caches_filled_for_real, _with_values_assumed
from effitrain.train.parallel import strategy_of
from effitrain.util.compat import fake_process_group, fake_tensor_mode, fsdp_mem_tracker_class

# FSDPMemTracker's categories -> effitrain's (the table above); Inputs are left out.
CATEGORY_OF = {
    "Sharded Param": "weights",
    "Unsharded Param": "weights",
    "All Gather": "weights",
    "Buffer": "weights",
    "Sharded Grad": "gradients",
    "Unsharded Grad": "gradients",
    "Reduce Scatter": "temporaries",
    "OptState": "optimizer_state",
    "Activation": "activations",
    "Temp": "temporaries",
}


class UnshardableOptimizer(ConfigError):
    """The optimizer's update fails on FSDP's sharded parameters (DTensors)."""


@dataclasses.dataclass
class ShardedTrace(Trace):
    """A :class:`Trace` of one rank of ``world_size``, with FSDP's own categories of each phase's
    peak (``fsdp_phases``: phase -> {"Sharded Param": bytes, ...}) beside effitrain's."""

    world_size: int = 1
    fsdp_phases: dict[str, dict[str, int]] = dataclasses.field(default_factory=dict)
    # phase -> FSDP's categories as the optimizer's update starts: every gradient reduce-scattered
    # and held, the state of the steps before (a fixed moment, where the peak may fall anywhere)
    at_update: dict[str, dict[str, int]] = dataclasses.field(default_factory=dict)


@contextlib.contextmanager
def gloo_reduce_scatter():
    """The fake group's reduce-scatter followed by a clone of its input, dropped at once: what gloo
    (the CPU run's backend) holds for the call, beside the input and the output. Made after the
    collective, not before, so the tracker has already filed the input as FSDP's reduce-scatter
    buffer when the clone's peak is taken, as in the real run (the same bytes, FSDP's split).
    FSDP2 calls ``torch.distributed.reduce_scatter_single`` by its module attribute."""
    plain = torch.distributed.reduce_scatter_single

    def as_gloo(output, input, *args, **kwargs):
        work = plain(output, input, *args, **kwargs)
        input.clone()  # gloo's buffer: counted at its peak, freed as the call returns
        return work

    torch.distributed.reduce_scatter_single = as_gloo
    try:
        yield
    finally:
        torch.distributed.reduce_scatter_single = plain


def fsdp_breakdown(snapshot: dict) -> tuple[dict[str, int], dict[str, int]]:
    """Bytes per effitrain category (and ``total``) and per FSDP category of an ``FSDPMemTracker``
    snapshot, all devices together."""
    fine = dict.fromkeys(CATEGORY_OF, 0)
    for per_device in snapshot.values():
        for kind, nbytes in per_device.items():
            kind = getattr(kind, "value", kind)
            if kind in fine:
                fine[kind] += int(nbytes)
    totals = dict.fromkeys(CATEGORIES, 0)
    for kind, nbytes in fine.items():
        totals[CATEGORY_OF[kind]] += nbytes
    totals["total"] = sum(totals[c] for c in CATEGORIES)
    return totals, fine


def tracked_phase(model, optimizer, run) -> tuple[tuple[dict, dict], dict | None]:
    """``run(tracker)`` under an ``FSDPMemTracker`` of ``model`` and ``optimizer``: its peak by
    effitrain's and FSDP's categories (:func:`fsdp_breakdown`), and FSDP's categories as the
    optimizer's update starts (None where ``run`` steps no optimizer). The prediction and the
    measurement of a real rank (tests/helpers/fsdp_rank_memory.py) both track a phase with it."""
    tracker = fsdp_mem_tracker_class()(model, optimizer)
    at_update = {}

    def note_update(*_):
        at_update.update(fsdp_breakdown(tracker.get_tracker_snapshot("current"))[1])

    hook = optimizer.register_step_pre_hook(note_update)
    try:
        with tracker:
            run(tracker)
    finally:
        hook.remove()
    return fsdp_breakdown(tracker.get_tracker_snapshot("peak")), at_update or None


def trace_sharded(config, optimizer_cfg, cfg, batches: list[dict], device: str = "cpu",
                  eval_shapes: dict | None = None, *, world_size: int, rank: int = 0) -> ShardedTrace:  # fmt: skip
    """One rank's run phases (first step, later step, evaluation) under ``cfg.parallel``'s FSDP2
    sharding over ``world_size`` processes, on fake tensors: the other arguments as
    :func:`effitrain.memory.replay.trace_run`'s (so one call site serves both), whose conventions it
    follows (FLOPs from an untracked step, the update replayed with its temporaries). ``rank``:
    whose rows (0, the default, holds the most).

    The fake process group lives only inside this call: it is destroyed on the way out, so the
    caller may call again or train afterwards. In a process that already has a process group (a
    rank of a real run) the trace runs in a child process of its own.

    Raises:
        ConfigError: ``world_size`` below 1.
        UnshardableOptimizer: an optimizer training refuses under FSDP (the strategy's
            ``replay_refusal``), or whose replayed update fails on DTensors.
        ValueError: ``cfg.parallel`` a strategy that does not shard.
    """
    if world_size < 1:
        raise ConfigError(f"--world-size={world_size} is invalid: expected a number of processes, 1 or more")
    strategy = strategy_of(cfg)
    if not strategy.shards:
        raise ValueError(f"parallel.strategy={strategy.name}: one rank's replay is of a strategy that shards")
    refusal = strategy.replay_refusal(optimizer_cfg)
    if refusal is not None:  # training refuses it: no prediction for a run that cannot be
        raise UnshardableOptimizer(refusal)
    if not 0 <= rank < world_size:
        raise ValueError(f"rank={rank}: expected 0 to {world_size - 1}")
    arguments = (config, optimizer_cfg, cfg, batches, device, eval_shapes)
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        import concurrent.futures
        import multiprocessing

        spawn = multiprocessing.get_context("spawn")
        with concurrent.futures.ProcessPoolExecutor(1, mp_context=spawn) as child:
            return child.submit(trace_sharded, *arguments, world_size=world_size, rank=rank).result()
    from torch.distributed.device_mesh import init_device_mesh

    fake_process_group(rank=rank, world_size=world_size)
    try:
        mesh = init_device_mesh("cpu", (world_size,))  # outside FakeTensorMode: see the module docstring
        return _trace(strategy, mesh, world_size, *arguments)
    finally:
        torch.distributed.destroy_process_group()


def _trace(
    strategy, mesh, world_size, config, optimizer_cfg, cfg, batches, device, eval_shapes
) -> ShardedTrace:
    import warnings

    import transformers

    from effitrain.config.schema import DEVICES
    from effitrain.memory.cuda import cuda_kernels, foreach_by_default
    from effitrain.train.optim import build_optimizer
    from effitrain.train.step import StepMeter, StepOps
    from effitrain.train.tasks import build_task

    if device not in DEVICES:
        raise ValueError(f"device={device!r}: expected one of {', '.join(DEVICES)}")
    cuda = device == "cuda"
    task = build_task(cfg)
    auto = getattr(transformers, task.auto_class)
    config = copy.deepcopy(config)  # checkpointing switches its use_cache off: not the caller's
    warnings.filterwarnings("ignore", message="Module is None. Skipping", category=UserWarning)
    _caches_filled_for_real(optimizer_cfg, cfg.weight_decay)

    phases, fsdp_phases, at_update, bounds = {}, {}, {}, {}
    with fake_tensor_mode(), torch.compiler.set_stance("force_eager"):
        with torch.device("cpu"):
            model = auto.from_config(config)
        model.train()
        # FSDP2's mixed-precision policy casts the gathered weights and the inputs: no autocast
        strategy.apply_on_mesh(model, cfg, mesh)
        assumed: list[torch.dtype] = []

        def make_optimizer():
            made = build_optimizer(optimizer_cfg, model, cfg.weight_decay)
            made.step = _refused_on_dtensors(_with_values_assumed(made.step, assumed), optimizer_cfg)
            if cuda:
                foreach_by_default(made)
            return made

        optimizer = make_optimizer()
        meter = StepMeter(1, [], torch.device("cpu"), False, False, task)
        max_norm = cfg.max_grad_norm or math.inf
        window = fake_window(batches, eval_shapes, synchronized_last=True)
        evaluation = window.evaluation
        ops = StepOps(
            backward=lambda loss: loss.backward(),
            no_sync=lambda: strategy.no_sync(model),
            clip=lambda: torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm, foreach=cuda or None),
            num_processes=world_size,
        )

        step = window.stepper(task, model, meter, ops)

        def tracked(phase, run):
            assumed.clear()
            (phases[phase], fsdp_phases[phase]), update = tracked_phase(model, optimizer, run)
            if update is not None:
                at_update[phase] = update
            if torch.bool in assumed:
                bounds[phase] = BOUND_ASSUMED_BRANCH

        def evaluate(tracker):
            model.eval()
            with torch.no_grad():
                task.loss_sum(model, evaluation)
            model.train()

        kernels = cuda_kernels() if cuda else gloo_reduce_scatter()
        with mask_skipping_as_recorded(model, window.unpadded), kernels:
            # one rank's FLOPs: the whole model on its batch
            flops = window_flops(window, step, torch.optim.SGD(model.parameters(), lr=0.0))
            _sharding_rules_cached(model, make_optimizer())
            apply_techniques(model, cfg)
            recomputed = 0
            if recomputing(cfg):  # counted again with the techniques applied: what they repeat
                recomputed = window_flops(window, step, torch.optim.SGD(model.parameters(), lr=0.0)) - flops
            for phase in ("first_step", "later_step"):
                tracked(phase, lambda tracker: step(optimizer, tracker))
            if evaluation is not None:
                tracked("eval", evaluate)
    return ShardedTrace(phases, flops, bounds, recomputed, world_size=world_size, fsdp_phases=fsdp_phases,
                        at_update=at_update)  # fmt: skip


def _sharding_rules_cached(model, optimizer) -> None:
    """One untracked update of a throwaway ``optimizer`` on zero gradients. Without it the first
    tracked update on fake DTensors counts several times the state in temporaries that the same
    update on real tensors never holds, and later updates do not: DTensor's sharding propagation,
    which runs an op it has not met yet on fake tensors (here of the tracked mode) and caches the
    result, is the likely cause. The FLOP step met the forward's and backward's ops already."""
    for param in model.parameters():
        param.grad = torch.zeros_like(param)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def _refused_on_dtensors(step, optimizer_cfg):
    """``step``, whose failure on sharded parameters (an update that mixes DTensors with the plain
    tensors of its own state, as Adafactor's factored statistics) says so in one line."""

    def stepped(*args, **kwargs):
        try:
            return step(*args, **kwargs)
        except RuntimeError as error:
            if "DTensor" not in str(error):
                raise
            raise UnshardableOptimizer(
                f"optimizer._target_={str(optimizer_cfg.get('_target_'))!r} is invalid with parallel=fsdp: "
                f"its update cannot take sharded parameters ({str(error).splitlines()[0]})"
            ) from None

    return stepped
