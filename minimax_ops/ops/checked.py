"""Checked mode: every fused layer step also runs the unfused chain on the same inputs.

Turn it on with MINIMAX_OPS_CHECK=1 (or the pass option ``checked=True``, which sets the fused
op's ``checked`` argument). The fused computation writes the real caches; the unfused one writes
clones, which must end byte-identical, so caches are written once. Per layer and token the max
absolute and relative differences of output and residual go to the ``minimax_ops`` logger, and a
relative difference past MINIMAX_OPS_CHECK_TOL (default 2e-2) raises CheckedModeError.
It is a debugging mode: each checked step clones the layer's caches and syncs with the host, so it
cannot run under CUDA-graph capture (the op says so) and costs a cache copy per layer and step.
"""

from __future__ import annotations

import os
from collections.abc import Callable

import torch

from ..log import logger
from .collectives import any_rank


class CheckedModeError(AssertionError):
    """The fused path disagreed with the unfused path past the tolerance."""


def enabled() -> bool:
    return os.environ.get("MINIMAX_OPS_CHECK", "0").strip().lower() not in ("", "0", "false", "no", "off")


def tolerance() -> float:
    return float(os.environ.get("MINIMAX_OPS_CHECK_TOL", "2e-2"))


def _diffs(got: torch.Tensor, want: torch.Tensor) -> tuple[list[float], list[float]]:
    """Per token row: max |got - want| and that over max |want|."""
    d = (got.float() - want.float()).abs().amax(dim=1)
    scale = want.float().abs().amax(dim=1).clamp_min(1e-6)
    return d.tolist(), (d / scale).tolist()


def run_checked(layer: int, kind: str, caches: list[torch.Tensor | None],
                fused: Callable[[list], tuple[torch.Tensor, torch.Tensor]],
                unfused: Callable[[list], tuple[torch.Tensor, torch.Tensor]], group_name: str = ""):
    """fused(caches) and unfused(cache clones); compare, log, raise past the tolerance. Under tensor
    parallelism the verdict is agreed across the group first, so that every rank raises or none."""
    shadows = [None if c is None else c.clone() for c in caches]
    out, residual = fused(caches)
    want_out, want_residual = unfused(shadows)
    failure = None
    for name, real, shadow in zip(("kv_cache", "index_cache"), caches, shadows):
        if real is not None and not torch.equal(real.view(torch.uint8), shadow.view(torch.uint8)):
            failure = failure or f"layer {layer} ({kind}): fused and unfused paths wrote different {name} bytes"
    tol = tolerance()
    for what, got, want in (("out", out, want_out), ("residual", residual, want_residual)):
        absd, reld = _diffs(got, want)
        for token, (a, r) in enumerate(zip(absd, reld)):
            logger.info("checked layer %d (%s) token %d %s: max abs diff %.3g, max rel diff %.3g",
                        layer, kind, token, what, a, r)
            if not r <= tol and failure is None:  # NaN fails too
                failure = (f"layer {layer} ({kind}) token {token} {what}: relative difference {r:.3g} "
                           f"exceeds MINIMAX_OPS_CHECK_TOL={tol:g}")
    if any_rank(failure is not None, group_name, out.device):
        raise CheckedModeError(failure or f"layer {layer} ({kind}): another rank of tensor-parallel group "
                                          f"{group_name!r} failed the check (see its error)")
    return out, residual
