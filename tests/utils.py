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
