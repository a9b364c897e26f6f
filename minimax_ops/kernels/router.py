"""Sigmoid top-k router of a MoE decode step.

``_router_logits_kernel`` splits the fp32 gate GEMV [n, H] x [E, H]^T over (expert tile, H split) so
the 3 MB gate streams on many SMs, writing fp32 partial logits; the top-k (sum of the partials in a
fixed order, sigmoid, top-k of score + bias) runs in the last of those programs to finish
(``splitk.last_arrival``: one launch), or in ``_router_topk_kernel`` (one program per token).

``router_logits`` is the fused layer's one-token form: ``_router_rows_kernel`` gives each program whole
gate rows (read before its PDL wait) and writes the complete fp32 logits, no partials and no
arrival counter; the expert kernels then make the top-k themselves from them (``topk_rows``, the
one top-k arithmetic; moe.routed_moe_experts).
"""

from __future__ import annotations

import dataclasses

import torch
import triton
import triton.language as tl

from .aot import KernelSpec, with_pdl_variants
from .norm import check_deferred_norm, check_rows, deferred_norm_args, rstd_of_parts, sumsq_parts
from .mx_decode import gdc_launch_dependents, gdc_wait, pdl_supported
from .splitk import last_arrival, split_counters, sum_splits
from .linear_mma import aot_norm_parts
from .tiles import TOKEN_BLOCK, RouterConfig, block_k_for, num_sms, router_config


@triton.jit
def topk_rows(logits, bias, e_mask, TOPK: tl.constexpr, K_POW2: tl.constexpr):
    """The router's choice from fp32 logits [R, E_POW2], one token's a row (``bias``: the choosing bias
    there, or None; ``e_mask``: the real experts): (ids int32 [R, K_POW2], scores fp32 [R, E_POW2]),
    ids = top-k of sigmoid(logit) + bias (descending; ties to the lower id; 0 past TOPK), scores =
    sigmoid(logit). Every reduction is along a row: rows laid one a warp (expert_slots.routed_ids)
    reduce without block barriers."""
    offs_e = tl.arange(0, logits.shape[1])[None, :]
    score = tl.sigmoid(logits)
    choice = score
    if bias is not None:
        choice = score + bias
    choice = tl.where(e_mask, choice, float("-inf"))
    cols = tl.arange(0, K_POW2)[None, :]
    ids = tl.zeros([logits.shape[0], K_POW2], dtype=tl.int32)
    for j in tl.static_range(TOPK):
        best = tl.argmax(choice, axis=1)[:, None]
        ids = tl.where(cols == j, best, ids)
        choice = tl.where(offs_e == best, float("-inf"), choice)
    return ids, score


@triton.jit
def topk_weights(ids, score, scaling, TOPK: tl.constexpr):
    """The weights of topk_rows' choice: the chosen scores renormalised to sum to ``scaling``
    (fp32 [R, K_POW2], 0 past TOPK)."""
    offs_e = tl.arange(0, score.shape[1])[None, :]
    cols = tl.arange(0, ids.shape[1])[None, :]
    weights = tl.zeros(ids.shape, dtype=tl.float32)
    for j in tl.static_range(TOPK):
        chosen = tl.max(tl.where(cols == j, ids, -1), axis=1)[:, None]
        weights = tl.where(cols == j, tl.sum(tl.where(offs_e == chosen, score, 0.0), axis=1)[:, None], weights)
    return weights / tl.sum(weights, axis=1)[:, None] * scaling


@triton.jit
def select_topk(logits, bias, e_mask, scaling, TOPK: tl.constexpr, K_POW2: tl.constexpr):
    """topk_rows then topk_weights: (ids int32 [R, K_POW2], weights fp32 [R, K_POW2])."""
    ids, score = topk_rows(logits, bias, e_mask, TOPK, K_POW2)
    return ids, topk_weights(ids, score, scaling, TOPK)


@triton.jit
def _topk_row(part_ptr, bias_ptr, weights_ptr, ids_ptr, t, n_tokens, n_experts, n_split, scaling,
              HAS_BIAS: tl.constexpr, E_POW2: tl.constexpr, TOPK: tl.constexpr, K_POW2: tl.constexpr,
              SPLIT_POW2: tl.constexpr, NW: tl.constexpr):
    """Token t: logits = sum of the split partials part[s, t, :] (all loaded at once, fixed tree
    order), then select_topk on NW equal rows of them (NW: the program's warps, a row each, so the
    arg-max rounds reduce inside warps; the partials are read once, then spread)."""
    offs_e = tl.arange(0, E_POW2)
    e_mask = offs_e < n_experts
    logits = sum_splits(part_ptr + t * n_experts + offs_e, e_mask, n_tokens * n_experts, n_split, SPLIT_POW2)
    rows = tl.zeros([NW, 1], dtype=tl.int32)
    offs_r = offs_e[None, :] + rows
    mask_r = offs_r < n_experts
    bias = None
    if HAS_BIAS:
        bias = tl.load(bias_ptr + offs_r, mask=mask_r, other=0.0)
    ids, weights = select_topk(tl.broadcast_to(logits[None, :], (NW, E_POW2)), bias, mask_r, scaling, TOPK, K_POW2)
    cols = tl.arange(0, K_POW2)[None, :]
    first = (tl.arange(0, NW)[:, None] == 0) & (cols < TOPK)
    tl.store(ids_ptr + t * TOPK + cols + rows, ids, mask=first)
    tl.store(weights_ptr + t * TOPK + cols + rows, weights, mask=first)


@triton.jit
def _router_logits_kernel(h_ptr, g_ptr, part_ptr, cnt_ptr, bias_ptr, weights_ptr, ids_ptr,
                          n_tokens, n_experts, iters_per_split, n_split, stride_hm, stride_ge, scaling,
                          BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_H: tl.constexpr,
                          LOGITS: tl.constexpr, FUSED_TOPK: tl.constexpr, HAS_BIAS: tl.constexpr,
                          E_POW2: tl.constexpr, TOPK: tl.constexpr, K_POW2: tl.constexpr, SPLIT_POW2: tl.constexpr,
                          PDL: tl.constexpr, NW: tl.constexpr):
    """Grid (expert tiles, H splits): part[split, t, e] = sum over the split's H of h[t] * gate[e] in
    fp32 (LOGITS 0: tl.dot, ieee fp32 FMAs; 1: tl.dot in 3xTF32 on tensor cores, fp32-accurate;
    2: one token at a time, multiply and row sums, gate tile loaded once); with FUSED_TOPK the last
    program to finish runs the top-k of every token. The gate does not depend on the previous
    kernel: as a programmatic dependent, a program loads its first gate tile before it waits."""
    pid_e = tl.program_id(0)
    pid_s = tl.program_id(1)
    offs_e = pid_e * BLOCK_E + tl.arange(0, BLOCK_E)
    rows = tl.minimum(offs_e, n_experts - 1).to(tl.int64)
    k0 = pid_s * iters_per_split * BLOCK_H
    offs_k = k0 + tl.arange(0, BLOCK_H)
    g_ptrs = g_ptr + rows[:, None] * stride_ge + offs_k[None, :]
    g_first = tl.load(g_ptrs)
    if PDL:
        gdc_wait()
        gdc_launch_dependents()
    if LOGITS == 2:
        t_rows = tl.arange(0, BLOCK_T)
        for t0 in range(0, n_tokens, BLOCK_T):
            acc = tl.zeros([BLOCK_T, BLOCK_E], dtype=tl.float32)
            for i in range(iters_per_split):
                g = tl.where(i == 0, g_first, tl.load(g_ptrs + i * BLOCK_H, mask=i > 0, other=0.0))
                for tt in range(0, tl.minimum(BLOCK_T, n_tokens - t0)):
                    x = tl.load(h_ptr + (t0 + tt) * stride_hm + offs_k + i * BLOCK_H).to(tl.float32)
                    row = tl.sum(g * x[None, :], axis=1)
                    acc = tl.where(t_rows[:, None] == tt, acc + row[None, :], acc)
            offs_t = t0 + t_rows
            out = part_ptr + pid_s * n_tokens * n_experts + offs_t[:, None] * n_experts + offs_e[None, :]
            tl.store(out, acc, mask=(offs_t[:, None] < n_tokens) & (offs_e[None, :] < n_experts))
    else:
        for t0 in range(0, n_tokens, BLOCK_T):
            offs_t = t0 + tl.arange(0, BLOCK_T)
            t_mask = offs_t < n_tokens
            x_ptrs = h_ptr + offs_t.to(tl.int64)[:, None] * stride_hm + offs_k[None, :]
            acc = tl.zeros([BLOCK_T, BLOCK_E], dtype=tl.float32)
            for i in range(iters_per_split):
                x = tl.load(x_ptrs + i * BLOCK_H, mask=t_mask[:, None], other=0.0).to(tl.float32)
                g = tl.trans(tl.where(i == 0, g_first, tl.load(g_ptrs + i * BLOCK_H, mask=i > 0, other=0.0)))
                if LOGITS == 1:
                    acc = tl.dot(x, g, acc, input_precision="tf32x3")
                else:
                    acc = tl.dot(x, g, acc, input_precision="ieee")
            out = part_ptr + pid_s * n_tokens * n_experts + offs_t[:, None] * n_experts + offs_e[None, :]
            tl.store(out, acc, mask=t_mask[:, None] & (offs_e[None, :] < n_experts))
    if FUSED_TOPK:
        if last_arrival(cnt_ptr, tl.num_programs(0) * tl.num_programs(1)):
            for t in range(0, n_tokens):
                _topk_row(part_ptr, bias_ptr, weights_ptr, ids_ptr, t, n_tokens, n_experts, n_split, scaling,
                          HAS_BIAS, E_POW2, TOPK, K_POW2, SPLIT_POW2, NW)


@triton.jit
def _router_topk_kernel(part_ptr, bias_ptr, weights_ptr, ids_ptr, n_tokens, n_experts, n_split, scaling,
                        HAS_BIAS: tl.constexpr, E_POW2: tl.constexpr, TOPK: tl.constexpr, K_POW2: tl.constexpr,
                        SPLIT_POW2: tl.constexpr, NW: tl.constexpr, PDL: tl.constexpr = False):
    """One program per token: the top-k of _router_logits_kernel's partials (its launches without FUSED_TOPK)."""
    if PDL:  # a programmatic dependent of the logits kernel, as that one is of its predecessor
        gdc_wait()
        gdc_launch_dependents()
    _topk_row(part_ptr, bias_ptr, weights_ptr, ids_ptr, tl.program_id(0), n_tokens, n_experts, n_split, scaling,
              HAS_BIAS, E_POW2, TOPK, K_POW2, SPLIT_POW2, NW)


@triton.jit
def _router_rows_kernel(h_ptr, g_ptr, logits_ptr, n_tokens, n_experts, hidden, stride_hm, stride_ge,
                        BLOCK_E: tl.constexpr, BLOCK_H: tl.constexpr, PDL: tl.constexpr, NORM: tl.constexpr = False,
                        nw_ptr=None, sumsq_ptr=None, n_parts=1, eps=0.0, BLOCK_P: tl.constexpr = 1):
    """Grid (expert tiles): logits[t, e] = sum over H of h[t] * gate[e] in fp32 for BLOCK_E whole gate
    rows (BLOCK_H >= H), read before the PDL wait: the gate does not depend on the previous kernel.
    NORM: h_ptr holds the residual sums of linear_mma.mma_linear_add_norm and h is made here as
    norm.add_rmsnorm makes it, from them, the norm weight (nw_ptr) and the row's rstd from the
    n_parts sums of squares at sumsq_ptr[t]."""
    offs_e = tl.program_id(0) * BLOCK_E + tl.arange(0, BLOCK_E)
    offs_k = tl.arange(0, BLOCK_H)
    k_mask = offs_k < hidden
    rows = tl.minimum(offs_e, n_experts - 1).to(tl.int64)
    g = tl.load(g_ptr + rows[:, None] * stride_ge + offs_k[None, :], mask=k_mask[None, :], other=0.0)
    if NORM:  # (a weight: before the wait)
        w1 = 1.0 + tl.load(nw_ptr + offs_k[None, :], mask=k_mask[None, :], other=0.0).to(tl.float32)
    if PDL:
        gdc_wait()
        gdc_launch_dependents()
    for t in range(0, n_tokens):
        # Rows [1, BLOCK_H], as the gate's are laid out: the product needs no layout change.
        x = tl.load(h_ptr + t * stride_hm + offs_k[None, :], mask=k_mask[None, :], other=0.0).to(tl.float32)
        if NORM:
            rstd = rstd_of_parts(sumsq_parts(sumsq_ptr + t * n_parts, n_parts, BLOCK_P), hidden, eps)
            x = (x * rstd * w1).to(h_ptr.dtype.element_ty).to(tl.float32)
        tl.store(logits_ptr + t * n_experts + offs_e, tl.sum(g * x, axis=1), mask=offs_e < n_experts)


ROWS_BLOCK_E = 1  # gate rows a program of _router_rows_kernel holds (one: 128 programs for the model's experts)
TOPK_WARPS = 4  # warps of _router_topk_kernel (its NW: a row of the token's logits each)


def check_gate(h: torch.Tensor, gate_weight: torch.Tensor, bias: torch.Tensor | None = None,
               top_k: int | None = None) -> None:
    """h bf16 [n, H], gate fp32 [E, H]; with them, bias fp32 [E] or None and 1 <= top_k <= E."""
    check_rows("h", h, shape="[n, H]", dim="H")
    hidden = h.shape[1]
    if gate_weight.dim() != 2 or gate_weight.dtype != torch.float32 or gate_weight.shape[1] != hidden:
        raise ValueError(f"gate_weight: expected fp32 [E, {hidden}], got {gate_weight.dtype} "
                         f"{tuple(gate_weight.shape)}")
    n_experts = gate_weight.shape[0]
    if bias is not None and (bias.dtype != torch.float32 or tuple(bias.shape) != (n_experts,)):
        raise ValueError(f"bias: expected fp32 [{n_experts}] or None, got {bias.dtype} {tuple(bias.shape)}")
    if top_k is not None and not 1 <= top_k <= n_experts:
        raise ValueError(f"top_k: expected 1..{n_experts}, got {top_k}")


def router_logits(h: torch.Tensor, gate_weight: torch.Tensor, *, pdl: bool = False,
                  deferred_norm: tuple | None = None) -> torch.Tensor:
    """fp32 logits [n, E] = fp32(h) @ gate^T, each from whole gate rows a program holds (the top-k is the
    caller's: moe.routed_moe_experts' expert kernels make it, topk_rows). ``deferred_norm`` (weight [H],
    sumsq [n, G] fp32, eps): h is the residual sum of linear_mma.mma_linear_add_norm and the product is
    that of the norm's h, made from them in the kernel (``_router_rows_kernel``'s NORM)."""
    check_gate(h, gate_weight)
    n, hidden = h.shape
    gate_weight = gate_weight.contiguous()
    n_experts = gate_weight.shape[0]
    logits = torch.empty(n, n_experts, dtype=torch.float32, device=h.device)
    if n == 0:
        return logits
    norm = {}
    if deferred_norm is not None:
        weight, sumsq, eps = deferred_norm
        check_deferred_norm(weight, sumsq, n, hidden)
        norm = dict(deferred_norm_args(sumsq, eps), nw_ptr=weight)
    pdl = pdl and pdl_supported(h.device)
    _router_rows_kernel[(triton.cdiv(n_experts, ROWS_BLOCK_E),)](
        h, gate_weight, logits, n, n_experts, hidden, h.stride(0), gate_weight.stride(0), BLOCK_E=ROWS_BLOCK_E,
        BLOCK_H=triton.next_power_of_2(hidden), PDL=pdl, num_warps=4, launch_pdl=pdl, **norm)
    return logits


def route(h: torch.Tensor, gate_weight: torch.Tensor, bias: torch.Tensor | None, top_k: int,
          scaling: float, *, config: RouterConfig | None = None, pdl: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """logits = fp32(h) @ gate^T; s = sigmoid; ids = top-k of s + bias (descending); weights =
    s[ids] / sum(s[ids]) * scaling. Returns (weights fp32 [n, k], ids int32 [n, k]).
    ``config`` overrides ``router_config`` (tuning, tests); ``pdl``: each kernel launched as a
    programmatic dependent of the one before it (the fused layer's; the vocabulary op launches plainly)."""
    check_gate(h, gate_weight, bias, top_k)
    n, hidden = h.shape
    gate_weight = gate_weight.contiguous()
    n_experts = gate_weight.shape[0]
    if hidden % 32:
        raise ValueError(f"h: hidden size must be a multiple of 32, got {hidden}")
    pdl = pdl and pdl_supported(h.device)
    weights = torch.empty(n, top_k, dtype=torch.float32, device=h.device)
    ids = torch.empty(n, top_k, dtype=torch.int32, device=h.device)
    if n == 0:
        return weights, ids
    cfg = config or router_config(n, n_experts, hidden, num_sms(h.device))
    block_h = block_k_for(hidden, cfg.block_h)
    iters = hidden // block_h
    split = max(1, min(cfg.split, iters))
    while iters % split:
        split -= 1
    tf32x3 = h.device.type == "cuda" and torch.version.hip is None
    logits = 2 if cfg.logits == 1 and not tf32x3 else cfg.logits  # 3xTF32: NVIDIA only
    counters = split_counters(h.device, 1) if cfg.fused_topk else None
    part = torch.empty(split, n, n_experts, dtype=torch.float32, device=h.device)
    bias_arg = bias.contiguous() if bias is not None else part
    meta = dict(HAS_BIAS=bias is not None, E_POW2=triton.next_power_of_2(n_experts), TOPK=top_k,
                K_POW2=triton.next_power_of_2(top_k), SPLIT_POW2=triton.next_power_of_2(split))
    _router_logits_kernel[(triton.cdiv(n_experts, cfg.block_e), split)](
        h, gate_weight, part, counters if counters is not None else part, bias_arg, weights, ids,
        n, n_experts, iters // split, split, h.stride(0), gate_weight.stride(0), float(scaling),
        BLOCK_T=TOKEN_BLOCK, BLOCK_E=cfg.block_e, BLOCK_H=block_h, LOGITS=logits, FUSED_TOPK=counters is not None,
        PDL=pdl, NW=cfg.num_warps, num_warps=cfg.num_warps, launch_pdl=pdl, **meta)
    if counters is None:
        _router_topk_kernel[(n,)](part, bias_arg, weights, ids, n, n_experts, split, float(scaling),
                                  NW=TOPK_WARPS, PDL=pdl, num_warps=TOPK_WARPS, launch_pdl=pdl, **meta)
    return weights, ids


# ---- ahead-of-time specs ---------------------------------------------------------------------------------

# (H, I, routed experts, top-k): the tiny preset and the real model.
AOT_SIZE = (6144, 3072, 128, 4)  # (hidden, inter, routed experts, top-k): the real model's
AOT_TOKENS = (1, 16)


def aot_specs() -> list[KernelSpec]:
    """Fused and two-kernel router at the real size; for CUDA only (``targets``) the 3xTF32 logits
    of many-token steps and the PDL launch of the fused router. Left out, compiling no line the kept
    ones do not: the tiny size (the same flags, narrower tiles and one split), routers without a
    bias (HAS_BIAS only adds its load) and the fused router without PDL on CUDA (PDL only adds the
    wait: its PDL launch stands for it there). The two-kernel router's top-k with PDL: CUDA only."""
    specs = []
    hidden, inter, n_routed, top_k = AOT_SIZE
    logits_sig = {"h_ptr": "*bf16", "g_ptr": "*fp32", "part_ptr": "*fp32", "cnt_ptr": "*i32", "bias_ptr": "*fp32",
                  "weights_ptr": "*fp32", "ids_ptr": "*i32", "n_tokens": "i32", "n_experts": "i32",
                  "iters_per_split": "i32", "n_split": "i32", "stride_hm": "i32", "stride_ge": "i32",
                  "scaling": "fp32"}
    for n in AOT_TOKENS:
        cfg = router_config(n, n_routed, hidden, 132)
        if cfg.logits == 1:  # 3xTF32 is CUDA-only (below); HIP runs LOGITS 2
            cfg = dataclasses.replace(cfg, logits=2)
        block_e, block_h, split = cfg.block_e, block_k_for(hidden, cfg.block_h), cfg.split
        meta = {"HAS_BIAS": True, "E_POW2": triton.next_power_of_2(n_routed), "TOPK": top_k,
                "K_POW2": triton.next_power_of_2(top_k), "SPLIT_POW2": triton.next_power_of_2(split)}
        tag = f"h{hidden}_e{block_e}h{block_h}x{meta['SPLIT_POW2']}_l{cfg.logits}_bias1"
        for fuse, pdl, targets in ((True, False, ("hip",)), (False, False, ()), (True, True, ("cuda",))):
            specs.append(KernelSpec(
                _router_logits_kernel, logits_sig,
                dict(meta, BLOCK_T=TOKEN_BLOCK, BLOCK_E=block_e, BLOCK_H=block_h, LOGITS=cfg.logits,
                     FUSED_TOPK=fuse, PDL=pdl, NW=cfg.num_warps), num_warps=cfg.num_warps, targets=targets,
                name=f"router_logits_{tag}_fused{int(fuse)}{'_pdl' if pdl else ''}"))
        specs += with_pdl_variants([KernelSpec(
            _router_topk_kernel,
            {"part_ptr": "*fp32", "bias_ptr": "*fp32", "weights_ptr": "*fp32", "ids_ptr": "*i32",
             "n_tokens": "i32", "n_experts": "i32", "n_split": "i32", "scaling": "fp32"},
            dict(meta, NW=TOPK_WARPS), num_warps=TOPK_WARPS, name=f"router_topk_{tag}")])
    cfg = router_config(max(AOT_TOKENS), n_routed, hidden, 132)
    block_h = block_k_for(hidden, cfg.block_h)
    specs.append(KernelSpec(
        _router_logits_kernel, logits_sig,
        {"HAS_BIAS": True, "E_POW2": triton.next_power_of_2(n_routed), "TOPK": top_k,
         "K_POW2": triton.next_power_of_2(top_k), "SPLIT_POW2": triton.next_power_of_2(cfg.split),
         "BLOCK_T": TOKEN_BLOCK, "BLOCK_E": cfg.block_e, "BLOCK_H": block_h, "LOGITS": 1, "FUSED_TOPK": False,
         "PDL": False, "NW": cfg.num_warps}, num_warps=cfg.num_warps, targets=("cuda",),
        name=f"router_logits_h{hidden}_e{cfg.block_e}h{block_h}_tf32x3"))
    rows_sig = {"h_ptr": "*bf16", "g_ptr": "*fp32", "logits_ptr": "*fp32", "n_tokens": "i32", "n_experts": "i32",
                "hidden": "i32", "stride_hm": "i32", "stride_ge": "i32"}
    rows = {"BLOCK_E": ROWS_BLOCK_E, "BLOCK_H": triton.next_power_of_2(hidden)}
    specs += with_pdl_variants([  # the fused layer's one-token logits, and with the post norm deferred into them
        KernelSpec(_router_rows_kernel, rows_sig, rows, name=f"router_rows_h{hidden}_e{ROWS_BLOCK_E}"),
        KernelSpec(_router_rows_kernel, {**rows_sig, "nw_ptr": "*bf16", "sumsq_ptr": "*fp32", "n_parts": "i32",
                                         "eps": "fp32"},
                   {**rows, "NORM": True, "BLOCK_P": triton.next_power_of_2(aot_norm_parts())},
                   name=f"router_rows_h{hidden}_e{ROWS_BLOCK_E}_norm")])
    # De-duplicate router specs that two token counts share.
    unique = {spec.label(): spec for spec in specs}
    return list(unique.values())
