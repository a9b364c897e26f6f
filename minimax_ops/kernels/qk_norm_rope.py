"""Per-head Gemma norm + NeoX partial RoPE of q / k (and the indexer's q / k), with the paged-cache
insert of k, v (and index_k) fused in: one pass over the fused projection's output.

Grid: (token, 128-wide segment of the qkv row). The row is laid out as
[q heads | k heads | v heads | index_q heads | index_k], every segment head_dim wide, so program
(i, s) reads columns s*D .. s*D+D-1 and its segment index alone says what to do with them. That
per-segment body (``norm_rope_insert_segment``, for a block of tokens) is also the epilogue of
qkv_mma's one-kernel qkv GEMV, so both produce the same bits: nothing in it depends on the number
of warps it runs with (the norm's sum of squares is a fixed pairwise tree, ``_row_sums``).

RoPE angles are formed in fp64 (pos * theta^(-2i/r), reduced mod 2*pi) and only then turned into
fp32 cos/sin: at positions near 2**20 an fp32 angle is off by ~0.05 rad, far outside bf16 noise.
"""

from __future__ import annotations

import dataclasses
import math
import struct

import torch
import triton
import triton.language as tl

from .aot import KernelSpec, with_pdl_variants
from .mx_decode import gdc_launch_dependents, gdc_wait, pdl_supported


def _f32(x: float) -> float:
    """x rounded to the nearest fp32."""
    return struct.unpack("f", struct.pack("f", x))[0]


# 2*pi as an fp32 pair (hi + lo ~ 48 bits): float literals in a Triton kernel are fp32 constants.
_TWO_PI_HI = _f32(2 * math.pi)
_TWO_PI_LO = _f32(2 * math.pi - _TWO_PI_HI)
TWO_PI_HI = tl.constexpr(_TWO_PI_HI)
TWO_PI_LO = tl.constexpr(_TWO_PI_LO)
INV_TWO_PI = tl.constexpr(1.0 / (2 * math.pi))
FP8_MAX = tl.constexpr(448.0)
MAX_ROTARY_DIM = 256  # _inv_freq below handles frequency indices < 128 (7 bits)


@triton.jit
def _inv_freq(i, base_hi, base_lo):
    """theta^(-2i/r) = base^i in fp64 by binary powering (base = theta^(-2/r) passed as hi + lo)."""
    base = tl.cast(base_hi, tl.float64) + tl.cast(base_lo, tl.float64)
    inv = tl.full(i.shape, 1.0, tl.float64)
    for bit in tl.static_range(7):
        inv = tl.where(((i >> bit) & 1) != 0, inv * base, inv)
        base = base * base
    return inv


@triton.jit
def _row_sums(x):
    """Row sums of x [T, N] (N a power of two) as a fixed tree: adjacent pairs, then pairs of those, ...

    Every level reduces an axis of length 2, a single (commutative) add, so the bits do not depend
    on how the compiler spreads x over threads and warps: kernels with other num_warps (the 1-warp
    qk_norm_rope launch, the 8-warp qkv_mma epilogue) get the same sums. tl.sum over N would not."""
    for _ in tl.static_range(16):
        if x.shape[1] > 2:
            x = tl.sum(tl.reshape(x, [x.shape[0], x.shape[1] // 2, 2]), axis=2)
    return tl.sum(x, axis=1)


@triton.jit
def _norm_rope(rows, live, w_ptr, pos, eps, base_hi, base_lo, HEAD_DIM: tl.constexpr, ROT_DIM: tl.constexpr):
    """Gemma RMSNorm of one head for a block of tokens (fp32; rows [T, 1] pointers to their first
    value, live [T] which exist, pos [T]) followed by NeoX RoPE on dims < ROT_DIM -> fp32 [T, HEAD_DIM]."""
    HALF: tl.constexpr = ROT_DIM // 2
    d = tl.arange(0, HEAD_DIM)
    # The rotation partner of dim d (x1 <-> x2); registers cannot be permuted, so load it again
    # (same cache lines, L1 hit).
    partner = tl.where(d < HALF, d + HALF, tl.where(d < ROT_DIM, d - HALF, d))
    m = live[:, None]
    x = tl.load(rows + d[None, :], mask=m, other=0.0).to(tl.float32)
    xp = tl.load(rows + partner[None, :], mask=m, other=0.0).to(tl.float32)
    rstd = tl.rsqrt(_row_sums(x * x) / HEAD_DIM + eps)[:, None]
    y = x * rstd * (1.0 + tl.load(w_ptr + d).to(tl.float32))[None, :]
    yp = xp * rstd * (1.0 + tl.load(w_ptr + partner).to(tl.float32))[None, :]
    angle = pos.to(tl.float64)[:, None] * _inv_freq(d % HALF, base_hi, base_lo)[None, :]
    turns = (angle * INV_TWO_PI).to(tl.int64).to(tl.float64)
    reduced = (angle - turns * TWO_PI_HI - turns * TWO_PI_LO).to(tl.float32)
    cos = tl.cos(reduced)
    sin = tl.sin(reduced)
    first, rotated = (d < HALF)[None, :], (d < ROT_DIM)[None, :]
    return tl.where(first, y * cos - yp * sin, tl.where(rotated, y * cos + yp * sin, y))


@triton.jit
def _round_to_e4m3_grid(x):
    """fp32 x (|x| <= 448) rounded to the nearest e4m3 value (ties to even), still in fp32.

    Only for the interpreter, whose fp32 -> fp8 cast loses the carry when a value rounds up to the
    next power of two (7.9 -> 4.0); it casts values already on the grid exactly."""
    bits = x.to(tl.int32, bitcast=True)
    exp = tl.maximum(((bits >> 23) & 0xFF) - 127, -6)  # subnormals share 2^-6's spacing
    ulp = ((exp - 3 + 127) << 23).to(tl.float32, bitcast=True)  # 3 mantissa bits
    return ((x / ulp + 12582912.0) - 12582912.0) * ulp  # + 1.5 * 2^23: fp32 add rounds to an integer


@triton.jit
def _to_cache(x, dtype, FP8: tl.constexpr, INTERPRETED: tl.constexpr):
    """Cast for a cache write; fp8 e4m3 saturates at +-448 (scale 1.0), like formats.to_cache_dtype."""
    if FP8:
        x = tl.minimum(tl.maximum(x, -FP8_MAX), FP8_MAX)
        if INTERPRETED:
            x = _round_to_e4m3_grid(x)
    return x.to(dtype)


@triton.jit
def norm_rope_insert_segment(
        qkv_ptr, stride_qkv, seg, tok0, n_tok,
        pos_ptr, slot_ptr, index_slot_ptr, q_w_ptr, k_w_ptr, index_q_w_ptr, index_k_w_ptr,
        kv_ptr, index_cache_ptr, q_out_ptr, index_q_out_ptr,
        stride_kv_block, stride_kv_head, stride_kv_slot, stride_ic_block, stride_ic_slot,
        eps, base_hi, base_lo, inv_k_scale, inv_v_scale,
        NUM_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr, INDEX_HEADS: tl.constexpr,
        HEAD_DIM: tl.constexpr, ROT_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
        KV_FP8: tl.constexpr, INDEX_FP8: tl.constexpr, INTERPRETED: tl.constexpr, TOKENS: tl.constexpr):
    """Segment ``seg`` (HEAD_DIM columns) of the qkv rows of tokens tok0 .. tok0 + TOKENS - 1 that
    are < n_tok: its norm / RoPE / cache insert, whatever the segment holds. The one body of both
    this module's kernel (one token a program) and qkv_mma's epilogue (a segment's tokens at once:
    one token after another would add up their load latencies)."""
    toks = tl.arange(0, TOKENS).to(tl.int64) + tok0
    live = toks < n_tok
    K_SEG: tl.constexpr = NUM_HEADS
    V_SEG: tl.constexpr = NUM_HEADS + NUM_KV_HEADS
    IQ_SEG: tl.constexpr = NUM_HEADS + 2 * NUM_KV_HEADS
    IK_SEG: tl.constexpr = IQ_SEG + INDEX_HEADS
    d = tl.arange(0, HEAD_DIM)[None, :]
    rows = qkv_ptr + toks[:, None] * stride_qkv + seg * HEAD_DIM
    pos = tl.load(pos_ptr + toks, mask=live, other=0)
    if seg < K_SEG:
        y = _norm_rope(rows, live, q_w_ptr, pos, eps, base_hi, base_lo, HEAD_DIM, ROT_DIM)
        q_dst = q_out_ptr + (toks[:, None] * NUM_HEADS + seg) * HEAD_DIM + d
        tl.store(q_dst, y.to(q_out_ptr.dtype.element_ty), mask=live[:, None])
    elif seg < IQ_SEG:  # k or v of kv head (seg - K_SEG) % NUM_KV_HEADS
        slot = tl.load(slot_ptr + toks, mask=live, other=-1)
        ok = (slot >= 0)[:, None]  # slot < 0: padding row, the cache is not touched
        slot = tl.maximum(slot, 0)[:, None]
        is_v = seg >= V_SEG
        head = tl.where(is_v, seg - V_SEG, seg - K_SEG)
        kv_dst = (kv_ptr + (slot // BLOCK_SIZE) * stride_kv_block + head * stride_kv_head
                  + (slot % BLOCK_SIZE) * stride_kv_slot + d)
        if is_v:
            v = tl.load(rows + d, mask=live[:, None], other=0.0).to(tl.float32)
            tl.store(kv_dst + HEAD_DIM, _to_cache(v * inv_v_scale, kv_ptr.dtype.element_ty, KV_FP8, INTERPRETED),
                     mask=ok)
        else:
            y = _norm_rope(rows, live, k_w_ptr, pos, eps, base_hi, base_lo, HEAD_DIM, ROT_DIM)
            tl.store(kv_dst, _to_cache(y * inv_k_scale, kv_ptr.dtype.element_ty, KV_FP8, INTERPRETED), mask=ok)
    elif INDEX_HEADS > 0:
        if seg < IK_SEG:
            y = _norm_rope(rows, live, index_q_w_ptr, pos, eps, base_hi, base_lo, HEAD_DIM, ROT_DIM)
            iq_dst = index_q_out_ptr + (toks[:, None] * INDEX_HEADS + seg - IQ_SEG) * HEAD_DIM + d
            tl.store(iq_dst, y.to(index_q_out_ptr.dtype.element_ty), mask=live[:, None])
        else:
            slot = tl.load(index_slot_ptr + toks, mask=live, other=-1)
            ok = (slot >= 0)[:, None]
            slot = tl.maximum(slot, 0)[:, None]
            y = _norm_rope(rows, live, index_k_w_ptr, pos, eps, base_hi, base_lo, HEAD_DIM, ROT_DIM)
            ik_dst = index_cache_ptr + (slot // BLOCK_SIZE) * stride_ic_block + (slot % BLOCK_SIZE) * stride_ic_slot + d
            tl.store(ik_dst, _to_cache(y, index_cache_ptr.dtype.element_ty, INDEX_FP8, INTERPRETED), mask=ok)


@triton.jit
def _qk_norm_rope_insert_kernel(
        qkv_ptr, stride_qkv, n_tok,
        pos_ptr, slot_ptr, index_slot_ptr, q_w_ptr, k_w_ptr, index_q_w_ptr, index_k_w_ptr,
        kv_ptr, index_cache_ptr, q_out_ptr, index_q_out_ptr,
        stride_kv_block, stride_kv_head, stride_kv_slot, stride_ic_block, stride_ic_slot,
        eps, base_hi, base_lo, inv_k_scale, inv_v_scale,
        NUM_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr, INDEX_HEADS: tl.constexpr,
        HEAD_DIM: tl.constexpr, ROT_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
        KV_FP8: tl.constexpr, INDEX_FP8: tl.constexpr, INTERPRETED: tl.constexpr, PDL: tl.constexpr):
    """Grid (token, segment)."""
    if PDL:  # launched as a programmatic dependent: wait for the previous kernel's outputs
        gdc_wait()
        gdc_launch_dependents()
    norm_rope_insert_segment(
        qkv_ptr, stride_qkv, tl.program_id(1), tl.program_id(0), n_tok,
        pos_ptr, slot_ptr, index_slot_ptr, q_w_ptr, k_w_ptr, index_q_w_ptr, index_k_w_ptr,
        kv_ptr, index_cache_ptr, q_out_ptr, index_q_out_ptr,
        stride_kv_block, stride_kv_head, stride_kv_slot, stride_ic_block, stride_ic_slot,
        eps, base_hi, base_lo, inv_k_scale, inv_v_scale,
        NUM_HEADS, NUM_KV_HEADS, INDEX_HEADS, HEAD_DIM, ROT_DIM, BLOCK_SIZE, KV_FP8, INDEX_FP8, INTERPRETED, 1)


_CACHE_DTYPES = (torch.bfloat16, torch.float8_e4m3fn)


def _need(ok: bool, msg: str) -> None:
    if not ok:
        raise ValueError(msg)


def _check_vector(name: str, t: torch.Tensor, n: int, dtype: torch.dtype) -> None:
    _need(t.shape == (n,) and t.dtype == dtype and t.is_contiguous(),
          f"{name}: expected a contiguous {dtype} [{n}] tensor, got {t.dtype} shape {tuple(t.shape)}")


def _check_norm_weight(name: str, t: torch.Tensor, dim: int) -> None:
    _need(t.shape == (dim,) and t.is_contiguous() and t.dtype in (torch.bfloat16, torch.float32),
          f"{name}: expected a contiguous bf16/fp32 [{dim}] tensor, got {t.dtype} shape {tuple(t.shape)}")


def _rope_base(rope_theta: float, rotary_dim: int) -> tuple[float, float]:
    """theta^(-2/r) as an fp32 (hi, lo) pair."""
    base = rope_theta ** (-2.0 / rotary_dim)
    hi = _f32(base)
    return hi, _f32(base - hi)


def qkv_width(num_heads: int, num_kv_heads: int, head_dim: int, index_heads: int = 0, index_dim: int = 0) -> int:
    """Columns of the fused projection's output [q | k | v (| index_q | index_k)]."""
    return (num_heads + 2 * num_kv_heads) * head_dim + ((index_heads + 1) * index_dim if index_heads > 0 else 0)


@dataclasses.dataclass
class SegmentLaunch:
    """What a kernel calling norm_rope_insert_segment is launched with, after the checks: the outputs,
    the segment arguments in the body's order, its constexprs and the number of segments."""
    q: torch.Tensor
    index_q: torch.Tensor | None
    args: tuple
    constexprs: dict
    segments: int


def segment_launch(n: int, device: torch.device, positions: torch.Tensor, slot_mapping: torch.Tensor,
                   index_slot_mapping: torch.Tensor | None, q_norm: torch.Tensor, k_norm: torch.Tensor,
                   index_q_norm: torch.Tensor | None, index_k_norm: torch.Tensor | None, kv_cache: torch.Tensor,
                   index_cache: torch.Tensor | None, *, num_heads: int, num_kv_heads: int, head_dim: int,
                   rotary_dim: int, rope_theta: float, eps: float, index_heads: int = 0, index_dim: int = 0,
                   k_scale: float = 1.0, v_scale: float = 1.0) -> SegmentLaunch:
    """Checks steps 3-4's arguments for n tokens (ValueError naming the argument) and allocates q /
    index_q; shared by qk_norm_rope_insert and qkv_mma.qkv_norm_rope_insert."""
    has_index = index_heads > 0
    _need(num_heads % num_kv_heads == 0,
          f"num_heads: expected a multiple of num_kv_heads={num_kv_heads}, got {num_heads}")
    _need(head_dim & (head_dim - 1) == 0, f"head_dim: expected a power of two, got {head_dim}")
    _need(0 < rotary_dim <= min(head_dim, MAX_ROTARY_DIM) and rotary_dim % 2 == 0,
          f"rotary_dim: expected an even number in 2..{min(head_dim, MAX_ROTARY_DIM)}, got {rotary_dim}")
    _check_vector("positions", positions, n, torch.int64)
    _check_vector("slot_mapping", slot_mapping, n, torch.int64)
    _need(k_scale > 0 and v_scale > 0, f"k_scale, v_scale: expected positive scales, got {k_scale}, {v_scale}")
    _check_norm_weight("q_norm", q_norm, head_dim)
    _check_norm_weight("k_norm", k_norm, head_dim)
    _need(kv_cache.dim() == 4 and kv_cache.shape[1] == num_kv_heads and kv_cache.shape[3] == 2 * head_dim
          and kv_cache.stride(3) == 1 and kv_cache.dtype in _CACHE_DTYPES,
          f"kv_cache: expected a bf16/fp8 [blocks, {num_kv_heads}, block_size, {2 * head_dim}] tensor with "
          f"a contiguous last dimension, got {kv_cache.dtype} shape {tuple(kv_cache.shape)}")
    block_size = kv_cache.shape[2]
    q = torch.empty(n, num_heads, head_dim, dtype=torch.bfloat16, device=device)
    index_q = None
    if has_index:
        _need(index_dim == head_dim, f"index_dim: expected head_dim={head_dim} (one segment width), got {index_dim}")
        _need(index_slot_mapping is not None and index_q_norm is not None and index_k_norm is not None
              and index_cache is not None,
              "index_slot_mapping, index_q_norm, index_k_norm, index_cache: all required when index_heads > 0")
        _check_vector("index_slot_mapping", index_slot_mapping, n, torch.int64)
        _check_norm_weight("index_q_norm", index_q_norm, index_dim)
        _check_norm_weight("index_k_norm", index_k_norm, index_dim)
        _need(index_cache.dim() == 3 and index_cache.shape[1:] == (block_size, index_dim)
              and index_cache.stride(2) == 1 and index_cache.dtype in _CACHE_DTYPES,
              f"index_cache: expected a bf16/fp8 [blocks, {block_size}, {index_dim}] tensor with a contiguous "
              f"last dimension, got {index_cache.dtype} shape {tuple(index_cache.shape)}")
        index_q = torch.empty(n, index_heads, index_dim, dtype=torch.bfloat16, device=device)
    # Dense layers: the index arguments are dead code (INDEX_HEADS=0); pass typed stand-ins.
    islots = index_slot_mapping if has_index else slot_mapping
    iq_w, ik_w = (index_q_norm, index_k_norm) if has_index else (q_norm, k_norm)
    icache = index_cache if has_index else kv_cache
    iq_out = index_q if has_index else q
    base_hi, base_lo = _rope_base(rope_theta, rotary_dim)
    args = (positions, slot_mapping, islots, q_norm, k_norm, iq_w, ik_w, kv_cache, icache, q, iq_out,
            kv_cache.stride(0), kv_cache.stride(1), kv_cache.stride(2), icache.stride(0),
            icache.stride(1) if has_index else 0, eps, base_hi, base_lo, 1.0 / k_scale, 1.0 / v_scale)
    constexprs = dict(NUM_HEADS=num_heads, NUM_KV_HEADS=num_kv_heads, INDEX_HEADS=index_heads if has_index else 0,
                      HEAD_DIM=head_dim, ROT_DIM=rotary_dim, BLOCK_SIZE=block_size,
                      KV_FP8=kv_cache.dtype == torch.float8_e4m3fn,
                      INDEX_FP8=has_index and index_cache.dtype == torch.float8_e4m3fn,
                      INTERPRETED=device.type != "cuda")
    segments = num_heads + 2 * num_kv_heads + (index_heads + 1 if has_index else 0)
    return SegmentLaunch(q, index_q, args, constexprs, segments)


def qk_norm_rope_insert(qkv: torch.Tensor, positions: torch.Tensor, slot_mapping: torch.Tensor,
                        index_slot_mapping: torch.Tensor | None, q_norm: torch.Tensor, k_norm: torch.Tensor,
                        index_q_norm: torch.Tensor | None, index_k_norm: torch.Tensor | None,
                        kv_cache: torch.Tensor, index_cache: torch.Tensor | None, *, num_heads: int,
                        num_kv_heads: int, head_dim: int, rotary_dim: int, rope_theta: float, eps: float,
                        index_heads: int = 0, index_dim: int = 0, k_scale: float = 1.0, v_scale: float = 1.0,
                        pdl: bool = False
                        ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Steps 3-4 of the decode spec. qkv bf16 [n, (H + 2*KVH)*D (+ (Hi + 1)*Di)]; writes k / k_scale,
    v / v_scale into kv_cache [blocks, KVH, bs, 2D] at slot_mapping (attention multiplies them back)
    and index_k into index_cache [blocks, bs, Di] at index_slot_mapping (slot < 0: nothing written).
    Returns (q bf16 [n, H, D], index_q bf16 [n, Hi, Di] or None)."""
    _need(qkv.dim() == 2 and qkv.dtype == torch.bfloat16 and qkv.stride(1) == 1,
          f"qkv: expected a bf16 [n, width] tensor with contiguous rows, got {qkv.dtype} shape "
          f"{tuple(qkv.shape)} strides {qkv.stride()}")
    n = qkv.shape[0]
    width = qkv_width(num_heads, num_kv_heads, head_dim, index_heads, index_dim)
    _need(qkv.shape[1] == width, f"qkv: expected width {width} for these head counts, got {qkv.shape[1]}")
    launch = segment_launch(n, qkv.device, positions, slot_mapping, index_slot_mapping, q_norm, k_norm, index_q_norm,
                            index_k_norm, kv_cache, index_cache, num_heads=num_heads, num_kv_heads=num_kv_heads,
                            head_dim=head_dim, rotary_dim=rotary_dim, rope_theta=rope_theta, eps=eps,
                            index_heads=index_heads, index_dim=index_dim, k_scale=k_scale, v_scale=v_scale)
    if n == 0:
        return launch.q, launch.index_q
    pdl = pdl and pdl_supported(qkv.device)
    _qk_norm_rope_insert_kernel[(n, launch.segments)](
        qkv, qkv.stride(0), n, *launch.args, **launch.constexprs, PDL=pdl, num_warps=max(1, head_dim // 128),
        launch_pdl=pdl)
    return launch.q, launch.index_q


# (H, KVH, Hi, D, rotary, block): the tiny preset and the real model (TP 1).
AOT_SHAPES = ((8, 2, 2, 32, 16, 16), (64, 4, 4, 128, 64, 128))


def segment_signature(kv_t: str, idx_t: str) -> dict[str, str]:
    """The AOT signature of norm_rope_insert_segment's arguments (kv / index cache pointer types)."""
    return {"pos_ptr": "*i64", "slot_ptr": "*i64", "index_slot_ptr": "*i64", "q_w_ptr": "*bf16", "k_w_ptr": "*bf16",
            "index_q_w_ptr": "*bf16", "index_k_w_ptr": "*bf16", "kv_ptr": kv_t, "index_cache_ptr": idx_t,
            "q_out_ptr": "*bf16", "index_q_out_ptr": "*bf16", "stride_kv_block": "i32", "stride_kv_head": "i32",
            "stride_kv_slot": "i32", "stride_ic_block": "i32", "stride_ic_slot": "i32", "eps": "fp32",
            "base_hi": "fp32", "base_lo": "fp32", "inv_k_scale": "fp32", "inv_v_scale": "fp32"}


def segment_constexprs(shape: tuple, kv_t: str, idx_t: str | None) -> dict:
    """norm_rope_insert_segment's constexprs for an AOT_SHAPES entry; idx_t None: a dense layer."""
    heads, kv_heads, index_heads, dim, rot, bs = shape
    return {"NUM_HEADS": heads, "NUM_KV_HEADS": kv_heads, "INDEX_HEADS": index_heads if idx_t else 0,
            "HEAD_DIM": dim, "ROT_DIM": rot, "BLOCK_SIZE": bs, "KV_FP8": kv_t == "*fp8e4nv",
            "INDEX_FP8": idx_t == "*fp8e4nv", "INTERPRETED": False}


def aot_specs() -> list[KernelSpec]:
    specs = []
    for shape in AOT_SHAPES:
        dim = shape[3]
        for kv_t in ("*bf16", "*fp8e4nv"):
            for idx_t in ("*bf16", "*fp8e4nv", None):  # None: dense (index arguments typed like the kv ones)
                sig = {"qkv_ptr": "*bf16", "stride_qkv": "i32", "n_tok": "i32",
                       **segment_signature(kv_t, idx_t or kv_t)}
                specs.append(KernelSpec(
                    _qk_norm_rope_insert_kernel, sig, segment_constexprs(shape, kv_t, idx_t),
                    num_warps=max(1, dim // 128),
                    name=f"qk_norm_rope_insert_d{dim}_kv{kv_t[1:]}" + (f"_index{idx_t[1:]}" if idx_t else "")))
    return with_pdl_variants(specs)
