"""Sigmoid top-k router and the routed + shared SwiGLU-OAI experts of a MoE decode step.

route: ``_router_logits_kernel`` splits the fp32 gate GEMV [n, H] x [E, H]^T over (expert tile,
H split) so the 3 MB gate streams on every SM; ``_router_topk_kernel`` (one program per token) sums
the split partials in a fixed order, applies the sigmoid and picks the top-k of score + bias.

moe_experts streams each *distinct* chosen expert's weights once per step, with no host sync:
- Slots: slot s of a launch is the s-th smallest expert id present in topk_ids, found in-kernel by
  every program from the <= n*k ids (a [E, 64] comparison per 64 ids); slots past the number of
  distinct experts exit at once. The grid has min(E, n*k) (+1 for a shared expert kept in the
  table, which takes the slot after the last routed one) slots, known on the host from shapes.
- ``_moe_w13_kernel`` (slot, I tile): one tile of interleaved gate/up rows times all tokens of the
  step (16-row tl.dot tiles; rows of tokens that did not choose the expert are masked off the x
  loads) -> SwiGLU-OAI -> bf16 intermediate a[token, top-k column, I], stored for choosing
  tokens only (the shared expert's column is k).
- ``_moe_w2_kernel`` (slot, H tile): a @ W2^T for the choosing tokens, written fp32 to
  y[token, top-k column, H]. a and y have one row per (token, column) pair: O(n*k) memory.
- ``_moe_combine_kernel`` (token, H tile): out = y_shared + sum_j w_j * y_j in a fixed order, so
  the result is deterministic (no float atomics). Ids outside [0, num_routed) contribute nothing.
A shared expert given separately (its own format) runs through the same two kernels in
SHARED_ONLY mode (one slot, every token). The weight decode and K loop are mx_linear's.
"""

from __future__ import annotations

import dataclasses

import torch
import triton
import triton.language as tl

from ..constants import MX_BLOCK
from .aot import KernelSpec
from .mx_linear import (_POINTER_TYPES, FMT_BF16, FMT_MXFP4, FMT_MXFP4_PREPARED, FMT_MXFP8, FORMAT_NAMES,
                        _stream_rows, as_kernel_operand, block_k_for, check_scale, in_features, kernel_format,
                        mxfp4_ptx, num_sms)

PAIR_BLOCK = tl.constexpr(64)  # top-k ids compared per step when finding a slot's expert
TOKEN_BLOCK = 16  # token rows per tl.dot tile (a step's tokens, padded)


# ---- router ----------------------------------------------------------------------------------------------


@triton.jit
def _router_logits_kernel(h_ptr, g_ptr, part_ptr, n_tokens, n_experts, iters_per_split,
                          stride_hm, stride_ge, stride_psplit,
                          BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_H: tl.constexpr):
    """Grid (expert tiles, H splits): part[split, t, e] = sum over the split's H of h[t] * gate[e]."""
    pid_e = tl.program_id(0)
    pid_s = tl.program_id(1)
    offs_e = pid_e * BLOCK_E + tl.arange(0, BLOCK_E)
    rows = tl.minimum(offs_e, n_experts - 1).to(tl.int64)
    k0 = pid_s * iters_per_split * BLOCK_H
    offs_k = k0 + tl.arange(0, BLOCK_H)
    for t0 in range(0, n_tokens, BLOCK_T):
        offs_t = t0 + tl.arange(0, BLOCK_T)
        t_mask = offs_t < n_tokens
        x_ptrs = h_ptr + offs_t.to(tl.int64)[:, None] * stride_hm + offs_k[None, :]
        g_ptrs = g_ptr + rows[:, None] * stride_ge + offs_k[None, :]
        acc = tl.zeros([BLOCK_T, BLOCK_E], dtype=tl.float32)
        for _ in range(iters_per_split):
            x = tl.load(x_ptrs, mask=t_mask[:, None], other=0.0).to(tl.float32)
            acc = tl.dot(x, tl.trans(tl.load(g_ptrs)), acc, input_precision="ieee")  # fp32 logits, no tf32
            x_ptrs += BLOCK_H
            g_ptrs += BLOCK_H
        out = part_ptr + pid_s * stride_psplit + offs_t[:, None] * n_experts + offs_e[None, :]
        tl.store(out, acc, mask=t_mask[:, None] & (offs_e[None, :] < n_experts))


@triton.jit
def _router_topk_kernel(part_ptr, bias_ptr, weights_ptr, ids_ptr, n_tokens, n_experts, n_split, stride_psplit,
                        scaling, HAS_BIAS: tl.constexpr, E_POW2: tl.constexpr, TOPK: tl.constexpr,
                        K_POW2: tl.constexpr):
    """One program per token: ids = top-k of sigmoid(logit) + bias (descending; ties to the lower
    id), weights = the chosen sigmoid scores renormalised to sum to `scaling`."""
    t = tl.program_id(0)
    offs_e = tl.arange(0, E_POW2)
    e_mask = offs_e < n_experts
    logits = tl.zeros([E_POW2], dtype=tl.float32)
    for s in range(n_split):
        logits += tl.load(part_ptr + s * stride_psplit + t * n_experts + offs_e, mask=e_mask, other=0.0)
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


# ---- experts ---------------------------------------------------------------------------------------------


@triton.jit
def _slot_expert(ids_ptr, n_pairs, slot, NUM_ROUTED: tl.constexpr, E_POW2: tl.constexpr,
                 FUSED_SHARED: tl.constexpr):
    """The slot-th smallest routed expert id present in ids[0:n_pairs]; with FUSED_SHARED the slot
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
    if FUSED_SHARED:
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
def _swiglu_oai(gate, up, alpha, limit):
    g = tl.minimum(gate, limit)
    u = tl.minimum(tl.maximum(up, -limit), limit)
    return g * tl.sigmoid(alpha * g) * (u + 1.0)


@triton.jit
def _moe_w13_kernel(h_ptr, ids_ptr, w_ptr, s_ptr, a_ptr,
                    n_tokens, n_pairs, inter, n_iters,
                    stride_hm, stride_we, stride_wn, stride_se, stride_sn, stride_am, stride_acol,
                    alpha, limit,
                    NUM_ROUTED: tl.constexpr, E_POW2: tl.constexpr, TOPK: tl.constexpr, K_POW2: tl.constexpr,
                    FUSED_SHARED: tl.constexpr, SHARED_ONLY: tl.constexpr, FMT: tl.constexpr,
                    BLOCK_M: tl.constexpr, BLOCK_I: tl.constexpr, BLOCK_K: tl.constexpr,
                    SWAP_AB: tl.constexpr, DOT_FP32: tl.constexpr, PTX: tl.constexpr):
    """Grid (slot, I tile): a[t, column, i] = swiglu_oai(h[t] W_gate[i]^T, h[t] W_up[i]^T) (bf16)
    for the tokens t that chose the slot's expert in top-k column `column` (k: shared expert)."""
    slot = tl.program_id(0)
    if SHARED_ONLY:
        expert = slot  # the one-slot grid of a separate shared expert: its [1, 2I, H] table
    else:
        expert = _slot_expert(ids_ptr, n_pairs, slot, NUM_ROUTED, E_POW2, FUSED_SHARED)
    if expert >= 0:
        # Gate row i and up row I + i side by side: one [BLOCK_M, 2*BLOCK_I] product, split at the end.
        r = tl.arange(0, 2 * BLOCK_I)
        offs_i = tl.program_id(1) * BLOCK_I + tl.arange(0, BLOCK_I)
        rows = (tl.minimum(tl.program_id(1) * BLOCK_I + r // 2, inter - 1) + (r % 2) * inter).to(tl.int64)
        w_rows = w_ptr + expert.to(tl.int64) * stride_we + rows * stride_wn
        s_rows = s_ptr + expert.to(tl.int64) * stride_se + rows * stride_sn
        for m0 in range(0, n_tokens, BLOCK_M):
            offs_m, col = _token_columns(ids_ptr, n_tokens, m0, expert, NUM_ROUTED, TOPK, K_POW2, BLOCK_M,
                                         SHARED_ONLY)
            chosen = col >= 0
            if tl.max(chosen.to(tl.int32), axis=0) > 0:
                acc = _stream_rows(h_ptr + offs_m.to(tl.int64) * stride_hm, chosen, w_rows, s_rows, 0, n_iters,
                                   FMT, BLOCK_M, 2 * BLOCK_I, BLOCK_K, SWAP_AB, DOT_FP32, PTX)
                gate, up = tl.split(tl.reshape(acc, [BLOCK_M, BLOCK_I, 2]))
                a = _swiglu_oai(gate, up, alpha, limit)
                a_ptrs = (a_ptr + offs_m.to(tl.int64)[:, None] * stride_am + col[:, None] * stride_acol
                          + offs_i[None, :])
                tl.store(a_ptrs, a.to(a_ptr.dtype.element_ty), mask=chosen[:, None] & (offs_i[None, :] < inter))


@triton.jit
def _moe_w2_kernel(a_ptr, ids_ptr, w_ptr, s_ptr, y_ptr,
                   n_tokens, n_pairs, hidden, n_iters,
                   stride_am, stride_acol, stride_we, stride_wn, stride_se, stride_sn, stride_ym, stride_ycol,
                   NUM_ROUTED: tl.constexpr, E_POW2: tl.constexpr, TOPK: tl.constexpr, K_POW2: tl.constexpr,
                   FUSED_SHARED: tl.constexpr, SHARED_ONLY: tl.constexpr, FMT: tl.constexpr,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                   SWAP_AB: tl.constexpr, DOT_FP32: tl.constexpr, PTX: tl.constexpr):
    """Grid (slot, H tile): y[t, column, h] = a[t, column] W2[h]^T (fp32) for the tokens that chose it."""
    slot = tl.program_id(0)
    if SHARED_ONLY:
        expert = slot
    else:
        expert = _slot_expert(ids_ptr, n_pairs, slot, NUM_ROUTED, E_POW2, FUSED_SHARED)
    if expert >= 0:
        offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        rows = tl.minimum(offs_n, hidden - 1).to(tl.int64)
        w_rows = w_ptr + expert.to(tl.int64) * stride_we + rows * stride_wn
        s_rows = s_ptr + expert.to(tl.int64) * stride_se + rows * stride_sn
        for m0 in range(0, n_tokens, BLOCK_M):
            offs_m, col = _token_columns(ids_ptr, n_tokens, m0, expert, NUM_ROUTED, TOPK, K_POW2, BLOCK_M,
                                         SHARED_ONLY)
            chosen = col >= 0
            if tl.max(chosen.to(tl.int32), axis=0) > 0:
                x_rows = a_ptr + offs_m.to(tl.int64) * stride_am + col * stride_acol  # masked where col < 0
                acc = _stream_rows(x_rows, chosen, w_rows, s_rows, 0, n_iters,
                                   FMT, BLOCK_M, BLOCK_N, BLOCK_K, SWAP_AB, DOT_FP32, PTX)
                y_ptrs = (y_ptr + offs_m.to(tl.int64)[:, None] * stride_ym + col[:, None] * stride_ycol
                          + offs_n[None, :])
                tl.store(y_ptrs, acc, mask=chosen[:, None] & (offs_n[None, :] < hidden))


@triton.jit
def _moe_combine_kernel(y_ptr, topk_weights_ptr, ids_ptr, out_ptr, hidden, stride_ym, stride_ycol, stride_om,
                        NUM_ROUTED: tl.constexpr, TOPK: tl.constexpr, HAS_SHARED: tl.constexpr,
                        BLOCK_H: tl.constexpr):
    """Grid (token, H tile): out = y[shared] + sum over j = 0..k-1 of w_j * y[j], in that order."""
    t = tl.program_id(0).to(tl.int64)
    offs_h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    h_mask = offs_h < hidden
    y_row = y_ptr + t * stride_ym + offs_h
    if HAS_SHARED:
        acc = tl.load(y_row + TOPK * stride_ycol, mask=h_mask, other=0.0)
    else:
        acc = tl.zeros([BLOCK_H], dtype=tl.float32)
    for j in tl.static_range(TOPK):
        expert = tl.load(ids_ptr + t * TOPK + j)
        ok = (expert >= 0) & (expert < NUM_ROUTED)  # y rows of invalid ids were never written
        y = tl.load(y_row + j * stride_ycol, mask=h_mask & ok, other=0.0)
        acc += tl.where(ok, tl.load(topk_weights_ptr + t * TOPK + j), 0.0) * y
    tl.store(out_ptr + t * stride_om + offs_h, acc.to(out_ptr.dtype.element_ty), mask=h_mask)


# ---- tile heuristic --------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class ExpertTiles:
    block_n: int  # w13: gate rows per program (and as many up rows); w2: output rows per program
    block_k: int
    num_warps: int = 4
    num_stages: int = 3
    swap_ab: bool = True


# Per format: (w13 gate rows, w2 rows, largest BLOCK_K, stages): 64-128 weight rows per program as
# in mx_linear's _TILES (fewer rows per warp cost more SASS per value). A 1-token step has 5
# experts, so e.g. MXFP4 runs 5 x I/64 = 240 w13 and 5 x H/128 = 240 w2 programs (2 per SM).
_EXPERT_TILES = {FMT_BF16: (32, 64, 128, 4), FMT_MXFP8: (32, 64, 256, 3), FMT_MXFP4: (64, 128, 256, 3),
                 FMT_MXFP4_PREPARED: (64, 128, 256, 3)}
COMBINE_BLOCK = 1024


def expert_tiles(fmt: int, k: int, rows_total: int, slots: int, w13: bool, sms: int) -> ExpertTiles:
    """Tiles of one expert launch over `slots` experts of `rows_total` weight rows (w13: 2I).
    A launch with too few programs for every SM to stream (a separate shared expert: one slot)
    halves its rows, and warps with them (2 warps on 32 rows measure ~5.7 SASS per fp8 value
    against 5.3 for 4 warps on 64: 16 rows per warp keep the MMA shapes whole)."""
    rows_13, rows_2, cap_k, stages = _EXPERT_TILES[fmt]
    rows = 2 * rows_13 if w13 else rows_2  # weight rows per program
    while rows > 32 and slots * triton.cdiv(rows_total, rows) < sms:
        rows //= 2
    return ExpertTiles(rows // 2 if w13 else rows, block_k_for(k, cap_k), num_warps=4 if rows >= 64 else 2,
                       num_stages=stages)


def router_split(n_experts: int, hidden: int, sms: int) -> tuple[int, int, int, int]:
    """(BLOCK_E, BLOCK_H, iters per split, splits) for the router GEMV: ~2 programs per SM."""
    block_e = 16
    block_h = block_k_for(hidden, 128)
    iters = hidden // block_h
    tiles = triton.cdiv(n_experts, block_e)
    options = [d for d in range(1, iters + 1) if iters % d == 0]
    split = next((d for d in options if tiles * d >= 2 * sms), options[-1])
    return block_e, block_h, iters // split, split


# ---- wrappers --------------------------------------------------------------------------------------------


def _check_activation(name: str, t: torch.Tensor) -> None:
    if t.dim() != 2 or t.dtype != torch.bfloat16 or t.stride(1) != 1:
        raise ValueError(f"{name}: expected a bf16 [n, H] tensor with contiguous rows, got "
                         f"{t.dtype} shape {tuple(t.shape)} strides {tuple(t.stride())}")


def route(h: torch.Tensor, gate_weight: torch.Tensor, bias: torch.Tensor | None, top_k: int,
          scaling: float) -> tuple[torch.Tensor, torch.Tensor]:
    """logits = fp32(h) @ gate^T; s = sigmoid; ids = top-k of s + bias (descending); weights =
    s[ids] / sum(s[ids]) * scaling. Returns (weights fp32 [n, k], ids int32 [n, k])."""
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
    block_e, block_h, iters, split = router_split(n_experts, hidden, num_sms(h.device))
    part = torch.empty(split, n, n_experts, dtype=torch.float32, device=h.device)
    _router_logits_kernel[(triton.cdiv(n_experts, block_e), split)](
        h, gate_weight, part, n, n_experts, iters, h.stride(0), gate_weight.stride(0), n * n_experts,
        BLOCK_T=TOKEN_BLOCK, BLOCK_E=block_e, BLOCK_H=block_h, num_warps=4)
    bias_arg = bias.contiguous() if bias is not None else part
    _router_topk_kernel[(n,)](
        part, bias_arg, weights, ids, n, n_experts, split, n * n_experts, float(scaling),
        HAS_BIAS=bias is not None, E_POW2=triton.next_power_of_2(n_experts), TOPK=top_k,
        K_POW2=triton.next_power_of_2(top_k), num_warps=4)
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


def _launch_experts(h, ids, w13, s13, fmt13, w2, s2, fmt2, a, y, *, slots, n_routed, fused_shared, shared_only,
                    alpha, limit):
    n, hidden = h.shape
    top_k = ids.shape[1]
    inter = in_features(w2, fmt2)
    sms = num_sms(h.device)
    common = dict(NUM_ROUTED=n_routed, E_POW2=triton.next_power_of_2(max(n_routed, 1)), TOPK=top_k,
                  K_POW2=triton.next_power_of_2(top_k), FUSED_SHARED=fused_shared, SHARED_ONLY=shared_only,
                  BLOCK_M=TOKEN_BLOCK, DOT_FP32=h.device.type != "cuda")
    t13 = expert_tiles(fmt13, hidden, 2 * inter, slots, True, sms)
    ptx13 = mxfp4_ptx(fmt13, None, h.device)
    w13k = as_kernel_operand(w13, fmt13, "w13", ptx13)
    s13 = s13 if s13 is not None else w13k
    _moe_w13_kernel[(slots, triton.cdiv(inter, t13.block_n))](
        h, ids, w13k, s13, a, n, n * top_k, inter, hidden // t13.block_k,
        h.stride(0), w13k.stride(0), w13k.stride(1), s13.stride(0), s13.stride(1), a.stride(0), a.stride(1),
        float(alpha), float(limit), FMT=fmt13, BLOCK_I=t13.block_n, BLOCK_K=t13.block_k, SWAP_AB=t13.swap_ab,
        PTX=ptx13, num_warps=t13.num_warps, num_stages=t13.num_stages, **common)
    t2 = expert_tiles(fmt2, inter, hidden, slots, False, sms)
    ptx2 = mxfp4_ptx(fmt2, None, h.device)
    w2k = as_kernel_operand(w2, fmt2, "w2", ptx2)
    s2 = s2 if s2 is not None else w2k
    _moe_w2_kernel[(slots, triton.cdiv(hidden, t2.block_n))](
        a, ids, w2k, s2, y, n, n * top_k, hidden, inter // t2.block_k,
        a.stride(0), a.stride(1), w2k.stride(0), w2k.stride(1), s2.stride(0), s2.stride(1), y.stride(0), y.stride(1),
        FMT=fmt2, BLOCK_N=t2.block_n, BLOCK_K=t2.block_k, SWAP_AB=t2.swap_ab, PTX=ptx2,
        num_warps=t2.num_warps, num_stages=t2.num_stages, **common)


def moe_experts(h: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                w13: torch.Tensor, w13_scale: torch.Tensor | None, w2: torch.Tensor, w2_scale: torch.Tensor | None,
                shared_w13: torch.Tensor | None = None, shared_w13_scale: torch.Tensor | None = None,
                shared_w2: torch.Tensor | None = None, shared_w2_scale: torch.Tensor | None = None, *,
                num_routed_experts: int, alpha: float = 1.702, limit: float = 7.0) -> torch.Tensor:
    """out [n, H] bf16 = shared(h) + sum_j topk_weights[:, j] * expert_{topk_ids[:, j]}(h).

    w13 [E', 2I, H] (gate rows then up rows) and w2 [E', H, I]: bf16, MXFP8, MXFP4 or MXFP4 kernel
    layout (``mx_linear.prepare_weight``), scales [E', rows, K/32]. The shared expert is the table's
    expert num_routed_experts (E' = num_routed + 1), or shared_w13 [2Is, H] / shared_w2 [H, Is] in
    their own formats, or absent. Ids outside [0, num_routed_experts) are ignored."""
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
    fmt2, w2, w2_scale = _expert_table("w2", w2, w2_scale, experts, hidden, two_inter // 2)
    separate = shared_w13 is not None
    if experts not in (num_routed_experts, num_routed_experts + 1) or (separate and experts != num_routed_experts):
        raise ValueError(f"w13: expected {num_routed_experts} experts (+1 if the shared expert is in the table "
                         f"and not given separately), got {experts}")
    if separate != (shared_w2 is not None):
        raise ValueError("shared_w13 / shared_w2: expected both or neither")
    fused = experts == num_routed_experts + 1
    out = torch.empty(n, hidden, dtype=torch.bfloat16, device=h.device)
    if n == 0:
        return out
    y = torch.empty(n, top_k + int(fused or separate), hidden, dtype=torch.float32, device=h.device)
    slots = min(num_routed_experts, n * top_k) + int(fused)
    # One row per (token, top-k column): only chosen pairs are written and read.
    a = torch.empty(n, y.shape[1], two_inter // 2, dtype=torch.bfloat16, device=h.device)
    _launch_experts(h, ids, w13, w13_scale, fmt13, w2, w2_scale, fmt2, a, y, slots=slots,
                    n_routed=num_routed_experts, fused_shared=fused, shared_only=False, alpha=alpha, limit=limit)
    if separate:
        sfmt13, sw13, ss13 = _expert_table("shared_w13", shared_w13, shared_w13_scale, 1, None, hidden)
        if sw13.shape[1] % 2:
            raise ValueError(f"shared_w13: expected 2*Is rows, got {sw13.shape[1]}")
        sfmt2, sw2, ss2 = _expert_table("shared_w2", shared_w2, shared_w2_scale, 1, hidden, sw13.shape[1] // 2)
        a_shared = torch.empty(n, y.shape[1], sw13.shape[1] // 2, dtype=torch.bfloat16, device=h.device)
        _launch_experts(h, ids, sw13, ss13, sfmt13, sw2, ss2, sfmt2, a_shared, y, slots=1,
                        n_routed=num_routed_experts, fused_shared=False, shared_only=True, alpha=alpha, limit=limit)
    _moe_combine_kernel[(n, triton.cdiv(hidden, COMBINE_BLOCK))](
        y, topk_weights, ids, out, hidden, y.stride(0), y.stride(1), out.stride(0),
        NUM_ROUTED=num_routed_experts, TOPK=top_k, HAS_SHARED=fused or separate, BLOCK_H=COMBINE_BLOCK, num_warps=4)
    return out


# ---- ahead-of-time specs ---------------------------------------------------------------------------------

# (H, I, routed experts, top-k): the tiny preset and the real model.
AOT_SIZES = [(64, 32, 8, 2), (6144, 3072, 128, 4)]
_MODES = {"fused": (True, False), "shared": (False, True), "routed": (False, False)}  # (FUSED_SHARED, SHARED_ONLY)


def _expert_specs(hidden: int, inter: int, n_routed: int, top_k: int, fmt: int, mode: str,
                  ptx: bool) -> list[KernelSpec]:
    fused, shared_only = _MODES[mode]
    common = {"NUM_ROUTED": n_routed, "E_POW2": triton.next_power_of_2(n_routed), "TOPK": top_k,
              "K_POW2": triton.next_power_of_2(top_k), "FUSED_SHARED": fused, "SHARED_ONLY": shared_only,
              "FMT": fmt, "BLOCK_M": TOKEN_BLOCK, "DOT_FP32": False, "PTX": ptx}
    label = f"{FORMAT_NAMES[fmt]}{'_ptx' if ptx else ''}_h{hidden}_{mode}"
    w_ptr = "*u8" if ptx else _POINTER_TYPES[fmt]
    s_ptr = "*u8" if fmt != FMT_BF16 else w_ptr
    slots = 1 if shared_only else min(n_routed, top_k) + fused  # as launched for a 1-token step
    t13 = expert_tiles(fmt, hidden, 2 * inter, slots, True, 132)
    t2 = expert_tiles(fmt, inter, hidden, slots, False, 132)
    return [
        KernelSpec(_moe_w13_kernel,
                   {"h_ptr": "*bf16", "ids_ptr": "*i32", "w_ptr": w_ptr, "s_ptr": s_ptr, "a_ptr": "*bf16",
                    "n_tokens": "i32", "n_pairs": "i32", "inter": "i32", "n_iters": "i32", "stride_hm": "i32",
                    "stride_we": "i32", "stride_wn": "i32", "stride_se": "i32", "stride_sn": "i32",
                    "stride_am": "i32", "stride_acol": "i32", "alpha": "fp32", "limit": "fp32"},
                   dict(common, BLOCK_I=t13.block_n, BLOCK_K=t13.block_k, SWAP_AB=t13.swap_ab),
                   num_warps=t13.num_warps, num_stages=t13.num_stages, name=f"moe_w13_{label}"),
        KernelSpec(_moe_w2_kernel,
                   {"a_ptr": "*bf16", "ids_ptr": "*i32", "w_ptr": w_ptr, "s_ptr": s_ptr, "y_ptr": "*fp32",
                    "n_tokens": "i32", "n_pairs": "i32", "hidden": "i32", "n_iters": "i32", "stride_am": "i32",
                    "stride_acol": "i32", "stride_we": "i32", "stride_wn": "i32", "stride_se": "i32",
                    "stride_sn": "i32", "stride_ym": "i32", "stride_ycol": "i32"},
                   dict(common, BLOCK_N=t2.block_n, BLOCK_K=t2.block_k, SWAP_AB=t2.swap_ab),
                   num_warps=t2.num_warps, num_stages=t2.num_stages, name=f"moe_w2_{label}")]


def aot_specs() -> list[KernelSpec]:
    """Portable specialisations: router and combine at both sizes; the expert kernels in every
    format and shared-expert mode at the real size, fused-shared at the tiny one. The CUDA-only
    MXFP4 PTX ones are in ``aot_specs_cuda``."""
    specs = []
    for hidden, inter, n_routed, top_k in AOT_SIZES:
        size = f"h{hidden}"
        block_e, block_h, _, _ = router_split(n_routed, hidden, 132)
        specs.append(KernelSpec(
            _router_logits_kernel,
            {"h_ptr": "*bf16", "g_ptr": "*fp32", "part_ptr": "*fp32", "n_tokens": "i32", "n_experts": "i32",
             "iters_per_split": "i32", "stride_hm": "i32", "stride_ge": "i32", "stride_psplit": "i32"},
            {"BLOCK_T": TOKEN_BLOCK, "BLOCK_E": block_e, "BLOCK_H": block_h}, name=f"router_logits_{size}"))
        for has_bias in (True, False):
            specs.append(KernelSpec(
                _router_topk_kernel,
                {"part_ptr": "*fp32", "bias_ptr": "*fp32", "weights_ptr": "*fp32", "ids_ptr": "*i32",
                 "n_tokens": "i32", "n_experts": "i32", "n_split": "i32", "stride_psplit": "i32", "scaling": "fp32"},
                {"HAS_BIAS": has_bias, "E_POW2": triton.next_power_of_2(n_routed), "TOPK": top_k,
                 "K_POW2": triton.next_power_of_2(top_k)}, name=f"router_topk_{size}_bias{int(has_bias)}"))
        for has_shared in (True, False):
            specs.append(KernelSpec(
                _moe_combine_kernel,
                {"y_ptr": "*fp32", "topk_weights_ptr": "*fp32", "ids_ptr": "*i32", "out_ptr": "*bf16",
                 "hidden": "i32", "stride_ym": "i32", "stride_ycol": "i32", "stride_om": "i32"},
                {"NUM_ROUTED": n_routed, "TOPK": top_k, "HAS_SHARED": has_shared, "BLOCK_H": COMBINE_BLOCK},
                name=f"moe_combine_{size}_shared{int(has_shared)}"))
        modes = ("fused",) if hidden == AOT_SIZES[0][0] else tuple(_MODES)
        for fmt in (FMT_BF16, FMT_MXFP8, FMT_MXFP4, FMT_MXFP4_PREPARED):
            for mode in modes:
                specs += _expert_specs(hidden, inter, n_routed, top_k, fmt, mode, ptx=False)
    return specs


def aot_specs_cuda() -> list[KernelSpec]:
    """MXFP4 inline-PTX expert kernels (real size, every shared-expert mode): cuda sm_90 only."""
    hidden, inter, n_routed, top_k = AOT_SIZES[-1]
    return [spec for fmt in (FMT_MXFP4, FMT_MXFP4_PREPARED) for mode in _MODES
            for spec in _expert_specs(hidden, inter, n_routed, top_k, fmt, mode, ptx=True)]
