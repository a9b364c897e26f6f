"""Steps and deployments the fused decode must not serve: the graph stays as it was, no fused op
appears, the compiled step still matches the reference, and the reason is logged once through
logging.getLogger("minimax_ops"). Also the pass's contract with Inductor / vLLM (uuid, pickling,
compile ranges) and its step guards on FakeTensor metadata.
"""

from __future__ import annotations

import copy
import pickle
from types import SimpleNamespace

import pytest
from conftest import minimax_reasons
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import graph_text as gt
from graph_passes import Deployment, MiniMaxM3DecodePass, deployment_refusal
from graph_passes.decode_layer_patterns import PATTERNS
from graph_passes.fx_utils import arg, op_of
from graph_passes.guards import step_refusal
from minimax_ops.config import preset
from minimax_ops.constants import MAX_CONTEXT, MAX_TOKENS
from minimax_ops.model import MiniMaxM3ForCausalLM

FUSED = ("minimax.fused_dense_decode_layer", "minimax.fused_decode_layer")
DECODE_ATTENTION = ("minimax.dense_attention_decode", "minimax.sparse_attention_decode", "minimax.index_topk")
BF16_TOLERANCE = 1e-2
CONTEXTS_17 = [3, 17, 40, 9, 31, 16, 5, 22, 48, 1, 12, 33, 27, 8, 45, 15, 30]


@pytest.fixture(autouse=True)
def fresh_log(minimax_log):
    return minimax_log


_reasons = minimax_reasons


def _run(graph_pass, context_lens, query_lens, *, seed, dynamic=False, **step):
    config, weights = gt.tiny2_weights()
    compiled = gt.compile_model(MiniMaxM3ForCausalLM(config, weights), graph_pass, dynamic=dynamic)
    ids, meta, caches = gt.step_inputs(config, context_lens, query_lens, seed=seed, **step)
    return compiled, gt.run_against_reference(compiled, config, weights, ids, meta, caches)


def _assert_untouched(graph_pass, result, *, calls=1):
    """Every recorded graph is unchanged and unfused, and the step matched the reference without
    running a fused op."""
    assert graph_pass.calls == calls == len(graph_pass.graphs)
    assert graph_pass.rewrites == 0
    for before, after in graph_pass.graphs:
        assert after == before
        assert not set(FUSED) & set(gt.op_counts(after))
    assert result.fused_runs == {"dense": 0, "sparse": 0}
    assert gt.relative_error(result.out, result.ref) < BF16_TOLERANCE
    assert result.caches_match, "kv / index cache bytes differ from the reference's"


def _assert_general_path(graph_pass):
    """The model took its any-step attention: no decode attention op was traced at all."""
    for before, _ in graph_pass.graphs:
        ops = gt.op_counts(before)
        assert ops["minimax.attention_any_step"] == 2
        assert not set(DECODE_ATTENTION) & set(ops)


def _assert_logged_once(caplog, *fragments) -> list[str]:
    reasons = _reasons(caplog)
    assert len(reasons) == len(set(reasons)), f"a reason was logged twice: {reasons}"
    for fragment in fragments:
        assert sum(fragment in r for r in reasons) == 1, f"{fragment!r} not logged exactly once in {reasons}"
    return reasons


# ---- steps the model sends down its general path ---------------------------------------------------------


def test_prefill_step_is_not_fused(caplog):
    p = MiniMaxM3DecodePass(record=True)
    _, result = _run(p, [0, 0, 21], [7, 4, 3], seed=1)  # two prefills and a 3-token extend
    _assert_untouched(p, result)
    _assert_general_path(p)
    # The cache inserts are still there, so the pass looked at each layer and said why it stopped.
    reasons = _assert_logged_once(caplog, "minimax.dense_attention_decode", "minimax.index_topk")
    assert all(r.startswith("decode layer left unfused:") for r in reasons)


def test_17_token_decode_step_is_not_fused(caplog):
    p = MiniMaxM3DecodePass(record=True)
    _, result = _run(p, CONTEXTS_17, 1, seed=2)
    _assert_untouched(p, result)
    _assert_general_path(p)
    _assert_logged_once(caplog, "minimax.dense_attention_decode", "minimax.index_topk")


def test_int32_positions_step_is_not_fused(caplog):
    p = MiniMaxM3DecodePass(record=True)
    config, weights = gt.tiny2_weights()
    compiled = gt.compile_model(MiniMaxM3ForCausalLM(config, weights), p)
    ids, meta, caches = gt.step_inputs(config, [37, 20], 1, seed=3)
    result = gt.run_against_reference(compiled, config, weights, ids, meta, caches,
                                      positions=meta.positions.to(torch.int32))
    _assert_untouched(p, result)
    _assert_general_path(p)


@pytest.fixture(scope="module")
def decode_graph():
    """The post-grad graph of a q=1 decode step of the tiny model, before any pass."""
    keeper = gt.GraphKeeper()
    _run(keeper, [37, 20], 1, seed=4)
    assert len(keeper.graphs) == 1
    return keeper.graphs[0]


def test_pass_guard_refuses_int32_positions_in_a_decode_graph(decode_graph, caplog):
    """A decode graph that reached the pass without the model's Dynamo guards (as under vLLM) but
    with int32 positions is left alone."""
    graph = copy.deepcopy(decode_graph)
    inserts = [n for n in graph.nodes if op_of(n) in {p.insert_op for p in PATTERNS}]
    assert len(inserts) == 2
    positions = arg(inserts[0], "positions")
    assert positions is arg(inserts[1], "positions") and positions.op == "placeholder"
    positions.meta["val"] = positions.meta["val"].to(torch.int32)
    before = str(graph)
    p = MiniMaxM3DecodePass(record=True)
    p(graph)
    assert p.rewrites == 0 and str(graph) == before and p.graphs == [(before, before)]
    assert _assert_logged_once(caplog, "positions is torch.int32") == [
        "decode layer left unfused: positions is torch.int32, the fused decode needs torch.int64"]
    # The same graph with int64 positions is fused: the refusal above is the dtype's doing.
    control = copy.deepcopy(decode_graph)
    MiniMaxM3DecodePass()(control)
    assert gt.op_counts(str(control))[FUSED[0]] == 1 and gt.op_counts(str(control))[FUSED[1]] == 1


# ---- deployments the fused decode does not serve --------------------------------------------------------


def test_bf16_kv_under_an_fp8_only_deployment_is_not_fused(caplog):
    config, _ = gt.tiny2_weights()
    p = MiniMaxM3DecodePass(Deployment(kv_cache_dtype="fp8", model_config=config), record=True)
    _, result = _run(p, [37, 20], 1, seed=5)
    _assert_untouched(p, result)
    # Both layers are refused for the same reason: one record.
    assert _assert_logged_once(caplog, "kv_cache holds torch.bfloat16") == [
        "decode layer left unfused: kv_cache holds torch.bfloat16 but the deployment's kv cache dtype is "
        "torch.float8_e4m3fn"]


def test_fp8_kv_under_an_fp8_deployment_is_fused(caplog):
    """Control for the refusal above: the same deployment with fp8 caches fuses both layers."""
    config, _ = gt.tiny2_weights()
    p = MiniMaxM3DecodePass(Deployment(kv_cache_dtype="fp8", model_config=config), record=True)
    _, result = _run(p, [37, 20], 1, seed=5, kv_dtype=torch.float8_e4m3fn)
    assert p.rewrites == 2 and result.fused_runs == {"dense": 1, "sparse": 1}
    assert gt.relative_error(result.out, result.ref) < BF16_TOLERANCE and result.caches_match
    assert _reasons(caplog) == []


def test_unsplittable_tensor_parallelism_is_logged_once_over_two_compiles(caplog):
    """tiny2 has 8 heads and 2 kv heads: TP 3 splits neither."""
    p = MiniMaxM3DecodePass(Deployment(tensor_parallel_size=3, model_config=gt.tiny2_weights()[0]), record=True)
    compiled, first = _run(p, [37, 20], 1, seed=6)
    config, weights = gt.tiny2_weights()
    ids, meta, caches = gt.step_inputs(config, [37, 20], 2, seed=7)  # new shapes: a second compile
    second = gt.run_against_reference(compiled, config, weights, ids, meta, caches)
    for result in (first, second):
        _assert_untouched(p, result, calls=2)
    assert _assert_logged_once(caplog, "tensor_parallel_size=3") == [
        "fused decode refused for this deployment: the model does not split for tensor parallelism: "
        "tensor_parallel_size=3: num_attention_heads=8 does not split evenly"]


@pytest.mark.parametrize("deployment,fragment", [
    (Deployment(piecewise_cudagraphs=True), "piecewise CUDA graphs"),
    (Deployment(max_model_len=MAX_CONTEXT + 1), f"max_model_len={MAX_CONTEXT + 1} exceeds"),
], ids=["piecewise_cudagraphs", "max_model_len"])
def test_refused_deployment_leaves_the_graph_alone(deployment, fragment, caplog):
    p = MiniMaxM3DecodePass(deployment, record=True)
    _, result = _run(p, [37, 20], 1, seed=8)
    _assert_untouched(p, result)
    (reason,) = _assert_logged_once(caplog, fragment)
    assert reason.startswith("fused decode refused for this deployment:")


@pytest.mark.parametrize("changes,refused", [
    ({}, False), ({"max_model_len": MAX_CONTEXT}, False), ({"kv_cache_dtype": "fp8_e4m3"}, False),
    ({"tensor_parallel_size": 2}, False), ({"tensor_parallel_size": 8}, False), ({"data_parallel_size": 2}, False),
    ({"pipeline_parallel_size": 2}, False), ({"tensor_parallel_size": 4, "model_config": preset("tiny_tp")}, False),
    ({"tensor_parallel_size": 16, "model_config": preset("tiny")}, True),  # 8 heads do not split 16 ways
    ({"tensor_parallel_size": 4, "model_config": preset("tiny")}, True),  # expert intermediate 32 / 4: not MX blocks
    ({"enable_expert_parallel": True}, True), ({"kv_cache_dtype": "fp8_e5m2"}, True),
    ({"index_cache_dtype": "int8"}, True), ({"splitting_ops": ("torch.ops.minimax.sparse_attention_decode",)}, True),
    ({"splitting_ops": ("vllm::unified_attention",)}, False),
])
def test_deployment_refusal(changes, refused):
    reason = deployment_refusal(Deployment(**changes))
    assert (reason is not None) == refused, reason


# ---- recompiles under the model's Dynamo guards --------------------------------------------------------


def test_guard_failures_recompile_unfused_and_keep_the_fused_graph():
    """One compiled model: a 4-token decode (fused), then a 17-token step and a prefill (each a
    guard failure: recompiled, unfused), then the 4-token shape again (no recompile, fused)."""
    config, weights = gt.tiny2_weights()
    p = MiniMaxM3DecodePass(record=True)
    compiled = gt.compile_model(MiniMaxM3ForCausalLM(config, weights), p, dynamic=None)  # torch.compile's default
    steps = [([30, 5, 9, 70], 1, True), (CONTEXTS_17, 1, False), ([0, 12], [6, 3], False), ([75, 3, 40, 11], 1, True)]
    calls = []
    for i, (contexts, query_lens, fused) in enumerate(steps):
        ids, meta, caches = gt.step_inputs(config, contexts, query_lens, seed=20 + i)
        result = gt.run_against_reference(compiled, config, weights, ids, meta, caches)
        assert gt.relative_error(result.out, result.ref) < BF16_TOLERANCE and result.caches_match, f"step {i}"
        assert result.fused_runs == ({"dense": 1, "sparse": 1} if fused else {"dense": 0, "sparse": 0}), f"step {i}"
        calls.append(p.calls)
    assert calls == [1, 2, 3, 3], "each guard failure compiles once; the decode shape reuses its graph"
    assert p.rewrites == 2
    (first_before, first_after), *rest = p.graphs
    assert {op: gt.op_counts(first_after)[op] for op in FUSED} == {FUSED[0]: 1, FUSED[1]: 1}
    for before, after in rest:
        assert after == before and not set(FUSED) & set(gt.op_counts(after))


def test_a_second_query_len_is_still_fused():
    config, weights = gt.tiny2_weights()
    p = MiniMaxM3DecodePass(record=True)
    compiled = gt.compile_model(MiniMaxM3ForCausalLM(config, weights), p, dynamic=None)
    for i, query_len in enumerate((1, 2)):
        ids, meta, caches = gt.step_inputs(config, [37, 20], query_len, seed=30 + i)
        result = gt.run_against_reference(compiled, config, weights, ids, meta, caches)
        assert gt.relative_error(result.out, result.ref) < BF16_TOLERANCE and result.caches_match
        assert result.fused_runs == {"dense": 1, "sparse": 1}, f"query_len={query_len} ran unfused"


# ---- the pass's contract with Inductor / vLLM ------------------------------------------------------------


def test_uuid_is_stable_and_follows_the_deployment():
    default = MiniMaxM3DecodePass().uuid()
    assert default == MiniMaxM3DecodePass().uuid() == MiniMaxM3DecodePass(Deployment()).uuid()
    assert default == MiniMaxM3DecodePass(record=True).uuid()  # recording is not configuration
    others = {MiniMaxM3DecodePass(Deployment(**c)).uuid() for c in (
        {"tensor_parallel_size": 4}, {"kv_cache_dtype": "fp8"}, {"max_model_len": 4096},
        {"model_config": gt.tiny2_weights()[0]})}
    assert len(others) == 4 and default not in others
    assert MiniMaxM3DecodePass(Deployment(kv_cache_dtype="fp8")).uuid() == \
        MiniMaxM3DecodePass(Deployment(kv_cache_dtype="fp8")).uuid()


def test_pass_pickles_without_its_recorded_graphs():
    p = MiniMaxM3DecodePass(Deployment(tensor_parallel_size=1, max_model_len=8192), record=True)
    p.graphs.append(("graph before", "graph after"))
    p.rewrites, p.calls = 3, 2
    q = pickle.loads(pickle.dumps(p))
    assert q.graphs == [] and p.graphs == [("graph before", "graph after")]
    assert q.deployment == p.deployment and q.record and (q.rewrites, q.calls) == (3, 2)
    assert q.uuid() == p.uuid()


def test_applicable_only_to_compile_ranges_within_max_tokens():
    p = MiniMaxM3DecodePass()
    for start, end in ((1, 1), (1, 8), (4, MAX_TOKENS)):
        assert p.is_applicable_for_range(SimpleNamespace(start=start, end=end))
    for start, end in ((1, MAX_TOKENS + 1), (17, 512), (1, 8192)):
        assert not p.is_applicable_for_range(SimpleNamespace(start=start, end=end))


# ---- step guards on FakeTensor metadata -----------------------------------------------------------------


def _fake_step(mode, *, tokens=4, query_len=1, table_dtype=torch.int32, positions_dtype=torch.int64,
               kv_dtype=torch.bfloat16, block=16, transpose_table=False):
    """The keyword arguments step_refusal reads, as FakeTensors of a sparse layer."""
    with mode:
        requests = tokens // query_len
        table = torch.empty(8, requests, dtype=table_dtype).t() if transpose_table \
            else torch.empty(requests, 8, dtype=table_dtype)
        return dict(x=torch.empty(tokens, 64, dtype=torch.bfloat16), query_len=query_len,
                    positions=torch.empty(tokens, dtype=positions_dtype),
                    slot_mapping=torch.empty(tokens, dtype=torch.int64),
                    index_slot_mapping=torch.empty(tokens, dtype=torch.int64), block_table=table,
                    seq_lens=torch.empty(requests, dtype=torch.int32),
                    kv_cache=torch.empty(64, 2, block, 64, dtype=kv_dtype),
                    index_cache=torch.empty(64, block, 32, dtype=torch.bfloat16))


@pytest.mark.parametrize("step,deployment,fragment", [
    ({"positions_dtype": torch.int32}, {}, "positions is torch.int32"),
    ({"tokens": 17}, {}, "step of 17 tokens"),
    ({"tokens": 5, "query_len": 2}, {}, "not known to be a multiple of query_len=2"),
    ({"table_dtype": torch.int64}, {}, "block_table is torch.int64"),
    ({"transpose_table": True}, {}, "block_table is not row-contiguous"),
    ({}, {"kv_cache_dtype": "fp8"}, "kv_cache holds torch.bfloat16"),
    ({"block": 32}, {"block_size": 16}, "kv cache block size 32"),
    ({"kv_dtype": torch.float16}, {}, "kv_cache dtype torch.float16 is not supported"),
])
def test_step_guard_refusals(step, deployment, fragment):
    mode = FakeTensorMode()
    assert step_refusal(_fake_step(mode), Deployment()) is None
    reason = step_refusal(_fake_step(mode, **step), Deployment(**deployment))
    assert reason is not None and fragment in reason, reason


def test_step_guard_refuses_a_symbolic_query_len():
    kw = _fake_step(FakeTensorMode())
    kw["query_len"] = SimpleNamespace(name="s0")  # anything that is not a compile-time int
    assert "query_len is not a compile-time constant" in step_refusal(kw, Deployment())
