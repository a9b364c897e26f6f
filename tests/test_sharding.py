"""sharding.py: the per-rank config, which kv heads a rank holds, each checkpoint tensor's split, the
loader's sharded and pipeline-stage reads, and (in one process) that the shards compute what the whole
model computes: the TP reference over the shards equals the TP 1 reference at fp32 tolerance."""

from __future__ import annotations

import pytest
import torch

from minimax_ops import reference_model as rm
from minimax_ops.cache import LayerCache, allocate_caches, build_step
from minimax_ops.config import preset
from minimax_ops.loader import checkpoint_tensors, load_weights, save_checkpoint, weights_from_tensors
from minimax_ops.sharding import (ShardingError, kv_head_slice, local_config, pipeline_layers, shard_checkpoint,
                                  shard_tensor)
from minimax_ops.weights import random_model_weights

CFG = preset("tiny_tp")  # 8 heads, 2 kv heads, intermediates 128
FORMATS = [pytest.param({}, id="bf16"), pytest.param({"linear_format": "mxfp8", "expert_format": "mxfp4"}, id="mx"),
           pytest.param({"linear_format": "mxfp4", "shared": "table"}, id="mxfp4-table")]


@pytest.mark.parametrize("t,heads,kv,inter", [(1, 8, 2, 128), (2, 4, 1, 64), (4, 2, 1, 32)])
def test_local_config(t, heads, kv, inter):
    c = local_config(CFG, t)
    assert (c.num_attention_heads, c.num_key_value_heads, c.sparse_num_index_heads) == (heads, kv, kv)
    assert c.intermediate_size == c.shared_intermediate_size == c.dense_intermediate_size == inter
    assert (c.hidden_size, c.head_dim, c.sparse_index_dim, c.num_local_experts) == (64, 32, 32, 8)


@pytest.mark.parametrize("config,t,fragment", [
    (CFG, 3, "tensor_parallel_size=3: num_attention_heads=8 does not split evenly"),
    (CFG, 16, "num_attention_heads=8 does not split evenly"),
    (CFG.replace(num_attention_heads=12, num_key_value_heads=3, sparse_num_index_heads=3), 2,
     "num_key_value_heads=3 neither splits"),
    (preset("tiny"), 4, "config field 'intermediate_size': must be a multiple of 32"),
    (CFG, 0, "tensor_parallel_size: expected a positive integer, got 0"),
])
def test_unsplittable_degrees_are_refused_with_the_reason(config, t, fragment):
    with pytest.raises(ShardingError, match=fragment):
        local_config(config, t)


@pytest.mark.parametrize("config,t,want", [
    (CFG, 1, [(0, 2)]), (CFG, 2, [(0, 1), (1, 2)]), (CFG, 4, [(0, 1), (0, 1), (1, 2), (1, 2)]),
    (preset("real"), 2, [(0, 2), (2, 4)]),
    (preset("real"), 8, [(0, 1)] * 2 + [(1, 2)] * 2 + [(2, 3)] * 2 + [(3, 4)] * 2),
])
def test_kv_heads_of_each_rank(config, t, want):
    got = [kv_head_slice(config, r, t) for r in range(t)]
    assert [(s.start, s.stop) for s in got] == want
    # The kv head a rank holds is the one its q heads attend with (GQA group = heads / kv heads).
    group, per_rank = config.num_attention_heads // config.num_key_value_heads, config.num_attention_heads // t
    for r, s in enumerate(got):
        assert {(r * per_rank + j) // group for j in range(per_rank)} == set(range(s.start, s.stop))


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(a.view(torch.uint8), b.view(torch.uint8))


def _split_dim(name: str) -> int | None:
    if any(k in name for k in ("o_proj", "down_proj", ".w2.")):
        return -1
    if any(k in name for k in ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj", ".w1.", ".w3.")) \
            and "index_k_proj" not in name:
        return 0
    return None


@pytest.mark.parametrize("formats", FORMATS)
@pytest.mark.parametrize("t", [2, 4])
def test_shards_reassemble_the_checkpoint(formats, t):
    shared = formats.pop("shared", "separate")
    weights = random_model_weights(CFG, generator=torch.Generator().manual_seed(1), shared=shared, **formats)
    full = checkpoint_tensors(weights, CFG)
    shards = [shard_checkpoint(full, CFG, r, t) for r in range(t)]
    for name, tensor in full.items():
        parts = [s[name] for s in shards]
        dim = _split_dim(name)
        if dim is None:
            assert all(_same(p, tensor) for p in parts), f"{name}: expected replicated"
        elif any(k in name for k in ("k_proj", "v_proj", "index_q_proj")) and t > CFG.num_key_value_heads:
            per_head = t // CFG.num_key_value_heads  # ranks sharing one kv head hold identical rows
            heads = parts[::per_head]
            assert all(_same(parts[r], heads[r // per_head]) for r in range(t)), name
            assert _same(torch.cat(heads, dim), tensor), name
        else:
            assert _same(torch.cat(parts, dim), tensor), name
            assert parts[0].shape[dim] == tensor.shape[dim] // t, name


def test_a_tensor_of_no_known_place_is_refused():
    with pytest.raises(ShardingError, match="model.layers.0.vision_tower.weight: not a MiniMax-M3 text-model tensor"):
        shard_tensor("model.layers.0.vision_tower.weight", torch.zeros(4), CFG, 0, 2)
    with pytest.raises(ShardingError, match="tp_rank: expected 0..1, got 2"):
        shard_tensor("model.norm.weight", torch.zeros(4), CFG, 2, 2)


def test_loader_reads_a_rank_shard_and_a_pipeline_stage(tmp_path):
    weights = random_model_weights(CFG, generator=torch.Generator().manual_seed(2), linear_format="mxfp8")
    save_checkpoint(weights, CFG, tmp_path, max_shard_bytes=200_000)
    config, rank1 = load_weights(tmp_path, tp_rank=1, tp_size=2)
    assert config == CFG
    want = weights_from_tensors(shard_checkpoint(checkpoint_tensors(weights, CFG), CFG, 1, 2), local_config(CFG, 2))
    for got, exp in zip(rank1.layers, want.layers, strict=True):
        assert got.tensors().keys() == exp.tensors().keys()
        assert all(_same(got.tensors()[k], exp.tensors()[k]) for k in got.tensors())
    assert rank1.layers[2].w13.shape == (8, 2 * 64, 64) and rank1.layers[0].qkv.shape[0] == (4 + 2) * 32
    _, stage = load_weights(tmp_path, layers=range(2, 4))
    assert len(stage.layers) == 2
    for got, exp in zip(stage.layers, weights.layers[2:], strict=True):
        assert all(_same(got.tensors()[k], exp.tensors()[k]) for k in exp.tensors())


@pytest.mark.parametrize("formats", FORMATS[:2])
@pytest.mark.parametrize("t", [2, 4])
def test_tp_reference_over_shards_equals_tp1(formats, t):
    """The oracle run over the shards, partials summed in fp32 as minimax.all_reduce does."""
    g = torch.Generator().manual_seed(3)
    weights = random_model_weights(CFG, generator=g, **formats)
    ckpt = checkpoint_tensors(weights, CFG)
    meta = build_step([37, 70, 20], 2, block_size=CFG.sparse_block_size, num_blocks=32, generator=g)
    ids = torch.randint(0, CFG.vocab_size, (meta.num_tokens,), generator=g)
    caches = allocate_caches(CFG, 32, generator=g)
    tp1_caches = [c.clone() for c in caches]
    want = rm.model_forward(ids, weights, tp1_caches, meta, CFG)
    shards = [weights_from_tensors(ckpt, CFG, tp_rank=r, tp_size=t) for r in range(t)]
    rank_caches = [[LayerCache(c.kv[:, kv_head_slice(CFG, r, t)].clone(), None if c.index is None else c.index.clone())
                    for c in caches] for r in range(t)]
    got = rm.tp_model_forward(ids, shards, rank_caches, meta, local_config(CFG, t))
    assert ((got - want).norm(dim=1) / want.norm(dim=1)).max() <= 1e-5
    for r in range(t):
        for layer, (mine, whole) in enumerate(zip(rank_caches[r], tp1_caches)):
            assert torch.equal(mine.kv, whole.kv[:, kv_head_slice(CFG, r, t)]), (r, layer)


@pytest.mark.parametrize("layers,size,want", [(4, 2, [(0, 2), (2, 4)]), (5, 2, [(0, 3), (3, 5)]),
                                              (60, 4, [(0, 15), (15, 30), (30, 45), (45, 60)]), (3, 1, [(0, 3)])])
def test_pipeline_layers(layers, size, want):
    assert [(r.start, r.stop) for r in (pipeline_layers(layers, k, size) for k in range(size))] == want


def test_pipeline_layers_refuses_impossible_splits():
    with pytest.raises(ShardingError, match="pipeline split"):
        pipeline_layers(2, 0, 3)
    with pytest.raises(ShardingError, match="pp_rank=2, pp_size=2"):
        pipeline_layers(4, 2, 2)
