"""Attention-side Triton kernels against the fp32 reference (minimax_ops.reference): per-head norm + partial
RoPE + paged-cache insert, the indexer's block top-k, and block-sparse / dense GQA decode attention (the sparse one
also with the indexer's top-k made in-kernel, against index_topk + sparse attention); the add + RMSNorm kernels are
test_kernels_norm.py's. On CPU they run under the Triton interpreter (tests/conftest.py).

Tolerances. Kernel results are stored as bf16 (or fp8 cache entries). The interpreter truncates
fp32 -> bf16 casts and double-rounds fp32 -> fp8 where torch and GPUs round to nearest, so a stored
value may sit one unit in the last place (ulp) of its format away from the reference's; value checks
therefore allow one ulp of the stored format plus fp32 noise. What must not change (cache slots outside
the step, padding rows) is checked byte for byte.

Caches are filled with random values at every live position (< seq_len of its request) and with a
large POISON everywhere else, so any read past a token's causal limit swamps scores and outputs.
"""

from __future__ import annotations

import math

import pytest
import torch

from minimax_ops import reference as ref
from minimax_ops.cache import build_step
from minimax_ops.config import preset
from minimax_ops.kernels import attention, index_topk, norm, qk_norm_rope
from utils import FP8, assert_within_ulp

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
CFG = preset("tiny")
H, KVH, D = CFG.num_attention_heads, CFG.num_key_value_heads, CFG.head_dim
ROT, THETA, EPS = CFG.rotary_dim, CFG.rope_theta, CFG.rms_norm_eps
BS, TOPK = CFG.sparse_block_size, CFG.sparse_topk_blocks
HI, DI = CFG.sparse_num_index_heads, CFG.sparse_index_dim
NUM_BLOCKS = 48
CACHE_DTYPES = [torch.bfloat16, FP8]
POISON = 300.0

# name -> (cached context lengths, query_len, padding requests); n = (requests + pads) * query_len.
# Lengths straddle block edges (a speculative step crossing into a new block), span fewer and more
# than TOPK blocks, and include padding rows (seq_len 0, slot -1).
STEPS = {
    "n1_q1": ([37], 1, 0),
    "n4_q1": ([5, 83, 16], 1, 1),
    "n4_q2": ([30, 61], 2, 0),
    "n8_q2": ([14, 95, 47], 2, 1),
    "n8_q4": ([14, 50], 4, 0),
}


def make_step(name: str, seed: int):
    contexts, query_len, pads = STEPS[name]
    gen = torch.Generator().manual_seed(seed)
    meta = build_step(contexts, query_len, block_size=BS, num_blocks=NUM_BLOCKS, pad_requests=pads, generator=gen)
    return meta.to(DEVICE), query_len, gen


def kv_lens(meta, query_len: int) -> list[int]:
    """kv_len of every token (<= 0 for padding rows)."""
    seq = meta.seq_lens.tolist()
    return [seq[i // query_len] - query_len + i % query_len + 1 if seq[i // query_len] > 0 else 0
            for i in range(meta.num_tokens)]


def live_positions(meta) -> torch.Tensor:
    """[NUM_BLOCKS, BS] bool: cache positions holding a token of some request (< its seq_len)."""
    live = torch.zeros(NUM_BLOCKS, BS, dtype=torch.bool)
    table = meta.block_table.cpu()
    for r, s in enumerate(meta.seq_lens.tolist()):
        for b in range(-(-s // BS)):
            live[table[r, b], :min(BS, s - b * BS)] = True
    return live


def poisoned_caches(meta, dtype, gen):
    live = live_positions(meta)
    kv = torch.randn(NUM_BLOCKS, KVH, BS, 2 * D, generator=gen)
    kv = torch.where(live[:, None, :, None], kv, POISON).to(dtype).to(DEVICE)
    index = torch.randn(NUM_BLOCKS, BS, DI, generator=gen)
    index = torch.where(live[:, :, None], index, POISON).to(dtype).to(DEVICE)
    return kv, index


def randn(*shape, gen, scale=1.0):
    return (torch.randn(*shape, generator=gen) * scale).to(torch.bfloat16).to(DEVICE)


# On a GPU the kernel rounds the softmax probabilities to bf16 for the P @ V tensor-core product
# (2^-9 relative each), so an output near zero may be off by a few thousandths of the largest value;
# the interpreter keeps them fp32.
ATTENTION_ATOL = 5e-3 if DEVICE == "cuda" else 1e-3


def assert_attention_close(out: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    """bf16 output [n, H*D] vs fp32 reference [n, H, D]: 1% relative, atol ATTENTION_ATOL of the largest value."""
    e = expected.reshape(out.shape[0], -1).cpu()
    torch.testing.assert_close(out.float().cpu(), e, rtol=1e-2, atol=ATTENTION_ATOL * e.abs().max().item(), msg=what)


# ---- per-head norm + RoPE + cache insert ------------------------------------------------------------------


def written_slots(slot_mapping: torch.Tensor) -> torch.Tensor:
    """[NUM_BLOCKS, BS] bool: the positions this step writes."""
    mask = torch.zeros(NUM_BLOCKS * BS, dtype=torch.bool)
    slots = slot_mapping.cpu()
    mask[slots[slots >= 0]] = True
    return mask.view(NUM_BLOCKS, BS)


def check_cache_writes(kernel_cache, ref_cache, before, written, dtype, what):
    """Slots outside the step: byte-identical to before; written slots: the reference's values."""
    k, r, b = (t.cpu() for t in (kernel_cache, ref_cache, before))
    if k.dim() == 4:  # [blocks, heads, bs, 2D] -> [blocks, bs, heads, 2D] to index by (block, offset)
        k, r, b = (t.transpose(1, 2) for t in (k, r, b))
    assert torch.equal(k[~written].view(torch.uint8), b[~written].view(torch.uint8)), \
        f"{what}: bytes changed outside the step's slots"
    assert_within_ulp(k[written], r[written], dtype, f"{what} written slots")


@pytest.mark.parametrize("dtype", CACHE_DTYPES, ids=["bf16", "fp8"])
@pytest.mark.parametrize("step,sparse,pos_offset", [
    ("n1_q1", True, 0), ("n4_q1", True, 0), ("n8_q2", True, 0), ("n8_q4", True, 0),
    ("n4_q2", False, 0),
    ("n4_q1", True, 2**20 - 200),  # RoPE angles near the 1M-token limit (fp32 angles would be off)
])
def test_qk_norm_rope_insert(step, sparse, pos_offset, dtype):
    meta, _, gen = make_step(step, seed=1)
    n = meta.num_tokens
    width = (H + 2 * KVH) * D + ((HI + 1) * DI if sparse else 0)
    qkv = randn(n, width, gen=gen, scale=2.0)
    norms = [randn(D, gen=gen, scale=0.3) for _ in range(4)]
    kv = torch.randn(NUM_BLOCKS, KVH, BS, 2 * D, generator=gen).to(dtype).to(DEVICE)
    index = torch.randn(NUM_BLOCKS, BS, DI, generator=gen).to(dtype).to(DEVICE) if sparse else None
    positions = meta.positions + pos_offset
    kw = dict(num_heads=H, num_kv_heads=KVH, head_dim=D, rotary_dim=ROT, rope_theta=THETA, eps=EPS,
              index_heads=HI if sparse else 0, index_dim=DI if sparse else 0)
    idx_slots = meta.index_slot_mapping if sparse else None
    idx_norms = norms[2:] if sparse else [None, None]

    kv_k, kv_r = kv.clone(), kv.clone()
    index_k, index_r = (index.clone(), index.clone()) if sparse else (None, None)
    q, index_q = qk_norm_rope.qk_norm_rope_insert(qkv, positions, meta.slot_mapping, idx_slots, *norms[:2],
                                                  *idx_norms, kv_k, index_k, **kw)
    q_ref, index_q_ref = ref.qk_norm_rope_insert(qkv, positions, meta.slot_mapping, idx_slots, *norms[:2],
                                                 *idx_norms, kv_r, index_r, **kw)
    assert q.dtype == torch.bfloat16 and q.shape == (n, H, D)
    assert_within_ulp(q, q_ref, torch.bfloat16, "q")
    written = written_slots(meta.slot_mapping)
    assert int(written.sum()) == sum(s >= 0 for s in meta.slot_mapping.tolist()) > 0
    check_cache_writes(kv_k, kv_r, kv, written, dtype, "kv_cache")
    if sparse:
        assert index_q.shape == (n, HI, DI)
        assert_within_ulp(index_q, index_q_ref, torch.bfloat16, "index_q")
        check_cache_writes(index_k, index_r, index, written_slots(meta.index_slot_mapping), dtype, "index_cache")
    else:
        assert index_q is None


def test_qk_norm_rope_insert_rejects_bad_inputs():
    qkv = torch.zeros(1, (H + 2 * KVH) * D + 5, dtype=torch.bfloat16, device=DEVICE)
    one = torch.zeros(1, dtype=torch.int64, device=DEVICE)
    w = torch.zeros(D, dtype=torch.bfloat16, device=DEVICE)
    kv = torch.zeros(NUM_BLOCKS, KVH, BS, 2 * D, dtype=torch.bfloat16, device=DEVICE)
    with pytest.raises(ValueError, match=f"qkv: expected width {(H + 2 * KVH) * D}"):
        qk_norm_rope.qk_norm_rope_insert(qkv, one, one, None, w, w, None, None, kv, None, num_heads=H,
                                         num_kv_heads=KVH, head_dim=D, rotary_dim=ROT, rope_theta=THETA, eps=EPS)


# ---- indexer top-k ------------------------------------------------------------------------------------------


def block_scores(index_q, index_cache, meta, query_len) -> list[torch.Tensor]:
    """Per token: [HI, nb] max-over-positions scores (fp32), from plain torch."""
    out, table, cache = [], meta.block_table.cpu(), index_cache.float().cpu()
    for i, kv_len in enumerate(kv_lens(meta, query_len)):
        nb = -(-max(kv_len, 0) // BS)
        keys = torch.stack([cache[table[i // query_len, p // BS], p % BS] for p in range(kv_len)]) \
            if kv_len > 0 else torch.zeros(0, DI)
        dots = index_q[i].float().cpu() @ keys.T  # [HI, kv_len]
        out.append(torch.stack([dots[:, b * BS:(b + 1) * BS].amax(-1) for b in range(nb)], -1)
                   if nb else torch.zeros(HI, 0))
    return out


def check_topk(ids: torch.Tensor, ids_ref: torch.Tensor, scores: list[torch.Tensor], topk: int) -> None:
    ids, ids_ref = ids.cpu(), ids_ref.cpu()
    assert ids.dtype == torch.int32 and ids.shape == ids_ref.shape
    for i, s in enumerate(scores):
        nb = s.shape[1]
        k = min(topk, nb)
        for h in range(ids.shape[1]):
            row = ids[i, h].tolist()
            assert row[k:] == [-1] * (topk - k), f"token {i} head {h}: {row} should end in -1 padding"
            chosen = row[:k]
            if not nb:
                continue
            assert chosen[0] == nb - 1, f"token {i} head {h}: local block {nb - 1} must come first, got {row}"
            assert len(set(chosen)) == k and all(0 <= b < nb for b in chosen), f"token {i} head {h}: {row}"
            if sorted(chosen) != sorted(ids_ref[i, h, :k].tolist()):
                # Only a near-tie (fp32 summation order) may pick a different block than the reference.
                others = [b for b in range(nb - 1) if b not in chosen]
                worst = min(s[h, b].item() for b in chosen[1:])
                assert worst >= max(s[h, b].item() for b in others) - 1e-4 * s[h].abs().max().item(), \
                    f"token {i} head {h}: chose {row}, reference {ids_ref[i, h].tolist()}, scores {s[h].tolist()}"


@pytest.mark.parametrize("dtype", CACHE_DTYPES, ids=["bf16", "fp8"])
@pytest.mark.parametrize("step", list(STEPS))
def test_index_topk(step, dtype):
    meta, query_len, gen = make_step(step, seed=2)
    _, index = poisoned_caches(meta, dtype, gen)
    index_q = randn(meta.num_tokens, HI, DI, gen=gen)
    ids = index_topk.index_topk(index_q, index, meta.block_table, meta.seq_lens, query_len, TOPK)
    ids_ref = ref.index_topk(index_q, index, meta.block_table, meta.seq_lens, query_len, TOPK)
    check_topk(ids, ids_ref, block_scores(index_q, index, meta, query_len), TOPK)


def test_index_topk_several_chunks(monkeypatch):
    """Rows longer than SHORT: selected by groups (of one block here), the best group maxima kept across
    CHUNK-wide slices."""
    monkeypatch.setattr(index_topk, "TOPK_CHUNK", 1)  # SHORT = BLOCK_K = 4 blocks, slices of 16 x 4 = 64
    gen = torch.Generator().manual_seed(3)
    meta = build_step([200, 70], 2, block_size=BS, num_blocks=NUM_BLOCKS, generator=gen).to(DEVICE)
    _, index = poisoned_caches(meta, torch.bfloat16, gen)
    index_q = randn(meta.num_tokens, HI, DI, gen=gen)
    ids = index_topk.index_topk(index_q, index, meta.block_table, meta.seq_lens, 2, TOPK)
    ids_ref = ref.index_topk(index_q, index, meta.block_table, meta.seq_lens, 2, TOPK)
    check_topk(ids, ids_ref, block_scores(index_q, index, meta, 2), TOPK)


def topk_by_keys(scores: torch.Tensor, kv_len: list[int], topk: int) -> torch.Tensor:
    """Pass 2's contract: per row the blocks of the top-k int64 keys (order-preserving int32 of the score)
    << 32 | block, the local block's key largest, best first; -1 past the row's nb blocks."""
    n, heads, _ = scores.shape
    out = torch.full((n, heads, topk), -1, dtype=torch.int32)
    for i, length in enumerate(kv_len):
        nb = -(-max(length, 0) // BS)
        if nb:
            bits = scores[i, :, :nb].contiguous().view(torch.int32).to(torch.int64)
            ordered = torch.where(bits >= 0, bits, bits ^ 0x7FFFFFFF)
            ordered[:, nb - 1] = 2**31 - 1
            keys = (ordered << 32) | torch.arange(nb)
            out[i, :, :min(topk, nb)] = (keys.topk(min(topk, nb)).values & 0xFFFFFFFF).to(torch.int32)
    return out


def selection_rows(kind: str, gen) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
    """[n, HI, 48] scores, seq_lens and per-token kv_len for pass 2 alone (query_len 2). Rows have 0
    blocks (padding, and a first token with kv_len 0), 1, 3, 4, 5, 8, 16, 17 and 46 blocks."""
    seq_lens = torch.tensor([0, 1, 3 * BS, 4 * BS + 1, 8 * BS, 16 * BS + 1, 45 * BS + 7], dtype=torch.int32)
    kv_len = [int(s) - 2 + j + 1 for s in seq_lens for j in range(2)]
    shape = (len(kv_len), HI, 48)
    if kind == "randn":
        scores = torch.randn(shape, generator=gen)
    elif kind == "ties":  # equal scores: the higher block has the larger key
        scores = torch.randint(0, 4, shape, generator=gen).float()
    else:  # +-0, infinities, NaN of either sign and near-ties, all ordered by their key
        vals = torch.tensor([0.0, -0.0, math.inf, -math.inf, math.nan, -math.nan, 1.0, 1.0 + 2**-23, -1.0, 1e-42])
        scores = vals[torch.randint(0, len(vals), shape, generator=gen)]
    return scores, seq_lens, kv_len


# (TOPK_CHUNK, GROUP_SLICES): SHORT = max(BLOCK_K, TOPK_CHUNK), groups of SHORT / BLOCK_K blocks read in
# slices of GROUP_SLICES x SHORT: groups of one block in 16-block slices; groups of 2 (BLOCK_K 4) in slices
# of 8; groups of 4 or 2 in slices of 32 (rows of up to 46 blocks: one to six slices).
SELECT_WIDTHS = [(4, 4), (8, 1), (16, 2)]


@pytest.mark.parametrize("widths", SELECT_WIDTHS, ids=lambda w: f"short{w[0]}x{w[1]}")
@pytest.mark.parametrize("topk", [TOPK, 5])
@pytest.mark.parametrize("kind", ["randn", "ties", "special"])
def test_index_topk_selection_matches_key_order(monkeypatch, kind, topk, widths):
    """Pass 2 alone on fresh scores against the int64 key order, exactly: rows shorter than topk, one
    tl.topk of SHORT blocks and just past it, rows selected by groups in one slice and in several,
    padding rows."""
    monkeypatch.setattr(index_topk, "TOPK_CHUNK", widths[0])
    monkeypatch.setattr(index_topk, "GROUP_SLICES", widths[1])
    scores, seq_lens, kv_len = selection_rows(kind, torch.Generator().manual_seed(4))
    out = torch.empty(len(kv_len), HI, topk, dtype=torch.int32, device=DEVICE)
    index_topk._select_blocks(scores.to(DEVICE), seq_lens.to(DEVICE), out, 2, BS)
    assert torch.equal(out.cpu(), topk_by_keys(scores, kv_len, topk))


# ---- sparse / dense attention ----------------------------------------------------------------------------------


def random_selection(meta, query_len, gen, topk=TOPK) -> torch.Tensor:
    """[n, KVH, topk] block ids: the local block first, then anything: repeats, -1 and ids past the
    token's last block (all to be ignored beyond the union of valid blocks)."""
    ids = torch.randint(-1, 9, (meta.num_tokens, KVH, topk), generator=gen, dtype=torch.int32)
    for i, kv_len in enumerate(kv_lens(meta, query_len)):
        if kv_len > 0:
            ids[i, :, 0] = -(-kv_len // BS) - 1
    return ids.to(DEVICE)


def scales(dtype):
    return (0.5, 2.0) if dtype == FP8 else (1.0, 1.0)


def assert_padding_rows_zero(out, meta, query_len):
    for i, kv_len in enumerate(kv_lens(meta, query_len)):
        if kv_len <= 0:
            assert torch.equal(out[i].cpu(), torch.zeros_like(out[i].cpu())), f"padding row {i} is not zero"


@pytest.mark.parametrize("dtype", CACHE_DTYPES, ids=["bf16", "fp8"])
@pytest.mark.parametrize("step", list(STEPS))
def test_sparse_attention(step, dtype):
    meta, query_len, gen = make_step(step, seed=4)
    kv, _ = poisoned_caches(meta, dtype, gen)
    q = randn(meta.num_tokens, H, D, gen=gen)
    ids = random_selection(meta, query_len, gen)
    out = attention.sparse_attention_decode(q, kv, meta.block_table, meta.seq_lens, ids, query_len, *scales(dtype))
    expected = ref.sparse_attention(q, kv, meta.block_table, meta.seq_lens, ids, query_len, *scales(dtype))
    assert out.dtype == torch.bfloat16 and out.shape == (meta.num_tokens, H * D)
    assert_attention_close(out, expected, f"sparse attention {step}")
    assert_padding_rows_zero(out, meta, query_len)


@pytest.mark.parametrize("dtype", CACHE_DTYPES, ids=["bf16", "fp8"])
@pytest.mark.parametrize("step", ["n1_q1", "n4_q2", "n8_q4"])  # same kernel as sparse: a lighter sweep
def test_dense_attention(step, dtype):
    meta, query_len, gen = make_step(step, seed=5)
    kv, _ = poisoned_caches(meta, dtype, gen)
    q = randn(meta.num_tokens, H, D, gen=gen)
    out = attention.dense_attention_decode(q, kv, meta.block_table, meta.seq_lens, query_len, *scales(dtype))
    expected = ref.dense_attention(q, kv, meta.block_table, meta.seq_lens, query_len, *scales(dtype))
    assert_attention_close(out, expected, f"dense attention {step}")
    assert_padding_rows_zero(out, meta, query_len)


@pytest.mark.parametrize("num_splits", [1, 3, 40])
def test_attention_split_merge(num_splits):
    """Forced split counts: one split, uneven splits, and more splits than tiles (empty partials)."""
    meta, query_len, gen = make_step("n4_q2", seed=6)
    kv, _ = poisoned_caches(meta, torch.bfloat16, gen)
    q = randn(meta.num_tokens, H, D, gen=gen)
    ids = random_selection(meta, query_len, gen)
    args = (meta.block_table, meta.seq_lens)
    dense = attention.dense_attention_decode(q, kv, *args, query_len, num_splits=num_splits)
    assert_attention_close(dense, ref.dense_attention(q, kv, *args, query_len), f"dense, {num_splits} splits")
    sparse = attention.sparse_attention_decode(q, kv, *args, ids, query_len, num_splits=num_splits)
    assert_attention_close(sparse, ref.sparse_attention(q, kv, *args, ids, query_len), f"sparse, {num_splits} splits")


def test_sparse_attention_with_all_blocks_is_dense():
    """topk >= the number of blocks: the sparse kernel over every block is the dense kernel. With one
    split both walk the same tiles in the same order, so the results agree bit for bit."""
    meta, query_len, gen = make_step("n4_q1", seed=7)
    kv, _ = poisoned_caches(meta, FP8, gen)
    q = randn(meta.num_tokens, H, D, gen=gen)
    width = meta.block_table.shape[1]
    every = torch.arange(width, dtype=torch.int32, device=DEVICE).expand(meta.num_tokens, KVH, width).contiguous()
    args = (meta.block_table, meta.seq_lens)
    sparse = attention.sparse_attention_decode(q, kv, *args, every, query_len, 0.5, 2.0, num_splits=1)
    dense = attention.dense_attention_decode(q, kv, *args, query_len, 0.5, 2.0, num_splits=1)
    assert torch.equal(sparse, dense)
    assert_attention_close(dense, ref.dense_attention(q, kv, *args, query_len, 0.5, 2.0), "dense vs reference")


def test_attention_rejects_bad_inputs():
    meta, query_len, gen = make_step("n4_q2", seed=8)
    kv, _ = poisoned_caches(meta, torch.bfloat16, gen)
    q = randn(meta.num_tokens, H, D, gen=gen)
    with pytest.raises(ValueError, match="block_ids: expected an int32"):
        attention.sparse_attention_decode(q, kv, meta.block_table, meta.seq_lens,
                                          torch.zeros(meta.num_tokens, KVH, TOPK, dtype=torch.int64, device=DEVICE),
                                          query_len)
    with pytest.raises(ValueError, match="q: expected 2 requests x query_len=1"):
        attention.dense_attention_decode(q, kv, meta.block_table, meta.seq_lens, 1)


# ---- sparse attention with the indexer's top-k made in-kernel ----------------------------------------------


def index_attention_inputs(step: str, dtype, seed: int):
    meta, query_len, gen = make_step(step, seed=seed)
    kv, index = poisoned_caches(meta, dtype, gen)
    return meta, query_len, kv, index, randn(meta.num_tokens, H, D, gen=gen), randn(meta.num_tokens, HI, DI, gen=gen)


def check_index_sparse_attention(meta, query_len, kv, index, q, index_q, topk, dtype, what):
    """index_scores + index_sparse_attention_decode against index_topk + sparse_attention_decode (bit for
    bit with one split: the same tiles in the same order; close with the default splits) and against the
    reference indexer + attention."""
    args = (meta.block_table, meta.seq_lens)
    scores = index_topk.index_scores(index_q, index, *args, query_len)
    assert scores.dtype == torch.float32 and scores.shape == (meta.num_tokens, HI, meta.block_table.shape[1])
    ids = index_topk.index_topk(index_q, index, *args, query_len, topk)
    check_topk(ids, ref.index_topk(index_q, index, *args, query_len, topk),
               block_scores(index_q, index, meta, query_len), topk)
    out = attention.index_sparse_attention_decode(q, scores, kv, *args, query_len, topk, *scales(dtype))
    assert out.dtype == torch.bfloat16 and out.shape == (meta.num_tokens, H * D)
    two_step = attention.sparse_attention_decode(q, kv, *args, ids, query_len, *scales(dtype))
    assert_attention_close(out, two_step.float(), f"{what}: vs index_topk + sparse_attention_decode")
    one = attention.index_sparse_attention_decode(q, scores, kv, *args, query_len, topk, *scales(dtype), num_splits=1)
    assert torch.equal(one, attention.sparse_attention_decode(q, kv, *args, ids, query_len, *scales(dtype),
                                                              num_splits=1)), f"{what}: one split"
    ids_ref = ref.index_topk(index_q, index, *args, query_len, topk)
    expected = ref.sparse_attention(q, kv, *args, ids_ref, query_len, *scales(dtype))
    assert_attention_close(out, expected, f"{what}: vs reference")
    assert_padding_rows_zero(out, meta, query_len)


@pytest.mark.parametrize("dtype", CACHE_DTYPES, ids=["bf16", "fp8"])
@pytest.mark.parametrize("step", list(STEPS))
def test_index_sparse_attention(step, dtype):
    """Query lengths 1, 2 and 4, several requests, padding rows, tokens with fewer than TOPK blocks."""
    meta, query_len, kv, index, q, index_q = index_attention_inputs(step, dtype, seed=10)
    check_index_sparse_attention(meta, query_len, kv, index, q, index_q, TOPK, dtype, step)


@pytest.mark.parametrize("topk", [2, 3, 6])
def test_index_sparse_attention_topk(topk):
    """top-k below its power-of-two width (entries past topk must not be walked) and above most rows' nb."""
    meta, query_len, kv, index, q, index_q = index_attention_inputs("n8_q2", FP8, seed=11)
    check_index_sparse_attention(meta, query_len, kv, index, q, index_q, topk, FP8, f"topk {topk}")


@pytest.mark.parametrize("dtype", CACHE_DTYPES, ids=["bf16", "fp8"])
def test_index_sparse_attention_several_chunks(monkeypatch, dtype):
    """Rows longer than SHORT: the in-kernel selection goes by groups, as index_topk's pass 2."""
    monkeypatch.setattr(index_topk, "TOPK_CHUNK", 1)  # SHORT = BLOCK_K = 4 blocks; rows of 5-14
    gen = torch.Generator().manual_seed(12)
    meta = build_step([200, 70], 2, block_size=BS, num_blocks=NUM_BLOCKS, pad_requests=1, generator=gen).to(DEVICE)
    kv, index = poisoned_caches(meta, dtype, gen)
    q, index_q = randn(meta.num_tokens, H, D, gen=gen), randn(meta.num_tokens, HI, DI, gen=gen)
    check_index_sparse_attention(meta, 2, kv, index, q, index_q, TOPK, dtype, "chunks")


@pytest.mark.parametrize("widths", SELECT_WIDTHS[1:], ids=lambda w: f"short{w[0]}x{w[1]}")
@pytest.mark.parametrize("kind", ["randn", "ties", "special"])
def test_index_sparse_attention_selection_is_index_topks(monkeypatch, kind, widths):
    """Fresh block scores (ties, +-0, infinities, NaN) into both paths: the in-kernel selection walks
    exactly the blocks of index_topk's pass 2, so one split gives the same bits. Rows of 0 to 46 blocks
    over the one-slice and the grouped selections: rows of up to PAGES (4) blocks take their pages (a
    random table) from those read before the wait (PAGES_FIRST), longer rows read them after the selection."""
    monkeypatch.setattr(index_topk, "TOPK_CHUNK", widths[0])
    monkeypatch.setattr(index_topk, "GROUP_SLICES", widths[1])
    monkeypatch.setattr(attention, "NEAR_PAGES", 4)
    gen = torch.Generator().manual_seed(13)
    scores, seq_lens, kv_len = selection_rows(kind, gen)
    n, width = len(kv_len), scores.shape[2]
    table = torch.randint(0, NUM_BLOCKS, (seq_lens.shape[0], width), generator=gen, dtype=torch.int32)
    kv = torch.randn(NUM_BLOCKS, KVH, BS, 2 * D, generator=gen).to(torch.bfloat16).to(DEVICE)
    q = randn(n, H, D, gen=gen)
    scores, seq_lens, table = scores.to(DEVICE), seq_lens.to(DEVICE), table.to(DEVICE)
    ids = torch.empty(n, HI, TOPK, dtype=torch.int32, device=DEVICE)
    index_topk._select_blocks(scores, seq_lens, ids, 2, BS)
    out = attention.index_sparse_attention_decode(q, scores, kv, table, seq_lens, 2, TOPK, num_splits=1)
    assert torch.equal(out, attention.sparse_attention_decode(q, kv, table, seq_lens, ids, 2, num_splits=1))
    assert out.float().abs().amax(-1).gt(0).tolist() == [length > 0 for length in kv_len]


@pytest.mark.parametrize("num_splits", [1, 3, 40])
def test_index_sparse_attention_splits(num_splits):
    """Forced split counts: one, uneven, and more splits than the selection's tiles (empty partials)."""
    meta, query_len, kv, index, q, index_q = index_attention_inputs("n4_q1", torch.bfloat16, seed=14)
    args = (meta.block_table, meta.seq_lens)
    scores = index_topk.index_scores(index_q, index, *args, query_len)
    out = attention.index_sparse_attention_decode(q, scores, kv, *args, query_len, TOPK, num_splits=num_splits)
    expected = ref.sparse_attention(q, kv, *args, ref.index_topk(index_q, index, *args, query_len, TOPK), query_len)
    assert_attention_close(out, expected, f"{num_splits} splits")


@pytest.mark.parametrize("no_select", [False, True], ids=["select", "no_select"])
def test_kernel_stage_index_sparse_attention(monkeypatch, no_select):
    """decode_layer's combined stage: the score pass and the selecting attention, or with
    MINIMAX_OPS_NO_ATTN_SELECT=1 (read at the call) index_topk + sparse_attention_decode; same result."""
    from minimax_ops.kernels.decode_layer import kernel_stages
    stages = kernel_stages()  # built before the switch is set: it must be read when the stage runs
    if no_select:
        monkeypatch.setenv("MINIMAX_OPS_NO_ATTN_SELECT", "1")
    else:
        monkeypatch.delenv("MINIMAX_OPS_NO_ATTN_SELECT", raising=False)
    calls = []
    for module, name in ((attention, "index_sparse_attention_decode"), (attention, "sparse_attention_decode"),
                         (index_topk, "index_topk"), (index_topk, "index_scores")):
        real = getattr(module, name)
        monkeypatch.setattr(module, name, lambda *a, _real=real, _name=name, **k: calls.append(_name) or _real(*a, **k))
    meta, query_len, kv, index, q, index_q = index_attention_inputs("n4_q2", FP8, seed=15)
    args = (meta.block_table, meta.seq_lens, query_len, TOPK, *scales(FP8))
    out = stages.index_sparse_attention(q, index_q, kv, index, *args)
    assert calls == (["index_topk", "sparse_attention_decode"] if no_select
                     else ["index_scores", "index_sparse_attention_decode"])
    expected = ref.sparse_attention(q, kv, meta.block_table, meta.seq_lens,
                                    ref.index_topk(index_q, index, meta.block_table, meta.seq_lens, query_len, TOPK),
                                    query_len, *scales(FP8))
    assert_attention_close(out, expected, "combined stage")


def test_index_sparse_attention_rejects_bad_inputs():
    meta, query_len, kv, index, q, index_q = index_attention_inputs("n4_q2", torch.bfloat16, seed=16)
    args = (meta.block_table, meta.seq_lens)
    scores = index_topk.index_scores(index_q, index, *args, query_len)
    n, width = meta.num_tokens, meta.block_table.shape[1]
    shape = rf"\[{n}, {KVH}, {width}\]"
    for bad in (scores.to(torch.bfloat16), scores[:, :1], scores[:, :, :-1], scores[:-1],
                scores.transpose(1, 2).contiguous().transpose(1, 2)):
        with pytest.raises(ValueError, match=rf"scores: expected an fp32 {shape}"):
            attention.index_sparse_attention_decode(q, bad, kv, *args, query_len, TOPK)
    with pytest.raises(ValueError, match="topk: expected >= 1, got 0"):
        attention.index_sparse_attention_decode(q, scores, kv, *args, query_len, 0)
    with pytest.raises(ValueError, match="q: expected 2 requests x query_len=1"):
        attention.index_sparse_attention_decode(q, scores, kv, *args, 1, TOPK)
    with pytest.raises(ValueError, match="kv_cache: expected a bf16/fp8"):
        attention.index_sparse_attention_decode(q, scores, kv.float(), *args, query_len, TOPK)
    with pytest.raises(ValueError, match="index_q: expected a bf16"):
        index_topk.index_scores(index_q.float(), index, *args, query_len)
    with pytest.raises(ValueError, match="seq_lens: expected int32"):
        index_topk.index_scores(index_q, index, meta.block_table, meta.seq_lens.long(), query_len)


# ---- AOT specs -------------------------------------------------------------------------------------------


@pytest.mark.parametrize("module", [norm, qk_norm_rope, index_topk, attention], ids=lambda m: m.__name__)
def test_aot_specs_cover_every_kernel(module):
    """Every @triton.jit kernel is listed, each spec names exactly the kernel's arguments."""
    specs = module.aot_specs()
    kernels = {name for name, obj in vars(module).items() if name.endswith("_kernel") and hasattr(obj, "arg_names")}
    assert kernels and kernels == {s.kernel.__name__ for s in specs}
    for spec in specs:
        args = set(spec.kernel.arg_names)
        assert set(spec.signature) | set(spec.constexprs) == args, spec.label()
        assert not set(spec.signature) & set(spec.constexprs), spec.label()
        assert all(not math.isnan(v) for v in spec.constexprs.values() if isinstance(v, float))
