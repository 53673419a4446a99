"""A replay's peak found on fewer blocks of the same model, moment by moment, where that gives the
whole model's peak exactly: the memory counterpart of :mod:`effitrain.memory.layer_flops`.

A fake tensor's operator costs the same whatever its sizes, so a replay of a 32-block model runs
ten times the operators of a 3-block one for the same answer's worth of structure. But a peak is
the largest of a step's moments, and which moment is largest can change as blocks are added (the
logits with a few blocks, the last block's backward with many): the peak itself is not affine in
the number of blocks, each moment is. So the tracker records every moment (the bytes by category
of each device after each operator), labelled by the block it runs in (:data:`Label`): inside a
block's forward or backward as the module tracker sees it, else the one block whose weights or
gradients the operator reads (clipping's norm of each gradient, an optimizer's state made per
weight). The moments then split into the same sequence of segments at every size: stretches
outside the blocks, and runs that pass through every block once, forward in order or backward in
reverse, in groups of ``period`` blocks (gradient checkpointing of every N-th block repeats every N).

Replayed at two, three and four groups, the sequences must match, segment for segment and moment
for moment, and every moment's bytes must be affine in the number of groups (the three replays on
a line, category by category): each is then extrapolated to the model's groups. Inside a run, the
groups are alike but for its odd ends (a first or last group with moments of its own, or bytes off
the others' line; with both ends odd, the replays are of three, four and five groups, :data:`WIDER`),
and a moment of the j-th alike group is affine in j too (checked on the two larger replays), so its
largest value over the groups is at the first or the last alike group: the whole model's run is its
odd ends, its first alike group and its last, in time order. The peak is the first moment to reach
the largest total, device by device, as ``MemTracker`` keeps it.

Where anything does not match or is not on a line, :class:`NotExtrapolable` is raised and the
caller replays the whole model. ``tests/memory/test_layer_memory.py`` holds extrapolated peaks
equal to whole replays, category by category.
"""

from __future__ import annotations

import dataclasses

from effitrain.util.compat.memtracker import MANY_BLOCKS

GROUPS = (2, 3, 4)  # the groups of blocks replayed: two make each moment's line, the third checks it
WIDER = (3, 4, 5)  # where both ends of a run are odd: its alike groups need one more group

TOTAL = "Total"  # MemTracker's key of a snapshot's total (mem_tracker._TOTAL_KEY)


class NotExtrapolable(Exception):
    """The replays on fewer blocks do not give the whole model's figures exactly: replay it whole."""


class BothEndsOdd(NotExtrapolable):
    """A run's first and last groups are both odd: replay at :data:`WIDER` groups."""


# (in backward, the block's index or None outside every block, or MANY for an operator reading
# several blocks' tensors at once: a foreach over every gradient)
Label = tuple
MANY = MANY_BLOCKS


@dataclasses.dataclass
class _Run:
    """A stretch of moments through every block once, in groups of ``period`` blocks."""

    backward: bool
    groups: list[list]  # each group's moments, in time order
    forms: list[tuple]  # each group's segment lengths


def worth_it(layers, period: int, groups: tuple = GROUPS) -> bool:
    """Whether ``layers`` blocks split into whole groups of ``period`` and replaying the three
    smaller models runs fewer blocks than the whole one."""
    return isinstance(layers, int) and layers % period == 0 and sum(groups) * period < layers


def _segments(timeline: list[tuple[Label, dict]]) -> list[tuple[Label, list[dict]]]:
    """Consecutive moments of one label, together."""
    segments: list[tuple[Label, list[dict]]] = []
    for label, moment in timeline:
        if segments and segments[-1][0] == label:
            segments[-1][1].append(moment)
        else:
            segments.append((label, [moment]))
    return segments


def _shape(timeline: list[tuple[Label, dict]], blocks: int, period: int) -> list:
    """The timeline as stretches outside the blocks, ``(label, moments)``, and :class:`_Run` s."""
    items: list = []
    segments = _segments(timeline)
    index = 0
    while index < len(segments):
        (backward, block), moments = segments[index]
        if block is None or block == MANY:
            items.append(((backward, block), moments))
            index += 1
            continue
        if block not in (0, blocks - 1):
            raise NotExtrapolable(f"a stretch begins inside the blocks, at block {block}")
        order = range(blocks) if block == 0 else range(blocks - 1, -1, -1)
        run = segments[index : index + blocks]
        if [label for label, _ in run] != [(backward, b) for b in order]:
            raise NotExtrapolable("a stretch does not pass through every block once, in order")
        grouped = [run[start : start + period] for start in range(0, blocks, period)]
        items.append(_Run(
            backward,
            [[moment for _, moments in group for moment in moments] for group in grouped],
            [tuple(len(moments) for _, moments in group) for group in grouped],
        ))  # fmt: skip
        index += blocks
    return items


def _form(item) -> tuple:
    if isinstance(item, _Run):
        return "run", item.backward  # its groups: _family
    label, moments = item
    return label, len(moments)


def _family(runs: list[_Run], keys: set, both: bool) -> tuple[int, int]:
    """Where a run's alike groups begin and end, as (a, b): ``a`` is 1 where its first group is odd,
    ``b`` 1 where its last is: other moments than the inner groups', or bytes off their line (the
    embedding's output, held through a forward under ``no_grad``, is the first block's input only).
    Read on the largest replay; every replay's groups must be alike but those ends. ``both``: both
    ends may be odd (the replays are :data:`WIDER`)."""
    largest = runs[-1]
    inner = set(largest.forms[1:-1])
    if len(inner) != 1:
        raise NotExtrapolable("the inner groups of a stretch differ in their moments")
    family, groups = inner.pop(), largest.groups
    step = _steps(groups[1], groups[2], keys)
    a = int(largest.forms[0] != family or _steps(groups[0], groups[1], keys) != step)
    b = int(largest.forms[-1] != family or _steps(groups[-2], groups[-1], keys) != step)
    if a and b and not both:
        raise BothEndsOdd("both ends of a stretch are odd")
    for run in runs:
        expected = [family] * len(run.forms)
        if a:
            expected[0] = largest.forms[0]
        if b:
            expected[-1] = largest.forms[-1]
        if run.forms != expected:
            raise NotExtrapolable("a stretch's groups differ between the replays")
    return a, b


def _keys(moments) -> set:
    return {(device, kind) for moment in moments for device, snapshot in moment.items() for kind in snapshot}


def _line(values: list[dict], keys: set, at: int, what: str, base: int) -> dict:
    """Moments of the three replays (dicts of device -> kind -> bytes; the first of ``base`` groups,
    one more each) on a line, each key's bytes at ``at`` groups, as a moment."""
    out: dict = {}
    for device, kind in keys:
        one, two, three = (v.get(device, {}).get(kind, 0) for v in values)
        if three - two != two - one:
            raise NotExtrapolable(
                f"{what}: {kind} on {device} is not affine in the blocks ({one}, {two}, {three})"
            )
        out.setdefault(device, {})[kind] = one + (at - base) * (two - one)
    return out


def _steps(first: list[dict], second: list[dict], keys: set) -> list[dict]:
    """Moment by moment, what the second group holds more than the first."""
    return [
        {(d, k): b.get(d, {}).get(k, 0) - a.get(d, {}).get(k, 0) for d, k in keys}
        for a, b in zip(first, second)
    ]


def _check_family(runs: list[_Run], a: int, keys: set) -> None:
    """A family group's moments are affine in its place: the two larger replays step alike from their
    family's first group to the next, and the largest's family lies on a line."""
    middle, largest = runs[1].groups, runs[2].groups
    step = _steps(middle[a], middle[a + 1], keys)
    if step != _steps(largest[a], largest[a + 1], keys) or step != _steps(
        largest[a + 1], largest[a + 2], keys
    ):
        raise NotExtrapolable("a group's moments are not affine in its place")


def extrapolated(timelines: list[list[tuple[Label, dict]]], blocks: int, period: int,
                 groups: tuple = GROUPS) -> list[dict]:  # fmt: skip
    """The moments that can hold the peak of the whole model of ``blocks`` blocks, in time order, from
    the ``timelines`` of its replays at ``groups`` groups of ``period`` blocks (:data:`GROUPS`, or
    :data:`WIDER` where both ends of a run are odd: :class:`BothEndsOdd`)."""
    target = blocks // period
    shapes = [_shape(timeline, count * period, period) for timeline, count in zip(timelines, groups)]
    forms = [[_form(item) for item in shape] for shape in shapes]
    if forms[0] != forms[1] or forms[1] != forms[2]:
        raise NotExtrapolable("the replays' stretches differ")
    moments: list[dict] = []
    for where, items in enumerate(zip(*shapes)):
        what = f"stretch {where}"
        if not isinstance(items[0], _Run):
            flat = [moments_ for _, moments_ in items]
            keys = _keys(m for ms in flat for m in ms)
            moments += [_line(list(at), keys, target, what, groups[0]) for at in zip(*flat)]
            continue
        runs = list(items)
        keys = _keys(m for run in runs for group in run.groups for m in group)
        a, b = _family(runs, keys, both=groups[0] > GROUPS[0])
        _check_family(runs, a, keys)
        # the first group, where it differs; the family's first and last (its largest moments are at
        # one of them); the last group, where it differs
        picks = [0] * a + [a, -1 - b] + [-1] * b
        for pick in picks:
            moments += [
                _line(list(at), keys, target, what, groups[0])
                for at in zip(*(run.groups[pick] for run in runs))
            ]
    return moments


def extrapolated_current(snapshots: list[dict], blocks: int, period: int, groups: tuple = GROUPS) -> dict:
    """A snapshot taken at the same point of each replay (what is held when the step is reached),
    extrapolated to the whole model's ``blocks``."""
    return _line(snapshots, _keys(snapshots), blocks // period, "the held snapshot", groups[0])


def peak(moments: list[dict]) -> dict:
    """Each device's snapshot at the first moment its total reaches its highest, as MemTracker keeps it."""
    best: dict = {}
    for moment in moments:
        for device, snapshot in moment.items():
            if device not in best or snapshot.get(TOTAL, 0) > best[device].get(TOTAL, 0):
                best[device] = snapshot
    return best
