"""Pipeline split of the compile-ready model: a stage holds a contiguous slice of the layers
(loader.load_model(layers=...)), the first embeds, the last returns logits, and between them travel
the intermediate tensors (hidden_states, residual). Two stages chained in one process must give the
whole model's logits and caches bit for bit, eagerly (a prefill and a decode) and compiled with the
pass (each stage's layers fused)."""

from __future__ import annotations

import pytest
import torch

import graph_text as gt
from graph_passes import MiniMaxM3DecodePass
from minimax_ops.cache import allocate_caches, build_step, request_block_ids
from minimax_ops.config import preset
from minimax_ops.loader import load_model, save_checkpoint
from minimax_ops.model import MiniMaxM3ForCausalLM
from minimax_ops.sharding import pipeline_layers
from minimax_ops.weights import random_model_weights

CFG = preset("tiny_tp")  # 4 layers: stage 0 holds the 2 dense ones, stage 1 the 2 sparse MoE ones
NUM_BLOCKS = 32


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("pp") / "ckpt"
    weights = random_model_weights(CFG, generator=torch.Generator().manual_seed(4), linear_format="mxfp8",
                                   expert_format="mxfp4")
    save_checkpoint(weights, CFG, path)
    return path


def _steps(gen):
    prefill = build_step([0, 0], [21, 40], block_size=CFG.sparse_block_size, num_blocks=NUM_BLOCKS, generator=gen)
    decode = build_step([21, 40], 1, block_size=CFG.sparse_block_size, num_blocks=NUM_BLOCKS, pad_requests=1,
                        generator=gen, block_ids=request_block_ids(prefill, CFG.sparse_block_size))
    return [(torch.randint(0, CFG.vocab_size, (m.num_tokens,), generator=gen), m) for m in (prefill, decode)]


def _bits(caches):
    return [(c.kv.view(torch.uint8).clone(), None if c.index is None else c.index.view(torch.uint8).clone())
            for c in caches]


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_two_stages_equal_the_whole_model(checkpoint, compiled):
    gen = torch.Generator().manual_seed(5)
    whole = load_model(checkpoint)
    stages = [load_model(checkpoint, layers=pipeline_layers(CFG.num_hidden_layers, k, 2)) for k in range(2)]
    assert [s.layer_range for s in stages] == [range(0, 2), range(2, 4)]
    assert [s.is_first_stage for s in stages] == [True, False] and [s.is_last_stage for s in stages] == [False, True]
    caches = allocate_caches(CFG, NUM_BLOCKS, generator=gen)
    whole_caches, stage_caches = [c.clone() for c in caches], [c.clone() for c in caches]
    steps = _steps(gen)
    passes = [MiniMaxM3DecodePass(record=True) for _ in stages]
    run = stages
    if compiled:
        steps = steps[1:]  # the decode (a prefill graph is unfused and costs a compile per stage)
        run = [gt.compile_model(s, p) for s, p in zip(stages, passes)]
    with gt.uncached_compiles():
        for ids, meta in steps:
            want = whole(ids, meta.positions, whole_caches, meta)
            mid = run[0](ids, meta.positions, stage_caches[:2], meta)
            assert set(mid) == {"hidden_states", "residual"}
            assert all(t.shape == (meta.num_tokens, CFG.hidden_size) and t.dtype == torch.bfloat16
                       for t in mid.values())
            got = run[1](ids, meta.positions, stage_caches[2:], meta, intermediate=mid)
            assert torch.equal(got, want)
    for (kv, index), (want_kv, want_index) in zip(_bits(stage_caches), _bits(whole_caches), strict=True):
        assert torch.equal(kv, want_kv) and (index is None) == (want_index is None)
        assert index is None or torch.equal(index, want_index)
    if compiled:
        assert [p.rewrites for p in passes] == [2, 2], "each stage's two layers fused"
        assert [len(p.graphs) for p in passes] == [1, 1]


def test_stage_arguments_are_checked(checkpoint):
    stage = load_model(checkpoint, layers=range(2, 4))
    weights = random_model_weights(CFG, generator=torch.Generator().manual_seed(6))
    with pytest.raises(ValueError, match=r"layers: expected a contiguous range within 0..4, got range\(2, 6\)"):
        MiniMaxM3ForCausalLM(CFG, weights, layers=range(2, 6))
    with pytest.raises(ValueError, match=r"weights: expected 2 layers \(range\(0, 2\)\), got 4"):
        MiniMaxM3ForCausalLM(CFG, weights, layers=range(0, 2))
    ids, meta = _steps(torch.Generator().manual_seed(7))[1]
    with pytest.raises(ValueError, match=r"caches: expected one per held layer \(2\), got 4"):
        stage(ids, meta.positions, allocate_caches(CFG, NUM_BLOCKS), meta, intermediate={})
    with pytest.raises(ValueError, match=r"intermediate: a stage after the first needs the previous stage's"):
        stage(ids, meta.positions, allocate_caches(CFG, NUM_BLOCKS)[2:], meta)
