"""GQA decode attention over a paged KV cache, block-sparse (selected blocks) or dense (all blocks).

Flash-decoding: ``_attention_split_kernel`` runs on a grid (token, kv head, split); each program walks
its share of the token's KV tiles (BLOCK_N positions of one block), keeps an online softmax for all
GROUP query heads of its kv head at once (each K/V tile is loaded once and used in a
[GROUP, D] x [D, BLOCK_N] tl.dot) and writes an unnormalised partial (acc, max, sum).
``_attention_merge_kernel`` combines the splits of each (token, query head) into bf16 output.

Sparse and dense share the split kernel (constexpr DENSE): a sparse token's tiles are those of
its kv head's selected logical blocks (entries -1 or past its last block are skipped); a dense
token's tiles are all of its blocks 0..nb-1, divided among the splits in-kernel from its real
length, so the host never reads seq_lens. Causality (positions < kv_len) is a mask, which also
covers speculative tokens of the same request.

The sparse kernel takes its selection one of two ways. ``sparse_attention_decode`` reads block ids
(the indexer's top-k, kernels/index_topk.py). ``index_sparse_attention_decode`` (constexpr SELECT,
the fused layer's path) reads the indexer's block scores instead and makes the top-k itself: every
split program of a (token, kv head) runs index_topk's ``select_blocks_row`` on index head kv_head's
score row, gets the same deterministic selection (keys are unique), and walks its own share of the
selected blocks' tiles. The repeated selection costs about what the kernel boundary and the ids'
round trip through memory cost (BENCHMARKS.md): one launch fewer, no time gained. The block table is
the step's metadata, so a SELECT program reads the pages of the row's first PAGES blocks before its PDL
wait (``PAGES_FIRST``) and takes its selection's pages from registers: one dependent round trip fewer
after the wait (rows of more blocks read them after the selection).

fp8 caches meet q and p in fp16 (``F16``: e4m3 -> fp16 is exact and one conversion per pair of values;
the bf16 form spent about as many instructions converting as loading), bf16 caches stay bf16. A tile
is a whole block where a sparse step has at least one (token, kv head, selected block) per program,
half a block otherwise (``_tile``: one-token steps need the smaller tiles to fill the GPU).
"""

from __future__ import annotations

import math
import os

import torch
import triton
import triton.language as tl

from .aot import KernelSpec, with_pdl_variants
from .index_topk import select_blocks_row, topk_widths
from .mx_decode import gdc_launch_dependents, gdc_wait, pdl_supported
from .tiles import num_sms

LOG2E = 1.4426950408889634
SPLIT_CHUNK = 32  # splits merged per step of the merge kernel's loop (1-token steps have up to 32)
NEAR_PAGES = 256  # SELECT programs read the pages of a row's first this many blocks before the PDL wait
MAX_TILE = 64  # positions per KV tile where whole blocks would leave SMs idle (16 blocks x 4 heads at 1 token)
_INTERPRETER_PROGRAMS = 8  # small interpreted grids that still exercise several splits


@triton.jit
def _attention_split_kernel(
        q_ptr, kv_ptr, block_table_ptr, seq_lens_ptr, select_ptr, part_acc_ptr, part_ml_ptr,
        stride_qn, stride_qh, stride_kb, stride_kh, stride_ks, stride_bt, stride_in, stride_ih,
        num_sparse_tiles, num_splits, qk_scale, v_scale,
        QUERY_LEN: tl.constexpr, GROUP: tl.constexpr, BLOCK_G: tl.constexpr, HEAD_DIM: tl.constexpr,
        BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_TOPK: tl.constexpr, DENSE: tl.constexpr,
        SELECT: tl.constexpr, SHORT: tl.constexpr, CHUNK: tl.constexpr, PAGES: tl.constexpr, F16: tl.constexpr,
        DOT_FP32: tl.constexpr, PDL: tl.constexpr, PAGES_FIRST: tl.constexpr = False):
    # select_ptr (strides stride_in, stride_ih): sparse, int32 block ids [n, KVH, topk]; SELECT, the
    # indexer's fp32 block scores [n, KVH, W]; dense, never read. num_sparse_tiles = topk tiles per block.
    if PDL and DENSE:  # launched as a programmatic dependent: wait for the previous kernel's outputs (q)
        gdc_wait()
        gdc_launch_dependents()
    tok = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    num_heads = tl.num_programs(1) * GROUP
    TILES_PER_BLOCK: tl.constexpr = BLOCK_SIZE // BLOCK_N
    req = tok // QUERY_LEN
    kv_len = tl.load(seq_lens_ptr + req) - QUERY_LEN + tok % QUERY_LEN + 1
    nb = tl.cdiv(tl.maximum(kv_len, 0), BLOCK_SIZE)
    if DENSE:
        total = nb * TILES_PER_BLOCK
    elif SELECT:
        # The selection's valid entries are its first min(nb, topk): the splits share just their tiles.
        total = tl.minimum(nb, num_sparse_tiles // TILES_PER_BLOCK) * TILES_PER_BLOCK
    else:
        total = tl.where(kv_len > 0, num_sparse_tiles, 0)  # padding rows: no tiles
    per_split = tl.cdiv(total, num_splits)
    t_start = split * per_split
    t_end = tl.minimum(t_start + per_split, total)

    g = tl.arange(0, BLOCK_G)
    g_ok = g < GROUP  # BLOCK_G >= 16 rows for tl.dot; extra rows are zeros and never stored
    d = tl.arange(0, HEAD_DIM)
    q = tl.load(q_ptr + tok.to(tl.int64) * stride_qn + (kv_head * GROUP + g)[:, None] * stride_qh + d[None, :],
                mask=g_ok[:, None], other=0.0)
    if DOT_FP32:  # the interpreter's bf16 tl.dot is wrong; GPUs take bf16 x bf16 -> fp32
        q = q.to(tl.float32)
    elif F16:
        # fp8 K / V: fp16 operands. e4m3 -> fp16 is one exact conversion per pair of values (bf16 takes
        # three instructions per value); q is RMS-normed, far inside fp16's range; p <= 1 keeps more bits.
        q = q.to(tl.float16)
    if SELECT and PAGES_FIRST:
        # The pages of the first PAGES blocks (the step's metadata, not the indexer's output): read before
        # the wait, so that a selection from a row of up to PAGES blocks finds its pages in registers.
        near = tl.arange(0, PAGES)
        near_pages = tl.load(block_table_ptr + req * stride_bt + near, mask=near < tl.minimum(nb, PAGES), other=-1)
    if PDL and not DENSE:
        # The sparse chain's previous kernel is the indexer: only the block ids are its output. q and
        # the new token's k / v come from the launch before it, complete once the indexer started, so
        # they are read before the wait (everything this kernel stores still comes after it).
        gdc_wait()
        gdc_launch_dependents()
    if SELECT:
        # index_topk's selection from the scores (read after the wait: the indexer wrote them); unique
        # ids, -1 past min(nb, topk), so there are no repeats to skip.
        kk = tl.arange(0, BLOCK_TOPK)
        selection = select_blocks_row(select_ptr + tok.to(tl.int64) * stride_in + kv_head * stride_ih, nb,
                                      num_sparse_tiles // TILES_PER_BLOCK, BLOCK_TOPK, SHORT, CHUNK)
    elif not DENSE:
        # The token's whole selection, to skip repeats: attention is over the union of the blocks.
        kk = tl.arange(0, BLOCK_TOPK)
        selection = tl.load(select_ptr + tok.to(tl.int64) * stride_in + kv_head * stride_ih + kk,
                            mask=kk < num_sparse_tiles // TILES_PER_BLOCK, other=-1)
        repeat = tl.sum(((selection[None, :] == selection[:, None]) & (kk[None, :] < kk[:, None])).to(tl.int32),
                        axis=1) > 0
        selection = tl.where(repeat, -1, selection)
    if not DENSE:
        # Every selected block's page in one load before the tile loop, whose only loads are then K / V
        # (their addresses from registers: the pipeliner can buffer them ahead, see SPLIT_LAUNCH).
        chosen = (selection >= 0) & (selection < nb)
        if SELECT and PAGES_FIRST:
            if nb <= PAGES:
                pages = tl.where(chosen, tl.gather(near_pages, tl.where(chosen, selection, 0), 0), -1)
            else:
                pages = tl.load(block_table_ptr + req * stride_bt + selection, mask=chosen, other=-1)
        else:
            pages = tl.load(block_table_ptr + req * stride_bt + selection, mask=chosen, other=-1)
        selection = tl.where(chosen, selection, -1)
    offs = tl.arange(0, BLOCK_N)
    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, HEAD_DIM], tl.float32)
    for t in range(t_start, t_end):
        slot = t // TILES_PER_BLOCK
        if DENSE:
            blk = slot
            ok = blk < nb
            page = tl.load(block_table_ptr + req * stride_bt + blk, mask=ok, other=0).to(tl.int64)
        else:  # entry `slot` of the registers (-1: past the selection, a repeat or past the last block)
            blk = tl.max(tl.where(kk == slot, selection, -1), axis=0)
            ok = blk >= 0
            page = tl.max(tl.where(kk == slot, pages, 0), axis=0).to(tl.int64)
        in_block = (t % TILES_PER_BLOCK) * BLOCK_N + offs
        valid = ok & (blk * BLOCK_SIZE + in_block < kv_len)
        # Masked-off rows are never read: unwritten cache slots may hold anything (even NaN).
        ptrs = kv_ptr + page * stride_kb + kv_head * stride_kh + in_block[:, None] * stride_ks + d[None, :]
        k = tl.load(ptrs, mask=valid[:, None], other=0.0)
        v = tl.load(ptrs + HEAD_DIM, mask=valid[:, None], other=0.0)
        if DOT_FP32:
            k = k.to(tl.float32)
            v = v.to(tl.float32)
        else:  # fp8 -> fp16 / bf16 is exact
            k = k.to(tl.float16 if F16 else tl.bfloat16)
            v = v.to(tl.float16 if F16 else tl.bfloat16)
        s = tl.dot(q, tl.trans(k)) * qk_scale  # log2 units: qk_scale folds in k_scale, 1/sqrt(D), log2(e)
        s = tl.where(valid[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row with nothing seen yet
        alpha = tl.exp2(m_i - m_safe)
        p = tl.exp2(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        p = p if DOT_FP32 else p.to(tl.float16 if F16 else tl.bfloat16)
        acc = acc * alpha[:, None] + tl.dot(p, v)
        m_i = m_new
    row = ((tok * num_heads + kv_head * GROUP + g).to(tl.int64)) * num_splits + split  # [n, H, S] index
    tl.store(part_acc_ptr + row[:, None] * HEAD_DIM + d[None, :], acc * v_scale, mask=g_ok[:, None])
    parts = tl.num_programs(0).to(tl.int64) * num_heads * num_splits
    tl.store(part_ml_ptr + row, m_i, mask=g_ok)
    tl.store(part_ml_ptr + parts + row, l_i, mask=g_ok)


@triton.jit
def _attention_merge_kernel(part_acc_ptr, part_ml_ptr, out_ptr, num_splits, stride_on,
                            HEAD_DIM: tl.constexpr, SPLIT_CHUNK: tl.constexpr, PDL: tl.constexpr):
    if PDL:  # launched as a programmatic dependent: wait for the previous kernel's outputs
        # The next kernel (o_proj) may launch first: it waits for this one's completion itself, and
        # reads its first weight step in the meantime.
        gdc_launch_dependents()
        gdc_wait()
    tok = tl.program_id(0)
    head = tl.program_id(1)
    num_heads = tl.num_programs(1)
    parts = tl.num_programs(0).to(tl.int64) * num_heads * num_splits
    base = (tok * num_heads + head).to(tl.int64) * num_splits
    s = tl.arange(0, SPLIT_CHUNK)
    d = tl.arange(0, HEAD_DIM)
    # One pass, rescaling online per chunk of splits: a step with <= SPLIT_CHUNK splits issues all its
    # loads (acc, sum, max) at once, one round trip. The acc tile is loaded first: with the max first,
    # ptxas (sm_90) ran the max's shuffles right after its load, stalled on it and issued acc's loads
    # only then, two round trips (a block barrier between the loads and the max did not stop it).
    m_run = tl.full([], float("-inf"), tl.float32)
    l_run = tl.full([], 0.0, tl.float32)
    acc = tl.zeros([HEAD_DIM], tl.float32)
    for s0 in range(0, num_splits, SPLIT_CHUNK):
        ok = s0 + s < num_splits
        a = tl.load(part_acc_ptr + (base + s0 + s)[:, None] * HEAD_DIM + d[None, :], mask=ok[:, None], other=0.0)
        l = tl.load(part_ml_ptr + parts + base + s0 + s, mask=ok, other=0.0)
        m = tl.load(part_ml_ptr + base + s0 + s, mask=ok, other=float("-inf"))
        m_new = tl.maximum(m_run, tl.max(m, axis=0))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_run - m_safe)  # 0 while nothing was seen
        w = tl.exp2(m - m_safe)  # empty splits (m = -inf) weigh 0
        l_run = l_run * alpha + tl.sum(w * l, axis=0)
        acc = acc * alpha + tl.sum(w[:, None] * a, axis=0)
        m_run = m_new
    o = acc / tl.where(l_run > 0, l_run, 1.0)  # padding rows: zeros
    tl.store(out_ptr + tok.to(tl.int64) * stride_on + head * HEAD_DIM + d, o.to(out_ptr.dtype.element_ty))


def near_pages(width: int, block_topk: int) -> int:
    """PAGES: the block-table entries a SELECT program reads before its wait (rows of up to that many
    blocks take their selection's pages from registers)."""
    return max(block_topk, min(NEAR_PAGES, triton.next_power_of_2(width)))


def _target_programs(device: torch.device, dense: bool) -> int:
    """Resident programs to aim for: enough to hide the latency of the scattered block loads (sparse
    steps: two per SM, each walking longer runs of tiles; dense: four)."""
    if device.type != "cuda":
        return _INTERPRETER_PROGRAMS
    return SPLIT_LAUNCH["dense_per_sm" if dense else "sparse_per_sm"] * num_sms(device)


# The split kernel's launch (benchmarks/sweep_attention.py sweeps it): programs per SM, pipeline stages
# (3 double-buffers a sparse program's K / V tiles, and measured slower than 2 in the layer: BENCHMARKS.md).
SPLIT_LAUNCH = {"sparse_per_sm": 2, "dense_per_sm": 4, "num_stages": 2}


def _need(ok: bool, msg: str) -> None:
    if not ok:
        raise ValueError(msg)


def _tile(block_size: int, blocks: int | None = None, programs: int = 0) -> int:
    """Positions per KV tile: whole blocks where a sparse step's (token, kv head, selected block)
    triples (``blocks``) give every program at least one; else (small sparse steps, dense) MAX_TILE."""
    return block_size if blocks is not None and blocks >= programs else min(block_size, MAX_TILE)


def _block_g(group: int) -> int:
    return max(16, triton.next_power_of_2(group))


def _check_common(q, kv_cache, block_table, seq_lens, query_len):
    _need(q.dim() == 3 and q.dtype == torch.bfloat16 and q.stride(2) == 1,
          f"q: expected a bf16 [n, heads, head_dim] tensor with a contiguous last dimension, got "
          f"{q.dtype} shape {tuple(q.shape)}")
    n, heads, dim = q.shape
    _need(dim >= 16 and dim & (dim - 1) == 0, f"q: head_dim must be a power of two >= 16, got {dim}")
    _need(kv_cache.dim() == 4 and kv_cache.shape[3] == 2 * dim and kv_cache.stride(3) == 1
          and kv_cache.dtype in (torch.bfloat16, torch.float8_e4m3fn),
          f"kv_cache: expected a bf16/fp8 [blocks, kv_heads, block_size, {2 * dim}] tensor with a contiguous "
          f"last dimension, got {kv_cache.dtype} shape {tuple(kv_cache.shape)}")
    kv_heads, block_size = kv_cache.shape[1], kv_cache.shape[2]
    _need(heads % kv_heads == 0, f"q: expected a multiple of kv_cache's {kv_heads} kv heads, got {heads}")
    _need(block_size >= 16 and block_size & (block_size - 1) == 0,
          f"kv_cache: block size must be a power of two >= 16, got {block_size}")
    _need(block_table.dim() == 2 and block_table.dtype == torch.int32 and block_table.stride(1) == 1,
          f"block_table: expected an int32 [B, W] tensor with contiguous rows, got {block_table.dtype} "
          f"shape {tuple(block_table.shape)}")
    num_reqs = block_table.shape[0]
    _need(seq_lens.shape == (num_reqs,) and seq_lens.dtype == torch.int32,
          f"seq_lens: expected int32 [{num_reqs}], got {seq_lens.dtype} shape {tuple(seq_lens.shape)}")
    _need(query_len >= 1 and n == num_reqs * query_len,
          f"q: expected {num_reqs} requests x query_len={query_len} tokens, got {n}")


def _launch(q, kv_cache, block_table, seq_lens, query_len, k_scale, v_scale, num_splits, pdl, block_ids=None,
            scores=None, topk=0):
    """Split + merge launches. The selection: block_ids (sparse), scores + topk (SELECT), neither (dense)."""
    n, heads, dim = q.shape
    kv_heads, block_size = kv_cache.shape[1], kv_cache.shape[2]
    group = heads // kv_heads
    select = scores is not None
    dense = block_ids is None and not select
    if block_ids is not None:
        topk = block_ids.shape[2]
    programs = _target_programs(q.device, dense)
    tile = _tile(block_size, None if dense else n * kv_heads * topk, programs)
    out = q.new_empty(n, heads * dim)
    if n == 0:
        return out
    sparse_tiles = 0 if dense else topk * (block_size // tile)
    max_tiles = block_table.shape[1] * (block_size // tile) if dense else sparse_tiles
    if num_splits is None:
        num_splits = triton.cdiv(programs, n * kv_heads)
    num_splits = max(1, min(num_splits, max_tiles))
    if not dense:  # drop splits that would get no tile
        num_splits = triton.cdiv(sparse_tiles, triton.cdiv(sparse_tiles, num_splits))
    part_acc = torch.empty(n, heads, num_splits, dim, dtype=torch.float32, device=q.device)
    part_ml = torch.empty(2, n, heads, num_splits, dtype=torch.float32, device=q.device)
    sel = scores if select else block_table if dense else block_ids  # dense: a typed stand-in, never read
    block_topk = 1 if dense else triton.next_power_of_2(topk)
    short, chunk = topk_widths(scores.shape[2], block_topk) if select else (1, 1)
    pdl = pdl and pdl_supported(q.device)
    _attention_split_kernel[(n, kv_heads, num_splits)](
        q, kv_cache, block_table, seq_lens, sel, part_acc, part_ml,
        q.stride(0), q.stride(1), kv_cache.stride(0), kv_cache.stride(1), kv_cache.stride(2),
        block_table.stride(0), sel.stride(0), sel.stride(1) if not dense else 0,
        sparse_tiles, num_splits, float(k_scale) * LOG2E / math.sqrt(dim), float(v_scale),
        QUERY_LEN=query_len, GROUP=group, BLOCK_G=_block_g(group), HEAD_DIM=dim, BLOCK_SIZE=block_size,
        BLOCK_N=tile, BLOCK_TOPK=block_topk, DENSE=dense, SELECT=select, SHORT=short, CHUNK=chunk,
        PAGES=near_pages(scores.shape[2], block_topk) if select else 1,
        F16=kv_cache.dtype == torch.float8_e4m3fn, DOT_FP32=q.device.type != "cuda", PDL=pdl,
        PAGES_FIRST=select and os.environ.get("MINIMAX_OPS_NO_PAGES_FIRST") != "1", num_warps=4,
        num_stages=SPLIT_LAUNCH["num_stages"], launch_pdl=pdl)
    _attention_merge_kernel[(n, heads)](part_acc, part_ml, out, num_splits, out.stride(0),
                                        HEAD_DIM=dim, SPLIT_CHUNK=SPLIT_CHUNK, PDL=pdl, num_warps=4, launch_pdl=pdl)
    return out


def sparse_attention_decode(q: torch.Tensor, kv_cache: torch.Tensor, block_table: torch.Tensor,
                            seq_lens: torch.Tensor, block_ids: torch.Tensor, query_len: int,
                            k_scale: float = 1.0, v_scale: float = 1.0, *,
                            num_splits: int | None = None, pdl: bool = False) -> torch.Tensor:
    """Block-sparse GQA decode: q bf16 [n, H, D]; kv_cache [blocks, KVH, bs, 2D] (bf16 or fp8,
    dequantised by k_scale / v_scale); block_ids int32 [n, KVH, topk] logical blocks per kv head
    (-1, repeats and blocks past the token's last are ignored). Causal (positions < kv_len). Returns bf16 [n, H*D];
    padding rows (seq_len 0) are zeros. num_splits overrides the split-K heuristic (tests)."""
    _check_common(q, kv_cache, block_table, seq_lens, query_len)
    n, kv_heads = q.shape[0], kv_cache.shape[1]
    _need(block_ids.dim() == 3 and block_ids.shape[:2] == (n, kv_heads) and block_ids.dtype == torch.int32
          and block_ids.stride(2) == 1 and block_ids.shape[2] >= 1,
          f"block_ids: expected an int32 [{n}, {kv_heads}, topk] tensor with a contiguous last dimension, "
          f"got {block_ids.dtype} shape {tuple(block_ids.shape)}")
    return _launch(q, kv_cache, block_table, seq_lens, query_len, k_scale, v_scale, num_splits, pdl,
                   block_ids=block_ids)


def index_sparse_attention_decode(q: torch.Tensor, scores: torch.Tensor, kv_cache: torch.Tensor,
                                  block_table: torch.Tensor, seq_lens: torch.Tensor, query_len: int, topk: int,
                                  k_scale: float = 1.0, v_scale: float = 1.0, *,
                                  num_splits: int | None = None, pdl: bool = False) -> torch.Tensor:
    """sparse_attention_decode over index_topk's selection made in-kernel: scores fp32 [n, KVH, W] are
    the indexer's block scores (kernels/index_topk.py ``index_scores``, index head h serving kv head h,
    W = block_table's width); each token's kv head attends over the blocks index_topk would choose
    (the local block and the best others, topk at most). Equal to index_topk + sparse_attention_decode
    up to the order of the splits' sums. With pdl, the scores are read only after the PDL wait."""
    _check_common(q, kv_cache, block_table, seq_lens, query_len)
    n, kv_heads, width = q.shape[0], kv_cache.shape[1], block_table.shape[1]
    _need(scores.dim() == 3 and scores.shape == (n, kv_heads, width) and scores.dtype == torch.float32
          and scores.stride(2) == 1,
          f"scores: expected an fp32 [{n}, {kv_heads}, {width}] tensor (index_scores' block scores) with a "
          f"contiguous last dimension, got {scores.dtype} shape {tuple(scores.shape)}")
    _need(topk >= 1, f"topk: expected >= 1, got {topk}")
    return _launch(q, kv_cache, block_table, seq_lens, query_len, k_scale, v_scale, num_splits, pdl,
                   scores=scores, topk=topk)


def dense_attention_decode(q: torch.Tensor, kv_cache: torch.Tensor, block_table: torch.Tensor,
                           seq_lens: torch.Tensor, query_len: int, k_scale: float = 1.0, v_scale: float = 1.0,
                           *, num_splits: int | None = None, pdl: bool = False) -> torch.Tensor:
    """Full causal GQA decode over all of each token's blocks (dense layers); as sparse_attention_decode
    otherwise. Long contexts are split over up to ~4 programs per SM."""
    _check_common(q, kv_cache, block_table, seq_lens, query_len)
    return _launch(q, kv_cache, block_table, seq_lens, query_len, k_scale, v_scale, num_splits, pdl)


def aot_specs() -> list[KernelSpec]:
    specs = []
    # (H, KVH, D, block size, top-k, table width): tiny preset and the real model (TP 1, 1M-token table).
    for heads, kv_heads, dim, bs, topk, width in ((8, 2, 32, 16, 4, 16), (64, 4, 128, 128, 16, 8192)):
        group = heads // kv_heads
        short, chunk = topk_widths(width, topk)
        for query_len in (1, 2, 4):
            for kv_t in ("*bf16", "*fp8e4nv"):
                # Whole-block tiles run in larger sparse steps (``_tile``): the real size's fp8 one-token
                # kernels stand for them.
                whole = bs > MAX_TILE and kv_t == "*fp8e4nv" and query_len == 1
                for kind, tile in [(k, _tile(bs)) for k in ("sparse", "select", "dense")] + \
                        [(k, bs) for k in ("sparse", "select") if whole]:
                    dense, select = kind == "dense", kind == "select"
                    specs.append(KernelSpec(
                        _attention_split_kernel,
                        {"q_ptr": "*bf16", "kv_ptr": kv_t, "block_table_ptr": "*i32", "seq_lens_ptr": "*i32",
                         "select_ptr": "*fp32" if select else "*i32", "part_acc_ptr": "*fp32",
                         "part_ml_ptr": "*fp32",
                         "stride_qn": "i32", "stride_qh": "i32", "stride_kb": "i32", "stride_kh": "i32",
                         "stride_ks": "i32", "stride_bt": "i32", "stride_in": "i32", "stride_ih": "i32",
                         "num_sparse_tiles": "i32", "num_splits": "i32", "qk_scale": "fp32", "v_scale": "fp32"},
                        {"QUERY_LEN": query_len, "GROUP": group, "BLOCK_G": _block_g(group), "HEAD_DIM": dim,
                         "BLOCK_SIZE": bs, "BLOCK_N": tile, "BLOCK_TOPK": 1 if dense else topk,
                         "DENSE": dense, "SELECT": select, "SHORT": short if select else 1,
                         "CHUNK": chunk if select else 1, "PAGES": near_pages(width, topk) if select else 1,
                         "F16": kv_t == "*fp8e4nv", "DOT_FP32": False, "PAGES_FIRST": select},
                        num_warps=4, num_stages=SPLIT_LAUNCH["num_stages"],
                        name=f"attention_{kind}_d{dim}_bs{bs}_q{query_len}_{kv_t[1:]}_t{tile}"))
        specs.append(KernelSpec(
            _attention_merge_kernel,
            {"part_acc_ptr": "*fp32", "part_ml_ptr": "*fp32", "out_ptr": "*bf16", "num_splits": "i32",
             "stride_on": "i32"},
            {"HEAD_DIM": dim, "SPLIT_CHUNK": SPLIT_CHUNK}, num_warps=4, name=f"attention_merge_d{dim}"))
    return with_pdl_variants(specs)
