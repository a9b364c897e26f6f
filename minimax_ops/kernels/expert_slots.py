"""Which expert a program of an expert kernel streams, and for which tokens: the slot -> expert
map computed in-kernel from the step's top-k ids (no host sync), the slot's weight pointers
(shared expert in the table or separate), the top-k column of each token, and SwiGLU-OAI. Shared by
the row-layout kernels (moe.py) and the mma-layout ones (moe_mma.py). Steps of many tokens can have
it all written once, as the step's slot table (``build_slot_table``), for the mma-layout kernels."""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from .aot import KernelSpec
from .router import topk_rows, topk_weights

PAIR_BLOCK = tl.constexpr(16)  # top-k ids compared per step when finding a slot's expert (E x 16 compares: few registers)
TOKEN_CHUNK = tl.constexpr(16)  # tokens whose top-k ids are compared per step when compacting an expert's tokens


@triton.jit
def slot_expert(ids_ptr, n_pairs, slot, NUM_ROUTED: tl.constexpr, E_POW2: tl.constexpr,
                 SHARED_SLOT: tl.constexpr):
    """The slot-th smallest routed expert id present in ids[0:n_pairs]; with SHARED_SLOT the last
    slot of the grid is the shared expert NUM_ROUTED (a slot known before the ids are: the fused
    layer's shared-expert programs start streaming while the router still runs, moe_mma.py);
    -1 for an empty slot (routed slots past the number of distinct experts)."""
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
        expert = tl.where(slot == tl.num_programs(0) - 1, NUM_ROUTED, expert)
    return expert


@triton.jit
def token_columns(ids_ptr, n_tokens, m0, expert, NUM_ROUTED: tl.constexpr, TOPK: tl.constexpr,
                   K_POW2: tl.constexpr, BLOCK_M: tl.constexpr, SHARED_ONLY: tl.constexpr):
    """Tokens m0..m0+BLOCK_M: (token index, the top-k column that chose `expert`, -1 if none).
    The shared expert (NUM_ROUTED, or every token with SHARED_ONLY) has column TOPK."""
    offs_m = m0 + tl.arange(0, BLOCK_M)
    col = columns_of(ids_ptr, offs_m[:, None], n_tokens, expert, NUM_ROUTED, TOPK, K_POW2, SHARED_ONLY)
    return offs_m, tl.reshape(col, [BLOCK_M])


@triton.jit
def program_expert(ids_ptr, n_pairs, NUM_ROUTED: tl.constexpr, E_POW2: tl.constexpr, SHARED_SLOT: tl.constexpr,
                   SHARED_ONLY: tl.constexpr):
    """The expert of this program's slot (program_id 0): slot_expert, or the slot itself in
    SHARED_ONLY launches (one slot whose 'table' is the shared expert)."""
    if SHARED_ONLY:
        expert = tl.program_id(0)
    else:
        expert = slot_expert(ids_ptr, n_pairs, tl.program_id(0), NUM_ROUTED, E_POW2, SHARED_SLOT)
    return expert


@triton.jit
def slot_weights(expert, w_ptr, s_ptr, sw_ptr, ss_ptr, inter, inter_shared,
                  stride_we, stride_wn, stride_se, stride_sn, stride_swn, stride_ssn,
                  stride_wt, stride_st, stride_swt, stride_sst,
                  NUM_ROUTED: tl.constexpr, SHARED_SEPARATE: tl.constexpr):
    """(weight base, scale base, weight row stride, scale row stride, weight tile-row stride, scale
    tile-row stride, intermediate size) of ``expert`` (-1: an empty slot, any readable base). A
    separate shared expert (SHARED_SEPARATE) reads its own tensors. Row strides are inside a tile
    for tiled layouts (whose tile-row strides the row layouts do not use)."""
    w_base = w_ptr + tl.maximum(expert, 0).to(tl.int64) * stride_we
    s_base = s_ptr + tl.maximum(expert, 0).to(tl.int64) * stride_se
    row_w = stride_wn
    row_s = stride_sn
    tile_w = stride_wt
    tile_s = stride_st
    inter_e = inter
    if SHARED_SEPARATE:
        shared = expert == NUM_ROUTED
        w_base = tl.where(shared, sw_ptr, w_base)
        s_base = tl.where(shared, ss_ptr, s_base)
        row_w = tl.where(shared, stride_swn, row_w)
        row_s = tl.where(shared, stride_ssn, row_s)
        tile_w = tl.where(shared, stride_swt, tile_w)
        tile_s = tl.where(shared, stride_sst, tile_s)
        inter_e = tl.where(shared, inter_shared, inter_e)
    return w_base, s_base, row_w, row_s, tile_w, tile_s, inter_e


@triton.jit
def swiglu_oai(gate, up, alpha, limit):
    g = tl.minimum(gate, limit)
    u = tl.minimum(tl.maximum(up, -limit), limit)
    return g * tl.sigmoid(alpha * g) * (u + 1.0)


@triton.jit
def columns_of(ids_ptr, tok, n_tokens, expert, NUM_ROUTED: tl.constexpr, TOPK: tl.constexpr, K_POW2: tl.constexpr,
               SHARED_ONLY: tl.constexpr):
    """token_columns for a 2-D tensor of token indices: the top-k column that chose `expert`
    (TOPK for the shared expert), -1 where the token chose it not or does not exist."""
    valid = (tok >= 0) & (tok < n_tokens)
    col = tl.where(valid, TOPK, -1)
    if not SHARED_ONLY:
        k = tl.arange(0, K_POW2)[None, None, :]
        ids = tl.load(ids_ptr + tok[:, :, None] * TOPK + k, mask=valid[:, :, None] & (k < TOPK), other=-1)
        routed = tl.max(tl.where(ids == expert, k, -1), axis=2)
        col = tl.where(expert == NUM_ROUTED, col, routed)
    return col


# One-token steps of the fused layer route inside the expert kernels (moe.routed_moe_experts): every
# program that needs the step's choice makes it from the router's logits (``routed_ids``, the router's
# own top-k arithmetic), and the helpers above take those ids from registers (``slot_expert_of``,
# ``columns_of_ids``) instead of from memory.


@triton.jit
def routed_ids(logits_ptr, bias_ptr, NW: tl.constexpr, NUM_ROUTED: tl.constexpr, E_POW2: tl.constexpr,
               TOPK: tl.constexpr, K_POW2: tl.constexpr, HAS_BIAS: tl.constexpr):
    """A one-token step's top-k ids from its fp32 router logits [NUM_ROUTED] (router.router_logits),
    as router.route chooses them (router.topk_rows): (ids int32 [K_POW2], and for routed_weights the
    ids and scores as rows). NW is the program's warp count: the logits are loaded as NW equal rows,
    which Triton lays one a warp (contiguous along the experts), so every arg-max round reduces
    inside a warp and only the final ids cross warps (the rounds over one row of 128 spread over the
    warps took ~20 block barriers)."""
    offs_e = tl.arange(0, E_POW2)[None, :] + tl.zeros([NW, 1], dtype=tl.int32)
    e_mask = offs_e < NUM_ROUTED
    bias = None
    if HAS_BIAS:
        bias = tl.load(bias_ptr + offs_e, mask=e_mask, other=0.0)
    logits = tl.load(logits_ptr + offs_e, mask=e_mask, other=0.0)
    id_rows, score_rows = topk_rows(logits, bias, e_mask, TOPK, K_POW2)
    return tl.max(id_rows, axis=0), id_rows, score_rows


@triton.jit
def routed_weights(id_rows, score_rows, scaling, TOPK: tl.constexpr):
    """The weights of routed_ids' choice (fp32 [K_POW2], summing to ``scaling``), as router.route's."""
    return tl.max(topk_weights(id_rows, score_rows, scaling, TOPK), axis=0)


@triton.jit
def slot_expert_of(ids, slot, TOPK: tl.constexpr):
    """The expert of a one-token step's slot ``slot`` from its ids in registers (routed_ids): the
    top-k column's (slot s streams ids[s]; w13 and w2 make the same ids, and their passes meet at
    the column), -1 past the last. The memory path's slots take the distinct experts in id order
    (slot_expert); this order needs no sort."""
    k = tl.arange(0, ids.shape[0])
    return tl.max(tl.where((k == slot) & (k < TOPK), ids, -1), axis=0)


@triton.jit
def columns_of_ids(ids, tok, n_tokens, expert, NUM_ROUTED: tl.constexpr, TOPK: tl.constexpr):
    """columns_of for one token's ids in registers (routed_ids): the top-k column that chose
    ``expert`` (TOPK for the shared expert) where tok is token 0, -1 elsewhere."""
    k = tl.arange(0, ids.shape[0])
    routed = tl.max(tl.where((ids == expert) & (k < TOPK), k, -1), axis=0)
    valid = (tok == 0) & (n_tokens > 0)
    return tl.where(valid, tl.where(expert == NUM_ROUTED, TOPK, routed), -1)


@triton.jit
def _chosen(ids_ptr, t0, n_tokens, expert, TOPK: tl.constexpr, K_POW2: tl.constexpr):
    """Tokens t0 .. t0 + TOKEN_CHUNK - 1 and whether each chose ``expert`` (int32 1 / 0)."""
    t = t0 + tl.arange(0, TOKEN_CHUNK)
    k = tl.arange(0, K_POW2)
    ids = tl.load(ids_ptr + t[:, None] * TOPK + k[None, :], mask=(t < n_tokens)[:, None] & (k < TOPK)[None, :],
                  other=-1)
    return t, tl.max((ids == expert).to(tl.int32), axis=1)


@triton.jit
def chooser_count(ids_ptr, n_tokens, expert, TOPK: tl.constexpr, K_POW2: tl.constexpr):
    """How many of the step's tokens chose the routed expert ``expert``."""
    count = n_tokens * 0
    for t0 in range(0, n_tokens, TOKEN_CHUNK):
        count += tl.sum(_chosen(ids_ptr, t0, n_tokens, expert, TOPK, K_POW2)[1], axis=0)
    return count


@triton.jit
def chooser_tokens(ids_ptr, n_tokens, expert, rank, compact, TOPK: tl.constexpr, K_POW2: tl.constexpr):
    """The token of each rank (an int32 tensor [R, C]): with ``compact`` the rank-th token, in token
    order, that chose ``expert``; else the token ``rank`` itself; -1 past the last. Expert passes of
    up to 8 tokens then carry only tokens that chose the expert, so a routed expert chosen by 8 or
    fewer tokens of a larger step streams its weights once."""
    tok = tl.where(rank < n_tokens, rank, -1)
    if compact:
        tok = tl.zeros_like(tok) - 1
        base = n_tokens * 0
        for t0 in range(0, n_tokens, TOKEN_CHUNK):
            t, chosen = _chosen(ids_ptr, t0, n_tokens, expert, TOPK, K_POW2)
            r = base + tl.cumsum(chosen, axis=0) - 1
            hit = (chosen > 0)[None, None, :] & (r[None, None, :] == rank[:, :, None])
            tok = tl.maximum(tok, tl.max(tl.where(hit, t[None, None, :], -1), axis=2))
            base += tl.sum(chosen, axis=0)
    return tok


# A step's slot table (expert launches of routed slots in steps of more than one token group, with
# compacted passes): one int32 row per routed slot, [expert (-1: empty), ranks (the tokens that
# chose it), token of rank 0 .. n-1, top-k column of rank 0 .. n-1] (-1 past the last rank), written
# by ``_slot_table_kernel`` once per step, so that each of the step's thousands of expert programs
# reads its expert and its passes' tokens instead of finding them from the step's ids. The shared
# expert's slot has no row: every token chose it (``slot_row_tokens``).
TABLE_HEAD = tl.constexpr(2)
PAIR_CHUNK = tl.constexpr(64)  # (token, top-k column) pairs placed per step by _slot_table_kernel


@triton.jit
def _pair_ids(ids_ptr, p0, n_pairs, NUM_ROUTED: tl.constexpr):
    """Pairs p0 .. p0 + PAIR_CHUNK - 1: (pair index, its routed id or -1)."""
    p = p0 + tl.arange(0, PAIR_CHUNK)
    e = tl.load(ids_ptr + p, mask=p < n_pairs, other=-1)
    return p, tl.where((e >= 0) & (e < NUM_ROUTED), e, -1)


@triton.jit
def _expert_counts(e, E_POW2: tl.constexpr):
    """How many of the pairs' ids (-1: none) name each expert [E_POW2]."""
    return tl.histogram(tl.maximum(e, 0), E_POW2, mask=e >= 0)


@triton.jit
def _slot_table_kernel(ids_ptr, table_ptr, n_tokens, n_pairs, table_words, stride_table,
                       NUM_ROUTED: tl.constexpr, E_POW2: tl.constexpr, TOPK: tl.constexpr, PDL: tl.constexpr):
    """One program: the slot table of the step's ids (slot s: the s-th smallest routed expert
    chosen; its ranks: the tokens that chose it, in token order, with their top-k columns)."""
    if PDL:
        gdc_wait()
        gdc_launch_dependents()
    for w0 in range(0, table_words, 1024):
        offs = w0 + tl.arange(0, 1024)
        tl.store(table_ptr + offs, tl.full([1024], -1, tl.int32), mask=offs < table_words)
    count = tl.zeros([E_POW2], dtype=tl.int32)
    for p0 in range(0, n_pairs, PAIR_CHUNK):
        count += _expert_counts(_pair_ids(ids_ptr, p0, n_pairs, NUM_ROUTED)[1], E_POW2)
    experts = tl.arange(0, E_POW2)
    slot = tl.cumsum((count > 0).to(tl.int32), axis=0) - 1
    tl.debug_barrier()  # (the -1 fill lands before the rows' stores)
    rows = table_ptr + slot.to(tl.int64) * stride_table
    tl.store(rows, experts, mask=count > 0)
    tl.store(rows + 1, count, mask=count > 0)
    seen = tl.zeros([E_POW2], dtype=tl.int32)  # pairs of earlier chunks that chose each expert
    q = tl.arange(0, PAIR_CHUNK)
    for p0 in range(0, n_pairs, PAIR_CHUNK):
        p, e = _pair_ids(ids_ptr, p0, n_pairs, NUM_ROUTED)
        # Counts by histogram and a pair's expert-indexed values by gather: reductions over [E_POW2, PAIR_CHUNK]
        # one-hot tensors took most of the kernel's instructions.
        e_at = tl.maximum(e, 0)
        within = tl.sum(((e[:, None] == e[None, :]) & (q[None, :] < q[:, None])).to(tl.int32), axis=1)
        rank = tl.gather(seen, e_at, 0) + within
        pair_slot = tl.gather(slot, e_at, 0)
        row = table_ptr + pair_slot.to(tl.int64) * stride_table + TABLE_HEAD
        tl.store(row + rank, p // TOPK, mask=e >= 0)
        tl.store(row + n_tokens + rank, p % TOPK, mask=e >= 0)
        seen += _expert_counts(e, E_POW2)


def slot_table_width(n_tokens: int) -> int:
    """Words of one slot's row of the slot table."""
    return TABLE_HEAD.value + 2 * n_tokens


def build_slot_table(ids: torch.Tensor, routed_slots: int, num_routed: int, pdl: bool) -> torch.Tensor:
    """The slot table [routed_slots, slot_table_width(n)] of int32 top-k ids [n, k] (one launch,
    a programmatic dependent with ``pdl``)."""
    n, top_k = ids.shape
    table = torch.empty(routed_slots, slot_table_width(n), dtype=torch.int32, device=ids.device)
    _slot_table_kernel[(1,)](ids, table, n, n * top_k, table.numel(), table.stride(0), NUM_ROUTED=num_routed,
                             E_POW2=triton.next_power_of_2(num_routed), TOPK=top_k, PDL=pdl, num_warps=4,
                             launch_pdl=pdl)
    return table


@triton.jit
def slot_row_tokens(row_ptr, n_tokens, rank, shared, TOPK: tl.constexpr):
    """(token, top-k column) of each rank (an int32 tensor) of a slot: from its slot table row, or
    for the shared expert's slot (``shared``, no row) token = rank, column TOPK; -1 for none."""
    ok = (rank >= 0) & (rank < n_tokens)
    tok = tl.load(row_ptr + TABLE_HEAD + rank, mask=ok & (shared == 0), other=-1)
    col = tl.load(row_ptr + TABLE_HEAD + n_tokens + rank, mask=ok & (shared == 0), other=-1)
    tok = tl.where(ok & shared, rank, tok)
    col = tl.where(ok & shared, TOPK, col)
    return tok, col


def aot_specs() -> list[KernelSpec]:
    """The slot table kernel at the tiny and the real expert count (the other helpers compile
    through the kernels that call them); PDL for CUDA only."""
    sig = {"ids_ptr": "*i32", "table_ptr": "*i32", "n_tokens": "i32", "n_pairs": "i32", "table_words": "i32",
           "stride_table": "i32"}
    return [KernelSpec(_slot_table_kernel, sig,
                       {"NUM_ROUTED": e, "E_POW2": triton.next_power_of_2(e), "TOPK": k, "PDL": pdl}, num_warps=4,
                       targets=("cuda",) if pdl else (), name=f"slot_table_e{e}k{k}{'_pdl' if pdl else ''}")
            for e, k in ((8, 2), (128, 4)) for pdl in (False, True)]
