"""Weight-streaming GEMV for decode: ``y = x @ dequant(W, s)^T`` with bf16, MXFP8 or MXFP4 weights.

Decode is bound by reading the weights once, so the kernel is built around that stream:
- The weight tile [BLOCK_N, BLOCK_K] is loaded as whole 32-bit words (4 fp8 or 8 e2m1 values) and
  decoded with a few shifts and masks per *pair* of values: each mask leaves two bf16 bit patterns
  (one per 16-bit half) that are the element times a fixed power of two (2^-120 for e4m3,
  2^-126 for e2m1; e4m3 and e2m1 subnormals land on bf16 subnormals). One bf16 multiply by
  ``2^(scale - 127 + bias)`` per value then gives the exact dequantised weight; the E8M0 scale is
  loaded once per 32-value group and broadcast. On NVIDIA sm_90+ MXFP4 decodes in inline PTX
  (``_PTX_MXFP4*``: same bits, but the pairs stay packed in bf16x2 registers); AMD and the
  interpreter run the portable Triton decode.
- x is loaded contiguously as a [BLOCK_M, BLOCK_K] tile (BLOCK_M = 16 token rows, padding rows
  masked off, so they cost no memory traffic) and multiplied on tensor cores in bf16 with fp32
  accumulation, weights as the A operand (wgmma on Hopper): 1..16 tokens cost the same per value.
- Where N alone gives too few programs to keep all SMs streaming, K is split; the splits write fp32
  partials and the last split program of each output tile to finish (an int32 arrival counter,
  ``_last_arrival``) sums them in a fixed order: deterministic, no float atomics, one launch.
  (Without counters, e.g. first call inside a CUDA-graph capture, ``_splitk_reduce_kernel`` sums.)
All loads of the K loop (x, weights, scales) are software-pipelined (cp.async) by Triton.
Measured on an H200 (benchmarks/sweep_kernels.py): MXFP8 qkv / o_proj at 1..16 tokens stream
~2.1-2.3 TB/s (50-53% of copy). A pure read of the same tile pattern (64 rows x 256 B per step)
reaches 3.3 TB/s, 128 B per row per step (MXFP4 tiles) only 2.1 TB/s: the rest is the decode +
MMA loop (~5.9 SASS instructions per fp8 value at ~12 resident warps per SM), and for MXFP4 also
the short per-row bursts.

Weight layouts (K = reduction dim, scale groups of 32 along K):
- bf16 [N, K]; MXFP8 float8_e4m3fn [N, K] + uint8 [N, K/32];
- MXFP4 canonical: uint8 [N, K/2] (element 2j low nibble) + uint8 [N, K/32];
- MXFP4 "kernel layout" from ``prepare_weight``: int32 [N, K/8] + the same scales. Each word holds
  the canonical word's 8 values with their bits pre-placed where the bf16 decode wants them and
  (k, k+1) pairs in one register (see ``_pack_mxfp4_words``): ~30% fewer decode instructions.
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

from ..constants import MX_BLOCK
from .aot import KernelSpec
from .norm import check_rows

# Weight format codes: the kernels' FMT constexpr.
FMT_BF16, FMT_MXFP8, FMT_MXFP4, FMT_MXFP4_PREPARED = 0, 1, 2, 3
FORMAT_NAMES = {FMT_BF16: "bf16", FMT_MXFP8: "mxfp8", FMT_MXFP4: "mxfp4", FMT_MXFP4_PREPARED: "mxfp4p"}
_POINTER_TYPES = {FMT_BF16: "*bf16", FMT_MXFP8: "*i32", FMT_MXFP4: "*i32", FMT_MXFP4_PREPARED: "*i32"}
DEFAULT_SMS = 132  # an H200; used where no GPU can be asked (CPU / interpreter)


# ---- decode ----------------------------------------------------------------------------------------------


@triton.jit
def _halves(p, F32: tl.constexpr):
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
def _decode_words(words, scales, FMT: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                  F32: tl.constexpr):
    """int32 words [BLOCK_N, BLOCK_K / values-per-word] + uint8 E8M0 scales [BLOCK_N, BLOCK_K / 32]
    -> exactly dequantised bf16 weights [BLOCK_N, BLOCK_K] in natural K order (fp32 with F32:
    the interpreter computes bf16 arithmetic on raw bits and flushes bf16 subnormals).

    tl.join appends a new last (fastest) dimension, so in join(join(a, b), join(c, d)) the outer
    join picks the lowest bit of the K offset; the comments give the offset of pair j's half h."""
    w = words.to(tl.uint32, bitcast=True)
    s = scales.to(tl.uint32)
    if FMT == 1:
        # e4m3 byte b -> bf16 bits (b & 0x80) << 8 | (b & 0x7f) << 4 = value * 2^-120.
        # Pair 0 = bytes 0 (low half) and 2 (high half), pair 1 = bytes 1 and 3: offset 2h + j.
        l0, h0 = _halves(((w << 4) & 0x07F007F0) | ((w << 8) & 0x80008000), F32)
        l1, h1 = _halves(((w >> 4) & 0x07F007F0) | (w & 0x80008000), F32)
        v = tl.join(tl.join(l0, h0), tl.join(l1, h1))
        exp_bits = tl.minimum(s + 120, 254)  # bf16 exponent field of 2^(s - 127 + 120)
    else:
        # e2m1 nibble c -> bf16 bits (c & 8) << 12 | (c & 7) << 6 = value * 2^-126.
        if FMT == 2:  # canonical (nibble t = offset t): pair j = nibbles j and j + 4: offset 4h + j
            l0, h0 = _halves(((w << 6) & 0x01C001C0) | ((w << 12) & 0x80008000), F32)
            l1, h1 = _halves(((w << 2) & 0x01C001C0) | ((w << 8) & 0x80008000), F32)
            l2, h2 = _halves(((w >> 2) & 0x01C001C0) | ((w << 4) & 0x80008000), F32)
            l3, h3 = _halves(((w >> 6) & 0x01C001C0) | (w & 0x80008000), F32)
            v = tl.join(tl.join(tl.join(l0, h0), tl.join(l2, h2)), tl.join(tl.join(l1, h1), tl.join(l3, h3)))
        else:  # kernel layout (_pack_mxfp4_words): pair j = offsets 2j, 2j + 1, so each bf16x2
            # register is already the (k, k+1) pair the tensor-core operand wants.
            l0, h0 = _halves(w & 0x81C081C0, F32)
            l1, h1 = _halves((w << 3) & 0x81C081C0, F32)
            l2, h2 = _halves((w << 6) & 0x81C081C0, F32)
            l3, h3 = _halves(((w << 1) & 0x80008000) | ((w >> 3) & 0x01800180) | ((w >> 7) & 0x00400040), F32)
            v = tl.join(tl.join(tl.join(l0, l2), tl.join(l1, l3)), tl.join(tl.join(h0, h2), tl.join(h1, h3)))
        exp_bits = tl.minimum(s + 126, 254)  # 2^(s - 127 + 126)
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
_PTX_MXFP4_PREPARED = tl.constexpr("""{
.reg .b32 t, u;
and.b32 t, $4, 0x81C081C0;
mul.rn.bf16x2 $0, t, $5;
shl.b32 t, $4, 3;
and.b32 t, t, 0x81C081C0;
mul.rn.bf16x2 $1, t, $5;
shl.b32 t, $4, 6;
and.b32 t, t, 0x81C081C0;
mul.rn.bf16x2 $2, t, $5;
shl.b32 t, $4, 1;
and.b32 t, t, 0x80008000;
shr.b32 u, $4, 3;
and.b32 u, u, 0x01800180;
or.b32 t, t, u;
shr.b32 u, $4, 7;
and.b32 u, u, 0x00400040;
or.b32 t, t, u;
mul.rn.bf16x2 $3, t, $5;
}""")


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
        lo, hi = tl.inline_asm_elementwise(_PTX_MXFP4_PREPARED, "=r,=r,=r,=r,r,r,r", [raw, scale],
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
        w = _decode_words(tl.load(w_ptrs), tl.load(s_ptrs), FMT, BLOCK_N, BLOCK_K, F32)
    return w


@triton.jit
def _mma(acc, x, w, SWAP_AB: tl.constexpr, DOT_FP32: tl.constexpr):
    """acc += x [BM, BK] @ w[BN, BK]^T; with SWAP_AB acc is [BN, BM] (weights as the A operand)."""
    if DOT_FP32:  # the interpreter's bf16 tl.dot is wrong; GPUs take bf16 x bf16 -> fp32
        x = x.to(tl.float32)
        w = w.to(tl.float32)
    if SWAP_AB:
        acc = tl.dot(w, tl.trans(x), acc)
    else:
        acc = tl.dot(x, tl.trans(w), acc)
    return acc


@triton.jit
def _stream_rows(x_rows, x_mask, w_rows, s_rows, k_begin, n_iters,
                 FMT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                 SWAP_AB: tl.constexpr, DOT_FP32: tl.constexpr, PTX: tl.constexpr, K_CHUNKS: tl.constexpr):
    """fp32 [BLOCK_M, BLOCK_N] = x[:, k] @ dequant(W[:, k])^T over k in [k_begin, k_begin + n_iters*STEP),
    STEP = K_CHUNKS * BLOCK_K: each loop step loads K_CHUNKS consecutive [BLOCK_N, BLOCK_K] tiles
    (so every weight row is read in runs of STEP values: fewer, longer DRAM bursts per row) and
    multiplies them one after the other (registers of one tile).

    x_rows [BLOCK_M] / w_rows, s_rows [BLOCK_N]: row base pointers; k_begin a multiple of STEP.
    W rows are bf16 elements, int32 words of an MX format, or MXFP4 bytes with PTX."""
    if FMT == 0:
        ROW_ELEMS: tl.constexpr = BLOCK_K
    elif PTX:
        ROW_ELEMS: tl.constexpr = BLOCK_K // 2
    else:
        ROW_ELEMS: tl.constexpr = BLOCK_K // 4 if FMT == 1 else BLOCK_K // 8
    GROUPS: tl.constexpr = BLOCK_K // 32
    x_ptrs = x_rows[:, None] + (k_begin + tl.arange(0, BLOCK_K))[None, :]
    w_ptrs = w_rows[:, None] + (k_begin // (BLOCK_K // ROW_ELEMS) + tl.arange(0, ROW_ELEMS))[None, :]
    s_ptrs = s_rows[:, None] + (k_begin // 32 + tl.arange(0, GROUPS))[None, :]
    if SWAP_AB:
        acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    else:
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for _ in range(n_iters):
        for c in tl.static_range(K_CHUNKS):
            x = tl.load(x_ptrs + c * BLOCK_K, mask=x_mask[:, None], other=0.0)
            w = _load_weights(w_ptrs + c * ROW_ELEMS, s_ptrs + c * GROUPS, FMT, BLOCK_N, BLOCK_K, DOT_FP32, PTX)
            acc = _mma(acc, x, w, SWAP_AB, DOT_FP32)
        x_ptrs += K_CHUNKS * BLOCK_K
        w_ptrs += K_CHUNKS * ROW_ELEMS
        s_ptrs += K_CHUNKS * GROUPS
    if SWAP_AB:
        acc = tl.trans(acc)
    return acc


# ---- kernels ---------------------------------------------------------------------------------------------

# Split-K modes (the SPLIT_MODE constexpr): one split stores y directly; PARTIALS stores fp32
# partials [split, M, N] for ``_splitk_reduce_kernel``; FUSED also stores partials, and the last of
# a tile's split programs to finish sums them (see ``_last_arrival``), so no second launch.
SPLIT_NONE, SPLIT_PARTIALS, SPLIT_FUSED = 0, 1, 2


@triton.jit
def _last_arrival(cnt_ptr, expected):
    """Counts this program in at cnt_ptr; True for the last of `expected` programs, which also
    resets the count to 0 for the next launch. The barrier orders every thread's earlier stores
    before the release; the acquire makes the other programs' stores visible to the last one
    (which must then read them with cache_modifier=".cg": L1 is not coherent)."""
    tl.debug_barrier()
    ticket = tl.atomic_add(cnt_ptr, 1, sem="acq_rel", scope="gpu")
    last = ticket == expected - 1
    if last:
        tl.atomic_xchg(cnt_ptr, 0, sem="relaxed", scope="gpu")
    return last


@triton.jit
def _sum_splits(part_ptrs, mask, split_stride, n_split, SPLIT_POW2: tl.constexpr):
    """sum over s < n_split of (part_ptrs + s * split_stride)[mask], added in the order s = 0, 1, ...
    (deterministic); unrolled up to SPLIT_POW2 so the loads can all be in flight at once."""
    acc = tl.load(part_ptrs, mask=mask, other=0.0, cache_modifier=".cg")
    for s in tl.static_range(1, SPLIT_POW2):
        acc += tl.load(part_ptrs + s * split_stride, mask=mask & (s < n_split), other=0.0, cache_modifier=".cg")
    return acc


@triton.jit
def _mx_linear_kernel(x_ptr, w_ptr, s_ptr, out_ptr, part_ptr, cnt_ptr,
                      M, N, iters_total, iters_per_split, n_split,
                      stride_xm, stride_wn, stride_sn, stride_om,
                      FMT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                      SWAP_AB: tl.constexpr, DOT_FP32: tl.constexpr, PTX: tl.constexpr, K_CHUNKS: tl.constexpr,
                      SPLIT_MODE: tl.constexpr, SPLIT_POW2: tl.constexpr):
    """Grid (N tiles, K splits, M tiles). y [M, N] = out; fp32 partials [n_split, M, N] = part.
    iters_* count steps of K_CHUNKS * BLOCK_K."""
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    pid_m = tl.program_id(2)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    # Rows past N re-read row N-1 (no load masks in the loop); their results are not stored.
    rows = tl.minimum(offs_n, N - 1).to(tl.int64)
    it_begin = pid_k * iters_per_split
    n_iters = tl.minimum(iters_per_split, iters_total - it_begin)
    acc = _stream_rows(x_ptr + offs_m.to(tl.int64) * stride_xm, offs_m < M,
                       w_ptr + rows * stride_wn, s_ptr + rows * stride_sn, it_begin * (K_CHUNKS * BLOCK_K), n_iters,
                       FMT, BLOCK_M, BLOCK_N, BLOCK_K, SWAP_AB, DOT_FP32, PTX, K_CHUNKS)
    mask = (offs_m[:, None] < M) & (offs_n[None, :] < N)
    out_ptrs = out_ptr + offs_m.to(tl.int64)[:, None] * stride_om + offs_n[None, :]
    if SPLIT_MODE == 0:
        tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=mask)
    else:
        mn = (tl.zeros([], dtype=tl.int64) + M) * N  # (M may be a specialised constant 1)
        part_ptrs = part_ptr + offs_m.to(tl.int64)[:, None] * N + offs_n[None, :]
        tl.store(part_ptrs + pid_k * mn, acc, mask=mask)
        if SPLIT_MODE == 2:
            if _last_arrival(cnt_ptr + pid_m * tl.num_programs(0) + pid_n, n_split):
                total = _sum_splits(part_ptrs, mask, mn, n_split, SPLIT_POW2)
                tl.store(out_ptrs, total.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _splitk_reduce_kernel(part_ptr, out_ptr, total, n_split, BLOCK: tl.constexpr, SPLIT_POW2: tl.constexpr):
    """out[i] = sum over splits of part[s, i] (fixed tree order), for contiguous [M, N]."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < total
    acc = _sum_splits(part_ptr + offs, mask, total, n_split, SPLIT_POW2)
    tl.store(out_ptr + offs, acc.to(out_ptr.dtype.element_ty), mask=mask)


# ---- formats and layouts ---------------------------------------------------------------------------------


def kernel_format(weight: torch.Tensor, scale: torch.Tensor | None, name: str = "weight") -> int:
    """FMT code of a (weight, scale) pair, canonical or kernel layout; works on FakeTensors."""
    if weight.dtype == torch.bfloat16:
        if scale is not None:
            raise ValueError(f"{name}: bf16 weights take no scale, got a {scale.dtype} scale")
        return FMT_BF16
    codes = {torch.float8_e4m3fn: FMT_MXFP8, torch.uint8: FMT_MXFP4, torch.int32: FMT_MXFP4_PREPARED}
    if weight.dtype not in codes:
        raise ValueError(f"{name}: expected dtype bfloat16, float8_e4m3fn (MXFP8), uint8 (MXFP4) or int32 "
                         f"(MXFP4 kernel layout), got {weight.dtype}")
    if scale is None or scale.dtype != torch.uint8:
        got = "None" if scale is None else str(scale.dtype)
        raise ValueError(f"{name}_scale: expected a uint8 E8M0 scale for {weight.dtype} weights, got {got}")
    return codes[weight.dtype]


def in_features(weight: torch.Tensor, fmt: int) -> int:
    return weight.shape[-1] * {FMT_BF16: 1, FMT_MXFP8: 1, FMT_MXFP4: 2, FMT_MXFP4_PREPARED: 8}[fmt]


def as_kernel_operand(weight: torch.Tensor, fmt: int, name: str = "weight", ptx: bool = False) -> torch.Tensor:
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


def _pack_mxfp4_words(packed: torch.Tensor) -> torch.Tensor:
    """Canonical e2m1 bytes [..., K/2] -> kernel-layout int32 words [..., K/8].

    Word i holds values 8i..8i+7; value 4h + j (h = 16-bit half, j = pair 0..3) has its sign s and
    magnitude bits m (3) at: pair 0: s@15, m@8..6; pair 1: s@12, m@5..3; pair 2: s@9, m@2..0;
    pair 3: s@14, m2 m1 @11,10, m0@13 (all + 16h). Pairs 0-2 then decode with one shift and one
    mask ``(w << 3j) & 0x81C081C0``; pair 3 with three."""
    codes = torch.stack([packed & 0xF, packed >> 4], dim=-1).flatten(-2).to(torch.int32)
    c = codes.unflatten(-1, (-1, 4, 2)).transpose(-1, -2)  # [..., word, half, j]: value 2j + half
    sign, mag = c & 8, c & 7
    halves = (((sign << 12) | (mag << 6))[..., 0] | ((sign << 9) | (mag << 3))[..., 1]
              | ((sign << 6) | mag)[..., 2] | ((sign << 11) | ((c & 6) << 9) | ((c & 1) << 13))[..., 3])
    as_bytes = torch.stack([halves[..., 0] & 0xFF, halves[..., 0] >> 8, halves[..., 1] & 0xFF, halves[..., 1] >> 8],
                           dim=-1).to(torch.uint8)  # little-endian words
    return as_bytes.flatten(-2).view(torch.int32)


def prepare_weight(weight: torch.Tensor, scale: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Load-time re-layout for the kernels (once per weight; not capturable, may allocate a lot).

    MXFP4 (uint8 [..., N, K/2]) becomes the int32 kernel layout [..., N, K/8]; everything else is
    returned contiguous and unchanged. mx_linear and moe_experts accept both layouts; the reference
    and ``formats.dequantize`` only the canonical one. Works on expert tables [E, N, K/2] too."""
    fmt = kernel_format(weight, scale)
    scale = None if scale is None else scale.contiguous()
    if fmt != FMT_MXFP4:
        return weight.contiguous(), scale
    if weight.shape[-1] % 4:
        raise ValueError(f"weight: MXFP4 K/2 = {weight.shape[-1]} must be a multiple of 4 (K of 8)")
    rows = weight.reshape(-1, weight.shape[-1])
    out = torch.empty(rows.shape[0], rows.shape[1] // 4, dtype=torch.int32, device=weight.device)
    chunk = max(1, 2**24 // rows.shape[1])  # bound the int32 temporaries (~16M values per chunk)
    for r in range(0, rows.shape[0], chunk):
        out[r:r + chunk] = _pack_mxfp4_words(rows[r:r + chunk])
    return out.reshape(*weight.shape[:-1], -1), scale


# ---- tile heuristic --------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class GemvConfig:
    block_m: int
    block_n: int
    block_k: int
    split_k: int = 1  # requested splits of K (the wrapper rounds to whole BLOCK_K steps)
    num_warps: int = 4
    num_stages: int = 3
    swap_ab: bool = True  # weights as the MMA's A operand: wgmma on Hopper, fewer register moves
    ptx: bool | None = None  # MXFP4 inline-PTX decode; None: wherever use_ptx(device) allows
    fused_reduce: bool = True  # split-K: the last split program of a tile sums the partials
    k_chunks: int = 1  # BLOCK_K tiles per K-loop step (longer runs of each weight row per step)


# ---- split-K arrival counters ------------------------------------------------------------------------------

COUNTER_SLOTS = 1 << 16
_COUNTERS: dict[torch.device, torch.Tensor] = {}


def split_counters(device: torch.device, needed: int) -> torch.Tensor | None:
    """Zeroed int32 arrival counters for the fused split-K reductions (``_last_arrival``), one
    buffer per device, left zeroed by every launch that uses it. None (use a separate reduce
    launch) if more are needed than exist, if MINIMAX_OPS_NO_FUSED_SPLITK=1, or if the buffer does
    not exist yet while a CUDA graph is being captured (it must be zeroed eagerly once).
    Kernels that use it must not run concurrently on two streams of one device."""
    if needed > COUNTER_SLOTS or os.environ.get("MINIMAX_OPS_NO_FUSED_SPLITK") == "1":
        return None
    buf = _COUNTERS.get(device)
    if buf is None:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            return None
        buf = _COUNTERS[device] = torch.zeros(COUNTER_SLOTS, dtype=torch.int32, device=device)
    return buf


def mxfp4_ptx(fmt: int, cfg_ptx: bool | None, device: torch.device) -> bool:
    """Whether an MXFP4 launch decodes with inline PTX (only MXFP4 has a PTX decode)."""
    if fmt not in (FMT_MXFP4, FMT_MXFP4_PREPARED):
        return False
    return use_ptx(device) if cfg_ptx is None else cfg_ptx


# Per format: (BLOCK_N, largest BLOCK_K, num_warps, num_stages, K chunks per step). MXFP8 from
# benchmarks/sweep_kernels.py on an H200 (triton 3.6; qkv 9856x6144 and o_proj 6144x8192, M = 1..16:
# 10 tiles x 6 splits, then K chunks 1-8); the others keep the SASS-derived tiles. Narrower K
# (64-128) with more resident warps, 8 warps, and K chunks (longer bursts per row, but 2-4x the
# shared memory) all measured slower than 64 x 256 x 3 stages split 4: wide per-row bursts matter
# more than occupancy here.
_TILES = {FMT_BF16: (64, 128, 4, 4, 1), FMT_MXFP8: (64, 256, 4, 3, 1), FMT_MXFP4: (128, 256, 4, 3, 1),
          FMT_MXFP4_PREPARED: (128, 256, 4, 3, 1)}
_PROGRAMS_PER_SM = 4  # K is split until this many programs stream per SM ...
_MAX_SPLIT = 4  # ... but into at most this many parts (8 splits of o_proj measured 10% slower than 4)
_MIN_ITERS_PER_SPLIT = 2


@functools.lru_cache(maxsize=None)
def num_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return DEFAULT_SMS


def block_k_for(k: int, cap: int) -> int:
    """Largest power of two <= cap dividing K (K is a multiple of 32), so the K loop needs no masks."""
    block = cap
    while k % block:
        block //= 2
    return block


def block_m_for(m: int) -> int:
    return 16 if m <= 16 else 32 if m <= 32 else 64


def gemv_config(fmt: int, m: int, n: int, k: int, sms: int = DEFAULT_SMS) -> GemvConfig:
    """Tiles for one GEMV: the format's tile, K split (at most _MAX_SPLIT ways) until ~4 programs
    per SM stream."""
    block_n, cap_k, warps, stages, chunks = _TILES[fmt]
    block_m = block_m_for(m)
    block_k = block_k_for(k, cap_k)
    while chunks > 1 and k % (block_k * chunks):
        chunks //= 2
    iters = k // (block_k * chunks)
    tiles = triton.cdiv(n, block_n) * triton.cdiv(m, block_m)
    split = 1
    target = _PROGRAMS_PER_SM * sms
    if tiles < target // 2:
        # Splits that divide the K steps evenly, each with at least a few steps.
        options = [d for d in range(1, min(iters, _MAX_SPLIT) + 1)
                   if iters % d == 0 and iters // d >= _MIN_ITERS_PER_SPLIT] or [1]
        split = next((d for d in options if tiles * d >= target), options[-1])
    return GemvConfig(block_m, block_n, block_k, split, num_warps=warps, num_stages=stages, k_chunks=chunks)


# ---- wrapper ---------------------------------------------------------------------------------------------


def check_scale(name: str, scale: torch.Tensor | None, shape: tuple[int, ...], fmt: int) -> None:
    if fmt == FMT_BF16:
        return
    if tuple(scale.shape) != shape:
        raise ValueError(f"{name}: expected shape {shape}, got {tuple(scale.shape)}")
    if scale.stride(-1) != 1:
        raise ValueError(f"{name}: the last dimension must be contiguous, got strides {tuple(scale.stride())}")


def mx_linear(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor | None, *,
              out_dtype: torch.dtype = torch.bfloat16, config: GemvConfig | None = None) -> torch.Tensor:
    """y [M, N] = x [M, K] @ dequant(weight, scale)^T, fp32 accumulation, cast to out_dtype.

    weight: bf16 [N, K]; MXFP8 float8_e4m3fn [N, K] + uint8 scale [N, K/32]; MXFP4 uint8 [N, K/2]
    + scale, or its kernel layout int32 [N, K/8] (``prepare_weight``) + scale. ``config`` overrides
    the tile heuristic (tuning, tests)."""
    check_rows("x", x, shape="[M, K]", dim="K")
    if weight.dim() != 2:
        raise ValueError(f"weight: expected a 2-D [N, K] tensor, got shape {tuple(weight.shape)}")
    fmt = kernel_format(weight, scale)
    m, k = x.shape
    n = weight.shape[0]
    if in_features(weight, fmt) != k:
        raise ValueError(f"weight: expected K = {k} input features (x is {tuple(x.shape)}), got shape "
                         f"{tuple(weight.shape)} ({FORMAT_NAMES[fmt]})")
    if k % MX_BLOCK:
        raise ValueError(f"x: K = {k} must be a multiple of {MX_BLOCK}")
    check_scale("scale", scale, (n, k // MX_BLOCK), fmt)
    if weight.device != x.device or (scale is not None and scale.device != x.device):
        raise ValueError(f"weight/scale: expected device {x.device}, got {weight.device}"
                         f"{'' if scale is None else ' / ' + str(scale.device)}")
    if out_dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise ValueError(f"out_dtype: expected bfloat16, float16 or float32, got {out_dtype}")
    out = torch.empty(m, n, dtype=out_dtype, device=x.device)
    if m == 0 or n == 0:
        return out
    cfg = config or gemv_config(fmt, m, n, k, num_sms(x.device))
    ptx = mxfp4_ptx(fmt, cfg.ptx, x.device)
    w = as_kernel_operand(weight, fmt, ptx=ptx)
    s = scale if scale is not None else w  # unused by the bf16 kernel; any pointer keeps it typed
    chunks = cfg.k_chunks
    while chunks > 1 and k % (cfg.block_k * chunks):
        chunks //= 2
    iters = k // (cfg.block_k * chunks)
    iters_per_split = triton.cdiv(iters, max(1, min(cfg.split_k, iters)))
    split = triton.cdiv(iters, iters_per_split)
    grid = (triton.cdiv(n, cfg.block_n), split, triton.cdiv(m, cfg.block_m))
    counters = split_counters(x.device, grid[0] * grid[2]) if split > 1 and cfg.fused_reduce else None
    mode = SPLIT_NONE if split == 1 else SPLIT_FUSED if counters is not None else SPLIT_PARTIALS
    part = out if split == 1 else torch.empty(split, m, n, dtype=torch.float32, device=x.device)
    _mx_linear_kernel[grid](
        x, w, s, out, part, counters if counters is not None else part, m, n, iters, iters_per_split, split,
        x.stride(0), w.stride(0), s.stride(0), out.stride(0),
        FMT=fmt, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, SWAP_AB=cfg.swap_ab,
        DOT_FP32=x.device.type != "cuda", PTX=ptx, K_CHUNKS=chunks, SPLIT_MODE=mode,
        SPLIT_POW2=triton.next_power_of_2(split),
        num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    if mode == SPLIT_PARTIALS:
        _splitk_reduce_kernel[(triton.cdiv(m * n, REDUCE_BLOCK),)](
            part, out, m * n, split, BLOCK=REDUCE_BLOCK, SPLIT_POW2=triton.next_power_of_2(split), num_warps=4)
    return out


REDUCE_BLOCK = 512


# ---- ahead-of-time specs ---------------------------------------------------------------------------------

# (M, N, K) the wrappers meet: the tiny preset (H=64: qkv 448 x 64, M past 16 tiles M) and the real
# model (qkv+index 9856 x 6144 splits K: fp32 partials; dense gate_up 24576 x 6144 does not).
AOT_SHAPES = [(1, 448, 64), (20, 192, 64), (1, 9856, 6144), (16, 24576, 6144)]


def _linear_spec(fmt: int, cfg: GemvConfig, split_mode: int, split_pow2: int, ptx: bool = False) -> KernelSpec:
    w_type = "*u8" if ptx else _POINTER_TYPES[fmt]
    return KernelSpec(
        _mx_linear_kernel,
        {"x_ptr": "*bf16", "w_ptr": w_type, "s_ptr": "*u8" if fmt else "*bf16", "out_ptr": "*bf16",
         "part_ptr": "*fp32" if split_mode else "*bf16", "cnt_ptr": "*i32" if split_mode == SPLIT_FUSED else "*fp32",
         "M": "i32", "N": "i32", "iters_total": "i32", "iters_per_split": "i32", "n_split": "i32",
         "stride_xm": "i32", "stride_wn": "i32", "stride_sn": "i32", "stride_om": "i32"},
        {"FMT": fmt, "BLOCK_M": cfg.block_m, "BLOCK_N": cfg.block_n, "BLOCK_K": cfg.block_k,
         "SWAP_AB": cfg.swap_ab, "DOT_FP32": False, "PTX": ptx, "K_CHUNKS": cfg.k_chunks, "SPLIT_MODE": split_mode,
         "SPLIT_POW2": split_pow2},
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        name=f"mx_linear_{FORMAT_NAMES[fmt]}{'_ptx' if ptx else ''}_m{cfg.block_m}_n{cfg.block_n}_k{cfg.block_k}x{cfg.k_chunks}"
             f"_w{cfg.num_warps}s{cfg.num_stages}_split{split_mode}x{split_pow2}")


def _linear_specs(ptx: bool) -> list[KernelSpec]:
    """Every (format, shape) the heuristic picks; split launches in both reduce modes."""
    specs, seen = [], set()
    formats = (FMT_MXFP4, FMT_MXFP4_PREPARED) if ptx else (FMT_BF16, FMT_MXFP8, FMT_MXFP4, FMT_MXFP4_PREPARED)
    for m, n, k in AOT_SHAPES:
        for fmt in formats:
            cfg = gemv_config(fmt, m, n, k)
            iters = k // (cfg.block_k * cfg.k_chunks)
            split = triton.cdiv(iters, triton.cdiv(iters, max(1, min(cfg.split_k, iters))))
            modes = [SPLIT_NONE] if split == 1 else [SPLIT_FUSED, SPLIT_PARTIALS]
            for mode in modes:
                key = (fmt, dataclasses.replace(cfg, split_k=1), mode, triton.next_power_of_2(split))
                if key not in seen:
                    seen.add(key)
                    specs.append(_linear_spec(fmt, cfg, mode, triton.next_power_of_2(split), ptx))
    return specs


def aot_specs() -> list[KernelSpec]:
    """Portable specialisations (every target). The CUDA-only PTX ones are in ``aot_specs_cuda``."""
    pows = sorted({int(spec.constexprs["SPLIT_POW2"]) for spec in _linear_specs(ptx=False)} | {2})
    return _linear_specs(ptx=False) + [KernelSpec(
        _splitk_reduce_kernel, {"part_ptr": "*fp32", "out_ptr": "*bf16", "total": "i32", "n_split": "i32"},
        {"BLOCK": REDUCE_BLOCK, "SPLIT_POW2": p}, num_warps=4, name=f"splitk_reduce_bf16_x{p}") for p in pows if p > 1]


def aot_specs_cuda() -> list[KernelSpec]:
    """MXFP4 inline-PTX specialisations: they compile for cuda sm_90 only."""
    return _linear_specs(ptx=True)
