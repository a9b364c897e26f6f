"""The stage kernels of a fused decode layer, each launched as a programmatic dependent (PDL) of
the one before it on the current stream.

With PDL (Hopper griddepcontrol) a kernel is launched while its predecessor still runs: its
programs become resident, compute their addresses and ask L2 for the first bytes of their weight
slice, then wait for the predecessor's outputs. Kernel boundaries inside the layer (and between
layers, whose first kernel is a dependent of the previous layer's last) stop draining the GPU.
That is only safe where the launch order is known, i.e. inside the fused op: the vocabulary ops
launch plainly. The indexer is the exception inside the op: a dependent in one-token steps only.
Off NVIDIA sm_90+ the flag is ignored (the same kernels run unchained).

``kernel_stages()`` has the call signatures of the vocabulary ops of ops/stages.py, so the one layer
chain (ops/chain.py) runs on either; in place of the qkv projection + qk norm / RoPE / insert pair it
offers ``qkv_norm_rope_insert`` (kernels/qkv_mma.py: one kernel where the weights allow), and in
place of the indexer top-k + sparse attention pair ``index_sparse_attention`` (the indexer's score
pass, then sparse attention making the top-k selection in-kernel: no top-k kernel, no block ids in
memory), and in place of the route + moe_experts pair ``routed_moe_experts`` (one-token steps on
mma-layout tables make the router's top-k inside the expert kernels, kernels/moe.py; other steps
launch the pair), and where no all-reduce separates the halves the o_proj + post norm + router +
experts steps as one, ``project_norm_routed_moe_experts`` (the post norm deferred into o_proj's last
programs, the router and w13, where the step routes in-kernel); the chain takes each when offered.
Inputs were checked by the fused op before the first launch.
"""

from __future__ import annotations

import os
from types import SimpleNamespace

import torch

from ..reference import swiglu_oai

from . import attention, index_topk, moe, mx_linear, norm, qkv_mma, router


def _out_dtype(out_fp32: bool) -> torch.dtype:
    return torch.float32 if out_fp32 else torch.bfloat16


def _add_rmsnorm(x, residual, weight, eps):
    return norm.add_rmsnorm(x, residual, weight, eps, pdl=True)


def _input_add_rmsnorm(x, residual, weight, eps):
    # The layer's first kernel lets the qkv GEMV launch before its own wait: the GEMV reads only weights before
    # its wait (which then covers the norm's). Not the post norm: its router's programs would take places on
    # o_proj's tail (BENCHMARKS.md). MINIMAX_OPS_NORM_LAUNCH_FIRST=0 (read at every call) turns it off.
    return norm.add_rmsnorm(x, residual, weight, eps, pdl=True,
                            launch_first=os.environ.get("MINIMAX_OPS_NORM_LAUNCH_FIRST") != "0")


def _mx_linear(x, weight, scale, out_fp32=False):
    return mx_linear.mx_linear(x, weight, scale, out_dtype=_out_dtype(out_fp32), pdl=True)


def _qkv_norm_rope_insert(*args, **kwargs):
    # The qkv GEMV and the qk norm / RoPE / cache insert in one kernel where the weights allow it.
    return qkv_mma.qkv_norm_rope_insert(*args, **kwargs, pdl=True)


def _route(h, gate, gate_bias, top_k, scaling):
    return router.route(h, gate, gate_bias, top_k, scaling, pdl=True)


def _moe_experts(h, topk_ids, topk_weights, w13, w13_scale, w2, w2_scale, shared_w13, shared_w13_scale, shared_w2,
                 shared_w2_scale, num_routed_experts, alpha, limit, out_fp32=False):
    out = moe.moe_experts(h, topk_ids, topk_weights, w13, w13_scale, w2, w2_scale, shared_w13, shared_w13_scale,
                          shared_w2, shared_w2_scale, num_routed_experts=num_routed_experts, alpha=alpha,
                          limit=limit, pdl=True)
    return out.float() if out_fp32 else out  # (the vocabulary op's tensor-parallel partial form)


def _routed_moe_experts(h, gate, gate_bias, top_k, scaling, w13, w13_scale, w2, w2_scale, shared_w13,
                        shared_w13_scale, shared_w2, shared_w2_scale, num_routed_experts, alpha, limit, out_fp32=False):
    # The steps moe.routes_in_kernel takes (decided here, once) route inside the expert kernels; other
    # steps launch the router and the experts (module functions: benchmarks/stage_removal.py replaces them).
    experts = (w13, w13_scale, w2, w2_scale, shared_w13, shared_w13_scale, shared_w2, shared_w2_scale)
    if not moe.routes_in_kernel(h.shape[0], w13, w13_scale):
        weights, ids = _route(h, gate, gate_bias, top_k, scaling)
        return _moe_experts(h, ids, weights, *experts, num_routed_experts, alpha, limit, out_fp32)
    out = moe.routed_moe_experts(h, gate, gate_bias, top_k, scaling, *experts, num_routed_experts=num_routed_experts,
                                 alpha=alpha, limit=limit, pdl=True)
    return out.float() if out_fp32 else out


def defers_post_norm(n_tokens, o_proj, o_proj_scale, w13, w13_scale, shared_w13, shared_w13_scale) -> bool:
    """Whether the FFN step takes o_proj with the post norm deferred (``_project_norm_routed_moe_experts``):
    steps routed in the expert kernels (moe.routes_in_kernel) whose o_proj and separate shared expert (if
    any) are in an mma layout too, unless MINIMAX_OPS_DEFER_POST_NORM=0 (read at every call: A/B runs switch
    it between rounds of one process)."""
    if os.environ.get("MINIMAX_OPS_DEFER_POST_NORM") == "0" or not moe.routes_in_kernel(n_tokens, w13, w13_scale):
        return False
    shared_mma = shared_w13 is None or mx_linear.in_mma_layout(shared_w13, shared_w13_scale)
    return shared_mma and mx_linear.in_mma_layout(o_proj, o_proj_scale)


def _project_norm_routed_moe_experts(attn, o_proj, o_proj_scale, residual, post_norm, eps, gate, gate_bias, top_k,
                                     scaling, w13, w13_scale, w2, w2_scale, shared_w13, shared_w13_scale, shared_w2,
                                     shared_w2_scale, num_routed_experts, alpha, limit):
    """o_proj, the post-attention norm and the routed + shared experts of a layer without an all-reduce
    between its halves (chain.OutProjection) -> (out, residual). Where ``defers_post_norm``: o_proj's
    last program of each column group adds the residual and sums the squares of its columns
    (linear_mma.mma_linear_add_norm), the router makes the norm's h from them and w13 applies the row's
    rstd to its products: no norm kernel between o_proj and the router. Otherwise the three steps."""
    experts = (w13, w13_scale, w2, w2_scale, shared_w13, shared_w13_scale, shared_w2, shared_w2_scale)
    if not defers_post_norm(attn.shape[0], o_proj, o_proj_scale, w13, w13_scale, shared_w13, shared_w13_scale):
        h, residual = _add_rmsnorm(_mx_linear(attn, o_proj, o_proj_scale), residual, post_norm, eps)
        return _routed_moe_experts(h, gate, gate_bias, top_k, scaling, *experts, num_routed_experts, alpha,
                                   limit), residual
    res_out, scaled, sumsq = mx_linear.mx_linear_add_norm(attn, o_proj, o_proj_scale, residual, post_norm, pdl=True)
    out = moe.routed_moe_experts(scaled, gate, gate_bias, top_k, scaling, *experts,
                                 num_routed_experts=num_routed_experts, alpha=alpha, limit=limit, pdl=True,
                                 deferred_norm=(res_out, post_norm, sumsq, eps))
    return out, res_out


def _mlp(h, w13, w13_scale, w2, w2_scale, alpha, limit, out_fp32=False):
    # The SwiGLU between the projections is a torch op: the PDL chain restarts after it.
    gate, up = mx_linear.mx_linear(h, w13, w13_scale, out_dtype=torch.float32, pdl=True).chunk(2, dim=-1)
    return mx_linear.mx_linear(swiglu_oai(gate, up, alpha, limit).to(torch.bfloat16), w2, w2_scale,
                               out_dtype=_out_dtype(out_fp32), pdl=True)


def kernel_stages() -> SimpleNamespace:
    """The stage kernels of a layer step. (None asks L2 for a later stage's weights: o_proj's asked
    for by the latency-bound indexer and attention made the layer slower at every share tried,
    BENCHMARKS.md.)"""

    def index_topk_(index_q, index_cache, block_table, seq_lens, query_len, topk):
        # A programmatic dependent only in one-token steps: with 2-16 tokens the indexer's kernels
        # measured 1-12 us slower launched early than launched plainly (BENCHMARKS.md).
        return index_topk.index_topk(index_q, index_cache, block_table, seq_lens, query_len, topk,
                                     pdl=index_q.shape[0] == 1)

    def sparse_attention_decode(q, kv_cache, block_table, seq_lens, block_ids, query_len, k_scale, v_scale):
        return attention.sparse_attention_decode(q, kv_cache, block_table, seq_lens, block_ids, query_len, k_scale,
                                                 v_scale, pdl=True)

    def index_sparse_attention(q, index_q, kv_cache, index_cache, block_table, seq_lens, query_len, topk, k_scale,
                               v_scale):
        """index_topk_ then sparse_attention_decode as three kernels: the indexer's score pass, the
        attention splits (each making the top-k selection from the scores itself) and their merge.
        MINIMAX_OPS_NO_ATTN_SELECT=1 (read at every call, so a CUDA graph keeps the form it was
        captured with) runs the two stages instead (score + top-k kernels, then attention on the
        block ids), for A/B measurements."""
        if os.environ.get("MINIMAX_OPS_NO_ATTN_SELECT") == "1":
            block_ids = index_topk_(index_q, index_cache, block_table, seq_lens, query_len, topk)
            return sparse_attention_decode(q, kv_cache, block_table, seq_lens, block_ids, query_len, k_scale, v_scale)
        # The score pass is a programmatic dependent in one-token steps only, as in index_topk_.
        scores = index_topk.index_scores(index_q, index_cache, block_table, seq_lens, query_len,
                                         pdl=index_q.shape[0] == 1)
        return attention.index_sparse_attention_decode(q, scores, kv_cache, block_table, seq_lens, query_len, topk,
                                                       k_scale, v_scale, pdl=True)

    def dense_attention_decode(q, kv_cache, block_table, seq_lens, query_len, k_scale, v_scale):
        return attention.dense_attention_decode(q, kv_cache, block_table, seq_lens, query_len, k_scale, v_scale,
                                                pdl=True)

    return SimpleNamespace(
        add_rmsnorm=_add_rmsnorm, input_add_rmsnorm=_input_add_rmsnorm, mx_linear=_mx_linear,
        qkv_norm_rope_insert=_qkv_norm_rope_insert,
        index_topk=index_topk_, index_sparse_attention=index_sparse_attention,
        sparse_attention_decode=sparse_attention_decode, dense_attention_decode=dense_attention_decode,
        route=_route, moe_experts=_moe_experts, routed_moe_experts=_routed_moe_experts,
        project_norm_routed_moe_experts=_project_norm_routed_moe_experts, mlp=_mlp)
