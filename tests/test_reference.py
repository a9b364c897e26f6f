"""The oracle itself (reference.py, reference_model.py), checked against independent float64 math and
against its own invariants: causality, padding, prefill/decode agreement, router and expert algebra."""

import math

import pytest
import torch

from minimax_ops import reference as ref
from minimax_ops import reference_model as rm
from minimax_ops.cache import allocate_caches, build_step, request_block_ids
from minimax_ops.config import preset
from minimax_ops.formats import dequantize, quantize
from minimax_ops.weights import SHARED_IN_TABLE, SHARED_SEPARATE, random_layer_weights, random_model_weights
from utils import rel_err

CFG = preset("tiny")  # 8 q heads / 2 kv heads, head_dim 32, rotary 16, 16-token blocks, top-4
BS = CFG.sparse_block_size
D = CFG.head_dim
H, KVH = CFG.num_attention_heads, CFG.num_key_value_heads
SPARSE_LAYER = CFG.num_hidden_layers - 1
DENSE_LAYER = 0


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _random_kv(num_blocks: int, gen: torch.Generator, dtype=torch.bfloat16) -> torch.Tensor:
    return torch.randn(num_blocks, KVH, BS, 2 * D, generator=gen).to(dtype)


def _spans(meta):
    """(token, request, position) of every token, request-major; padding requests give position -1."""
    out, i = [], 0
    for r, q in enumerate(meta.query_lens):
        seq = int(meta.seq_lens[r])
        for j in range(q):
            out.append((i, r, seq - q + j if seq > 0 else -1))
            i += 1
    return out


def _logical_rows(cache: torch.Tensor, table_row: torch.Tensor, length: int) -> torch.Tensor:
    """Positions 0..length-1 of one request, read through its block table, float64."""
    pos = torch.arange(length)
    pages = table_row.long()[pos // BS]
    rows = cache[pages, :, pos % BS] if cache.dim() == 4 else cache[pages, pos % BS]
    return rows.double()


def _attention64(q, kv, meta, *, blocks=None, k_scale=1.0, v_scale=1.0):
    """Causal GQA attention in float64 from first principles; blocks(i, kv_head) -> allowed logical
    blocks (None: all)."""
    out = torch.zeros(q.shape, dtype=torch.float64)
    group = H // KVH
    for i, r, pos in _spans(meta):
        if pos < 0:
            continue
        rows = _logical_rows(kv, meta.block_table[r], pos + 1)
        for h in range(H):
            kvh = h // group
            keys, vals = rows[:, kvh, :D] * k_scale, rows[:, kvh, D:] * v_scale
            s = keys @ q[i, h].double() / math.sqrt(D)
            if blocks is not None:
                ok = torch.tensor([p // BS in blocks(i, kvh) for p in range(pos + 1)])
                s = s.masked_fill(~ok, -math.inf)
            out[i, h] = torch.softmax(s, -1) @ vals
    return out


def _index_topk64(index_q, index_cache, meta, topk):
    """Lightning indexer from first principles: local block first, then the others by max dot score."""
    n, heads, _ = index_q.shape
    out = torch.full((n, heads, topk), -1, dtype=torch.int32)
    for i, r, pos in _spans(meta):
        if pos < 0:
            continue
        nb = pos // BS + 1
        keys = _logical_rows(index_cache, meta.block_table[r], pos + 1)
        for h in range(heads):
            dots = keys @ index_q[i, h].double()
            score = [dots[b * BS:(b + 1) * BS].max().item() for b in range(nb - 1)]
            order = [nb - 1] + sorted(range(nb - 1), key=lambda b: -score[b])
            out[i, h, :min(topk, nb)] = torch.tensor(order[:topk], dtype=torch.int32)
    return out


# ---- elementwise pieces ------------------------------------------------------------------------------


def test_gemma_rmsnorm_matches_float64():
    g = _gen(0)
    for scale, eps in ((1.0, 1e-6), (300.0, 1e-6), (1e-3, 1e-2)):
        x = (torch.randn(7, 96, generator=g) * scale).bfloat16()
        w = (torch.randn(96, generator=g) * 0.3).bfloat16()
        x64 = x.double()
        want = x64 / torch.sqrt(x64.pow(2).mean(-1, keepdim=True) + eps) * (1 + w.double())
        got = ref.gemma_rmsnorm(x, w, eps)
        assert got.dtype == torch.float32
        assert torch.allclose(got.double(), want, rtol=1e-5, atol=1e-6 * want.abs().max().item())


def test_swiglu_oai_clamps_as_specified():
    g = _gen(1)
    gate = torch.randn(5, 64, generator=g) * 8
    up = torch.randn(5, 64, generator=g) * 8
    g64 = gate.double().clamp(max=7.0)
    want = g64 * torch.sigmoid(1.702 * g64) * (up.double().clamp(-7.0, 7.0) + 1)
    assert torch.allclose(ref.swiglu_oai(gate, up).double(), want, rtol=1e-5, atol=1e-6)
    # Gate clamps only from above, up on both sides.
    t = lambda *v: torch.tensor(v)  # noqa: E731
    got = ref.swiglu_oai(t(100.0, 100.0, -3.0, -3.0, 2.0), t(100.0, -100.0, 100.0, 0.5, -7.5))
    sig = lambda v: 1 / (1 + math.exp(-1.702 * v))  # noqa: E731
    want = [7 * sig(7) * 8, 7 * sig(7) * -6, -3 * sig(-3) * 8, -3 * sig(-3) * 1.5, 2 * sig(2) * -6]
    assert torch.allclose(got.double(), torch.tensor(want, dtype=torch.float64), rtol=1e-6)
    # Another alpha / limit.
    got = ref.swiglu_oai(gate, up, alpha=1.0, limit=3.0)
    g3 = gate.double().clamp(max=3.0)
    assert torch.allclose(got.double(), g3 * torch.sigmoid(g3) * (up.double().clamp(-3, 3) + 1), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("rotary_dim,head_dim,theta", [(16, 32, 10000.0), (64, 128, 5e6)])
def test_rope_partial_and_complex_form(rotary_dim, head_dim, theta):
    g = _gen(2)
    positions = torch.tensor([0, 1, 2, 17, 4095, 123_457, 2**20 - 1])
    x = torch.randn(len(positions), 3, head_dim, generator=g)
    got = ref.apply_partial_rope(x, positions, rotary_dim, theta)
    # Dims >= rotary_dim pass through bit for bit; position 0 is the identity.
    assert torch.equal(got[..., rotary_dim:], x[..., rotary_dim:])
    assert torch.equal(got[0], x[0])
    # NeoX pairs (i, i + r/2) rotate as complex numbers by pos * theta^(-2i/r).
    half = rotary_dim // 2
    x64 = x.double()
    pairs = torch.view_as_complex(torch.stack([x64[..., :half], x64[..., half:rotary_dim]], -1).contiguous())
    inv_freq = theta ** (-2.0 * torch.arange(half, dtype=torch.float64) / rotary_dim)
    angle = positions.double()[:, None] * inv_freq
    rotated = pairs * torch.polar(torch.ones_like(angle), angle)[:, None, :]
    want = torch.cat([rotated.real, rotated.imag], -1)
    assert torch.allclose(got[..., :rotary_dim].double(), want, rtol=1e-5, atol=1e-5)
    # A rotation: pair norms unchanged.
    got_pairs = got[..., :half].double() ** 2 + got[..., half:rotary_dim].double() ** 2
    assert torch.allclose(got_pairs, pairs.abs() ** 2, rtol=1e-5)


def test_linear_matches_dequantized_weights():
    g = _gen(3)
    x = torch.randn(5, 64, generator=g).bfloat16()
    w = torch.randn(48, 64, generator=g)
    for fmt in ("bf16", "mxfp8", "mxfp4"):
        qw, qs = quantize(w, fmt)
        want = x.double() @ dequantize(qw, qs).double().T
        assert rel_err(ref.linear(x, qw, qs), want) < 1e-6


# ---- attention -----------------------------------------------------------------------------------------


def _step(context_lens, q, *, seed, num_blocks=40, pad=0):
    return build_step(context_lens, q, block_size=BS, num_blocks=num_blocks, pad_requests=pad, generator=_gen(seed))


@pytest.mark.parametrize("kv_dtype,k_scale,v_scale", [(torch.bfloat16, 1.0, 1.0), (torch.float8_e4m3fn, 0.5, 2.0)])
def test_dense_attention_matches_float64(kv_dtype, k_scale, v_scale):
    g = _gen(4)
    meta = _step([5, 40, 77, 16], 3, seed=4, pad=1)
    kv = _random_kv(40, g, kv_dtype)
    q = torch.randn(meta.num_tokens, H, D, generator=g)
    got = ref.dense_attention(q, kv, meta.block_table, meta.seq_lens, 3, k_scale, v_scale)
    want = _attention64(q, kv, meta, k_scale=k_scale, v_scale=v_scale)
    assert rel_err(got, want) < 1e-5
    assert (got[-3:] == 0).all()  # padding rows


def test_sparse_attention_with_all_blocks_equals_dense():
    g = _gen(5)
    meta = _step([5, 40, 77, 16], 3, seed=5, pad=1)
    kv = _random_kv(40, g)
    index = torch.randn(40, BS, D, generator=g).bfloat16()
    q = torch.randn(meta.num_tokens, H, D, generator=g)
    index_q = torch.randn(meta.num_tokens, KVH, D, generator=g)
    # top-k wide enough for every block of the longest sequence (80 tokens -> 5 blocks).
    ids = ref.index_topk(index_q, index, meta.block_table, meta.seq_lens, 3, 8)
    for i, r, pos in _spans(meta):
        if pos >= 0:
            nb = pos // BS + 1
            assert sorted(ids[i, 0, :nb].tolist()) == list(range(nb)) and (ids[i, :, nb:] == -1).all()
    sparse = ref.sparse_attention(q, kv, meta.block_table, meta.seq_lens, ids, 3)
    dense = ref.dense_attention(q, kv, meta.block_table, meta.seq_lens, 3)
    assert torch.allclose(sparse, dense, rtol=1e-5, atol=1e-6)
    assert rel_err(dense, _attention64(q, kv, meta)) < 1e-5


def test_sparse_attention_attends_only_selected_blocks():
    g = _gen(6)
    meta = _step([70, 100], 2, seed=6)
    kv = _random_kv(40, g)
    q = torch.randn(meta.num_tokens, H, D, generator=g)
    ids = torch.full((meta.num_tokens, KVH, 4), -1, dtype=torch.int32)
    for i, r, pos in _spans(meta):
        for h in range(KVH):
            nb = pos // BS + 1
            pick = torch.randperm(nb - 1, generator=g)[:2].tolist() + [nb - 1]
            ids[i, h, :3] = torch.tensor(pick, dtype=torch.int32)
            ids[i, h, 3] = nb + 2  # a future block id must be ignored
    got = ref.sparse_attention(q, kv, meta.block_table, meta.seq_lens, ids, 2)
    allowed = lambda i, h: {b for b in ids[i, h].tolist() if b >= 0}  # noqa: E731
    want = _attention64(q, kv, meta, blocks=allowed)
    assert rel_err(got, want) < 1e-5
    assert rel_err(got, ref.dense_attention(q, kv, meta.block_table, meta.seq_lens, 2)) > 1e-2


# ---- indexer --------------------------------------------------------------------------------------------


def _planted_index(meta, num_blocks, gen, huge):
    """Index keys whose dot with the unit vector e_h is known: column h is negative everywhere except
    one position per (request, block) with a distinct positive integer, and `huge` at each request's
    last written position and in the unwritten tail of its last block (future / stale slots)."""
    cache = torch.randn(num_blocks, BS, D, generator=gen)
    cache[..., :KVH] = -(1 + 9 * torch.rand(num_blocks, BS, KVH, generator=gen))
    for r, seq in enumerate(meta.seq_lens.tolist()):
        if seq <= 0:
            continue
        nb = -(-seq // BS)
        table = meta.block_table[r].tolist()
        for h in range(KVH):
            planted = torch.randperm(nb, generator=gen) + 1
            for b in range(nb):
                off = int(torch.randint(0, min(BS, seq - b * BS), (1,), generator=gen))
                cache[table[b], off, h] = float(planted[b])
            cache[table[nb - 1], (seq - 1) % BS:, h] = huge
    return cache


@pytest.mark.parametrize("index_dtype,huge", [(torch.bfloat16, 1000.0), (torch.float8_e4m3fn, 384.0)])
def test_index_topk_picks_best_blocks_causally(index_dtype, huge):
    g = _gen(7)
    # Requests whose 2-3 token steps cross block boundaries (79 -> 80, 15 -> 16), fewer blocks than
    # top-k (3 tokens), long ones (150 tokens, 10 blocks), plus a padding row.
    meta = build_step([79, 15, 3, 150, 40], [3, 3, 3, 3, 3], block_size=BS, num_blocks=48, pad_requests=1,
                      generator=g)
    cache = _planted_index(meta, 48, g, huge).to(index_dtype)
    index_q = torch.eye(KVH, D).expand(meta.num_tokens, KVH, D).contiguous()  # head h reads column h
    topk = CFG.sparse_topk_blocks
    ids = ref.index_topk(index_q, cache, meta.block_table, meta.seq_lens, 3, topk)
    assert ids.dtype == torch.int32 and ids.shape == (meta.num_tokens, KVH, topk)
    assert torch.equal(ids, _index_topk64(index_q, cache, meta, topk))
    for i, r, pos in _spans(meta):
        if pos < 0:
            assert (ids[i] == -1).all()
            continue
        nb = pos // BS + 1
        assert (ids[i, :, 0] == nb - 1).all(), "local block not first"
        assert (ids[i] < nb).all(), "a future block was selected"
        k = min(topk, nb)
        assert (ids[i, :, k:] == -1).all() and (ids[i, :, :k] >= 0).all()
        for h in range(KVH):
            assert len(set(ids[i, h, :k].tolist())) == k
    # The step crossing 79 -> 80: token 0 has 5 blocks and must not see block 5 (which holds `huge`).
    assert 5 not in ids[0].tolist() and (ids[1, :, 0] == 5).all()
    # 15 -> 16: token 0 has one block only.
    assert ids[3].tolist() == [[0, -1, -1, -1]] * KVH
    # Heads choose independently (different planted scores): somewhere they differ.
    assert any(ids[i, 0, 1:].tolist() != ids[i, 1, 1:].tolist() for i in range(9, 12))


def test_index_topk_keeps_local_block_even_when_worst():
    g = _gen(8)
    meta = build_step([100, 60, 33], 1, block_size=BS, num_blocks=32, generator=g)
    cache = torch.randn(32, BS, D, generator=g)
    for r, seq in enumerate(meta.seq_lens.tolist()):
        cache[meta.block_table[r, (seq - 1) // BS]] = -50.0  # every key of the local block
    index_q = torch.rand(meta.num_tokens, KVH, D, generator=g) + 0.5  # positive: local dots ~ -50*D
    ids = ref.index_topk(index_q, cache.bfloat16(), meta.block_table, meta.seq_lens, 1, 4)
    for i, r, pos in _spans(meta):
        assert (ids[i, :, 0] == pos // BS).all()
    assert torch.equal(ids, _index_topk64(index_q, cache.bfloat16(), meta, 4))


def test_index_topk_random_keys_match_float64():
    g = _gen(9)
    meta = build_step([200, 64, 17], [2, 1, 4], block_size=BS, num_blocks=32, generator=g)
    cache = torch.randn(32, BS, D, generator=g).bfloat16()
    index_q = torch.randn(meta.num_tokens, KVH, D, generator=g)
    ids = ref.index_topk(index_q, cache, meta.block_table, meta.seq_lens, 0, 4, query_lens=[2, 1, 4])
    assert torch.equal(ids, _index_topk64(index_q, cache, meta, 4))


# ---- multi-token steps: each token sees its own prefix --------------------------------------------------


def test_later_cache_contents_do_not_change_earlier_tokens():
    g = _gen(10)
    q_len = 4
    meta = _step([44, 90], q_len, seed=10)  # 44..47 then 48 (new block); 90..93
    kv = _random_kv(40, g)
    index = torch.randn(40, BS, D, generator=g).bfloat16()
    q = torch.randn(meta.num_tokens, H, D, generator=g)
    index_q = torch.randn(meta.num_tokens, KVH, D, generator=g)

    def run(kv, index):
        ids = ref.index_topk(index_q, index, meta.block_table, meta.seq_lens, q_len, 2)
        return (ids, ref.sparse_attention(q, kv, meta.block_table, meta.seq_lens, ids, q_len),
                ref.dense_attention(q, kv, meta.block_table, meta.seq_lens, q_len))

    base = run(kv, index)
    for i, r, pos in _spans(meta):
        kv2, index2 = kv.clone(), index.clone()
        # Overwrite every slot of request r after token i's position (this step's later tokens and
        # stale tail slots) with large values.
        table = meta.block_table[r].long()
        for p in range(pos + 1, int(meta.seq_lens[r]) // BS * BS + BS):
            kv2[table[p // BS], :, p % BS] = 30.0
            index2[table[p // BS], p % BS] = 30.0
        out = run(kv2, index2)
        for a, b in zip(base, out):
            assert torch.equal(a[i], b[i]), f"token {i} (position {pos}) saw a later position"
        if pos < int(meta.seq_lens[r]) - 1:  # the request's last token does see the change
            last = i + int(meta.seq_lens[r]) - 1 - pos
            assert not torch.equal(base[2][last], out[2][last])


@pytest.mark.parametrize("layer", [DENSE_LAYER, SPARSE_LAYER])
def test_multi_token_step_equals_one_token_at_a_time(layer):
    g = _gen(11)
    w = random_layer_weights(CFG, layer, generator=g)
    q_len, ctx = 3, [62, 20, 90]  # 62..64 crosses into block 4
    meta = build_step(ctx, q_len, block_size=BS, num_blocks=40, generator=g)
    blocks = request_block_ids(meta, BS)
    caches = allocate_caches(CFG, 40, generator=g)[layer]
    h = torch.randn(meta.num_tokens, CFG.hidden_size, generator=g)
    one = caches.clone()
    together = rm.attention_block(h, w, caches, meta, CFG, act_dtype=None)
    for j in range(q_len):
        step = build_step([c + j for c in ctx], 1, block_size=BS, num_blocks=40, block_ids=blocks)
        rows = torch.arange(len(ctx)) * q_len + j
        single = rm.attention_block(h[rows], w, one, step, CFG, act_dtype=None)
        assert rel_err(single, together[rows]) < 1e-5, f"token {j} of each request differs"
    # Same caches afterwards (up to a bf16 rounding flip from fp32 matmul order).
    assert torch.allclose(one.kv.float(), caches.kv.float(), rtol=1e-2, atol=1e-2)
    if one.index is not None:
        assert torch.allclose(one.index.float(), caches.index.float(), rtol=1e-2, atol=1e-2)


# ---- padding rows ------------------------------------------------------------------------------------


@pytest.mark.parametrize("cache_dtype", [torch.bfloat16, torch.float8_e4m3fn])
def test_padding_rows_leave_caches_byte_identical(cache_dtype):
    g = _gen(12)
    c, layer = CFG, SPARSE_LAYER
    w = random_layer_weights(c, layer, generator=g)
    real = build_step([30, 7], 2, block_size=BS, num_blocks=16, generator=_gen(13))
    padded = build_step([30, 7], 2, block_size=BS, num_blocks=16, generator=_gen(13), pad_requests=3)
    assert torch.equal(padded.block_table[:2], real.block_table)
    base = allocate_caches(c, 16, kv_dtype=cache_dtype, index_dtype=cache_dtype, generator=g)[layer]
    qkv = torch.randn(padded.num_tokens, c.qkv_size(layer), generator=g) * 3

    def insert(meta, rows, cache):
        return ref.qk_norm_rope_insert(
            qkv[:rows], meta.positions, meta.slot_mapping, meta.index_slot_mapping, w.q_norm, w.k_norm,
            w.index_q_norm, w.index_k_norm, cache.kv, cache.index, num_heads=c.num_attention_heads,
            num_kv_heads=c.num_key_value_heads, head_dim=c.head_dim, rotary_dim=c.rotary_dim,
            rope_theta=c.rope_theta, eps=c.rms_norm_eps, index_heads=c.sparse_num_index_heads,
            index_dim=c.sparse_index_dim)

    a, b = base.clone(), base.clone()
    qa, iqa = insert(real, 4, a)
    qb, iqb = insert(padded, padded.num_tokens, b)
    assert torch.equal(a.kv.view(torch.uint8), b.kv.view(torch.uint8))
    assert torch.equal(a.index.view(torch.uint8), b.index.view(torch.uint8))
    assert torch.equal(qa, qb[:4]) and torch.equal(iqa, iqb[:4])
    # The real rows did write, and only at their slots.
    written = torch.zeros(16 * BS, dtype=torch.bool)
    written[real.slot_mapping] = True
    changed_kv = (a.kv.view(torch.uint8) != base.kv.view(torch.uint8)).any(-1).any(1).flatten()
    changed_index = (a.index.view(torch.uint8) != base.index.view(torch.uint8)).any(-1).flatten()
    assert torch.equal(changed_kv, written) and torch.equal(changed_index, written)
    # A step of padding rows only writes nothing; the layer's outputs there are zero / -1.
    only_pad = build_step([], 2, block_size=BS, num_blocks=16, pad_requests=2)
    d = base.clone()
    h = torch.randn(only_pad.num_tokens, c.hidden_size, generator=g)
    out = rm.attention_block(h, w, d, only_pad, c)
    assert torch.equal(d.kv.view(torch.uint8), base.kv.view(torch.uint8))
    assert torch.equal(d.index.view(torch.uint8), base.index.view(torch.uint8))
    assert torch.isfinite(out).all()


def test_padding_rows_in_a_whole_layer_step():
    g = _gen(14)
    w = random_layer_weights(CFG, SPARSE_LAYER, generator=g)
    meta = build_step([30, 70], 1, block_size=BS, num_blocks=16, generator=_gen(15), pad_requests=2)
    base = allocate_caches(CFG, 16, kv_dtype=torch.float8_e4m3fn, generator=g)[SPARSE_LAYER]
    cache = base.clone()
    h = torch.randn(meta.num_tokens, CFG.hidden_size, generator=g)
    out = rm.attention_block(h, w, cache, meta, CFG)
    written = torch.zeros(16 * BS, dtype=torch.bool)
    written[meta.slot_mapping[meta.slot_mapping >= 0]] = True
    changed = (cache.kv.view(torch.uint8) != base.kv.view(torch.uint8)).any(-1).any(1).flatten()
    assert torch.equal(changed, written)
    assert torch.isfinite(out).all()
    # Real rows do not depend on the padding rows' inputs.
    h2 = h.clone()
    h2[2:] = torch.randn(2, CFG.hidden_size, generator=g) * 10
    out2 = rm.attention_block(h2, w, base.clone(), meta, CFG)
    assert torch.allclose(out2[:2], out[:2], rtol=1e-2, atol=1e-2)


# ---- whole model: prefill then decode == one longer prefill -----------------------------------------------


def test_decode_after_prefill_equals_longer_prefill():
    g = _gen(16)
    weights = random_model_weights(CFG, generator=g)
    length = 80  # 81 tokens = 6 blocks > top-4: the indexer really chooses
    tokens = torch.randint(0, CFG.vocab_size, (length + 2,), generator=g)
    num_blocks = 12

    full_meta = build_step([0], [length + 2], block_size=BS, num_blocks=num_blocks, generator=_gen(17))
    full = rm.model_forward(tokens, weights, allocate_caches(CFG, num_blocks, fill="nan"), full_meta, CFG,
                            act_dtype=None)
    assert torch.isfinite(full).all()

    caches = allocate_caches(CFG, num_blocks, fill="nan")  # NaN poison: any unwritten read shows
    pre = build_step([0], [length], block_size=BS, num_blocks=num_blocks, generator=_gen(18))
    prefill = rm.model_forward(tokens[:length], weights, caches, pre, CFG, act_dtype=None)
    assert rel_err(prefill, full[:length]) < 1e-4
    # One decode token, with a padding request alongside.
    dec = build_step([length], 1, block_size=BS, num_blocks=num_blocks, pad_requests=1,
                     block_ids=request_block_ids(pre, BS))
    ids = torch.cat([tokens[length:length + 1], torch.randint(0, CFG.vocab_size, (1,), generator=g)])
    logits = rm.model_forward(ids, weights, caches, dec, CFG, act_dtype=None)
    assert rel_err(logits[0], full[length]) < 1e-4
    assert torch.isfinite(logits).all()
    # The default bf16 activation rounding stays close.
    caches_bf16 = allocate_caches(CFG, num_blocks, fill="nan")
    rm.model_forward(tokens[:length], weights, caches_bf16, pre, CFG)
    logits_bf16 = rm.model_forward(ids, weights, caches_bf16, dec, CFG)
    assert rel_err(logits_bf16[0], full[length]) < 5e-2


def test_speculative_decode_after_prefill_equals_longer_prefill():
    g = _gen(19)
    weights = random_model_weights(CFG, generator=g)
    length, q_len, num_blocks = 64, 2, 12  # the 2 tokens sit at positions 64, 65: a new block
    tokens = torch.randint(0, CFG.vocab_size, (length + q_len,), generator=g)
    full_meta = build_step([0], [length + q_len], block_size=BS, num_blocks=num_blocks, generator=_gen(20))
    full = rm.model_forward(tokens, weights, allocate_caches(CFG, num_blocks, fill="nan"), full_meta, CFG,
                            act_dtype=None)
    caches = allocate_caches(CFG, num_blocks, fill="nan")
    pre = build_step([0], [length], block_size=BS, num_blocks=num_blocks, generator=_gen(21))
    rm.model_forward(tokens[:length], weights, caches, pre, CFG, act_dtype=None)
    dec = build_step([length], q_len, block_size=BS, num_blocks=num_blocks, block_ids=request_block_ids(pre, BS))
    logits = rm.model_forward(tokens[length:], weights, caches, dec, CFG, act_dtype=None)
    assert rel_err(logits, full[length:]) < 1e-4


# ---- router and experts -----------------------------------------------------------------------------------


def test_route_weights_and_bias():
    g = _gen(22)
    n, e, k, scaling = 64, CFG.num_local_experts, CFG.num_experts_per_tok, CFG.routed_scaling_factor
    h = torch.randn(n, CFG.hidden_size, generator=g)
    gate = torch.randn(e, CFG.hidden_size, generator=g) * CFG.hidden_size ** -0.5
    bias = torch.randn(e, generator=g) * 0.3
    weights, ids = ref.route(h, gate, bias, k, scaling)
    assert ids.dtype == torch.int32 and ids.shape == (n, k) and weights.shape == (n, k)
    assert torch.allclose(weights.sum(-1), torch.full((n,), scaling), rtol=1e-6)
    assert all(len(set(row)) == k for row in ids.tolist())
    # Independent float64: choose by score + bias, weigh by the score alone.
    s = torch.sigmoid(h.double() @ gate.double().T)
    want_ids = (s + bias.double()).topk(k, dim=-1).indices
    assert torch.equal(ids.long().sort(-1).values, want_ids.sort(-1).values)
    chosen = s.gather(1, ids.long())
    assert torch.allclose(weights.double(), chosen / chosen.sum(-1, keepdim=True) * scaling, rtol=1e-5)
    # Another bias: where it picks the same experts, the weights are the same.
    other_w, other_ids = ref.route(h, gate, torch.randn(e, generator=g) * 0.3, k, scaling)
    same = 0
    for t in range(n):
        a, b = ids[t].long().sort(), other_ids[t].long().sort()
        if torch.equal(a.values, b.values):
            same += 1
            assert torch.allclose(weights[t][a.indices], other_w[t][b.indices], rtol=1e-6)
    assert 0 < same < n  # the bias did change some choices, and some stayed
    # A shift of every bias changes nothing; no bias at all chooses by score.
    shift_w, shift_ids = ref.route(h, gate, bias + 5.0, k, scaling)
    assert torch.equal(shift_ids, ids) and torch.allclose(shift_w, weights)
    plain_w, plain_ids = ref.route(h, gate, None, k, scaling)
    assert torch.equal(plain_ids.long().sort(-1).values, s.topk(k, dim=-1).indices.sort(-1).values)
    # A large bias on expert 3 forces it in everywhere, with its unbiased score as weight.
    forced = bias.clone()
    forced[3] = 50.0
    fw, fids = ref.route(h, gate, forced, k, scaling)
    assert (fids == 3).any(-1).all()
    chosen = s.gather(1, fids.long())
    assert torch.allclose(fw.double(), chosen / chosen.sum(-1, keepdim=True) * scaling, rtol=1e-5)
    assert fw.max() < scaling  # no weight took the bias into account


def _mlp64(x, w13, s13, w2, s2):
    gate, up = (x.double() @ dequantize(w13, s13).double().T).chunk(2, dim=-1)
    g = gate.clamp(max=CFG.swiglu_limit)
    act = g * torch.sigmoid(CFG.swiglu_alpha * g) * (up.clamp(-CFG.swiglu_limit, CFG.swiglu_limit) + 1)
    return act @ dequantize(w2, s2).double().T


@pytest.mark.parametrize("fmt", ["bf16", "mxfp8", "mxfp4"])
def test_moe_experts_shared_in_table_equals_separate(fmt):
    g = _gen(23)
    w = random_layer_weights(CFG, SPARSE_LAYER, linear_format=fmt, shared=SHARED_SEPARATE, generator=g)
    e = CFG.num_local_experts
    n = 10
    h = torch.randn(n, CFG.hidden_size, generator=g)
    weights, ids = ref.route(h, w.gate, w.gate_bias, CFG.num_experts_per_tok, CFG.routed_scaling_factor)
    kw = dict(num_routed_experts=e, alpha=CFG.swiglu_alpha, limit=CFG.swiglu_limit)
    separate = ref.moe_experts(h, ids, weights, w.w13, w.w13_scale, w.w2, w.w2_scale, w.shared_w13,
                               w.shared_w13_scale, w.shared_w2, w.shared_w2_scale, **kw)
    cat = lambda t, s: None if t is None else torch.cat([t, s[None]])  # noqa: E731
    table = ref.moe_experts(h, ids, weights, cat(w.w13, w.shared_w13), cat(w.w13_scale, w.shared_w13_scale),
                            cat(w.w2, w.shared_w2), cat(w.w2_scale, w.shared_w2_scale), **kw)
    assert torch.allclose(table, separate, rtol=1e-5, atol=1e-6)
    # Independent: every expert on every token, then pick.
    sc = lambda s, i: None if s is None else s[i]  # noqa: E731
    every = torch.stack([_mlp64(h, w.w13[i], sc(w.w13_scale, i), w.w2[i], sc(w.w2_scale, i)) for i in range(e)], 1)
    routed = (every.gather(1, ids.long()[..., None].expand(-1, -1, CFG.hidden_size))
              * weights.double()[..., None]).sum(1)
    shared = _mlp64(h, w.shared_w13, w.shared_w13_scale, w.shared_w2, w.shared_w2_scale)
    assert rel_err(separate, routed + shared) < 1e-5
    # Without a shared expert only the routed part remains.
    alone = ref.moe_experts(h, ids, weights, w.w13, w.w13_scale, w.w2, w.w2_scale, **kw)
    assert rel_err(alone, routed) < 1e-5


def test_random_layer_weights_shared_in_table():
    w = random_layer_weights(CFG, SPARSE_LAYER, shared=SHARED_IN_TABLE, generator=_gen(24))
    assert w.shared_in_table and w.shared_w13 is None
    assert w.w13.shape == (CFG.num_local_experts + 1, 2 * CFG.intermediate_size, CFG.hidden_size)
    h = torch.randn(3, CFG.hidden_size, generator=_gen(25))
    out = rm.ffn_block(h, w, CFG)
    assert out.shape == (3, CFG.hidden_size) and torch.isfinite(out).all()


def _rope64(x, positions):
    """Independent NeoX partial RoPE in float64 (complex rotation of pairs (i, i + r/2))."""
    r, half = CFG.rotary_dim, CFG.rotary_dim // 2
    pairs = torch.complex(x[..., :half], x[..., half:r])
    angle = positions.double()[:, None] * CFG.rope_theta ** (-2.0 * torch.arange(half, dtype=torch.float64) / r)
    rot = pairs * torch.polar(torch.ones_like(angle), angle)[:, None, :]
    return torch.cat([rot.real, rot.imag, x[..., r:]], -1)


def _norm64(x, w):
    return x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + CFG.rms_norm_eps) * (1 + w.double())


def test_qk_norm_rope_insert_matches_float64():
    # fp32 caches (the reference takes any cache tensor) keep the written k / v / index_k unrounded.
    g = _gen(26)
    meta = _step([10, 47], 2, seed=26, pad=1)
    kv = torch.randn(40, KVH, BS, 2 * D, generator=g)
    index = torch.randn(40, BS, D, generator=g)
    w = random_layer_weights(CFG, SPARSE_LAYER, generator=g)
    qkv = torch.randn(meta.num_tokens, CFG.qkv_size(SPARSE_LAYER), generator=g) * 2
    q, index_q = ref.qk_norm_rope_insert(
        qkv, meta.positions, meta.slot_mapping, meta.index_slot_mapping, w.q_norm, w.k_norm, w.index_q_norm,
        w.index_k_norm, kv, index, num_heads=H, num_kv_heads=KVH, head_dim=D, rotary_dim=CFG.rotary_dim,
        rope_theta=CFG.rope_theta, eps=CFG.rms_norm_eps, index_heads=KVH, index_dim=D)
    n, x = meta.num_tokens, qkv.double()
    parts = torch.split(x, [H * D, KVH * D, KVH * D, KVH * D, D], dim=-1)
    want_q = _rope64(_norm64(parts[0].view(n, H, D), w.q_norm), meta.positions)
    want_k = _rope64(_norm64(parts[1].view(n, KVH, D), w.k_norm), meta.positions)
    want_iq = _rope64(_norm64(parts[3].view(n, KVH, D), w.index_q_norm), meta.positions)
    want_ik = _rope64(_norm64(parts[4].view(n, 1, D), w.index_k_norm), meta.positions)[:, 0]
    tol = dict(rtol=1e-5, atol=1e-5)
    assert torch.allclose(q.double(), want_q, **tol) and torch.allclose(index_q.double(), want_iq, **tol)
    for i, r, pos in _spans(meta):
        if pos < 0:
            continue
        slot = int(meta.slot_mapping[i])
        assert torch.allclose(kv[slot // BS, :, slot % BS, :D].double(), want_k[i], **tol)
        assert torch.equal(kv[slot // BS, :, slot % BS, D:], qkv[i, H * D + KVH * D:H * D + 2 * KVH * D].view(KVH, D))
        islot = int(meta.index_slot_mapping[i])
        assert torch.allclose(index[islot // BS, islot % BS].double(), want_ik[i], **tol)
