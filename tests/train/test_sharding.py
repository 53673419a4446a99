"""FSDP2 sharding: the blocks it shards, each rank's rows (padding included), the policies it follows."""

from __future__ import annotations

import math

import pytest
import torch
from omegaconf import OmegaConf

from effitrain.train.sharding import mixed_precision_policy, shard, transformer_blocks


def tiny_bert():
    from transformers import BertConfig, BertForSequenceClassification

    config = BertConfig(vocab_size=101, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                        intermediate_size=64, max_position_embeddings=64, num_labels=3)  # fmt: skip
    return BertForSequenceClassification(config)


def tiny_llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=101, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                         num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=64)  # fmt: skip
    return LlamaForCausalLM(config)


@pytest.fixture(params=[0, 2], ids=["first-rank", "last-rank"])
def fake_group(request):
    """``(rank, world)`` of a fake process group of 3 in this process (collectives do nothing): 3
    divides neither 101 (the vocabulary) nor 32 or 64, so the last rank's rows are padding in part."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    torch.distributed.init_process_group("fake", rank=request.param, world_size=3, store=FakeStore())
    try:
        yield request.param, 3
    finally:
        torch.distributed.destroy_process_group()


def test_blocks_are_the_classes_no_split_modules_names():
    bert, llama = tiny_bert(), tiny_llama()
    assert transformer_blocks(bert) == [bert.bert.embeddings, *bert.bert.encoder.layer]
    assert transformer_blocks(llama) == list(llama.model.layers)
    with pytest.raises(ValueError, match="names no transformer blocks"):
        transformer_blocks(torch.nn.Linear(2, 2))


FSDP = OmegaConf.create({"strategy": "fsdp", "reshard_after_forward": True, "offload": False})


@pytest.mark.parametrize("build", [tiny_bert, tiny_llama])
def test_each_rank_holds_ceil_dim0_over_world_rows(fake_group, build):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor

    rank, world = fake_group
    model = build()
    names = {name: (tuple(p.shape), p.dtype) for name, p in model.named_parameters()}
    shard(model, FSDP, "no", init_device_mesh("cpu", (world,)))
    sharded = dict(model.named_parameters())
    assert sharded.keys() == names.keys()  # the no-decay split reads these names
    for name, param in sharded.items():
        shape, dtype = names[name]
        assert isinstance(param, DTensor) and tuple(param.shape) == shape
        rows = math.ceil(shape[0] / world)
        real_rows = max(min(rows, shape[0] - rank * rows), 0)  # the last rank's may fall short
        assert tuple(param.to_local().shape) == (real_rows, *shape[1:])
        # what the rank holds: dim 0 padded to a multiple of the world, ceil(dim0 / world) rows each
        padded = rows * math.prod(shape[1:]) * dtype.itemsize
        assert param.to_local().untyped_storage().nbytes() == padded


def test_bf16_gathers_in_bf16_and_reduces_in_fp32():
    policy = mixed_precision_policy("bf16")
    assert (policy.param_dtype, policy.reduce_dtype) == (torch.bfloat16, torch.float32)
    plain = mixed_precision_policy("no")
    assert (plain.param_dtype, plain.reduce_dtype) == (None, None)
