"""Deployment facts the fused decode depends on, and the refusals decided once from them.

A refused deployment leaves every graph untouched; the reason is logged once. Under vLLM the
facts come from the VllmConfig (``from_vllm_config``); plain torch.compile users pass a
Deployment to the pass (or get the permissive default, where the graph's own cache dtypes and
shapes decide).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from minimax_ops.config import DENSE, SPARSE_MOE, MiniMaxM3Config
from minimax_ops.constants import MAX_CONTEXT
from minimax_ops.sharding import ShardingError, local_config

CACHE_DTYPE_NAMES = {"auto": None, "bf16": torch.bfloat16, "bfloat16": torch.bfloat16,
                     "fp8": torch.float8_e4m3fn, "fp8_e4m3": torch.float8_e4m3fn}


@dataclass(frozen=True)
class Deployment:
    tensor_parallel_size: int = 1
    data_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    enable_expert_parallel: bool = False
    kv_cache_dtype: str = "auto"  # "auto": whatever the traced cache holds (bf16 or fp8)
    index_cache_dtype: str = "auto"
    block_size: int | None = None  # None: the model config's sparse_block_size
    max_model_len: int | None = None
    piecewise_cudagraphs: bool = False  # PIECEWISE / FULL_AND_PIECEWISE split graphs at attention
    # FULL: one capture serves decode and mixed batches of the same padded size, freezing the
    # batch-kind decision (step_context.py) at capture; FULL_DECODE_ONLY captures decodes alone.
    mixed_batch_cudagraphs: bool = False
    splitting_ops: tuple[str, ...] = ()
    model_config: MiniMaxM3Config | None = None
    # Context parallelism shards the KV cache across ranks (vLLM's parallel_config).
    decode_context_parallel_size: int = 1
    prefill_context_parallel_size: int = 1
    model_config_error: str | None = None  # the served MiniMax-M3 config could not be parsed
    # One compiled graph serves steps of every size (vLLM's trace-once mode, what its CPU platform
    # runs): the fused ops then take the unfused stages for steps above MAX_TOKENS at run time.
    any_size_graphs: bool = False

    def key(self) -> str:
        """Stable text of every field, for the pass's uuid()."""
        return repr(dataclasses.astuple(self))

    def cache_dtype(self, which: str) -> torch.dtype | None:
        name = self.kv_cache_dtype if which == "kv" else self.index_cache_dtype
        return CACHE_DTYPE_NAMES.get(name, name)  # an unknown name stays a string: refused below


def deployment_refusal(d: Deployment) -> str | None:
    """Why this deployment cannot use the fused decode, or None. Checked once, before rewriting."""
    # Tensor parallelism is served (the fused layer all-reduces inside: ops/collectives.py) as far as
    # the model splits (sharding.py: checked when the shards are made); data parallelism without
    # expert parallelism is independent replicas, and pipeline parallelism gives each rank whole
    # layers: neither changes a layer.
    cfg = d.model_config
    if cfg is not None and d.tensor_parallel_size > 1:
        try:
            local_config(cfg, d.tensor_parallel_size)
        except ShardingError as e:
            return f"the model does not split for tensor parallelism: {e}"
    if d.enable_expert_parallel:
        return ("expert parallelism is enabled: the fused decode keeps every expert on every rank (experts split "
                "along their intermediate dim), and routing tokens to experts on other ranks is not built")
    for name in ("decode_context_parallel_size", "prefill_context_parallel_size"):
        if getattr(d, name) != 1:
            return (f"{name}={getattr(d, name)}: context parallelism shards the KV cache across ranks, "
                    "the fused decode needs each request's whole cache on one rank")
    if d.model_config_error is not None:
        return f"the served MiniMax-M3 config is not supported by the fused decode: {d.model_config_error}"
    for which in ("kv", "index"):
        dtype = d.cache_dtype(which)
        if isinstance(dtype, str):
            return f"{which} cache dtype {dtype!r} is not supported (expected bf16 or fp8 e4m3)"
    if d.block_size is not None and cfg is not None and d.block_size != cfg.sparse_block_size:
        return (f"cache block size {d.block_size} differs from the model's sparse block size "
                f"{cfg.sparse_block_size}")
    if d.max_model_len is not None and d.max_model_len > MAX_CONTEXT:
        return f"max_model_len={d.max_model_len} exceeds the fused decode's limit of {MAX_CONTEXT} tokens"
    if d.mixed_batch_cudagraphs:
        return ("FULL CUDA graphs replay one capture for decode and mixed batches of the same padded size, "
                "but the decode layers decide the batch kind at capture; use FULL_DECODE_ONLY (or NONE)")
    if d.piecewise_cudagraphs:
        return ("piecewise CUDA graphs split each layer at attention, so no whole decode layer is visible "
                "to fuse; use FULL_DECODE_ONLY or FULL (or NONE)")
    hidden = [op for op in d.splitting_ops if "minimax" in op]
    if hidden:
        return f"splitting_ops {hidden} split decode layers apart, so no whole layer can be fused"
    if cfg is not None:
        kinds = cfg.layer_kinds
        prefix = cfg.num_dense_prefix
        if any(k != DENSE for k in kinds[:prefix]) or any(k != SPARSE_MOE for k in kinds[prefix:]):
            return f"layer mix {kinds} is not a dense prefix followed by sparse MoE layers"
    return None
