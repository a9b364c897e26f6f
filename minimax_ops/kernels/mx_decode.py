"""MX weight decode and the weight-streaming K loop shared by the GEMV and the expert kernels.

- The weight tile [BLOCK_N, BLOCK_K] is loaded as whole 32-bit words (4 fp8 or 8 e2m1 values) and
  decoded with a few shifts and masks per *pair* of values: each mask leaves two bf16 bit patterns
  (one per 16-bit half) that are the element times a fixed power of two (2^-120 for e4m3,
  2^-126 for e2m1; e4m3 and e2m1 subnormals land on bf16 subnormals). One bf16 multiply by
  ``2^(scale - 127 + bias)`` per value then gives the exact dequantised weight; the E8M0 scale is
  loaded once per 32-value group and broadcast. On NVIDIA sm_90+ MXFP4 decodes in inline PTX
  (``_PTX_MXFP4*``: same bits, but the pairs stay packed in bf16x2 registers); AMD and the
  interpreter run the portable Triton decode.
- ``stream_rows`` multiplies x [BLOCK_M, BLOCK_K] tiles (16 token rows, padding rows masked off, so
  they cost no memory traffic) by the decoded tiles on tensor cores in bf16 with fp32
  accumulation, weights as the A operand (wgmma on Hopper): 1..16 tokens cost the same per value.
  All loads of the K loop are software-pipelined (cp.async) by Triton.
- Layouts (formats.LAYOUTS): rows of a canonical or ``mxfp4_words`` weight are addressed by row
  pointers; a tiled weight (TILE_N > 0) by tile-row pointers, advancing one whole [TILE_N, BLOCK_K]
  tile per K step, so each step reads one contiguous block.
Decoding is exact for E8M0 scales 10..128 (MXFP4, 2^-117..2^1) and 10..134 (MXFP8): larger
scales saturate at 2^1 / 2^7 (real checkpoints sit far inside).
"""

from __future__ import annotations

import dataclasses
import functools
import os

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from ..constants import MX_BLOCK
from ..formats import (FMT_BF16, FMT_MXFP4, FMT_MXFP4_WORDS, FMT_MXFP8, WeightLayout, logical_shape, tile_shape,
                       weight_layout)

__all__ = ["gdc_launch_dependents", "gdc_wait"]  # re-exported for the kernels that launch with PDL

FORMAT_NAMES = {FMT_BF16: "bf16", FMT_MXFP8: "mxfp8", FMT_MXFP4: "mxfp4", FMT_MXFP4_WORDS: "mxfp4w"}
POINTER_TYPES = {FMT_BF16: "*bf16", FMT_MXFP8: "*i32", FMT_MXFP4: "*i32", FMT_MXFP4_WORDS: "*i32"}


@triton.jit
def bf16_halves(p, F32: tl.constexpr):
    """uint32 holding two bf16 bit patterns -> (low, high) values; bf16, or with F32 the same
    values as fp32 (bits << 16: exact, subnormals included)."""
    if F32:
        lo = (p << 16).to(tl.float32, bitcast=True)
        hi = (p & 0xFFFF0000).to(tl.float32, bitcast=True)
    else:
        lo = p.to(tl.uint16).to(tl.bfloat16, bitcast=True)
        hi = (p >> 16).to(tl.uint16).to(tl.bfloat16, bitcast=True)
    return lo, hi


@triton.jit
def mxfp4_word_pairs(w):
    """An ``mxfp4_words`` word (uint32) -> its four bf16x2 bit patterns: pair j holds values 2j and
    2j + 1, each e2m1 value placed as bf16 bits (c & 8) << 12 | (c & 7) << 6 = value * 2^-126.
    The placement is formats._WORD_PAIRS: pairs 0-2 a rotate and a mask, pair 3 a rotate and two
    masks, 9 integer instructions (SASS) a word. The bits that the rotates by 2 and 6 wrap around
    are masked off, so pairs 0, 1 are plain shifts (ptxas may issue those as IMAD.SHL on the FMA pipe,
    easing the integer ALU pipe that the other decode instructions share)."""
    p0 = (w << 2) & 0x81C081C0
    p1 = (w << 6) & 0x81C081C0
    p2 = ((w << 12) | (w >> 20)) & 0x81C081C0
    p3 = (w & 0x81808180) | (((w << 8) | (w >> 24)) & 0x00400040)
    return p0, p1, p2, p3


def mxfp4_words_ptx(word: str, outs: tuple[str, str, str, str], scales: tuple[str, str, str, str]) -> str:
    """PTX of mxfp4_word_pairs on register ``word``: out j = pair j times bf16x2 register scales[j]
    (temporaries t, u must be declared by the caller). ``shf.l.wrap`` is the rotate and the rotate by
    8 of pair 3 a byte permute; pairs 0, 1 shift (see mxfp4_word_pairs)."""
    pairs = [f"shl.b32 t, {word}, 2;\nand.b32 t, t, 0x81C081C0;",
             f"shl.b32 t, {word}, 6;\nand.b32 t, t, 0x81C081C0;",
             f"shf.l.wrap.b32 t, {word}, {word}, 12;\nand.b32 t, t, 0x81C081C0;",
             f"prmt.b32 u, {word}, {word}, 0x2103;\nand.b32 u, u, 0x00400040;\nand.b32 t, {word}, 0x81808180;\n"
             f"or.b32 t, t, u;"]
    return "".join(f"{p}\nmul.rn.bf16x2 {o}, t, {sc};\n" for p, o, sc in zip(pairs, outs, scales))


@triton.jit
def _decode_words(words, scales, FMT: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                  F32: tl.constexpr, SCALED: tl.constexpr):
    """int32 words [BLOCK_N, BLOCK_K / values-per-word] + uint8 E8M0 scales [BLOCK_N, BLOCK_K / 32]
    -> exactly dequantised bf16 weights [BLOCK_N, BLOCK_K] in natural K order (fp32 with F32:
    the interpreter computes bf16 arithmetic on raw bits and flushes bf16 subnormals).

    tl.join appends a new last (fastest) dimension, so in join(join(a, b), join(c, d)) the outer
    join picks the lowest bit of the K offset; the comments give the offset of pair j's half h.
    SCALED False: the element values times 2^-120 (e4m3) / 2^-126 (e2m1), scales not applied (the
    FMA path applies them once per group)."""
    w = words.to(tl.uint32, bitcast=True)
    s = scales.to(tl.uint32)
    if FMT == 1:
        # e4m3 byte b -> bf16 bits (b & 0x80) << 8 | (b & 0x7f) << 4 = value * 2^-120.
        # Pair 0 = bytes 0 (low half) and 2 (high half), pair 1 = bytes 1 and 3: offset 2h + j.
        l0, h0 = bf16_halves(((w << 4) & 0x07F007F0) | ((w << 8) & 0x80008000), F32)
        l1, h1 = bf16_halves(((w >> 4) & 0x07F007F0) | (w & 0x80008000), F32)
        v = tl.join(tl.join(l0, h0), tl.join(l1, h1))
        exp_bits = tl.minimum(s + 120, 254)  # bf16 exponent field of 2^(s - 127 + 120)
    else:
        # e2m1 nibble c -> bf16 bits (c & 8) << 12 | (c & 7) << 6 = value * 2^-126.
        if FMT == 2:  # canonical (nibble t = offset t): pair j = nibbles j and j + 4: offset 4h + j
            l0, h0 = bf16_halves(((w << 6) & 0x01C001C0) | ((w << 12) & 0x80008000), F32)
            l1, h1 = bf16_halves(((w << 2) & 0x01C001C0) | ((w << 8) & 0x80008000), F32)
            l2, h2 = bf16_halves(((w >> 2) & 0x01C001C0) | ((w << 4) & 0x80008000), F32)
            l3, h3 = bf16_halves(((w >> 6) & 0x01C001C0) | (w & 0x80008000), F32)
            v = tl.join(tl.join(tl.join(l0, h0), tl.join(l2, h2)), tl.join(tl.join(l1, h1), tl.join(l3, h3)))
        else:  # kernel layout (_pack_mxfp4_words): pair j = offsets 2j, 2j + 1, so each bf16x2
            # register is already the (k, k+1) pair the tensor-core operand wants.
            p0, p1, p2, p3 = mxfp4_word_pairs(w)
            l0, h0 = bf16_halves(p0, F32)
            l1, h1 = bf16_halves(p1, F32)
            l2, h2 = bf16_halves(p2, F32)
            l3, h3 = bf16_halves(p3, F32)
            v = tl.join(tl.join(tl.join(l0, l2), tl.join(l1, l3)), tl.join(tl.join(h0, h2), tl.join(h1, h3)))
        exp_bits = tl.minimum(s + 126, 254)  # 2^(s - 127 + 126)
    if SCALED:
        if F32:
            scale = (exp_bits << 23).to(tl.float32, bitcast=True)
        else:
            scale = (exp_bits << 7).to(tl.uint16).to(tl.bfloat16, bitcast=True)
        v = tl.reshape(v, [BLOCK_N, BLOCK_K // 32, 32]) * scale[:, :, None]
    return tl.reshape(v, [BLOCK_N, BLOCK_K])


# CUDA (sm_90+) inline-PTX decode of MXFP4: one 32-bit register of raw bytes in, four bf16x2
# registers out, so values never leave their packed pairs (Triton's element-wise decode spends
# about as many instructions re-packing 16-bit halves as decoding). Same bit logic as
# _decode_words; $5 is a bf16x2 register holding the group's scale factor twice; outputs $0..$3
# are the word's values (0, 1), (2, 3), (4, 5), (6, 7). (For MXFP8 the portable decode measured
# fewer SASS instructions than a PTX one, so there is none.)
_PTX_MXFP4 = tl.constexpr("""{
.reg .b32 q0, q1, q2, q3, t;
shl.b32 q0, $4, 6;
and.b32 q0, q0, 0x01C001C0;
shl.b32 t, $4, 12;
and.b32 t, t, 0x80008000;
or.b32 q0, q0, t;
shl.b32 q1, $4, 2;
and.b32 q1, q1, 0x01C001C0;
shl.b32 t, $4, 8;
and.b32 t, t, 0x80008000;
or.b32 q1, q1, t;
shr.b32 q2, $4, 2;
and.b32 q2, q2, 0x01C001C0;
shl.b32 t, $4, 4;
and.b32 t, t, 0x80008000;
or.b32 q2, q2, t;
shr.b32 q3, $4, 6;
and.b32 q3, q3, 0x01C001C0;
and.b32 t, $4, 0x80008000;
or.b32 q3, q3, t;
prmt.b32 t, q0, q1, 0x5410;
mul.rn.bf16x2 $0, t, $5;
prmt.b32 t, q2, q3, 0x5410;
mul.rn.bf16x2 $1, t, $5;
prmt.b32 t, q0, q1, 0x7632;
mul.rn.bf16x2 $2, t, $5;
prmt.b32 t, q2, q3, 0x7632;
mul.rn.bf16x2 $3, t, $5;
}""")
_PTX_MXFP4_WORDS = tl.constexpr("{\n.reg .b32 t, u;\n" + mxfp4_words_ptx("$4", ("$0", "$1", "$2", "$3"),
                                                                           ("$5",) * 4) + "}")


@triton.jit
def _decode_mxfp4_ptx(raw, scales, FMT: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """MXFP4 bytes [BLOCK_N, BLOCK_K / 2] (canonical or kernel layout) + E8M0 scales
    [BLOCK_N, BLOCK_K / 32] -> bf16 [BLOCK_N, BLOCK_K]; one inline-PTX call per 4 bytes (pack=4)."""
    exp_bits = tl.minimum(scales.to(tl.uint32) + 126, 254)  # 2^(s - 127 + 126), see _decode_words
    scale = (exp_bits << 7).to(tl.uint16).to(tl.bfloat16, bitcast=True)
    scale = tl.reshape(tl.broadcast_to(scale[:, :, None], [BLOCK_N, BLOCK_K // 32, 16]), [BLOCK_N, BLOCK_K // 2])
    # Output element e of a call is byte e's slot: lo gets values 0-3 of each word, hi values 4-7.
    if FMT == 2:
        lo, hi = tl.inline_asm_elementwise(_PTX_MXFP4, "=r,=r,=r,=r,r,r,r", [raw, scale],
                                           dtype=(tl.bfloat16, tl.bfloat16), is_pure=True, pack=4)
    else:
        lo, hi = tl.inline_asm_elementwise(_PTX_MXFP4_WORDS, "=r,=r,=r,=r,r,r,r", [raw, scale],
                                           dtype=(tl.bfloat16, tl.bfloat16), is_pure=True, pack=4)
    v = tl.reshape(tl.join(lo, hi), [BLOCK_N, BLOCK_K // 8, 4, 2])  # [.., word, value % 4, value // 4]
    return tl.reshape(tl.permute(v, (0, 1, 3, 2)), [BLOCK_N, BLOCK_K])


@triton.jit
def _load_weights(w_ptrs, s_ptrs, FMT: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                  F32: tl.constexpr, PTX: tl.constexpr):
    """One [BLOCK_N, BLOCK_K] weight tile, bf16 (fp32 with F32); rows are clamped by the caller,
    so no masks. w_ptrs address int32 words, or MXFP4 bytes with PTX. (No early returns in these
    helpers: code after a return in a constexpr branch is still compiled and must type-check.)"""
    if FMT == 0:
        w = tl.load(w_ptrs)
    elif PTX:
        w = _decode_mxfp4_ptx(tl.load(w_ptrs), tl.load(s_ptrs), FMT, BLOCK_N, BLOCK_K)
    else:
        w = _decode_words(tl.load(w_ptrs), tl.load(s_ptrs), FMT, BLOCK_N, BLOCK_K, F32, True)
    return w


@triton.jit
def _mma(acc, x, w, SWAP_AB: tl.constexpr, DOT_FP32: tl.constexpr):
    """acc += x [BM, BK] @ w[BN, BK]^T; with SWAP_AB acc is [BN, BM] (weights as the A operand)."""
    if DOT_FP32:  # the interpreter's bf16 tl.dot is wrong; GPUs take bf16 x bf16 -> fp32
        x = x.to(tl.float32)
        w = w.to(tl.float32)
    if SWAP_AB:
        # "+ 0.0" uses the product inside the loop, so Triton waits for this wgmma here instead of
        # leaving it in flight into the next iteration, whose decode ptxas gives the registers this
        # wgmma's A operand still reads (a race: wgmma_hazards.py; the loads stay pipelined).
        acc = tl.dot(w, tl.trans(x), acc) + 0.0
    else:
        acc = tl.dot(x, tl.trans(w), acc)
    return acc


@triton.jit
def stream_rows(x_rows, x_mask, w_rows, s_rows, k_begin, n_iters,
                 FMT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                 SWAP_AB: tl.constexpr, DOT_FP32: tl.constexpr, PTX: tl.constexpr, K_CHUNKS: tl.constexpr,
                 TILE_N: tl.constexpr, FMA: tl.constexpr):
    """fp32 [BLOCK_M, BLOCK_N] = x[:, k] @ dequant(W[:, k])^T over k in [k_begin, k_begin + n_iters*STEP),
    STEP = K_CHUNKS * BLOCK_K: each loop step loads K_CHUNKS consecutive [BLOCK_N, BLOCK_K] tiles
    (so every weight row is read in runs of STEP values: fewer, longer DRAM bursts per row) and
    multiplies them one after the other (registers of one tile).

    x_rows [BLOCK_M]: row base pointers; k_begin a multiple of STEP. Row layouts (TILE_N 0): w_rows,
    s_rows [BLOCK_N] are weight / scale row base pointers. Tiled layouts: they point at the rows of
    the K-tile 0 of their tile rows (TILE_N rows a tile; BLOCK_N may cover several tile rows), and
    each BLOCK_K step moves one whole tile. W is bf16 elements, int32 words of an MX format, or
    MXFP4 bytes with PTX.

    FMA (one token row, BLOCK_M = 1): no tensor cores; each value is decoded to fp32 and
    multiply-added on the CUDA cores (MXFP8 as fp8 elements through the hardware conversion, its
    scale applied once per 32-value group), which at one token costs fewer instructions per
    weight byte than staging decoded tiles for the MMA."""
    if FMT == 0:
        ROW_ELEMS: tl.constexpr = BLOCK_K
    elif FMA and FMT == 1:
        ROW_ELEMS: tl.constexpr = BLOCK_K  # fp8 elements (as_kernel_operand(native=True))
    elif PTX:
        ROW_ELEMS: tl.constexpr = BLOCK_K // 2
    else:
        ROW_ELEMS: tl.constexpr = BLOCK_K // 4 if FMT == 1 else BLOCK_K // 8
    GROUPS: tl.constexpr = BLOCK_K // 32
    if TILE_N == 0:
        W_STEP: tl.constexpr = ROW_ELEMS
        S_STEP: tl.constexpr = GROUPS
    else:
        W_STEP: tl.constexpr = TILE_N * ROW_ELEMS
        S_STEP: tl.constexpr = TILE_N * GROUPS
    x_ptrs = x_rows[:, None] + (k_begin + tl.arange(0, BLOCK_K))[None, :]
    w_ptrs = w_rows[:, None] + ((k_begin // BLOCK_K) * W_STEP + tl.arange(0, ROW_ELEMS))[None, :]
    s_ptrs = s_rows[:, None] + ((k_begin // BLOCK_K) * S_STEP + tl.arange(0, GROUPS))[None, :]
    if FMA:
        row = tl.zeros([BLOCK_N], dtype=tl.float32)
        for _ in range(n_iters):
            for c in tl.static_range(K_CHUNKS):
                x = tl.load(x_ptrs + c * BLOCK_K, mask=x_mask[:, None], other=0.0).to(tl.float32)  # [1, BK]
                if FMT == 1:
                    w = tl.load(w_ptrs + c * W_STEP).to(tl.float32)
                    part = tl.sum(tl.reshape(w * x, [BLOCK_N, GROUPS, 32]), axis=2)
                    sc = (tl.minimum(tl.load(s_ptrs + c * S_STEP).to(tl.uint32), 254) << 23).to(tl.float32,
                                                                                              bitcast=True)
                    row += tl.sum(part * sc, axis=1)
                elif FMT == 0:
                    w = tl.load(w_ptrs + c * W_STEP).to(tl.float32)
                    row += tl.sum(w * x, axis=1)
                else:  # MXFP4: values * 2^-126 in fp32, the scale 2^(s - 127 + 126) once per group
                    scales = tl.load(s_ptrs + c * S_STEP)
                    w = _decode_words(tl.load(w_ptrs + c * W_STEP), scales, FMT, BLOCK_N, BLOCK_K, True, False)
                    part = tl.sum(tl.reshape(w * x, [BLOCK_N, GROUPS, 32]), axis=2)
                    sc = (tl.minimum(scales.to(tl.uint32) + 126, 254) << 23).to(tl.float32, bitcast=True)
                    row += tl.sum(part * sc, axis=1)
            x_ptrs += K_CHUNKS * BLOCK_K
            w_ptrs += K_CHUNKS * W_STEP
            s_ptrs += K_CHUNKS * S_STEP
        acc = row[None, :]
    else:
        if SWAP_AB:
            acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
        else:
            acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for _ in range(n_iters):
            for c in tl.static_range(K_CHUNKS):
                x = tl.load(x_ptrs + c * BLOCK_K, mask=x_mask[:, None], other=0.0)
                w = _load_weights(w_ptrs + c * W_STEP, s_ptrs + c * S_STEP, FMT, BLOCK_N, BLOCK_K, DOT_FP32, PTX)
                acc = _mma(acc, x, w, SWAP_AB, DOT_FP32)
            x_ptrs += K_CHUNKS * BLOCK_K
            w_ptrs += K_CHUNKS * W_STEP
            s_ptrs += K_CHUNKS * S_STEP
        if SWAP_AB:
            acc = tl.trans(acc)
    return acc


def as_kernel_operand(weight: torch.Tensor, fmt: int, name: str = "weight", ptx: bool = False,
                      native: bool = False) -> torch.Tensor:
    # (any layout of formats.LAYOUTS: only the last dimension is reinterpreted; native: MXFP8 as
    # its fp8 elements, for the FMA path's hardware conversion)
    if native and fmt == FMT_MXFP8:
        return weight
    """The tensor the kernels index: bf16 as is; MX formats as int32 words along K, or as raw
    bytes for the PTX decode."""
    if weight.stride(-1) != 1:
        raise ValueError(f"{name}: the last (K) dimension must be contiguous, got strides {weight.stride()}")
    if fmt == FMT_BF16:
        return weight
    try:
        return weight.view(torch.uint8 if ptx else torch.int32)
    except RuntimeError as e:
        raise ValueError(f"{name}: rows must be 4-byte aligned to be read as 32-bit words, got shape "
                         f"{tuple(weight.shape)} strides {weight.stride()}") from e


@functools.lru_cache(maxsize=None)
def use_ptx(device: torch.device) -> bool:
    """Inline-PTX decode on NVIDIA sm_90+ (mul.bf16x2); MINIMAX_OPS_NO_PTX=1 forces the portable
    Triton decode (the one AMD and the interpreter run)."""
    if device.type != "cuda" or torch.version.hip is not None or os.environ.get("MINIMAX_OPS_NO_PTX") == "1":
        return False
    return torch.cuda.get_device_capability(device) >= (9, 0)


def mxfp4_ptx(fmt: int, cfg_ptx: bool | None, device: torch.device) -> bool:
    """Whether an MXFP4 launch decodes with inline PTX (only MXFP4 has a PTX decode)."""
    if fmt not in (FMT_MXFP4, FMT_MXFP4_WORDS):
        return False
    return use_ptx(device) if cfg_ptx is None else cfg_ptx


# ---- programmatic dependent launch and L2 prefetch ----------------------------------------------------------

# Bytes of its weight slice a program launched with PDL asks L2 for before it waits on its
# predecessor (the first few K steps: enough to keep DRAM busy across the kernel boundary).
PREFETCH_BYTES = 64 * 1024


@triton.jit
def prefetch_l2(ptr, nbytes):
    """Ask L2 for nbytes (a multiple of 16) from ptr (16-byte aligned) without waiting: the sm_90
    bulk prefetch. Only under PDL (CUDA) constexpr branches."""
    tl.inline_asm_elementwise("cp.async.bulk.prefetch.L2.global [$1], $2; // $0", "=r,l,r",
                              [ptr.to(tl.int64, bitcast=True), (nbytes // 16 * 16).to(tl.int32)], dtype=tl.int32,
                              is_pure=False, pack=1)


@functools.lru_cache(maxsize=None)
def pdl_supported(device: torch.device) -> bool:
    """Programmatic dependent launch (griddepcontrol): NVIDIA sm_90+; MINIMAX_OPS_NO_PDL=1 turns it off."""
    if device.type != "cuda" or torch.version.hip is not None or os.environ.get("MINIMAX_OPS_NO_PDL") == "1":
        return False
    return torch.cuda.get_device_capability(device) >= (9, 0)


# ---- weight checks -----------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class LinearWeight:
    layout: WeightLayout
    n: int  # output features
    tiles: tuple[int, int] | None  # (BN, BK) of tiled storage


def check_weight(name: str, weight: torch.Tensor, scale: torch.Tensor | None, k: int | None, device: torch.device,
                 rank: int = 2) -> LinearWeight:
    """A (weight, scale) pair in any layout with K input features (None: any), on ``device``."""
    if weight.dtype == torch.bfloat16 and scale is not None:
        raise ValueError(f"{name}: bf16 weights take no scale, got a {scale.dtype} scale")
    if weight.dtype != torch.bfloat16 and (scale is None or scale.dtype != torch.uint8):
        got = "None" if scale is None else str(scale.dtype)
        raise ValueError(f"{name}_scale: expected a uint8 E8M0 scale for {weight.dtype} weights, got {got}")
    try:
        layout = weight_layout(weight, scale, rank, name)
    except ValueError as e:
        raise ValueError(f"{name}: expected a {rank}-d weight ({rank + 2}-d tiled) of dtype bfloat16, float8_e4m3fn, "
                         f"uint8 or int32, got {weight.dtype} shape {tuple(weight.shape)} ({e})") from None
    *_, n, kk = logical_shape(weight, layout)
    if k is not None and kk != k:
        raise ValueError(f"{name}: expected K = {k} input features, got shape {tuple(weight.shape)} ({layout.name})")
    if kk % MX_BLOCK:
        raise ValueError(f"{name}: K = {kk} must be a multiple of {MX_BLOCK}")
    tiles = tile_shape(weight, layout)
    if scale is not None and not layout.mma:  # (weight_layout checked mma-layout scales)
        want = (*weight.shape[:-1], (tiles[1] if tiles else kk) // MX_BLOCK)
        if tuple(scale.shape) != want:
            raise ValueError(f"{name}_scale: expected shape {want}, got {tuple(scale.shape)}")
        if scale.stride(-1) != 1:
            raise ValueError(f"{name}_scale: the last dimension must be contiguous, got strides {tuple(scale.stride())}")
        if layout.tiled and not scale.is_contiguous():
            raise ValueError(f"{name}_scale: tiled scales must be contiguous, got strides {tuple(scale.stride())}")
    if layout.mma and not (weight.is_contiguous() and scale.is_contiguous()):
        raise ValueError(f"{name}/{name}_scale: {layout.name} weights and scales must be contiguous")
    if layout.tiled and not weight.is_contiguous():
        raise ValueError(f"{name}: tiled weights must be contiguous, got strides {tuple(weight.stride())}")
    if weight.device != device or (scale is not None and scale.device != device):
        raise ValueError(f"{name}/{name}_scale: expected device {device}, got {weight.device}"
                         f"{'' if scale is None else ' / ' + str(scale.device)}")
    return LinearWeight(layout, n, tiles)


def aot_specs() -> list:
    """None of its own: these are helpers, compiled (and covered) through the kernels that call them."""
    return []
