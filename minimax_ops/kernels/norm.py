"""Gemma RMSNorm, optionally fused with the residual add: ``x * rsqrt(mean(x^2) + eps) * (1 + w)``.

One program per row: a decode step has at most a few dozen rows of 6144, so the whole row sits in
registers and the kernel is one read of x / residual / weight and one write of each output.
"""

from __future__ import annotations

import dataclasses

import torch
import triton
import triton.language as tl

from .aot import KernelSpec, with_pdl_variants
from .mx_decode import gdc_launch_dependents, gdc_wait, pdl_supported


@triton.jit
def round_to_bf16(x):
    """fp32 x rounded to the nearest bf16 (ties to even, NaN kept), as fp32: what torch's cast to bf16 gives,
    made with integer ops so that the interpreter (whose fp32 -> bf16 cast truncates) gives it too."""
    u = x.to(tl.uint32, bitcast=True)
    rounded = ((u + 0x7FFF + ((u >> 16) & 1)) & 0xFFFF0000).to(tl.float32, bitcast=True)
    return tl.where(x != x, x, rounded)


@triton.jit
def _rmsnorm_kernel(x_ptr, res_ptr, w_ptr, h_ptr, res_out_ptr,
                    stride_x, stride_res, stride_h, stride_res_out,
                    hidden, eps,
                    BLOCK_H: tl.constexpr, HAS_RESIDUAL: tl.constexpr, PDL: tl.constexpr,
                    LAUNCH_FIRST: tl.constexpr = False):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_H)
    mask = cols < hidden
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)  # (a weight: before the wait)
    if PDL:  # launched as a programmatic dependent: wait for the previous kernel's outputs
        if LAUNCH_FIRST:  # the dependent's programs come in (and read their weights) while this one waits
            gdc_launch_dependents()
            gdc_wait()
        else:
            gdc_wait()
            gdc_launch_dependents()
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    if x_ptr.dtype.element_ty == tl.float32:  # an fp32 all-reduce sum: first the bf16 the vocabulary's would give
        x = round_to_bf16(x)
    if HAS_RESIDUAL:
        r = tl.load(res_ptr + row * stride_res + cols, mask=mask, other=0.0).to(tl.float32)
        summed = (x + r).to(res_out_ptr.dtype.element_ty)
        tl.store(res_out_ptr + row * stride_res_out + cols, summed, mask=mask)
        # Normalise what was stored (the bf16 residual), as the next layer will see it.
        x = summed.to(tl.float32)
    rstd = tl.rsqrt(tl.sum(x * x, axis=0) / hidden + eps)
    tl.store(h_ptr + row * stride_h + cols, (x * rstd * (1.0 + w)).to(h_ptr.dtype.element_ty), mask=mask)


def _num_warps(block_h: int) -> int:
    # ~8-16 elements per thread keeps the row in registers without spilling.
    return max(1, min(16, block_h // 512))


def check_rows(name: str, t: torch.Tensor, width: int | None = None, *, shape: str = "[tokens, hidden]",
               dim: str = "hidden", dtypes: tuple[torch.dtype, ...] = (torch.bfloat16,)) -> None:
    """A 2-D activation (bf16 unless ``dtypes`` says otherwise) whose last dimension is contiguous (shared by
    the kernel wrappers)."""
    if t.dim() != 2:
        raise ValueError(f"{name}: expected a 2-D {shape} tensor, got shape {tuple(t.shape)}")
    if t.dtype not in dtypes:
        expected = " or ".join(str(d) for d in dtypes)
        raise ValueError(f"{name}: expected dtype {expected}, got {t.dtype}")
    if t.stride(1) != 1:
        raise ValueError(f"{name}: the {dim} dimension must be contiguous, got strides {tuple(t.stride())}")
    if width is not None and t.shape[1] != width:
        raise ValueError(f"{name}: expected {dim} size {width}, got {t.shape[1]}")


def check_norm_weight(weight: torch.Tensor, hidden: int) -> None:
    if weight.shape != (hidden,) or not weight.is_contiguous():
        raise ValueError(f"weight: expected a contiguous [{hidden}] tensor, got shape {tuple(weight.shape)}")
    if weight.dtype not in (torch.bfloat16, torch.float32):
        raise ValueError(f"weight: expected bfloat16 or float32, got {weight.dtype}")


@triton.jit
def sumsq_parts(ss_ptr, n_parts, BLOCK_P: tl.constexpr):
    """A row's n_parts sums of squares left by linear_mma.mma_linear_add_norm (the norm deferred to its
    consumers), loaded; ``rstd_of_parts`` reduces them (a consumer may load early and reduce late)."""
    offs = tl.arange(0, BLOCK_P)
    return tl.load(ss_ptr + offs, mask=offs < n_parts, other=0.0)


@triton.jit
def rstd_of_parts(parts, hidden, eps):
    """rsqrt(mean of squares + eps) from ``sumsq_parts``, summed in one fixed order wherever it is read."""
    return tl.rsqrt(tl.sum(parts, axis=0) / hidden + eps)


def deferred_norm_args(sumsq: torch.Tensor, eps: float) -> dict:
    """The launch arguments a consumer kernel of the deferred norm takes (NORM, sumsq_ptr, n_parts, eps, BLOCK_P:
    ``sumsq_parts`` / ``rstd_of_parts`` in it)."""
    return dict(NORM=True, sumsq_ptr=sumsq, n_parts=sumsq.shape[1], eps=float(eps),
                BLOCK_P=triton.next_power_of_2(sumsq.shape[1]))


def check_deferred_norm(weight: torch.Tensor, sumsq: torch.Tensor, n: int, hidden: int) -> None:
    """The norm weight [hidden] and the sums of squares [n, groups] fp32 of linear_mma.mma_linear_add_norm."""
    check_norm_weight(weight, hidden)
    if sumsq.dtype != torch.float32 or sumsq.dim() != 2 or sumsq.shape[0] != n or not sumsq.is_contiguous():
        raise ValueError(f"sumsq: expected contiguous fp32 [{n}, groups], got {sumsq.dtype} {tuple(sumsq.shape)}")


def add_rmsnorm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                eps: float, *, pdl: bool = False, launch_first: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """residual_out = bf16(residual + x) (fp32 add); h = gemma_rmsnorm(residual_out, weight).

    x, residual: bf16 [n, H]; x may be fp32 too (a tensor-parallel all-reduce's sum, which the fused layer
    keeps fp32: it is rounded to bf16 first, as minimax.all_reduce rounds it, so h and residual_out have the
    bits they would have after that op); weight [H] (bf16 or fp32). Returns (h, residual_out), both bf16 [n, H].
    ``launch_first`` (with ``pdl``): the next kernel launches before this one waits for the previous one,
    for a next kernel that reads nothing but weights before its own wait (which then covers both).
    """
    check_rows("x", x, dtypes=(torch.bfloat16, torch.float32))
    n, hidden = x.shape
    check_rows("residual", residual, hidden)
    if residual.shape[0] != n:
        raise ValueError(f"residual: expected {n} rows like x, got {residual.shape[0]}")
    check_norm_weight(weight, hidden)
    h = torch.empty_like(residual)
    res_out = torch.empty_like(residual)
    if n == 0:
        return h, res_out
    block_h = triton.next_power_of_2(hidden)
    pdl = pdl and pdl_supported(x.device)
    _rmsnorm_kernel[(n,)](x, residual, weight, h, res_out,
                          x.stride(0), residual.stride(0), h.stride(0), res_out.stride(0),
                          hidden, eps, BLOCK_H=block_h, HAS_RESIDUAL=True, PDL=pdl, LAUNCH_FIRST=pdl and launch_first,
                          num_warps=_num_warps(block_h), launch_pdl=pdl)
    return h, res_out


def rmsnorm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """gemma_rmsnorm(x, weight) for bf16 x [n, H] -> bf16 [n, H] (the final norm)."""
    check_rows("x", x)
    n, hidden = x.shape
    check_norm_weight(weight, hidden)
    h = torch.empty_like(x)
    if n == 0:
        return h
    block_h = triton.next_power_of_2(hidden)
    # The residual pointers are unused (HAS_RESIDUAL=False); pass x so the signature stays typed.
    _rmsnorm_kernel[(n,)](x, x, weight, h, x, x.stride(0), x.stride(0), h.stride(0), x.stride(0),
                          hidden, eps, BLOCK_H=block_h, HAS_RESIDUAL=False, PDL=False, num_warps=_num_warps(block_h))
    return h


def aot_specs() -> list[KernelSpec]:
    specs = []
    for hidden in (64, 6144):  # tiny and real hidden sizes
        block_h = triton.next_power_of_2(hidden)
        # x fp32: the post norm of a tensor-parallel fused layer, on the all-reduce's fp32 sum.
        for w_type, has_res, x_type in (("*bf16", True, "*bf16"), ("*bf16", False, "*bf16"), ("*fp32", True, "*bf16"),
                                        ("*fp32", False, "*bf16"), ("*bf16", True, "*fp32"), ("*fp32", True, "*fp32")):
            specs.append(KernelSpec(
                _rmsnorm_kernel,
                {"x_ptr": x_type, "res_ptr": "*bf16", "w_ptr": w_type, "h_ptr": "*bf16",
                 "res_out_ptr": "*bf16", "stride_x": "i32", "stride_res": "i32", "stride_h": "i32",
                 "stride_res_out": "i32", "hidden": "i32", "eps": "fp32"},
                {"BLOCK_H": block_h, "HAS_RESIDUAL": has_res, "LAUNCH_FIRST": False}, num_warps=_num_warps(block_h),
                name=f"rmsnorm_h{hidden}_{w_type[1:]}{'_residual' if has_res else ''}"
                     f"{'_x_fp32' if x_type == '*fp32' else ''}"))
    specs = with_pdl_variants(specs)
    # The fused layer's input norm letting its dependent launch first (CUDA, PDL).
    return specs + [dataclasses.replace(s, constexprs={**s.constexprs, "LAUNCH_FIRST": True}, name=f"{s.label()}_first")
                    for s in specs if s.constexprs["PDL"] and s.constexprs["HAS_RESIDUAL"]
                    and s.signature["x_ptr"] == "*bf16"]
