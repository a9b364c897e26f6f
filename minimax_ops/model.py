"""MiniMaxM3ForCausalLM: the compile-ready text model, written in the torch.ops.minimax vocabulary.

Its forward branches in Python on host-side step facts (``decode_eligible``): under torch.compile
each predicate becomes a Dynamo guard, so a step that fails one (a prefill, 17 tokens, int32
positions, ...) traces a different graph and never reaches the decode chain that the graph pass
fuses. Caches and step metadata are forward arguments, not module state: re-allocating a cache
needs no rebuild and bakes no pointer anywhere.
"""

from __future__ import annotations

import torch
from torch import nn

from .cache import LayerCache, StepMetadata
from .config import SPARSE_MOE, MiniMaxM3Config
from .constants import MAX_TOKENS
from .ops.fused import DENSE_WEIGHTS, SPARSE_WEIGHTS
from .step_contract import STEP_DTYPES, fusable_token_count
from .weights import LayerWeights, ModelWeights

minimax = torch.ops.minimax


# Indexing this tuple with meta.query_len specialises it (a Dynamo guard on its value). Read as a
# plain attribute, automatic-dynamic turns it into a SymInt once a second value is seen, and the
# fused op needs query_len as a compile-time constant.
_STATIC_INTS = tuple(range(MAX_TOKENS + 1))


def _param(t: torch.Tensor | None) -> nn.Parameter | None:
    return None if t is None else nn.Parameter(t, requires_grad=False)


def decode_eligible(num_tokens: int, positions: torch.Tensor, meta: StepMetadata) -> bool:
    """Host-side facts that make a step a fusable decode (each one a guard under torch.compile); the
    contract itself is step_contract's."""
    tensors = {"positions": positions, "slot_mapping": meta.slot_mapping,
               "index_slot_mapping": meta.index_slot_mapping, "block_table": meta.block_table,
               "seq_lens": meta.seq_lens}
    return (meta.num_prefills == 0 and meta.query_len >= 1 and fusable_token_count(num_tokens, meta.query_len)
            and all(t.dtype == STEP_DTYPES[name] for name, t in tensors.items())
            and meta.block_table.is_contiguous() and meta.index_shares_block_ids)


class MiniMaxM3DecoderLayer(nn.Module):
    """One decoder layer; parameters in the fused forms the ops take (see loader.py for the mapping
    from the checkpoint's tensor names)."""

    decode_query_len = 0  # set by MiniMaxM3ForCausalLM.set_decode_query_len (vLLM mode)

    def __init__(self, config: MiniMaxM3Config, weights: LayerWeights, layer_index: int):
        super().__init__()
        self.config, self.kind, self.layer_index = config, weights.kind, layer_index
        self.k_scale, self.v_scale = 1.0, 1.0  # fp8 KV dequant scales (per layer scalars)
        for name, t in weights.tensors().items():
            self.register_parameter(name, _param(t))
        for name in ("qkv_scale", "o_proj_scale", "w13_scale", "w2_scale", "index_q_norm", "index_k_norm",
                     "gate", "gate_bias", "shared_w13", "shared_w13_scale", "shared_w2", "shared_w2_scale"):
            if not hasattr(self, name):
                setattr(self, name, None)

    @property
    def sparse(self) -> bool:
        return self.kind == SPARSE_MOE

    def forward(self, x, residual, positions, cache: LayerCache, meta: StepMetadata, decode: bool):
        c = self.config
        h, residual = minimax.add_rmsnorm(x, residual, self.input_norm, c.rms_norm_eps)
        qkv = minimax.mx_linear(h, self.qkv, self.qkv_scale)
        attn = self._attention(qkv, positions, cache, meta, self._query_len(meta) if decode else 0)
        o = minimax.mx_linear(attn, self.o_proj, self.o_proj_scale)
        h, residual = minimax.add_rmsnorm(o, residual, self.post_norm, c.rms_norm_eps)
        if not self.sparse:
            return minimax.mlp(h, self.w13, self.w13_scale, self.w2, self.w2_scale, c.swiglu_alpha,
                               c.swiglu_limit), residual
        weights, ids = minimax.route(h, self.gate, self.gate_bias, c.num_experts_per_tok, c.routed_scaling_factor)
        out = minimax.moe_experts(h, ids, weights, self.w13, self.w13_scale, self.w2, self.w2_scale,
                                  self.shared_w13, self.shared_w13_scale, self.shared_w2, self.shared_w2_scale,
                                  c.num_local_experts, c.swiglu_alpha, c.swiglu_limit)
        return out, residual

    def _query_len(self, meta: StepMetadata) -> int:
        # vLLM mode traces the configured decode query length; otherwise the step's (specialised).
        return self.decode_query_len or _STATIC_INTS[meta.query_len]

    def fused_forward(self, x, residual, positions, cache: LayerCache, meta: StepMetadata):
        """The same layer as one fused op call (decode steps only)."""
        c = self.config
        dims = (self._query_len(meta), c.num_attention_heads, c.num_key_value_heads, c.head_dim, c.rotary_dim,
                c.rope_theta, c.rms_norm_eps)
        if not self.sparse:
            return minimax.fused_dense_decode_layer(
                x, residual, positions, meta.slot_mapping, meta.block_table, meta.seq_lens, cache.kv,
                *(getattr(self, n) for n in DENSE_WEIGHTS), *dims, c.swiglu_alpha, c.swiglu_limit,
                self.k_scale, self.v_scale, self.layer_index)
        return minimax.fused_decode_layer(
            x, residual, positions, meta.slot_mapping, meta.index_slot_mapping, meta.block_table, meta.seq_lens,
            cache.kv, cache.index, *(getattr(self, n) for n in SPARSE_WEIGHTS), *dims, c.sparse_num_index_heads,
            c.sparse_index_dim, c.sparse_topk_blocks, c.num_experts_per_tok, c.routed_scaling_factor,
            c.num_local_experts, c.swiglu_alpha, c.swiglu_limit, self.k_scale, self.v_scale, self.layer_index)

    def _attention(self, qkv, positions, cache: LayerCache, meta: StepMetadata, query_len: int):
        """query_len > 0: the decode vocabulary; 0: any step (metadata widened to what the ops take,
        so a step refused for int32 metadata still runs)."""
        c = self.config
        dims = (c.num_attention_heads, c.num_key_value_heads, c.head_dim, c.rotary_dim, c.rope_theta,
                c.rms_norm_eps)
        slots, index_slots = meta.slot_mapping, meta.index_slot_mapping
        if not query_len:
            positions, slots, index_slots = positions.long(), slots.long(), index_slots.long()
        if self.sparse:
            q, index_q = minimax.qk_norm_rope_kv_index_insert(
                qkv, positions, slots, index_slots, self.q_norm, self.k_norm, self.index_q_norm,
                self.index_k_norm, cache.kv, cache.index, *dims, c.sparse_num_index_heads, c.sparse_index_dim,
                self.k_scale, self.v_scale)
        else:
            q = minimax.qk_norm_rope_kv_insert(qkv, positions, slots, self.q_norm, self.k_norm, cache.kv, *dims,
                                               self.k_scale, self.v_scale)
            index_q = None
        if not query_len:
            table, seq_lens = meta.block_table.to(torch.int32).contiguous(), meta.seq_lens.to(torch.int32)
            return minimax.attention_any_step(q, index_q, cache.kv, cache.index, table, seq_lens,
                                              list(meta.query_lens), c.sparse_topk_blocks, self.k_scale,
                                              self.v_scale)
        if not self.sparse:
            return minimax.dense_attention_decode(q, cache.kv, meta.block_table, meta.seq_lens, query_len,
                                                  self.k_scale, self.v_scale)
        block_ids = minimax.index_topk(index_q, cache.index, meta.block_table, meta.seq_lens, query_len,
                                       c.sparse_topk_blocks)
        return minimax.sparse_attention_decode(q, cache.kv, meta.block_table, meta.seq_lens, block_ids, query_len,
                                               self.k_scale, self.v_scale)


class MiniMaxM3Model(nn.Module):
    def __init__(self, config: MiniMaxM3Config, weights: ModelWeights):
        super().__init__()
        self.embed_tokens = nn.Embedding.from_pretrained(weights.embed, freeze=True)
        self.layers = nn.ModuleList(MiniMaxM3DecoderLayer(config, w, i) for i, w in enumerate(weights.layers))
        self.norm = _param(weights.final_norm)


class MiniMaxM3ForCausalLM(nn.Module):
    """forward(input_ids, positions, caches, meta) -> fp32 logits [n, vocab], for prefill and decode.

    ``use_fused_ops = True`` makes eager decode steps call the fused ops directly (what the graph
    pass produces under torch.compile); by default the model speaks the unfused vocabulary."""

    use_fused_ops = False
    decode_query_len = 0

    def set_decode_query_len(self, query_len: int) -> None:
        """vLLM mode: vLLM drops Dynamo guards, so forward must not branch on host-side step facts.
        With query_len > 0 it always traces the decode chain for that query length, and the
        step-kind-dependent ops decide at run time from step_context (falling back to the general
        computation for prefills and mixed batches). 0 restores guard-based branching."""
        if not 0 <= query_len <= MAX_TOKENS:
            raise ValueError(f"query_len: expected 0..{MAX_TOKENS}, got {query_len}")
        self.decode_query_len = query_len
        for layer in self.model.layers:
            layer.decode_query_len = query_len

    def __init__(self, config: MiniMaxM3Config, weights: ModelWeights):
        super().__init__()
        if len(weights.layers) != config.num_hidden_layers:
            raise ValueError(f"weights: expected {config.num_hidden_layers} layers, got {len(weights.layers)}")
        self.config = config
        self.model = MiniMaxM3Model(config, weights)
        self.lm_head = _param(weights.lm_head)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, caches: list[LayerCache],
                meta: StepMetadata) -> torch.Tensor:
        return self.logits(self.hidden_states(input_ids, positions, caches, meta))

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """fp32 logits of final hidden states (vLLM computes them for the sampled tokens only)."""
        return minimax.mx_linear(h, self.lm_head, None).float()

    def hidden_states(self, input_ids: torch.Tensor, positions: torch.Tensor, caches: list[LayerCache],
                      meta: StepMetadata) -> torch.Tensor:
        """The final norm's output, bf16 [n, hidden]."""
        decode = bool(self.decode_query_len) or decode_eligible(input_ids.shape[0], positions, meta)
        if decode and not self.decode_query_len:
            # decode_eligible checked it; asserting it also makes it a fact the graph pass can prove
            # on a symbolic token count.
            torch._check(input_ids.shape[0] % meta.query_len == 0)
        x = self.model.embed_tokens(input_ids)
        residual = torch.zeros_like(x)
        fused = decode and self.use_fused_ops
        for layer, cache in zip(self.model.layers, caches):
            if fused:
                x, residual = layer.fused_forward(x, residual, positions, cache, meta)
            else:
                x, residual = layer(x, residual, positions, cache, meta, decode)
        h, _ = minimax.add_rmsnorm(x, residual, self.model.norm, self.config.rms_norm_eps)
        return h
