"""The ``mxfp4_mma`` / ``mxfp8_mma`` layouts (formats.py) and their expert kernels (kernels/moe_mma.py).

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
from minimax_ops.formats import (MMA8_SCALE_BIAS, MMA_SCALE_BIAS, dequantize, logical_in_features,
                                 logical_out_features, pack_mxfp4_words, quantize, to_canonical, to_mma_layout,
                                 unpack_e2m1, unpack_mxfp8_words, weight_layout)
from minimax_ops.kernels.expert_slots import build_slot_table
from minimax_ops.kernels.moe import moe_experts
from minimax_ops.kernels.tiles import mma_expert_tiles, portable_mma_tiles
from minimax_ops.weights import to_kernel_layout
from utils import rel_err

# 4 routed experts: an interpreted launch costs per slot (min(E, n * K) + 1), and 4 already gives steps whose
# experts are chosen by several tokens and by both 8-token groups.
H, I, E, K = 256, 128, 4, 2


def _mx4(*shape, scale=0.5):
    return quantize(torch.randn(*shape) * scale, "mxfp4")


def _mx8(*shape, scale=0.5):
    return quantize(torch.randn(*shape) * scale, "mxfp8")


_MX = {"mxfp4": _mx4, "mxfp8": _mx8}


# ---- the layout --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("fmt", ["mxfp4", "mxfp8"])
@pytest.mark.parametrize("lead", [(), (3,)])
def test_round_trip_and_logical_shape(lead, fmt):
    torch.manual_seed(0)
    w, s = _MX[fmt](*lead, 48, 192)
    mw, ms = to_mma_layout(w, s)
    rank = len(lead) + 2
    dtype, last = (torch.int32, 128) if fmt == "mxfp4" else (torch.float8_e4m3fn, 1024)
    assert mw.dtype == dtype and mw.shape == (*lead, 3, 3, last) and ms.shape == (*lead, 3, 3, 32)
    assert weight_layout(mw, ms, rank).name == f"{fmt}_mma"
    assert logical_in_features(mw, rank) == 192 and logical_out_features(mw, rank) == 48
    back = to_canonical(mw, ms, rank)
    assert torch.equal(back[0].view(torch.uint8), w.view(torch.uint8)) and torch.equal(back[1], s)
    assert torch.equal(dequantize(mw, ms, rank), dequantize(w, s))


def test_mxfp4_diagnostic_halves_keep_their_half():
    """MINIMAX_OPS_DIAG_MXFP4's block products (benchmarks only): decode_only keeps every decode
    instruction and no mma, mma_only the four mma and no decode; both read every operand."""
    from minimax_ops.kernels.mma_decode import _mxfp4_block_ptx
    full, decode, mma = (_mxfp4_block_ptx(p) for p in ("", "decode_only", "mma_only"))
    assert full.count("mma.sync") == 4 and full.count("mul.rn.bf16x2") == 16
    assert decode.count("mma.sync") == 0 and decode.count("mul.rn.bf16x2") == 16
    assert "prmt" in full and "prmt" in decode  # (the decode's fourth pair: so mma_only's has none to drop)
    assert mma.count("mma.sync") == 4 and mma.count("mul.rn.bf16x2") == 0 and "prmt" not in mma
    for text in (full, decode, mma):
        assert all(f"${i}" in text for i in range(24)), text


def _run_ptx(text: str, regs: dict[str, int]) -> dict[str, int]:
    """Evaluates the mov / prmt (default mode) / shl lines of a PTX snippet on 32-bit registers."""
    def val(x):
        return regs[x] if x in regs else int(x, 0)
    for line in text.replace("{", "").replace("}", "").split(";"):
        op, _, args = line.strip().partition(" ")
        if not op or op.startswith(".reg"):
            continue
        dst, *src = [a.strip() for a in args.split(",")]
        if op == "mov.b32":
            regs[dst] = val(src[0])
        elif op == "shl.b32":
            regs[dst] = (val(src[0]) << val(src[1])) & 0xFFFFFFFF
        elif op == "prmt.b32":
            pool = [(val(r) >> 8 * i) & 0xFF for r in src[:2] for i in range(4)]  # bytes of a, then of b
            out = 0
            for i in range(4):
                sel = (val(src[2]) >> 4 * i) & 0xF
                byte = pool[sel & 7]
                out |= ((0xFF if byte & 0x80 else 0) if sel & 8 else byte) << 8 * i
            regs[dst] = out
        else:
            raise AssertionError(f"unexpected instruction {op!r}")
    return regs


def test_scale_words_put_each_byte_in_both_bf16_exponents():
    """SCALE_WORDS_PTX (mma_decode.scale_words' PTX), evaluated on random packed scale bytes: register e is the
    bf16x2 word whose two halves are 2^(byte e - 127) (the byte as the exponent field, sign and mantissa 0)."""
    from minimax_ops.kernels.mma_decode import SCALE_WORDS_PTX
    gen = torch.Generator().manual_seed(11)
    for packed in torch.randint(0, 2**32, (64,), generator=gen, dtype=torch.int64).tolist():
        regs = _run_ptx(SCALE_WORDS_PTX.value, {"$4": packed})
        for e in range(4):
            byte = (packed >> 8 * e) & 0xFF
            assert regs[f"${e}"] == (byte << 7) | (byte << 23), (hex(packed), e)
            if 0 < byte < 255:
                halves = torch.tensor([regs[f"${e}"] & 0xFFFF, regs[f"${e}"] >> 16], dtype=torch.int32)
                assert (halves << 16).view(torch.float32).double().tolist() == [2.0 ** (byte - 127)] * 2


def test_fp8_value_positions_and_bit_decode():
    """mxfp8_mma: value (row 16b + 8h + g, K 64kb + 32q + 8c + 4jj + v) sits in word
    128q + 4(4g + c) + 2jj + h of block (b, kb), value v; scale byte 4g + 2h + q (+ 120). The
    kernels' decode, done here on the integers: (w & 0x87F087F0) holds values 0, 1 and
    ((w << 4) & 0x80F080F0) | ((w >> 4) & 0x07000700) values 2, 3, as bf16 bits of v * 2^-120."""
    torch.manual_seed(2)
    w, s = _mx8(32, 128)
    mw, ms = to_mma_layout(w, s)
    words = mw.view(torch.int32).to(torch.int64) & 0xFFFFFFFF  # [2, 2, 256]
    stored = unpack_mxfp8_words(mw.view(torch.int32))  # [2, 2, 1024] bytes
    pairs = [words & 0x87F087F0, ((words << 4) & 0x80F080F0) | ((words >> 4) & 0x07000700)]

    def bf16(bits):  # 16-bit patterns -> their bf16 values * 2^120, in float64
        return (bits.to(torch.int32) << 16).view(torch.float32).double() * 2.0 ** 120

    codes = w.view(torch.uint8)
    values = w.double()
    for row in range(32):
        b, h, g = row // 16, (row % 16) // 8, row % 8
        for k in range(0, 128, 3):
            kb, q, c, jj, v = k // 64, (k % 64) // 32, (k % 32) // 8, (k % 8) // 4, k % 4
            word = 128 * q + 4 * (4 * g + c) + 2 * jj + h
            assert stored[b, kb, 4 * word + v] == codes[row, k], (row, k)
            bits = (pairs[v // 2][b, kb, word] >> (16 * (v % 2))) & 0xFFFF
            assert bf16(bits) == values[row, k], (row, k)
            assert ms[b, kb, 4 * g + 2 * h + q] == s[row, k // 32] + MMA8_SCALE_BIAS


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
    w8, s8 = _mx8(32, 128)
    with pytest.raises(ValueError, match="scales up to 134"):
        to_mma_layout(w8, torch.full_like(s8, 135))
    nan = w8.clone()
    nan.view(torch.uint8)[3, 5] = 0x7F
    with pytest.raises(ValueError, match="NaN"):
        to_mma_layout(nan, s8)
    mw8, ms8 = to_mma_layout(w8, s8)
    with pytest.raises(ValueError, match="mxfp8_mma scales of shape"):
        weight_layout(mw8, ms8[..., :16], 2)


# ---- the expert kernels ----------------------------------------------------------------------------------


def _routing(n, device):
    ids = torch.stack([torch.randperm(E)[:K] for _ in range(n)]).int()
    return ids.to(device), (torch.rand(n, K) + 0.1).to(device)


def _tables(device, experts=E, shared=True, inter_shared=I, fmt="mxfp4", hidden=H, inter=I):
    mx = _MX[fmt]
    tabs = [mx(experts, 2 * inter, hidden), mx(experts, hidden, inter)]
    if shared:
        tabs += [mx(2 * inter_shared, hidden), mx(hidden, inter_shared)]
    canonical = [t.to(device) for pair in tabs for t in pair]
    mma = [t.to(device) for pair in tabs for t in to_mma_layout(*pair)]
    return canonical, mma


@pytest.mark.parametrize("n, shared", [(1, "separate"), (3, "table"), (9, "separate"), (4, "none"), (2, "other")])
def test_moe_experts_match_reference(n, shared, device):
    """One token, a table holding the shared expert, two token groups of 8, no shared expert, and a
    shared expert in another layout (words: its own launches next to the mma ones)."""
    _check_moe(n, shared, device, "mxfp4")


@pytest.mark.parametrize("n, shared", [(1, "separate"), (9, "table")])
def test_moe_experts_mxfp8_match_reference(n, shared, device):
    _check_moe(n, shared, device, "mxfp8", hidden=128, inter=64)  # (smaller: the interpreter's emulation is slow)


def _check_moe(n, shared, device, fmt, hidden=H, inter=I):
    torch.manual_seed(n)
    h = torch.randn(n, hidden, device=device).bfloat16()
    ids, weights = _routing(n, device)
    canonical, mma = _tables(device, E + (shared == "table"), shared in ("separate", "other"), inter, fmt, hidden, inter)
    if shared == "other":
        mma[4:] = [pack_mxfp4_words(canonical[4]), canonical[5], pack_mxfp4_words(canonical[6]), canonical[7]]
    want = ref.moe_experts(h, ids, weights, *canonical, num_routed_experts=E)
    out = moe_experts(h, ids, weights, *mma, num_routed_experts=E)
    assert out.shape == (n, hidden) and torch.isfinite(out).all()
    assert rel_err(out, want) < 1.5e-2
    assert torch.equal(out, moe_experts(h, ids, weights, *mma, num_routed_experts=E))


# (w13 grid splits, w13 warp splits, w13 depth, w2 splits, w2 depth, L2 prefetch steps of both: no table uses
# one, the tiles allow it; PTX only)
_TILE_CASES = {"mxfp4": ((1, 1, 1, 1, 1, 0), (2, 1, 1, 2, 1, 2), (1, 2, 1, 1, 1, 0), (4, 1, 1, 1, 2, 0),
                         (1, 1, 2, 2, 1, 1), (2, 2, 1, 2, 1, 0), (1, 2, 2, 1, 1, 0)),
               "mxfp8": ((2, 1, 1, 2, 1, 2), (1, 1, 2, 1, 2, 0), (1, 2, 1, 1, 1, 0))}
# The leading cases each run on CUDA only: under the interpreter (~10 s a case) the rest still take every grid
# split, warp split, depth and w2 split above, alone or together.
_CUDA_ONLY_CASES = {"mxfp4": 3, "mxfp8": 0}


@pytest.mark.parametrize("fmt", ["mxfp4", "mxfp8"])
def test_moe_splits_depths_and_padding_rows(device, fmt):
    """H split of w13 (by the grid: partials summed by the last split; by a program's warps: summed
    through shared memory; both), I split of w2, load depths, L2 prefetch distances, a shared expert
    of another size merged into the routed launches; zero-weight padding rows."""
    torch.manual_seed(7)
    n = 5
    h = torch.randn(n, H, device=device).bfloat16()
    h[3] = 0
    ids, weights = _routing(n, device)
    weights[3:] = 0
    canonical, mma = _tables(device, inter_shared=2 * I, fmt=fmt)
    want = ref.moe_experts(h, ids, weights, *canonical, num_routed_experts=E)
    fp8 = fmt == "mxfp8"
    base13, base2 = mma_expert_tiles(H, True, fp8=fp8), mma_expert_tiles(I, False, fp8=fp8)
    for s13, ws13, d13, s2, d2, prefetch in _TILE_CASES[fmt][0 if device == "cuda" else _CUDA_ONLY_CASES[fmt]:]:
        t13 = dataclasses.replace(base13, split=s13, warp_split=ws13, k_chunks=d13, num_warps=2,
                                  num_stages=1 + prefetch)
        t2 = dataclasses.replace(base2, split=s2, k_chunks=d2, num_warps=1, num_stages=1 + prefetch)
        out = moe_experts(h, ids, weights, *mma, num_routed_experts=E, tiles=(t13, t2))
        assert rel_err(out, want) < 1.5e-2, (t13, t2)
        assert (out[3] == 0).all() and torch.isfinite(out).all()


def test_moe_refuses_mixed_or_misaligned_tables(device):
    canonical, mma = _tables(device, shared=False)
    h = torch.randn(2, H, device=device).bfloat16()
    ids, weights = _routing(2, device)
    with pytest.raises(ValueError, match="both or neither in an mma layout"):
        moe_experts(h, ids, weights, mma[0], mma[1], pack_mxfp4_words(canonical[2]), canonical[3],
                    num_routed_experts=E)
    w13, s13 = to_mma_layout(*_mx4(E, 128, H))
    w2, s2 = to_mma_layout(*_mx4(E, H, 64))
    shifted = torch.empty(w2.numel() + 1, dtype=w2.dtype, device=device)[1:].view(w2.shape)  # 4 bytes off
    shifted.copy_(w2)
    with pytest.raises(ValueError, match="16-byte aligned"):
        moe_experts(h, ids, weights, w13.to(device), s13.to(device), shifted, s2.to(device), num_routed_experts=E)
    t13 = mma_expert_tiles(H, True)
    bad = dataclasses.replace(t13, split=3)  # 3 splits of H's 4 K blocks
    with pytest.raises(ValueError, match="tiles: w13's"):
        moe_experts(h, ids, weights, *mma, num_routed_experts=E, tiles=(bad, mma_expert_tiles(I, False)))


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


def test_kernel_layout_lays_mxfp8_weights_as_mma():
    """MXFP8 qkv / o_proj / experts / shared expert as mxfp8_mma (values unchanged), bf16 untouched."""
    from minimax_ops.config import preset
    from minimax_ops.weights import random_layer_weights
    cfg = preset("tiny").replace(hidden_size=H, intermediate_size=I, shared_intermediate_size=I)
    layer = next(i for i in range(cfg.num_hidden_layers) if cfg.layer_kind(i) == SPARSE_MOE)
    w = random_layer_weights(cfg, layer, linear_format="mxfp8", generator=torch.Generator().manual_seed(0))
    k = to_kernel_layout(w, mma=True)
    for name, rank in (("qkv", 2), ("o_proj", 2), ("w13", 3), ("w2", 3), ("shared_w13", 2), ("shared_w2", 2)):
        weight, scale = getattr(w, name), getattr(w, f"{name}_scale")
        if weight is None:
            continue
        kw, ks = getattr(k, name), getattr(k, f"{name}_scale")
        assert weight_layout(kw, ks, rank).name == "mxfp8_mma", name
        assert torch.equal(dequantize(kw, ks, rank), dequantize(weight, scale, rank)), name


@pytest.mark.parametrize("n, shared", [(1, "table"), (5, "merged"), (3, "own")])
def test_moe_invalid_ids_and_padding_rows(n, shared, device):
    """Ids outside [0, routed experts) (-1, and past the shared expert's id) add nothing, a zero
    padding row stays 0; with the shared expert in the table, merged into the routed launches, or
    in launches of its own (an intermediate size the merge does not fit)."""
    torch.manual_seed(40 + n)
    hidden, inter = 128, 128
    h = torch.randn(n, hidden, device=device).bfloat16()
    ids, weights = _routing(n, device)
    ids[0, K - 1] = -1
    if n > 2:
        ids[2, 0] = E + 2
        h[n - 1] = 0
        weights[n - 1] = 0
    canonical, mma = _tables(device, E + (shared == "table"), shared != "table", 64 if shared == "own" else inter,
                             "mxfp4", hidden, inter)
    keep = torch.where((ids >= 0) & (ids < E), ids, 0)  # the reference takes valid ids; weight 0 adds nothing
    want = ref.moe_experts(h, keep, torch.where(ids == keep, weights, 0.0), *canonical, num_routed_experts=E)
    out = moe_experts(h, ids, weights, *mma, num_routed_experts=E)
    assert torch.isfinite(out).all() and rel_err(out, want) < 1.5e-2
    if n > 2:
        assert (out[n - 1] == 0).all()


@pytest.mark.parametrize("n", [pytest.param(1, marks=pytest.mark.skipif(not torch.cuda.is_available(),
                                                                         reason="CUDA: slow to emulate")), 3])
def test_mxfp4_w13_gate_and_up_in_one_stream(n, device, monkeypatch):
    """The mxfp4_mma w13 streams each K block's gate and up blocks together (half the depth per
    matrix, accumulators in depth / 2 sets): at depths 1, 2, 4 (one, two and four K blocks a step
    of each matrix, 8 K blocks: several loop turns, an odd step count, a lone step) and 1 or 2 row
    blocks per program it matches the reference and the two-stream kernel (on CPU too: the
    emulation then runs these tiles rather than the portable ones)."""
    from minimax_ops.kernels import moe_mma
    monkeypatch.setattr(moe_mma, "portable_mma_tiles", lambda t: t)
    torch.manual_seed(50 + n)
    hidden, inter = 512, 64
    h = torch.randn(n, hidden, device=device).bfloat16()
    ids, weights = _routing(n, device)
    canonical, mma = _tables(device, E + 1, False, fmt="mxfp4", hidden=hidden, inter=inter)
    want = ref.moe_experts(h, ids, weights, *canonical, num_routed_experts=E)
    base13 = mma_expert_tiles(hidden, True)
    t2 = dataclasses.replace(mma_expert_tiles(inter, False), num_warps=1, k_chunks=1, num_stages=1)
    # (depth 4 x 2 warps is the slowest to emulate: CUDA only; depth 2 already takes the halves path)
    cases = ((1, 2), (2, 1), (4, 2)) if device == "cuda" else ((1, 2), (2, 1))
    for depth, warps in cases:
        t13 = dataclasses.replace(base13, k_chunks=depth, num_warps=warps, num_stages=1,
                                  warp_split=1)  # (no L2 prefetch: PTX)
        streams = {paired: moe_experts(h, ids, weights, *mma, num_routed_experts=E,
                                       tiles=(dataclasses.replace(t13, paired=paired), t2))
                   for paired in (True, False)}
        out, two_streams = streams[True], streams[False]
        assert rel_err(out, want) < 1.5e-2, (depth, warps)
        assert rel_err(out, two_streams) < 5e-3, (depth, warps)


@pytest.mark.parametrize("fmt", ["mxfp4", pytest.param("mxfp8", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="CUDA: slow to emulate (the ring is format-independent code)"))])
def test_moe_three_step_ring(fmt, device, monkeypatch):
    """Three load steps held in registers, x loaded at each product (ExpertTiles.ring 3, block_stream's
    RING: the one-token w2's tiles), in both kernels: 4 and 5 steps (a loop turn, then one or two
    steps), the paired w13, w2's preloaded first step (and first two, bit for bit); on CUDA also 2 and 1
    steps (no turn), more tokens and two token groups on one stream (MXFP8, fixed groups). Against the
    reference and the two-step ring."""
    from minimax_ops.kernels import moe_mma
    monkeypatch.setattr(moe_mma, "portable_mma_tiles", lambda t: t)
    torch.manual_seed(61)
    hidden, inter = 256, 320  # 4 and 5 K blocks
    fp8 = fmt == "mxfp8"
    canonical, mma = _tables(device, inter_shared=inter, fmt=fmt, hidden=hidden, inter=inter)
    base13, base2 = mma_expert_tiles(hidden, True, fp8=fp8), mma_expert_tiles(inter, False, fp8=fp8)
    tokens = (1, 3, 12) if device == "cuda" else (1,)
    if fp8 and device == "cuda":
        monkeypatch.setenv("MINIMAX_OPS_NO_COMPACT", "1")  # 12 tokens: two groups on one weight stream
    for n in tokens:
        h = torch.randn(n, hidden, device=device).bfloat16()
        ids, weights = _routing(n, device)
        want = ref.moe_experts(h, ids, weights, *canonical, num_routed_experts=E)
        for s13, s2 in ((1, 1), (2, 5))[:2 if device == "cuda" else 1]:  # K splits: w13 4 / 2 steps, w2 5 / 1
            t13 = dataclasses.replace(base13, split=s13, k_chunks=1, num_warps=1, num_stages=1, warp_split=1)
            t2 = dataclasses.replace(base2, split=s2, k_chunks=1, num_warps=1, num_stages=1)
            two = moe_experts(h, ids, weights, *mma, num_routed_experts=E,
                              tiles=(dataclasses.replace(t13, ring=2), dataclasses.replace(t2, ring=2)))
            ring3 = (dataclasses.replace(t13, ring=3), dataclasses.replace(t2, ring=3))
            out = moe_experts(h, ids, weights, *mma, num_routed_experts=E, tiles=ring3)
            assert rel_err(out, want) < 1.5e-2, (n, t13, t2)
            assert rel_err(out, two) < 1e-5, (n, t13, t2)
            # w2 with its first two steps read before the wait (the rule takes it for the fused layer's routed
            # one-token w2 only: forced here): the same products, in order
            with monkeypatch.context() as m:
                m.setattr(moe_mma, "w2_preload_steps", lambda n_tokens, ring, pdl, routed: 2 if n_tokens == 1 else 0)
                preloaded = moe_experts(h, ids, weights, *mma, num_routed_experts=E, tiles=ring3)
            assert torch.equal(preloaded, out), (n, t13, t2)


def test_w2_preload_steps_rule(monkeypatch):
    """w2 reads one weight step before its wait in steps of one token group, two where it is the fused
    layer's routed one (a programmatic dependent) with tiles that hold three steps (unless
    MINIMAX_OPS_W2_PRELOAD_STEPS=1), none where the preload is off."""
    from minimax_ops.kernels.mma_launch import w2_preload_steps
    monkeypatch.delenv("MINIMAX_OPS_W2_PRELOAD_STEPS", raising=False)
    monkeypatch.delenv("MINIMAX_OPS_NO_PRELOAD", raising=False)
    assert [w2_preload_steps(1, 3, True, True), w2_preload_steps(1, 2, True, True), w2_preload_steps(1, 3, False, True),
            w2_preload_steps(1, 3, True, False), w2_preload_steps(8, 2, True, False),
            w2_preload_steps(16, 3, True, False)] == [2, 1, 1, 1, 1, 0]
    monkeypatch.setenv("MINIMAX_OPS_W2_PRELOAD_STEPS", "1")
    assert [w2_preload_steps(1, 3, True, True), w2_preload_steps(16, 3, True, False)] == [1, 0]
    monkeypatch.setenv("MINIMAX_OPS_NO_PRELOAD", "1")
    assert w2_preload_steps(1, 3, True, True) == 0


def test_one_token_w2_ring():
    """The table's one-token w2 tiles take the three-step ring in both formats, but MXFP8's w2 that
    makes the router's top-k itself (routed) the plain one; larger steps and w13 the plain one; the
    portable tiles always the plain one."""
    assert mma_expert_tiles(3072, False, one_token=True, routed=True).ring == 3
    assert mma_expert_tiles(3072, False, fp8=True, one_token=True, routed=True).ring == 2
    for fp8 in (False, True):
        assert mma_expert_tiles(3072, False, fp8=fp8, one_token=True).ring == 3
        assert mma_expert_tiles(3072, False, fp8=fp8).ring == 2
        assert mma_expert_tiles(6144, True, fp8=fp8, one_token=True).ring == 2
        assert portable_mma_tiles(mma_expert_tiles(3072, False, fp8=fp8, one_token=True)).ring == 2


@pytest.mark.parametrize("fmt, shared", [("mxfp4", "separate"), ("mxfp4", "table"), ("mxfp8", "table")])
def test_routed_experts_take_compacted_token_passes(fmt, shared, device, monkeypatch):
    """Steps of more than 8 tokens: a routed expert's passes take the tokens that chose it (kernel
    COMPACT). An expert chosen by 12 of 16 tokens (two passes, the second part-filled), one chosen
    by tokens of both 8-token groups (one pass), one by a single token of the second group; an
    invalid id and a zero padding row. Matches the reference and, bit for bit, the fixed 8-token
    groups (each token's products are the same whichever mma column carries it) and the passes
    found from the ids in w2 instead of read from the slot table w13 writes."""
    torch.manual_seed(60)
    n, hidden, inter = 16, 128, 64
    h = torch.randn(n, hidden, device=device).bfloat16()
    ids = torch.tensor([[0, 1]] * 4 + [[0, 2]] * 4 + [[0, 1]] * 4 + [[2, 1], [3, 0], [1, 2], [1, 2]]).int()
    ids[5, 1] = -1  # an invalid id adds nothing
    weights = torch.rand(n, K) + 0.1
    h[n - 1] = 0
    weights[n - 1] = 0
    ids, weights = ids.to(device), weights.to(device)
    canonical, mma = _tables(device, E + (shared == "table"), shared == "separate", inter, fmt, hidden, inter)
    keep = torch.where(ids >= 0, ids, 0)
    want = ref.moe_experts(h, keep, torch.where(ids == keep, weights, 0.0), *canonical, num_routed_experts=E)
    out = moe_experts(h, ids, weights, *mma, num_routed_experts=E)
    assert torch.isfinite(out).all() and rel_err(out, want) < 1.5e-2
    assert (out[n - 1] == 0).all()
    monkeypatch.setenv("MINIMAX_OPS_NO_SLOT_TABLE", "1")
    assert torch.equal(out, moe_experts(h, ids, weights, *mma, num_routed_experts=E))
    monkeypatch.delenv("MINIMAX_OPS_NO_SLOT_TABLE")
    monkeypatch.setenv("MINIMAX_OPS_NO_COMPACT", "1")
    assert torch.equal(out, moe_experts(h, ids, weights, *mma, num_routed_experts=E))


@pytest.mark.parametrize("shared", ["separate", "table", "own"])
def test_shared_expert_takes_a_slot_per_pass(shared, device, monkeypatch):
    """Steps of more than 8 tokens give the shared expert a slot per 8-token pass (9 tokens: two, the
    last holding one token), whether it is in the table, merged into the routed launches or in
    launches of its own, with w13 split over H (the last split of a slot sums only its pass's tokens):
    the reference, and bit for bit the one slot that streams its passes in turn
    (MINIMAX_OPS_NO_SHARED_PASSES=1: each token's products are the same whichever program makes them)."""
    torch.manual_seed(70)
    n, hidden, inter = 9, 128, 128
    h = torch.randn(n, hidden, device=device).bfloat16()
    ids, weights = _routing(n, device)
    canonical, mma = _tables(device, E + (shared == "table"), shared != "table", 64 if shared == "own" else inter,
                             "mxfp4", hidden, inter)
    want = ref.moe_experts(h, ids, weights, *canonical, num_routed_experts=E)
    t13 = dataclasses.replace(mma_expert_tiles(hidden, True), split=2, k_chunks=1,
                              warp_split=1)  # (2 K blocks: one a split)
    t2 = mma_expert_tiles(inter, False)
    out = moe_experts(h, ids, weights, *mma, num_routed_experts=E, tiles=(t13, t2))
    assert torch.isfinite(out).all() and rel_err(out, want) < 1.5e-2
    monkeypatch.setenv("MINIMAX_OPS_NO_SHARED_PASSES", "1")
    assert torch.equal(out, moe_experts(h, ids, weights, *mma, num_routed_experts=E, tiles=(t13, t2)))


@pytest.mark.parametrize("n, experts, top_k", [(16, 128, 4), (40, 8, 2)])
def test_slot_table_lists_each_experts_tokens_in_order(n, experts, top_k, device):
    """build_slot_table against the table made by hand: slot s holds the s-th smallest routed id
    chosen, how many tokens chose it, those tokens in token order with their top-k columns, -1 after;
    empty slots -1. Invalid ids (-1, >= the routed count) are in no slot; 40 x 2 ids take two chunks."""
    g = torch.Generator().manual_seed(n)
    ids = torch.stack([torch.randperm(experts, generator=g)[:top_k] for _ in range(n)]).int()
    ids[3, 0], ids[n - 1, top_k - 1] = -1, experts  # an invalid id of each kind
    routed_slots = min(experts, n * top_k)
    table = build_slot_table(ids.to(device), routed_slots, experts, pdl=False).cpu()
    want = torch.full((routed_slots, 2 + 2 * n), -1, dtype=torch.int32)
    for slot, e in enumerate(sorted({int(i) for i in ids.flatten() if 0 <= i < experts})):
        pairs = [(t, k) for t in range(n) for k in range(top_k) if ids[t, k] == e]
        want[slot, :2] = torch.tensor([e, len(pairs)])
        want[slot, 2:2 + len(pairs)] = torch.tensor([t for t, _ in pairs])
        want[slot, 2 + n:2 + n + len(pairs)] = torch.tensor([k for _, k in pairs])
    assert torch.equal(table, want)


@pytest.mark.parametrize("inter,fills", [(3072, False), (1536, False), (768, True), (384, True)])
def test_one_token_w13_fills_the_sms_at_a_tensor_parallel_ranks_intermediate(inter, fills):
    """tiles.expert_tiles: a one-token mma-layout w13 launch that would leave SMs without a program (4 routed
    slots + the shared expert at a TP 4 / TP 8 rank's intermediate, 768 / 384, on 132 SMs) splits H by every
    warp of a program (one row block a program: twice the programs); TP 1 / TP 2 ranks keep the table's tiles,
    and so do 16-token steps and w2."""
    from minimax_ops.formats import MMA_CODES
    from minimax_ops.kernels.tiles import expert_tiles
    for code in MMA_CODES:
        t = expert_tiles(code, 6144, 2 * inter, 5, True, 132, n_tokens=1, routed=True)
        plain = mma_expert_tiles(6144, True, fp8=code == MMA_CODES[1], one_token=True, routed=True)
        programs = 5 * (2 * inter // 32 // t.row_blocks) * t.split
        if fills:
            assert (t.split, t.warp_split, t.row_blocks) == (1, t.num_warps, 1) and t != plain
            assert programs == 2 * 5 * (2 * inter // 32 // plain.row_blocks)
        else:
            assert t == plain and programs >= 132
        assert expert_tiles(code, 6144, 2 * inter, 5, True, 132, n_tokens=16) == mma_expert_tiles(
            6144, True, fp8=code == MMA_CODES[1])
        assert expert_tiles(code, inter, 6144, 5, False, 132, n_tokens=1, routed=True) == mma_expert_tiles(
            inter, False, fp8=code == MMA_CODES[1], one_token=True, routed=True)
