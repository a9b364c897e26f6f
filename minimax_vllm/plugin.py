"""vLLM ``vllm.general_plugins`` entry point (pyproject.toml: ``minimax_vllm.plugin:register``).

vLLM calls ``register()`` in every process it starts (API server, engine core, each worker), so
the ``torch.ops.minimax`` ops exist wherever a compiled graph that names them is built or loaded,
the decode pass can read the deployment, and MiniMax-M3's architectures are served by this
project's model (announced on the ``minimax_ops`` logger; ``MINIMAX_OPS_VLLM_MODEL=0`` keeps vLLM's
own). It may be called several times per process: everything here is idempotent.
"""

from __future__ import annotations

import logging
import os

import torch

from minimax_ops.log import log_once

# The architecture names of MiniMax-M3 checkpoints (config.json "architectures") in vLLM 0.32 / 0.33.
ARCHITECTURES = ("MiniMaxM3SparseForCausalLM", "MiniMaxM3SparseForConditionalGeneration")
MODEL_ENV = "MINIMAX_OPS_VLLM_MODEL"  # "0": leave vLLM's own MiniMax-M3 classes in place
# vLLM turns on breakable CUDA graphs for MiniMax-M3's architecture names, which forces compilation
# mode NONE (no pass runs); it reads this variable only when it is unset.
BREAKABLE_ENV = "VLLM_USE_BREAKABLE_CUDAGRAPH"

# FixFunctionalizationPass, which vLLM's PostGradPassManager always runs last, looks these up as
# torch.ops._C.<name>.default for every auto_functionalized node it meets (ours included). vLLM's
# compiled extension defines them; a platform without it (a CPU-only install of the CUDA wheel)
# needs stand-ins, else the lookup raises AttributeError inside the compile.
C_OPS_LOOKED_UP = ("rotary_embedding", "fused_add_rms_norm", "fused_add_rms_norm_static_fp8_quant",
                   "rms_norm_dynamic_per_token_quant", "rms_norm", "rms_norm_static_fp8_quant", "silu_and_mul",
                   "silu_and_mul_quant", "fused_qk_norm_rope")

_c_library: torch.library.Library | None = None  # kept alive: dropping it would unregister the stand-ins


def register() -> None:
    """Register the minimax ops, the pass's deployment reader, the model for MiniMax-M3's
    architectures and, off CUDA/ROCm, the inert torch.ops._C stand-ins."""
    import minimax_ops  # noqa: F401  (registers torch.ops.minimax.*)
    import minimax_vllm  # noqa: F401  (registers the decode pass's deployment reader)

    register_c_stand_ins()
    register_model()


def register_model() -> bool:
    """Serve MiniMax-M3's architectures with minimax_vllm.model.MiniMaxM3ForVllm unless
    MINIMAX_OPS_VLLM_MODEL=0. Returns whether it did."""
    from vllm import ModelRegistry

    if os.environ.get(MODEL_ENV, "1") == "0":
        log_once(f"{MODEL_ENV}=0: MiniMax-M3 is served by vLLM's own model classes (no fused decode)")
        return False
    from .model import MiniMaxM3ForVllm

    for arch in ARCHITECTURES:
        ModelRegistry.register_model(arch, MiniMaxM3ForVllm)
    if os.environ.get(BREAKABLE_ENV) == "1":
        log_once(f"{BREAKABLE_ENV}=1 forces vLLM's compilation mode NONE: the fused decode pass will not run; "
                 f"unset it or set {BREAKABLE_ENV}=0", logging.WARNING)
    os.environ.setdefault(BREAKABLE_ENV, "0")
    log_once(f"minimax_ops serves {', '.join(ARCHITECTURES)} in vLLM (compile-ready model, fused decode pass); "
             f"{MODEL_ENV}=0 restores vLLM's own classes", logging.WARNING)
    return True


def register_c_stand_ins() -> list[str]:
    """Define the torch.ops._C names FixFunctionalizationPass reads that are missing here; returns
    the names added. Never on CUDA/ROCm (vLLM's extension defines the real ops there and a
    stand-in registered first would collide with them). The stand-ins are only looked up and
    compared by identity, never called."""
    global _c_library
    from vllm.platforms import current_platform

    if current_platform.is_cuda_alike():
        return []
    # A platform build that ships vllm._C (e.g. vLLM's CPU build) defines the real ops: load them first, the
    # platform's way (the CPU build picks its AVX2 or AVX-512 library; importing vllm._C itself runs AVX-512
    # code, which kills the process on a CPU without it).
    try:
        current_platform.import_kernels()
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
