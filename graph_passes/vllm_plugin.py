"""vLLM ``vllm.general_plugins`` entry point (pyproject.toml: ``graph_passes.vllm_plugin:register``).

vLLM calls ``register()`` in every process it starts (API server, engine core, each worker), so
the ``torch.ops.minimax`` ops exist wherever a compiled graph that names them is built or loaded.
It may be called several times per process: everything here is idempotent.
"""

from __future__ import annotations

import importlib

import torch

# FixFunctionalizationPass, which vLLM's PostGradPassManager always runs last, looks these up as
# torch.ops._C.<name>.default for every auto_functionalized node it meets (ours included). vLLM's
# compiled extension defines them; a platform without it (a CPU-only install of the CUDA wheel)
# needs stand-ins, else the lookup raises AttributeError inside the compile.
C_OPS_LOOKED_UP = ("rotary_embedding", "fused_add_rms_norm", "fused_add_rms_norm_static_fp8_quant",
                   "rms_norm_dynamic_per_token_quant", "rms_norm", "rms_norm_static_fp8_quant", "silu_and_mul",
                   "silu_and_mul_quant", "fused_qk_norm_rope")

_c_library: torch.library.Library | None = None  # kept alive: dropping it would unregister the stand-ins


def register() -> None:
    """Register the minimax ops and, off CUDA/ROCm, the inert torch.ops._C stand-ins."""
    import minimax_ops  # noqa: F401  (registers torch.ops.minimax.*)

    register_c_stand_ins()


def register_c_stand_ins() -> list[str]:
    """Define the torch.ops._C names FixFunctionalizationPass reads that are missing here; returns
    the names added. Never on CUDA/ROCm (vLLM's extension defines the real ops there and a
    stand-in registered first would collide with them). The stand-ins are only looked up and
    compared by identity, never called."""
    global _c_library
    from vllm.platforms import current_platform

    if current_platform.is_cuda_alike():
        return []
    try:  # a platform build that ships vllm._C (e.g. vLLM's CPU build) defines the real ops: load them first
        importlib.import_module("vllm._C")
    except (ImportError, OSError):  # not built for this platform, or its shared libraries are missing
        pass
    added = []
    for name in C_OPS_LOOKED_UP:
        if hasattr(torch.ops._C, name):
            continue
        if _c_library is None:
            _c_library = torch.library.Library("_C", "FRAGMENT")
        _c_library.define(f"{name}(Tensor x) -> ()")
        added.append(name)
    return added
