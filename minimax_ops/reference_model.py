"""Reference layers and text model, composed from reference.py: the oracle for whole steps.

``act_dtype`` rounds activations at the stage boundaries where the ops store them (bf16 by
default), so the oracle and the kernels see the same inputs at every stage; None keeps fp32.
One function serves prefill and decode: token spans come from the step's query lengths.

Tensor parallelism is emulated in one process (``tp_model_forward``): every rank's shard computes
its partial o_proj / FFN output in fp32, and the partials are summed in fp32 and rounded once, as
the ops and minimax.all_reduce do. With one shard it is the plain model.
"""

from __future__ import annotations

import torch

from . import reference as ref
from .cache import LayerCache, StepMetadata
from .config import SPARSE_MOE, MiniMaxM3Config
from .weights import LayerWeights, ModelWeights


def _rounder(act_dtype: torch.dtype | None):
    if act_dtype is None:
        return lambda t: t.float()
    return lambda t: t.to(act_dtype).float()


def attention_block(h, w: LayerWeights, cache: LayerCache, meta: StepMetadata, config: MiniMaxM3Config,
                    *, k_scale=1.0, v_scale=1.0, act_dtype=torch.bfloat16, partial=False):
    """Steps 2-7 on normed input h [n, H]: projection, norm/RoPE/insert, (indexer,) attention, o_proj
    (left in fp32 with partial: a tensor-parallel partial sum)."""
    c, rnd, n = config, _rounder(act_dtype), h.shape[0]
    sparse = w.kind == SPARSE_MOE
    qkv = rnd(ref.linear(h, w.qkv, w.qkv_scale))
    q, index_q = ref.qk_norm_rope_insert(
        qkv, meta.positions, meta.slot_mapping, meta.index_slot_mapping, w.q_norm, w.k_norm,
        w.index_q_norm, w.index_k_norm, cache.kv, cache.index, num_heads=c.num_attention_heads,
        num_kv_heads=c.num_key_value_heads, head_dim=c.head_dim, rotary_dim=c.rotary_dim,
        rope_theta=c.rope_theta, eps=c.rms_norm_eps, index_heads=c.sparse_num_index_heads if sparse else 0,
        index_dim=c.sparse_index_dim if sparse else 0, k_scale=k_scale, v_scale=v_scale)
    q = rnd(q)
    lens = list(meta.query_lens)
    if sparse:
        ids = ref.index_topk(rnd(index_q), cache.index, meta.block_table, meta.seq_lens, 0, c.sparse_topk_blocks,
                             query_lens=lens)
        attn = ref.sparse_attention(q, cache.kv, meta.block_table, meta.seq_lens, ids, 0, k_scale, v_scale,
                                    query_lens=lens)
    else:
        attn = ref.dense_attention(q, cache.kv, meta.block_table, meta.seq_lens, 0, k_scale, v_scale,
                                   query_lens=lens)
    o = ref.linear(rnd(attn.reshape(n, -1)), w.o_proj, w.o_proj_scale)
    return o if partial else rnd(o)


def ffn_block(h, w: LayerWeights, config: MiniMaxM3Config):
    """Steps 9-10 (router + experts + shared) for sparse MoE layers, the dense MLP otherwise."""
    c = config
    if w.kind != SPARSE_MOE:
        return ref.mlp(h, w.w13, w.w13_scale, w.w2, w.w2_scale, c.swiglu_alpha, c.swiglu_limit)
    weights, ids = ref.route(h, w.gate, w.gate_bias, c.num_experts_per_tok, c.routed_scaling_factor)
    return ref.moe_experts(h, ids, weights, w.w13, w.w13_scale, w.w2, w.w2_scale, w.shared_w13,
                           w.shared_w13_scale, w.shared_w2, w.shared_w2_scale,
                           num_routed_experts=c.num_local_experts, alpha=c.swiglu_alpha, limit=c.swiglu_limit)


def layer_forward(x, residual, w: LayerWeights, cache: LayerCache, meta: StepMetadata, config: MiniMaxM3Config,
                  *, k_scale=1.0, v_scale=1.0, act_dtype=torch.bfloat16):
    """One decoder layer: (x, residual) -> (out, residual), caches written in place.
    x is the previous layer's FFN output; the first layer gets the embeddings and a zero residual."""
    return tp_layer_forward(x, residual, [w], [cache], meta, config, k_scale=k_scale, v_scale=v_scale,
                            act_dtype=act_dtype)


def tp_layer_forward(x, residual, shards: list[LayerWeights], caches: list[LayerCache], meta: StepMetadata,
                     config: MiniMaxM3Config, *, k_scale=1.0, v_scale=1.0, act_dtype=torch.bfloat16):
    """layer_forward over the ranks' shards (config: the per-rank config), each rank writing its own cache."""
    rnd, eps = _rounder(act_dtype), config.rms_norm_eps
    residual = rnd(residual.float() + x.float())
    h = rnd(ref.gemma_rmsnorm(residual, shards[0].input_norm, eps))
    attn = rnd(sum(attention_block(h, w, cache, meta, config, k_scale=k_scale, v_scale=v_scale, act_dtype=act_dtype,
                                   partial=True) for w, cache in zip(shards, caches, strict=True)))
    residual = rnd(residual + attn)
    h = rnd(ref.gemma_rmsnorm(residual, shards[0].post_norm, eps))
    return rnd(sum(ffn_block(h, w, config) for w in shards)), residual


def model_forward(input_ids, weights: ModelWeights, caches: list[LayerCache], meta: StepMetadata,
                  config: MiniMaxM3Config, *, act_dtype=torch.bfloat16) -> torch.Tensor:
    """Embedding, every layer, final norm, lm_head -> fp32 logits [n, vocab]."""
    return tp_model_forward(input_ids, [weights], [caches], meta, config, act_dtype=act_dtype)


def tp_model_forward(input_ids, rank_weights: list[ModelWeights], rank_caches: list[list[LayerCache]],
                     meta: StepMetadata, config: MiniMaxM3Config, *, act_dtype=torch.bfloat16) -> torch.Tensor:
    """model_forward over the ranks' shards (config: the per-rank config; embeddings, final norm and
    lm_head are replicated, so rank 0's serve)."""
    first = rank_weights[0]
    x = first.embed[input_ids].float()
    residual = torch.zeros_like(x)
    for i in range(len(first.layers)):
        x, residual = tp_layer_forward(x, residual, [w.layers[i] for w in rank_weights],
                                       [c[i] for c in rank_caches], meta, config, act_dtype=act_dtype)
    h = ref.gemma_rmsnorm(residual + x, first.final_norm, config.rms_norm_eps)
    return ref.linear(h, first.lm_head)
