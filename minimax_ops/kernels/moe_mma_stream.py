"""Stream-K forms of moe_mma's w13 / w2 kernels, for steps of one token group (the one-token decode).

moe_mma's grid gives each (slot, row group, K split) a program: at one token that is 480 programs
where 528 fit, and the routed ones run on 384 of them once the shared expert's programs (which start
under the router) are done. Here a launch has exactly the programs that are resident at once, and
each takes an equal share of the work, counted in units of one load step of one row group
(``tile``): program p streams the units [p * U / P, (p + 1) * U / P), which may end inside one tile
and go on into the next. Every tile is summed by the last of the programs that streamed part of it
(splitk.last_arrival; partials added in program order, so the result does not depend on who came
last).

- ``_stream_w13_kernel``: the shared expert's tiles first (they need only h: every program streams
  its share of them under the router's tail, waiting only before it stores), then, after the PDL
  wait, the routed experts' tiles, each list shared among all programs. The last program of a tile
  applies SwiGLU -> a [token, column, i] (bf16).
- ``_stream_w2_kernel``: one list of the shared expert's then the routed experts' tiles (all wait for
  w13; the first step of each program's first tile is read before the wait, as moe_mma's PRELOAD
  does): the last program of a tile writes y[0, token, column, h] (fp32; one split for the combine).

Partials are fp32 [program, segment, token, row values] (segment: the program's k-th tile of the
list), written only for the step's tokens. ``stream_plan`` sizes them: the most tiles one program's
share touches and the most programs that share one tile (its partial loads, all in flight at once).
"""

from __future__ import annotations

import dataclasses
import functools
import os

import torch
import triton
import triton.language as tl

from ..formats import FMT_MXFP8_MMA
from .aot import KernelSpec
from .expert_slots import columns_of, slot_expert, slot_weights, swiglu_oai
from .mma_decode import (TOKENS, block_stream, check_aligned, first_blocks, fold, fragment_index, fragment_out,
                         mma_operands, pair_sets, preload_first, warp_rows)
from .mx_decode import gdc_launch_dependents, gdc_wait
from .splitk import split_counters
from .tiles import check_k_steps, mma_expert_tiles, num_sms, portable_mma_tiles, register_cap

_INTERPRETER_PROGRAMS = 5  # interpreted launches: few programs, shares that cross tiles


@triton.jit
def _share(p, P, begin, end):
    """Program p's share [lo, hi) of the units [begin, end)."""
    n = end - begin
    return begin + (p * n) // P, begin + ((p + 1) * n) // P


@triton.jit
def _owner(u, P, begin, end):
    """The program whose share of the units [begin, end) holds unit u."""
    return ((u - begin + 1) * P - 1) // (end - begin)


@triton.jit
def _tile_of(u, tiles_a, steps_a, steps_b):
    """(tile, its first unit, its end) of unit u: the shared expert's tiles_a tiles of steps_a units
    come first, then the routed tiles of steps_b units."""
    units_a = tiles_a * steps_a
    in_a = u < units_a
    t_b = tl.maximum(u - units_a, 0) // tl.maximum(steps_b, 1)
    tile = tl.where(in_a, u // tl.maximum(steps_a, 1), tiles_a + t_b)
    t_lo = tl.where(in_a, tile * steps_a, units_a + t_b * steps_b)
    return tile, t_lo, t_lo + tl.where(in_a, steps_a, steps_b)


@triton.jit
def _sum_shares(part_ptr, offs, mask, tile, t_lo, t_hi, P, begin, end, tiles_a, steps_a, steps_b, stride_seg,
                SEGS: tl.constexpr, SHARES: tl.constexpr):
    """The tile's partials summed in program order: program q stored its k-th tile of the list at
    part_ptr + (q * SEGS + k) * stride_seg + offs; SHARES loads (the programs from the owner of the
    tile's first unit to that of its last, empty shares skipped), all in flight at once."""
    q0 = _owner(t_lo, P, begin, end)
    q1 = _owner(t_hi - 1, P, begin, end)
    acc = tl.zeros(offs.shape, dtype=tl.float32)
    for j in tl.static_range(SHARES):
        q = q0 + j
        lo, hi = _share(q, P, begin, end)
        k = tile - _tile_of(lo, tiles_a, steps_a, steps_b)[0]
        acc += tl.load(part_ptr + (q * SEGS + k).to(tl.int64) * stride_seg + offs, mask=mask & (q <= q1) & (lo < hi),
                       other=0.0, cache_modifier=".cg")
    return acc


@triton.jit
def _arrive(cnt_ptr, tile, t_lo, t_hi, P, begin, end):
    """splitk.last_arrival for the programs whose shares hold units of the tile: those from the owner
    of its first unit to that of its last, or where the list has fewer units than programs (shares
    of one unit or none) one per unit."""
    tl.debug_barrier()
    expected = tl.minimum(_owner(t_hi - 1, P, begin, end) - _owner(t_lo, P, begin, end) + 1, t_hi - t_lo)
    ticket = tl.atomic_add(cnt_ptr + tile, 1, sem="acq_rel", scope="gpu")
    last = ticket == expected - 1
    if last:
        tl.atomic_xchg(cnt_ptr + tile, 0, sem="relaxed", scope="gpu")
    return last


@triton.jit
def _tile_expert(ids_ptr, n_pairs, tile, tiles_a, groups, NUM_ROUTED: tl.constexpr, E_POW2: tl.constexpr,
                 SHARED_ONLY: tl.constexpr):
    """(expert, row group) of a tile: the shared expert's (tile < tiles_a; its id in the launch's
    table: NUM_ROUTED, or 0 in SHARED_ONLY launches; the ids are not read: its w13 tiles run before
    the router is done) or routed slot (tile - tiles_a) // groups's."""
    shared = tile < tiles_a
    routed_tile = tl.maximum(tile - tiles_a, 0)
    group = tl.where(shared, tile, routed_tile % groups)
    expert = tile * 0 + (0 if SHARED_ONLY else NUM_ROUTED)
    if not shared:
        expert = slot_expert(ids_ptr, n_pairs, routed_tile // groups, NUM_ROUTED, E_POW2, False)
    return expert, group


@triton.jit
def _stream_w13_kernel(h_ptr, ids_ptr, w_ptr, s_ptr, sw_ptr, ss_ptr, a_ptr, part_ptr, cnt_ptr,
                       n_tokens, n_pairs, inter, inter_shared, k_blocks, tiles_a, groups, routed,
                       stride_hm, stride_we, stride_wb, stride_se, stride_sb, stride_swb, stride_ssb,
                       stride_am, stride_acol, stride_seg, stride_list, alpha, limit,
                       NUM_ROUTED: tl.constexpr, E_POW2: tl.constexpr, TOPK: tl.constexpr, K_POW2: tl.constexpr,
                       SHARED_SEPARATE: tl.constexpr, SHARED_ONLY: tl.constexpr, NW: tl.constexpr,
                       DEPTH: tl.constexpr, PTX: tl.constexpr, PDL: tl.constexpr, PREFETCH: tl.constexpr,
                       FP8: tl.constexpr, PAIRED: tl.constexpr, SEGS: tl.constexpr, SHARES: tl.constexpr,
                       WAIT_FIRST: tl.constexpr = False):
    """h_ptr: int32 view of h [n, H] (stride_hm in words), n <= 8; w / s as moe_mma's w13; tiles_a:
    the shared expert's row groups (0: none in this launch), groups: a routed expert's. Two lists:
    the shared tiles (stores wait for the router: buffers of this step may reuse memory it still
    reads), then after the PDL wait the routed ones (partials stride_list further). Only then may w2
    launch: it reads the ids before its own wait."""
    stride_hm = tl.multiple_of(stride_hm, 16)
    P = tl.num_programs(0)
    steps = k_blocks // DEPTH
    units_a = tiles_a * steps
    d, g, c, e = fragment_index(NW, DEPTH)
    x_rows = h_ptr + tl.where(g < n_tokens, g, 0).to(tl.int64) * stride_hm  # (no token: any readable row)
    column, row = fragment_out(NW)
    tok = tl.where(column < n_tokens, column, -1)
    if PDL:
        if WAIT_FIRST:
            gdc_wait()
    for li in range(2):
        if li == 1:
            if PDL:
                gdc_wait()
                gdc_launch_dependents()
        begin = tl.where(li == 0, 0, units_a)
        end = tl.where(li == 0, units_a, units_a + routed * groups * steps)
        lo, hi = begin, begin
        if end > begin:
            lo, hi = _share(tl.program_id(0), P, begin, end)
        list_ptr = part_ptr + li * stride_list
        u = lo
        k = 0
        while u < hi:
            tile, t_lo, t_hi = _tile_of(u, tiles_a, steps, steps)
            expert, group = _tile_expert(ids_ptr, n_pairs, tile, tiles_a, groups, NUM_ROUTED, E_POW2, SHARED_ONLY)
            w_base, s_base, row_w, row_s, _, _, inter_e = slot_weights(
                expert, w_ptr, s_ptr, sw_ptr, ss_ptr, inter, inter_shared, stride_we, stride_wb, stride_se,
                stride_sb, stride_swb, stride_ssb, 0, 0, 0, 0, NUM_ROUTED, SHARED_SEPARATE)
            row_w, row_s = tl.multiple_of(row_w, 16), tl.multiple_of(row_s, 16)
            i_blocks = inter_e // 16
            u_end = tl.minimum(hi, t_hi)
            live = (expert >= 0) & (group * NW < i_blocks)
            col = columns_of(ids_ptr, tok, n_tokens, expert, NUM_ROUTED, TOPK, K_POW2, SHARED_ONLY)
            i_out = group * NW * 16 + row
            ok = (col >= 0) & (i_out < inter_e)
            offs = tl.maximum(tok, 0) * (2 * NW * 16) + 2 * row
            if live:
                ib = tl.minimum(group * NW + warp_rows(NW, DEPTH), i_blocks - 1).to(tl.int64)
                gate_w, gate_s = w_base + ib * row_w, s_base + ib * row_s
                kb_begin = (u - t_lo) * DEPTH
                if PAIRED:  # gate and up blocks of each K block in one stream (moe_mma's PAIRED)
                    zp = tl.zeros([pair_sets(DEPTH) * NW * 32, 4], dtype=tl.float32)
                    gate, up = block_stream(zp, zp, gate_w, gate_s, x_rows, x_rows, kb_begin, u_end - u, NW, DEPTH,
                                            PTX, PREFETCH, FP8, False, 1, True, i_blocks * row_w, i_blocks * row_s)
                else:
                    zero = tl.zeros([DEPTH * NW * 32, 4], dtype=tl.float32)
                    gate = block_stream(zero, zero, gate_w, gate_s, x_rows, x_rows, kb_begin, u_end - u, NW, DEPTH,
                                        PTX, PREFETCH, FP8)[0]
                    up = block_stream(zero, zero, gate_w + i_blocks * row_w, gate_s + i_blocks * row_s, x_rows,
                                      x_rows, kb_begin, u_end - u, NW, DEPTH, PTX, PREFETCH, FP8)[0]
                if PDL:
                    if li == 0:
                        gdc_wait()
                SETS: tl.constexpr = pair_sets(DEPTH) if PAIRED else DEPTH
                p_ptrs = list_ptr + (tl.program_id(0) * SEGS + k).to(tl.int64) * stride_seg + offs
                tl.store(p_ptrs, fold(gate, NW, SETS), mask=ok)
                tl.store(p_ptrs + 1, fold(up, NW, SETS), mask=ok)
            if _arrive(cnt_ptr, tile, t_lo, t_hi, P, begin, end):
                if live:
                    gate = _sum_shares(list_ptr, offs, ok, tile, t_lo, t_hi, P, begin, end, tiles_a, steps, steps,
                                       stride_seg, SEGS, SHARES)
                    up = _sum_shares(list_ptr, offs + 1, ok, tile, t_lo, t_hi, P, begin, end, tiles_a, steps, steps,
                                     stride_seg, SEGS, SHARES)
                    a_ptrs = a_ptr + tl.maximum(tok, 0).to(tl.int64) * stride_am + col * stride_acol + i_out
                    tl.store(a_ptrs, swiglu_oai(gate, up, alpha, limit).to(a_ptr.dtype.element_ty), mask=ok)
            k += 1
            u = u_end


@triton.jit
def _w2_tile(u, ids_ptr, w_ptr, s_ptr, sw_ptr, ss_ptr, n_pairs, inter, inter_shared, hidden, tiles_a, groups,
             steps_a, steps_b, stride_we, stride_wb, stride_se, stride_sb, stride_swb, stride_ssb,
             NUM_ROUTED: tl.constexpr, E_POW2: tl.constexpr, SHARED_SEPARATE: tl.constexpr,
             SHARED_ONLY: tl.constexpr, NW: tl.constexpr, DEPTH: tl.constexpr):
    """The w2 tile of unit u: (tile, its first unit, its end, expert, row group, each warp's weight
    and scale row pointers, the expert's I, whether it streams)."""
    tile, t_lo, t_hi = _tile_of(u, tiles_a, steps_a, steps_b)
    expert, group = _tile_expert(ids_ptr, n_pairs, tile, tiles_a, groups, NUM_ROUTED, E_POW2, SHARED_ONLY)
    w_base, s_base, row_w, row_s, _, _, inter_e = slot_weights(
        expert, w_ptr, s_ptr, sw_ptr, ss_ptr, inter, inter_shared, stride_we, stride_wb, stride_se, stride_sb,
        stride_swb, stride_ssb, 0, 0, 0, 0, NUM_ROUTED, SHARED_SEPARATE)
    row_w, row_s = tl.multiple_of(row_w, 16), tl.multiple_of(row_s, 16)
    h_blocks = hidden // 16
    hb = tl.minimum(group * NW + warp_rows(NW, DEPTH), h_blocks - 1).to(tl.int64)
    live = (expert >= 0) & (group * NW < h_blocks)
    return tile, t_lo, t_hi, expert, group, w_base + hb * row_w, s_base + hb * row_s, inter_e, live


@triton.jit
def _w2_segment(u, hi, k, first, a_ptr, ids_ptr, w_ptr, s_ptr, sw_ptr, ss_ptr, y_ptr, part_ptr, cnt_ptr, n_tokens,
                n_pairs, hidden, inter, inter_shared, units, tiles_a, groups, steps_a, steps_b, stride_am, stride_acol,
                stride_we, stride_wb, stride_se, stride_sb, stride_swb, stride_ssb, stride_ym, stride_ycol,
                stride_seg, NUM_ROUTED: tl.constexpr, E_POW2: tl.constexpr, TOPK: tl.constexpr,
                K_POW2: tl.constexpr, SHARED_SEPARATE: tl.constexpr, SHARED_ONLY: tl.constexpr, NW: tl.constexpr,
                DEPTH: tl.constexpr, PTX: tl.constexpr, PREFETCH: tl.constexpr, FP8: tl.constexpr,
                PRELOADED: tl.constexpr, SEGS: tl.constexpr, SHARES: tl.constexpr):
    """The program's units [u, min(hi, end of u's tile)) of w2 (its k-th tile), stored as a partial;
    the tile's last program writes y. PRELOADED: ``first`` holds the segment's first step. Returns
    where the next segment starts."""
    P = tl.num_programs(0)
    tile, t_lo, t_hi, expert, group, w_rows, s_rows, inter_e, live = _w2_tile(
        u, ids_ptr, w_ptr, s_ptr, sw_ptr, ss_ptr, n_pairs, inter, inter_shared, hidden, tiles_a, groups, steps_a,
        steps_b, stride_we, stride_wb, stride_se, stride_sb, stride_swb, stride_ssb, NUM_ROUTED, E_POW2,
        SHARED_SEPARATE, SHARED_ONLY, NW, DEPTH)
    u_end = tl.minimum(hi, t_hi)
    column, row = fragment_out(NW)
    tok = tl.where(column < n_tokens, column, -1)
    col = columns_of(ids_ptr, tok, n_tokens, expert, NUM_ROUTED, TOPK, K_POW2, SHARED_ONLY)
    h_out = group * NW * 16 + row
    ok = (col >= 0) & (h_out < hidden)
    offs = tl.maximum(tok, 0) * (NW * 16) + row
    if live:
        d, g, c, e = fragment_index(NW, DEPTH)
        tok_x = tl.where(g < n_tokens, g, -1)
        col_x = columns_of(ids_ptr, tok_x, n_tokens, expert, NUM_ROUTED, TOPK, K_POW2, SHARED_ONLY)
        x_rows = a_ptr + tl.maximum(tok_x, 0).to(tl.int64) * stride_am + tl.maximum(col_x, 0) * stride_acol
        zero = tl.zeros([DEPTH * NW * 32, 4], dtype=tl.float32)
        acc = block_stream(zero, zero, w_rows, s_rows, x_rows, x_rows, (u - t_lo) * DEPTH, u_end - u, NW, DEPTH,
                           PTX, PREFETCH, FP8, PRELOADED=PRELOADED, first=first)[0]
        tl.store(part_ptr + (tl.program_id(0) * SEGS + k).to(tl.int64) * stride_seg + offs, fold(acc, NW, DEPTH),
                 mask=ok)
    if _arrive(cnt_ptr, tile, t_lo, t_hi, P, 0, units):
        if live:
            acc = _sum_shares(part_ptr, offs, ok, tile, t_lo, t_hi, P, 0, units, tiles_a, steps_a, steps_b,
                              stride_seg, SEGS, SHARES)
            tl.store(y_ptr + tl.maximum(tok, 0).to(tl.int64) * stride_ym + col * stride_ycol + h_out, acc, mask=ok)
    return u_end


@triton.jit
def _stream_w2_kernel(a_ptr, ids_ptr, w_ptr, s_ptr, sw_ptr, ss_ptr, y_ptr, part_ptr, cnt_ptr,
                      n_tokens, n_pairs, hidden, inter, inter_shared, tiles_a, groups, routed,
                      stride_am, stride_acol, stride_we, stride_wb, stride_se, stride_sb, stride_swb, stride_ssb,
                      stride_ym, stride_ycol, stride_seg,
                      NUM_ROUTED: tl.constexpr, E_POW2: tl.constexpr, TOPK: tl.constexpr, K_POW2: tl.constexpr,
                      SHARED_SEPARATE: tl.constexpr, SHARED_ONLY: tl.constexpr, NW: tl.constexpr,
                      DEPTH: tl.constexpr, PTX: tl.constexpr, PDL: tl.constexpr, PREFETCH: tl.constexpr,
                      FP8: tl.constexpr, PRELOAD: tl.constexpr, SEGS: tl.constexpr, SHARES: tl.constexpr):
    """a_ptr: int32 view of a [n, columns, I] (strides in words); y: fp32 [n, columns, H] (split 0).
    The experts come from the ids, complete before w13's routed list began: PRELOAD reads the first
    step of the program's first tile before the PDL wait for w13's activations."""
    stride_am, stride_acol = tl.multiple_of(stride_am, 16), tl.multiple_of(stride_acol, 16)
    steps_a = inter_shared // 64 // DEPTH
    steps_b = inter // 64 // DEPTH
    units = tiles_a * steps_a + routed * groups * steps_b
    lo, hi = _share(tl.program_id(0), tl.num_programs(0), 0, units)
    step0 = None
    if PRELOAD:
        tile, t_lo, _, _, _, w_rows, s_rows, _, live = _w2_tile(
            lo, ids_ptr, w_ptr, s_ptr, sw_ptr, ss_ptr, n_pairs, inter, inter_shared, hidden, tiles_a, groups, steps_a,
            steps_b, stride_we, stride_wb, stride_se, stride_sb, stride_swb, stride_ssb, NUM_ROUTED, E_POW2,
            SHARED_SEPARATE, SHARED_ONLY, NW, DEPTH)
        step0 = first_blocks(w_rows, s_rows, (lo - t_lo) * DEPTH, live & (lo < hi), NW, DEPTH, FP8)
    if PDL:
        gdc_wait()
        gdc_launch_dependents()
    u = lo
    k = 0
    if PRELOAD:  # the first segment on its preloaded step
        if u < hi:
            u = _w2_segment(u, hi, 0, step0, a_ptr, ids_ptr, w_ptr, s_ptr, sw_ptr, ss_ptr, y_ptr, part_ptr, cnt_ptr,
                            n_tokens, n_pairs, hidden, inter, inter_shared, units, tiles_a, groups, steps_a, steps_b,
                            stride_am, stride_acol, stride_we, stride_wb, stride_se, stride_sb, stride_swb,
                            stride_ssb, stride_ym, stride_ycol, stride_seg, NUM_ROUTED, E_POW2, TOPK, K_POW2,
                            SHARED_SEPARATE, SHARED_ONLY, NW, DEPTH, PTX, PREFETCH, FP8, True, SEGS, SHARES)
            k = 1
    while u < hi:
        u = _w2_segment(u, hi, k, None, a_ptr, ids_ptr, w_ptr, s_ptr, sw_ptr, ss_ptr, y_ptr, part_ptr, cnt_ptr,
                        n_tokens, n_pairs, hidden, inter, inter_shared, units, tiles_a, groups, steps_a, steps_b,
                        stride_am, stride_acol, stride_we, stride_wb, stride_se, stride_sb, stride_swb, stride_ssb,
                        stride_ym, stride_ycol, stride_seg, NUM_ROUTED, E_POW2, TOPK, K_POW2, SHARED_SEPARATE,
                        SHARED_ONLY, NW, DEPTH, PTX, PREFETCH, FP8, False, SEGS, SHARES)
        k += 1


# ---- launch ------------------------------------------------------------------------------------------------


def _tile_of_host(u: int, tiles_a: int, steps_a: int, steps_b: int) -> tuple[int, int, int]:
    """``_tile_of`` on the host (non-negative integers: the same floor divisions)."""
    units_a = tiles_a * steps_a
    if u < units_a:
        return u // steps_a, u // steps_a * steps_a, u // steps_a * steps_a + steps_a
    t_b = (u - units_a) // steps_b
    return tiles_a + t_b, units_a + t_b * steps_b, units_a + (t_b + 1) * steps_b


@functools.lru_cache(maxsize=256)
def list_sizes(programs: int, begin: int, end: int, tiles_a: int, steps_a: int, steps_b: int) -> tuple[int, int]:
    """(the most tiles one program's share of the units [begin, end) touches, the most programs from
    the owner of a tile's first unit to that of its last): the kernels' SEGS and SHARES for that list."""
    n = end - begin
    segs, shares = 1, 1
    for p in range(programs):
        lo, hi = begin + p * n // programs, begin + (p + 1) * n // programs
        if lo < hi:
            segs = max(segs, _tile_of_host(hi - 1, tiles_a, steps_a, steps_b)[0]
                       - _tile_of_host(lo, tiles_a, steps_a, steps_b)[0] + 1)
    u = begin
    while u < end:
        _, t_lo, t_hi = _tile_of_host(u, tiles_a, steps_a, steps_b)
        shares = max(shares, ((t_hi - begin) * programs - 1) // n - ((t_lo - begin + 1) * programs - 1) // n + 1)
        u = t_hi
    return segs, shares


def stream_programs(device: torch.device, t) -> int:
    """A stream-K launch's programs: the tiles' ``stream`` per SM (all resident at once), or a few
    when interpreted (shares that cross tiles)."""
    if device.type != "cuda":
        return _INTERPRETER_PROGRAMS
    return t.stream * num_sms(device)


def streams(t13, t2, n_tokens: int) -> bool:
    """Whether an n-token step's expert launches take the stream-K kernels: both tiles ask for it
    (``stream`` programs per SM), the step is one token group and w2 unsplit (the combine then sums
    one split), unless MINIMAX_OPS_NO_STREAM_K=1 (read at every launch: A/B runs switch it)."""
    return (t13.stream > 0 and t2.stream > 0 and n_tokens <= TOKENS.value and t2.split == 1
            and os.environ.get("MINIMAX_OPS_NO_STREAM_K") != "1")


@dataclasses.dataclass(frozen=True)
class StreamLaunch:
    """The work lists of one stream-K expert launch pair (tiles in row groups, units in load steps)."""
    programs: int
    shared_groups13: int  # the shared expert's w13 tiles (0: none in the launch)
    groups13: int  # a routed expert's w13 tiles
    steps13: int
    routed: int  # routed slots
    groups2: int  # w2 tiles per expert
    shared_steps2: int
    steps2: int

    @property
    def counters(self) -> int:
        return self.shared_groups13 + self.routed * self.groups13 + self.w2_tiles

    @property
    def w2_tiles(self) -> int:
        return (int(self.shared_groups13 > 0) + self.routed) * self.groups2

    def sizes13(self) -> tuple[int, int]:
        """w13's SEGS and SHARES: the larger of its two lists' (shared tiles, then routed ones)."""
        units_a = self.shared_groups13 * self.steps13
        end = units_a + self.routed * self.groups13 * self.steps13
        sizes = [list_sizes(self.programs, b, e, self.shared_groups13, self.steps13, self.steps13)
                 for b, e in ((0, units_a), (units_a, end)) if e > b]
        return max((s[0] for s in sizes), default=1), max((s[1] for s in sizes), default=1)

    def sizes2(self) -> tuple[int, int]:
        tiles_a = self.groups2 if self.shared_groups13 else 0
        return list_sizes(self.programs, 0, tiles_a * self.shared_steps2 + self.routed * self.groups2 * self.steps2,
                          tiles_a, self.shared_steps2, self.steps2)


def _launch(h32, ids, ops13, ops2, a, y, counters, plan: StreamLaunch, common: dict, *, inter, inter_shared, t13, t2,
            alpha, limit, preload, pdl):
    """The two launches: ops13 / ops2 the (w, s, sw, ss) operands, counters plan.counters zeroed arrival
    counters, common the constexprs both kernels take."""
    n = h32.shape[0]
    P = plan.programs
    segs13, shares13 = plan.sizes13()
    nw13, nw2 = t13.num_warps, t2.num_warps
    part13 = torch.empty(2, P * segs13, n * 2 * nw13 * 16, dtype=torch.float32, device=h32.device)
    w, s, sw, ss = ops13
    a32 = a.view(torch.int32)
    _stream_w13_kernel[(P,)](
        h32, ids, w, s, sw, ss, a, part13, counters, n, ids.numel(), inter, inter_shared, h32.shape[1] // 32,
        plan.shared_groups13, plan.groups13, plan.routed, h32.stride(0), w.stride(0), w.stride(1), s.stride(0),
        s.stride(1), sw.stride(1), ss.stride(1), a.stride(0), a.stride(1), part13.stride(1), part13.stride(0),
        float(alpha), float(limit), NW=nw13, DEPTH=t13.k_chunks, PREFETCH=max(0, t13.num_stages - 1),
        PAIRED=t13.paired, SEGS=segs13, SHARES=shares13, WAIT_FIRST=os.environ.get("MINIMAX_OPS_DIAG_WAIT") == "1",
        num_warps=nw13,
        num_stages=1, launch_pdl=pdl, **register_cap(t13), **common)
    segs2, shares2 = plan.sizes2()
    part2 = torch.empty(P * segs2, n * nw2 * 16, dtype=torch.float32, device=h32.device)
    w, s, sw, ss = ops2
    _stream_w2_kernel[(P,)](
        a32, ids, w, s, sw, ss, y, part2, counters[plan.counters - plan.w2_tiles:], n, ids.numel(), y.shape[3], inter,
        inter_shared, plan.groups2 if plan.shared_groups13 else 0, plan.groups2, plan.routed, a32.stride(0),
        a32.stride(1), w.stride(0), w.stride(1), s.stride(0), s.stride(1), sw.stride(1), ss.stride(1), y.stride(1),
        y.stride(2), part2.stride(0), NW=nw2, DEPTH=t2.k_chunks, PREFETCH=max(0, t2.num_stages - 1), PRELOAD=preload,
        SEGS=segs2, SHARES=shares2, num_warps=nw2, num_stages=1, launch_pdl=pdl, **register_cap(t2), **common)


def launch_stream_experts(h, ids, w13, w2, a, y, *, slots, inter, shared_slot, shared_separate, shared_only, t13,
                          t2, n_routed, ptx, alpha, limit, pdl) -> bool:
    """moe_mma.launch_mma_experts in stream-K form (its arguments; ``streams`` says when): False,
    launching nothing, where the arrival counters are not there (moe_mma's grid then runs the step)."""
    n, hidden = h.shape
    shared = shared_slot or shared_only
    inter_shared = w13.inter_shared if shared_separate else inter
    check_k_steps("w13", 1, t13.k_chunks, hidden)
    check_k_steps("w2", 1, t2.k_chunks, inter, *((inter_shared,) if shared else ()))
    plan = StreamLaunch(
        programs=stream_programs(h.device, t13), shared_groups13=triton.cdiv(inter_shared // 16, t13.num_warps)
        if shared else 0, groups13=triton.cdiv(inter // 16, t13.num_warps), steps13=hidden // 64 // t13.k_chunks,
        routed=slots - int(shared), groups2=triton.cdiv(hidden // 16, t2.num_warps),
        shared_steps2=inter_shared // 64 // t2.k_chunks, steps2=inter // 64 // t2.k_chunks)
    counters = split_counters(h.device, plan.counters)
    if counters is None:
        return False
    h32 = h.view(torch.int32)
    check_aligned("h / the activation buffer", h32.unsqueeze(-1), a.view(torch.int32).unsqueeze(-1))
    common = dict(NUM_ROUTED=n_routed, E_POW2=triton.next_power_of_2(max(n_routed, 1)), TOPK=ids.shape[1],
                  K_POW2=triton.next_power_of_2(ids.shape[1]), SHARED_SEPARATE=shared_separate,
                  SHARED_ONLY=shared_only, PTX=ptx, PDL=pdl, FP8=w13.fmt == FMT_MXFP8_MMA)
    ops13 = (*mma_operands("w13", w13.w, w13.s), *mma_operands("shared_w13", w13.sw, w13.ss))
    ops2 = (*mma_operands("w2", w2.w, w2.s), *mma_operands("shared_w2", w2.sw, w2.ss))
    _launch(h32, ids, ops13, ops2, a, y, counters, plan, common, inter=inter, inter_shared=inter_shared, t13=t13,
            t2=t2, alpha=alpha, limit=limit, preload=preload_first(n), pdl=pdl)
    return True


# ---- ahead-of-time specs ---------------------------------------------------------------------------------

AOT_SIZE = (6144, 3072, 128, 4)  # (hidden, inter, routed experts, top-k): the real model's
AOT_SMS = 132  # the plan's programs (SEGS / SHARES) as on an H200


def aot_specs() -> list[KernelSpec]:
    """The one-token launches at the real size, shared expert separate in the table's layout (the
    loader's merged mode): the inline-PTX decode of both formats as programmatic dependents (CUDA),
    and the portable emulation of MXFP4 without PDL (what AMD runs; w13's shared-tile and routed-tile
    code, the only mode-dependent parts, are in every spec)."""
    hidden, inter, n_routed, top_k = AOT_SIZE
    common_sig = {"ids_ptr": "*i32", "w_ptr": "*i32", "s_ptr": "*u8", "sw_ptr": "*i32", "ss_ptr": "*u8",
                  "part_ptr": "*fp32", "cnt_ptr": "*i32", "n_tokens": "i32", "n_pairs": "i32", "inter": "i32",
                  "inter_shared": "i32", "tiles_a": "i32", "groups": "i32", "routed": "i32"}
    strides = {n: "i32" for n in ("stride_we", "stride_wb", "stride_se", "stride_sb", "stride_swb", "stride_ssb")}
    sig13 = {"h_ptr": "*i32", "a_ptr": "*bf16", **common_sig, "k_blocks": "i32", "stride_hm": "i32", **strides,
             "stride_am": "i32", "stride_acol": "i32", "stride_seg": "i32", "stride_list": "i32", "alpha": "fp32",
             "limit": "fp32"}
    sig2 = {"a_ptr": "*i32", "y_ptr": "*fp32", **common_sig, "hidden": "i32", "stride_am": "i32", "stride_acol": "i32",
            **strides, "stride_ym": "i32", "stride_ycol": "i32", "stride_seg": "i32"}
    specs = []
    for fp8, ptx in ((False, True), (True, True), (False, False)):
        t13 = mma_expert_tiles(hidden, True, fp8=fp8, one_token=True)
        t2 = mma_expert_tiles(inter, False, fp8=fp8, one_token=True)
        if not ptx:
            t13, t2 = portable_mma_tiles(t13), portable_mma_tiles(t2)
        plan = StreamLaunch(t13.stream * AOT_SMS, triton.cdiv(inter // 16, t13.num_warps),
                            triton.cdiv(inter // 16, t13.num_warps), hidden // 64 // t13.k_chunks, top_k,
                            triton.cdiv(hidden // 16, t2.num_warps), inter // 64 // t2.k_chunks,
                            inter // 64 // t2.k_chunks)
        (segs13, shares13), (segs2, shares2) = plan.sizes13(), plan.sizes2()
        common = {"NUM_ROUTED": n_routed, "E_POW2": triton.next_power_of_2(n_routed), "TOPK": top_k,
                  "K_POW2": triton.next_power_of_2(top_k), "SHARED_SEPARATE": True, "SHARED_ONLY": False, "PTX": ptx,
                  "PDL": ptx, "FP8": fp8}
        label = f"{'fp8' if fp8 else 'fp4'}{'_ptx_pdl' if ptx else ''}"
        targets = ("cuda",) if ptx else ("hip",)
        specs.append(KernelSpec(
            _stream_w13_kernel, sig13,
            dict(common, NW=t13.num_warps, DEPTH=t13.k_chunks, PREFETCH=max(0, t13.num_stages - 1),
                 PAIRED=t13.paired, SEGS=segs13, SHARES=shares13),
            num_warps=t13.num_warps, num_stages=1, targets=targets, name=f"stream_w13_{label}",
            max_registers=t13.max_registers))
        specs.append(KernelSpec(
            _stream_w2_kernel, sig2,
            dict(common, NW=t2.num_warps, DEPTH=t2.k_chunks, PREFETCH=max(0, t2.num_stages - 1), PRELOAD=True,
                 SEGS=segs2, SHARES=shares2),
            num_warps=t2.num_warps, num_stages=1, targets=targets, name=f"stream_w2_{label}",
            max_registers=t2.max_registers))
    return specs
