"""Lightning indexer: per token and index head, the top-k logical KV blocks by block score
S[b] = max over cached positions p < kv_len in block b of dot(index_q, index_k[p]).

Two passes:
1. ``_index_score_kernel``, grid (request, split): each program scores a contiguous run of one
   request's blocks for all its query tokens and index heads at once ([query_len * Hi, Di] x
   [Di, block] tl.dot), so every index key is read from memory once per request. Runs are sized from
   the request's real length in-kernel (no host sync), the grid from the table width. As a
   programmatic dependent a program reads its first block's keys before it waits, where that block
   holds no key of this step.
   Scores go to an fp32 scratch [n, Hi, W]. fp8 keys meet q in fp16 (``F16``), bf16 keys in bf16.
2. ``_index_topk_kernel``, one program per (token, head): ``select_blocks_row`` packs (score, block)
   into one sortable int64 (``topk_keys``) and keeps the best k with tl.topk. The local block (nb - 1)
   gets the largest key, so it is always chosen first. tl.topk's cost follows its width, not nb: a row
   of up to SHORT (TOPK_CHUNK) blocks takes one SHORT-wide tl.topk; a longer row is cut into groups of
   SHORT / k blocks, the k groups of the largest maxima are kept, and one SHORT-wide tl.topk selects
   among their blocks (the same k keys as a tl.topk as wide as the row, for a fraction of its cost:
   BENCHMARKS.md, twenty-first session).

``index_topk`` runs both passes (the vocabulary op). ``index_scores`` runs pass 1 alone: the fused
decode layer's sparse attention (kernels/attention.py, ``index_sparse_attention_decode``) makes the
selection of pass 2 itself, with the same ``select_blocks_row`` (one source of truth for the choice),
so pass 2's kernel and its block ids' round trip through memory drop out.
"""

from __future__ import annotations

import os
from dataclasses import replace

import torch
import triton
import triton.language as tl

from .aot import KernelSpec, with_pdl_variants
from .mx_decode import gdc_launch_dependents, gdc_wait, pdl_supported
from .tiles import num_sms

TOPK_CHUNK = 256  # pass 2: rows of up to this many blocks take one tl.topk this wide; longer rows go by groups
GROUP_SLICES = 16  # ... of which a slice of GROUP_SLICES x TOPK_CHUNK blocks is read at a time
_INTERPRETER_PROGRAMS = 8  # keeps interpreted grids small while still exercising several splits


@triton.jit
def _block_keys(cache_ptr, block_table_ptr, req, b, seq_len, stride_cb, stride_cs, stride_bt, offs, d, load,
                F16: tl.constexpr, DOT_FP32: tl.constexpr):
    """The index keys of the request's logical block b ([BLOCK_SIZE, Di], zeros past seq_len or where
    ``load`` is false), as the score tl.dot takes them (F16: fp8 keys widened to fp16, see the kernel)."""
    page = tl.load(block_table_ptr + req * stride_bt + b, mask=load, other=0).to(tl.int64)
    pos = b * offs.shape[0] + offs
    keys = tl.load(cache_ptr + page * stride_cb + offs[:, None] * stride_cs + d[None, :],
                   mask=((pos < seq_len) & load)[:, None], other=0.0)
    return keys.to(tl.float32) if DOT_FP32 else keys.to(tl.float16) if F16 else keys.to(tl.bfloat16)


@triton.jit
def _store_block_score(q, keys, b, kv_len, score_ptrs, row_ok, offs, BLOCK_SIZE: tl.constexpr):
    """Block b's score of every (token, head) row: the max over its causal positions of q . key."""
    s = tl.dot(q, tl.trans(keys))  # [BLOCK_M, BLOCK_SIZE] fp32
    s = tl.where((b * BLOCK_SIZE + offs)[None, :] < kv_len[:, None], s, float("-inf"))
    tl.store(score_ptrs + b, tl.max(s, axis=1), mask=row_ok)


@triton.jit
def _index_score_kernel(q_ptr, cache_ptr, block_table_ptr, seq_lens_ptr, scores_ptr,
                        stride_qn, stride_qh, stride_cb, stride_cs, stride_bt, stride_sn, stride_sh,
                        num_splits,
                        QUERY_LEN: tl.constexpr, INDEX_HEADS: tl.constexpr, INDEX_DIM: tl.constexpr,
                        BLOCK_SIZE: tl.constexpr, BLOCK_M: tl.constexpr, F16: tl.constexpr, DOT_FP32: tl.constexpr,
                        PDL: tl.constexpr, EARLY: tl.constexpr = True):
    req = tl.program_id(0)
    split = tl.program_id(1)
    seq_len = tl.load(seq_lens_ptr + req)
    nb = tl.cdiv(tl.maximum(seq_len, 0), BLOCK_SIZE)  # blocks of the request's last token
    per_split = tl.cdiv(nb, num_splits)
    b_start = split * per_split
    b_end = tl.minimum(b_start + per_split, nb)
    offs = tl.arange(0, BLOCK_SIZE)
    d = tl.arange(0, INDEX_DIM)
    # A block older than this step's tokens is not written by the previous kernel (which inserts only
    # the step's keys): as a programmatic dependent, the first such block's keys are read before the wait
    # (EARLY; the [BLOCK_SIZE, Di] tile it holds across the wait costs shared memory and registers).
    early = (b_start < b_end) & (b_start < (seq_len - QUERY_LEN) // BLOCK_SIZE) & PDL & EARLY
    keys = _block_keys(cache_ptr, block_table_ptr, req, b_start, seq_len, stride_cb, stride_cs, stride_bt, offs, d,
                       early, F16, DOT_FP32)
    if PDL:  # launched as a programmatic dependent: wait for the previous kernel's outputs
        gdc_wait()
        gdc_launch_dependents()

    # Rows of the score tile: (query token j, index head h), padded to BLOCK_M >= 16 for tl.dot.
    rows = tl.arange(0, BLOCK_M)
    row_ok = rows < QUERY_LEN * INDEX_HEADS
    j = rows // INDEX_HEADS
    head = rows % INDEX_HEADS
    tok = (req * QUERY_LEN + j).to(tl.int64)
    kv_len = seq_len - QUERY_LEN + j + 1  # causal: token j sees positions < kv_len
    q = tl.load(q_ptr + tok[:, None] * stride_qn + head[:, None] * stride_qh + d[None, :],
                mask=row_ok[:, None], other=0.0)
    if DOT_FP32:  # the interpreter's bf16 tl.dot is wrong; real GPUs take bf16 x bf16 -> fp32
        q = q.to(tl.float32)
    elif F16:
        # fp8 keys: fp16 operands. e4m3 -> fp16 is one exact conversion per pair of values where bf16
        # takes three instructions per value, which bounded this pass; q is RMS-normed (|q| <= sqrt(Di)
        # times its norm weight), far inside fp16's range, and products accumulate in fp32 either way.
        q = q.to(tl.float16)
    score_ptrs = scores_ptr + tok * stride_sn + head * stride_sh
    if b_start < b_end:
        if not early:
            keys = _block_keys(cache_ptr, block_table_ptr, req, b_start, seq_len, stride_cb, stride_cs, stride_bt,
                               offs, d, True, F16, DOT_FP32)
        _store_block_score(q, keys, b_start, kv_len, score_ptrs, row_ok, offs, BLOCK_SIZE)
    for b in range(b_start + 1, b_end):
        keys = _block_keys(cache_ptr, block_table_ptr, req, b, seq_len, stride_cb, stride_cs, stride_bt, offs, d,
                           True, F16, DOT_FP32)
        _store_block_score(q, keys, b, kv_len, score_ptrs, row_ok, offs, BLOCK_SIZE)


@triton.jit
def topk_keys(row, blk, nb):
    """Blocks blk of a score row (fp32 pointer, one score per block) as unique int64 keys:
    (order-preserving int32 of the score) << 32 | block, so that one int64 max selects both. The local
    block (nb - 1) is the largest; entries past nb are not read and get the smallest high word, so
    they sort below every real block."""
    valid = blk < nb
    bits = tl.load(row + blk, mask=valid, other=0.0).to(tl.int32, bitcast=True)
    ordered = tl.where(bits >= 0, bits, bits ^ 0x7FFFFFFF)
    ordered = tl.where(blk == nb - 1, 2147483647, ordered)  # the local block always wins
    ordered = tl.where(valid, ordered, -2147483648)
    return (ordered.to(tl.int64) << 32) | blk.to(tl.int64)


@triton.jit
def select_blocks_row(row, nb, topk, BLOCK_K: tl.constexpr, SHORT: tl.constexpr, CHUNK: tl.constexpr):
    """The top-k selection of one (token, index head) score row of nb blocks: int32 [BLOCK_K] logical
    block ids, best first (the local block nb - 1 first), -1 from min(nb, topk) on. Keys are unique,
    so the selection is deterministic: every program that selects from the same row gets the same ids.
    SHORT, CHUNK: from ``topk_widths`` (SHORT a multiple of BLOCK_K, CHUNK of SHORT)."""
    # tl.topk's cost follows its width, not nb: the narrow one for rows that fit it.
    blocks = tl.arange(0, SHORT)
    if nb > SHORT:
        # Longer rows in groups of GROUP = SHORT / BLOCK_K consecutive blocks. Each of the best BLOCK_K keys lies in a group
        # whose maximum is at least that key, and there are at most BLOCK_K such groups (keys are unique),
        # so those keys lie in the BLOCK_K groups of largest maxima: a pass over CHUNK-wide slices keeps
        # the best group maxima, then the one SHORT-wide tl.topk below selects among those groups' blocks.
        # The result is the one tl.topk over the whole row would give.
        GROUP: tl.constexpr = SHORT // BLOCK_K
        NG: tl.constexpr = CHUNK // GROUP
        slice_blocks = tl.arange(0, NG)[:, None] * GROUP + tl.arange(0, GROUP)[None, :]
        lead = tl.topk(tl.max(topk_keys(row, slice_blocks, nb), axis=1), BLOCK_K)  # (the first slice)
        for start in range(CHUNK, nb, CHUNK):
            maxima = tl.max(topk_keys(row, start + slice_blocks, nb), axis=1)
            lead = tl.topk(tl.reshape(tl.join(lead, tl.topk(maxima, BLOCK_K)), [2 * BLOCK_K]), BLOCK_K)
        # The kept groups' blocks, GROUP a group, in a tensor made like a short row's: the groups (distinct)
        # are taken out of `kept` one scalar at a time, so no tensor changes layout. (A selection in the
        # layout of the 2-D tensors above made the attention kernel walk wrong blocks on the H200 with
        # Triton 3.6: BENCHMARKS.md, twenty-first session.)
        kept = (lead & 0xFFFFFFFF).to(tl.int32) // GROUP
        slot = blocks // GROUP
        blocks = blocks % GROUP
        for i in tl.static_range(BLOCK_K):
            group = tl.max(kept, axis=0)
            kept = tl.where(kept == group, -1, kept)
            blocks += tl.where(slot == i, group * GROUP, 0)
    best = tl.topk(topk_keys(row, blocks, nb), BLOCK_K)
    k = tl.arange(0, BLOCK_K)
    return tl.where((k < nb) & (k < topk), (best & 0xFFFFFFFF).to(tl.int32), -1)


@triton.jit
def _index_topk_kernel(scores_ptr, seq_lens_ptr, out_ptr, stride_sn, stride_sh, stride_on, stride_oh,
                       QUERY_LEN: tl.constexpr, INDEX_HEADS: tl.constexpr, BLOCK_SIZE: tl.constexpr,
                       TOPK: tl.constexpr, BLOCK_K: tl.constexpr, SHORT: tl.constexpr, CHUNK: tl.constexpr,
                       PDL: tl.constexpr):
    if PDL:  # launched as a programmatic dependent: wait for the previous kernel's outputs
        gdc_wait()
        gdc_launch_dependents()
    pid = tl.program_id(0)
    tok = pid // INDEX_HEADS
    head = pid % INDEX_HEADS
    req = tok // QUERY_LEN
    kv_len = tl.load(seq_lens_ptr + req) - QUERY_LEN + tok % QUERY_LEN + 1
    nb = tl.cdiv(tl.maximum(kv_len, 0), BLOCK_SIZE)  # padding rows: nb = 0 -> all -1
    row = scores_ptr + tok.to(tl.int64) * stride_sn + head * stride_sh
    ids = select_blocks_row(row, nb, TOPK, BLOCK_K, SHORT, CHUNK)
    k = tl.arange(0, BLOCK_K)
    tl.store(out_ptr + tok.to(tl.int64) * stride_on + head * stride_oh + k, ids, mask=k < TOPK)


def _num_programs(device: torch.device) -> int:
    if device.type != "cuda":
        return _INTERPRETER_PROGRAMS
    return SCORE_LAUNCH["programs_per_sm"] * num_sms(device)


# The score pass's launch (benchmarks/sweep_attention.py sweeps it): programs per SM, warps, pipeline stages.
SCORE_LAUNCH = {"programs_per_sm": 4, "num_warps": 4, "num_stages": 2}


def _block_m(query_len: int, index_heads: int) -> int:
    return max(16, triton.next_power_of_2(query_len * index_heads))


def topk_widths(width: int, block_k: int) -> tuple[int, int]:
    """``select_blocks_row``'s widths for score rows of ``width`` blocks and BLOCK_K = block_k: (SHORT,
    the rows of up to SHORT blocks take one tl.topk that wide, longer ones go by groups of SHORT / BLOCK_K
    blocks; CHUNK, the slices longer rows are read in)."""
    short = max(block_k, min(TOPK_CHUNK, triton.next_power_of_2(width)))
    return short, max(short, min(GROUP_SLICES * short, triton.next_power_of_2(width)))


def _need(ok: bool, msg: str) -> None:
    if not ok:
        raise ValueError(msg)


def _check_inputs(index_q, index_cache, block_table, seq_lens, query_len) -> None:
    _need(index_q.dim() == 3 and index_q.dtype == torch.bfloat16 and index_q.stride(2) == 1,
          f"index_q: expected a bf16 [n, heads, dim] tensor with a contiguous last dimension, got "
          f"{index_q.dtype} shape {tuple(index_q.shape)}")
    n, heads, dim = index_q.shape
    _need(index_cache.dim() == 3 and index_cache.shape[2] == dim and index_cache.stride(2) == 1
          and index_cache.dtype in (torch.bfloat16, torch.float8_e4m3fn),
          f"index_cache: expected a bf16/fp8 [blocks, block_size, {dim}] tensor with a contiguous last "
          f"dimension, got {index_cache.dtype} shape {tuple(index_cache.shape)}")
    _need(dim >= 16 and dim & (dim - 1) == 0, f"index_q: head dim must be a power of two >= 16, got {dim}")
    block_size = index_cache.shape[1]
    _need(block_size >= 16 and block_size & (block_size - 1) == 0,
          f"index_cache: block size must be a power of two >= 16, got {block_size}")
    _need(block_table.dim() == 2 and block_table.dtype == torch.int32 and block_table.stride(1) == 1,
          f"block_table: expected an int32 [B, W] tensor with contiguous rows, got {block_table.dtype} "
          f"shape {tuple(block_table.shape)}")
    num_reqs = block_table.shape[0]
    _need(seq_lens.shape == (num_reqs,) and seq_lens.dtype == torch.int32,
          f"seq_lens: expected int32 [{num_reqs}], got {seq_lens.dtype} shape {tuple(seq_lens.shape)}")
    _need(query_len >= 1 and n == num_reqs * query_len,
          f"index_q: expected {num_reqs} requests x query_len={query_len} tokens, got {n}")


def _score(index_q, index_cache, block_table, seq_lens, query_len, pdl) -> torch.Tensor:
    """Pass 1 on checked inputs -> fp32 [n, Hi, W] block scores (entries at or past a token's nb unwritten)."""
    n, heads, dim = index_q.shape
    num_reqs, width = block_table.shape
    scores = torch.empty(n, heads, width, dtype=torch.float32, device=index_q.device)
    if n == 0:
        return scores
    num_splits = max(1, min(width, triton.cdiv(_num_programs(index_q.device), num_reqs)))
    _index_score_kernel[(num_reqs, num_splits)](
        index_q, index_cache, block_table, seq_lens, scores,
        index_q.stride(0), index_q.stride(1), index_cache.stride(0), index_cache.stride(1),
        block_table.stride(0), scores.stride(0), scores.stride(1), num_splits,
        QUERY_LEN=query_len, INDEX_HEADS=heads, INDEX_DIM=dim, BLOCK_SIZE=index_cache.shape[1],
        BLOCK_M=_block_m(query_len, heads), F16=index_cache.dtype == torch.float8_e4m3fn,
        DOT_FP32=index_q.device.type != "cuda", PDL=pdl, EARLY=os.environ.get("MINIMAX_OPS_NO_SCORE_EARLY") != "1",
        num_warps=SCORE_LAUNCH["num_warps"],
        num_stages=SCORE_LAUNCH["num_stages"], launch_pdl=pdl)
    return scores


def index_scores(index_q: torch.Tensor, index_cache: torch.Tensor, block_table: torch.Tensor,
                 seq_lens: torch.Tensor, query_len: int, *, pdl: bool = False) -> torch.Tensor:
    """Pass 1 alone (inputs as index_topk's) -> fp32 [n, Hi, W] block scores, W = block_table's
    width: entry b of a token's row is block b's score for b < the token's block count nb; entries
    from nb on are not written (whatever reads the scores must stop at nb, as select_blocks_row does)."""
    _check_inputs(index_q, index_cache, block_table, seq_lens, query_len)
    return _score(index_q, index_cache, block_table, seq_lens, query_len, pdl and pdl_supported(index_q.device))


def index_topk(index_q: torch.Tensor, index_cache: torch.Tensor, block_table: torch.Tensor,
               seq_lens: torch.Tensor, query_len: int, topk: int, *, pdl: bool = False) -> torch.Tensor:
    """index_q bf16 [n, Hi, Di], index_cache bf16/fp8 [blocks, bs, Di], block_table int32 [B, W],
    seq_lens int32 [B], n = B * query_len -> int32 [n, Hi, topk] logical block ids, the local block
    first, then the best others; -1 where a token has fewer than topk blocks (all -1 for padding)."""
    _check_inputs(index_q, index_cache, block_table, seq_lens, query_len)
    _need(topk >= 1, f"topk: expected >= 1, got {topk}")
    n, heads, _ = index_q.shape
    out = torch.empty(n, heads, topk, dtype=torch.int32, device=index_q.device)
    if n == 0:
        return out
    pdl = pdl and pdl_supported(index_q.device)
    scores = _score(index_q, index_cache, block_table, seq_lens, query_len, pdl)
    _select_blocks(scores, seq_lens, out, query_len, index_cache.shape[1], pdl)
    return out


def _select_blocks(scores: torch.Tensor, seq_lens: torch.Tensor, out: torch.Tensor, query_len: int,
                   block_size: int, pdl: bool = False) -> None:
    """Pass 2: block scores fp32 [n, Hi, W] -> out int32 [n, Hi, topk], the best blocks of each row."""
    n, heads, width = scores.shape
    topk = out.shape[2]
    block_k = triton.next_power_of_2(topk)
    short, chunk = topk_widths(width, block_k)
    _index_topk_kernel[(n * heads,)](
        scores, seq_lens, out, scores.stride(0), scores.stride(1), out.stride(0), out.stride(1),
        QUERY_LEN=query_len, INDEX_HEADS=heads, BLOCK_SIZE=block_size, TOPK=topk, BLOCK_K=block_k,
        SHORT=short, CHUNK=chunk, PDL=pdl, num_warps=4, launch_pdl=pdl)


def aot_specs() -> list[KernelSpec]:
    specs = []
    # (Hi, Di, block size, top-k, table width): tiny preset and the real model (1M-token table).
    for heads, dim, bs, topk, width in ((2, 32, 16, 4, 16), (4, 128, 128, 16, 8192)):
        for query_len in (1, 2, 4):
            for cache_t in ("*bf16", "*fp8e4nv"):
                specs.append(KernelSpec(
                    _index_score_kernel,
                    {"q_ptr": "*bf16", "cache_ptr": cache_t, "block_table_ptr": "*i32", "seq_lens_ptr": "*i32",
                     "scores_ptr": "*fp32", "stride_qn": "i32", "stride_qh": "i32", "stride_cb": "i32",
                     "stride_cs": "i32", "stride_bt": "i32", "stride_sn": "i32", "stride_sh": "i32",
                     "num_splits": "i32"},
                    {"QUERY_LEN": query_len, "INDEX_HEADS": heads, "INDEX_DIM": dim, "BLOCK_SIZE": bs,
                     "BLOCK_M": _block_m(query_len, heads), "F16": cache_t == "*fp8e4nv", "DOT_FP32": False,
                     "EARLY": True},
                    num_warps=SCORE_LAUNCH["num_warps"], num_stages=SCORE_LAUNCH["num_stages"], name=f"index_score_d{dim}_bs{bs}_q{query_len}_{cache_t[1:]}"))
            block_k = triton.next_power_of_2(topk)
            short, chunk = topk_widths(width, block_k)
            specs.append(KernelSpec(
                _index_topk_kernel,
                {"scores_ptr": "*fp32", "seq_lens_ptr": "*i32", "out_ptr": "*i32", "stride_sn": "i32",
                 "stride_sh": "i32", "stride_on": "i32", "stride_oh": "i32"},
                {"QUERY_LEN": query_len, "INDEX_HEADS": heads, "BLOCK_SIZE": bs, "TOPK": topk,
                 "BLOCK_K": block_k, "SHORT": short, "CHUNK": chunk},
                num_warps=4, name=f"index_topk_bs{bs}_k{topk}_q{query_len}"))
    specs = with_pdl_variants(specs)
    # The real size's one-token PDL launch without the early read (MINIMAX_OPS_NO_SCORE_EARLY=1)
    early = next(s for s in specs if s.name == "index_score_d128_bs128_q1_fp8e4nv_pdl")
    return specs + [replace(early, constexprs={**early.constexprs, "EARLY": False}, name=f"{early.name}_late")]
