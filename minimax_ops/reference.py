"""The oracle: MiniMax-M3 decode math in plain PyTorch, fp32, one short function per spec step.

Nothing here is fast or capturable (it loops over tokens and experts and may sync with the host);
everything else in the package is checked against it. Each function follows
docs/m3-decode-spec.md; shapes per rank with TP = 1.
"""

from __future__ import annotations

import math

import torch

from .cache import LayerCache
from .formats import dequantize, to_cache_dtype

# ---- elementwise pieces -------------------------------------------------------------------


def gemma_rmsnorm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x * rsqrt(mean(x^2) + eps) * (1 + w), in fp32 over the last dimension."""
    x = x.float()
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * (1.0 + weight.float())


def rope_cos_sin(positions: torch.Tensor, rotary_dim: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin(pos * theta^(-2i/rotary_dim)), i < rotary_dim/2, computed in float64 -> [n, r/2] fp32."""
    i = torch.arange(rotary_dim // 2, dtype=torch.float64, device=positions.device)
    angle = positions.to(torch.float64)[:, None] * theta ** (-2.0 * i / rotary_dim)
    return angle.cos().float(), angle.sin().float()


def apply_partial_rope(x: torch.Tensor, positions: torch.Tensor, rotary_dim: int, theta: float) -> torch.Tensor:
    """NeoX (half-split) RoPE on dims [0, rotary_dim) of every head of x [n, heads, d]; the rest pass."""
    x = x.float()
    cos, sin = (t[:, None, :] for t in rope_cos_sin(positions, rotary_dim, theta))
    half = rotary_dim // 2
    x1, x2 = x[..., :half], x[..., half:rotary_dim]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin, x[..., rotary_dim:]], dim=-1)


def swiglu_oai(gate: torch.Tensor, up: torch.Tensor, alpha: float = 1.702, limit: float = 7.0) -> torch.Tensor:
    g = gate.float().clamp(max=limit)
    return g * torch.sigmoid(alpha * g) * (up.float().clamp(-limit, limit) + 1.0)


def linear(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor | None = None) -> torch.Tensor:
    """x @ dequant(weight)^T in fp32, for bf16, MXFP8 or MXFP4 weights."""
    return x.float() @ dequantize(weight, scale, rank=2).T


# ---- attention side ----------------------------------------------------------------------------


def qk_norm_rope_insert(qkv, positions, slot_mapping, index_slot_mapping, q_norm, k_norm, index_q_norm,
                        index_k_norm, kv_cache, index_cache, *, num_heads, num_kv_heads, head_dim,
                        rotary_dim, rope_theta, eps, index_heads=0, index_dim=0, k_scale=1.0, v_scale=1.0):
    """Steps 3-4: per-head norm + partial RoPE of q, k (and index q/k); k / k_scale, v / v_scale (vLLM's
    convention: attention multiplies by the scales when reading) and index k into the paged caches at
    their slots (slot < 0: padding row, nothing written). Returns (q, index_q) fp32."""
    n = qkv.shape[0]
    sizes = [num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim]
    if index_heads:
        sizes += [index_heads * index_dim, index_dim]
    parts = torch.split(qkv.float(), sizes, dim=-1)
    rope = lambda t: apply_partial_rope(t, positions, rotary_dim, rope_theta)  # noqa: E731
    q = rope(gemma_rmsnorm(parts[0].view(n, num_heads, head_dim), q_norm, eps))
    k = rope(gemma_rmsnorm(parts[1].view(n, num_kv_heads, head_dim), k_norm, eps))
    v = parts[2].view(n, num_kv_heads, head_dim)
    bs = kv_cache.shape[2]
    valid = slot_mapping >= 0
    slots = slot_mapping[valid]
    kv_cache[slots // bs, :, slots % bs] = to_cache_dtype(torch.cat([k / k_scale, v / v_scale], -1)[valid],
                                                          kv_cache.dtype)
    index_q = None
    if index_heads:
        index_q = rope(gemma_rmsnorm(parts[3].view(n, index_heads, index_dim), index_q_norm, eps))
        index_k = rope(gemma_rmsnorm(parts[4].view(n, 1, index_dim), index_k_norm, eps))[:, 0]
        ivalid = index_slot_mapping >= 0
        islots = index_slot_mapping[ivalid]
        index_cache[islots // bs, islots % bs] = to_cache_dtype(index_k[ivalid], index_cache.dtype)
    return q, index_q


def token_spans(seq_lens: torch.Tensor, query_lens: list[int] | int, num_tokens: int) -> list[tuple[int, int]]:
    """(request, kv_len) of every token: request r's j-th of q tokens sits at seq_len - q + j and
    attends to kv_len = seq_len - q + j + 1 positions. Padding requests give kv_len <= 0."""
    seq = seq_lens.tolist()
    if isinstance(query_lens, int):
        query_lens = [query_lens] * (num_tokens // max(query_lens, 1))
    spans = []
    for r, q in enumerate(query_lens):
        for j in range(q):
            spans.append((r, seq[r] - q + j + 1 if seq[r] > 0 else 0))
    if len(spans) != num_tokens:
        raise ValueError(f"query lengths cover {len(spans)} tokens, the step has {num_tokens}")
    return spans


def _gather_positions(cache: torch.Tensor, table_row: torch.Tensor, blocks: list[int], kv_len: int):
    """Rows of a paged cache [blocks, (heads,) bs, d] at the positions < kv_len of the given logical
    blocks, in logical order. Returns (rows [P, (heads,) d] fp32, positions [P])."""
    bs = cache.shape[-2]
    pos = torch.cat([torch.arange(b * bs, min((b + 1) * bs, kv_len)) for b in sorted(blocks)])
    pages = table_row.long().cpu()[pos // bs].to(cache.device)
    offs = (pos % bs).to(cache.device)
    rows = cache[pages, :, offs] if cache.dim() == 4 else cache[pages, offs]
    return rows.float(), pos


def index_topk(index_q, index_cache, block_table, seq_lens, query_len, topk, *, query_lens=None):
    """Step 5: per token and index head, the local block plus the best other blocks by
    max-over-positions dot score; [n, Hi, topk] int32 logical block ids, -1 padded, best first."""
    n, heads, _ = index_q.shape
    bs = index_cache.shape[1]
    out = torch.full((n, heads, topk), -1, dtype=torch.int32)
    for i, (r, kv_len) in enumerate(token_spans(seq_lens, query_lens or query_len, n)):
        if kv_len <= 0:
            continue
        nb = math.ceil(kv_len / bs)
        keys, pos = _gather_positions(index_cache, block_table[r], list(range(nb)), kv_len)
        dots = index_q[i].float() @ keys.T  # [Hi, P]
        scores = torch.full((heads, nb), -math.inf, device=dots.device)
        scores = scores.scatter_reduce(1, (pos // bs).to(dots.device).expand(heads, -1), dots, "amax")
        scores[:, nb - 1] = math.inf  # the local block is always chosen
        k = min(topk, nb)
        out[i, :, :k] = scores.topk(k, dim=-1).indices.to(torch.int32).cpu()
    return out.to(index_q.device)


def _attend(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """softmax(q K^T / sqrt(d)) V for q [G, d], K/V [P, d], fp32."""
    probs = torch.softmax(q @ keys.T / math.sqrt(q.shape[-1]), dim=-1)
    return probs @ values


def _attention(q, kv_cache, block_table, seq_lens, query_len, blocks_of, k_scale, v_scale, query_lens):
    n, heads, d = q.shape
    kv_heads, bs = kv_cache.shape[1], kv_cache.shape[2]
    group = heads // kv_heads
    out = torch.zeros(n, heads, d, dtype=torch.float32, device=q.device)
    for i, (r, kv_len) in enumerate(token_spans(seq_lens, query_lens or query_len, n)):
        if kv_len <= 0:
            continue
        for h in range(kv_heads):
            blocks = blocks_of(i, h, math.ceil(kv_len / bs))
            if not blocks:  # nothing selected (hand-made block ids): the kernels give zeros too
                continue
            rows, _ = _gather_positions(kv_cache[:, h:h + 1], block_table[r], blocks, kv_len)
            keys, values = rows[:, 0, :d] * k_scale, rows[:, 0, d:] * v_scale
            out[i, h * group:(h + 1) * group] = _attend(q[i, h * group:(h + 1) * group].float(), keys, values)
    return out


def sparse_attention(q, kv_cache, block_table, seq_lens, block_ids, query_len, k_scale=1.0, v_scale=1.0,
                     *, query_lens=None):
    """Step 6: kv head h attends over the union of its selected blocks (ids -1 ignored), causal."""
    ids = block_ids.cpu()

    def blocks_of(i, h, nb):
        return sorted({b for b in ids[i, h].tolist() if 0 <= b < nb})

    return _attention(q, kv_cache, block_table, seq_lens, query_len, blocks_of, k_scale, v_scale, query_lens)


def dense_attention(q, kv_cache, block_table, seq_lens, query_len, k_scale=1.0, v_scale=1.0, *, query_lens=None):
    """Full causal GQA attention over every cached position (dense layers 0-2)."""
    return _attention(q, kv_cache, block_table, seq_lens, query_len, lambda i, h, nb: list(range(nb)),
                      k_scale, v_scale, query_lens)


# ---- FFN side --------------------------------------------------------------------------------------


def route(h, gate_weight, bias, top_k, scaling):
    """Step 9: sigmoid scores; the bias only chooses; chosen scores renormalised then scaled."""
    scores = torch.sigmoid(h.float() @ gate_weight.float().T)
    choice = scores + bias.float() if bias is not None else scores
    ids = choice.topk(top_k, dim=-1).indices
    weights = scores.gather(1, ids)
    return weights / weights.sum(-1, keepdim=True) * scaling, ids.to(torch.int32)


def mlp(x, w13, w13_scale, w2, w2_scale, alpha=1.702, limit=7.0):
    """SwiGLU-OAI MLP: w13 holds all gate rows then all up rows."""
    gate, up = linear(x, w13, w13_scale).chunk(2, dim=-1)
    return linear(swiglu_oai(gate, up, alpha, limit), w2, w2_scale)


def moe_experts(h, topk_ids, topk_weights, w13, w13_scale, w2, w2_scale, shared_w13=None, shared_w13_scale=None,
                shared_w2=None, shared_w2_scale=None, *, num_routed_experts, alpha=1.702, limit=7.0):
    """Step 10: sum_k w_k * expert_k(h) + shared(h). The shared expert is separate (shared_*) or
    the table's extra expert at index num_routed_experts."""
    x = h.float()
    out = torch.zeros_like(x)
    sc = lambda s, e: None if s is None else s[e]  # noqa: E731
    for e in torch.unique(topk_ids).tolist():
        tok, slot = (topk_ids == e).nonzero(as_tuple=True)
        y = mlp(x[tok], w13[e], sc(w13_scale, e), w2[e], sc(w2_scale, e), alpha, limit)
        out.index_add_(0, tok, y * topk_weights[tok, slot, None].float())
    if shared_w13 is not None:
        out += mlp(x, shared_w13, shared_w13_scale, shared_w2, shared_w2_scale, alpha, limit)
    elif w13.shape[0] == num_routed_experts + 1:
        e = num_routed_experts
        out += mlp(x, w13[e], sc(w13_scale, e), w2[e], sc(w2_scale, e), alpha, limit)
    return out
