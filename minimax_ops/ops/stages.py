"""The traceable decode vocabulary: one torch.library op per decode stage that is not plain ATen.

A sparse MoE decode layer traces to this chain (and the graph pass fuses exactly this chain):

    h, residual = add_rmsnorm(x, residual, input_norm)
    qkv         = mx_linear(h, qkv_w, qkv_s)
    q, index_q  = qk_norm_rope_kv_index_insert(qkv, ..., kv_cache!, index_cache!)
    block_ids   = index_topk(index_q, index_cache, block_table, seq_lens, query_len, topk)
    attn        = sparse_attention_decode(q, kv_cache, block_table, seq_lens, block_ids, query_len)
    o           = mx_linear(attn, o_w, o_s)
    h, residual = add_rmsnorm(o, residual, post_norm)
    w, ids      = route(h, gate, gate_bias, top_k, scaling)
    out         = moe_experts(h, ids, w, w13, ..., w2, ..., shared...)

Dense layers: qk_norm_rope_kv_insert, dense_attention_decode and mlp instead.
Each op checks its inputs in both its fake and its real implementation (ops/checks.py); the real
one runs Triton kernels where backend.use_kernels says so, the reference otherwise.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .. import reference as ref
from ..formats import logical_out_features
from ..backend import use_kernels
from ..step_context import general_step
from ..step_contract import STEP_DTYPES
from . import prefill
from .checks import (check, check_activation, check_cache, check_down_proj, check_dtype, check_linear,
                     check_shape, check_step)

BF16 = torch.bfloat16


# ---- add + norm ------------------------------------------------------------------------------------------


def _check_add_rmsnorm(x, residual, weight):
    check_activation("x", x)
    check_activation("residual", residual, x.shape[1])
    check_shape("residual", residual, tuple(x.shape))
    check_shape("weight", weight, (x.shape[1],))


@torch.library.custom_op("minimax::add_rmsnorm", mutates_args=())
def add_rmsnorm(x: Tensor, residual: Tensor, weight: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    """residual' = residual + x; h = gemma_rmsnorm(residual'). Returns (h, residual') in bf16."""
    _check_add_rmsnorm(x, residual, weight)
    if use_kernels(x):
        from ..kernels.norm import add_rmsnorm as kernel
        return kernel(x, residual, weight, eps)
    res = (residual.float() + x.float()).to(BF16)
    return ref.gemma_rmsnorm(res, weight, eps).to(BF16), res


@add_rmsnorm.register_fake
def _(x, residual, weight, eps):
    _check_add_rmsnorm(x, residual, weight)
    return torch.empty_like(x), torch.empty_like(x)


# ---- linear ----------------------------------------------------------------------------------------------


def _out_dtype(out_fp32: bool) -> torch.dtype:
    """out_fp32: a tensor-parallel partial sum, kept in fp32 so that the all-reduce rounds once."""
    return torch.float32 if out_fp32 else BF16


@torch.library.custom_op("minimax::mx_linear", mutates_args=())
def mx_linear(x: Tensor, weight: Tensor, scale: Tensor | None, out_fp32: bool = False) -> Tensor:
    """x @ dequant(weight)^T for bf16, MXFP8 or MXFP4 weights; bf16 out (fp32 with out_fp32), fp32
    accumulation."""
    check_activation("x", x)
    check_linear("weight", x, weight, scale)
    if use_kernels(x):
        from ..kernels.mx_linear import mx_linear as kernel
        return kernel(x, weight, scale, out_dtype=_out_dtype(out_fp32))
    return ref.linear(x, weight, scale).to(_out_dtype(out_fp32))


@mx_linear.register_fake
def _(x, weight, scale, out_fp32=False):
    check_activation("x", x)
    check_linear("weight", x, weight, scale)
    return x.new_empty(x.shape[0], logical_out_features(weight, 2), dtype=_out_dtype(out_fp32))


# ---- per-head norm + RoPE + cache insert ------------------------------------------------------------


def _check_insert(qkv, positions, slot_mapping, kv_cache, num_heads, num_kv_heads, head_dim, index_width=0,
                  k_scale=1.0, v_scale=1.0):
    n = qkv.shape[0]
    check(k_scale > 0 and v_scale > 0, f"k_scale, v_scale: expected positive scales, got {k_scale}, {v_scale}")
    check_activation("qkv", qkv, (num_heads + 2 * num_kv_heads) * head_dim + index_width)
    check_step(n, positions, slot_mapping, None, None)
    check_cache("kv_cache", kv_cache, (None, num_kv_heads, None, 2 * head_dim))


@torch.library.custom_op("minimax::qk_norm_rope_kv_insert", mutates_args=("kv_cache",))
def qk_norm_rope_kv_insert(qkv: Tensor, positions: Tensor, slot_mapping: Tensor, q_norm: Tensor, k_norm: Tensor,
                           kv_cache: Tensor, num_heads: int, num_kv_heads: int, head_dim: int, rotary_dim: int,
                           rope_theta: float, eps: float, k_scale: float = 1.0, v_scale: float = 1.0) -> Tensor:
    """Dense layers: q/k per-head Gemma norm + partial RoPE, k / k_scale and v / v_scale into kv_cache
    (the attention ops multiply by the scales). Returns q [n, H, D]."""
    _check_insert(qkv, positions, slot_mapping, kv_cache, num_heads, num_kv_heads, head_dim, k_scale=k_scale,
                  v_scale=v_scale)
    args = (qkv, positions, slot_mapping, None, q_norm, k_norm, None, None, kv_cache, None)
    kw = dict(num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim, rotary_dim=rotary_dim,
              rope_theta=rope_theta, eps=eps, k_scale=k_scale, v_scale=v_scale)
    if use_kernels(qkv):
        from ..kernels.qk_norm_rope import qk_norm_rope_insert as kernel
        return kernel(*args, **kw)[0]
    return ref.qk_norm_rope_insert(*args, **kw)[0].to(BF16)


@qk_norm_rope_kv_insert.register_fake
def _(qkv, positions, slot_mapping, q_norm, k_norm, kv_cache, num_heads, num_kv_heads, head_dim, rotary_dim,
      rope_theta, eps, k_scale=1.0, v_scale=1.0):
    _check_insert(qkv, positions, slot_mapping, kv_cache, num_heads, num_kv_heads, head_dim, k_scale=k_scale,
                  v_scale=v_scale)
    return qkv.new_empty(qkv.shape[0], num_heads, head_dim)


@torch.library.custom_op("minimax::qk_norm_rope_kv_index_insert", mutates_args=("kv_cache", "index_cache"))
def qk_norm_rope_kv_index_insert(qkv: Tensor, positions: Tensor, slot_mapping: Tensor, index_slot_mapping: Tensor,
                                 q_norm: Tensor, k_norm: Tensor, index_q_norm: Tensor, index_k_norm: Tensor,
                                 kv_cache: Tensor, index_cache: Tensor, num_heads: int, num_kv_heads: int,
                                 head_dim: int, rotary_dim: int, rope_theta: float, eps: float, index_heads: int,
                                 index_dim: int, k_scale: float = 1.0, v_scale: float = 1.0) -> tuple[Tensor, Tensor]:
    """Sparse layers: as qk_norm_rope_kv_insert, plus index q/k norm + RoPE and index_k into
    index_cache. Returns (q [n, H, D], index_q [n, Hi, Di])."""
    _check_index_insert(qkv, positions, slot_mapping, index_slot_mapping, kv_cache, index_cache, num_heads,
                        num_kv_heads, head_dim, index_heads, index_dim, k_scale, v_scale)
    args = (qkv, positions, slot_mapping, index_slot_mapping, q_norm, k_norm, index_q_norm, index_k_norm,
            kv_cache, index_cache)
    kw = dict(num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim, rotary_dim=rotary_dim,
              rope_theta=rope_theta, eps=eps, index_heads=index_heads, index_dim=index_dim, k_scale=k_scale,
              v_scale=v_scale)
    if use_kernels(qkv):
        from ..kernels.qk_norm_rope import qk_norm_rope_insert as kernel
        return kernel(*args, **kw)
    q, index_q = ref.qk_norm_rope_insert(*args, **kw)
    return q.to(BF16), index_q.to(BF16)


def _check_index_insert(qkv, positions, slot_mapping, index_slot_mapping, kv_cache, index_cache, num_heads,
                        num_kv_heads, head_dim, index_heads, index_dim, k_scale=1.0, v_scale=1.0):
    _check_insert(qkv, positions, slot_mapping, kv_cache, num_heads, num_kv_heads, head_dim,
                  (index_heads + 1) * index_dim, k_scale, v_scale)
    check_dtype("index_slot_mapping", index_slot_mapping, STEP_DTYPES["index_slot_mapping"])
    check_shape("index_slot_mapping", index_slot_mapping, (qkv.shape[0],))
    check_cache("index_cache", index_cache, (None, kv_cache.shape[2], index_dim))


@qk_norm_rope_kv_index_insert.register_fake
def _(qkv, positions, slot_mapping, index_slot_mapping, q_norm, k_norm, index_q_norm, index_k_norm, kv_cache,
      index_cache, num_heads, num_kv_heads, head_dim, rotary_dim, rope_theta, eps, index_heads, index_dim,
      k_scale=1.0, v_scale=1.0):
    _check_index_insert(qkv, positions, slot_mapping, index_slot_mapping, kv_cache, index_cache, num_heads,
                        num_kv_heads, head_dim, index_heads, index_dim, k_scale, v_scale)
    n = qkv.shape[0]
    return qkv.new_empty(n, num_heads, head_dim), qkv.new_empty(n, index_heads, index_dim)


# ---- indexer + attention -------------------------------------------------------------------------------


def _check_index_topk(index_q, index_cache, block_table, seq_lens, query_len, topk):
    check_dtype("index_q", index_q, BF16)
    check_shape("index_q", index_q, (None, None, index_cache.shape[-1]))
    check_cache("index_cache", index_cache, (None, None, index_q.shape[-1]))
    check_step(index_q.shape[0], None, None, block_table, seq_lens, query_len)
    check(topk >= 1, f"topk: expected >= 1, got {topk}")


@torch.library.custom_op("minimax::index_topk", mutates_args=())
def index_topk(index_q: Tensor, index_cache: Tensor, block_table: Tensor, seq_lens: Tensor, query_len: int,
               topk: int) -> Tensor:
    """Lightning indexer: per token and index head, the local block plus the best blocks by
    max-over-positions score. [n, Hi, topk] int32 logical block ids, -1 padded."""
    step = general_step(query_len)  # not the uniform decode this graph was traced for (step_context.py)
    _check_index_topk(index_q, index_cache, block_table, seq_lens, None if step else query_len, topk)
    if step is not None:
        return prefill.general_index_topk(index_q, index_cache, block_table, seq_lens, topk, step.query_lens)
    if use_kernels(index_q):
        from ..kernels.index_topk import index_topk as kernel
        return kernel(index_q, index_cache, block_table, seq_lens, query_len, topk)
    return ref.index_topk(index_q, index_cache, block_table, seq_lens, query_len, topk)


@index_topk.register_fake
def _(index_q, index_cache, block_table, seq_lens, query_len, topk):
    _check_index_topk(index_q, index_cache, block_table, seq_lens, query_len, topk)
    return index_q.new_empty(index_q.shape[0], index_q.shape[1], topk, dtype=torch.int32)


def _check_attention(q, kv_cache, block_table, seq_lens, query_len, block_ids=None):
    check_dtype("q", q, BF16)
    check(q.dim() == 3, f"q: expected [tokens, heads, head_dim], got shape {tuple(q.shape)}")
    check_cache("kv_cache", kv_cache, (None, None, None, 2 * q.shape[2]))
    check(q.shape[1] % kv_cache.shape[1] == 0,
          f"q: expected a multiple of kv_cache's {kv_cache.shape[1]} kv heads, got {q.shape[1]} heads")
    check_step(q.shape[0], None, None, block_table, seq_lens, query_len)
    if block_ids is not None:
        check_dtype("block_ids", block_ids, torch.int32)
        check_shape("block_ids", block_ids, (q.shape[0], kv_cache.shape[1], None))


@torch.library.custom_op("minimax::sparse_attention_decode", mutates_args=())
def sparse_attention_decode(q: Tensor, kv_cache: Tensor, block_table: Tensor, seq_lens: Tensor, block_ids: Tensor,
                            query_len: int, k_scale: float, v_scale: float) -> Tensor:
    """Block-sparse GQA decode over each kv head's selected blocks, causal. [n, H*D] bf16."""
    step = general_step(query_len)
    _check_attention(q, kv_cache, block_table, seq_lens, None if step else query_len, block_ids)
    if step is not None:
        return prefill.general_attention(q, kv_cache, block_table, seq_lens, block_ids, k_scale, v_scale,
                                         step.query_lens)
    if use_kernels(q):
        from ..kernels.attention import sparse_attention_decode as kernel
        return kernel(q, kv_cache, block_table, seq_lens, block_ids, query_len, k_scale, v_scale)
    out = ref.sparse_attention(q, kv_cache, block_table, seq_lens, block_ids, query_len, k_scale, v_scale)
    return out.reshape(q.shape[0], -1).to(BF16)


@sparse_attention_decode.register_fake
def _(q, kv_cache, block_table, seq_lens, block_ids, query_len, k_scale, v_scale):
    _check_attention(q, kv_cache, block_table, seq_lens, query_len, block_ids)
    return q.new_empty(q.shape[0], q.shape[1] * q.shape[2])


@torch.library.custom_op("minimax::dense_attention_decode", mutates_args=())
def dense_attention_decode(q: Tensor, kv_cache: Tensor, block_table: Tensor, seq_lens: Tensor, query_len: int,
                           k_scale: float, v_scale: float) -> Tensor:
    """Full causal GQA decode over every cached position (dense layers). [n, H*D] bf16."""
    step = general_step(query_len)
    _check_attention(q, kv_cache, block_table, seq_lens, None if step else query_len)
    if step is not None:
        return prefill.general_attention(q, kv_cache, block_table, seq_lens, None, k_scale, v_scale,
                                         step.query_lens)
    if use_kernels(q):
        from ..kernels.attention import dense_attention_decode as kernel
        return kernel(q, kv_cache, block_table, seq_lens, query_len, k_scale, v_scale)
    out = ref.dense_attention(q, kv_cache, block_table, seq_lens, query_len, k_scale, v_scale)
    return out.reshape(q.shape[0], -1).to(BF16)


@dense_attention_decode.register_fake
def _(q, kv_cache, block_table, seq_lens, query_len, k_scale, v_scale):
    _check_attention(q, kv_cache, block_table, seq_lens, query_len)
    return q.new_empty(q.shape[0], q.shape[1] * q.shape[2])


# ---- router + experts ----------------------------------------------------------------------------------


def _check_route(h, gate, bias, top_k):
    check_activation("h", h)
    check_dtype("gate", gate, torch.float32)
    check_shape("gate", gate, (None, h.shape[1]))
    if bias is not None:
        check_dtype("gate_bias", bias, torch.float32)
        check_shape("gate_bias", bias, (gate.shape[0],))
    check(1 <= top_k <= gate.shape[0], f"top_k: expected 1..{gate.shape[0]}, got {top_k}")


@torch.library.custom_op("minimax::route", mutates_args=())
def route(h: Tensor, gate: Tensor, gate_bias: Tensor | None, top_k: int, scaling: float) -> tuple[Tensor, Tensor]:
    """Sigmoid router: (weights fp32 [n, k], ids int32 [n, k]); the bias only chooses."""
    _check_route(h, gate, gate_bias, top_k)
    if use_kernels(h):
        from ..kernels.router import route as kernel
        return kernel(h, gate, gate_bias, top_k, scaling)
    return ref.route(h, gate, gate_bias, top_k, scaling)


@route.register_fake
def _(h, gate, gate_bias, top_k, scaling):
    _check_route(h, gate, gate_bias, top_k)
    n = h.shape[0]
    return h.new_empty(n, top_k, dtype=torch.float32), h.new_empty(n, top_k, dtype=torch.int32)


def _check_moe(h, topk_ids, topk_weights, w13, w13_scale, w2, w2_scale, shared_w13, shared_w13_scale, shared_w2,
               shared_w2_scale, num_routed_experts):
    check_activation("h", h)
    check_dtype("topk_ids", topk_ids, torch.int32)
    check_shape("topk_ids", topk_ids, (h.shape[0], None))
    check_dtype("topk_weights", topk_weights, torch.float32)
    check_shape("topk_weights", topk_weights, tuple(topk_ids.shape))
    check_linear("w13", h, w13, w13_scale, experts=True)
    experts = w13.shape[0]
    check(experts in (num_routed_experts, num_routed_experts + 1),
          f"w13: expected {num_routed_experts} experts (+1 shared in the table), got {experts}")
    check(w2.shape[0] == experts, f"w2: expected {experts} experts like w13, got {w2.shape[0]}")
    check(logical_out_features(w2, 3) == h.shape[1],
          f"w2: expected {h.shape[1]} output rows, got shape {tuple(w2.shape)}")
    check_down_proj("w2", "w13", w13, w2, w2_scale, h.shape[1], experts=True)
    if shared_w13 is not None:
        check(experts == num_routed_experts, "shared_w13: given separately while w13 also holds a shared expert")
        check_linear("shared_w13", h, shared_w13, shared_w13_scale)
        check(shared_w2 is not None, "shared_w2: expected a tensor since shared_w13 is given, got None")
        check_down_proj("shared_w2", "shared_w13", shared_w13, shared_w2, shared_w2_scale, h.shape[1])


@torch.library.custom_op("minimax::moe_experts", mutates_args=())
def moe_experts(h: Tensor, topk_ids: Tensor, topk_weights: Tensor, w13: Tensor, w13_scale: Tensor | None, w2: Tensor,
                w2_scale: Tensor | None, shared_w13: Tensor | None, shared_w13_scale: Tensor | None,
                shared_w2: Tensor | None, shared_w2_scale: Tensor | None, num_routed_experts: int, alpha: float,
                limit: float, out_fp32: bool = False) -> Tensor:
    """sum_k w_k * SwiGLU-OAI expert_k(h) + shared(h), bf16 [n, H] (fp32 with out_fp32; the kernel
    path writes bf16 today, widened)."""
    args = (h, topk_ids, topk_weights, w13, w13_scale, w2, w2_scale, shared_w13, shared_w13_scale, shared_w2,
            shared_w2_scale)
    _check_moe(*args, num_routed_experts)
    kernel = ref.moe_experts
    if use_kernels(h):
        from ..kernels.moe import moe_experts as kernel
    out = kernel(*args, num_routed_experts=num_routed_experts, alpha=alpha, limit=limit)
    return out.to(_out_dtype(out_fp32))


@moe_experts.register_fake
def _(h, topk_ids, topk_weights, w13, w13_scale, w2, w2_scale, shared_w13, shared_w13_scale, shared_w2,
      shared_w2_scale, num_routed_experts, alpha, limit, out_fp32=False):
    _check_moe(h, topk_ids, topk_weights, w13, w13_scale, w2, w2_scale, shared_w13, shared_w13_scale, shared_w2,
               shared_w2_scale, num_routed_experts)
    return torch.empty_like(h, dtype=_out_dtype(out_fp32))


@torch.library.custom_op("minimax::mlp", mutates_args=())
def mlp(h: Tensor, w13: Tensor, w13_scale: Tensor | None, w2: Tensor, w2_scale: Tensor | None, alpha: float,
        limit: float, out_fp32: bool = False) -> Tensor:
    """Dense SwiGLU-OAI MLP (layers 0-2): w13 [2I, H] (gate rows, then up rows), w2 [H, I]; bf16 out
    (fp32 with out_fp32)."""
    check_activation("h", h)
    check_linear("w13", h, w13, w13_scale)
    check_down_proj("w2", "w13", w13, w2, w2_scale, h.shape[1])
    if use_kernels(h):
        from ..kernels.mx_linear import mx_linear as kernel
        gate, up = kernel(h, w13, w13_scale, out_dtype=torch.float32).chunk(2, dim=-1)
        return kernel(ref.swiglu_oai(gate, up, alpha, limit).to(BF16), w2, w2_scale, out_dtype=_out_dtype(out_fp32))
    return ref.mlp(h, w13, w13_scale, w2, w2_scale, alpha, limit).to(_out_dtype(out_fp32))


@mlp.register_fake
def _(h, w13, w13_scale, w2, w2_scale, alpha, limit, out_fp32=False):
    check_activation("h", h)
    check_linear("w13", h, w13, w13_scale)
    check_down_proj("w2", "w13", w13, w2, w2_scale, h.shape[1])
    return h.new_empty(h.shape[0], logical_out_features(w2, 2), dtype=_out_dtype(out_fp32))
