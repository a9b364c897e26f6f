"""The model's caches as vLLM KV-cache layers, and StepMetadata from vLLM's attention metadata.

Each decoder layer declares its main KV cache (K and V of every kv head: ``[blocks, kv_heads, block,
2*head_dim]``) and each sparse layer also its index cache (``[blocks, block, index_dim]``) as
``FullAttentionSpec`` layers of one backend. All specs are full attention of one block size, so vLLM
puts every layer in ONE KV-cache group (a UniformTypeKVCacheSpecs when page sizes differ): the two
caches of a layer share block ids, block table and slot mapping by construction, which is what the
fused decode needs. Should vLLM ever group them apart, ``step_from_vllm`` refuses the step with a
reason rather than index one cache through the other's blocks.

vLLM allocates, binds (``bind_kv_cache``) and re-binds the tensors; the model passes whatever is bound
as forward arguments each step. The layout is LBHNC (each layer's cache contiguous, blocks outermost),
the one the ops take.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import nn
from vllm.config import VllmConfig, get_current_vllm_config
from vllm.model_executor.layers.attention_layer_base import AttentionLayerBase
from vllm.v1.attention.backend import (AttentionBackend, AttentionCGSupport, AttentionImplBase, AttentionMetadata,
                                       AttentionMetadataBuilder, CommonAttentionMetadata, MultipleOf)
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheSpec
from vllm.v1.kv_cache_layout import KVCacheLayout

from minimax_ops.cache import StepMetadata
from minimax_ops.log import log_once


@dataclass
class MiniMaxM3AttentionMetadata(AttentionMetadata):
    """What one step's builder hands the model: vLLM's common metadata and the host-side query
    lengths (from ``query_start_loc_cpu``, already on the host: no device sync)."""

    common: CommonAttentionMetadata
    query_lens: tuple[int, ...]


class MiniMaxM3MetadataBuilder(AttentionMetadataBuilder[MiniMaxM3AttentionMetadata]):
    # FULL_DECODE_ONLY captures uniform decode batches; the ops read persistent tensors only.
    _cudagraph_support: ClassVar[AttentionCGSupport] = AttentionCGSupport.UNIFORM_BATCH
    reorder_batch_threshold = None  # request order is the scheduler's; the ops take any order

    def __init__(self, kv_cache_spec: KVCacheSpec, layer_names: list[str], vllm_config: VllmConfig,
                 device: torch.device):
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)

    def build(self, common_prefix_len: int, common_attn_metadata: CommonAttentionMetadata,
              fast_build: bool = False) -> MiniMaxM3AttentionMetadata:
        loc = common_attn_metadata.query_start_loc_cpu[:common_attn_metadata.num_reqs + 1]
        return MiniMaxM3AttentionMetadata(common_attn_metadata, tuple((loc[1:] - loc[:-1]).tolist()))


class MiniMaxM3AttentionImpl(AttentionImplBase):
    """Attention runs inside the model's own ops; vLLM never calls this."""

    def forward(self, *args, **kwargs):
        raise RuntimeError("MiniMaxM3AttentionImpl.forward: attention runs in torch.ops.minimax, not here")


class MiniMaxM3Backend(AttentionBackend):
    supported_dtypes: ClassVar[list[torch.dtype]] = [torch.bfloat16]
    supported_kv_cache_dtypes: ClassVar[list] = ["auto", "bfloat16", "fp8", "fp8_e4m3"]

    @staticmethod
    def get_name() -> str:
        return "MINIMAX_OPS"

    @staticmethod
    def get_impl_cls() -> type[AttentionImplBase]:
        return MiniMaxM3AttentionImpl

    @staticmethod
    def get_builder_cls():
        return MiniMaxM3MetadataBuilder

    @staticmethod
    def get_supported_kernel_block_sizes(kv_cache_spec=None) -> list:
        return [MultipleOf(1)]  # the manager's block is the ops' block: never split

    @classmethod
    def supports_head_size(cls, head_size: int) -> bool:
        return True

    @classmethod
    def supported_kv_cache_layouts(cls) -> tuple[KVCacheLayout, ...]:
        return (KVCacheLayout.LBHNC,)


class MiniMaxM3CacheLayer(nn.Module, AttentionLayerBase):
    """One cache of one decoder layer, registered in vLLM's static forward context under ``name``.
    ``kind`` "kv": K|V of ``heads`` kv heads of ``head_dim``; "index": one ``head_dim`` key per token."""

    def __init__(self, name: str, kind: str, heads: int, head_dim: int, dtype: torch.dtype, block_size: int):
        super().__init__()
        self.layer_name, self.kind = name, kind
        self.heads, self.head_dim, self.dtype, self.block_size = heads, head_dim, dtype, block_size
        self.kv_cache = torch.tensor([])  # bound by vLLM (bind_kv_cache)
        context = get_current_vllm_config().compilation_config.static_forward_context
        if name in context:
            raise ValueError(f"Duplicate layer name: {name}")
        context[name] = self

    def get_kv_cache_spec(self, vllm_config: VllmConfig) -> KVCacheSpec:
        return FullAttentionSpec(block_size=self.block_size, num_kv_heads=self.heads, head_size=self.head_dim,
                                 head_size_v=self.head_dim if self.kind == "kv" else 0, dtype=self.dtype)

    def get_attn_backend(self) -> type[AttentionBackend]:
        return MiniMaxM3Backend

    def cache(self) -> torch.Tensor:
        """The bound cache in the ops' layout (a view of vLLM's tensor, not a copy)."""
        kv = self.kv_cache
        if kv.dim() != 4:
            raise RuntimeError(f"{self.layer_name}: no KV cache bound yet (vLLM binds it after profiling)")
        if self.kind == "index":
            kv = kv.squeeze(1)  # [blocks, 1, block, index_dim] -> [blocks, block, index_dim]
        if not kv.is_contiguous():
            raise RuntimeError(f"{self.layer_name}: vLLM bound a non-contiguous cache (shape {tuple(kv.shape)}, "
                               f"strides {kv.stride()}); the minimax ops need the LBHNC layout")
        return kv

    def forward(self) -> None:  # never called: the caches are read by the model's ops
        raise RuntimeError("MiniMaxM3CacheLayer is a cache holder, not a module to call")


MIN_REQUEST_ROWS = 2  # block table / seq_lens rows passed to the graph: never a size Dynamo specialises


def _pad_requests(table: torch.Tensor, seq_lens: torch.Tensor, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """At least ``rows`` request rows; the added ones are padding requests (seq_len 0, read by nothing)."""
    if table.shape[0] >= rows:
        return table, seq_lens
    extra = rows - table.shape[0]
    return (torch.cat([table, table.new_zeros(extra, table.shape[1])]),
            torch.cat([seq_lens, seq_lens.new_zeros(extra)]))


def idle_step(positions: torch.Tensor, table_width: int, device) -> StepMetadata:
    """A step that writes and reads no cache (every slot -1, every request padding), for vLLM's dummy
    runs: the compiled graph runs (and compiles) at their sizes without touching a cache."""
    n = positions.shape[0]
    slots = torch.full((n,), -1, dtype=torch.int64, device=device)
    table = torch.zeros(max(n, MIN_REQUEST_ROWS), table_width, dtype=torch.int32, device=device)
    seq_lens = torch.zeros(table.shape[0], dtype=torch.int32, device=device)
    return StepMetadata(positions=positions, slot_mapping=slots, index_slot_mapping=slots, block_table=table,
                        seq_lens=seq_lens, query_lens=(), num_prefills=1)


def step_from_vllm(main: MiniMaxM3AttentionMetadata, index: MiniMaxM3AttentionMetadata | None,
                   positions: torch.Tensor, table_width: int) -> StepMetadata:
    """The StepMetadata of one vLLM step (no device sync: host facts come from host tensors). ``main``
    is a main-cache layer's metadata, ``index`` a sparse layer's index-cache metadata (None when the
    model has no sparse layer); ``table_width`` the block-table width the graph was built for."""
    c = main.common
    if c.block_table_tensor.shape[1] != table_width:
        raise RuntimeError(f"block_table: vLLM's table has {c.block_table_tensor.shape[1]} columns, the model "
                           f"was built for {table_width} (ceil(max_model_len / block_size))")
    n = positions.shape[0]
    slots = c.slot_mapping[:n]
    index_slots = slots
    if index is not None and index.common.block_table_tensor is not c.block_table_tensor:
        reason = ("vLLM gave the index cache its own cache group (block table) apart from the main KV cache; "
                  "the minimax ops index both through one block table, so this deployment is refused")
        log_once(reason)
        raise RuntimeError(reason)
    if slots.shape[0] < n:  # tokens vLLM padded the batch with: padding rows write nothing
        slots = torch.cat([slots, slots.new_full((n - slots.shape[0],), -1)])
        index_slots = slots
    reqs = c.num_reqs
    table, seq_lens = _pad_requests(c.block_table_tensor[:reqs], c.seq_lens[:reqs], MIN_REQUEST_ROWS)
    # A batch whose tokens the requests do not cover exactly is never a uniform decode for the ops
    # (counted as holding a prefill, so they take the general path).
    covered = sum(main.query_lens) == n
    return StepMetadata(positions=positions, slot_mapping=slots.long(), index_slot_mapping=index_slots.long(),
                        block_table=table, seq_lens=seq_lens,
                        query_lens=main.query_lens, num_prefills=0 if covered else 1)
