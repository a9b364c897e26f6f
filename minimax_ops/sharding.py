"""Tensor-parallel sharding of a full MiniMax-M3 checkpoint, and the pipeline split of its layers.

Per m3-decode-spec.md, with TP degree t (every rank holds equal shapes; only the slices differ):

- q heads split: rank r holds heads [r*H/t, (r+1)*H/t);
- k, v and index-q heads split the same way over the KV kv heads, and replicated when t > KV (then
  t must be a multiple of KV, and rank r holds kv head r // (t/KV): the one its q heads attend with;
  index head h serves kv head h, so it goes along);
- index-k, every norm, the fp8 KV scales, the router gate and bias, embeddings and lm_head: replicated;
- o_proj and every down projection (w2, down_proj): row-parallel, split along their input dim K;
- routed experts, the shared expert and the dense MLP: gate/up rows split along the intermediate
  dim (every rank holds every expert: no expert parallelism).

MX formats keep their blocks whole: a K split falls on 32-element block boundaries (the local
sizes must be multiples of 32, which ``local_config`` checks), and packed MXFP4 halves and E8M0
scales split in proportion. ``shard_tensor`` works on one checkpoint-named tensor, so the
safetensors loader (loader.py) and vLLM's ``load_weights`` (an iterator of (name, tensor)) both use it.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

import torch

from .config import ConfigError, MiniMaxM3Config


class ShardingError(ValueError):
    """A tensor-parallel degree the model cannot be split into, or a tensor this module cannot place."""


_SCALES = r"(weight|weight_scale_inv|weight_scale)"
_LAYER = r"model\.layers\.\d+\."
_ROWS_Q = re.compile(_LAYER + r"self_attn\.q_proj\." + _SCALES + "$")
_ROWS_KV = re.compile(_LAYER + r"self_attn\.(k_proj|v_proj|index_q_proj)\." + _SCALES + "$")
_ROWS_FFN = re.compile(_LAYER + r"(mlp|block_sparse_moe\.shared_experts)\.(gate_proj|up_proj)\." + _SCALES + "$"
                       r"|" + _LAYER + r"block_sparse_moe\.experts\.\d+\.(w1|w3)\." + _SCALES + "$")
_COLS = re.compile(_LAYER + r"(self_attn\.o_proj|mlp\.down_proj|block_sparse_moe\.shared_experts\.down_proj"
                   r"|block_sparse_moe\.experts\.\d+\.w2)\." + _SCALES + "$")
_REPLICATED = re.compile(r"model\.embed_tokens\.weight|model\.norm\.weight|lm_head\.weight"
                         r"|" + _LAYER + r"(input_layernorm|post_attention_layernorm)\.weight"
                         r"|" + _LAYER + r"self_attn\.(q_norm|k_norm|index_q_norm|index_k_norm)\.weight"
                         r"|" + _LAYER + r"self_attn\.(k_scale|v_scale)"
                         r"|" + _LAYER + r"self_attn\.index_k_proj\." + _SCALES
                         + r"|" + _LAYER + r"block_sparse_moe\.(gate\.weight|e_score_correction_bias)")


def _check_degree(config: MiniMaxM3Config, tp_size: int) -> None:
    t, heads, kv = tp_size, config.num_attention_heads, config.num_key_value_heads
    if not isinstance(t, int) or t < 1:
        raise ShardingError(f"tensor_parallel_size: expected a positive integer, got {t!r}")
    if heads % t:
        raise ShardingError(f"tensor_parallel_size={t}: num_attention_heads={heads} does not split evenly")
    if (kv % t if t <= kv else t % kv):
        raise ShardingError(f"tensor_parallel_size={t}: num_key_value_heads={kv} neither splits evenly nor "
                            f"replicates evenly (t must divide {kv} or be a multiple of it)")
    for name in ("intermediate_size", "shared_intermediate_size", "dense_intermediate_size"):
        if getattr(config, name) % t:
            raise ShardingError(f"tensor_parallel_size={t}: {name}={getattr(config, name)} does not split evenly")


def local_kv_heads(config: MiniMaxM3Config, tp_size: int) -> int:
    return max(1, config.num_key_value_heads // tp_size)


def local_config(config: MiniMaxM3Config, tp_size: int) -> MiniMaxM3Config:
    """The per-rank config: the shapes a rank's weights and caches have (the same on every rank).
    Its head and intermediate counts are the rank's; the ops and the loader take it as they would
    a whole model's."""
    _check_degree(config, tp_size)
    if tp_size == 1:
        return config
    kv = local_kv_heads(config, tp_size)
    sparse = any(config.moe_layer_freq)
    try:
        return config.replace(
            num_attention_heads=config.num_attention_heads // tp_size, num_key_value_heads=kv,
            sparse_num_index_heads=kv if sparse else config.sparse_num_index_heads,
            intermediate_size=config.intermediate_size // tp_size,
            shared_intermediate_size=config.shared_intermediate_size // tp_size,
            dense_intermediate_size=config.dense_intermediate_size // tp_size)
    except ConfigError as e:
        raise ShardingError(f"tensor_parallel_size={tp_size}: the per-rank shapes are not supported: {e}") from None


def kv_head_slice(config: MiniMaxM3Config, tp_rank: int, tp_size: int) -> slice:
    """The global kv heads (and index heads) rank tp_rank holds."""
    kv = config.num_key_value_heads
    parts = min(tp_size, kv)
    part = tp_rank * parts // tp_size
    width = kv // parts
    return slice(part * width, (part + 1) * width)


def _part(t: torch.Tensor, dim: int, parts: int, index: int, name: str) -> torch.Tensor:
    size = t.shape[dim]
    if size % parts:
        raise ShardingError(f"{name}: size {size} in dimension {dim} does not split into {parts} parts "
                            f"(shape {tuple(t.shape)})")
    step = size // parts
    return t.narrow(dim, index * step, step).clone()  # a clone: the full tensor can then be freed


def shard_tensor(name: str, tensor: torch.Tensor, config: MiniMaxM3Config, tp_rank: int,
                 tp_size: int) -> torch.Tensor:
    """Rank tp_rank's part of the checkpoint tensor ``name`` (the tensor itself when replicated)."""
    _check_degree(config, tp_size)
    if not 0 <= tp_rank < tp_size:
        raise ShardingError(f"tp_rank: expected 0..{tp_size - 1}, got {tp_rank}")
    if tp_size == 1 or _REPLICATED.fullmatch(name):
        return tensor
    if _ROWS_Q.fullmatch(name) or _ROWS_FFN.fullmatch(name):
        return _part(tensor, 0, tp_size, tp_rank, name)
    if _ROWS_KV.fullmatch(name):
        kv = config.num_key_value_heads
        parts = min(tp_size, kv)
        return _part(tensor, 0, parts, tp_rank * parts // tp_size, name)
    if _COLS.fullmatch(name):
        return _part(tensor, tensor.dim() - 1, tp_size, tp_rank, name)
    raise ShardingError(f"{name}: not a MiniMax-M3 text-model tensor, so its tensor-parallel placement is unknown")


def shard_checkpoint(tensors: Mapping[str, torch.Tensor], config: MiniMaxM3Config, tp_rank: int,
                     tp_size: int) -> dict[str, torch.Tensor]:
    """shard_tensor over a whole state dict of checkpoint names."""
    return {name: shard_tensor(name, t, config, tp_rank, tp_size) for name, t in tensors.items()}


def pipeline_layers(num_layers: int, pp_rank: int, pp_size: int) -> range:
    """The layers pipeline stage pp_rank holds: contiguous, sizes differing by at most one (the
    earlier stages take the remainder). vLLM deployments use vLLM's own split instead."""
    if not 1 <= pp_size <= num_layers or not 0 <= pp_rank < pp_size:
        raise ShardingError(f"pipeline split: expected 1 <= pp_size <= {num_layers} layers and 0 <= pp_rank < "
                            f"pp_size, got pp_rank={pp_rank}, pp_size={pp_size}")
    base, extra = divmod(num_layers, pp_size)
    start = pp_rank * base + min(pp_rank, extra)
    return range(start, start + base + (pp_rank < extra))
