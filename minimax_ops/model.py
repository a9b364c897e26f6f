"""MiniMaxM3ForCausalLM: the compile-ready text model, written in the torch.ops.minimax vocabulary.

Its forward branches in Python on host-side step facts (``decode_eligible``): under torch.compile
each predicate becomes a Dynamo guard, so a step that fails one (a prefill, 17 tokens, int32
positions, ...) traces a different graph and never reaches the decode chain that the graph pass
fuses. Caches and step metadata are forward arguments, not module state: re-allocating a cache
needs no rebuild and bakes no pointer anywhere.

Tensor parallelism: the model holds one rank's shard (sharding.py) and is given the all-reduce
group by name (ops/collectives.py); each layer then calls ``minimax.all_reduce`` after o_proj and
after its FFN (ops/chain.py), and the graph pass takes both into the fused layer. Pipeline
parallelism: a model built with ``layers=range(a, b)`` holds only those layers; a stage that does not
start at layer 0 takes ``intermediate`` (hidden_states, residual) from the previous stage, and one
that does not end at the last layer returns them instead of logits.
"""

from __future__ import annotations

import functools

import torch
from torch import nn

from .cache import LayerCache, StepMetadata
from .config import SPARSE_MOE, MiniMaxM3Config
from .constants import MAX_TOKENS
from .ops import chain
from .ops.chain import DENSE_WEIGHTS, SPARSE_WEIGHTS, DenseConsts, SparseConsts
from .sharding import local_config
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
    from the checkpoint's tensor names). ``config``: the per-rank config under tensor parallelism
    (sharding.local_config), whose head and intermediate counts match the weights given."""

    decode_query_len = 0  # set by MiniMaxM3ForCausalLM.set_decode_query_len (vLLM mode)

    def __init__(self, config: MiniMaxM3Config, weights: LayerWeights, layer_index: int, group_name: str = ""):
        super().__init__()
        self.config, self.kind, self.layer_index = config, weights.kind, layer_index
        self.group_name = group_name  # tensor-parallel all-reduce group ("" = none)
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

    def _query_len(self, meta: StepMetadata) -> int:
        # vLLM mode traces the configured decode query length; otherwise the step's (specialised).
        return self.decode_query_len or _STATIC_INTS[meta.query_len]

    def consts(self, query_len: int) -> SparseConsts | DenseConsts:
        """The layer's constant arguments, in the fused op's order."""
        c = self.config
        heads = (query_len, c.num_attention_heads, c.num_key_value_heads, c.head_dim, c.rotary_dim, c.rope_theta,
                 c.rms_norm_eps)
        scales = (self.k_scale, self.v_scale, bool(self.group_name))
        if not self.sparse:
            return DenseConsts(*heads, c.swiglu_alpha, c.swiglu_limit, *scales)
        return SparseConsts(*heads, c.sparse_num_index_heads, c.sparse_index_dim, c.sparse_topk_blocks,
                            c.num_experts_per_tok, c.routed_scaling_factor, c.num_local_experts, c.swiglu_alpha,
                            c.swiglu_limit, *scales)

    def _weights(self) -> dict:
        return {n: getattr(self, n) for n in (SPARSE_WEIGHTS if self.sparse else DENSE_WEIGHTS)}

    def _step(self, positions, cache: LayerCache, meta: StepMetadata, widen: bool) -> tuple:
        """The attention half's step and cache arguments. widen: the any-step path, metadata widened
        to what the ops take (so a step refused for int32 metadata still runs)."""
        slots, index_slots, table, seq_lens = meta.slot_mapping, meta.index_slot_mapping, meta.block_table, \
            meta.seq_lens
        if widen:
            positions, slots, index_slots = positions.long(), slots.long(), index_slots.long()
            table, seq_lens = table.to(torch.int32).contiguous(), seq_lens.to(torch.int32)
        if self.sparse:
            return positions, slots, index_slots, table, seq_lens, cache.kv, cache.index
        return positions, slots, table, seq_lens, cache.kv

    def forward(self, x, residual, positions, cache: LayerCache, meta: StepMetadata, decode: bool):
        """The layer as the vocabulary chain: decode ops for a decode step, attention_any_step otherwise."""
        attention, ffn = (chain.sparse_attention, chain.sparse_ffn) if self.sparse else \
            (chain.dense_attention, chain.dense_ffn)
        if not decode:
            attention = functools.partial(attention, query_lens=list(meta.query_lens))
        args = (x, residual, *self._step(positions, cache, meta, not decode))
        return chain.run_layer(attention, ffn, args, self._weights(), self.consts(self._query_len(meta) if decode
                                                                                  else 0), self.group_name)

    def fused_forward(self, x, residual, positions, cache: LayerCache, meta: StepMetadata):
        """The same layer as one fused op call (decode steps only)."""
        op = minimax.fused_decode_layer if self.sparse else minimax.fused_dense_decode_layer
        w = self._weights()
        return op(x, residual, *self._step(positions, cache, meta, False), *w.values(),
                  *self.consts(self._query_len(meta))[:-1], layer_index=self.layer_index, group_name=self.group_name)


class MiniMaxM3Model(nn.Module):
    def __init__(self, config: MiniMaxM3Config, weights: ModelWeights, layers: range, group_name: str = ""):
        super().__init__()
        self.embed_tokens = nn.Embedding.from_pretrained(weights.embed, freeze=True)
        self.layers = nn.ModuleList(MiniMaxM3DecoderLayer(config, w, i, group_name)
                                    for i, w in zip(layers, weights.layers))
        self.norm = _param(weights.final_norm)


def _group_name(tp_group) -> str:
    """A torch.distributed ProcessGroup, or a group name (collectives.py), as a name."""
    if tp_group is None:
        return ""
    return tp_group if isinstance(tp_group, str) else tp_group.group_name


class MiniMaxM3ForCausalLM(nn.Module):
    """forward(input_ids, positions, caches, meta, intermediate=None) -> fp32 logits [n, vocab], for
    prefill and decode.

    ``tp_size`` / ``tp_group``: tensor parallelism; ``weights`` are then this rank's shard
    (loader.load_weights(..., tp_rank=, tp_size=)) and ``tp_group`` the all-reduce group, a
    ``torch.distributed`` ProcessGroup or a group name (``"vllm:tp"``: vLLM's). ``layers``: this
    pipeline stage's layers (default all), ``weights.layers`` holding exactly those, ``caches`` one
    per held layer. ``use_fused_ops = True`` makes eager decode steps call the fused ops directly
    (what the graph pass produces under torch.compile); by default the model speaks the unfused vocabulary."""

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

    def __init__(self, config: MiniMaxM3Config, weights: ModelWeights, *, tp_size: int = 1, tp_group=None,
                 layers: range | None = None):
        super().__init__()
        layers = range(config.num_hidden_layers) if layers is None else layers
        if layers.step != 1 or not 0 <= layers.start < layers.stop <= config.num_hidden_layers:
            raise ValueError(f"layers: expected a contiguous range within 0..{config.num_hidden_layers}, got {layers}")
        if len(weights.layers) != len(layers):
            raise ValueError(f"weights: expected {len(layers)} layers ({layers}), got {len(weights.layers)}")
        group_name = _group_name(tp_group)
        if (tp_size > 1) != bool(group_name):
            raise ValueError(f"tp_group: expected a group exactly when tp_size > 1, got tp_size={tp_size}, "
                             f"tp_group={tp_group!r}")
        self.config = config  # the whole model's; layers run with the per-rank local_config
        self.tp_size, self.group_name, self.layer_range = tp_size, group_name, layers
        self.model = MiniMaxM3Model(local_config(config, tp_size), weights, layers, group_name)
        self.lm_head = _param(weights.lm_head)

    @property
    def is_first_stage(self) -> bool:
        return self.layer_range.start == 0

    @property
    def is_last_stage(self) -> bool:
        return self.layer_range.stop == self.config.num_hidden_layers

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, caches: list[LayerCache],
                meta: StepMetadata, intermediate: dict[str, torch.Tensor] | None = None):
        """fp32 logits on the last pipeline stage; an earlier stage returns the next one's intermediate."""
        out = self.hidden_states(input_ids, positions, caches, meta, intermediate)
        return self.logits(out) if self.is_last_stage else out

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """fp32 logits of final hidden states (vLLM computes them for the sampled tokens only)."""
        return minimax.mx_linear(h, self.lm_head, None).float()

    def hidden_states(self, input_ids: torch.Tensor, positions: torch.Tensor, caches: list[LayerCache],
                      meta: StepMetadata, intermediate: dict[str, torch.Tensor] | None = None):
        """The final norm's output, bf16 [n, hidden], on the last pipeline stage; an earlier stage
        returns {"hidden_states", "residual"} (its last layer's output, reduced) for the next."""
        decode = bool(self.decode_query_len) or decode_eligible(input_ids.shape[0], positions, meta)
        if decode and not self.decode_query_len:
            # decode_eligible checked it; asserting it also makes it a fact the graph pass can prove
            # on a symbolic token count.
            torch._check(input_ids.shape[0] % meta.query_len == 0)
        if len(caches) != len(self.model.layers):
            raise ValueError(f"caches: expected one per held layer ({len(self.model.layers)}), got {len(caches)}")
        if self.is_first_stage:
            x = self.model.embed_tokens(input_ids)
            residual = torch.zeros_like(x)
        elif intermediate is None or set(intermediate) != {"hidden_states", "residual"}:
            got = None if intermediate is None else set(intermediate)
            raise ValueError(f"intermediate: a stage after the first needs the previous stage's "
                             f"{{'hidden_states', 'residual'}}, got {got}")
        else:
            x, residual = intermediate["hidden_states"], intermediate["residual"]
        fused = decode and self.use_fused_ops
        for layer, cache in zip(self.model.layers, caches):
            if fused:
                x, residual = layer.fused_forward(x, residual, positions, cache, meta)
            else:
                x, residual = layer(x, residual, positions, cache, meta, decode)
        if not self.is_last_stage:
            return {"hidden_states": x, "residual": residual}
        h, _ = minimax.add_rmsnorm(x, residual, self.model.norm, self.config.rms_norm_eps)
        return h
