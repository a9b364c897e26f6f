"""Deterministic split-K reduction: when a launch splits K over several programs, each writes fp32
partials and the last program of an output tile to finish sums them in a fixed order (an int32
arrival counter, ``last_arrival``): no float atomics, one launch. Without counters (e.g. the
first call inside a CUDA-graph capture) ``splitk_reduce_kernel`` sums in a second launch.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from .aot import KernelSpec

# Split-K modes (the SPLIT_MODE constexpr): one split stores y directly; PARTIALS stores fp32
# partials [split, M, N] for ``splitk_reduce_kernel``; FUSED also stores partials, and the last of
# a tile's split programs to finish sums them (see ``last_arrival``), so no second launch.
SPLIT_NONE, SPLIT_PARTIALS, SPLIT_FUSED = 0, 1, 2


@triton.jit
def last_arrival(cnt_ptr, expected):
    """Counts this program in at cnt_ptr; True for the last of `expected` programs, which also
    resets the count to 0 for the next launch. The barrier orders every thread's earlier stores
    before the release; the acquire makes the other programs' stores visible to the last one
    (which must then read them with cache_modifier=".cg": L1 is not coherent)."""
    tl.debug_barrier()
    ticket = tl.atomic_add(cnt_ptr, 1, sem="acq_rel", scope="gpu")
    last = ticket == expected - 1
    if last:
        tl.atomic_xchg(cnt_ptr, 0, sem="relaxed", scope="gpu")
    return last


@triton.jit
def sum_splits(part_ptrs, mask, split_stride, n_split, SPLIT_POW2: tl.constexpr):
    """sum over s < n_split of (part_ptrs + s * split_stride)[mask], added in the order s = 0, 1, ...
    (deterministic); unrolled up to SPLIT_POW2 so the loads can all be in flight at once."""
    acc = tl.load(part_ptrs, mask=mask, other=0.0, cache_modifier=".cg")
    for s in tl.static_range(1, SPLIT_POW2):
        acc += tl.load(part_ptrs + s * split_stride, mask=mask & (s < n_split), other=0.0, cache_modifier=".cg")
    return acc


@triton.jit
def splitk_reduce_kernel(part_ptr, out_ptr, total, n_split, BLOCK: tl.constexpr, SPLIT_POW2: tl.constexpr):
    """out[i] = sum over splits of part[s, i] (fixed tree order), for contiguous [M, N]."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < total
    acc = sum_splits(part_ptr + offs, mask, total, n_split, SPLIT_POW2)
    tl.store(out_ptr + offs, acc.to(out_ptr.dtype.element_ty), mask=mask)



COUNTER_SLOTS = 1 << 16
_COUNTERS: dict[torch.device, torch.Tensor] = {}


def split_counters(device: torch.device, needed: int) -> torch.Tensor | None:
    """Zeroed int32 arrival counters for the fused split-K reductions (``last_arrival``), one
    buffer per device, left zeroed by every launch that uses it. None (use a separate reduce
    launch) if more are needed than exist, if MINIMAX_OPS_NO_FUSED_SPLITK=1, or if the buffer does
    not exist yet while a CUDA graph is being captured (it must be zeroed eagerly once).
    Kernels that use it must not run concurrently on two streams of one device."""
    if needed > COUNTER_SLOTS or os.environ.get("MINIMAX_OPS_NO_FUSED_SPLITK") == "1":
        return None
    buf = _COUNTERS.get(device)
    if buf is None:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            return None
        buf = _COUNTERS[device] = torch.zeros(COUNTER_SLOTS, dtype=torch.int32, device=device)
    return buf


REDUCE_BLOCK = 512


def aot_specs() -> list[KernelSpec]:
    return [KernelSpec(splitk_reduce_kernel, {"part_ptr": "*fp32", "out_ptr": "*bf16", "total": "i32", "n_split": "i32"},
                       {"BLOCK": REDUCE_BLOCK, "SPLIT_POW2": p}, num_warps=4, name=f"splitk_reduce_bf16_x{p}")
            for p in (2, 4)]
