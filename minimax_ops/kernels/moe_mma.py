"""The routed + shared experts of a MoE step for expert tables in the ``mxfp4_mma`` / ``mxfp8_mma``
layouts: the same job, slots and buffers as moe.py's w13 / w2 kernels (whose wrapper launches
these), with the weight product of mma_decode.block_stream (MX values decoded into mma.sync
operand registers; FP8 selects the mxfp8_mma blocks).

- ``_mma_w13_kernel`` (slot, group of NW gate blocks, H split): warp w streams gate row block i and
  up row block I/16 + i (16 rows each) over its split of H for up to 8 tokens at a time, then
  SwiGLU-OAI -> bf16 a[token, top-k column, i] (split: fp32 partials, the last split to finish sums
  them in order). With a warp split (KS, ExpertTiles.warp_split) a program's NW warps stream NW / KS
  gate blocks, KS parts of H each, summed through shared memory (no partials, no arrival). MXFP4
  steps stream the gate and up blocks of each K block together (``PAIRED``, ExpertTiles.paired:
  block_stream's PAIR): one set of x registers feeds both mma chains, each matrix at half the load
  depth (the same bytes per step) in half as many accumulator sets, and no gate result is held
  while up streams: fewer registers, so more programs fit per SM (one-token steps also split H in
  two, by the warps: tiles.py). MXFP8 (twice the bytes per block, shallower and split,
  already at 3+ programs per SM) and paired token groups stream gate, then up.
- ``_mma_w2_kernel`` (slot, group of NW output row blocks, I split): y[split, token, column, h]
  fp32 for the split's K blocks; moe_combine.py's kernel sums the splits. One-token steps hold three of its
  load steps in registers (``RING``, ExpertTiles.ring), the others two.
Tokens go 8 per pass (the mma's N). In steps of more than 8 tokens a routed expert's passes take
only the tokens that chose it, in token order (``COMPACT``, expert_slots.chooser_tokens): fixed
groups of 8 consecutive tokens streamed an expert chosen in both groups twice, a compacted pass
streams it once unless more than 8 tokens chose it; the shared expert takes every token, in a slot per
pass whose programs run side by side (expert_passes.program_slot: they read each weight line at about the
same time). With fixed groups (MINIMAX_OPS_NO_COMPACT=1) a group that did not choose the slot's expert is not multiplied,
and mxfp8_mma steps pair two groups on one weight stream (``_two_groups``). Compacted steps build the
step's slot table first (one program, expert_slots.build_slot_table: each slot's expert and its
passes' tokens), which w13 and w2 read (``TABLE``, ``slot_tables``) instead of each of their
thousands of programs scanning the step's ids.
"""

from __future__ import annotations

import itertools
import os

import torch
import triton
import triton.language as tl

from ..formats import FMT_MXFP8_MMA
from .aot import KernelSpec
from .expert_passes import program_slot, shared_pass, shared_passes, token_groups, pass_tokens
from .expert_slots import (build_slot_table, columns_of, columns_of_ids, routed_ids, routed_weights, slot_weights,
                           swiglu_oai)
from .linear_mma import aot_norm_parts
from .mma_decode import (TOKENS, block_stream, first_blocks, first_two_blocks, fold, fold_warps, fragment_index,
                         pair_sets, warp_parts, warp_rows)
from .mma_launch import check_aligned, mma_operands, preloads, w2_preload_steps, w2_two_steps, weights_evict_first
from .mx_decode import gdc_launch_dependents, gdc_wait, use_ptx
from .norm import deferred_norm_args, rstd_of_parts, sumsq_parts
from .splitk import last_arrival, split_counters, sum_splits
from .tiles import check_k_steps, check_warp_split, mma_expert_tiles, portable_mma_tiles, register_cap


@triton.jit
def _fragment_out(m0, NW: tl.constexpr):
    """(rank, output row) of each register of a folded [NW * 32, 4] fragment of the token group at
    rank m0 and this program's NW row blocks (computed where they are stored: nothing held across
    the K loop)."""
    d1, g1, c1, e1 = fragment_index(NW, 1)
    return 2 * c1 + e1 % 2 + m0, (tl.program_id(1) * NW + warp_rows(NW, 1)) * 16 + g1 + 8 * (e1 // 2)


@triton.jit
def _store_gate_up(gate, up, m0, compact, inter_e, ids_ptr, ids, row_ptr, n_tokens, expert, a_ptr, part_ptr, stride_am,
                   stride_acol, stride_psplit, stride_pm, stride_pcol, alpha, limit, NUM_ROUTED: tl.constexpr,
                   TOPK: tl.constexpr, K_POW2: tl.constexpr, SHARED_ONLY: tl.constexpr, SPLIT: tl.constexpr,
                   NW: tl.constexpr, TABLE: tl.constexpr, rstd=None):
    """The (gate, up) fragments of the token group at rank m0: SwiGLU -> a (one split), or fp32 partials.
    rstd (the deferred norm's, one-token steps): the products' factor, applied before SwiGLU."""
    rank, i_out = _fragment_out(m0, NW)
    tok, col = pass_tokens(ids_ptr, ids, row_ptr, rank, n_tokens, expert, compact, NUM_ROUTED, TOPK, K_POW2,
                            SHARED_ONLY, TABLE)
    ok = (col >= 0) & (i_out < inter_e)
    if SPLIT == 1:
        if rstd is not None:
            gate, up = gate * rstd, up * rstd
        a_ptrs = a_ptr + tok.to(tl.int64) * stride_am + col * stride_acol + i_out
        tl.store(a_ptrs, swiglu_oai(gate, up, alpha, limit).to(a_ptr.dtype.element_ty), mask=ok)
    else:
        p_ptrs = (part_ptr + tl.program_id(2) * stride_psplit + tok.to(tl.int64) * stride_pm + col * stride_pcol
                  + 2 * i_out)
        tl.store(p_ptrs, gate, mask=ok)
        tl.store(p_ptrs + 1, up, mask=ok)


@triton.jit
def _store_y(acc, m0, compact, hidden, ids_ptr, ids, row_ptr, n_tokens, expert, y_ptr, stride_ysplit, stride_ym,
             stride_ycol, NUM_ROUTED: tl.constexpr, TOPK: tl.constexpr, K_POW2: tl.constexpr,
             SHARED_ONLY: tl.constexpr, NW: tl.constexpr, TABLE: tl.constexpr):
    rank, h_out = _fragment_out(m0, NW)
    tok, col = pass_tokens(ids_ptr, ids, row_ptr, rank, n_tokens, expert, compact, NUM_ROUTED, TOPK, K_POW2,
                            SHARED_ONLY, TABLE)
    y_ptrs = y_ptr + tl.program_id(2) * stride_ysplit + tok.to(tl.int64) * stride_ym + col * stride_ycol + h_out
    tl.store(y_ptrs, acc, mask=(col >= 0) & (h_out < hidden))


@triton.jit
def _mma_w13_kernel(h_ptr, ids_ptr, w_ptr, s_ptr, sw_ptr, ss_ptr, a_ptr, part_ptr, cnt_ptr, table_ptr,
                    route_ptr, bias_ptr, tw_ptr, scaling,
                    n_tokens, n_pairs, inter, inter_shared, k_blocks, stride_table, shared_slots,
                    stride_hm, stride_we, stride_wb, stride_se, stride_sb, stride_swb, stride_ssb,
                    stride_am, stride_acol, stride_psplit, stride_pm, stride_pcol, alpha, limit,
                    NUM_ROUTED: tl.constexpr, E_POW2: tl.constexpr, TOPK: tl.constexpr, K_POW2: tl.constexpr,
                    SHARED_SLOT: tl.constexpr, SHARED_SEPARATE: tl.constexpr, SHARED_ONLY: tl.constexpr,
                    NW: tl.constexpr, DEPTH: tl.constexpr, SPLIT: tl.constexpr, SPLIT_POW2: tl.constexpr,
                    PTX: tl.constexpr, PDL: tl.constexpr, PREFETCH: tl.constexpr, FP8: tl.constexpr,
                    TWO_GROUPS: tl.constexpr, PAIRED: tl.constexpr, COMPACT: tl.constexpr, TABLE: tl.constexpr,
                    RING: tl.constexpr = 2, KS: tl.constexpr = 1, ROUTE: tl.constexpr = False,
                    HAS_BIAS: tl.constexpr = False, NORM: tl.constexpr = False, sumsq_ptr=None, n_parts=1, eps=0.0,
                    BLOCK_P: tl.constexpr = 1, EVICT_FIRST: tl.constexpr = False):
    """h_ptr: int32 view of h [n, H] (stride_hm in words); w / s: the table's words and scale bytes
    [E, row blocks, K blocks, 128 | 256] / [.., 32]; strides in their own units. With SPLIT > 1 the
    H splits store fp32 (gate, up) partials [split, token, column, 2i + (0, 1)] and the last of a
    tile's splits to finish sums them in order and applies SwiGLU. KS: the NW warps stream NW // KS
    (gate, up) row blocks, KS parts of the split's H each, summed through shared memory
    (mma_decode.warp_parts / fold_warps).

    PDL: the routed slots wait for the router first (their expert comes from its ids). The shared
    expert's slots (``shared_pass``) need only h, complete since the router passed its own wait: they
    stream its weights under the router's tail and wait only before their first store (buffers of this
    step may reuse memory the router still uses). TABLE: routed slots read their expert and tokens
    from the step's slot table (expert_slots.build_slot_table, the kernel before this one).

    ROUTE (one-token steps, moe.routed_moe_experts): the kernel before this one wrote the router's
    logits (route_ptr, router.router_logits), not ids: every program makes the top-k itself
    (expert_slots.routed_ids; the shared expert's, which do not wait, make it from logits not yet
    written and never use it), and program (0, 0, 0) stores the ids and weights (tw_ptr, scaled by
    ``scaling``) at ids_ptr for the combine.

    NORM (one-token steps): h is the scaled rows of linear_mma.mma_linear_add_norm, the post norm deferred:
    each program loads the token's sums of squares (sumsq_ptr) at its start, and its gate and up products
    are multiplied by the rstd they make before SwiGLU (the norm's h is that rstd times the scaled rows)."""
    tl.static_assert(not (PAIRED and TWO_GROUPS), "_mma_w13_kernel: a PAIRED stream takes one token group")
    STEP: tl.constexpr = 2 * TOKENS if TWO_GROUPS else TOKENS
    NWR: tl.constexpr = NW // KS  # (gate, up) row blocks of the program
    if PDL:
        if SHARED_SLOT:
            if shared_pass(shared_slots) < 0:
                gdc_wait()
        else:
            gdc_wait()
        gdc_launch_dependents()
    stride_hm = tl.multiple_of(stride_hm, 16)
    parts = None
    if NORM:  # (reduced where used: the load stays in flight under the stream)
        parts = sumsq_parts(sumsq_ptr, n_parts, BLOCK_P)
    ids = None
    if ROUTE:
        ids, id_rows, score_rows = routed_ids(route_ptr, bias_ptr, NW, NUM_ROUTED, E_POW2, TOPK, K_POW2, HAS_BIAS)
        if (tl.program_id(0) == 0) & (tl.program_id(1) == 0) & (tl.program_id(2) == 0):  # a routed slot's
            cols = tl.arange(0, K_POW2)
            tl.store(ids_ptr + cols, ids, mask=cols < TOPK)
            tl.store(tw_ptr + cols, routed_weights(id_rows, score_rows, scaling, TOPK), mask=cols < TOPK)
    expert, row_ptr, compact, first_rank, ranks = program_slot(ids_ptr, ids, table_ptr, stride_table, n_tokens,
                                                               n_pairs, shared_slots, NUM_ROUTED, E_POW2, TOPK, K_POW2,
                                                               SHARED_SLOT, SHARED_ONLY, COMPACT, TABLE, STEP)
    w_base, s_base, row_w, row_s, tile_w, tile_s, inter_e = slot_weights(
        expert, w_ptr, s_ptr, sw_ptr, ss_ptr, inter, inter_shared, stride_we, stride_wb, stride_se, stride_sb,
        stride_swb, stride_ssb, 0, 0, 0, 0, NUM_ROUTED, SHARED_SEPARATE)
    row_w, row_s = tl.multiple_of(row_w, 16), tl.multiple_of(row_s, 16)
    i_blocks = inter_e // 16
    if (expert >= 0) & (tl.program_id(1) * NWR < i_blocks):
        d, g, c, e = fragment_index(NW, DEPTH)
        row_block, k_part = warp_parts(NW, DEPTH, KS)
        ib = tl.minimum(tl.program_id(1) * NWR + row_block, i_blocks - 1).to(tl.int64)
        gate_w, up_w = w_base + ib * row_w, w_base + (ib + i_blocks) * row_w
        gate_s, up_s = s_base + ib * row_s, s_base + (ib + i_blocks) * row_s
        kb_split = k_blocks // (SPLIT * KS)
        kb_begin = (tl.program_id(2) * KS + k_part) * kb_split
        n_steps = kb_split // DEPTH
        for m0 in range(first_rank, ranks, STEP):
            go, both, first, tok_x, _, tok_y, _ = token_groups(ids_ptr, ids, row_ptr, m0, g, n_tokens, expert,
                                                               compact, NUM_ROUTED, TOPK, K_POW2, SHARED_ONLY,
                                                               TWO_GROUPS, TABLE)
            if go:
                x_rows = h_ptr + tl.maximum(tok_x, 0).to(tl.int64) * stride_hm  # (no token: any readable row)
                zero = tl.zeros([DEPTH * NW * 32, 4], dtype=tl.float32)
                if PAIRED:  # gate and up blocks of each K block in one stream, on one set of x loads
                    zp = tl.zeros([pair_sets(DEPTH) * NW * 32, 4], dtype=tl.float32)
                    gate, up = block_stream(zp, zp, gate_w, gate_s, x_rows, x_rows, kb_begin, n_steps, NW, DEPTH,
                                            PTX, PREFETCH, FP8, False, 1, True, i_blocks * row_w, i_blocks * row_s,
                                            RING=RING, EVICT_FIRST=EVICT_FIRST)
                    gate2, up2 = zero, zero  # (unused: PAIRED passes take one token group, both is False)
                elif both:
                    y_rows = h_ptr + tl.maximum(tok_y, 0).to(tl.int64) * stride_hm
                    gate, gate2 = block_stream(zero, zero, gate_w, gate_s, x_rows, y_rows, kb_begin, n_steps, NW,
                                               DEPTH, PTX, PREFETCH, FP8, GROUPS=2, RING=RING, EVICT_FIRST=EVICT_FIRST)
                    up, up2 = block_stream(zero, zero, up_w, up_s, x_rows, y_rows, kb_begin, n_steps, NW, DEPTH, PTX,
                                           PREFETCH, FP8, GROUPS=2, RING=RING, EVICT_FIRST=EVICT_FIRST)
                else:
                    gate, gate2 = block_stream(zero, zero, gate_w, gate_s, x_rows, x_rows, kb_begin, n_steps, NW,
                                               DEPTH, PTX, PREFETCH, FP8, RING=RING, EVICT_FIRST=EVICT_FIRST)
                    up, up2 = block_stream(zero, zero, up_w, up_s, x_rows, x_rows, kb_begin, n_steps, NW, DEPTH, PTX,
                                           PREFETCH, FP8, RING=RING, EVICT_FIRST=EVICT_FIRST)
                if PDL:
                    if SHARED_SLOT:  # (a no-op for the routed slots, which waited already)
                        gdc_wait()
                SETS: tl.constexpr = pair_sets(DEPTH) if PAIRED else DEPTH
                rstd = None
                if NORM:
                    if SPLIT == 1:
                        rstd = rstd_of_parts(parts, k_blocks * 64, eps)
                _store_gate_up(fold_warps(fold(gate, NW, SETS), NW, KS), fold_warps(fold(up, NW, SETS), NW, KS), first,
                               compact, inter_e, ids_ptr, ids, row_ptr, n_tokens, expert, a_ptr, part_ptr, stride_am,
                               stride_acol, stride_psplit, stride_pm, stride_pcol, alpha, limit, NUM_ROUTED, TOPK,
                               K_POW2, SHARED_ONLY, SPLIT, NWR, TABLE, rstd)
                if both:
                    _store_gate_up(fold_warps(fold(gate2, NW, DEPTH), NW, KS), fold_warps(fold(up2, NW, DEPTH), NW, KS),
                                   m0 + TOKENS, compact, inter_e, ids_ptr, ids, row_ptr, n_tokens, expert, a_ptr,
                                   part_ptr, stride_am, stride_acol, stride_psplit, stride_pm, stride_pcol, alpha,
                                   limit, NUM_ROUTED, TOPK, K_POW2, SHARED_ONLY, SPLIT, NWR, TABLE)
        if SPLIT > 1:
            if last_arrival(cnt_ptr + tl.program_id(0) * tl.num_programs(1) + tl.program_id(1), SPLIT):
                for m0 in range(first_rank, tl.where(shared_pass(shared_slots) >= 0, ranks, n_tokens),
                                TOKENS):  # (routed slots: by token)
                    tok, i_out = _fragment_out(m0, NWR)
                    if ids is None:
                        col = columns_of(ids_ptr, tok, n_tokens, expert, NUM_ROUTED, TOPK, K_POW2, SHARED_ONLY)
                    else:
                        col = columns_of_ids(ids, tok, n_tokens, expert, NUM_ROUTED, TOPK)
                    ok = (col >= 0) & (i_out < inter_e)
                    if tl.max(tl.max(col, axis=1), axis=0) >= 0:
                        p_ptrs = part_ptr + tok.to(tl.int64) * stride_pm + tl.maximum(col, 0) * stride_pcol + 2 * i_out
                        gate = sum_splits(p_ptrs, ok, stride_psplit, SPLIT, SPLIT_POW2)
                        up = sum_splits(p_ptrs + 1, ok, stride_psplit, SPLIT, SPLIT_POW2)
                        if NORM:
                            rstd = rstd_of_parts(parts, k_blocks * 64, eps)
                            gate, up = gate * rstd, up * rstd
                        a_ptrs = a_ptr + tok.to(tl.int64) * stride_am + col * stride_acol + i_out
                        tl.store(a_ptrs, swiglu_oai(gate, up, alpha, limit).to(a_ptr.dtype.element_ty), mask=ok)


@triton.jit
def _mma_w2_kernel(a_ptr, ids_ptr, w_ptr, s_ptr, sw_ptr, ss_ptr, y_ptr, table_ptr, route_ptr, bias_ptr,
                   n_tokens, n_pairs, hidden, inter, inter_shared, stride_table, shared_slots,
                   stride_am, stride_acol, stride_we, stride_wb, stride_se, stride_sb, stride_swb, stride_ssb,
                   stride_ysplit, stride_ym, stride_ycol,
                   NUM_ROUTED: tl.constexpr, E_POW2: tl.constexpr, TOPK: tl.constexpr, K_POW2: tl.constexpr,
                   SHARED_SLOT: tl.constexpr, SHARED_SEPARATE: tl.constexpr, SHARED_ONLY: tl.constexpr,
                   NW: tl.constexpr, DEPTH: tl.constexpr, SPLIT: tl.constexpr, PTX: tl.constexpr,
                   PDL: tl.constexpr, PREFETCH: tl.constexpr, FP8: tl.constexpr, TWO_GROUPS: tl.constexpr,
                   PRELOAD: tl.constexpr, COMPACT: tl.constexpr, TABLE: tl.constexpr, RING: tl.constexpr = 2,
                   ROUTE: tl.constexpr = False, HAS_BIAS: tl.constexpr = False, EVICT_FIRST: tl.constexpr = False):
    """a_ptr: int32 view of a [n, columns, I] (strides in words). Every split stores its partial
    for the chosen (token, column) pairs. The slot's expert comes from the router, complete before
    w13 began: PRELOAD finds it from the ids and reads the first weight step (PRELOAD 2, RING 3: the
    first two) before (PDL) waiting for w13's activations (mma_decode.first_blocks); TABLE reads the
    expert and its passes' tokens from the step's slot table (complete before w13's routed programs
    passed their wait). ROUTE: the expert from the router's logits (route_ptr), as w13's; complete
    before w13's routed programs passed their wait too, so also read before this kernel's."""
    STEP: tl.constexpr = 2 * TOKENS if TWO_GROUPS else TOKENS
    ids = None
    if ROUTE:
        ids, _, _ = routed_ids(route_ptr, bias_ptr, NW, NUM_ROUTED, E_POW2, TOPK, K_POW2, HAS_BIAS)
    expert, row_ptr, compact, first_rank, ranks = program_slot(ids_ptr, ids, table_ptr, stride_table, n_tokens,
                                                               n_pairs, shared_slots, NUM_ROUTED, E_POW2, TOPK, K_POW2,
                                                               SHARED_SLOT, SHARED_ONLY, COMPACT, TABLE, STEP)
    w_base, s_base, row_w, row_s, tile_w, tile_s, inter_e = slot_weights(
        expert, w_ptr, s_ptr, sw_ptr, ss_ptr, inter, inter_shared, stride_we, stride_wb, stride_se, stride_sb,
        stride_swb, stride_ssb, 0, 0, 0, 0, NUM_ROUTED, SHARED_SEPARATE)
    row_w, row_s = tl.multiple_of(row_w, 16), tl.multiple_of(row_s, 16)
    stride_am, stride_acol = tl.multiple_of(stride_am, 16), tl.multiple_of(stride_acol, 16)
    h_blocks = hidden // 16
    d, g, c, e = fragment_index(NW, DEPTH)
    hb = tl.minimum(tl.program_id(1) * NW + warp_rows(NW, DEPTH), h_blocks - 1).to(tl.int64)
    w_rows, s_rows = w_base + hb * row_w, s_base + hb * row_s
    kb_split = inter_e // 64 // SPLIT
    kb_begin = tl.program_id(2) * kb_split
    n_steps = kb_split // DEPTH
    step0, step1 = None, None
    if PRELOAD:
        if PRELOAD == 2:
            step0, step1 = first_two_blocks(w_rows, s_rows, kb_begin, expert >= 0, n_steps, NW, DEPTH, FP8, PTX,
                                            EVICT_FIRST)
        else:
            step0 = first_blocks(w_rows, s_rows, kb_begin, (expert >= 0) & (n_steps > 0), NW, DEPTH, FP8, PTX,
                                 EVICT_FIRST)
    if PDL:
        gdc_wait()
        gdc_launch_dependents()
    if (expert >= 0) & (tl.program_id(1) * NW < h_blocks):
        for m0 in range(first_rank, ranks, STEP):
            go, both, first, tok_x, col_x, tok_b, col_b = token_groups(ids_ptr, ids, row_ptr, m0, g, n_tokens,
                                                                       expert, compact, NUM_ROUTED, TOPK, K_POW2,
                                                                       SHARED_ONLY, TWO_GROUPS, TABLE)
            if go:
                # lanes without a token: any readable row
                x_rows = (a_ptr + tl.maximum(tok_x, 0).to(tl.int64) * stride_am
                          + tl.maximum(col_x, 0) * stride_acol)
                zero = tl.zeros([DEPTH * NW * 32, 4], dtype=tl.float32)
                if both:
                    y_rows = (a_ptr + tl.maximum(tok_b, 0).to(tl.int64) * stride_am
                              + tl.maximum(col_b, 0) * stride_acol)
                    acc, acc2 = block_stream(zero, zero, w_rows, s_rows, x_rows, y_rows, kb_begin, n_steps, NW, DEPTH,
                                             PTX, PREFETCH, FP8, GROUPS=2, PRELOADED=PRELOAD, first=step0, RING=RING,
                                             EVICT_FIRST=EVICT_FIRST, second=step1)
                else:
                    acc, acc2 = block_stream(zero, zero, w_rows, s_rows, x_rows, x_rows, kb_begin, n_steps, NW, DEPTH,
                                             PTX, PREFETCH, FP8, PRELOADED=PRELOAD, first=step0, RING=RING,
                                             EVICT_FIRST=EVICT_FIRST, second=step1)
                _store_y(fold(acc, NW, DEPTH), first, compact, hidden, ids_ptr, ids, row_ptr, n_tokens, expert, y_ptr,
                         stride_ysplit, stride_ym, stride_ycol, NUM_ROUTED, TOPK, K_POW2, SHARED_ONLY, NW, TABLE)
                if both:
                    _store_y(fold(acc2, NW, DEPTH), m0 + TOKENS, compact, hidden, ids_ptr, ids, row_ptr, n_tokens,
                             expert, y_ptr, stride_ysplit, stride_ym, stride_ycol, NUM_ROUTED, TOPK, K_POW2,
                             SHARED_ONLY, NW, TABLE)


def _two_groups(fmt: int, n_tokens: int, ptx: bool) -> bool:
    """Whether the kernels pair two token groups on one weight stream: mxfp8_mma steps of more than
    8 tokens on the PTX path, where routed experts do not take compacted passes (``compacts``: a
    compacted pass rarely has a second group, and the paired code's registers cost the single passes
    more than the shared expert's second pass costs); the MXFP4 decode is issue-bound (a second pass
    costs it no more than decoding twice), and the portable emulation gains nothing from it."""
    return fmt == FMT_MXFP8_MMA and n_tokens > 8 and ptx and not compacts()


def compacts() -> bool:
    """Whether routed experts take compacted token passes (COMPACT), unless MINIMAX_OPS_NO_COMPACT=1
    (read at every launch: A/B runs switch it between rounds of one process)."""
    return os.environ.get("MINIMAX_OPS_NO_COMPACT") != "1"


def slot_tables(shared_only: bool, n_tokens: int, compact: bool) -> bool:
    """The rule: launches of routed slots with compacted passes in steps of more than one token
    group build the step's slot table first (expert_slots.build_slot_table, one program) and w13 /
    w2 read their slots from it (TABLE): thousands of expert programs then make a load where each
    scanned the step's ids several times. One-token-group steps keep the scan (a few ids; their w2
    finds its expert before its PDL wait, to read its first weights early). The AOT specs follow it."""
    return not shared_only and n_tokens > TOKENS.value and compact


def slot_table_on(shared_only: bool, n_tokens: int) -> bool:
    """``slot_tables`` at a launch, unless MINIMAX_OPS_NO_SLOT_TABLE=1 (read at every launch: A/B
    runs switch it between rounds of one process)."""
    return slot_tables(shared_only, n_tokens, compacts()) and os.environ.get("MINIMAX_OPS_NO_SLOT_TABLE") != "1"


def _prefetch(t) -> int:
    """L2 prefetch distance in load steps: ExpertTiles.num_stages carries it for these kernels
    (portable tiles have none: the prefetch is PTX)."""
    return max(0, t.num_stages - 1)


def launch_mma_experts(h, ids, w13, w2, a, y, part, *, slots, inter, n_routed, shared_slot, shared_separate, shared_only,
                       t13, t2, alpha, limit, pdl, route=None, norm=None):
    """moe.py's _launch_experts for mxfp4_mma / mxfp8_mma tables: w13 / w2 are its kernel-weight
    records (tables [E, row blocks, K blocks, 128 | 256 words] + scales [.., 32]); t13 / t2
    ExpertTiles whose row_blocks are the row blocks per program (num_warps / warp_split) and k_chunks the
    blocks per load step. ``route`` (one-token steps): (fp32 router logits [1, E], fp32 bias [E] or
    None, the fp32 top-k weights [1, k] to write, scaling): the kernels make the top-k (ROUTE) and w13
    writes ids and weights; else ids hold the step's choice. ``norm`` (one-token steps, checked by
    moe.routed_moe_experts): (sumsq [1, G] fp32, eps) of linear_mma.mma_linear_add_norm, h being its
    scaled rows: w13 applies the deferred norm (NORM)."""
    n, hidden = h.shape
    top_k = ids.shape[1]
    inter_max = max(inter, w13.inter_shared) if shared_separate else inter
    check_warp_split("w13", t13.num_warps, t13.warp_split)
    ptx = use_ptx(h.device) if t13.ptx is None else t13.ptx
    if not ptx:
        t13, t2 = portable_mma_tiles(t13), portable_mma_tiles(t2)
    check_k_steps("w13", t13.split * t13.warp_split, t13.k_chunks, hidden)
    if t2.warp_split != 1:
        raise ValueError(f"tiles: w2 splits K by the grid only, got warp_split {t2.warp_split}")
    check_k_steps("w2", t2.split, t2.k_chunks, inter, *((w13.inter_shared,) if shared_separate else ()))
    two = _two_groups(w13.fmt, n, ptx)
    common = dict(NUM_ROUTED=n_routed, E_POW2=triton.next_power_of_2(max(n_routed, 1)), TOPK=top_k,
                  K_POW2=triton.next_power_of_2(top_k), SHARED_SLOT=shared_slot, SHARED_SEPARATE=shared_separate,
                  SHARED_ONLY=shared_only, PTX=ptx, PDL=pdl, FP8=w13.fmt == FMT_MXFP8_MMA, TWO_GROUPS=two,
                  COMPACT=compacts(), EVICT_FIRST=weights_evict_first(ptx))
    # ``slots`` counts the shared expert once; the grid gives it a slot per pass (program_slot).
    routed = slots - int(shared_slot or shared_only)
    shared_slots = shared_passes(n, two) if shared_slot or shared_only else 0
    slots = routed + shared_slots
    w, s = mma_operands("w13", w13.w, w13.s)
    sw, ss = mma_operands("shared_w13", w13.sw, w13.ss)
    h32, a32 = h.view(torch.int32), a.view(torch.int32)
    check_aligned("h / the activation buffer", h32.unsqueeze(-1), a32.unsqueeze(-1))
    nw13 = t13.num_warps
    groups = triton.cdiv(inter_max // 16, t13.row_blocks)
    split = t13.split
    counters = split_counters(h.device, slots * groups) if split > 1 else None
    if counters is None or part is None:
        split, part, counters = 1, a, ids  # (unused pointers)
    if route is not None:
        if n != 1 or shared_only:
            raise ValueError(f"route: the experts route in-kernel only one-token steps of routed slots, got {n} tokens")
        logits, bias, tw, scaling = route
        common.update(ROUTE=True, HAS_BIAS=bias is not None, COMPACT=False)
        routing = (logits, bias if bias is not None else logits, tw, float(scaling))
    else:
        routing = (y, y, y, 1.0)  # (unused fp32 pointers)
    table_on = slot_table_on(shared_only, n) and route is None
    table = build_slot_table(ids, routed, n_routed, pdl) if table_on else ids
    norm_args = {} if norm is None else deferred_norm_args(*norm)
    _mma_w13_kernel[(slots, groups, split)](
        h32, ids, w, s, sw, ss, a, part, counters, table, *routing, n, n * top_k, inter, w13.inter_shared, hidden // 64,
        table.stride(0), shared_slots, h.stride(0) // 2, w.stride(0), w.stride(1), s.stride(0), s.stride(1),
        sw.stride(1), ss.stride(1), a.stride(0), a.stride(1), part.stride(0), part.stride(1) if split > 1 else 0,
        part.stride(2) if split > 1 else 0, float(alpha), float(limit),
        NW=nw13, DEPTH=t13.k_chunks, SPLIT=split, SPLIT_POW2=triton.next_power_of_2(split), PREFETCH=_prefetch(t13),
        PAIRED=t13.paired, TABLE=table_on, num_warps=nw13, num_stages=1, launch_pdl=pdl, **register_cap(t13),
        RING=t13.ring, KS=t13.warp_split, **common, **norm_args)
    w, s = mma_operands("w2", w2.w, w2.s)
    sw, ss = mma_operands("shared_w2", w2.sw, w2.ss)
    nw2 = t2.num_warps
    _mma_w2_kernel[(slots, triton.cdiv(hidden // 16, nw2), t2.split)](
        a32, ids, w, s, sw, ss, y, table, *routing[:2], n, n * top_k, hidden, inter, w2.inter_shared, table.stride(0),
        shared_slots,
        a32.stride(0), a32.stride(1), w.stride(0), w.stride(1), s.stride(0), s.stride(1), sw.stride(1), ss.stride(1),
        y.stride(0), y.stride(1), y.stride(2),
        NW=nw2, DEPTH=t2.k_chunks, SPLIT=t2.split, PREFETCH=_prefetch(t2),
        PRELOAD=w2_preload_steps(n, t2.ring, pdl, route is not None), TABLE=table_on, RING=t2.ring,
        num_warps=nw2, num_stages=1, launch_pdl=pdl, **register_cap(t2), **common)


# ---- ahead-of-time specs ---------------------------------------------------------------------------------

# (H, I, routed experts, top-k): a small table the layout fits and the real model.
AOT_SIZES = [(256, 128, 8, 2), (6144, 3072, 128, 4)]
_MODES = {"table": (True, False, False), "merged": (True, True, False), "shared": (False, False, True),
          "routed": (False, False, False)}


def aot_specs() -> list[KernelSpec]:
    """The launches' specialisations of both kernels (default tiles; w13 also split in two where
    its tiles are not paired):
    - inline-PTX decode (CUDA): MXFP4 and MXFP8 in the merged mode (the loader's: the shared expert
      given separately, in the table's layout) with and without PDL; the shared-only mode and the
      routed slot-table kernels with PDL; MXFP4 at the small size without PDL;
    - the portable emulation (HIP): MXFP4 at the real size, MXFP8 one-token steps at the small size;
      on CUDA only the MXFP4 one-token pair and the MXFP8 one-token w2 (mma layouts are laid out
      where the PTX kernels run, weights.mma_layout_default, and launches there take PTX unless
      MINIMAX_OPS_NO_PTX=1);
    - paired token groups (TWO_GROUPS) once per kernel: they launch only with fixed token groups
      (``_two_groups``, MINIMAX_OPS_NO_COMPACT=1), on the PTX decode.
    Left out, as compiling no line the kept specs do not on the same target:
    - the table mode (SHARED_SEPARATE only adds selects to the merged mode's code) and the routed
      mode (SHARED_SLOT=False only drops one) but for its slot-table kernels, whose row read
      (``program_slot``) differs; the PDL entry wait without a shared slot is the shared-only mode's too;
    - PTX without PDL (PDL only adds the waits) but in the merged mode and at the small size: the
      vocabulary ops launch them, and the fragment-layout probe of tests/test_kernels_aot.py reads
      exactly these specs;
    - the small size where its flags and tiles are the real size's (MXFP4 portable, PTX with PDL,
      MXFP8 PTX);
    - the MXFP8 portable slot-table kernels: they add only slot-table code, format-independent,
      that the MXFP4 portable ones compile on the same targets."""
    common_sig = {"ids_ptr": "*i32", "w_ptr": "*i32", "s_ptr": "*u8", "sw_ptr": "*i32", "ss_ptr": "*u8",
                  "table_ptr": "*i32", "n_tokens": "i32", "n_pairs": "i32", "inter": "i32", "inter_shared": "i32",
                  "stride_table": "i32", "shared_slots": "i32"}
    strides = {n: "i32" for n in ("stride_we", "stride_wb", "stride_se", "stride_sb", "stride_swb", "stride_ssb")}
    routing = {"route_ptr": "*fp32", "bias_ptr": "*fp32"}
    sig13 = {"h_ptr": "*i32", **common_sig, **routing, "tw_ptr": "*fp32", "scaling": "fp32", "a_ptr": "*bf16",
             "part_ptr": "*fp32", "cnt_ptr": "*i32", "k_blocks": "i32",
             "stride_hm": "i32", **strides, "stride_am": "i32", "stride_acol": "i32", "stride_psplit": "i32",
             "stride_pm": "i32", "stride_pcol": "i32", "alpha": "fp32", "limit": "fp32"}
    sig2 = {"a_ptr": "*i32", **common_sig, **routing, "y_ptr": "*fp32", "hidden": "i32", "stride_am": "i32",
            "stride_acol": "i32",
            **strides, "stride_ysplit": "i32", "stride_ym": "i32", "stride_ycol": "i32"}
    sig13_norm = {**sig13, "sumsq_ptr": "*fp32", "n_parts": "i32", "eps": "fp32"}
    specs, seen = [], set()

    def launch(fp8, size, mode, ptx, pdl, n_tokens, targets, tables=None, compact=True, w2_targets=None,
               route=False, norm=False):
        """Append the w13 / w2 kernels an n_tokens step launches (as the first step size that runs
        these tiles; compact: MINIMAX_OPS_NO_COMPACT unset), each distinct kernel once, for targets
        (w2: w2_targets if given); tables True / False: only if they do / do not read the step's
        slot table; route: the one-token step routed in-kernel (with a bias); norm: its w13 taking the
        deferred post norm (NORM; w2 is the same kernel either way)."""
        hidden, inter, n_routed, top_k = size
        shared_slot, shared_separate, shared_only = _MODES[mode]
        t13 = mma_expert_tiles(hidden, True, fp8=fp8, one_token=n_tokens == 1, routed=route)
        paired = t13.paired
        t2 = mma_expert_tiles(inter, False, fp8=fp8, one_token=n_tokens == 1, routed=route)
        t13, t2 = (t13, t2) if ptx else (portable_mma_tiles(t13), portable_mma_tiles(t2))
        preload = preloads(n_tokens)
        table = slot_tables(shared_only, n_tokens, compact)
        if tables is not None and table != tables:
            return
        two = fp8 and ptx and n_tokens > TOKENS.value and not compact  # (_two_groups)
        common = {"NUM_ROUTED": n_routed, "E_POW2": triton.next_power_of_2(n_routed), "TOPK": top_k,
                  "K_POW2": triton.next_power_of_2(top_k), "SHARED_SLOT": shared_slot,
                  "SHARED_SEPARATE": shared_separate, "SHARED_ONLY": shared_only, "PTX": ptx, "EVICT_FIRST": ptx,
                  "PDL": pdl,
                  "FP8": fp8, "TWO_GROUPS": two, "COMPACT": compact and not route, "ROUTE": route, "HAS_BIAS": route}
        label = (f"{'fp8_' if fp8 else ''}h{hidden}_{mode}{'_ptx' if ptx else ''}{'_pdl' if pdl else ''}"
                 f"{'' if compact else '_fixed'}{'_two' if two else ''}{'_route' if route else ''}")
        tag = f"{'_preload' if preload else ''}{'_table' if table else ''}"
        # (grid splits, warp splits): the tiles', the same K parts all by the grid (tiles.WARP_SPLIT off),
        # unpaired also two grid splits, and one-token steps also the tiles' fill (a warp a K part: the
        # intermediates of a tensor-parallel rank, tiles.expert_tiles)
        forms = {(t13.split, t13.warp_split), (t13.split * t13.warp_split, 1)} | (set() if paired else {(2, 1)})
        if n_tokens == 1 and ptx:
            fill = mma_expert_tiles(hidden, True, fp8=fp8, one_token=True, routed=route, fill=True)
            forms.add((fill.split, fill.warp_split))
        norm_args = dict(NORM=True, BLOCK_P=triton.next_power_of_2(aot_norm_parts())) if norm else {}
        for split, ws in sorted(forms):
            if (label, "w13", t13, split, ws, table, norm) in seen or (norm and not ptx
                                                                        and (split, ws) != (t13.split, t13.warp_split)):
                continue  # (NORM adds its epilogue only: on AMD the tiles' form stands for the others)
            seen.add((label, "w13", t13, split, ws, table, norm))
            specs.append(KernelSpec(
                _mma_w13_kernel, sig13_norm if norm else sig13,
                dict(common, NW=t13.num_warps, DEPTH=t13.k_chunks, SPLIT=split,
                     SPLIT_POW2=triton.next_power_of_2(split), PREFETCH=_prefetch(t13), PAIRED=paired, TABLE=table,
                     RING=t13.ring, KS=ws, **norm_args),
                num_warps=t13.num_warps, num_stages=1, targets=targets,
                name=f"mma_w13_{label}{'_norm' if norm else ''}_d{t13.k_chunks}_s{split}{f'w{ws}' if ws > 1 else ''}"
                     f"{'_paired' if paired else ''}{'_table' if table else ''}",
                max_registers=t13.max_registers))
        # (the fused layer's routed ring-3 w2 also with two steps read before the wait; one where the switch says)
        for steps in (int(preload), 2) if w2_two_steps(n_tokens, t2.ring, pdl, route) else (int(preload),):
            if (label, "w2", t2, steps, table) in seen:
                continue
            seen.add((label, "w2", t2, steps, table))
            specs.append(KernelSpec(
                _mma_w2_kernel, sig2,
                dict(common, NW=t2.num_warps, DEPTH=t2.k_chunks, SPLIT=t2.split, PREFETCH=_prefetch(t2),
                     PRELOAD=steps, TABLE=table, RING=t2.ring),
                num_warps=t2.num_warps, num_stages=1, targets=targets if w2_targets is None else w2_targets,
                name=f"mma_w2_{label}_d{t2.k_chunks}_s{t2.split}{tag}{'2' if steps == 2 else ''}"
                     f"{'_ring3' if t2.ring == 3 else ''}",
                max_registers=t2.max_registers))

    small, real = AOT_SIZES
    for fp8, n_tokens in itertools.product((False, True), (1, 16)):
        # PTX, real size: the merged mode with and without PDL, the shared-only and routed modes with;
        # MXFP8 in the merged mode only (the MXFP4 specs cover the modes, these the fp8 decode).
        for mode, pdl in (("merged", False), ("merged", True), ("shared", True), ("routed", True)):
            if not fp8 or mode == "merged":
                launch(fp8, real, mode, True, pdl, n_tokens, ("cuda",), tables=True if mode == "routed" else None)
        if fp8:  # portable MXFP8 at the small size only (mma layouts are laid out only where PTX runs)
            launch(fp8, small, "table", False, False, n_tokens, ("hip",), tables=False, w2_targets=())
            continue
        launch(fp8, small, "table", True, False, n_tokens, ("cuda",))
        for mode in ("merged", "shared", "routed"):  # portable, real size; CUDA: the merged one-token pair
            launch(fp8, real, mode, False, False, n_tokens, () if mode == "merged" and n_tokens == 1 else ("hip",),
                   tables=True if mode == "routed" else None)
    # The fused layer's one-token steps route in-kernel (moe.routed_moe_experts): its PTX launches, the
    # portable MXFP4 ones (CUDA and HIP), the portable MXFP8 ones at the small size (HIP).
    for fp8 in (False, True):
        launch(fp8, real, "merged", True, True, 1, ("cuda",), route=True)
        launch(fp8, real, "merged", True, True, 1, ("cuda",), route=True, norm=True)  # the post norm deferred
    launch(False, real, "merged", False, False, 1, (), route=True)
    launch(False, real, "merged", False, False, 1, ("hip",), route=True, norm=True)
    launch(True, small, "table", False, False, 1, ("hip",), route=True)
    # TWO_GROUPS launches only with fixed token groups (MINIMAX_OPS_NO_COMPACT=1, an A/B switch): kept
    # compiled once per kernel (w13 and w2 both pair the groups), for the PTX decode it runs on.
    launch(True, real, "merged", True, False, 16, ("cuda",), compact=False)
    return specs
