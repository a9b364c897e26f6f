"""GPU tests (H200): kernels, the fused op and the compiled model against the reference, at tiny and
real sizes, eager and under CUDA-graph capture. Skipped cleanly without CUDA (CI)."""

from __future__ import annotations

import pytest
import torch

import minimax_ops  # noqa: F401
from minimax_ops.cache import allocate_caches, build_step, request_block_ids
from minimax_ops.config import preset
from minimax_ops.model import MiniMaxM3DecoderLayer, MiniMaxM3ForCausalLM
from minimax_ops.ops import fused as fused_ops
from minimax_ops.reference_model import layer_forward, model_forward
from minimax_ops.sharding import local_config
from minimax_ops.weights import model_to_kernel_layout, random_layer_weights, random_model_weights, to_kernel_layout
from graph_text import compile_model, uncached_compiles
from utils import rel_err

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

FP8 = torch.float8_e4m3fn
BF16 = torch.bfloat16


def rel(a, b):
    assert torch.isfinite(a.float()).all(), "non-finite output"
    return rel_err(a, b)


def same_bytes(a, b):
    return torch.equal(a.view(torch.uint8), b.view(torch.uint8))


def _real_small_layers():
    """The real per-layer dims (6144 hidden, 64/4 heads, 128 experts) over a 4-layer stack."""
    return preset("real").replace(num_hidden_layers=4, moe_layer_freq=(0, 0, 0, 1), sparse_attention_freq=(0, 0, 0, 1))


CASES = [  # (config name, layer, linear fmt, expert fmt, shared, kv dtype, index dtype, weight layout)
    ("tiny", 1, "bf16", "bf16", "separate", BF16, BF16, "canonical"),
    ("tiny", 1, "mxfp8", "mxfp4", "table", FP8, FP8, "tiled"),
    ("tiny", 0, "mxfp8", "mxfp8", "separate", FP8, FP8, "kernel"),
    ("real", 3, "mxfp8", "mxfp4", "separate", FP8, FP8, "kernel"),
    ("real", 3, "mxfp8", "mxfp4", "separate", FP8, FP8, "tiled"),
    ("real", 3, "mxfp8", "mxfp4", "table", FP8, FP8, "canonical"),
    ("real", 3, "mxfp8", "mxfp8", "table", FP8, BF16, "kernel"),
    ("real", 3, "bf16", "mxfp8", "separate", BF16, BF16, "tiled"),
    ("real", 0, "mxfp8", "mxfp8", "separate", BF16, BF16, "kernel"),
]
LAYOUTS = {"canonical": lambda w: w, "kernel": to_kernel_layout, "tiled": lambda w: to_kernel_layout(w, tiled=True)}


def _setup(name, layer_idx, lin, exp, shared, kv_dtype, index_dtype, layout, contexts, query_len, seed, pad_requests=1,
           tp=1, group_name=""):
    """w: canonical weights (the reference's); the layer holds them in ``layout`` (LAYOUTS). tp: one rank's
    shapes of that tensor-parallel degree, its all-reduces over ``group_name``."""
    cfg = local_config(preset("tiny") if name == "tiny" else _real_small_layers(), tp)
    g = torch.Generator().manual_seed(seed)
    w = random_layer_weights(cfg, layer_idx, linear_format=lin, expert_format=exp, shared=shared, generator=g,
                             device="cuda")
    bs = cfg.sparse_block_size
    blocks = sum(-(-(c + query_len) // bs) for c in contexts) + 4
    caches = allocate_caches(cfg, blocks, kv_dtype=kv_dtype, index_dtype=index_dtype, device="cuda", generator=g)
    meta = build_step(contexts, query_len, block_size=bs, num_blocks=blocks, pad_requests=pad_requests, device="cuda",
                      generator=g, table_width=blocks)
    n = meta.num_tokens
    x = torch.randn(n, cfg.hidden_size, generator=g).to(BF16).cuda()
    res = torch.randn(n, cfg.hidden_size, generator=g).to(BF16).cuda()
    layer = MiniMaxM3DecoderLayer(cfg, LAYOUTS[layout](w), layer_idx, group_name).cuda()
    return cfg, w, layer, caches[layer_idx], meta, x, res, blocks, g


@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(map(str, c[:5])) + f"-{c[5]}".replace("torch.", "")
                         + f"-{c[7]}")
@pytest.mark.parametrize("query_len", [1, 2])
def test_layer_matches_reference(case, query_len):
    """Unfused chain (stage kernels) and fused op on CUDA vs the fp32 reference; caches identical."""
    name = case[0]
    contexts = [37, 80, 5] if name == "tiny" else [4000, 33000, 700, 128 * 20 - query_len]
    cfg, w, layer, cache, meta, x, res, *_ = _setup(*case, contexts=contexts, query_len=query_len, seed=1)
    ref_cache, unfused_cache, fused_cache = cache.clone(), cache.clone(), cache.clone()
    want_out, want_res = layer_forward(x, res, w, ref_cache, meta, cfg)
    out_u, res_u = layer(x, res, meta.positions, unfused_cache, meta, True)
    out_f, res_f = layer.fused_forward(x, res, meta.positions, fused_cache, meta)
    torch.cuda.synchronize()
    real = meta.num_tokens - query_len  # the padding request's rows are excluded from numerics
    for out, r in ((out_u, res_u), (out_f, res_f)):
        assert rel(out[:real], want_out[:real]) < 2e-2
        assert rel(r[:real], want_res[:real]) < 1e-2
        assert torch.isfinite(out).all()
    for got in (unfused_cache, fused_cache):
        assert same_bytes(got.kv, ref_cache.kv) or rel(got.kv, ref_cache.kv) < 1e-2
        if got.index is not None:
            assert same_bytes(got.index, ref_cache.index) or rel(got.index, ref_cache.index) < 1e-2


def _fused_under_switch(monkeypatch, switch, layer, cache, meta, x, res):
    """(out, residual, caches written) of the fused layer with environment switch ``switch`` at "0", then "1"."""
    runs = []
    for value in ("0", "1"):
        monkeypatch.setenv(switch, value)
        written = cache.clone()
        runs.append((*layer.fused_forward(x, res, meta.positions, written, meta), written))
        torch.cuda.synchronize()
    return runs


def test_score_pass_reading_its_first_keys_after_the_wait_changes_nothing(monkeypatch):
    """The indexer's score pass reads its first block's keys before its PDL wait (default) or after it
    (MINIMAX_OPS_NO_SCORE_EARLY=1, read at every call): the fused layer's output, residual and caches are the
    same bytes either way (the same products, loaded at another time)."""
    *_, layer, cache, meta, x, res, _, _ = _setup("real", 3, "mxfp8", "mxfp4", "separate", FP8, FP8, "kernel",
                                                  contexts=[4000, 33000, 700], query_len=1, seed=5)
    (out0, res0, cache0), (out1, res1, cache1) = _fused_under_switch(monkeypatch, "MINIMAX_OPS_NO_SCORE_EARLY",
                                                                     layer, cache, meta, x, res)
    assert torch.isfinite(out0[:-1].float()).all()
    assert same_bytes(out0, out1) and same_bytes(res0, res1)
    assert same_bytes(cache0.kv, cache1.kv) and same_bytes(cache0.index, cache1.index)


@pytest.mark.parametrize("name,layer_idx", [("tiny", 1), ("real", 3), ("real", 0)])
def test_fused_op_capture_and_replay(name, layer_idx):
    """Capture the fused op once; write new steps into the same buffers; replay matches the reference."""
    fmt = ("mxfp8", "mxfp4") if name == "real" else ("bf16", "bf16")
    contexts = [300, 41] if name == "tiny" else [5000, 1500]
    cfg, w, layer, cache, meta, x, res, blocks, g = _setup(name, layer_idx, *fmt, "separate", FP8, FP8, "kernel",
                                                           contexts, 1, 2)
    static = dict(x=x.clone(), res=res.clone(), pos=meta.positions.clone(), slots=meta.slot_mapping.clone(),
                  islots=meta.index_slot_mapping.clone(), table=meta.block_table.clone(), seq=meta.seq_lens.clone())
    smeta = build_step(contexts, 1, block_size=cfg.sparse_block_size, num_blocks=blocks, pad_requests=1,
                       device="cuda", generator=g, table_width=blocks)
    for k, name_ in (("pos", "positions"), ("slots", "slot_mapping"), ("islots", "index_slot_mapping"),
                     ("table", "block_table"), ("seq", "seq_lens")):
        setattr(smeta, name_, static[k])
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        layer.fused_forward(static["x"], static["res"], static["pos"], cache.clone(), smeta)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    calls = dict(fused_ops.impl_calls)
    with torch.cuda.graph(graph):
        out, out_res = layer.fused_forward(static["x"], static["res"], static["pos"], cache, smeta)
    after_capture = dict(fused_ops.impl_calls)
    ids = request_block_ids(meta, cfg.sparse_block_size)
    ctx = list(contexts)
    for step in range(3):
        ctx = [c + 1 for c in ctx]
        new = build_step(ctx, 1, block_size=cfg.sparse_block_size, num_blocks=blocks, pad_requests=1, device="cuda",
                         block_ids=ids, generator=g, table_width=blocks)
        for k, t in (("pos", new.positions), ("slots", new.slot_mapping), ("islots", new.index_slot_mapping),
                     ("table", new.block_table), ("seq", new.seq_lens)):
            static[k].copy_(t)
        static["x"].copy_(torch.randn(x.shape, generator=g).to(BF16))
        static["res"].copy_(torch.randn(x.shape, generator=g).to(BF16))
        ref_cache = cache.clone()
        want, want_res = layer_forward(static["x"], static["res"], w, ref_cache, new, cfg)
        out.fill_(float("nan"))  # poison: every element must be written by the replay
        out_res.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        real = new.num_tokens - 1
        assert rel(out[:real], want[:real]) < 2e-2
        assert rel(out_res[:real], want_res[:real]) < 1e-2
        assert same_bytes(cache.kv, ref_cache.kv) or rel(cache.kv, ref_cache.kv) < 1e-2
        ids = request_block_ids(new, cfg.sparse_block_size)
    assert fused_ops.impl_calls == after_capture, "the op's Python ran during replay"
    assert sum(after_capture.values()) == sum(calls.values()) + 1


@pytest.mark.parametrize("name,layout", [("tiny", "canonical"), ("real2", "canonical"), ("real2", "kernel")])
def test_compiled_model_with_pass_full_cuda_graph(name, layout):
    """torch.compile + the pass, captured whole in a CUDA graph, replays decode steps that match the
    eager reference; the fused op is in the graph and its Python does not run per replay."""
    from graph_passes import MiniMaxM3DecodePass
    if name == "tiny":
        cfg, fmts = preset("tiny"), dict(linear_format="mxfp8", expert_format="mxfp4")
    else:  # 1 dense + 1 sparse MoE layer at the real dims, small vocabulary
        cfg = preset("real").replace(num_hidden_layers=2, moe_layer_freq=(0, 1), sparse_attention_freq=(0, 1),
                                     vocab_size=512)
        fmts = dict(linear_format="mxfp8", expert_format="mxfp4")
    g = torch.Generator().manual_seed(3)
    weights = random_model_weights(cfg, generator=g, device="cuda", **fmts)
    # The model holds its weights in `layout` (kernel: what a deployment loads); the reference reads the canonical ones.
    model = MiniMaxM3ForCausalLM(cfg, model_to_kernel_layout(weights) if layout == "kernel" else weights).cuda()
    bs = cfg.sparse_block_size
    prompts = [40, 23] if name == "tiny" else [300, 200]
    blocks = sum(-(-(p + 8) // bs) for p in prompts) + 4
    caches = allocate_caches(cfg, blocks, kv_dtype=FP8, index_dtype=FP8, device="cuda", generator=g)
    pre = build_step([0, 0], prompts, block_size=bs, num_blocks=blocks, device="cuda", generator=g)
    ids = torch.randint(0, cfg.vocab_size, (sum(prompts),), generator=g).cuda()
    model(ids, pre.positions, caches, pre)  # prefill through the eager model fills the caches
    block_ids = request_block_ids(pre, bs)
    ctx = list(prompts)
    meta = build_step(ctx, 1, block_size=bs, num_blocks=blocks, block_ids=block_ids, pad_requests=2, device="cuda",
                      generator=g, table_width=blocks)
    tokens = torch.randint(0, cfg.vocab_size, (meta.num_tokens,), generator=g).cuda()
    p = MiniMaxM3DecodePass(record=True)
    # Fresh Dynamo state and no compile caches: an earlier test's compiled model would be reused unseen
    # by the pass (no rewrite recorded).
    compiled = compile_model(model, p, dynamic=None)
    warm = [c.clone() for c in caches]
    with uncached_compiles():
        compiled(tokens, meta.positions, warm, meta)  # compile + warm up on scratch caches
    assert p.rewrites == cfg.num_hidden_layers
    assert "fused_decode_layer" in p.graphs[-1][1]
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        logits = compiled(tokens, meta.positions, caches, meta)
    calls = dict(fused_ops.impl_calls)
    for step in range(4):
        ref_caches = [c.clone() for c in caches]
        new = build_step(ctx, 1, block_size=bs, num_blocks=blocks, block_ids=block_ids, pad_requests=2,
                         device="cuda", generator=g, table_width=blocks)
        for field in ("positions", "slot_mapping", "index_slot_mapping", "block_table", "seq_lens"):
            getattr(meta, field).copy_(getattr(new, field))
        tokens.copy_(torch.randint(0, cfg.vocab_size, tokens.shape, generator=g))
        want = model_forward(tokens, weights, ref_caches, new, cfg)
        logits.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert rel(logits[:2], want[:2]) < 3e-2, f"step {step}"
        for a, b in zip(caches, ref_caches):
            assert same_bytes(a.kv, b.kv) or rel(a.kv, b.kv) < 1e-2
        block_ids = request_block_ids(new, bs)
        ctx = [c + 1 for c in ctx]
    assert fused_ops.impl_calls == calls, "the fused op's Python ran during replay"


@pytest.mark.parametrize("experts", ["mxfp4", "mxfp8"])
@pytest.mark.parametrize("switch", ["MINIMAX_OPS_ROUTE_IN_EXPERTS", "MINIMAX_OPS_DEFER_POST_NORM"])
def test_one_token_step_against_its_switch(switch, experts, monkeypatch):
    """The one-token fused layer's own paths, each the default, against its switch at 0: routed in the
    experts (the router writes logits, the expert kernels make the top-k; off: the router's top-k launch)
    and the post norm deferred into o_proj, the router and w13 (off: the norm kernel). Either way the fused
    layer matches the reference and the path switched off (within one bf16 rounding of the experts'
    input), writes the same residual and caches bit for bit, and its captured graph replays to the same
    bits."""
    cfg, w, layer, cache, meta, x, res, *_ = _setup("real", 3, "mxfp8", experts, "separate", FP8, FP8, "kernel",
                                                    contexts=[33000], query_len=1, seed=9, pad_requests=0)
    assert meta.num_tokens == 1
    want, want_res = layer_forward(x, res, w, cache.clone(), meta, cfg)
    (out0, res0, cache0), (out1, res1, cache1) = _fused_under_switch(monkeypatch, switch, layer, cache, meta, x, res)
    assert rel(out1, want) < 2e-2 and rel(res1, want_res) < 1e-2 and rel(out1, out0) < 1e-2
    assert same_bytes(res0, res1) and same_bytes(cache0.kv, cache1.kv) and same_bytes(cache0.index, cache1.index)
    graph = torch.cuda.CUDAGraph()
    layer.fused_forward(x, res, meta.positions, cache.clone(), meta)
    with torch.cuda.graph(graph):
        out, _ = layer.fused_forward(x, res, meta.positions, cache1, meta)
    graph.replay()
    first = out.clone()
    mismatches = 0
    for _ in range(100):
        graph.replay()
        mismatches += int(not torch.equal(out, first))
    torch.cuda.synchronize()
    assert mismatches == 0 and rel(first, want) < 2e-2


@pytest.mark.parametrize("experts", ["mxfp4", "mxfp8"])
def test_tensor_parallel_rank_keeps_its_sums_in_fp32(experts, one_rank_group, monkeypatch):
    """One rank of TP 4 at the real shapes (16 q heads, 1 kv head, expert intermediate 768), its all-reduces
    over a one-rank NCCL group: the fused layer, which keeps the first sum in fp32 for its post norm kernel
    (MINIMAX_OPS_FP32_SUMS=1, the default), matches the reference, gives the bits of minimax.all_reduce's bf16
    between the halves (=0), and a captured graph (the all-reduces in it) replays to the same bits."""
    cfg, w, layer, cache, meta, x, res, *_ = _setup("real", 3, "mxfp8", experts, "separate", FP8, FP8, "kernel",
                                                    contexts=[4000, 33000], query_len=1, seed=13, tp=4,
                                                    group_name=one_rank_group)
    assert (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.intermediate_size) == (16, 1, 768)
    want, want_res = layer_forward(x, res, w, cache.clone(), meta, cfg)
    (out0, res0, cache0), (out1, res1, cache1) = _fused_under_switch(monkeypatch, "MINIMAX_OPS_FP32_SUMS", layer,
                                                                     cache, meta, x, res)
    real = meta.num_tokens - 1
    assert rel(out1[:real], want[:real]) < 2e-2 and rel(res1[:real], want_res[:real]) < 1e-2
    assert same_bytes(out0, out1) and same_bytes(res0, res1)
    assert same_bytes(cache0.kv, cache1.kv) and same_bytes(cache0.index, cache1.index)
    written = cache.clone()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out, out_res = layer.fused_forward(x, res, meta.positions, written, meta)
    graph.replay()
    torch.cuda.synchronize()
    assert same_bytes(out, out1) and same_bytes(out_res, res1) and same_bytes(written.kv, cache1.kv)


def test_thousand_replays_are_bit_identical():
    """Determinism: 1000 replays of a captured real-size fused layer on the same inputs give the same
    bits (no float atomics, fixed reduction orders), and the caches it rewrites stay identical."""
    cfg, w, layer, cache, meta, x, res, blocks, g = _setup("real", 3, "mxfp8", "mxfp4", "separate", FP8, FP8, "kernel",
                                                           [9000, 300, 4096], 1, 7)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        layer.fused_forward(x, res, meta.positions, cache, meta)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out, out_res = layer.fused_forward(x, res, meta.positions, cache, meta)
    graph.replay()
    first, first_res, first_kv = out.clone(), out_res.clone(), cache.kv.clone()
    mismatches = 0
    for _ in range(1000):
        graph.replay()
        mismatches += int(not torch.equal(out, first)) + int(not torch.equal(out_res, first_res))
    torch.cuda.synchronize()
    assert mismatches == 0
    assert same_bytes(cache.kv, first_kv)
    want, _ = layer_forward(x, res, w, cache.clone(), meta, cfg)
    real = meta.num_tokens - 1
    assert rel(first[:real], want[:real]) < 2e-2


@pytest.mark.parametrize("expert_format", ["mxfp4", "mxfp8"])
def test_row_layout_kernels_reproducible(expert_format):
    """The row-layout expert and GEMV kernels (canonical tables, real size, 5 / 10 / 16 tokens): 60
    calls on the same inputs, with other allocations' memory rewritten between calls, give the same
    bits. (A wgmma A-register race once made some of these calls return other values or NaN.)"""
    cfg = _real_small_layers()
    w = random_layer_weights(cfg, 3, linear_format="mxfp8", expert_format=expert_format, shared="table",
                             generator=torch.Generator().manual_seed(3), device="cuda")
    mm = torch.ops.minimax
    churn = torch.empty(1 << 26, device="cuda")
    for n in (5, 10, 16):
        h = torch.randn(n, cfg.hidden_size, device="cuda").to(BF16)
        weights, ids = mm.route(h, w.gate, w.gate_bias, cfg.num_experts_per_tok, cfg.routed_scaling_factor)
        calls = {
            "moe_experts": lambda: mm.moe_experts(h, ids, weights, w.w13, w.w13_scale, w.w2, w.w2_scale, None, None,
                                                  None, None, cfg.num_local_experts, cfg.swiglu_alpha, cfg.swiglu_limit),
            "mx_linear": lambda: mm.mx_linear(h, w.qkv, w.qkv_scale)}
        for name, call in calls.items():
            first = call()
            differ = 0
            for i in range(60):
                churn.fill_(float("nan") if i % 2 else 3.0e38)
                differ += int(not torch.equal(call(), first))
            torch.cuda.synchronize()
            assert differ == 0, f"{name}, {n} tokens: {differ} of 60 calls differ"
            assert torch.isfinite(first.float()).all()
