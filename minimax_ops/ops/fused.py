"""The fused decode: one op per decoder layer and step.

    torch.ops.minimax.fused_decode_layer(x, residual, <step metadata>, kv_cache!, index_cache!,
                                         <layer weights>, <layer constants>) -> (out, residual)

replaces the nine-op sparse MoE chain of ops/stages.py (add_rmsnorm ... moe_experts), and
``fused_dense_decode_layer`` the dense chain. Weights, caches and metadata are tensor arguments,
so nothing is baked: re-allocated caches or new weights are just new arguments, and under a CUDA
graph the op reads each step's metadata from the same persistent buffers.

Where kernels run (CUDA, or CPU under the Triton interpreter) the implementation launches the
stage kernels back to back on the current stream with no host sync; elsewhere it runs the
reference stages, so eager, compiled and fused paths agree by construction on CPU.

Before anything is written: shapes and dtypes are checked always; metadata values (slots and
block ids inside the caches, seq_lens inside the table, shared block ids) where reading them is
free or asked for (validate.py); in checked mode also NaN/Inf in x, and the step runs the unfused
chain beside the fused one (checked.py). ``layer_index`` only labels checked-mode reports.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..constants import MAX_TOKENS
from . import checked as checked_mode
from . import stages
from .checks import check, check_activation, check_cache, check_down_proj, check_linear, check_shape, check_step
from ..step_context import general_step
from .validate import should_validate, validate_step_values

# How often each fused op's Python implementation ran: a captured CUDA graph replays without it.
impl_calls = {"sparse": 0, "dense": 0}
# How many of those ran the unfused stages instead (a step that is not the traced decode, or too large).
fallback_calls = {"sparse": 0, "dense": 0}

SPARSE_WEIGHTS = ("input_norm", "qkv", "qkv_scale", "q_norm", "k_norm", "index_q_norm", "index_k_norm",
                  "o_proj", "o_proj_scale", "post_norm", "gate", "gate_bias", "w13", "w13_scale", "w2",
                  "w2_scale", "shared_w13", "shared_w13_scale", "shared_w2", "shared_w2_scale")
DENSE_WEIGHTS = ("input_norm", "qkv", "qkv_scale", "q_norm", "k_norm", "o_proj", "o_proj_scale", "post_norm",
                 "w13", "w13_scale", "w2", "w2_scale")


def _check_step(x, residual, positions, slot_mapping, block_table, seq_lens, kv_cache, query_len):
    n = x.shape[0]
    # No upper bound here: a graph that serves every step size (vLLM's trace-once mode) holds the fused
    # op for large steps too, and the implementation runs the unfused stages above MAX_TOKENS.
    check(n >= 1, f"x: expected at least 1 token, got {n}")
    check_activation("x", x)
    check_activation("residual", residual, x.shape[1])
    check_step(n, positions, slot_mapping, block_table, seq_lens, query_len)
    check_cache("kv_cache", kv_cache, (None, None, None, None))


def _meta(*shape, dtype=torch.bfloat16) -> Tensor:
    """A shape-only stand-in for an intermediate, so that a later stage's checks can run up front."""
    return torch.empty(shape, dtype=dtype, device="meta")


def _check_late_weights(x, w, num_heads, head_dim, top_k=None, num_routed_experts=None):
    """The weight checks of the stages after the cache insert, run before it: a refused call writes
    nothing. top_k None: the dense MLP, else the router and experts."""
    n, hidden = x.shape
    check_linear("o_proj", _meta(n, num_heads * head_dim), w["o_proj"], w["o_proj_scale"])
    check(w["o_proj"].shape[0] == hidden,
          f"o_proj: expected {hidden} output rows, got shape {tuple(w['o_proj'].shape)}")
    check_shape("post_norm", w["post_norm"], (hidden,))
    if top_k is None:
        check_linear("w13", x, w["w13"], w["w13_scale"])
        check_down_proj("w2", "w13", w["w13"], w["w2"], w["w2_scale"], hidden)
        return
    stages._check_route(x, w["gate"], w["gate_bias"], top_k)
    stages._check_moe(x, _meta(n, top_k, dtype=torch.int32), _meta(n, top_k, dtype=torch.float32), w["w13"],
                      w["w13_scale"], w["w2"], w["w2_scale"], w["shared_w13"], w["shared_w13_scale"], w["shared_w2"],
                      w["shared_w2_scale"], num_routed_experts)


def _sparse_stages(x, residual, positions, slot_mapping, index_slot_mapping, block_table, seq_lens, kv_cache,
                   index_cache, w, query_len, num_heads, num_kv_heads, head_dim, rotary_dim, rope_theta, eps,
                   index_heads, index_dim, topk_blocks, top_k, routed_scaling, num_routed_experts, alpha, limit,
                   k_scale, v_scale):
    """The sparse MoE layer as the nine vocabulary stages (w: weights by SPARSE_WEIGHTS name)."""
    h, residual = stages.add_rmsnorm(x, residual, w["input_norm"], eps)
    qkv_out = stages.mx_linear(h, w["qkv"], w["qkv_scale"])
    q, index_q = stages.qk_norm_rope_kv_index_insert(
        qkv_out, positions, slot_mapping, index_slot_mapping, w["q_norm"], w["k_norm"], w["index_q_norm"],
        w["index_k_norm"], kv_cache, index_cache, num_heads, num_kv_heads, head_dim, rotary_dim, rope_theta, eps,
        index_heads, index_dim, k_scale, v_scale)
    block_ids = stages.index_topk(index_q, index_cache, block_table, seq_lens, query_len, topk_blocks)
    attn = stages.sparse_attention_decode(q, kv_cache, block_table, seq_lens, block_ids, query_len, k_scale, v_scale)
    o = stages.mx_linear(attn, w["o_proj"], w["o_proj_scale"])
    h, residual = stages.add_rmsnorm(o, residual, w["post_norm"], eps)
    weights, ids = stages.route(h, w["gate"], w["gate_bias"], top_k, routed_scaling)
    out = stages.moe_experts(h, ids, weights, w["w13"], w["w13_scale"], w["w2"], w["w2_scale"], w["shared_w13"],
                             w["shared_w13_scale"], w["shared_w2"], w["shared_w2_scale"], num_routed_experts, alpha,
                             limit)
    return out, residual


def _dense_stages(x, residual, positions, slot_mapping, block_table, seq_lens, kv_cache, w, query_len, num_heads,
                  num_kv_heads, head_dim, rotary_dim, rope_theta, eps, alpha, limit, k_scale, v_scale):
    """The dense layer as its seven vocabulary stages."""
    h, residual = stages.add_rmsnorm(x, residual, w["input_norm"], eps)
    qkv_out = stages.mx_linear(h, w["qkv"], w["qkv_scale"])
    q = stages.qk_norm_rope_kv_insert(qkv_out, positions, slot_mapping, w["q_norm"], w["k_norm"], kv_cache,
                                      num_heads, num_kv_heads, head_dim, rotary_dim, rope_theta, eps, k_scale,
                                      v_scale)
    attn = stages.dense_attention_decode(q, kv_cache, block_table, seq_lens, query_len, k_scale, v_scale)
    o = stages.mx_linear(attn, w["o_proj"], w["o_proj_scale"])
    h, residual = stages.add_rmsnorm(o, residual, w["post_norm"], eps)
    return stages.mlp(h, w["w13"], w["w13_scale"], w["w2"], w["w2_scale"], alpha, limit), residual


# The fused implementations. Today they launch the stage kernels back to back inside one op (one
# dispatch, one node for CUDA graphs); fused kernels replace stages here without touching callers.
fused_sparse_impl = _sparse_stages
fused_dense_impl = _dense_stages


def _run(kind, layer_index, checked, caches, fused, unfused):
    if checked:
        return checked_mode.run_checked(layer_index, kind, caches, fused, unfused)
    return fused(caches)


@torch.library.custom_op("minimax::fused_decode_layer", mutates_args=("kv_cache", "index_cache"))
def fused_decode_layer(
        x: Tensor, residual: Tensor, positions: Tensor, slot_mapping: Tensor, index_slot_mapping: Tensor,
        block_table: Tensor, seq_lens: Tensor, kv_cache: Tensor, index_cache: Tensor,
        input_norm: Tensor, qkv: Tensor, qkv_scale: Tensor | None, q_norm: Tensor, k_norm: Tensor,
        index_q_norm: Tensor, index_k_norm: Tensor, o_proj: Tensor, o_proj_scale: Tensor | None, post_norm: Tensor,
        gate: Tensor, gate_bias: Tensor | None, w13: Tensor, w13_scale: Tensor | None, w2: Tensor,
        w2_scale: Tensor | None, shared_w13: Tensor | None, shared_w13_scale: Tensor | None,
        shared_w2: Tensor | None, shared_w2_scale: Tensor | None,
        query_len: int, num_heads: int, num_kv_heads: int, head_dim: int, rotary_dim: int, rope_theta: float,
        eps: float, index_heads: int, index_dim: int, topk_blocks: int, top_k: int, routed_scaling: float,
        num_routed_experts: int, alpha: float, limit: float, k_scale: float, v_scale: float,
        layer_index: int = -1, checked: bool = False,
) -> tuple[Tensor, Tensor]:
    """One sparse MoE decode layer: (x, residual) -> (out, residual); writes k/v and index_k."""
    impl_calls["sparse"] += 1
    # A step that is not the uniform decode this op was compiled for (vLLM cannot guard batch kinds),
    # or one larger than the fused kernels take (a graph serving every size), runs the unfused
    # stages, whose step-dependent ops take the general path (step_context.py).
    fallback = general_step(query_len) is not None or x.shape[0] > MAX_TOKENS
    fallback_calls["sparse"] += fallback
    _check_step(x, residual, positions, slot_mapping, block_table, seq_lens, kv_cache,
                None if fallback else query_len)
    check_cache("index_cache", index_cache, (kv_cache.shape[0], kv_cache.shape[2], None))
    checked = checked or checked_mode.enabled()
    if should_validate(x, checked) and not fallback:
        validate_step_values(x, positions, slot_mapping, index_slot_mapping, block_table, seq_lens, kv_cache,
                             index_cache, query_len, finite=checked)
    w = dict(zip(SPARSE_WEIGHTS, (input_norm, qkv, qkv_scale, q_norm, k_norm, index_q_norm, index_k_norm, o_proj,
                                  o_proj_scale, post_norm, gate, gate_bias, w13, w13_scale, w2, w2_scale, shared_w13,
                                  shared_w13_scale, shared_w2, shared_w2_scale)))
    _check_late_weights(x, w, num_heads, head_dim, top_k, num_routed_experts)
    consts = (query_len, num_heads, num_kv_heads, head_dim, rotary_dim, rope_theta, eps, index_heads, index_dim,
              topk_blocks, top_k, routed_scaling, num_routed_experts, alpha, limit, k_scale, v_scale)
    step = (x, residual, positions, slot_mapping, index_slot_mapping, block_table, seq_lens)
    return _run("sparse_moe", layer_index, checked and not fallback, [kv_cache, index_cache],
                lambda c: (_sparse_stages if fallback else fused_sparse_impl)(*step, c[0], c[1], w, *consts),
                lambda c: _sparse_stages(*step, c[0], c[1], w, *consts))


@fused_decode_layer.register_fake
def _(x, residual, positions, slot_mapping, index_slot_mapping, block_table, seq_lens, kv_cache, index_cache,
      *rest):
    query_len = rest[len(SPARSE_WEIGHTS)]
    _check_step(x, residual, positions, slot_mapping, block_table, seq_lens, kv_cache, query_len)
    check_cache("index_cache", index_cache, (kv_cache.shape[0], kv_cache.shape[2], None))
    return torch.empty_like(x), torch.empty_like(x)


@torch.library.custom_op("minimax::fused_dense_decode_layer", mutates_args=("kv_cache",))
def fused_dense_decode_layer(
        x: Tensor, residual: Tensor, positions: Tensor, slot_mapping: Tensor, block_table: Tensor, seq_lens: Tensor,
        kv_cache: Tensor, input_norm: Tensor, qkv: Tensor, qkv_scale: Tensor | None, q_norm: Tensor,
        k_norm: Tensor, o_proj: Tensor, o_proj_scale: Tensor | None, post_norm: Tensor, w13: Tensor,
        w13_scale: Tensor | None, w2: Tensor, w2_scale: Tensor | None,
        query_len: int, num_heads: int, num_kv_heads: int, head_dim: int, rotary_dim: int, rope_theta: float,
        eps: float, alpha: float, limit: float, k_scale: float, v_scale: float,
        layer_index: int = -1, checked: bool = False,
) -> tuple[Tensor, Tensor]:
    """One dense decode layer (full GQA attention + SwiGLU-OAI MLP)."""
    impl_calls["dense"] += 1
    # A step that is not the uniform decode this op was compiled for (vLLM cannot guard batch kinds),
    # or one larger than the fused kernels take (a graph serving every size), runs the unfused
    # stages, whose step-dependent ops take the general path (step_context.py).
    fallback = general_step(query_len) is not None or x.shape[0] > MAX_TOKENS
    fallback_calls["dense"] += fallback
    _check_step(x, residual, positions, slot_mapping, block_table, seq_lens, kv_cache,
                None if fallback else query_len)
    checked = checked or checked_mode.enabled()
    if should_validate(x, checked) and not fallback:
        validate_step_values(x, positions, slot_mapping, None, block_table, seq_lens, kv_cache, None, query_len,
                             finite=checked)
    w = dict(zip(DENSE_WEIGHTS, (input_norm, qkv, qkv_scale, q_norm, k_norm, o_proj, o_proj_scale, post_norm, w13,
                                 w13_scale, w2, w2_scale)))
    _check_late_weights(x, w, num_heads, head_dim)
    consts = (query_len, num_heads, num_kv_heads, head_dim, rotary_dim, rope_theta, eps, alpha, limit, k_scale,
              v_scale)
    step = (x, residual, positions, slot_mapping, block_table, seq_lens)
    return _run("dense", layer_index, checked and not fallback, [kv_cache],
                lambda c: (_dense_stages if fallback else fused_dense_impl)(*step, c[0], w, *consts),
                lambda c: _dense_stages(*step, c[0], w, *consts))


@fused_dense_decode_layer.register_fake
def _(x, residual, positions, slot_mapping, block_table, seq_lens, kv_cache, *rest):
    query_len = rest[len(DENSE_WEIGHTS)]
    _check_step(x, residual, positions, slot_mapping, block_table, seq_lens, kv_cache, query_len)
    return torch.empty_like(x), torch.empty_like(x)
