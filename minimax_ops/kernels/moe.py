"""The routed + shared SwiGLU-OAI experts of a MoE decode step (the router is router.py).

moe_experts streams each *distinct* chosen expert's weights once per step, with no host sync:
- Slots: slot s of a launch is the s-th smallest expert id present in topk_ids, found in-kernel by
  every program from the <= n*k ids (an [E, 16] comparison per 16 ids); slots past the number of
  distinct experts exit at once. The grid has min(E, n*k) (+1 for a shared expert, which takes the
  last slot of the grid, from the table or from its own tensors) slots, known on the host.
- ``_moe_w13_kernel`` (slot, I tile, H split): one tile of interleaved gate/up rows times all tokens
  of the step (16-row tl.dot tiles; rows of tokens that did not choose the expert are masked off
  the x loads) -> SwiGLU-OAI -> bf16 intermediate a[token, top-k column, I], stored for choosing
  tokens only (the shared expert's column is k). With H split, the splits write fp32 partials
  and the last split program of a tile to finish sums them (fixed order) and applies SwiGLU.
- ``_moe_w2_kernel`` (slot, H tile, I split): a @ W2^T for the choosing tokens, written fp32 to
  y[split, token, top-k column, H]. a and y have one row per (token, column) pair: O(n*k) memory.
- moe_combine.py's kernel (token, H tile): out = y_shared + sum_j w_j * y_j, in a fixed order.
Splitting H / I spreads the few experts of a small step over every SM without shrinking the
weight tiles (small tiles cost more instructions per weight value). A shared expert given
separately in another format than the routed table runs through the same kernels in SHARED_ONLY
mode (one slot, every token). The weight decode and K loop are mx_decode's; tables in the
``mxfp4_mma`` / ``mxfp8_mma`` layouts run moe_mma.py's kernels in place of w13 / w2 (same grid, buffers and combine).
"""

from __future__ import annotations

import dataclasses
import math
import os

import torch
import triton
import triton.language as tl

from ..formats import FMT_BF16, FMT_MXFP4, FMT_MXFP4_WORDS, FMT_MXFP8, MMA_CODES
from .aot import KernelSpec
from .mx_decode import (FORMAT_NAMES, POINTER_TYPES, PREFETCH_BYTES, as_kernel_operand, check_weight,
                        gdc_launch_dependents, gdc_wait, mxfp4_ptx, pdl_supported, prefetch_l2, stream_rows)
from .expert_slots import program_expert, slot_weights, swiglu_oai, token_columns
from . import router
from .moe_combine import combine_experts
from .moe_mma import launch_mma_experts
from .norm import check_rows
from .splitk import last_arrival, split_counters, sum_splits
from .tiles import EXPERT_FORMATS, TOKEN_BLOCK, ExpertTiles, expert_tiles, fit_chunks, num_sms

@triton.jit
def _store_activation(acc, a_ptr, offs_m, col, chosen, offs_i, inter_e, stride_am, stride_acol, alpha, limit,
                      BLOCK_M: tl.constexpr, BLOCK_I: tl.constexpr):
    """acc [BLOCK_M, 2*BLOCK_I] (gate i at 2i, up i at 2i+1) -> SwiGLU-OAI -> bf16 a rows."""
    gate, up = tl.split(tl.reshape(acc, [BLOCK_M, BLOCK_I, 2]))
    a = swiglu_oai(gate, up, alpha, limit)
    a_ptrs = a_ptr + offs_m.to(tl.int64)[:, None] * stride_am + col[:, None] * stride_acol + offs_i[None, :]
    tl.store(a_ptrs, a.to(a_ptr.dtype.element_ty), mask=chosen[:, None] & (offs_i[None, :] < inter_e))


@triton.jit
def _moe_w13_kernel(h_ptr, ids_ptr, w_ptr, s_ptr, sw_ptr, ss_ptr, a_ptr, part_ptr, cnt_ptr,
                    n_tokens, n_pairs, inter, inter_shared, h_iters,
                    stride_hm, stride_we, stride_wn, stride_se, stride_sn, stride_swn, stride_ssn,
                    stride_wt, stride_st, stride_swt, stride_sst,
                    stride_am, stride_acol, stride_psplit, stride_pm, stride_pcol,
                    alpha, limit,
                    NUM_ROUTED: tl.constexpr, E_POW2: tl.constexpr, TOPK: tl.constexpr, K_POW2: tl.constexpr,
                    SHARED_SLOT: tl.constexpr, SHARED_SEPARATE: tl.constexpr, SHARED_ONLY: tl.constexpr,
                    FMT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_I: tl.constexpr, BLOCK_K: tl.constexpr,
                    SWAP_AB: tl.constexpr, DOT_FP32: tl.constexpr, PTX: tl.constexpr, K_CHUNKS: tl.constexpr,
                    SPLIT: tl.constexpr, SPLIT_POW2: tl.constexpr, TILED: tl.constexpr, PDL: tl.constexpr,
                    FMA: tl.constexpr):
    """Grid (slot, I tile, H split): a[t, column, i] = swiglu_oai(h[t] W_gate[i]^T, h[t] W_up[i]^T)
    (bf16) for the tokens t that chose the slot's expert in top-k column `column` (k: shared).
    Tiled w13: tile row t holds gate rows of I tile t, tile row t + I/BLOCK_I the matching up rows.
    PDL: the slot's expert comes from the router just before, so the program waits first."""
    if PDL:
        gdc_wait()
        gdc_launch_dependents()
    expert = program_expert(ids_ptr, n_pairs, NUM_ROUTED, E_POW2, SHARED_SLOT, SHARED_ONLY)
    w_base, s_base, row_w, row_s, tile_w, tile_s, inter_e = slot_weights(
        expert, w_ptr, s_ptr, sw_ptr, ss_ptr, inter, inter_shared, stride_we, stride_wn, stride_se, stride_sn,
        stride_swn, stride_ssn, stride_wt, stride_st, stride_swt, stride_sst, NUM_ROUTED, SHARED_SEPARATE)
    i0 = tl.program_id(1) * BLOCK_I
    if (expert >= 0) & (i0 < inter_e):
        # Gate row i and up row I + i side by side: one [BLOCK_M, 2*BLOCK_I] product, split at the end.
        r = tl.arange(0, 2 * BLOCK_I)
        offs_i = i0 + tl.arange(0, BLOCK_I)
        if TILED:
            tile_rows = (tl.program_id(1) + (r % 2) * (inter_e // BLOCK_I)).to(tl.int64)
            w_rows = w_base + tile_rows * tile_w + (r // 2) * row_w
            s_rows = s_base + tile_rows * tile_s + (r // 2) * row_s
        else:
            rows = (tl.minimum(i0 + r // 2, inter_e - 1) + (r % 2) * inter_e).to(tl.int64)
            w_rows = w_base + rows * row_w
            s_rows = s_base + rows * row_s
        ips = tl.cdiv(h_iters, SPLIT)
        it_begin = tl.program_id(2) * ips
        n_iters = tl.minimum(ips, h_iters - it_begin)
        part_cols = tl.program_id(1) * 2 * BLOCK_I + r
        for m0 in range(0, n_tokens, BLOCK_M):
            offs_m, col = token_columns(ids_ptr, n_tokens, m0, expert, NUM_ROUTED, TOPK, K_POW2, BLOCK_M,
                                         SHARED_ONLY)
            chosen = col >= 0
            if tl.max(chosen.to(tl.int32), axis=0) > 0:
                acc = stream_rows(h_ptr + offs_m.to(tl.int64) * stride_hm, chosen, w_rows, s_rows,
                                  it_begin * (K_CHUNKS * BLOCK_K), n_iters, FMT, BLOCK_M, 2 * BLOCK_I, BLOCK_K,
                                  SWAP_AB, DOT_FP32, PTX, K_CHUNKS, BLOCK_I if TILED else 0, FMA)
                if SPLIT == 1:
                    _store_activation(acc, a_ptr, offs_m, col, chosen, offs_i, inter_e, stride_am, stride_acol,
                                      alpha, limit, BLOCK_M, BLOCK_I)
                else:
                    p_ptrs = (part_ptr + offs_m.to(tl.int64)[:, None] * stride_pm + col[:, None] * stride_pcol
                              + part_cols[None, :])
                    tl.store(p_ptrs + tl.program_id(2) * stride_psplit, acc, mask=chosen[:, None])
        if SPLIT > 1:
            # The last of the tile's SPLIT programs sums the partials in a fixed order.
            if last_arrival(cnt_ptr + tl.program_id(0) * tl.num_programs(1) + tl.program_id(1), SPLIT):
                for m0 in range(0, n_tokens, BLOCK_M):
                    offs_m, col = token_columns(ids_ptr, n_tokens, m0, expert, NUM_ROUTED, TOPK, K_POW2,
                                                 BLOCK_M, SHARED_ONLY)
                    chosen = col >= 0
                    if tl.max(chosen.to(tl.int32), axis=0) > 0:
                        p_ptrs = (part_ptr + offs_m.to(tl.int64)[:, None] * stride_pm
                                  + tl.maximum(col, 0)[:, None] * stride_pcol + part_cols[None, :])
                        acc = sum_splits(p_ptrs, chosen[:, None] & (r[None, :] >= 0), stride_psplit, SPLIT,
                                          SPLIT_POW2)
                        _store_activation(acc, a_ptr, offs_m, col, chosen, offs_i, inter_e, stride_am,
                                          stride_acol, alpha, limit, BLOCK_M, BLOCK_I)


@triton.jit
def _moe_w2_kernel(a_ptr, ids_ptr, w_ptr, s_ptr, sw_ptr, ss_ptr, y_ptr,
                   n_tokens, n_pairs, hidden, inter, inter_shared,
                   stride_am, stride_acol, stride_we, stride_wn, stride_se, stride_sn, stride_swn, stride_ssn,
                   stride_wt, stride_st, stride_swt, stride_sst, stride_ysplit, stride_ym, stride_ycol,
                   NUM_ROUTED: tl.constexpr, E_POW2: tl.constexpr, TOPK: tl.constexpr, K_POW2: tl.constexpr,
                   SHARED_SLOT: tl.constexpr, SHARED_SEPARATE: tl.constexpr, SHARED_ONLY: tl.constexpr,
                   FMT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                   SWAP_AB: tl.constexpr, DOT_FP32: tl.constexpr, PTX: tl.constexpr, K_CHUNKS: tl.constexpr,
                   SPLIT: tl.constexpr, TILED: tl.constexpr, PDL: tl.constexpr, PREFETCH: tl.constexpr,
                   FMA: tl.constexpr):
    """Grid (slot, H tile, I split): y[split, t, column, h] = a[t, column, split's I] W2[h, split's I]^T
    (fp32) for the tokens that chose the slot's expert; every split stores (zeros past its I).
    PDL: the ids are two kernels old (complete), so the program finds its expert, asks L2 for the
    start of its tiled weight slice, and only then waits for w13's activations."""
    expert = program_expert(ids_ptr, n_pairs, NUM_ROUTED, E_POW2, SHARED_SLOT, SHARED_ONLY)
    w_base, s_base, row_w, row_s, tile_w, tile_s, inter_e = slot_weights(
        expert, w_ptr, s_ptr, sw_ptr, ss_ptr, inter, inter_shared, stride_we, stride_wn, stride_se, stride_sn,
        stride_swn, stride_ssn, stride_wt, stride_st, stride_swt, stride_sst, NUM_ROUTED, SHARED_SEPARATE)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    if TILED:
        w_rows = w_base + tl.program_id(1).to(tl.int64) * tile_w + tl.arange(0, BLOCK_N) * row_w
        s_rows = s_base + tl.program_id(1).to(tl.int64) * tile_s + tl.arange(0, BLOCK_N) * row_s
    else:
        rows = tl.minimum(offs_n, hidden - 1).to(tl.int64)
        w_rows = w_base + rows * row_w
        s_rows = s_base + rows * row_s
    i_iters = inter_e // (K_CHUNKS * BLOCK_K)
    ips = tl.cdiv(i_iters, SPLIT)
    it_begin = tl.program_id(2) * ips
    n_iters = tl.minimum(ips, i_iters - it_begin)
    if PDL:
        if TILED and PREFETCH > 0:
            if expert >= 0:
                start = w_base + tl.program_id(1).to(tl.int64) * tile_w + (it_begin * K_CHUNKS).to(tl.int64) * BLOCK_N * row_w
                prefetch_l2(start, tl.minimum(n_iters * K_CHUNKS * BLOCK_N * row_w * (1 if FMA and FMT == 1 else 4),
                                              PREFETCH))
        gdc_wait()
        gdc_launch_dependents()
    if expert >= 0:
        for m0 in range(0, n_tokens, BLOCK_M):
            offs_m, col = token_columns(ids_ptr, n_tokens, m0, expert, NUM_ROUTED, TOPK, K_POW2, BLOCK_M,
                                         SHARED_ONLY)
            chosen = col >= 0
            if tl.max(chosen.to(tl.int32), axis=0) > 0:
                x_rows = a_ptr + offs_m.to(tl.int64) * stride_am + col * stride_acol  # masked where col < 0
                acc = stream_rows(x_rows, chosen, w_rows, s_rows, it_begin * (K_CHUNKS * BLOCK_K), n_iters,
                                  FMT, BLOCK_M, BLOCK_N, BLOCK_K, SWAP_AB, DOT_FP32, PTX, K_CHUNKS,
                                  BLOCK_N if TILED else 0, FMA)
                y_ptrs = (y_ptr + tl.program_id(2) * stride_ysplit + offs_m.to(tl.int64)[:, None] * stride_ym
                          + col[:, None] * stride_ycol + offs_n[None, :])
                tl.store(y_ptrs, acc, mask=chosen[:, None] & (offs_n[None, :] < hidden))


# ---- wrappers ----------------------------------------------------------------------------------------------


@dataclasses.dataclass
class _Table:
    """A checked expert table [E, rows, K] (a 2-D shared weight made [1, rows, K]) in any layout."""
    fmt: int  # the kernels' FMT decode code
    w: torch.Tensor
    scale: torch.Tensor | None
    rows: int
    tiles: tuple[int, int] | None  # (BN, BK) of tiled storage


def _expert_table(name: str, w: torch.Tensor, scale: torch.Tensor | None, experts: int | None, rows: int | None,
                  k: int, single: bool = False) -> _Table:
    """single: one expert's matrices (the separate shared expert), made a table of one."""
    if single:
        w = w.unsqueeze(0)
        scale = None if scale is None else scale.unsqueeze(0)
    lw = check_weight(name, w, scale, None, w.device, rank=3)
    if (experts is not None and w.shape[0] != experts) or (rows is not None and lw.n != rows):
        raise ValueError(f"{name}: expected {experts} experts x {rows} rows, got shape {tuple(w.shape)}")
    check_weight(name, w, scale, k, w.device, rank=3)
    return _Table(lw.layout.code, w, scale, lw.n, lw.tiles)


@dataclasses.dataclass
class _Weights:
    """One launch's expert weights in kernel form: the table, and a shared expert merged into it."""
    fmt: int
    tiled: bool
    w: torch.Tensor
    s: torch.Tensor
    sw: torch.Tensor  # = w when there is no separate shared expert in this launch
    ss: torch.Tensor
    inter_shared: int

    def strides(self) -> tuple[int, ...]:
        """(expert, row) strides of w and s, row strides of sw and ss, then tile-row strides of w, s,
        sw, ss (0 for row layouts): the kernels' stride_we .. stride_sst."""
        row = 3 if self.tiled else 1
        tile = [t.stride(1) if self.tiled else 0 for t in (self.w, self.s, self.sw, self.ss)]
        return (self.w.stride(0), self.w.stride(row), self.s.stride(0), self.s.stride(row), self.sw.stride(row),
                self.ss.stride(row), *tile)


def _checked_tables(hidden: int, w13, w13_scale, w2, w2_scale, shared_w13, shared_w13_scale, shared_w2,
                    shared_w2_scale, num_routed_experts: int) -> tuple[_Table, _Table, _Table | None, _Table | None]:
    """The expert tables (w13, w2, shared_w13, shared_w2; the shared ones None where not given), checked
    against each other and the hidden size, or ValueError naming the argument (before any launch)."""
    t13_w = _expert_table("w13", w13, w13_scale, None, None, hidden)
    experts, two_inter = t13_w.w.shape[0], t13_w.rows
    if two_inter % 2:
        raise ValueError(f"w13: expected 2*I rows (gate then up), got {two_inter}")
    inter = two_inter // 2
    t2_w = _expert_table("w2", w2, w2_scale, experts, hidden, inter)
    if t13_w.fmt != t2_w.fmt and (t13_w.fmt in MMA_CODES or t2_w.fmt in MMA_CODES):
        raise ValueError("w13 / w2: expected both or neither in an mma layout (mxfp4_mma / mxfp8_mma), of one format")
    separate = shared_w13 is not None
    if experts not in (num_routed_experts, num_routed_experts + 1) or (separate and experts != num_routed_experts):
        raise ValueError(f"w13: expected {num_routed_experts} experts (+1 if the shared expert is in the table "
                         f"and not given separately), got {experts}")
    if separate != (shared_w2 is not None):
        raise ValueError("shared_w13 / shared_w2: expected both or neither")
    s13 = s2 = None
    if separate:
        s13 = _expert_table("shared_w13", shared_w13, shared_w13_scale, 1, None, hidden, single=True)
        if s13.rows % 2:
            raise ValueError(f"shared_w13: expected 2*Is rows, got {s13.rows}")
        s2 = _expert_table("shared_w2", shared_w2, shared_w2_scale, 1, hidden, s13.rows // 2, single=True)
    return t13_w, t2_w, s13, s2


def _kernel_weights(table: _Table, shared: _Table | None, inter_shared: int, name: str, ptx: bool,
                    fma: bool = False) -> _Weights:
    fmt = table.fmt
    ptx = ptx and not fma and table.tiles is None  # tiled tables: portable decode
    wk = as_kernel_operand(table.w, fmt, name, ptx, native=fma)
    sk = table.scale if table.scale is not None else wk
    swk = wk if shared is None else as_kernel_operand(shared.w, fmt, f"shared_{name}", ptx, native=fma)
    ssk = sk if shared is None else (shared.scale if shared.scale is not None else swk)
    return _Weights(fmt, table.tiles is not None, wk, sk, swk, ssk, inter_shared)


def _launch_experts(h, ids, w13: _Weights, w2: _Weights, a, y, part, *, slots, inter, n_routed, shared_slot,
                    shared_separate, shared_only, t13: ExpertTiles, t2: ExpertTiles, alpha, limit, pdl, route=None,
                    norm=None):
    if w13.fmt in MMA_CODES:
        return launch_mma_experts(h, ids, w13, w2, a, y, part, slots=slots, inter=inter, n_routed=n_routed,
                                  shared_slot=shared_slot, shared_separate=shared_separate, shared_only=shared_only,
                                  t13=t13, t2=t2, alpha=alpha, limit=limit, pdl=pdl, route=route, norm=norm)
    n, hidden = h.shape
    top_k = ids.shape[1]
    inter_max = max(inter, w13.inter_shared) if shared_separate else inter
    common = dict(NUM_ROUTED=n_routed, E_POW2=triton.next_power_of_2(max(n_routed, 1)), TOPK=top_k,
                  K_POW2=triton.next_power_of_2(top_k), SHARED_SLOT=shared_slot, SHARED_SEPARATE=shared_separate,
                  SHARED_ONLY=shared_only, BLOCK_M=1 if t13.fma else TOKEN_BLOCK, DOT_FP32=h.device.type != "cuda",
                  PDL=pdl, FMA=t13.fma)
    i_tiles = triton.cdiv(inter_max, t13.block_n)
    counters = split_counters(h.device, slots * i_tiles) if t13.split > 1 else None
    if t13.split > 1 and counters is None:
        t13 = dataclasses.replace(t13, split=1)
    if part is None or t13.split == 1:
        part = a
    _moe_w13_kernel[(slots, i_tiles, t13.split)](
        h, ids, w13.w, w13.s, w13.sw, w13.ss, a, part, counters if counters is not None else ids,
        n, n * top_k, inter, w13.inter_shared, hidden // (t13.block_k * t13.k_chunks),
        h.stride(0), *w13.strides(), a.stride(0), a.stride(1), part.stride(0),
        part.stride(1) if part.dim() == 4 else 0, part.stride(2) if part.dim() == 4 else 0,
        float(alpha), float(limit), FMT=w13.fmt, BLOCK_I=t13.block_n, BLOCK_K=t13.block_k, SWAP_AB=t13.swap_ab,
        PTX=mxfp4_ptx(w13.fmt, t13.ptx, h.device) and not t13.fma and not w13.tiled, K_CHUNKS=t13.k_chunks, SPLIT=t13.split,
        SPLIT_POW2=triton.next_power_of_2(t13.split), TILED=w13.tiled,
        num_warps=t13.num_warps, num_stages=t13.num_stages, launch_pdl=pdl, **common)
    _moe_w2_kernel[(slots, triton.cdiv(hidden, t2.block_n), t2.split)](
        a, ids, w2.w, w2.s, w2.sw, w2.ss, y, n, n * top_k, hidden, inter, w2.inter_shared,
        a.stride(0), a.stride(1), *w2.strides(), y.stride(0), y.stride(1), y.stride(2),
        FMT=w2.fmt, BLOCK_N=t2.block_n, BLOCK_K=t2.block_k, SWAP_AB=t2.swap_ab,
        PTX=mxfp4_ptx(w2.fmt, t2.ptx, h.device) and not t2.fma and not w2.tiled,
        K_CHUNKS=t2.k_chunks, SPLIT=t2.split, TILED=w2.tiled, PREFETCH=PREFETCH_BYTES if pdl else 0,
        num_warps=t2.num_warps, num_stages=t2.num_stages, launch_pdl=pdl, **common)


def _with_tiles(t: ExpertTiles, table: _Table) -> ExpertTiles:
    """A tiled table fixes the block rows and BLOCK_K."""
    return t if table.tiles is None else dataclasses.replace(t, block_n=table.tiles[0], block_k=table.tiles[1])


def moe_experts(h: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                w13: torch.Tensor, w13_scale: torch.Tensor | None, w2: torch.Tensor, w2_scale: torch.Tensor | None,
                shared_w13: torch.Tensor | None = None, shared_w13_scale: torch.Tensor | None = None,
                shared_w2: torch.Tensor | None = None, shared_w2_scale: torch.Tensor | None = None, *,
                num_routed_experts: int, alpha: float = 1.702, limit: float = 7.0,
                tiles: tuple[ExpertTiles, ExpertTiles] | None = None, pdl: bool = False) -> torch.Tensor:
    """out [n, H] bf16 = shared(h) + sum_j topk_weights[:, j] * expert_{topk_ids[:, j]}(h).

    w13 [E', 2I, H] (gate rows then up rows) and w2 [E', H, I] in any layout of formats.LAYOUTS
    (a tiled table fixes its tiles), scales beside them. The shared expert is the table's expert
    num_routed_experts (E' = num_routed + 1), or shared_w13 [2Is, H] / shared_w2 [H, Is] in their
    own formats, or absent. Ids outside [0, num_routed_experts) are ignored. ``tiles`` overrides
    the (w13, w2) tile heuristic (tuning, tests). ``pdl``: launch as programmatic dependents
    (CUDA sm_90+ only)."""
    check_rows("h", h, shape="[n, H]", dim="H")
    n, hidden = h.shape
    if topk_ids.dim() != 2 or topk_ids.shape[0] != n or topk_ids.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"topk_ids: expected int32 [{n}, k], got {topk_ids.dtype} {tuple(topk_ids.shape)}")
    if topk_weights.dtype != torch.float32 or topk_weights.shape != topk_ids.shape:
        raise ValueError(f"topk_weights: expected fp32 {tuple(topk_ids.shape)}, got {topk_weights.dtype} "
                         f"{tuple(topk_weights.shape)}")
    tables = _checked_tables(hidden, w13, w13_scale, w2, w2_scale, shared_w13, shared_w13_scale, shared_w2,
                             shared_w2_scale, num_routed_experts)
    return _run_experts(h, topk_ids.to(torch.int32).contiguous(), topk_weights.contiguous(), tables,
                        num_routed_experts=num_routed_experts, alpha=alpha, limit=limit, tiles=tiles, pdl=pdl)


def _run_experts(h: torch.Tensor, ids: torch.Tensor, topk_weights: torch.Tensor, tables: tuple, *,
                 num_routed_experts: int, alpha: float, limit: float, tiles: tuple[ExpertTiles, ExpertTiles] | None,
                 pdl: bool, route: tuple | None = None, norm: tuple | None = None) -> torch.Tensor:
    """moe_experts on checked inputs: ids int32 / topk_weights fp32 contiguous [n, k], ``tables``
    _checked_tables'. ``route`` (routed_moe_experts, a one-token step on mma-layout tables): the router's
    (logits, bias, scaling); ids / topk_weights are then buffers the expert kernels fill. ``norm`` (the
    same steps): (sumsq, eps) of a deferred post norm, h its scaled rows (moe_mma.launch_mma_experts)."""
    n, hidden = h.shape
    pdl = pdl and pdl_supported(h.device)
    top_k = ids.shape[1]
    t13_w, t2_w, s13, s2 = tables
    inter = t13_w.rows // 2
    separate = s13 is not None
    fused = t13_w.w.shape[0] == num_routed_experts + 1
    inter_shared = s13.rows // 2 if separate else inter
    out = torch.empty(n, hidden, dtype=torch.bfloat16, device=h.device)
    if n == 0:
        return out
    sms = num_sms(h.device)
    routed_slots = min(num_routed_experts, n * top_k)
    # A separate shared expert in the routed layouts joins the routed launches (one slot more).
    merge = separate and (s13.fmt, s2.fmt, s13.tiles, s2.tiles) == (t13_w.fmt, t2_w.fmt, t13_w.tiles, t2_w.tiles)
    slots = routed_slots + int(fused or merge)
    inter_max = max(inter, inter_shared) if merge else inter
    if tiles is None:
        k2 = math.gcd(inter, inter_shared) if merge else inter  # BLOCK_K must divide both
        routed = route is not None
        t13 = expert_tiles(t13_w.fmt, hidden, 2 * inter_max, slots, True, sms, n_tokens=n, routed=routed)
        t2 = expert_tiles(t2_w.fmt, k2, hidden, slots, False, sms, n_tokens=n, routed=routed)
    else:
        t13, t2 = tiles
    t13, t2 = _with_tiles(t13, t13_w), _with_tiles(t2, t2_w)
    t13 = dataclasses.replace(t13, k_chunks=fit_chunks(hidden, t13.block_k, t13.k_chunks))
    t2 = dataclasses.replace(t2, k_chunks=fit_chunks(inter, t2.block_k, t2.k_chunks))
    mma = t2_w.fmt in MMA_CODES  # each split of the merged shared expert needs whole load steps
    if merge and (inter_shared % (t2.block_k * t2.k_chunks * (t2.split if mma else 1)) or inter_shared % t13.block_n):
        merge, slots, inter_max = False, routed_slots + int(fused), inter
    has_shared = fused or separate
    y = torch.empty(t2.split, n, top_k + int(has_shared), hidden, dtype=torch.float32, device=h.device)
    # One row per (token, top-k column): only chosen pairs are written and read.
    a = torch.empty(n, y.shape[2], inter_max, dtype=torch.bfloat16, device=h.device)
    part = None
    if t13.split > 1:
        part = torch.empty(t13.split, n, y.shape[2], 2 * inter_max, dtype=torch.float32, device=h.device)
    ptx13, ptx2 = mxfp4_ptx(t13_w.fmt, t13.ptx, h.device), mxfp4_ptx(t2_w.fmt, t2.ptx, h.device)
    kw13 = _kernel_weights(t13_w, s13 if merge else None, inter_shared, "w13", ptx13, t13.fma)
    kw2 = _kernel_weights(t2_w, s2 if merge else None, inter_shared, "w2", ptx2, t2.fma)
    _launch_experts(h, ids, kw13, kw2, a, y, part, slots=slots, inter=inter, n_routed=num_routed_experts,
                    shared_slot=fused or merge, shared_separate=merge, shared_only=False, t13=t13, t2=t2,
                    alpha=alpha, limit=limit, pdl=pdl,
                    route=None if route is None else (route[0], route[1], topk_weights, route[2]), norm=norm)
    if separate and not merge:
        st13 = _with_tiles(expert_tiles(s13.fmt, hidden, 2 * inter_shared, 1, True, sms, n_tokens=n), s13)
        st2 = dataclasses.replace(_with_tiles(expert_tiles(s2.fmt, inter_shared, hidden, 1, False, sms,
                                                           can_split=False, n_tokens=n), s2),
                                  split=t2.split)  # the combine sums every column over t2.split splits
        a_shared = torch.empty(n, y.shape[2], inter_shared, dtype=torch.bfloat16, device=h.device)
        spart = None
        if st13.split > 1:
            spart = torch.empty(st13.split, n, y.shape[2], 2 * inter_shared, dtype=torch.float32, device=h.device)
        _launch_experts(h, ids, _kernel_weights(s13, None, inter_shared, "shared_w13",
                                                mxfp4_ptx(s13.fmt, None, h.device), st13.fma),
                        _kernel_weights(s2, None, inter_shared, "shared_w2", mxfp4_ptx(s2.fmt, None, h.device),
                                        st2.fma),
                        a_shared, y, spart, slots=1, inter=inter_shared, n_routed=num_routed_experts,
                        shared_slot=False, shared_separate=False, shared_only=True, t13=st13, t2=st2,
                        alpha=alpha, limit=limit, pdl=pdl, norm=norm)
    combine_experts(y, topk_weights, ids, out, num_routed=num_routed_experts, top_k=top_k, has_shared=has_shared,
                    split=t2.split, pdl=pdl)
    return out


def routes_in_kernel(n_tokens: int, w13: torch.Tensor, w13_scale: torch.Tensor | None) -> bool:
    """Whether a step of the fused layer makes its top-k inside the expert kernels (routed_moe_experts):
    one-token steps on expert tables in an mma layout (their kernels take the choice from registers),
    unless MINIMAX_OPS_ROUTE_IN_EXPERTS=0 (read at every call: A/B runs switch it between rounds; the
    router's top-k launch then runs as in the unfused chain)."""
    if n_tokens != 1 or os.environ.get("MINIMAX_OPS_ROUTE_IN_EXPERTS") == "0":
        return False
    return check_weight("w13", w13, w13_scale, None, w13.device, rank=3).layout.code in MMA_CODES


def routed_moe_experts(h: torch.Tensor, gate: torch.Tensor, gate_bias: torch.Tensor | None, top_k: int,
                       scaling: float, w13: torch.Tensor, w13_scale: torch.Tensor | None, w2: torch.Tensor,
                       w2_scale: torch.Tensor | None, shared_w13: torch.Tensor | None = None,
                       shared_w13_scale: torch.Tensor | None = None, shared_w2: torch.Tensor | None = None,
                       shared_w2_scale: torch.Tensor | None = None, *, num_routed_experts: int, alpha: float = 1.702,
                       limit: float = 7.0, pdl: bool = False, deferred_norm: tuple | None = None) -> torch.Tensor:
    """router.route then moe_experts for a one-token step on mma-layout tables (``routes_in_kernel``'s
    steps; the caller decides, decode_layer's FFN step for the fused layer), routed inside the expert
    kernels: the router writes only its logits (router.router_logits: whole gate rows a program, no
    partials, no arrival counter, no top-k program) and each expert program makes the router's top-k
    itself from them (the top-k tail of the router and the ids' round trip leave the critical path).
    ``deferred_norm`` (residual_out, norm weight, sumsq, eps) of linear_mma.mma_linear_add_norm: the
    post norm before this step left to it, h being the scaled rows: the router makes the norm's h from
    residual_out and the sums, w13 multiplies its products by the row's rstd (no norm kernel). Other
    steps are refused by name before anything is launched."""
    router.check_gate(h, gate, gate_bias, top_k)
    if gate.shape[0] != num_routed_experts:
        raise ValueError(f"gate: expected {num_routed_experts} rows (one a routed expert), got {gate.shape[0]}")
    # Checked before the router's launch, so a refused step launches nothing.
    tables = _checked_tables(h.shape[1], w13, w13_scale, w2, w2_scale, shared_w13, shared_w13_scale, shared_w2,
                             shared_w2_scale, num_routed_experts)
    if h.shape[0] != 1:
        raise ValueError(f"route: the experts route in-kernel only one-token steps, got {h.shape[0]} tokens")
    if tables[0].fmt not in MMA_CODES:
        raise ValueError("route: the experts route in-kernel only in the mma layouts (mxfp4_mma / mxfp8_mma)")
    norm = None
    if deferred_norm is None:
        logits = router.router_logits(h, gate, pdl=pdl)
    else:
        residual_out, norm_weight, sumsq, eps = deferred_norm
        check_rows("residual_out", residual_out, h.shape[1])
        if tables[2] is not None and tables[2].fmt not in MMA_CODES:
            raise ValueError("deferred_norm: a separate shared expert must be in an mma layout too")
        logits = router.router_logits(residual_out, gate, pdl=pdl, deferred_norm=(norm_weight, sumsq, eps))
        norm = (sumsq, eps)
    ids = torch.empty(h.shape[0], top_k, dtype=torch.int32, device=h.device)
    weights = torch.empty(h.shape[0], top_k, dtype=torch.float32, device=h.device)
    return _run_experts(h, ids, weights, tables, num_routed_experts=num_routed_experts, alpha=alpha, limit=limit,
                        tiles=None, pdl=pdl, route=(logits, None if gate_bias is None else gate_bias.contiguous(),
                                                    scaling), norm=norm)


# ---- ahead-of-time specs ---------------------------------------------------------------------------------

# (H, I, routed experts, top-k): the tiny preset and the real model.
AOT_SIZE = (6144, 3072, 128, 4)  # (hidden, inter, routed experts, top-k): the real model's
AOT_TOKENS = (1, 16)
# (SHARED_SLOT, SHARED_SEPARATE, SHARED_ONLY): shared expert in the table, separate but merged into
# the routed launches, separate in its own launches, absent.
_MODES = {"table": (True, False, False), "merged": (True, True, False), "shared": (False, False, True),
          "routed": (False, False, False)}


def _launch_tiles(hidden: int, inter: int, n_routed: int, top_k: int, fmt: int, mode: str,
                  n: int) -> tuple[ExpertTiles, ExpertTiles]:
    """The (w13, w2) tiles moe_experts picks for an n-token step (as in the wrapper)."""
    shared_slot, _, shared_only = _MODES[mode]
    if shared_only:
        t13 = expert_tiles(fmt, hidden, 2 * inter, 1, True, 132, n_tokens=n)
        return t13, expert_tiles(fmt, inter, hidden, 1, False, 132, can_split=False, n_tokens=n)
    slots = min(n_routed, n * top_k) + int(shared_slot)
    return (expert_tiles(fmt, hidden, 2 * inter, slots, True, 132, n_tokens=n),
            expert_tiles(fmt, inter, hidden, slots, False, 132, n_tokens=n))


def _expert_specs(hidden: int, inter: int, n_routed: int, top_k: int, fmt: int, mode: str, t13: ExpertTiles,
                  t2: ExpertTiles, ptx: bool, tiled: bool = False, pdl: bool = False) -> list[KernelSpec]:
    shared_slot, shared_separate, shared_only = _MODES[mode]
    common = {"NUM_ROUTED": n_routed, "E_POW2": triton.next_power_of_2(n_routed), "TOPK": top_k,
              "K_POW2": triton.next_power_of_2(top_k), "SHARED_SLOT": shared_slot,
              "SHARED_SEPARATE": shared_separate, "SHARED_ONLY": shared_only, "FMT": fmt,
              "BLOCK_M": 1 if t13.fma else TOKEN_BLOCK, "DOT_FP32": False, "PTX": ptx and not t13.fma, "TILED": tiled,
              "PDL": pdl, "FMA": t13.fma}
    label = (f"{FORMAT_NAMES[fmt]}{'_ptx' if ptx else ''}{'_tiled' if tiled else ''}{'_pdl' if pdl else ''}"
             f"_h{hidden}_{mode}")
    targets = ("cuda",) if (ptx or pdl) else ()
    w_ptr = "*u8" if ptx and not t13.fma else "*fp8e4nv" if t13.fma and fmt == FMT_MXFP8 else POINTER_TYPES[fmt]
    s_ptr = "*u8" if fmt != FMT_BF16 else w_ptr
    weights = {"w_ptr": w_ptr, "s_ptr": s_ptr, "sw_ptr": w_ptr, "ss_ptr": s_ptr}
    strides = {n: "i32" for n in ("stride_we", "stride_wn", "stride_se", "stride_sn", "stride_swn", "stride_ssn",
                                  "stride_wt", "stride_st", "stride_swt", "stride_sst")}
    return [
        KernelSpec(_moe_w13_kernel,
                   {"h_ptr": "*bf16", "ids_ptr": "*i32", **weights, "a_ptr": "*bf16",
                    "part_ptr": "*fp32" if t13.split > 1 else "*bf16", "cnt_ptr": "*i32",
                    "n_tokens": "i32", "n_pairs": "i32", "inter": "i32", "inter_shared": "i32", "h_iters": "i32",
                    "stride_hm": "i32", **strides, "stride_am": "i32", "stride_acol": "i32", "stride_psplit": "i32",
                    "stride_pm": "i32", "stride_pcol": "i32", "alpha": "fp32", "limit": "fp32"},
                   dict(common, BLOCK_I=t13.block_n, BLOCK_K=t13.block_k, SWAP_AB=t13.swap_ab, K_CHUNKS=t13.k_chunks,
                        SPLIT=t13.split,
                        SPLIT_POW2=triton.next_power_of_2(t13.split)),
                   num_warps=t13.num_warps, num_stages=t13.num_stages, targets=targets,
                   name=f"moe_w13_{label}_i{t13.block_n}k{t13.block_k}x{t13.k_chunks}s{t13.split}"),
        KernelSpec(_moe_w2_kernel,
                   {"a_ptr": "*bf16", "ids_ptr": "*i32", **weights, "y_ptr": "*fp32",
                    "n_tokens": "i32", "n_pairs": "i32", "hidden": "i32", "inter": "i32", "inter_shared": "i32",
                    "stride_am": "i32", "stride_acol": "i32", **strides, "stride_ysplit": "i32", "stride_ym": "i32",
                    "stride_ycol": "i32"},
                   dict(common, BLOCK_N=t2.block_n, BLOCK_K=t2.block_k, SWAP_AB=t2.swap_ab, K_CHUNKS=t2.k_chunks,
                        SPLIT=t2.split, PREFETCH=PREFETCH_BYTES if pdl else 0),
                   num_warps=t2.num_warps, num_stages=t2.num_stages, targets=targets,
                   name=f"moe_w2_{label}_n{t2.block_n}k{t2.block_k}x{t2.k_chunks}s{t2.split}")]


def _all_expert_specs(ptx: bool, tiled: bool = False, pdl: bool = False) -> list[KernelSpec]:
    """Expert kernels at the real size in the merged and shared-only modes (every split the
    heuristic picks for 1- and 16-token steps), in every format (PTX: the MXFP4 launches of more
    than one token, the one-token steps decode portably). Tiled (an optional layout): the merged
    mode in the layouts weights.py produces (decoded portably: the PTX decode reads row layouts).
    Left out, compiling no line the kept ones do not: the table and routed modes (SHARED_SLOT and
    SHARED_SEPARATE only add selects to the merged mode's code) and the tiny size (its flags and
    tiles are the real size's, only narrower)."""
    specs, seen = [], set()
    formats = (FMT_MXFP4, FMT_MXFP4_WORDS) if ptx else (FMT_BF16, FMT_MXFP8, FMT_MXFP4, FMT_MXFP4_WORDS)
    if tiled:
        formats = tuple(f for f in formats if f != FMT_MXFP4)
    hidden, inter, n_routed, top_k = AOT_SIZE
    for fmt in formats:
        for mode in ("merged",) if tiled else ("merged", "shared"):
            for n in AOT_TOKENS:
                t13, t2 = _launch_tiles(hidden, inter, n_routed, top_k, fmt, mode, n)
                if ptx and t13.fma:  # (launches take PTX only off the one-token FMA path)
                    continue
                for spec in _expert_specs(hidden, inter, n_routed, top_k, fmt, mode, t13, t2, ptx, tiled, pdl):
                    if spec.label() not in seen:
                        seen.add(spec.label())
                        specs.append(spec)
    return specs


def combine_splits() -> list[int]:
    """The I splits a real-size w2 launch can leave for the expert combine to sum (any format, mode, step)."""
    hidden, inter, n_routed, top_k = AOT_SIZE
    return sorted({_launch_tiles(hidden, inter, n_routed, top_k, fmt, mode, n)[1].split
                   for fmt in EXPERT_FORMATS for mode in _MODES for n in AOT_TOKENS})


def aot_specs() -> list[KernelSpec]:
    """Every specialisation of the expert kernels (``_all_expert_specs``; the combine's are moe_combine.py's), row
    and tiled layouts; the MXFP4 inline-PTX ones and the PDL ones for CUDA only (their ``targets``). PDL only
    adds the prefetch and the waits, so where launches take both the PDL variant stands for the
    other: the PTX ones with PDL only (the fused layer's), the tiled ones without PDL for HIP only.
    None with PTX and tiled: tiled tables decode portably."""
    tiled_hip = [dataclasses.replace(s, targets=("hip",)) for s in _all_expert_specs(ptx=False, tiled=True)]
    return (_all_expert_specs(ptx=False) + tiled_hip + _all_expert_specs(ptx=True, pdl=True)
            + _all_expert_specs(ptx=False, tiled=True, pdl=True))
