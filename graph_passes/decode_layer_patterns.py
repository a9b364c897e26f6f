"""The two decode-layer chains the pass fuses, each anchored on its cache-insert op.

How a layer is recognised: from the (functionalised) cache-insert call, walk the data edges back to
the input add_rmsnorm and forward to the FFN op, checking at every step the op, the argument it
flows into, and that no value escapes the chain (an intermediate with a user outside the layer
would be lost by fusing). Anchoring on the insert is robust because it is the one op per layer
that owns a cache, it appears once per layer whatever else surrounds the layer, and every other
chain op is reached through named arguments, never by node order or names. What the walk finds
is then re-checked against the step guards on FakeTensor metadata (guards.py).

Under tensor parallelism the chain also holds ``minimax.all_reduce`` after o_proj and after the FFN
(ops/chain.py): both or neither, with one group name, which the fused call then takes as its
``group_name`` and reduces with inside its body.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.fx import Graph, Node

from minimax_ops.ops.chain import DENSE_WEIGHTS, SPARSE_WEIGHTS

from .fx_utils import arg, insert_functional_call, is_op, mutated_output, only_users, outputs

mm = torch.ops.minimax


class Refused(Exception):
    """This layer cannot be fused; the message says why."""


def _need(cond: bool, reason: str) -> None:
    if not cond:
        raise Refused(reason)


def _reduced(node: Node, what: str) -> tuple[Node | None, Node]:
    """(the all_reduce taking node, its output) when node's one user is minimax.all_reduce, else (None, node)."""
    reduces = [u for u in node.users if is_op(u, mm.all_reduce.default)]
    # A tensor-parallel partial sum is kept in fp32 (ops/chain.py); a whole one is bf16.
    _need(bool(arg(node, "out_fp32")) == bool(reduces), f"{what}: out_fp32 does not match its all-reduce")
    if not reduces:
        return None, node
    _need(len(reduces) == 1 and only_users(node, set(reduces)), f"{what}: all-reduced and also used unreduced")
    return reduces[0], reduces[0]


def _group_name(first: Node | None, second: Node | None) -> str:
    _need((first is None) == (second is None), "one of the layer's two all-reduces is missing")
    if first is None:
        return ""
    name = arg(first, "group_name")
    _need(arg(second, "group_name") == name, "the layer's two all-reduces name different groups")
    return name


def _sole_user(node: Node, op: Any, what: str) -> Node:
    users = [u for u in node.users if is_op(u, op)]
    _need(len(users) == 1, f"{what}: expected one {op} user, found {len(users)}")
    return users[0]


@dataclass
class LayerMatch:
    kind: str
    nodes: list[Node]  # every chain node, in graph order (getitems included)
    last: Node  # where the fused call goes
    kwargs: dict[str, Any]  # fused op arguments
    mutated: dict[str, Node]  # cache name -> base node
    replaced: list[Node | None] = field(default_factory=list)  # old values, in fused-output order
    val: dict[str, Any] = field(default_factory=dict)


class _DecodeLayerPattern:
    fused_op: Any
    insert_op: Any
    weight_names: tuple[str, ...]
    caches: tuple[str, ...]

    def _front(self, insert: Node):
        """add_rmsnorm -> mx_linear -> insert; returns (norm, its getitems, linear)."""
        qkv = arg(insert, "qkv")
        _need(is_op(qkv, mm.mx_linear.default), "qkv: not produced by minimax.mx_linear")
        h = arg(qkv, "x")
        norm = h.args[0] if isinstance(h, Node) and h.target is operator.getitem else None
        _need(norm is not None and is_op(norm, mm.add_rmsnorm.default), "qkv input: not an add_rmsnorm output")
        got = outputs(norm)
        _need(h is got.get(0) and only_users(h, {qkv}) and only_users(qkv, {insert}),
              "normed input or qkv has users outside the layer")
        return norm, got, qkv

    def _back(self, attn: Node, norm: Node, norm_out: dict[int, Node]):
        """attention -> o_proj mx_linear (-> all_reduce) -> add_rmsnorm (residual from the input norm).
        Returns (o_proj, its all_reduce or None, post norm, post norm outputs)."""
        o = _sole_user(attn, mm.mx_linear.default, "attention output")
        _need(only_users(attn, {o}), "attention output has users outside the layer")
        reduce, o_out = _reduced(o, "o_proj output")
        post = _sole_user(o_out, mm.add_rmsnorm.default, "o_proj output")
        _need(only_users(o_out, {post}), "o_proj output has users outside the layer")
        _need(arg(post, "residual") is norm_out.get(1) and only_users(norm_out[1], {post}),
              "post-attention norm does not take the layer's residual alone")
        _need(arg(post, "eps") == arg(norm, "eps"), "input and post-attention norms use different eps")
        return o, reduce, post, outputs(post)

    def _finish(self, kind, chain, ffn, reduce, kwargs, mutated, replaced, insert):
        """ffn: the layer's FFN op; reduce: the o_proj all_reduce (None without tensor parallelism)."""
        eps_insert = arg(insert, "eps")
        _need(eps_insert == kwargs["eps"], "qk norm eps differs from the layer norm eps")
        # The fused op takes one (k_scale, v_scale) for writing and reading the cache.
        _need((arg(insert, "k_scale"), arg(insert, "v_scale")) == (kwargs["k_scale"], kwargs["v_scale"]),
              "the cache insert's k/v scales differ from the attention's")
        out_reduce, out = _reduced(ffn, "FFN output")
        kwargs["group_name"] = _group_name(reduce, out_reduce)
        order = {n: i for i, n in enumerate(insert.graph.nodes)}
        nodes = sorted((n for n in (*chain, reduce, out_reduce) if n is not None), key=order.__getitem__)
        return LayerMatch(kind, nodes, out, kwargs, mutated, [out, *replaced])

    def _common_kwargs(self, norm, qkv, insert, attn, o, post) -> dict[str, Any]:
        kw = dict(x=arg(norm, "x"), residual=arg(norm, "residual"), positions=arg(insert, "positions"),
                  slot_mapping=arg(insert, "slot_mapping"), block_table=arg(attn, "block_table"),
                  seq_lens=arg(attn, "seq_lens"), input_norm=arg(norm, "weight"), qkv=arg(qkv, "weight"),
                  qkv_scale=arg(qkv, "scale"), q_norm=arg(insert, "q_norm"), k_norm=arg(insert, "k_norm"),
                  o_proj=arg(o, "weight"), o_proj_scale=arg(o, "scale"), post_norm=arg(post, "weight"),
                  query_len=arg(attn, "query_len"), eps=arg(norm, "eps"), k_scale=arg(attn, "k_scale"),
                  v_scale=arg(attn, "v_scale"))
        for name in ("num_heads", "num_kv_heads", "head_dim", "rotary_dim", "rope_theta"):
            kw[name] = arg(insert, name)
        return kw

    def replace(self, graph: Graph, m: LayerMatch) -> Node:
        returns = 2
        with graph.inserting_before(m.last):
            call, items = insert_functional_call(graph, m.kwargs.get("_like"), self.fused_op,
                                                 {k: v for k, v in m.kwargs.items() if k != "_like"},
                                                 m.mutated, returns)
        for new, old in zip(items, m.replaced):
            if old is not None:
                new.meta["val"] = old.meta.get("val")
                old.replace_all_uses_with(new)
        call.meta["val"] = tuple(i.meta.get("val") for i in items)
        for node in reversed(m.nodes):
            if not node.users:
                graph.erase_node(node)
        return call


class SparseMoEDecodeLayer(_DecodeLayerPattern):
    """A sparse MoE decode layer (MiniMax-M3 layers 3..59).

    unfused:
        h, res   = add_rmsnorm(x, residual, input_norm)
        qkv      = mx_linear(h, qkv_w, qkv_s)
        q, iq    = qk_norm_rope_kv_index_insert(qkv, ..., kv_cache!, index_cache!)
        blocks   = index_topk(iq, index_cache, block_table, seq_lens, q_len, topk)
        attn     = sparse_attention_decode(q, kv_cache, block_table, seq_lens, blocks, q_len)
        h, res   = add_rmsnorm((all_reduce)(mx_linear(attn, o_w, o_s)), res, post_norm)
        w, ids   = route(h, gate, gate_bias, top_k, scaling)
        out      = (all_reduce)(moe_experts(h, ids, w, w13, ..., w2, ..., shared...))
    fused:
        out, res = fused_decode_layer(x, residual, <metadata>, kv_cache!, index_cache!, <weights>, ...,
                                      group_name)
    """

    fused_op = mm.fused_decode_layer.default
    insert_op = mm.qk_norm_rope_kv_index_insert.default
    weight_names = SPARSE_WEIGHTS
    caches = ("kv_cache", "index_cache")

    def match(self, insert: Node) -> LayerMatch:
        norm, norm_out, qkv = self._front(insert)
        got = outputs(insert)
        q, iq = got.get(0), got.get(1)
        kv_new, idx_new = mutated_output(insert, "kv_cache"), mutated_output(insert, "index_cache")
        _need(q is not None and iq is not None and kv_new is not None and idx_new is not None,
              "cache insert outputs are not all used")
        topk = _sole_user(iq, mm.index_topk.default, "index_q")
        attn = _sole_user(topk, mm.sparse_attention_decode.default, "block ids")
        _need(only_users(iq, {topk}) and only_users(q, {attn}) and only_users(topk, {attn}),
              "q, index_q or block ids have users outside the layer")
        _need(arg(topk, "index_cache") is idx_new and arg(attn, "kv_cache") is kv_new and arg(attn, "q") is q,
              "indexer / attention do not read the caches this layer just wrote")
        _need(arg(topk, "block_table") is arg(attn, "block_table") and arg(topk, "seq_lens") is arg(attn, "seq_lens")
              and arg(topk, "query_len") == arg(attn, "query_len"),
              "index cache does not share the main cache's block table (block ids must be shared)")
        o, reduce, post, post_out = self._back(attn, norm, norm_out)
        h = post_out.get(0)
        router = _sole_user(h, mm.route.default, "post-attention norm output")
        experts = _sole_user(h, mm.moe_experts.default, "post-attention norm output")
        r_out = outputs(router)
        _need(arg(experts, "topk_weights") is r_out.get(0) and arg(experts, "topk_ids") is r_out.get(1)
              and only_users(h, {router, experts}) and all(only_users(n, {experts}) for n in r_out.values()),
              "router outputs do not feed only this layer's experts")
        kw = self._common_kwargs(norm, qkv, insert, attn, o, post)
        kw.update(index_slot_mapping=arg(insert, "index_slot_mapping"), index_q_norm=arg(insert, "index_q_norm"),
                  index_k_norm=arg(insert, "index_k_norm"), gate=arg(router, "gate"),
                  gate_bias=arg(router, "gate_bias"), top_k=arg(router, "top_k"), routed_scaling=arg(router, "scaling"),
                  index_heads=arg(insert, "index_heads"), index_dim=arg(insert, "index_dim"),
                  topk_blocks=arg(topk, "topk"), num_routed_experts=arg(experts, "num_routed_experts"),
                  alpha=arg(experts, "alpha"), limit=arg(experts, "limit"), _like=insert)
        for name in ("w13", "w13_scale", "w2", "w2_scale", "shared_w13", "shared_w13_scale", "shared_w2",
                     "shared_w2_scale"):
            kw[name] = arg(experts, name)
        chain = [norm, *norm_out.values(), qkv, insert, *got.values(), topk, attn, o, post, *post_out.values(),
                 router, *r_out.values(), experts]
        mutated = {"kv_cache": arg(insert, "kv_cache"), "index_cache": arg(insert, "index_cache")}
        return self._finish("sparse_moe", chain, experts, reduce, kw, mutated, [post_out.get(1), kv_new, idx_new],
                            insert)


class DenseDecodeLayer(_DecodeLayerPattern):
    """A dense decode layer (MiniMax-M3 layers 0..2).

    unfused:
        h, res   = add_rmsnorm(x, residual, input_norm)
        q        = qk_norm_rope_kv_insert(mx_linear(h, qkv_w, qkv_s), ..., kv_cache!)
        attn     = dense_attention_decode(q, kv_cache, block_table, seq_lens, q_len)
        h, res   = add_rmsnorm((all_reduce)(mx_linear(attn, o_w, o_s)), res, post_norm)
        out      = (all_reduce)(mlp(h, w13, w13_s, w2, w2_s))
    fused:
        out, res = fused_dense_decode_layer(x, residual, <metadata>, kv_cache!, <weights>, ..., group_name)
    """

    fused_op = mm.fused_dense_decode_layer.default
    insert_op = mm.qk_norm_rope_kv_insert.default
    weight_names = DENSE_WEIGHTS
    caches = ("kv_cache",)

    def match(self, insert: Node) -> LayerMatch:
        norm, norm_out, qkv = self._front(insert)
        got = outputs(insert)
        q, kv_new = got.get(0), mutated_output(insert, "kv_cache")
        _need(q is not None and kv_new is not None, "cache insert outputs are not all used")
        attn = _sole_user(q, mm.dense_attention_decode.default, "q")
        _need(only_users(q, {attn}) and arg(attn, "kv_cache") is kv_new,
              "attention does not read the cache this layer just wrote, or q escapes the layer")
        o, reduce, post, post_out = self._back(attn, norm, norm_out)
        h = post_out.get(0)
        ffn = _sole_user(h, mm.mlp.default, "post-attention norm output")
        _need(only_users(h, {ffn}), "post-attention norm output has users outside the layer")
        kw = self._common_kwargs(norm, qkv, insert, attn, o, post)
        kw.update(w13=arg(ffn, "w13"), w13_scale=arg(ffn, "w13_scale"), w2=arg(ffn, "w2"),
                  w2_scale=arg(ffn, "w2_scale"), alpha=arg(ffn, "alpha"), limit=arg(ffn, "limit"), _like=insert)
        chain = [norm, *norm_out.values(), qkv, insert, *got.values(), attn, o, post, *post_out.values(), ffn]
        return self._finish("dense", chain, ffn, reduce, kw, {"kv_cache": arg(insert, "kv_cache")},
                            [post_out.get(1), kv_new], insert)


PATTERNS = (SparseMoEDecodeLayer(), DenseDecodeLayer())
