"""The post-attention norm deferred into its neighbours (one-token steps routed in the expert kernels, TP 1):
o_proj's last program of each column group adds the residual and sums its columns' squares
(linear_mma.mma_linear_add_norm), the router makes the norm's h from those sums (router.router_logits'
deferred_norm) and w13 multiplies its products by the row's rstd (moe.routed_moe_experts' deferred_norm);
decode_layer's project_norm_routed_moe_experts runs the three instead of o_proj, the norm kernel, router
and experts. On CPU the kernels run under the Triton interpreter (the whole layer too, on mma-layout weights
of a small config), on CUDA through the PTX (test_gpu.py has the real-size layer).
"""

from __future__ import annotations

import pytest
import torch

from minimax_ops import reference as ref
from minimax_ops.cache import allocate_caches, build_step
from minimax_ops.config import preset
from minimax_ops.formats import quantize, to_mma_layout
from minimax_ops.kernels import decode_layer, mx_linear, norm, router, tiles
from minimax_ops.kernels.moe import routed_moe_experts
from minimax_ops.model import MiniMaxM3DecoderLayer
from minimax_ops.reference_model import layer_forward
from minimax_ops.weights import random_layer_weights, to_kernel_layout
from utils import mma_expert_tables, rel_err

E, K, SCALING, EPS = 8, 2, 2.0, 1e-6
SIZES = {"mxfp4": (256, 128), "mxfp8": (128, 64)}  # (hidden, inter); MXFP8 smaller: slow interpreted
ATTN = 128  # o_proj's input features


@pytest.fixture(autouse=True)
def defaults(monkeypatch):
    """The default path (no switch set), whatever the environment the tests run in."""
    for name in ("MINIMAX_OPS_ROUTE_IN_EXPERTS", "MINIMAX_OPS_DEFER_POST_NORM", "MINIMAX_OPS_NORM_LAUNCH_FIRST"):
        monkeypatch.delenv(name, raising=False)


def _o_proj(device, hidden, fmt="mxfp8"):
    """(canonical (weight, scale), mma-layout (weight, scale)) of a random o_proj [hidden, ATTN]."""
    w, s = quantize(torch.randn(hidden, ATTN) * 0.1, fmt)
    return (w.to(device), s.to(device)), tuple(t.to(device) for t in to_mma_layout(w, s))


def _rows(device, m, width, scale=1.0):
    return (torch.randn(m, width, device=device) * scale).bfloat16()


def _assert_rounded_alike(got, want_fp32):
    """got is want_fp32 rounded to bf16: bit for bit on CUDA; within one bf16 step under the interpreter,
    whose fp32 -> bf16 casts truncate."""
    if got.device.type == "cuda":
        assert torch.equal(got, want_fp32.bfloat16())
    else:
        assert torch.allclose(got.float(), want_fp32, rtol=2.0 ** -7, atol=0.0)


def _norm_weight(device, hidden):
    return (torch.randn(hidden, device=device) * 0.2).bfloat16()


@pytest.mark.parametrize("m", [1, 3])
def test_o_proj_leaves_the_norms_residual_scaled_rows_and_sums(device, m):
    """residual_out is add_rmsnorm's residual bit for bit (o_proj's own bf16 output added), the scaled rows
    are residual_out * (1 + w) in bf16 bit for bit, and the sums of squares add up to the rows'."""
    torch.manual_seed(m)
    hidden = 256
    _, (w, s) = _o_proj(device, hidden)
    x, residual, nw = _rows(device, m, ATTN), _rows(device, m, hidden), _norm_weight(device, hidden)
    res_out, scaled, sumsq = mx_linear.mx_linear_add_norm(x, w, s, residual, nw)
    o = mx_linear.mx_linear(x, w, s)
    h, want_res = norm.add_rmsnorm(o, residual, nw, EPS)
    assert torch.equal(res_out, want_res)
    _assert_rounded_alike(scaled, res_out.float() * (1.0 + nw.float()))
    assert sumsq.shape[0] == m and sumsq.shape[1] > 1  # (several column groups: a real reduction)
    assert rel_err(sumsq.sum(1), res_out.double().pow(2).sum(1)) < 1e-6
    # The norm's h from the sums: add_rmsnorm's within its bf16 rounding (truncation, interpreted).
    rstd = torch.rsqrt(sumsq.sum(1, keepdim=True) / hidden + EPS)
    assert rel_err(res_out.float() * rstd * (1.0 + nw.float()), h) < 8e-3


def test_the_router_makes_the_norms_h_from_the_sums(device):
    """Logits from residual_out and the sums are the fp32 products of the norm's h (add_rmsnorm's)."""
    torch.manual_seed(7)
    hidden = 256
    _, (w, s) = _o_proj(device, hidden)
    x, residual, nw = _rows(device, 2, ATTN), _rows(device, 2, hidden), _norm_weight(device, hidden)
    gate = torch.randn(E, hidden, device=device) * 0.05
    res_out, _, sumsq = mx_linear.mx_linear_add_norm(x, w, s, residual, nw)
    got = router.router_logits(res_out, gate, deferred_norm=(nw, sumsq, EPS))
    h, _ = norm.add_rmsnorm(mx_linear.mx_linear(x, w, s), residual, nw, EPS)
    assert rel_err(got, h.double() @ gate.double().T) < 1e-4
    with pytest.raises(ValueError, match="sumsq: expected contiguous fp32"):
        router.router_logits(res_out, gate, deferred_norm=(nw, sumsq[:1], EPS))


def _tables(device, fmt, shared, hidden, inter):
    return mma_expert_tables(device, fmt, shared, E, hidden, inter)


@pytest.mark.parametrize("fmt, shared, grid_split", [("mxfp4", "separate", False), ("mxfp4", "table", False),
                                                     ("mxfp8", "separate", False), ("mxfp4", "separate", True)])
def test_deferred_norm_experts_match_the_reference(fmt, shared, grid_split, device, monkeypatch, request):
    """o_proj with the deferred norm, then the router and experts taking it: the reference's output (the fp32
    norm, route and experts on o_proj's output) within the MX tolerance, and the same step fed add_rmsnorm's h
    within one bf16 rounding of the experts' input; replays are bit-identical. ``grid_split``: w13's K split
    made by the grid (tiles.WARP_SPLIT without it), so the rstd is applied where the last split sums the
    partials."""
    hidden, inter = SIZES[fmt]
    if grid_split:
        monkeypatch.setattr(tiles, "WARP_SPLIT", frozenset())
        tiles.mma_expert_tiles.cache_clear()
        request.addfinalizer(tiles.mma_expert_tiles.cache_clear)  # (before monkeypatch restores WARP_SPLIT)
        assert tiles.mma_expert_tiles(hidden, True, fp8=fmt == "mxfp8", one_token=True, routed=True).split > 1
    torch.manual_seed(13)
    canonical, mma = _tables(device, fmt, shared, hidden, inter)
    (cw, cs), (w, s) = _o_proj(device, hidden)
    x, residual, nw = _rows(device, 1, ATTN), _rows(device, 1, hidden), _norm_weight(device, hidden)
    gate, gate_bias = torch.randn(E, hidden, device=device) * 0.05, torch.randn(E, device=device) * 0.5
    o = ref.linear(x, cw, cs).bfloat16()
    res_ref = (o.float() + residual.float()).bfloat16()
    h_ref = ref.gemma_rmsnorm(res_ref.float(), nw.float(), EPS).bfloat16()
    weights, ids = ref.route(h_ref, gate, gate_bias, K, SCALING)
    want = ref.moe_experts(h_ref, ids, weights, *canonical, num_routed_experts=E)

    def step():
        res_out, scaled, sumsq = mx_linear.mx_linear_add_norm(x, w, s, residual, nw)
        return routed_moe_experts(scaled, gate, gate_bias, K, SCALING, *mma, num_routed_experts=E,
                                  deferred_norm=(res_out, nw, sumsq, EPS)), res_out

    out, res_out = step()
    assert out.shape == (1, hidden) and torch.isfinite(out).all()
    assert rel_err(res_out, res_ref) < 1e-2
    assert rel_err(out, want) < 1.5e-2
    h, _ = norm.add_rmsnorm(mx_linear.mx_linear(x, w, s), residual, nw, EPS)
    plain = routed_moe_experts(h, gate, gate_bias, K, SCALING, *mma, num_routed_experts=E)
    assert rel_err(out, plain) < 1e-2
    assert torch.equal(step()[0], out)


def test_the_ffn_step_defers_the_norm_where_it_routes_in_kernel(device, monkeypatch):
    """decode_layer's o_proj + norm + experts step launches no norm kernel on the deferred path and the
    three steps with MINIMAX_OPS_DEFER_POST_NORM=0; both give the same residual bit for bit and outputs
    within one bf16 rounding of the experts' input."""
    torch.manual_seed(17)
    hidden, inter = SIZES["mxfp4"]
    _, mma = _tables(device, "mxfp4", "separate", hidden, inter)
    _, (w, s) = _o_proj(device, hidden)
    x, residual, nw = _rows(device, 1, ATTN), _rows(device, 1, hidden), _norm_weight(device, hidden)
    gate, gate_bias = torch.randn(E, hidden, device=device) * 0.05, torch.randn(E, device=device) * 0.5
    step = decode_layer.kernel_stages().project_norm_routed_moe_experts
    args = (x, w, s, residual, nw, EPS, gate, gate_bias, K, SCALING, *mma, E, 1.702, 7.0)
    assert decode_layer.defers_post_norm(1, w, s, mma[0], mma[1], mma[4], mma[5])
    calls = []
    add_rmsnorm = norm.add_rmsnorm
    monkeypatch.setattr(norm, "add_rmsnorm", lambda *a, **k: calls.append(1) or add_rmsnorm(*a, **k))
    out, res = step(*args)
    assert calls == []
    monkeypatch.setenv("MINIMAX_OPS_DEFER_POST_NORM", "0")
    assert not decode_layer.defers_post_norm(1, w, s, mma[0], mma[1], mma[4], mma[5])
    out3, res3 = step(*args)
    assert calls == [1]
    assert torch.equal(res, res3)
    assert rel_err(out, out3) < 1e-2


def test_what_cannot_take_a_deferred_norm_is_refused(device):
    """Steps the deferred norm does not serve are not decode_layer's to defer, and the launches refuse them
    by name: canonical o_proj weights, more than one token in the experts, canonical expert tables."""
    torch.manual_seed(19)
    hidden, inter = SIZES["mxfp4"]
    canonical, mma = _tables(device, "mxfp4", "separate", hidden, inter)
    (cw, cs), (w, s) = _o_proj(device, hidden)
    assert not decode_layer.defers_post_norm(2, w, s, mma[0], mma[1], mma[4], mma[5])
    assert not decode_layer.defers_post_norm(1, cw, cs, mma[0], mma[1], mma[4], mma[5])
    assert not decode_layer.defers_post_norm(1, w, s, canonical[0], canonical[1], canonical[4], canonical[5])
    x, residual, nw = _rows(device, 2, ATTN), _rows(device, 2, hidden), _norm_weight(device, hidden)
    with pytest.raises(ValueError, match="weight: the deferred norm takes weights in an mma layout"):
        mx_linear.mx_linear_add_norm(x, cw, cs, residual, nw)
    with pytest.raises(ValueError, match="residual: expected 2 rows"):
        mx_linear.mx_linear_add_norm(x, w, s, residual[:1], nw)
    res_out, scaled, sumsq = mx_linear.mx_linear_add_norm(x, w, s, residual, nw)
    gate = torch.randn(E, hidden, device=device) * 0.05
    with pytest.raises(ValueError, match="route: .* only one-token steps"):
        routed_moe_experts(scaled, gate, None, K, SCALING, *mma, num_routed_experts=E,
                           deferred_norm=(res_out, nw, sumsq, EPS))


@pytest.mark.skipif(torch.cuda.is_available(), reason="interpreter-only (test_gpu.py runs the real-size layer)")
def test_fused_layer_defers_its_post_norm_under_the_interpreter(monkeypatch):
    """A one-token step of the whole fused sparse layer on mma-layout weights through the kernels (CPU,
    interpreted): the attention half hands o_proj to the FFN half, which runs it with the post norm deferred
    (no norm kernel after the input norm), and the layer matches the reference."""
    monkeypatch.setenv("MINIMAX_OPS_CPU_KERNELS", "1")
    cfg = preset("tiny").replace(hidden_size=128, intermediate_size=128, shared_intermediate_size=128)
    g = torch.Generator().manual_seed(23)
    w = random_layer_weights(cfg, 1, linear_format="mxfp8", expert_format="mxfp4", generator=g)
    cache = allocate_caches(cfg, 8, kv_dtype=torch.float8_e4m3fn, index_dtype=torch.float8_e4m3fn, generator=g)[1]
    meta = build_step([40], 1, block_size=cfg.sparse_block_size, num_blocks=8, pad_requests=0, generator=g)
    x = torch.randn(1, cfg.hidden_size, generator=g).bfloat16()
    res = torch.randn(1, cfg.hidden_size, generator=g).bfloat16()
    layer = MiniMaxM3DecoderLayer(cfg, to_kernel_layout(w, mma=True), 1)
    deferred, norms = [], []
    add_norm, add_rmsnorm = mx_linear.mx_linear_add_norm, norm.add_rmsnorm
    monkeypatch.setattr(mx_linear, "mx_linear_add_norm", lambda *a, **k: deferred.append(1) or add_norm(*a, **k))
    monkeypatch.setattr(norm, "add_rmsnorm",
                        lambda *a, **k: norms.append(k.get("launch_first")) or add_rmsnorm(*a, **k))
    want, want_res = layer_forward(x, res, w, cache.clone(), meta, cfg)
    out, out_res = layer.fused_forward(x, res, meta.positions, cache, meta)
    # (the one norm kernel is the input norm's, launching the qkv GEMV before its wait)
    assert deferred == [1] and norms == [True], "o_proj did not take the post norm (or a norm kernel ran for it)"
    assert torch.isfinite(out).all()
    assert rel_err(out, want) < 3e-2 and rel_err(out_res, want_res) < 1e-2
