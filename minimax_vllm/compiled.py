"""MiniMaxM3VllmModel: the compile-ready text model as a vLLM ``@support_torch_compile`` module.

What vLLM's compilation (VLLM_COMPILE, or the CPU platform's trace-once mode) needs, and what this
module does for it:

- vLLM traces ``forward`` once with dim 0 of the token tensors dynamic, drops every Dynamo guard and
  picks a compiled artifact per compile range by token count alone. So the wrapped model runs in
  "vLLM mode" (``MiniMaxM3ForCausalLM.set_decode_query_len``): it never branches on host-side step facts
  and always traces the decode chain for uniform decodes of ``decode_query_len`` tokens per request.
  At run time the step-kind-dependent ops read the step (``minimax_ops.step_context.use_step``, set by
  the caller) and take the general path for a step that is not such a decode, with no device sync.
- Caches are forward arguments (lists of tensors): vLLM allocates and binds them, and binding new ones
  only means new arguments; nothing is rebuilt, no pointer is baked into a graph.
- Step tensors are forward arguments (dynamic dim 0: tokens for input_ids / positions / slots,
  requests for block_table / seq_lens); the block table's width is fixed per deployment.

``MiniMaxM3ForVllm`` (model.py) wraps it for vLLM's engine; tests may drive it directly with
``run_step`` and caches it owns (``num_blocks``).
"""

from __future__ import annotations

import math

import torch
from torch import nn
from vllm.compilation.decorators import support_torch_compile
from vllm.config import VllmConfig
from vllm.forward_context import set_forward_context
from vllm.sequence import IntermediateTensors

from minimax_ops.cache import LayerCache, StepMetadata, allocate_caches
from minimax_ops.config import MiniMaxM3Config
from minimax_ops.model import MiniMaxM3ForCausalLM
from minimax_ops.ops.collectives import VLLM_TP_GROUP
from minimax_ops.sharding import local_config
from minimax_ops.step_context import use_step
from minimax_ops.weights import ModelWeights, random_model_weights

from .deployment import deployment_from_vllm_config, minimax_m3_config_from_vllm

TOKEN_DIM_ARGS = ("input_ids", "positions", "slot_mapping", "index_slot_mapping")
REQUEST_DIM_ARGS = ("block_table", "seq_lens")


def cache_dtype(deployment, which: str) -> torch.dtype:
    """The torch dtype of the deployment's kv / index cache (bf16 for "auto")."""
    dtype = deployment.cache_dtype(which)
    if dtype is None:
        return torch.bfloat16
    if isinstance(dtype, str):
        name = deployment.kv_cache_dtype if which == "kv" else deployment.index_cache_dtype
        raise ValueError(f"{which} cache dtype {name!r}: the minimax ops store bf16 or fp8 e4m3 caches")
    return dtype


def decode_query_len_of(vllm_config: VllmConfig) -> int:
    """vLLM's uniform decode query length: 1 + speculative tokens."""
    spec = getattr(vllm_config, "speculative_config", None)
    return 1 + (getattr(spec, "num_speculative_tokens", None) or 0)


# Request dims stay backed (vLLM picks a compile range by the graph's first size symbol, the token
# count); MiniMaxM3ForVllm never passes fewer than MIN_REQUEST_ROWS rows, so Dynamo's specialisation
# of sizes 0 and 1 cannot freeze the graph to one request.
@support_torch_compile(dynamic_arg_dims={name: 0 for name in TOKEN_DIM_ARGS + REQUEST_DIM_ARGS
                                         + ("intermediate_tensors",)})
class MiniMaxM3VllmModel(nn.Module):
    """forward(input_ids, positions, slot_mapping, index_slot_mapping, block_table, seq_lens, kv_caches,
    index_caches, intermediate_tensors=None) -> final hidden states bf16 [n, hidden] (``self.model.logits``
    makes logits), or on a pipeline stage before the last the {"hidden_states", "residual"} for the next.
    ``kv_caches`` has one cache per held layer, ``index_caches`` one per held sparse layer.

    ``config``: the model's MiniMaxM3Config when the VllmConfig carries no MiniMax-M3 hf_config;
    ``weights``: ModelWeights (default: random, seeded), this rank's shard and stage; ``num_blocks``: when
    given, the module owns caches of that many blocks as buffers (``layer_caches()``, for tests);
    ``decode_query_len``: the uniform decode the graph is traced for (default 1 + speculative tokens);
    ``layers``: this pipeline stage's layers (default all). Under tensor parallelism (the config's
    tensor_parallel_size) the all-reduces go through vLLM's TP group (collectives.VLLM_TP_GROUP)."""

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = "", config: MiniMaxM3Config | None = None,
                 weights: ModelWeights | None = None, num_blocks: int | None = None,
                 decode_query_len: int | None = None, layers: range | None = None):
        super().__init__()
        config = minimax_m3_config_from_vllm(vllm_config) or config
        if config is None:
            raise ValueError("config: the VllmConfig has no MiniMax-M3 hf_config, so pass a MiniMaxM3Config, got None")
        deployment = deployment_from_vllm_config(vllm_config, config)
        if deployment.mixed_batch_cudagraphs:  # wrong answers for mixed batches, fused or not
            raise ValueError("compilation_config.cudagraph_mode: FULL freezes each layer's batch-kind decision "
                             "at capture for decode and mixed batches alike; use FULL_DECODE_ONLY or NONE")
        device = vllm_config.device_config.device
        tp = vllm_config.parallel_config.tensor_parallel_size
        if weights is None:
            weights = random_model_weights(local_config(config, tp), generator=torch.Generator().manual_seed(0),
                                           device=device)
        self.config = config
        self.decode_query_len = decode_query_len or decode_query_len_of(vllm_config)
        layers = range(config.num_hidden_layers) if layers is None else layers
        self.model = MiniMaxM3ForCausalLM(config, weights, tp_size=tp, tp_group=VLLM_TP_GROUP if tp > 1 else None,
                                          layers=layers)
        self.model.set_decode_query_len(self.decode_query_len)  # vLLM mode: see the module docstring
        max_len = deployment.max_model_len or config.max_position_embeddings
        self.table_width = math.ceil(max_len / config.sparse_block_size)  # block table columns a request can need
        self.sparse_layers = [config.layer_kinds[i] != "dense" for i in layers]
        self.owns_caches = num_blocks is not None
        if self.owns_caches:
            caches = allocate_caches(local_config(config, tp), num_blocks, kv_dtype=cache_dtype(deployment, "kv"),
                                     index_dtype=cache_dtype(deployment, "index"), device=device,
                                     fill="zeros")[layers.start:layers.stop]
            for i, cache in enumerate(caches):
                self.register_buffer(f"kv_cache_{i}", cache.kv)
                if cache.index is not None:
                    self.register_buffer(f"index_cache_{i}", cache.index)

    def layer_caches(self) -> list[LayerCache]:
        """The owned cache buffers as LayerCaches (the same tensors, not copies)."""
        return [LayerCache(getattr(self, f"kv_cache_{i}"), getattr(self, f"index_cache_{i}") if sparse else None)
                for i, sparse in enumerate(self.sparse_layers)]

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, slot_mapping: torch.Tensor,
                index_slot_mapping: torch.Tensor, block_table: torch.Tensor, seq_lens: torch.Tensor,
                kv_caches: list[torch.Tensor], index_caches: list[torch.Tensor],
                intermediate_tensors: IntermediateTensors | None = None):
        # Only the tensors are traced; the host facts here describe the decode the graph is built
        # for, and the ops compare them with the real step's (step_context) at run time.
        q = self.decode_query_len
        meta = StepMetadata(positions=positions, slot_mapping=slot_mapping, index_slot_mapping=index_slot_mapping,
                            block_table=block_table, seq_lens=seq_lens, query_lens=(q,), num_prefills=0,
                            query_len=q)
        index = iter(index_caches)
        caches = [LayerCache(kv, next(index) if sparse else None) for kv, sparse in zip(kv_caches, self.sparse_layers)]
        intermediate = None if intermediate_tensors is None else dict(intermediate_tensors.tensors)
        return self.model.hidden_states(input_ids, positions, caches, meta, intermediate)


def step_args(input_ids: torch.Tensor, meta: StepMetadata, caches: list[LayerCache]) -> tuple:
    """MiniMaxM3VllmModel's forward arguments for one step."""
    return (input_ids, meta.positions, meta.slot_mapping, meta.index_slot_mapping, meta.block_table, meta.seq_lens,
            [c.kv for c in caches], [c.index for c in caches if c.index is not None])


def run_step(model: MiniMaxM3VllmModel, input_ids: torch.Tensor, meta: StepMetadata) -> torch.Tensor:
    """One step over the module's own caches, the way the engine calls it (forward context set, the
    step's host facts current): fp32 logits [n, vocab]."""
    with set_forward_context(None, model.vllm_config, num_tokens=meta.num_tokens), use_step(meta):
        return model.model.logits(model(*step_args(input_ids, meta, model.layer_caches())))
