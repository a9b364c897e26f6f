"""MiniMaxM3VllmModel: the compile-ready text model as a vLLM ``@support_torch_compile`` module.

What vLLM's VLLM_COMPILE pipeline needs, and what this wrapper does for it:

- vLLM traces ``forward`` once with dim 0 of the token tensors dynamic, drops every Dynamo guard and
  picks a compiled artifact per compile range by token count alone. So the wrapped model runs in
  "vLLM mode" (``MiniMaxM3ForCausalLM.set_decode_query_len``): it never branches on host-side step facts
  and always traces the decode chain for uniform decodes of ``decode_query_len`` tokens per request.
  At run time the step-kind-dependent ops read the step from vLLM's forward context
  (``attn_metadata``, a StepMetadata: see minimax_ops.step_context) and take the general path for a
  step that is not such a decode (a prefill, a mixed batch), with no device sync.
- Caches are registered buffers, as vLLM binds KV caches to its attention layers: they enter the
  graph as inputs that the cache-insert ops mutate in place.
- Step tensors are forward arguments (dynamic dim 0: tokens for input_ids / positions / slots,
  requests for block_table / seq_lens); the block table's width is fixed per deployment.

Use: build under ``set_current_vllm_config(vllm_config)``, call through ``run_step`` (which sets the
forward context the way vLLM's model runner does). Serving real MiniMax-M3 checkpoints through
vLLM's model registry is not wired: weights are given (or random), there is no load_weights.
"""

from __future__ import annotations

import math

import torch
from torch import nn
from vllm.compilation.decorators import support_torch_compile
from vllm.config import VllmConfig
from vllm.forward_context import set_forward_context

from graph_passes.vllm_config import deployment_from_vllm_config, minimax_m3_config_from_vllm

from .cache import LayerCache, StepMetadata, allocate_caches
from .config import MiniMaxM3Config
from .model import MiniMaxM3ForCausalLM
from .weights import ModelWeights, random_model_weights

TOKEN_DIM_ARGS = ("input_ids", "positions", "slot_mapping", "index_slot_mapping")
REQUEST_DIM_ARGS = ("block_table", "seq_lens")


def _cache_dtype(deployment, which: str) -> torch.dtype:
    dtype = deployment.cache_dtype(which)
    if dtype is None:
        return torch.bfloat16
    if isinstance(dtype, str):
        name = deployment.kv_cache_dtype if which == "kv" else deployment.index_cache_dtype
        raise ValueError(f"{which} cache dtype {name!r}: the minimax ops store bf16 or fp8 e4m3 caches")
    return dtype


@support_torch_compile(dynamic_arg_dims={name: 0 for name in TOKEN_DIM_ARGS + REQUEST_DIM_ARGS})
class MiniMaxM3VllmModel(nn.Module):
    """forward(input_ids, positions, slot_mapping, index_slot_mapping, block_table, seq_lens) -> fp32
    logits [n, vocab]; caches are the buffers ``kv_cache_<layer>`` / ``index_cache_<layer>``.

    ``config``: the model's MiniMaxM3Config when the VllmConfig carries no MiniMax-M3 hf_config;
    ``weights``: ModelWeights (default: random, seeded; loading checkpoints is not wired);
    ``num_blocks``: cache blocks (default: vLLM's num_gpu_blocks, else enough for max_num_seqs
    requests of max_model_len tokens); ``decode_query_len``: the uniform decode the graph is traced
    for (default 1 + speculative tokens, vLLM's uniform_decode_query_len)."""

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = "", config: MiniMaxM3Config | None = None,
                 weights: ModelWeights | None = None, num_blocks: int | None = None,
                 decode_query_len: int | None = None):
        super().__init__()
        config = minimax_m3_config_from_vllm(vllm_config) or config
        if config is None:
            raise ValueError("config: the VllmConfig has no MiniMax-M3 hf_config, so pass a MiniMaxM3Config, got None")
        deployment = deployment_from_vllm_config(vllm_config, config)
        if deployment.mixed_batch_cudagraphs:  # wrong answers for mixed batches, fused or not
            raise ValueError("compilation_config.cudagraph_mode: FULL freezes each layer's batch-kind decision "
                             "at capture for decode and mixed batches alike; use FULL_DECODE_ONLY or NONE")
        device = vllm_config.device_config.device
        if weights is None:
            weights = random_model_weights(config, generator=torch.Generator().manual_seed(0), device=device)
        if decode_query_len is None:
            decode_query_len = 1 + (getattr(vllm_config, "num_speculative_tokens", 0) or 0)
        self.config = config
        self.decode_query_len = decode_query_len
        self.model = MiniMaxM3ForCausalLM(config, weights)
        self.model.set_decode_query_len(decode_query_len)  # vLLM mode: see the module docstring
        block = config.sparse_block_size
        max_len = deployment.max_model_len or config.max_position_embeddings
        self.table_width = math.ceil(max_len / block)  # block table columns a request can need
        if num_blocks is None:
            num_blocks = vllm_config.cache_config.num_gpu_blocks or \
                vllm_config.scheduler_config.max_num_seqs * self.table_width
        caches = allocate_caches(config, num_blocks, kv_dtype=_cache_dtype(deployment, "kv"),
                                 index_dtype=_cache_dtype(deployment, "index"), device=device, fill="zeros")
        self.sparse_layers = [c.index is not None for c in caches]
        for i, cache in enumerate(caches):
            self.register_buffer(f"kv_cache_{i}", cache.kv)
            if cache.index is not None:
                self.register_buffer(f"index_cache_{i}", cache.index)

    def layer_caches(self) -> list[LayerCache]:
        """The cache buffers as LayerCaches (the same tensors, not copies)."""
        return [LayerCache(getattr(self, f"kv_cache_{i}"), getattr(self, f"index_cache_{i}") if sparse else None)
                for i, sparse in enumerate(self.sparse_layers)]

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, slot_mapping: torch.Tensor,
                index_slot_mapping: torch.Tensor, block_table: torch.Tensor, seq_lens: torch.Tensor) -> torch.Tensor:
        # Only the tensors are traced; the host facts here describe the decode the graph is built
        # for, and the ops compare them with the real step's (forward context) at run time.
        q = self.decode_query_len
        meta = StepMetadata(positions=positions, slot_mapping=slot_mapping, index_slot_mapping=index_slot_mapping,
                            block_table=block_table, seq_lens=seq_lens, query_lens=(q,), num_prefills=0,
                            query_len=q)
        return self.model(input_ids, positions, self.layer_caches(), meta)


def step_args(input_ids: torch.Tensor, meta: StepMetadata) -> tuple[torch.Tensor, ...]:
    """MiniMaxM3VllmModel's forward arguments for one step."""
    return (input_ids, meta.positions, meta.slot_mapping, meta.index_slot_mapping, meta.block_table, meta.seq_lens)


def run_step(model: MiniMaxM3VllmModel, input_ids: torch.Tensor, meta: StepMetadata) -> torch.Tensor:
    """One step the way vLLM's model runner calls a model: inside a forward context whose
    attn_metadata is the step's metadata (its host facts decide each op's path at run time)."""
    with set_forward_context(meta, model.vllm_config, num_tokens=meta.num_tokens):
        return model(*step_args(input_ids, meta))
