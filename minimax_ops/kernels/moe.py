"""Sigmoid top-k router and the routed + shared SwiGLU-OAI experts of a MoE decode step.

route: ``_router_logits_kernel`` splits the fp32 gate GEMV [n, H] x [E, H]^T over (expert tile,
H split) so the 3 MB gate streams on many SMs, writing fp32 partial logits; the top-k (sum of the
partials in a fixed order, sigmoid, top-k of score + bias) runs in the last of those programs to
finish (``_last_arrival``: one launch), or in ``_router_topk_kernel`` (one program per token).

moe_experts streams each *distinct* chosen expert's weights once per step, with no host sync:
- Slots: slot s of a launch is the s-th smallest expert id present in topk_ids, found in-kernel by
  every program from the <= n*k ids (an [E, 16] comparison per 16 ids); slots past the number of
  distinct experts exit at once. The grid has min(E, n*k) (+1 for a shared expert, which takes the
  slot after the last routed one, from the table or from its own tensors) slots, known on the host.
- ``_moe_w13_kernel`` (slot, I tile, H split): one tile of interleaved gate/up rows times all tokens
  of the step (16-row tl.dot tiles; rows of tokens that did not choose the expert are masked off
  the x loads) -> SwiGLU-OAI -> bf16 intermediate a[token, top-k column, I], stored for choosing
  tokens only (the shared expert's column is k). With H split, the splits write fp32 partials
  and the last split program of a tile to finish sums them (fixed order) and applies SwiGLU.
- ``_moe_w2_kernel`` (slot, H tile, I split): a @ W2^T for the choosing tokens, written fp32 to
  y[split, token, top-k column, H]. a and y have one row per (token, column) pair: O(n*k) memory.
- ``_moe_combine_kernel`` (token, H tile): out = y_shared + sum_j w_j * y_j (each summed over the
  I splits) in a fixed order, so the result is deterministic (no float atomics). Ids outside
  [0, num_routed) contribute nothing.
Splitting H / I spreads the few experts of a small step over every SM without shrinking the
weight tiles (small tiles cost more instructions per weight value). A shared expert given
separately in another format than the routed table runs through the same kernels in SHARED_ONLY
mode (one slot, every token). The weight decode and K loop are mx_linear's.
"""

from __future__ import annotations

import dataclasses
import math

import torch
import triton
import triton.language as tl

from ..constants import MX_BLOCK
from .aot import KernelSpec
from .mx_linear import (_POINTER_TYPES, FMT_BF16, FMT_MXFP4, FMT_MXFP4_PREPARED, FMT_MXFP8, FORMAT_NAMES,
                        _last_arrival, _stream_rows, _sum_splits, as_kernel_operand, block_k_for, check_scale,
                        in_features, kernel_format, mxfp4_ptx, num_sms, split_counters)

PAIR_BLOCK = tl.constexpr(16)  # top-k ids compared per step when finding a slot's expert (E x 16 compares: few registers)
TOKEN_BLOCK = 16  # token rows per tl.dot tile (a step's tokens, padded)


# ---- router ----------------------------------------------------------------------------------------------


@triton.jit
def _topk_row(part_ptr, bias_ptr, weights_ptr, ids_ptr, t, n_tokens, n_experts, n_split, scaling,
              HAS_BIAS: tl.constexpr, E_POW2: tl.constexpr, TOPK: tl.constexpr, K_POW2: tl.constexpr,
              SPLIT_POW2: tl.constexpr):
    """Token t: logits = sum of the split partials part[s, t, :] (all loaded at once, fixed tree
    order); ids = top-k of sigmoid(logit) + bias (descending; ties to the lower id), weights = the
    chosen sigmoid scores renormalised to sum to `scaling`."""
    offs_e = tl.arange(0, E_POW2)
    e_mask = offs_e < n_experts
    logits = _sum_splits(part_ptr + t * n_experts + offs_e, e_mask, n_tokens * n_experts, n_split, SPLIT_POW2)
    score = tl.sigmoid(logits)
    choice = score
    if HAS_BIAS:
        choice = score + tl.load(bias_ptr + offs_e, mask=e_mask, other=0.0)
    choice = tl.where(e_mask, choice, float("-inf"))
    cols = tl.arange(0, K_POW2)
    ids = tl.zeros([K_POW2], dtype=tl.int32)
    weights = tl.zeros([K_POW2], dtype=tl.float32)
    for j in tl.static_range(TOPK):
        best = tl.argmax(choice, axis=0)
        ids = tl.where(cols == j, best, ids)
        weights = tl.where(cols == j, tl.sum(tl.where(offs_e == best, score, 0.0), axis=0), weights)
        choice = tl.where(offs_e == best, float("-inf"), choice)
    weights = weights / tl.sum(weights, axis=0) * scaling
    tl.store(ids_ptr + t * TOPK + cols, ids, mask=cols < TOPK)
    tl.store(weights_ptr + t * TOPK + cols, weights, mask=cols < TOPK)


@triton.jit
def _router_logits_kernel(h_ptr, g_ptr, part_ptr, cnt_ptr, bias_ptr, weights_ptr, ids_ptr,
                          n_tokens, n_experts, iters_per_split, n_split, stride_hm, stride_ge, scaling,
                          BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_H: tl.constexpr,
                          LOGITS: tl.constexpr, FUSED_TOPK: tl.constexpr, HAS_BIAS: tl.constexpr,
                          E_POW2: tl.constexpr, TOPK: tl.constexpr, K_POW2: tl.constexpr, SPLIT_POW2: tl.constexpr):
    """Grid (expert tiles, H splits): part[split, t, e] = sum over the split's H of h[t] * gate[e] in
    fp32 (LOGITS 0: tl.dot, ieee fp32 FMAs; 1: tl.dot in 3xTF32 on tensor cores, fp32-accurate;
    2: one token at a time, multiply and row sums, gate tile loaded once); with FUSED_TOPK the last
    program to finish runs the top-k of every token."""
    pid_e = tl.program_id(0)
    pid_s = tl.program_id(1)
    offs_e = pid_e * BLOCK_E + tl.arange(0, BLOCK_E)
    rows = tl.minimum(offs_e, n_experts - 1).to(tl.int64)
    k0 = pid_s * iters_per_split * BLOCK_H
    offs_k = k0 + tl.arange(0, BLOCK_H)
    if LOGITS == 2:
        g_ptrs = g_ptr + rows[:, None] * stride_ge + offs_k[None, :]
        t_rows = tl.arange(0, BLOCK_T)
        for t0 in range(0, n_tokens, BLOCK_T):
            acc = tl.zeros([BLOCK_T, BLOCK_E], dtype=tl.float32)
            for i in range(iters_per_split):
                g = tl.load(g_ptrs + i * BLOCK_H)
                for tt in range(0, tl.minimum(BLOCK_T, n_tokens - t0)):
                    x = tl.load(h_ptr + (t0 + tt) * stride_hm + offs_k + i * BLOCK_H).to(tl.float32)
                    row = tl.sum(g * x[None, :], axis=1)
                    acc = tl.where(t_rows[:, None] == tt, acc + row[None, :], acc)
            offs_t = t0 + t_rows
            out = part_ptr + pid_s * n_tokens * n_experts + offs_t[:, None] * n_experts + offs_e[None, :]
            tl.store(out, acc, mask=(offs_t[:, None] < n_tokens) & (offs_e[None, :] < n_experts))
    else:
        for t0 in range(0, n_tokens, BLOCK_T):
            offs_t = t0 + tl.arange(0, BLOCK_T)
            t_mask = offs_t < n_tokens
            x_ptrs = h_ptr + offs_t.to(tl.int64)[:, None] * stride_hm + offs_k[None, :]
            g_ptrs = g_ptr + rows[:, None] * stride_ge + offs_k[None, :]
            acc = tl.zeros([BLOCK_T, BLOCK_E], dtype=tl.float32)
            for _ in range(iters_per_split):
                x = tl.load(x_ptrs, mask=t_mask[:, None], other=0.0).to(tl.float32)
                g = tl.trans(tl.load(g_ptrs))
                if LOGITS == 1:
                    acc = tl.dot(x, g, acc, input_precision="tf32x3")
                else:
                    acc = tl.dot(x, g, acc, input_precision="ieee")
                x_ptrs += BLOCK_H
                g_ptrs += BLOCK_H
            out = part_ptr + pid_s * n_tokens * n_experts + offs_t[:, None] * n_experts + offs_e[None, :]
            tl.store(out, acc, mask=t_mask[:, None] & (offs_e[None, :] < n_experts))
    if FUSED_TOPK:
        if _last_arrival(cnt_ptr, tl.num_programs(0) * tl.num_programs(1)):
            for t in range(0, n_tokens):
                _topk_row(part_ptr, bias_ptr, weights_ptr, ids_ptr, t, n_tokens, n_experts, n_split, scaling,
                          HAS_BIAS, E_POW2, TOPK, K_POW2, SPLIT_POW2)


@triton.jit
def _router_topk_kernel(part_ptr, bias_ptr, weights_ptr, ids_ptr, n_tokens, n_experts, n_split, scaling,
                        HAS_BIAS: tl.constexpr, E_POW2: tl.constexpr, TOPK: tl.constexpr, K_POW2: tl.constexpr,
                        SPLIT_POW2: tl.constexpr):
    """One program per token: the top-k of _router_logits_kernel's partials (unfused mode)."""
    _topk_row(part_ptr, bias_ptr, weights_ptr, ids_ptr, tl.program_id(0), n_tokens, n_experts, n_split, scaling,
              HAS_BIAS, E_POW2, TOPK, K_POW2, SPLIT_POW2)


# ---- experts ---------------------------------------------------------------------------------------------


@triton.jit
def _slot_expert(ids_ptr, n_pairs, slot, NUM_ROUTED: tl.constexpr, E_POW2: tl.constexpr,
                 SHARED_SLOT: tl.constexpr):
    """The slot-th smallest routed expert id present in ids[0:n_pairs]; with SHARED_SLOT the slot
    right after the last present one is the shared expert NUM_ROUTED; -1 for an empty slot."""
    experts = tl.arange(0, E_POW2)
    present = tl.zeros([E_POW2], dtype=tl.int32)
    for p0 in range(0, n_pairs, PAIR_BLOCK):
        offs = p0 + tl.arange(0, PAIR_BLOCK)
        ids = tl.load(ids_ptr + offs, mask=offs < n_pairs, other=-1)
        present = tl.maximum(present, tl.max((ids[None, :] == experts[:, None]).to(tl.int32), axis=1))
    present = tl.where(experts < NUM_ROUTED, present, 0)
    rank = tl.cumsum(present, axis=0) - 1
    expert = tl.max(tl.where((present > 0) & (rank == slot), experts, -1), axis=0)
    if SHARED_SLOT:
        expert = tl.where(slot == tl.sum(present, axis=0), NUM_ROUTED, expert)
    return expert


@triton.jit
def _token_columns(ids_ptr, n_tokens, m0, expert, NUM_ROUTED: tl.constexpr, TOPK: tl.constexpr,
                   K_POW2: tl.constexpr, BLOCK_M: tl.constexpr, SHARED_ONLY: tl.constexpr):
    """Tokens m0..m0+BLOCK_M: (token index, the top-k column that chose `expert`, -1 if none).
    The shared expert (NUM_ROUTED, or every token with SHARED_ONLY) has column TOPK."""
    offs_m = m0 + tl.arange(0, BLOCK_M)
    valid = offs_m < n_tokens
    col = tl.where(valid, TOPK, -1)
    if not SHARED_ONLY:
        cols = tl.arange(0, K_POW2)
        ids = tl.load(ids_ptr + offs_m[:, None] * TOPK + cols[None, :],
                      mask=valid[:, None] & (cols[None, :] < TOPK), other=-1)
        routed_col = tl.max(tl.where(ids == expert, cols[None, :], -1), axis=1)
        col = tl.where(expert == NUM_ROUTED, col, routed_col)
    return offs_m, col


@triton.jit
def _slot_weights(ids_ptr, n_pairs, w_ptr, s_ptr, sw_ptr, ss_ptr, inter, inter_shared,
                  stride_we, stride_wn, stride_se, stride_sn, stride_swn, stride_ssn,
                  NUM_ROUTED: tl.constexpr, E_POW2: tl.constexpr, SHARED_SLOT: tl.constexpr,
                  SHARED_SEPARATE: tl.constexpr, SHARED_ONLY: tl.constexpr):
    """(expert, weight base, scale base, weight row stride, scale row stride, intermediate size) of
    this program's slot; expert -1 for an empty slot. A separate shared expert (SHARED_SEPARATE)
    reads its own tensors; SHARED_ONLY launches have one slot whose 'table' is that expert."""
    slot = tl.program_id(0)
    if SHARED_ONLY:
        expert = slot
    else:
        expert = _slot_expert(ids_ptr, n_pairs, slot, NUM_ROUTED, E_POW2, SHARED_SLOT)
    w_base = w_ptr + tl.maximum(expert, 0).to(tl.int64) * stride_we
    s_base = s_ptr + tl.maximum(expert, 0).to(tl.int64) * stride_se
    row_w = stride_wn
    row_s = stride_sn
    inter_e = inter
    if SHARED_SEPARATE:
        shared = expert == NUM_ROUTED
        w_base = tl.where(shared, sw_ptr, w_base)
        s_base = tl.where(shared, ss_ptr, s_base)
        row_w = tl.where(shared, stride_swn, row_w)
        row_s = tl.where(shared, stride_ssn, row_s)
        inter_e = tl.where(shared, inter_shared, inter_e)
    return expert, w_base, s_base, row_w, row_s, inter_e


@triton.jit
def _swiglu_oai(gate, up, alpha, limit):
    g = tl.minimum(gate, limit)
    u = tl.minimum(tl.maximum(up, -limit), limit)
    return g * tl.sigmoid(alpha * g) * (u + 1.0)


@triton.jit
def _store_activation(acc, a_ptr, offs_m, col, chosen, offs_i, inter_e, stride_am, stride_acol, alpha, limit,
                      BLOCK_M: tl.constexpr, BLOCK_I: tl.constexpr):
    """acc [BLOCK_M, 2*BLOCK_I] (gate i at 2i, up i at 2i+1) -> SwiGLU-OAI -> bf16 a rows."""
    gate, up = tl.split(tl.reshape(acc, [BLOCK_M, BLOCK_I, 2]))
    a = _swiglu_oai(gate, up, alpha, limit)
    a_ptrs = a_ptr + offs_m.to(tl.int64)[:, None] * stride_am + col[:, None] * stride_acol + offs_i[None, :]
    tl.store(a_ptrs, a.to(a_ptr.dtype.element_ty), mask=chosen[:, None] & (offs_i[None, :] < inter_e))


@triton.jit
def _moe_w13_kernel(h_ptr, ids_ptr, w_ptr, s_ptr, sw_ptr, ss_ptr, a_ptr, part_ptr, cnt_ptr,
                    n_tokens, n_pairs, inter, inter_shared, h_iters,
                    stride_hm, stride_we, stride_wn, stride_se, stride_sn, stride_swn, stride_ssn,
                    stride_am, stride_acol, stride_psplit, stride_pm, stride_pcol,
                    alpha, limit,
                    NUM_ROUTED: tl.constexpr, E_POW2: tl.constexpr, TOPK: tl.constexpr, K_POW2: tl.constexpr,
                    SHARED_SLOT: tl.constexpr, SHARED_SEPARATE: tl.constexpr, SHARED_ONLY: tl.constexpr,
                    FMT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_I: tl.constexpr, BLOCK_K: tl.constexpr,
                    SWAP_AB: tl.constexpr, DOT_FP32: tl.constexpr, PTX: tl.constexpr, K_CHUNKS: tl.constexpr,
                    SPLIT: tl.constexpr, SPLIT_POW2: tl.constexpr):
    """Grid (slot, I tile, H split): a[t, column, i] = swiglu_oai(h[t] W_gate[i]^T, h[t] W_up[i]^T)
    (bf16) for the tokens t that chose the slot's expert in top-k column `column` (k: shared)."""
    expert, w_base, s_base, row_w, row_s, inter_e = _slot_weights(
        ids_ptr, n_pairs, w_ptr, s_ptr, sw_ptr, ss_ptr, inter, inter_shared, stride_we, stride_wn, stride_se,
        stride_sn, stride_swn, stride_ssn, NUM_ROUTED, E_POW2, SHARED_SLOT, SHARED_SEPARATE, SHARED_ONLY)
    i0 = tl.program_id(1) * BLOCK_I
    if (expert >= 0) & (i0 < inter_e):
        # Gate row i and up row I + i side by side: one [BLOCK_M, 2*BLOCK_I] product, split at the end.
        r = tl.arange(0, 2 * BLOCK_I)
        offs_i = i0 + tl.arange(0, BLOCK_I)
        rows = (tl.minimum(i0 + r // 2, inter_e - 1) + (r % 2) * inter_e).to(tl.int64)
        w_rows = w_base + rows * row_w
        s_rows = s_base + rows * row_s
        ips = tl.cdiv(h_iters, SPLIT)
        it_begin = tl.program_id(2) * ips
        n_iters = tl.minimum(ips, h_iters - it_begin)
        part_cols = tl.program_id(1) * 2 * BLOCK_I + r
        for m0 in range(0, n_tokens, BLOCK_M):
            offs_m, col = _token_columns(ids_ptr, n_tokens, m0, expert, NUM_ROUTED, TOPK, K_POW2, BLOCK_M,
                                         SHARED_ONLY)
            chosen = col >= 0
            if tl.max(chosen.to(tl.int32), axis=0) > 0:
                acc = _stream_rows(h_ptr + offs_m.to(tl.int64) * stride_hm, chosen, w_rows, s_rows,
                                   it_begin * (K_CHUNKS * BLOCK_K), n_iters, FMT, BLOCK_M, 2 * BLOCK_I, BLOCK_K,
                                   SWAP_AB, DOT_FP32, PTX, K_CHUNKS)
                if SPLIT == 1:
                    _store_activation(acc, a_ptr, offs_m, col, chosen, offs_i, inter_e, stride_am, stride_acol,
                                      alpha, limit, BLOCK_M, BLOCK_I)
                else:
                    p_ptrs = (part_ptr + offs_m.to(tl.int64)[:, None] * stride_pm + col[:, None] * stride_pcol
                              + part_cols[None, :])
                    tl.store(p_ptrs + tl.program_id(2) * stride_psplit, acc, mask=chosen[:, None])
        if SPLIT > 1:
            # The last of the tile's SPLIT programs sums the partials in a fixed order.
            if _last_arrival(cnt_ptr + tl.program_id(0) * tl.num_programs(1) + tl.program_id(1), SPLIT):
                for m0 in range(0, n_tokens, BLOCK_M):
                    offs_m, col = _token_columns(ids_ptr, n_tokens, m0, expert, NUM_ROUTED, TOPK, K_POW2,
                                                 BLOCK_M, SHARED_ONLY)
                    chosen = col >= 0
                    if tl.max(chosen.to(tl.int32), axis=0) > 0:
                        p_ptrs = (part_ptr + offs_m.to(tl.int64)[:, None] * stride_pm
                                  + tl.maximum(col, 0)[:, None] * stride_pcol + part_cols[None, :])
                        acc = _sum_splits(p_ptrs, chosen[:, None] & (r[None, :] >= 0), stride_psplit, SPLIT,
                                          SPLIT_POW2)
                        _store_activation(acc, a_ptr, offs_m, col, chosen, offs_i, inter_e, stride_am,
                                          stride_acol, alpha, limit, BLOCK_M, BLOCK_I)


@triton.jit
def _moe_w2_kernel(a_ptr, ids_ptr, w_ptr, s_ptr, sw_ptr, ss_ptr, y_ptr,
                   n_tokens, n_pairs, hidden, inter, inter_shared,
                   stride_am, stride_acol, stride_we, stride_wn, stride_se, stride_sn, stride_swn, stride_ssn,
                   stride_ysplit, stride_ym, stride_ycol,
                   NUM_ROUTED: tl.constexpr, E_POW2: tl.constexpr, TOPK: tl.constexpr, K_POW2: tl.constexpr,
                   SHARED_SLOT: tl.constexpr, SHARED_SEPARATE: tl.constexpr, SHARED_ONLY: tl.constexpr,
                   FMT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                   SWAP_AB: tl.constexpr, DOT_FP32: tl.constexpr, PTX: tl.constexpr, K_CHUNKS: tl.constexpr,
                   SPLIT: tl.constexpr):
    """Grid (slot, H tile, I split): y[split, t, column, h] = a[t, column, split's I] W2[h, split's I]^T
    (fp32) for the tokens that chose the slot's expert; every split stores (zeros past its I)."""
    expert, w_base, s_base, row_w, row_s, inter_e = _slot_weights(
        ids_ptr, n_pairs, w_ptr, s_ptr, sw_ptr, ss_ptr, inter, inter_shared, stride_we, stride_wn, stride_se,
        stride_sn, stride_swn, stride_ssn, NUM_ROUTED, E_POW2, SHARED_SLOT, SHARED_SEPARATE, SHARED_ONLY)
    if expert >= 0:
        offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        rows = tl.minimum(offs_n, hidden - 1).to(tl.int64)
        w_rows = w_base + rows * row_w
        s_rows = s_base + rows * row_s
        i_iters = inter_e // (K_CHUNKS * BLOCK_K)
        ips = tl.cdiv(i_iters, SPLIT)
        it_begin = tl.program_id(2) * ips
        n_iters = tl.minimum(ips, i_iters - it_begin)
        for m0 in range(0, n_tokens, BLOCK_M):
            offs_m, col = _token_columns(ids_ptr, n_tokens, m0, expert, NUM_ROUTED, TOPK, K_POW2, BLOCK_M,
                                         SHARED_ONLY)
            chosen = col >= 0
            if tl.max(chosen.to(tl.int32), axis=0) > 0:
                x_rows = a_ptr + offs_m.to(tl.int64) * stride_am + col * stride_acol  # masked where col < 0
                acc = _stream_rows(x_rows, chosen, w_rows, s_rows, it_begin * (K_CHUNKS * BLOCK_K), n_iters,
                                   FMT, BLOCK_M, BLOCK_N, BLOCK_K, SWAP_AB, DOT_FP32, PTX, K_CHUNKS)
                y_ptrs = (y_ptr + tl.program_id(2) * stride_ysplit + offs_m.to(tl.int64)[:, None] * stride_ym
                          + col[:, None] * stride_ycol + offs_n[None, :])
                tl.store(y_ptrs, acc, mask=chosen[:, None] & (offs_n[None, :] < hidden))


@triton.jit
def _moe_combine_kernel(y_ptr, topk_weights_ptr, ids_ptr, out_ptr, hidden, stride_ysplit, stride_ym, stride_ycol,
                        stride_om, NUM_ROUTED: tl.constexpr, TOPK: tl.constexpr, HAS_SHARED: tl.constexpr,
                        BLOCK_H: tl.constexpr, SPLIT: tl.constexpr):
    """Grid (token, H tile): out = y[shared] + sum over j = 0..k-1 of w_j * y[j], in that order,
    each y summed over the I splits first."""
    t = tl.program_id(0).to(tl.int64)
    offs_h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    h_mask = offs_h < hidden
    y_row = y_ptr + t * stride_ym + offs_h
    acc = tl.zeros([BLOCK_H], dtype=tl.float32)
    if HAS_SHARED:
        for s in tl.static_range(SPLIT):
            acc += tl.load(y_row + s * stride_ysplit + TOPK * stride_ycol, mask=h_mask, other=0.0)
    for j in tl.static_range(TOPK):
        expert = tl.load(ids_ptr + t * TOPK + j)
        ok = (expert >= 0) & (expert < NUM_ROUTED)  # y rows of invalid ids were never written
        y = tl.zeros([BLOCK_H], dtype=tl.float32)
        for s in tl.static_range(SPLIT):
            y += tl.load(y_row + s * stride_ysplit + j * stride_ycol, mask=h_mask & ok, other=0.0)
        acc += tl.where(ok, tl.load(topk_weights_ptr + t * TOPK + j), 0.0) * y
    tl.store(out_ptr + t * stride_om + offs_h, acc.to(out_ptr.dtype.element_ty), mask=h_mask)


# ---- tile heuristic --------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class ExpertTiles:
    block_n: int  # w13: gate rows per program (and as many up rows); w2: output rows per program
    block_k: int
    num_warps: int = 4
    num_stages: int = 3
    split: int = 1  # K splits (w13: over H, w2: over I)
    swap_ab: bool = True
    ptx: bool | None = None  # MXFP4 inline-PTX decode; None: wherever mx_linear.use_ptx allows
    k_chunks: int = 1  # BLOCK_K tiles per K-loop step (see mx_linear._stream_rows)


# Per format, per kernel (w13, w2): (weight rows per program, largest BLOCK_K, num_warps, num_stages,
# K chunks per step), from benchmarks/sweep_kernels.py on an H200 (triton 3.6; 1/4/16-token steps,
# shared expert separate; 3 runs, ~40 tiles x splits per kernel and format): MXFP8 streams 64-row
# tiles 256 values wide, MXFP4 128-row tiles 256 (w13) / 64 (w2) values wide. Wider MXFP4 rows
# (512 values, 8 warps: 10% slower at 1 token, 2x at 16) and K chunks (up to 30% slower: shared
# memory) lost. K is split only to bring a launch to _EXPERT_MIN_PROGRAMS per SM: splitting w13 (H)
# never paid, splitting w2 (I) helps 1-2 token steps by a few %. The kernel-layout MXFP4
# (prepare_weight) runs 9-10% faster than canonical with these tiles; the PTX decode is worth ~10%
# there and nothing measurable on canonical MXFP4.
_EXPERT_TILES = {
    FMT_BF16: ((64, 128, 4, 3, 1), (64, 128, 4, 3, 1)),
    FMT_MXFP8: ((64, 256, 4, 3, 1), (64, 256, 4, 3, 1)),
    FMT_MXFP4: ((128, 256, 4, 3, 1), (128, 64, 4, 3, 1)),
    FMT_MXFP4_PREPARED: ((128, 256, 4, 3, 1), (128, 64, 4, 3, 1)),
}
_EXPERT_MIN_PROGRAMS = (1.0, 5.0)  # per SM, (w13, w2)
_MIN_ITERS_PER_SPLIT = 4
COMBINE_BLOCK = 1024


def expert_tiles(fmt: int, k: int, rows_total: int, slots: int, w13: bool, sms: int,
                 can_split: bool = True) -> ExpertTiles:
    """Tiles of one expert launch over `slots` experts of `rows_total` weight rows (w13: 2I) and
    K = k: the format's tile, K split until the launch has _EXPERT_MIN_PROGRAMS programs per SM."""
    rows, cap_k, warps, stages, chunks = _EXPERT_TILES[fmt][0 if w13 else 1]
    rows = max(32 if w13 else 16, min(rows, triton.next_power_of_2(rows_total)))  # tiny models: no idle rows
    block_k = block_k_for(k, cap_k)
    chunks = fit_chunks(k, block_k, chunks)
    tiles = slots * triton.cdiv(rows_total, rows)
    split = 1
    if can_split:
        iters = k // (block_k * chunks)
        options = [d for d in range(1, iters + 1) if iters % d == 0 and iters // d >= _MIN_ITERS_PER_SPLIT] or [1]
        target = _EXPERT_MIN_PROGRAMS[0 if w13 else 1] * sms
        split = next((d for d in options if tiles * d >= target), options[-1])
    return ExpertTiles(rows // 2 if w13 else rows, block_k, warps, stages, split, k_chunks=chunks)


def fit_chunks(k: int, block_k: int, chunks: int) -> int:
    """The largest power-of-two count <= chunks of BLOCK_K tiles per step that divides K."""
    while chunks > 1 and k % (block_k * chunks):
        chunks //= 2
    return chunks


@dataclasses.dataclass(frozen=True)
class RouterConfig:
    block_e: int
    block_h: int
    split: int  # H splits (the wrapper rounds it down to a divisor of hidden / block_h)
    logits: int = 2  # _router_logits_kernel's LOGITS mode
    fused_topk: bool = True
    num_warps: int = 4


def router_config(n_tokens: int, n_experts: int, hidden: int, sms: int) -> RouterConfig:
    """Router GEMV tiles, from benchmarks/sweep_kernels.py on an H200 (128 x 6144 fp32 gate): 32
    experts x 256 of H per program, one step each (96 programs). 1 token: multiply + row sums and
    the top-k in the last program (one launch, 5.8 us); up to 8 tokens the same logits and the
    top-k one program per token (9 us at 4); more tokens: 3xTF32 tensor-core logits (10 us at 16).
    The fp32-FMA tl.dot (LOGITS 0) took ~15 us at every size."""
    block_e = 32 if n_experts >= 32 else 16
    block_h = block_k_for(hidden, 256)
    iters = hidden // block_h
    tiles = triton.cdiv(n_experts, block_e)
    split = max(d for d in range(1, iters + 1) if iters % d == 0 and (tiles * d <= 2 * sms or d == 1))
    logits = 2 if n_tokens <= 8 else 1
    return RouterConfig(block_e, block_h, split, logits, fused_topk=n_tokens == 1)


# ---- wrappers --------------------------------------------------------------------------------------------


def _check_activation(name: str, t: torch.Tensor) -> None:
    if t.dim() != 2 or t.dtype != torch.bfloat16 or t.stride(1) != 1:
        raise ValueError(f"{name}: expected a bf16 [n, H] tensor with contiguous rows, got "
                         f"{t.dtype} shape {tuple(t.shape)} strides {tuple(t.stride())}")


def route(h: torch.Tensor, gate_weight: torch.Tensor, bias: torch.Tensor | None, top_k: int,
          scaling: float, *, config: RouterConfig | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """logits = fp32(h) @ gate^T; s = sigmoid; ids = top-k of s + bias (descending); weights =
    s[ids] / sum(s[ids]) * scaling. Returns (weights fp32 [n, k], ids int32 [n, k]).
    ``config`` overrides ``router_config`` (tuning, tests)."""
    _check_activation("h", h)
    n, hidden = h.shape
    if gate_weight.dim() != 2 or gate_weight.dtype != torch.float32 or gate_weight.shape[1] != hidden:
        raise ValueError(f"gate_weight: expected fp32 [E, {hidden}], got {gate_weight.dtype} "
                         f"{tuple(gate_weight.shape)}")
    gate_weight = gate_weight.contiguous()
    n_experts = gate_weight.shape[0]
    if bias is not None and (bias.dtype != torch.float32 or tuple(bias.shape) != (n_experts,)):
        raise ValueError(f"bias: expected fp32 [{n_experts}] or None, got {bias.dtype} {tuple(bias.shape)}")
    if not 1 <= top_k <= n_experts:
        raise ValueError(f"top_k: expected 1..{n_experts}, got {top_k}")
    if hidden % 32:
        raise ValueError(f"h: hidden size must be a multiple of 32, got {hidden}")
    weights = torch.empty(n, top_k, dtype=torch.float32, device=h.device)
    ids = torch.empty(n, top_k, dtype=torch.int32, device=h.device)
    if n == 0:
        return weights, ids
    cfg = config or router_config(n, n_experts, hidden, num_sms(h.device))
    block_h = block_k_for(hidden, cfg.block_h)
    iters = hidden // block_h
    split = max(1, min(cfg.split, iters))
    while iters % split:
        split -= 1
    tf32x3 = h.device.type == "cuda" and torch.version.hip is None
    logits = 2 if cfg.logits == 1 and not tf32x3 else cfg.logits  # 3xTF32: NVIDIA only
    counters = split_counters(h.device, 1) if cfg.fused_topk else None
    part = torch.empty(split, n, n_experts, dtype=torch.float32, device=h.device)
    bias_arg = bias.contiguous() if bias is not None else part
    meta = dict(HAS_BIAS=bias is not None, E_POW2=triton.next_power_of_2(n_experts), TOPK=top_k,
                K_POW2=triton.next_power_of_2(top_k), SPLIT_POW2=triton.next_power_of_2(split))
    _router_logits_kernel[(triton.cdiv(n_experts, cfg.block_e), split)](
        h, gate_weight, part, counters if counters is not None else part, bias_arg, weights, ids,
        n, n_experts, iters // split, split, h.stride(0), gate_weight.stride(0), float(scaling),
        BLOCK_T=TOKEN_BLOCK, BLOCK_E=cfg.block_e, BLOCK_H=block_h, LOGITS=logits, FUSED_TOPK=counters is not None,
        num_warps=cfg.num_warps, **meta)
    if counters is None:
        _router_topk_kernel[(n,)](part, bias_arg, weights, ids, n, n_experts, split, float(scaling), num_warps=4,
                                  **meta)
    return weights, ids


def _expert_table(name: str, w: torch.Tensor, scale: torch.Tensor | None, experts: int | None, rows: int | None,
                  k: int) -> tuple[int, torch.Tensor, torch.Tensor | None]:
    """Checks a table [E, rows, K(packed)] (or a 2-D [rows, K] shared weight, made [1, rows, K])."""
    if w.dim() == 2:
        w = w.unsqueeze(0)
        scale = None if scale is None else scale.unsqueeze(0)
    fmt = kernel_format(w, scale, name)
    if w.dim() != 3:
        raise ValueError(f"{name}: expected an [E, rows, K] table, got shape {tuple(w.shape)}")
    if (experts is not None and w.shape[0] != experts) or (rows is not None and w.shape[1] != rows):
        raise ValueError(f"{name}: expected {experts} experts x {rows} rows, got shape {tuple(w.shape)}")
    if in_features(w, fmt) != k:
        raise ValueError(f"{name}: expected {k} input features, got shape {tuple(w.shape)} ({FORMAT_NAMES[fmt]})")
    check_scale(f"{name}_scale", scale, (w.shape[0], w.shape[1], k // MX_BLOCK), fmt)
    return fmt, w, scale


@dataclasses.dataclass
class _Weights:
    """One launch's expert weights in kernel form: the table, and a shared expert merged into it."""
    fmt: int
    w: torch.Tensor
    s: torch.Tensor
    sw: torch.Tensor  # = w when there is no separate shared expert in this launch
    ss: torch.Tensor
    inter_shared: int


def _kernel_weights(fmt, w, s, sw, ss, inter_shared, name, ptx) -> _Weights:
    wk = as_kernel_operand(w, fmt, name, ptx)
    sk = s if s is not None else wk
    swk = wk if sw is None else as_kernel_operand(sw, fmt, f"shared_{name}", ptx)
    ssk = sk if sw is None else (ss if ss is not None else swk)
    return _Weights(fmt, wk, sk, swk, ssk, inter_shared)


def _launch_experts(h, ids, w13: _Weights, w2: _Weights, a, y, part, *, slots, inter, n_routed, shared_slot,
                    shared_separate, shared_only, t13: ExpertTiles, t2: ExpertTiles, alpha, limit):
    n, hidden = h.shape
    top_k = ids.shape[1]
    inter_max = max(inter, w13.inter_shared) if shared_separate else inter
    common = dict(NUM_ROUTED=n_routed, E_POW2=triton.next_power_of_2(max(n_routed, 1)), TOPK=top_k,
                  K_POW2=triton.next_power_of_2(top_k), SHARED_SLOT=shared_slot, SHARED_SEPARATE=shared_separate,
                  SHARED_ONLY=shared_only, BLOCK_M=TOKEN_BLOCK, DOT_FP32=h.device.type != "cuda")
    i_tiles = triton.cdiv(inter_max, t13.block_n)
    counters = split_counters(h.device, slots * i_tiles) if t13.split > 1 else None
    if t13.split > 1 and counters is None:
        t13 = dataclasses.replace(t13, split=1)
    if part is None or t13.split == 1:
        part = a
    _moe_w13_kernel[(slots, i_tiles, t13.split)](
        h, ids, w13.w, w13.s, w13.sw, w13.ss, a, part, counters if counters is not None else ids,
        n, n * top_k, inter, w13.inter_shared, hidden // (t13.block_k * t13.k_chunks),
        h.stride(0), w13.w.stride(0), w13.w.stride(1), w13.s.stride(0), w13.s.stride(1), w13.sw.stride(1),
        w13.ss.stride(1), a.stride(0), a.stride(1), part.stride(0), part.stride(1) if part.dim() == 4 else 0,
        part.stride(2) if part.dim() == 4 else 0,
        float(alpha), float(limit), FMT=w13.fmt, BLOCK_I=t13.block_n, BLOCK_K=t13.block_k, SWAP_AB=t13.swap_ab,
        PTX=mxfp4_ptx(w13.fmt, t13.ptx, h.device), K_CHUNKS=t13.k_chunks, SPLIT=t13.split, SPLIT_POW2=triton.next_power_of_2(t13.split),
        num_warps=t13.num_warps, num_stages=t13.num_stages, **common)
    _moe_w2_kernel[(slots, triton.cdiv(hidden, t2.block_n), t2.split)](
        a, ids, w2.w, w2.s, w2.sw, w2.ss, y, n, n * top_k, hidden, inter, w2.inter_shared,
        a.stride(0), a.stride(1), w2.w.stride(0), w2.w.stride(1), w2.s.stride(0), w2.s.stride(1), w2.sw.stride(1),
        w2.ss.stride(1), y.stride(0), y.stride(1), y.stride(2),
        FMT=w2.fmt, BLOCK_N=t2.block_n, BLOCK_K=t2.block_k, SWAP_AB=t2.swap_ab, PTX=mxfp4_ptx(w2.fmt, t2.ptx, h.device),
        K_CHUNKS=t2.k_chunks, SPLIT=t2.split, num_warps=t2.num_warps, num_stages=t2.num_stages, **common)


def moe_experts(h: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                w13: torch.Tensor, w13_scale: torch.Tensor | None, w2: torch.Tensor, w2_scale: torch.Tensor | None,
                shared_w13: torch.Tensor | None = None, shared_w13_scale: torch.Tensor | None = None,
                shared_w2: torch.Tensor | None = None, shared_w2_scale: torch.Tensor | None = None, *,
                num_routed_experts: int, alpha: float = 1.702, limit: float = 7.0,
                tiles: tuple[ExpertTiles, ExpertTiles] | None = None) -> torch.Tensor:
    """out [n, H] bf16 = shared(h) + sum_j topk_weights[:, j] * expert_{topk_ids[:, j]}(h).

    w13 [E', 2I, H] (gate rows then up rows) and w2 [E', H, I]: bf16, MXFP8, MXFP4 or MXFP4 kernel
    layout (``mx_linear.prepare_weight``), scales [E', rows, K/32]. The shared expert is the table's
    expert num_routed_experts (E' = num_routed + 1), or shared_w13 [2Is, H] / shared_w2 [H, Is] in
    their own formats, or absent. Ids outside [0, num_routed_experts) are ignored. ``tiles``
    overrides the (w13, w2) tile heuristic (tuning, tests)."""
    _check_activation("h", h)
    n, hidden = h.shape
    if topk_ids.dim() != 2 or topk_ids.shape[0] != n or topk_ids.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"topk_ids: expected int32 [{n}, k], got {topk_ids.dtype} {tuple(topk_ids.shape)}")
    if topk_weights.dtype != torch.float32 or topk_weights.shape != topk_ids.shape:
        raise ValueError(f"topk_weights: expected fp32 {tuple(topk_ids.shape)}, got {topk_weights.dtype} "
                         f"{tuple(topk_weights.shape)}")
    ids = topk_ids.to(torch.int32).contiguous()
    topk_weights = topk_weights.contiguous()
    top_k = ids.shape[1]
    fmt13, w13, w13_scale = _expert_table("w13", w13, w13_scale, None, None, hidden)
    experts, two_inter = w13.shape[0], w13.shape[1]
    if two_inter % 2:
        raise ValueError(f"w13: expected 2*I rows (gate then up), got {two_inter}")
    inter = two_inter // 2
    fmt2, w2, w2_scale = _expert_table("w2", w2, w2_scale, experts, hidden, inter)
    separate = shared_w13 is not None
    if experts not in (num_routed_experts, num_routed_experts + 1) or (separate and experts != num_routed_experts):
        raise ValueError(f"w13: expected {num_routed_experts} experts (+1 if the shared expert is in the table "
                         f"and not given separately), got {experts}")
    if separate != (shared_w2 is not None):
        raise ValueError("shared_w13 / shared_w2: expected both or neither")
    fused = experts == num_routed_experts + 1
    inter_shared = inter
    if separate:
        sfmt13, sw13, ss13 = _expert_table("shared_w13", shared_w13, shared_w13_scale, 1, None, hidden)
        if sw13.shape[1] % 2:
            raise ValueError(f"shared_w13: expected 2*Is rows, got {sw13.shape[1]}")
        inter_shared = sw13.shape[1] // 2
        sfmt2, sw2, ss2 = _expert_table("shared_w2", shared_w2, shared_w2_scale, 1, hidden, inter_shared)
    out = torch.empty(n, hidden, dtype=torch.bfloat16, device=h.device)
    if n == 0:
        return out
    sms = num_sms(h.device)
    routed_slots = min(num_routed_experts, n * top_k)
    # A separate shared expert in the routed formats joins the routed launches (one slot more).
    merge = separate and (sfmt13, sfmt2) == (fmt13, fmt2)
    slots = routed_slots + int(fused or merge)
    inter_max = max(inter, inter_shared) if merge else inter
    if tiles is None:
        k2 = math.gcd(inter, inter_shared) if merge else inter  # BLOCK_K must divide both
        t13 = expert_tiles(fmt13, hidden, 2 * inter_max, slots, True, sms)
        t2 = expert_tiles(fmt2, k2, hidden, slots, False, sms)
    else:
        t13, t2 = tiles
    t13 = dataclasses.replace(t13, k_chunks=fit_chunks(hidden, t13.block_k, t13.k_chunks))
    t2 = dataclasses.replace(t2, k_chunks=fit_chunks(inter, t2.block_k, t2.k_chunks))
    if merge and inter_shared % (t2.block_k * t2.k_chunks):
        merge, slots, inter_max = False, routed_slots + int(fused), inter
    has_shared = fused or separate
    y = torch.empty(t2.split, n, top_k + int(has_shared), hidden, dtype=torch.float32, device=h.device)
    # One row per (token, top-k column): only chosen pairs are written and read.
    a = torch.empty(n, y.shape[2], inter_max, dtype=torch.bfloat16, device=h.device)
    part = None
    if t13.split > 1:
        part = torch.empty(t13.split, n, y.shape[2], 2 * inter_max, dtype=torch.float32, device=h.device)
    ptx13, ptx2 = mxfp4_ptx(fmt13, t13.ptx, h.device), mxfp4_ptx(fmt2, t2.ptx, h.device)
    kw13 = _kernel_weights(fmt13, w13, w13_scale, sw13 if merge else None, ss13 if merge else None, inter_shared,
                           "w13", ptx13)
    kw2 = _kernel_weights(fmt2, w2, w2_scale, sw2 if merge else None, ss2 if merge else None, inter_shared, "w2",
                          ptx2)
    _launch_experts(h, ids, kw13, kw2, a, y, part, slots=slots, inter=inter, n_routed=num_routed_experts,
                    shared_slot=fused or merge, shared_separate=merge, shared_only=False, t13=t13, t2=t2,
                    alpha=alpha, limit=limit)
    if separate and not merge:
        st13 = expert_tiles(sfmt13, hidden, 2 * inter_shared, 1, True, sms)
        st2 = dataclasses.replace(expert_tiles(sfmt2, inter_shared, hidden, 1, False, sms, can_split=False),
                                  split=t2.split)  # the combine sums every column over t2.split splits
        a_shared = torch.empty(n, y.shape[2], inter_shared, dtype=torch.bfloat16, device=h.device)
        spart = None
        if st13.split > 1:
            spart = torch.empty(st13.split, n, y.shape[2], 2 * inter_shared, dtype=torch.float32, device=h.device)
        _launch_experts(h, ids, _kernel_weights(sfmt13, sw13, ss13, None, None, inter_shared, "shared_w13",
                                                mxfp4_ptx(sfmt13, None, h.device)),
                        _kernel_weights(sfmt2, sw2, ss2, None, None, inter_shared, "shared_w2",
                                        mxfp4_ptx(sfmt2, None, h.device)),
                        a_shared, y, spart, slots=1, inter=inter_shared, n_routed=num_routed_experts,
                        shared_slot=False, shared_separate=False, shared_only=True, t13=st13, t2=st2,
                        alpha=alpha, limit=limit)
    _moe_combine_kernel[(n, triton.cdiv(hidden, COMBINE_BLOCK))](
        y, topk_weights, ids, out, hidden, y.stride(0), y.stride(1), y.stride(2), out.stride(0),
        NUM_ROUTED=num_routed_experts, TOPK=top_k, HAS_SHARED=has_shared, BLOCK_H=COMBINE_BLOCK, SPLIT=t2.split,
        num_warps=4)
    return out


# ---- ahead-of-time specs ---------------------------------------------------------------------------------

# (H, I, routed experts, top-k): the tiny preset and the real model.
AOT_SIZES = [(64, 32, 8, 2), (6144, 3072, 128, 4)]
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
        t13 = expert_tiles(fmt, hidden, 2 * inter, 1, True, 132)
        return t13, expert_tiles(fmt, inter, hidden, 1, False, 132, can_split=False)
    slots = min(n_routed, n * top_k) + int(shared_slot)
    return (expert_tiles(fmt, hidden, 2 * inter, slots, True, 132),
            expert_tiles(fmt, inter, hidden, slots, False, 132))


def _expert_specs(hidden: int, inter: int, n_routed: int, top_k: int, fmt: int, mode: str, t13: ExpertTiles,
                  t2: ExpertTiles, ptx: bool) -> list[KernelSpec]:
    shared_slot, shared_separate, shared_only = _MODES[mode]
    common = {"NUM_ROUTED": n_routed, "E_POW2": triton.next_power_of_2(n_routed), "TOPK": top_k,
              "K_POW2": triton.next_power_of_2(top_k), "SHARED_SLOT": shared_slot,
              "SHARED_SEPARATE": shared_separate, "SHARED_ONLY": shared_only, "FMT": fmt, "BLOCK_M": TOKEN_BLOCK,
              "DOT_FP32": False, "PTX": ptx}
    label = f"{FORMAT_NAMES[fmt]}{'_ptx' if ptx else ''}_h{hidden}_{mode}"
    w_ptr = "*u8" if ptx else _POINTER_TYPES[fmt]
    s_ptr = "*u8" if fmt != FMT_BF16 else w_ptr
    weights = {"w_ptr": w_ptr, "s_ptr": s_ptr, "sw_ptr": w_ptr, "ss_ptr": s_ptr}
    strides = {n: "i32" for n in ("stride_we", "stride_wn", "stride_se", "stride_sn", "stride_swn", "stride_ssn")}
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
                   num_warps=t13.num_warps, num_stages=t13.num_stages,
                   name=f"moe_w13_{label}_i{t13.block_n}k{t13.block_k}x{t13.k_chunks}s{t13.split}"),
        KernelSpec(_moe_w2_kernel,
                   {"a_ptr": "*bf16", "ids_ptr": "*i32", **weights, "y_ptr": "*fp32",
                    "n_tokens": "i32", "n_pairs": "i32", "hidden": "i32", "inter": "i32", "inter_shared": "i32",
                    "stride_am": "i32", "stride_acol": "i32", **strides, "stride_ysplit": "i32", "stride_ym": "i32",
                    "stride_ycol": "i32"},
                   dict(common, BLOCK_N=t2.block_n, BLOCK_K=t2.block_k, SWAP_AB=t2.swap_ab, K_CHUNKS=t2.k_chunks,
                        SPLIT=t2.split),
                   num_warps=t2.num_warps, num_stages=t2.num_stages,
                   name=f"moe_w2_{label}_n{t2.block_n}k{t2.block_k}x{t2.k_chunks}s{t2.split}")]


def _all_expert_specs(ptx: bool) -> list[KernelSpec]:
    """Expert kernels in every format and shared-expert mode at the real size (every split the
    heuristic picks for 1- and 16-token steps), table mode at the tiny size."""
    specs, seen = [], set()
    formats = (FMT_MXFP4, FMT_MXFP4_PREPARED) if ptx else (FMT_BF16, FMT_MXFP8, FMT_MXFP4, FMT_MXFP4_PREPARED)
    for hidden, inter, n_routed, top_k in (AOT_SIZES[-1:] if ptx else AOT_SIZES):
        modes = ("table",) if hidden == AOT_SIZES[0][0] else tuple(_MODES)
        for fmt in formats:
            for mode in modes:
                for n in AOT_TOKENS:
                    for spec in _expert_specs(hidden, inter, n_routed, top_k, fmt, mode,
                                              *_launch_tiles(hidden, inter, n_routed, top_k, fmt, mode, n), ptx):
                        if spec.label() not in seen:
                            seen.add(spec.label())
                            specs.append(spec)
    return specs


def aot_specs() -> list[KernelSpec]:
    """Portable specialisations: router (fused and two-kernel) and combine at both sizes, and the
    expert kernels (``_all_expert_specs``). The CUDA-only MXFP4 PTX ones are in ``aot_specs_cuda``."""
    specs = []
    for hidden, inter, n_routed, top_k in AOT_SIZES:
        size = f"h{hidden}"
        for n in AOT_TOKENS:
            cfg = router_config(n, n_routed, hidden, 132)
            if cfg.logits == 1:  # 3xTF32 is CUDA-only (aot_specs_cuda); HIP runs LOGITS 2
                cfg = dataclasses.replace(cfg, logits=2)
            block_e, block_h, split = cfg.block_e, block_k_for(hidden, cfg.block_h), cfg.split
            for has_bias in (True, False):
                meta = {"HAS_BIAS": has_bias, "E_POW2": triton.next_power_of_2(n_routed), "TOPK": top_k,
                        "K_POW2": triton.next_power_of_2(top_k), "SPLIT_POW2": triton.next_power_of_2(split)}
                tag = f"{size}_e{block_e}h{block_h}x{meta['SPLIT_POW2']}_l{cfg.logits}_bias{int(has_bias)}"
                for fuse in (True, False):
                    specs.append(KernelSpec(
                        _router_logits_kernel,
                        {"h_ptr": "*bf16", "g_ptr": "*fp32", "part_ptr": "*fp32", "cnt_ptr": "*i32",
                         "bias_ptr": "*fp32", "weights_ptr": "*fp32", "ids_ptr": "*i32", "n_tokens": "i32",
                         "n_experts": "i32", "iters_per_split": "i32", "n_split": "i32", "stride_hm": "i32",
                         "stride_ge": "i32", "scaling": "fp32"},
                        dict(meta, BLOCK_T=TOKEN_BLOCK, BLOCK_E=block_e, BLOCK_H=block_h, LOGITS=cfg.logits,
                             FUSED_TOPK=fuse), num_warps=cfg.num_warps, name=f"router_logits_{tag}_fused{int(fuse)}"))
                specs.append(KernelSpec(
                    _router_topk_kernel,
                    {"part_ptr": "*fp32", "bias_ptr": "*fp32", "weights_ptr": "*fp32", "ids_ptr": "*i32",
                     "n_tokens": "i32", "n_experts": "i32", "n_split": "i32", "scaling": "fp32"},
                    meta, name=f"router_topk_{tag}"))
        splits = sorted({_launch_tiles(hidden, inter, n_routed, top_k, fmt, mode, n)[1].split
                         for fmt in _EXPERT_TILES for mode in _MODES for n in AOT_TOKENS})
        for has_shared in (True, False):
            for split in splits:
                specs.append(KernelSpec(
                    _moe_combine_kernel,
                    {"y_ptr": "*fp32", "topk_weights_ptr": "*fp32", "ids_ptr": "*i32", "out_ptr": "*bf16",
                     "hidden": "i32", "stride_ysplit": "i32", "stride_ym": "i32", "stride_ycol": "i32",
                     "stride_om": "i32"},
                    {"NUM_ROUTED": n_routed, "TOPK": top_k, "HAS_SHARED": has_shared, "BLOCK_H": COMBINE_BLOCK,
                     "SPLIT": split}, name=f"moe_combine_{size}_shared{int(has_shared)}_split{split}"))
    # De-duplicate router specs that two token counts share.
    unique = {spec.label(): spec for spec in specs}
    return list(unique.values()) + _all_expert_specs(ptx=False)


def aot_specs_cuda() -> list[KernelSpec]:
    """CUDA-only: MXFP4 inline-PTX expert kernels (real size, every shared-expert mode) and the
    3xTF32 router logits (many-token steps)."""
    specs = []
    for hidden, inter, n_routed, top_k in AOT_SIZES:
        cfg = router_config(max(AOT_TOKENS), n_routed, hidden, 132)
        block_h = block_k_for(hidden, cfg.block_h)
        specs.append(KernelSpec(
            _router_logits_kernel,
            {"h_ptr": "*bf16", "g_ptr": "*fp32", "part_ptr": "*fp32", "cnt_ptr": "*i32", "bias_ptr": "*fp32",
             "weights_ptr": "*fp32", "ids_ptr": "*i32", "n_tokens": "i32", "n_experts": "i32",
             "iters_per_split": "i32", "n_split": "i32", "stride_hm": "i32", "stride_ge": "i32", "scaling": "fp32"},
            {"HAS_BIAS": True, "E_POW2": triton.next_power_of_2(n_routed), "TOPK": top_k,
             "K_POW2": triton.next_power_of_2(top_k), "SPLIT_POW2": triton.next_power_of_2(cfg.split),
             "BLOCK_T": TOKEN_BLOCK, "BLOCK_E": cfg.block_e, "BLOCK_H": block_h, "LOGITS": 1, "FUSED_TOPK": False},
            num_warps=cfg.num_warps, name=f"router_logits_h{hidden}_e{cfg.block_e}h{block_h}_tf32x3"))
    return specs + _all_expert_specs(ptx=True)
