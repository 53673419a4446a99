"""``parallel=fsdp``'s object (effitrain/train/parallel/fsdp.py): it shards in a group of one and
says so, switches the gradients' collective off for a micro-batch, and names the optimizers its
parameters refuse (the sharding itself: tests/train/test_sharding.py; its checkpoint:
tests/train/test_sharded_checkpoint.py)."""

from __future__ import annotations

import pytest
import torch
from omegaconf import OmegaConf

from effitrain.train.parallel.fsdp import FSDP

CFG = OmegaConf.create(
    {
        "parallel": {"strategy": "fsdp", "reshard_after_forward": True, "offload": False},
        "precision": {"mixed_precision": "no"},
    }
)


@pytest.fixture
def model():
    from transformers import BertConfig, BertForSequenceClassification

    config = BertConfig(
        vocab_size=32, hidden_size=8, num_hidden_layers=2, num_attention_heads=2, intermediate_size=16
    )
    yield BertForSequenceClassification(config)
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


def test_apply_in_one_process_shards_over_a_group_of_one_and_says_so(model):
    from torch.distributed.fsdp import FSDPModule

    said = []
    sharded = FSDP().apply(model, CFG, torch.device("cpu"), said.append)
    assert said == [
        "parallel=fsdp in one process: sharded over a group of one (nothing split, offload applies)"
    ]
    assert torch.distributed.get_world_size() == 1
    # the root and each of the 2 layers and the embeddings: transformers' _no_split_modules
    assert sum(isinstance(m, FSDPModule) for m in sharded.modules()) == 4


def test_no_sync_switches_the_gradients_collective_off_for_its_block_only():
    class Model:
        calls = []

        def set_requires_gradient_sync(self, value):
            self.calls.append(value)

    with FSDP().no_sync(Model()):
        assert Model.calls == [False]
    assert Model.calls == [False, True]


@pytest.mark.parametrize(
    "target, refused",
    [
        ("torch.optim.AdamW", False),
        ("bitsandbytes.optim.Adam8bit", True),
        ("transformers.optimization.Adafactor", True),
        ("effitrain.train.apollo.APOLLOAdamW", True),
    ],
)
def test_the_replay_refuses_what_training_refuses(target, refused):
    why = FSDP().replay_refusal(OmegaConf.create({"_target_": target}))
    if not refused:
        assert why is None
        return
    assert why == (
        f"optimizer._target_={target!r} is invalid with parallel=fsdp: its update mixes plain tensors "
        "with the sharded (DTensor) parameters"
    )
