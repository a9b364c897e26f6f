"""Which expert a program of an expert kernel streams, and for which tokens: the slot -> expert
map computed in-kernel from the step's top-k ids (no host sync), the slot's weight pointers
(shared expert in the table or separate), the top-k column of each token, and SwiGLU-OAI. Shared by
the row-layout kernels (moe.py) and the mma-layout ones (moe_mma.py)."""

from __future__ import annotations

import triton
import triton.language as tl

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
def slot_weights(ids_ptr, n_pairs, w_ptr, s_ptr, sw_ptr, ss_ptr, inter, inter_shared,
                  stride_we, stride_wn, stride_se, stride_sn, stride_swn, stride_ssn,
                  stride_wt, stride_st, stride_swt, stride_sst,
                  NUM_ROUTED: tl.constexpr, E_POW2: tl.constexpr, SHARED_SLOT: tl.constexpr,
                  SHARED_SEPARATE: tl.constexpr, SHARED_ONLY: tl.constexpr):
    """(expert, weight base, scale base, weight row stride, scale row stride, weight tile-row
    stride, scale tile-row stride, intermediate size) of this program's slot; expert -1 for an
    empty slot. A separate shared expert (SHARED_SEPARATE) reads its own tensors; SHARED_ONLY
    launches have one slot whose 'table' is that expert. Row strides are inside a tile for tiled
    layouts (whose tile-row strides the row layouts do not use)."""
    slot = tl.program_id(0)
    if SHARED_ONLY:
        expert = slot
    else:
        expert = slot_expert(ids_ptr, n_pairs, slot, NUM_ROUTED, E_POW2, SHARED_SLOT)
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
    return expert, w_base, s_base, row_w, row_s, tile_w, tile_s, inter_e


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


def aot_specs() -> list:
    """None of its own: these are helpers, compiled (and covered) through the kernels that call them."""
    return []
