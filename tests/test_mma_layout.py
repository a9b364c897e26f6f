"""The ``mxfp4_mma`` expert layout (formats.py) and its expert kernels (kernels/moe_mma.py).

On CPU the kernels run under the Triton interpreter through the portable emulation of the
inline-PTX block product; on CUDA through the PTX itself. Both are checked against the fp32
reference at sizes the layout fits (K a multiple of 128).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from minimax_ops import reference as ref
from minimax_ops.config import SPARSE_MOE
from minimax_ops.formats import (MMA_SCALE_BIAS, dequantize, logical_in_features, logical_out_features,
                                 pack_mxfp4_words, quantize, to_canonical, to_mma_layout, unpack_e2m1, weight_layout)
from minimax_ops.kernels.moe import moe_experts
from minimax_ops.kernels.tiles import mma_expert_tiles
from minimax_ops.weights import to_kernel_layout

H, I, E, K = 256, 128, 8, 2


def rel_err(got, want) -> float:
    return ((got.float() - want.float()).norm() / want.float().norm()).item()


def _mx4(*shape, scale=0.5):
    return quantize(torch.randn(*shape) * scale, "mxfp4")


# ---- the layout --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("lead", [(), (3,)])
def test_round_trip_and_logical_shape(lead):
    torch.manual_seed(0)
    w, s = _mx4(*lead, 48, 192)
    mw, ms = to_mma_layout(w, s)
    rank = len(lead) + 2
    assert mw.dtype == torch.int32 and mw.shape == (*lead, 3, 3, 128) and ms.shape == (*lead, 3, 3, 32)
    assert weight_layout(mw, ms, rank).name == "mxfp4_mma"
    assert logical_in_features(mw, rank) == 192 and logical_out_features(mw, rank) == 48
    back = to_canonical(mw, ms, rank)
    assert torch.equal(back[0], w) and torch.equal(back[1], s)
    assert torch.equal(dequantize(mw, ms, rank), dequantize(w, s))


def test_value_positions_follow_the_documented_map():
    """Value (row 16b + 8h + g, K 64kb + 32q + 8c + 4jj + 2t + u) sits in word 4(4g + c) + 2q + jj of
    block (b, kb), value 4t + 2h + u of that word; its scale at byte 4g + 2h + q (+ the bias)."""
    torch.manual_seed(1)
    w, s = _mx4(32, 128)
    mw, ms = to_mma_layout(w, s)
    codes = unpack_e2m1(w)  # [32, 128] values before scaling
    stored = unpack_e2m1(pack_words_inverse(mw))  # [2, 2, 1024]: word-major values of each block
    for row in range(32):
        b, h, g = row // 16, (row % 16) // 8, row % 8
        for k in range(128):
            kb, q, c, jj, t, u = k // 64, (k % 64) // 32, (k % 32) // 8, (k % 8) // 4, (k % 4) // 2, k % 2
            word, value = 4 * (4 * g + c) + 2 * q + jj, 4 * t + 2 * h + u
            assert stored[b, kb, 8 * word + value] == codes[row, k], (row, k)
            assert ms[b, kb, 4 * g + 2 * h + q] == s[row, k // 32] + MMA_SCALE_BIAS


def pack_words_inverse(mw):
    """mxfp4_mma words -> the canonical bytes of their values in storage order."""
    from minimax_ops.formats import unpack_mxfp4_words
    return unpack_mxfp4_words(mw)


def test_layout_refusals_name_the_problem():
    w, s = _mx4(32, 128)
    with pytest.raises(ValueError, match="scales up to 128"):
        to_mma_layout(w, torch.full_like(s, 129))
    with pytest.raises(ValueError, match="N % 16 == 0 and K % 64 == 0"):
        to_mma_layout(*_mx4(24, 128))
    with pytest.raises(ValueError, match="canonical MXFP4"):
        to_mma_layout(pack_mxfp4_words(w), s)
    mw, ms = to_mma_layout(w, s)
    with pytest.raises(ValueError, match="mxfp4_mma scales of shape"):
        weight_layout(mw, ms[..., :16], 2)


# ---- the expert kernels ----------------------------------------------------------------------------------


def _routing(n, device):
    ids = torch.stack([torch.randperm(E)[:K] for _ in range(n)]).int()
    return ids.to(device), (torch.rand(n, K) + 0.1).to(device)


def _tables(device, experts=E, shared=True, inter_shared=I):
    tabs = [_mx4(experts, 2 * I, H), _mx4(experts, H, I)]
    if shared:
        tabs += [_mx4(2 * inter_shared, H), _mx4(H, inter_shared)]
    canonical = [t.to(device) for pair in tabs for t in pair]
    mma = [t.to(device) for pair in tabs for t in to_mma_layout(*pair)]
    return canonical, mma


@pytest.mark.parametrize("n, shared", [(1, "separate"), (3, "table"), (9, "separate"), (4, "none"), (2, "other")])
def test_moe_experts_match_reference(n, shared, device):
    """One token, a table holding the shared expert, two token groups of 8, no shared expert, and a
    shared expert in another layout (words: its own launches next to the mma ones)."""
    torch.manual_seed(n)
    h = torch.randn(n, H, device=device).bfloat16()
    ids, weights = _routing(n, device)
    canonical, mma = _tables(device, E + (shared == "table"), shared in ("separate", "other"))
    if shared == "other":
        mma[4:] = [pack_mxfp4_words(canonical[4]), canonical[5], pack_mxfp4_words(canonical[6]), canonical[7]]
    want = ref.moe_experts(h, ids, weights, *canonical, num_routed_experts=E)
    out = moe_experts(h, ids, weights, *mma, num_routed_experts=E)
    assert out.shape == (n, H) and torch.isfinite(out).all()
    assert rel_err(out, want) < 1.5e-2
    assert torch.equal(out, moe_experts(h, ids, weights, *mma, num_routed_experts=E))


def test_moe_splits_depths_and_padding_rows(device):
    """H split of w13 (partials summed by the last split), I split of w2, load depths, a shared
    expert of another size merged into the routed launches; zero-weight padding rows."""
    torch.manual_seed(7)
    n = 5
    h = torch.randn(n, H, device=device).bfloat16()
    h[3] = 0
    ids, weights = _routing(n, device)
    weights[3:] = 0
    canonical, mma = _tables(device, inter_shared=2 * I)
    want = ref.moe_experts(h, ids, weights, *canonical, num_routed_experts=E)
    base13, base2 = mma_expert_tiles(H, True), mma_expert_tiles(I, False)
    for s13, d13, s2, d2 in ((1, 1, 1, 1), (2, 1, 2, 1), (4, 1, 1, 2), (1, 2, 2, 1)):
        t13 = dataclasses.replace(base13, split=s13, k_chunks=d13, num_warps=2)
        t2 = dataclasses.replace(base2, split=s2, k_chunks=d2, num_warps=1)
        out = moe_experts(h, ids, weights, *mma, num_routed_experts=E, tiles=(t13, t2))
        assert rel_err(out, want) < 1.5e-2, (t13, t2)
        assert (out[3] == 0).all() and torch.isfinite(out).all()


def test_moe_refuses_mixed_or_misaligned_tables(device):
    canonical, mma = _tables(device, shared=False)
    h = torch.randn(2, H, device=device).bfloat16()
    ids, weights = _routing(2, device)
    with pytest.raises(ValueError, match="both or neither in the mxfp4_mma layout"):
        moe_experts(h, ids, weights, mma[0], mma[1], pack_mxfp4_words(canonical[2]), canonical[3],
                    num_routed_experts=E)
    w2, s2 = to_mma_layout(*_mx4(E, H, 64))  # K = 64: the row-block stride is not a multiple of 16
    w13, s13 = to_mma_layout(*_mx4(E, 128, H))
    with pytest.raises(ValueError, match="multiples of 16 elements"):
        moe_experts(h, ids, weights, w13.to(device), s13.to(device), w2.to(device), s2.to(device),
                    num_routed_experts=E)


def test_kernel_layout_picks_mma_for_sparse_moe_experts():
    """weights.to_kernel_layout: MXFP4 expert tables and the shared expert of a sparse MoE layer in
    mxfp4_mma where K is a multiple of 128, pre-placed words otherwise."""
    from minimax_ops.config import preset
    from minimax_ops.weights import random_layer_weights
    cfg = preset("tiny").replace(hidden_size=H, intermediate_size=I, shared_intermediate_size=I)
    layer = next(i for i in range(cfg.num_hidden_layers) if cfg.layer_kind(i) == SPARSE_MOE)
    w = random_layer_weights(cfg, layer, linear_format="mxfp8", expert_format="mxfp4",
                             generator=torch.Generator().manual_seed(0))
    k = to_kernel_layout(w, mma=True)
    assert weight_layout(k.w13, k.w13_scale, 3).name == "mxfp4_mma"
    assert weight_layout(k.w2, k.w2_scale, 3).name == "mxfp4_mma"
    if w.shared_w13 is not None:
        assert weight_layout(k.shared_w13, k.shared_w13_scale, 2).name == "mxfp4_mma"
    assert torch.equal(dequantize(k.w13, k.w13_scale, 3), dequantize(w.w13, w.w13_scale, 3))
    small = random_layer_weights(preset("tiny"), layer, linear_format="mxfp8", expert_format="mxfp4",
                                 generator=torch.Generator().manual_seed(0))
    assert weight_layout(to_kernel_layout(small, mma=True).w2, small.w2_scale, 3).name == "mxfp4_words"
    assert weight_layout(to_kernel_layout(w, mma=False).w2, w.w2_scale, 3).name == "mxfp4_words"
