"""``effitrain estimate``'s engine: what it asks the replay for (the replay itself is tested in
tests/memory)."""

from __future__ import annotations

import torch

from effitrain.commands.estimate import estimate_memory
from tests.helpers.run import compose


def test_estimate_traces_the_worst_case_step_and_an_evaluation_of_eval_batch_size(monkeypatch):
    """Every micro-batch max_length tokens, gradient_accumulation_steps of them, and the eval phase
    at eval_batch_size x max_length rows (12 x 40 here, not the micro batch's 4)."""
    import effitrain.memory.shared
    from effitrain.memory.replay import Trace

    asked = []

    def replay(config, optimizer_cfgs, cfg, batches, device, eval_shapes, steps=None):
        asked.append((batches, device, eval_shapes))
        peak = dict.fromkeys(["weights", "gradients", "optimizer_state", "activations", "temporaries"], 0)
        peak["total"] = 1
        return {
            name: Trace({"first_step": peak, "later_step": peak, "eval": peak}, 1) for name in optimizer_cfgs
        }

    monkeypatch.setattr(effitrain.memory.shared, "trace_runs", replay)
    cfg = compose(
        "max_length=40", "micro_batch_size=4", "eval_batch_size=12", "gradient_accumulation_steps=3"
    )
    estimate_memory(cfg)

    def shapes(rows: int) -> dict:
        tokens = ((rows, 40), torch.int64)
        return {"input_ids": tokens, "attention_mask": tokens, "labels": ((rows,), torch.int64),
                "token_type_ids": tokens}  # fmt: skip

    [(batches, device, evaluation)] = asked
    assert batches == [shapes(4)] * 3 and device == "cpu"
    assert evaluation == shapes(12)
