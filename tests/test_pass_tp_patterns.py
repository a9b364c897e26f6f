"""The pass on tensor-parallel decode graphs, in one process: each layer's two minimax.all_reduce calls
(after o_proj, after the FFN) become part of the fused call, whose group_name they hand over; a layer
whose reduces are incomplete or name different groups is left unfused with the reason.

The graph is the post-grad graph of rank 0's shard of tiny_tp at TP 2, traced with a group name no
process group answers to: compiling needs only the name (the fake), so the graph is kept by a
recording pass and the call that would reduce is expected to fail.
"""

from __future__ import annotations

import copy

import pytest
import torch
from conftest import minimax_reasons

import graph_text as gt
from graph_passes import MiniMaxM3DecodePass
from graph_passes.fx_utils import arg, op_of
from minimax_ops.config import preset
from minimax_ops.loader import checkpoint_tensors, weights_from_tensors
from minimax_ops.model import MiniMaxM3ForCausalLM
from minimax_ops.sharding import local_config
from minimax_ops.weights import random_model_weights

CFG = preset("tiny_tp")
GROUP = "no-such-group"
FUSED = ("minimax.fused_dense_decode_layer", "minimax.fused_decode_layer")
mm = torch.ops.minimax


@pytest.fixture(scope="module")
def tp_graph():
    weights = random_model_weights(CFG, generator=torch.Generator().manual_seed(8))
    shard = weights_from_tensors(checkpoint_tensors(weights, CFG), CFG, tp_rank=0, tp_size=2)
    model = MiniMaxM3ForCausalLM(CFG, shard, tp_size=2, tp_group=GROUP)
    keeper = gt.GraphKeeper()
    compiled = gt.compile_model(model, keeper)
    ids, meta, _ = gt.step_inputs(CFG, [37, 20], 1, seed=9)
    caches = gt.step_inputs(local_config(CFG, 2), [37, 20], 1, seed=9)[2]
    with gt.uncached_compiles(), pytest.raises(Exception, match=GROUP):
        compiled(ids, meta.positions, caches, meta)  # compiles, then fails to reduce: no such group
    assert len(keeper.graphs) == 1
    return keeper.graphs[0]


def _reduces(graph):
    return [n for n in graph.nodes if op_of(n) is mm.all_reduce.default]


def test_both_reduces_of_every_layer_go_into_the_fused_call(tp_graph):
    graph = copy.deepcopy(tp_graph)
    assert len(_reduces(graph)) == 2 * CFG.num_hidden_layers
    p = MiniMaxM3DecodePass(record=True)
    p(graph)
    assert p.rewrites == CFG.num_hidden_layers and not _reduces(graph)
    fused_ops = (mm.fused_decode_layer.default, mm.fused_dense_decode_layer.default)
    calls = [n for n in graph.nodes if op_of(n) in fused_ops]
    assert len(calls) == CFG.num_hidden_layers and all(arg(n, "group_name") == GROUP for n in calls)
    counts = gt.op_counts(str(graph))
    assert (counts[FUSED[0]], counts[FUSED[1]]) == (2, 2)


def _refused(graph, caplog, fragment):
    p = MiniMaxM3DecodePass(record=True)
    p(graph)
    reasons = minimax_reasons(caplog)
    assert any(fragment in r for r in reasons), reasons
    return p.rewrites


def test_a_missing_reduce_leaves_the_layer_unfused(tp_graph, minimax_log):
    graph = copy.deepcopy(tp_graph)
    ffn_reduce = _reduces(graph)[1]  # layer 0's, after its MLP
    ffn_reduce.replace_all_uses_with(ffn_reduce.args[0])
    graph.erase_node(ffn_reduce)
    assert _refused(graph, minimax_log, "FFN output: out_fp32 does not match its all-reduce") == 3


def test_reduces_naming_two_groups_leave_the_layer_unfused(tp_graph, minimax_log):
    graph = copy.deepcopy(tp_graph)
    first = _reduces(graph)[0]
    first.args = (first.args[0], "another-group")
    assert _refused(graph, minimax_log, "the layer's two all-reduces name different groups") == 3
