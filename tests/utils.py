"""Helpers shared by the test modules (imported as ``utils``: pytest puts tests/ on sys.path)."""

from __future__ import annotations

import os
from pathlib import Path

import torch


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    """Relative error ||got - want|| / ||want|| (Frobenius), computed in float64."""
    return ((got.double() - want.double()).norm() / want.double().norm()).item()


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
