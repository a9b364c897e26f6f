"""Weight-streaming GEMV for decode: ``y = x @ dequant(W, s)^T`` with bf16, MXFP8 or MXFP4 weights.

Decode is bound by reading the weights once, so the kernel is built around that stream (the decode
and K loop are mx_decode's): a program streams one [BLOCK_N rows, K range] slice of W against all
tokens of the step. Where N alone gives too few programs to keep all SMs streaming, K is split and
the splits are summed deterministically (splitk.py). Weights come in any layout of
formats.LAYOUTS; tiled weights are read one contiguous tile per K step. Measured figures are in
BENCHMARKS.md; the tiles are chosen in tiles.py.
"""

from __future__ import annotations

import dataclasses

import torch
import triton
import triton.language as tl

from ..formats import FMT_BF16, FMT_MXFP4, FMT_MXFP4_WORDS, FMT_MXFP8
from .aot import KernelSpec
from .mx_decode import (FORMAT_NAMES, POINTER_TYPES, PREFETCH_BYTES, as_kernel_operand, check_weight, gdc_launch_dependents,
                        gdc_wait, mxfp4_ptx, pdl_supported, prefetch_l2, stream_rows)
from .linear_mma import mma_linear, mma_linear_add_norm
from .norm import check_rows
from .splitk import (REDUCE_BLOCK, SPLIT_FUSED, SPLIT_NONE, SPLIT_PARTIALS, last_arrival, split_counters,
                     splitk_reduce_kernel, sum_splits)
from .tiles import GemvConfig, gemv_config, num_sms


@triton.jit
def _mx_linear_kernel(x_ptr, w_ptr, s_ptr, out_ptr, part_ptr, cnt_ptr,
                      M, N, iters_total, iters_per_split, n_split,
                      stride_xm, stride_wt, stride_wn, stride_st, stride_sn, stride_om,
                      FMT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                      SWAP_AB: tl.constexpr, DOT_FP32: tl.constexpr, PTX: tl.constexpr, K_CHUNKS: tl.constexpr,
                      SPLIT_MODE: tl.constexpr, SPLIT_POW2: tl.constexpr, TILED: tl.constexpr,
                      PDL: tl.constexpr, PREFETCH: tl.constexpr, FMA: tl.constexpr):
    """Grid (N tiles, K splits, M tiles). y [M, N] = out; fp32 partials [n_split, M, N] = part.
    iters_* count steps of K_CHUNKS * BLOCK_K. Row layouts: stride_wn / stride_sn are row strides
    (stride_wt, stride_st unused); tiled: stride_wt / stride_st step one tile row (BLOCK_N rows) and
    stride_wn / stride_sn one row inside a tile. PDL: launched as a programmatic dependent, the
    program first asks L2 for the start of its weight slice (PREFETCH bytes of the tiled stream),
    then waits for the previous kernel before reading x."""
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    pid_m = tl.program_id(2)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    it_begin = pid_k * iters_per_split
    n_iters = tl.minimum(iters_per_split, iters_total - it_begin)
    if TILED:  # BLOCK_N divides N (formats.to_layout), so every row exists
        r = tl.arange(0, BLOCK_N).to(tl.int64)
        w_rows = w_ptr + pid_n.to(tl.int64) * stride_wt + r * stride_wn
        s_rows = s_ptr + pid_n.to(tl.int64) * stride_st + r * stride_sn
    else:
        # Rows past N re-read row N-1 (no load masks in the loop); their results are not stored.
        rows = tl.minimum(offs_n, N - 1).to(tl.int64)
        w_rows = w_ptr + rows * stride_wn
        s_rows = s_ptr + rows * stride_sn
    if PDL:
        if TILED and PREFETCH > 0:
            start = w_ptr + pid_n.to(tl.int64) * stride_wt + (it_begin * K_CHUNKS).to(tl.int64) * BLOCK_N * stride_wn
            slice_bytes = n_iters * K_CHUNKS * BLOCK_N * stride_wn * (1 if FMA and FMT == 1 else 4)
            prefetch_l2(start, tl.minimum(slice_bytes, PREFETCH))
        gdc_wait()
        gdc_launch_dependents()
    acc = stream_rows(x_ptr + offs_m.to(tl.int64) * stride_xm, offs_m < M, w_rows, s_rows,
                      it_begin * (K_CHUNKS * BLOCK_K), n_iters, FMT, BLOCK_M, BLOCK_N, BLOCK_K, SWAP_AB, DOT_FP32, PTX,
                      K_CHUNKS, BLOCK_N if TILED else 0, FMA)
    mask = (offs_m[:, None] < M) & (offs_n[None, :] < N)
    out_ptrs = out_ptr + offs_m.to(tl.int64)[:, None] * stride_om + offs_n[None, :]
    if SPLIT_MODE == 0:
        tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=mask)
    else:
        mn = (tl.zeros([], dtype=tl.int64) + M) * N  # (M may be a specialised constant 1)
        part_ptrs = part_ptr + offs_m.to(tl.int64)[:, None] * N + offs_n[None, :]
        tl.store(part_ptrs + pid_k * mn, acc, mask=mask)
        if SPLIT_MODE == 2:
            if last_arrival(cnt_ptr + pid_m * tl.num_programs(0) + pid_n, n_split):
                total = sum_splits(part_ptrs, mask, mn, n_split, SPLIT_POW2)
                tl.store(out_ptrs, total.to(out_ptr.dtype.element_ty), mask=mask)


# ---- wrapper ---------------------------------------------------------------------------------------------


def mx_linear(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor | None, *,
              out_dtype: torch.dtype = torch.bfloat16, config: GemvConfig | None = None,
              pdl: bool = False) -> torch.Tensor:
    """y [M, N] = x [M, K] @ dequant(weight, scale)^T, fp32 accumulation, cast to out_dtype.

    (weight, scale) in any layout of formats.LAYOUTS (bf16, MXFP8, MXFP4 canonical, words or tiled;
    a tiled weight fixes BLOCK_N and BLOCK_K; the mma layouts run linear_mma.py's kernel). ``config``
    overrides the tile heuristic (tuning, tests). ``pdl``: launch as a programmatic dependent of the previous kernel on the stream
    (griddepcontrol; CUDA sm_90+ only, ignored elsewhere)."""
    check_rows("x", x, shape="[M, K]", dim="K")
    m, k = x.shape
    lw = check_weight("weight", weight, scale, k, x.device)
    fmt, n = lw.layout.code, lw.n
    if out_dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise ValueError(f"out_dtype: expected bfloat16, float16 or float32, got {out_dtype}")
    if lw.layout.mma:  # (allocates its own output)
        return mma_linear(x, weight, scale, fmt, out_dtype, pdl=pdl)
    out = torch.empty(m, n, dtype=out_dtype, device=x.device)
    if m == 0 or n == 0:
        return out
    cfg = config or gemv_config(fmt, m, n, k, num_sms(x.device))
    if lw.tiles is not None:
        cfg = dataclasses.replace(cfg, block_n=lw.tiles[0], block_k=lw.tiles[1])
    fma = cfg.fma and m == 1 and cfg.block_m == 1
    ptx = mxfp4_ptx(fmt, cfg.ptx, x.device) and not fma and lw.tiles is None  # tiled: portable decode
    w = as_kernel_operand(weight, fmt, ptx=ptx, native=fma)
    s = scale if scale is not None else w  # unused by the bf16 kernel; any pointer keeps it typed
    chunks = cfg.k_chunks
    while chunks > 1 and k % (cfg.block_k * chunks):
        chunks //= 2
    iters = k // (cfg.block_k * chunks)
    iters_per_split = triton.cdiv(iters, max(1, min(cfg.split_k, iters)))
    split = triton.cdiv(iters, iters_per_split)
    grid = (triton.cdiv(n, cfg.block_n), split, triton.cdiv(m, cfg.block_m))
    counters = split_counters(x.device, grid[0] * grid[2]) if split > 1 and cfg.fused_reduce else None
    mode = SPLIT_NONE if split == 1 else SPLIT_FUSED if counters is not None else SPLIT_PARTIALS
    part = out if split == 1 else torch.empty(split, m, n, dtype=torch.float32, device=x.device)
    tiled = lw.tiles is not None
    pdl = pdl and pdl_supported(x.device)
    _mx_linear_kernel[grid](
        x, w, s, out, part, counters if counters is not None else part, m, n, iters, iters_per_split, split,
        x.stride(0), w.stride(0) if tiled else 0, w.stride(-2), s.stride(0) if tiled else 0, s.stride(-2),
        out.stride(0),
        FMT=fmt, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, SWAP_AB=cfg.swap_ab,
        DOT_FP32=x.device.type != "cuda", PTX=ptx, K_CHUNKS=chunks, SPLIT_MODE=mode,
        SPLIT_POW2=triton.next_power_of_2(split), TILED=tiled, PDL=pdl, PREFETCH=PREFETCH_BYTES if pdl else 0, FMA=fma,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, launch_pdl=pdl)
    if mode == SPLIT_PARTIALS:
        splitk_reduce_kernel[(triton.cdiv(m * n, REDUCE_BLOCK),)](
            part, out, m * n, split, BLOCK=REDUCE_BLOCK, SPLIT_POW2=triton.next_power_of_2(split), num_warps=4)
    return out


def in_mma_layout(weight: torch.Tensor, scale: torch.Tensor | None, rank: int = 2) -> bool:
    """Whether a checked (weight, scale) pair is in an mma layout (mxfp4_mma / mxfp8_mma)."""
    return check_weight("weight", weight, scale, None, weight.device, rank=rank).layout.mma


def mx_linear_add_norm(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor | None, residual: torch.Tensor,
                       norm_weight: torch.Tensor, *,
                       pdl: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """mx_linear (bf16 out) followed by norm.add_rmsnorm with the norm's reduction deferred to the
    consumers, for weights in an mma layout: (residual_out, scaled rows, sums of squares), as
    linear_mma.mma_linear_add_norm says."""
    check_rows("x", x, shape="[M, K]", dim="K")
    lw = check_weight("weight", weight, scale, x.shape[1], x.device)
    if not lw.layout.mma:
        raise ValueError(f"weight: the deferred norm takes weights in an mma layout (mxfp4_mma / mxfp8_mma), got "
                         f"{lw.layout.name}")
    return mma_linear_add_norm(x, weight, scale, lw.layout.code, residual, norm_weight, pdl=pdl)


# ---- ahead-of-time specs ---------------------------------------------------------------------------------

# (M, N, K) the wrappers meet: the tiny preset (H=64: qkv 448 x 64, M past 16 tiles M) and the real
# model (qkv+index 9856 x 6144 splits K: fp32 partials; dense gate_up 24576 x 6144 does not).
AOT_SHAPES = [(1, 448, 64), (20, 192, 64), (1, 9856, 6144), (16, 24576, 6144)]


def _linear_spec(fmt: int, cfg: GemvConfig, split_mode: int, split_pow2: int, ptx: bool = False, tiled: bool = False,
                 pdl: bool = False) -> KernelSpec:
    w_type = "*u8" if ptx else "*fp8e4nv" if cfg.fma and fmt == FMT_MXFP8 else POINTER_TYPES[fmt]
    return KernelSpec(
        _mx_linear_kernel,
        {"x_ptr": "*bf16", "w_ptr": w_type, "s_ptr": "*u8" if fmt else "*bf16", "out_ptr": "*bf16",
         "part_ptr": "*fp32" if split_mode else "*bf16", "cnt_ptr": "*i32" if split_mode == SPLIT_FUSED else "*fp32",
         "M": "i32", "N": "i32", "iters_total": "i32", "iters_per_split": "i32", "n_split": "i32",
         "stride_xm": "i32", "stride_wt": "i32", "stride_wn": "i32", "stride_st": "i32", "stride_sn": "i32",
         "stride_om": "i32"},
        {"FMT": fmt, "BLOCK_M": cfg.block_m, "BLOCK_N": cfg.block_n, "BLOCK_K": cfg.block_k,
         "SWAP_AB": cfg.swap_ab, "DOT_FP32": False, "PTX": ptx, "K_CHUNKS": cfg.k_chunks, "SPLIT_MODE": split_mode,
         "SPLIT_POW2": split_pow2, "TILED": tiled, "PDL": pdl, "PREFETCH": PREFETCH_BYTES if pdl else 0,
         "FMA": cfg.fma},
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, targets=("cuda",) if (ptx or pdl) else (),
        name=f"mx_linear_{FORMAT_NAMES[fmt]}{'_ptx' if ptx else ''}{'_tiled' if tiled else ''}{'_pdl' if pdl else ''}"
             f"_m{cfg.block_m}_n{cfg.block_n}_k{cfg.block_k}x{cfg.k_chunks}_w{cfg.num_warps}s{cfg.num_stages}"
             f"_split{split_mode}x{split_pow2}")


def _linear_specs(ptx: bool, tiled: bool = False, pdl: bool = False) -> list[KernelSpec]:
    """Every (format, shape) the heuristic picks; split launches with the fused reduction (which
    stands for SPLIT_PARTIALS: its partials' stores, then the last split's sum). Tiled: the
    real-size shapes in the layouts weights.py produces (MXFP4 as words)."""
    specs, seen = [], set()
    formats = (FMT_MXFP4, FMT_MXFP4_WORDS) if ptx else (FMT_BF16, FMT_MXFP8, FMT_MXFP4, FMT_MXFP4_WORDS)
    if tiled:
        formats = tuple(f for f in formats if f != FMT_MXFP4)
    for m, n, k in (AOT_SHAPES[2:] if tiled else AOT_SHAPES):
        for fmt in formats:
            cfg = gemv_config(fmt, m, n, k)
            if ptx and cfg.fma:  # one-token launches decode portably (no PTX there)
                continue
            iters = k // (cfg.block_k * cfg.k_chunks)
            split = triton.cdiv(iters, triton.cdiv(iters, max(1, min(cfg.split_k, iters))))
            mode = SPLIT_NONE if split == 1 else SPLIT_FUSED
            key = (fmt, dataclasses.replace(cfg, split_k=1), mode, triton.next_power_of_2(split))
            if key not in seen:
                seen.add(key)
                specs.append(_linear_spec(fmt, cfg, mode, triton.next_power_of_2(split), ptx, tiled, pdl))
    return specs


def aot_specs() -> list[KernelSpec]:
    """Every specialisation, row and tiled layouts; the MXFP4 inline-PTX and PDL ones for CUDA only
    (their ``targets``). Where a variant only adds code to another, launches of both compile as
    the larger: PDL (the prefetch and the wait) stands for no PDL, so the PTX ones are PDL only
    (the fused layer's) and the tiled ones without PDL HIP only; the fused split-K reduction
    (SPLIT_FUSED: the partials' stores, then the last split's sum) stands for SPLIT_PARTIALS (the
    stores alone). None with PTX and tiled: tiled weights decode portably."""
    return (_linear_specs(ptx=False)
            + [dataclasses.replace(s, targets=("hip",)) for s in _linear_specs(ptx=False, tiled=True)]
            + _linear_specs(ptx=True, pdl=True) + _linear_specs(ptx=False, tiled=True, pdl=True))
