"""The qkv GEMV with the qk-norm / RoPE / cache insert as its epilogue: steps 2-4 of a decode step
in one launch where the qkv weight is in an mma layout (``mxfp4_mma`` / ``mxfp8_mma``).

A program of linear_mma's GEMV (``mma_linear_program``) owns NW row blocks, NW * 16 columns of the
qkv row; with NW * 16 == head_dim that is exactly one segment (one head of q, k, v, index_q or the
index key). The program that holds the group's result complete (the last of its K splits to arrive;
with one split, the program itself after its store) has stored it to the qkv buffer as bf16, as
mx_linear does; after a barrier (a program's stores are then visible to all its threads) it runs
qk_norm_rope's per-segment body (``norm_rope_insert_segment``) on that segment for every token of
the step, all tokens at once. Same code, same roundings as mx_linear + qk_norm_rope_insert, so the
same bits (qk_norm_rope's docstring says why the body does not depend on the warps it runs with);
what goes is a launch, its wait on the GEMV's tail and the re-read of qkv by another kernel.

Where the one-kernel path does not apply (a weight not in an mma layout, a GEMV group that is not
one segment: NW * 16 != head_dim, a step of more than ONE_KERNEL_TOKENS tokens)
``qkv_norm_rope_insert`` runs the two kernels instead, with the same results. Off PTX (interpreter,
AMD) the emulated block product runs head_dim / 16 row blocks a program: its per-row arithmetic does
not depend on how many, so the bits still match mma_linear's.
"""

from __future__ import annotations

import dataclasses

import torch
import triton
import triton.language as tl

from ..formats import FMT_MXFP8_MMA, MMA_K, MMA_ROWS
from .aot import KernelSpec
from .linear_mma import aligned_x, linear_tiles, mma_linear, mma_linear_program, split_buffers
from .mma_decode import TOKENS
from .mma_launch import mma_operands, preload_first, preloads, weights_evict_first
from .mx_decode import check_weight, pdl_supported
from .mx_linear import mx_linear
from .norm import check_rows
from .qk_norm_rope import (AOT_SHAPES, norm_rope_insert_segment, qk_norm_rope_insert, qkv_width, segment_constexprs,
                           segment_launch, segment_signature)
from .tiles import MmaLinearTiles, mma_linear_tiles, portable_mma_tiles, register_cap


@triton.jit
def _qkv_norm_rope_insert_kernel(
        x_ptr, w_ptr, s_ptr, qkv_ptr, part_ptr, cnt_ptr, M, N, k_blocks, stride_xm, stride_wb, stride_sb, stride_qkv,
        pos_ptr, slot_ptr, index_slot_ptr, q_w_ptr, k_w_ptr, index_q_w_ptr, index_k_w_ptr,
        kv_ptr, index_cache_ptr, q_out_ptr, index_q_out_ptr,
        stride_kv_block, stride_kv_head, stride_kv_slot, stride_ic_block, stride_ic_slot,
        eps, base_hi, base_lo, inv_k_scale, inv_v_scale,
        NW: tl.constexpr, DEPTH: tl.constexpr, SPLIT: tl.constexpr, SPLIT_POW2: tl.constexpr,
        PTX: tl.constexpr, PDL: tl.constexpr, PREFETCH: tl.constexpr, FP8: tl.constexpr,
        NUM_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr, INDEX_HEADS: tl.constexpr,
        HEAD_DIM: tl.constexpr, ROT_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
        KV_FP8: tl.constexpr, INDEX_FP8: tl.constexpr, INTERPRETED: tl.constexpr, SEG_TOKENS: tl.constexpr,
        PRELOAD: tl.constexpr, EVICT_FIRST: tl.constexpr = False):
    """Grid (segment = group of NW row blocks, K split): the GEMV arguments as mma_linear_program's
    (out = qkv), then norm_rope_insert_segment's, SEG_TOKENS tokens of a segment at a time."""
    done = mma_linear_program(x_ptr, w_ptr, s_ptr, qkv_ptr, part_ptr, cnt_ptr, M, N, k_blocks, stride_xm, stride_wb,
                              stride_sb, stride_qkv, NW, DEPTH, SPLIT, SPLIT_POW2, PTX, PDL, PREFETCH, FP8, PRELOAD,
                              EVICT_FIRST=EVICT_FIRST)
    if done:
        tl.debug_barrier()  # the segment's columns, stored by all warps, read back by all
        for t0 in range(0, M, SEG_TOKENS):
            norm_rope_insert_segment(
                qkv_ptr, stride_qkv, tl.program_id(0), t0, M,
                pos_ptr, slot_ptr, index_slot_ptr, q_w_ptr, k_w_ptr, index_q_w_ptr, index_k_w_ptr,
                kv_ptr, index_cache_ptr, q_out_ptr, index_q_out_ptr,
                stride_kv_block, stride_kv_head, stride_kv_slot, stride_ic_block, stride_ic_slot,
                eps, base_hi, base_lo, inv_k_scale, inv_v_scale,
                NUM_HEADS, NUM_KV_HEADS, INDEX_HEADS, HEAD_DIM, ROT_DIM, BLOCK_SIZE, KV_FP8, INDEX_FP8, INTERPRETED,
                SEG_TOKENS)


# Steps of more tokens (more than one token group of the mma) run the two kernels: at 16 tokens the one kernel,
# whose programs each own a head's rows, streamed slower than the GEMV's own tiles (BENCHMARKS.md).
ONE_KERNEL_TOKENS = TOKENS.value


def one_kernel_tiles(mma: bool, fp8: bool, n: int, k: int, head_dim: int, device: torch.device,
                     tiles: MmaLinearTiles | None = None) -> tuple[MmaLinearTiles, bool] | None:
    """(GEMV tiles, PTX) of the one-kernel path for a qkv weight [n, k], or None where it does not
    apply: not an mma layout (``mma``), or a GEMV group that is not one head_dim-wide segment. The
    tiles are mma_linear's (``tiles`` overrides the heuristic as there), so the GEMV's sums match;
    off PTX the row blocks per program are head_dim / 16."""
    if not mma:
        return None
    t, ptx = linear_tiles(n, k, device, fp8, tiles, warp_split=False)  # (a program owns its segment's rows)
    t = _segment_tiles(t, ptx, head_dim)
    return (t, ptx) if t.num_warps * MMA_ROWS == head_dim and t.warp_split == 1 else None


def _segment_tiles(t: MmaLinearTiles, ptx: bool, head_dim: int) -> MmaLinearTiles:
    """Off PTX (portable tiles) a program runs one segment: head_dim / 16 row blocks."""
    if ptx or head_dim % MMA_ROWS:
        return t
    return dataclasses.replace(t, num_warps=head_dim // MMA_ROWS)


def seg_tokens(m: int) -> int:
    """Tokens of a segment the epilogue handles at once: all of a step's (up to ONE_KERNEL_TOKENS)."""
    return min(ONE_KERNEL_TOKENS, triton.next_power_of_2(max(m, 1)))


def qkv_norm_rope_insert(h: torch.Tensor, qkv_weight: torch.Tensor, qkv_scale: torch.Tensor | None,
                         positions: torch.Tensor, slot_mapping: torch.Tensor, index_slot_mapping: torch.Tensor | None,
                         q_norm: torch.Tensor, k_norm: torch.Tensor, index_q_norm: torch.Tensor | None,
                         index_k_norm: torch.Tensor | None, kv_cache: torch.Tensor, index_cache: torch.Tensor | None,
                         *, num_heads: int, num_kv_heads: int, head_dim: int, rotary_dim: int, rope_theta: float,
                         eps: float, index_heads: int = 0, index_dim: int = 0, k_scale: float = 1.0,
                         v_scale: float = 1.0, pdl: bool = False, tiles: MmaLinearTiles | None = None
                         ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``qk_norm_rope_insert(mx_linear(h, qkv_weight, qkv_scale), ...)`` (same arguments after the
    weight, same results, same cache writes): h bf16 [n, hidden]; returns (q bf16 [n, H, D],
    index_q bf16 [n, Hi, Di] or None: a dense layer, index_heads 0).

    One kernel for mma-layout weights whose GEMV groups are one segment each (module docstring);
    anything else runs mx_linear and qk_norm_rope_insert, the two kernels. ``pdl``: launched as a
    programmatic dependent (it asks L2 for its first weight steps, then waits before reading h);
    CUDA sm_90+ only, ignored elsewhere. ``tiles`` overrides the GEMV's tile heuristic as in
    linear_mma.mma_linear (tests, tuning; mma layouts only)."""
    check_rows("h", h)
    m, k = h.shape
    lw = check_weight("qkv_weight", qkv_weight, qkv_scale, k, h.device)
    width = qkv_width(num_heads, num_kv_heads, head_dim, index_heads, index_dim)
    if lw.n != width:
        raise ValueError(f"qkv_weight: expected {width} output rows for these head counts, got {lw.n}")
    fp8 = lw.layout.code == FMT_MXFP8_MMA
    plan = one_kernel_tiles(lw.layout.mma, fp8, width, k, head_dim, h.device, tiles) if m <= ONE_KERNEL_TOKENS \
        else None
    kw = dict(num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim, rotary_dim=rotary_dim,
              rope_theta=rope_theta, eps=eps, index_heads=index_heads, index_dim=index_dim, k_scale=k_scale,
              v_scale=v_scale)
    if plan is None:  # the two kernels
        if tiles is not None and lw.layout.mma:
            qkv = mma_linear(h, qkv_weight, qkv_scale, lw.layout.code, torch.bfloat16, tiles=tiles, pdl=pdl)
        else:
            qkv = mx_linear(h, qkv_weight, qkv_scale, pdl=pdl)
        return qk_norm_rope_insert(qkv, positions, slot_mapping, index_slot_mapping, q_norm, k_norm, index_q_norm,
                                   index_k_norm, kv_cache, index_cache, pdl=pdl, **kw)
    launch = segment_launch(m, h.device, positions, slot_mapping, index_slot_mapping, q_norm, k_norm, index_q_norm,
                            index_k_norm, kv_cache, index_cache, **kw)
    if m == 0:
        return launch.q, launch.index_q
    t, ptx = plan
    w, s = mma_operands("qkv_weight", qkv_weight, qkv_scale)
    x32 = aligned_x(h)
    qkv = torch.empty(m, width, dtype=torch.bfloat16, device=h.device)
    split, part, counters = split_buffers(h.device, launch.segments, t.split, m, width, qkv)
    pdl = pdl and pdl_supported(h.device)
    _qkv_norm_rope_insert_kernel[(launch.segments, split)](
        x32, w, s, qkv, part, counters if counters is not None else s, m, width, k // MMA_K,
        x32.stride(0), w.stride(0), s.stride(0), qkv.stride(0), *launch.args,
        NW=t.num_warps, DEPTH=t.depth, SPLIT=split, SPLIT_POW2=triton.next_power_of_2(split), PTX=ptx, PDL=pdl,
        PREFETCH=t.prefetch, FP8=fp8, **launch.constexprs, SEG_TOKENS=seg_tokens(m), PRELOAD=preload_first(m),
        EVICT_FIRST=weights_evict_first(ptx), num_warps=t.num_warps,
        num_stages=1, launch_pdl=pdl, **register_cap(t))
    return launch.q, launch.index_q


# ---- ahead-of-time specs ---------------------------------------------------------------------------------

_GEMV_SIG = {"x_ptr": "*i32", "w_ptr": "*i32", "s_ptr": "*u8", "qkv_ptr": "*bf16", "part_ptr": "*fp32",
             "cnt_ptr": "*i32", "M": "i32", "N": "i32", "k_blocks": "i32", "stride_xm": "i32", "stride_wb": "i32",
             "stride_sb": "i32", "stride_qkv": "i32"}


def _spec(shape: tuple, k: int, fp8: bool, ptx: bool, pdl: bool, kv_t: str, idx_t: str | None,
          tokens: int, targets: tuple = ()) -> KernelSpec:
    heads, kv_heads, index_heads, dim = shape[:4]
    n = qkv_width(heads, kv_heads, dim, index_heads if idx_t else 0, dim)
    t = mma_linear_tiles(n, k, 132, fp8, warp_split=False)
    t = _segment_tiles(t if ptx else portable_mma_tiles(t), ptx, dim)
    assert t.num_warps * MMA_ROWS == dim, (shape, t)
    gemv = dict(NW=t.num_warps, DEPTH=t.depth, SPLIT=t.split, SPLIT_POW2=triton.next_power_of_2(t.split), PTX=ptx,
                PDL=pdl, PREFETCH=t.prefetch, FP8=fp8, PRELOAD=preloads(tokens), EVICT_FIRST=ptx)
    name = (f"qkv_norm_rope_insert_{'fp8' if fp8 else 'fp4'}_n{n}_k{k}{'_ptx' if ptx else ''}{'_pdl' if pdl else ''}"
            f"_s{t.split}_kv{kv_t[1:]}" + (f"_index{idx_t[1:]}" if idx_t else "") + f"_t{tokens}")
    return KernelSpec(_qkv_norm_rope_insert_kernel, {**_GEMV_SIG, **segment_signature(kv_t, idx_t or kv_t)},
                      {**gemv, **segment_constexprs(shape, kv_t, idx_t), "SEG_TOKENS": tokens},
                      num_warps=t.num_warps, num_stages=1, targets=("cuda",) if ptx else targets, name=name,
                      max_registers=t.max_registers)


def aot_specs() -> list[KernelSpec]:
    """The real model (qkv + index 9856 x 6144, both formats, fp8 caches; one and ONE_KERNEL_TOKENS tokens),
    plain and as a PDL dependent, with the inline-PTX decode (CUDA: mma layouts are laid out only
    where it runs), plus its dense layers (9216 x 6144) and bf16 caches; the portable decode at the
    tiny preset's shape (K = 256: split) for AMD: MXFP4 with each pairing of cache types, MXFP8 (its
    emulated decode the slowest to compile; the epilogue is the same code) with one; for CUDA, where
    the mma layouts exist only with the PTX decode, the first of them alone (the portable code path
    compiled there once, as moe_mma's)."""
    tiny, real = AOT_SHAPES
    fp8_t, bf16_t = "*fp8e4nv", "*bf16"
    specs = [_spec(real, 6144, fp8, True, pdl, fp8_t, fp8_t, tokens)
             for fp8 in (False, True) for pdl in (False, True) for tokens in (1, ONE_KERNEL_TOKENS)]
    specs += [_spec(real, 6144, True, True, True, fp8_t, None, ONE_KERNEL_TOKENS),
              _spec(real, 6144, True, True, True, bf16_t, bf16_t, ONE_KERNEL_TOKENS)]
    specs += [_spec(tiny, 256, False, False, False, kv_t, idx_t, 4, () if i == 0 else ("hip",))
              for i, (kv_t, idx_t) in enumerate(((bf16_t, fp8_t), (fp8_t, bf16_t), (fp8_t, None)))]
    specs.append(_spec(tiny, 256, True, False, False, bf16_t, fp8_t, 4, ("hip",)))
    return specs
