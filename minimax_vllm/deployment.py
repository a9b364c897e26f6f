"""The Deployment the fused decode serves, read from a vLLM ``VllmConfig``.

Where each fact lives in vLLM 0.33:

- parallelism: ``parallel_config`` (tensor / data / pipeline parallel sizes, expert parallelism,
  decode / prefill context parallelism: the last two shard the KV cache across ranks);
- main cache: ``cache_config.cache_dtype`` ("auto" = the model dtype) and ``cache_config.block_size``
  (after the platform and attention backend have resolved it: the pass reads it at compile time);
- index cache: ``attention_config.indexer_kv_dtype``, resolved the way vLLM's own MiniMax-M3
  resolves it (``resolve_indexer_kv_dtype("bf16")``: "auto" means bf16);
- ``model_config.max_model_len`` (unknown without a model config: SchedulerConfig takes it as an
  init-only value and keeps no copy);
- ``compilation_config.cudagraph_mode.requires_piecewise_compilation()`` and ``splitting_ops``;
- the model: ``model_config.hf_config`` when it is a MiniMax-M3 config (vLLM's ``minimax_m3_vl`` /
  ``minimax_m3_text`` types, or a MiniMaxM3 architecture), parsed by MiniMaxM3Config.from_hf_dict.

Importing this module registers ``deployment_from_current_vllm_config`` as the decode pass's deployment
reader (graph_passes.fused_decode_pass.add_deployment_reader), so graph_passes never imports vLLM code.
Nothing here imports vLLM unless the process already did: the pass asks on every compile, also under
plain torch.compile.
"""

from __future__ import annotations

import sys
from typing import Any

from minimax_ops.config import ConfigError, MiniMaxM3Config

from graph_passes.deployment import Deployment
from graph_passes.fused_decode_pass import add_deployment_reader

MINIMAX_M3_MODEL_TYPES = ("minimax_m3_vl", "minimax_m3_text", "minimax_m3")


def is_minimax_m3_hf_config(hf_config: Any) -> bool:
    model_type = getattr(hf_config, "model_type", None)
    architectures = getattr(hf_config, "architectures", None) or []
    return model_type in MINIMAX_M3_MODEL_TYPES or any("MiniMaxM3" in a for a in architectures)


def minimax_m3_config_from_vllm(vllm_config: Any) -> MiniMaxM3Config | None:
    """The MiniMaxM3Config of the served model, None when the model is not MiniMax-M3 (or there is
    no model config). Raises ConfigError when it is MiniMax-M3 but a field is unsupported."""
    model_config = getattr(vllm_config, "model_config", None)
    hf_config = getattr(model_config, "hf_config", None)
    if hf_config is None or not is_minimax_m3_hf_config(hf_config):
        return None
    return MiniMaxM3Config.from_hf_dict(hf_config.to_dict())


def _kv_cache_dtype(cache_dtype: str, model_config: Any) -> str:
    """vLLM's "auto" stores the cache in the model dtype: name it, so that a float16 model (whose
    cache would be fp16) is refused rather than assumed bf16."""
    if cache_dtype != "auto" or model_config is None:
        return cache_dtype
    dtype = getattr(model_config, "dtype", None)
    return str(dtype).removeprefix("torch.") if dtype is not None else "auto"


def deployment_from_vllm_config(vllm_config: Any, model_config: MiniMaxM3Config | None = None) -> Deployment:
    """Deployment facts of ``vllm_config``. ``model_config`` is used when the VllmConfig carries no
    MiniMax-M3 hf_config (tests, or a wrapper given its config directly)."""
    parallel = vllm_config.parallel_config
    cache = vllm_config.cache_config
    compilation = vllm_config.compilation_config
    vllm_model = getattr(vllm_config, "model_config", None)
    error = None
    try:
        model_config = minimax_m3_config_from_vllm(vllm_config) or model_config
    except ConfigError as e:
        error = str(e)
    max_model_len = getattr(vllm_model, "max_model_len", None)  # the scheduler keeps no copy of it
    attention = getattr(vllm_config, "attention_config", None)
    index_dtype = attention.resolve_indexer_kv_dtype("bf16") if attention is not None else "auto"
    mode = compilation.cudagraph_mode
    return Deployment(
        tensor_parallel_size=parallel.tensor_parallel_size,
        data_parallel_size=parallel.data_parallel_size,
        pipeline_parallel_size=parallel.pipeline_parallel_size,
        enable_expert_parallel=bool(parallel.enable_expert_parallel),
        decode_context_parallel_size=getattr(parallel, "decode_context_parallel_size", 1),
        prefill_context_parallel_size=getattr(parallel, "prefill_context_parallel_size", 1),
        kv_cache_dtype=_kv_cache_dtype(str(cache.cache_dtype), vllm_model),
        index_cache_dtype=str(index_dtype),
        block_size=cache.block_size,
        max_model_len=max_model_len,
        piecewise_cudagraphs=mode is not None and mode.requires_piecewise_compilation(),
        mixed_batch_cudagraphs=mode is not None and getattr(mode, "name", "") == "FULL",
        splitting_ops=tuple(compilation.splitting_ops or ()),
        any_size_graphs=getattr(compilation.mode, "name", "") == "DYNAMO_TRACE_ONCE",
        model_config=model_config,
        model_config_error=error,
    )


def deployment_from_current_vllm_config() -> Deployment | None:
    """The Deployment of vLLM's current config; None when vLLM is not in use in this process (never
    imported: then no config can be current) or no config is current. Errors in reading the config
    propagate: a refusal must never silently become 'allowed'."""
    if "vllm.config" not in sys.modules:
        return None
    from vllm.config import get_current_vllm_config_or_none

    vllm_config = get_current_vllm_config_or_none()
    if vllm_config is None:
        return None
    return deployment_from_vllm_config(vllm_config)


add_deployment_reader(deployment_from_current_vllm_config)
