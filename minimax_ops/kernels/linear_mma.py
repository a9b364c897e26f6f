"""Weight-streaming GEMV for weights in the mma layouts (``mxfp4_mma`` / ``mxfp8_mma``, formats.py):
``y = x @ dequant(W)^T`` with mma_decode.block_stream (MX values decoded into mma.sync operand
registers, no shared memory), for the decode steps' 1..16 tokens.

Grid (group of NW row blocks, K split): warp w streams row block NW * pid + w (16 rows) over its
split of K for the step's tokens, 8 a group, two groups per weight load (so 9..16 tokens read the
weights once). With a warp split (KS, tiles.split_in_warps) the NW warps stream NW / KS row blocks,
KS parts of the split each, and sum the parts through shared memory. One grid split stores y;
several store fp32 partials and the last split of a group to finish sums them in a fixed order
(splitk.py). Launched as a programmatic dependent, a program
reads its first weight step (steps of one token group: mma_launch.preload_first) or, with tiles
that say so, asks L2 for its first load steps, before it waits for x. Tiles come from
tiles.mma_linear_tiles.
The program is a @triton.jit function of its own (``mma_linear_program``): qkv_mma runs it with
the qk-norm / RoPE / cache insert as its epilogue.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..formats import FMT_MXFP8_MMA, MMA_K, MMA_ROWS
from .aot import KernelSpec
from .mma_decode import (TOKENS, block_stream, first_blocks, fold, fold_warps, fragment_index, prefetch_step,
                         stream_pointers, warp_parts, warp_rows)
from .mma_launch import check_aligned, mma_operands, preload_first, preloads, weights_evict_first
from .mx_decode import gdc_launch_dependents, gdc_wait, pdl_supported, use_ptx
from .norm import check_norm_weight, check_rows
from .splitk import last_arrival, split_counters, sum_splits
from .tiles import (MmaLinearTiles, check_k_steps, check_warp_split, mma_linear_tiles, num_sms, portable_mma_tiles,
                    register_cap)


@triton.jit
def _store_rows(total, tok, n_out, ok, m0, M, out_ptr, stride_om, NORM: tl.constexpr, res_ptr, nw_ptr, xs_ptr,
                sumsq_ptr, stride_rm):
    """Stores the fp32 GEMV result of the fragment's (tok, n_out) (the tokens m0 .. m0 + 7) as out_ptr's
    dtype; NORM: the residual add of norm.add_rmsnorm with the norm itself deferred to the consumers
    (``mma_linear_add_norm``): out = bf16(bf16(y) + residual), xs = bf16(out * (1 + w)) and, per token,
    the sum of out^2 over the program's columns at sumsq_ptr[token, group]: a consumer's rstd is
    rsqrt(sum of a token's groups / N + eps), which it applies after its own (linear) product of xs."""
    ptrs = tok.to(tl.int64) * stride_om + n_out
    if NORM:  # (both loads before the first store, which they could alias: one round trip)
        r = tl.load(res_ptr + tok.to(tl.int64) * stride_rm + n_out, mask=ok, other=0.0).to(tl.float32)
        w = tl.load(nw_ptr + n_out, mask=ok, other=0.0).to(tl.float32)
        summed = (total.to(out_ptr.dtype.element_ty).to(tl.float32) + r).to(out_ptr.dtype.element_ty)
        tl.store(out_ptr + ptrs, summed, mask=ok)
        s = summed.to(tl.float32)
        tl.store(xs_ptr + ptrs, (s * (1.0 + w)).to(xs_ptr.dtype.element_ty), mask=ok)
        sq = tl.where(ok, s * s, 0.0)
        for t in tl.static_range(TOKENS):
            if m0 + t < M:
                row_sum = tl.sum(tl.sum(tl.where(tok == m0 + t, sq, 0.0), axis=1), axis=0)
                tl.store(sumsq_ptr + (m0 + t) * tl.num_programs(0) + tl.program_id(0), row_sum)
    else:
        tl.store(out_ptr + ptrs, total.to(out_ptr.dtype.element_ty), mask=ok)


@triton.jit
def mma_linear_program(x_ptr, w_ptr, s_ptr, out_ptr, part_ptr, cnt_ptr, M, N, k_blocks,
                       stride_xm, stride_wb, stride_sb, stride_om,
                       NW: tl.constexpr, DEPTH: tl.constexpr, SPLIT: tl.constexpr, SPLIT_POW2: tl.constexpr,
                       PTX: tl.constexpr, PDL: tl.constexpr, PREFETCH: tl.constexpr, FP8: tl.constexpr,
                       PRELOAD: tl.constexpr = False, KS: tl.constexpr = 1, NORM: tl.constexpr = False,
                       res_ptr=None, nw_ptr=None, xs_ptr=None, sumsq_ptr=None, stride_rm=0,
                       EVICT_FIRST: tl.constexpr = False):
    """Program (group, split) of the GEMV. x_ptr: int32 view of x [M, K] (stride_xm in words); w / s:
    int32 words [N/16, K/64, 128 | 256] and scale bytes [N/16, K/64, 32] (row-block strides in their
    units); out [M, N]; part [SPLIT, M, N] fp32. Returns whether this program stored the group's
    columns of out complete (one split: every program; else the last to arrive), so a caller can
    run an epilogue on them (after a tl.debug_barrier, its own stores are visible to all its threads).
    PRELOAD: the first weight step is read first, before the PDL wait (mma_decode.first_blocks).
    KS: the NW warps stream NW // KS row blocks (the group) in KS parts of the split's K each, summed
    through shared memory (mma_decode.warp_parts / fold_warps).
    NORM: the stored columns are a residual add with the following RMS norm deferred (``_store_rows``:
    out_ptr gets the residual sum, xs_ptr its scaled rows, sumsq_ptr the group's sums of squares); its PDL
    dependents launch once every program has streamed its weights, not after the wait.
    EVICT_FIRST: the weights stream with L2's evict-first policy (block_stream's; mma_launch.weights_evict_first)."""
    NWR: tl.constexpr = NW // KS  # row blocks of the group
    stride_xm = tl.multiple_of(stride_xm, 4)
    stride_wb, stride_sb = tl.multiple_of(stride_wb, 16), tl.multiple_of(stride_sb, 16)
    n_blocks = N // 16
    row_block, k_part = warp_parts(NW, DEPTH, KS)
    rb = tl.minimum(tl.program_id(0) * NWR + row_block, n_blocks - 1).to(tl.int64)
    w_rows, s_rows = w_ptr + rb * stride_wb, s_ptr + rb * stride_sb
    kb_split = k_blocks // (SPLIT * KS)
    kb_begin = (tl.program_id(1) * KS + k_part) * kb_split
    n_steps = kb_split // DEPTH
    step0 = None
    if PRELOAD:
        step0 = first_blocks(w_rows, s_rows, kb_begin, n_steps > 0, NW, DEPTH, FP8, PTX, EVICT_FIRST)
    if PDL:
        if PREFETCH > 0:  # the weights do not depend on the previous kernel: ask for them first
            w_pf, s_pf, w_lead, s_lead = stream_pointers(w_rows, s_rows, kb_begin, NW, DEPTH, FP8)
            for p in tl.static_range(PREFETCH):
                prefetch_step(w_pf, s_pf, w_lead, s_lead, p, n_steps, DEPTH, FP8)
        gdc_wait()
        if not NORM:
            gdc_launch_dependents()
    d, g, c, e = fragment_index(NW, DEPTH)
    d1, g1, c1, e1 = fragment_index(NWR, 1)
    n_out = (tl.program_id(0) * NWR + warp_rows(NWR, 1)) * 16 + g1 + 8 * (e1 // 2)
    mn = (tl.zeros([], dtype=tl.int64) + M) * N
    for m0 in range(0, M, 2 * TOKENS):
        x_rows = x_ptr + tl.minimum(m0 + g, M - 1).to(tl.int64) * stride_xm
        zero = tl.zeros([DEPTH * NW * 32, 4], dtype=tl.float32)
        if m0 + TOKENS < M:
            y_rows = x_ptr + tl.minimum(g + (m0 + TOKENS), M - 1).to(tl.int64) * stride_xm
            acc, acc2 = block_stream(zero, zero, w_rows, s_rows, x_rows, y_rows, kb_begin, n_steps, NW, DEPTH, PTX,
                                     PREFETCH, FP8, PDL, 2, PRELOADED=PRELOAD, first=step0,
                                     EVICT_FIRST=EVICT_FIRST)
        else:
            acc, acc2 = block_stream(zero, zero, w_rows, s_rows, x_rows, x_rows, kb_begin, n_steps, NW, DEPTH, PTX,
                                     PREFETCH, FP8, PDL, 1, PRELOADED=PRELOAD, first=step0,
                                     EVICT_FIRST=EVICT_FIRST)
        for half in tl.static_range(2):
            part = fold_warps(fold(acc if half == 0 else acc2, NW, DEPTH), NW, KS)
            tok = 2 * c1 + e1 % 2 + (m0 + half * TOKENS)
            ok = (tok < M) & (n_out < N)
            if SPLIT == 1:
                _store_rows(part, tok, n_out, ok, m0 + half * TOKENS, M, out_ptr, stride_om, NORM, res_ptr, nw_ptr,
                            xs_ptr, sumsq_ptr, stride_rm)
            else:
                tl.store(part_ptr + tl.program_id(1) * mn + tok.to(tl.int64) * N + n_out, part, mask=ok)
    if PDL:
        if NORM:  # (the consumer's many programs, resident early, would take places from this grid's second wave)
            gdc_launch_dependents()
    done = tl.program_id(1) == 0
    if SPLIT > 1:
        done = last_arrival(cnt_ptr + tl.program_id(0), SPLIT)
        if done:
            for m0 in range(0, M, TOKENS):
                tok = m0 + 2 * c1 + e1 % 2
                ok = (tok < M) & (n_out < N)
                total = sum_splits(part_ptr + tok.to(tl.int64) * N + n_out, ok, mn, SPLIT, SPLIT_POW2)
                _store_rows(total, tok, n_out, ok, m0, M, out_ptr, stride_om, NORM, res_ptr, nw_ptr, xs_ptr, sumsq_ptr,
                            stride_rm)
    return done


@triton.jit
def _mma_linear_kernel(x_ptr, w_ptr, s_ptr, out_ptr, part_ptr, cnt_ptr, M, N, k_blocks,
                       stride_xm, stride_wb, stride_sb, stride_om,
                       NW: tl.constexpr, DEPTH: tl.constexpr, SPLIT: tl.constexpr, SPLIT_POW2: tl.constexpr,
                       PTX: tl.constexpr, PDL: tl.constexpr, PREFETCH: tl.constexpr, FP8: tl.constexpr,
                       PRELOAD: tl.constexpr, KS: tl.constexpr = 1, NORM: tl.constexpr = False,
                       res_ptr=None, nw_ptr=None, xs_ptr=None, sumsq_ptr=None, stride_rm=0,
                       EVICT_FIRST: tl.constexpr = False):
    """Grid (groups of NW // KS row blocks, SPLIT); arguments as mma_linear_program's."""
    mma_linear_program(x_ptr, w_ptr, s_ptr, out_ptr, part_ptr, cnt_ptr, M, N, k_blocks, stride_xm, stride_wb,
                       stride_sb, stride_om, NW, DEPTH, SPLIT, SPLIT_POW2, PTX, PDL, PREFETCH, FP8, PRELOAD, KS,
                       NORM, res_ptr, nw_ptr, xs_ptr, sumsq_ptr, stride_rm, EVICT_FIRST)


def linear_tiles(n: int, k: int, device: torch.device, fp8: bool, tiles: MmaLinearTiles | None = None,
                 warp_split: bool = True) -> tuple[MmaLinearTiles, bool]:
    """(tiles, PTX decode) of an mma-layout GEMV [N, K] on ``device``: ``tiles`` or the heuristic's
    (``warp_split`` as mma_linear_tiles'), the portable ones where the PTX does not run (shared with
    qkv_mma, whose GEMV must match)."""
    ptx = use_ptx(device)
    t = tiles or mma_linear_tiles(n, k, num_sms(device), fp8, warp_split)
    check_warp_split("weight", t.num_warps, t.warp_split)
    if not ptx:
        t = portable_mma_tiles(t)
    check_k_steps("weight", t.split * t.warp_split, t.depth, k)
    return t, ptx


def split_buffers(device: torch.device, groups: int, split: int, m: int, n: int,
                  out: torch.Tensor) -> tuple[int, torch.Tensor, torch.Tensor | None]:
    """(split, fp32 partials, arrival counters) for a launch of ``groups`` x ``split`` programs: one
    split (partials = out) where no counters are to be had (the first call inside a graph capture)."""
    counters = split_counters(device, groups) if split > 1 else None
    if counters is None:
        return 1, out, None
    return split, torch.empty(split, m, n, dtype=torch.float32, device=device), counters


def aligned_x(x: torch.Tensor) -> torch.Tensor:
    """x [M, K] bf16 as the kernels read it: an int32 view of 16-byte aligned rows of 32-bit pairs
    (copied where x is not so)."""
    if x.stride(-1) != 1 or x.stride(0) % 8 or x.data_ptr() % 16:
        x = x.contiguous() if x.data_ptr() % 16 == 0 else x.clone()
    x32 = x.view(torch.int32)
    check_aligned("x", x32.unsqueeze(-1))
    return x32


def mma_linear(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, fmt: int, out_dtype: torch.dtype,
               tiles: MmaLinearTiles | None = None, pdl: bool = False) -> torch.Tensor:
    """y [M, N] = x [M, K] (bf16) @ dequant(weight)^T for a checked (weight, scale) pair in an mma
    layout (mx_linear's path for them): fp32 accumulation, out_dtype. ``tiles`` overrides
    tiles.mma_linear_tiles (tuning, tests)."""
    m, k = x.shape
    out = torch.empty(m, weight.shape[-3] * MMA_ROWS, dtype=out_dtype, device=x.device)
    _launch(x, weight, scale, fmt, out, tiles, pdl)
    return out


def mma_linear_add_norm(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, fmt: int, residual: torch.Tensor,
                        norm_weight: torch.Tensor, tiles: MmaLinearTiles | None = None,
                        pdl: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """y = x @ dequant(weight)^T (bf16, as mma_linear's) followed by norm.add_rmsnorm(y, residual,
    norm_weight) with the norm's one reduction left to the consumers: -> (residual_out, scaled, sumsq)
    where residual_out = bf16(y + residual) exactly as add_rmsnorm's, scaled = bf16(residual_out * (1 +
    norm_weight)) and sumsq [M, G] fp32 the sums of residual_out^2 over each program group's columns.
    The norm's h is bf16(residual_out * rstd * (1 + w)) with rstd = rsqrt(sumsq.sum(1) / N + eps), a
    scalar per row, so a linear consumer multiplies its product of ``scaled`` by rstd instead of
    reading h (router.router_logits and moe.routed_moe_experts take these three). The GEMV's last
    program of each group does it on the columns it stores: no norm kernel, no second pass."""
    m = x.shape[0]
    n = weight.shape[-3] * MMA_ROWS
    check_rows("residual", residual, n)
    if residual.shape[0] != m:
        raise ValueError(f"residual: expected {m} rows like x, got {residual.shape[0]}")
    check_norm_weight(norm_weight, n)
    res_out = torch.empty(m, n, dtype=torch.bfloat16, device=x.device)
    scaled = torch.empty_like(res_out)
    sumsq = _launch(x, weight, scale, fmt, res_out, tiles, pdl, norm=(residual, norm_weight, scaled))
    return res_out, scaled, sumsq


def column_groups(n: int, t: MmaLinearTiles) -> int:
    """The programs' column groups of a GEMV [N, K] on tiles t (the first grid axis)."""
    return triton.cdiv(n // MMA_ROWS, t.row_blocks)


def aot_norm_parts() -> int:
    """The sums of squares per row mma_linear_add_norm leaves for the real model's o_proj (MXFP8, 132 SMs):
    what the consumers' AOT specs size BLOCK_P for."""
    n, k = AOT_SHAPES[2]
    return column_groups(n, mma_linear_tiles(n, k, 132, True))


def _launch(x, weight, scale, fmt, out, tiles, pdl, norm=None):
    """The GEMV into out; norm (residual, norm weight, scaled rows out): the deferred norm's epilogue
    too, returning the sums of squares it stores [M, column groups] fp32 (else None)."""
    m, k = x.shape
    n = out.shape[1]
    if norm is None and (m == 0 or n == 0):
        return None
    fp8 = fmt == FMT_MXFP8_MMA
    t, ptx = linear_tiles(n, k, x.device, fp8, tiles)
    groups = column_groups(n, t)
    sumsq = None if norm is None else torch.empty(m, groups, dtype=torch.float32, device=x.device)
    if m == 0 or n == 0:
        return sumsq
    w, s = mma_operands("weight", weight, scale)
    x32 = aligned_x(x)
    split, part, counters = split_buffers(x.device, groups, t.split, m, n, out)
    pdl = pdl and pdl_supported(x.device)
    norm_args = {}
    if norm is not None:
        residual, norm_weight, scaled = norm
        norm_args = dict(NORM=True, res_ptr=residual, nw_ptr=norm_weight, xs_ptr=scaled, sumsq_ptr=sumsq,
                         stride_rm=residual.stride(0))
    _mma_linear_kernel[(groups, split)](
        x32, w, s, out, part, counters if counters is not None else s, m, n, k // MMA_K,
        x32.stride(0), w.stride(0), s.stride(0), out.stride(0),
        NW=t.num_warps, DEPTH=t.depth, SPLIT=split, SPLIT_POW2=triton.next_power_of_2(split), PTX=ptx, PDL=pdl,
        PREFETCH=t.prefetch, FP8=fp8, PRELOAD=preload_first(m), KS=t.warp_split, num_warps=t.num_warps,
        num_stages=1, launch_pdl=pdl, EVICT_FIRST=weights_evict_first(ptx), **register_cap(t), **norm_args)
    return sumsq


# ---- ahead-of-time specs ---------------------------------------------------------------------------------

# (N, K) met: a small matrix and the real model's qkv + index (9856 x 6144) and o_proj (6144 x 8192).
AOT_SHAPES = [(64, 128), (9856, 6144), (6144, 8192)]


def aot_specs() -> list[KernelSpec]:
    """Both formats with the heuristic's tiles, as one-token steps launch them: the inline-PTX decode
    (plain and as a PDL dependent) at every shape for CUDA, the portable one at the small shape for
    AMD, and for CUDA in MXFP4 only (mma layouts exist there only with the PTX decode: the portable
    path compiled once, as moe_mma's)."""
    sig = {"x_ptr": "*i32", "w_ptr": "*i32", "s_ptr": "*u8", "out_ptr": "*bf16", "part_ptr": "*fp32",
           "cnt_ptr": "*i32", "M": "i32", "N": "i32", "k_blocks": "i32", "stride_xm": "i32", "stride_wb": "i32",
           "stride_sb": "i32", "stride_om": "i32"}
    specs = []
    for fp8 in (False, True):
        for n, k in AOT_SHAPES:
            for ptx, pdl in ((False, False), (True, False), (True, True)):
                if not ptx and (n, k) != AOT_SHAPES[0]:
                    continue  # portable at the small size only (mma layouts are laid out only where PTX runs)
                t = mma_linear_tiles(n, k, 132, fp8)
                t = t if ptx else portable_mma_tiles(t)
                specs.append(KernelSpec(
                    _mma_linear_kernel, sig,
                    dict(NW=t.num_warps, DEPTH=t.depth, SPLIT=t.split, SPLIT_POW2=triton.next_power_of_2(t.split),
                         PTX=ptx, PDL=pdl, PREFETCH=t.prefetch, FP8=fp8, PRELOAD=preloads(1), KS=t.warp_split,
                         EVICT_FIRST=ptx),
                    num_warps=t.num_warps, num_stages=1, targets=("cuda",) if ptx else ("hip",) if fp8 else (),
                    name=f"mma_linear_{'fp8' if fp8 else 'fp4'}_n{n}_k{k}{'_ptx' if ptx else ''}{'_pdl' if pdl else ''}"
                         f"_s{t.split}" + (f"w{t.warp_split}" if t.warp_split > 1 else ""),
                    max_registers=t.max_registers))
    # o_proj with the post norm deferred (mma_linear_add_norm, the fused layer's one-token steps): the PTX
    # PDL launch at the real size (MXFP8, the model's o_proj, at one split and the tiles'; MXFP4 at the
    # tiles'), and for AMD the portable one at the small size (its epilogue at one split in MXFP4, after the
    # split-K reduction in MXFP8: the epilogue is the same code in either format).
    norm_sig = {**sig, "res_ptr": "*bf16", "nw_ptr": "*bf16", "xs_ptr": "*bf16", "sumsq_ptr": "*fp32",
                "stride_rm": "i32"}
    for fp8 in (False, True):
        for (n, k), ptx in ((AOT_SHAPES[2], True), (AOT_SHAPES[0], False)):
            t = mma_linear_tiles(n, k, 132, fp8)
            t = t if ptx else portable_mma_tiles(t)
            splits = {1, t.split} if ptx and fp8 else {t.split} if fp8 or ptx else {1}
            for split in sorted(splits):
                specs.append(KernelSpec(
                    _mma_linear_kernel, norm_sig,
                    dict(NW=t.num_warps, DEPTH=t.depth, SPLIT=split, SPLIT_POW2=triton.next_power_of_2(split),
                         PTX=ptx, PDL=ptx, PREFETCH=t.prefetch, FP8=fp8, PRELOAD=preloads(1), KS=t.warp_split,
                         NORM=True, EVICT_FIRST=ptx),
                    num_warps=t.num_warps, num_stages=1, targets=("cuda",) if ptx else ("hip",),
                    name=f"mma_linear_add_norm_{'fp8' if fp8 else 'fp4'}_n{n}_k{k}{'_ptx_pdl' if ptx else ''}"
                         f"_s{split}" + (f"w{t.warp_split}" if t.warp_split > 1 else ""),
                    max_registers=t.max_registers))
    return specs
