"""The passes of an expert slot in the mma-layout expert kernels (moe_mma.py): which expert a program's
slot streams and for which (token, top-k column) pairs, from the step's ids in memory, its slot table
(expert_slots.build_slot_table) or, for a one-token step routed in-kernel, ids in registers
(expert_slots.routed_ids); the shared expert's slots, one per pass of 8 tokens; compacted passes.
"""

from __future__ import annotations

import os

import triton
import triton.language as tl

from .expert_slots import (chooser_count, chooser_tokens, columns_of, columns_of_ids, slot_expert, slot_expert_of,
                           slot_row_tokens)
from .mma_decode import TOKENS


@triton.jit
def pass_tokens(ids_ptr, ids, row_ptr, rank, n_tokens, expert, compact, NUM_ROUTED: tl.constexpr,
                TOPK: tl.constexpr, K_POW2: tl.constexpr, SHARED_ONLY: tl.constexpr, TABLE: tl.constexpr):
    """(token, top-k column) of each rank of the slot's passes: from the step's slot table (TABLE;
    row_ptr: the slot's row), or found from the step's ids (expert_slots.chooser_tokens, columns_of),
    in memory or, for a step routed in-kernel, in registers (``ids``: expert_slots.routed_ids)."""
    if TABLE:
        tok, col = slot_row_tokens(row_ptr, n_tokens, rank, expert == NUM_ROUTED, TOPK)
    else:
        if ids is None:
            tok = chooser_tokens(ids_ptr, n_tokens, expert, rank, compact, TOPK, K_POW2)
            col = columns_of(ids_ptr, tok, n_tokens, expert, NUM_ROUTED, TOPK, K_POW2, SHARED_ONLY)
        else:
            tok = tl.where(rank < n_tokens, rank, -1)
            col = columns_of_ids(ids, tok, n_tokens, expert, NUM_ROUTED, TOPK)
    return tok, col


@triton.jit
def token_groups(ids_ptr, ids, row_ptr, m0, g, n_tokens, expert, compact, NUM_ROUTED: tl.constexpr,
                 TOPK: tl.constexpr, K_POW2: tl.constexpr, SHARED_ONLY: tl.constexpr, TWO_GROUPS: tl.constexpr,
                 TABLE: tl.constexpr):
    """Which token groups of the pass at rank m0 (one, or two with TWO_GROUPS: ranks m0 and m0 + 8;
    ranks name tokens through expert_slots.chooser_tokens) chose ``expert``, g the lanes' rank in a
    group: (go: any did, both: two did, first: the rank offset of the first that did, tok_first /
    col_first: the lanes' tokens (-1: none) and top-k columns (-1 where a token did not choose it) in
    that group, tok_b / col_b: the same in the second)."""
    tok_a, col_a = pass_tokens(ids_ptr, ids, row_ptr, m0 + g, n_tokens, expert, compact, NUM_ROUTED, TOPK,
                               K_POW2, SHARED_ONLY, TABLE)
    any_a = tl.max(tl.max(col_a, axis=1), axis=0) >= 0
    if TWO_GROUPS:
        tok_b, col_b = pass_tokens(ids_ptr, ids, row_ptr, g + (m0 + TOKENS), n_tokens, expert, compact,
                                   NUM_ROUTED, TOPK, K_POW2, SHARED_ONLY, TABLE)
        any_b = tl.max(tl.max(col_b, axis=1), axis=0) >= 0
        go = any_a | any_b
        both = any_a & any_b
        first = tl.where(any_a, m0, m0 + TOKENS)
        tok_first = tl.where(any_a, tok_a, tok_b)
        col_first = tl.where(any_a, col_a, col_b)
    else:
        tok_b = tok_a
        col_b = col_a
        go = any_a
        both = False
        first = m0
        tok_first = tok_a
        col_first = col_a
    return go, both, first, tok_first, col_first, tok_b, col_b


@triton.jit
def slot_compacts(ids_ptr, n_tokens, expert, NUM_ROUTED: tl.constexpr, TOPK: tl.constexpr, K_POW2: tl.constexpr,
                  SHARED_ONLY: tl.constexpr, COMPACT: tl.constexpr):
    """(compact, ranks): whether the slot's passes take only the tokens that chose its expert (a
    routed expert in a step of more than one token group), and how many ranks its passes cover."""
    if COMPACT and not SHARED_ONLY:
        compact = (n_tokens > TOKENS) & (expert != NUM_ROUTED)
    else:
        compact = n_tokens < 0  # (never)
    ranks = n_tokens
    if compact:
        ranks = chooser_count(ids_ptr, n_tokens, expert, TOPK, K_POW2)
    return compact, ranks


@triton.jit
def shared_pass(shared_slots):
    """Which pass of the shared expert this program's slot makes: the grid's last ``shared_slots``
    slots are its (0 in launches without it), routed slots get a negative index."""
    return tl.program_id(0) - (tl.num_programs(0) - shared_slots)


@triton.jit
def program_slot(ids_ptr, ids, table_ptr, stride_table, n_tokens, n_pairs, shared_slots, NUM_ROUTED: tl.constexpr,
                 E_POW2: tl.constexpr, TOPK: tl.constexpr, K_POW2: tl.constexpr, SHARED_SLOT: tl.constexpr,
                 SHARED_ONLY: tl.constexpr, COMPACT: tl.constexpr, TABLE: tl.constexpr, PASS: tl.constexpr):
    """(expert, its slot table row, compact, first rank, end rank) of this program's slot: read from
    the step's slot table (TABLE: routed slots), or found from the step's ids (``slot_compacts``; a
    one-token step routed in-kernel: from its ``ids`` in registers, no compacted passes).

    The shared expert's slots (``shared_pass``; SHARED_ONLY launches have no other) have no row and
    take every token: slot p the ranks of pass p (PASS tokens; the last slot the rest), so its passes
    stream side by side, the programs of one row block adjacent in the launch order, reading each
    weight line at about the same time (one slot would stream its passes one after the other)."""
    pass_index = shared_pass(shared_slots)
    shared = pass_index >= 0
    if TABLE:
        row_ptr = table_ptr + tl.program_id(0) * stride_table
        expert = tl.where(shared, NUM_ROUTED, tl.load(row_ptr, mask=shared == 0, other=-1))
        ranks = tl.where(shared, n_tokens, tl.load(row_ptr + 1, mask=shared == 0, other=0))
        compact = n_tokens < 0  # (the rows name the passes' tokens)
    else:
        row_ptr = table_ptr  # (unused)
        if SHARED_ONLY:
            expert = tl.program_id(0) * 0  # (the launch's one-expert table)
        elif ids is None:
            expert = tl.where(shared, NUM_ROUTED, slot_expert(ids_ptr, n_pairs, tl.program_id(0), NUM_ROUTED, E_POW2,
                                                              False))
        else:
            expert = tl.where(shared, NUM_ROUTED, slot_expert_of(ids, tl.program_id(0), TOPK))
        if ids is None:
            compact, ranks = slot_compacts(ids_ptr, n_tokens, expert, NUM_ROUTED, TOPK, K_POW2, SHARED_ONLY, COMPACT)
        else:
            compact, ranks = n_tokens < 0, n_tokens
    first = tl.where(shared, pass_index * PASS, 0)
    ranks = tl.where(shared & (pass_index < shared_slots - 1), first + PASS, ranks)
    return expert, row_ptr, compact, first, ranks


def shared_passes(n_tokens: int, two_groups: bool) -> int:
    """The shared expert's slots in an n-token step: one per pass of 8 tokens (16 with two token
    groups a pass), unless MINIMAX_OPS_NO_SHARED_PASSES=1 (one slot streaming its passes in turn;
    read at every launch: A/B runs switch it between rounds of one process)."""
    if os.environ.get("MINIMAX_OPS_NO_SHARED_PASSES") == "1":
        return 1
    return max(1, triton.cdiv(n_tokens, (2 if two_groups else 1) * TOKENS.value))


def aot_specs() -> list:
    """None of its own: these are helpers, compiled (and covered) through moe_mma's kernels."""
    return []
