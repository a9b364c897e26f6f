"""The driver's view of the package's compiled Triton kernels on this GPU (ab_fused imports it): what one
program holds and how many an SM keeps resident (``cuOccupancyMaxActiveBlocksPerMultiprocessor``), and
their shared-memory carveout preference (``cuFuncSetAttribute``), which an A/B run may set for every kernel.

Why the carveout: an SM splits one on-chip array between L1 and shared memory, and changes the split only
when no program runs on it. A programmatic dependent whose programs need more shared memory than the split
its predecessor's programs run under cannot start beside them, whatever its registers allow.
"""

from __future__ import annotations

import ctypes
import importlib

from minimax_ops.kernels import aot_check

_SHARED_SIZE_BYTES = 1  # CU_FUNC_ATTRIBUTE_SHARED_SIZE_BYTES (static shared memory)
_NUM_REGS = 4  # CU_FUNC_ATTRIBUTE_NUM_REGS
_CARVEOUT = 9  # CU_FUNC_ATTRIBUTE_PREFERRED_SHARED_MEMORY_CARVEOUT: percent of the largest share, -1 none
_lib: list = []


def _cuda():
    if not _lib:
        _lib.append(ctypes.CDLL("libcuda.so.1"))
    return _lib[0]


def _check(err: int, what: str) -> None:
    if err:
        raise RuntimeError(f"{what} failed with CUresult {err}")


def specialisations(kernels) -> list[tuple[str, object]]:
    """(kernel name, compiled specialisation) for every specialisation of the given (name, @triton.jit kernel)
    pairs compiled in this process so far, its handles loaded."""
    out = []
    for name, fn in kernels:
        for cache in getattr(fn, "device_caches", {}).values():
            for compiled in cache[0].values():
                if getattr(compiled, "function", None) is None:
                    compiled._init_handles()
                out.append((name, compiled))
    return out


def package_kernels() -> list[tuple[str, object]]:
    """specialisations() of every kernel of minimax_ops.kernels."""
    modules = (importlib.import_module(f"{aot_check.PACKAGE}.{m}") for m in aot_check.module_names())
    return specialisations(pair for mod in modules for pair in aot_check.jit_functions(mod).items())


def _attribute(function: int, attribute: int) -> int:
    value = ctypes.c_int()
    _check(_cuda().cuFuncGetAttribute(ctypes.byref(value), attribute, ctypes.c_void_p(function)),
           f"cuFuncGetAttribute({attribute})")
    return value.value


def programs_per_sm(compiled) -> int:
    """Programs of a compiled kernel an SM holds at once, by the driver (its launch's dynamic shared memory)."""
    n = ctypes.c_int()
    threads = 32 * compiled.metadata.num_warps
    _check(_cuda().cuOccupancyMaxActiveBlocksPerMultiprocessor(
        ctypes.byref(n), ctypes.c_void_p(compiled.function), threads, ctypes.c_size_t(compiled.metadata.shared)),
        "cuOccupancyMaxActiveBlocksPerMultiprocessor")
    return n.value


def set_carveout(percent: int) -> int:
    """Every compiled package kernel prefers this shared-memory carveout (percent of the largest; -1: the
    driver's choice). Returns how many kernels were set."""
    kernels = package_kernels()
    for _, compiled in kernels:
        _check(_cuda().cuFuncSetAttribute(ctypes.c_void_p(compiled.function), _CARVEOUT, ctypes.c_int(percent)),
               f"cuFuncSetAttribute(carveout {percent})")
    return len(kernels)


def report() -> list[str]:
    """One line per compiled package kernel: registers and spills, shared memory (static + Triton's dynamic),
    warps, and programs an SM holds."""
    lines = []
    for name, compiled in sorted(package_kernels(), key=lambda item: item[0]):
        static = _attribute(compiled.function, _SHARED_SIZE_BYTES)
        lines.append(f"{name[:40]:40s} regs {_attribute(compiled.function, _NUM_REGS):3d} "
                     f"spills {getattr(compiled, 'n_spills', 0):3d} smem {static + compiled.metadata.shared:6d} "
                     f"warps {compiled.metadata.num_warps:2d} -> {programs_per_sm(compiled):2d} a SM")
    return lines
