"""Ahead-of-time compile specs: how CI proves every kernel compiles for CUDA sm_90 and AMD
gfx942 / gfx950 without a GPU (the interpreter never runs the real compiler).

Each kernel module defines ``aot_specs() -> list[KernelSpec]`` listing representative
specialisations (the constexpr values the wrappers really launch with).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

TARGETS = (("cuda", 90, 32), ("hip", "gfx942", 64), ("hip", "gfx950", 64))
# Each target compiles a cover of each kernel's specs (``cover``): every kernel meets each compiler with every
# value each of its constexprs and num_warps takes in some spec. The AMD chips take different covers where ties
# allow (``COVER_FROM_END``), so more combinations meet an AMD compiler than either cover holds. On CUDA sm_90 a
# kernel whose compiles issue wgmma compiles every spec (``EVERY_SPEC_IF_WGMMA``): whether Triton gives a wgmma
# its A operand in registers, where the race ``wgmma_hazards`` refuses lives, is decided spec by spec.
COVER_FROM_END = ("hip:gfx950",)
EVERY_SPEC_IF_WGMMA = ("cuda:90",)


@dataclass
class KernelSpec:
    kernel: Any  # a @triton.jit function
    signature: dict[str, str]  # every non-constexpr argument -> triton type ("*bf16", "i32", "fp32", ...)
    constexprs: dict[str, Any] = field(default_factory=dict)
    num_warps: int = 4
    num_stages: int = 2
    name: str = ""
    targets: tuple[str, ...] = ()  # backends to compile for ("cuda", "hip"); empty = every target
    max_registers: int = 0  # ptxas register cap (the launch's maxnreg; CUDA-only specs), 0: none

    def label(self) -> str:
        return self.name or getattr(self.kernel, "__name__", repr(self.kernel))


def cover(specs: list[KernelSpec], from_end: bool = False) -> list[int]:
    """Indices of a subset of ``specs`` in which each kernel meets every (constexpr, value) and num_warps
    that any of its specs has: greedy set cover, the spec adding most unmet pairs first (on ties the first
    in list order, or with ``from_end`` the last)."""
    def pairs(spec):
        kernel = id(spec.kernel)
        return {(kernel, name, repr(value)) for name, value in spec.constexprs.items()} | {
            (kernel, "num_warps", repr(spec.num_warps))}

    wanted = [pairs(s) for s in specs]
    unmet, chosen = set().union(*wanted), []
    while unmet:
        best = max(range(len(specs)), key=lambda i: (len(wanted[i] & unmet), i if from_end else -i))
        chosen.append(best)
        unmet -= wanted[best]
    return sorted(chosen)


def with_pdl_variants(specs: list[KernelSpec]) -> list[KernelSpec]:
    """Every spec in the form each backend launches it: on CUDA with PDL=True (the fused decode launches
    its kernels as programmatic dependents; griddepcontrol is PTX, and PDL=False differs from it by those
    instructions alone, so one CUDA compile stands for both), elsewhere with PDL=False (which compiles
    that branch too)."""
    out = []
    for spec in specs:
        wanted = spec.targets or tuple(dict.fromkeys(backend for backend, *_ in TARGETS))
        if "cuda" in wanted:
            out.append(replace(spec, constexprs={**spec.constexprs, "PDL": True}, name=f"{spec.label()}_pdl",
                               targets=("cuda",)))
        if any(t != "cuda" for t in wanted):
            out.append(replace(spec, constexprs={**spec.constexprs, "PDL": False},
                               targets=tuple(t for t in wanted if t != "cuda")))
    return out

