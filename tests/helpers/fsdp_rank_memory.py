"""Each rank's memory in a real FSDP2 run on CPU, measured, for the test that compares it with the
prediction (tests/memory/test_sharded.py):

    python -m torch.distributed.run --standalone --nproc_per_node 2 -m tests.helpers.fsdp_rank_memory OUT

Every rank trains two steps of the tiny Llama below over gloo, sharded by training's own ``shard``,
stepped by the backends' ``window_step`` with the accelerator backend's FSDP operations, and
evaluates once; each phase is tracked by :func:`effitrain.memory.sharded.tracked_phase`, as the
prediction tracks it. Rank r writes ``OUT/rank<r>.json``: {"phases": {phase: {category: bytes}},
"at_update": {phase: {category: bytes}}}.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
from transformers import LlamaConfig

VOCAB, HIDDEN, INTERMEDIATE, LAYERS = 101, 32, 64, 2
LLAMA = LlamaConfig(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=INTERMEDIATE, num_hidden_layers=LAYERS,
                    num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=64)  # fmt: skip
TOKENS = (1, 8)
# no padding in the measured batches: the model skips its mask, as the prediction is told
BATCH = {"padded": False, **{key: (TOKENS, torch.int64) for key in ("input_ids", "attention_mask", "labels")}}
OVERRIDES = ("task=causal_lm", "parallel=fsdp", "optimizer=adamw")


def main(out: Path) -> None:
    from functools import partial

    from torch.distributed.device_mesh import init_device_mesh
    from transformers import AutoModelForCausalLM

    from effitrain.memory.sharded import tracked_phase
    from effitrain.train.optim import build_optimizer
    from effitrain.train.sharding import full_value, gradient_sync_off, shard
    from effitrain.train.step import StepMeter, StepOps, step_items, window_step
    from effitrain.train.tasks import build_task
    from tests.helpers.run import compose

    torch.distributed.init_process_group("gloo")
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    cfg = compose(*OVERRIDES, tiny=False)
    task = build_task(cfg)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(LLAMA)
    model.train()
    shard(model, cfg.parallel, cfg.precision.mixed_precision, init_device_mesh("cpu", (world,)))
    optimizer = build_optimizer(cfg.optimizer, model, cfg.weight_decay)
    ids = torch.randint(0, VOCAB, TOKENS)
    window = [{"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids.clone()}]
    items = step_items(task, window, torch.device("cpu"))
    meter = StepMeter(2, [], torch.device("cpu"), False, False, task)
    ops = StepOps(
        backward=lambda loss: loss.backward(),
        no_sync=partial(gradient_sync_off, model),
        clip=lambda: full_value(torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.max_grad_norm)),
        num_processes=world,
    )

    def step(tracker):
        window_step(
            task, model, optimizer, window, items, meter, ops, lambda batch: tracker.reset_mod_stats()
        )

    def evaluate(tracker):
        model.eval()
        with torch.no_grad():
            task.loss_sum(model, window[0])
        model.train()

    measured = {"phases": {}, "at_update": {}}
    for phase, run in (("first_step", step), ("later_step", step), ("eval", evaluate)):
        (_, measured["phases"][phase]), update = tracked_phase(model, optimizer, run)
        if update is not None:
            measured["at_update"][phase] = update
    (out / f"rank{rank}.json").write_text(json.dumps(measured))
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main(Path(sys.argv[1]))
