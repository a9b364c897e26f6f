"""The decoder layer chain in the vocabulary, written once: the model traces it (model.py), the graph
pass fuses what it traces (graph_passes/decode_layer_patterns.py), and the fused ops run it as their
default implementation and fallback (fused.py).

A layer is two halves split at the tensor-parallel all-reduces (m3-decode-spec.md, steps 1-7 and 8-11):

    o, residual   = attention half(x, residual, <step>, <caches>, w, c)     # o unreduced
    o             = all_reduce(o)                                            # tensor parallel only
    out, residual = FFN half(o, residual, w, c)                              # out unreduced
    out           = all_reduce(out)

``w`` maps the names in SPARSE_WEIGHTS / DENSE_WEIGHTS to tensors (the layer's shard under tensor
parallelism); ``c`` is a SparseConsts / DenseConsts, whose fields are the fused ops' constant
arguments in their order, then ``partial``: under tensor parallelism the halves return fp32 partial
sums (o_proj / FFN ``out_fp32``), and the all-reduce sums them in fp32 and rounds once, so a TP
result equals the TP 1 result up to fp32 reassociation (bf16 partials would round twice, and a
flipped top-k choice downstream turns that into a different token). A layer's output is reduced,
so the next layer (or the final norm, or a pipeline stage boundary) receives whole hidden states.
"""

from __future__ import annotations

from collections import namedtuple

import torch

from .collectives import reduce_sum

MM = torch.ops.minimax
mm = MM

SPARSE_WEIGHTS = ("input_norm", "qkv", "qkv_scale", "q_norm", "k_norm", "index_q_norm", "index_k_norm",
                  "o_proj", "o_proj_scale", "post_norm", "gate", "gate_bias", "w13", "w13_scale", "w2",
                  "w2_scale", "shared_w13", "shared_w13_scale", "shared_w2", "shared_w2_scale")
DENSE_WEIGHTS = ("input_norm", "qkv", "qkv_scale", "q_norm", "k_norm", "o_proj", "o_proj_scale", "post_norm",
                 "w13", "w13_scale", "w2", "w2_scale")


_HEADS = ("query_len", "num_heads", "num_kv_heads", "head_dim", "rotary_dim", "rope_theta", "eps")
_SPARSE = ("index_heads", "index_dim", "topk_blocks", "top_k", "routed_scaling", "num_routed_experts")
# `partial` is not an op argument: fp32 partial sums under tensor parallelism (module docstring).
_TAIL = ("alpha", "limit", "k_scale", "v_scale", "partial")
SparseConsts = namedtuple("SparseConsts", (*_HEADS, *_SPARSE, *_TAIL), defaults=(False,))
DenseConsts = namedtuple("DenseConsts", (*_HEADS, *_TAIL), defaults=(False,))


# The attention output before o_proj, handed to the FFN half by a kernel namespace that offers
# ``project_norm_routed_moe_experts`` where no all-reduce separates the halves (TP 1, sparse_attention):
# o_proj then runs as the FFN step's first kernel, the post norm deferred into it.
OutProjection = namedtuple("OutProjection", ("x", "weight", "scale"))


def _fp32(c) -> tuple:
    """The out_fp32 argument, given only when set: graphs without tensor parallelism keep their form."""
    return (True,) if c.partial else ()


def _heads(c):
    return c.num_heads, c.num_kv_heads, c.head_dim, c.rotary_dim, c.rope_theta, c.eps


def _project_insert(x, residual, positions, slot_mapping, index_slot_mapping, kv_cache, index_cache, w, c, mm):
    """Input norm, the qkv projection and the qk norm / RoPE / cache insert -> (q, index_q or None,
    residual); index_slot_mapping None: a dense layer. A kernel namespace (``ops``) may offer the
    projection and the insert as one step, ``qkv_norm_rope_insert`` (the signature of
    kernels/qkv_mma.py's), and the layer's input norm apart from its other norms, ``input_add_rmsnorm``
    (add_rmsnorm's signature; the kernel namespace launches it differently); the vocabulary has two ops."""
    input_norm = getattr(mm, "input_add_rmsnorm", None) if mm is not MM else None
    h, residual = (input_norm or mm.add_rmsnorm)(x, residual, w["input_norm"], c.eps)
    sparse = index_slot_mapping is not None
    one_step = getattr(mm, "qkv_norm_rope_insert", None) if mm is not MM else None
    if one_step is not None:
        index = dict(index_heads=c.index_heads, index_dim=c.index_dim) if sparse else {}
        q, index_q = one_step(h, w["qkv"], w["qkv_scale"], positions, slot_mapping, index_slot_mapping, w["q_norm"],
                              w["k_norm"], w.get("index_q_norm"), w.get("index_k_norm"), kv_cache, index_cache,
                              num_heads=c.num_heads, num_kv_heads=c.num_kv_heads, head_dim=c.head_dim,
                              rotary_dim=c.rotary_dim, rope_theta=c.rope_theta, eps=c.eps, **index,
                              k_scale=c.k_scale, v_scale=c.v_scale)
        return q, index_q, residual
    qkv = mm.mx_linear(h, w["qkv"], w["qkv_scale"])
    if sparse:
        q, index_q = mm.qk_norm_rope_kv_index_insert(
            qkv, positions, slot_mapping, index_slot_mapping, w["q_norm"], w["k_norm"], w["index_q_norm"],
            w["index_k_norm"], kv_cache, index_cache, *_heads(c), c.index_heads, c.index_dim, c.k_scale, c.v_scale)
        return q, index_q, residual
    q = mm.qk_norm_rope_kv_insert(qkv, positions, slot_mapping, w["q_norm"], w["k_norm"], kv_cache, *_heads(c),
                                  c.k_scale, c.v_scale)
    return q, None, residual


def sparse_attention(x, residual, positions, slot_mapping, index_slot_mapping, block_table, seq_lens, kv_cache,
                     index_cache, w, c: SparseConsts, query_lens: list[int] | None = None, ops=None):
    """Steps 1-7 of a sparse MoE layer -> (o unreduced, residual). ``query_lens`` (the model's
    any-step path, prefills and mixed batches) replaces indexer + decode attention by attention_any_step.
    ``ops``: the vocabulary (default) or kernels/decode_layer.kernel_stages(), same signatures; a kernel
    namespace may offer the indexer top-k and the sparse attention as one step, ``index_sparse_attention``
    (the top-k made inside the attention kernel); the vocabulary has two ops."""
    mm = ops or MM
    q, index_q, residual = _project_insert(x, residual, positions, slot_mapping, index_slot_mapping, kv_cache,
                                           index_cache, w, c, mm)
    one_step = getattr(mm, "index_sparse_attention", None) if mm is not MM else None
    if query_lens is not None:
        attn = mm.attention_any_step(q, index_q, kv_cache, index_cache, block_table, seq_lens, query_lens,
                                     c.topk_blocks, c.k_scale, c.v_scale)
    elif one_step is not None:
        attn = one_step(q, index_q, kv_cache, index_cache, block_table, seq_lens, c.query_len, c.topk_blocks,
                        c.k_scale, c.v_scale)
    else:
        block_ids = mm.index_topk(index_q, index_cache, block_table, seq_lens, c.query_len, c.topk_blocks)
        attn = mm.sparse_attention_decode(q, kv_cache, block_table, seq_lens, block_ids, c.query_len, c.k_scale,
                                          c.v_scale)
    if mm is not MM and not c.partial and getattr(mm, "project_norm_routed_moe_experts", None) is not None:
        return OutProjection(attn, w["o_proj"], w["o_proj_scale"]), residual
    return mm.mx_linear(attn, w["o_proj"], w["o_proj_scale"], *_fp32(c)), residual


def dense_attention(x, residual, positions, slot_mapping, block_table, seq_lens, kv_cache, w, c: DenseConsts,
                    query_lens: list[int] | None = None, ops=None):
    """Steps 1-7 of a dense layer (full GQA attention) -> (o unreduced, residual)."""
    mm = ops or MM
    q, _, residual = _project_insert(x, residual, positions, slot_mapping, None, kv_cache, None, w, c, mm)
    if query_lens is not None:
        attn = mm.attention_any_step(q, None, kv_cache, None, block_table, seq_lens, query_lens, 1, c.k_scale,
                                     c.v_scale)
    else:
        attn = mm.dense_attention_decode(q, kv_cache, block_table, seq_lens, c.query_len, c.k_scale, c.v_scale)
    return mm.mx_linear(attn, w["o_proj"], w["o_proj_scale"], *_fp32(c)), residual


def sparse_ffn(o, residual, w, c: SparseConsts, ops=None):
    """Steps 8-10 on the reduced attention output: post norm, router, routed + shared experts
    -> (out unreduced, residual). A kernel namespace (``ops``) may offer the router and the experts as
    one step, ``routed_moe_experts`` (the signature of kernels/moe.py's, the router's arguments first);
    the vocabulary has two ops. ``o`` an OutProjection (sparse_attention's, TP 1 on kernels): step 7 too,
    o_proj through post norm and experts as one kernel step (``project_norm_routed_moe_experts``)."""
    mm = ops or MM
    experts = (w["w13"], w["w13_scale"], w["w2"], w["w2_scale"], w["shared_w13"], w["shared_w13_scale"], w["shared_w2"],
               w["shared_w2_scale"], c.num_routed_experts, c.alpha, c.limit, *_fp32(c))
    if isinstance(o, OutProjection):
        return mm.project_norm_routed_moe_experts(o.x, o.weight, o.scale, residual, w["post_norm"], c.eps, w["gate"],
                                                  w["gate_bias"], c.top_k, c.routed_scaling, *experts)
    h, residual = mm.add_rmsnorm(o, residual, w["post_norm"], c.eps)
    one_step = getattr(mm, "routed_moe_experts", None) if mm is not MM else None
    if one_step is not None:
        return one_step(h, w["gate"], w["gate_bias"], c.top_k, c.routed_scaling, *experts), residual
    weights, ids = mm.route(h, w["gate"], w["gate_bias"], c.top_k, c.routed_scaling)
    return mm.moe_experts(h, ids, weights, *experts), residual


def dense_ffn(o, residual, w, c: DenseConsts, ops=None):
    """Post norm and the dense SwiGLU-OAI MLP -> (out unreduced, residual)."""
    mm = ops or MM
    h, residual = mm.add_rmsnorm(o, residual, w["post_norm"], c.eps)
    return mm.mlp(h, w["w13"], w["w13_scale"], w["w2"], w["w2_scale"], c.alpha, c.limit, *_fp32(c)), residual


def all_reduce(x, group_name: str):
    """The tensor-parallel sum, bf16 ("" = no tensor parallelism: x itself, and no op in the graph)."""
    return mm.all_reduce(x, group_name) if group_name else x


def run_layer(attention, ffn, attention_args, w, c, group_name: str, fp32_sums: bool = False):
    """One layer: attention(*attention_args, w, c), all-reduce, ffn, all-reduce -> (out, residual).
    ``fp32_sums`` (the fused ops where their FFN half runs on the stage kernels): the halves' fp32 partials
    are theirs, so each is summed in place (collectives.reduce_sum), and the FFN half takes the first sum
    in fp32: its post norm kernel rounds it to bf16 as minimax.all_reduce would (no cast kernel between)."""
    o, residual = attention(*attention_args, w, c)
    if not (fp32_sums and group_name):
        out, residual = ffn(all_reduce(o, group_name), residual, w, c)
        return all_reduce(out, group_name), residual
    out, residual = ffn(reduce_sum(o, group_name, in_place=True), residual, w, c)
    return reduce_sum(out, group_name, in_place=True).to(torch.bfloat16), residual
