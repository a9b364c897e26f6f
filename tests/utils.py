"""Helpers shared by the test modules (imported as ``utils``: pytest puts tests/ on sys.path)."""

from __future__ import annotations

import os
from pathlib import Path

import torch


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    """Relative error ||got - want|| / ||want|| (Frobenius), computed in float64."""
    return ((got.double() - want.double()).norm() / want.double().norm()).item()


FP8 = torch.float8_e4m3fn


def ulp(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Spacing of `dtype` numbers at magnitude |x| (subnormal spacing below the normal range)."""
    mantissa, min_exp = (3, -6) if dtype == FP8 else (7, -126)
    exp = torch.floor(torch.log2(x.abs().float().clamp_min(2.0**min_exp)))
    return torch.exp2(exp - mantissa)


def assert_within_ulp(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype, what: str) -> None:
    """|actual - expected| <= 1 ulp of `dtype` at the larger magnitude, plus fp32 noise."""
    a, e = actual.float().cpu(), expected.float().cpu()
    assert a.shape == e.shape, f"{what}: shape {tuple(a.shape)} != {tuple(e.shape)}"
    assert torch.isfinite(a).all(), f"{what}: non-finite values"
    tol = ulp(torch.maximum(a.abs(), e.abs()), dtype) + 1e-5 * e.abs() + 1e-6
    bad = (a - e).abs() > tol
    assert not bad.any(), (f"{what}: {int(bad.sum())} of {a.numel()} values off by more than one "
                           f"{dtype} ulp, worst {(a - e).abs().max().item():.3g}")


ROOT = Path(__file__).resolve().parents[1]  # the checkout


def aot_env() -> dict[str, str]:
    """The environment of the AOT compile check's subprocess: the real compiler (no interpreter),
    this checkout first on the path."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    return env


def mma_expert_tables(device, fmt: str, shared: str, experts: int, hidden: int, inter: int) -> tuple[list, list]:
    """(canonical, mma-layout) random MX expert tables as moe_experts takes them (w13, its scale, w2, its
    scale, then the shared expert's four, None where absent): ``experts`` routed experts, the shared one in
    the table (``shared`` "table") or as its own pair of matrices ("separate")."""
    from minimax_ops.formats import quantize, to_mma_layout
    mx = lambda *shape: quantize(torch.randn(*shape) * 0.5, fmt)  # noqa: E731
    pairs = [mx(experts + (shared == "table"), 2 * inter, hidden), mx(experts + (shared == "table"), hidden, inter)]
    if shared == "separate":
        pairs += [mx(2 * inter, hidden), mx(hidden, inter)]
    canonical = [t.to(device) for pair in pairs for t in pair]
    mma = [t.to(device) for pair in pairs for t in to_mma_layout(*pair)]
    pad = [None] * (8 - len(canonical))
    return canonical + pad, mma + pad
