"""The ``mxfp4_mma`` / ``mxfp8_mma`` weight layouts' block product: MX weights decoded straight into
tensor-core operand registers (formats.py documents the layouts).

A block is 16 weight rows x 64 K values = 128 int32 words + 32 scale bytes; one warp streams one
block per call: lane l = 4g + c holds words 4l..4l+3, word j the 8 values the lane's A fragment of
``mma.sync.m16n8k16`` k-step j wants (rows g and g + 8), bits pre-placed as in ``mxfp4_words``, so
a word decodes with 9 integer instructions (SASS) and 4 ``mul.bf16x2`` by the group scale into the
four A registers: no shared-memory round trip, no re-packing of 16-bit halves. The B operand is the
lane's x pairs (token g, 8 consecutive K values per 32-group), so one call multiplies the block by
up to 8 token rows. Scale bytes are stored biased (``E = s + 126``: the bf16 exponent that turns
the decode's v * 2^-126 into v * 2^(s - 127)).

Every tensor here is in *fragment order*: [DEPTH * NW * 32, 4], row d * NW * 32 + r block d of
lane r % 32 of warp r // 32, column e its register e. Every operand load is contiguous along the 4
columns (128-bit words; the lane's 4 scale bytes as one uint8 [R, 4] load, which Triton packs into
one register and ``scale_words`` turns into 4 registers at once), so Triton gives each thread one
row: the inline PTX relies on that, and nothing after it reshapes or reduces across rows
(tests/test_kernels_aot.py checks the layout of every PTX launch). The accumulator's register e of
lane (g, c) is row g + 8 * (e // 2) of the block, token column 2c + e % 2.

An ``mxfp8_mma`` block is the same 16 x 64 values in 256 words (8 a lane, two 128-bit loads): per
k-step a word of row g and one of row g + 8, 4 values each, decoded with 5 integer instructions
and 2 ``mul.bf16x2`` into two A registers (scale bytes biased by 120: e4m3 decodes as v * 2^-120).

The interpreter and non-NVIDIA targets run ``_emulate``: the same decode of the same operands, the
products summed in fp32 in an order of its own, written with few whole-tensor ops (the interpreter's time
follows their count).
"""

from __future__ import annotations

import os

import triton
import triton.language as tl

from ..formats import MMA8_SCALE_BIAS, MMA_SCALE_BIAS
from .mx_decode import bf16_halves, mxfp4_word_pairs, mxfp4_words_ptx

TOKENS = tl.constexpr(8)  # token columns of one mma (the B operand's N)
# The decode places e4m3 / e2m1 values as bf16 bits of v * 2^-bias (formats.MMA8_SCALE_BIAS / MMA_SCALE_BIAS);
# the emulation multiplies the bias back, exactly (e4m3 subnormals and e2m1's 0.5 are fp32 subnormals there).
FP8_BIAS, FP4_BIAS = tl.constexpr(MMA8_SCALE_BIAS), tl.constexpr(MMA_SCALE_BIAS)
FP8_UNBIAS, FP4_UNBIAS = tl.constexpr(2.0 ** MMA8_SCALE_BIAS), tl.constexpr(2.0 ** MMA_SCALE_BIAS)
# Diagnostics only (wrong numerics), read once per process (benchmarks: what the decode and the mma cost).
# MINIMAX_OPS_DIAG_NO_DECODE: blocks folded into the accumulator with XORs and converts instead of decoded
# and multiplied, the loads kept; 1 (or mxfp4): mxfp4_mma blocks, mxfp8: mxfp8_mma blocks, all: both.
# MINIMAX_OPS_DIAG_MXFP4: one half of the mxfp4_mma block product kept: decode_only (the words decoded, the
# mma replaced by three lop3 a word folding its operands into the accumulators), mma_only (the mma on the
# raw words and scale words, no decode).
_DIAG = os.environ.get("MINIMAX_OPS_DIAG_NO_DECODE", "")
DIAG_NO_DECODE = tl.constexpr(_DIAG in ("1", "mxfp4", "all"))
DIAG_NO_DECODE_FP8 = tl.constexpr(_DIAG in ("mxfp8", "all"))
_DIAG_MXFP4 = os.environ.get("MINIMAX_OPS_DIAG_MXFP4", "")
if _DIAG_MXFP4 not in ("", "decode_only", "mma_only"):
    raise ValueError(f"MINIMAX_OPS_DIAG_MXFP4: expected decode_only or mma_only, got {_DIAG_MXFP4!r}")

# One call: $0..$3 accumulators out, $4..$7 the lane's 4 words (k-steps 0..3), $8..$11 x pairs of
# group 0 (K 8c .. 8c + 7 of the block's first 32), $12..$15 of group 1, $16..$19 the lane's scale
# words (``scale_words``: rows g / g + 8 of group 0 in $16 / $18, of group 1 in $17 / $19), $20..$23
# accumulators in.
_MMA = "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {{$0, $1, $2, $3}}, {{a0, a1, a2, a3}}, {{{b0}, {b1}}}, {{{c}}};\n"


def _decode_mma(w: str, lo: str, hi: str, b0: str, b1: str, c: str, part: str = "") -> str:
    """One word into a0..a3 (rows g, g + 8, g, g + 8: scales lo, hi, lo, hi), then its k-step's mma
    (``part``: the diagnostics' halves, see MINIMAX_OPS_DIAG_MXFP4)."""
    if part == "mma_only":
        raw = f"mov.b32 a0, {w};\nmov.b32 a1, {lo};\nmov.b32 a2, {w};\nmov.b32 a3, {hi};\n"
        return raw + _MMA.format(b0=b0, b1=b1, c=c)
    decode = mxfp4_words_ptx(w, ("a0", "a1", "a2", "a3"), (lo, hi, lo, hi))
    if part == "decode_only":
        first = "" if c == _ACC else "mov.b32 $0, $20;\nmov.b32 $1, $21;\nmov.b32 $2, $22;\nmov.b32 $3, $23;\n"
        return (decode + first + f"lop3.b32 $0, $0, a0, a1, 0x96;\nlop3.b32 $1, $1, a2, a3, 0x96;\n"
                f"lop3.b32 $2, $2, {b0}, {b1}, 0x96;\n")
    return decode + _MMA.format(b0=b0, b1=b1, c=c)


# The lane's 4 scale bytes (one packed register) -> 4 bf16x2 scale words, column e the bf16 whose
# exponent field is byte e (the biased E above), in both halves. Done where the bytes are loaded
# (``scale_words``), so that a load step carried over a loop turn holds 32-bit values: a uint8 tensor
# carried in registers becomes a register per byte, repacked before every use.
SCALE_WORDS_PTX = tl.constexpr("{\n.reg .b32 z;\nmov.b32 z, 0;\n" + "".join(
    f"prmt.b32 ${e}, $4, z, 0x4{e}4{e};\nshl.b32 ${e}, ${e}, 7;\n" for e in range(4)) + "}")
_ACC_IN = "$20, $21, $22, $23"
_ACC = "$0, $1, $2, $3"


def _mxfp4_block_ptx(part: str = "") -> str:
    """The mxfp4_mma block product's PTX (``part``: a diagnostic's half, see MINIMAX_OPS_DIAG_MXFP4)."""
    return ("{\n.reg .b32 t, u, a0, a1, a2, a3;\n"
            # group 0 (k-steps 0, 1): row g scale $16, row g + 8 scale $18; group 1: $17, $19
            + _decode_mma(w="$4", lo="$16", hi="$18", b0="$8", b1="$9", c=_ACC_IN, part=part)
            + _decode_mma(w="$5", lo="$16", hi="$18", b0="$10", b1="$11", c=_ACC, part=part)
            + _decode_mma(w="$6", lo="$17", hi="$19", b0="$12", b1="$13", c=_ACC, part=part)
            + _decode_mma(w="$7", lo="$17", hi="$19", b0="$14", b1="$15", c=_ACC, part=part)
            + "}")


MMA_BLOCK_PTX = tl.constexpr(_mxfp4_block_ptx(_DIAG_MXFP4))


# The bit masks of an mxfp8_mma word's decode into bf16 pairs: one source for MMA8_BLOCK_PTX and its
# emulation (``_fp8_values``).
KEEP8, TOP8, LOW8 = tl.constexpr(0x87F087F0), tl.constexpr(0x80F080F0), tl.constexpr(0x07000700)


# mxfp8_mma: $4..$7 the lane's words of k-steps 0, 1 (row g, row g + 8, row g, row g + 8), $8..$11
# of k-steps 2, 3, $12..$19 x pairs of groups 0 / 1, $20..$23 the scale words, $24..$27 accumulators in.
def _decode8(w: str, lo: str, hi: str, sc: str) -> str:
    """One mxfp8_mma word -> bf16x2 pairs lo (values 0, 1) and hi (2, 3), times the scale pair sc."""
    return (f"and.b32 {lo}, {w}, {KEEP8.value:#x};\nshl.b32 t, {w}, 4;\nshr.b32 u, {w}, 4;\n"
            f"and.b32 u, u, {LOW8.value:#x};\n"
            f"lop3.b32 {hi}, t, u, m, 0xEC;\nmul.rn.bf16x2 {lo}, {lo}, {sc};\nmul.rn.bf16x2 {hi}, {hi}, {sc};\n")


def _decode8_mma(wg: str, wh: str, lo: str, hi: str, b0: str, b1: str, c: str) -> str:
    """One k-step: row g's word into a0 / a2, row g + 8's into a1 / a3 (scales lo / hi), then its mma."""
    return _decode8(wg, "a0", "a2", lo) + _decode8(wh, "a1", "a3", hi) + _MMA.format(b0=b0, b1=b1, c=c)


MMA8_BLOCK_PTX = tl.constexpr(
    f"{{\n.reg .b32 t, u, m, a0, a1, a2, a3;\nmov.b32 m, {TOP8.value:#x};\n"
    + _decode8_mma("$4", "$5", "$20", "$22", "$12", "$13", "$24, $25, $26, $27")
    + _decode8_mma("$6", "$7", "$20", "$22", "$14", "$15", _ACC)
    + _decode8_mma("$8", "$9", "$21", "$23", "$16", "$17", _ACC)
    + _decode8_mma("$10", "$11", "$21", "$23", "$18", "$19", _ACC)
    + "}")


@triton.jit
def scale_words(s, PTX: tl.constexpr):
    """Loaded scale bytes (uint8 [R, 4]) as the block product takes them: with PTX the lane's 4 bf16x2
    scale words (int32 [R, 4], see SCALE_WORDS_PTX), otherwise the bytes as they are (``_emulate``)."""
    if PTX:
        s = tl.inline_asm_elementwise(SCALE_WORDS_PTX, "=r,=r,=r,=r,r", [s], dtype=tl.int32, is_pure=True, pack=4)
    return s


@triton.jit
def _rows_by_half(t, NW: tl.constexpr):
    """[NW, 8 (g), 4 (c), 4 (k-step), 2 (h)] -> [NW, 16 (row g + 8h), 4, 4]: the block's rows on one axis."""
    return tl.reshape(tl.permute(t, (0, 4, 1, 2, 3)), [NW, 16, 4, 4])


@triton.jit
def _fp8_values(w, w_hi, NW: tl.constexpr):
    """mxfp8_mma words (k-steps 0, 1 in ``w``, 2, 3 in ``w_hi``, formats.pack_mxfp8_words) -> (lo, hi) fp32
    [NW, 16 (row), 4 (c), 4 (k-step j), 2 (q)]: row r's values at K + 2q (lo) and K + 2q + 1 (hi) of k-step j.
    A word's bits as MMA8_BLOCK_PTX places them: bf16 pairs (K + 0, + 1) and (K + 2, + 3) of value * 2^-120."""
    wg, wh = _by_step(w, w_hi, NW)
    u = _rows_by_half(tl.join(wg, wh), NW).to(tl.uint32, bitcast=True)
    p = tl.join(u & KEEP8, ((u << 4) & TOP8) | ((u >> 4) & LOW8))
    lo, hi = bf16_halves(p, True)
    return lo * FP8_UNBIAS, hi * FP8_UNBIAS


@triton.jit
def _fp4_values(w, NW: tl.constexpr):
    """mxfp4_mma words (word j: k-step j) -> (lo, hi) as ``_fp8_values``: pairs 0 / 1 of a word are rows g /
    g + 8 at K + 0, + 1, pairs 2 / 3 the same rows at K + 2, + 3 (mxfp4_word_pairs)."""
    p0, p1, p2, p3 = mxfp4_word_pairs(w.to(tl.uint32, bitcast=True))
    p = tl.reshape(tl.join(tl.join(p0, p1), tl.join(p2, p3)), [NW, 8, 4, 4, 2, 2])  # [.., j, h, q]
    p = tl.reshape(tl.permute(p, (0, 4, 1, 2, 3, 5)), [NW, 16, 4, 4, 2])
    lo, hi = bf16_halves(p, True)
    return lo * FP4_UNBIAS, hi * FP4_UNBIAS


@triton.jit
def _by_step(a, b, NW: tl.constexpr):
    """Two [R, 4] operands of a block's k-step halves (``a`` k-steps 0, 1 and ``b`` 2, 3, two slots a
    step) -> (even, odd) [NW, 8, 4, 4]: last axis the k-step j, holding slot 2 (j % 2) / 2 (j % 2) + 1 of
    ``a`` (j < 2) or ``b``."""
    ab = tl.join(tl.reshape(a, [NW, 8, 4, 2, 2]), tl.reshape(b, [NW, 8, 4, 2, 2]))  # [.., j % 2, slot % 2, j // 2]
    even, odd = tl.split(tl.permute(ab, (0, 1, 2, 5, 3, 4)))  # split on slot % 2
    return tl.reshape(even, [NW, 8, 4, 4]), tl.reshape(odd, [NW, 8, 4, 4])


@triton.jit
def _emulate(acc, w, w_hi, x0, x1, s, NW: tl.constexpr, FP8: tl.constexpr):
    """MMA_BLOCK_PTX / MMA8_BLOCK_PTX with whole-tensor ops (fragment order in and out), the four
    k-steps and both row halves at once: weights as [warp, row (g + 8h), c, k-step j, K pair q], x as
    [warp, token, c, j, q], the products [warp, row, token, c, j, q] summed over q and c, times the row's
    group scale, summed over the k-steps in order."""
    if FP8:
        lo, hi = _fp8_values(w, w_hi, NW)
    else:
        lo, hi = _fp4_values(w, NW)
    # x pairs of k-step j (token g of the lane's row axis): K + 0, + 1 (q = 0) and + 2, + 3 (q = 1) of group j // 2
    b0, b1 = _by_step(x0, x1, NW)
    x_lo, x_hi = bf16_halves(tl.join(b0, b1).to(tl.uint32, bitcast=True), True)  # [NW, token, c, j, q]
    # scale of (row g + 8h, group j // 2) as fp32: 2^(s - 127), s = E - formats.MMA_SCALE_BIAS / MMA8_SCALE_BIAS
    BIAS: tl.constexpr = FP8_BIAS if FP8 else FP4_BIAS
    byte = tl.reshape(s, [NW, 8, 4, 4]).to(tl.int32)  # column e: byte 4g + e of the block, e = 2h + group
    sc = tl.max((((byte - BIAS) << 23).to(tl.float32, bitcast=True)), axis=2)  # [NW, 8, e]: equal over c
    sc = tl.reshape(tl.permute(tl.reshape(sc, [NW, 8, 2, 2]), (0, 2, 1, 3)), [NW, 16, 2])  # [NW, row, group]
    sc = tl.reshape(tl.join(sc, sc), [NW, 16, 4])  # [NW, row, j]
    prod = lo[:, :, None] * x_lo[:, None] + hi[:, :, None] * x_hi[:, None]  # [NW, row, token, c, j, q]
    d = tl.sum(tl.sum(tl.sum(prod, axis=5), axis=3) * sc[:, :, None, :], axis=3)  # [NW, row, token]
    # row g + 8h, token column 2c + e % 2 -> fragment order [NW, 8 (g), 4 (c), 4 (e = 2h + e % 2)]
    frag = tl.permute(tl.reshape(d, [NW, 2, 8, 4, 2]), (0, 2, 3, 1, 4))
    return acc + tl.reshape(frag, [NW * 32, 4])


@triton.jit
def mma_block(acc, w, w_hi, x0, x1, s, NW: tl.constexpr, PTX: tl.constexpr, FP8: tl.constexpr = False):
    """acc [NW * 32, 4] fp32 += one block per warp times up to 8 token rows (fragment order, see
    the module docstring; rows past NW * 32 are further blocks of the same lanes): w int32 words
    (FP8: the words of k-steps 0, 1 and w_hi those of 2, 3; MXFP4 ignores w_hi), x0 / x1 int32
    bf16 pairs of the lane's token at K 8c .. 8c + 7 of groups 0 / 1, s ``scale_words`` of the lane's
    4 biased scale bytes (uint8, column e byte 4g + e of the block)."""
    if PTX:
        if FP8 and DIAG_NO_DECODE_FP8:
            acc = acc + (w ^ w_hi ^ x0 ^ x1).to(tl.float32) + s.to(tl.float32)
        elif FP8:
            acc = tl.inline_asm_elementwise(MMA8_BLOCK_PTX, "=f,=f,=f,=f," + "r," * 20 + "f,f,f,f",
                                            [w, w_hi, x0, x1, s, acc], dtype=tl.float32, is_pure=True, pack=4)
        elif DIAG_NO_DECODE:
            acc = acc + (w ^ x0 ^ x1).to(tl.float32) + s.to(tl.float32)
        else:
            acc = tl.inline_asm_elementwise(MMA_BLOCK_PTX, "=f,=f,=f,=f," + "r," * 16 + "f,f,f,f",
                                            [w, x0, x1, s, acc], dtype=tl.float32, is_pure=True, pack=4)
    else:
        acc = _emulate(acc, w, w_hi, x0, x1, s, NW, FP8)
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
def prefetch_step(w_ptrs, s_ptrs, w_lead, s_lead, step, n_steps, DEPTH: tl.constexpr, FP8: tl.constexpr = False):
    """L2 prefetch of step ``step`` (clamped) of each warp's weight and scale streams: lanes 0, 8,
    16, 24 of every block for the 4 lines of its words (8 for FP8 blocks), lane 0 of every 4th
    block for the scales (pointers and flags from ``stream_pointers``)."""
    WORDS: tl.constexpr = 256 if FP8 else 128
    k = tl.minimum(step, n_steps - 1) * DEPTH
    _prefetch_lines(w_ptrs + k * WORDS, w_lead)
    if FP8:
        _prefetch_lines(w_ptrs + k * WORDS + 128, w_lead)
    _prefetch_lines(s_ptrs + k * 32, s_lead)


@triton.jit
def _prefetch_streams(w_pf, s_pf, w_lead, s_lead, w_pair, s_pair, step, n_steps, DEPTH: tl.constexpr,
                      FP8: tl.constexpr, PAIR: tl.constexpr):
    """prefetch_step of the stream, and with PAIR of the second one beside it."""
    prefetch_step(w_pf, s_pf, w_lead, s_lead, step, n_steps, DEPTH, FP8)
    if PAIR:
        prefetch_step(w_pf + w_pair, s_pf + s_pair, w_lead, s_lead, step, n_steps, DEPTH, FP8)


@triton.jit
def _load_blocks(w_ptrs, s_ptrs, k, FP8: tl.constexpr, PTX: tl.constexpr, mask=None,
                 EVICT_FIRST: tl.constexpr = False):
    """Words, FP8's second words (= the words for MXFP4) and scales (``scale_words``) of the blocks
    at K block k (nothing read where a mask is given and false); EVICT_FIRST: with L2's evict-first policy."""
    WORDS: tl.constexpr = 256 if FP8 else 128
    POLICY: tl.constexpr = "evict_first" if EVICT_FIRST else ""
    w = tl.load(w_ptrs + k * WORDS, mask=mask, eviction_policy=POLICY)
    if FP8:
        w_hi = tl.load(w_ptrs + k * WORDS + 128, mask=mask, eviction_policy=POLICY)
    else:
        w_hi = w
    return w, w_hi, scale_words(tl.load(s_ptrs + k * 32, mask=mask, eviction_policy=POLICY), PTX)


@triton.jit
def _load_x(x_ptrs, y_ptrs, k, GROUPS: tl.constexpr):
    """The x pairs of one or two token groups at K block k."""
    x0 = tl.load(x_ptrs + k * 32)
    x1 = tl.load(x_ptrs + k * 32 + 16)
    if GROUPS == 2:
        y0 = tl.load(y_ptrs + k * 32)
        y1 = tl.load(y_ptrs + k * 32 + 16)
    else:
        y0, y1 = x0, x1
    return x0, x1, y0, y1


@triton.jit
def _weight_pointers(w_rows, s_rows, kb_begin, NW: tl.constexpr, DEPTH: tl.constexpr, FP8: tl.constexpr):
    """Each lane's word and scale pointers into its block of K block kb_begin, in fragment order."""
    WORDS: tl.constexpr = 256 if FP8 else 128
    d, g, c, e = fragment_index(NW, DEPTH)
    w_ptrs = w_rows + kb_begin * WORDS + ((g * 4 + c) * 4 + d * WORDS + e)
    s_ptrs = s_rows + kb_begin * 32 + (4 * g + d * 32 + e)  # bytes 4g .. 4g + 3: one 32-bit load
    return w_ptrs, s_ptrs


@triton.jit
def first_blocks(w_rows, s_rows, kb_begin, valid, NW: tl.constexpr, DEPTH: tl.constexpr, FP8: tl.constexpr,
                 PTX: tl.constexpr, EVICT_FIRST: tl.constexpr = False):
    """Step 0 of a single-stream block_stream's weights (pass them as its ``first``), read where ``valid``
    (a scalar) holds. The weights do not depend on the previous kernel: a programmatic dependent reads
    them before it waits, so its first DRAM round trip overlaps that kernel's tail instead of following it."""
    w_ptrs, s_ptrs = _weight_pointers(w_rows, s_rows, kb_begin, NW, DEPTH, FP8)
    return _load_blocks(w_ptrs, s_ptrs, 0, FP8, PTX, valid, EVICT_FIRST)


@triton.jit
def first_two_blocks(w_rows, s_rows, kb_begin, valid, n_steps, NW: tl.constexpr, DEPTH: tl.constexpr,
                     FP8: tl.constexpr, PTX: tl.constexpr, EVICT_FIRST: tl.constexpr = False):
    """``first_blocks`` for block_stream's PRELOADED 2: steps 0 and 1 (its ``first``, ``second``) from one set
    of pointers, each read where ``valid`` holds and the program has that many of its n_steps."""
    w_ptrs, s_ptrs = _weight_pointers(w_rows, s_rows, kb_begin, NW, DEPTH, FP8)
    step0 = _load_blocks(w_ptrs, s_ptrs, 0, FP8, PTX, valid & (n_steps > 0), EVICT_FIRST)
    step1 = _load_blocks(w_ptrs, s_ptrs, DEPTH, FP8, PTX, valid & (n_steps > 1), EVICT_FIRST)
    return step0, step1


@triton.jit
def _load_x_at(x_ptrs, y_ptrs, step, n_steps, DEPTH: tl.constexpr, GROUPS: tl.constexpr):
    """The x pairs of load step ``step`` (clamped to the last step, as the weights are)."""
    return _load_x(x_ptrs, y_ptrs, tl.minimum(step, n_steps - 1) * DEPTH, GROUPS)


@triton.jit
def _load_weights(w_ptrs, s_ptrs, w_pair, s_pair, step, n_steps, DEPTH: tl.constexpr, FP8: tl.constexpr,
                  PAIR: tl.constexpr, PTX: tl.constexpr, EVICT_FIRST: tl.constexpr = False):
    """Step ``step`` of block_stream's weight loads (clamped to the last step: a prefetch past the end
    re-reads it, so no load needs a mask): words, FP8's second words and scales; with PAIR the second
    stream's too, otherwise the first's again."""
    k = tl.minimum(step, n_steps - 1) * DEPTH
    w, w_hi, s = _load_blocks(w_ptrs, s_ptrs, k, FP8, PTX, None, EVICT_FIRST)
    if PAIR:
        u, u_hi, us = _load_blocks(w_ptrs + w_pair, s_ptrs + s_pair, k, FP8, PTX, None, EVICT_FIRST)
    else:
        u, u_hi, us = w, w_hi, s
    return w, w_hi, s, u, u_hi, us


@triton.jit
def stream_pointers(w_rows, s_rows, kb_begin, NW: tl.constexpr, DEPTH: tl.constexpr, FP8: tl.constexpr = False):
    """The L2 prefetch pointers and lead-lane flags of block_stream's weight and scale streams
    (one per lane row, [R, 1]: no layout conversion in the loop)."""
    WORDS: tl.constexpr = 256 if FP8 else 128
    d, g, c, e = fragment_index(NW, DEPTH)
    w_pf = w_rows + kb_begin * WORDS + ((g * 4 + c) * 4 + d * WORDS)
    s_pf = s_rows + kb_begin * 32 + d * 32
    return w_pf, s_pf, (c == 0) & (g % 2 == 0), (c == 0) & (g == 0) & (d % 4 == 0)


@triton.jit
def _step_product(acc, acc2, w, w_hi, s, u, u_hi, us, x0, x1, y0, y1, NW: tl.constexpr, PTX: tl.constexpr,
                  FP8: tl.constexpr, GROUPS: tl.constexpr, PAIR: tl.constexpr, HALVES: tl.constexpr):
    """One loaded step of NW * 32 rows into (acc, acc2): acc += w x; acc2 += w y (GROUPS = 2) or
    u x (PAIR; with HALVES the step's two halves of rows one after the other into accumulators of
    NW * 16 rows)."""
    if HALVES:
        R: tl.constexpr = NW * 16
        w_0, w_1 = _halves(w, R)
        h_0, h_1 = _halves(w_hi, R)
        s_0, s_1 = _halves(s, R)
        u_0, u_1 = _halves(u, R)
        uh_0, uh_1 = _halves(u_hi, R)
        us_0, us_1 = _halves(us, R)
        x0_0, x0_1 = _halves(x0, R)
        x1_0, x1_1 = _halves(x1, R)
        acc = mma_block(acc, w_0, h_0, x0_0, x1_0, s_0, NW // 2, PTX, FP8)
        acc2 = mma_block(acc2, u_0, uh_0, x0_0, x1_0, us_0, NW // 2, PTX, FP8)
        acc = mma_block(acc, w_1, h_1, x0_1, x1_1, s_1, NW // 2, PTX, FP8)
        acc2 = mma_block(acc2, u_1, uh_1, x0_1, x1_1, us_1, NW // 2, PTX, FP8)
    else:
        acc = mma_block(acc, w, w_hi, x0, x1, s, NW, PTX, FP8)
        if GROUPS == 2:
            acc2 = mma_block(acc2, w, w_hi, y0, y1, s, NW, PTX, FP8)
        if PAIR:
            acc2 = mma_block(acc2, u, u_hi, x0, x1, us, NW, PTX, FP8)
    return acc, acc2


@triton.jit
def _prefetch_and_load(w_pf, s_pf, w_lead, s_lead, w_ptrs, s_ptrs, w_pair, s_pair, step, n_steps,
                       PREFETCH: tl.constexpr, DEPTH: tl.constexpr, FP8: tl.constexpr, PAIR: tl.constexpr,
                       PTX: tl.constexpr, EVICT_FIRST: tl.constexpr):
    """Step ``step``'s weights (``_load_weights``), after the L2 prefetch of the step PREFETCH - 1
    beyond it."""
    if PREFETCH > 0:
        _prefetch_streams(w_pf, s_pf, w_lead, s_lead, w_pair, s_pair, step - 1 + PREFETCH, n_steps, DEPTH, FP8, PAIR)
    return _load_weights(w_ptrs, s_ptrs, w_pair, s_pair, step, n_steps, DEPTH, FP8, PAIR, PTX, EVICT_FIRST)


@triton.jit
def _late_x_product(acc, acc2, w, w_hi, s, u, u_hi, us, x_ptrs, y_ptrs, step, NW: tl.constexpr, DEPTH: tl.constexpr,
                    PTX: tl.constexpr, FP8: tl.constexpr, GROUPS: tl.constexpr, PAIR: tl.constexpr,
                    HALVES: tl.constexpr):
    """_step_product of load step ``step`` with its x pairs loaded here (block_stream's RING 3)."""
    x0, x1, y0, y1 = _load_x(x_ptrs, y_ptrs, step * DEPTH, GROUPS)
    return _step_product(acc, acc2, w, w_hi, s, u, u_hi, us, x0, x1, y0, y1, NW * DEPTH, PTX, FP8, GROUPS, PAIR,
                         HALVES)


@triton.jit
def _halves(t, R: tl.constexpr):
    """Fragment-order [2R, 4] -> rows [0, R) and [R, 2R), i.e. depths d < D/2 and d >= D/2: each
    thread's own registers (no data moves)."""
    a, b = tl.split(tl.permute(tl.reshape(t, [2, R, 4]), (1, 2, 0)))
    return a, b


@triton.jit
def block_stream(acc, acc2, w_rows, s_rows, x_rows, y_rows, kb_begin, n_steps, NW: tl.constexpr, DEPTH: tl.constexpr,
                 PTX: tl.constexpr, PREFETCH: tl.constexpr = 0, FP8: tl.constexpr = False,
                 SKIP_PREFETCH: tl.constexpr = False, GROUPS: tl.constexpr = 1, PAIR: tl.constexpr = False,
                 w_pair=0, s_pair=0, PRELOADED: tl.constexpr = False, first=None, RING: tl.constexpr = 2,
                 EVICT_FIRST: tl.constexpr = False, second=None):
    """(acc, acc2) [DEPTH * NW * 32, 4] += the K blocks kb_begin .. kb_begin + n_steps * DEPTH - 1
    of each warp's row block times the token group at x_rows (and, GROUPS = 2, the second one at
    y_rows into acc2: the weights are loaded once for both; GROUPS = 1 returns acc2 as given), in
    fragment order; rows of depth d accumulate blocks d, d + DEPTH, ..: ``fold`` sums them.
    n_steps >= 1.

    PAIR (GROUPS = 1): a second weight stream, the row blocks w_pair words / s_pair scale bytes
    after the first (w13's up rows beside its gate rows), times the same x registers into acc2:
    one set of x loads feeds both mma chains, and neither result is held while the other streams.
    A step then loads 2 * DEPTH blocks; with DEPTH > 1 acc and acc2 have DEPTH / 2 * NW * 32 rows
    (set d sums blocks d and d + DEPTH / 2 of each step, fold with DEPTH / 2): the two streams keep
    DEPTH mma chains in flight on half the accumulator registers (``pair_sets``).

    w_rows [DEPTH * NW * 32, 1]: int32 pointer to each warp's row block's first word (its K blocks
    follow each other, 128 words apart; 256 for FP8 = mxfp8_mma); s_rows: uint8 pointer to its first
    scale byte (32 a block); x_rows / y_rows: int32 pointer to the K-block-0 pair of the lane's
    token row (token g of its group; any readable row for tokens that take no part: their columns
    are never stored). DEPTH blocks are loaded per step, the next steps' while this one is
    multiplied (registers, no shared memory: RING below); with PREFETCH > 0 (CUDA) the step PREFETCH ahead is
    asked into L2 first, so those register loads wait on L2 rather than DRAM latency
    (SKIP_PREFETCH: the caller already asked for the first PREFETCH steps, with ``prefetch_step``).
    PRELOADED: ``first`` holds step 0's weights (``first_blocks``, one stream), read by the caller
    before its PDL wait; the same for every pass over the token groups (the K range is the pass's).
    PRELOADED 2 (RING 3): ``second`` holds step 1's too (``first_two_blocks``, read where n_steps > 1), so
    the ring is full at the wait.
    RING: load steps held in registers. 2: the next step's weights and x pairs are loaded while this
    one is multiplied; 3: the next two steps' weights, and each step's x pairs (L1 / L2 hits) only at
    its product, so the third step takes their registers (ExpertTiles.ring). EVICT_FIRST: the weight loads
    with L2's evict-first policy (read once: the rest of L2 keeps what is read again)."""
    tl.static_assert(not PAIR or GROUPS == 1, "block_stream: PAIR takes one token group")
    tl.static_assert(not (PAIR and PRELOADED), "block_stream: a preloaded first step is one stream's")
    HALVES: tl.constexpr = PAIR and pair_sets(DEPTH) < DEPTH
    d, g, c, e = fragment_index(NW, DEPTH)
    w_ptrs, s_ptrs = _weight_pointers(w_rows, s_rows, kb_begin, NW, DEPTH, FP8)
    x_ptrs = x_rows + kb_begin * 32 + (c * 4 + d * 32 + e)
    y_ptrs = y_rows + kb_begin * 32 + (c * 4 + d * 32 + e)
    w_pf, s_pf, w_lead, s_lead = stream_pointers(w_rows, s_rows, kb_begin, NW, DEPTH, FP8)
    if PREFETCH > 0 and not SKIP_PREFETCH:
        for p in tl.static_range(PREFETCH):
            _prefetch_streams(w_pf, s_pf, w_lead, s_lead, w_pair, s_pair, p, n_steps, DEPTH, FP8, PAIR)
    tl.static_assert(RING == 2 or RING == 3, "block_stream: RING is 2 or 3 steps")
    tl.static_assert(PRELOADED != 2 or RING == 3, "block_stream: two preloaded steps take the three-step ring")
    if PRELOADED:
        wa, ha, sa = first
        ua, uha, usa = wa, ha, sa
    else:
        wa, ha, sa, ua, uha, usa = _load_weights(w_ptrs, s_ptrs, w_pair, s_pair, 0, n_steps, DEPTH, FP8, PAIR, PTX,
                                                 EVICT_FIRST)
    if RING == 2:
        xa0, xa1, ya0, ya1 = _load_x(x_ptrs, y_ptrs, 0, GROUPS)
        for it in range(n_steps // 2):  # two steps a turn: the buffers swap roles instead of being copied
            wb, hb, sb, ub, uhb, usb = _prefetch_and_load(w_pf, s_pf, w_lead, s_lead, w_ptrs, s_ptrs, w_pair, s_pair,
                                                          2 * it + 1, n_steps, PREFETCH, DEPTH, FP8, PAIR, PTX,
                                                          EVICT_FIRST)
            xb0, xb1, yb0, yb1 = _load_x_at(x_ptrs, y_ptrs, 2 * it + 1, n_steps, DEPTH, GROUPS)
            acc, acc2 = _step_product(acc, acc2, wa, ha, sa, ua, uha, usa, xa0, xa1, ya0, ya1, NW * DEPTH, PTX, FP8,
                                      GROUPS, PAIR, HALVES)
            wa, ha, sa, ua, uha, usa = _prefetch_and_load(w_pf, s_pf, w_lead, s_lead, w_ptrs, s_ptrs, w_pair, s_pair,
                                                          2 * it + 2, n_steps, PREFETCH, DEPTH, FP8, PAIR, PTX,
                                                          EVICT_FIRST)
            xa0, xa1, ya0, ya1 = _load_x_at(x_ptrs, y_ptrs, 2 * it + 2, n_steps, DEPTH, GROUPS)
            acc, acc2 = _step_product(acc, acc2, wb, hb, sb, ub, uhb, usb, xb0, xb1, yb0, yb1, NW * DEPTH, PTX, FP8,
                                      GROUPS, PAIR, HALVES)
        if n_steps % 2:
            acc, acc2 = _step_product(acc, acc2, wa, ha, sa, ua, uha, usa, xa0, xa1, ya0, ya1, NW * DEPTH, PTX, FP8,
                                      GROUPS, PAIR, HALVES)
    else:
        # Three steps a turn, two in flight while the third is multiplied; the x pairs are loaded at
        # their product (L1 / L2 hits), so the third step's weights take their registers.
        if PRELOADED == 2:
            wb, hb, sb = second
            ub, uhb, usb = wb, hb, sb
        else:
            wb, hb, sb, ub, uhb, usb = _load_weights(w_ptrs, s_ptrs, w_pair, s_pair, 1, n_steps, DEPTH, FP8, PAIR,
                                                     PTX, EVICT_FIRST)
        for it in range(n_steps // 3):
            wc, hc, sc, uc, uhc, usc = _prefetch_and_load(w_pf, s_pf, w_lead, s_lead, w_ptrs, s_ptrs, w_pair, s_pair,
                                                          3 * it + 2, n_steps, PREFETCH, DEPTH, FP8, PAIR, PTX,
                                                          EVICT_FIRST)
            acc, acc2 = _late_x_product(acc, acc2, wa, ha, sa, ua, uha, usa, x_ptrs, y_ptrs, 3 * it, NW, DEPTH, PTX,
                                        FP8, GROUPS, PAIR, HALVES)
            wa, ha, sa, ua, uha, usa = _prefetch_and_load(w_pf, s_pf, w_lead, s_lead, w_ptrs, s_ptrs, w_pair, s_pair,
                                                          3 * it + 3, n_steps, PREFETCH, DEPTH, FP8, PAIR, PTX,
                                                          EVICT_FIRST)
            acc, acc2 = _late_x_product(acc, acc2, wb, hb, sb, ub, uhb, usb, x_ptrs, y_ptrs, 3 * it + 1, NW, DEPTH,
                                        PTX, FP8, GROUPS, PAIR, HALVES)
            wb, hb, sb, ub, uhb, usb = _prefetch_and_load(w_pf, s_pf, w_lead, s_lead, w_ptrs, s_ptrs, w_pair, s_pair,
                                                          3 * it + 4, n_steps, PREFETCH, DEPTH, FP8, PAIR, PTX,
                                                          EVICT_FIRST)
            acc, acc2 = _late_x_product(acc, acc2, wc, hc, sc, uc, uhc, usc, x_ptrs, y_ptrs, 3 * it + 2, NW, DEPTH,
                                        PTX, FP8, GROUPS, PAIR, HALVES)
        done = n_steps // 3 * 3
        if n_steps - done >= 1:
            acc, acc2 = _late_x_product(acc, acc2, wa, ha, sa, ua, uha, usa, x_ptrs, y_ptrs, done, NW, DEPTH, PTX,
                                        FP8, GROUPS, PAIR, HALVES)
        if n_steps - done == 2:
            acc, acc2 = _late_x_product(acc, acc2, wb, hb, sb, ub, uhb, usb, x_ptrs, y_ptrs, done + 1, NW, DEPTH,
                                        PTX, FP8, GROUPS, PAIR, HALVES)
    return acc, acc2


@triton.constexpr_function
def pair_sets(depth):
    """Accumulator sets per stream of a PAIR block_stream of depth ``depth`` (its rows / (NW * 32))."""
    return depth // 2 if depth > 1 else 1


@triton.jit
def fold(acc, NW: tl.constexpr, DEPTH: tl.constexpr):
    """[DEPTH * NW * 32, 4] accumulators of block_stream -> [NW * 32, 4] (their sum, fixed order)."""
    if DEPTH == 1:
        out = acc
    else:
        out = tl.sum(tl.reshape(acc, [DEPTH, NW * 32, 4]), axis=0)
    return out


@triton.jit
def warp_rows(NW: tl.constexpr, DEPTH: tl.constexpr):
    """Warp index of each row of a fragment-order [DEPTH * NW * 32, 4] tensor, [R, 1]."""
    return (tl.arange(0, DEPTH * NW * 32)[:, None] % (NW * 32)) // 32


@triton.jit
def warp_parts(NW: tl.constexpr, DEPTH: tl.constexpr, KS: tl.constexpr):
    """(row block of the program, K part) of each row of a fragment-order [DEPTH * NW * 32, 4] tensor
    whose NW warps stream NW // KS row blocks in KS parts of K each (warp w: row block w % (NW // KS),
    part w // (NW // KS)), [R, 1] each. KS = 1: every warp its own row block, all of K."""
    w = warp_rows(NW, DEPTH)
    return w % (NW // KS), w // (NW // KS)


@triton.jit
def fold_warps(acc, NW: tl.constexpr, KS: tl.constexpr):
    """Folded [NW * 32, 4] accumulators of warps streaming KS K parts (``warp_parts``) ->
    [NW // KS * 32, 4]: their sum in a fixed order, through shared memory, so a K split inside a
    program needs no fp32 partials in global memory and no arrival counter (splitk.py)."""
    if KS == 1:
        out = acc
    else:
        out = tl.sum(tl.reshape(acc, [KS, NW // KS * 32, 4]), axis=0)
    return out


def aot_specs() -> list:
    """None of its own: these are helpers, compiled (and covered) through the kernels that call them."""
    return []
