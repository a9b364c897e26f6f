"""The decode graph of the 2-layer tiny model (1 dense + 1 sparse MoE) before and after
MiniMaxM3DecodePass, as normalised expecttest snapshots, plus what the snapshots cannot say: each
layer is fused exactly once, the compiled step matches the reference (logits and cache bytes) for
q=1 and q=2, and the pass emits the same call in auto_functionalized v1 and v2 form.

Snapshots are tied to the torch version CI runs (2.13); refresh them with
``EXPECTTEST_ACCEPT=1 pytest tests/test_pass_snapshots.py`` and review the diff.
"""

from __future__ import annotations

import functools
import operator
from dataclasses import dataclass

import expecttest
import pytest
import torch
from torch.fx import Graph

import graph_text as gt
from graph_passes import MiniMaxM3DecodePass
from graph_passes.fx_utils import AF_V1, AF_V2, arg, insert_functional_call, is_op, mutated_output, op_of, outputs
from minimax_ops.model import MiniMaxM3ForCausalLM

mm = torch.ops.minimax
FUSED = ("minimax.fused_dense_decode_layer", "minimax.fused_decode_layer")
BF16_TOLERANCE = 1e-2  # relative Frobenius error of fp32 logits against the fp32 reference


@dataclass
class DecodeRun:
    graph_pass: MiniMaxM3DecodePass
    before: str
    after: str
    result: gt.StepResult


@functools.lru_cache(maxsize=None)
def decode_run(query_len: int, form: str = "v2") -> DecodeRun:
    """One compiled decode step of 2 requests (contexts 37 and 20 tokens) at query_len, with the
    mutating ops in auto_functionalized ``form``; shared by the tests below (compiles are slow)."""
    config, weights = gt.tiny2_weights()
    ids, meta, caches = gt.step_inputs(config, [37, 20], query_len, seed=10 + query_len)
    graph_pass = MiniMaxM3DecodePass(record=True)
    compiled = gt.compile_model(MiniMaxM3ForCausalLM(config, weights), graph_pass)
    with torch._inductor.config.patch(enable_auto_functionalized_v2=(form == "v2")):
        result = gt.run_against_reference(compiled, config, weights, ids, meta, caches)
    assert len(graph_pass.graphs) == 1, f"expected one compiled graph, got {len(graph_pass.graphs)}"
    before, after = graph_pass.graphs[0]
    return DecodeRun(graph_pass, before, after, result)


class TestDecodeGraphSnapshots(expecttest.TestCase):
    def test_q1_decode_graph_before_pass(self):
        self.assertExpectedInline(gt.normalize_graph(decode_run(1).before), """\
embedding = aten.embedding(in6, in0)
full = aten.full([2, 64], 0, dtype=torch.bfloat16, layout=torch.strided, device=<device>, pin_memory=False)
add_rmsnorm = minimax.add_rmsnorm(embedding, full, in7, 1e-06)
mx_linear = minimax.mx_linear(add_rmsnorm[0], in8, None)
qk_norm_rope_kv_insert = af_v2 minimax.qk_norm_rope_kv_insert(qkv=mx_linear, positions=in1, slot_mapping=in2,
    q_norm=in9, k_norm=in10, kv_cache=in15!, num_heads=8, num_kv_heads=2, head_dim=32, rotary_dim=16,
    rope_theta=5000000.0, eps=1e-06, k_scale=1.0, v_scale=1.0)
dense_attention_decode = minimax.dense_attention_decode(qk_norm_rope_kv_insert[0], qk_norm_rope_kv_insert[1],
    in4, in5, 1, 1.0, 1.0)
mx_linear_1 = minimax.mx_linear(dense_attention_decode, in11, None)
add_rmsnorm_1 = minimax.add_rmsnorm(mx_linear_1, add_rmsnorm[1], in12, 1e-06)
mlp = minimax.mlp(add_rmsnorm_1[0], in13, None, in14, None, 1.702, 7.0)
add_rmsnorm_2 = minimax.add_rmsnorm(mlp, add_rmsnorm_1[1], in16, 1e-06)
mx_linear_2 = minimax.mx_linear(add_rmsnorm_2[0], in17, None)
qk_norm_rope_kv_index_insert = af_v2 minimax.qk_norm_rope_kv_index_insert(qkv=mx_linear_2, positions=in1,
    slot_mapping=in2, index_slot_mapping=in3, q_norm=in18, k_norm=in19, index_q_norm=in20, index_k_norm=in21,
    kv_cache=in30!, index_cache=in31!, num_heads=8, num_kv_heads=2, head_dim=32, rotary_dim=16,
    rope_theta=5000000.0, eps=1e-06, index_heads=2, index_dim=32, k_scale=1.0, v_scale=1.0)
index_topk = minimax.index_topk(qk_norm_rope_kv_index_insert[1], qk_norm_rope_kv_index_insert[3], in4, in5, 1,
    4)
sparse_attention_decode = minimax.sparse_attention_decode(qk_norm_rope_kv_index_insert[0],
    qk_norm_rope_kv_index_insert[2], in4, in5, index_topk, 1, 1.0, 1.0)
mx_linear_3 = minimax.mx_linear(sparse_attention_decode, in22, None)
add_rmsnorm_3 = minimax.add_rmsnorm(mx_linear_3, add_rmsnorm_2[1], in23, 1e-06)
route = minimax.route(add_rmsnorm_3[0], in24, in25, 2, 2.0)
moe_experts = minimax.moe_experts(add_rmsnorm_3[0], route[1], route[0], in26, None, in27, None, in28, None,
    in29, None, 8, 1.702, 7.0)
add_rmsnorm_4 = minimax.add_rmsnorm(moe_experts, add_rmsnorm_3[1], in32, 1e-06)
mx_linear_4 = minimax.mx_linear(add_rmsnorm_4[0], in33, None)
convert_element_type = prims.convert_element_type(mx_linear_4, torch.float32)
copy_ = aten.copy_(in15, qk_norm_rope_kv_insert[1])
copy__1 = aten.copy_(in30, qk_norm_rope_kv_index_insert[2])
copy__2 = aten.copy_(in31, qk_norm_rope_kv_index_insert[3])
return (convert_element_type,)
""")

    def test_q1_decode_graph_after_pass(self):
        self.assertExpectedInline(gt.normalize_graph(decode_run(1).after), """\
embedding = aten.embedding(in6, in0)
full = aten.full([2, 64], 0, dtype=torch.bfloat16, layout=torch.strided, device=<device>, pin_memory=False)
fused_dense_decode_layer = af_v2 minimax.fused_dense_decode_layer(x=embedding, residual=full, positions=in1,
    slot_mapping=in2, block_table=in4, seq_lens=in5, kv_cache=in15!, input_norm=in7, qkv=in8, qkv_scale=None,
    q_norm=in9, k_norm=in10, o_proj=in11, o_proj_scale=None, post_norm=in12, w13=in13, w13_scale=None,
    w2=in14, w2_scale=None, query_len=1, num_heads=8, num_kv_heads=2, head_dim=32, rotary_dim=16,
    rope_theta=5000000.0, eps=1e-06, alpha=1.702, limit=7.0, k_scale=1.0, v_scale=1.0, layer_index=0,
    checked=False, group_name=)
fused_decode_layer = af_v2 minimax.fused_decode_layer(x=fused_dense_decode_layer[0],
    residual=fused_dense_decode_layer[1], positions=in1, slot_mapping=in2, index_slot_mapping=in3,
    block_table=in4, seq_lens=in5, kv_cache=in30!, index_cache=in31!, input_norm=in16, qkv=in17,
    qkv_scale=None, q_norm=in18, k_norm=in19, index_q_norm=in20, index_k_norm=in21, o_proj=in22,
    o_proj_scale=None, post_norm=in23, gate=in24, gate_bias=in25, w13=in26, w13_scale=None, w2=in27,
    w2_scale=None, shared_w13=in28, shared_w13_scale=None, shared_w2=in29, shared_w2_scale=None, query_len=1,
    num_heads=8, num_kv_heads=2, head_dim=32, rotary_dim=16, rope_theta=5000000.0, eps=1e-06, index_heads=2,
    index_dim=32, topk_blocks=4, top_k=2, routed_scaling=2.0, num_routed_experts=8, alpha=1.702, limit=7.0,
    k_scale=1.0, v_scale=1.0, layer_index=1, checked=False, group_name=)
add_rmsnorm = minimax.add_rmsnorm(fused_decode_layer[0], fused_decode_layer[1], in32, 1e-06)
mx_linear = minimax.mx_linear(add_rmsnorm[0], in33, None)
convert_element_type = prims.convert_element_type(mx_linear, torch.float32)
copy_ = aten.copy_(in15, fused_dense_decode_layer[2])
copy__1 = aten.copy_(in30, fused_decode_layer[2])
copy__2 = aten.copy_(in31, fused_decode_layer[3])
return (convert_element_type,)
""")

    def test_normalisation_of_names_symbols_and_paths(self):
        text = """graph():
    %arg0_1 : [num_users=2] = placeholder[target=arg0_1]
    %arg1_1 : [num_users=1] = placeholder[target=arg1_1]
    %arg2_1 : [num_users=0] = placeholder[target=arg2_1]
    # File: /work/main/minimax_ops/model.py:140 in forward, code: x = self.model.embed_tokens(input_ids)
    %sym_size_int_7 : [num_users=2] = call_function[target=torch.ops.aten.sym_size.int](args = (%arg1_1, 0), kwargs = {})
    %le_3 : [num_users=1] = call_function[target=operator.le](args = (%sym_size_int_7, 16), kwargs = {})
    %_assert_scalar_2 : [num_users=0] = call_function[target=torch.ops.aten._assert_scalar.default](args = (%le_3, "Runtime assertion failed for expression s77 <= 16 on node 'le_3' at /x/y.py:12"), kwargs = {})
    %full_default_4 : [num_users=1] = call_function[target=torch.ops.aten.full.default](args = ([%sym_size_int_7, 64], 0), kwargs = {dtype: torch.bfloat16, device: cuda:0})
    %add_rmsnorm_9 : [num_users=2] = call_function[target=torch.ops.minimax.add_rmsnorm.default](args = (%full_default_4, %full_default_4, %arg0_1, 1e-06), kwargs = {})
    %getitem_31 : [num_users=1] = call_function[target=operator.getitem](args = (%add_rmsnorm_9, 1), kwargs = {})
    %add_rmsnorm_10 : [num_users=2] = call_function[target=torch.ops.minimax.add_rmsnorm.default](args = (%getitem_31, %full_default_4, %arg0_1, 1e-06), kwargs = {})
    %getitem_40 : [num_users=1] = call_function[target=operator.getitem](args = (%add_rmsnorm_10, 0), kwargs = {})
    return (getitem_40,)"""
        renumbered = (text.replace("_9 ", "_1 ").replace("_9,", "_1,").replace("s77", "s3")
                      .replace("/work/main", "/ci/src").replace(":140", ":99"))
        self.assertEqual(gt.normalize_graph(renumbered), gt.normalize_graph(text))
        self.assertExpectedInline(gt.normalize_graph(text), """\
sym_size = aten.sym_size.int(in1, 0)
le = operator.le(sym_size, 16)
_assert_scalar = aten._assert_scalar(le,
    "Runtime assertion failed for expression s0 <= 16 on node 'le' at <path>")
full = aten.full([sym_size, 64], 0, dtype=torch.bfloat16, device=<device>)
add_rmsnorm = minimax.add_rmsnorm(full, full, in0, 1e-06)
add_rmsnorm_1 = minimax.add_rmsnorm(add_rmsnorm[1], full, in0, 1e-06)
return (add_rmsnorm_1[0],)
""")
        minimax_only = gt.normalize_graph(text, keep=lambda op: op.startswith("minimax."))
        self.assertExpectedInline(minimax_only, """\
add_rmsnorm = minimax.add_rmsnorm(full, full, in0, 1e-06)
add_rmsnorm_1 = minimax.add_rmsnorm(add_rmsnorm[1], full, in0, 1e-06)
return (add_rmsnorm_1[0],)
""")


def _minimax_ops(text: str) -> dict[str, int]:
    return {op: n for op, n in gt.op_counts(text).items() if op.startswith("minimax.")}


@pytest.mark.parametrize("query_len", [1, 2])
def test_pass_fuses_each_layer_once_and_matches_reference(query_len):
    run = decode_run(query_len)
    assert _minimax_ops(run.before) == {
        "minimax.add_rmsnorm": 5, "minimax.mx_linear": 5, "minimax.qk_norm_rope_kv_insert": 1,
        "minimax.dense_attention_decode": 1, "minimax.mlp": 1, "minimax.qk_norm_rope_kv_index_insert": 1,
        "minimax.index_topk": 1, "minimax.sparse_attention_decode": 1, "minimax.route": 1,
        "minimax.moe_experts": 1}
    # Only the final norm and the lm_head stay outside the fused layers.
    assert _minimax_ops(run.after) == {FUSED[0]: 1, FUSED[1]: 1, "minimax.add_rmsnorm": 1, "minimax.mx_linear": 1}
    assert run.graph_pass.rewrites == 2 and run.graph_pass.calls == 1
    fused = [n for n in gt.parse_graph(run.after) if n.op in FUSED]
    assert [n.kwargs["query_len"] for n in fused] == [str(query_len)] * 2
    # The sparse layer consumes the dense layer's (out, residual) directly.
    text = gt.normalize_graph(run.after, width=10**6)
    assert "minimax.fused_decode_layer(x=fused_dense_decode_layer[0], residual=fused_dense_decode_layer[1]," in text
    r = run.result
    assert r.fused_runs == {"dense": 1, "sparse": 1}, "the compiled step did not run the fused ops"
    assert gt.relative_error(r.out, r.ref) < BF16_TOLERANCE
    assert r.caches_match, "kv / index cache bytes differ from the reference's"


def test_pass_emits_the_same_call_in_v1_form():
    v1, v2 = decode_run(1, "v1"), decode_run(1, "v2")
    assert gt.functional_forms(v1.before) == {("minimax.qk_norm_rope_kv_insert", "v1"): 1,
                                              ("minimax.qk_norm_rope_kv_index_insert", "v1"): 1}
    assert gt.functional_forms(v1.after) == {(FUSED[0], "v1"): 1, (FUSED[1], "v1"): 1}
    assert gt.normalize_graph(v1.after) == gt.normalize_graph(v2.after).replace("af_v2", "af_v1")
    assert v1.graph_pass.rewrites == 2
    r = v1.result
    assert r.fused_runs == {"dense": 1, "sparse": 1}
    assert gt.relative_error(r.out, r.ref) < BF16_TOLERANCE and r.caches_match


# ---- fx_utils on hand-built nodes of both functional forms ---------------------------------------------


def _insert_graph(form):
    """A graph holding one qk_norm_rope_kv_index_insert call in the given form (v2 with the bases in
    reverse schema order, so index lookups are exercised) and its four getitems."""
    g = Graph()
    names = ("qkv", "positions", "slot_mapping", "index_slot_mapping", "q_norm", "k_norm", "index_q_norm",
             "index_k_norm", "kv_cache", "index_cache")
    ph = {n: g.placeholder(n) for n in names}
    kw = {n: ph[n] for n in names if n not in ("kv_cache", "index_cache")}
    kw.update(num_heads=8, num_kv_heads=2, head_dim=32, rotary_dim=16, rope_theta=5e6, eps=1e-6, index_heads=2,
              index_dim=32)
    op = mm.qk_norm_rope_kv_index_insert.default
    if form == "v1":
        call = g.call_function(AF_V1, (op,), {**kw, "kv_cache": ph["kv_cache"], "index_cache": ph["index_cache"]})
    else:
        call = g.call_function(AF_V2, (op,), {**kw, "_kv_cache_base_index": 1, "_index_cache_base_index": 0,
                                              "_all_bases": [ph["index_cache"], ph["kv_cache"]]})
    items = [g.call_function(operator.getitem, (call, i)) for i in range(4)]
    return g, ph, call, items


@pytest.mark.parametrize("form", ["v1", "v2"])
def test_fx_utils_read_both_functional_forms(form):
    g, ph, call, items = _insert_graph(form)
    assert op_of(call) is mm.qk_norm_rope_kv_index_insert.default and is_op(call, op_of(call))
    assert arg(call, "kv_cache") is ph["kv_cache"] and arg(call, "index_cache") is ph["index_cache"]
    assert arg(call, "positions") is ph["positions"] and arg(call, "index_dim") == 32
    assert outputs(call) == dict(enumerate(items))
    if form == "v1":  # outputs: 2 returns, then the mutated args in schema order
        assert mutated_output(call, "kv_cache") is items[2] and mutated_output(call, "index_cache") is items[3]
    else:  # outputs: 2 returns, then the new bases in _all_bases order
        assert mutated_output(call, "kv_cache") is items[3] and mutated_output(call, "index_cache") is items[2]
    with pytest.raises(KeyError, match="no argument 'bogus'"):
        arg(g.call_function(mm.mx_linear.default, (ph["qkv"], ph["q_norm"], None)), "bogus")


@pytest.mark.parametrize("form", ["v1", "v2"])
def test_insert_functional_call_follows_the_form_of_its_model(form):
    g, ph, call, _ = _insert_graph(form)
    op = mm.fused_decode_layer.default
    new, items = insert_functional_call(g, call, op, {"x": ph["qkv"], "query_len": 1},
                                        {"index_cache": ph["index_cache"], "kv_cache": ph["kv_cache"]}, 2)
    assert new.target is (AF_V1 if form == "v1" else AF_V2) and op_of(new) is op
    assert arg(new, "kv_cache") is ph["kv_cache"] and arg(new, "index_cache") is ph["index_cache"]
    assert arg(new, "x") is ph["qkv"] and arg(new, "query_len") == 1
    assert [i.args for i in items] == [(new, k) for k in range(4)]
    assert mutated_output(new, "kv_cache") is items[2] and mutated_output(new, "index_cache") is items[3]
    assert gt.functional_forms(str(g)) == {("minimax.qk_norm_rope_kv_index_insert", form): 1,
                                           ("minimax.fused_decode_layer", form): 1}
