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

In steps of one-token requests, where ``scores_in_kernel`` says so (opt-in), the kernel also makes the
indexer's score pass (``qkv_norm_rope_insert_scores``): its grid is 1-D with the index segments' programs first
(linear_mma.group_and_split), each counting in (splitk.count_in) once its segment is inserted; every
later program, after its own GEMV, waits for those counts (splitk.wait_for: the programs it waits for
were launched before it, so they are resident or done) and scores its share of the index cache's blocks
(index_topk.score_share). One launch fewer, and the attention split that follows waits for this kernel,
not for a score kernel launched after its tail.

Where the one-kernel path does not apply (a weight not in an mma layout, a GEMV group that is not
one segment: NW * 16 != head_dim, a step of more than ONE_KERNEL_TOKENS tokens)
``qkv_norm_rope_insert`` runs the two kernels instead, with the same results. Off PTX (interpreter,
AMD) the emulated block product runs head_dim / 16 row blocks a program: its per-row arithmetic does
not depend on how many, so the bits still match mma_linear's.
"""

from __future__ import annotations

import dataclasses
import os

import torch
import triton
import triton.language as tl

from ..formats import FMT_MXFP8_MMA, MMA_K, MMA_ROWS
from .aot import KernelSpec
from .index_topk import check_index_inputs, index_scores, score_share
from .linear_mma import aligned_x, group_and_split, linear_tiles, mma_linear, mma_linear_program, split_buffers
from .mma_decode import TOKENS
from .mma_launch import mma_operands, preload_first, preloads, weights_evict_first
from .mx_decode import check_weight, pdl_supported
from .mx_linear import mx_linear
from .norm import check_rows
from .qk_norm_rope import (AOT_SHAPES, norm_rope_insert_segment, qk_norm_rope_insert, qkv_width, segment_constexprs,
                           segment_launch, segment_signature)
from .splitk import count_in, split_counters, wait_for
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
        PRELOAD: tl.constexpr, EVICT_FIRST: tl.constexpr = False,
        SCORE: tl.constexpr = False, DIAG: tl.constexpr = 0,
        block_table_ptr=None, seq_lens_ptr=None, scores_ptr=None, ready_ptr=None, stride_bt=0, stride_sn=0,
        stride_sh=0, num_reqs=0):
    """Grid (segment = group of NW row blocks, K split): the GEMV arguments as mma_linear_program's
    (out = qkv), then norm_rope_insert_segment's, SEG_TOKENS tokens of a segment at a time. SCORE: a 1-D
    grid, the index segments' programs first (``group_and_split``), which count in at ready_ptr once
    their segment is inserted; every later program then scores its share of the index cache's blocks
    (index_topk.score_share, the indexer's pass 1 for one-token requests) into scores_ptr."""
    IQ_SEG: tl.constexpr = NUM_HEADS + 2 * NUM_KV_HEADS
    LEAD: tl.constexpr = IQ_SEG if SCORE else -1
    seg, _ = group_and_split(SPLIT, LEAD)
    done = mma_linear_program(x_ptr, w_ptr, s_ptr, qkv_ptr, part_ptr, cnt_ptr, M, N, k_blocks, stride_xm, stride_wb,
                              stride_sb, stride_qkv, NW, DEPTH, SPLIT, SPLIT_POW2, PTX, PDL, PREFETCH, FP8, PRELOAD,
                              EVICT_FIRST=EVICT_FIRST, LEAD=LEAD)
    if done:
        tl.debug_barrier()  # the segment's columns, stored by all warps, read back by all
        for t0 in range(0, M, SEG_TOKENS):
            norm_rope_insert_segment(
                qkv_ptr, stride_qkv, seg, t0, M,
                pos_ptr, slot_ptr, index_slot_ptr, q_w_ptr, k_w_ptr, index_q_w_ptr, index_k_w_ptr,
                kv_ptr, index_cache_ptr, q_out_ptr, index_q_out_ptr,
                stride_kv_block, stride_kv_head, stride_kv_slot, stride_ic_block, stride_ic_slot,
                eps, base_hi, base_lo, inv_k_scale, inv_v_scale,
                NUM_HEADS, NUM_KV_HEADS, INDEX_HEADS, HEAD_DIM, ROT_DIM, BLOCK_SIZE, KV_FP8, INDEX_FP8, INTERPRETED,
                SEG_TOKENS)
        if SCORE:
            if seg >= IQ_SEG:  # index_q or the index key, stored: the score programs may read it
                count_in(ready_ptr)
    if SCORE:
        leading = (INDEX_HEADS + 1) * SPLIT
        share = tl.program_id(0) - leading
        if share >= 0:
            shares = tl.num_programs(0) - leading
            if DIAG & 2 == 0:
                wait_for(ready_ptr, INDEX_HEADS + 1, shares)
            if DIAG & 1 == 0:
                score_share(index_q_out_ptr, index_cache_ptr, block_table_ptr, seq_lens_ptr, scores_ptr, num_reqs,
                            share, shares, INDEX_HEADS * HEAD_DIM, HEAD_DIM, stride_ic_block, stride_ic_slot,
                            stride_bt, stride_sn, stride_sh, INDEX_HEADS, HEAD_DIM, BLOCK_SIZE)


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
    kw = _heads(num_heads, num_kv_heads, head_dim, rotary_dim, rope_theta, eps, index_heads, index_dim, k_scale,
                v_scale)
    q, index_q, _ = _run(h, qkv_weight, qkv_scale, (positions, slot_mapping, index_slot_mapping, q_norm, k_norm,
                                                    index_q_norm, index_k_norm, kv_cache, index_cache), kw, pdl, tiles)
    return q, index_q


def qkv_norm_rope_insert_scores(h: torch.Tensor, qkv_weight: torch.Tensor, qkv_scale: torch.Tensor | None,
                                positions: torch.Tensor, slot_mapping: torch.Tensor, index_slot_mapping: torch.Tensor,
                                q_norm: torch.Tensor, k_norm: torch.Tensor, index_q_norm: torch.Tensor,
                                index_k_norm: torch.Tensor, kv_cache: torch.Tensor, index_cache: torch.Tensor,
                                block_table: torch.Tensor, seq_lens: torch.Tensor, query_len: int, *, num_heads: int,
                                num_kv_heads: int, head_dim: int, rotary_dim: int, rope_theta: float, eps: float,
                                index_heads: int, index_dim: int, k_scale: float = 1.0, v_scale: float = 1.0,
                                pdl: bool = False, tiles: MmaLinearTiles | None = None
                                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, bool]:
    """``qkv_norm_rope_insert`` (a sparse layer's) followed by the indexer's score pass,
    ``index_topk.index_scores(index_q, index_cache, block_table, seq_lens, query_len)`` -> (q, index_q,
    scores, whether the qkv kernel made the scores), the same values. In one kernel where the one-kernel
    path runs, ``scores_in_kernel`` says so and the arrival counters exist: the qkv kernel's programs that
    do not hold an index segment score the index cache's blocks once the index segments are stored (no
    score launch, no wait on the GEMV's tail); otherwise the two launches (the score pass a programmatic
    dependent in one-token steps, as the fused layer launches it)."""
    kw = _heads(num_heads, num_kv_heads, head_dim, rotary_dim, rope_theta, eps, index_heads, index_dim, k_scale,
                v_scale)
    if index_heads <= 0:
        raise ValueError(f"index_heads: expected > 0 (a sparse layer's projection), got {index_heads}")
    score = (block_table, seq_lens, query_len)
    q, index_q, scores = _run(h, qkv_weight, qkv_scale, (positions, slot_mapping, index_slot_mapping, q_norm, k_norm,
                                                         index_q_norm, index_k_norm, kv_cache, index_cache), kw, pdl,
                              tiles, score)
    if scores is not None:
        return q, index_q, scores, True
    return q, index_q, index_scores(index_q, index_cache, block_table, seq_lens, query_len,
                                    pdl=pdl and h.shape[0] == 1), False


def _heads(num_heads, num_kv_heads, head_dim, rotary_dim, rope_theta, eps, index_heads, index_dim, k_scale, v_scale):
    """The insert's keyword arguments, as segment_launch and qk_norm_rope_insert take them."""
    return dict(num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim, rotary_dim=rotary_dim,
                rope_theta=rope_theta, eps=eps, index_heads=index_heads, index_dim=index_dim, k_scale=k_scale,
                v_scale=v_scale)


def scores_in_kernel(n_tokens: int, query_len: int) -> bool:
    """Whether the score pass runs in the qkv kernel (where the one-kernel path runs): steps of
    one-token requests where MINIMAX_OPS_SCORE_IN_QKV=1 (read at every call). Opt-in: it measured
    slower than the score kernel (BENCHMARKS.md, thirty-seventh session)."""
    return query_len == 1 and n_tokens <= ONE_KERNEL_TOKENS and os.environ.get("MINIMAX_OPS_SCORE_IN_QKV") == "1"


def _run(h, qkv_weight, qkv_scale, step: tuple, kw: dict, pdl: bool, tiles: MmaLinearTiles | None,
         score: tuple | None = None) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """The one kernel or the two (module docstring) -> (q, index_q, scores or None where the score pass
    did not run in the kernel). ``step``: the insert's tensors in qkv_norm_rope_insert's order; ``score``:
    (block_table, seq_lens, query_len) to score in the kernel where it can."""
    check_rows("h", h)
    m, k = h.shape
    lw = check_weight("qkv_weight", qkv_weight, qkv_scale, k, h.device)
    width = qkv_width(kw["num_heads"], kw["num_kv_heads"], kw["head_dim"], kw["index_heads"], kw["index_dim"])
    if lw.n != width:
        raise ValueError(f"qkv_weight: expected {width} output rows for these head counts, got {lw.n}")
    fp8 = lw.layout.code == FMT_MXFP8_MMA
    plan = one_kernel_tiles(lw.layout.mma, fp8, width, k, kw["head_dim"], h.device, tiles) \
        if m <= ONE_KERNEL_TOKENS else None
    if plan is None:  # the two kernels
        if tiles is not None and lw.layout.mma:
            qkv = mma_linear(h, qkv_weight, qkv_scale, lw.layout.code, torch.bfloat16, tiles=tiles, pdl=pdl)
        else:
            qkv = mx_linear(h, qkv_weight, qkv_scale, pdl=pdl)
        return (*qk_norm_rope_insert(qkv, *step, pdl=pdl, **kw), None)
    launch = segment_launch(m, h.device, *step, **kw)
    if m == 0:
        return launch.q, launch.index_q, None
    t, ptx = plan
    w, s = mma_operands("qkv_weight", qkv_weight, qkv_scale)
    x32 = aligned_x(h)
    qkv = torch.empty(m, width, dtype=torch.bfloat16, device=h.device)
    split, part, counters = split_buffers(h.device, launch.segments, t.split, m, width, qkv)
    pdl = pdl and pdl_supported(h.device)
    grid, scoring = (launch.segments, split), {}
    if score is not None:
        block_table, seq_lens, query_len = score
        check_index_inputs(launch.index_q, step[-1], block_table, seq_lens, query_len)
        ready = split_counters(h.device, launch.segments + 2)
        if ready is not None and scores_in_kernel(m, query_len):
            scores = torch.empty(m, kw["index_heads"], block_table.shape[1], dtype=torch.float32, device=h.device)
            grid = (launch.segments * split,)
            scoring = dict(SCORE=True, DIAG=int(os.environ.get("MINIMAX_OPS_SCORE_DIAG", "0")),
                           block_table_ptr=block_table, seq_lens_ptr=seq_lens, scores_ptr=scores,
                           ready_ptr=ready[launch.segments:], stride_bt=block_table.stride(0),
                           stride_sn=scores.stride(0), stride_sh=scores.stride(1), num_reqs=block_table.shape[0])
    _qkv_norm_rope_insert_kernel[grid](
        x32, w, s, qkv, part, counters if counters is not None else s, m, width, k // MMA_K,
        x32.stride(0), w.stride(0), s.stride(0), qkv.stride(0), *launch.args,
        NW=t.num_warps, DEPTH=t.depth, SPLIT=split, SPLIT_POW2=triton.next_power_of_2(split), PTX=ptx, PDL=pdl,
        PREFETCH=t.prefetch, FP8=fp8, **launch.constexprs, SEG_TOKENS=seg_tokens(m), PRELOAD=preload_first(m),
        EVICT_FIRST=weights_evict_first(ptx), **scoring, num_warps=t.num_warps,
        num_stages=1, launch_pdl=pdl, **register_cap(t))
    return launch.q, launch.index_q, scoring.get("scores_ptr")


# ---- ahead-of-time specs ---------------------------------------------------------------------------------

_GEMV_SIG = {"x_ptr": "*i32", "w_ptr": "*i32", "s_ptr": "*u8", "qkv_ptr": "*bf16", "part_ptr": "*fp32",
             "cnt_ptr": "*i32", "M": "i32", "N": "i32", "k_blocks": "i32", "stride_xm": "i32", "stride_wb": "i32",
             "stride_sb": "i32", "stride_qkv": "i32"}


_SCORE_SIG = {"block_table_ptr": "*i32", "seq_lens_ptr": "*i32", "scores_ptr": "*fp32", "ready_ptr": "*i32",
              "stride_bt": "i32", "stride_sn": "i32", "stride_sh": "i32", "num_reqs": "i32"}


def _spec(shape: tuple, k: int, fp8: bool, ptx: bool, pdl: bool, kv_t: str, idx_t: str | None,
          tokens: int, targets: tuple = (), score: bool = False) -> KernelSpec:
    heads, kv_heads, index_heads, dim = shape[:4]
    n = qkv_width(heads, kv_heads, dim, index_heads if idx_t else 0, dim)
    t = mma_linear_tiles(n, k, 132, fp8, warp_split=False)
    t = _segment_tiles(t if ptx else portable_mma_tiles(t), ptx, dim)
    assert t.num_warps * MMA_ROWS == dim, (shape, t)
    gemv = dict(NW=t.num_warps, DEPTH=t.depth, SPLIT=t.split, SPLIT_POW2=triton.next_power_of_2(t.split), PTX=ptx,
                PDL=pdl, PREFETCH=t.prefetch, FP8=fp8, PRELOAD=preloads(tokens), EVICT_FIRST=ptx)
    name = (f"qkv_norm_rope_insert_{'fp8' if fp8 else 'fp4'}_n{n}_k{k}{'_ptx' if ptx else ''}{'_pdl' if pdl else ''}"
            f"_s{t.split}_kv{kv_t[1:]}" + (f"_index{idx_t[1:]}" if idx_t else "") + f"_t{tokens}"
            + ("_score" if score else ""))
    scoring = dict(SCORE=True) if score else {}
    return KernelSpec(_qkv_norm_rope_insert_kernel,
                      {**_GEMV_SIG, **segment_signature(kv_t, idx_t or kv_t), **(_SCORE_SIG if score else {})},
                      {**gemv, **segment_constexprs(shape, kv_t, idx_t), "SEG_TOKENS": tokens, **scoring},
                      num_warps=t.num_warps, num_stages=1, targets=("cuda",) if ptx else targets, name=name,
                      max_registers=t.max_registers)


def aot_specs() -> list[KernelSpec]:
    """The real model (qkv + index 9856 x 6144, both formats, fp8 caches; one and ONE_KERNEL_TOKENS tokens),
    plain and as a PDL dependent, with the inline-PTX decode (CUDA: mma layouts are laid out only
    where it runs), plus its dense layers (9216 x 6144) and bf16 caches; the portable decode at the
    tiny preset's shape (K = 256: split) for AMD: MXFP4 with each pairing of cache types, MXFP8 (its
    emulated decode the slowest to compile; the epilogue is the same code) with one; for CUDA, where
    the mma layouts exist only with the PTX decode, the first of them alone (the portable code path
    compiled there once, as moe_mma's). The score pass in the kernel (``SCORE``): the real model's
    one-token-request steps (CUDA), and the tiny shape's portable form for AMD with each index cache type."""
    tiny, real = AOT_SHAPES
    fp8_t, bf16_t = "*fp8e4nv", "*bf16"
    specs = [_spec(real, 6144, fp8, True, pdl, fp8_t, fp8_t, tokens)
             for fp8 in (False, True) for pdl in (False, True) for tokens in (1, ONE_KERNEL_TOKENS)]
    specs += [_spec(real, 6144, True, True, True, fp8_t, None, ONE_KERNEL_TOKENS),
              _spec(real, 6144, True, True, True, bf16_t, bf16_t, ONE_KERNEL_TOKENS)]
    specs += [_spec(real, 6144, fp8, True, True, fp8_t, fp8_t, tokens, score=True)
              for fp8 in (False, True) for tokens in (1, ONE_KERNEL_TOKENS)]
    specs += [_spec(tiny, 256, False, False, False, kv_t, idx_t, 4, () if i == 0 else ("hip",))
              for i, (kv_t, idx_t) in enumerate(((bf16_t, fp8_t), (fp8_t, bf16_t), (fp8_t, None)))]
    specs += [_spec(tiny, 256, False, False, False, idx_t, idx_t, 1, ("hip",), score=True) for idx_t in (fp8_t, bf16_t)]
    specs.append(_spec(tiny, 256, True, False, False, bf16_t, fp8_t, 4, ("hip",)))
    return specs
