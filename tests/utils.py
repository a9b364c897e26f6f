"""Helpers shared by the test modules (imported as ``utils``: pytest puts tests/ on sys.path)."""

from __future__ import annotations

import torch


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    """Relative error ||got - want|| / ||want|| (Frobenius), computed in float64."""
    return ((got.double() - want.double()).norm() / want.double().norm()).item()
