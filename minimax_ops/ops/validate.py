"""Value checks of a decode step's metadata: the ones that need to read tensor contents.

Shape and dtype checks (checks.py) cost nothing and run always. These read values, which on a GPU
means a host sync, so they run where that is free (CPU tensors) or asked for (checked mode,
MINIMAX_OPS_CHECK=1), and never under CUDA-graph capture. Every one runs before the op writes
anything, so a refused step leaves the caches byte-identical. On the GPU without checked mode
the kernels still never write outside a cache: padding slots (< 0) are skipped.
"""

from __future__ import annotations

import torch

from ..constants import MAX_CONTEXT


class StepValueError(ValueError):
    """Step metadata whose values the fused decode cannot serve; nothing was written."""


def _fail(msg: str) -> None:
    raise StepValueError(msg)


def validate_step_values(x, positions, slot_mapping, index_slot_mapping, block_table, seq_lens, kv_cache,
                         index_cache, query_len: int, *, finite: bool) -> None:
    """Slots inside the caches, block ids inside the cache, seq_lens inside the block table, and
    (finite=True) no NaN/Inf in the hidden state."""
    n = x.shape[0]
    requests = n // query_len
    num_blocks, block = kv_cache.shape[0], kv_cache.shape[2]
    capacity = num_blocks * block
    seq = seq_lens[:requests].to(torch.int64)
    if (seq < 0).any() or (seq > MAX_CONTEXT).any():
        _fail(f"seq_lens: expected values in 0..{MAX_CONTEXT}, got {seq.tolist()}")
    width = block_table.shape[1] * block
    if (seq > width).any():
        _fail(f"seq_lens: expected at most block_table width x block size = {width} tokens, got {seq.tolist()}")
    live = seq > 0
    if (live & (seq < query_len)).any():
        _fail(f"seq_lens: a live request must hold at least query_len={query_len} tokens, got {seq.tolist()}")
    for name, slots, cap in (("slot_mapping", slot_mapping, capacity),
                             ("index_slot_mapping", index_slot_mapping,
                              None if index_cache is None else index_cache.shape[0] * block)):
        if slots is None:
            continue
        bad = (slots < -1) | (slots >= cap)
        if bad.any():
            _fail(f"{name}: expected slots in -1..{cap - 1} (cache of {cap} slots), got "
                  f"{slots[bad].tolist()} at rows {bad.nonzero().flatten().tolist()}")
    if index_slot_mapping is not None and not torch.equal(index_slot_mapping, slot_mapping):
        _fail("index_slot_mapping: the fused decode needs the index cache to share the main cache's block ids "
              "(index slots equal to main slots)")
    blocks_needed = (seq + block - 1) // block
    cols = torch.arange(block_table.shape[1], device=block_table.device)
    used = cols[None, :] < blocks_needed[:, None]
    ids = block_table[:requests].to(torch.int64)
    bad = used & ((ids < 0) | (ids >= num_blocks))
    if bad.any():
        _fail(f"block_table: expected block ids in 0..{num_blocks - 1}, got {ids[bad].tolist()}")
    if finite and not torch.isfinite(x).all():
        rows = (~torch.isfinite(x)).any(dim=1).nonzero().flatten().tolist()
        _fail(f"x: the hidden state holds NaN or Inf at token rows {rows}")


def should_validate(x: torch.Tensor, checked: bool) -> bool:
    if x.device.type == "cpu":
        return True
    if checked:
        if torch.cuda.is_current_stream_capturing():
            raise RuntimeError("checked mode reads values on the host and cannot run under CUDA-graph capture; "
                               "unset MINIMAX_OPS_CHECK (or the pass's checked option) to capture")
        return True
    return False
