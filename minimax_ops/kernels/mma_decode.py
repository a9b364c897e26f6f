"""The ``mxfp4_mma`` weight layout's block product: MXFP4 weights decoded straight into tensor-core
operand registers (formats.py documents the layout).

A block is 16 weight rows x 64 K values = 128 int32 words + 32 scale bytes; one warp streams one
block per call: lane l = 4g + c holds words 4l..4l+3, word j the 8 values the lane's A fragment of
``mma.sync.m16n8k16`` k-step j wants (rows g and g + 8), bits pre-placed as in ``mxfp4_words``, so
a word decodes with 11 integer instructions (SASS) and 4 ``mul.bf16x2`` by the group scale into the
four A registers: no shared-memory round trip, no re-packing of 16-bit halves. The B operand is the
lane's x pairs (token g, 8 consecutive K values per 32-group), so one call multiplies the block by
up to 8 token rows. Scale bytes are stored biased (``E = s + 126``: the bf16 exponent that turns
the decode's v * 2^-126 into v * 2^(s - 127)).

Every tensor here is in *fragment order*: [DEPTH * NW * 32, 4], row d * NW * 32 + r block d of
lane r % 32 of warp r // 32, column e its register e. The loads are contiguous along the 4 columns (128-bit words, 32-bit
scale bytes), so Triton gives each thread one row: the inline PTX relies on that, and nothing
after it reshapes or reduces across rows (which could make Triton pick another layout); the GPU
tests check the result against the reference. The accumulator's register e of lane
(g, c) is row g + 8 * (e // 2) of the block, token column 2c + e % 2.

The interpreter and non-NVIDIA targets run ``_emulate``: the same arithmetic on the same operands,
written with whole-tensor ops (slow, exact to fp32 rounding).
"""

from __future__ import annotations

import triton
import triton.language as tl

from .mx_decode import bf16_halves, mxfp4_word_pairs, mxfp4_words_ptx

TOKENS = tl.constexpr(8)  # token columns of one mma (the B operand's N)

# One call: $0..$3 accumulators out, $4..$7 the lane's 4 words (k-steps 0..3), $8..$11 x pairs of
# group 0 (K 8c .. 8c + 7 of the block's first 32), $12..$15 of group 1, $16 (= $17 = $18 = $19)
# the lane's word of 4 biased scale bytes, $20..$23 accumulators in.
_MMA = "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {{$0, $1, $2, $3}}, {{a0, a1, a2, a3}}, {{{b0}, {b1}}}, {{{c}}};\n"


def _decode_mma(w: str, lo: str, hi: str, b0: str, b1: str, c: str) -> str:
    """One word into a0..a3 (rows g, g + 8, g, g + 8: scales lo, hi, lo, hi), then its k-step's mma."""
    return mxfp4_words_ptx(w, ("a0", "a1", "a2", "a3"), (lo, hi, lo, hi)) + _MMA.format(b0=b0, b1=b1, c=c)


_SCALES = """mov.b32 z, 0;
prmt.b32 s0, $16, z, 0x4040;
shl.b32 s0, s0, 7;
prmt.b32 s1, $16, z, 0x4141;
shl.b32 s1, s1, 7;
prmt.b32 s2, $16, z, 0x4242;
shl.b32 s2, s2, 7;
prmt.b32 s3, $16, z, 0x4343;
shl.b32 s3, s3, 7;
"""
_ACC_IN = "$20, $21, $22, $23"
_ACC = "$0, $1, $2, $3"
MMA_BLOCK_PTX = tl.constexpr(
    "{\n.reg .b32 t, u, z, s0, s1, s2, s3, a0, a1, a2, a3;\n" + _SCALES
    # group 0 (k-steps 0, 1): row g scale s0, row g + 8 scale s2; group 1: s1, s3
    + _decode_mma(w="$4", lo="s0", hi="s2", b0="$8", b1="$9", c=_ACC_IN)
    + _decode_mma(w="$5", lo="s0", hi="s2", b0="$10", b1="$11", c=_ACC)
    + _decode_mma(w="$6", lo="s1", hi="s3", b0="$12", b1="$13", c=_ACC)
    + _decode_mma(w="$7", lo="s1", hi="s3", b0="$14", b1="$15", c=_ACC)
    + "}")


@triton.jit
def _word_values(w):
    """mxfp4_words word -> its 8 e2m1 values v0 .. v7 as fp32 (pairs (v0, v1) .. (v6, v7))."""
    p0, p1, p2, p3 = mxfp4_word_pairs(w.to(tl.uint32, bitcast=True))
    v0, v1 = _e2m1_pair(p0)
    v2, v3 = _e2m1_pair(p1)
    v4, v5 = _e2m1_pair(p2)
    v6, v7 = _e2m1_pair(p3)
    return v0, v1, v2, v3, v4, v5, v6, v7


@triton.jit
def _e2m1_pair(p):
    lo, hi = bf16_halves(p, True)  # the values * 2^-126; * 2^126 is exact
    return lo * 85070591730234615865843651857942052864.0, hi * 85070591730234615865843651857942052864.0


@triton.jit
def _split4(t, NW: tl.constexpr):
    """[NW, 8, 4, 4] -> its 4 slices along the last axis, each [NW, 8, 4]."""
    a, b = tl.split(tl.reshape(t, [NW, 8, 4, 2, 2]))  # last axis = slot % 2
    s0, s2 = tl.split(a)
    s1, s3 = tl.split(b)
    return s0, s1, s2, s3


@triton.jit
def _emulate(acc, w, x0, x1, s, NW: tl.constexpr):
    """MMA_BLOCK_PTX with whole-tensor ops (fragment order in and out)."""
    shape: tl.constexpr = [NW, 8, 4, 4]
    w0, w1, w2, w3 = _split4(tl.reshape(w, shape), NW)
    byte = (tl.reshape(s, shape) >> (8 * tl.arange(0, 4)[None, None, None, :])) & 255  # column e: byte e
    # scale of (row g + 8h, group q) as fp32: 2^(s - 127), s = E - formats.MMA_SCALE_BIAS (126)
    sc = tl.max((((byte - 126) << 23).to(tl.float32, bitcast=True)), axis=2)  # [NW, 8, 4]: equal over c
    sc0, sc1 = tl.split(tl.reshape(sc, [NW, 8, 2, 2]))  # byte b = 2h + q; split on q
    s_g0, s_h0 = tl.split(sc0)  # group 0: rows g, g + 8
    s_g1, s_h1 = tl.split(sc1)
    d_lo = tl.zeros([NW, 8, 8], dtype=tl.float32)  # [warp, row g, token]
    d_hi = tl.zeros([NW, 8, 8], dtype=tl.float32)  # row g + 8
    xa = _split4(tl.reshape(x0, shape), NW)
    xb = _split4(tl.reshape(x1, shape), NW)
    for j in tl.static_range(4):
        wj = w0 if j == 0 else w1 if j == 1 else w2 if j == 2 else w3
        v0, v1, v2, v3, v4, v5, v6, v7 = _word_values(wj)  # each [NW, 8(g), 4(c)]
        xs = xa if j < 2 else xb
        b0 = xs[0] if j % 2 == 0 else xs[2]  # x pair for K +0, +1 (token g of the lane's row axis)
        b1 = xs[1] if j % 2 == 0 else xs[3]  # K +2, +3
        x00, x01 = bf16_halves(b0.to(tl.uint32, bitcast=True), True)
        x10, x11 = bf16_halves(b1.to(tl.uint32, bitcast=True), True)
        lo = s_g0 if j < 2 else s_g1
        hi = s_h0 if j < 2 else s_h1
        # a0 = (row g; K +0, +1) = (v0, v1), a1 = (row g + 8; +0, +1) = (v2, v3),
        # a2 = (row g; +2, +3) = (v4, v5), a3 = (row g + 8; +2, +3) = (v6, v7)
        row_g = (v0[:, :, None, :] * x00[:, None, :, :] + v1[:, :, None, :] * x01[:, None, :, :]
                 + v4[:, :, None, :] * x10[:, None, :, :] + v5[:, :, None, :] * x11[:, None, :, :])
        row_h = (v2[:, :, None, :] * x00[:, None, :, :] + v3[:, :, None, :] * x01[:, None, :, :]
                 + v6[:, :, None, :] * x10[:, None, :, :] + v7[:, :, None, :] * x11[:, None, :, :])
        d_lo += tl.sum(row_g, axis=3) * lo[:, :, None]
        d_hi += tl.sum(row_h, axis=3) * hi[:, :, None]
    # token column 2c + e % 2, row half e // 2 -> fragment order [NW, 8(g), 4(c), 4(e)]
    lo2 = tl.reshape(d_lo, [NW, 8, 4, 2])
    hi2 = tl.reshape(d_hi, [NW, 8, 4, 2])
    frag = tl.permute(tl.join(lo2, hi2), (0, 1, 2, 4, 3))
    return acc + tl.reshape(frag, [NW * 32, 4])


@triton.jit
def mma_block(acc, w, x0, x1, s, NW: tl.constexpr, PTX: tl.constexpr):
    """acc [NW * 32, 4] fp32 += one block per warp times up to 8 token rows (fragment order, see
    the module docstring; rows past NW * 32 are further blocks of the same lanes): w int32 words,
    x0 / x1 int32 bf16 pairs of the lane's token at K 8c .. 8c + 7 of groups 0 / 1, s the lane's
    int32 word of biased scale bytes (the same in all 4 columns)."""
    if PTX:
        acc = tl.inline_asm_elementwise(MMA_BLOCK_PTX, "=f,=f,=f,=f," + "r," * 16 + "f,f,f,f",
                                        [w, x0, x1, s, acc], dtype=tl.float32, is_pure=True, pack=4)
    else:
        acc = _emulate(acc, w, x0, x1, s, NW)
    return acc


@triton.jit
def fragment_index(NW: tl.constexpr, DEPTH: tl.constexpr = 1):
    """(d, g, c, e) of the fragment-order [DEPTH * NW * 32, 4] tensors: row d * NW * 32 + r is
    block d of lane r % 32 (= 4g + c) of warp r // 32 (Triton repeats a [NW * 32, 4] thread tile
    down the rows, so all DEPTH rows of a lane are its registers), column e its register e."""
    row = tl.arange(0, DEPTH * NW * 32)[:, None]
    r = row % (NW * 32)
    return row // (NW * 32), (r // 4) % 8, r % 4, tl.arange(0, 4)[None, :]


_PREFETCH_LINE = tl.constexpr("{\n.reg .pred p;\nsetp.ne.b32 p, $2, 0;\n@p prefetch.global.L2 [$1];\nmov.b32 $0, 0;\n}")


@triton.jit
def _prefetch_lines(ptrs, flag):
    """Ask L2 for the 128-byte line at each pointer whose flag is set (no wait, no registers)."""
    tl.inline_asm_elementwise(_PREFETCH_LINE, "=r,l,r", [ptrs.to(tl.int64, bitcast=True), flag.to(tl.int32)],
                              dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def _prefetch_step(w_ptrs, s_ptrs, w_lead, s_lead, step, n_steps, DEPTH: tl.constexpr):
    """L2 prefetch of step ``step`` (clamped) of each warp's weight and scale streams: lanes 0, 8,
    16, 24 of every block for the 4 lines of its words, lane 0 of every 4th block for the scales."""
    k = tl.minimum(step, n_steps - 1) * DEPTH
    _prefetch_lines(w_ptrs + k * 128, w_lead)
    _prefetch_lines(s_ptrs + k * 8, s_lead)


@triton.jit
def _load_step(w_ptrs, s_ptrs, x_ptrs, step, n_steps, DEPTH: tl.constexpr):
    """Step ``step`` of block_stream's loads (clamped to the last step: a prefetch past the end
    re-reads it, so no load needs a mask)."""
    k = tl.minimum(step, n_steps - 1) * DEPTH
    return (tl.load(w_ptrs + k * 128), tl.load(s_ptrs + k * 8), tl.load(x_ptrs + k * 32),
            tl.load(x_ptrs + k * 32 + 16))


@triton.jit
def block_stream(acc, w_rows, s_rows, x_rows, kb_begin, n_steps, NW: tl.constexpr, DEPTH: tl.constexpr,
                 PTX: tl.constexpr, PREFETCH: tl.constexpr = 0):
    """acc [DEPTH * NW * 32, 4] += the K blocks kb_begin .. kb_begin + n_steps * DEPTH - 1 of each
    warp's row block times x (fragment order; rows of depth d accumulate blocks d, d + DEPTH, ..:
    ``fold`` sums them). n_steps >= 1.

    w_rows [DEPTH * NW * 32, 1]: int32 pointer to each warp's row block's first word (its K blocks
    follow each other, 128 words apart); s_rows: int32 pointer to its first scale word (8 words a
    block); x_rows: int32 pointer to the K-block-0 pair of the lane's token row (token g of its
    group; any readable row for tokens that take no part: their columns are never stored).
    DEPTH blocks are loaded per step, the next step's while this one is multiplied (registers, no
    shared memory); with PREFETCH > 0 (CUDA) the step PREFETCH ahead is asked into L2 first, so
    those register loads wait on L2 rather than DRAM latency."""
    d, g, c, e = fragment_index(NW, DEPTH)
    w_ptrs = w_rows + kb_begin * 128 + ((g * 4 + c) * 4 + d * 128 + e)
    s_ptrs = s_rows + kb_begin * 8 + (g + d * 8 + e * 0)
    x_ptrs = x_rows + kb_begin * 32 + (c * 4 + d * 32 + e)
    # prefetch pointers and flags one per lane row ([R, 1]: no layout conversion in the loop)
    w_pf = w_rows + kb_begin * 128 + ((g * 4 + c) * 4 + d * 128)
    s_pf = s_rows + kb_begin * 8 + d * 8
    w_lead = (c == 0) & (g % 2 == 0)
    s_lead = (c == 0) & (g == 0) & (d % 4 == 0)
    if PREFETCH > 0:
        for p in tl.static_range(PREFETCH):
            _prefetch_step(w_pf, s_pf, w_lead, s_lead, p, n_steps, DEPTH)
    wa, sa, xa0, xa1 = _load_step(w_ptrs, s_ptrs, x_ptrs, 0, n_steps, DEPTH)
    for it in range(n_steps // 2):  # two steps a turn: the buffers swap roles instead of being copied
        if PREFETCH > 0:
            _prefetch_step(w_pf, s_pf, w_lead, s_lead, 2 * it + PREFETCH, n_steps, DEPTH)
        wb, sb, xb0, xb1 = _load_step(w_ptrs, s_ptrs, x_ptrs, 2 * it + 1, n_steps, DEPTH)
        acc = mma_block(acc, wa, xa0, xa1, sa, NW * DEPTH, PTX)
        if PREFETCH > 0:
            _prefetch_step(w_pf, s_pf, w_lead, s_lead, 2 * it + 1 + PREFETCH, n_steps, DEPTH)
        wa, sa, xa0, xa1 = _load_step(w_ptrs, s_ptrs, x_ptrs, 2 * it + 2, n_steps, DEPTH)
        acc = mma_block(acc, wb, xb0, xb1, sb, NW * DEPTH, PTX)
    if n_steps % 2:
        acc = mma_block(acc, wa, xa0, xa1, sa, NW * DEPTH, PTX)
    return acc


@triton.jit
def fold(acc, NW: tl.constexpr, DEPTH: tl.constexpr):
    """[DEPTH * NW * 32, 4] accumulators of block_stream -> [NW * 32, 4] (their sum, fixed order)."""
    if DEPTH == 1:
        out = acc
    else:
        out = tl.sum(tl.reshape(acc, [DEPTH, NW * 32, 4]), axis=0)
    return out


def aot_specs() -> list:
    """None of its own: these are helpers, compiled (and covered) through the kernels that call them."""
    return []
