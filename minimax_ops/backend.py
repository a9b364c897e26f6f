"""Which implementation an op runs: Triton kernels on CUDA; on CPU the reference, or the same
Triton kernels under the interpreter when MINIMAX_OPS_CPU_KERNELS=1 and TRITON_INTERPRET=1
(how CI exercises the kernels without a GPU)."""

from __future__ import annotations

import os

import torch


def cpu_kernels_enabled() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1" and os.environ.get("MINIMAX_OPS_CPU_KERNELS") == "1"


def use_kernels(t: torch.Tensor) -> bool:
    if t.device.type == "cuda":
        return True
    return t.device.type == "cpu" and cpu_kernels_enabled()
