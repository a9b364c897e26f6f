"""Paged KV / index caches and the per-step metadata a decode layer reads.

Main cache of a layer: [num_blocks, kv_heads, block_size, 2*head_dim], K in [..., :head_dim],
V in [..., head_dim:]; index cache of a sparse layer: [num_blocks, block_size, index_dim].
A slot is ``physical_block * block_size + offset``; slot < 0 marks a padding row (nothing written).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from .config import SPARSE_MOE, MiniMaxM3Config

CACHE_DTYPES = (torch.bfloat16, torch.float8_e4m3fn)


@dataclass
class StepMetadata:
    """What one forward step knows about its tokens.

    Tensors live on the model's device; ``query_lens`` and ``num_prefills`` are host-side facts
    (identical on every rank) so that a compiled model can branch on them (Dynamo guards).
    Tokens are request-major: request r owns tokens sum(query_lens[:r]) .. + query_lens[r].
    """

    positions: torch.Tensor  # int64 [n]
    slot_mapping: torch.Tensor  # int64 [n], main cache slots, -1 = padding
    index_slot_mapping: torch.Tensor  # int64 [n], index cache slots, -1 = padding
    block_table: torch.Tensor  # int32 [B, W], row-contiguous
    seq_lens: torch.Tensor  # int32 [B], cached tokens + this step's tokens; 0 = padding request
    query_lens: tuple[int, ...]  # host: tokens per request in this step
    num_prefills: int = 0  # host: requests in this step that are prefills
    query_len: int = 0  # host: the uniform per-request query length, 0 when lengths differ
    # host: the index cache uses the main cache's block ids (one block table, slots in step): the
    # fused decode inserts and indexes both caches through the main block table.
    index_shares_block_ids: bool = True

    def __post_init__(self) -> None:
        lens = set(self.query_lens)
        if not self.query_len and len(lens) == 1:
            self.query_len = lens.pop()

    @property
    def num_tokens(self) -> int:
        return self.positions.shape[0]

    def to(self, device: torch.device | str) -> "StepMetadata":
        return dataclasses.replace(self, **{
            f.name: getattr(self, f.name).to(device) for f in dataclasses.fields(self)
            if isinstance(getattr(self, f.name), torch.Tensor)})


@dataclass
class LayerCache:
    kv: torch.Tensor  # [num_blocks, kv_heads, block_size, 2*head_dim]
    index: torch.Tensor | None = None  # [num_blocks, block_size, index_dim], sparse layers only

    def clone(self) -> "LayerCache":
        return LayerCache(self.kv.clone(), None if self.index is None else self.index.clone())


def _fill(t: torch.Tensor, fill: str, generator: torch.Generator | None) -> torch.Tensor:
    if fill == "zeros":
        return t.zero_()
    if fill == "random":
        if generator is not None and generator.device != t.device:
            # Real-size caches are slow to fill from the CPU: draw on the cache's device.
            seed = int(torch.randint(2**62, (1,), generator=generator))
            generator = torch.Generator(t.device).manual_seed(seed)
        return t.copy_(torch.randn(t.shape, generator=generator, device=t.device).to(t.dtype))
    if fill == "nan":  # poison: any read of an unwritten slot shows up
        if t.element_size() == 1:  # fp8 e4m3fn: 0x7F is NaN; fill through a byte view, return t itself
            t.view(torch.uint8).fill_(0x7F)
            return t
        return t.fill_(float("nan"))
    raise ValueError(f"fill: expected 'zeros', 'random' or 'nan', got {fill!r}")


def allocate_caches(config: MiniMaxM3Config, num_blocks: int, *, kv_dtype: torch.dtype = torch.bfloat16,
                    index_dtype: torch.dtype = torch.bfloat16, device: torch.device | str = "cpu",
                    fill: str = "random", generator: torch.Generator | None = None) -> list[LayerCache]:
    """One LayerCache per layer; sparse MoE layers also get an index cache."""
    for name, dtype in (("kv_dtype", kv_dtype), ("index_dtype", index_dtype)):
        if dtype not in CACHE_DTYPES:
            raise ValueError(f"{name}: expected torch.bfloat16 or torch.float8_e4m3fn, got {dtype}")
    bs = config.sparse_block_size
    caches = []
    for layer in range(config.num_hidden_layers):
        kv = torch.empty(num_blocks, config.num_key_value_heads, bs, 2 * config.head_dim,
                         dtype=kv_dtype, device=device)
        index = None
        if config.layer_kind(layer) == SPARSE_MOE:
            index = torch.empty(num_blocks, bs, config.sparse_index_dim, dtype=index_dtype, device=device)
            _fill(index, fill, generator)
        caches.append(LayerCache(_fill(kv, fill, generator), index))
    return caches


def build_step(context_lens: list[int], query_lens: int | list[int], *, block_size: int,
               num_blocks: int, num_prefills: int | None = None, pad_requests: int = 0,
               table_width: int | None = None, device: torch.device | str = "cpu",
               generator: torch.Generator | None = None,
               block_ids: list[list[int]] | None = None) -> StepMetadata:
    """Metadata for one step: request r has context_lens[r] cached tokens and adds query_lens[r].

    Physical blocks are drawn from a random permutation of the pool (so logical order never
    equals physical order); ``block_ids`` reuses a previous step's assignment instead (same
    requests, next step). ``pad_requests`` appends padding rows (seq_len 0, slot -1).
    num_prefills defaults to the requests with no cached context.
    """
    if isinstance(query_lens, int):
        query_lens = [query_lens] * len(context_lens)
    if len(query_lens) != len(context_lens):
        raise ValueError(f"query_lens: expected {len(context_lens)} entries, got {len(query_lens)}")
    if block_ids is not None and len(block_ids) != len(context_lens):
        raise ValueError(f"block_ids: expected {len(context_lens)} lists, got {len(block_ids)}")
    seq_lens = [c + q for c, q in zip(context_lens, query_lens)]
    need = [-(-s // block_size) for s in seq_lens]
    # A request may already hold more blocks than this step needs (reused block_ids): keep them all.
    width = table_width or max([1, *need, *(len(ids) for ids in block_ids or [])])
    if max([0, *need]) > width:
        raise ValueError(f"table_width={width} is too small for {max(need)} blocks")
    if block_ids is None:
        if sum(need) > num_blocks:
            raise ValueError(f"num_blocks={num_blocks} is too small: the step needs {sum(need)}")
        perm = torch.randperm(num_blocks, generator=generator).tolist()
        block_ids, start = [], 0
        for k in need:
            block_ids.append(perm[start:start + k])
            start += k
    else:  # same requests, next step: keep their blocks, add free ones where they grew
        used = {b for ids in block_ids for b in ids}
        free = [b for b in torch.randperm(num_blocks, generator=generator).tolist() if b not in used]
        block_ids = [list(ids) for ids in block_ids]
        for ids, k in zip(block_ids, need):
            while len(ids) < k:
                if not free:
                    raise ValueError(f"num_blocks={num_blocks} is too small for the next step")
                ids.append(free.pop())
    table = torch.zeros(len(seq_lens) + pad_requests, width, dtype=torch.int32)
    positions, slots = [], []
    for r, (ids, ctx, q) in enumerate(zip(block_ids, context_lens, query_lens)):
        table[r, :min(len(ids), width)] = torch.tensor(ids[:width], dtype=torch.int32)
        for p in range(ctx, ctx + q):
            positions.append(p)
            slots.append(ids[p // block_size] * block_size + p % block_size)
    pad_q = query_lens[0] if query_lens else 1
    positions += [0] * (pad_requests * pad_q)
    slots += [-1] * (pad_requests * pad_q)
    if num_prefills is None:
        num_prefills = sum(1 for c in context_lens if c == 0)
    slot_t = torch.tensor(slots, dtype=torch.int64, device=device)
    return StepMetadata(
        positions=torch.tensor(positions, dtype=torch.int64, device=device),
        slot_mapping=slot_t, index_slot_mapping=slot_t.clone(),
        block_table=table.to(device),
        seq_lens=torch.tensor(seq_lens + [0] * pad_requests, dtype=torch.int32, device=device),
        query_lens=tuple(query_lens) + (pad_q,) * pad_requests, num_prefills=num_prefills)


def request_block_ids(meta: StepMetadata, block_size: int) -> list[list[int]]:
    """The physical blocks each real request holds (to build the next step of the same requests)."""
    out = []
    for r, s in enumerate(meta.seq_lens.tolist()):
        if s > 0:
            out.append(meta.block_table[r, :-(-s // block_size)].tolist())
    return out
