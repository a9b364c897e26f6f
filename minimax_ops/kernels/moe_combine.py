"""The expert combine of a MoE decode step: each token's output row from the experts' w2 rows.

``_moe_combine_kernel`` (token, H tile): out = y_shared + sum_j w_j * y_j, each y first summed over the w2
launch's I splits, in that fixed order, so the result is deterministic (no float atomics). Ids outside
[0, num_routed) contribute nothing. y is moe.py's fp32 [split, token, top-k column (+ the shared expert's,
column k), H] buffer, written by its w2 kernels or moe_mma.py's.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .aot import KernelSpec
from .mx_decode import gdc_launch_dependents, gdc_wait
from .tiles import COMBINE_BLOCK, combine_block


@triton.jit
def _moe_combine_kernel(y_ptr, topk_weights_ptr, ids_ptr, out_ptr, hidden, stride_ysplit, stride_ym, stride_ycol,
                        stride_om, NUM_ROUTED: tl.constexpr, TOPK: tl.constexpr, HAS_SHARED: tl.constexpr,
                        BLOCK_H: tl.constexpr, SPLIT: tl.constexpr, PDL: tl.constexpr):
    """Grid (token, H tile): out = y[shared] + sum over j = 0..k-1 of w_j * y[j], in that order,
    each y summed over the I splits first."""
    if PDL:
        gdc_wait()
        gdc_launch_dependents()
    t = tl.program_id(0).to(tl.int64)
    offs_h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    h_mask = offs_h < hidden
    y_row = y_ptr + t * stride_ym + offs_h
    acc = tl.zeros([BLOCK_H], dtype=tl.float32)
    if HAS_SHARED:
        for s in tl.static_range(SPLIT):
            acc += tl.load(y_row + s * stride_ysplit + TOPK * stride_ycol, mask=h_mask, other=0.0)
    for j in tl.static_range(TOPK):
        expert = tl.load(ids_ptr + t * TOPK + j)
        ok = (expert >= 0) & (expert < NUM_ROUTED)  # y rows of invalid ids were never written
        y = tl.zeros([BLOCK_H], dtype=tl.float32)
        # y's loads do not wait for the id (one round trip after the PDL wait, not two): an invalid
        # id's row is read (in bounds, never written) and dropped by the select, NaNs and all.
        for s in tl.static_range(SPLIT):
            y += tl.load(y_row + s * stride_ysplit + j * stride_ycol, mask=h_mask, other=0.0)
        acc += tl.where(ok, tl.load(topk_weights_ptr + t * TOPK + j) * y, 0.0)
    tl.store(out_ptr + t * stride_om + offs_h, acc.to(out_ptr.dtype.element_ty), mask=h_mask)


def combine_experts(y: torch.Tensor, topk_weights: torch.Tensor, ids: torch.Tensor, out: torch.Tensor, *,
                    num_routed: int, top_k: int, has_shared: bool, split: int, pdl: bool) -> torch.Tensor:
    """out[t] = y[:, t, k].sum(0) (if has_shared) + sum over j < top_k of topk_weights[t, j] * y[:, t, j].sum(0),
    for j whose ids[t, j] is a routed expert; y's first ``split`` planes are read. A programmatic dependent of
    the w2 launch when ``pdl``."""
    n, hidden = out.shape
    block_h = combine_block()
    _moe_combine_kernel[(n, triton.cdiv(hidden, block_h))](
        y, topk_weights, ids, out, hidden, y.stride(0), y.stride(1), y.stride(2), out.stride(0),
        NUM_ROUTED=num_routed, TOPK=top_k, HAS_SHARED=has_shared, BLOCK_H=block_h, SPLIT=split,
        PDL=pdl, num_warps=4, launch_pdl=pdl)
    return out


def aot_specs() -> list[KernelSpec]:
    """The real size's combines: every split a w2 launch can leave, with and without the shared expert (the tiny
    size adds none); the PDL form (with the shared expert, as the fused layer launches it) for CUDA only."""
    from .moe import AOT_SIZE, combine_splits  # (moe.py imports this module to launch the combine)
    hidden, _, n_routed, top_k = AOT_SIZE
    splits = combine_splits()
    specs = []
    for has_shared, pdl in ((True, False), (False, False), (True, True)):
        for split in splits:
            specs.append(KernelSpec(
                _moe_combine_kernel,
                {"y_ptr": "*fp32", "topk_weights_ptr": "*fp32", "ids_ptr": "*i32", "out_ptr": "*bf16",
                 "hidden": "i32", "stride_ysplit": "i32", "stride_ym": "i32", "stride_ycol": "i32",
                 "stride_om": "i32"},
                {"NUM_ROUTED": n_routed, "TOPK": top_k, "HAS_SHARED": has_shared, "BLOCK_H": COMBINE_BLOCK,
                 "SPLIT": split, "PDL": pdl}, targets=("cuda",) if pdl else (),
                name=f"moe_combine_h{hidden}_shared{int(has_shared)}_split{split}{'_pdl' if pdl else ''}"))
    return specs
